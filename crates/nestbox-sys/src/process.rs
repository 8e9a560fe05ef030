//! Process creation and control: forking into new namespaces with `clone(2)`,
//! signalling one thread (`tgkill`), raw wait statuses, `_exit`, and a fresh
//! image of the running binary (`exec_self`).

use std::os::fd::{FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sched::CloneFlags;
use nix::unistd::Pid;

use crate::Result;

/// What a fork returned, like `fork(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forked {
    /// In the parent, with the child's pid (as seen from the parent).
    Parent(Pid),
    /// In the child.
    Child,
}

/// Fork the calling process into new namespaces `flags` (`clone(2)` with no
/// new stack and `SIGCHLD`, so it behaves like `fork(2)`). With
/// `CLONE_NEWPID` the child is pid 1 of its pid namespace.
///
/// # Safety
/// As for `fork(2)`: the caller must be single-threaded (or the child must
/// touch no lock, allocator or other state another thread may have held at
/// the fork), and until it calls `exec` or [`exit_now`] the child may only do
/// what is async-signal-safe in the parent's state. `flags` must not contain
/// `CLONE_VM`, `CLONE_SETTLS`, `CLONE_VFORK` or the tid-pointer flags, which
/// would share or write memory the Rust program owns.
pub unsafe fn fork_into(flags: CloneFlags) -> Result<Forked> {
    let raw = flags.bits() as libc::c_ulong | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: the caller upholds the fork conditions above; with a null stack and
    // no CLONE_VM the child gets a copy of the address space, as with fork.
    let ret = unsafe { libc::syscall(libc::SYS_clone, raw, 0usize, 0usize, 0usize, 0usize) };
    match Errno::result(ret)? {
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(Pid::from_raw(pid as i32))),
    }
}

/// Fork the calling process through glibc's `fork(3)`, whose fork handlers
/// take malloc's locks in the parent around the fork and reset them in the
/// child: unlike [`fork_into`] (a bare `clone`), the child may allocate even
/// when other threads of the parent were allocating or freeing at that moment.
///
/// # Safety
/// The child must not use any other lock another thread of the parent may
/// have held at the fork (a `Mutex`, a channel, stdio's locks), and must end
/// with `exec` or [`exit_now`].
pub unsafe fn fork_with_malloc() -> Result<Forked> {
    // SAFETY: the caller upholds the conditions above; glibc's fork keeps its
    // allocator consistent in the child.
    let ret = unsafe { libc::fork() };
    match Errno::result(ret)? {
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(Pid::from_raw(pid))),
    }
}

/// [`fork_into`], also returning (in the parent) a pidfd of the child
/// (`CLONE_PIDFD`): the way to name a child born in a pid namespace other than
/// the one the caller's `/proc` shows.
///
/// # Safety
/// As for [`fork_into`].
pub unsafe fn fork_into_with_pidfd(flags: CloneFlags) -> Result<(Forked, Option<OwnedFd>)> {
    let raw = flags.bits() as libc::c_ulong
        | libc::CLONE_PIDFD as libc::c_ulong
        | libc::SIGCHLD as libc::c_ulong;
    let mut pidfd: libc::c_int = -1;
    // SAFETY: as in fork_into (conditions upheld by the caller); with CLONE_PIDFD
    // the kernel stores the child's pidfd in `pidfd`, a live local passed as the
    // parent-tid pointer.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone,
            raw,
            0usize,
            &mut pidfd as *mut libc::c_int,
            0usize,
            0usize,
        )
    };
    match Errno::result(ret)? {
        0 => Ok((Forked::Child, None)),
        pid => {
            // SAFETY: the kernel just created this descriptor for the caller.
            let fd = (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) });
            Ok((Forked::Parent(Pid::from_raw(pid as i32)), fd))
        }
    }
}

/// Send signal `sig` (a raw number: real-time signals included; 0 only checks)
/// to thread `tid` of thread group `tgid`.
pub fn tgkill(tgid: i32, tid: i32, sig: i32) -> Result<()> {
    // SAFETY: integer arguments only.
    let rc = unsafe { libc::syscall(libc::SYS_tgkill, tgid, tid, sig) };
    Errno::result(rc).map(drop)
}

/// `waitpid(pid, flags | __WALL)` returning the raw status, retrying on
/// `EINTR`; `None` with `WNOHANG` and nothing to report. Ptrace stops carry
/// event bits in the raw status that `nix`'s decoded one does not keep.
pub fn waitpid_raw(pid: i32, flags: libc::c_int) -> Result<Option<libc::c_int>> {
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid out-pointer for the duration of the call.
        let rc = unsafe { libc::waitpid(pid, &mut status, flags | libc::__WALL) };
        match Errno::result(rc) {
            Ok(0) => return Ok(None),
            Ok(_) => return Ok(Some(status)),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

/// The robust futex list of process `pid` (`get_robust_list(2)`): (head
/// address, length), both in `pid`'s address space. Needs ptrace rights over it.
pub fn robust_list(pid: i32) -> Result<(u64, u64)> {
    let mut head: u64 = 0;
    let mut len: u64 = 0;
    // SAFETY: head and len are valid out-pointers for a pointer and a size_t
    // (both 8 bytes on the 64-bit targets nestbox builds for).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_robust_list,
            pid,
            std::ptr::addr_of_mut!(head),
            std::ptr::addr_of_mut!(len),
        )
    };
    Errno::result(rc).map(|_| (head, len))
}

/// Give every signal its default disposition (except SIGKILL and SIGSTOP,
/// which have no other) and empty the signal mask, as a freshly started
/// program expects (Rust ignores SIGPIPE; an init may have blocked all).
pub fn reset_signal_dispositions() {
    use nix::sys::signal::{sigprocmask, SigHandler, SigSet, SigmaskHow, Signal};
    for sig in Signal::iterator() {
        if matches!(sig, Signal::SIGKILL | Signal::SIGSTOP) {
            continue;
        }
        // SAFETY: installing SIG_DFL involves no handler code at all
        // (and fails only for SIGKILL/SIGSTOP, skipped above).
        let _ = unsafe { nix::sys::signal::signal(sig, SigHandler::SigDfl) };
    }
    // Fails only for an invalid `how`, and SIG_SETMASK is valid.
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
}

/// The pidfd [`forward_signals`] sends to (-1: none).
static FORWARD_TO: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn forward_signal(sig: libc::c_int) {
    let fd = FORWARD_TO.load(std::sync::atomic::Ordering::Relaxed);
    if fd >= 0 {
        // SAFETY: pidfd_send_signal is a plain system call (async-signal-safe);
        // a null info is allowed; a failure (the process gone) is ignored.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd,
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
}

/// From now on, pass each of `signals` the calling process receives on to
/// the process `pidfd` refers to (which a pid could not name for sure: it
/// may be reused) instead of acting on it. The descriptor is kept open for
/// the rest of this process's life. For a process that stands for another
/// (nestbox-runc's waiter of a container forked from a template).
pub fn forward_signals(pidfd: OwnedFd, signals: &[nix::sys::signal::Signal]) -> Result<()> {
    use std::os::fd::IntoRawFd;
    FORWARD_TO.store(pidfd.into_raw_fd(), std::sync::atomic::Ordering::Relaxed);
    let action = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(forward_signal),
        nix::sys::signal::SaFlags::SA_RESTART,
        nix::sys::signal::SigSet::empty(),
    );
    for sig in signals {
        // SAFETY: the handler only reads an atomic and makes one system call,
        // both async-signal-safe.
        unsafe { nix::sys::signal::sigaction(*sig, &action) }?;
    }
    Ok(())
}

/// End the calling process at once with `code` (`_exit(2)`): no exit
/// handlers, no buffered-output flush, no destructors, which is what a forked
/// child must do so it does not run its parent's a second time.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit has no preconditions; skipping destructors only leaks.
    unsafe { libc::_exit(code) }
}

/// Replace the calling process's image with a fresh one of its own
/// executable, started with `args` and `env`; returns only on failure, with
/// its reason.
///
/// The executable is `/proc/self/exe`, which names the running binary's file
/// itself: it is found from any mount namespace (a box's, after its root was
/// pivoted away from the host's) and is the same binary even if the file at
/// its path was replaced since (a rebuilt or upgraded nestbox), so the new
/// image always understands what the old one hands over. `execve(2)` keeps
/// the pid, the parent, the children, the namespaces and cgroups, the
/// blocked signal mask and the pending signals, and every descriptor without
/// close-on-exec; it drops every mapping, every other thread, the signal
/// handlers (to their defaults) and the dumpable mark (set again to 1).
/// The caller's credentials are recomputed as for any non-set-user-ID
/// binary. The thread name becomes `exe`: the new image names itself.
pub fn exec_self(args: &[&std::ffi::CStr], env: &[&std::ffi::CStr]) -> Errno {
    match nix::unistd::execve(c"/proc/self/exe", args, env) {
        Err(e) => e,
        Ok(never) => match never {},
    }
}

/// `MADV_COLLAPSE` (Linux 6.1): make a range of anonymous memory transparent
/// huge pages now, copying its small pages into them.
pub const MADV_COLLAPSE: i32 = 25;

/// `process_madvise(2)`: give `advice` for the range `[start, start + len)` of
/// the memory of the process `pidfd` refers to; the bytes advised.
///
/// Safe to call: the range is only a hint to the kernel about the other
/// process's mappings (this process's memory is not touched), and the advice
/// values the kernel accepts here (`MADV_COLD`, `MADV_PAGEOUT`,
/// `MADV_WILLNEED`, `MADV_COLLAPSE`) never change the memory's contents.
pub fn process_madvise(
    pidfd: std::os::fd::BorrowedFd<'_>,
    start: u64,
    len: u64,
    advice: i32,
) -> Result<usize> {
    use std::os::fd::AsRawFd;
    let iov = libc::iovec {
        iov_base: start as *mut libc::c_void,
        iov_len: len as usize,
    };
    // SAFETY: the kernel reads one iovec from `iov`, which lives for the call;
    // the addresses in it belong to the other process and are never
    // dereferenced here.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            pidfd.as_raw_fd(),
            &iov as *const libc::iovec,
            1usize,
            advice,
            0u32,
        )
    };
    Errno::result(ret).map(|n| n as usize)
}

/// `prlimit(pid, resource)`: the (soft, hard) limit of another process.
pub fn get_rlimit(pid: i32, resource: i32) -> Result<(u64, u64)> {
    let mut old = libc::rlimit64 {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: the kernel writes one rlimit64 into `old`, which lives for the
    // call; no new limit is passed.
    let ret = unsafe { libc::prlimit64(pid, resource as _, std::ptr::null(), &mut old) };
    Errno::result(ret)?;
    Ok((old.rlim_cur, old.rlim_max))
}

/// `prlimit(pid, resource, soft, hard)`: set another process's limit (raising
/// a hard limit needs `CAP_SYS_RESOURCE`).
pub fn set_rlimit(pid: i32, resource: i32, soft: u64, hard: u64) -> Result<()> {
    let new = libc::rlimit64 {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: the kernel reads one rlimit64 from `new`, which lives for the
    // call; the old limit is not asked for.
    let ret = unsafe { libc::prlimit64(pid, resource as _, &new, std::ptr::null_mut()) };
    Errno::result(ret).map(drop)
}

/// `kcmp(pid1, pid2, KCMP_FILE, fd1, fd2)`: whether fd `fd1` of `pid1` and fd
/// `fd2` of `pid2` are the same open file description (needs ptrace access to
/// both; root has it).
pub fn same_open_file(pid1: i32, fd1: i32, pid2: i32, fd2: i32) -> Result<bool> {
    const KCMP_FILE: libc::c_int = 0;
    // SAFETY: kcmp takes only integers and reads nothing from this process.
    let ret = unsafe { libc::syscall(libc::SYS_kcmp, pid1, pid2, KCMP_FILE, fd1, fd2) };
    Errno::result(ret).map(|order| order == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scheduling_class_set_is_the_one_read() {
        // On a thread of its own: the class is the calling thread's, and a
        // nice value raised cannot be lowered again without privilege.
        std::thread::spawn(|| {
            set_scheduling(Scheduling::Normal(7)).unwrap();
            assert_eq!(scheduling().unwrap(), Scheduling::Normal(7));
            set_scheduling(Scheduling::Idle).unwrap();
            assert_eq!(scheduling().unwrap(), Scheduling::Idle);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn fork_into_no_new_namespace() {
        // SAFETY: the child only calls _exit (async-signal-safe) and the flags are
        // empty. The test harness is multi-threaded, which _exit tolerates.
        match unsafe { fork_into(CloneFlags::empty()) }.unwrap() {
            Forked::Child => exit_now(7),
            Forked::Parent(pid) => {
                let status = waitpid_raw(pid.as_raw(), 0).unwrap().unwrap();
                assert!(libc::WIFEXITED(status));
                assert_eq!(libc::WEXITSTATUS(status), 7);
            }
        }
    }

    #[test]
    fn fork_with_pidfd() {
        // SAFETY: as above.
        match unsafe { fork_into_with_pidfd(CloneFlags::empty()) }.unwrap() {
            (Forked::Child, _) => exit_now(0),
            (Forked::Parent(pid), fd) => {
                assert!(fd.is_some());
                let status = waitpid_raw(pid.as_raw(), 0).unwrap().unwrap();
                assert!(libc::WIFEXITED(status));
            }
        }
    }

    #[test]
    fn tgkill_zero_checks_a_thread() {
        let me = std::process::id() as i32;
        tgkill(me, me, 0).unwrap();
        assert_eq!(tgkill(me, -1, 0).unwrap_err(), Errno::EINVAL);
    }
}

/// `struct clone_args` of `clone3(2)` up to `set_tid_size` (Linux 5.5).
#[repr(C)]
#[derive(Default)]
struct Clone3Args {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
}

/// Make a stub process inside a box, to be turned into a restored process by
/// ptrace (nestbox's restore): a child of ours joins the namespaces
/// `namespaces` (`(CLONE_NEW* flag, namespace fd)`, in the order given: the
/// user namespace first, the pid namespace last), moves itself into the
/// cgroups by writing `0` to each of `cgroup_files` (v1 `tasks` or v2
/// `cgroup.procs`, opened for writing), and forks a helper into the joined
/// pid namespace as pid `helper_pid` (`clone3` with `set_tid`), which forks
/// the stub the same way as pid `ns_pid`; the helper is then killed, and
/// reaped by our child, which ends: an orphan goes to the reaper of its
/// parent's pid namespace, so the stub is adopted by the box's init (not by
/// the host's, as a child of our first child would be), and no zombie of the
/// helper is left in the box's pid namespace. The stub only waits in
/// `pause()`. Returns the stub's host pid.
///
/// # Safety
/// As for [`fork_into`]: the child runs only async-signal-safe calls, but the
/// caller must not hold state the forked child could need (it touches none).
/// The caller must be allowed to enter each namespace (root, or the owner of
/// the user namespace) and `ns_pid` must be free in the pid namespace.
pub unsafe fn spawn_stub(
    namespaces: &[(libc::c_int, std::os::fd::BorrowedFd<'_>)],
    cgroup_files: &[std::os::fd::BorrowedFd<'_>],
    ns_pid: i32,
    helper_pid: i32,
) -> Result<i32> {
    use std::os::fd::AsRawFd;
    let mut pipe = [0 as libc::c_int; 2];
    // SAFETY: `pipe` is a valid array of two ints for the kernel to fill.
    Errno::result(unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) })?;
    // SAFETY: both fds were just made by pipe2 and are owned here only.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the caller upholds fork_into's conditions; the child below
    // makes raw syscalls only and ends with exit_now.
    match unsafe { fork_into(CloneFlags::empty()) }? {
        Forked::Child => {
            let report = |value: i32| {
                let bytes = value.to_ne_bytes();
                // SAFETY: writes 4 bytes from a live local to our own pipe end.
                unsafe { libc::write(write_end.as_raw_fd(), bytes.as_ptr().cast(), 4) };
            };
            let errno = || Errno::last_raw();
            for (flag, fd) in namespaces {
                // SAFETY: setns with a namespace fd the caller owns.
                if unsafe { libc::setns(fd.as_raw_fd(), *flag) } != 0 {
                    report(-errno());
                    exit_now(1);
                }
            }
            for fd in cgroup_files {
                // SAFETY: writes one byte from a static string to an fd the caller owns.
                if unsafe { libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) } != 1 {
                    report(-errno());
                    exit_now(2);
                }
            }
            let fork_as = |pid: libc::pid_t| {
                let args = Clone3Args {
                    exit_signal: libc::SIGCHLD as u64,
                    set_tid: std::ptr::addr_of!(pid) as u64,
                    set_tid_size: 1,
                    ..Clone3Args::default()
                };
                // SAFETY: clone3 without CLONE_VM gives the new process a copy
                // of this one's memory, like fork; `args` and `pid` are live.
                unsafe {
                    libc::syscall(
                        libc::SYS_clone3,
                        std::ptr::addr_of!(args),
                        std::mem::size_of::<Clone3Args>(),
                    )
                }
            };
            match fork_as(helper_pid) {
                // The helper, in the box's pid namespace: it forks the stub
                // and waits to be killed (by our caller, once it has read the
                // stub's host pid from the helper's children).
                0 => match fork_as(ns_pid) {
                    0 | 1.. => loop {
                        // SAFETY: pause has no preconditions.
                        unsafe { libc::pause() };
                    },
                    _ => exit_now(3),
                },
                p if p < 0 => {
                    report(-errno());
                    exit_now(3)
                }
                helper => {
                    report(helper as i32);
                    // Reap the helper once our caller has killed it: left to
                    // the host's init (the reaper of this process's pid
                    // namespace), its zombie stayed in the box's pid
                    // namespace until that init got to it (a second here),
                    // and the box's init, which ends its box only once it is
                    // alone there, waited for it.
                    let mut status = 0;
                    // SAFETY: waits for our own child with a live local status.
                    unsafe { libc::waitpid(helper as libc::pid_t, &mut status, 0) };
                    exit_now(0)
                }
            }
        }
        Forked::Parent(child) => {
            drop(write_end);
            let mut bytes = [0u8; 4];
            // SAFETY: reads at most 4 bytes into a live local buffer from our own pipe end.
            let n = unsafe { libc::read(read_end.as_raw_fd(), bytes.as_mut_ptr().cast(), 4) };
            let helper = match (n, i32::from_ne_bytes(bytes)) {
                (4, p) if p > 0 => p,
                (4, e) => {
                    waitpid_raw(child.as_raw(), 0)?;
                    return Err(Errno::from_raw(-e));
                }
                _ => {
                    waitpid_raw(child.as_raw(), 0)?;
                    return Err(Errno::ECHILD);
                }
            };
            // The helper's one child is the stub; then the helper goes and the
            // box's init adopts the stub.
            let children = format!("/proc/{helper}/task/{helper}/children");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            let stub = loop {
                let found = std::fs::read_to_string(&children)
                    .ok()
                    .and_then(|t| t.split_whitespace().next().and_then(|p| p.parse().ok()));
                if let Some(stub) = found {
                    break Ok(stub);
                }
                let state =
                    std::fs::read_to_string(format!("/proc/{helper}/stat")).unwrap_or_default();
                if state.is_empty() || state.contains(") Z") || std::time::Instant::now() > deadline
                {
                    break Err(Errno::ESRCH);
                }
                std::thread::sleep(std::time::Duration::from_micros(100));
            };
            // SAFETY: kill with integer arguments; the helper is ours, parked in pause().
            unsafe { libc::kill(helper, libc::SIGKILL) };
            // Our child reaps it, then ends.
            waitpid_raw(child.as_raw(), 0)?;
            stub
        }
    }
}

/// A scheduling class for the calling process (see [`set_scheduling`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheduling {
    /// The ordinary class (`SCHED_OTHER`) at nice `n` (-20..=19).
    Normal(i32),
    /// `SCHED_IDLE`: runs only when nothing of the ordinary class wants the
    /// CPU, and any such process it wakes preempts it at once.
    Idle,
}

/// The class the calling thread runs in: `SCHED_IDLE`, or the ordinary
/// class at its nice value (any other policy is read as the ordinary class).
pub fn scheduling() -> Result<Scheduling> {
    // SAFETY: sched_getscheduler of pid 0 only reads the calling thread's policy.
    let policy = unsafe { libc::sched_getscheduler(0) };
    if policy < 0 {
        return Err(Errno::last());
    }
    if policy == libc::SCHED_IDLE {
        return Ok(Scheduling::Idle);
    }
    // getpriority returns -1 for a nice of -1 too: errno tells them apart.
    Errno::clear();
    // SAFETY: getpriority of PRIO_PROCESS 0 only reads the caller's nice value.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    if nice == -1 && Errno::last_raw() != 0 {
        return Err(Errno::last());
    }
    Ok(Scheduling::Normal(nice))
}

/// Put the calling process (its calling thread: nestbox's processes that
/// call this are single-threaded) in `class`. Nothing else is affected; an
/// error means the class was left as it was.
pub fn set_scheduling(class: Scheduling) -> Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = match class {
        Scheduling::Normal(_) => libc::SCHED_OTHER,
        Scheduling::Idle => libc::SCHED_IDLE,
    };
    // SAFETY: sched_setscheduler of pid 0 changes only the calling thread;
    // `param` is a valid sched_param (priority 0 is the only one allowed for
    // both policies) that lives for the call.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
        return Err(Errno::last());
    }
    if let Scheduling::Normal(nice) = class {
        // SAFETY: setpriority of PRIO_PROCESS 0 changes only the caller's nice value.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } != 0 {
            return Err(Errno::last());
        }
    }
    Ok(())
}
