//! The operations the CLI offers on boxes: run (foreground or detached), stop,
//! kill, rm, logs, inspect, stats and gc. Each works from the recorded state, so
//! any nestbox process can act on any box of the same root.

use std::fs::File;
use std::io::Read;
use std::os::fd::OwnedFd;
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
    spec.validate()?;
    let record = reg.create(spec)?;
    run_box(reg, &record, Mode::Foreground)
}

/// Start a box in the background under a detached monitor; returns once the
/// command runs (or with the reason it could not start).
pub fn run_detached(reg: &Registry, spec: &BoxSpec) -> Result<()> {
    spec.validate()?;
    let record = reg.create(spec)?;
    let (ready_r, ready_w) = pipe2(OFlag::O_CLOEXEC).map_err(RuntimeError::sys("pipe2"))?;
    // SAFETY: the CLI is single-threaded, so the child may run arbitrary code.
    match unsafe { fork() } {
        Err(e) => {
            let _ = reg.remove(&record);
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
            if keep > 3 {
                crate::process::close_fds_range(3, keep - 1);
            }
            crate::process::close_fds_from(keep + 1);
            become_daemon();
            let code = match run_box(reg, &record, Mode::Detached(ready_w)) {
                Ok(o) => o.exit_code,
                Err(e) => e.exit_code(),
            };
            std::process::exit(code)
        }
        Ok(ForkResult::Parent { .. }) => {
            drop(ready_w);
            wait_ready(reg, &record, ready_r)
        }
    }
}

/// Leave the caller's session and terminal; stdio to /dev/null.
pub(crate) fn become_daemon() {
    let _ = nix::unistd::setsid();
    let _ = nix::unistd::chdir("/");
    crate::process::stdio_to_dev_null();
}

/// How long a pool refill waits before it starts: boxes and clones often come
/// in bursts, and a refill takes locks (the kernel's RTNL for a network
/// namespace, a template's clone lock and a ptrace stop for a clone) and CPU
/// time that the next requests of the burst need.
const REFILL_DELAY: Duration = Duration::from_millis(100);

/// Run the pool refill `work` in a detached child process (its own session,
/// stdio on /dev/null, none of the caller's descriptors) and return at once.
/// The child waits [`REFILL_DELAY`] and runs under SCHED_IDLE, so it takes no
/// CPU time from the request that drew from the pool or from the next ones; on
/// a machine with no idle time the pool stays empty and requests are served
/// the slow way. The child exits 0 if `work` succeeds.
pub(crate) fn spawn_refill(work: impl FnOnce() -> Result<()>) {
    // Forked twice, so that the refill is nobody's child to reap (a long-lived
    // caller such as `nestbox serve` would otherwise collect zombies).
    // SAFETY: the callers (the CLI, a box's monitor, `nestbox serve`) are
    // single-threaded, so the children may run arbitrary code.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let _ = nix::sys::wait::waitpid(child, None);
            return;
        }
        Ok(nix::unistd::ForkResult::Child) => {}
        Err(_) => return,
    }
    // SAFETY: as above: this intermediate child is single-threaded too.
    let second = unsafe { nix::unistd::fork() };
    if !matches!(second, Ok(nix::unistd::ForkResult::Child)) {
        // SAFETY: _exit ends the intermediate child without running the
        // caller's exit handlers or flushing its buffers twice.
        unsafe { libc::_exit(0) }
    }
    crate::process::close_fds_from(3);
    become_daemon();
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sets this (new, single-threaded) process's own scheduling
    // policy; `param` is a valid sched_param for SCHED_IDLE.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    std::thread::sleep(REFILL_DELAY);
    std::process::exit(i32::from(work().is_err()))
}

fn wait_ready(reg: &Registry, record: &BoxRecord, ready: OwnedFd) -> Result<()> {
    let mut text = String::new();
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
    let _ = cleanup_dead(reg, record);
    Err(RuntimeError::Launch {
        code: 125,
        message: format!(
            "the monitor of box {:?} died while starting it",
            record.name()
        ),
    })
}

/// Stop a box: SIGTERM to its command (through init), SIGKILL after `timeout`.
/// Stopping a box that is not running does nothing.
pub fn stop(reg: &Registry, name: &str, timeout: Duration) -> Result<()> {
    let record = reg.load(name)?;
    let Some(target) = signal_target(&record) else {
        return settle(reg, &record);
    };
    let _ = kill(target, Signal::SIGTERM);
    let watched = match record.state.effective_status() {
        Status::Frozen => record.state.template.as_ref().map(|t| t.process),
        _ => record.state.init,
    };
    if !wait_until(timeout, || !watched.is_some_and(|p| p.alive())) {
        let _ = kill(target, Signal::SIGKILL);
    }
    if record.state.effective_status() == Status::Frozen
        && !crate::template::clones_of(reg, name)?.is_empty()
    {
        // Its init stays for the clones; the monitor records the end when it goes.
        return Ok(());
    }
    settle(reg, &record)
}

/// Send `signal` to the box's command (SIGKILL ends the whole box at once).
pub fn kill_box(reg: &Registry, name: &str, signal: Signal) -> Result<()> {
    let record = reg.load(name)?;
    let target =
        signal_target(&record).ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    kill(target, signal).map_err(RuntimeError::sys(format!("kill box {name:?}")))
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
        let _ = cg.set_frozen(false, Duration::from_secs(5));
    }
    match &record.state.template {
        Some(t) if t.process.alive() => Some(Pid::from_raw(t.process.pid)),
        _ => Some(init),
    }
}

/// Remove a box; a running one only with `force` (it is killed first). A frozen
/// box is thawed first (a frozen process cannot die); a template with live clones
/// keeps its init until they are gone (see [`crate::template::remove_box`]).
pub fn remove(reg: &Registry, name: &str, force: bool) -> Result<()> {
    let record = reg.load(name)?;
    if record.state.effective_status() == Status::Frozen {
        if !force {
            return Err(RuntimeError::StillRunning(name.to_string()));
        }
        if record.state.template.is_some() {
            return crate::template::remove_box(reg, &record);
        }
        if let Some(cg) = &record.state.cgroup {
            let _ = cg.set_frozen(false, Duration::from_secs(5));
        }
    }
    if let Some(init) = running_init(&record) {
        if !force {
            return Err(RuntimeError::StillRunning(name.to_string()));
        }
        crate::clone::learn_from_leaving_clone(reg, &record);
        let _ = kill(init, Signal::SIGKILL);
    } else if record.state.effective_status() == Status::Creating && !force {
        return Err(RuntimeError::StillRunning(name.to_string()));
    }
    settle(reg, &record)?;
    let record = reg.load(name)?;
    if let Some(cg) = &record.state.cgroup {
        let _ = cg.kill_all();
        cg.remove()?;
    }
    crate::network::release(reg.roots(), &record.state.id)?;
    reg.remove(&record)?;
    if let Some(of) = &record.spec.clone_of {
        wait_for_removed_template(reg, &of.template_box);
    }
    Ok(())
}

/// The last clone of a removed template takes the template's box with it: its
/// init, which lingered for the clones, sees them gone within half a second and
/// its monitor removes the box. Wait for that (bounded), so that what `rm` was
/// asked to remove is gone when it returns: a `network rm` right after must not
/// find the template's address still leased.
fn wait_for_removed_template(reg: &Registry, box_name: &str) {
    let going = || {
        reg.load(box_name).is_ok_and(|t| {
            t.state.template.as_ref().is_some_and(|i| i.removed)
                && crate::template::clones_of(reg, box_name).is_ok_and(|c| c.is_empty())
        })
    };
    if going() {
        wait_until(Duration::from_secs(5), || !going());
    }
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
    if wait_until(Duration::from_secs(10), || recorded(reg) || monitor_gone()) && recorded(reg) {
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
fn cleanup_dead(reg: &Registry, record: &BoxRecord) -> Result<()> {
    if let Some(cg) = &record.state.cgroup {
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

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
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

/// Everything known about a box, as JSON.
pub fn inspect(reg: &Registry, name: &str) -> Result<serde_json::Value> {
    let record = reg.load(name)?;
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
        "memory_sharing": crate::clone::sharing(reg, &record),
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
                || !records.iter().any(|t| {
                    t.state.template.is_some()
                        && r.name().starts_with(&crate::clone::pool_prefix(t))
                }))
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
            cleanup_dead(reg, &record)?;
            reg.remove(&record)?;
            report.boxes.push(record.name().to_string());
        } else {
            live_ids.push(record.state.id.clone());
        }
    }
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
            let age = std::fs::symlink_metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok());
            if age.is_none_or(|a| a < Duration::from_secs(5)) {
                continue;
            }
        } else if is_live(&name) {
            continue;
        }
        crate::registry::remove_tree(&dir)?;
        report.dirs.push(dir.display().to_string());
    }
    report.cgroups.sort();
    report.cgroups.dedup();
    Ok(report)
}
