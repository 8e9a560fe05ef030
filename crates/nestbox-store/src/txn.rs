//! Transactions: how objects and images enter the store without ever being seen
//! half-written.
//!
//! A transaction owns a staging directory `tmp/<id>/` (flocked for its lifetime, so
//! a staging directory whose lock can be taken belongs to a dead process and is
//! removed by the next import or `store gc`). Object contents are written there
//! while being hashed; an object that already exists is dropped at once. Publishing
//! syncs the filesystem once (`syncfs`, instead of one `fsync` per object: the
//! cost of crash safety is one flush per import, not one per file), then renames
//! every staged object into `objects/` with `RENAME_NOREPLACE`, writes the manifest
//! the same way, syncs again, builds the lower tree and finally creates the image
//! name. Killed at any point before the name exists, an import leaves at most
//! complete, valid, unreferenced objects (which `gc` reclaims) and a stale staging
//! directory; nothing visible and nothing `verify` could call corrupt.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::manifest::Manifest;
use crate::meta::Meta;
use crate::refs::{validate_name, ImageRef};
use crate::store::{Store, StoreLock};

/// Size of the copy buffer.
const CHUNK: usize = 1 << 20;

thread_local! {
    /// The copy buffer of [`Txn::put_reader`] on this thread.
    static COPY_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Counters of one transaction.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TxnStats {
    /// Objects added to the store.
    pub new_objects: u64,
    /// Content bytes added to the store.
    pub new_bytes: u64,
    /// Files whose object already existed.
    pub reused_objects: u64,
    /// Content bytes that were already stored.
    pub reused_bytes: u64,
}

#[derive(Debug, Default)]
struct Staged {
    /// Final object path → staged temporary file.
    pending: HashMap<PathBuf, PathBuf>,
    stats: TxnStats,
}

/// One import or commit in progress. Dropping it unpublished removes its staging.
#[derive(Debug)]
pub struct Txn<'s> {
    store: &'s Store,
    dir: PathBuf,
    staged: Mutex<Staged>,
    seq: AtomicU64,
    _own: Flock<fs::File>,
    _store_lock: StoreLock,
}

impl<'s> Txn<'s> {
    /// Start a transaction (takes the store's shared lock, removes stale staging).
    pub fn begin(store: &'s Store) -> Result<Self> {
        let store_lock = store.lock_shared()?;
        clean_stale(store, false);
        let mut rnd = [0u8; 6];
        getrandom(&mut rnd)?;
        let name = format!("txn-{}-{}", std::process::id(), crate::hash::hex(&rnd));
        // Made under a hidden name and renamed once locked, so a cleaner never sees
        // a live staging directory without its lock.
        let hidden = store.tmp_dir().join(format!(".{name}"));
        let dir = store.tmp_dir().join(&name);
        fs::create_dir(&hidden).map_err(StoreError::io("mkdir", &hidden))?;
        let lock_path = hidden.join(".lock");
        let own = fs::File::create(&lock_path)
            .map_err(StoreError::io("create", &lock_path))
            .and_then(|f| {
                Flock::lock(f, FlockArg::LockExclusiveNonblock)
                    .map_err(|(_, e)| StoreError::sys("flock", &lock_path)(e))
            })
            .and_then(|l| {
                fs::rename(&hidden, &dir)
                    .map(|()| l)
                    .map_err(StoreError::io("rename", &dir))
            });
        let own = match own {
            Ok(l) => l,
            Err(e) => {
                if let Err(r) = fs::remove_dir_all(&hidden) {
                    tracing::warn!("removing {}: {r}", hidden.display());
                }
                return Err(e);
            }
        };
        Ok(Txn {
            store,
            dir,
            staged: Mutex::new(Staged::default()),
            seq: AtomicU64::new(0),
            _own: own,
            _store_lock: store_lock,
        })
    }

    /// The store.
    pub fn store(&self) -> &'s Store {
        self.store
    }

    /// A fresh path in the staging directory (scratch space removed with it).
    pub fn scratch(&self, what: &str) -> PathBuf {
        self.dir.join(format!(
            "{what}-{}",
            self.seq.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Counters so far.
    pub fn stats(&self) -> TxnStats {
        self.staged.lock().expect("not poisoned").stats
    }

    /// Store the content read from `src` with metadata `meta`; its digest and length.
    /// Read errors become `read_err(e)` (the caller names the input); write errors
    /// name the staging file. `progress` is called with each chunk's length.
    pub fn put_reader(
        &self,
        src: &mut dyn Read,
        meta: &Meta,
        read_err: &dyn Fn(std::io::Error) -> StoreError,
        progress: &dyn Fn(u64),
    ) -> Result<(Digest, u64)> {
        let tmp = self.scratch("obj");
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(StoreError::io("create", &tmp))?;
        let result = COPY_BUFFER.with_borrow_mut(|buf| {
            // One buffer per thread, allocated (and zeroed) once: a fresh
            // 1 MiB buffer per file costs more than a small file's whole copy.
            buf.resize(CHUNK, 0);
            let mut hasher = blake3::Hasher::new();
            let mut len = 0u64;
            loop {
                let n = match src.read(buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(read_err(e)),
                };
                hasher.update(&buf[..n]);
                out.write_all(&buf[..n])
                    .map_err(StoreError::io("write", &tmp))?;
                len += n as u64;
                progress(n as u64);
            }
            Ok((Digest::from_hasher(&hasher), len))
        });
        let (digest, len) = match result {
            Ok(v) => v,
            Err(e) => {
                drop(out);
                if let Err(r) = fs::remove_file(&tmp) {
                    tracing::warn!("removing {}: {r}", tmp.display());
                }
                return Err(e);
            }
        };
        self.stage(out, tmp, digest, len, meta)?;
        Ok((digest, len))
    }

    /// Store `data` with metadata `meta`; its digest.
    pub fn put_bytes(&self, data: &[u8], meta: &Meta) -> Result<Digest> {
        let tmp = self.scratch("obj");
        let digest = Digest::of(data);
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(StoreError::io("create", &tmp))?;
        if let Err(e) = out.write_all(data) {
            // In the transaction's directory, removed with it.
            let _ = fs::remove_file(&tmp);
            return Err(StoreError::io("write", &tmp)(e));
        }
        self.stage(out, tmp, digest, data.len() as u64, meta)?;
        Ok(digest)
    }

    fn stage(
        &self,
        out: fs::File,
        tmp: PathBuf,
        digest: Digest,
        len: u64,
        meta: &Meta,
    ) -> Result<()> {
        let fin = self.store.object_path(&digest, &meta.key());
        let mut st = self.staged.lock().expect("not poisoned");
        if st.pending.contains_key(&fin) || fin.exists() {
            st.stats.reused_objects += 1;
            st.stats.reused_bytes += len;
            drop(st);
            drop(out);
            return fs::remove_file(&tmp).map_err(StoreError::io("unlink", &tmp));
        }
        st.stats.new_objects += 1;
        st.stats.new_bytes += len;
        st.pending.insert(fin, tmp.clone());
        drop(st);
        if let Err(e) = meta.apply_fd(&out, &tmp) {
            let mut st = self.staged.lock().expect("not poisoned");
            st.pending.retain(|_, t| *t != tmp);
            return Err(e);
        }
        Ok(())
    }

    /// Make every staged object durable and visible in `objects/`.
    pub fn publish(&self) -> Result<()> {
        let pending: Vec<(PathBuf, PathBuf)> = {
            let mut st = self.staged.lock().expect("not poisoned");
            st.pending.drain().collect()
        };
        if pending.is_empty() {
            return Ok(());
        }
        self.store.sync()?;
        // Each of the 256 fan-out directories is looked at once, not once per object.
        let mut seen = std::collections::HashSet::new();
        for (fin, tmp) in pending {
            let parent = fin.parent().expect("objects have a parent");
            if seen.insert(parent.to_path_buf()) && !parent.is_dir() {
                match fs::create_dir(parent) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => return Err(StoreError::io("mkdir", parent)(e)),
                }
            }
            match nix::fcntl::renameat2(
                None,
                &tmp,
                None,
                &fin,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            ) {
                Ok(()) => {}
                // Published meanwhile by another import: same content and metadata.
                Err(nix::errno::Errno::EEXIST) => {
                    // Our copy is in the transaction's directory, removed with it.
                    let _ = fs::remove_file(&tmp);
                }
                Err(e) => return Err(StoreError::sys("rename", &fin)(e)),
            }
        }
        self.store.sync()
    }

    /// Finish: store `manifest` as an object, publish everything, build the lower
    /// tree, then create the name. The image exists from the last step on.
    pub fn commit_image(self, name: &str, manifest: &Manifest, source: &str) -> Result<ImageRef> {
        validate_name(name)?;
        let bytes = manifest.to_bytes();
        let id = self.put_bytes(&bytes, &Meta::internal())?;
        self.publish()?;
        crate::tree::ensure_tree_locked(self.store, &id, Some(manifest))?;
        let (files, total) = manifest.file_stats();
        let r = ImageRef {
            name: name.to_string(),
            id,
            created: now(),
            source: source.to_string(),
            files,
            bytes: total,
        };
        self.store.create_ref(&r)?;
        Ok(r)
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        // A transaction's directory that cannot be removed is logged; store
        // gc removes transaction leftovers.
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("removing {}: {e}", self.dir.display());
            }
        }
    }
}

/// Remove staging directories of transactions whose process is gone (their lock
/// can be taken). With `all_hidden` (only under the exclusive store lock, when no
/// transaction can be starting) half-made hidden ones go too.
pub fn clean_stale(store: &Store, all_hidden: bool) -> u64 {
    let mut removed = 0;
    let Ok(entries) = fs::read_dir(store.tmp_dir()) else {
        return 0;
    };
    for e in entries.flatten() {
        let dir = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        let stale = if name.starts_with('.') {
            all_hidden
        } else {
            is_stale(&dir)
        };
        if stale && fs::remove_dir_all(&dir).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn is_stale(dir: &Path) -> bool {
    match fs::File::open(dir.join(".lock")) {
        Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
        // Locked staging directories always have their lock file.
        Err(_) => true,
    }
}

/// Unix time now, in seconds.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Fill `buf` from the kernel's random source (blocking until it is seeded);
/// no weaker fallback.
fn getrandom(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid writable buffer of rest.len() bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(StoreError::Random(e));
        }
        filled += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getrandom_fills_the_whole_buffer() {
        // 64 random bytes are all zero with probability 2^-512.
        let mut a = [0u8; 64];
        getrandom(&mut a).unwrap();
        assert_ne!(a, [0u8; 64]);
        let mut b = [0u8; 64];
        getrandom(&mut b).unwrap();
        assert_ne!(a, b);
    }
}
