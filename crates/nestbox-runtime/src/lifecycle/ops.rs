//! The operations the CLI offers on boxes: run (foreground or detached), stop,
//! kill, rm, logs, inspect, stats and gc. Each works from the recorded state, so
//! any nestbox process can act on any box of the same root.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use nestbox_cgroup::{Hierarchies, Stats};
use nix::fcntl::OFlag;
use nix::sys::signal::{kill, Signal};
use nix::unistd::{fork, pipe2, ForkResult, Pid};
use serde_json::json;

use crate::monitor::{run_box, Mode, Outcome};
use crate::registry::{BoxRecord, Registry};
use crate::spec::BoxSpec;
use crate::state::Status;
use crate::{Result, RuntimeError};

/// Run a box in the foreground: returns how it ended.
pub fn run_foreground(reg: &Registry, spec: &BoxSpec) -> Result<Outcome> {
    run_foreground_inner(reg, spec).map_err(|e| e.in_box(&spec.name))
}

fn run_foreground_inner(reg: &Registry, spec: &BoxSpec) -> Result<Outcome> {
    spec.validate()?;
    crate::phases::mark("cli: validated");
    if let Some(claimed) = crate::lifecycle::shell::claim(reg, spec, false)? {
        return claimed.wait();
    }
    crate::phases::mark("cli: no shell, cold start");
    let record = reg.create(spec)?;
    crate::phases::mark("cli: record created");
    run_box(reg, &record, Mode::Foreground)
}

/// Start a box in the background under a detached monitor; returns once the
/// command runs (or with the reason it could not start).
pub fn run_detached(reg: &Registry, spec: &BoxSpec) -> Result<()> {
    run_detached_inner(reg, spec).map_err(|e| e.in_box(&spec.name))
}

fn run_detached_inner(reg: &Registry, spec: &BoxSpec) -> Result<()> {
    spec.validate()?;
    if crate::lifecycle::shell::claim(reg, spec, true)?.is_some() {
        return Ok(());
    }
    let record = reg.create(spec)?;
    start_detached(reg, record, false)
}

/// Start box `record` again, in the background, from its spec: a box that
/// has exited (its writable layer as it is, e.g. after a rollback). Returns
/// once the command runs; a failure leaves the record, marked exited.
pub fn restart_detached(reg: &Registry, record: &BoxRecord) -> Result<()> {
    let mut record = record.clone();
    record.state = reg.update(record.name(), |s| {
        s.status = Status::Creating;
        s.monitor = Some(crate::liveness::ProcRef::current());
        s.init = None;
        s.started_at = None;
        s.finished_at = None;
        s.exit_code = None;
        s.oom_killed = false;
        s.error = None;
        s.final_stats = None;
        s.watchdog = None;
    })?;
    let name = record.name().to_string();
    start_detached(reg, record, true).map_err(|e| e.in_box(&name))
}

/// Start the pooled shell `record` under a detached monitor (see
/// [`crate::lifecycle::shell`]); returns once it is ready to be claimed.
pub(crate) fn start_shell(reg: &Registry, record: BoxRecord) -> Result<()> {
    let name = record.name().to_string();
    start_detached_as(reg, record, Start::Shell).map_err(|e| e.in_box(&name))
}

/// What a detached monitor starts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Start {
    /// A new box.
    First,
    /// A box that ran before.
    Again,
    /// A pooled shell.
    Shell,
}

fn start_detached(reg: &Registry, record: BoxRecord, again: bool) -> Result<()> {
    start_detached_as(reg, record, if again { Start::Again } else { Start::First })
}

fn start_detached_as(reg: &Registry, record: BoxRecord, kind: Start) -> Result<()> {
    spawn_monitor(reg, record, kind)?.wait(reg)
}

/// A box whose detached monitor is starting it: [`PendingStart::wait`] tells
/// whether it runs.
pub(crate) struct PendingStart {
    record: BoxRecord,
    ready: OwnedFd,
}

impl PendingStart {
    /// Wait for the monitor's word: the box runs, or its start failed (what
    /// the monitor left is cleaned up then, as [`run_detached`] does).
    pub(crate) fn wait(self, reg: &Registry) -> Result<()> {
        wait_ready(reg, &self.record, self.ready)
    }
}

/// [`run_detached`] in two steps, for a box no shell of the pool can serve (a
/// clone's shell): its record is made and its monitor started, and this
/// returns at once; the caller waits for the start later, so that several
/// boxes start at the same time.
pub(crate) fn begin_detached(reg: &Registry, spec: &BoxSpec) -> Result<PendingStart> {
    spec.validate().map_err(|e| e.in_box(&spec.name))?;
    let record = reg.create(spec).map_err(|e| e.in_box(&spec.name))?;
    spawn_monitor(reg, record, Start::First).map_err(|e| e.in_box(&spec.name))
}

/// Fork the detached monitor of `record`, which starts it as `kind` says.
fn spawn_monitor(reg: &Registry, record: BoxRecord, kind: Start) -> Result<PendingStart> {
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    // SAFETY: the CLI is single-threaded, so the child may run arbitrary code.
    match unsafe { fork() } {
        Err(e) => {
            crate::diag::warn_on_err(
                Some(record.name()),
                "removing the record",
                reg.remove(&record),
            );
            Err(RuntimeError::sys("fork monitor")(e))
        }
        Ok(ForkResult::Child) => {
            drop(ready_r);
            // The monitor outlives the caller: it must keep none of the caller's
            // descriptors but its ready pipe. Otherwise a lock the caller holds
            // (a template's clone lock while it starts clone shells) stays held
            // for the monitor's whole life should the caller die before
            // unlocking it, and `nestbox serve`'s listening socket keeps
            // accepting connections no one answers after the server died.
            let keep = std::os::fd::AsRawFd::as_raw_fd(&ready_w) as u32;
            // SAFETY: this child never returns to its callers (it ends with
            // exit below), so the objects up the stack that own the closed
            // descriptors are never used or dropped again; `reg` and `record`
            // hold no descriptor, and `ready_w` is kept.
            let closed = unsafe {
                crate::process::close_fds(3, keep.saturating_sub(1))
                    .and_then(|()| crate::process::close_fds_from(keep + 1))
            };
            if let Err(e) = closed {
                tracing::error!(box_name = record.name(), "{e}");
                std::process::exit(crate::error::EXIT_NESTBOX_ERROR);
            }
            crate::process::become_daemon();
            let started = match kind {
                Start::First => run_box(reg, &record, Mode::Detached(ready_w)),
                Start::Again => crate::monitor::rerun_box(reg, &record, Mode::Detached(ready_w)),
                Start::Shell => run_box(reg, &record, Mode::Shell(ready_w)),
            };
            let code = match started {
                Ok(o) => o.exit_code,
                Err(e) => {
                    // A start error was reported to the caller as well; one
                    // after the start has no one else to tell.
                    tracing::error!(box_name = record.name(), "{e}");
                    e.exit_code()
                }
            };
            std::process::exit(code)
        }
        Ok(ForkResult::Parent { .. }) => {
            drop(ready_w);
            Ok(PendingStart {
                record,
                ready: ready_r,
            })
        }
    }
}

fn wait_ready(reg: &Registry, record: &BoxRecord, ready: OwnedFd) -> Result<()> {
    let mut text = String::new();
    // A read error leaves `text` short, which reads as "the monitor died" below.
    let _ = File::from(ready).read_to_string(&mut text);
    if text == "ok" {
        return Ok(());
    }
    if let Some((code, msg)) = text.split_once('\t') {
        return Err(RuntimeError::Launch {
            code: code.parse().unwrap_or(125),
            message: msg.to_string(),
        });
    }
    // The monitor died before saying anything: clean up what it left.
    crate::diag::warn_on_err(
        Some(record.name()),
        "cleaning up",
        cleanup_dead(reg, record),
    );
    Err(RuntimeError::Launch {
        code: 125,
        message: format!(
            "the monitor of box {:?} died while starting it",
            record.name()
        ),
    })
}

/// What a higher layer knows about a box that its life does not: a template's
/// clones, what a leaving clone teaches its template. The operations below take
/// it as a parameter, so that this layer never imports the templates layer;
/// [`PlainBoxes`] knows of no relation (every box is a plain box).
pub trait Relations {
    /// Whether the frozen box `record` must keep its init after its process was
    /// stopped (a template whose clones live in its pid namespace).
    fn keeps_init(&self, reg: &Registry, record: &BoxRecord) -> Result<bool>;
    /// Remove the frozen box `record` when the higher layer owns its removal (a
    /// template: its pool first, its init kept for its clones). `None`: remove
    /// it as a plain box.
    fn remove_frozen(&self, reg: &Registry, record: &BoxRecord) -> Option<Result<()>>;
    /// Called just before a running box is killed for `rm -f`.
    fn before_removal(&self, reg: &Registry, record: &BoxRecord);
    /// More to say about a box in `inspect` (`memory_sharing`).
    fn inspect_extra(&self, reg: &Registry, record: &BoxRecord) -> Option<serde_json::Value>;
    /// Called once `record`'s box is removed (`rm`), cgroup, address and record gone.
    fn after_removal(&self, reg: &Registry, record: &BoxRecord);
}

/// No relations: every box is a plain box.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainBoxes;

impl Relations for PlainBoxes {
    fn keeps_init(&self, _: &Registry, _: &BoxRecord) -> Result<bool> {
        Ok(false)
    }
    fn remove_frozen(&self, _: &Registry, _: &BoxRecord) -> Option<Result<()>> {
        None
    }
    fn before_removal(&self, _: &Registry, _: &BoxRecord) {}
    fn inspect_extra(&self, _: &Registry, _: &BoxRecord) -> Option<serde_json::Value> {
        None
    }
    fn after_removal(&self, _: &Registry, _: &BoxRecord) {}
}

/// Stop a box: SIGTERM to its command (through init), SIGKILL after `timeout`.
/// Stopping a box that is not running does nothing.
pub fn stop(reg: &Registry, name: &str, timeout: Duration) -> Result<()> {
    stop_with(reg, &PlainBoxes, name, timeout)
}

/// [`stop`], with what `rel` knows about the box.
pub fn stop_with(reg: &Registry, rel: &dyn Relations, name: &str, timeout: Duration) -> Result<()> {
    stop_inner(reg, rel, name, timeout).map_err(|e| e.in_box(name))
}

fn stop_inner(reg: &Registry, rel: &dyn Relations, name: &str, timeout: Duration) -> Result<()> {
    let record = reg.load(name)?;
    let Some(target) = signal_target(&record) else {
        return settle(reg, &record);
    };
    let watched = match record.state.effective_status() {
        Status::Frozen => record.state.template.as_ref().map(|t| t.process),
        _ => record.state.init,
    };
    // Its end is seen the moment it comes through a pidfd (opened before the
    // signal, while it is sure to run); polling is the fallback.
    let pidfd = watched.as_ref().and_then(crate::process::pidfd_of);
    // ESRCH: the box ended meanwhile, which is what stop wants.
    let _ = kill(target, Signal::SIGTERM);
    crate::phases::mark("stop: SIGTERM sent");
    let gone = || !watched.is_some_and(|p| p.alive());
    let ended = match &pidfd {
        Some(fd) => match nestbox_sys::pidfd::wait_ended(fd.as_fd(), Some(timeout)) {
            Ok(ended) => ended || gone(),
            Err(_) => wait_until(timeout, gone),
        },
        None => wait_until(timeout, gone),
    };
    if !ended {
        // As above: ESRCH means it is gone.
        let _ = kill(target, Signal::SIGKILL);
    }
    crate::phases::mark("stop: init ended");
    if record.state.effective_status() == Status::Frozen && rel.keeps_init(reg, &record)? {
        // Its init stays for the clones; the monitor records the end when it goes.
        return Ok(());
    }
    settle(reg, &record)
}

/// Send `signal` to the box's command (SIGKILL ends the whole box at once).
pub fn kill_box(reg: &Registry, name: &str, signal: Signal) -> Result<()> {
    kill_inner(reg, name, signal).map_err(|e| e.in_box(name))
}

fn kill_inner(reg: &Registry, name: &str, signal: Signal) -> Result<()> {
    let record = reg.load(name)?;
    let target =
        signal_target(&record).ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    kill(target, signal).map_err(RuntimeError::sys(format!("kill {}", signal.as_str())))
}

/// The host pid of the process that box `name` sees as `box_pid` (default:
/// its command, pid 2), for a debugger attached from outside (`nestbox
/// debug`). The box must run, not be frozen (a frozen process cannot be
/// attached to).
pub fn host_pid_of(reg: &Registry, name: &str, box_pid: Option<i32>) -> Result<i32> {
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    if running_init(&record).is_none() {
        return Err(RuntimeError::NotRunning(name.to_string()));
    }
    if record.state.effective_status() == Status::Frozen {
        return Err(RuntimeError::WrongState {
            name: name.to_string(),
            problem: "is frozen: a debugger cannot attach to its processes".into(),
        });
    }
    let want = box_pid.unwrap_or(crate::init::ADOPTED_PID);
    let procs = record
        .state
        .cgroup
        .as_ref()
        .map(|c| c.procs())
        .transpose()?
        .unwrap_or_default();
    procs
        .into_iter()
        .find(|&p| {
            crate::process::ns_pids(std::path::Path::new(&format!("/proc/{p}")))
                .and_then(|n| n.last().copied())
                == Some(want)
        })
        .ok_or_else(|| RuntimeError::InvalidInput(format!("box {name:?} has no process {want}")))
}

/// Where a box's signals go: its init, which forwards them to the command. A
/// frozen box is thawed first (a frozen process takes no signal), and a template's
/// signals go straight to its process: its init must stay, for its clones' sake.
fn signal_target(record: &BoxRecord) -> Option<Pid> {
    let init = running_init(record)?;
    if record.state.effective_status() != Status::Frozen {
        return Some(init);
    }
    if let Some(cg) = &record.state.cgroup {
        let thawed = cg.set_frozen(false, Duration::from_secs(5));
        crate::diag::warn_on_err(Some(record.name()), "thawing", thawed);
    }
    match &record.state.template {
        Some(t) if t.process.alive() => Some(Pid::from_raw(t.process.pid)),
        _ => Some(init),
    }
}

/// Remove a box; a running one only with `force` (it is killed first). A frozen
/// box is thawed first (a frozen process cannot die); a template with live clones
/// keeps its init until they are gone (see [`Relations::remove_frozen`]).
pub fn remove(reg: &Registry, name: &str, force: bool) -> Result<()> {
    remove_with(reg, &PlainBoxes, name, force)
}

/// [`remove`], with what `rel` knows about the box.
pub fn remove_with(reg: &Registry, rel: &dyn Relations, name: &str, force: bool) -> Result<()> {
    remove_inner(reg, rel, name, force).map_err(|e| e.in_box(name))
}

fn remove_inner(reg: &Registry, rel: &dyn Relations, name: &str, force: bool) -> Result<()> {
    match begin_removal(reg, rel, name, force)? {
        Removal::Done => Ok(()),
        Removal::Ending => finish_removal(reg, rel, name),
    }
}

/// Remove boxes `names`, each as [`remove_with`] removes it, but the running
/// ones (with `force`) are all killed first and then removed one by one:
/// their ends (each monitor recording its box's end, the kernel tearing down
/// each box's namespaces and veth pair) overlap instead of following one
/// another. One result per name, in order; a failure leaves the other names
/// to be removed.
pub fn remove_many_with(
    reg: &Registry,
    rel: &dyn Relations,
    names: &[String],
    force: bool,
) -> Vec<Result<()>> {
    let begun: Vec<Result<Removal>> = names
        .iter()
        .map(|name| begin_removal(reg, rel, name, force).map_err(|e| e.in_box(name)))
        .collect();
    names
        .iter()
        .zip(begun)
        .map(|(name, begun)| match begun? {
            Removal::Done => Ok(()),
            Removal::Ending => finish_removal(reg, rel, name).map_err(|e| e.in_box(name)),
        })
        .collect()
}

/// Where a removal stands after its first step.
enum Removal {
    /// Removed already (a template, removed by its relations).
    Done,
    /// Its processes are killed (or were gone): [`finish_removal`] is left.
    Ending,
}

/// The first step of a removal: refuse a running box without `force`, thaw a
/// frozen one, and kill the box's init.
fn begin_removal(reg: &Registry, rel: &dyn Relations, name: &str, force: bool) -> Result<Removal> {
    let record = reg.load(name)?;
    if record.state.effective_status() == Status::Frozen {
        if !force {
            return Err(RuntimeError::StillRunning(name.to_string()));
        }
        if let Some(done) = rel.remove_frozen(reg, &record) {
            return done.map(|()| Removal::Done);
        }
        if let Some(cg) = &record.state.cgroup {
            let thawed = cg.set_frozen(false, Duration::from_secs(5));
            crate::diag::warn_on_err(Some(name), "thawing", thawed);
        }
    }
    if let Some(init) = running_init(&record) {
        if !force {
            return Err(RuntimeError::StillRunning(name.to_string()));
        }
        rel.before_removal(reg, &record);
        // ESRCH: it died meanwhile, as wanted.
        let _ = kill(init, Signal::SIGKILL);
    } else if record.state.effective_status() == Status::Creating && !force {
        return Err(RuntimeError::StillRunning(name.to_string()));
    }
    Ok(Removal::Ending)
}

/// The rest of a removal once the box's init is killed: wait for its
/// monitor, then remove its cgroup, network lease and record.
fn finish_removal(reg: &Registry, rel: &dyn Relations, name: &str) -> Result<()> {
    let record = reg.load(name)?;
    settle(reg, &record)?;
    let record = reg.load(name)?;
    if let Some(cg) = &record.state.cgroup {
        // A process that survives the kill makes the removal fail, which reports it.
        let _ = cg.kill_all();
        cg.remove()?;
    }
    crate::network::release(reg.roots(), &record.state.id)?;
    reg.remove(&record)?;
    rel.after_removal(reg, &record);
    Ok(())
}

/// The host pid of a running box's init.
fn running_init(record: &BoxRecord) -> Option<Pid> {
    match (record.state.effective_status(), record.state.init) {
        (Status::Running | Status::Frozen, Some(p)) if p.alive() => Some(Pid::from_raw(p.pid)),
        _ => None,
    }
}

/// Wait for the monitor to record the end of a box whose init is gone; if the
/// monitor is dead too, release the box's resources here.
fn settle(reg: &Registry, record: &BoxRecord) -> Result<()> {
    let name = record.name();
    let monitor_gone = || {
        !reg.load(name)
            .ok()
            .and_then(|r| r.state.monitor)
            .is_some_and(|m| m.alive())
    };
    let recorded = |r: &Registry| reg_status(r, name) == Some(Status::Exited);
    // Checked every millisecond at first: the monitor records the end a few
    // milliseconds after init's, and a rollback waits for it with the box down.
    let done = || recorded(reg) || monitor_gone();
    if (wait_every(Duration::from_millis(50), Duration::from_millis(1), &done)
        || wait_until(Duration::from_secs(10), &done))
        && recorded(reg)
    {
        return Ok(());
    }
    let record = reg.load(name)?;
    if record.state.effective_status() == Status::Dead {
        cleanup_dead(reg, &record)?;
    }
    Ok(())
}

fn reg_status(reg: &Registry, name: &str) -> Option<Status> {
    reg.load(name).ok().map(|r| r.state.status)
}

/// Free what a dead box (monitor gone) still holds and mark it dead.
pub(crate) fn cleanup_dead(reg: &Registry, record: &BoxRecord) -> Result<()> {
    if let Some(cg) = &record.state.cgroup {
        // A process that survives the kill makes the removal fail, which reports it.
        let _ = cg.kill_all();
        cg.remove()?;
    }
    crate::network::release(reg.roots(), &record.state.id)?;
    reg.update(record.name(), |s| {
        s.status = Status::Dead;
        s.cgroup = None;
        s.error.get_or_insert_with(|| "its monitor died".into());
    })
    .map(|_| ())
}

/// Whether `done` holds within `limit`, checked every `pause`.
fn wait_every(limit: Duration, pause: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(pause);
    }
    done()
}

pub(crate) fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    let mut pause = Duration::from_millis(2);
    while Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    done()
}

/// Resource figures: live from the cgroup while running, else the last recorded.
pub fn stats(reg: &Registry, name: &str) -> Result<Stats> {
    stats_inner(reg, name).map_err(|e| e.in_box(name))
}

fn stats_inner(reg: &Registry, name: &str) -> Result<Stats> {
    let record = reg.load(name)?;
    if let (Some(cg), Some(_)) = (&record.state.cgroup, running_init(&record)) {
        return Ok(cg.stats()?);
    }
    record
        .state
        .final_stats
        .clone()
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))
}

/// Same-page merging figures of a running box's processes (`None` when it is
/// not running).
pub fn ksm(reg: &Registry, name: &str) -> Result<Option<crate::ksm::BoxKsm>> {
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    Ok(match (&record.state.cgroup, running_init(&record)) {
        (Some(cg), Some(_)) => Some(crate::ksm::of_processes(&cg.procs().unwrap_or_default())),
        _ => None,
    })
}

/// Everything known about a box, as JSON.
pub fn inspect(reg: &Registry, name: &str) -> Result<serde_json::Value> {
    inspect_with(reg, &PlainBoxes, name)
}

/// [`inspect`], with what `rel` knows about the box.
pub fn inspect_with(reg: &Registry, rel: &dyn Relations, name: &str) -> Result<serde_json::Value> {
    let record = reg.load(name).map_err(|e| e.in_box(name))?;
    let status = record.state.effective_status();
    let pids = match (&record.state.cgroup, running_init(&record)) {
        (Some(cg), Some(_)) => cg.procs().unwrap_or_default(),
        _ => vec![],
    };
    let mut state = serde_json::to_value(&record.state).unwrap_or_default();
    state["status"] = json!(status.as_str());
    state["monitor_pid"] = json!(record.state.monitor.map(|m| m.pid));
    state["init_pid"] = json!(record.state.init.map(|m| m.pid));
    Ok(json!({
        "name": record.name(),
        "id": record.state.id,
        "spec": record.spec,
        "state": state,
        "pids": pids,
        "cgroup": record.state.cgroup.as_ref().map(|c| c.paths()),
        "limits": record.spec.limits,
        "exit_code": record.state.exit_code,
        "oom_killed": record.state.oom_killed,
        "log_path": record.log_path(),
        // Where its `trace` monitors write (`--monitor trace:…`), if it has one.
        "trace_log": record
            .spec
            .monitors
            .iter()
            .any(|m| m.starts_with("trace:") || m.starts_with("packets:"))
            .then(|| crate::monitor::trace_log(&record)),
        "memory_sharing": rel.inspect_extra(reg, &record),
    }))
}

/// What `gc` removed.
#[derive(Debug, Default)]
pub struct GcReport {
    /// Dead boxes removed with all they held.
    pub boxes: Vec<String>,
    /// Cgroups no box owns.
    pub cgroups: Vec<String>,
    /// Record or data directories no box owns.
    pub dirs: Vec<String>,
    /// Boxes whose network leftovers (veth, address, rules, classes) were released.
    pub network: Vec<String>,
    /// What `gc` inside each running nest box collected (`BOX: line`), for
    /// its boxes that died (see [`crate::lifecycle::nest::gc_inside`]).
    pub nested: Vec<String>,
}

/// Remove every box whose monitor died, and every leftover no live box owns:
/// cgroups named after unknown ids, half-made or half-removed records, data
/// directories of unknown ids. Boxes that exited normally are kept (use `rm`).
pub fn gc(reg: &Registry) -> Result<GcReport> {
    let mut report = GcReport::default();
    let mut live_ids = Vec::new();
    let records = reg.list()?;
    // A pooled clone is hidden from ps, so no one can rm it: one that ended, or
    // whose template box is gone (its pool outlived it: a pooled shell whose
    // maker was killed, a refill racing with the template's removal), is
    // collected here.
    let unclaimable = |r: &BoxRecord| {
        r.is_pooled()
            && (r.state.effective_status() == Status::Exited
                || !records
                    .iter()
                    .any(|t| t.state.template.is_some() && r.name().starts_with(&t.pool_prefix())))
    };
    for record in &records {
        if record.state.effective_status() != Status::Dead && unclaimable(record) {
            match remove(reg, record.name(), true) {
                Ok(()) => report.boxes.push(record.name().to_string()),
                Err(RuntimeError::NoSuchBox(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    for record in reg.list()? {
        if record.state.effective_status() == Status::Dead {
            match cleanup_dead(reg, &record) {
                Ok(()) => {}
                // Renamed meanwhile (a shell made ready or claimed) or removed
                // by another: not this listing's to collect.
                Err(RuntimeError::NoSuchBox(_)) => continue,
                Err(e) => return Err(e),
            }
            reg.remove(&record)?;
            report.boxes.push(record.name().to_string());
        } else {
            live_ids.push(record.state.id.clone());
        }
    }
    // A box whose monitor removes it right now (a claimed shell's, after
    // answering its caller) still holds its cgroup, address and layer.
    live_ids.extend(reg.young_tomb_ids());
    // A box's cgroup, address and layers are made after its record is visible
    // (created, or renamed by a claim); a box started while this runs is not in
    // the listing above. So before anything is released as no box's, its id is
    // looked up again in fresh listings (two: a directory read may miss a
    // record renamed while it reads).
    let known = std::cell::RefCell::new(live_ids.clone());
    let is_live = |id: &str| {
        if known.borrow().iter().any(|l| l == id) {
            return true;
        }
        for _ in 0..2 {
            let now: Vec<String> = reg
                .list()
                .map(|l| l.into_iter().map(|r| r.state.id).collect())
                .unwrap_or_default();
            let hit = now.iter().any(|l| l == id);
            known.borrow_mut().extend(now);
            if hit {
                return true;
            }
        }
        false
    };
    if let Ok(h) = Hierarchies::detect() {
        // Cgroups of other roots count as live: only this root's own are collected.
        let roots = reg.roots();
        let live = |cg_id: &str| roots.box_id_of_cgroup(cg_id).is_none_or(&is_live);
        for cg in nestbox_cgroup::find_stale(&h, &live) {
            // As above: the removal reports a process that survived.
            let _ = cg.kill_all();
            cg.remove()?;
            report
                .cgroups
                .extend(cg.paths().into_values().map(|p| p.display().to_string()));
        }
    }
    let live_now: Vec<String> = reg
        .list()?
        .into_iter()
        .map(|r| r.state.id)
        .chain(live_ids.iter().cloned())
        .collect();
    for id in crate::network::gc(reg.roots(), &live_now, &is_live)? {
        report.network.push(id);
    }
    let live_now: Vec<String> = reg
        .list()?
        .into_iter()
        .map(|r| r.state.id)
        .chain(live_now)
        .collect();
    for dir in reg.orphans(&live_now) {
        // A record being made (.new-) or removed (.rm-) by another command right
        // now is no leftover (both take well under a second): only one its maker
        // left behind, dying, is. A layer directory made by a box started
        // meanwhile belongs to a live box.
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if name.starts_with(".new-") || name.starts_with(".rm-") {
            // Made, or renamed into place by a removal, that long ago.
            let age = crate::registry::age(&dir);
            if age.is_none_or(|a| a < Duration::from_secs(5)) {
                continue;
            }
        } else if is_live(&name) {
            continue;
        }
        // A data directory no box owns may still have its disk mounted.
        crate::disk::release(&dir)?;
        crate::registry::remove_tree(&dir)?;
        report.dirs.push(dir.display().to_string());
    }
    report.cgroups.sort();
    report.cgroups.dedup();
    // The boxes inside the running nest boxes: their own gc, in each.
    let records = reg.list()?;
    for record in crate::lifecycle::nest::running_nest_boxes(&records).values() {
        match crate::lifecycle::nest::gc_inside(reg, record, NESTED_GC_TIMEOUT) {
            Ok(lines) => report.nested.extend(lines),
            Err(e) => report.nested.push(format!("{}: {e}", record.name())),
        }
    }
    Ok(report)
}

/// How long `gc` waits for the `gc` inside one nest box.
const NESTED_GC_TIMEOUT: Duration = Duration::from_secs(60);
