//! The `mounts` of config.json: options parsed into mount flags, propagation
//! and filesystem data, and each mount made under the container's root (in its
//! own mount namespace, before the pivot), its target resolved so that no
//! symlink in the root filesystem can lead it outside.

use std::fs;
use std::path::{Path, PathBuf};

use nestbox_isolation::mounts;
use nestbox_isolation::rootfs::{make_mountpoint, secure_join};
use nestbox_sys::mount::MsFlags;

use crate::{OciError, Result};

/// One mount, translated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// Absolute path in the container.
    pub destination: PathBuf,
    /// Filesystem type ("bind" or empty for a bind mount).
    pub fstype: String,
    /// Source (a host path for a bind mount).
    pub source: String,
    /// Mount flags (without propagation).
    pub flags: MsFlags,
    /// Propagation flags, applied after the mount.
    pub propagation: Vec<MsFlags>,
    /// Filesystem-specific options.
    pub data: String,
}

/// Propagation option name to its flags.
pub fn propagation_flag(name: &str) -> Option<MsFlags> {
    Some(match name {
        "private" => MsFlags::MS_PRIVATE,
        "rprivate" => MsFlags::MS_PRIVATE | MsFlags::MS_REC,
        "shared" => MsFlags::MS_SHARED,
        "rshared" => MsFlags::MS_SHARED | MsFlags::MS_REC,
        "slave" => MsFlags::MS_SLAVE,
        "rslave" => MsFlags::MS_SLAVE | MsFlags::MS_REC,
        "unbindable" => MsFlags::MS_UNBINDABLE,
        "runbindable" => MsFlags::MS_UNBINDABLE | MsFlags::MS_REC,
        _ => return None,
    })
}

/// A flag option: (name, set, flag).
const FLAG_OPTIONS: &[(&str, bool, MsFlags)] = &[
    ("ro", true, MsFlags::MS_RDONLY),
    ("rw", false, MsFlags::MS_RDONLY),
    ("nosuid", true, MsFlags::MS_NOSUID),
    ("suid", false, MsFlags::MS_NOSUID),
    ("nodev", true, MsFlags::MS_NODEV),
    ("dev", false, MsFlags::MS_NODEV),
    ("noexec", true, MsFlags::MS_NOEXEC),
    ("exec", false, MsFlags::MS_NOEXEC),
    ("sync", true, MsFlags::MS_SYNCHRONOUS),
    ("async", false, MsFlags::MS_SYNCHRONOUS),
    ("dirsync", true, MsFlags::MS_DIRSYNC),
    ("remount", true, MsFlags::MS_REMOUNT),
    ("mand", true, MsFlags::MS_MANDLOCK),
    ("nomand", false, MsFlags::MS_MANDLOCK),
    ("noatime", true, MsFlags::MS_NOATIME),
    ("atime", false, MsFlags::MS_NOATIME),
    ("nodiratime", true, MsFlags::MS_NODIRATIME),
    ("diratime", false, MsFlags::MS_NODIRATIME),
    ("relatime", true, MsFlags::MS_RELATIME),
    ("norelatime", false, MsFlags::MS_RELATIME),
    ("strictatime", true, MsFlags::MS_STRICTATIME),
    ("nostrictatime", false, MsFlags::MS_STRICTATIME),
    ("lazytime", true, MsFlags::MS_LAZYTIME),
    ("nolazytime", false, MsFlags::MS_LAZYTIME),
    ("silent", true, MsFlags::MS_SILENT),
    ("loud", false, MsFlags::MS_SILENT),
    ("bind", true, MsFlags::MS_BIND),
    ("rbind", true, MsFlags::MS_BIND.union(MsFlags::MS_REC)),
];

/// Options that name a feature nestbox does not have.
const REFUSED_OPTIONS: &[&str] = &["idmap", "ridmap", "tmpcopyup"];

impl MountEntry {
    /// Translate one `mounts[]` entry.
    pub fn from_spec(m: &oci_spec::runtime::Mount) -> Result<MountEntry> {
        let destination = m.destination().clone();
        if !destination.is_absolute() {
            return Err(OciError::Unsupported(format!(
                "mounts: destination {} is not absolute",
                destination.display()
            )));
        }
        let mut flags = MsFlags::empty();
        let mut propagation = Vec::new();
        let mut data = Vec::new();
        for opt in m.options().iter().flatten() {
            if let Some(&(_, set, flag)) = FLAG_OPTIONS.iter().find(|(n, _, _)| n == opt) {
                if set {
                    flags |= flag;
                } else {
                    flags &= !flag;
                }
            } else if let Some(p) = propagation_flag(opt) {
                propagation.push(p);
            } else if REFUSED_OPTIONS.contains(&opt.as_str()) {
                return Err(OciError::Unsupported(format!(
                    "mounts: {}: option {opt:?} is not supported",
                    destination.display()
                )));
            } else {
                data.push(opt.clone());
            }
        }
        let fstype = m.typ().clone().unwrap_or_default();
        if fstype == "bind" {
            flags |= MsFlags::MS_BIND;
        }
        let source = m
            .source()
            .as_ref()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| fstype.clone());
        if flags.contains(MsFlags::MS_BIND) && !Path::new(&source).exists() {
            return Err(OciError::Unsupported(format!(
                "mounts: {}: bind source {source} does not exist",
                destination.display()
            )));
        }
        Ok(MountEntry {
            destination,
            fstype,
            source,
            flags,
            propagation,
            data: data.join(","),
        })
    }

    fn is_bind(&self) -> bool {
        self.flags.contains(MsFlags::MS_BIND)
    }

    /// Make this mount under `root` (the container's root, seen from the
    /// runtime side of the container's mount namespace).
    pub fn mount(&self, root: &Path) -> Result<()> {
        let target = secure_join(root, &self.destination)?;
        let source_is_dir = !self.is_bind() || Path::new(&self.source).is_dir();
        make_mountpoint(&target, source_is_dir)?;
        let fail = |e: nix::errno::Errno| {
            OciError::sys(
                format!(
                    "mount {} ({}) on {}",
                    self.source,
                    self.fstype,
                    self.destination.display()
                ),
                e,
            )
        };
        if self.is_bind() {
            let recursive = self.flags.contains(MsFlags::MS_REC);
            nestbox_sys::mount::bind(Path::new(&self.source), &target, recursive).map_err(fail)?;
            let extra = self.flags - (MsFlags::MS_BIND | MsFlags::MS_REC | MsFlags::MS_REMOUNT);
            if !extra.is_empty() {
                nestbox_sys::mount::remount_bind(&target, extra).map_err(fail)?;
            }
        } else if self.fstype == "cgroup" || self.fstype == "cgroup2" {
            mount_cgroups(&target, self.flags)?;
        } else {
            let data = (!self.data.is_empty()).then_some(self.data.as_str());
            let r =
                nestbox_sys::mount::mount_fs(&self.source, &target, &self.fstype, self.flags, data);
            match r {
                // A sysfs in a network namespace the user namespace does not own
                // is refused: bind the host's instead, read-only (as runc does).
                Err(nix::errno::Errno::EPERM) if self.fstype == "sysfs" => {
                    mounts::bind(Path::new("/sys"), &target, true)?;
                    mounts::restrict_tree(&target, MsFlags::MS_RDONLY)?;
                }
                // mqueue likewise when the IPC namespace is not owned.
                Err(nix::errno::Errno::EPERM) if self.fstype == "mqueue" => {
                    mounts::bind(Path::new("/dev/mqueue"), &target, false)?;
                }
                other => other.map_err(fail)?,
            }
        }
        for p in &self.propagation {
            nestbox_sys::mount::set_propagation(&target, *p).map_err(fail)?;
        }
        Ok(())
    }
}

/// A `cgroup` mount: a tmpfs holding each cgroup hierarchy the runtime sees
/// under `/sys/fs/cgroup`, mounted anew so that, in a cgroup namespace, the
/// container's own cgroup is the root it shows.
fn mount_cgroups(target: &Path, flags: MsFlags) -> Result<()> {
    let base = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let fail = |what: String, e| OciError::sys(what, e);
    let info = "/proc/self/mountinfo";
    let text = fs::read_to_string(info).map_err(|e| OciError::io("read", info, e))?;
    let hierarchies = cgroup_mounts(&text);
    nestbox_sys::mount::mount_fs("tmpfs", target, "tmpfs", base, Some("mode=755"))
        .map_err(|e| fail(format!("mount tmpfs on {}", target.display()), e))?;
    for (name, fstype, data) in hierarchies {
        let dir = target.join(&name);
        make_mountpoint(&dir, true)?;
        let data = (!data.is_empty()).then_some(data.as_str());
        let ro = flags & MsFlags::MS_RDONLY;
        nestbox_sys::mount::mount_fs("cgroup", &dir, &fstype, base | ro, data)
            .map_err(|e| fail(format!("mount {fstype} on {}", dir.display()), e))?;
    }
    if flags.contains(MsFlags::MS_RDONLY) {
        nestbox_sys::mount::remount_bind(target, base | MsFlags::MS_RDONLY)
            .map_err(|e| fail(format!("remount {} read-only", target.display()), e))?;
    }
    Ok(())
}

/// The cgroup hierarchies mounted directly under `/sys/fs/cgroup` in a
/// mountinfo text: (directory name, fstype, mount data naming the controllers).
fn cgroup_mounts(mountinfo: &str) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let point = left.split_whitespace().nth(4).unwrap_or("");
        let mut r = right.split_whitespace();
        let (fstype, _source, opts) = (
            r.next().unwrap_or(""),
            r.next().unwrap_or(""),
            r.next().unwrap_or(""),
        );
        let Some(name) = point.strip_prefix("/sys/fs/cgroup/") else {
            continue;
        };
        if name.contains('/') || !matches!(fstype, "cgroup" | "cgroup2") {
            continue;
        }
        let data = if fstype == "cgroup" {
            opts.split(',')
                .filter(|o| !matches!(*o, "rw" | "ro"))
                .collect::<Vec<_>>()
                .join(",")
        } else {
            String::new()
        };
        out.push((name.to_string(), fstype.to_string(), data));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(json: &str) -> Result<MountEntry> {
        let m: oci_spec::runtime::Mount = serde_json::from_str(json).unwrap();
        MountEntry::from_spec(&m)
    }

    #[test]
    fn options_become_flags_propagation_and_data() {
        let e = entry(
            r#"{"destination":"/dev","type":"tmpfs","source":"tmpfs",
               "options":["nosuid","strictatime","mode=755","size=65536k","rslave"]}"#,
        )
        .unwrap();
        assert_eq!(e.flags, MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME);
        assert_eq!(e.data, "mode=755,size=65536k");
        assert_eq!(e.propagation, vec![MsFlags::MS_SLAVE | MsFlags::MS_REC]);
    }

    #[test]
    fn later_options_override_earlier_ones() {
        let e = entry(r#"{"destination":"/x","type":"tmpfs","options":["ro","rw"]}"#).unwrap();
        assert!(!e.flags.contains(MsFlags::MS_RDONLY));
    }

    #[test]
    fn cgroup_hierarchies_are_read_from_mountinfo() {
        let text = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                    40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,name=systemd\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n\
                    42 23 0:39 / /proc rw - proc proc rw\n";
        assert_eq!(
            cgroup_mounts(text),
            vec![
                ("cpu".into(), "cgroup".into(), "cpu".into()),
                ("systemd".into(), "cgroup".into(), "name=systemd".into()),
                ("unified".into(), "cgroup2".into(), String::new()),
            ]
        );
    }

    #[test]
    fn bad_mounts_are_refused() {
        assert!(entry(r#"{"destination":"x","type":"tmpfs"}"#).is_err());
        assert!(entry(r#"{"destination":"/x","type":"bind","source":"/no/such/dir"}"#).is_err());
        assert!(entry(r#"{"destination":"/x","type":"tmpfs","options":["idmap"]}"#).is_err());
    }
}
