//! The threads of a template process: what each one is made of, read from the
//! stopped template ([`ThreadState::capture`]), and its re-creation in the
//! clone's process ([`recreate`]).
//!
//! Per thread: the general-purpose registers (FS/GS base included), the whole
//! XSAVE area (x87/SSE/AVX/AVX-512/PKRU: `PTRACE_GETREGSET NT_X86_XSTATE`, as
//! large as the kernel says), the blocked-signal mask (`PTRACE_GETSIGMASK`),
//! the rseq registration (`PTRACE_GET_RSEQ_CONFIGURATION`), the robust futex
//! list (`get_robust_list(tid)`), and, read by syscalls injected in the thread
//! itself, its alternate signal stack and `clear_child_tid` address
//! (`prctl(PR_GET_TID_ADDRESS)`); plus its tid in the box's pid namespace.
//!
//! A thread is re-created by a `clone3` injected in the clone's (already
//! forked) process with the flags `pthread_create` uses, `set_tid` = its tid in
//! the pid namespace (the clone's pid namespace is fresh, and the process holds
//! `CAP_SYS_ADMIN` in its user namespace until its capabilities are restored),
//! so tids cached by runtimes stay right and futex words holding a tid (a
//! mutex's owner, a robust list) keep naming the right thread. It is attached
//! automatically (`PTRACE_O_TRACECLONE`), given its registers, XSAVE area and
//! signal mask by ptrace, and its rseq area, robust list and alternate stack by
//! syscalls injected in it.
//!
//! A thread stopped inside a syscall resumes as after a signal: the kernel
//! restarts `-ERESTARTSYS`, `-ERESTARTNOINTR` and `-ERESTARTNOHAND` from the
//! saved registers. `-ERESTART_RESTARTBLOCK` would resume through the thread's
//! restart block, which a new thread does not have (it holds its creator's), so
//! such a thread re-runs its original syscall instead: a relative sleep or
//! timed wait then restarts with its full duration.

use crate::caps::{self, CapState};
use crate::error::{RemoteError, Result};
use crate::layout;
use crate::memory::Scratch;
use crate::procfs::Status;
use crate::tracee::{ptrace_err, Regs, Tracee};

/// `NT_X86_XSTATE`: the XSAVE area register set.
const NT_X86_XSTATE: u32 = 0x202;
/// `NT_PRFPREG`: the FXSAVE area (512 bytes), for CPUs without XSAVE.
const NT_PRFPREG: u32 = 2;
/// Larger than any XSAVE area (AMX's is about 11 KiB); the kernel says how
/// much of it it filled.
const XSTATE_BUFFER: usize = 64 * 1024;
/// `ERESTART_RESTARTBLOCK`, the kernel-internal errno of a syscall that
/// resumes through the thread's restart block.
const ERESTART_RESTARTBLOCK: i64 = 516;
/// `PR_GET_TID_ADDRESS` (needs `CONFIG_CHECKPOINT_RESTORE`).
const PR_GET_TID_ADDRESS: u64 = 40;
/// The red zone below a thread's stack pointer, which the thread may use.
const RED_ZONE: u64 = 128;

/// Everything a thread of a template process is made of, beyond the memory
/// and fds its process shares.
#[derive(Debug, Clone)]
pub struct ThreadState {
    /// Host tid of the template's thread.
    pub host_tid: i32,
    /// Its tid in the innermost pid namespace (the box's).
    pub ns_tid: i32,
    /// Its general-purpose registers at the stop.
    pub regs: Regs,
    /// Register set note (`NT_X86_XSTATE`, or `NT_PRFPREG` without XSAVE) and
    /// the kernel's bytes of it.
    pub fpu: (u32, Vec<u8>),
    /// Blocked signals (bit `n - 1` for signal `n`).
    pub sigmask: u64,
    /// rseq registration: (area, length, signature).
    pub rseq: Option<(u64, u32, u32)>,
    /// Robust futex list: (head, length).
    pub robust_list: (u64, u64),
    /// Alternate signal stack: (base, size, flags without `SS_ONSTACK`).
    pub altstack: Option<(u64, u64, i32)>,
    /// `clear_child_tid` address (0: none).
    pub clear_child_tid: u64,
    /// Capability sets (per thread in Linux).
    pub caps: CapState,
    /// Its name (`comm`, what `PR_SET_NAME` set: `/proc/PID/task/TID/comm`).
    pub name: Vec<u8>,
}

impl ThreadState {
    /// Read the state of `thread`, a stopped thread of the template. Two
    /// syscalls are injected in it (writing below its red zone, memory it does
    /// not use); its registers are put back afterwards.
    ///
    /// # Errors
    /// A failed ptrace request or injected call, naming the thread.
    pub fn capture(thread: &mut Tracee) -> Result<ThreadState> {
        let tid = thread.pid();
        let regs = *thread.original_regs().ok_or(RemoteError::NotStopped {
            pid: tid,
            what: "registers saved at the first stop",
        })?;
        let status = Status::read(tid)?;
        let ns_tid = status.innermost_pid()?;
        let caps = CapState::from_status(&status)?;
        let name = read_name(tid)?;
        let fpu = read_fpu(tid)?;
        let sigmask =
            nestbox_sys::ptrace::get_sigmask(tid).map_err(ptrace_err("PTRACE_GETSIGMASK", tid))?;
        // Kernels without the request (before 5.13) simply have no rseq to carry.
        let rseq = thread.rseq_configuration().unwrap_or(None);
        let robust_list = nestbox_sys::process::robust_list(tid).map_err(|e| RemoteError::Sys {
            op: "get_robust_list",
            pid: tid,
            source: e.into(),
        })?;
        let queried = query_in_thread(thread, &regs);
        let restored = thread.restore_regs();
        let (altstack, clear_child_tid) = queried?;
        restored?;
        Ok(ThreadState {
            host_tid: tid,
            ns_tid,
            regs,
            fpu,
            sigmask,
            rseq,
            robust_list,
            altstack,
            clear_child_tid,
            caps,
            name,
        })
    }

    /// The registers the re-created thread resumes with: the template's, except
    /// that a syscall to be resumed through the restart block is re-run from
    /// the start (a new thread has no restart block of its own).
    pub fn resume_regs(&self) -> Regs {
        let mut regs = self.regs;
        if (regs.orig_rax as i64) >= 0 && regs.rax as i64 == -ERESTART_RESTARTBLOCK {
            regs.rax = regs.orig_rax;
            regs.rip -= 2;
            regs.orig_rax = u64::MAX;
        }
        regs
    }
}

/// The thread's name, without the newline `/proc` adds.
fn read_name(tid: i32) -> Result<Vec<u8>> {
    let path = crate::procfs::proc_path(tid, "comm");
    let mut name = std::fs::read(&path).map_err(|source| RemoteError::Proc { path, source })?;
    if name.last() == Some(&b'\n') {
        name.pop();
    }
    Ok(name)
}

/// The thread's XSAVE area, as large as the kernel has it (the FXSAVE area on
/// a CPU without XSAVE).
fn read_fpu(tid: i32) -> Result<(u32, Vec<u8>)> {
    let mut buf = vec![0u8; XSTATE_BUFFER];
    match nestbox_sys::ptrace::get_regset(tid, NT_X86_XSTATE, &mut buf) {
        Ok(len) => {
            buf.truncate(len);
            Ok((NT_X86_XSTATE, buf))
        }
        Err(nix::errno::Errno::ENODEV) => {
            let len = nestbox_sys::ptrace::get_regset(tid, NT_PRFPREG, &mut buf)
                .map_err(ptrace_err("PTRACE_GETREGSET NT_PRFPREG", tid))?;
            buf.truncate(len);
            Ok((NT_PRFPREG, buf))
        }
        Err(e) => Err(ptrace_err("PTRACE_GETREGSET NT_X86_XSTATE", tid)(e)),
    }
}

/// Read the alternate signal stack and the `clear_child_tid` address by
/// syscalls injected in `thread`, their results written below its red zone.
#[allow(clippy::type_complexity)]
fn query_in_thread(thread: &mut Tracee, regs: &Regs) -> Result<(Option<(u64, u64, i32)>, u64)> {
    let stack_len = std::mem::size_of::<libc::stack_t>() as u64;
    let addr = (regs.rsp - RED_ZONE - stack_len - 8 - 16) & !15;
    let tid_addr = addr + stack_len.next_multiple_of(8);
    thread.syscall(
        "sigaltstack",
        || "reading a thread's alternate signal stack".into(),
        libc::SYS_sigaltstack,
        &[0, addr],
    )?;
    let clear_child_tid =
        match thread.inject_raw(libc::SYS_prctl, &[PR_GET_TID_ADDRESS, tid_addr])? {
            // A kernel without CONFIG_CHECKPOINT_RESTORE cannot tell it: the thread
            // is re-created without one (only a joiner of an exiting thread cares).
            (rc, _) if rc == -i64::from(libc::EINVAL) => {
                tracing::warn!(
                    tid = thread.pid(),
                    "PR_GET_TID_ADDRESS unsupported: clear_child_tid not carried"
                );
                None
            }
            (rc, _) if rc < 0 => {
                return Err(RemoteError::Injected {
                    syscall: "prctl(PR_GET_TID_ADDRESS)",
                    pid: thread.pid(),
                    context: String::new(),
                    source: std::io::Error::from_raw_os_error(-rc as i32),
                })
            }
            _ => Some(()),
        };
    let mut buf = vec![0u8; (tid_addr - addr + 8) as usize];
    thread.read_mem(addr, &mut buf)?;
    let ss = layout::parse_stack_t(&buf);
    let altstack = (ss.ss_flags & libc::SS_DISABLE == 0).then_some((
        ss.ss_sp as u64,
        ss.ss_size as u64,
        ss.ss_flags & !libc::SS_ONSTACK,
    ));
    let at = (tid_addr - addr) as usize;
    let cct = clear_child_tid.map_or(0, |()| {
        u64::from_ne_bytes(buf[at..at + 8].try_into().unwrap_or([0; 8]))
    });
    Ok((altstack, cct))
}

/// Give thread `t` (re-created, stopped) the parts of `state` that are set
/// through ptrace and by injection in the thread; `with_regs` also sets its
/// registers (the thread resumes with them at detach).
pub(crate) fn apply(
    t: &mut Tracee,
    scratch: &mut Scratch,
    state: &ThreadState,
    with_regs: bool,
) -> Result<()> {
    let tid = t.pid();
    if with_regs {
        let regs = state.resume_regs();
        // Injections below run from the thread's own registers (its stack).
        t.set_regs(&regs)?;
        t.set_original(regs);
    }
    let (note, bytes) = &state.fpu;
    nestbox_sys::ptrace::set_regset(tid, *note, bytes)
        .map_err(ptrace_err("PTRACE_SETREGSET (FPU/vector state)", tid))?;
    nestbox_sys::ptrace::set_sigmask(tid, state.sigmask)
        .map_err(ptrace_err("PTRACE_SETSIGMASK", tid))?;
    if let Some((ptr, len, sig)) = state.rseq {
        t.syscall(
            "rseq",
            || format!("re-registering the rseq area at {ptr:#x}"),
            libc::SYS_rseq,
            &[ptr, u64::from(len), 0, u64::from(sig)],
        )?;
    }
    let (head, len) = state.robust_list;
    if head != 0 {
        t.syscall(
            "set_robust_list",
            String::new,
            libc::SYS_set_robust_list,
            &[head, len],
        )?;
    }
    if with_regs && read_name(tid)? != state.name {
        scratch.reset();
        let addr = scratch.put_path(t, &state.name)?;
        t.syscall(
            "prctl(PR_SET_NAME)",
            || format!("naming a thread {:?}", String::from_utf8_lossy(&state.name)),
            libc::SYS_prctl,
            &[libc::PR_SET_NAME as u64, addr],
        )?;
    }
    if let Some((sp, size, flags)) = state.altstack {
        let ss = libc::stack_t {
            ss_sp: sp as *mut libc::c_void,
            ss_flags: flags,
            ss_size: size as usize,
        };
        scratch.reset();
        let addr = scratch.put(t, &layout::stack_t(&ss))?;
        t.syscall(
            "sigaltstack",
            || "restoring a thread's alternate signal stack".into(),
            libc::SYS_sigaltstack,
            &[addr, 0],
        )?;
    }
    Ok(())
}

/// Re-create the template threads `threads` (not its leader) in `g`, the
/// clone's process, stopped in an injection, whose memory `scratch` is in.
/// Each gets its tid in the pid namespace `g` lives in, which must be free
/// there; `cookie` goes in the arguments the seccomp filter checks. Returns the
/// new threads, stopped with their state set: detach them to let them run
/// (dropped, they kill the whole process).
///
/// # Errors
/// A failed `clone3` (`EEXIST`: the tid is taken; `EPERM`: no `CAP_SYS_ADMIN`
/// in the pid namespace's user namespace), ptrace request or injected call.
pub(crate) fn recreate(
    g: &mut Tracee,
    scratch: &mut Scratch,
    threads: &[ThreadState],
    cookie: [u64; 2],
) -> Result<Vec<Tracee>> {
    let mut made = Vec::with_capacity(threads.len());
    for state in threads {
        scratch.reset();
        let tid_addr = scratch.put(g, &state.ns_tid.to_ne_bytes())?;
        let mut flags = (libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS) as u64;
        if state.clear_child_tid != 0 {
            flags |= libc::CLONE_CHILD_CLEARTID as u64;
        }
        let args = layout::CloneArgs {
            flags,
            child_tid: state.clear_child_tid,
            tls: state.regs.fs_base,
            set_tid: tid_addr,
            set_tid_size: 1,
            ..layout::CloneArgs::default()
        };
        let args_addr = scratch.put(g, &args.to_bytes())?;
        let host_tid = g.fork_syscall(
            "clone3",
            || {
                format!(
                    "thread {} (tid {} in the box)",
                    state.host_tid, state.ns_tid
                )
            },
            libc::SYS_clone3,
            &[
                args_addr,
                layout::CLONE_ARGS_SIZE as u64,
                cookie[0],
                cookie[1],
            ],
        )?;
        let mut thread = Tracee::adopt_thread(host_tid, g.pid(), g.syscall_insn)?;
        apply(&mut thread, scratch, state, true)?;
        made.push(thread);
    }
    Ok(made)
}

/// Give the re-created `threads` the capability sets of their `states`. They
/// were cloned with the bounding set `inherited` and every other capability
/// of their creator; what a thread's own bounding set lacks beyond that is
/// dropped in it.
pub(crate) fn restore_caps(
    threads: &mut [Tracee],
    scratch: &mut Scratch,
    states: &[ThreadState],
    inherited: u64,
) -> Result<()> {
    for (thread, state) in threads.iter_mut().zip(states) {
        caps::restore_bounding(thread, scratch, state.caps.bounding, inherited, 0)?;
        caps::restore_sets(thread, scratch, &state.caps)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state_with(rax: i64, orig_rax: i64, rip: u64) -> ThreadState {
        // SAFETY: user_regs_struct is plain integers; all-zero is valid.
        let mut regs: Regs = unsafe { std::mem::zeroed() };
        regs.rax = rax as u64;
        regs.orig_rax = orig_rax as u64;
        regs.rip = rip;
        ThreadState {
            host_tid: 1,
            ns_tid: 1,
            regs,
            fpu: (NT_X86_XSTATE, Vec::new()),
            sigmask: 0,
            rseq: None,
            robust_list: (0, 0),
            altstack: None,
            clear_child_tid: 0,
            caps: CapState {
                inheritable: 0,
                permitted: 0,
                effective: 0,
                bounding: 0,
                ambient: 0,
                no_new_privs: false,
                seccomp: 0,
            },
            name: Vec::new(),
        }
    }

    #[test]
    fn restart_block_syscalls_rerun_the_original_call() {
        let nanosleep = libc::SYS_nanosleep;
        let r = state_with(-516, nanosleep, 0x1002).resume_regs();
        assert_eq!(
            (r.rax, r.rip, r.orig_rax),
            (nanosleep as u64, 0x1000, u64::MAX)
        );
    }

    #[test]
    fn other_restarts_and_results_are_left_to_the_kernel() {
        for rax in [-512i64, -513, -514, -4, 0, 7] {
            let r = state_with(rax, libc::SYS_futex, 0x1002).resume_regs();
            assert_eq!((r.rax as i64, r.rip), (rax, 0x1002), "rax {rax}");
        }
        // Not in a syscall: -516 in rax is just a value.
        let r = state_with(-516, -1, 0x1002).resume_regs();
        assert_eq!((r.rax as i64, r.rip), (-516, 0x1002));
    }
}
