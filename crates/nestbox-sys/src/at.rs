//! Opening files relative to an open directory (`openat(2)`), for callers
//! that make or read many files in a few directories: each open walks one
//! name, not the whole path again.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::Result;

/// Open `name` relative to the directory open as `dir` with `flags` (and
/// `mode` for a file it creates, `O_TMPFILE` included); close-on-exec always.
pub fn open_at(dir: &impl AsFd, name: &Path, flags: OFlag, mode: Mode) -> Result<OwnedFd> {
    let fd = nix::fcntl::openat(
        Some(dir.as_fd().as_raw_fd()),
        name,
        flags | OFlag::O_CLOEXEC,
        mode,
    )?;
    // SAFETY: openat just returned this new descriptor; nothing else owns or
    // closes it, so the OwnedFd is its only owner.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_relative_to_the_directory() {
        let tmp = std::env::temp_dir().join(format!("nestbox-sys-at-{}", std::process::id()));
        std::fs::create_dir(&tmp).unwrap();
        std::fs::write(tmp.join("f"), b"hi").unwrap();
        let dir = std::fs::File::open(&tmp).unwrap();
        let f = open_at(&dir, Path::new("f"), OFlag::O_RDONLY, Mode::empty()).unwrap();
        assert_eq!(
            std::io::read_to_string(std::fs::File::from(f)).unwrap(),
            "hi"
        );
        assert_eq!(
            open_at(&dir, Path::new("none"), OFlag::O_RDONLY, Mode::empty()).unwrap_err(),
            nix::errno::Errno::ENOENT
        );
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
