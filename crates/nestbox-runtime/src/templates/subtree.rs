//! The boxes inside a nest box, carried through the nest box's checkpoint,
//! freeze (and so its clones), migration and snapshot with its processes
//! (`docs/nesting.md`, "A nest box saved with its boxes").
//!
//! The rebuild engine re-creates a box's own processes only: the boxes inside
//! a nest box live in namespaces nested in its own, which it does not make
//! again. So before a nest box with boxes inside is saved, the nestbox inside
//! it **suspends** them (`nestbox subtree suspend`, run in the box through
//! `exec`: [`suspend_inside`]): each running box's processes are
//! checkpointed (kept in the box's data directory as
//! `suspended.processes/`, their pages in the page pool of the nestbox
//! inside), killed while frozen, and the box stopped; a nest box among them
//! suspends its own boxes first, so a whole subtree is saved, deepest first.
//! Its pooled shells are drained (they are made again on demand). The nest
//! box is then saved with no box running inside it; its state directory,
//! which holds all of that, goes with it (a checkpoint's `nest/`, a clone's
//! copy).
//!
//! Wherever the nest box runs again — itself after `checkpoint
//! --leave-running` or `snapshot --checkpoint`, a restored box, a clone, the
//! migrated box on its target, or itself after a save that failed — the
//! nestbox inside **resumes** them ([`resume_inside`], `nestbox subtree
//! resume`): each suspended box is started again and its processes restored
//! in place (`checkpoint::restore_in_place`, as a rollback does), which in a
//! nest box among them resumes the boxes inside it in turn. Each box keeps
//! its name, id, address and files.
//!
//! Refused in one line, before anything inside is stopped: a template inside
//! (`template save` keeps one on disk), a clone or a restored box inside
//! (their root stands on another box's or a checkpoint's layers, and they
//! are not started again), a `--rm` box or one under monitors.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::registry::{BoxRecord, Registry};
use crate::state::Status;
use crate::{Result, RuntimeError};

/// Where a suspended box's processes are kept, in its data directory.
const SUSPENDED: &str = "suspended.processes";
/// How long the nestbox inside a box may take to suspend or resume its boxes.
const SUBTREE_TIMEOUT: Duration = Duration::from_secs(300);

/// The checkpoint of suspended box `record`'s processes.
fn suspended_dir(record: &BoxRecord) -> PathBuf {
    record.lib_dir().join(SUSPENDED)
}

/// The checkpoints of the processes of every suspended box of `reg` (`gc`
/// keeps their pages).
pub(crate) fn suspended_dirs(reg: &Registry) -> Result<Vec<PathBuf>> {
    Ok(reg
        .list()?
        .iter()
        .map(suspended_dir)
        .filter(|d| d.is_dir())
        .collect())
}

/// Why box `record` cannot be suspended with the nest box it runs in, if
/// it cannot.
fn unsuspendable(record: &BoxRecord) -> Option<&'static str> {
    let status = record.state.effective_status();
    if record.state.template.is_some() || status == Status::Frozen {
        return Some("is a template: remove it (`template save` keeps it on disk) first");
    }
    if status != Status::Running && status != Status::Creating {
        return None;
    }
    if status == Status::Creating {
        return Some("is being created");
    }
    if record.spec.clone_of.is_some() || record.spec.restore_of.is_some() {
        return Some(
            "is a clone or a restored box, which cannot be started again: remove it first",
        );
    }
    if record.spec.remove_on_exit {
        return Some("was started with --rm: stopping it would remove it");
    }
    None
}

/// `nestbox subtree suspend`, run by the nestbox inside a nest box: suspend
/// every running box (module documentation). Every box is checked before
/// any is stopped; should one fail meanwhile, those already suspended are
/// resumed. Returns the names suspended.
///
/// # Errors
/// A box that cannot be suspended (named, with why), or a checkpoint that
/// fails.
pub fn suspend_all(reg: &Registry) -> Result<Vec<String>> {
    let _lock = subtree_lock(reg)?;
    let mut running = Vec::new();
    for r in reg.list()? {
        if crate::shell::is_shell_name(r.name()) {
            continue;
        }
        if let Some(problem) = unsuspendable(&r) {
            return Err(RuntimeError::Unsupported {
                name: r.name().to_string(),
                problem: format!(
                    "{problem}: the boxes inside a box for boxes are saved with it only when each was started with run -d"
                ),
            });
        }
        if r.state.effective_status() == Status::Running {
            crate::template::refuse_monitored(&r, "saved with the box it runs in")?;
            running.push(r);
        }
    }
    crate::shell::drain(reg, &|_| true)?;
    let mut done = Vec::new();
    for r in &running {
        if let Err(e) = suspend_one(reg, r) {
            if !done.is_empty() {
                crate::diag::warn_on_err(
                    Some(r.name()),
                    "resuming the boxes suspended before a failure",
                    resume_suspended(reg).map(|_| ()),
                );
            }
            return Err(e);
        }
        done.push(r.name().to_string());
    }
    Ok(done)
}

/// Checkpoint box `record`'s processes into its data directory and stop it.
fn suspend_one(reg: &Registry, record: &BoxRecord) -> Result<()> {
    let dir = suspended_dir(record);
    if dir.exists() {
        crate::registry::remove_tree(&dir)?;
    }
    let name = format!("suspend-{}", record.state.id);
    crate::checkpoint::checkpoint_processes(reg, record, &name, &dir, true, &mut || Ok(()))?;
    Ok(())
}

/// `nestbox subtree resume`: start every suspended box of `reg` again with
/// its processes as suspended (module documentation). A box that cannot be
/// resumed stays stopped, its checkpoint kept, and the others are resumed.
/// Returns the names resumed.
///
/// # Errors
/// The first box that could not be resumed, named.
pub fn resume_all(reg: &Registry) -> Result<Vec<String>> {
    let _lock = subtree_lock(reg)?;
    resume_suspended(reg)
}

/// One suspension or resumption at a time in a root: a `gc` resuming what a
/// killed save left and a clone resuming its boxes never both restore one.
fn subtree_lock(reg: &Registry) -> Result<nix::fcntl::Flock<fs::File>> {
    let dir = &reg.roots().run;
    fs::create_dir_all(dir).map_err(RuntimeError::io("mkdir", dir))?;
    crate::state::wait_for_lock(&dir.join("subtree.lock"))
}

/// [`resume_all`], the caller holding the subtree lock.
fn resume_suspended(reg: &Registry) -> Result<Vec<String>> {
    let mut done = Vec::new();
    let mut failed = None;
    for r in reg.list()? {
        let dir = suspended_dir(&r);
        if !dir.is_dir() {
            continue;
        }
        if r.state.effective_status() == Status::Running {
            // Started meanwhile: what was suspended is gone with its processes.
            crate::registry::remove_tree(&dir)?;
            continue;
        }
        match crate::checkpoint::restore_in_place(reg, &r, &dir) {
            Ok(_) => {
                crate::registry::remove_tree(&dir)?;
                done.push(r.name().to_string());
            }
            Err(e) => {
                tracing::warn!(box_name = r.name(), "resuming a suspended box: {e}");
                failed.get_or_insert(e.in_box(r.name()));
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(done),
    }
}

/// Before running nest box `record` is frozen to be saved: have the nestbox
/// inside suspend its boxes, if any runs. Returns whether it was asked to.
///
/// # Errors
/// What the nestbox inside refused or failed, in one line; its boxes then
/// run as before.
pub(crate) fn suspend_inside(reg: &Registry, record: &BoxRecord) -> Result<bool> {
    if !record.spec.nest || record.state.template.is_some() {
        return Ok(false);
    }
    let cgroup = crate::checkpoint::running_cgroup(record)?;
    if cgroup.procs_below()?.is_empty() {
        return Ok(false);
    }
    crate::phases::mark("subtree: suspending the boxes inside");
    run_inside(
        reg,
        record,
        "suspend",
        "could not suspend the boxes inside it",
    )?;
    crate::phases::mark("subtree: boxes inside suspended");
    Ok(true)
}

/// Once nest box `name` runs again (module documentation): have the nestbox
/// inside resume the boxes suspended in its state directory, if any.
///
/// # Errors
/// A box inside that could not be resumed, in one line (the others are).
pub(crate) fn resume_inside(reg: &Registry, name: &str) -> Result<()> {
    match reg.load(name) {
        Ok(record) => resume_inside_record(reg, &record),
        Err(_) => Ok(()),
    }
}

/// [`resume_inside`] of the box read as `record`.
fn resume_inside_record(reg: &Registry, record: &BoxRecord) -> Result<()> {
    if !nest_holds_suspended(record) {
        return Ok(());
    }
    crate::phases::mark("subtree: resuming the boxes inside");
    run_inside(
        reg,
        record,
        "resume",
        "could not resume the boxes inside it",
    )?;
    crate::phases::mark("subtree: boxes inside resumed");
    Ok(())
}

/// Whether box `name` is a nest box with boxes suspended inside it.
pub(crate) fn holds_suspended_boxes(reg: &Registry, name: &str) -> bool {
    reg.load(name).is_ok_and(|r| nest_holds_suspended(&r))
}

/// Whether the box read as `record` is a nest box with boxes suspended
/// inside it.
fn nest_holds_suspended(record: &BoxRecord) -> bool {
    record.spec.nest && holds_suspended(&crate::nest::state_dir(record))
}

/// [`resume_inside`] where a failure is logged and the caller goes on (a
/// save that failed: the nest box runs again, and so should its boxes).
pub(crate) fn resume_inside_or_warn(reg: &Registry, name: &str) {
    crate::diag::warn_on_err(
        Some(name),
        "resuming the boxes inside it",
        resume_inside(reg, name),
    );
}

/// `gc`: in each running nest box (not a template) that holds suspended
/// boxes and that no save is under way for (its box lock is free), resume
/// them — what a save killed with SIGKILL left (or a resume that failed,
/// tried again). Returns a line per nest box: what was resumed or why not.
///
/// # Errors
/// The box records cannot be read.
pub fn resume_left_suspended(reg: &Registry) -> Result<Vec<String>> {
    let mut lines = Vec::new();
    for r in reg.list()? {
        if r.state.template.is_some()
            || r.state.effective_status() != Status::Running
            || !nest_holds_suspended(&r)
        {
            continue;
        }
        let Some(_lock) = crate::clone::try_box_lock(&r) else {
            continue;
        };
        match resume_inside_record(reg, &r) {
            Ok(()) => lines.push(format!("{}: boxes left suspended inside resumed", r.name())),
            Err(e) => lines.push(format!("{}: {e}", r.name())),
        }
    }
    Ok(lines)
}

/// Whether the state directory `state` of a nest box (the data directory of
/// the nestbox inside) holds a suspended box.
fn holds_suspended(state: &Path) -> bool {
    fs::read_dir(state.join("boxes"))
        .is_ok_and(|entries| entries.flatten().any(|e| e.path().join(SUSPENDED).is_dir()))
}

/// Run `nestbox subtree VERB` in nest box `record`.
fn run_inside(reg: &Registry, record: &BoxRecord, verb: &str, what: &str) -> Result<()> {
    let (code, text) = crate::nest::run_nested(reg, record, &["subtree", verb], SUBTREE_TIMEOUT)?;
    if code == 0 {
        return Ok(());
    }
    let said = text
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(|l| crate::nest::sanitize(l.trim_start_matches("nestbox: error: ")))
        .unwrap_or_else(|| format!("exit code {code}"));
    Err(RuntimeError::WrongState {
        name: record.name().to_string(),
        problem: format!("{what}: {said}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_directory_holds_a_suspended_box_only_when_one_has_its_processes_kept() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!holds_suspended(dir.path()));
        fs::create_dir_all(dir.path().join("boxes/abc/layers")).unwrap();
        assert!(!holds_suspended(dir.path()));
        fs::create_dir_all(dir.path().join("boxes/def").join(SUSPENDED)).unwrap();
        assert!(holds_suspended(dir.path()));
    }
}
