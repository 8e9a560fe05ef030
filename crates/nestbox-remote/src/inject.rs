//! Running syscalls inside a stopped tracee: point its instruction pointer at a
//! `syscall` instruction it already has (in its `[vdso]`), load the syscall number
//! and arguments, single-step, and read the result.
//!
//! `orig_rax` is set to -1 for every injected call so that the kernel's
//! syscall-restart logic (which runs when a tracee that was stopped inside an
//! interrupted syscall resumes) leaves the injected call alone; the original
//! registers, put back afterwards, carry the interrupted call's restart state.

use std::io;
use std::sync::OnceLock;

use crate::error::{RemoteError, Result};
use crate::maps;
use crate::tracee::{is_fault, ptrace_err, Stop, Tracee};

/// `0f 05`, little-endian.
const SYSCALL_INSN: u16 = 0x050f;

/// Offset of a `syscall` instruction in this kernel's 64-bit vDSO image (the image
/// is the same in every 64-bit process), found once in our own vDSO.
fn vdso_syscall_offset() -> Option<u64> {
    static OFFSET: OnceLock<Option<u64>> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        // SAFETY: getauxval only reads the auxiliary vector.
        let base = unsafe { libc::getauxval(libc::AT_SYSINFO_EHDR) };
        if base == 0 {
            return None;
        }
        let own = maps::read_maps(std::process::id() as i32).ok()?;
        let vdso = own.iter().find(|m| m.name == "[vdso]" && m.start == base)?;
        let len = (vdso.end - vdso.start) as usize;
        // SAFETY: the kernel maps the whole [vdso] range readable in every process
        // for its lifetime; `len` is the mapping's size from /proc/self/maps.
        let image = unsafe { std::slice::from_raw_parts(base as *const u8, len) };
        image
            .windows(2)
            .position(|w| w == [0x0f, 0x05])
            .map(|pos| pos as u64)
    })
}

impl Tracee {
    /// Find (once) the address of a `syscall` instruction in the tracee: in its
    /// `[vdso]` at the offset it has in ours, else by scanning its executable
    /// mappings.
    pub(crate) fn find_syscall_insn(&mut self) -> Result<u64> {
        if self.syscall_insn != 0 {
            return Ok(self.syscall_insn);
        }
        let mappings = maps::read_maps(self.pid())?;
        if let (Some(vdso), Some(offset)) = (
            mappings.iter().find(|m| m.name == "[vdso]"),
            vdso_syscall_offset(),
        ) {
            let addr = vdso.start + offset;
            if addr + 2 <= vdso.end && self.peek(addr)? as u16 == SYSCALL_INSN {
                self.syscall_insn = addr;
                return Ok(addr);
            }
        }
        for map in mappings
            .iter()
            .filter(|m| m.prot == libc::PROT_READ | libc::PROT_EXEC)
        {
            let len = (map.end - map.start).min(1 << 20) as usize;
            let mut buf = vec![0u8; len];
            if self.read_mem(map.start, &mut buf).is_err() {
                continue;
            }
            if let Some(pos) = buf.windows(2).position(|w| w == [0x0f, 0x05]) {
                self.syscall_insn = map.start + pos as u64;
                return Ok(self.syscall_insn);
            }
        }
        Err(RemoteError::NoSyscallInstruction { pid: self.pid() })
    }

    /// `PTRACE_PEEKTEXT`: one word of the tracee's memory.
    fn peek(&self, addr: u64) -> Result<u64> {
        nestbox_sys::ptrace::peek_text(self.pid(), addr).map_err(|e| RemoteError::Ptrace {
            op: "PTRACE_PEEKTEXT",
            pid: self.pid(),
            source: e.into(),
        })
    }

    /// Run syscall `nr` with `args` in the tracee and return the raw `rax` it left
    /// (negative errno on failure), plus the host pid of a child it created (for
    /// fork/clone). The tracee ends stopped, with the syscall's result registers.
    pub(crate) fn inject_raw(&mut self, nr: i64, args: &[u64]) -> Result<(i64, Option<i32>)> {
        self.begin_syscall(nr, args)?;
        self.end_syscall()
    }

    /// First half of [`Tracee::inject_raw`]: load the call and let the tracee
    /// step through it. Several tracees may run their calls at once; each is
    /// then waited for with [`Tracee::end_syscall`].
    pub(crate) fn begin_syscall(&mut self, nr: i64, args: &[u64]) -> Result<()> {
        let insn = self.find_syscall_insn()?;
        let mut regs = match self.current {
            Some(regs) => regs,
            None => self.get_regs()?,
        };
        let arg = |i: usize| args.get(i).copied().unwrap_or(0);
        regs.rax = nr as u64;
        regs.orig_rax = u64::MAX;
        regs.rdi = arg(0);
        regs.rsi = arg(1);
        regs.rdx = arg(2);
        regs.r10 = arg(3);
        regs.r8 = arg(4);
        regs.r9 = arg(5);
        regs.rip = insn;
        self.set_regs(&regs)?;
        self.resume(libc::PTRACE_SINGLESTEP, 0)
    }

    /// Second half of [`Tracee::inject_raw`]: wait until the call begun with
    /// [`Tracee::begin_syscall`] has returned; its raw `rax` and the host pid of
    /// a child it created.
    pub(crate) fn end_syscall(&mut self) -> Result<(i64, Option<i32>)> {
        let insn = self.syscall_insn;
        let mut child = None;
        loop {
            match self.wait_blocking()? {
                Stop::Signal(libc::SIGTRAP) => {
                    let after = self.get_regs()?;
                    self.current = Some(after);
                    if after.rip == insn + 2 {
                        self.settle()?;
                        return Ok((after.rax as i64, child));
                    }
                    // A SIGTRAP that is not our single-step: keep it for later.
                    self.defer(libc::SIGTRAP);
                    if after.rip != insn {
                        return Err(RemoteError::NotStopped {
                            pid: self.pid(),
                            what: "at the injected syscall instruction",
                        });
                    }
                }
                Stop::Signal(sig) if is_fault(sig) => {
                    return Err(RemoteError::Faulted {
                        pid: self.pid(),
                        signal: sig,
                        what: "at an injected syscall",
                    })
                }
                Stop::Signal(sig) => self.defer(sig),
                Stop::NewChild(pid) => child = Some(pid),
                Stop::Interrupt | Stop::OtherEvent(_) => {}
            }
            self.resume(libc::PTRACE_SINGLESTEP, 0)?;
        }
    }

    /// Run syscall `nr` with up to six `args` in the stopped tracee and return the
    /// raw result (a negative errno on failure). The tracee stays stopped; its
    /// registers are put back by [`Tracee::restore_regs`] or at detach.
    pub fn inject_syscall(&mut self, nr: i64, args: &[u64]) -> Result<i64> {
        if args.len() > 6 {
            return Err(RemoteError::Plan(
                "a syscall takes at most six arguments".into(),
            ));
        }
        Ok(self.inject_raw(nr, args)?.0)
    }

    /// Run a syscall in the tracee; a negative result becomes
    /// [`RemoteError::Injected`] naming `name` and `context`.
    pub(crate) fn syscall(
        &mut self,
        name: &'static str,
        context: impl FnOnce() -> String,
        nr: i64,
        args: &[u64],
    ) -> Result<u64> {
        let (rax, _) = self.inject_raw(nr, args)?;
        check(self.pid(), name, context, rax)
    }

    /// Run a fork-like syscall in the tracee and return the new child's host pid
    /// (the child is auto-attached; take it with [`Tracee::adopt`]).
    pub(crate) fn fork_syscall(
        &mut self,
        name: &'static str,
        context: impl FnOnce() -> String,
        nr: i64,
        args: &[u64],
    ) -> Result<i32> {
        let (rax, child) = self.inject_raw(nr, args)?;
        check(self.pid(), name, context, rax)?;
        child.ok_or(RemoteError::NotStopped {
            pid: self.pid(),
            what: "a fork event after an injected fork",
        })
    }

    /// Make the tracee call `exit_group(code)` and wait until it is gone.
    pub(crate) fn exit_group(&mut self, code: i32) -> Result<()> {
        let insn = self.find_syscall_insn()?;
        let mut regs = match self.current {
            Some(regs) => regs,
            None => self.get_regs()?,
        };
        regs.rax = libc::SYS_exit_group as u64;
        regs.orig_rax = u64::MAX;
        regs.rdi = code as u64;
        regs.rip = insn;
        self.set_regs(&regs)?;
        loop {
            self.resume(libc::PTRACE_CONT, 0)?;
            match self.wait_blocking() {
                Err(RemoteError::Exited { .. }) => {
                    self.mark_gone();
                    return Ok(());
                }
                Err(other) => return Err(other),
                Ok(_) => {}
            }
        }
    }

    /// `PTRACE_GET_RSEQ_CONFIGURATION`: (abi pointer, length, signature), if the
    /// tracee registered an rseq area.
    pub(crate) fn rseq_configuration(&self) -> Result<Option<(u64, u32, u32)>> {
        nestbox_sys::ptrace::rseq_configuration(self.pid())
            .map_err(ptrace_err("PTRACE_GET_RSEQ_CONFIGURATION", self.pid()))
    }
}

/// Map a raw syscall return to a result.
fn check(pid: i32, name: &'static str, context: impl FnOnce() -> String, rax: i64) -> Result<u64> {
    if (-4095..0).contains(&rax) {
        Err(RemoteError::Injected {
            syscall: name,
            pid,
            context: context(),
            source: io::Error::from_raw_os_error(-rax as i32),
        })
    } else {
        Ok(rax as u64)
    }
}
