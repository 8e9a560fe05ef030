//! Reading a directory tree as a layer: a root filesystem directory for import,
//! or a box's overlayfs upper directory for commit (where a character device 0/0
//! is a whiteout and an `overlay.opaque` xattr marks an opaque directory).
//! File contents are hashed and stored by a few worker threads.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::layer::{Layer, Op};
use crate::manifest::{Entry, Kind};
use crate::meta::{get_xattr, Meta};
use crate::progress::Progress;
use crate::txn::Txn;
use crate::walk::walk;

/// How to read a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeKind {
    /// A root filesystem; device nodes only if allowed.
    Rootfs {
        /// `--allow-devices` was given (and the caller is root).
        allow_devices: bool,
    },
    /// An overlayfs upper directory.
    Upper,
}

/// Read the tree at `root` into a layer, storing file contents through `txn`.
pub fn read_tree(root: &Path, kind: TreeKind, txn: &Txn<'_>, progress: &Progress) -> Result<Layer> {
    let entries = walk(root, true)?;
    let mut layer = Layer::default();
    let mut jobs: Vec<(usize, PathBuf, Meta)> = Vec::new();
    let mut slots: Vec<Option<(String, Meta)>> = Vec::new();
    for e in entries {
        let ft = e.md.file_type();
        let refused = |why: String| StoreError::refused(root, e.rel.clone(), why);
        if kind == TreeKind::Upper {
            if ft.is_char_device() && e.md.rdev() == 0 {
                layer.whiteouts.push(e.rel.clone());
                continue;
            }
            if ft.is_dir() && is_opaque(&e.path) {
                layer.opaque.push(e.rel.clone());
            }
            if e.rel.is_empty() {
                // The upper root's own metadata is the runtime's, not the box's.
                continue;
            }
        }
        let meta = Meta::from_metadata(&e.path, &e.md, true)?;
        let kind_of = if ft.is_dir() {
            Kind::Dir
        } else if ft.is_file() {
            jobs.push((slots.len(), e.path.clone(), meta.clone()));
            slots.push(Some((e.rel.clone(), meta)));
            continue;
        } else if ft.is_symlink() {
            let t = fs::read_link(&e.path).map_err(StoreError::io("readlink", &e.path))?;
            let target = t
                .to_str()
                .ok_or_else(|| refused("symlink target is not UTF-8".into()))?
                .to_string();
            // Unlike archive members, symlinks of a directory (the caller's own
            // tree, or a box's layer) are kept verbatim: a subtree such as
            // /usr/lib legitimately links above its own root, and in a box every
            // target resolves inside the box root anyway.
            Kind::Symlink { target }
        } else if ft.is_char_device() || ft.is_block_device() {
            let (major, minor) = (
                nix::sys::stat::major(e.md.rdev()) as u32,
                nix::sys::stat::minor(e.md.rdev()) as u32,
            );
            if let TreeKind::Rootfs { allow_devices } = kind {
                let c = if ft.is_char_device() { 'c' } else { 'b' };
                if !allow_devices {
                    return Err(refused(format!(
                        "device node ({c} {major}:{minor}) needs --allow-devices"
                    )));
                }
                if !nix::unistd::geteuid().is_root() {
                    return Err(refused(format!(
                        "device node ({c} {major}:{minor}) can only be imported as root"
                    )));
                }
            }
            if ft.is_char_device() {
                Kind::Char { major, minor }
            } else {
                Kind::Block { major, minor }
            }
        } else if ft.is_fifo() {
            Kind::Fifo
        } else {
            // Sockets belong to a running process, not to an image.
            continue;
        };
        slots.push(None);
        layer.ops.push(Op::Put(
            e.rel,
            Entry {
                kind: kind_of,
                meta,
            },
        ));
    }
    let stored = store_files(&jobs, txn, progress)?;
    // Files go after directories/symlinks of the same walk; order within the map
    // does not matter as every path is distinct.
    for ((idx, _, _), (object, size)) in jobs.iter().zip(stored) {
        let (rel, meta) = slots[*idx].take().expect("each job once");
        layer.ops.push(Op::Put(
            rel,
            Entry {
                kind: Kind::File { object, size },
                meta,
            },
        ));
    }
    Ok(layer)
}

/// Whether an upper directory is opaque (`trusted.overlay.opaque` or, for a box
/// with a user namespace, `user.overlay.opaque` set to "y").
pub fn is_opaque(dir: &Path) -> bool {
    [c"trusted.overlay.opaque", c"user.overlay.opaque"]
        .iter()
        .any(|n| get_xattr(dir, n).as_deref() == Some(b"y"))
}

/// Store every file, in parallel; results in job order.
fn store_files(
    jobs: &[(usize, PathBuf, Meta)],
    txn: &Txn<'_>,
    progress: &Progress,
) -> Result<Vec<(Digest, u64)>> {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .clamp(1, 4)
        .min(jobs.len().max(1));
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let results: Mutex<Vec<Option<(Digest, u64)>>> = Mutex::new(vec![None; jobs.len()]);
    let first_error: Mutex<Option<StoreError>> = Mutex::new(None);
    txn.expect_objects(jobs.len());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= jobs.len() || failed.load(Ordering::Relaxed) {
                    break;
                }
                let (_, path, meta) = &jobs[i];
                match store_one(path, meta, txn, progress) {
                    Ok(r) => results.lock().expect("not poisoned")[i] = Some(r),
                    Err(e) => {
                        failed.store(true, Ordering::Relaxed);
                        first_error.lock().expect("not poisoned").get_or_insert(e);
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("not poisoned") {
        return Err(e);
    }
    Ok(results
        .into_inner()
        .expect("not poisoned")
        .into_iter()
        .map(|r| r.expect("every job done"))
        .collect())
}

fn store_one(
    path: &Path,
    meta: &Meta,
    txn: &Txn<'_>,
    progress: &Progress,
) -> Result<(Digest, u64)> {
    let mut f = fs::File::open(path).map_err(StoreError::io("open", path))?;
    let read_err = |e| StoreError::io("read", path)(e);
    txn.put_reader(&mut f, meta, &read_err, &|n| progress.inc(n))
}
