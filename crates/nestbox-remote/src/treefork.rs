//! Remote fork of a whole box: every process of its tree, in the order
//! tree.rs plans, with the same pids, parents, sessions and groups.
//!
//! A process whose parent is the box's init is made by the remote fork of
//! fork.rs ([`make_root`]): its memory is its template process's,
//! copy-on-write. Any other process is forked by its parent's clone, held
//! stopped for the purpose (`clone3` with `set_tid`: the same pid), then given
//! its own template process's memory (rebuild.rs), state (procstate.rs),
//! fds and threads. Every process is held until the whole tree is made (a
//! parent forks its children while it still has every capability in the
//! clone's user namespace), then all are let go, children first.
//!
//! fds of a forked child: an fd that is the same open file description in the
//! child and its parent in the template stays the one the parent's clone has
//! (so a listening socket or a pipe end the two share in the template is
//! shared in the clone); any other fd of the child is re-targeted in it by the
//! rules of the clone fd matrix, and fds the parent's clone has that the child
//! does not are closed. The child's fds 0–2 stay the clone's stdio.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{RemoteError, Result};
use crate::fdinfo::{
    ensure_clonable, inspect_fds, mark_peers_inside, mark_pidfds_inside, mark_stdio, FdEntry,
};
use crate::fork::{
    ensure_all_threads_held, fix_up, fork_into, make_root, read_template, CloneTables, ForkPlan,
    Made, Phases,
};
use crate::memory::Scratch;
use crate::objects::CloneObjects;
use crate::procfs::Status;
use crate::procimage::{set_credentials, Credentials};
use crate::procstate::ProcessState;
use crate::rebuild::{rebuild, Layout, LiveProcess};
use crate::retarget::{box_pidfds, retarget_with, FdOutcome};
use crate::shmem::SharedObjects;
use crate::tracee::{Tracee, TRACE_OPTIONS};
use crate::tree::{Membership, Origin, Step};

/// One process of the clone, once made.
#[derive(Debug, Clone, Serialize)]
pub struct ForkedProcess {
    /// Its pid in the clone's pid namespace (the template process's).
    pub ns_pid: i32,
    /// Its host pid.
    pub pid: i32,
}

/// The result of a remote fork of a process tree.
#[derive(Debug, Clone, Serialize)]
pub struct ForkedTree {
    /// Every process made, in the order made (the first is the box's main
    /// process).
    pub processes: Vec<ForkedProcess>,
    /// What happened to each fd of the first process's template.
    pub fds: Vec<FdOutcome>,
    /// Time from the start of the call to the last process running.
    pub elapsed: Duration,
    /// Time spent in each step of making the first process, then in the rest
    /// of the tree and in letting it go (for tuning).
    pub phases: Vec<(&'static str, Duration)>,
}

/// Fork the template box whose processes are `templates` (each seized with
/// every thread and stopped, in the order of `steps` from
/// [`crate::tree::plan`]) into the clone shell of `plan`. `plan.inventory`
/// is the first process's fd inventory if already taken. On success every
/// process of the clone runs (or has received `plan.on_clone_signal`); the
/// template processes are left stopped, their registers intact.
///
/// # Errors
/// Any failure names the process, call and fd concerned; every process made
/// so far is killed and the template is left as it was.
pub fn remote_fork_tree(
    templates: &mut [Tracee],
    steps: &[Step],
    plan: &ForkPlan<'_>,
) -> Result<ForkedTree> {
    let start = Instant::now();
    if templates.len() != steps.len() || steps.is_empty() {
        return Err(RemoteError::Plan(format!(
            "{} template processes for {} steps of the tree",
            templates.len(),
            steps.len()
        )));
    }
    let host_of: BTreeMap<i32, i32> = steps
        .iter()
        .map(|s| (s.process.pid, s.process.host_pid))
        .collect();
    // Above every pid and tid of a tree (a box of one: its own, which the
    // fork knows from its thread states).
    let mut free_floor = 0;
    if steps.len() > 1 {
        for t in templates.iter() {
            for tid in std::iter::once(t.pid()).chain(t.threads().iter().map(Tracee::pid)) {
                free_floor = free_floor.max(Status::read(tid)?.innermost_pid()? + 1);
            }
        }
    }
    // The state of every process of a tree (not needed for a box of one).
    let mut states: BTreeMap<i32, ProcessState> = BTreeMap::new();
    if steps.len() > 1 {
        for (template, step) in templates.iter_mut().zip(steps) {
            states.insert(step.process.pid, ProcessState::capture(template)?);
        }
    }
    // The fds of every process, with the Unix connections and pidfds between
    // them known, and the connected objects of the whole box: made in the
    // first process, installed in each.
    let mut inventories: Vec<Vec<FdEntry>> = Vec::with_capacity(steps.len());
    for (i, template) in templates.iter().enumerate() {
        inventories.push(match (&plan.inventory, i) {
            // (Its timerfd and eventfd states are read again by make_root.)
            (Some(entries), 0) => entries.clone(),
            _ => inspect_fds(template.pid())?,
        });
    }
    let host_pids: Vec<i32> = templates.iter().map(Tracee::pid).collect();
    mark_box(&mut inventories, &host_pids);
    let mut tables = CloneTables {
        objects: CloneObjects::plan(
            &templates
                .iter()
                .zip(&inventories)
                .map(|(t, e)| (t.pid(), e.as_slice()))
                .collect::<Vec<_>>(),
        ),
        shared: SharedObjects::default(),
    };
    let mut made: Vec<(i32, Made)> = Vec::with_capacity(steps.len());
    let mut root_phases = None;
    for (i, (template, step)) in templates.iter_mut().zip(steps).enumerate() {
        let pid = step.process.pid;
        let mut process = match step.origin {
            Origin::RemoteFork => {
                let own_plan = ForkPlan {
                    namespaces: plan.namespaces.clone(),
                    setns_cookie: plan.setns_cookie,
                    cgroup_task_files: plan.cgroup_task_files.clone(),
                    tasks_files_opener: plan.tasks_files_opener,
                    stdio: plan.stdio,
                    on_clone_signal: None,
                    inventory: Some(inventories[i].clone()),
                };
                let (made, phases) =
                    make_root(template, &own_plan, start, free_floor, Some(&mut tables))?;
                if i == 0 {
                    root_phases = Some(phases);
                }
                made
            }
            Origin::ForkedBy(parent) => {
                let own = &states[&pid];
                // Its user and group ids may differ from its parent's (a
                // root server's worker running as a user): fork_child sets them.
                own.check_inherits_but(
                    template.pid(),
                    &states[&parent],
                    &["Uid", "Gid", "Groups"],
                )?;
                let parent_made = made
                    .iter_mut()
                    .find(|(p, _)| *p == parent)
                    .map(|(_, m)| m)
                    .ok_or_else(|| {
                        RemoteError::Plan(format!("the parent {parent} of {pid} was not made"))
                    })?;
                let base = host_of[&parent];
                let child = Child {
                    template,
                    base,
                    ns_pid: pid,
                    process_state: own,
                    entries: &inventories[i],
                    own_ids: !own.same_ids(&states[&parent]),
                };
                fork_child(parent_made, child, &mut tables, plan)?
            }
        };
        set_membership(&mut process, step.membership)?;
        made.push((pid, process));
    }
    // pidfds of other processes of the box, now that they all exist.
    for ((_, m), entries) in made.iter_mut().zip(&inventories) {
        box_pidfds(&mut m.process, entries)?;
    }
    let mut phases = root_phases.unwrap_or_else(|| Phases::new(start));
    if made.len() > 1 {
        phases.mark("other processes");
    }
    let fds = made.first().map(|(_, m)| m.fds.clone()).unwrap_or_default();
    // The tracer's duplicates of the new pipes' and socket pairs' ends go
    // before anything runs: an end that no process of the box holds (the
    // reader of a pipe whose reader was outside the box) must be closed
    // from the clone's first instruction on, or a write meanwhile would
    // succeed into a pipe that nobody reads once the tracer is gone.
    drop(tables);
    let mut processes = Vec::with_capacity(made.len());
    // Children first: a parent runs only once everything it may wait for is there.
    let mut released = Vec::with_capacity(made.len());
    while let Some((ns_pid, m)) = made.pop() {
        let pid = m.release(plan.on_clone_signal)?;
        released.push(ForkedProcess { ns_pid, pid });
    }
    processes.extend(released.into_iter().rev());
    phases.mark("release");
    Ok(ForkedTree {
        processes,
        fds,
        elapsed: start.elapsed(),
        phases: phases.done,
    })
}

/// `setsid()` or `setpgid()` in the held process, as the plan says.
pub(crate) fn set_membership(process: &mut Made, membership: Membership) -> Result<()> {
    let p = &mut process.process;
    match membership {
        Membership::Inherit => return Ok(()),
        Membership::NewSession => {
            p.syscall("setsid", String::new, libc::SYS_setsid, &[])?;
        }
        Membership::OwnGroup => {
            p.syscall(
                "setpgid",
                || "its own group".into(),
                libc::SYS_setpgid,
                &[0, 0],
            )?;
        }
        Membership::JoinGroup(pgid) => {
            p.syscall(
                "setpgid",
                || format!("joining group {pgid}"),
                libc::SYS_setpgid,
                &[0, pgid as u64],
            )?;
        }
    }
    Ok(())
}

/// A child of a template's process tree, to be forked by its parent's clone.
struct Child<'a> {
    /// The template process, stopped with all its threads.
    template: &'a mut Tracee,
    /// Host pid of its parent in the template.
    base: i32,
    /// Its pid in the box.
    ns_pid: i32,
    process_state: &'a ProcessState,
    /// Its fds (with the box's Unix connections marked).
    entries: &'a [FdEntry],
    /// It runs with user or group ids other than its parent's.
    own_ids: bool,
}

/// Fork `child` from the held clone of its parent and make it its template's
/// copy: memory, process state, fds, threads. Returned held.
fn fork_child(
    parent: &mut Made,
    child: Child<'_>,
    tables: &mut CloneTables,
    plan: &ForkPlan<'_>,
) -> Result<Made> {
    let Child {
        template,
        base,
        ns_pid,
        process_state,
        entries,
        own_ids,
    } = child;
    let target = template.pid();
    ensure_all_threads_held(template)?;
    let status = Status::read(target)?;
    ensure_clonable(target, entries)?;
    let mut state = read_template(template, &status)?;
    state.ns_pid = ns_pid;

    let mut x = fork_held(parent, ns_pid, plan.setns_cookie)?;
    // Its memory, made like its template process's (rebuild.rs), with the
    // shared memory of the box's clone (the table its parent's clone made).
    // Its rseq area is registered below with the rest of its thread's state.
    let mut target_layout = Layout::read(target)?;
    target_layout.rseq = None;
    let source = LiveProcess::open(base, target)?;
    rebuild(
        &mut x,
        &mut tables.shared,
        &Layout::read(base)?,
        &target_layout,
        target,
        &source,
    )?;
    let mut scratch = Scratch::map(&mut x)?;
    process_state.apply(&mut x, &mut scratch)?;
    let outcomes = child_fds(
        &mut x,
        &mut scratch,
        base,
        target,
        entries,
        &mut tables.objects,
    )?;
    // Its user and group ids, when they are not its parent's (the fork gave
    // it the parent's): set before its threads are made, which inherit them.
    if own_ids {
        set_credentials(&mut x, &mut scratch, &Credentials::read(target)?)?;
    }
    // Bounding set, securebits and capability sets: as the parent's clone,
    // which has them from the same box (check_inherits), unless it has ids
    // of its own: then its template's sets are given to every thread (the
    // main thread's at release), as for a process that joined a user
    // namespace (setting the ids kept the parent's permitted set).
    let own_caps = parent.caps.is_some() || own_ids;
    let threads = fix_up(&mut x, &mut scratch, &state, 0, own_caps, plan.setns_cookie)?;
    // Its restart block is its parent's (the fork copied it), not its
    // template's: a call to resume through it is re-run instead.
    crate::retarget::own_pidfds(&mut x, entries)?;
    x.set_original(state.leader.resume_regs());
    Ok(Made {
        process: x,
        threads,
        scratch,
        ns_pid,
        caps: own_caps.then_some(state.leader.caps),
        fds: outcomes,
    })
}

/// Fork the held process `parent` (`clone3` with `set_tid`: pid `ns_pid` in
/// its pid namespace, `cookie` for the seccomp filter) and take the child,
/// stopped and killed with us.
pub(crate) fn fork_held(parent: &mut Made, ns_pid: i32, cookie: [u64; 2]) -> Result<Tracee> {
    let insn = parent.process.syscall_insn;
    let (x_pid, with_pid) = fork_into(&mut parent.process, &mut parent.scratch, 0, ns_pid, cookie)?;
    let mut x = Tracee::adopt(x_pid, insn)?;
    // (A restore with its seccomp filter suspended keeps it so in the child.)
    x.keep_options(parent.process.sticky_options);
    x.set_options(TRACE_OPTIONS | libc::PTRACE_O_EXITKILL)?;
    if !with_pid {
        return Err(RemoteError::Unclonable(format!(
            "the seccomp filter refuses clone3 with the given cookie, so process {ns_pid} of the tree cannot get its pid"
        )));
    }
    Ok(x)
}

/// The fds of the forked child `x`: see the module documentation.
fn child_fds(
    x: &mut Tracee,
    scratch: &mut Scratch,
    base: i32,
    target: i32,
    entries: &[FdEntry],
    objects: &mut CloneObjects,
) -> Result<Vec<FdOutcome>> {
    let have = inspect_fds(x.pid())?;
    let same_as_parent =
        |fd: i32| nestbox_sys::process::same_open_file(base, fd, target, fd).unwrap_or(false);
    let own: Vec<FdEntry> = entries
        .iter()
        .filter(|e| (e.fd > 2 || e.not_box_stdio) && !same_as_parent(e.fd))
        .cloned()
        .collect();
    // The parent's fds the child does not have at all go; a number the child
    // has is replaced by its own object below (dup3 onto it).
    let mut close = Vec::new();
    for e in &have {
        if e.fd > 2 && !entries.iter().any(|own| own.fd == e.fd) {
            close.push(e.fd);
        }
    }
    for fd in close {
        x.syscall(
            "close",
            || format!("fd {fd} of the parent's clone, not the child's"),
            libc::SYS_close,
            &[fd as u64],
        )?;
    }
    // A number the child has and the parent's clone does not is held by a
    // placeholder meanwhile, so that no new object is made on it (the
    // re-targeting makes each object on a free number and moves it onto its
    // own with dup3).
    for e in &own {
        if !have.iter().any(|h| h.fd == e.fd) {
            x.syscall(
                "dup3",
                || format!("holding fd {} for the child's own object", e.fd),
                libc::SYS_dup3,
                &[0, e.fd as u64, libc::O_CLOEXEC as u64],
            )?;
        }
    }
    let mut outcomes = retarget_with(x, scratch, target, &own, [0, 1, 2], Some((objects, false)))?;
    outcomes.sort_by_key(|o| o.fd);
    Ok(outcomes)
}

/// Mark, over the inventories of every process of a box (host pids
/// `host_pids`, in the same order), the Unix connections and the pidfds
/// between its processes.
pub(crate) fn mark_box(inventories: &mut [Vec<FdEntry>], host_pids: &[i32]) {
    let mut all: Vec<&mut [FdEntry]> = inventories.iter_mut().map(|v| v.as_mut_slice()).collect();
    if all.len() > 1 {
        mark_stdio(&mut all);
        mark_peers_inside(&mut all);
    }
    mark_pidfds_inside(&mut all, host_pids);
}

/// The fd inventories of the box's processes `host_pids` (its init excluded),
/// with what connects them marked, each checked against the clone fd matrix:
/// the freeze-time check of a whole box.
///
/// # Errors
/// The first fd no rule covers, naming its process, fd and kind; a process that
/// went.
pub fn check_box_fds(host_pids: &[i32]) -> Result<()> {
    let mut inventories = host_pids
        .iter()
        .map(|p| inspect_fds(*p))
        .collect::<Result<Vec<_>>>()?;
    mark_box(&mut inventories, host_pids);
    for (pid, entries) in host_pids.iter().zip(&inventories) {
        ensure_clonable(*pid, entries)?;
    }
    Ok(())
}
