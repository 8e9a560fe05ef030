//! Detection of the cgroup hierarchies of the running system.
//!
//! Every controller is looked up where it really is, at run time:
//!
//! * cgroup v1 hierarchies come from `/proc/self/mountinfo` lines with
//!   filesystem type `cgroup`; the super options name the controllers bound
//!   to the hierarchy (possibly several, e.g. `cpu,cpuacct`). Named
//!   hierarchies without controllers (`name=systemd`) are ignored.
//! * the cgroup v2 hierarchy is the `cgroup2` mount; its controllers are the
//!   ones listed in the root's `cgroup.controllers`.
//!
//! The invoking process's cgroup in each hierarchy comes from
//! `/proc/self/cgroup` and is made relative to the mount's root (the 4th
//! mountinfo field), so hierarchies mounted at a sub-path (as inside
//! containers) work. A pure v1, a pure v2 and a hybrid system all produce a
//! [`Hierarchies`] value; which hierarchy serves which controller is decided
//! per controller.

use std::collections::BTreeSet;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::CgroupError;
use crate::fsutil::join_rel;

/// A cgroup hierarchy version.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Version {
    /// Legacy cgroup v1: one hierarchy per (group of) controller(s).
    V1,
    /// Unified cgroup v2: one hierarchy for all controllers.
    V2,
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        })
    }
}

/// One mounted cgroup hierarchy and the invoking process's place in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchy {
    version: Version,
    mount_point: PathBuf,
    mount_root: String,
    controllers: Vec<String>,
    cgroup_path: String,
    invoking_dir: PathBuf,
}

impl Hierarchy {
    /// v1 or v2.
    pub fn version(&self) -> Version {
        self.version
    }

    /// Where the hierarchy is mounted (re-rooted under the `fs_prefix` given
    /// to [`Hierarchies::from_proc_text`]).
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// The cgroup that is mounted at [`Self::mount_point`] (mountinfo field 4,
    /// usually `/`).
    pub fn mount_root(&self) -> &str {
        &self.mount_root
    }

    /// The controllers bound to the hierarchy: the v1 super options, or the
    /// v2 root's `cgroup.controllers`.
    pub fn controllers(&self) -> &[String] {
        &self.controllers
    }

    /// True when `controller` is bound to this hierarchy.
    pub fn carries(&self, controller: &str) -> bool {
        self.controllers.iter().any(|c| c == controller)
    }

    /// The invoking process's cgroup as written in `/proc/self/cgroup`.
    pub fn cgroup_path(&self) -> &str {
        &self.cgroup_path
    }

    /// The directory of the invoking process's cgroup: the parent of every
    /// box cgroup created in this hierarchy.
    pub fn invoking_dir(&self) -> &Path {
        &self.invoking_dir
    }
}

/// All cgroup hierarchies usable by this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hierarchies {
    list: Vec<Hierarchy>,
}

/// One parsed `/proc/self/mountinfo` line of a cgroup filesystem.
struct CgroupMount {
    root: String,
    mount_point: String,
    fstype: String,
    super_opts: Vec<String>,
}

/// One parsed `/proc/self/cgroup` line.
struct ProcCgroup {
    id: String,
    controllers: BTreeSet<String>,
    path: String,
}

/// The ids of the mounts of `/proc/self/mountinfo` text that no path
/// reaches: each mount a later one covers. A mount N whose parent is P hides
/// every mount D made before it (the kernel lists mounts in the order they
/// were made) that is P or below P, is mounted at N's mount point or below
/// it, and is not in N's own sub-tree. A box that binds the host's `/sys`
/// with its cgroup mounts and mounts its own over `/sys/fs/cgroup` lists
/// both sets; only its own are reachable.
fn hidden_mounts(text: &str) -> BTreeSet<u64> {
    struct M {
        id: u64,
        parent: u64,
        point: String,
    }
    let mounts: Vec<M> = text
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let id = f.next()?.parse().ok()?;
            let parent = f.next()?.parse().ok()?;
            let point = nestbox_sys::mount::unescape_mountinfo(f.nth(2)?);
            Some(M { id, parent, point })
        })
        .collect();
    let parent_of = |id: u64| mounts.iter().find(|m| m.id == id).map(|m| m.parent);
    // Whether `id` is `top` or below it (a bounded walk: a parent loop, or
    // the namespace's root whose parent is outside, ends it).
    let within = |mut id: u64, top: u64| {
        for _ in 0..mounts.len() + 1 {
            if id == top {
                return true;
            }
            match parent_of(id) {
                Some(p) if p != id => id = p,
                _ => return false,
            }
        }
        false
    };
    let at_or_below = |point: &str, top: &str| {
        let top = top.trim_end_matches('/');
        point == top
            || top.is_empty()
            || point.strip_prefix(top).is_some_and(|r| r.starts_with('/'))
    };
    let mut hidden = BTreeSet::new();
    for (i, n) in mounts.iter().enumerate() {
        for d in &mounts[..i] {
            if at_or_below(&d.point, &n.point) && within(d.id, n.parent) && !within(d.id, n.id) {
                hidden.insert(d.id);
            }
        }
    }
    hidden
}

fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let hidden = hidden_mounts(text);
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if sep < 6 || fields.len() < sep + 4 {
            continue;
        }
        let fstype = fields[sep + 1];
        if fstype != "cgroup" && fstype != "cgroup2" {
            continue;
        }
        if fields[0].parse().is_ok_and(|id: u64| hidden.contains(&id)) {
            continue;
        }
        out.push(CgroupMount {
            root: nestbox_sys::mount::unescape_mountinfo(fields[3]),
            mount_point: nestbox_sys::mount::unescape_mountinfo(fields[4]),
            fstype: fstype.to_string(),
            super_opts: fields[sep + 3].split(',').map(str::to_string).collect(),
        });
    }
    out
}

fn parse_proc_cgroup(text: &str) -> Vec<ProcCgroup> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let path = path.strip_suffix(" (deleted)").unwrap_or(path);
        out.push(ProcCgroup {
            id: id.to_string(),
            controllers: ctrls
                .split(',')
                .filter(|c| !c.is_empty() && !c.contains('='))
                .map(str::to_string)
                .collect(),
            path: path.to_string(),
        });
    }
    out
}

/// `cgroup_path` relative to the mounted `root`, or `None` when the process's
/// cgroup is outside the mounted sub-tree.
fn relative_to_root(cgroup_path: &str, root: &str) -> Option<String> {
    let root = root.trim_end_matches('/');
    if root.is_empty() {
        return Some(cgroup_path.to_string());
    }
    if cgroup_path == root {
        return Some("/".to_string());
    }
    cgroup_path
        .strip_prefix(root)
        .filter(|rest| rest.starts_with('/'))
        .map(str::to_string)
}

/// The cgroup v2 path `rel` without a trailing [`crate::V2_LEAF`]: the
/// process runs in a box whose cgroup is delegated to it, and the box's
/// cgroup (the leaf's parent) is where its boxes go.
fn strip_v2_leaf(rel: &str) -> String {
    match rel.strip_suffix(crate::V2_LEAF) {
        Some(parent) if parent.ends_with('/') => {
            let p = parent.trim_end_matches('/');
            if p.is_empty() {
                "/".to_string()
            } else {
                p.to_string()
            }
        }
        _ => rel.to_string(),
    }
}

/// Re-roots an absolute mount point under `prefix`.
fn reroot(prefix: &Path, mount_point: &str) -> PathBuf {
    join_rel(prefix, mount_point)
}

impl Hierarchies {
    /// Detects the hierarchies from `/proc/self/mountinfo` and
    /// `/proc/self/cgroup`.
    pub fn detect() -> Result<Self, CgroupError> {
        let mountinfo = crate::fsutil::read(Path::new("/proc/self/mountinfo"))?;
        let cgroup = crate::fsutil::read(Path::new("/proc/self/cgroup"))?;
        Self::from_proc_text(&mountinfo, &cgroup, Path::new("/"))
    }

    /// Builds the hierarchies from the text of `/proc/self/mountinfo` and
    /// `/proc/self/cgroup`. Every mount point is re-rooted under `fs_prefix`
    /// (`/sys/fs/cgroup/memory` becomes `<fs_prefix>/sys/fs/cgroup/memory`),
    /// so a temp dir can stand in for the real filesystem; pass `/` for the
    /// real system. The v2 root's `cgroup.controllers` is read from there
    /// (missing means no controllers).
    pub fn from_proc_text(
        mountinfo: &str,
        proc_self_cgroup: &str,
        fs_prefix: &Path,
    ) -> Result<Self, CgroupError> {
        let mounts = parse_mountinfo(mountinfo);
        let lines = parse_proc_cgroup(proc_self_cgroup);
        // Every v1 controller the kernel has shows up in some v1 line of
        // /proc/self/cgroup; super options outside that set (rw, xattr,
        // seclabel, ...) are not controllers.
        let known: BTreeSet<&str> = lines
            .iter()
            .filter(|l| l.id != "0")
            .flat_map(|l| l.controllers.iter().map(String::as_str))
            .collect();

        let mut list: Vec<Hierarchy> = Vec::new();
        // (hierarchy key, problem): v1 keyed by controller set, v2 by None.
        let mut problems: Vec<(Option<BTreeSet<String>>, String)> = Vec::new();
        let mut done_v1: Vec<BTreeSet<String>> = Vec::new();
        let mut done_v2 = false;
        for m in &mounts {
            if m.fstype == "cgroup" {
                let controllers: Vec<String> = m
                    .super_opts
                    .iter()
                    .filter(|o| known.contains(o.as_str()))
                    .cloned()
                    .collect();
                let set: BTreeSet<String> = controllers.iter().cloned().collect();
                if set.is_empty() || done_v1.contains(&set) {
                    continue;
                }
                let Some(line) = lines.iter().find(|l| l.id != "0" && l.controllers == set) else {
                    problems.push((
                        Some(set),
                        format!(
                            "no /proc/self/cgroup line for the v1 hierarchy {} at {}",
                            controllers.join(","),
                            m.mount_point
                        ),
                    ));
                    continue;
                };
                let Some(rel) = relative_to_root(&line.path, &m.root) else {
                    problems.push((
                        Some(set),
                        format!(
                            "cgroup {} of the {} hierarchy is outside the sub-tree {} mounted at {}",
                            line.path,
                            controllers.join(","),
                            m.root,
                            m.mount_point
                        ),
                    ));
                    continue;
                };
                let mount_point = reroot(fs_prefix, &m.mount_point);
                done_v1.push(set);
                list.push(Hierarchy {
                    version: Version::V1,
                    invoking_dir: join_rel(&mount_point, &rel),
                    mount_point,
                    mount_root: m.root.clone(),
                    controllers,
                    cgroup_path: line.path.clone(),
                });
            } else if !done_v2 {
                let Some(line) = lines
                    .iter()
                    .find(|l| l.id == "0" && l.controllers.is_empty())
                else {
                    problems.push((
                        None,
                        format!(
                            "no 0:: line in /proc/self/cgroup for the cgroup2 mount at {}",
                            m.mount_point
                        ),
                    ));
                    continue;
                };
                let Some(rel) = relative_to_root(&line.path, &m.root) else {
                    problems.push((
                        None,
                        format!(
                            "cgroup {} is outside the cgroup2 sub-tree {} mounted at {}",
                            line.path, m.root, m.mount_point
                        ),
                    ));
                    continue;
                };
                // A delegated box's processes sit in its v2 leaf: the boxes it
                // starts go beside it, under the box's own cgroup.
                let rel = strip_v2_leaf(&rel);
                let mount_point = reroot(fs_prefix, &m.mount_point);
                let controllers = fs::read_to_string(mount_point.join("cgroup.controllers"))
                    .map(|s| s.split_whitespace().map(str::to_string).collect())
                    .unwrap_or_default();
                done_v2 = true;
                list.push(Hierarchy {
                    version: Version::V2,
                    invoking_dir: join_rel(&mount_point, &rel),
                    mount_point,
                    mount_root: m.root.clone(),
                    controllers,
                    cgroup_path: line.path.clone(),
                });
            }
        }
        // A hierarchy mounted twice may fail once and succeed once: only
        // complain about hierarchies that ended up missing.
        let missing = problems.iter().find(|(key, _)| match key {
            Some(set) => !done_v1.contains(set),
            None => !done_v2,
        });
        if let Some((_, reason)) = missing {
            return Err(CgroupError::Detect {
                reason: reason.clone(),
            });
        }
        if list.is_empty() {
            return Err(CgroupError::Detect {
                reason: "no cgroup or cgroup2 filesystem with controllers is mounted".into(),
            });
        }
        Ok(Hierarchies { list })
    }

    /// All usable hierarchies, in mount order.
    pub fn hierarchies(&self) -> &[Hierarchy] {
        &self.list
    }

    /// The v1 hierarchies.
    pub fn v1(&self) -> impl Iterator<Item = &Hierarchy> + '_ {
        self.list.iter().filter(|h| h.version == Version::V1)
    }

    /// The v2 hierarchy, if cgroup2 is mounted.
    pub fn v2(&self) -> Option<&Hierarchy> {
        self.list.iter().find(|h| h.version == Version::V2)
    }

    /// The hierarchy `controller` (v1 name, or `io` for v2) is bound to: a v1
    /// hierarchy carrying it, else the v2 hierarchy when it lists it.
    pub fn find(&self, controller: &str) -> Option<&Hierarchy> {
        self.v1()
            .find(|h| h.carries(controller))
            .or_else(|| self.v2().filter(|h| h.carries(controller)))
    }

    /// True when both v1 controller hierarchies and a v2 hierarchy exist.
    pub fn is_hybrid(&self) -> bool {
        self.v1().next().is_some() && self.v2().is_some()
    }

    /// A one-line description, e.g.
    /// `hybrid: v1 cpu,cpuacct,memory + v2 hugetlb`, `v1: cpu,cpuacct,memory`
    /// or `v2: cpuset,cpu,io,memory,pids`.
    pub fn summary(&self) -> String {
        let v1: Vec<&str> = self
            .v1()
            .flat_map(|h| h.controllers.iter().map(String::as_str))
            .collect();
        let v2 = self.v2().map(|h| {
            if h.controllers.is_empty() {
                "(no controllers)".to_string()
            } else {
                h.controllers.join(",")
            }
        });
        match (v1.is_empty(), v2) {
            (false, Some(v2)) => format!("hybrid: v1 {} + v2 {v2}", v1.join(",")),
            (false, None) => format!("v1: {}", v1.join(",")),
            (true, Some(v2)) => format!("v2: {v2}"),
            (true, None) => "none".to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testfs;

    #[test]
    fn this_machine_hybrid() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path();
        testfs::file(p, "sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n");
        let h = Hierarchies::from_proc_text(testfs::HYBRID_MOUNTINFO, testfs::HYBRID_CGROUP, p)
            .unwrap();
        assert_eq!(
            h.summary(),
            "hybrid: v1 cpu,cpuacct,cpuset,memory,devices,freezer,blkio,pids + v2 hugetlb"
        );
        assert!(h.is_hybrid());
        let mem = h.find("memory").unwrap();
        assert_eq!(mem.version(), Version::V1);
        assert_eq!(
            mem.invoking_dir(),
            p.join("sys/fs/cgroup/memory/process_api/8a4fc6f47409c39973b09d59b9138c45")
        );
        assert_eq!(
            mem.cgroup_path(),
            "/process_api/8a4fc6f47409c39973b09d59b9138c45"
        );
        let cpu = h.find("cpu").unwrap();
        assert_eq!(cpu.controllers(), ["cpu"]);
        assert_eq!(cpu.invoking_dir(), p.join("sys/fs/cgroup/cpu"));
        assert_ne!(h.find("cpuacct").unwrap().mount_point(), cpu.mount_point());
        // name=systemd is not a controller hierarchy.
        assert!(h
            .hierarchies()
            .iter()
            .all(|h| !h.mount_point().ends_with("systemd")));
        let v2 = h.v2().unwrap();
        assert_eq!(v2.controllers(), ["hugetlb"]);
        assert_eq!(v2.invoking_dir(), p.join("sys/fs/cgroup/unified"));
        assert!(h.find("io").is_none());
        assert_eq!(h.find("hugetlb").unwrap().version(), Version::V2);
    }

    /// A nest box sharing the host's network: the host's `/sys` bound with
    /// its cgroup mounts (whose roots are above the box's cgroup namespace),
    /// the box's own tmpfs and cgroup mounts over `/sys/fs/cgroup`.
    const OVER_MOUNTED: &str = "\
595 500 0:60 / / rw - overlay overlay rw
608 595 0:22 / /sys ro,relatime - sysfs sysfs rw
609 608 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
610 609 0:29 /.. /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
613 609 0:32 /../../.. /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
614 609 0:33 /.. /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
619 609 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
620 608 0:13 / /sys/kernel/tracing rw,relatime - tracefs none rw
632 609 0:218 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs rw,size=64k
633 632 0:29 / /sys/fs/cgroup/cpu rw,nosuid - cgroup cgroup rw,cpu
636 632 0:32 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory
";

    #[test]
    fn mounts_covered_by_a_later_mount_are_not_used() {
        let cgroup = "5:devices:/\n4:memory:/\n1:cpu:/\n0::/\n";
        let hidden = hidden_mounts(OVER_MOUNTED);
        assert_eq!(
            hidden.into_iter().collect::<Vec<_>>(),
            [609, 610, 613, 614, 619],
            "the first tmpfs and what was on it; /sys and tracefs stay"
        );
        let tmp = tempfile::tempdir().unwrap();
        let h = Hierarchies::from_proc_text(OVER_MOUNTED, cgroup, tmp.path()).unwrap();
        assert_eq!(h.summary(), "v1: cpu,memory");
        assert!(h.find("devices").is_none());
        assert_eq!(
            h.find("memory").unwrap().invoking_dir(),
            tmp.path().join("sys/fs/cgroup/memory")
        );
    }

    #[test]
    fn pure_v2() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path();
        testfs::file(
            p,
            "sys/fs/cgroup/cgroup.controllers",
            "cpuset cpu io memory hugetlb pids rdma misc\n",
        );
        let h = Hierarchies::from_proc_text(testfs::V2_MOUNTINFO, testfs::V2_CGROUP, p).unwrap();
        assert_eq!(
            h.summary(),
            "v2: cpuset,cpu,io,memory,hugetlb,pids,rdma,misc"
        );
        assert!(!h.is_hybrid());
        assert_eq!(h.hierarchies().len(), 1);
        let v2 = h.v2().unwrap();
        assert_eq!(
            v2.invoking_dir(),
            p.join("sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope")
        );
        assert_eq!(h.find("memory").unwrap().version(), Version::V2);
    }

    #[test]
    fn pure_v1_comounted_and_subpath_root() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path();
        let h = Hierarchies::from_proc_text(testfs::V1_MOUNTINFO, testfs::V1_CGROUP, p).unwrap();
        assert_eq!(
            h.summary(),
            "v1: cpu,cpuacct,cpuset,memory,devices,freezer,blkio,pids,net_cls,net_prio"
        );
        assert!(h.v2().is_none());
        let cpu = h.find("cpu").unwrap();
        assert!(std::ptr::eq(cpu, h.find("cpuacct").unwrap()));
        assert_eq!(cpu.controllers(), ["cpu", "cpuacct"]);
        assert_eq!(
            cpu.invoking_dir(),
            p.join("sys/fs/cgroup/cpu,cpuacct/docker/abc")
        );
        // memory is mounted with root /docker/abc: the process's cgroup is
        // the mount point itself.
        let mem = h.find("memory").unwrap();
        assert_eq!(mem.mount_root(), "/docker/abc");
        assert_eq!(mem.invoking_dir(), p.join("sys/fs/cgroup/memory"));
        // seclabel is a super option but not a controller.
        assert_eq!(h.find("pids").unwrap().controllers(), ["pids"]);
    }

    #[test]
    fn outside_subtree_is_an_error() {
        let mi = "32 31 0:29 /other /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
        let err =
            Hierarchies::from_proc_text(mi, "4:memory:/docker/abc\n", Path::new("/x")).unwrap_err();
        assert!(
            err.to_string().contains("outside the sub-tree /other"),
            "{err}"
        );
    }

    #[test]
    fn nothing_mounted() {
        let err = Hierarchies::from_proc_text("", "0::/\n", Path::new("/")).unwrap_err();
        assert!(matches!(err, CgroupError::Detect { .. }));
    }

    #[test]
    fn detect_real_machine() {
        // Works everywhere cgroups are mounted (every CI machine).
        match Hierarchies::detect() {
            Ok(h) => eprintln!("detected {}", h.summary()),
            Err(e) => nestbox_testkit::skip("detect_real_machine", &e.to_string()),
        }
    }
}
