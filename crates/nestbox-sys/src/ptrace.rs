//! Typed `ptrace(2)` requests.
//!
//! Every request that hands the kernel a pointer is given one here that points
//! to a live buffer of the type that request reads or writes, so callers hold
//! no pointer conditions: all of these are safe. Tracing another process
//! cannot touch this process's memory (a process cannot trace a thread of its
//! own thread group). Requests act on the tracee thread `pid`; the kernel
//! accepts them only from the thread that attached, and most only while the
//! tracee is in a ptrace-stop (`ESRCH` otherwise).
//!
//! Signals are raw numbers (real-time signals included; 0 for none), which
//! `nix::sys::ptrace` cannot express; that is why these are written out.

use nix::errno::Errno;

use crate::Result;

/// The registers of an x86_64 tracee thread.
pub type Regs = libc::user_regs_struct;

/// Request number of `PTRACE_GET_RSEQ_CONFIGURATION` (Linux 5.13).
const PTRACE_GET_RSEQ_CONFIGURATION: libc::c_uint = 0x420f;

/// Integer-only request: no pointer is passed in `addr` or `data`.
fn request(req: libc::c_uint, pid: i32, addr: usize, data: usize) -> Result<libc::c_long> {
    // SAFETY: callers pass only requests whose `addr` and `data` are integers (or
    // addresses in the tracee, which the kernel interprets there), never
    // pointers into this process.
    let rc = unsafe { libc::ptrace(req, pid, addr as *mut libc::c_void, data) };
    Errno::result(rc)
}

/// `PTRACE_SEIZE` with `options` (`PTRACE_O_*`): attach without stopping.
pub fn seize(pid: i32, options: libc::c_int) -> Result<()> {
    request(libc::PTRACE_SEIZE, pid, 0, options as usize).map(drop)
}

/// `PTRACE_INTERRUPT`: ask a seized tracee to stop.
pub fn interrupt(pid: i32) -> Result<()> {
    request(libc::PTRACE_INTERRUPT, pid, 0, 0).map(drop)
}

/// `PTRACE_SETOPTIONS`.
pub fn set_options(pid: i32, options: libc::c_int) -> Result<()> {
    request(libc::PTRACE_SETOPTIONS, pid, 0, options as usize).map(drop)
}

/// `PTRACE_CONT`, delivering signal `sig` (0: none).
pub fn cont(pid: i32, sig: i32) -> Result<()> {
    request(libc::PTRACE_CONT, pid, 0, sig as usize).map(drop)
}

/// `PTRACE_SINGLESTEP`, delivering signal `sig` (0: none).
pub fn single_step(pid: i32, sig: i32) -> Result<()> {
    request(libc::PTRACE_SINGLESTEP, pid, 0, sig as usize).map(drop)
}

/// `PTRACE_DETACH`, delivering signal `sig` (0: none).
pub fn detach(pid: i32, sig: i32) -> Result<()> {
    request(libc::PTRACE_DETACH, pid, 0, sig as usize).map(drop)
}

/// `PTRACE_GETEVENTMSG`: the message of the last ptrace event (the new pid
/// after a fork/clone event).
pub fn get_event_msg(pid: i32) -> Result<libc::c_ulong> {
    let mut msg: libc::c_ulong = 0;
    // SAFETY: `data` points to a live c_ulong, the one the request writes.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETEVENTMSG,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::addr_of_mut!(msg),
        )
    };
    Errno::result(rc).map(|_| msg)
}

/// `PTRACE_GETREGS`.
pub fn get_regs(pid: i32) -> Result<Regs> {
    let mut regs = std::mem::MaybeUninit::<Regs>::zeroed();
    // SAFETY: `data` points to a live user_regs_struct, the one the request writes.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGS,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            regs.as_mut_ptr(),
        )
    };
    Errno::result(rc)?;
    // SAFETY: zeroed is a valid user_regs_struct (plain integers), which the
    // kernel has now filled in.
    Ok(unsafe { regs.assume_init() })
}

/// `PTRACE_SETREGS`.
pub fn set_regs(pid: i32, regs: &Regs) -> Result<()> {
    // SAFETY: `data` points to a live user_regs_struct, which the request only reads.
    let rc = unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGS,
            pid,
            std::ptr::null_mut::<libc::c_void>(),
            std::ptr::from_ref(regs),
        )
    };
    Errno::result(rc).map(drop)
}

/// `PTRACE_PEEKTEXT`: the word at `addr` in the tracee.
pub fn peek_text(pid: i32, addr: u64) -> Result<u64> {
    // PEEKTEXT returns the word itself; -1 is ambiguous, so clear errno first.
    Errno::clear();
    // SAFETY: `addr` is an address in the tracee; `data` is unused (null).
    let word = unsafe {
        libc::ptrace(
            libc::PTRACE_PEEKTEXT,
            pid,
            addr as *mut libc::c_void,
            std::ptr::null_mut::<libc::c_void>(),
        )
    };
    if word == -1 && Errno::last_raw() != 0 {
        return Err(Errno::last());
    }
    Ok(word as u64)
}

/// `PTRACE_POKETEXT`: write the word `value` at `addr` in the tracee.
pub fn poke_text(pid: i32, addr: u64, value: u64) -> Result<()> {
    request(libc::PTRACE_POKETEXT, pid, addr as usize, value as usize).map(drop)
}

/// The tracee's restartable-sequence registration, if any:
/// (`rseq` area address, its size, its signature).
pub fn rseq_configuration(pid: i32) -> Result<Option<(u64, u32, u32)>> {
    /// `struct ptrace_rseq_configuration` of the kernel (24 bytes, no padding).
    #[repr(C)]
    #[derive(Default)]
    struct RseqConfiguration {
        rseq_abi_pointer: u64,
        rseq_abi_size: u32,
        signature: u32,
        flags: u32,
        pad: u32,
    }
    let mut conf = RseqConfiguration::default();
    // SAFETY: `data` points to a live RseqConfiguration and `addr` gives its
    // size, which bounds what the kernel writes.
    let rc = unsafe {
        libc::ptrace(
            PTRACE_GET_RSEQ_CONFIGURATION,
            pid,
            std::mem::size_of::<RseqConfiguration>() as *mut libc::c_void,
            std::ptr::addr_of_mut!(conf),
        )
    };
    Errno::result(rc)?;
    Ok((conf.rseq_abi_pointer != 0).then_some((
        conf.rseq_abi_pointer,
        conf.rseq_abi_size,
        conf.signature,
    )))
}

/// Request numbers of `PTRACE_GETSIGMASK` / `PTRACE_SETSIGMASK` (Linux 3.11).
const PTRACE_GETSIGMASK: libc::c_uint = 0x420a;
const PTRACE_SETSIGMASK: libc::c_uint = 0x420b;
/// `PTRACE_GETREGSET` / `PTRACE_SETREGSET`.
const PTRACE_GETREGSET: libc::c_uint = 0x4204;
const PTRACE_SETREGSET: libc::c_uint = 0x4205;

/// `PTRACE_GETREGSET` of register set `note` (`NT_*`) into `buf`; returns how
/// many bytes the kernel wrote (the set's size, when `buf` is large enough).
pub fn get_regset(pid: i32, note: u32, buf: &mut [u8]) -> Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: `data` points to a live iovec describing `buf`, which the kernel
    // writes at most `iov_len` bytes of, and whose length it updates.
    let rc = unsafe {
        libc::ptrace(
            PTRACE_GETREGSET,
            pid,
            note as usize as *mut libc::c_void,
            std::ptr::addr_of_mut!(iov),
        )
    };
    Errno::result(rc)?;
    Ok(iov.iov_len)
}

/// `PTRACE_SETREGSET` of register set `note` (`NT_*`) from `data`.
pub fn set_regset(pid: i32, note: u32, data: &[u8]) -> Result<()> {
    let iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    // SAFETY: `data` points to a live iovec describing `data`, which the
    // request only reads.
    let rc = unsafe {
        libc::ptrace(
            PTRACE_SETREGSET,
            pid,
            note as usize as *mut libc::c_void,
            std::ptr::addr_of!(iov),
        )
    };
    Errno::result(rc).map(drop)
}

/// `PTRACE_GETSIGMASK`: the tracee thread's blocked-signal mask (bit `n - 1`
/// for signal `n`).
pub fn get_sigmask(pid: i32) -> Result<u64> {
    let mut mask: u64 = 0;
    // SAFETY: `data` points to a live u64 and `addr` gives its size, the kernel
    // sigset size on x86_64, which bounds what the request writes.
    let rc = unsafe {
        libc::ptrace(
            PTRACE_GETSIGMASK,
            pid,
            std::mem::size_of::<u64>() as *mut libc::c_void,
            std::ptr::addr_of_mut!(mask),
        )
    };
    Errno::result(rc).map(|_| mask)
}

/// `PTRACE_SETSIGMASK`: set the tracee thread's blocked-signal mask.
pub fn set_sigmask(pid: i32, mask: u64) -> Result<()> {
    // SAFETY: `data` points to a live u64 of the size given in `addr`, which the
    // request only reads.
    let rc = unsafe {
        libc::ptrace(
            PTRACE_SETSIGMASK,
            pid,
            std::mem::size_of::<u64>() as *mut libc::c_void,
            std::ptr::addr_of!(mask),
        )
    };
    Errno::result(rc).map(drop)
}

/// The 27 words of `regs` in the kernel's order, for comparing register sets
/// (`user_regs_struct` has no `PartialEq` without libc's extra traits).
pub fn regs_words(r: &Regs) -> [u64; 27] {
    [
        r.r15, r.r14, r.r13, r.r12, r.rbp, r.rbx, r.r11, r.r10, r.r9, r.r8, r.rax, r.rcx, r.rdx,
        r.rsi, r.rdi, r.orig_rax, r.rip, r.cs, r.eflags, r.rsp, r.ss, r.fs_base, r.gs_base, r.ds,
        r.es, r.fs, r.gs,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regs_words_cover_the_struct() {
        assert_eq!(std::mem::size_of::<Regs>(), 27 * 8);
        // SAFETY: user_regs_struct is plain integers; all-zero is valid.
        let mut r: Regs = unsafe { std::mem::zeroed() };
        r.r15 = 1;
        r.gs = 27;
        r.rip = 17;
        let w = regs_words(&r);
        assert_eq!((w[0], w[16], w[26]), (1, 17, 27));
        assert_eq!(std::mem::offset_of!(Regs, rip), 16 * 8);
        assert_eq!(std::mem::offset_of!(Regs, gs), 26 * 8);
    }

    #[test]
    fn requests_on_a_non_tracee_fail() {
        // Our own parent is not our tracee.
        let ppid = nix::unistd::getppid().as_raw();
        assert_eq!(interrupt(ppid).unwrap_err(), Errno::ESRCH);
        assert!(get_regs(ppid).is_err());
    }
}
