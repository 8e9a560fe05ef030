//! Mount primitives with errors that name the mount and its target. The calls
//! themselves are made by [`nestbox_sys::mount`]; this module adds the context.

use std::path::Path;

use nestbox_sys::mount::{self as sys, MsFlags};

use crate::{IsolationError, Result};

/// Mount a filesystem of `fstype` from `source` at `target`.
pub fn mount_fs(
    source: &str,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<()> {
    sys::mount_fs(source, target, fstype, flags, data)
        .map_err(|e| IsolationError::at(format!("mount {fstype}"), target, e))
}

/// Bind-mount `source` on `target` (recursively when `recursive`).
pub fn bind(source: &Path, target: &Path, recursive: bool) -> Result<()> {
    sys::bind(source, target, recursive)
        .map_err(|e| IsolationError::at(format!("bind {}", source.display()), target, e))
}

/// Make the mount at `target` read-only, keeping its other flags (nosuid, nodev…).
pub fn remount_read_only(target: &Path) -> Result<()> {
    let current = statvfs_flags(target)?;
    sys::remount_read_only(target, current)
        .map_err(|e| IsolationError::at("remount read-only", target, e))
}

/// Make the mount at `target` writable, keeping its other flags (nosuid, nodev…).
pub fn remount_writable(target: &Path) -> Result<()> {
    let current = statvfs_flags(target)?;
    sys::remount_bind(target, current - MsFlags::MS_RDONLY)
        .map_err(|e| IsolationError::at("remount writable", target, e))
}

/// Add `extra` (e.g. nosuid, nodev, read-only) to the mount at `target` and to
/// every mount below it, keeping each one's other flags. A recursive bind brings
/// the source's submounts along with their own flags, and a bind remount
/// changes one mount only, so each is remounted in turn (parents first).
pub fn restrict_tree(target: &Path, extra: MsFlags) -> Result<()> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| IsolationError::io("read", Path::new("/proc/self/mountinfo"), e))?;
    for mount_point in mounts_at_or_below(&info, target) {
        let current = statvfs_flags(&mount_point)?;
        sys::remount_bind(&mount_point, current | extra)
            .map_err(|e| IsolationError::at("restrict mount", &mount_point, e))?;
    }
    Ok(())
}

/// Mount points in `mountinfo` equal to `target` or below it, in mount order.
fn mounts_at_or_below(mountinfo: &str, target: &Path) -> Vec<std::path::PathBuf> {
    let mut seen = Vec::new();
    for line in mountinfo.lines() {
        let Some(field) = line.split(' ').nth(4) else {
            continue;
        };
        let path = std::path::PathBuf::from(sys::unescape_mountinfo(field));
        if path.starts_with(target) && !seen.contains(&path) {
            seen.push(path);
        }
    }
    seen
}

/// The mount flags that must be preserved on a bind remount (locked in a user namespace).
fn statvfs_flags(target: &Path) -> Result<MsFlags> {
    use nix::sys::statvfs::{statvfs, FsFlags};
    let st = statvfs(target).map_err(|e| IsolationError::at("statvfs", target, e))?;
    let f = st.flags();
    let mut out = MsFlags::empty();
    for (fs, ms) in [
        (FsFlags::ST_NOSUID, MsFlags::MS_NOSUID),
        (FsFlags::ST_NODEV, MsFlags::MS_NODEV),
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if f.contains(fs) {
            out |= ms;
        }
    }
    Ok(out)
}

/// Stop mount events from propagating between the box and the host.
pub fn make_private_recursive(path: &Path) -> Result<()> {
    sys::make_private_recursive(path).map_err(|e| IsolationError::at("make mount private", path, e))
}

/// Lazily detach the mount at `target`.
pub fn detach(target: &Path) -> Result<()> {
    sys::detach(target).map_err(|e| IsolationError::at("umount", target, e))
}

/// Overlay mount options for `lowers` (topmost first) and an optional writable layer.
/// Paths may not contain the option separators `,` and `:`.
pub fn overlay_options(
    lowers: &[&Path],
    upper: Option<(&Path, &Path)>,
    userxattr: bool,
) -> Result<String> {
    let check = |p: &Path| -> Result<String> {
        let s = p.to_str().ok_or_else(|| {
            IsolationError::at("overlay path not UTF-8", p, nix::errno::Errno::EINVAL)
        })?;
        if s.contains([',', ':', '\\']) {
            return Err(IsolationError::at(
                "overlay path contains ',' ':' or '\\'",
                p,
                nix::errno::Errno::EINVAL,
            ));
        }
        Ok(s.to_string())
    };
    let lower: Vec<String> = lowers.iter().map(|p| check(p)).collect::<Result<_>>()?;
    let mut opts = format!("lowerdir={}", lower.join(":"));
    if let Some((up, work)) = upper {
        opts.push_str(&format!(
            ",upperdir={},workdir={}",
            check(up)?,
            check(work)?
        ));
    }
    if userxattr {
        opts.push_str(",userxattr");
    }
    Ok(opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_below_a_target_are_found_unescaped_and_in_order() {
        let info = "1 0 0:1 / / rw - ext4 /dev/vda rw\n\
                    2 1 0:2 / /box/vol rw - ext4 /dev/vda rw\n\
                    3 2 0:3 / /box/vol/a\\040b rw - tmpfs t rw\n\
                    4 1 0:4 / /box/volume2 rw - tmpfs t rw\n\
                    5 2 0:5 / /box/vol rw - tmpfs t rw\n";
        assert_eq!(
            mounts_at_or_below(info, Path::new("/box/vol")),
            [
                std::path::PathBuf::from("/box/vol"),
                std::path::PathBuf::from("/box/vol/a b")
            ]
        );
    }

    #[test]
    fn overlay_options_are_well_formed() {
        let o = overlay_options(
            &[Path::new("/a"), Path::new("/b")],
            Some((Path::new("/u"), Path::new("/w"))),
            false,
        )
        .unwrap();
        assert_eq!(o, "lowerdir=/a:/b,upperdir=/u,workdir=/w");
        let o = overlay_options(&[Path::new("/a")], None, true).unwrap();
        assert_eq!(o, "lowerdir=/a,userxattr");
    }

    #[test]
    fn overlay_rejects_separator_in_path() {
        let e = overlay_options(&[Path::new("/a:b")], None, false).unwrap_err();
        assert!(e.to_string().contains("/a:b"));
    }
}
