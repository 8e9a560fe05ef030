//! A process under our ptrace: attach with `PTRACE_SEIZE` + `PTRACE_INTERRUPT`, wait
//! for its stop, read and write its registers, detach or kill it.
//!
//! ptrace works per thread: a [`Tracee`] is one traced thread. The template's
//! [`Tracee`] is its thread-group leader, and it also holds the other threads of
//! the group ([`Tracee::threads`]), seized, stopped and detached with it, so that
//! the whole process stands still while it is forked.
//!
//! A [`Tracee`] is tied to the thread that attached (ptrace requests are only
//! accepted from the tracing thread), so it is neither `Send` nor `Sync`. While a
//! tracee exists, the calling process must not reap with `waitpid(-1, __WALL)`
//! elsewhere: the stops of tracees are reported through `waitpid`.
//!
//! Signals that arrive for the tracee while we drive it (signal-delivery stops)
//! are not lost: they are remembered and re-sent with `tgkill` when it is detached.

use std::fmt;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use nestbox_sys::ptrace::{self as sys_ptrace, regs_words};

use crate::error::{RemoteError, Result};
use crate::procfs::Status;
use crate::threads::ThreadState;

/// How long a seize waits for a template's exiting tracer to let it go.
const TRACER_EXIT_WAIT: Duration = Duration::from_secs(2);

/// The x86_64 general-purpose registers as `PTRACE_GETREGS` returns them.
pub type Regs = libc::user_regs_struct;

/// `PTRACE_O_*` options set on every tracee: auto-attach forked and cloned children.
pub(crate) const TRACE_OPTIONS: libc::c_int =
    libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACECLONE | libc::PTRACE_O_TRACEVFORK;

/// `PTRACE_O_SUSPEND_SECCOMP`: the tracee's seccomp filters do not apply to
/// it while it is traced with this option (needs `CAP_SYS_ADMIN` in the
/// initial user namespace).
pub(crate) const PTRACE_O_SUSPEND_SECCOMP: libc::c_int = 1 << 21;

/// What the tracee is to us: the template (detached on drop, registers restored)
/// or a process we created (killed on drop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Template,
    Child,
}

/// How a wait on the tracee ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// `PTRACE_EVENT_STOP` (interrupt, group stop, start of an auto-attached child).
    Interrupt,
    /// Fork/vfork/clone event; the new child's host pid.
    NewChild(i32),
    /// Any other `PTRACE_EVENT_*`.
    OtherEvent(i32),
    /// Signal-delivery stop with this signal.
    Signal(i32),
}

/// A thread attached with `PTRACE_SEIZE` (for the template: its leader, holding
/// the other threads of its group).
pub struct Tracee {
    pid: i32,
    /// Its thread group (process) id.
    tgid: i32,
    role: Role,
    attached: bool,
    stopped: bool,
    /// Registers at the first stop: what the process resumes with.
    original: Option<Regs>,
    /// Registers at the current stop (the base of the next injection).
    pub(crate) current: Option<Regs>,
    /// Signals that arrived while we drove the tracee, re-sent at detach.
    deferred: Vec<i32>,
    /// Address of a `syscall` instruction in the tracee (0 until found).
    pub(crate) syscall_insn: u64,
    /// The other threads of the template's thread group (empty for every
    /// other tracee), in the order they were seized.
    threads: Vec<Tracee>,
    /// The state of the leader and of `threads`, once read: it stays what it
    /// is while every thread is held, so the forks of one stop share it.
    pub(crate) captured: Option<(ThreadState, Vec<ThreadState>)>,
    /// The `MADV_DONTFORK` ranges of the template's memory, once read (they
    /// do not change while it is held either).
    pub(crate) dontfork: Option<crate::dontfork::DontFork>,
    /// Options added to every `PTRACE_SETOPTIONS` of it ([`Tracee::keep_options`]).
    pub(crate) sticky_options: libc::c_int,
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for Tracee {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracee")
            .field("pid", &self.pid)
            .field("tgid", &self.tgid)
            .field(
                "threads",
                &self.threads.iter().map(|t| t.pid).collect::<Vec<_>>(),
            )
            .field("role", &self.role)
            .field("attached", &self.attached)
            .field("stopped", &self.stopped)
            .field("deferred_signals", &self.deferred)
            .field("syscall_insn", &format_args!("{:#x}", self.syscall_insn))
            .finish()
    }
}

/// A ptrace error of request `op` on `pid`.
pub(crate) fn ptrace_err(
    op: &'static str,
    pid: i32,
) -> impl FnOnce(nix::errno::Errno) -> RemoteError {
    move |e| RemoteError::Ptrace {
        op,
        pid,
        source: e.into(),
    }
}

/// Whether `sig` is raised by the kernel at a faulting instruction: stepping
/// that instruction again would fault again, forever.
pub(crate) fn is_fault(sig: i32) -> bool {
    matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE
    )
}

/// Describe a wait status that is not a stop.
pub(crate) fn describe_exit(status: libc::c_int) -> Option<String> {
    if libc::WIFEXITED(status) {
        Some(format!("exited with status {}", libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(format!("was killed by signal {}", libc::WTERMSIG(status)))
    } else {
        None
    }
}

/// `waitpid(pid, flags | __WALL)` retrying on EINTR; `None` with `WNOHANG` and no change.
pub(crate) fn waitpid(pid: i32, flags: libc::c_int) -> Result<Option<libc::c_int>> {
    nestbox_sys::process::waitpid_raw(pid, flags).map_err(ptrace_err("waitpid", pid))
}

/// The thread ids of process `pid` (`/proc/PID/task`), ascending.
pub(crate) fn task_ids(pid: i32) -> Result<Vec<i32>> {
    let path = crate::procfs::proc_path(pid, "task");
    let dir = std::fs::read_dir(&path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            RemoteError::NoSuchProcess { pid }
        } else {
            RemoteError::Proc {
                path: path.clone(),
                source,
            }
        }
    })?;
    let mut tids: Vec<i32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
        .collect();
    tids.sort_unstable();
    Ok(tids)
}

impl Tracee {
    /// `PTRACE_SEIZE` the process, every one of its threads (auto-attaching
    /// their future children and threads) and ask each to stop with
    /// `PTRACE_INTERRUPT`. Returns at once: a process in a frozen cgroup only
    /// stops once thawed; call [`Tracee::wait_stopped`] after thawing.
    ///
    /// # Errors
    /// [`RemoteError::AlreadyTraced`] when another tracer holds the process,
    /// [`RemoteError::NoSuchProcess`] when it does not exist,
    /// [`RemoteError::ZombieLeader`] when its main thread has exited.
    pub fn seize_and_interrupt(pid: i32) -> Result<Tracee> {
        let status = Status::read(pid)?;
        if status.get("State")?.starts_with('Z') {
            let threads = status.threads()?;
            if threads > 1 {
                return Err(RemoteError::ZombieLeader { pid, threads });
            }
            return Err(RemoteError::NoSuchProcess { pid });
        }
        let mut tracee =
            Tracee::seize_thread(pid, pid)?.ok_or(RemoteError::NoSuchProcess { pid })?;
        tracee.seize_new_threads()?;
        Ok(tracee)
    }

    /// Seize and interrupt thread `tid` of process `tgid`; `None` when it has
    /// exited meanwhile (only for a thread that is not the leader).
    fn seize_thread(tgid: i32, tid: i32) -> Result<Option<Tracee>> {
        let deadline = Instant::now() + TRACER_EXIT_WAIT;
        while let Err(err) =
            sys_ptrace::seize(tid, TRACE_OPTIONS).map_err(ptrace_err("PTRACE_SEIZE", tid))
        {
            return match err.errno() {
                // Traced by a process that is exiting (a clone or checkpoint
                // killed with SIGKILL): an exiting process closes its files,
                // and so releases the template's clone lock, before the
                // kernel detaches its tracees. Seize again once it has.
                Some(libc::EPERM)
                    if Status::read(tid)
                        .and_then(|s| s.tracer_pid())
                        .is_ok_and(|t| t != 0 && crate::procfs::exiting(t))
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                Some(libc::ESRCH) if tid == tgid => Err(RemoteError::NoSuchProcess { pid: tid }),
                Some(libc::ESRCH) => Ok(None),
                Some(libc::EPERM) => match Status::read(tid).and_then(|s| s.tracer_pid()) {
                    // A thread cloned by one we had already seized is attached
                    // to us automatically; it stops on its own.
                    Ok(tracer) if tracer == std::process::id() as i32 && tid != tgid => {
                        let mut thread = Tracee::new(tid, Role::Template);
                        thread.tgid = tgid;
                        thread.attached = true;
                        Ok(Some(thread))
                    }
                    Ok(tracer) if tracer != 0 => {
                        Err(RemoteError::AlreadyTraced { pid: tgid, tracer })
                    }
                    Err(RemoteError::NoSuchProcess { .. }) if tid != tgid => Ok(None),
                    _ => Err(err),
                },
                _ => Err(err),
            };
        }
        let mut tracee = Tracee::new(tid, Role::Template);
        tracee.tgid = tgid;
        tracee.attached = true;
        match sys_ptrace::interrupt(tid) {
            Ok(()) => Ok(Some(tracee)),
            // It exited between the seize and the interrupt.
            Err(nix::errno::Errno::ESRCH) if tid != tgid => {
                tracee.mark_gone();
                Ok(None)
            }
            Err(e) => Err(ptrace_err("PTRACE_INTERRUPT", tid)(e)),
        }
    }

    /// Seize the threads of the process that are not seized yet (a thread
    /// created between the listing of `/proc/PID/task` and the seize of its
    /// creator shows up in the next listing); returns whether any was new.
    fn seize_new_threads(&mut self) -> Result<bool> {
        let mut any = false;
        loop {
            let mut new = false;
            for tid in task_ids(self.pid)? {
                if tid == self.pid || self.threads.iter().any(|t| t.pid == tid) {
                    continue;
                }
                if let Some(thread) = Tracee::seize_thread(self.pid, tid)? {
                    self.threads.push(thread);
                    new = true;
                }
            }
            if !new {
                return Ok(any);
            }
            any = true;
        }
    }

    /// The other threads of the template process, seized with it (empty for a
    /// tracee that is not a template).
    pub fn threads(&self) -> &[Tracee] {
        &self.threads
    }

    /// The state of this template process's leader and other threads, once a
    /// fork of this stop has read it (to keep it for later stops of the same
    /// frozen process: [`Tracee::reuse_state`]).
    pub fn read_state(&self) -> Option<&(ThreadState, Vec<ThreadState>)> {
        self.captured.as_ref()
    }

    /// Fork from `state`, read at an earlier stop of this same template
    /// process, instead of reading its threads again. The caller must know
    /// that the process ran no code of its own since (a template: frozen, and
    /// thawed only while held under ptrace); its registers may then differ
    /// from `state`'s only in how a system call the stop interrupted ends
    /// (restarted or failed with `EINTR`), both of which the process could
    /// have seen. Taken only when `state` names exactly the threads held now
    /// (by host tid); returns whether it was.
    ///
    /// # Errors
    /// Finding a `syscall` instruction in the process failed.
    pub fn reuse_state(&mut self, state: (ThreadState, Vec<ThreadState>)) -> Result<bool> {
        let mut held: Vec<i32> = self.threads.iter().map(|t| t.pid()).collect();
        let mut named: Vec<i32> = state.1.iter().map(|t| t.host_tid).collect();
        held.sort_unstable();
        named.sort_unstable();
        if state.0.host_tid != self.pid() || held != named || self.role != Role::Template {
            return Ok(false);
        }
        let insn = self.find_syscall_insn()?;
        for thread in &mut self.threads {
            thread.syscall_insn = insn;
        }
        self.captured = Some(state);
        Ok(true)
    }

    /// The other threads of the template process, to read their state.
    pub fn threads_mut(&mut self) -> &mut [Tracee] {
        &mut self.threads
    }

    /// Take the other threads out (to drive them together with the leader);
    /// give them back with [`Tracee::put_threads`].
    pub(crate) fn take_threads(&mut self) -> Vec<Tracee> {
        std::mem::take(&mut self.threads)
    }

    /// Give back the threads taken with [`Tracee::take_threads`].
    pub(crate) fn put_threads(&mut self, threads: Vec<Tracee>) {
        self.threads = threads;
    }

    /// The thread group (process) id of the tracee.
    pub fn tgid(&self) -> i32 {
        self.tgid
    }

    pub(crate) fn new(pid: i32, role: Role) -> Tracee {
        Tracee {
            pid,
            tgid: pid,
            role,
            attached: false,
            stopped: false,
            original: None,
            current: None,
            deferred: Vec::new(),
            syscall_insn: 0,
            threads: Vec::new(),
            captured: None,
            dontfork: None,
            sticky_options: 0,
            _not_send: PhantomData,
        }
    }

    /// Take over an auto-attached child (from a fork event): wait for its first
    /// stop. It is killed if dropped.
    pub(crate) fn adopt(pid: i32, syscall_insn: u64) -> Result<Tracee> {
        Tracee::adopt_thread(pid, pid, syscall_insn)
    }

    /// Take over an auto-attached thread `tid` of process `tgid` (from a clone
    /// event): wait for its first stop. Its process is killed if dropped.
    pub(crate) fn adopt_thread(tid: i32, tgid: i32, syscall_insn: u64) -> Result<Tracee> {
        let pid = tid;
        let mut child = Tracee::new(pid, Role::Child);
        child.tgid = tgid;
        child.attached = true;
        child.syscall_insn = syscall_insn;
        loop {
            match child.wait_blocking()? {
                Stop::Interrupt => break,
                Stop::Signal(sig) => {
                    child.defer(sig);
                    child.resume(libc::PTRACE_CONT, 0)?;
                }
                Stop::NewChild(_) | Stop::OtherEvent(_) => child.resume(libc::PTRACE_CONT, 0)?,
            }
        }
        let regs = child.get_regs()?;
        child.original = Some(regs);
        child.current = Some(regs);
        Ok(child)
    }

    /// Host pid of the tracee.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether the tracee is in a ptrace-stop.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Wait until the tracee, and every thread seized with it, has stopped after
    /// [`Tracee::seize_and_interrupt`], for at most `timeout` in all. Records
    /// their registers as the ones they will resume with. A thread that exits
    /// meanwhile is forgotten; one created meanwhile is seized and waited for.
    pub fn wait_stopped(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let pid = self.pid;
        let mut born = Vec::new();
        self.wait_own_stop(deadline, &mut born)?;
        loop {
            let mut i = 0;
            while i < self.threads.len() {
                match self.threads[i].wait_own_stop(deadline, &mut born) {
                    Ok(()) => i += 1,
                    Err(RemoteError::Exited { .. }) => {
                        self.threads.remove(i);
                    }
                    Err(e) => return Err(e),
                }
            }
            // Threads cloned by a thread before it stopped were attached to
            // us automatically (PTRACE_O_TRACECLONE) and stop on their own.
            let mut adopted = false;
            for tid in born.drain(..) {
                if self.threads.iter().any(|t| t.pid == tid) {
                    continue;
                }
                if Status::read(tid)
                    .and_then(|s| s.decimal::<i32>("Tgid"))
                    .ok()
                    == Some(pid)
                {
                    let mut thread = Tracee::new(tid, Role::Template);
                    thread.tgid = pid;
                    thread.attached = true;
                    self.threads.push(thread);
                    adopted = true;
                }
            }
            if !self.seize_new_threads()? && !adopted {
                return Ok(());
            }
            self.captured = None;
            self.dontfork = None;
        }
    }

    /// Wait for this one thread's stop until `deadline`; the ids of threads and
    /// children it created meanwhile are added to `born`.
    fn wait_own_stop(&mut self, deadline: Instant, born: &mut Vec<i32>) -> Result<()> {
        if self.stopped {
            return Ok(());
        }
        let start = Instant::now();
        let timeout = deadline.saturating_duration_since(start);
        let mut pause = Duration::from_micros(20);
        loop {
            match waitpid(self.pid, libc::WNOHANG)? {
                Some(status) => {
                    match self.decode(status)? {
                        Stop::Interrupt => {}
                        Stop::Signal(sig) => self.defer(sig),
                        Stop::NewChild(child) => {
                            born.push(child);
                            self.resume(libc::PTRACE_CONT, 0)?;
                            continue;
                        }
                        Stop::OtherEvent(_) => {
                            self.resume(libc::PTRACE_CONT, 0)?;
                            continue;
                        }
                    }
                    let regs = self.get_regs()?;
                    if regs.cs != 0x33 {
                        return Err(RemoteError::Not64Bit {
                            pid: self.pid,
                            cs: regs.cs,
                        });
                    }
                    self.original = Some(regs);
                    self.current = Some(regs);
                    return Ok(());
                }
                None if Instant::now() >= deadline => {
                    return Err(RemoteError::Timeout {
                        pid: self.pid,
                        timeout,
                    })
                }
                None => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(2));
                }
            }
        }
    }

    /// Block until the next stop or exit of the tracee and decode it.
    pub(crate) fn wait_blocking(&mut self) -> Result<Stop> {
        let status = waitpid(self.pid, 0)?.unwrap_or(0);
        self.decode(status)
    }

    fn decode(&mut self, status: libc::c_int) -> Result<Stop> {
        if let Some(how) = describe_exit(status) {
            self.attached = false;
            self.stopped = false;
            return Err(RemoteError::Exited { pid: self.pid, how });
        }
        if !libc::WIFSTOPPED(status) {
            return Err(RemoteError::NotStopped {
                pid: self.pid,
                what: "a wait status that is neither stop nor exit",
            });
        }
        self.stopped = true;
        let sig = libc::WSTOPSIG(status);
        let event = status >> 16;
        Ok(match event {
            0 => Stop::Signal(sig),
            libc::PTRACE_EVENT_STOP => Stop::Interrupt,
            libc::PTRACE_EVENT_FORK | libc::PTRACE_EVENT_VFORK | libc::PTRACE_EVENT_CLONE => {
                let msg = sys_ptrace::get_event_msg(self.pid)
                    .map_err(ptrace_err("PTRACE_GETEVENTMSG", self.pid))?;
                Stop::NewChild(msg as i32)
            }
            other => Stop::OtherEvent(other),
        })
    }

    /// Resume with `request` (`PTRACE_CONT`, `PTRACE_SINGLESTEP`) delivering `sig`.
    pub(crate) fn resume(&mut self, request: libc::c_uint, sig: i32) -> Result<()> {
        let op = if request == libc::PTRACE_SINGLESTEP {
            "PTRACE_SINGLESTEP"
        } else {
            "PTRACE_CONT"
        };
        let resumed = if request == libc::PTRACE_SINGLESTEP {
            sys_ptrace::single_step(self.pid, sig)
        } else {
            sys_ptrace::cont(self.pid, sig)
        };
        resumed.map_err(ptrace_err(op, self.pid))?;
        self.stopped = false;
        Ok(())
    }

    pub(crate) fn defer(&mut self, sig: i32) {
        if !self.deferred.contains(&sig) {
            self.deferred.push(sig);
        }
    }

    fn require_stopped(&self, what: &'static str) -> Result<()> {
        if self.attached && self.stopped {
            Ok(())
        } else {
            Err(RemoteError::NotStopped {
                pid: self.pid,
                what,
            })
        }
    }

    /// The tracee's registers now.
    pub fn get_regs(&self) -> Result<Regs> {
        self.require_stopped("reading registers")?;
        sys_ptrace::get_regs(self.pid).map_err(ptrace_err("PTRACE_GETREGS", self.pid))
    }

    /// Set the tracee's registers.
    pub fn set_regs(&mut self, regs: &Regs) -> Result<()> {
        self.require_stopped("writing registers")?;
        sys_ptrace::set_regs(self.pid, regs).map_err(ptrace_err("PTRACE_SETREGS", self.pid))?;
        self.current = Some(*regs);
        Ok(())
    }

    /// The registers the tracee had when it first stopped under us: what it resumes
    /// with when detached.
    pub fn original_regs(&self) -> Option<&Regs> {
        self.original.as_ref()
    }

    /// Make `regs` the registers the tracee resumes with (used to give a forked
    /// process its template's registers).
    pub(crate) fn set_original(&mut self, regs: Regs) {
        self.original = Some(regs);
    }

    /// Put back the registers the tracee resumes with.
    pub fn restore_regs(&mut self) -> Result<()> {
        if let Some(regs) = self.original {
            if self.current.as_ref().map(regs_words) != Some(regs_words(&regs)) {
                self.set_regs(&regs)?;
            }
        }
        Ok(())
    }

    /// Set ptrace options (`PTRACE_O_*`).
    pub(crate) fn set_options(&self, options: libc::c_int) -> Result<()> {
        sys_ptrace::set_options(self.pid, options | self.sticky_options)
            .map_err(ptrace_err("PTRACE_SETOPTIONS", self.pid))
    }

    /// Add `options` to every later [`Tracee::set_options`] of this tracee
    /// (until it is detached, which clears every option).
    pub(crate) fn keep_options(&mut self, options: libc::c_int) {
        self.sticky_options |= options;
    }

    /// Restore the original registers, re-send signals that arrived while we held
    /// the process, and detach so it runs (unless its cgroup is frozen); the
    /// same for every thread seized with it. The first failure is returned,
    /// after every thread has been tried.
    pub fn detach(mut self) -> Result<()> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<()> {
        self.captured = None;
        self.dontfork = None;
        let mut first_err = None;
        for thread in &mut self.threads {
            if let Err(e) = thread.detach_inner() {
                first_err.get_or_insert(e);
            }
        }
        self.threads.clear();
        let own = self.detach_own();
        match first_err {
            Some(e) => own.and(Err(e)),
            None => own,
        }
    }

    fn detach_own(&mut self) -> Result<()> {
        if !self.attached {
            return Ok(());
        }
        // A tracee killed meanwhile (its box stopped or removed while it
        // was traced: SIGKILL ends a stopped tracee too) has no registers to
        // put back and cannot be detached from (ESRCH): what was done with it
        // before stands, and nothing is left to undo.
        let pid = self.pid;
        let killed = move |e: &RemoteError| {
            matches!(e, RemoteError::Ptrace { source, .. } if source.raw_os_error() == Some(libc::ESRCH))
                && crate::procfs::exiting(pid)
        };
        if self.stopped {
            if let Err(e) = self.restore_regs() {
                if !killed(&e) {
                    return Err(e);
                }
            }
        }
        for sig in std::mem::take(&mut self.deferred) {
            // Best effort: a signal that cannot be re-sent (the process is gone)
            // has nobody left to reach.
            let _ = nestbox_sys::process::tgkill(self.tgid, self.pid, sig);
        }
        let result = sys_ptrace::detach(self.pid, 0).map_err(ptrace_err("PTRACE_DETACH", self.pid));
        self.attached = false;
        self.stopped = false;
        match result {
            Err(e) if killed(&e) => {
                // Its end goes to its parent once its tracer has seen it.
                let _ = nix::sys::wait::waitpid(
                    nix::unistd::Pid::from_raw(self.pid),
                    Some(
                        nix::sys::wait::WaitPidFlag::__WALL | nix::sys::wait::WaitPidFlag::WNOHANG,
                    ),
                );
                Ok(())
            }
            r => r.map(drop),
        }
    }

    /// Kill the tracee with SIGKILL and wait for it to be gone from our side (its
    /// real parent then reaps it).
    pub(crate) fn kill(&mut self) {
        if !self.attached {
            return;
        }
        // An error means the process is already gone, which the wait below sees.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        // A thread group leader's end is reported only once its other
        // threads are gone; those we trace too (a clone's re-created
        // threads) report their own end to us first, and must be reaped
        // here, or the leader's wait would never return.
        loop {
            for tid in task_ids(self.pid).unwrap_or_default() {
                if tid != self.pid {
                    let _ = waitpid(tid, libc::WNOHANG);
                }
            }
            match waitpid(self.pid, libc::WNOHANG) {
                Ok(Some(status)) if describe_exit(status).is_some() => break,
                Ok(Some(_)) => {}
                Ok(None) => std::thread::sleep(std::time::Duration::from_micros(200)),
                Err(_) => break,
            }
        }
        self.attached = false;
        self.stopped = false;
    }

    /// Let go of a stopped child and kill it without waiting for its end (its
    /// real parent reaps it): for a process whose teardown (a large memory)
    /// need not be waited for. Killed and waited for, as on drop, if it cannot
    /// be detached.
    pub(crate) fn abandon(mut self) {
        if self.attached && self.stopped && sys_ptrace::detach(self.pid, 0).is_ok() {
            self.attached = false;
            self.stopped = false;
            // An error means it is gone already.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    /// After a call injected in a thread we do not own (a template's, a
    /// checkpointed box's), which ends in a SIGTRAP stop with the call's
    /// registers: put the thread's own registers back and move it to an
    /// event stop (`PTRACE_INTERRUPT`, then `PTRACE_CONT` without the SIGTRAP:
    /// the pending interrupt stops it again before it returns to user space).
    /// Should we die between two calls (SIGKILL), the thread then goes on as
    /// it was, instead of taking the SIGTRAP (a core dump) or resuming with
    /// the injected registers. Threads of our own processes are left as
    /// they are (they die with us).
    pub(crate) fn settle(&mut self) -> Result<()> {
        let (Role::Template, Some(own)) = (self.role, self.original) else {
            return Ok(());
        };
        self.set_regs(&own)?;
        sys_ptrace::interrupt(self.pid).map_err(ptrace_err("PTRACE_INTERRUPT", self.pid))?;
        self.resume(libc::PTRACE_CONT, 0)?;
        loop {
            match self.wait_blocking()? {
                Stop::Interrupt => return Ok(()),
                Stop::Signal(sig) => {
                    // Arrived meanwhile: kept for the detach; the interrupt
                    // is still pending.
                    self.defer(sig);
                    self.resume(libc::PTRACE_CONT, 0)?;
                }
                Stop::NewChild(_) | Stop::OtherEvent(_) => {
                    self.resume(libc::PTRACE_CONT, 0)?;
                }
            }
        }
    }

    /// The tracee made ours: killed when dropped instead of let go (a stub
    /// process seized to be made into a restored one).
    pub(crate) fn owned(mut self) -> Tracee {
        self.role = Role::Child;
        self
    }

    /// Forget the tracee after it exited under our control.
    pub(crate) fn mark_gone(&mut self) {
        self.attached = false;
        self.stopped = false;
    }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        match self.role {
            Role::Template => {
                let unstopped = |t: &Tracee| t.attached && !t.stopped;
                if unstopped(self) || self.threads.iter().any(unstopped) {
                    // PTRACE_DETACH needs a stopped tracee: give the pending
                    // interrupt a moment (a frozen tracee stays attached until
                    // this process exits, when the kernel detaches it).
                    // A tracee that does not stop in time is detached below
                    // all the same (and fails there, logged).
                    let _ = self.wait_stopped(Duration::from_millis(100));
                }
                if let Err(e) = self.detach_inner() {
                    tracing::warn!("detaching from the template on drop: {e}");
                }
            }
            Role::Child => self.kill(),
        }
    }
}
