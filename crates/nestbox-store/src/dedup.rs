//! `dedup`: merge files that have become identical — in the writable layers of
//! boxes that no longer run, and against the store's objects — into one shared
//! inode, by partial hashing (after the L4Linux cloning thesis, §3.3.1):
//!
//! 1. group candidates by size (no bytes read); a file alone in its group is unique;
//! 2. for each sample size S₁ < S₂ < … (parameters), hash the next part of the
//!    file up to Sₖ and regroup; the hash state carries over, so no byte is read
//!    twice and the last level yields the full BLAKE3 content digest;
//! 3. hash the rest of the content and regroup;
//! 4. within a group, files whose inode metadata (mode, owner, mtime, xattrs)
//!    also agree are merged after a full byte comparison: each becomes a hardlink
//!    to the store object of that content and metadata (an existing one, or the
//!    first file of the group, linked into the store as a new object).
//!
//! What a box sees never changes: only files with equal content *and* metadata
//! are merged; files of a box that other names of the box hardlink are left
//! alone, as are files carrying overlayfs xattrs. The caller passes only the
//! layers of boxes that are not running (overlayfs writes upper files in place,
//! so an upper file of a running box must never become a shared inode).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::meta::{read_xattrs, Meta};
use crate::store::Store;
use crate::verify::parse_object_name;
use crate::walk::walk;

/// Parameters of a dedup run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DedupOptions {
    /// Sample sizes of the partial-hash levels, increasing (bytes from the start).
    pub samples: Vec<u64>,
    /// Report what would be merged, change nothing.
    pub dry_run: bool,
}

impl Default for DedupOptions {
    fn default() -> Self {
        DedupOptions {
            samples: vec![4 << 10, 64 << 10],
            dry_run: false,
        }
    }
}

/// A writable layer to deduplicate.
#[derive(Debug, Clone)]
pub struct DedupLayer {
    /// Whose it is (a box name), for the report.
    pub label: String,
    /// Its upper directory.
    pub upper: PathBuf,
}

/// Figures of one level, like Table 5.2 of the thesis.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct LevelStats {
    /// "size", "sample 4096", "full", "compare".
    pub level: String,
    /// Files examined at this level.
    pub files: u64,
    /// Bytes read at this level.
    pub bytes_read: u64,
    /// Files that matched at least one other file at this level.
    pub matched: u64,
    /// Of those, files a later level found different (partial-hash collisions).
    pub collisions: u64,
}

/// What a dedup run found and did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DedupReport {
    /// Layers scanned.
    pub layers: u64,
    /// Store objects taking part.
    pub objects: u64,
    /// Candidate files (layer files and objects).
    pub candidates: u64,
    /// Their total size.
    pub candidate_bytes: u64,
    /// Per level.
    pub levels: Vec<LevelStats>,
    /// Layer files replaced by a hardlink to a shared object (or that would be).
    pub merged_files: u64,
    /// Bytes those files no longer hold separately.
    pub merged_bytes: u64,
    /// Objects created from layer files.
    pub new_objects: u64,
    /// Files identical in content to another but with other metadata (kept apart).
    pub metadata_differs: u64,
    /// Layer files left alone: hardlinked within the box, or with overlayfs xattrs.
    pub skipped_files: u64,
    /// Files found unique.
    pub unique_files: u64,
    /// Their total size.
    pub unique_bytes: u64,
    /// Bytes read from them.
    pub unique_bytes_read: u64,
    /// Whether nothing was changed.
    pub dry_run: bool,
    /// Wall-clock seconds.
    pub seconds: f64,
}

#[derive(Debug)]
struct Cand {
    path: PathBuf,
    size: u64,
    dev: u64,
    /// (digest, key) if this is a store object.
    object: Option<(Digest, String)>,
    hasher: blake3::Hasher,
    read: u64,
}

impl Store {
    /// Merge identical files of `layers` (boxes not running) and the store.
    pub fn dedup(&self, layers: &[DedupLayer], opts: &DedupOptions) -> Result<DedupReport> {
        let _lock = self.lock_exclusive()?;
        let start = Instant::now();
        let mut report = DedupReport {
            dry_run: opts.dry_run,
            layers: layers.len() as u64,
            ..DedupReport::default()
        };
        let mut samples = opts.samples.clone();
        samples.sort_unstable();
        samples.dedup();
        samples.retain(|s| *s > 0);

        // Candidates: store objects and regular files of the layers.
        let mut cands: Vec<Cand> = Vec::new();
        let mut object_inodes: HashSet<(u64, u64)> = HashSet::new();
        for e in walk(&self.objects_dir(), true)? {
            if !e.md.is_file() {
                continue;
            }
            let name = e.rel.rsplit('/').next().unwrap_or(&e.rel);
            let Some(obj) = parse_object_name(name) else {
                continue;
            };
            object_inodes.insert((e.md.dev(), e.md.ino()));
            report.objects += 1;
            cands.push(Cand {
                path: e.path,
                size: e.md.len(),
                dev: e.md.dev(),
                object: Some(obj),
                hasher: blake3::Hasher::new(),
                read: 0,
            });
        }
        for layer in layers {
            if !layer.upper.is_dir() {
                continue;
            }
            for e in walk(&layer.upper, true)? {
                if !e.md.is_file() || e.md.len() == 0 {
                    continue;
                }
                if object_inodes.contains(&(e.md.dev(), e.md.ino())) {
                    continue; // already shared
                }
                if e.md.nlink() > 1 {
                    report.skipped_files += 1;
                    continue;
                }
                cands.push(Cand {
                    path: e.path,
                    size: e.md.len(),
                    dev: e.md.dev(),
                    object: None,
                    hasher: blake3::Hasher::new(),
                    read: 0,
                });
            }
        }
        report.candidates = cands.len() as u64;
        report.candidate_bytes = cands.iter().map(|c| c.size).sum();

        // Level 0: size. Groups made only of objects cannot merge (objects are
        // already unique per content and metadata).
        let mut groups: Vec<Vec<usize>> = {
            let mut by: HashMap<(u64, u64), Vec<usize>> = HashMap::new();
            for (i, c) in cands.iter().enumerate() {
                by.entry((c.dev, c.size)).or_default().push(i);
            }
            by.into_values().collect()
        };
        let mut size_level = LevelStats {
            level: "size".into(),
            files: cands.len() as u64,
            ..LevelStats::default()
        };
        let mut unique: Vec<usize> = Vec::new();
        groups.retain(|g| {
            let keep = g.len() > 1 && g.iter().any(|i| cands[*i].object.is_none());
            if keep {
                size_level.matched += g.len() as u64;
            } else {
                unique.extend(g.iter().filter(|i| cands[**i].object.is_none()));
            }
            keep
        });
        let mut levels = vec![size_level];

        // Levels 1..: samples, then the full content.
        let mut bounds: Vec<(String, Option<u64>)> = samples
            .iter()
            .map(|s| (format!("sample {s}"), Some(*s)))
            .collect();
        bounds.push(("full".into(), None));
        let mut done: u64 = 0;
        for (name, upto) in bounds {
            let mut lvl = LevelStats {
                level: name,
                ..LevelStats::default()
            };
            let mut next: Vec<Vec<usize>> = Vec::new();
            for g in groups {
                let mut by: HashMap<[u8; 32], Vec<usize>> = HashMap::new();
                for i in g {
                    let c = &mut cands[i];
                    lvl.files += 1;
                    let end = upto.map_or(c.size, |u| u.min(c.size));
                    if end > done {
                        let n = feed(c, done, end)?;
                        lvl.bytes_read += n;
                    }
                    by.entry(*c.hasher.finalize().as_bytes())
                        .or_default()
                        .push(i);
                }
                for sub in by.into_values() {
                    if sub.len() > 1 && sub.iter().any(|i| cands[*i].object.is_none()) {
                        lvl.matched += sub.len() as u64;
                        next.push(sub);
                    } else {
                        unique.extend(sub.iter().filter(|i| cands[**i].object.is_none()));
                    }
                }
            }
            // Files that matched at the previous level but not here were collisions there.
            let survivors: u64 = next.iter().map(|g| g.len() as u64).sum();
            if let Some(prev) = levels.last_mut() {
                prev.collisions = prev.matched.saturating_sub(survivors);
            }
            levels.push(lvl);
            groups = next;
            if let Some(u) = upto {
                done = u;
            }
        }

        // Merge: within each full-hash group, by metadata, after a byte compare.
        let mut compare = LevelStats {
            level: "compare".into(),
            ..LevelStats::default()
        };
        for g in groups {
            let digest = Digest(*cands[g[0]].hasher.finalize().as_bytes());
            let mut by_meta: BTreeMap<String, Vec<usize>> = BTreeMap::new();
            for i in g {
                let key = match &cands[i].object {
                    Some((_, k)) => k.clone(),
                    None => {
                        let p = &cands[i].path;
                        let md = fs::symlink_metadata(p).map_err(StoreError::io("stat", p))?;
                        if has_overlay_xattrs(p) {
                            report.skipped_files += 1;
                            continue;
                        }
                        Meta::from_metadata(p, &md, true)?.key()
                    }
                };
                by_meta.entry(key).or_default().push(i);
            }
            let classes = by_meta.len();
            for (key, members) in by_meta {
                let has_layer = members.iter().any(|i| cands[*i].object.is_none());
                if members.len() < 2 || !has_layer {
                    if classes > 1 {
                        report.metadata_differs += members
                            .iter()
                            .filter(|i| cands[**i].object.is_none())
                            .count() as u64;
                    }
                    continue;
                }
                let target_idx = members
                    .iter()
                    .copied()
                    .find(|i| cands[*i].object.is_some())
                    .unwrap_or(members[0]);
                let size = cands[target_idx].size;
                let object_path = self.object_path(&digest, &key);
                let mut target_is_object = cands[target_idx].object.is_some();
                for &i in &members {
                    if i == target_idx {
                        continue;
                    }
                    compare.files += 1;
                    let (same, read) = same_content(&cands[target_idx].path, &cands[i].path)?;
                    compare.bytes_read += read;
                    if !same {
                        compare.collisions += 1;
                        continue;
                    }
                    compare.matched += 1;
                    if !opts.dry_run {
                        if !target_is_object {
                            adopt(&cands[target_idx].path, &object_path)?;
                            target_is_object = true;
                            report.new_objects += 1;
                        }
                        replace_with_link(&object_path, &cands[i].path)?;
                    } else if !target_is_object {
                        target_is_object = true;
                        report.new_objects += 1;
                    }
                    report.merged_files += 1;
                    report.merged_bytes += size;
                }
            }
        }
        levels.push(compare);
        report.levels = levels;
        unique.sort_unstable();
        unique.dedup();
        for i in unique {
            report.unique_files += 1;
            report.unique_bytes += cands[i].size;
            report.unique_bytes_read += cands[i].read;
        }
        if !opts.dry_run && report.merged_files > 0 {
            self.sync()?;
        }
        report.seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }
}

/// Hash bytes [from, to) of a candidate into its running hash.
fn feed(c: &mut Cand, from: u64, to: u64) -> Result<u64> {
    let f = fs::File::open(&c.path).map_err(StoreError::io("open", &c.path))?;
    let mut buf = vec![0u8; ((to - from) as usize).min(1 << 20)];
    let mut off = from;
    while off < to {
        let want = ((to - off) as usize).min(buf.len());
        let n = f
            .read_at(&mut buf[..want], off)
            .map_err(StoreError::io("read", &c.path))?;
        if n == 0 {
            break; // shrank meanwhile: it will simply not match
        }
        c.hasher.update(&buf[..n]);
        off += n as u64;
    }
    let n = off - from;
    c.read += n;
    Ok(n)
}

/// Whether two files have the same bytes; and how many bytes were read.
fn same_content(a: &Path, b: &Path) -> Result<(bool, u64)> {
    let mut fa = fs::File::open(a).map_err(StoreError::io("open", a))?;
    let mut fb = fs::File::open(b).map_err(StoreError::io("open", b))?;
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut read = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(StoreError::io("read", a))?;
        let nb = read_full(&mut fb, &mut bb).map_err(StoreError::io("read", b))?;
        read += (na + nb) as u64;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok((false, read));
        }
        if na == 0 {
            return Ok((true, read));
        }
    }
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn has_overlay_xattrs(p: &Path) -> bool {
    let Ok(c) = crate::meta::cstring(p) else {
        return true;
    };
    let mut names = vec![0u8; 4096];
    // SAFETY: c is NUL-terminated; names has names.len() writable bytes.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOTSUP);
    }
    names[..n as usize]
        .split(|b| *b == 0)
        .any(|raw| std::str::from_utf8(raw).is_ok_and(crate::meta::is_overlay_xattr))
        || read_xattrs(p).is_err()
}

/// Make the layer file `file` a store object: fsync it, then link it in.
fn adopt(file: &Path, object: &Path) -> Result<()> {
    fs::File::open(file)
        .and_then(|f| f.sync_all())
        .map_err(StoreError::io("fsync", file))?;
    let parent = object.parent().expect("objects have a parent");
    match fs::create_dir(parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(StoreError::io("mkdir", parent)(e)),
    }
    fs::hard_link(file, object).map_err(StoreError::io("link", object))
}

/// Atomically replace `file` with a hardlink to `object`.
fn replace_with_link(object: &Path, file: &Path) -> Result<()> {
    let dir = file.parent().expect("layer files have a parent");
    let tmp = dir.join(format!(".nestbox-dedup-{}", std::process::id()));
    // A leftover of an earlier run: if it cannot be removed, the link below
    // fails with EEXIST and says so, so the result may be ignored here.
    let _ = fs::remove_file(&tmp);
    fs::hard_link(object, &tmp).map_err(StoreError::io("link", &tmp))?;
    fs::rename(&tmp, file).map_err(|e| {
        crate::store::discard_file(&tmp);
        StoreError::io("rename", file)(e)
    })
}
