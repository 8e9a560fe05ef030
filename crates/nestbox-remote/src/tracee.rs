//! A process under our ptrace: attach with `PTRACE_SEIZE` + `PTRACE_INTERRUPT`, wait
//! for its stop, read and write its registers, detach or kill it.
//!
//! A [`Tracee`] is tied to the thread that attached (ptrace requests are only
//! accepted from the tracing thread), so it is neither `Send` nor `Sync`. While a
//! tracee exists, the calling process must not reap with `waitpid(-1, __WALL)`
//! elsewhere: the stops of tracees are reported through `waitpid`.
//!
//! Signals that arrive for the tracee while we drive it (signal-delivery stops)
//! are not lost: they are remembered and re-sent with `tgkill` when it is detached.

use std::fmt;
use std::io;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use crate::error::{RemoteError, Result};
use crate::procfs::Status;

/// The x86_64 general-purpose registers as `PTRACE_GETREGS` returns them.
pub type Regs = libc::user_regs_struct;

/// `PTRACE_O_*` options set on every tracee: auto-attach forked and cloned children.
pub(crate) const TRACE_OPTIONS: libc::c_int =
    libc::PTRACE_O_TRACEFORK | libc::PTRACE_O_TRACECLONE | libc::PTRACE_O_TRACEVFORK;

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

/// A process attached with `PTRACE_SEIZE`.
pub struct Tracee {
    pid: i32,
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
    _not_send: PhantomData<*const ()>,
}

impl fmt::Debug for Tracee {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracee")
            .field("pid", &self.pid)
            .field("role", &self.role)
            .field("attached", &self.attached)
            .field("stopped", &self.stopped)
            .field("deferred_signals", &self.deferred)
            .field("syscall_insn", &format_args!("{:#x}", self.syscall_insn))
            .finish()
    }
}

pub(crate) fn ptrace_err(op: &'static str, pid: i32) -> RemoteError {
    RemoteError::Ptrace {
        op,
        pid,
        source: io::Error::last_os_error(),
    }
}

/// `ptrace(request, pid, addr, data)`, mapping -1 to an error naming `op`.
pub(crate) fn ptrace(
    op: &'static str,
    request: libc::c_uint,
    pid: i32,
    addr: usize,
    data: usize,
) -> Result<libc::c_long> {
    // SAFETY: every caller passes, for requests that dereference `addr` or `data`,
    // a pointer to a live buffer of the size that request uses (user_regs_struct,
    // c_ulong, or the rseq configuration); the other requests take plain integers.
    // ptrace cannot otherwise touch this process's memory.
    let rc = unsafe { libc::ptrace(request, pid, addr as *mut libc::c_void, data) };
    if rc == -1 {
        Err(ptrace_err(op, pid))
    } else {
        Ok(rc)
    }
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
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer for the duration of the call.
        let rc = unsafe { libc::waitpid(pid, &mut status, flags | libc::__WALL) };
        if rc == pid {
            return Ok(Some(status));
        }
        if rc == 0 {
            return Ok(None);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(RemoteError::Ptrace {
                op: "waitpid",
                pid,
                source: err,
            });
        }
    }
}

impl Tracee {
    /// `PTRACE_SEIZE` the process (auto-attaching its future children) and ask it to
    /// stop with `PTRACE_INTERRUPT`. Returns at once: a process in a frozen cgroup
    /// only stops once thawed; call [`Tracee::wait_stopped`] after thawing.
    ///
    /// # Errors
    /// [`RemoteError::AlreadyTraced`] when another tracer holds the process,
    /// [`RemoteError::NoSuchProcess`] when it does not exist.
    pub fn seize_and_interrupt(pid: i32) -> Result<Tracee> {
        if let Err(err) = ptrace(
            "PTRACE_SEIZE",
            libc::PTRACE_SEIZE,
            pid,
            0,
            TRACE_OPTIONS as usize,
        ) {
            return Err(match err.errno() {
                Some(libc::ESRCH) => RemoteError::NoSuchProcess { pid },
                Some(libc::EPERM) => match Status::read(pid).and_then(|s| s.tracer_pid()) {
                    Ok(tracer) if tracer != 0 => RemoteError::AlreadyTraced { pid, tracer },
                    _ => err,
                },
                _ => err,
            });
        }
        let mut tracee = Tracee::new(pid, Role::Template);
        tracee.attached = true;
        ptrace("PTRACE_INTERRUPT", libc::PTRACE_INTERRUPT, pid, 0, 0)?;
        Ok(tracee)
    }

    pub(crate) fn new(pid: i32, role: Role) -> Tracee {
        Tracee {
            pid,
            role,
            attached: false,
            stopped: false,
            original: None,
            current: None,
            deferred: Vec::new(),
            syscall_insn: 0,
            _not_send: PhantomData,
        }
    }

    /// Take over an auto-attached child (from a fork event): wait for its first
    /// stop. It is killed if dropped.
    pub(crate) fn adopt(pid: i32, syscall_insn: u64) -> Result<Tracee> {
        let mut child = Tracee::new(pid, Role::Child);
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

    /// Wait until the tracee has stopped after [`Tracee::seize_and_interrupt`], for
    /// at most `timeout`. Records its registers as the ones it will resume with.
    pub fn wait_stopped(&mut self, timeout: Duration) -> Result<()> {
        if self.stopped {
            return Ok(());
        }
        let start = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            match waitpid(self.pid, libc::WNOHANG)? {
                Some(status) => {
                    match self.decode(status)? {
                        Stop::Interrupt => {}
                        Stop::Signal(sig) => self.defer(sig),
                        Stop::NewChild(_) | Stop::OtherEvent(_) => {
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
                None if start.elapsed() >= timeout => {
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
                let mut msg: libc::c_ulong = 0;
                ptrace(
                    "PTRACE_GETEVENTMSG",
                    libc::PTRACE_GETEVENTMSG,
                    self.pid,
                    0,
                    std::ptr::addr_of_mut!(msg) as usize,
                )?;
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
        ptrace(op, request, self.pid, 0, sig as usize)?;
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
        // SAFETY: user_regs_struct is plain integers; all-zero is a valid value.
        let mut regs: Regs = unsafe { std::mem::zeroed() };
        ptrace(
            "PTRACE_GETREGS",
            libc::PTRACE_GETREGS,
            self.pid,
            0,
            std::ptr::addr_of_mut!(regs) as usize,
        )?;
        Ok(regs)
    }

    /// Set the tracee's registers.
    pub fn set_regs(&mut self, regs: &Regs) -> Result<()> {
        self.require_stopped("writing registers")?;
        ptrace(
            "PTRACE_SETREGS",
            libc::PTRACE_SETREGS,
            self.pid,
            0,
            std::ptr::from_ref(regs) as usize,
        )?;
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
            if self.current.as_ref().map(regs_bytes) != Some(regs_bytes(&regs)) {
                self.set_regs(&regs)?;
            }
        }
        Ok(())
    }

    /// Set ptrace options (`PTRACE_O_*`).
    pub(crate) fn set_options(&self, options: libc::c_int) -> Result<()> {
        ptrace(
            "PTRACE_SETOPTIONS",
            libc::PTRACE_SETOPTIONS,
            self.pid,
            0,
            options as usize,
        )?;
        Ok(())
    }

    /// Restore the original registers, re-send signals that arrived while we held
    /// the process, and detach so it runs (unless its cgroup is frozen).
    pub fn detach(mut self) -> Result<()> {
        self.detach_inner()
    }

    fn detach_inner(&mut self) -> Result<()> {
        if !self.attached {
            return Ok(());
        }
        if self.stopped {
            self.restore_regs()?;
        }
        for sig in std::mem::take(&mut self.deferred) {
            // SAFETY: tgkill takes plain integers. The tgid equals the tid: the
            // processes we drive are single-threaded.
            unsafe { libc::syscall(libc::SYS_tgkill, self.pid, self.pid, sig) };
        }
        let result = ptrace("PTRACE_DETACH", libc::PTRACE_DETACH, self.pid, 0, 0);
        self.attached = false;
        self.stopped = false;
        result.map(drop)
    }

    /// Kill the tracee with SIGKILL and wait for it to be gone from our side (its
    /// real parent then reaps it).
    pub(crate) fn kill(&mut self) {
        if !self.attached {
            return;
        }
        // SAFETY: kill takes plain integers.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
        loop {
            match waitpid(self.pid, 0) {
                Ok(Some(status)) if describe_exit(status).is_some() => break,
                Ok(_) => {}
                Err(_) => break,
            }
        }
        self.attached = false;
        self.stopped = false;
    }

    /// Forget the tracee after it exited under our control.
    pub(crate) fn mark_gone(&mut self) {
        self.attached = false;
        self.stopped = false;
    }
}

fn regs_bytes(regs: &Regs) -> [u64; 27] {
    // SAFETY: user_regs_struct is exactly 27 u64 fields on x86_64, no padding.
    unsafe { std::mem::transmute_copy(regs) }
}

impl Drop for Tracee {
    fn drop(&mut self) {
        match self.role {
            Role::Template => {
                if self.attached && !self.stopped {
                    // PTRACE_DETACH needs a stopped tracee: give the pending
                    // interrupt a moment (a frozen tracee stays attached until
                    // this process exits, when the kernel detaches it).
                    let _ = self.wait_stopped(Duration::from_millis(100));
                }
                let _ = self.detach_inner();
            }
            Role::Child => self.kill(),
        }
    }
}
