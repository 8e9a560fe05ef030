//! Lower trees: an image materialised as real directories whose regular files are
//! hardlinks to the store's inodes. Built once per image under a temporary name and
//! renamed into place, then shared read-only by every box of the image as the
//! lower layer of its root overlay — so every box (and every image holding the same
//! file with the same metadata) uses one inode and one page-cache copy.
//!
//! Directories, symlinks, devices and fifos are created per tree (they hold no
//! file data). The top-level mount points the runtime needs (`proc`, `sys`, `dev`)
//! are added when an image lacks them.

use std::fs;
use std::os::unix::fs::{symlink, DirBuilderExt};
use std::path::Path;

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::manifest::{Entry, Kind, Manifest};
use crate::store::Store;

/// Top-level directories every tree has (mount points of the box's `/proc`, `/sys`, `/dev`).
const MOUNT_POINTS: &[(&str, u32)] = &[("proc", 0o555), ("sys", 0o555), ("dev", 0o755)];

/// The lower tree of image `id`, built if missing (takes the store's shared lock).
pub fn ensure_tree(store: &Store, id: &Digest) -> Result<std::path::PathBuf> {
    let path = store.tree_path(id);
    if path.is_dir() {
        return Ok(path);
    }
    let _lock = store.lock_shared()?;
    ensure_tree_locked(store, id, None)
}

/// Same, with the store lock already held; `manifest` saves reading it again.
pub(crate) fn ensure_tree_locked(
    store: &Store,
    id: &Digest,
    manifest: Option<&Manifest>,
) -> Result<std::path::PathBuf> {
    let path = store.tree_path(id);
    if path.is_dir() {
        return Ok(path);
    }
    let owned;
    let manifest = match manifest {
        Some(m) => m,
        None => {
            owned = store.manifest(id)?;
            &owned
        }
    };
    let mut rnd = [0u8; 4];
    rnd.copy_from_slice(&crate::txn::now().to_bits().to_le_bytes()[..4]);
    let tmp = store.trees_dir().join(format!(
        ".tmp-{}-{}-{}",
        id.short(),
        std::process::id(),
        crate::hash::hex(&rnd)
    ));
    if let Err(e) = build(store, manifest, &tmp) {
        crate::store::discard_tree(&tmp);
        return Err(e);
    }
    match fs::rename(&tmp, &path) {
        Ok(()) => Ok(path),
        // Another process built it meanwhile: use theirs.
        Err(_) if path.is_dir() => {
            crate::store::discard_tree(&tmp);
            Ok(path)
        }
        Err(e) => {
            crate::store::discard_tree(&tmp);
            Err(StoreError::io("rename", &path)(e))
        }
    }
}

/// Make `entry` (manifest path `path`) at `target`: a directory, a regular
/// file hardlinked to its object in `store`, or a symlink or special file
/// made anew with its metadata (a directory's metadata is the caller's, set
/// once its children exist).
pub(crate) fn make_entry(
    store: &Store,
    dirs: &fs::DirBuilder,
    path: &str,
    entry: &Entry,
    target: &Path,
) -> Result<()> {
    match &entry.kind {
        Kind::Dir => dirs
            .create(target)
            .map_err(StoreError::io("mkdir", target))?,
        Kind::File { object, .. } => {
            let src = store.object_path(object, &entry.meta.key());
            fs::hard_link(&src, target).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound && !src.exists() {
                    StoreError::MissingObject(format!("{object} ({path})"))
                } else {
                    StoreError::io("link", target)(e)
                }
            })?;
        }
        Kind::Symlink { target: to } => {
            symlink(to, target).map_err(StoreError::io("symlink", target))?;
            entry.meta.apply_path(target, true)?;
        }
        Kind::Char { major, minor } | Kind::Block { major, minor } => {
            let kind = if matches!(entry.kind, Kind::Char { .. }) {
                nix::sys::stat::SFlag::S_IFCHR
            } else {
                nix::sys::stat::SFlag::S_IFBLK
            };
            nix::sys::stat::mknod(
                target,
                kind,
                nix::sys::stat::Mode::from_bits_truncate(0o600),
                nix::sys::stat::makedev(u64::from(*major), u64::from(*minor)),
            )
            .map_err(StoreError::sys("mknod", target))?;
            entry.meta.apply_path(target, false)?;
        }
        Kind::Fifo => {
            nix::unistd::mkfifo(target, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .map_err(StoreError::sys("mkfifo", target))?;
            entry.meta.apply_path(target, false)?;
        }
    }
    Ok(())
}

fn build(store: &Store, manifest: &Manifest, root: &Path) -> Result<()> {
    let mut dirs = fs::DirBuilder::new();
    dirs.mode(0o700);
    dirs.create(root).map_err(StoreError::io("mkdir", root))?;
    for (path, entry) in &manifest.entries {
        if path.is_empty() {
            continue;
        }
        make_entry(store, &dirs, path, entry, &root.join(path))?;
    }
    for (name, mode) in MOUNT_POINTS {
        if !manifest.entries.contains_key(*name) {
            let p = root.join(name);
            dirs.create(&p).map_err(StoreError::io("mkdir", &p))?;
            fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(*mode))
                .map_err(StoreError::io("chmod", &p))?;
        }
    }
    // Directory metadata last, children first, so nothing moves an mtime once set.
    for (path, entry) in manifest.entries.iter().rev() {
        if entry.is_dir() {
            entry.meta.apply_path(&root.join(path), false)?;
        }
    }
    Ok(())
}

/// Remove a tree whose directories may lack write permission for the owner.
pub fn remove_tree(path: &Path) -> Result<()> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) => {
            open_up(path);
            match fs::remove_dir_all(path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(StoreError::io("remove", path)(e)),
            }
        }
    }
}

fn open_up(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(md) = fs::symlink_metadata(path) else {
        return;
    };
    if md.is_dir() {
        // Best effort: where it fails, the removal that follows fails and
        // reports the path, so the result may be ignored here.
        let _ = fs::set_permissions(path, fs::Permissions::from_mode(0o700));
        if let Ok(entries) = fs::read_dir(path) {
            for e in entries.flatten() {
                open_up(&e.path());
            }
        }
    }
}
