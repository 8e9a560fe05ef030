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
//! (`prctl(PR_GET_TID_ADDRESS)`); plus its tid in the box's pid namespace, its
//! capability sets and its name (`/proc/PID/task/TID/status` and `comm`).
//!
//! A thread is re-created by a `clone3` injected in the clone's (already
//! forked) process with the flags `pthread_create` uses, `set_tid` = its tid in
//! the pid namespace (the clone's pid namespace is fresh, and the process holds
//! `CAP_SYS_ADMIN` in its user namespace until its capabilities are restored),
//! so tids cached by runtimes stay right and futex words holding a tid (a
//! mutex's owner, a robust list) keep naming the right thread. It is attached
//! automatically (`PTRACE_O_TRACECLONE`), given its registers, XSAVE area and
//! signal mask by ptrace, and its rseq area, robust list, alternate stack, name
//! and capabilities by syscalls injected in it.
//!
//! Injected calls that concern many threads run in all of them at once
//! ([`Tracee::begin_syscall`] in each, then [`Tracee::end_syscall`] in each),
//! and the threads are made in rounds in which every thread made so far clones
//! the next one, so the cost grows with log2 of the thread count for the
//! clones and by one round trip per call kind for the rest.
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
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ThreadState {
    /// Host tid of the template's thread.
    pub host_tid: i32,
    /// Its tid in the innermost pid namespace (the box's).
    pub ns_tid: i32,
    /// Its general-purpose registers at the stop.
    #[serde(with = "regs_words")]
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
        let mut states = capture_all(&mut [thread])?;
        Ok(states.remove(0))
    }

    /// The registers the re-created thread resumes with: the template's, except
    /// that a syscall to be resumed through the restart block is re-run from
    /// the start (a new thread has no restart block of its own). A thread
    /// stopped in `restart_syscall` itself (resuming a call interrupted at an
    /// earlier stop) no longer shows which call that was: it returns `EINTR`
    /// from it, as the kernel makes such a call return when a signal handler
    /// runs.
    pub fn resume_regs(&self) -> Regs {
        let mut regs = self.regs;
        if (regs.orig_rax as i64) >= 0 && regs.rax as i64 == -ERESTART_RESTARTBLOCK {
            if regs.orig_rax == libc::SYS_restart_syscall as u64 {
                regs.rax = (-i64::from(libc::EINTR)) as u64;
            } else {
                regs.rax = regs.orig_rax;
                regs.rip -= 2;
            }
            regs.orig_rax = u64::MAX;
        }
        regs
    }
}

/// [`ThreadState::capture`] of several stopped threads at once: the syscalls
/// injected in them run in all of them together (see [`syscall_each`]).
pub(crate) fn capture_all(threads: &mut [&mut Tracee]) -> Result<Vec<ThreadState>> {
    let mut states = Vec::with_capacity(threads.len());
    for thread in threads.iter() {
        states.push(read_without_injection(thread)?);
    }
    // Answers go below each thread's red zone: stack_t, then clear_child_tid.
    let stack_len = std::mem::size_of::<libc::stack_t>() as u64;
    let answer_at = |s: &ThreadState| (s.regs.rsp - RED_ZONE - stack_len - 8 - 16) & !15;
    let tid_at = |s: &ThreadState| answer_at(s) + stack_len.next_multiple_of(8);
    let altstacks: Vec<_> = states
        .iter()
        .map(|s| Some((libc::SYS_sigaltstack, vec![0, answer_at(s)])))
        .collect();
    let tid_addresses: Vec<_> = states
        .iter()
        .map(|s| Some((libc::SYS_prctl, vec![PR_GET_TID_ADDRESS, tid_at(s)])))
        .collect();
    let queried = syscall_each(threads, &altstacks).and_then(|alt| {
        let tid = syscall_each(threads, &tid_addresses)?;
        Ok((alt, tid))
    });
    let mut restored = Ok(());
    for thread in threads.iter_mut() {
        let r = thread.restore_regs();
        if restored.is_ok() {
            restored = r;
        }
    }
    let (alt, tid) = queried?;
    restored?;
    for (i, (thread, state)) in threads.iter().zip(states.iter_mut()).enumerate() {
        let failed = |syscall: &'static str, rc: i64| RemoteError::Injected {
            syscall,
            pid: thread.pid(),
            context: "reading a thread's state".into(),
            source: std::io::Error::from_raw_os_error(-rc as i32),
        };
        let alt_rc = alt[i].unwrap_or(0);
        if alt_rc < 0 {
            return Err(failed("sigaltstack", alt_rc));
        }
        let addr = answer_at(state);
        let mut buf = vec![0u8; (tid_at(state) - addr + 8) as usize];
        thread.read_mem(addr, &mut buf)?;
        let ss = layout::parse_stack_t(&buf);
        state.altstack = (ss.ss_flags & libc::SS_DISABLE == 0).then_some((
            ss.ss_sp as u64,
            ss.ss_size as u64,
            ss.ss_flags & !libc::SS_ONSTACK,
        ));
        state.clear_child_tid = match tid[i].unwrap_or(0) {
            // A kernel without CONFIG_CHECKPOINT_RESTORE cannot tell it: the
            // thread is re-created without one (only a joiner of an exiting
            // thread cares).
            rc if rc == -i64::from(libc::EINVAL) => {
                tracing::warn!(
                    tid = thread.pid(),
                    "PR_GET_TID_ADDRESS unsupported: clear_child_tid not carried"
                );
                0
            }
            rc if rc < 0 => return Err(failed("prctl(PR_GET_TID_ADDRESS)", rc)),
            _ => {
                let at = (tid_at(state) - addr) as usize;
                u64::from_ne_bytes(buf[at..at + 8].try_into().unwrap_or([0; 8]))
            }
        };
    }
    Ok(states)
}

/// What ptrace and `/proc` tell about a stopped thread (the alternate stack
/// and clear-child-tid address are left empty).
fn read_without_injection(thread: &Tracee) -> Result<ThreadState> {
    let tid = thread.pid();
    let regs = *thread.original_regs().ok_or(RemoteError::NotStopped {
        pid: tid,
        what: "registers saved at the first stop",
    })?;
    let status = Status::read(tid)?;
    let robust_list = nestbox_sys::process::robust_list(tid).map_err(|e| RemoteError::Sys {
        op: "get_robust_list",
        pid: tid,
        source: e.into(),
    })?;
    Ok(ThreadState {
        host_tid: tid,
        ns_tid: status.innermost_pid()?,
        regs,
        fpu: read_fpu(tid)?,
        sigmask: nestbox_sys::ptrace::get_sigmask(tid)
            .map_err(ptrace_err("PTRACE_GETSIGMASK", tid))?,
        // Kernels without the request (before 5.13) simply have no rseq to carry.
        rseq: thread.rseq_configuration().unwrap_or(None),
        robust_list,
        altstack: None,
        clear_child_tid: 0,
        caps: CapState::from_status(&status)?,
        name: read_name(tid)?,
    })
}

/// Run one syscall in each of `threads` (`None`: none in that one), all at
/// once: each steps through its own while the others do, and they are waited
/// for in turn, so their round trips overlap instead of adding up. Returns the
/// raw results in order. Every call begun is waited for, even after a failure,
/// so that no thread is left mid-step.
fn syscall_each(
    threads: &mut [&mut Tracee],
    calls: &[Option<(i64, Vec<u64>)>],
) -> Result<Vec<Option<i64>>> {
    let (out, err) = syscall_each_full(threads, calls);
    match err {
        Some(e) => Err(e),
        None => Ok(out.into_iter().map(|r| r.map(|(rax, _)| rax)).collect()),
    }
}

/// [`syscall_each`] giving, for each call, its raw result and the host pid
/// of a child it created, whatever failed (returned apart: the children made
/// must be taken over even then).
#[allow(clippy::type_complexity)]
fn syscall_each_full(
    threads: &mut [&mut Tracee],
    calls: &[Option<(i64, Vec<u64>)>],
) -> (Vec<Option<(i64, Option<i32>)>>, Option<RemoteError>) {
    let mut begun = vec![false; threads.len()];
    let mut first_err = None;
    for (i, (thread, call)) in threads.iter_mut().zip(calls).enumerate() {
        if let Some((nr, args)) = call {
            match thread.begin_syscall(*nr, args) {
                Ok(()) => begun[i] = true,
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
    }
    let mut out = vec![None; threads.len()];
    for (i, thread) in threads.iter_mut().enumerate() {
        if begun[i] {
            match thread.end_syscall() {
                Ok(result) => out[i] = Some(result),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
    }
    (out, first_err)
}

/// [`syscall_each`], a negative result an [`RemoteError::Injected`] error
/// naming `name`, the thread and `context`.
pub(crate) fn syscall_each_checked(
    threads: &mut [&mut Tracee],
    name: &'static str,
    context: &str,
    calls: &[Option<(i64, Vec<u64>)>],
) -> Result<()> {
    let results = syscall_each(threads, calls)?;
    for (thread, rc) in threads.iter().zip(results) {
        if let Some(rc) = rc.filter(|rc| (-4095..0).contains(rc)) {
            return Err(RemoteError::Injected {
                syscall: name,
                pid: thread.pid(),
                context: context.to_string(),
                source: std::io::Error::from_raw_os_error(-rc as i32),
            });
        }
    }
    Ok(())
}

/// How many threads share the scratch area in one round of [`apply_all`]
/// (each needs at most 48 bytes of it).
const CHUNK: usize = 256;

/// Give the re-created `threads` (stopped) the parts of their `states` that are
/// set through ptrace and by syscalls injected in them (all threads of a chunk
/// at once); `with_regs` also sets their registers and names (the main thread
/// of a clone keeps its own, carried by the fork). Each resumes with its
/// registers at detach.
pub(crate) fn apply_all(
    threads: &mut [&mut Tracee],
    scratch: &mut Scratch,
    states: &[&ThreadState],
    with_regs: bool,
) -> Result<()> {
    for (thread, state) in threads.iter_mut().zip(states) {
        let tid = thread.pid();
        if with_regs {
            let regs = state.resume_regs();
            // Injections below run from the thread's own registers (its stack).
            thread.set_regs(&regs)?;
            thread.set_original(regs);
        }
        let (note, bytes) = &state.fpu;
        nestbox_sys::ptrace::set_regset(tid, *note, bytes)
            .map_err(ptrace_err("PTRACE_SETREGSET (FPU/vector state)", tid))?;
        nestbox_sys::ptrace::set_sigmask(tid, state.sigmask)
            .map_err(ptrace_err("PTRACE_SETSIGMASK", tid))?;
    }
    let rseq: Vec<_> = states
        .iter()
        .map(|s| {
            s.rseq.map(|(ptr, len, sig)| {
                (libc::SYS_rseq, vec![ptr, u64::from(len), 0, u64::from(sig)])
            })
        })
        .collect();
    syscall_each_checked(
        threads,
        "rseq",
        "re-registering a thread's rseq area",
        &rseq,
    )?;
    let robust: Vec<_> = states
        .iter()
        .map(|s| {
            let (head, len) = s.robust_list;
            (head != 0).then(|| (libc::SYS_set_robust_list, vec![head, len]))
        })
        .collect();
    syscall_each_checked(
        threads,
        "set_robust_list",
        "a thread's robust futex list",
        &robust,
    )?;
    // Threads start with their creator's name.
    let inherited = match (with_regs, threads.first()) {
        (true, Some(first)) => Some(read_name(first.pid())?),
        _ => None,
    };
    let mut start = 0;
    while start < threads.len() {
        let end = (start + CHUNK).min(threads.len());
        let chunk = &mut threads[start..end];
        let chunk_states = &states[start..end];
        scratch.reset();
        let mut names = Vec::with_capacity(chunk.len());
        let mut stacks = Vec::with_capacity(chunk.len());
        for (thread, state) in chunk.iter().zip(chunk_states) {
            names.push(match &inherited {
                Some(inherited) if *inherited != state.name => {
                    let addr = scratch.put_path(thread, &state.name)?;
                    Some((libc::SYS_prctl, vec![libc::PR_SET_NAME as u64, addr]))
                }
                _ => None,
            });
            stacks.push(match state.altstack {
                Some((sp, size, flags)) => {
                    let ss = libc::stack_t {
                        ss_sp: sp as *mut libc::c_void,
                        ss_flags: flags,
                        ss_size: size as usize,
                    };
                    let addr = scratch.put(thread, &layout::stack_t(&ss))?;
                    Some((libc::SYS_sigaltstack, vec![addr, 0]))
                }
                None => None,
            });
        }
        syscall_each_checked(chunk, "prctl(PR_SET_NAME)", "naming a thread", &names)?;
        syscall_each_checked(
            chunk,
            "sigaltstack",
            "restoring a thread's alternate signal stack",
            &stacks,
        )?;
        start = end;
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
    // In rounds: every thread of G made so far clones one more at the same
    // time, so n threads take about log2(n) rounds, not n. A thread clones
    // with the attributes of its creator, and before any is given its own
    // state every creator has G's main thread's (bounding set, securebits,
    // mask, name, full capabilities for set_tid).
    let mut made: Vec<Tracee> = Vec::with_capacity(threads.len());
    let (insn, tgid) = (g.syscall_insn, g.pid());
    let mut next = 0;
    while next < threads.len() {
        let mut creators: Vec<&mut Tracee> = Vec::with_capacity(made.len() + 1);
        creators.push(&mut *g);
        creators.extend(made.iter_mut());
        let count = creators.len().min(threads.len() - next).min(CHUNK);
        let creators = &mut creators[..count];
        let round = &threads[next..next + count];
        scratch.reset();
        let mut calls = Vec::with_capacity(count);
        for (creator, state) in creators.iter().zip(round) {
            let tid_addr = scratch.put(creator, &state.ns_tid.to_ne_bytes())?;
            let args_addr = scratch.put(creator, &clone_args(state, tid_addr).to_bytes())?;
            calls.push(Some((
                libc::SYS_clone3,
                vec![
                    args_addr,
                    layout::CLONE_ARGS_SIZE as u64,
                    cookie[0],
                    cookie[1],
                ],
            )));
        }
        let (results, failed) = syscall_each_full(creators, &calls);
        // Whatever failed, the threads made are taken over (and so killed
        // with G on failure).
        let mut new = Vec::with_capacity(count);
        for result in results.iter().flatten() {
            if let (_, Some(tid)) = result {
                new.push(Tracee::adopt_thread(*tid, tgid, insn)?);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        for ((result, state), creator) in results.iter().zip(round).zip(creators.iter()) {
            let rax = result.map_or(0, |(rax, _)| rax);
            if (-4095..0).contains(&rax) {
                return Err(RemoteError::Injected {
                    syscall: "clone3",
                    pid: creator.pid(),
                    context: format!(
                        "thread {} (tid {} in the box)",
                        state.host_tid, state.ns_tid
                    ),
                    source: std::io::Error::from_raw_os_error(-rax as i32),
                });
            }
        }
        if new.len() != count {
            return Err(RemoteError::NotStopped {
                pid: tgid,
                what: "a clone event after an injected clone3",
            });
        }
        made.extend(new);
        next += count;
    }
    let mut refs: Vec<&mut Tracee> = made.iter_mut().collect();
    let states: Vec<&ThreadState> = threads.iter().collect();
    apply_all(&mut refs, scratch, &states, true)?;
    Ok(made)
}

/// The `clone3` arguments that re-create the thread of `state`, its tid read
/// from `tid_addr`.
fn clone_args(state: &ThreadState, tid_addr: u64) -> layout::CloneArgs {
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
    layout::CloneArgs {
        flags,
        child_tid: state.clear_child_tid,
        tls: state.regs.fs_base,
        set_tid: tid_addr,
        set_tid_size: 1,
        ..layout::CloneArgs::default()
    }
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
        if state.caps.bounding != inherited {
            caps::restore_bounding(thread, scratch, state.caps.bounding, inherited, 0)?;
        }
    }
    let mut refs: Vec<&mut Tracee> = threads.iter_mut().collect();
    let mut start = 0;
    while start < refs.len() {
        let end = (start + CHUNK).min(refs.len());
        scratch.reset();
        let mut calls = Vec::with_capacity(end - start);
        for (thread, state) in refs[start..end].iter().zip(&states[start..end]) {
            let data = scratch.put(thread, &caps::capset_data(&state.caps))?;
            calls.push(Some((libc::SYS_capset, vec![data, data + 8])));
        }
        syscall_each_checked(
            &mut refs[start..end],
            "capset",
            "a thread's capability sets",
            &calls,
        )?;
        start = end;
    }
    for (thread, state) in threads.iter_mut().zip(states) {
        caps::raise_ambient(thread, &state.caps)?;
    }
    Ok(())
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
        // Kept at its size (a few KiB), not the buffer's.
        Ok(len) => Ok((NT_X86_XSTATE, buf[..len].to_vec())),
        Err(nix::errno::Errno::ENODEV) => {
            let len = nestbox_sys::ptrace::get_regset(tid, NT_PRFPREG, &mut buf)
                .map_err(ptrace_err("PTRACE_GETREGSET NT_PRFPREG", tid))?;
            Ok((NT_PRFPREG, buf[..len].to_vec()))
        }
        Err(e) => Err(ptrace_err("PTRACE_GETREGSET NT_X86_XSTATE", tid)(e)),
    }
}

/// A thread's general-purpose registers as 27 words, in the kernel's
/// `user_regs_struct` order (how a checkpoint image stores them).
mod regs_words {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::tracee::Regs;

    macro_rules! regs_fields {
        ($m:ident) => {
            $m!(
                r15, r14, r13, r12, rbp, rbx, r11, r10, r9, r8, rax, rcx, rdx, rsi, rdi, orig_rax,
                rip, cs, eflags, rsp, ss, fs_base, gs_base, ds, es, fs, gs
            )
        };
    }

    pub fn serialize<S: Serializer>(regs: &Regs, s: S) -> Result<S::Ok, S::Error> {
        macro_rules! words {
            ($($f:ident),*) => { vec![$(regs.$f),*] };
        }
        let words: Vec<u64> = regs_fields!(words);
        words.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Regs, D::Error> {
        let words = Vec::<u64>::deserialize(d)?;
        if words.len() != 27 {
            return Err(serde::de::Error::invalid_length(
                words.len(),
                &"27 register words",
            ));
        }
        let mut it = words.into_iter();
        macro_rules! build {
            ($($f:ident),*) => { Regs { $($f: it.next().unwrap_or(0)),* } };
        }
        Ok(regs_fields!(build))
    }
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
    fn a_thread_in_restart_syscall_gets_eintr() {
        let r = state_with(-516, libc::SYS_restart_syscall, 0x1002).resume_regs();
        assert_eq!(
            (r.rax as i64, r.rip, r.orig_rax),
            (-i64::from(libc::EINTR), 0x1002, u64::MAX)
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
