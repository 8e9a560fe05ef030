//! `store verify`: re-hash every object and compare with its name, check that each
//! inode still carries the metadata its name promises, that every image's manifest
//! is intact and every object it names exists.

use std::fs;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use serde::Serialize;

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::meta::Meta;
use crate::store::Store;
use crate::walk::walk;

/// What verification found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// Objects re-hashed.
    pub objects: u64,
    /// Bytes re-hashed.
    pub bytes: u64,
    /// Images checked.
    pub images: u64,
    /// One line per problem (empty when the store is sound).
    pub problems: Vec<String>,
}

/// Split an object file name `HEX.KEY`.
pub fn parse_object_name(name: &str) -> Option<(Digest, String)> {
    let (hex, key) = name.split_once('.')?;
    let d = Digest::parse(hex)?;
    (key.len() == 16 && key.bytes().all(|b| b.is_ascii_hexdigit())).then(|| (d, key.to_string()))
}

/// BLAKE3 of a file's content.
pub fn hash_file(path: &std::path::Path) -> std::io::Result<(Digest, u64)> {
    let mut f = fs::File::open(path)?;
    let mut h = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((Digest::from_hasher(&h), n))
}

impl Store {
    /// Check the whole store.
    pub fn verify(&self) -> Result<VerifyReport> {
        let _lock = self.lock_shared()?;
        let root_user = nix::unistd::geteuid().is_root();
        let mut files: Vec<(PathBuf, String)> = Vec::new();
        let mut problems = Vec::new();
        for e in walk(&self.objects_dir(), true)? {
            if e.rel.is_empty() || (e.md.is_dir() && !e.rel.contains('/')) {
                continue;
            }
            if !e.md.is_file() {
                problems.push(format!("objects/{}: not a regular file", e.rel));
                continue;
            }
            files.push((e.path, e.rel));
        }
        let next = AtomicUsize::new(0);
        let bytes = AtomicU64::new(0);
        let found: Mutex<Vec<String>> = Mutex::new(Vec::new());
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .clamp(1, 4);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((path, rel)) = files.get(i) else {
                        break;
                    };
                    if let Some(p) = check_object(path, rel, root_user, &bytes) {
                        found.lock().expect("not poisoned").push(p);
                    }
                });
            }
        });
        problems.extend(found.into_inner().expect("not poisoned"));
        let mut images = 0;
        for image in self.images()? {
            images += 1;
            let m = match self.manifest(&image.id) {
                Ok(m) => m,
                Err(e) => {
                    problems.push(format!("image {:?}: {e}", image.name));
                    continue;
                }
            };
            for (d, key) in m.inodes() {
                if !self.object_path(&d, &key).is_file() {
                    problems.push(format!(
                        "image {:?}: object {d}.{key} is missing",
                        image.name
                    ));
                }
            }
        }
        problems.sort();
        Ok(VerifyReport {
            objects: files.len() as u64,
            bytes: bytes.into_inner(),
            images,
            problems,
        })
    }
}

fn check_object(
    path: &std::path::Path,
    rel: &str,
    root_user: bool,
    bytes: &AtomicU64,
) -> Option<String> {
    let name = rel.rsplit('/').next().unwrap_or(rel);
    let Some((want, key)) = parse_object_name(name) else {
        return Some(format!("objects/{rel}: not an object name"));
    };
    if !rel.starts_with(&want.to_hex()[..2]) {
        return Some(format!("objects/{rel}: in the wrong directory"));
    }
    match hash_file(path) {
        Ok((got, n)) => {
            bytes.fetch_add(n, Ordering::Relaxed);
            if got != want {
                return Some(format!("objects/{rel}: corrupt: content hashes to {got}"));
            }
        }
        Err(e) => {
            return Some(format!(
                "objects/{rel}: {}",
                StoreError::io("read", path)(e)
            ))
        }
    }
    if root_user {
        match fs::symlink_metadata(path)
            .map_err(StoreError::io("stat", path))
            .and_then(|md| Meta::from_metadata(path, &md, true))
        {
            Ok(meta) if meta.key() != key => {
                return Some(format!(
                    "objects/{rel}: metadata changed (mode {:o}, owner {}:{}, mtime {})",
                    meta.mode, meta.uid, meta.gid, meta.mtime
                ))
            }
            Ok(_) => {}
            Err(e) => return Some(format!("objects/{rel}: {e}")),
        }
    }
    None
}
