//! File metadata that lives on the inode — mode, owner, mtime, extended
//! attributes — how it is read from a file, applied to one, and condensed into the
//! *metadata key* that names an inode variant of an object.
//!
//! Hardlinked files share one inode and so one set of metadata: two files with the
//! same content but different metadata cannot be one inode. The store therefore
//! keys every stored inode by (content digest, metadata key).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Result, StoreError};
use crate::hash::{hex, unhex};

/// An extended attribute value (serialised as hex).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct XattrValue(pub Vec<u8>);

impl std::fmt::Debug for XattrValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", hex(&self.0))
    }
}

impl Serialize for XattrValue {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&hex(&self.0))
    }
}

impl<'de> Deserialize<'de> for XattrValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        unhex(&s)
            .map(XattrValue)
            .ok_or_else(|| serde::de::Error::custom("bad xattr hex"))
    }
}

/// Inode metadata of an image entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Meta {
    /// Permission bits including set-id and sticky (`mode & 0o7777`).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time, seconds since the epoch.
    pub mtime: i64,
    /// Nanoseconds of the modification time.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtime_nsec: u32,
    /// Extended attributes (name → value), overlayfs' own excluded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, XattrValue>,
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Whether an extended attribute belongs to overlayfs (never stored, never applied:
/// in a lower layer it would change what the overlay shows).
pub fn is_overlay_xattr(name: &str) -> bool {
    name.starts_with("trusted.overlay.") || name.starts_with("user.overlay.")
}

impl Meta {
    /// The metadata of the object holding manifests and other store-internal data.
    pub fn internal() -> Self {
        Meta {
            mode: 0o444,
            ..Meta::default()
        }
    }

    /// From `lstat` of a file plus its extended attributes.
    pub fn from_metadata(path: &Path, md: &std::fs::Metadata, with_xattrs: bool) -> Result<Self> {
        Ok(Meta {
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            mtime: md.mtime(),
            mtime_nsec: md.mtime_nsec().clamp(0, 999_999_999) as u32,
            xattrs: if with_xattrs {
                read_xattrs(path)?
            } else {
                BTreeMap::new()
            },
        })
    }

    /// The 16-hex-digit key naming this metadata (part of a stored inode's name).
    pub fn key(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(b"nestbox-meta-v1\0");
        h.update(&self.mode.to_le_bytes());
        h.update(&self.uid.to_le_bytes());
        h.update(&self.gid.to_le_bytes());
        h.update(&self.mtime.to_le_bytes());
        h.update(&self.mtime_nsec.to_le_bytes());
        for (k, v) in &self.xattrs {
            h.update(&(k.len() as u64).to_le_bytes());
            h.update(k.as_bytes());
            h.update(&(v.0.len() as u64).to_le_bytes());
            h.update(&v.0);
        }
        hex(&h.finalize().as_bytes()[..8])
    }

    /// Set owner, mode, xattrs and mtime on an open regular file (in that order:
    /// chown clears set-id bits, and every change but the last would move mtime).
    /// Without root, a chown to another owner is skipped (the file keeps the caller's).
    pub fn apply_fd(&self, file: &std::fs::File, path: &Path) -> Result<()> {
        self.apply_fd_owned(file, path, None, false)
    }

    /// [`Meta::apply_fd`] on a file known to be owned by `owner` (user, group)
    /// already: no chown when that is the owner wanted; no chmod with
    /// `mode_set` (the file was made with this mode, which has no set-ID or
    /// sticky bit for a chown to clear).
    pub(crate) fn apply_fd_owned(
        &self,
        file: &std::fs::File,
        path: &Path,
        owner: Option<(u32, u32)>,
        mode_set: bool,
    ) -> Result<()> {
        let fd = file.as_fd();
        let chown = if owner == Some((self.uid, self.gid)) {
            Ok(())
        } else {
            nix::unistd::fchown(fd.as_raw_fd(), Some(self.uid.into()), Some(self.gid.into()))
        };
        match chown {
            Ok(()) => {}
            Err(nix::errno::Errno::EPERM) if !nix::unistd::geteuid().is_root() => {}
            Err(e) => return Err(StoreError::sys("fchown", path)(e)),
        }
        if !(mode_set && self.mode & 0o7000 == 0) {
            nix::sys::stat::fchmod(
                fd.as_raw_fd(),
                nix::sys::stat::Mode::from_bits_truncate(self.mode),
            )
            .map_err(StoreError::sys("fchmod", path))?;
        }
        for (name, value) in &self.xattrs {
            let cname = CString::new(name.as_str())
                .map_err(|_| StoreError::refused(path, name.clone(), "xattr name contains NUL"))?;
            // SAFETY: fd is an open descriptor owned by `file`; name is a NUL-terminated
            // C string and value points to value.0.len() readable bytes.
            let rc = unsafe {
                libc::fsetxattr(
                    fd.as_raw_fd(),
                    cname.as_ptr(),
                    value.0.as_ptr().cast(),
                    value.0.len(),
                    0,
                )
            };
            if rc != 0 {
                return Err(StoreError::io("fsetxattr", path.join(name))(
                    std::io::Error::last_os_error(),
                ));
            }
        }
        let times = [
            nix::sys::time::TimeSpec::new(self.mtime, i64::from(self.mtime_nsec)),
            nix::sys::time::TimeSpec::new(self.mtime, i64::from(self.mtime_nsec)),
        ];
        nix::sys::stat::futimens(fd.as_raw_fd(), &times[0], &times[1])
            .map_err(StoreError::sys("futimens", path))?;
        // The kernel clamps a time the filesystem cannot hold (ext4 keeps up to
        // 2446) without an error; an object whose inode differs from its key
        // would be reported corrupt by `store verify` ever after.
        // Every filesystem holds the times of 1970–2038: those need no check.
        if (0..=i64::from(i32::MAX)).contains(&self.mtime) {
            return Ok(());
        }
        let kept = nix::sys::stat::fstat(fd.as_raw_fd())
            .map_err(StoreError::sys("fstat", path))?
            .st_mtime;
        if kept != self.mtime {
            return Err(StoreError::Unsupported(format!(
                "mtime {} is out of the range this filesystem stores (it keeps {kept})",
                self.mtime
            )));
        }
        Ok(())
    }

    /// Set owner, mode (unless a symlink), xattrs and times on `path` without
    /// following a final symlink.
    pub fn apply_path(&self, path: &Path, is_symlink: bool) -> Result<()> {
        match nix::unistd::fchownat(
            None,
            path,
            Some(self.uid.into()),
            Some(self.gid.into()),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        ) {
            Ok(()) => {}
            Err(nix::errno::Errno::EPERM) if !nix::unistd::geteuid().is_root() => {}
            Err(e) => return Err(StoreError::sys("lchown", path)(e)),
        }
        if !is_symlink {
            nix::sys::stat::fchmodat(
                None,
                path,
                nix::sys::stat::Mode::from_bits_truncate(self.mode),
                nix::sys::stat::FchmodatFlags::FollowSymlink,
            )
            .map_err(StoreError::sys("chmod", path))?;
        }
        let cpath = cstring(path)?;
        for (name, value) in &self.xattrs {
            let Ok(cname) = CString::new(name.as_str()) else {
                continue;
            };
            // SAFETY: both pointers are NUL-terminated C strings that live across the
            // call, and value points to value.0.len() readable bytes.
            let rc = unsafe {
                libc::lsetxattr(
                    cpath.as_ptr(),
                    cname.as_ptr(),
                    value.0.as_ptr().cast(),
                    value.0.len(),
                    0,
                )
            };
            if rc != 0 {
                return Err(StoreError::io("lsetxattr", path.join(name))(
                    std::io::Error::last_os_error(),
                ));
            }
        }
        let t = nix::sys::time::TimeSpec::new(self.mtime, i64::from(self.mtime_nsec));
        nix::sys::stat::utimensat(
            None,
            path,
            &t,
            &t,
            nix::sys::stat::UtimensatFlags::NoFollowSymlink,
        )
        .map_err(StoreError::sys("utimensat", path))?;
        Ok(())
    }
}

/// `path` as a C string.
pub fn cstring(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        StoreError::io("path", path)(std::io::Error::from(std::io::ErrorKind::InvalidInput))
    })
}

/// The extended attributes of `path` (not following a final symlink), overlayfs'
/// own left out. A filesystem without xattr support has none.
pub fn read_xattrs(path: &Path) -> Result<BTreeMap<String, XattrValue>> {
    let cpath = cstring(path)?;
    let mut out = BTreeMap::new();
    let mut names = vec![0u8; 1024];
    let len = loop {
        // SAFETY: cpath is NUL-terminated; names has names.len() writable bytes.
        let n = unsafe { libc::llistxattr(cpath.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n as usize;
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ERANGE) => names.resize(names.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(out),
            _ => return Err(StoreError::io("llistxattr", path)(err)),
        }
    };
    for raw in names[..len].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(name) = std::str::from_utf8(raw) else {
            continue;
        };
        if is_overlay_xattr(name) {
            continue;
        }
        let cname = CString::new(raw).expect("split at NUL");
        let mut value = vec![0u8; 256];
        loop {
            // SAFETY: both strings are NUL-terminated; value has value.len() writable bytes.
            let n = unsafe {
                libc::lgetxattr(
                    cpath.as_ptr(),
                    cname.as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            if n >= 0 {
                value.truncate(n as usize);
                break;
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ERANGE) => value.resize(value.len() * 4, 0),
                Some(libc::ENODATA) => {
                    value.clear();
                    break;
                }
                _ => return Err(StoreError::io("lgetxattr", path.join(name))(err)),
            }
        }
        out.insert(name.to_string(), XattrValue(value));
    }
    Ok(out)
}

/// One extended attribute of `path` (not following symlinks), if set.
pub fn get_xattr(path: &Path, name: &CStr) -> Option<Vec<u8>> {
    let cpath = cstring(path).ok()?;
    let mut value = vec![0u8; 64];
    // SAFETY: both strings are NUL-terminated; value has value.len() writable bytes.
    let n = unsafe {
        libc::lgetxattr(
            cpath.as_ptr(),
            name.as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    if n < 0 {
        return None;
    }
    value.truncate(n as usize);
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_depends_on_every_field() {
        let a = Meta {
            mode: 0o644,
            ..Meta::default()
        };
        let mut b = a.clone();
        assert_eq!(a.key(), b.key());
        b.mtime = 1;
        assert_ne!(a.key(), b.key());
        let mut c = a.clone();
        c.xattrs.insert("user.x".into(), XattrValue(b"1".to_vec()));
        assert_ne!(a.key(), c.key());
        assert_eq!(a.key().len(), 16);
    }

    #[test]
    fn applied_metadata_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::File::create(&p).unwrap();
        let md = f.metadata().unwrap();
        let mut m = Meta {
            mode: 0o640,
            uid: md.uid(),
            gid: md.gid(),
            mtime: 1_600_000_000,
            mtime_nsec: 5,
            xattrs: BTreeMap::new(),
        };
        m.xattrs
            .insert("user.nestbox".into(), XattrValue(b"v".to_vec()));
        match m.apply_fd(&f, &p) {
            Ok(()) => {}
            // tmpfs without user xattrs: check the rest.
            Err(_) => {
                m.xattrs.clear();
                m.apply_fd(&f, &p).unwrap();
            }
        }
        let back = Meta::from_metadata(&p, &std::fs::metadata(&p).unwrap(), true).unwrap();
        assert_eq!(back, m);
    }
}
