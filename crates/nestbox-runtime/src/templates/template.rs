//! Templates: boxes frozen with the cgroup freezer so that clones can be forked from
//! them (`nestbox freeze`, `nestbox template ls|rm`), and what a clone shell takes
//! from its template (identity maps, the seccomp cookie, the pid namespace).
//!
//! A template keeps its monitor, init and cgroup. Its one process is the one clones
//! are forked from. Clones live in pid namespaces nested in the template's, so the
//! template's init must outlive them: removing a template that still has clones
//! kills its process, and its init lingers until the last clone is gone (see
//! [`crate::init`]).

use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub use crate::lifecycle::nested::{
    enter_pid_namespace_of, load_template, root_ids, shell_identity,
};
use crate::liveness::ProcRef;
use crate::registry::{BoxRecord, Registry};
use crate::state::{now, Status, TemplateInfo};
use crate::{Result, RuntimeError};

/// How long quiescing or thawing a box may take.
const FREEZER_TIMEOUT: Duration = Duration::from_secs(5);

/// One template, as `template ls` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TemplateSummary {
    /// Template name.
    pub name: String,
    /// The frozen box.
    pub box_name: String,
    /// Host pid of the process clones are forked from.
    pub pid: i32,
    /// Live clones.
    pub clones: usize,
    /// Clones forked ahead of time, waiting to be claimed.
    pub pooled: usize,
    /// Removed, waiting for its clones to go.
    pub removed: bool,
}

/// A box under monitors cannot be frozen, cloned, checkpointed or moved:
/// its monitor filter's listener belongs to its monitor process, and a copy
/// of its processes would stop at their first subscribed call with no one
/// to answer. (A box for boxes, `--nest`, is saved with the boxes inside
/// it suspended: [`crate::subtree`].)
pub(crate) fn refuse_monitored(record: &crate::registry::BoxRecord, what: &str) -> Result<()> {
    if crate::templates::attach::has_attached(record) {
        return Err(RuntimeError::Unsupported {
            name: record.name().to_string(),
            problem: format!("has monitors attached (nestbox monitor attach): it cannot be {what}"),
        });
    }
    if record.spec.monitors.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::Unsupported {
        name: record.name().to_string(),
        problem: format!("runs under monitors (--monitor): it cannot be {what}"),
    })
}

/// Freeze the running box `name` into a template called `as_name` (default: the
/// box name). Refuses boxes it could not clone from, checked once frozen (so
/// that no process comes or goes meanwhile), and thaws them as they were.
/// `pool` clones are forked ahead of time (see [`crate::clone::fill_pool`]).
pub fn freeze(
    reg: &Registry,
    name: &str,
    as_name: Option<&str>,
    pool: usize,
) -> Result<TemplateInfo> {
    freeze_inner(reg, name, as_name, pool).map_err(|e| e.in_box(name))
}

fn freeze_inner(
    reg: &Registry,
    name: &str,
    as_name: Option<&str>,
    pool: usize,
) -> Result<TemplateInfo> {
    let template_name = as_name.unwrap_or(name).to_string();
    crate::spec::validate_name(&template_name)?;
    if template_name != name && (reg.load(&template_name).is_ok()) {
        return Err(RuntimeError::NameInUse(template_name));
    }
    if let Some(other) = find_template(reg, &template_name)? {
        return Err(RuntimeError::TemplateNameInUse {
            name: template_name,
            box_name: other.name().to_string(),
        });
    }
    let record = reg.load(name)?;
    // One at a time with checkpoints and migrations of the box (see
    // `checkpoint`), the box read again under the lock.
    let _lock = crate::clone::box_lock(&record)?;
    let record = reg.load(name)?;
    refuse_monitored(&record, "frozen or cloned")?;
    match record.state.effective_status() {
        Status::Running => {}
        Status::Frozen => {
            return Err(RuntimeError::WrongState {
                name: name.to_string(),
                problem: "is already frozen".into(),
            })
        }
        other => {
            return Err(RuntimeError::WrongState {
                name: name.to_string(),
                problem: format!(
                    "has {}: only a running box can be frozen",
                    match other {
                        Status::Exited => "exited",
                        Status::Dead => "died",
                        _ => "not started",
                    }
                ),
            })
        }
    }
    let cgroup = record
        .state
        .cgroup
        .clone()
        .ok_or_else(|| RuntimeError::Unsupported {
            name: name.to_string(),
            problem: "has no cgroup, so it cannot be frozen (run nestbox as root)".into(),
        })?;
    // The boxes inside a nest box are saved first, each with its processes,
    // and stopped: each clone runs them again (`subtree`), and so does the
    // box should this freeze fail.
    let suspended = crate::subtree::suspend_inside(reg, &record)?;
    let started = Instant::now();
    if let Err(e) = cgroup.set_frozen(true, FREEZER_TIMEOUT) {
        if suspended {
            crate::subtree::resume_inside_or_warn(reg, name);
        }
        return Err(e.into());
    }
    let freeze_ms = started.elapsed().as_secs_f64() * 1e3;
    // What is frozen is read and checked: no process of it can come or go
    // meanwhile (a command's short-lived child, which a read of the running
    // box could list and then not find). A box refused goes on as it was.
    let thaw = || {
        if let Err(e) = cgroup.set_frozen(false, FREEZER_TIMEOUT) {
            tracing::warn!(box_name = name, "thawing after a failed freeze: {e}");
        }
        if suspended {
            crate::subtree::resume_inside_or_warn(reg, name);
        }
    };
    let steps = match refuse_boxes_inside(&record, &cgroup, false)
        .and_then(|()| checked_tree(name, &record))
    {
        Ok(steps) => steps,
        Err(e) => {
            thaw();
            return Err(e);
        }
    };
    let Some(process) = ProcRef::of(steps[0].process.host_pid) else {
        // Not a template: left as it was, running.
        thaw();
        return Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: "exited while freezing".into(),
        });
    };
    // Fewer page-table entries for every fork to copy (see
    // nestbox_remote::collapse_anonymous); an optimisation only.
    for step in &steps {
        match nestbox_remote::collapse_anonymous(step.process.host_pid) {
            Ok(done) if done.failed > 0 => tracing::warn!(
                box_name = name,
                "{} of {} ranges of the memory of process {} not collapsed into huge pages",
                done.failed,
                done.failed + done.ranges,
                step.process.host_pid
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(box_name = name, "collapsing the template's memory: {e}"),
        }
    }
    let info = TemplateInfo {
        name: template_name,
        process,
        frozen_at: now(),
        freeze_ms,
        pool,
        removed: false,
    };
    let recorded = info.clone();
    // Only the box frozen, and only while it still runs: a stop or rm -f racing
    // with this freeze may have recorded its end (or a new box taken the name)
    // since it was loaded, and a template must never be recorded over that.
    let mut frozen = false;
    let update = reg.update(name, |s| {
        if s.id == record.state.id && s.status == Status::Running {
            s.status = Status::Frozen;
            s.template = Some(recorded);
            frozen = true;
        }
    });
    if update.is_err() || !frozen {
        crate::diag::warn_on_err(
            Some(name),
            "thawing after a failed freeze",
            cgroup.set_frozen(false, FREEZER_TIMEOUT),
        );
        update?;
        return Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: "exited while freezing".to_string(),
        });
    }
    Ok(info)
}

/// A box for boxes (`--nest`) is saved (frozen, checkpointed, moved) only
/// while no box runs inside it: the processes of its boxes (and of the
/// nestbox inside's pooled shells) are in the cgroups below its own, and the
/// engine re-creates only the box's own processes. Its boxes are suspended
/// before (`subtree`), so one found here started meanwhile (`snapshot`,
/// false: a snapshot's checkpoint does not suspend them, since their data is
/// in the box's state directory, which a snapshot does not hold). Called
/// with the box frozen, so that none can start meanwhile.
pub(crate) fn refuse_boxes_inside(
    record: &BoxRecord,
    cgroup: &nestbox_cgroup::BoxCgroup,
    snapshot: bool,
) -> Result<()> {
    if !record.spec.nest {
        return Ok(());
    }
    let inside = cgroup.procs_below()?.len();
    if inside == 0 {
        return Ok(());
    }
    let what = if snapshot {
        "a snapshot with --checkpoint of a box for boxes is taken only with none inside (its boxes' data is in its state directory, which a snapshot does not hold): `nestbox checkpoint` saves it with its boxes"
    } else {
        "a box inside started while it was being saved: try again"
    };
    Err(RuntimeError::Unsupported {
        name: record.name().to_string(),
        problem: format!(
            "runs boxes of its own (--nest; {inside} processes in boxes inside it, the pooled shells of its nestbox included): {what}"
        ),
    })
}

/// The processes of a box besides its init, in the order a clone re-creates
/// them (`nestbox_remote::tree`): the first is the box's main process, which
/// clones fork from. Refuses a tree a clone cannot reproduce, naming the
/// process.
pub(crate) fn template_tree(record: &BoxRecord) -> Result<Vec<nestbox_remote::tree::Step>> {
    let name = record.name();
    let init = record.state.init.map(|p| p.pid).unwrap_or(0);
    let cgroup = record
        .state
        .cgroup
        .as_ref()
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    let others: Vec<i32> = cgroup.procs()?.into_iter().filter(|p| *p != init).collect();
    if others.is_empty() {
        return Err(RuntimeError::Unsupported {
            name: name.to_string(),
            problem: "has no process to freeze besides its init".into(),
        });
    }
    let refused = |e| crate::clone::refused_at_freeze(name, e);
    let processes = nestbox_remote::tree::read_box(init, &others).map_err(refused)?;
    nestbox_remote::tree::plan(&processes).map_err(refused)
}

/// The processes of box `name` (`record`) as clones fork them, each checked
/// against what a clone can copy (its ids, its fds).
fn checked_tree(name: &str, record: &BoxRecord) -> Result<Vec<nestbox_remote::tree::Step>> {
    let steps = template_tree(record)?;
    for step in &steps {
        // A process forked by its parent's clone gets its own ids set; one
        // forked from its template process directly (a child of the box's
        // init) must run as the box's root, which the remote fork needs.
        let root_uid = root_ids(record).map_or(0, |(uid, _)| uid);
        let must_be_root = matches!(step.origin, nestbox_remote::tree::Origin::RemoteFork);
        check_cloneable(
            name,
            Pid::from_raw(step.process.host_pid),
            must_be_root.then_some(root_uid),
        )?;
    }
    let host_pids: Vec<i32> = steps.iter().map(|s| s.process.host_pid).collect();
    crate::clone::check_fds(name, &host_pids)?;
    Ok(steps)
}

/// Refuse processes nestbox cannot fork remotely, naming the reason.
/// `root_uid`: the host uid of the box's root, which the process must run as
/// (`None`: any uid).
fn check_cloneable(name: &str, pid: Pid, root_uid: Option<u32>) -> Result<()> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            // It ended since the cgroup was read (a stop or rm -f racing).
            RuntimeError::WrongState {
                name: name.to_string(),
                problem: "exited while freezing".to_string(),
            }
        } else {
            RuntimeError::io("read", format!("/proc/{pid}/status"))(e)
        }
    })?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().to_string())
            .unwrap_or_default()
    };
    let comm = field("Name:");
    let threads: u32 = field("Threads:").parse().unwrap_or(1);
    if threads > 1 && field("State:").starts_with('Z') {
        return Err(RuntimeError::Unsupported {
            name: name.to_string(),
            problem: format!("cannot be cloned: the main thread of process {pid} ({comm}) has exited ({threads} threads left)"),
        });
    }
    let tracer: i32 = field("TracerPid:").parse().unwrap_or(0);
    if tracer != 0 {
        return Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: format!(
                "cannot be cloned: process {pid} ({comm}) is already being traced by pid {tracer}"
            ),
        });
    }
    let euid = field("Uid:")
        .split_whitespace()
        .nth(1)
        .unwrap_or("0")
        .to_string();
    if let Some(root_uid) = root_uid.filter(|r| euid != r.to_string()) {
        return Err(RuntimeError::Unsupported {
            name: name.to_string(),
            problem: format!("cannot be cloned: process {pid} ({comm}) runs as uid {euid}, not as the box's root ({root_uid}); cloning supports other uids only in processes their parent in the box forked"),
        });
    }
    Ok(())
}

/// Find the box holding the template called `name`.
pub fn find_template(reg: &Registry, name: &str) -> Result<Option<BoxRecord>> {
    // Most templates carry their box's name: read that record alone. Template
    // names are unique (freeze refuses a second), so a match is the one.
    if let Ok(r) = reg.load(name) {
        if r.state.template.as_ref().is_some_and(|t| t.name == name) {
            return Ok(Some(r));
        }
    }
    Ok(reg
        .list()?
        .into_iter()
        .find(|r| r.state.template.as_ref().is_some_and(|t| t.name == name)))
}

/// The template called `name`, which must be frozen and not removed.
pub fn load_frozen(reg: &Registry, name: &str) -> Result<BoxRecord> {
    let Some(record) = find_template(reg, name)? else {
        return Err(match reg.load(name) {
            Ok(_) => RuntimeError::WrongState {
                name: name.to_string(),
                problem: format!("is not a template: freeze it first (nestbox freeze {name})"),
            },
            Err(_) => RuntimeError::NoSuchTemplate(name.to_string()),
        });
    };
    let Some(info) = record.state.template.clone() else {
        return Err(RuntimeError::NoSuchTemplate(name.to_string()));
    };
    if info.removed || record.state.effective_status() != Status::Frozen {
        return Err(RuntimeError::TemplateRemoved(name.to_string()));
    }
    if !info.process.alive() {
        return Err(
            RuntimeError::Failed(format!("the process of template {name:?} is gone"))
                .in_box(record.name()),
        );
    }
    Ok(record)
}

/// Whether `record` is a clone (or a clone shell being made) of template box
/// `box_name`.
pub fn is_clone_of(record: &BoxRecord, box_name: &str) -> bool {
    record
        .spec
        .clone_of
        .as_ref()
        .is_some_and(|c| c.template_box == box_name)
}

/// Live clones of the template box `box_name`.
pub fn clones_of(reg: &Registry, box_name: &str) -> Result<Vec<BoxRecord>> {
    Ok(reg
        .list()?
        .into_iter()
        .filter(|r| {
            is_clone_of(r, box_name)
                && !r.is_pooled()
                && matches!(
                    r.state.effective_status(),
                    Status::Creating | Status::Running | Status::Frozen
                )
        })
        .collect())
}

/// Every template of this root.
pub fn list(reg: &Registry) -> Result<Vec<TemplateSummary>> {
    let mut out = Vec::new();
    for record in reg.list()? {
        let Some(t) = &record.state.template else {
            continue;
        };
        if record.state.effective_status() != Status::Frozen {
            continue;
        }
        out.push(TemplateSummary {
            name: t.name.clone(),
            box_name: record.name().to_string(),
            pid: t.process.pid,
            clones: clones_of(reg, record.name())?.len(),
            pooled: crate::clone::pooled_of(reg, &record)?.len(),
            removed: t.removed,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Remove the template `name` (its box too). With live clones, only its process
/// is killed: its init keeps the clones' ancestor pid namespace alive and leaves,
/// with the box, when the last clone has gone.
pub fn remove(reg: &Registry, name: &str) -> Result<()> {
    let record = match find_template(reg, name)? {
        Some(r) => r,
        None => return Err(RuntimeError::NoSuchTemplate(name.to_string())),
    };
    remove_box(reg, &record)
}

/// Remove a template box (from `rm -f` or `template rm`).
pub fn remove_box(reg: &Registry, record: &BoxRecord) -> Result<()> {
    let box_name = record.name();
    // Wait for a fork in progress (a pool refill), then remove the whole pool,
    // shells not yet forked into included; a refill that gets the lock later
    // finds the template gone and makes nothing.
    let _lock = crate::clone::clone_lock(record)?;
    for pooled in reg.names_prefixed(&record.pool_prefix())? {
        match crate::templates::ops::remove(reg, &pooled, true) {
            Ok(()) | Err(RuntimeError::NoSuchBox(_)) => {}
            Err(e) => return Err(e),
        }
    }
    if clones_of(reg, box_name)?.is_empty() {
        if let Some(cg) = &record.state.cgroup {
            let thawed = cg.set_frozen(false, FREEZER_TIMEOUT);
            crate::diag::warn_on_err(Some(box_name), "thawing", thawed);
        }
        // Thawed: from here on it is removed like any running box.
        reg.update(box_name, |s| s.status = Status::Running)?;
        return crate::templates::ops::remove(reg, box_name, true);
    }
    let info = record.state.template.clone();
    reg.update(box_name, |s| {
        if let Some(t) = s.template.as_mut() {
            t.removed = true;
        }
    })?;
    if let Some(t) = info {
        if t.process.alive() {
            // ESRCH: it died meanwhile, as wanted.
            let _ = kill(Pid::from_raw(t.process.pid), Signal::SIGKILL);
        }
    }
    if let Some(cg) = &record.state.cgroup {
        let thawed = cg.set_frozen(false, FREEZER_TIMEOUT);
        crate::diag::warn_on_err(Some(box_name), "thawing", thawed);
    }
    Ok(())
}
