//! Inode flags of a directory (`FS_IOC_GETFLAGS`, `FS_IOC_SETFLAGS`, as
//! `lsattr` and `chattr` read and set them).
//!
//! Used to mark a directory whose subdirectories are unrelated to each other
//! (the store's staging area) as the top of directory hierarchies
//! (`chattr +T`): ext4's Orlov allocator then places each new subdirectory,
//! and so the inodes of the files made in it, in a block group with room to
//! spare instead of next to its parent. On a filesystem without a journal,
//! ext4 passes over every inode freed in the last seconds when it looks for
//! a free one; a directory next to others that create and delete many files
//! makes each new file cost a scan of thousands of them.

use std::os::fd::{AsFd, AsRawFd};

use nix::errno::Errno;

use crate::Result;

/// `FS_TOPDIR_FL` of `<linux/fs.h>`: the top of directory hierarchies.
const FS_TOPDIR_FL: libc::c_int = 0x0002_0000;

/// The inode flags of the file open as `file`.
pub fn get(file: &impl AsFd) -> Result<libc::c_int> {
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int (the kernel's flags word, despite
    // the `long` of its request number) to the pointer, which points to
    // `flags`, valid and writable for the call; the descriptor is open.
    let rc = unsafe {
        libc::ioctl(
            file.as_fd().as_raw_fd(),
            libc::FS_IOC_GETFLAGS,
            &mut flags as *mut libc::c_int,
        )
    };
    Errno::result(rc).map(|_| flags)
}

/// Mark the directory open as `dir` as the top of directory hierarchies
/// (`chattr +T`), unless it is already; `Ok(false)` if it already was.
/// Filesystems without inode flags answer `ENOTTY` or `EOPNOTSUPP`.
pub fn set_topdir(dir: &impl AsFd) -> Result<bool> {
    let flags = get(dir)?;
    if flags & FS_TOPDIR_FL != 0 {
        return Ok(false);
    }
    let new = flags | FS_TOPDIR_FL;
    // SAFETY: FS_IOC_SETFLAGS reads one int from the pointer, which points to
    // `new`, valid for the call; the descriptor is open. It changes no memory
    // of this process.
    let rc = unsafe {
        libc::ioctl(
            dir.as_fd().as_raw_fd(),
            libc::FS_IOC_SETFLAGS,
            &new as *const libc::c_int,
        )
    };
    Errno::result(rc).map(|_| true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topdir_is_set_once() {
        let tmp = std::env::temp_dir().join(format!("nestbox-sys-topdir-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        let dir = std::fs::File::open(&tmp).unwrap();
        match set_topdir(&dir) {
            Ok(changed) => {
                assert!(changed);
                assert_ne!(get(&dir).unwrap() & FS_TOPDIR_FL, 0);
                assert!(!set_topdir(&dir).unwrap(), "already set");
            }
            // A temp directory on a filesystem without inode flags (tmpfs).
            Err(Errno::ENOTTY | Errno::EOPNOTSUPP | Errno::EINVAL) => {}
            Err(e) => panic!("FS_IOC_SETFLAGS: {e}"),
        }
        std::fs::remove_dir(&tmp).unwrap();
    }
}
