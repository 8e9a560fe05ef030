//! The box root: overlay layers from the image, volumes, tmpfs mounts, `/dev`,
//! `/proc`, `/sys`, then `pivot_root` into it with the old root detached.
//!
//! All of it is done by the box's first process inside its own, private mount
//! namespace, so nothing is ever mounted on the host and nothing needs unmounting
//! when the box ends: the namespace and its mounts vanish with its last process.

use std::fs;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use nestbox_sys::mount::MsFlags;
use nix::unistd::chdir;

use crate::{dev, mounts, procfs, IsolationError, Result};

/// One overlay of the root: read-only lowers under a private writable layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerMount {
    /// Path inside the box ("/" for the root).
    pub target: PathBuf,
    /// Read-only lower directories, topmost first.
    pub lowers: Vec<PathBuf>,
    /// The box's writable directory for this layer.
    pub upper: PathBuf,
    /// Overlayfs work directory (same filesystem as `upper`).
    pub work: PathBuf,
}

/// A host path mounted into the box.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Volume {
    /// Host path (must exist).
    pub source: PathBuf,
    /// Absolute path in the box.
    pub target: PathBuf,
    /// Mounted read-only.
    pub read_only: bool,
}

/// Everything needed to assemble a box root.
#[derive(Debug, Clone)]
pub struct RootfsPlan {
    /// Host directory the root is assembled on (inside the private mount namespace).
    pub mountpoint: PathBuf,
    /// Overlay layers, root first.
    pub layers: Vec<LayerMount>,
    /// Host directories bound read-only (source, target in the box), after the layers.
    pub read_only_binds: Vec<(PathBuf, PathBuf)>,
    /// Small read-only files given by their content (path in the box,
    /// content), such as the box's own `/etc/machine-id`. They live in the
    /// box's `/dev` tmpfs, so nothing is written to disk for them.
    pub files: Vec<(PathBuf, Vec<u8>)>,
    /// Host directories or files bound in.
    pub volumes: Vec<Volume>,
    /// Paths that get a fresh tmpfs.
    pub tmpfs: Vec<PathBuf>,
    /// Make the root (all layers) read-only.
    pub read_only: bool,
    /// Running in a user namespace (overlay uses user xattrs, no devpts gid).
    pub userns: bool,
    /// What a box that may run boxes of its own needs (`--nest`): its
    /// cgroups at `/sys/fs/cgroup` and a hidden unmasked procfs and sysfs.
    pub nest: Option<NestMounts>,
}

/// The mounts of a box that may run boxes of its own (`--nest`, see
/// `docs/nesting.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NestMounts {
    /// Cgroup hierarchies mounted (from the box's cgroup namespace, so each
    /// shows the box's own cgroup as its root) on a tmpfs at `/sys/fs/cgroup`.
    pub cgroups: Vec<CgroupMount>,
}

/// One cgroup hierarchy mounted in a box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// Directory under `/sys/fs/cgroup` (as on the host: `memory`,
    /// `cpu,cpuacct`, `unified`...); empty for a lone cgroup2 hierarchy
    /// mounted at `/sys/fs/cgroup` itself (pure v2).
    pub dir: String,
    /// `cgroup` (v1) or `cgroup2`.
    pub fstype: String,
    /// The mount options: the v1 hierarchy's controllers (`cpu,cpuacct`);
    /// none for `cgroup2`.
    pub options: Option<String>,
}

/// Assemble the root described by `plan` at `plan.mountpoint`.
/// Must run in the box's new mount namespace, before [`pivot_into`].
pub fn assemble(plan: &RootfsPlan) -> Result<()> {
    mounts::make_private_recursive(Path::new("/"))?;
    let root = &plan.mountpoint;
    let writable_fs = MsFlags::MS_NODEV;
    for layer in &plan.layers {
        let target = secure_join(root, &layer.target)?;
        let lowers: Vec<&Path> = layer.lowers.iter().map(PathBuf::as_path).collect();
        let opts =
            mounts::overlay_options(&lowers, Some((&layer.upper, &layer.work)), plan.userns)?;
        mounts::mount_fs("overlay", &target, "overlay", writable_fs, Some(&opts))?;
    }
    for (source, target) in &plan.read_only_binds {
        let target = secure_join(root, target)?;
        match mounts::bind(source, &target, false) {
            Ok(()) => mounts::remount_read_only(&target)?,
            // Inside a box (a box nested in a box), a system directory of
            // the outer box has mounts of its own on it (its machine-id,
            // hosts file), locked in this namespace: the kernel binds it only
            // with them (a bind without them would uncover what they hide).
            Err(e) if e.errno == nix::errno::Errno::EINVAL && plan.userns => {
                mounts::bind(source, &target, true)?;
                mounts::restrict_tree(&target, MsFlags::MS_RDONLY)?;
            }
            Err(e) => return Err(e),
        }
    }
    dev::populate(&root.join("dev"), plan.userns)?;
    procfs::mount_proc(root)?;
    procfs::mount_sys(root)?;
    for (i, (path, content)) in plan.files.iter().enumerate() {
        place_file(root, i, path, content, plan.nest.is_some())?;
    }
    for vol in &plan.volumes {
        let target = secure_join(root, &vol.target)?;
        make_mountpoint(&target, vol.source.is_dir())?;
        mounts::bind(&vol.source, &target, true)?;
        // A volume is a writable filesystem of the box like any other: no
        // device node or set-id bit made on it (or on a mount under it) works.
        let mut restrict = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if vol.read_only {
            restrict |= MsFlags::MS_RDONLY;
        }
        mounts::restrict_tree(&target, restrict)?;
    }
    for path in &plan.tmpfs {
        let target = secure_join(root, path)?;
        make_mountpoint(&target, true)?;
        mounts::mount_fs(
            "tmpfs",
            &target,
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=1777"),
        )?;
    }
    if plan.read_only {
        for layer in &plan.layers {
            mounts::remount_read_only(&secure_join(root, &layer.target)?)?;
        }
    }
    procfs::apply_masks(root)?;
    if let Some(nest) = &plan.nest {
        mount_cgroups(root, &nest.cgroups)?;
        procfs::mount_hidden_for_nesting(root)?;
        procfs::open_net_sysctls(root)?;
    }
    Ok(())
}

/// Mount `cgroups` at `root/sys/fs/cgroup`, on a tmpfs made read-only once
/// they are mounted. Must run in the box's cgroup namespace, so each
/// hierarchy's root is the box's own cgroup.
fn mount_cgroups(root: &Path, cgroups: &[CgroupMount]) -> Result<()> {
    if cgroups.is_empty() {
        return Ok(());
    }
    let base = root.join("sys/fs/cgroup");
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // Pure cgroup v2: the one hierarchy is `/sys/fs/cgroup` itself.
    if let [only] = cgroups {
        if only.dir.is_empty() {
            return mounts::mount_fs(
                "cgroup",
                &base,
                &only.fstype,
                flags,
                only.options.as_deref(),
            );
        }
    }
    mounts::mount_fs("tmpfs", &base, "tmpfs", flags, Some("mode=755,size=64k"))?;
    for cg in cgroups {
        if cg.dir.is_empty() || cg.dir.contains('/') || cg.dir.starts_with('.') {
            return Err(IsolationError::at(
                "cgroup mount directory",
                base.join(&cg.dir),
                nix::errno::Errno::EINVAL,
            ));
        }
        let target = base.join(&cg.dir);
        fs::DirBuilder::new()
            .mode(0o755)
            .create(&target)
            .map_err(|e| IsolationError::io("mkdir", &target, e))?;
        mounts::mount_fs("cgroup", &target, &cg.fstype, flags, cg.options.as_deref())?;
    }
    mounts::remount_read_only(&base)
}

/// Make `root` the root of the calling process's mount namespace and detach the
/// old root entirely, so no path leads back to the host (the chroot barrier).
pub fn pivot_into(root: &Path) -> Result<()> {
    chdir(root).map_err(|e| IsolationError::at("chdir", root, e))?;
    // pivot_root(".", ".") stacks the old root on top of the new one at "/";
    // detaching "." afterwards removes it without needing a put_old directory.
    nestbox_sys::mount::pivot_root(Path::new("."), Path::new("."))
        .map_err(|e| IsolationError::at("pivot_root", root, e))?;
    mounts::detach(Path::new("."))?;
    chdir("/").map_err(|e| IsolationError::at("chdir", "/", e))?;
    Ok(())
}

/// Bind a read-only file holding `content` at `path` in the box. The file is
/// made in the box's `/dev` tmpfs under a temporary name and unlinked once
/// bound: the mount keeps it, and nothing else in the box can reach it.
///
/// In a box that runs boxes of its own (`nest`) the file is kept, in the
/// directory [`procfs::HIDDEN_DIR`] that is covered at the end of the
/// assembly: a nested box binds its own file over this mount, which the
/// kernel refuses on a mount of an unlinked file.
fn place_file(root: &Path, index: usize, path: &Path, content: &[u8], nest: bool) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let staging = if nest {
        let dir = root.join(procfs::HIDDEN_DIR).join("files");
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| IsolationError::io("mkdir", &dir, e))?;
        dir.join(index.to_string())
    } else {
        root.join("dev").join(format!(".nestbox-file-{index}"))
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(&staging)
        .map_err(|e| IsolationError::io("create", &staging, e))?;
    file.write_all(content)
        .map_err(|e| IsolationError::io("write", &staging, e))?;
    drop(file);
    let target = secure_join(root, path)?;
    let bound = make_mountpoint(&target, false)
        .and_then(|()| mounts::bind(&staging, &target, false))
        .and_then(|()| mounts::remount_read_only(&target));
    if !nest {
        // The staging file is in the box's own /dev tmpfs: one that could
        // not be unlinked is invisible under its bind and goes with the box.
        let _ = fs::remove_file(&staging);
    }
    bound
}

/// Create a mount point (directory or empty file) if it does not exist yet,
/// with its missing parent directories.
pub fn make_mountpoint(target: &Path, dir: bool) -> Result<()> {
    if target.symlink_metadata().is_ok() {
        return Ok(());
    }
    if let Some(parent) = target.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(parent)
            .map_err(|e| IsolationError::io("mkdir", parent, e))?;
    }
    let made = if dir {
        fs::DirBuilder::new().mode(0o755).create(target)
    } else {
        fs::File::create(target).map(|_| ())
    };
    made.map_err(|e| IsolationError::io("create mount point", target, e))
}

/// Join `path` (absolute, inside the box) onto `root`, resolving symlinks as if
/// `root` were `/`, so no component can lead outside the box root.
pub fn secure_join(root: &Path, path: &Path) -> Result<PathBuf> {
    let mut resolved = PathBuf::new();
    let mut pending: Vec<PathBuf> = components_rev(path);
    let mut links = 0;
    while let Some(part) = pending.pop() {
        if part.as_os_str() == ".." {
            resolved.pop();
            continue;
        }
        let candidate = resolved.join(&part);
        let host = root.join(&candidate);
        match fs::symlink_metadata(&host) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > 40 {
                    return Err(IsolationError::at(
                        "resolve (too many symlinks)",
                        host,
                        nix::errno::Errno::ELOOP,
                    ));
                }
                let target =
                    fs::read_link(&host).map_err(|e| IsolationError::io("readlink", &host, e))?;
                if target.is_absolute() {
                    resolved = PathBuf::new();
                }
                pending.extend(components_rev(&target));
            }
            _ => resolved = candidate,
        }
    }
    Ok(root.join(resolved))
}

/// Normal and parent components of `p`, reversed so they can be popped in order.
fn components_rev(p: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = p
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(PathBuf::from(n)),
            Component::ParentDir => Some(PathBuf::from("..")),
            _ => None,
        })
        .collect();
    v.reverse();
    v
}

/// Owner (uid, gid) of `path`, for checks and tests.
pub fn owner(path: &Path) -> Result<(u32, u32)> {
    let m = fs::metadata(path).map_err(|e| IsolationError::io("stat", path, e))?;
    Ok((m.uid(), m.gid()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn secure_join_stays_inside_root() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        fs::create_dir_all(r.join("usr/bin")).unwrap();
        symlink("usr/bin", r.join("bin")).unwrap();
        symlink("/etc/passwd", r.join("usr/abs")).unwrap();
        symlink("../../../../..", r.join("usr/up")).unwrap();
        assert_eq!(
            secure_join(r, Path::new("/bin/x")).unwrap(),
            r.join("usr/bin/x")
        );
        assert_eq!(
            secure_join(r, Path::new("/usr/abs")).unwrap(),
            r.join("etc/passwd")
        );
        assert_eq!(
            secure_join(r, Path::new("/usr/up/etc")).unwrap(),
            r.join("etc")
        );
        assert_eq!(secure_join(r, Path::new("/../../x")).unwrap(), r.join("x"));
    }

    #[test]
    fn secure_join_detects_symlink_loops() {
        let root = tempfile::tempdir().unwrap();
        symlink("b", root.path().join("a")).unwrap();
        symlink("a", root.path().join("b")).unwrap();
        assert!(secure_join(root.path(), Path::new("/a/x")).is_err());
    }
}
