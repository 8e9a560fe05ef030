//! A box's size-limited writable layer (`--disk SIZE`): the upper and work
//! directories of its overlay live on a filesystem of their own, an ext4
//! image of SIZE bytes in the box's data directory, attached to a loop device
//! and mounted at `<data dir>/disk`.
//!
//! Why this way: the host's root filesystem here is ext4 without the
//! `prjquota` option, so project quotas (the usual per-directory limit) are
//! not available; a size-limited tmpfs would keep the box's files in RAM and
//! charge them to whichever cgroup first touches each page. A sparse image
//! costs only the blocks written, its data is cached once (the loop device
//! uses direct I/O on the image), and a full image fails the box's writes with
//! ENOSPC and nothing else: the host's filesystem and the other boxes' layers
//! are separate filesystems.
//!
//! Formatting shells out to `mkfs.ext4` (e2fsprogs, installed by
//! `scripts/setup.sh`): writing an ext4 image is a program of its own, and no
//! well-kept crate does it. The image has no journal (the layer is scratch
//! space of one box, removed with it) and no reserved blocks, so the box gets
//! SIZE minus ext4's metadata.
//!
//! Cleanup: the loop device is attached with autoclear, so it detaches itself
//! when the filesystem is unmounted; [`release`] unmounts it (lazily while
//! the box's mount namespace is still being torn down), waits until the
//! device has let the image go, and is called by
//! every removal of a box's data directory (rm, a failed start, gc of a
//! dead box or of a data directory no box owns). The mount is made in the
//! host's mount namespace and kept while the box's record exists (a stopped
//! box keeps its layer, as without `--disk`); a start after a reboot mounts
//! the image again.

use std::fs::OpenOptions;
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nestbox_sys::mount::MsFlags;

use crate::{Result, RuntimeError};

/// The image file in a box's data directory.
pub const IMAGE: &str = "disk.img";
/// Where the image is mounted in a box's data directory.
pub const MOUNT: &str = "disk";
/// The smallest `--disk` accepted (ext4 with its metadata needs some room).
pub const MIN_SIZE: u64 = 8 << 20;
/// The largest `--disk` accepted (16 TiB, ext4's limit with 4 KiB blocks).
pub const MAX_SIZE: u64 = 16 << 40;

/// Where the writable layers of a box with a disk live: `<lib_dir>/disk`.
pub fn mount_point(lib_dir: &Path) -> PathBuf {
    lib_dir.join(MOUNT)
}

/// Checks a `--disk` size before anything is made.
pub fn validate(size: u64) -> Result<()> {
    if !(MIN_SIZE..=MAX_SIZE).contains(&size) {
        return Err(RuntimeError::InvalidInput(format!(
            "--disk {size} bytes is out of range: it must be between 8m and 16t"
        )));
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(RuntimeError::InvalidInput(
            "--disk needs root: the layer is a filesystem image mounted from a loop device".into(),
        ));
    }
    Ok(())
}

/// Whether `dir` is the root of a mount other than its parent's (a different
/// device than its parent directory).
fn is_mounted(dir: &Path) -> bool {
    let (Ok(me), Some(Ok(parent))) = (std::fs::metadata(dir), dir.parent().map(std::fs::metadata))
    else {
        return false;
    };
    me.dev() != parent.dev()
}

/// Make sure the box's disk of `size` bytes is mounted at
/// [`mount_point`]`(lib_dir)`: formats the image the first time, attaches and
/// mounts it when it is not mounted. `owner` (host uid, gid) owns the root
/// of the new filesystem. On failure nothing it made stays attached or
/// mounted (the image file, if made, goes with the data directory).
pub fn ensure_mounted(lib_dir: &Path, size: u64, owner: Option<(u32, u32)>) -> Result<PathBuf> {
    let target = mount_point(lib_dir);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&target)
        .map_err(RuntimeError::io("mkdir", &target))?;
    if is_mounted(&target) {
        return Ok(target);
    }
    let image = lib_dir.join(IMAGE);
    if !image.exists() {
        format(&image, size, owner)?;
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&image)
        .map_err(RuntimeError::io("open", &image))?;
    let loop_dev = nestbox_sys::loopdev::attach(file.as_fd()).map_err(RuntimeError::sys(
        format!("attach {} to a loop device", image.display()),
    ))?;
    // The device holds the file open itself; on failure dropping `loop_dev`
    // (its only user) detaches it.
    drop(file);
    nestbox_sys::mount::mount_fs(
        &loop_dev.path,
        &target,
        "ext4",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOATIME,
        None,
    )
    .map_err(RuntimeError::sys(format!(
        "mount {} ({}) on {}",
        loop_dev.path,
        image.display(),
        target.display()
    )))?;
    Ok(target)
}

/// Create the sparse image `image` of `size` bytes and format it as ext4. A
/// half-made image is removed.
fn format(image: &Path, size: u64, owner: Option<(u32, u32)>) -> Result<()> {
    let partial = image.with_extension("img.new");
    let made = (|| {
        let f = std::fs::File::create(&partial).map_err(RuntimeError::io("create", &partial))?;
        f.set_len(size)
            .map_err(RuntimeError::io("set the size of", &partial))?;
        drop(f);
        let (uid, gid) = owner.unwrap_or((0, 0));
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0", "-O", "^has_journal", "-E"])
            .arg(format!(
                "root_owner={uid}:{gid},lazy_itable_init=1,nodiscard"
            ))
            .arg(&partial)
            .output()
            .map_err(|e| {
                RuntimeError::Failed(format!(
                    "--disk: cannot run mkfs.ext4 ({e}): install e2fsprogs (scripts/setup.sh does)"
                ))
            })?;
        if !out.status.success() {
            return Err(RuntimeError::Failed(format!(
                "--disk: mkfs.ext4 {} failed: {}",
                partial.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        std::fs::rename(&partial, image).map_err(RuntimeError::io("rename", &partial))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    made
}

/// Unmount the box's disk if it is mounted (the loop device then detaches
/// itself). A data directory without a disk is fine. Called before the data
/// directory is removed.
pub fn release(lib_dir: &Path) -> Result<()> {
    let target = mount_point(lib_dir);
    if !is_mounted(&target) {
        return Ok(());
    }
    let device = std::fs::metadata(&target).map(|m| m.dev()).ok();
    match nestbox_sys::mount::unmount(&target) {
        Ok(()) => {}
        // Still used (a process of a box being torn down has a file open, or
        // the box's mount namespace is not torn down yet): detached now,
        // freed with its last user.
        Err(nix::errno::Errno::EBUSY) => nestbox_sys::mount::detach(&target)
            .map_err(RuntimeError::sys(format!("umount {}", target.display())))?,
        Err(e) => return Err(RuntimeError::sys(format!("umount {}", target.display()))(e)),
    }
    if let Some(device) = device {
        wait_detached(device, &lib_dir.join(IMAGE), RELEASE_WAIT);
    }
    Ok(())
}

/// How long a removal waits for a box's loop device to let its image go.
const RELEASE_WAIT: Duration = Duration::from_secs(5);

/// Wait until loop device `device` no longer has `image` as its backing
/// file: it detaches itself (autoclear) once its filesystem's last user is
/// gone, which after a lazy unmount is when the box's mount namespace has
/// been torn down, a moment after the box's processes. So a removal returns
/// with nothing of the disk left. A device that keeps it longer is logged
/// (it still goes with its last user).
fn wait_detached(device: u64, image: &Path, within: Duration) {
    let backing = format!(
        "/sys/dev/block/{}:{}/loop/backing_file",
        nix::sys::stat::major(device),
        nix::sys::stat::minor(device)
    );
    let image = image.to_string_lossy();
    let deadline = Instant::now() + within;
    // The file says the path, with " (deleted)" once it is unlinked; a
    // device taken by another image meanwhile is not ours any more.
    while std::fs::read_to_string(&backing).is_ok_and(|b| b.starts_with(image.as_ref())) {
        if Instant::now() > deadline {
            tracing::warn!("loop device {backing} still holds {image} after {within:?}");
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Bytes used and the usable size of the box's disk, if it has one mounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Usage {
    /// Bytes in use (data and metadata of the box's layer).
    pub used_bytes: u64,
    /// Bytes the box can use in all (the image size minus ext4's overhead).
    pub limit_bytes: u64,
}

/// The usage of the box's disk (`None` if it has no disk mounted).
pub fn usage(lib_dir: &Path) -> Option<Usage> {
    let target = mount_point(lib_dir);
    if !is_mounted(&target) {
        return None;
    }
    let s = nix::sys::statvfs::statvfs(&target).ok()?;
    let frsize = s.fragment_size();
    let total = s.blocks() * frsize;
    let free = s.blocks_free() * frsize;
    Some(Usage {
        used_bytes: total.saturating_sub(free),
        limit_bytes: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_out_of_range_are_refused() {
        let e = validate(1 << 20).unwrap_err().to_string();
        assert!(e.contains("--disk 1048576 bytes is out of range"), "{e}");
        assert!(validate(MAX_SIZE + 1).is_err());
    }

    #[test]
    fn a_directory_without_a_disk_is_released_as_is() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(!is_mounted(&mount_point(tmp.path())));
        release(tmp.path()).unwrap();
        assert!(usage(tmp.path()).is_none());
    }
}
