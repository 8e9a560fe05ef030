//! The box's minimal `/dev`: a small tmpfs holding bind mounts of the harmless
//! character devices, a private devpts instance, `/dev/shm` and the usual links.
//! No host block device or other node is reachable.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use nestbox_sys::mount::MsFlags;

use crate::{mounts, IsolationError, Result};

/// Character devices every box gets, bound from the host's `/dev`.
pub const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// The usual links of `/dev`: (name, target).
pub const LINKS: &[(&str, &str)] = &[
    ("ptmx", "pts/ptmx"),
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
];

/// Populate `dev` (the box's `/dev` mount point, seen from the host side).
pub fn populate(dev: &Path, userns: bool) -> Result<()> {
    // nodev: box root keeps CAP_MKNOD, and a node it makes here (a host disk,
    // say) must not open. The bound nodes below are mounts of their own and
    // keep working.
    mounts::mount_fs(
        "tmpfs",
        dev,
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=755,size=65536k"),
    )?;
    for name in DEVICES {
        let target = dev.join(name);
        fs::File::create(&target).map_err(|e| IsolationError::io("create", &target, e))?;
        mounts::bind(&Path::new("/dev").join(name), &target, false)?;
    }
    let pts = dev.join("pts");
    mkdir(&pts, 0o755)?;
    let pts_opts = if userns {
        "newinstance,ptmxmode=0666,mode=620"
    } else {
        "newinstance,ptmxmode=0666,mode=620,gid=5"
    };
    mounts::mount_fs(
        "devpts",
        &pts,
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(pts_opts),
    )?;
    let shm = dev.join("shm");
    mkdir(&shm, 0o1777)?;
    mounts::mount_fs(
        "shm",
        &shm,
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("mode=1777,size=65536k"),
    )?;
    for &(link, target) in LINKS {
        let path = dev.join(link);
        symlink(target, &path).map_err(|e| IsolationError::io("symlink", &path, e))?;
    }
    Ok(())
}

fn mkdir(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    fs::DirBuilder::new()
        .mode(mode)
        .create(path)
        .map_err(|e| IsolationError::io("mkdir", path, e))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .map_err(|e| IsolationError::io("chmod", path, e))
}
