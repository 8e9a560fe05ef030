//! `/proc` and `/sys` for a box: a fresh procfs of the box's pid namespace, a
//! read-only sysfs, and the masked and read-only paths runc applies, so kernel
//! interfaces that leak host information or allow host changes are out of reach.

use std::path::Path;

use nestbox_sys::mount::MsFlags;

use crate::{mounts, Result};

/// Paths hidden from the box: files are covered by `/dev/null`, directories by an
/// empty read-only tmpfs.
pub const MASKED_PATHS: &[&str] = &[
    "proc/acpi",
    "proc/asound",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "sys/firmware",
    "sys/devices/virtual/powercap",
];

/// Paths the box may read but not write.
pub const READ_ONLY_PATHS: &[&str] = &[
    "proc/bus",
    "proc/fs",
    "proc/irq",
    "proc/sys",
    "proc/sysrq-trigger",
];

const KERNEL_FS_FLAGS: MsFlags = MsFlags::MS_NOSUID
    .union(MsFlags::MS_NODEV)
    .union(MsFlags::MS_NOEXEC);

/// Mount a procfs of the caller's pid namespace at `root/proc`.
pub fn mount_proc(root: &Path) -> Result<()> {
    mounts::mount_fs("proc", &root.join("proc"), "proc", KERNEL_FS_FLAGS, None)
}

/// Mount sysfs read-only at `root/sys`; where the kernel refuses a new sysfs (a user
/// namespace that does not own the network namespace), bind the host's read-only.
pub fn mount_sys(root: &Path) -> Result<()> {
    let target = root.join("sys");
    match mounts::mount_fs(
        "sysfs",
        &target,
        "sysfs",
        KERNEL_FS_FLAGS | MsFlags::MS_RDONLY,
        None,
    ) {
        Ok(()) => Ok(()),
        Err(e) if e.errno == nix::errno::Errno::EPERM => {
            mounts::bind(Path::new("/sys"), &target, true)?;
            mounts::remount_read_only(&target)
        }
        Err(e) => Err(e),
    }
}

/// Where a box that may run boxes of its own (`--nest`) keeps its hidden,
/// unmasked procfs and sysfs: in its `/dev` tmpfs, under an empty read-only
/// tmpfs that covers the directory.
pub const HIDDEN_DIR: &str = "dev/.nestbox";

/// Mount a fresh, unmasked procfs and (where the kernel allows one) sysfs
/// below [`HIDDEN_DIR`] of `root`, then cover that directory with an empty
/// read-only tmpfs, so no path reaches them.
///
/// Why: in a user namespace the kernel mounts a new procfs or sysfs only if
/// the mount namespace already holds one of the same kind that is *fully
/// visible* (`mnt_already_visible`: no locked mount on top of anything in it
/// but an empty directory). A box's own `/proc` and `/sys` carry the masks
/// above, which are locked mounts in the namespaces of the boxes it starts, so
/// a nested box could mount neither. These two, without masks, satisfy the
/// rule; being covered, they show nothing to the box (and a box cannot
/// uncover them: unmounting needs `CAP_SYS_ADMIN` over this mount namespace,
/// which the box's command lacks, and in a nested namespace the cover is a
/// locked mount).
pub fn mount_hidden_for_nesting(root: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let dir = root.join(HIDDEN_DIR);
    for sub in ["proc", "sys"] {
        let d = dir.join(sub);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&d)
            .map_err(|e| crate::IsolationError::io("mkdir", &d, e))?;
    }
    // Read-write, as the procfs of a nested box is: a locked read-only flag
    // would refuse it.
    mounts::mount_fs("proc", &dir.join("proc"), "proc", KERNEL_FS_FLAGS, None)?;
    match mounts::mount_fs(
        "sysfs",
        &dir.join("sys"),
        "sysfs",
        KERNEL_FS_FLAGS | MsFlags::MS_RDONLY,
        None,
    ) {
        // Without a network namespace of its own (`--network host`) the box
        // has no sysfs of its own either; its nested boxes then bind its
        // `/sys` (see `mount_sys`).
        Ok(()) => {}
        Err(e) if e.errno == nix::errno::Errno::EPERM => {}
        Err(e) => return Err(e),
    }
    mounts::mount_fs(
        "tmpfs",
        &dir,
        "tmpfs",
        KERNEL_FS_FLAGS | MsFlags::MS_RDONLY,
        Some("size=0,mode=000"),
    )
}

/// Make `root/proc/sys/net` writable again under the read-only `/proc/sys`
/// (a bind of it on itself, remounted writable), for a nest box: the nestbox
/// inside sets its bridge's sysctls (`ip_forward`, the bridge's
/// `forwarding`, a veth's `disable_ipv6`) there. `/proc/sys/net` shows the
/// network namespace of whoever opens it, and the kernel lets only the root
/// of the user namespace owning that namespace write it: in a box with its
/// own network namespace that is the box's own; in one sharing the host's
/// (`--network host`) the host's root's, so nothing changes there.
pub fn open_net_sysctls(root: &Path) -> Result<()> {
    let path = root.join("proc/sys/net");
    if path.symlink_metadata().is_err() {
        return Ok(());
    }
    mounts::bind(&path, &path, false)?;
    mounts::remount_writable(&path)
}

/// Apply [`MASKED_PATHS`] and [`READ_ONLY_PATHS`] under `root` (needs `root/dev/null`).
pub fn apply_masks(root: &Path) -> Result<()> {
    let null = root.join("dev/null");
    for rel in MASKED_PATHS {
        let path = root.join(rel);
        let Ok(meta) = path.symlink_metadata() else {
            continue;
        };
        if meta.is_dir() {
            mounts::mount_fs(
                "tmpfs",
                &path,
                "tmpfs",
                KERNEL_FS_FLAGS | MsFlags::MS_RDONLY,
                Some("size=0"),
            )?;
        } else {
            mounts::bind(&null, &path, false)?;
        }
    }
    for rel in READ_ONLY_PATHS {
        let path = root.join(rel);
        if path.symlink_metadata().is_err() {
            continue;
        }
        mounts::bind(&path, &path, true)?;
        mounts::remount_read_only(&path)?;
    }
    Ok(())
}
