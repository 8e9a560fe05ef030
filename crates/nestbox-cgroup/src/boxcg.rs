//! The cgroup(s) of one box: creation with limits, process membership,
//! statistics, freezing, killing and removal — one interface over v1, v2 and
//! hybrid layouts.
//!
//! A box owns one directory `nestbox-<id>` under the invoking process's
//! cgroup in every hierarchy that carries a controller it uses. Which
//! hierarchy serves a controller is decided per controller: a v1 hierarchy
//! carrying it wins, else the v2 hierarchy if it lists it. The v2 directory
//! also provides the "core" features (freezing, CPU usage) when no v1
//! `freezer`/`cpuacct` hierarchy exists.
//!
//! [`BoxCgroup`] only holds `(version, controllers, directory)` triples, so it
//! serialises to JSON and another process can re-open it from saved state.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};

use crate::detect::{Hierarchies, Hierarchy, Version};
use crate::error::{CgroupError, CgroupWarning};
use crate::limits::Limits;
use crate::stats::{self, Stats};
use crate::{fsutil, v1, v2};

/// One rule of a device cgroup: allow or deny `access` (of `r`, `w`, `m`)
/// to devices of type `kind` (`a` all, `b` block, `c` character) with the
/// numbers given (`None`: any).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRule {
    /// Allow (`true`) or deny.
    pub allow: bool,
    /// `a`, `b` or `c`.
    pub kind: char,
    /// Major number (`None`: any).
    pub major: Option<i64>,
    /// Minor number (`None`: any).
    pub minor: Option<i64>,
    /// Some of `r`, `w`, `m`.
    pub access: String,
}

impl DeviceRule {
    /// A rule: allow (or deny) `access` (some of `rwm`) to devices of `kind`
    /// (`a`, `b` or `c`) numbered `major`:`minor` (`None`: any).
    pub fn new(
        allow: bool,
        kind: char,
        major: Option<i64>,
        minor: Option<i64>,
        access: &str,
    ) -> DeviceRule {
        DeviceRule {
            allow,
            kind,
            major,
            minor,
            access: access.into(),
        }
    }

    /// The rule as a v1 `devices.allow`/`devices.deny` line (`c 1:3 rwm`,
    /// `a *:* rwm`).
    pub fn v1_text(&self) -> String {
        let num = |n: Option<i64>| n.map_or("*".to_string(), |v| v.to_string());
        format!(
            "{} {}:{} {}",
            self.kind,
            num(self.major),
            num(self.minor),
            self.access
        )
    }
}

/// Prefix of every box cgroup directory name.
pub const DIR_PREFIX: &str = "nestbox-";
/// How long [`BoxCgroup::freeze`] and [`BoxCgroup::thaw`] wait.
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long [`BoxCgroup::kill_all`] waits for the processes to go.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest accepted box id.
pub const MAX_ID_LEN: usize = 128;

/// v1 controllers a box uses.
const V1_USED: &[&str] = &[
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
];
/// v1 controllers used only when a limit asks for them (the network ones,
/// which cgroup v2 has not; hugetlb, for a box with hugepage limits).
const V1_ON_REQUEST: &[&str] = &["net_cls", "net_prio", "hugetlb"];
/// v1 names of the controllers that v2 can provide.
const V2_BACKED: &[&str] = &["cpu", "cpuset", "blkio", "memory", "pids"];

/// Checks that `id` is usable in `nestbox-<id>`: 1 to [`MAX_ID_LEN`]
/// characters of `a-z`, `0-9` and `-`.
pub fn validate_id(id: &str) -> Result<(), CgroupError> {
    let err = |reason: &str| CgroupError::InvalidId {
        id: id.to_string(),
        reason: reason.to_string(),
    };
    if id.is_empty() {
        return Err(err("must not be empty"));
    }
    if id.len() > MAX_ID_LEN {
        return Err(err("is longer than 128 characters"));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(err("may only contain a-z, 0-9 and '-'"));
    }
    Ok(())
}

/// The directory name of box `id`: `nestbox-<id>`.
pub fn dir_name(id: &str) -> String {
    format!("{DIR_PREFIX}{id}")
}

/// One directory of a box cgroup.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CgroupDir {
    /// The hierarchy version.
    pub version: Version,
    /// The controllers the box uses through this directory (v1 names for
    /// v1; for v2 the controllers enabled for it, e.g. `io`).
    pub controllers: Vec<String>,
    /// The absolute directory.
    pub path: PathBuf,
}

/// The cgroup(s) of one box.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct BoxCgroup {
    id: String,
    dirs: Vec<CgroupDir>,
    #[serde(default)]
    warnings: Vec<CgroupWarning>,
    /// The directories' name when the caller chose the path
    /// ([`BoxCgroup::prepare_at`]); `None`: `nestbox-<id>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
    /// Set when the box's cgroups are delegated to it
    /// ([`BoxCgroup::prepare_delegated`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    delegation: Option<Delegation>,
}

/// What a box whose cgroups are delegated to it (a box that runs boxes of
/// its own) was given: see [`BoxCgroup::prepare_delegated`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Delegation {
    /// The (uid, gid) the directories and their membership files belong to.
    pub owner: (u32, u32),
    /// The hierarchies to mount in the box, with the box's cgroup as their root.
    pub mounts: Vec<BoxMount>,
}

/// One cgroup hierarchy a delegated box mounts at `/sys/fs/cgroup`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct BoxMount {
    /// The directory under `/sys/fs/cgroup`: the hierarchy's own mount
    /// point's name (`memory`, `cpu,cpuacct`, `unified`), or empty for a
    /// cgroup2 hierarchy mounted at `/sys/fs/cgroup` itself (pure v2).
    pub dir: String,
    /// `cgroup` or `cgroup2`.
    pub fstype: String,
    /// The v1 hierarchy's controllers, as mount options (`cpu,cpuacct`).
    pub options: Option<String>,
}

/// The leaf a delegated box's own processes live in on cgroup v2: v2 lets a
/// cgroup enable controllers for its children only while it has no
/// processes of its own, so the box's processes sit in `B/nestbox.init` and
/// the boxes it starts beside them in `B/nestbox-*`. (Its name does not start
/// with `nestbox-`, so `gc` never takes it for a box.)
pub const V2_LEAF: &str = "nestbox.init";

/// The files of a new cgroup directory whose owner decides who may move
/// processes in and make child cgroups (the kernel's delegation rule: the
/// directory, and `cgroup.procs`, `cgroup.threads`, `cgroup.subtree_control`
/// on v2, `tasks` and `cgroup.procs` on v1). Limit files stay root's, so the
/// box cannot raise its own limits.
const DELEGATED_FILES: &[&str] = &[
    "cgroup.procs",
    "cgroup.threads",
    "cgroup.subtree_control",
    "tasks",
];

/// Gives `dir` and its delegation files (those that exist) to `owner`.
fn delegate_dir(dir: &Path, owner: (u32, u32)) -> Result<(), CgroupError> {
    let chown = |p: &Path| {
        std::os::unix::fs::chown(p, Some(owner.0), Some(owner.1))
            .map_err(|e| CgroupError::io(crate::error::Op::Chown, p, e))
    };
    chown(dir)?;
    for f in DELEGATED_FILES {
        let file = dir.join(f);
        if file.exists() {
            chown(&file)?;
        }
    }
    Ok(())
}

/// Where a controller's files of the box are.
enum Loc<'a> {
    V1(&'a Path),
    V2(&'a Path),
}

/// What [`BoxCgroup::create`] will make.
struct Plan<'a> {
    v1: Vec<(&'a Hierarchy, Vec<String>)>,
    /// The v2 hierarchy and the (available) controllers wanted from it.
    v2: Option<(&'a Hierarchy, Vec<&'static str>)>,
    /// v2 controllers needed by a requested limit.
    required_v2: BTreeSet<&'static str>,
    warnings: Vec<CgroupWarning>,
}

/// The name of the directory a hierarchy is mounted on, for the box's own
/// `/sys/fs/cgroup` (empty: the hierarchy is `/sys/fs/cgroup` itself).
fn mount_dir_name(hi: &Hierarchy) -> String {
    let mp = hi.mount_point();
    if mp.ends_with("sys/fs/cgroup") {
        return String::new();
    }
    mp.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The hierarchies and controllers a box's cgroup uses. `every_hierarchy`
/// (a delegated box): the v1 cpuset too, without a CPU list. Inside a user
/// namespace the v1 devices controller is left out: only the host's root
/// may write its rules, and a box stays in its caller's devices cgroup,
/// which allows no more than the caller has.
fn plan_for<'a>(
    h: &'a Hierarchies,
    limits: &Limits,
    every_hierarchy: bool,
) -> Result<Plan<'a>, CgroupError> {
    let requested = limits.requested();
    let skip_devices = fsutil::in_user_namespace();
    // The network controllers (v1 only) only for a box whose limits ask for
    // them: every other box stays in the caller's net_cls/net_prio cgroups.
    let asked = |c: &str| V1_ON_REQUEST.contains(&c) && requested.iter().any(|(_, r)| *r == c);
    let v1: Vec<(&Hierarchy, Vec<String>)> = h
        .v1()
        .filter_map(|hi| {
            let used: Vec<String> = hi
                .controllers()
                .iter()
                .filter(|c| V1_USED.contains(&c.as_str()) || asked(c))
                .filter(|c| !(skip_devices && c.as_str() == "devices"))
                .cloned()
                .collect();
            (!used.is_empty()).then_some((hi, used))
        })
        .collect();
    let v1_has = |c: &str| v1.iter().any(|(_, used)| used.iter().any(|u| u == c));
    let mut warnings = Vec::new();
    let mut required_v2 = BTreeSet::new();
    let mut v2_plan = None;
    match h.v2() {
        Some(v2h) => {
            let available = v2::available(v2h.invoking_dir())?
                .unwrap_or_else(|| v2h.controllers().iter().cloned().collect());
            let mut wanted = Vec::new();
            for &c in V2_BACKED.iter().filter(|c| !v1_has(c)) {
                let name = v2::v2_name(c);
                if available.contains(name) {
                    wanted.push(name);
                } else {
                    warnings.push(CgroupWarning::ControllerUnavailable {
                        controller: name.to_string(),
                    });
                }
            }
            for &(option, c) in &requested {
                if v1_has(c) {
                    continue;
                }
                let name = v2::v2_name(c);
                if !available.contains(name) {
                    return Err(CgroupError::ControllerUnavailable {
                        option,
                        controller: name.to_string(),
                        reason: format!(
                            "no cgroup v1 hierarchy carries it and it is not listed in {}",
                            v2h.invoking_dir().join("cgroup.controllers").display()
                        ),
                    });
                }
                required_v2.insert(name);
                // (hugetlb is wanted only by a box that asks for it.)
                if !wanted.contains(&name) {
                    wanted.push(name);
                }
            }
            let core_needed = !v1_has("freezer") || !v1_has("cpuacct");
            if core_needed || !wanted.is_empty() {
                v2_plan = Some((v2h, wanted));
            }
        }
        None => {
            for c in V2_BACKED.iter().chain(&["freezer"]).filter(|c| !v1_has(c)) {
                warnings.push(CgroupWarning::ControllerUnavailable {
                    controller: c.to_string(),
                });
            }
            if let Some((option, c)) = requested.iter().find(|(_, c)| !v1_has(c)) {
                return Err(CgroupError::ControllerUnavailable {
                    option,
                    controller: c.to_string(),
                    reason: "no cgroup v1 hierarchy carries it and cgroup v2 is not mounted".into(),
                });
            }
        }
    }
    // A v1 cpuset hierarchy of its own adds nothing to a box without a CPU
    // list: it would copy its parent's CPUs and memory nodes, and the box
    // stays in the caller's cpuset without it. (Making, filling and removing
    // it costs every box start about 0.15 ms here.)
    let v1 = v1
        .into_iter()
        .filter(|(_, used)| {
            every_hierarchy || limits.cpuset_cpus.is_some() || used.as_slice() != ["cpuset"]
        })
        .collect();
    Ok(Plan {
        v1,
        v2: v2_plan,
        required_v2,
        warnings,
    })
}

/// The file of cgroup `dir` a single-threaded process writes `0` to in order
/// to move itself there: v1 `tasks` (the cheap path, see
/// [`BoxCgroup::self_join_files`]), v2 `cgroup.procs`.
fn join_file(dir: &Path, version: Version) -> PathBuf {
    match version {
        Version::V1 => dir.join("tasks"),
        Version::V2 => dir.join("cgroup.procs"),
    }
}

/// [`join_file`] of where the box's own processes live: on v2, in the
/// [`V2_LEAF`] of a delegated box.
fn leaf_join_file(dir: &Path, version: Version, delegated: bool) -> PathBuf {
    match (version, delegated) {
        (Version::V2, true) => dir.join(V2_LEAF).join("cgroup.procs"),
        _ => join_file(dir, version),
    }
}

/// A box cgroup decided but not made yet: see [`BoxCgroup::prepare`].
#[derive(Debug, Clone)]
pub struct PendingCgroup {
    id: String,
    name: String,
    /// The caller chose the path ([`BoxCgroup::prepare_at`]).
    chosen: bool,
    /// The v2 parent directory and the controllers wanted there.
    v2: Option<(PathBuf, Vec<&'static str>)>,
    /// The v2 cgroup from which down to the parent the controllers are
    /// enabled: the invoking cgroup, or for an absolute `cgroupsPath` the
    /// hierarchy's root ([`v2::enable_along`]).
    v2_top: Option<PathBuf>,
    /// Each v1 parent directory and the controllers used from it.
    v1: Vec<(PathBuf, Vec<String>)>,
    required_v2: BTreeSet<&'static str>,
    warnings: Vec<CgroupWarning>,
    limits: Limits,
    /// Delegated to its box ([`BoxCgroup::prepare_delegated`]).
    delegation: Option<Delegation>,
}

impl PendingCgroup {
    /// The directories [`Self::create`] makes, v2 first, then each v1
    /// hierarchy, with their versions.
    fn dirs(&self) -> impl Iterator<Item = (PathBuf, Version)> + '_ {
        let v2 = self.v2.iter().map(|(parent, _)| (parent, Version::V2));
        let v1 = self.v1.iter().map(|(parent, _)| (parent, Version::V1));
        v2.chain(v1)
            .map(|(parent, version)| (parent.join(&self.name), version))
    }

    /// The files a process writes `0` to in order to move itself into the
    /// cgroup once made, as [`BoxCgroup::self_join_files`] lists them.
    pub fn self_join_files(&self) -> Vec<PathBuf> {
        let delegated = self.delegation.is_some();
        self.dirs()
            .map(|(dir, version)| leaf_join_file(&dir, version, delegated))
            .collect()
    }

    /// Makes the directories in every hierarchy and writes the limits. On
    /// error every directory made so far is removed again.
    pub fn create(mut self) -> Result<BoxCgroup, CgroupError> {
        let mut warnings = std::mem::take(&mut self.warnings);
        let mut made = Vec::new();
        match build(&self, &mut made, &mut warnings) {
            Ok(dirs) => Ok(BoxCgroup {
                name: self.chosen.then(|| self.name.clone()),
                id: self.id,
                dirs,
                warnings,
                delegation: self.delegation,
            }),
            Err(e) => {
                // The first error is reported; a directory that cannot be
                // removed now is logged and found again by `gc` (by its name).
                for d in made.iter().rev() {
                    if let Err(e) = fsutil::remove_dir(d) {
                        tracing::warn!("removing a half-made cgroup: {e}");
                    }
                }
                Err(e)
            }
        }
    }
}

impl BoxCgroup {
    /// Creates the cgroup of box `id` under the invoking process's cgroup in
    /// every hierarchy carrying a controller the box uses, and writes
    /// `limits`. On v2 the needed controllers are enabled in the parent's
    /// `cgroup.subtree_control` first (that change is not undone). On v1
    /// the cpuset is initialised from the parent and devices are restricted
    /// to [`v1::DEFAULT_DEVICE_RULES`].
    ///
    /// Errors: an invalid id or limit, a requested limit whose controller is
    /// not usable, an existing directory, or any failed write. On error every
    /// directory made so far is removed again.
    pub fn create(h: &Hierarchies, id: &str, limits: &Limits) -> Result<BoxCgroup, CgroupError> {
        Self::prepare(h, id, limits)?.create()
    }

    /// Decides the cgroup of box `id` as [`Self::create`] would make it, checks
    /// the limits and that no directory of that name exists, and makes
    /// nothing: [`PendingCgroup::create`] does. In between, a process can be
    /// forked that joins the cgroup ([`PendingCgroup::self_join_files`]) once
    /// it has been made.
    pub fn prepare(
        h: &Hierarchies,
        id: &str,
        limits: &Limits,
    ) -> Result<PendingCgroup, CgroupError> {
        Self::prepare_in(h, id, limits, dir_name(id), |hi| {
            (
                hi.invoking_dir().to_path_buf(),
                hi.invoking_dir().to_path_buf(),
            )
        })
    }

    /// Like [`Self::prepare`], but the cgroup is the directory `path` of
    /// every hierarchy (the OCI runtime spec's `cgroupsPath`): an absolute
    /// `path` is taken from each hierarchy's mount point, a relative one from
    /// the invoking process's cgroup. Missing parent directories are made by
    /// [`PendingCgroup::create`] (v1 cpusets initialised from their parents)
    /// and left in place by [`Self::remove`], which removes the last one only.
    pub fn prepare_at(
        h: &Hierarchies,
        id: &str,
        path: &Path,
        limits: &Limits,
    ) -> Result<PendingCgroup, CgroupError> {
        use std::path::Component;
        let bad = |reason: &str| CgroupError::InvalidPath {
            path: path.to_path_buf(),
            reason: reason.to_string(),
        };
        if path
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::RootDir))
        {
            return Err(bad("may hold no '.' or '..' component"));
        }
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| bad("names no directory"))?
            .to_string();
        let rel: PathBuf = path
            .parent()
            .map(|p| {
                p.components()
                    .filter(|c| matches!(c, Component::Normal(_)))
                    .collect()
            })
            .unwrap_or_default();
        let absolute = path.is_absolute();
        let mut pending = Self::prepare_in(h, id, limits, name, |hi| {
            let base = if absolute {
                hi.mount_point()
            } else {
                hi.invoking_dir()
            };
            (base.to_path_buf(), base.join(&rel))
        })?;
        pending.chosen = true;
        Ok(pending)
    }

    /// Like [`Self::prepare`], for a box that runs boxes of its own (`run
    /// --nest`): the cgroup is made in every hierarchy carrying a controller
    /// boxes use (the v1 cpuset too, its CPUs copied from the parent), and on
    /// creation delegated to `owner`, the host (uid, gid) of the box's root:
    /// each directory, and the files that move processes and make children
    /// (`tasks`, `cgroup.procs`, `cgroup.threads`, `cgroup.subtree_control`),
    /// belong to it; limit files stay root's. On v2 the box's own processes
    /// belong in the leaf [`V2_LEAF`] (see [`Self::ns_root_join_files`]).
    /// [`Delegation::mounts`] lists the hierarchies to mount in the box (not
    /// the v1 devices controller, which only the host's root may write: the
    /// box's children stay in its devices cgroup).
    pub fn prepare_delegated(
        h: &Hierarchies,
        id: &str,
        limits: &Limits,
        owner: (u32, u32),
    ) -> Result<PendingCgroup, CgroupError> {
        let mut pending = Self::prepare_with(h, id, limits, dir_name(id), true, |hi| {
            (
                hi.invoking_dir().to_path_buf(),
                hi.invoking_dir().to_path_buf(),
            )
        })?;
        let mut mounts = Vec::new();
        let plan = plan_for(h, limits, true)?;
        for (hi, _) in &plan.v1 {
            if hi.carries("devices") {
                continue;
            }
            mounts.push(BoxMount {
                dir: mount_dir_name(hi),
                fstype: "cgroup".into(),
                options: Some(hi.controllers().join(",")),
            });
        }
        if let Some((hi, _)) = &plan.v2 {
            mounts.push(BoxMount {
                dir: mount_dir_name(hi),
                fstype: "cgroup2".into(),
                options: None,
            });
        }
        pending.delegation = Some(Delegation { owner, mounts });
        Ok(pending)
    }

    fn prepare_in(
        h: &Hierarchies,
        id: &str,
        limits: &Limits,
        name: String,
        // (the cgroup the path is taken from, the parent of the box's)
        parent_of: impl Fn(&Hierarchy) -> (PathBuf, PathBuf),
    ) -> Result<PendingCgroup, CgroupError> {
        Self::prepare_with(h, id, limits, name, false, parent_of)
    }

    fn prepare_with(
        h: &Hierarchies,
        id: &str,
        limits: &Limits,
        name: String,
        every_hierarchy: bool,
        // (the cgroup the path is taken from, the parent of the box's)
        parent_of: impl Fn(&Hierarchy) -> (PathBuf, PathBuf),
    ) -> Result<PendingCgroup, CgroupError> {
        validate_id(id)?;
        limits.validate()?;
        limits.validate_cpuset_against(h)?;
        let plan = plan_for(h, limits, every_hierarchy)?;
        let pending = PendingCgroup {
            id: id.to_string(),
            name,
            chosen: false,
            v2_top: plan.v2.as_ref().map(|(hi, _)| parent_of(hi).0),
            v2: plan.v2.map(|(hi, wanted)| (parent_of(hi).1, wanted)),
            v1: plan
                .v1
                .into_iter()
                .map(|(hi, used)| (parent_of(hi).1, used))
                .collect(),
            required_v2: plan.required_v2,
            warnings: plan.warnings,
            limits: limits.clone(),
            delegation: None,
        };
        for (t, _) in pending.dirs() {
            if t.symlink_metadata().is_ok() {
                return Err(CgroupError::AlreadyExists { path: t });
            }
        }
        Ok(pending)
    }

    /// Re-assembles a box cgroup from its parts (e.g. found on disk).
    pub fn from_dirs(id: &str, dirs: Vec<CgroupDir>) -> Result<BoxCgroup, CgroupError> {
        validate_id(id)?;
        Ok(BoxCgroup {
            id: id.to_string(),
            dirs,
            warnings: Vec::new(),
            name: None,
            delegation: None,
        })
    }

    /// Give the v1 `tasks` files of the box's directories to `owner` (a
    /// host (uid, gid)), so that a process of `owner`'s may open them to move
    /// its own processes in: cgroup v1 lets a writer that is not the initial
    /// namespace's root move only processes of its own uid, by the
    /// credentials the file was opened with. For the clones of a template
    /// inside a box, whose processes are the template's root's. Nothing else
    /// changes hands (directories, limits, v2 files).
    pub fn give_tasks_files_to(&self, owner: (u32, u32)) -> Result<(), CgroupError> {
        for d in self.dirs.iter().filter(|d| d.version == Version::V1) {
            let file = d.path.join("tasks");
            std::os::unix::fs::chown(&file, Some(owner.0), Some(owner.1))
                .map_err(|e| CgroupError::io(crate::error::Op::Chown, &file, e))?;
        }
        Ok(())
    }

    /// The delegation of a box that runs boxes of its own, if any.
    pub fn delegation(&self) -> Option<&Delegation> {
        self.delegation.as_ref()
    }

    /// The box id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Replace the box's device rules (the OCI config's
    /// `linux.resources.devices`, say): every device denied, then `rules` in
    /// order, a later rule overriding an earlier one. On cgroup v1 they go to
    /// the devices controller. Without one (pure cgroup v2, which has no
    /// devices controller) they become a device program attached to the
    /// box's v2 directory ([`crate::devfilter`]).
    pub fn set_device_rules(&self, rules: &[DeviceRule]) -> Result<(), CgroupError> {
        let v1: Vec<&CgroupDir> = self
            .dirs
            .iter()
            .filter(|d| d.version == Version::V1 && d.controllers.iter().any(|c| c == "devices"))
            .collect();
        if !v1.is_empty() {
            for d in v1 {
                v1::set_device_rules(&d.path, rules)?;
            }
            return Ok(());
        }
        // Pure v2: a device program on the box's directory.
        let v2: Vec<&CgroupDir> = self
            .dirs
            .iter()
            .filter(|d| d.version == Version::V2)
            .collect();
        if v2.is_empty() {
            return Err(CgroupError::Unsupported {
                option: "device rules",
                reason: "the box has neither a cgroup v1 devices directory nor a cgroup v2 one"
                    .into(),
            });
        }
        for d in v2 {
            crate::devfilter::attach(&d.path, rules)?;
        }
        Ok(())
    }

    /// The box's directories.
    pub fn dirs(&self) -> &[CgroupDir] {
        &self.dirs
    }

    /// Non-fatal problems met by [`Self::create`].
    pub fn warnings(&self) -> &[CgroupWarning] {
        &self.warnings
    }

    /// Controller name → directory. On v2 every enabled controller maps to
    /// the one directory, which is also listed as `unified`.
    pub fn paths(&self) -> BTreeMap<String, PathBuf> {
        let mut m = BTreeMap::new();
        for d in &self.dirs {
            for c in &d.controllers {
                m.entry(c.clone()).or_insert_with(|| d.path.clone());
            }
            if d.version == Version::V2 {
                m.insert("unified".to_string(), d.path.clone());
            }
        }
        m
    }

    /// True when any of the box's directories still exists.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|d| d.path.exists())
    }

    /// Moves process `pid` into the box (writes `cgroup.procs` in every
    /// directory).
    pub fn add_process(&self, pid: i32) -> Result<(), CgroupError> {
        if pid <= 0 {
            return Err(CgroupError::InvalidPid { pid });
        }
        for d in &self.dirs {
            fsutil::write(&d.path.join("cgroup.procs"), &pid.to_string())?;
        }
        Ok(())
    }

    /// The files a single-threaded process writes `0` to in order to move itself
    /// into the box: `tasks` on v1, `cgroup.procs` on v2.
    ///
    /// Moving *oneself* through a v1 `tasks` file skips the kernel's global
    /// thread-group rwsem, whose write side waits for an RCU grace period (about
    /// 10 ms per move on this machine); [`BoxCgroup::add_process`] always pays it.
    ///
    /// For a delegated box these are where its processes live: on v2 its
    /// [`V2_LEAF`].
    pub fn self_join_files(&self) -> Vec<PathBuf> {
        let delegated = self.delegation.is_some();
        self.dirs
            .iter()
            .map(|d| leaf_join_file(&d.path, d.version, delegated))
            .collect()
    }

    /// The files a delegated box's first process writes `0` to once it has
    /// made its cgroup namespace (after [`Self::ns_root_join_files`]): its
    /// v2 leaf's `cgroup.procs`. Empty for a box that is not delegated or has
    /// no v2 cgroup.
    pub fn leaf_join_files(&self) -> Vec<PathBuf> {
        if self.delegation.is_none() {
            return Vec::new();
        }
        self.dirs
            .iter()
            .filter(|d| d.version == Version::V2)
            .map(|d| d.path.join(V2_LEAF).join("cgroup.procs"))
            .collect()
    }

    /// The files a delegated box's first process writes `0` to before it
    /// makes its cgroup namespace, so that the namespace's root is the box's
    /// cgroup itself (its children's parent) rather than the v2 leaf it then
    /// moves to ([`Self::self_join_files`]). The same as those for a box that
    /// is not delegated.
    pub fn ns_root_join_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|d| join_file(&d.path, d.version))
            .collect()
    }

    /// Move the calling process into the box cgroup by writing `0` to each of
    /// [`BoxCgroup::self_join_files`]. The caller must be single-threaded on v1
    /// (only the calling thread moves).
    pub fn join_self(&self) -> Result<(), CgroupError> {
        for file in self.self_join_files() {
            fsutil::write(&file, "0")?;
        }
        Ok(())
    }

    /// The processes in the box: the sorted union of every `cgroup.procs`.
    /// Directories that are gone count as empty.
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = BTreeSet::new();
        let delegated = self.delegation.is_some();
        let files = self.dirs.iter().flat_map(|d| {
            let leaf = (delegated && d.version == Version::V2)
                .then(|| d.path.join(V2_LEAF).join("cgroup.procs"));
            std::iter::once(d.path.join("cgroup.procs")).chain(leaf)
        });
        for file in files {
            add_procs(&file, &mut all)?;
        }
        Ok(all.into_iter().collect())
    }

    /// The processes of the box and of every cgroup below it (the boxes a
    /// delegated box started, to any depth): the sorted union of every
    /// `cgroup.procs` of the subtree. Directories that are gone count as empty.
    pub fn procs_tree(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = BTreeSet::new();
        for d in &self.dirs {
            walk_procs(&d.path, &mut all)?;
        }
        Ok(all.into_iter().collect())
    }

    /// The processes in the cgroups below the box's own (the boxes a
    /// delegated box started, to any depth), in any hierarchy. Unlike
    /// "[`Self::procs_tree`] less [`Self::procs`]", this finds them when a
    /// hierarchy the box does not divide (its v1 `devices` cgroup) lists
    /// them with the box's own processes.
    pub fn procs_below(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = BTreeSet::new();
        let delegated = self.delegation.is_some();
        for d in &self.dirs {
            // A delegated v2 box keeps its own processes in its leaf.
            let leaf = (delegated && d.version == Version::V2).then(|| d.path.join(V2_LEAF));
            for sub in subdirs(&d.path) {
                if Some(&sub) != leaf.as_ref() {
                    walk_procs(&sub, &mut all)?;
                }
            }
        }
        Ok(all.into_iter().collect())
    }

    fn v1_dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|d| d.version == Version::V1 && d.controllers.iter().any(|c| c == controller))
            .map(|d| d.path.as_path())
    }

    fn v2_dir(&self) -> Option<&CgroupDir> {
        self.dirs.iter().find(|d| d.version == Version::V2)
    }

    /// Where the files of `v1` (or, on v2, of `v2`; `None` = core files that
    /// need no controller) are.
    fn locate(&self, v1: &str, v2: Option<&str>) -> Option<Loc<'_>> {
        if let Some(p) = self.v1_dir(v1) {
            return Some(Loc::V1(p));
        }
        let d = self.v2_dir()?;
        match v2 {
            None => Some(Loc::V2(&d.path)),
            Some(c) => d
                .controllers
                .iter()
                .any(|x| x == c)
                .then_some(Loc::V2(&d.path)),
        }
    }

    /// Current resource usage. Controllers the box has no cgroup for give 0.
    pub fn stats(&self) -> Result<Stats, CgroupError> {
        let cpu_usage_ns = match self.locate("cpuacct", None) {
            Some(Loc::V1(d)) => stats::read_u64(&d.join("cpuacct.usage"))?,
            Some(Loc::V2(d)) => stats::v2_cpu_usage_ns(&d.join("cpu.stat"))?,
            None => 0,
        };
        let (memory_current, memory_peak) = match self.locate("memory", Some("memory")) {
            Some(Loc::V1(d)) => (
                stats::read_u64(&d.join("memory.usage_in_bytes"))?,
                stats::read_u64(&d.join("memory.max_usage_in_bytes"))?,
            ),
            Some(Loc::V2(d)) => {
                let current = stats::read_u64(&d.join("memory.current"))?;
                let peak_file = d.join("memory.peak");
                let peak = match fsutil::read_opt(&peak_file)? {
                    Some(text) => stats::parse_u64(&peak_file, &text)?,
                    None => current,
                };
                (current, peak)
            }
            None => (0, 0),
        };
        let pids_current = match self.locate("pids", Some("pids")) {
            Some(Loc::V1(d) | Loc::V2(d)) => stats::read_u64(&d.join("pids.current"))?,
            None => 0,
        };
        Ok(Stats {
            cpu_usage_ns,
            memory_current,
            memory_peak,
            pids_current,
            oom_kills: self.oom_kills()?,
        })
    }

    /// Number of OOM kills in the box: v1 `oom_kill` of `memory.oom_control`
    /// (0 on kernels without it), v2 `oom_kill` of `memory.events`.
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        match self.locate("memory", Some("memory")) {
            Some(Loc::V1(d)) => stats::read_keyed(&d.join("memory.oom_control"), "oom_kill"),
            Some(Loc::V2(d)) => stats::read_keyed(&d.join("memory.events"), "oom_kill"),
            None => Ok(0),
        }
    }

    /// Freezes every process of the box, waiting up to [`FREEZE_TIMEOUT`].
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_frozen(true, FREEZE_TIMEOUT)
    }

    /// Thaws the box, waiting up to [`FREEZE_TIMEOUT`].
    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false, FREEZE_TIMEOUT)
    }

    /// Freezes (`frozen`) or thaws the box, waiting up to `timeout` for the
    /// kernel to confirm. A freeze that times out is undone. Thawing a cgroup
    /// that is gone (the box ended and its cgroup was removed meanwhile)
    /// succeeds: nothing of it is frozen any more.
    pub fn set_frozen(&self, frozen: bool, timeout: Duration) -> Result<(), CgroupError> {
        let result = match self.locate("freezer", None) {
            Some(Loc::V1(d)) => v1::set_frozen(d, frozen, timeout),
            Some(Loc::V2(d)) => v2::set_frozen(d, frozen, timeout),
            None => Err(CgroupError::NoController { what: "freezer" }),
        };
        match result {
            Err(e) if !frozen && e.is_not_found() => Ok(()),
            other => other,
        }
    }

    /// Thaw every cgroup below the box's freezer (v1 `freezer.state`, v2
    /// `cgroup.freeze`): the boxes a delegated box runs, some perhaps frozen
    /// by the nestbox inside. Best effort: a cgroup that went meanwhile is
    /// fine, and a write that fails leaves `kill_all` to report what
    /// survives.
    fn thaw_below(&self) {
        let (dir, file, value) = match self.locate("freezer", None) {
            Some(Loc::V1(d)) => (d, "freezer.state", "THAWED"),
            Some(Loc::V2(d)) => (d, "cgroup.freeze", "0"),
            None => return,
        };
        let mut todo = vec![dir.to_path_buf()];
        while let Some(d) = todo.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    let f = e.path().join(file);
                    if f.exists() {
                        if let Err(err) = fsutil::write(&f, value) {
                            tracing::warn!("thawing a box inside a box: {err}");
                        }
                    }
                    todo.push(e.path());
                }
            }
        }
    }

    /// Refuses to act on directories not named `nestbox-<id>` (a tampered or
    /// corrupt saved state must not make us kill or remove anything else).
    fn check_dirs(&self) -> Result<(), CgroupError> {
        let want = self.name.clone().unwrap_or_else(|| dir_name(&self.id));
        for d in &self.dirs {
            if d.path.file_name().and_then(|n| n.to_str()) != Some(want.as_str())
                || !d.path.is_absolute()
            {
                return Err(CgroupError::NotBoxDir {
                    path: d.path.clone(),
                    id: self.id.clone(),
                });
            }
        }
        Ok(())
    }

    /// Sends SIGKILL to every process of the box (never to pid 1 or to the
    /// calling process). A vanished process is fine.
    fn signal_all(&self) -> Result<(), CgroupError> {
        let me = std::process::id() as i32;
        for pid in self.procs_tree()? {
            if pid <= 1 || pid == me {
                continue;
            }
            match kill(Pid::from_raw(pid), Signal::SIGKILL) {
                Ok(()) | Err(Errno::ESRCH) => {}
                Err(err) => return Err(CgroupError::Signal { pid, err }),
            }
        }
        Ok(())
    }

    /// Kills every process of the box and waits (up to [`KILL_TIMEOUT`])
    /// until none is left. Uses v2 `cgroup.kill` when the kernel has it;
    /// else freezes the box (so nothing can fork), SIGKILLs every process
    /// and thaws. Directories not named `nestbox-<id>` are refused.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        self.check_dirs()?;
        let by_kernel = match self.v2_dir() {
            Some(d) if d.path.exists() => v2::kill(&d.path)?,
            _ => false,
        };
        if by_kernel && matches!(self.locate("freezer", None), Some(Loc::V1(_))) {
            // A hybrid layout (a v2 directory for hugetlb, the freezer in
            // v1): a process frozen by the v1 freezer does not die of the
            // SIGKILL queued until it is thawed.
            self.thaw()?;
        }
        if !by_kernel {
            // Usually the box's init has gone and the kernel killed the rest
            // of its pid namespace: nothing to do.
            if self.procs_tree()?.is_empty() {
                return Ok(());
            }
            let frozen = self.freeze().is_ok();
            let sent = self.signal_all();
            if frozen {
                self.thaw()?;
            }
            // A box inside (a delegated box's) frozen by its own nestbox —
            // a template — stays frozen when its parent thaws, and a frozen
            // process does not die: thaw them all.
            self.thaw_below();
            sent?;
        }
        let mut left = Vec::new();
        let done = fsutil::poll_until(KILL_TIMEOUT, Duration::from_millis(10), |round| {
            left = self.procs_tree()?;
            if !left.is_empty() && round % 10 == 9 {
                self.signal_all()?;
            }
            Ok(left.is_empty())
        })?;
        if done {
            return Ok(());
        }
        Err(CgroupError::Timeout {
            what: format!("processes {left:?} to exit"),
            path: self
                .dirs
                .first()
                .map(|d| d.path.clone())
                .unwrap_or_default(),
            waited: KILL_TIMEOUT,
        })
    }

    /// Writes the limits set in `limits` into the box's existing
    /// directories (a running box's resources changed; limits left `None`
    /// are not touched). Errors: an invalid limit, or a write the kernel
    /// refuses (a memory limit below the current usage, say).
    pub fn update(&self, limits: &Limits) -> Result<(), CgroupError> {
        limits.validate()?;
        let carries = |c: &str| {
            self.dirs
                .iter()
                .any(|d| d.controllers.iter().any(|x| x == c))
        };
        if !limits.hugepage_limits.is_empty() && !carries("hugetlb") {
            // (Its hugetlb cgroup is made only for a box created with them.)
            return Err(CgroupError::Unsupported {
                option: "hugepage_limits",
                reason: "the box was created without hugepage limits: it has no hugetlb cgroup to change".into(),
            });
        }
        for d in &self.dirs {
            match d.version {
                Version::V1 => {
                    let parent = d.path.parent().unwrap_or(&d.path);
                    v1::apply(&d.path, parent, &d.controllers, limits, false)?
                }
                Version::V2 => v2::apply(&d.path, &d.controllers, limits)?,
            }
        }
        Ok(())
    }

    /// Removes every directory of the box (and any child cgroups in them).
    /// Directories not named `nestbox-<id>` are refused.
    /// Missing directories are fine, so this is idempotent; `EBUSY` is
    /// retried briefly. All directories are attempted; the first error is
    /// returned.
    pub fn remove(&self) -> Result<(), CgroupError> {
        self.check_dirs()?;
        let mut first = None;
        for d in &self.dirs {
            if let Err(e) = fsutil::remove_dir(&d.path) {
                first.get_or_insert(e);
            } else if d.controllers.iter().any(|c| c == "cpu") {
                if let Some(parent) = d.path.parent() {
                    let cpus = crate::limits::online_cpus() as f64;
                    crate::reserve::after_remove(parent, d.version, cpus);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Records the box's CPU reservation on its new directory `dir` of the CPU
/// controller and re-weighs the reserved siblings (see [`crate::reserve`]).
fn reserved(dir: &Path, version: Version, limits: &Limits) -> Result<(), CgroupError> {
    let scale = crate::reserve::scale(version);
    let base = match (version, limits.cpu_shares) {
        (Version::V1, Some(s)) => s,
        (Version::V2, Some(s)) => crate::limits::shares_to_weight(s),
        (_, None) => scale.default,
    };
    crate::reserve::after_create(
        dir,
        version,
        limits.cpu_reserve.map(|r| (r, base)),
        crate::limits::online_cpus() as f64,
    )
}

/// Makes `dir` and its missing ancestors (a v1 cpuset's initialised from
/// their parents when `cpuset`); an existing one is fine.
fn make_parents(dir: &Path, cpuset: bool) -> Result<(), CgroupError> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = dir.parent().ok_or_else(|| CgroupError::InvalidPath {
        path: dir.to_path_buf(),
        reason: "has no parent cgroup".into(),
    })?;
    make_parents(parent, cpuset)?;
    match fsutil::make_dir(dir) {
        Ok(()) => {}
        Err(CgroupError::AlreadyExists { .. }) => return Ok(()),
        Err(e) => return Err(e),
    }
    if cpuset {
        v1::init_cpuset(dir, parent)?;
    }
    Ok(())
}

/// Makes the directories of `plan`, recording each in `made`.
fn build(
    pending: &PendingCgroup,
    made: &mut Vec<PathBuf>,
    warnings: &mut Vec<CgroupWarning>,
) -> Result<Vec<CgroupDir>, CgroupError> {
    let (name, limits) = (&pending.name, &pending.limits);
    let mut dirs = Vec::new();
    if let Some((parent, wanted)) = &pending.v2 {
        make_parents(parent, false)?;
        let enabled = if wanted.is_empty() {
            Vec::new()
        } else {
            let top = pending.v2_top.as_deref().unwrap_or(parent);
            v2::enable_along(top, parent, wanted, &pending.required_v2, warnings)?
        };
        let dir = parent.join(name);
        fsutil::make_dir(&dir)?;
        made.push(dir.clone());
        v2::apply(&dir, &enabled, limits)?;
        if enabled.iter().any(|c| c == "cpu") {
            reserved(&dir, Version::V2, limits)?;
        }
        if let Some(d) = &pending.delegation {
            let leaf = dir.join(V2_LEAF);
            fsutil::make_dir(&leaf)?;
            delegate_dir(&dir, d.owner)?;
            delegate_dir(&leaf, d.owner)?;
        }
        dirs.push(CgroupDir {
            version: Version::V2,
            controllers: enabled,
            path: dir,
        });
    }
    for (parent, used) in &pending.v1 {
        make_parents(parent, used.iter().any(|c| c == "cpuset"))?;
        let dir = parent.join(name);
        fsutil::make_dir(&dir)?;
        made.push(dir.clone());
        v1::apply(&dir, parent, used, limits, true)?;
        if used.iter().any(|c| c == "cpu") {
            reserved(&dir, Version::V1, limits)?;
        }
        if let Some(d) = &pending.delegation {
            // The devices controller is not the box's to write (see
            // `BoxCgroup::prepare_delegated`).
            if !used.iter().any(|c| c == "devices") {
                delegate_dir(&dir, d.owner)?;
            }
        }
        dirs.push(CgroupDir {
            version: Version::V1,
            controllers: used.clone(),
            path: dir,
        });
    }
    Ok(dirs)
}

/// Add the pids of `cgroup.procs` file `file` to `all`; false if the cgroup
/// is gone (a box whose last process ended may have its cgroup removed by its
/// monitor while this reads it).
/// The directories in `dir` (none when it is gone).
fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Add the processes of cgroup `dir` and of every cgroup below it to `all`.
fn walk_procs(dir: &Path, all: &mut BTreeSet<i32>) -> Result<(), CgroupError> {
    if !add_procs(&dir.join("cgroup.procs"), all)? {
        return Ok(());
    }
    for sub in subdirs(dir) {
        walk_procs(&sub, all)?;
    }
    Ok(())
}

fn add_procs(file: &Path, all: &mut BTreeSet<i32>) -> Result<bool, CgroupError> {
    let Some(text) = fsutil::read_if_alive(file)? else {
        return Ok(false);
    };
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let pid = line.parse::<i32>().map_err(|_| CgroupError::Parse {
            path: file.to_path_buf(),
            content: line.to_string(),
            reason: "expected a pid".into(),
        })?;
        all.insert(pid);
    }
    Ok(true)
}
