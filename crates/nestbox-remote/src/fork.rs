//! Remote fork: make a stopped template process fork itself into a prepared clone
//! shell, by injected syscalls.
//!
//! The chain of processes, and why each exists:
//!
//! 1. **C1** = `clone(CLONE_VM | CLONE_PARENT)` injected in the template P. It
//!    shares P's memory (no page-table copy) and its parent is P's parent, so P
//!    never sees it. C1 receives the shell's namespace fds and the clone's stdio
//!    (`SCM_RIGHTS`), joins the shell's user namespace (P's euid owns it, so P's
//!    forks hold every capability in it) with the `setns` seccomp cookie, then the
//!    other namespaces (pid last: it only applies to children), changes to P's
//!    working directory, re-targets the fds and is moved into the clone's cgroup.
//! 2. **G1** = fork of C1 (the one copy of the page tables), created in the
//!    shell's pid namespace: a process cannot share memory with a child in
//!    another pid namespace, and a child orphaned by C1 would be re-parented to
//!    the reaper of *C1's* pid namespace (the template's init), not the shell's.
//! 3. **G** = `clone(CLONE_VM)` of G1, in the same pid namespace, which is allowed
//!    to share G1's memory; G1 then exits, so G is re-parented to the shell's init
//!    and owns the memory alone. With `clone3` (allowed by the cookie) G gets the
//!    pid P has in its own namespace, and G1 a different one.
//!
//! Memory P marked `MADV_DONTFORK` (V8's heap), which a fork skips, is found
//! by G1 coming out smaller than P; it is then unmarked by C1 just around a
//! second fork of G1 and marked again in both ([`crate::dontfork`]).
//!
//! In G the injected calls re-register what fork or `CLONE_VM` does not carry
//! over (rseq area, robust futex list, alternate signal stack, clear-child-tid
//! address), re-create P's other threads with their tids and state
//! ([`crate::threads`]) and restore P's capability state; then G and its
//! threads get P's exact registers (an interrupted syscall is restarted) and
//! are detached. On any failure every process made so far is
//! killed and the template is left as it was.

use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde::Serialize;

use crate::batch::Batch;
use crate::caps::{self, CapState};
use crate::dontfork::DontFork;
use crate::error::{RemoteError, Result};
use crate::fdinfo::{ensure_clonable, inspect_fds, refresh_volatile, FdEntry};
use crate::fdtransfer::install_fds_with;
use crate::layout;
use crate::memory::{Scratch, SCRATCH_LEN};
use crate::objects::CloneObjects;
use crate::procfs::{self, Status};
use crate::retarget::{retarget_with, FdOutcome};
use crate::shmem::SharedObjects;
use crate::threads::{self, ThreadState};
use crate::tracee::{task_ids, Tracee, TRACE_OPTIONS};

/// A namespace of the clone shell to join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum NsKind {
    /// User namespace (joined first).
    User,
    /// Mount namespace (resets root and cwd to the namespace's root).
    Mount,
    /// Network namespace.
    Net,
    /// UTS namespace.
    Uts,
    /// IPC namespace.
    Ipc,
    /// Cgroup namespace.
    Cgroup,
    /// Time namespace (applies to children).
    Time,
    /// Pid namespace (applies to children; joined last).
    Pid,
}

impl NsKind {
    /// The namespaces every clone shell has (all but time), in join order.
    pub const SHELL: [NsKind; 7] = [
        NsKind::User,
        NsKind::Mount,
        NsKind::Net,
        NsKind::Uts,
        NsKind::Ipc,
        NsKind::Cgroup,
        NsKind::Pid,
    ];

    /// The `CLONE_NEW*` flag `setns` takes for it.
    pub fn clone_flag(self) -> i32 {
        match self {
            NsKind::User => libc::CLONE_NEWUSER,
            NsKind::Mount => libc::CLONE_NEWNS,
            NsKind::Net => libc::CLONE_NEWNET,
            NsKind::Uts => libc::CLONE_NEWUTS,
            NsKind::Ipc => libc::CLONE_NEWIPC,
            NsKind::Cgroup => libc::CLONE_NEWCGROUP,
            NsKind::Time => libc::CLONE_NEWTIME,
            NsKind::Pid => libc::CLONE_NEWPID,
        }
    }

    /// Its name in `/proc/PID/ns`.
    pub fn proc_name(self) -> &'static str {
        match self {
            NsKind::User => "user",
            NsKind::Mount => "mnt",
            NsKind::Net => "net",
            NsKind::Uts => "uts",
            NsKind::Ipc => "ipc",
            NsKind::Cgroup => "cgroup",
            NsKind::Time => "time",
            NsKind::Pid => "pid",
        }
    }
}

/// What the clone is forked into.
#[derive(Debug)]
pub struct ForkPlan<'a> {
    /// The clone shell's namespaces (any order; joined user first, pid last).
    pub namespaces: Vec<(NsKind, BorrowedFd<'a>)>,
    /// The two values the template's seccomp filter wants in the third and fourth
    /// arguments of `setns` (and `clone3`) before it lets them through.
    pub setns_cookie: [u64; 2],
    /// Files the new process's tid is written to: cgroup v1 `tasks` files (or v2
    /// `cgroup.procs`).
    pub cgroup_task_files: Vec<PathBuf>,
    /// The effective uid the `tasks` files are opened as (`None`: the
    /// caller's own). cgroup v1 lets a writer that is not the initial
    /// namespace's root move only processes of its uid, judged by the
    /// credentials the file was opened with: a tracer that is root of a user
    /// namespace only (nestbox inside a box) opens them as the template's
    /// process's uid, which the files must let write.
    pub tasks_files_opener: Option<u32>,
    /// The clone's stdin, stdout, stderr (replace the template's fds 0, 1, 2).
    pub stdio: [BorrowedFd<'a>; 3],
    /// A signal sent to the clone once it runs (`--on-clone-signal`).
    pub on_clone_signal: Option<Signal>,
    /// The template's fd inventory from [`crate::inspect_fds`], if already taken
    /// (while the template is frozen its fds do not change; the timerfd and
    /// eventfd states are re-read); `None`: taken now.
    pub inventory: Option<Vec<FdEntry>>,
}

/// The result of a remote fork.
#[derive(Debug, Clone, Serialize)]
pub struct Forked {
    /// Host pid of the clone's process.
    pub pid: i32,
    /// Its pid inside the shell's pid namespace.
    pub ns_pid: i32,
    /// What happened to each fd of the template.
    pub fds: Vec<FdOutcome>,
    /// Time from the start of the call (template stopped) to the clone running.
    pub elapsed: Duration,
    /// Time spent in each step, in order (for tuning).
    pub phases: Vec<(&'static str, Duration)>,
}

/// Records how long each step of a remote fork takes.
#[derive(Debug)]
pub(crate) struct Phases {
    last: Instant,
    pub(crate) done: Vec<(&'static str, Duration)>,
}

impl Phases {
    pub(crate) fn new(start: Instant) -> Phases {
        Phases {
            last: start,
            done: Vec::with_capacity(16),
        }
    }

    pub(crate) fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.done.push((name, now - self.last));
        self.last = now;
    }
}

/// What is read from the template before it forks.
pub(crate) struct TemplateState {
    pub(crate) cwd: PathBuf,
    pub(crate) ns_pid: i32,
    /// The main thread (its registers are the ones G resumes with).
    pub(crate) leader: ThreadState,
    /// The other threads, re-created in G.
    pub(crate) threads: Vec<ThreadState>,
    /// The lowest pid G1 may take (above every pid and tid of the box's
    /// process tree, which the tree's processes are given later).
    pub(crate) free_floor: i32,
}

impl TemplateState {
    /// A pid in the box's pid namespace that no thread of the template has
    /// (for G1, which must not take a pid a thread of G is re-created with).
    fn free_ns_pid(&self) -> i32 {
        let highest = self
            .threads
            .iter()
            .map(|t| t.ns_tid)
            .chain([self.ns_pid, self.free_floor - 1])
            .max()
            .unwrap_or(self.ns_pid);
        if highest == i32::MAX {
            // Not reachable with the kernel's pid_max (at most 2^22).
            2
        } else {
            highest + 1
        }
    }
}

/// Fork the stopped `template` (seized with every thread by
/// [`Tracee::seize_and_interrupt`]) into the clone shell described by `plan`,
/// every thread re-created in the clone (see the threads module). The template
/// is left stopped with its registers intact; detach it with
/// [`Tracee::detach`]. The clone's process is running when this returns.
///
/// # Errors
/// Any failure is returned with the syscall, pid and fd concerned; the processes
/// made so far are killed and the template is as before.
pub fn remote_fork(template: &mut Tracee, plan: &ForkPlan<'_>) -> Result<Forked> {
    let start = Instant::now();
    let (made, mut phases) = make_root(template, plan, start, 0, None)?;
    let ns_pid = made.ns_pid;
    let fds = made.fds.clone();
    let pid = made.release(plan.on_clone_signal)?;
    phases.mark("detach G");
    Ok(Forked {
        pid,
        ns_pid,
        fds,
        elapsed: start.elapsed(),
        phases: phases.done,
    })
}

/// The new objects of a clone made of several processes, shared among them:
/// connected objects (pipes, socket pairs) and shared memory, each made once
/// and given to every process that has the template's.
#[derive(Debug, Default)]
pub(crate) struct CloneTables {
    pub objects: CloneObjects,
    pub shared: SharedObjects,
}

/// A process of a clone that has been made and is held stopped: its main
/// thread, its re-created threads (their state set), the scratch area mapped
/// in it, and what is left to do before it runs: [`Made::release`]. Until then
/// it may fork children of its own (it still holds every capability in its
/// user namespace, which `set_tid` needs). Dropped, it is killed.
#[derive(Debug)]
pub(crate) struct Made {
    pub process: Tracee,
    pub threads: Vec<Tracee>,
    pub scratch: Scratch,
    /// Its pid in the clone's pid namespace.
    pub ns_pid: i32,
    /// The capability sets its main thread gets at release (`None`: it did not
    /// join a user namespace, so it keeps its own).
    pub caps: Option<CapState>,
    /// What was done with each of its template's fds.
    pub fds: Vec<FdOutcome>,
}

impl Made {
    /// Give the main thread its capability sets, unmap the scratch area, let
    /// every thread go, then send `signal` (if any) to the process. Returns
    /// its host pid.
    pub(crate) fn release(mut self, signal: Option<Signal>) -> Result<i32> {
        if let Some(caps) = &self.caps {
            caps::restore_sets(&mut self.process, &mut self.scratch, caps)?;
        }
        self.scratch.unmap(&mut self.process)?;
        for thread in std::mem::take(&mut self.threads) {
            thread.detach()?;
        }
        let pid = self.process.pid();
        self.process.detach()?;
        if let Some(sig) = signal {
            // To the main thread (stop signals stop every thread).
            nestbox_sys::process::tgkill(pid, pid, sig as i32).map_err(|e| RemoteError::Sys {
                op: "tgkill (on-clone signal)",
                pid,
                source: e.into(),
            })?;
        }
        Ok(pid)
    }
}

/// Make (and hold stopped) the clone of the stopped `template`, a child of
/// its box's init, in the shell of `plan`: everything [`remote_fork`] does but
/// the release. Returns it with the phases so far.
pub(crate) fn make_root(
    template: &mut Tracee,
    plan: &ForkPlan<'_>,
    start: Instant,
    free_floor: i32,
    tables: Option<&mut CloneTables>,
) -> Result<(Made, Phases)> {
    let mut phases = Phases::new(start);
    if !template.is_stopped() {
        return Err(RemoteError::NotStopped {
            pid: template.pid(),
            what: "call wait_stopped before remote_fork",
        });
    }
    let pid = template.pid();
    let mut namespaces = plan.namespaces.clone();
    namespaces.sort_by_key(|(kind, _)| *kind);
    if namespaces.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(RemoteError::Plan("a namespace kind is given twice".into()));
    }
    let status = Status::read(pid)?;
    ensure_all_threads_held(template)?;
    let entries = match &plan.inventory {
        Some(entries) => {
            let mut entries = entries.clone();
            refresh_volatile(pid, &mut entries)?;
            entries
        }
        None => inspect_fds(pid)?,
    };
    ensure_clonable(pid, &entries)?;
    phases.mark("inventory");
    let mut state = read_template(template, &status)?;
    state.free_floor = free_floor;
    template.find_syscall_insn()?;
    phases.mark("template state");

    // C1: shares the template's memory, child of the template's parent.
    let flags = (libc::CLONE_VM | libc::CLONE_PARENT) as u64;
    let c1_pid = template.fork_syscall(
        "clone",
        || "CLONE_VM|CLONE_PARENT".into(),
        libc::SYS_clone,
        &[flags, 0, 0, 0, 0],
    );
    let restored = template.restore_regs();
    let c1_pid = c1_pid?;
    let mut c1 = Tracee::adopt(c1_pid, template.syscall_insn)?;
    restored?;
    c1.set_options(TRACE_OPTIONS | libc::PTRACE_O_EXITKILL)?;
    let mut scratch = Scratch::map(&mut c1)?;
    phases.mark("fork C1");
    let mut session = Session {
        scratch_in_template: Some(scratch.addr),
        phases,
    };
    let result = session.run(
        template,
        c1,
        &mut scratch,
        plan,
        &namespaces,
        &entries,
        &state,
        tables,
    );
    match result {
        Ok(made) => Ok((made, session.phases)),
        Err(err) => {
            session.clean_template(template);
            Err(err)
        }
    }
}

/// Every thread of the template must be stopped under us: a thread left
/// running would change the memory while it is copied.
pub(crate) fn ensure_all_threads_held(template: &Tracee) -> Result<()> {
    let held = |tid: i32| {
        tid == template.pid()
            || template
                .threads()
                .iter()
                .any(|t| t.pid() == tid && t.is_stopped())
    };
    match task_ids(template.pid())?
        .into_iter()
        .find(|tid| !held(*tid))
    {
        None => Ok(()),
        Some(tid) => Err(RemoteError::NotStopped {
            pid: tid,
            what: "every thread of the template (seize it with Tracee::seize_and_interrupt)",
        }),
    }
}

pub(crate) fn read_template(template: &mut Tracee, status: &Status) -> Result<TemplateState> {
    let pid = template.pid();
    let cwd = procfs::cwd(pid)?;
    let ns_pid = status.innermost_pid()?;
    let (leader, threads) = match template.captured.clone() {
        Some(captured) => captured,
        None => {
            let syscall_insn = template.find_syscall_insn()?;
            // Every thread at once: the leader first, then the others.
            let mut others = template.take_threads();
            let mut group: Vec<&mut Tracee> = Vec::with_capacity(others.len() + 1);
            group.push(&mut *template);
            for thread in &mut others {
                thread.syscall_insn = syscall_insn;
                group.push(thread);
            }
            let captured = threads::capture_all(&mut group);
            drop(group);
            template.put_threads(others);
            let mut threads = captured?;
            let leader = threads.remove(0);
            template.captured = Some((leader.clone(), threads.clone()));
            (leader, threads)
        }
    };
    Ok(TemplateState {
        cwd,
        ns_pid,
        leader,
        threads,
        free_floor: 0,
    })
}

struct Session {
    /// Address of the scratch area while it is mapped in the template's memory.
    scratch_in_template: Option<u64>,
    phases: Phases,
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        template: &mut Tracee,
        mut c1: Tracee,
        scratch: &mut Scratch,
        plan: &ForkPlan<'_>,
        namespaces: &[(NsKind, BorrowedFd<'_>)],
        entries: &[FdEntry],
        state: &TemplateState,
        mut tables: Option<&mut CloneTables>,
    ) -> Result<Made> {
        let insn = template.syscall_insn;
        let [cookie0, cookie1] = plan.setns_cookie;

        // C1 moves itself into the clone's v1 cgroups (below): it writes "0" to
        // `tasks` files opened here. A single thread moving itself skips the
        // kernel's global thread-group lock, whose write side waits for an RCU
        // grace period (9-16 ms a fork here) when another process moves it.
        // Other files (v2 `cgroup.procs`) are written from here with its pid.
        let (self_moved, moved_here): (Vec<&PathBuf>, Vec<&PathBuf>) = plan
            .cgroup_task_files
            .iter()
            .partition(|p| p.file_name().is_some_and(|n| n == "tasks"));
        let tasks_files = self_moved
            .iter()
            .map(|path| {
                let opened = match plan.tasks_files_opener {
                    Some(uid) => nestbox_sys::creds::open_for_writing_as(path, uid)
                        .map(std::fs::File::from)
                        .map_err(std::io::Error::from),
                    None => std::fs::OpenOptions::new().write(true).open(path),
                };
                opened.map_err(|source| RemoteError::Cgroup {
                    pid: c1.pid(),
                    path: path.to_path_buf(),
                    source,
                })
            })
            .collect::<Result<Vec<_>>>()?;

        // Namespace fds, stdio and the `tasks` files, in one message.
        let mut handed: Vec<BorrowedFd<'_>> = namespaces.iter().map(|(_, fd)| *fd).collect();
        handed.extend(plan.stdio.iter().copied());
        handed.extend(tasks_files.iter().map(|f| f.as_fd()));
        let installed = install_fds_with(&mut c1, scratch, &handed)?;
        let (ns_fds, rest) = installed.split_at(namespaces.len());
        let (stdio_fds, tasks_fds) = rest.split_at(3);
        let stdio = [stdio_fds[0], stdio_fds[1], stdio_fds[2]];
        drop(tasks_files);
        self.phases.mark("fd hand-over");

        // The namespaces and the working directory in one resume (batch.rs).
        scratch.reset();
        let cwd = state.cwd.as_os_str().as_encoded_bytes();
        let cwd_addr = scratch.put_path(&c1, cwd)?;
        let mut batch = Batch::new();
        batch.push(
            "prctl(PR_GET_SECUREBITS)",
            String::new(),
            libc::SYS_prctl,
            &[libc::PR_GET_SECUREBITS as u64],
        );
        for ((kind, _), fd) in namespaces.iter().zip(ns_fds) {
            batch.push(
                "setns",
                format!("{} namespace", kind.proc_name()),
                libc::SYS_setns,
                &[*fd as u64, kind.clone_flag() as u64, cookie0, cookie1],
            );
        }
        batch.push(
            "chdir",
            format!(
                "to the template's working directory {}",
                state.cwd.display()
            ),
            libc::SYS_chdir,
            &[cwd_addr],
        );
        let securebits = batch.run(&mut c1, scratch)?[0];
        self.phases.mark("setns + chdir");

        let objects = tables.as_deref_mut().map(|t| {
            let creator = !t.objects.is_created();
            (&mut t.objects, creator)
        });
        let outcomes = retarget_with(&mut c1, scratch, template.pid(), entries, stdio, objects)?;
        self.phases.mark("fd re-targeting");

        if !tasks_fds.is_empty() {
            scratch.reset();
            let zero = scratch.put(&c1, b"0")?;
            let mut batch = Batch::new();
            for (fd, path) in tasks_fds.iter().zip(&self_moved) {
                batch.push(
                    "write",
                    format!("0 to {} (C1 moving itself)", path.display()),
                    libc::SYS_write,
                    &[*fd as u64, zero, 1],
                );
            }
            batch.run(&mut c1, scratch)?;
        }
        for path in moved_here {
            move_to_cgroup(c1.pid(), path)?;
        }
        close_all(&mut c1, &installed)?;
        self.phases.mark("cgroup");

        // G1: a fork (the one copy of the page tables) into the shell's pid namespace.
        let g1_ns_pid = state.free_ns_pid();
        let (mut g1, clone3_ok, dontfork) =
            fork_g1(template, &mut c1, scratch, g1_ns_pid, plan.setns_cookie)?;
        self.phases.mark("fork G1");
        let g1_scratch = scratch.inherited();
        // The template's memory no longer needs the scratch area.
        g1_scratch.unmap(&mut c1)?;
        self.scratch_in_template = None;
        c1.exit_group(0)?;
        self.phases.mark("C1 exit");

        // G: shares G1's memory, so no second copy; G1 exits and G is adopted by
        // the shell's init.
        let mut g1_scratch = g1_scratch;
        let (g_pid, _) = if clone3_ok {
            fork_into(
                &mut g1,
                &mut g1_scratch,
                libc::CLONE_VM as u64,
                state.ns_pid,
                plan.setns_cookie,
            )?
        } else {
            (legacy_fork(&mut g1, libc::CLONE_VM as u64)?, false)
        };
        let mut g = Tracee::adopt(g_pid, insn)?;
        self.phases.mark("fork G");
        g1.exit_group(0)?;
        self.phases.mark("G1 exit");
        if !clone3_ok && !state.threads.is_empty() {
            return Err(RemoteError::Plan(format!(
                "the template's seccomp filter refuses clone3 with the given cookie, so its {} other threads cannot be re-created with their tids",
                state.threads.len()
            )));
        }

        let mut g_scratch = g1_scratch.inherited();
        match tables {
            Some(tables) => {
                tables
                    .shared
                    .make_private(&mut g, &mut g_scratch, template.pid(), entries)?;
            }
            None => {
                crate::shmem::make_private(&mut g, &mut g_scratch, template.pid(), entries)?;
            }
        }
        let joined_user_ns = namespaces.iter().any(|(kind, _)| *kind == NsKind::User);
        let mut threads = fix_up(
            &mut g,
            &mut g_scratch,
            state,
            securebits,
            joined_user_ns,
            plan.setns_cookie,
        )?;
        {
            let mut group: Vec<&mut Tracee> = Vec::with_capacity(threads.len() + 1);
            group.push(&mut g);
            group.extend(threads.iter_mut());
            dontfork.mark(&mut group)?;
        }
        rearm_signalfd_watches(&mut g, &mut g_scratch, entries)?;
        crate::retarget::own_pidfds(&mut g, entries)?;
        self.phases.mark("G fix-up");
        g.set_original(state.leader.regs);
        let ns_pid = if clone3_ok {
            state.ns_pid
        } else {
            Status::read(g_pid)?.innermost_pid()?
        };
        Ok(Made {
            process: g,
            threads,
            scratch: g_scratch,
            ns_pid,
            caps: joined_user_ns.then_some(state.leader.caps),
            fds: outcomes,
        })
    }

    /// After a failure: the scratch area may still be mapped in the template's
    /// memory (C1 shared it); unmap it through the template itself.
    fn clean_template(&mut self, template: &mut Tracee) {
        if let Some(addr) = self.scratch_in_template.take() {
            // Already after a failure, which is what is reported: a scratch
            // area left mapped or registers not restored are logged.
            if let Err(e) = template.syscall(
                "munmap",
                || "scratch area left by a failed fork".into(),
                libc::SYS_munmap,
                &[addr, SCRATCH_LEN as u64],
            ) {
                tracing::warn!("unmapping the scratch area in the template: {e}");
            }
            if let Err(e) = template.restore_regs() {
                tracing::warn!("restoring the template's registers after a failed fork: {e}");
            }
        }
    }
}

/// Fork G1 from C1 with every mapping of the template's memory, those marked
/// `MADV_DONTFORK` (V8's heap) included, which a fork skips: when they are
/// known (an earlier fork of this stop found them), C1, which shares the
/// template's memory, clears their mark around the fork and the marks are put
/// back at once. Otherwise a plain fork is tried first, and its size compared
/// with the template's (`VmSize`, equal unless a mapping was skipped): only
/// when they differ are the skipped mappings found (those of the template's
/// `/proc/PID/maps` the first G1 lacks) and G1 forked again with them.
/// Returns G1, whether `clone3` was allowed, and the ranges.
fn fork_g1(
    template: &mut Tracee,
    c1: &mut Tracee,
    scratch: &mut Scratch,
    ns_pid: i32,
    cookie: [u64; 2],
) -> Result<(Tracee, bool, DontFork)> {
    let pid = template.pid();
    let dontfork = match template.dontfork.clone() {
        Some(known) => known,
        None => {
            let (g1_pid, clone3_ok) = fork_into(c1, scratch, 0, ns_pid, cookie)?;
            let g1 = Tracee::adopt(g1_pid, template.syscall_insn)?;
            if vm_size(g1_pid)? == vm_size(pid)? {
                template.dontfork = Some(DontFork::default());
                return Ok((g1, clone3_ok, DontFork::default()));
            }
            // What this G1 lacks is what was marked. It is let go and killed
            // (its teardown not waited for); its pid stays taken until C1
            // exits, so the next G1 gets the one after it.
            let dontfork = DontFork::missing_in(pid, g1_pid);
            g1.abandon();
            let dontfork = dontfork?;
            template.dontfork = Some(dontfork.clone());
            return fork_g1_unmarked(template, c1, scratch, ns_pid + 1, cookie, &dontfork)
                .map(|(g1, clone3_ok)| (g1, clone3_ok, dontfork));
        }
    };
    let (g1, clone3_ok) = fork_g1_unmarked(template, c1, scratch, ns_pid, cookie, &dontfork)?;
    Ok((g1, clone3_ok, dontfork))
}

/// Fork G1 with the `MADV_DONTFORK` marks of `dontfork` cleared around the
/// fork (see [`fork_g1`]).
fn fork_g1_unmarked(
    template: &mut Tracee,
    c1: &mut Tracee,
    scratch: &mut Scratch,
    ns_pid: i32,
    cookie: [u64; 2],
    dontfork: &DontFork,
) -> Result<(Tracee, bool)> {
    let unmarked = dontfork.unmark(c1);
    let forked = unmarked.and_then(|()| fork_into(c1, scratch, 0, ns_pid, cookie));
    let remarked = remark_template(template, c1, dontfork);
    let (g1_pid, clone3_ok) = forked?;
    remarked?;
    let g1 = Tracee::adopt(g1_pid, template.syscall_insn)?;
    Ok((g1, clone3_ok))
}

/// `VmSize` of `/proc/PID/status`, in kB.
fn vm_size(pid: i32) -> Result<u64> {
    let status = Status::read(pid)?;
    let text = status.get("VmSize")?;
    let kb = text.trim_end_matches("kB").trim();
    kb.parse().map_err(|_| RemoteError::Parse {
        path: procfs::proc_path(pid, "status"),
        message: format!("VmSize: {text:?}"),
    })
}

/// Put the `MADV_DONTFORK` marks back in the template's memory, spread over
/// its stopped threads and C1 (which shares that memory), whose registers are
/// then put back.
fn remark_template(template: &mut Tracee, c1: &mut Tracee, dontfork: &DontFork) -> Result<()> {
    if dontfork.ranges.is_empty() {
        return Ok(());
    }
    let mut others = template.take_threads();
    let marked = {
        let mut group: Vec<&mut Tracee> = Vec::with_capacity(others.len() + 2);
        group.push(c1);
        group.push(&mut *template);
        group.extend(others.iter_mut());
        let marked = dontfork.mark(&mut group);
        let mut restored = Ok(());
        for thread in group.into_iter().skip(1) {
            let r = thread.restore_regs();
            if restored.is_ok() {
                restored = r;
            }
        }
        marked.and(restored)
    };
    template.put_threads(others);
    marked
}

/// Close the fds that were handed over (one `close_range` when contiguous).
fn close_all(tracee: &mut Tracee, fds: &[i32]) -> Result<()> {
    let mut sorted = fds.to_vec();
    sorted.sort_unstable();
    let contiguous = sorted.windows(2).all(|w| w[1] == w[0] + 1);
    if let (true, Some(first), Some(last)) = (contiguous, sorted.first(), sorted.last()) {
        tracee.syscall(
            "close_range",
            || "handed-over fds".into(),
            nestbox_sys::fd::SYS_CLOSE_RANGE,
            &nestbox_sys::fd::close_range_args(*first as u32, *last as u32, 0),
        )?;
        return Ok(());
    }
    for fd in sorted {
        tracee.syscall(
            "close",
            || "handed-over fd".into(),
            libc::SYS_close,
            &[fd as u64],
        )?;
    }
    Ok(())
}

fn move_to_cgroup(pid: i32, path: &std::path::Path) -> Result<()> {
    let err = |source| RemoteError::Cgroup {
        pid,
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(err)?;
    file.write_all(pid.to_string().as_bytes()).map_err(err)
}

/// Fork `parent` with `clone3` (`flags`, exit signal SIGCHLD, pid `ns_pid` in the
/// namespace it creates children in). Falls back to `clone` when `clone3` is not
/// allowed (ENOSYS from the seccomp filter), and says so.
pub(crate) fn fork_into(
    parent: &mut Tracee,
    scratch: &mut Scratch,
    flags: u64,
    ns_pid: i32,
    cookie: [u64; 2],
) -> Result<(i32, bool)> {
    scratch.reset();
    let tid_addr = scratch.put(parent, &(ns_pid as i64).to_ne_bytes()[..4])?;
    let args = layout::CloneArgs {
        flags,
        exit_signal: libc::SIGCHLD as u64,
        set_tid: tid_addr,
        set_tid_size: 1,
        ..layout::CloneArgs::default()
    };
    let args_addr = scratch.put(parent, &args.to_bytes())?;
    let size = layout::CLONE_ARGS_SIZE as u64;
    let result = parent.fork_syscall(
        "clone3",
        || format!("pid {ns_pid} in the shell's pid namespace"),
        libc::SYS_clone3,
        &[args_addr, size, cookie[0], cookie[1]],
    );
    match result {
        Ok(pid) => Ok((pid, true)),
        Err(e) if e.errno() == Some(libc::ENOSYS) => Ok((legacy_fork(parent, flags)?, false)),
        Err(e) => Err(e),
    }
}

fn legacy_fork(parent: &mut Tracee, flags: u64) -> Result<i32> {
    parent.fork_syscall(
        "clone",
        || "fork into the shell's pid namespace".into(),
        libc::SYS_clone,
        &[flags | libc::SIGCHLD as u64, 0, 0, 0, 0],
    )
}

/// In G: give the main thread what fork or `CLONE_VM` does not carry over
/// (rseq area, robust futex list, alternate signal stack, clear-child-tid
/// address; its FPU state and signal mask are set again too), re-create the
/// other threads (while G still holds every capability in its user namespace,
/// which `set_tid` needs) with their capability state. G's own capability sets
/// are restored at [`Made::release`]. Returns the new threads, stopped.
pub(crate) fn fix_up(
    g: &mut Tracee,
    scratch: &mut Scratch,
    state: &TemplateState,
    securebits: u64,
    joined_user_ns: bool,
    cookie: [u64; 2],
) -> Result<Vec<Tracee>> {
    threads::apply_all(&mut [&mut *g], scratch, &[&state.leader], false)?;
    if state.leader.clear_child_tid != 0 {
        g.syscall(
            "set_tid_address",
            || "restoring the main thread's clear_child_tid".into(),
            libc::SYS_set_tid_address,
            &[state.leader.clear_child_tid],
        )?;
    }
    let caps = &state.leader.caps;
    if joined_user_ns {
        // Threads cloned after this inherit the bounding set and securebits.
        caps::restore_bounding(g, scratch, caps.bounding, !0, securebits)?;
    }
    let mut threads = threads::recreate(g, scratch, &state.threads, cookie)?;
    if joined_user_ns {
        threads::restore_caps(&mut threads, scratch, &state.threads, caps.bounding)?;
    }
    Ok(threads)
}

/// Register every signalfd watched by an epoll instance again, from `g`.
///
/// An epoll registration of a signalfd waits on the signal queue of the
/// process that made it: C1, which re-created the epoll instance and exits.
/// When C1's signal handlers go, the kernel detaches the registration
/// (`POLLFREE`), after which no signal of the clone would ever wake it: the
/// registration is made again in the clone's own process (delete, then add
/// with the same events and data).
pub(crate) fn rearm_signalfd_watches(
    g: &mut Tracee,
    scratch: &mut Scratch,
    entries: &[FdEntry],
) -> Result<()> {
    use crate::fdinfo::FdKind;
    let signalfds: Vec<i32> = entries
        .iter()
        .filter(|e| matches!(e.kind, FdKind::SignalFd { .. }))
        .map(|e| e.fd)
        .collect();
    if signalfds.is_empty() {
        return Ok(());
    }
    let mut batch = Batch::new();
    scratch.reset();
    for entry in entries {
        let FdKind::Epoll(watches) = &entry.kind else {
            continue;
        };
        for watch in watches.iter().filter(|w| signalfds.contains(&w.fd)) {
            let mut event = Vec::with_capacity(12);
            event.extend_from_slice(&watch.events.to_ne_bytes());
            event.extend_from_slice(&watch.data.to_ne_bytes());
            let addr = scratch.put(g, &event)?;
            let context = format!("epoll fd {} watching signalfd {}", entry.fd, watch.fd);
            batch.push(
                "epoll_ctl(EPOLL_CTL_DEL)",
                context.clone(),
                libc::SYS_epoll_ctl,
                &[
                    entry.fd as u64,
                    libc::EPOLL_CTL_DEL as u64,
                    watch.fd as u64,
                    0,
                ],
            );
            batch.push(
                "epoll_ctl(EPOLL_CTL_ADD)",
                context,
                libc::SYS_epoll_ctl,
                &[
                    entry.fd as u64,
                    libc::EPOLL_CTL_ADD as u64,
                    watch.fd as u64,
                    addr,
                ],
            );
        }
    }
    batch.run(g, scratch)?;
    Ok(())
}
