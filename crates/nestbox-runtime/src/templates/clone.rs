//! `nestbox clone`: boxes forked from a template's frozen process.
//!
//! For each clone a *shell* is started first: a full box (monitor, cgroup, its own
//! writable layer over the template's frozen files, its own pid, mount, network,
//! uts, ipc, cgroup and user namespaces) whose init waits for a process. Then the
//! template's process is made to fork itself by ptrace syscall injection
//! ([`nestbox_remote`]): the child enters the shell's namespaces and cgroup, its
//! descriptors are re-targeted (see docs/clone-fds.md), it forks once more so the
//! clone is born in the shell's pid namespace, and is adopted by the shell's init.
//! Memory is shared copy-on-write with the template by the kernel's fork.
//!
//! If anything fails, every shell this call made is removed and the template is
//! left as it was (frozen, untraced).

use std::fs::File;
use std::os::fd::OwnedFd;
use std::time::Duration;

use nestbox_cgroup::Limits;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::liveness::ProcRef;
use crate::registry::{BoxRecord, Registry};
use crate::spec::{BoxSpec, CloneSource};
use crate::state::CloneInfo;
use crate::{Result, RuntimeError};

/// How long the template's freezer may take to thaw or freeze again.
const FREEZER_TIMEOUT: Duration = Duration::from_secs(5);
/// How many clone shells start at the same time (each is started by a
/// monitor process of its own).
const SHELLS_AT_ONCE: usize = 3;
/// How long the template's init may take to reap what the forks left it.
const INTERMEDIATES_REAPED_TIMEOUT: Duration = Duration::from_secs(2);
/// Processes each clone adds (monitor, init, the clone's process).
const PIDS_PER_CLONE: u64 = 3;
/// Memory each clone adds before it writes (monitor, init, page tables, layer), a
/// conservative estimate used to refuse counts the host cannot hold.
const MEMORY_PER_CLONE: u64 = 8 << 20;

/// What the user asked of `nestbox clone`.
#[derive(Debug, Clone, Default)]
pub struct CloneRequest {
    /// Names of the clones (generated when empty; then `count` clones).
    pub names: Vec<String>,
    /// Number of clones.
    pub count: usize,
    /// Limits for each clone (`None`: the template's).
    pub limits: Option<Limits>,
    /// Signal delivered to each clone's process right after the fork.
    pub on_clone_signal: Option<Signal>,
    /// Fork for the template's pool: the clones stay stopped, hidden, under
    /// pool names, until a later `clone` claims them.
    pub pooled: bool,
    /// Give each clone a network namespace with loopback only (`--network
    /// none`) instead of the template's network: no address, veth or
    /// bandwidth class; its listening sockets answer on its loopback.
    pub without_network: bool,
    /// Put each clone on this network (`--network NAME`; `bridge` or
    /// `default`: the root's default network) instead of its template's.
    pub network: Option<String>,
    /// Size of each clone's writable layer (`--disk`; `None`: the template's).
    pub disk: Option<u64>,
    /// Fork each clone now, never claim one from the pool: the shell's monitor
    /// is then forked by the calling process, so that when the caller exits the
    /// monitor is adopted by the caller's subreaper (`nestbox-runc`, whose
    /// caller — conmon, the containerd shim — waits on it).
    pub fork_now: bool,
    /// The clone's stdin, stdout and stderr (`None`: `/dev/null` and its
    /// box's log). The template's process's descriptors 0, 1 and 2 become
    /// duplicates of these in each clone (`nestbox-runc` gives the streams
    /// its caller gave it: conmon's pipes, or a terminal). Implies `fork_now`
    /// semantics for the pool: such a clone is always forked.
    pub stdio: Option<std::sync::Arc<[OwnedFd; 3]>>,
}

/// One clone made.
#[derive(Debug, Clone)]
pub struct Cloned {
    /// Box name.
    pub name: String,
    /// Host pid of its process.
    pub pid: i32,
    /// Milliseconds from stopping the template's process to the clone running
    /// (for a clone claimed from the pool: the claim).
    pub fork_ms: f64,
    /// Its address on the box network, if it has one.
    pub address: Option<String>,
    /// Host pids of its other processes (a template with a process tree).
    pub others: Vec<i32>,
}

/// What a claim from the pool leaves for after the caller has its answer: the
/// claimed clones' names in the network's hosts file (only other boxes look
/// them up there) and the pool's refill. [`FollowUp::finish`] does it.
#[derive(Debug, Default)]
#[must_use = "the claimed clones' hosts entries and the pool refill wait for finish()"]
pub struct FollowUp {
    /// (box id, new name) of each claimed clone on a bridge network.
    hosts: Vec<(String, String)>,
    /// The templates whose pools were drawn from.
    pub(crate) refill: Vec<String>,
}

impl FollowUp {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty() && self.refill.is_empty()
    }

    /// Take over the work of `other` too.
    pub fn absorb(&mut self, other: FollowUp) {
        self.hosts.extend(other.hosts);
        for t in other.refill {
            if !self.refill.contains(&t) {
                self.refill.push(t);
            }
        }
    }

    /// Name the claimed clones in the hosts file and start the pool's refill
    /// in the background.
    pub fn finish(self, reg: &Registry) -> Result<()> {
        for template in &self.refill {
            spawn_refill(reg, template);
        }
        if self.hosts.is_empty() {
            return Ok(());
        }
        let mut first_error = None;
        for (id, name) in &self.hosts {
            if !still_running(reg, id, name) {
                continue;
            }
            // The template's network, which may be a user-defined one.
            let net = match crate::network::view_of_box(reg.roots(), id)? {
                Some(n) => n,
                None => match crate::network::view(reg.roots())? {
                    Some(n) => n,
                    None => continue,
                },
            };
            if let Err(e) = net.rename(id, &[name.as_str()]) {
                // The clone may have ended or been removed since the check
                // above: its address is released before its record says so
                // (the monitor releases, then records the end; `rm` releases,
                // then removes the record). A clone still running that has no
                // address is a real error.
                if still_running(reg, id, name) {
                    first_error.get_or_insert(RuntimeError::from(e).in_box(name));
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Whether the box `name` is still the clone with id `id` and its init lives.
/// A box's address is only ever released after its init has died, so a box
/// for which this holds must have its address.
fn still_running(reg: &Registry, id: &str, name: &str) -> bool {
    reg.load(name)
        .is_ok_and(|r| r.state.id == id && r.state.init.is_some_and(|p| p.alive()))
}

/// Make the clones of template `template`: claimed from its pool first (when the
/// request sets no limits of its own), forked now for the rest; a pool that was
/// drawn from is refilled in the background.
pub fn clone_template(reg: &Registry, template: &str, req: &CloneRequest) -> Result<Vec<Cloned>> {
    let (made, follow_up) = clone_template_answer_first(reg, template, req)?;
    follow_up.finish(reg)?;
    Ok(made)
}

/// [`clone_template`] for a caller that answers its client before the
/// bookkeeping of a claim ([`FollowUp`]): when this returns, each clone is
/// running under its name with its hostname, and its record says so.
pub fn clone_template_answer_first(
    reg: &Registry,
    template: &str,
    req: &CloneRequest,
) -> Result<(Vec<Cloned>, FollowUp)> {
    let t = match crate::template::load_frozen(reg, template) {
        Ok(t) => t,
        // Gone (a reboot, its box removed): started again from its saved
        // checkpoint, if it has one (`template save`, `freeze --persist`).
        Err(e @ (RuntimeError::NoSuchTemplate(_) | RuntimeError::TemplateRemoved(_))) => {
            match crate::checkpoint::revive_template(reg, template)? {
                Some(t) => t,
                None => return Err(e),
            }
        }
        Err(e) => return Err(e),
    };
    if req.count == 0 {
        return Err(RuntimeError::InvalidInput(
            "the clone count must be at least 1".into(),
        ));
    }
    // A single clone is checked only if it has to be forked (below): a claim
    // from the pool takes nothing new from the host.
    if req.count > 1 {
        check_capacity(req.count, req.limits.as_ref().unwrap_or(&t.spec.limits))?;
    }
    let names = clone_names(reg, &t, req)?;
    let mut made = Vec::new();
    let mut follow_up = FollowUp::default();
    let mut rest = Vec::new();
    for name in names {
        // Pooled clones have the template's settings: a request with its own is forked.
        let claimed = if req.pooled
            || req.fork_now
            || req.limits.is_some()
            || req.without_network
            || req.network.is_some()
            || req.disk.is_some()
            || req.stdio.is_some()
        {
            None
        } else {
            claim_pooled(reg, &t, &name, req, &mut follow_up)?
        };
        match claimed {
            Some(c) => made.push(c),
            None => rest.push(name),
        }
    }
    if !made.is_empty() {
        follow_up.refill.push(template.to_string());
    }
    if rest.is_empty() {
        return with_boxes_inside(reg, &t, made, follow_up);
    }
    let fresh = CloneRequest {
        names: rest.clone(),
        count: rest.len(),
        ..req.clone()
    };
    match fork_fresh(reg, &t, &fresh) {
        Ok(forked) => made.extend(forked),
        Err(e) => {
            // The claimed clones are made and stay: their bookkeeping is done.
            crate::diag::warn_on_err(None, "after a clone", follow_up.finish(reg));
            return Err(e);
        }
    }
    with_boxes_inside(reg, &t, made, follow_up)
}

/// Clones `made` of nest template `t` with the boxes suspended inside it
/// when it was frozen (`subtree`) running again in each. Should that fail
/// in one, every clone made here is removed and the clone fails.
fn with_boxes_inside(
    reg: &Registry,
    t: &BoxRecord,
    made: Vec<Cloned>,
    follow_up: FollowUp,
) -> Result<(Vec<Cloned>, FollowUp)> {
    if !t.spec.nest {
        return Ok((made, follow_up));
    }
    if let Err(e) = resume_boxes_inside(reg, &made) {
        crate::diag::warn_on_err(None, "after a clone", follow_up.finish(reg));
        return Err(e);
    }
    Ok((made, follow_up))
}

/// The boxes suspended inside nest clones `made` running again in each; if
/// that fails in one, every clone of `made` is removed.
pub(crate) fn resume_boxes_inside(reg: &Registry, made: &[Cloned]) -> Result<()> {
    let resumed = made
        .iter()
        .try_for_each(|c| crate::subtree::resume_inside(reg, &c.name));
    if resumed.is_err() {
        for c in made {
            crate::diag::warn_on_err(
                Some(&c.name),
                "removing a clone whose boxes inside could not be resumed",
                crate::templates::ops::remove(reg, &c.name, true),
            );
        }
    }
    resumed
}

/// Fork `req.names` now (each in a new shell), under the template's clone lock.
fn fork_fresh(reg: &Registry, t: &BoxRecord, req: &CloneRequest) -> Result<Vec<Cloned>> {
    check_capacity(req.count, req.limits.as_ref().unwrap_or(&t.spec.limits))?;
    let _lock = clone_lock(t)?;
    // The template may have been removed while this waited for the lock (a
    // pool refill runs late at idle priority): then nothing is made.
    let current = reg.load(t.name())?;
    if current.state.id != t.state.id
        || current.state.effective_status() != crate::state::Status::Frozen
        || current.state.template.as_ref().is_none_or(|i| i.removed)
    {
        return Err(RuntimeError::TemplateRemoved(t.template_name().to_string()));
    }
    let names = req.names.clone();
    let mut shells = Vec::new();
    let result = start_shells(reg, t, &names, req, &mut shells)
        .and_then(|()| fork_into_shells(reg, t, &shells, req));
    if result.is_err() {
        for name in &shells {
            if reg.load(name).is_ok() {
                let removed = crate::templates::ops::remove(reg, name, true);
                crate::diag::warn_on_err(Some(name), "removing a shell of a failed clone", removed);
            }
        }
    }
    result
}

/// How many of the latest claimed clones a refill learns the working set from.
const WORKING_SET_SOURCES: usize = 4;

/// Where template box `t`'s clones' working set is recorded.
fn working_set_file(reg: &Registry, t: &BoxRecord) -> std::path::PathBuf {
    working_set_file_of(reg, t.name())
}

fn working_set_file_of(reg: &Registry, template_box: &str) -> std::path::PathBuf {
    reg.roots().box_run(template_box).join("working-set")
}

/// Before claimed clone `r` is removed, add what its process touched to its
/// template's working set, if the template keeps a pool (best effort): clones
/// that serve a request and go are what a pool's working set is learned from.
pub(crate) fn learn_from_leaving_clone(reg: &Registry, r: &BoxRecord) {
    let (Some(src), Some(process)) = (
        &r.spec.clone_of,
        r.state.clone.as_ref().and_then(|c| c.process),
    ) else {
        return;
    };
    if r.is_pooled() || !process.alive() {
        return;
    }
    let pooling = reg.load(&src.template_box).is_ok_and(|t| {
        t.state
            .template
            .as_ref()
            .is_some_and(|i| i.pool > 0 && !i.removed)
    });
    if pooling {
        let file = working_set_file_of(reg, &src.template_box);
        let recorded = crate::working_set::record(&file, process.pid);
        crate::diag::warn_on_err(Some(r.name()), "recording the working set", recorded);
    }
}

/// The name prefix of template box `t`'s pooled clones: a claim finds them by
/// their directory names, without reading any other record.
fn clone_names(reg: &Registry, t: &BoxRecord, req: &CloneRequest) -> Result<Vec<String>> {
    if req.pooled {
        return Ok((0..req.count)
            .map(|_| format!("{}{}", t.pool_prefix(), crate::registry::new_id()))
            .collect());
    }
    if !req.names.is_empty() {
        if req.names.len() != req.count {
            return Err(RuntimeError::InvalidInput(format!(
                "{} names given for {} clones",
                req.names.len(),
                req.count
            )));
        }
        for n in &req.names {
            check_new_name(reg, n)?;
        }
        return Ok(req.names.clone());
    }
    Ok((0..req.count)
        .map(|_| crate::registry::generated_name())
        .collect())
}

/// Refuse a name a user gives a new clone that is invalid, reserved or taken.
pub(crate) fn check_new_name(reg: &Registry, name: &str) -> Result<()> {
    crate::spec::validate_user_name(name)?;
    if reg.load(name).is_ok() {
        return Err(RuntimeError::NameInUse(name.to_string()));
    }
    Ok(())
}

/// Refuse counts beyond what the host's memory or process table can hold.
fn check_capacity(count: usize, limits: &Limits) -> Result<()> {
    let count = count as u64;
    let pid_max: u64 = read_number("/proc/sys/kernel/pid_max").unwrap_or(32768);
    // Tasks in use: the fourth field of /proc/loadavg ("running/total"); an
    // unreadable file counts as none in use (the kernel refuses forks anyway).
    let running: u64 = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| {
            l.split_whitespace()
                .nth(3)
                .and_then(|f| f.split_once('/'))
                .and_then(|(_, total)| total.parse().ok())
        })
        .unwrap_or(0);
    let pids_per_clone = PIDS_PER_CLONE.max(limits.pids.unwrap_or(0).min(PIDS_PER_CLONE));
    if running + count * pids_per_clone > pid_max {
        return Err(RuntimeError::Resources(format!(
            "{count} clones need about {} processes, but only {} more fit under kernel.pid_max={pid_max}",
            count * pids_per_clone,
            pid_max.saturating_sub(running)
        )));
    }
    let available = meminfo_available().unwrap_or(u64::MAX);
    if count.saturating_mul(MEMORY_PER_CLONE) > available {
        return Err(RuntimeError::Resources(format!(
            "{count} clones need about {} of memory before they write, but only {} is available",
            crate::size::format_size(count * MEMORY_PER_CLONE),
            crate::size::format_size(available)
        )));
    }
    Ok(())
}

fn read_number(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn meminfo_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// The spec of a clone: its template's, with its own name, hostname and limits.
fn clone_spec(t: &BoxRecord, name: &str, req: &CloneRequest) -> BoxSpec {
    let mut spec = t.spec.clone();
    spec.name = name.to_string();
    spec.hostname = name.to_string();
    spec.interactive = false;
    spec.remove_on_exit = false;
    // A clone of a box for boxes (`--nest`, frozen with no box inside) is
    // one too: its shell gets a delegated cgroup of its own and a copy of
    // the template's state directory (`nest::volumes`).
    // A host port can be published by one box only.
    spec.network.publish.clear();
    if req.without_network {
        spec.network = crate::spec::NetSpec {
            mode: crate::spec::NetworkMode::None,
            ..Default::default()
        };
    } else if let Some(n) = &req.network {
        spec.network.mode = crate::spec::NetworkMode::Bridge;
        spec.network.name = match n.as_str() {
            "bridge" | "default" => None,
            other => Some(other.to_string()),
        };
    }
    if let Some(limits) = &req.limits {
        spec.limits = limits.clone();
    }
    if req.disk.is_some() {
        spec.disk = req.disk;
    }
    spec.clone_of = Some(CloneSource {
        template_box: t.name().to_string(),
        template: t
            .state
            .template
            .as_ref()
            .map(|i| i.name.clone())
            .unwrap_or_default(),
    });
    spec
}

fn start_shells(
    reg: &Registry,
    t: &BoxRecord,
    names: &[String],
    req: &CloneRequest,
    made: &mut Vec<String>,
) -> Result<()> {
    // Up to SHELLS_AT_ONCE shells start at the same time (each is its own
    // monitor process): their starts overlap on the host's CPUs. The first
    // failure stops new starts; those under way are waited for (the caller
    // removes every shell of `made`).
    let mut starting: std::collections::VecDeque<(crate::lifecycle::ops::PendingStart, String)> =
        std::collections::VecDeque::new();
    let mut failed = None;
    let wait = |p: crate::lifecycle::ops::PendingStart, name: &str| {
        p.wait(reg).map_err(|e| e.in_box(name))
    };
    for name in names {
        if starting.len() >= SHELLS_AT_ONCE {
            if let Some((p, n)) = starting.pop_front() {
                if let Err(e) = wait(p, &n) {
                    failed = Some(e);
                    break;
                }
            }
        }
        let spec = clone_spec(t, name, req);
        // Recorded first, so a shell whose start fails midway is removed too.
        made.push(name.clone());
        match crate::lifecycle::ops::begin_detached(reg, &spec) {
            Ok(p) => starting.push_back((p, name.clone())),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    for (p, n) in starting {
        if let Err(e) = wait(p, &n) {
            failed.get_or_insert(e);
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Stop the template's process, fork one clone into each shell, let it go again.
fn fork_into_shells(
    reg: &Registry,
    t: &BoxRecord,
    shells: &[String],
    req: &CloneRequest,
) -> Result<Vec<Cloned>> {
    let info = t
        .state
        .template
        .clone()
        .ok_or_else(|| RuntimeError::WrongState {
            name: t.name().to_string(),
            problem: "is not a template".into(),
        })?;
    let cgroup = t
        .state
        .cgroup
        .clone()
        .ok_or_else(|| RuntimeError::NotRunning(t.name().to_string()))?;
    let cookie = t.state.setns_cookie.unwrap_or_default();
    // Inside a box (nestbox is root of the box's user namespace only) the
    // clone's process moves itself into its shell's v1 cgroups through files
    // opened as its uid, the template's root's, who the shell's monitor gave
    // them to (`give_tasks_files_to`).
    let tasks_files_opener = nestbox_isolation::idmap::in_user_namespace()
        .then(|| crate::template::root_ids(t).map(|(uid, _)| uid))
        .flatten();
    // The template's process tree (frozen, so it cannot change), each process
    // stopped under ptrace with all its threads.
    let steps = crate::template::template_tree(t)?;
    let mut tracees = Vec::with_capacity(steps.len());
    for step in &steps {
        tracees.push(
            nestbox_remote::Tracee::seize_and_interrupt(step.process.host_pid)
                .map_err(|e| remote_error(t.name(), e))?,
        );
    }
    // The stop request is served once the process runs: thaw for the fork, freeze
    // again before letting go of it.
    let thawed = cgroup.set_frozen(false, FREEZER_TIMEOUT);
    let forked = thawed.map_err(RuntimeError::from).and_then(|()| {
        let mut reused = Vec::with_capacity(tracees.len());
        for tracee in &mut tracees {
            tracee
                .wait_stopped(Duration::from_secs(5))
                .map_err(|e| remote_error(t.name(), e))?;
            // Its threads' state as an earlier fork read it (it ran no code
            // since: `kept_state`).
            reused.push(crate::templates::kept_state::reuse(reg, t, tracee));
        }
        let inventory =
            nestbox_remote::inspect_fds(info.process.pid).map_err(|e| remote_error(t.name(), e))?;
        let mut out = Vec::new();
        for name in shells {
            out.push(fork_one(
                reg,
                &mut tracees,
                &steps,
                name,
                cookie,
                tasks_files_opener,
                &inventory,
                req,
            )?);
        }
        for (tracee, reused) in tracees.iter().zip(reused) {
            if !reused {
                crate::templates::kept_state::keep(reg, t, tracee);
            }
        }
        Ok(out)
    });
    if forked.is_ok() {
        if let Some(init) = t.state.init {
            wait_reaped_by(init.pid, INTERMEDIATES_REAPED_TIMEOUT);
        }
    }
    let refrozen = cgroup.set_frozen(true, FREEZER_TIMEOUT);
    let mut detached = Ok(());
    for tracee in tracees {
        if let Err(e) = tracee.detach() {
            detached = Err(e);
        }
    }
    // A template process that ended while it was being forked (its template
    // removed or stopped meanwhile) fails the fork in many ways (no process,
    // no mappings left to find a syscall instruction in, ...): all of them
    // mean the template went.
    let forked = forked.map_err(|e| {
        if info.process.ends_within(Duration::from_secs(1)) {
            RuntimeError::TemplateRemoved(t.template_name().to_string())
        } else {
            e
        }
    })?;
    refrozen?;
    detached.map_err(|e| remote_error(t.name(), e))?;
    // A pooled clone can be claimed once its record names its process: only
    // after its working set is copied (a claimed clone runs, and must not
    // have pages written back under it).
    let file = working_set_file(reg, t);
    for c in &forked {
        if req.pooled {
            prefetch_when_stopped(&file, c.pid);
        }
        let process = ProcRef::of(c.pid);
        let others: Vec<ProcRef> = c.others.iter().filter_map(|p| ProcRef::of(*p)).collect();
        reg.update(&c.name, |s| {
            s.clone = Some(CloneInfo {
                process,
                others,
                fork_ms: Some(c.fork_ms),
            });
        })?;
    }
    Ok(forked)
}

/// Wait until process `init` (a template's init) has no child left that
/// has exited and is not reaped, for `limit` at most (then warn and go on).
///
/// Each remote fork leaves its intermediate processes (C1, G1: see
/// `nestbox_remote`'s fork) to the template's init, which reaps them. G1 has
/// a pid in the clone's pid namespace: left a zombie when the template is
/// frozen again, it would keep that namespace alive, and the clone's end
/// (its init waits for every pid of its namespace to be freed) would wait
/// until the template thawed.
fn wait_reaped_by(init: i32, limit: Duration) {
    let zombies = || -> Vec<i32> {
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .filter(|p| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
                stat.rfind(')')
                    .and_then(|i| stat.get(i + 2..i + 3))
                    .is_some_and(|state| state == "Z")
            })
            .collect()
    };
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = zombies();
        if left.is_empty() {
            return;
        }
        if std::time::Instant::now() >= deadline {
            tracing::warn!(
                "the template's init (pid {init}) has not reaped the clone's intermediate processes {left:?}: \
                 the clone's end will wait for the template to run again"
            );
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Copy a pooled clone's recorded working set once it has stopped (best
/// effort: a clone that does not stop within 100 ms is left as it is).
fn prefetch_when_stopped(file: &std::path::Path, pid: i32) {
    let deadline = std::time::Instant::now() + Duration::from_millis(100);
    while !crate::working_set::is_stopped(pid) {
        if std::time::Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    // An optimisation only: a page not copied ahead is faulted in on use.
    if let Err(e) = crate::working_set::prefetch(file, pid) {
        tracing::warn!("prefetching the working set into pid {pid}: {e}");
    }
}

fn remote_error(template: &str, e: nestbox_remote::RemoteError) -> RuntimeError {
    // A template's process goes only when the template is removed (template rm,
    // rm -f, stop), which may race with this clone.
    if let nestbox_remote::RemoteError::NoSuchProcess { .. }
    | nestbox_remote::RemoteError::Exited { .. } = e
    {
        return RuntimeError::TemplateRemoved(template.to_string());
    }
    RuntimeError::Remote {
        what: "cloning template box",
        name: template.to_string(),
        source: e,
    }
}

/// Fork one clone into the shell box `name`.
#[allow(clippy::too_many_arguments)]
fn fork_one(
    reg: &Registry,
    tracees: &mut [nestbox_remote::Tracee],
    steps: &[nestbox_remote::tree::Step],
    name: &str,
    cookie: [u64; 2],
    tasks_files_opener: Option<u32>,
    inventory: &[nestbox_remote::FdEntry],
    req: &CloneRequest,
) -> Result<Cloned> {
    use std::os::fd::AsFd;
    let pooled = req.pooled;
    let shell = reg.load(name)?;
    let init = shell
        .state
        .init
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    // The shell ended meanwhile (the clone was removed or stopped by a racing
    // command, or its template went, which the caller tells apart).
    let ended = |e: RuntimeError| {
        if init.alive() {
            e
        } else {
            RuntimeError::NotRunning(name.to_string())
        }
    };
    let namespaces = shell_namespaces(init.pid).map_err(ended)?;
    // The caller's streams when it gives some, else the shell's log.
    let shell_fds;
    let stdio = match &req.stdio {
        Some(fds) => [fds[0].as_fd(), fds[1].as_fd(), fds[2].as_fd()],
        None => {
            shell_fds = shell_stdio(init.pid).map_err(ended)?;
            [
                shell_fds[0].as_fd(),
                shell_fds[1].as_fd(),
                shell_fds[2].as_fd(),
            ]
        }
    };
    let plan = nestbox_remote::ForkPlan {
        namespaces: namespaces.iter().map(|(k, f)| (*k, f.as_fd())).collect(),
        setns_cookie: cookie,
        cgroup_task_files: shell
            .state
            .cgroup
            .as_ref()
            .map(|c| c.self_join_files())
            .unwrap_or_default(),
        tasks_files_opener,
        stdio,
        // A pooled clone waits, stopped, until it is claimed.
        on_clone_signal: if pooled {
            Some(Signal::SIGSTOP)
        } else {
            req.on_clone_signal
        },
        inventory: Some(inventory.to_vec()),
    };
    let forked = nestbox_remote::remote_fork_tree(tracees, steps, &plan).map_err(|source| {
        RuntimeError::Remote {
            what: "forking clone",
            name: name.to_string(),
            source,
        }
    })?;
    let fork_ms = forked.elapsed.as_secs_f64() * 1e3;
    tracing::debug!(box_name = name, fork_ms, phases = ?forked.phases, "forked");
    if std::env::var_os("NB_PHASES").is_some() {
        eprintln!("PHASES {fork_ms:.2} {:?}", forked.phases);
    }
    let root = forked.processes[0].clone();
    if root.ns_pid != crate::init::ADOPTED_PID {
        for p in &forked.processes {
            // ESRCH only if the new process died already, as wanted.
            let _ = nix::sys::signal::kill(Pid::from_raw(p.pid), Signal::SIGKILL);
        }
        return Err(RuntimeError::Failed(format!(
            "clone {name:?} got pid {} in its shell instead of {}",
            root.ns_pid,
            crate::init::ADOPTED_PID
        )));
    }
    Ok(Cloned {
        name: name.to_string(),
        pid: root.pid,
        others: forked.processes[1..].iter().map(|p| p.pid).collect(),
        fork_ms,
        address: network_address(&shell),
    })
}

/// The shell's namespaces (the remote fork joins the user namespace first: that
/// grants the capabilities to join the others; and the pid namespace last).
fn shell_namespaces(init: i32) -> Result<Vec<(nestbox_remote::NsKind, File)>> {
    let mut out = Vec::new();
    for kind in nestbox_remote::NsKind::SHELL {
        let path = format!("/proc/{init}/ns/{}", kind.proc_name());
        let f = File::open(&path).map_err(RuntimeError::io("open", &path))?;
        out.push((kind, f));
    }
    Ok(out)
}

/// The clone's stdin (/dev/null) and its log pipes, taken from the shell's init.
pub(crate) fn shell_stdio(init: i32) -> Result<[OwnedFd; 3]> {
    let null: OwnedFd = File::open("/dev/null")
        .map_err(RuntimeError::io("open", "/dev/null"))?
        .into();
    let pidfd = crate::process::pidfd_open(init)?;
    let out = crate::process::pidfd_getfd(&pidfd, 1, init)?;
    let err = crate::process::pidfd_getfd(&pidfd, 2, init)?;
    Ok([null, out, err])
}

/// The template's clone lock: one process at a time stops and forks its process.
pub(crate) fn clone_lock(t: &BoxRecord) -> Result<nix::fcntl::Flock<File>> {
    template_lock(t, "clone.lock")
}

/// Box `record`'s clone lock, for what else stops or freezes its processes
/// (a checkpoint, a migration, a freeze): one at a time with its clones, so
/// a clone never finds the template traced by a checkpoint of it, nor a
/// checkpoint that thaws its box at the end a box frozen meanwhile. A box
/// removed meanwhile is said not to run.
pub(crate) fn box_lock(record: &BoxRecord) -> Result<nix::fcntl::Flock<File>> {
    clone_lock(record).map_err(|e| match e {
        RuntimeError::TemplateRemoved(_) if record.state.template.is_none() => {
            RuntimeError::NotRunning(record.name().to_string())
        }
        e => e,
    })
}

/// [`box_lock`] if no one holds it now (`None` then: a freeze, checkpoint,
/// migration or clone of the box is under way).
pub(crate) fn try_box_lock(record: &BoxRecord) -> Option<nix::fcntl::Flock<File>> {
    crate::state::lock_file(&record.run_dir().join("clone.lock"), false)
        .ok()
        .flatten()
}

/// The template's refill lock: one refill of its pool at a time, so that two
/// refills started by two claims do not both fork the whole deficit (the
/// clones one is forking are not counted until they have a process).
fn refill_lock(t: &BoxRecord) -> Result<nix::fcntl::Flock<File>> {
    template_lock(t, "refill.lock")
}

/// An exclusive lock on file `name` of the template's run directory.
fn template_lock(t: &BoxRecord, name: &str) -> Result<nix::fcntl::Flock<File>> {
    let path = t.run_dir().join(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                // Its record went since it was loaded (template rm, rm -f).
                RuntimeError::TemplateRemoved(t.template_name().to_string())
            } else {
                RuntimeError::io("open", &path)(e)
            }
        })?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| RuntimeError::sys(format!("flock {}", path.display()))(e))
}

/// The pooled clones of template box `box_name` whose process lives.
pub fn pooled_of(reg: &Registry, t: &BoxRecord) -> Result<Vec<BoxRecord>> {
    Ok(reg
        .list_prefixed(&t.pool_prefix())?
        .into_iter()
        .filter(|r| live_pooled_clone_of(r, t))
        .collect())
}

/// Whether `r` waits in template box `t`'s pool with its process alive.
fn live_pooled_clone_of(r: &BoxRecord, t: &BoxRecord) -> bool {
    r.is_pooled()
        && crate::template::is_clone_of(r, t.name())
        && r.state
            .clone
            .as_ref()
            .is_some_and(|c| c.process.is_some_and(|p| p.alive()))
}

/// A box's address on its network, from its record.
fn network_address(r: &BoxRecord) -> Option<String> {
    r.state
        .network
        .as_ref()?
        .get("address")?
        .as_str()
        .map(str::to_string)
}

/// Claim a pooled clone of `t` as `name`: rename its record (atomically: of
/// two claimers one wins), give it its hostname and let its process go on.
/// Its name in the hosts file is left to `follow_up`. `None` when the pool is
/// empty.
fn claim_pooled(
    reg: &Registry,
    t: &BoxRecord,
    name: &str,
    req: &CloneRequest,
    follow_up: &mut FollowUp,
) -> Result<Option<Cloned>> {
    while let Some(c) = first_live_pooled(reg, t)? {
        if let Some(made) = take_pooled(reg, &c, name, req, follow_up)? {
            return Ok(Some(made));
        }
    }
    Ok(None)
}

/// The first pooled clone of `t` whose process lives (in name order).
pub(crate) fn first_live_pooled(reg: &Registry, t: &BoxRecord) -> Result<Option<BoxRecord>> {
    for candidate in reg.names_prefixed(&t.pool_prefix())? {
        if let Ok(c) = reg.load(&candidate) {
            if live_pooled_clone_of(&c, t) {
                return Ok(Some(c));
            }
        }
    }
    Ok(None)
}

/// Take the pooled clone `c` as `name`: rename its record, give it its
/// hostname and wake it; its hosts entry goes to `follow_up`. `None` when
/// another claimer took it first.
pub(crate) fn take_pooled(
    reg: &Registry,
    c: &BoxRecord,
    name: &str,
    req: &CloneRequest,
    follow_up: &mut FollowUp,
) -> Result<Option<Cloned>> {
    let started = std::time::Instant::now();
    match reg.rename(c.name(), name) {
        Ok(()) => {}
        Err(RuntimeError::NoSuchBox(_)) => return Ok(None),
        Err(e) => return Err(e),
    }
    let pid = match wake_claimed(c, name, req) {
        Ok(pid) => pid,
        Err(e) => {
            let removed = crate::templates::ops::remove(reg, name, true);
            crate::diag::warn_on_err(
                Some(name),
                "removing a clone that could not be woken",
                removed,
            );
            // Its template was removed meanwhile (which ends the pool's clones):
            // not a failure of this request, which takes the next one or forks.
            let gone = |p: Option<crate::liveness::ProcRef>| p.is_none_or(|p| !p.alive());
            if gone(c.state.init) || gone(c.state.clone.as_ref().and_then(|i| i.process)) {
                return Ok(None);
            }
            return Err(e);
        }
    };
    if c.spec.network.mode == crate::spec::NetworkMode::Bridge {
        follow_up.hosts.push((c.state.id.clone(), name.to_string()));
    }
    Ok(Some(Cloned {
        name: name.to_string(),
        pid,
        others: Vec::new(),
        fork_ms: started.elapsed().as_secs_f64() * 1e3,
        address: network_address(c),
    }))
}

/// Give the claimed pooled clone `c` (now named `name`) its hostname, then let
/// its process go on (and signal it, if asked).
fn wake_claimed(c: &BoxRecord, name: &str, req: &CloneRequest) -> Result<i32> {
    let init = c
        .state
        .init
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    let pid = c
        .state
        .clone
        .as_ref()
        .and_then(|c| c.process)
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?
        .pid;
    // Its identity first: the process may read its hostname at once.
    set_hostname_in(init.pid, name)?;
    let pid_t = Pid::from_raw(pid);
    // Children first, as they were let go (a parent wakes to a complete tree).
    let others: Vec<i32> = c
        .state
        .clone
        .as_ref()
        .map(|c| c.others.iter().map(|p| p.pid).collect())
        .unwrap_or_default();
    for other in others.iter().rev() {
        nix::sys::signal::kill(Pid::from_raw(*other), Signal::SIGCONT)
            .map_err(RuntimeError::sys(format!("wake clone {name:?}")))?;
    }
    nix::sys::signal::kill(pid_t, Signal::SIGCONT)
        .map_err(RuntimeError::sys(format!("wake clone {name:?}")))?;
    if let Some(sig) = req.on_clone_signal {
        nix::sys::signal::kill(pid_t, sig)
            .map_err(RuntimeError::sys(format!("signal clone {name:?}")))?;
    }
    Ok(pid)
}

/// Set the hostname in the uts namespace of `pid`, coming back to our own.
/// Inside a box (nestbox is root of the box's user namespace only) a child
/// process joins the clone's user namespace first to do it (see
/// [`nestbox_sys::ns::set_hostname_from_child`]).
fn set_hostname_in(pid: i32, name: &str) -> Result<()> {
    use nestbox_sys::ns::{Namespace, NsGuard};
    use std::os::fd::AsFd;
    let path = format!("/proc/{pid}/ns/uts");
    let theirs = File::open(&path).map_err(RuntimeError::io("open", &path))?;
    if nestbox_isolation::idmap::in_user_namespace() {
        let userns_path = format!("/proc/{pid}/ns/user");
        let userns = File::open(&userns_path).map_err(RuntimeError::io("open", &userns_path))?;
        return nestbox_sys::ns::set_hostname_from_child(userns.as_fd(), theirs.as_fd(), name)
            .map_err(RuntimeError::sys(format!("sethostname in {path}")));
    }
    let guard = NsGuard::enter(theirs.as_fd(), Namespace::Uts)
        .map_err(RuntimeError::sys(format!("setns({path})")))?;
    let set = nix::unistd::sethostname(name).map_err(RuntimeError::sys("sethostname"));
    guard
        .leave()
        .map_err(RuntimeError::sys("setns(own uts namespace)"))?;
    set
}

/// Bring template `template`'s pool up to its size (synchronously).
pub fn fill_pool(reg: &Registry, template: &str) -> Result<usize> {
    let t = crate::template::load_frozen(reg, template)?;
    let want = t.state.template.as_ref().map(|i| i.pool).unwrap_or(0);
    let _refill = refill_lock(&t)?;
    let have = pooled_of(reg, &t)?.len();
    if have >= want {
        return Ok(have);
    }
    // Learn what the latest claimed clones have written so far, for the new
    // pooled clones to have it copied ahead of time.
    let recent: Vec<i32> = crate::template::clones_of(reg, t.name())?
        .into_iter()
        .filter_map(|c| c.state.clone.and_then(|i| i.process))
        .filter(|p| p.alive())
        .map(|p| p.pid)
        .collect();
    for pid in recent.iter().rev().take(WORKING_SET_SOURCES) {
        let recorded = crate::working_set::record(&working_set_file(reg, &t), *pid);
        crate::diag::warn_on_err(Some(t.name()), "recording the working set", recorded);
    }
    let req = CloneRequest {
        count: want - have,
        pooled: true,
        ..CloneRequest::default()
    };
    clone_template(reg, template, &req)?;
    Ok(want)
}

/// Refill the pool in a detached process, off the caller's critical path (see
/// [`crate::process::spawn_refill`]: delayed, at idle priority).
fn spawn_refill(reg: &Registry, template: &str) {
    crate::process::spawn_refill(|| fill_pool(reg, template).map(|_| ()));
}

/// Refuse, before freezing, a box one of whose processes (`host_pids`, its
/// init excluded) holds a descriptor no clone rule covers, or shared memory a
/// clone could not get its own copy of.
pub fn check_fds(name: &str, host_pids: &[i32]) -> Result<()> {
    nestbox_remote::check_box_fds(host_pids).map_err(|e| refused_at_freeze(name, e))?;
    for pid in host_pids {
        nestbox_remote::ensure_memory_clonable(*pid).map_err(|e| refused_at_freeze(name, e))?;
    }
    Ok(())
}

/// Why box `name` cannot be frozen into a template, from the remote-fork
/// layer's answer: a process that ended meanwhile (a stop or rm -f racing with
/// the freeze) or something a clone cannot reproduce.
pub(crate) fn refused_at_freeze(name: &str, e: nestbox_remote::RemoteError) -> RuntimeError {
    match e {
        nestbox_remote::RemoteError::NoSuchProcess { .. } => RuntimeError::WrongState {
            name: name.to_string(),
            problem: "exited while freezing".to_string(),
        },
        e => RuntimeError::Unsupported {
            name: name.to_string(),
            problem: format!("cannot be cloned: {e}"),
        },
    }
}

/// Memory of one process from /proc/PID/smaps_rollup, in bytes.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ProcessMemory {
    /// Resident set.
    pub rss: u64,
    /// Proportional set (shared pages divided among their users).
    pub pss: u64,
    /// Pages mapped by this process only.
    pub private: u64,
    /// Pages also mapped by others (the template, sibling clones).
    pub shared: u64,
}

impl ProcessMemory {
    /// Read the figures of `pid`.
    pub fn of(pid: i32) -> Option<ProcessMemory> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
        let mut m = ProcessMemory::default();
        for line in text.lines() {
            let mut parts = line.split_whitespace();
            let (Some(key), Some(value)) = (parts.next(), parts.next()) else {
                continue;
            };
            let bytes = value.parse::<u64>().unwrap_or(0) * 1024;
            match key {
                "Rss:" => m.rss = bytes,
                "Pss:" => m.pss = bytes,
                "Private_Clean:" | "Private_Dirty:" => m.private += bytes,
                "Shared_Clean:" | "Shared_Dirty:" => m.shared += bytes,
                _ => {}
            }
        }
        Some(m)
    }
}

/// Memory sharing of a clone or a template, for `stats` and `inspect`.
pub fn sharing(reg: &Registry, record: &BoxRecord) -> Option<serde_json::Value> {
    if let (Some(c), Some(src)) = (&record.state.clone, &record.spec.clone_of) {
        let p = c.process.filter(|p| p.alive())?;
        let mut m = ProcessMemory::of(p.pid)?;
        // A clone of a process tree: all its processes.
        for other in c.others.iter().filter(|p| p.alive()) {
            if let Some(o) = ProcessMemory::of(other.pid) {
                m.rss += o.rss;
                m.pss += o.pss;
                m.private += o.private;
                m.shared += o.shared;
            }
        }
        return Some(serde_json::json!({
            "role": "clone",
            "template": src.template,
            "process": m,
            "private_bytes": m.private,
            "shared_with_template_bytes": m.shared,
        }));
    }
    let t = record.state.template.as_ref()?;
    let own = ProcessMemory::of(t.process.pid).filter(|_| t.process.alive())?;
    let clones = crate::template::clones_of(reg, record.name()).ok()?;
    let mut rss = own.rss;
    let mut pss = own.pss;
    let mut count = 0;
    for c in &clones {
        if let Some(m) = c
            .state
            .clone
            .as_ref()
            .and_then(|i| i.process)
            .filter(|p| p.alive())
            .and_then(|p| ProcessMemory::of(p.pid))
        {
            rss += m.rss;
            pss += m.pss;
            count += 1;
        }
    }
    Some(serde_json::json!({
        "role": "template",
        "process": own,
        "clones": count,
        "total_rss_bytes": rss,
        "total_pss_bytes": pss,
        "sharing_ratio": if pss > 0 { rss as f64 / pss as f64 } else { 1.0 },
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::paths::Roots;
    use crate::spec::tests_support::sample;

    /// The check behind a claim's follow-up: a clone that ended or went since
    /// its claim (its address released before its record says so) is skipped,
    /// not reported; one whose init lives must have its address.
    #[test]
    fn a_follow_up_skips_clones_that_ended_or_went() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        let rec = reg.create(&sample("c1")).unwrap();
        let id = rec.state.id.clone();
        // Not started: no init.
        assert!(!still_running(&reg, &id, "c1"));
        // Its init lives (this test's own process stands for it).
        let me = ProcRef::of(std::process::id() as i32).unwrap();
        reg.update("c1", |s| s.init = Some(me)).unwrap();
        assert!(still_running(&reg, &id, "c1"));
        // Another box under the name now.
        assert!(!still_running(&reg, "another-id", "c1"));
        // Its init died (a pid and start time that no process has).
        let dead = ProcRef {
            pid: me.pid,
            start_time: me.start_time + 1,
        };
        reg.update("c1", |s| s.init = Some(dead)).unwrap();
        assert!(!still_running(&reg, &id, "c1"));
        // Removed.
        reg.remove(&reg.load("c1").unwrap()).unwrap();
        assert!(!still_running(&reg, &id, "c1"));
    }
}
