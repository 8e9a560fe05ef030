//! Mount calls: mount a filesystem, bind, move, remount read-only, make
//! private, detach, bind a namespace file, pivot the root (or chroot).
//!
//! The mechanics only: which mount goes where, and with which flags, is the
//! callers' policy (`nestbox-isolation` for a box's root, the runtime's
//! network pool for its namespace files). All are safe: they take paths and
//! flags and change the caller's mount namespace only.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags};

pub use nix::mount::MsFlags;

use crate::Result;

/// Mount a filesystem of type `fstype` from `source` at `target`.
pub fn mount_fs(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<()> {
    mount(Some(source), target, Some(fstype), flags, data)
}

/// Bind-mount `source` on `target` (with its submounts when `recursive`).
pub fn bind(source: &Path, target: &Path, recursive: bool) -> Result<()> {
    let mut flags = MsFlags::MS_BIND;
    if recursive {
        flags |= MsFlags::MS_REC;
    }
    mount(Some(source), target, None::<&str>, flags, None::<&str>)
}

/// Bind the namespace file `ns` (an open `/proc/PID/ns/*` or namespace fd) on
/// the existing file `target`, which then keeps the namespace alive until it
/// is unmounted.
pub fn bind_nsfs(ns: BorrowedFd<'_>, target: &Path) -> Result<()> {
    let source = format!("/proc/self/fd/{}", ns.as_raw_fd());
    bind(Path::new(&source), target, false)
}

/// Move the mount at `source` to `target` (`MS_MOVE`).
pub fn move_mount(source: &Path, target: &Path) -> Result<()> {
    mount(
        Some(source),
        target,
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
}

/// Make the bind mount at `target` read-only, keeping the flags in `keep`
/// (`MS_NOSUID`, `MS_NODEV`, ...: in a user namespace the kernel refuses a
/// remount that would drop a locked one).
pub fn remount_read_only(target: &Path, keep: MsFlags) -> Result<()> {
    remount_bind(target, MsFlags::MS_RDONLY | keep)
}

/// Set the per-mount flags of the mount at `target` to `flags` (a bind
/// remount: the filesystem's own options are untouched). Flags not in
/// `flags` are cleared, so pass the ones to keep as well.
pub fn remount_bind(target: &Path, flags: MsFlags) -> Result<()> {
    let flags = MsFlags::MS_REMOUNT | MsFlags::MS_BIND | flags;
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
}

/// Stop mount events under `path` from propagating to or from other mount
/// namespaces (`MS_REC | MS_PRIVATE`).
pub fn make_private_recursive(path: &Path) -> Result<()> {
    mount(
        None::<&str>,
        path,
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
}

/// Unmount the mount at `target` now (`umount2` without flags: EBUSY while
/// it is in use).
pub fn unmount(target: &Path) -> Result<()> {
    umount2(target, MntFlags::empty())
}

/// Set the propagation type of the mount at `target` (`flags` holds one of
/// `MS_SHARED`, `MS_SLAVE`, `MS_PRIVATE`, `MS_UNBINDABLE`, optionally with
/// `MS_REC` for every mount below it too).
pub fn set_propagation(target: &Path, flags: MsFlags) -> Result<()> {
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
}

/// Lazily detach the mount at `target` (`umount2(MNT_DETACH)`).
pub fn detach(target: &Path) -> Result<()> {
    umount2(target, MntFlags::MNT_DETACH)
}

/// `pivot_root(new_root, put_old)`.
pub fn pivot_root(new_root: &Path, put_old: &Path) -> Result<()> {
    nix::unistd::pivot_root(new_root, put_old)
}

/// `chroot(path)`: change the calling process's root directory (its mount
/// namespace is left as it is).
pub fn chroot(path: &Path) -> Result<()> {
    nix::unistd::chroot(path)
}

/// Undo the octal escapes (`\040` for a space, `\011`, `\012`, `\134`) the
/// kernel writes into the path fields of `/proc/*/mountinfo`. A backslash not
/// followed by three octal digits is kept as it is.
pub fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(value as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detach_of_a_non_mount_fails() {
        let dir = std::env::temp_dir();
        // A plain directory is not a mount point (EINVAL), or we lack rights (EPERM).
        let e = detach(&dir.join("nestbox-sys-no-such-dir")).unwrap_err();
        assert!(
            matches!(e, nix::errno::Errno::ENOENT | nix::errno::Errno::EPERM),
            "{e}"
        );
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/a\040b"), "/a b");
        assert_eq!(unescape_mountinfo(r"a\134b\011"), "a\\b\t");
        assert_eq!(unescape_mountinfo(r"/a\04"), r"/a\04");
        assert_eq!(unescape_mountinfo(r"tail\"), r"tail\");
    }
}
