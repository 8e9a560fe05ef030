//! Extended attributes of a path (`getxattr`, `setxattr`, `removexattr`),
//! following symlinks.
//!
//! Used to keep small facts with the object they describe, e.g. a box's CPU
//! reservation on its cgroup directory, where every nestbox process sharing
//! that cgroup parent can read it and it vanishes with the directory.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::errno::Errno;

use crate::Result;

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)
}

fn c_name(name: &str) -> Result<CString> {
    CString::new(name).map_err(|_| Errno::EINVAL)
}

/// The value of attribute `name` of `path`; `Ok(None)` when it has none
/// (`ENODATA`).
pub fn get(path: &Path, name: &str) -> Result<Option<Vec<u8>>> {
    let (p, n) = (c_path(path)?, c_name(name)?);
    let mut value = vec![0u8; 256];
    loop {
        // SAFETY: both strings are NUL-terminated; `value` has `value.len()`
        // writable bytes.
        let got = unsafe {
            libc::getxattr(
                p.as_ptr(),
                n.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        match Errno::result(got) {
            Ok(len) => {
                value.truncate(len as usize);
                return Ok(Some(value));
            }
            Err(Errno::ENODATA) => return Ok(None),
            Err(Errno::ERANGE) if value.len() < 1 << 16 => value.resize(value.len() * 4, 0),
            Err(e) => return Err(e),
        }
    }
}

/// Set attribute `name` of `path` to `value`.
pub fn set(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let (p, n) = (c_path(path)?, c_name(name)?);
    // SAFETY: both strings are NUL-terminated; `value` is readable for its length.
    Errno::result(unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    })
    .map(drop)
}

/// Remove attribute `name` of `path`; one that is not there is fine.
pub fn remove(path: &Path, name: &str) -> Result<()> {
    let (p, n) = (c_path(path)?, c_name(name)?);
    // SAFETY: both strings are NUL-terminated.
    match Errno::result(unsafe { libc::removexattr(p.as_ptr(), n.as_ptr()) }) {
        Ok(_) | Err(Errno::ENODATA) => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_remove() {
        let dir = std::env::temp_dir().join(format!("nestbox-sys-xattr-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let name = "user.nestbox.test";
        if let Err(e) = set(&dir, name, b"0.5") {
            std::fs::remove_dir(&dir).unwrap();
            panic!("user xattrs on {}: {e}", dir.display());
        }
        assert_eq!(get(&dir, name).unwrap().as_deref(), Some(&b"0.5"[..]));
        remove(&dir, name).unwrap();
        assert_eq!(get(&dir, name).unwrap(), None);
        remove(&dir, name).unwrap();
        std::fs::remove_dir(&dir).unwrap();
    }
}
