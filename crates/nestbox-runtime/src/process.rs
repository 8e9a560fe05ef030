//! Small process helpers shared by the monitor, init, exec and the detached
//! start: shell-style exit codes from wait statuses, waiting for one child,
//! pointing stdio at `/dev/null`, becoming a daemon, running a pool refill in
//! a detached idle-priority process, pidfds of recorded processes, and
//! holding a box's mount namespace past its end (released in the background).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{pipe2, ForkResult, Pid};

use crate::error::EXIT_NESTBOX_ERROR;
use crate::liveness::ProcRef;

/// The shell-style exit code of a wait status: the code, or 128+N when killed by
/// signal N; `None` while the process is merely stopped or continued.
pub fn exit_code(status: WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + sig as i32),
        _ => None,
    }
}

/// Wait until the child `pid` ends and return its exit code (125 if it cannot be waited for).
pub fn wait_exit_code(pid: Pid) -> i32 {
    loop {
        match waitpid(pid, None) {
            Ok(status) => {
                if let Some(code) = exit_code(status) {
                    return code;
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return EXIT_NESTBOX_ERROR,
        }
    }
}

/// Close every descriptor of this process from `first` on (a forked helper
/// must not keep its parent's pipes, locks or box descriptors open); checked,
/// with a one-by-one fallback on kernels without `close_range`.
///
/// # Safety
/// As for [`nestbox_sys::fd::close_range`]: no live object of this process
/// owns one of those descriptors and uses or closes it afterwards.
pub unsafe fn close_fds_from(first: u32) -> crate::Result<()> {
    // SAFETY: the caller upholds the condition of close_range (above).
    unsafe { close_fds(first, u32::MAX) }
}

/// Close the descriptors `first..=last` of this process (none if `last <
/// first`), checked, as [`close_fds_from`] does.
///
/// # Safety
/// As for [`close_fds_from`].
pub unsafe fn close_fds(first: u32, last: u32) -> crate::Result<()> {
    if last < first {
        return Ok(());
    }
    // SAFETY: the caller upholds the condition of close_range (above).
    unsafe { nestbox_sys::fd::close_range(first, last) }.map_err(crate::RuntimeError::sys(format!(
        "close_range({first}, {last})"
    )))
}

/// The `/proc/PID` directories of the processes this process's `/proc` shows
/// (none if `/proc` cannot be read).
pub fn proc_pid_dirs() -> impl Iterator<Item = std::path::PathBuf> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path())
}

/// The pids of the process whose `/proc` directory is `dir`, outermost
/// namespace first (its `NSpid` line); `None` if it is gone.
pub fn ns_pids(dir: &std::path::Path) -> Option<Vec<i32>> {
    std::fs::read_to_string(dir.join("status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|v| {
            v.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
}

/// Point stdin, stdout and stderr at `/dev/null` (best effort).
pub fn stdio_to_dev_null() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            // Best effort, as documented: dup2 onto 0-2 fails only with EINTR
            // or EBUSY (a racing open), and the old descriptor then stays.
            let _ = nix::unistd::dup2(null.as_raw_fd(), fd);
        }
    }
}

/// A pidfd for `pid`.
pub fn pidfd_open(pid: i32) -> crate::Result<OwnedFd> {
    nestbox_sys::pidfd::pidfd_open(pid)
        .map_err(crate::RuntimeError::sys(format!("pidfd_open({pid})")))
}

/// A duplicate of descriptor `target` of the process behind `pidfd` (`pid`, for
/// the error message).
pub fn pidfd_getfd(pidfd: &OwnedFd, target: i32, pid: i32) -> crate::Result<OwnedFd> {
    nestbox_sys::pidfd::pidfd_getfd(pidfd.as_fd(), target).map_err(crate::RuntimeError::sys(
        format!("pidfd_getfd(pid {pid}, fd {target})"),
    ))
}

/// A pidfd for the recorded process `p` if it is alive: that very process,
/// never a later one that reused its pid.
pub(crate) fn pidfd_of(p: &ProcRef) -> Option<OwnedFd> {
    let fd = nestbox_sys::pidfd::pidfd_open(p.pid).ok()?;
    // Opened before the check: a process alive now with `p`'s start time has
    // held the pid since it started, so the pidfd names it.
    p.alive().then_some(fd)
}

/// The mount namespace of the live recorded process `p` (a box's init), held
/// open so that it outlives the box: when the box's last process ends, its
/// root overlay stays mounted (and unused) until the descriptor is closed,
/// instead of being unmounted in the exit of that process, which makes
/// overlayfs sync the whole filesystem of its upper layer (every dirty file
/// on it, the box's and everybody else's) while whoever waits for the box's
/// end waits too. Hand it to [`release_in_background`] once done. `None` if
/// the process is gone or its namespace cannot be opened.
pub(crate) fn hold_mount_ns(p: &ProcRef) -> Option<OwnedFd> {
    let pidfd = pidfd_of(p)?;
    let ns = std::fs::File::open(format!("/proc/{}/ns/mnt", p.pid)).ok()?;
    // Still running after the open: the path named `p`, not a process that
    // took its pid after it ended.
    match nestbox_sys::pidfd::wait_ended(pidfd.as_fd(), Some(Duration::ZERO)) {
        Ok(false) => Some(OwnedFd::from(ns)),
        _ => None,
    }
}

/// Drop the last reference to a finished box's mount namespace in a child
/// process that nobody waits for. Tearing the namespace down unmounts the
/// box's root: the kernel waits for an RCU grace period, frees the blocks of
/// the writable layer's (already removed) directories, and overlayfs syncs
/// the filesystem of its upper layer (every dirty file on it, whoever wrote
/// it: 1.5 ms on an idle machine, tens of milliseconds after a box wrote a
/// thousand files) -- none of which the box's user needs to wait for, since
/// the box and its layer are gone. The child keeps nothing else open (so the
/// caller's pipes see their end at once) and exits once this process has
/// closed its own copy of the namespace (the end of a pipe tells it), so
/// that the child's is the last reference.
pub(crate) fn release_in_background(ns: OwnedFd) {
    let Ok((wait_r, wait_w)) = pipe2(OFlag::empty()) else {
        return;
    };
    // SAFETY: between fork and _exit the child only calls dup2, close_range,
    // read and _exit, all async-signal-safe, which is what a fork of a
    // process that may have other threads allows.
    match unsafe { nix::unistd::fork() } {
        Ok(ForkResult::Child) => {
            // SAFETY: dup2 on this process's own descriptor table; the objects
            // owning descriptors 2 and up (`ns`, the pipe) are never used again:
            // this child ends with _exit below.
            let closed = unsafe {
                libc::dup2(ns.as_raw_fd(), 0);
                libc::dup2(wait_r.as_raw_fd(), 1);
                nestbox_sys::fd::close_range(2, u32::MAX)
            };
            if closed.is_err() {
                // Could not drop the caller's pipes: leave at once rather than
                // hold them open (the namespace is then released by the parent).
                nestbox_sys::process::exit_now(1);
            }
            // SAFETY: a one-byte read into a buffer on this stack; _exit ends the
            // child without running the parent's exit handlers.
            unsafe {
                let mut byte = 0u8;
                while libc::read(1, (&mut byte as *mut u8).cast(), 1) < 0
                    && Errno::last() == Errno::EINTR
                {}
                libc::_exit(0)
            }
        }
        // The parent's copies close here (the namespace first, then the
        // pipe that lets the child go); had the fork failed, this releases
        // the namespace in the foreground, as without this.
        _ => drop((ns, wait_w, wait_r)),
    }
}

/// Remove the layers a rollback replaced (`replaced`: nothing uses them any
/// more) and then drop `ns`, the mount namespace of the box as it was before
/// (if it was held: [`hold_mount_ns`]), in a detached process at the lowest
/// priority (nice 19), and return at once: the box already runs on its new layers, and neither the removal
/// (tens of milliseconds for a layer of a thousand files) nor the unmount of
/// the old root and its sync concern the caller. The process is nobody's
/// child (forked twice), keeps only the trash directories' locks (so
/// [`crate::snapshots::recover`] leaves them to it) and the namespace, and
/// drops the namespace once this process has closed its own copy, so that
/// the unmount happens there. Should it die midway, what it leaves is trash
/// that the box's next snapshot operation (or its removal) removes.
pub(crate) fn discard_in_background(replaced: crate::snapshots::Replaced, ns: Option<OwnedFd>) {
    if replaced.dirs.is_empty() && ns.is_none() {
        return;
    }
    let Ok((wait_r, wait_w)) = pipe2(OFlag::O_CLOEXEC) else {
        remove_trash(&replaced);
        return;
    };
    // SAFETY: the callers (the CLI, `nestbox serve`) are single-threaded, so
    // the children may run arbitrary code.
    match unsafe { nix::unistd::fork() } {
        Ok(ForkResult::Parent { child }) => {
            // Reaps the intermediate child, which exits at once; only EINTR
            // could fail, leaving a zombie until this process exits.
            let _ = waitpid(child, None);
            // Our copies of the namespace, the locks and the pipe close here:
            // the remover's are the last.
            drop((ns, replaced, wait_w, wait_r));
            return;
        }
        Ok(ForkResult::Child) => {}
        Err(_) => {
            // No process to do it: done here, as without this.
            remove_trash(&replaced);
            return;
        }
    }
    // SAFETY: as above: this intermediate child is single-threaded too.
    if !matches!(unsafe { nix::unistd::fork() }, Ok(ForkResult::Child)) {
        nestbox_sys::process::exit_now(0)
    }
    drop(wait_w);
    let mut keep: Vec<i32> = replaced
        .dirs
        .iter()
        .map(|(_, lock)| lock.as_raw_fd())
        .chain(ns.as_ref().map(|n| n.as_raw_fd()))
        .chain([wait_r.as_raw_fd()])
        .filter(|&fd| fd > 2)
        .collect();
    keep.sort_unstable();
    // SAFETY: this child never returns to its caller (it ends with exit_now
    // below), so no object up the stack uses a closed descriptor again; the
    // ones it still uses (`keep`) stay open.
    let closed = unsafe { close_all_but(&keep) };
    if closed.is_err() {
        // Could not drop the caller's descriptors (its locks, its pipes):
        // leave at once rather than hold them; the trash stays for `recover`.
        nestbox_sys::process::exit_now(1)
    }
    crate::diag::descriptors_closed();
    become_daemon();
    // The lowest priority: on a busy machine the box's next operations (a
    // snapshot, another rollback) go first; the removal takes what is left.
    // SAFETY: sets this (new, single-threaded) process's own nice value;
    // integer arguments only, no memory is passed.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    remove_trash(&replaced);
    // The caller's copy of the namespace is closed once the pipe ends.
    let mut byte = [0u8; 1];
    while matches!(
        nix::unistd::read(wait_r.as_raw_fd(), &mut byte),
        Err(Errno::EINTR)
    ) {}
    drop(ns);
    nestbox_sys::process::exit_now(0)
}

/// Remove the trash directories of `replaced` (failures are logged: what is
/// left goes at the box's next `recover` or with the box).
fn remove_trash(replaced: &crate::snapshots::Replaced) {
    for (dir, _) in &replaced.dirs {
        crate::diag::warn_on_err(
            None,
            "removing a replaced layer",
            crate::registry::remove_tree(dir),
        );
    }
}

/// Close every descriptor from 3 on but those of `keep` (sorted).
///
/// # Safety
/// As for [`close_fds_from`], for the descriptors closed.
unsafe fn close_all_but(keep: &[i32]) -> crate::Result<()> {
    let mut first = 3u32;
    for &fd in keep {
        let fd = fd as u32;
        if fd > first {
            // SAFETY: the caller upholds it for these descriptors.
            unsafe { close_fds(first, fd - 1) }?;
        }
        first = first.max(fd + 1);
    }
    // SAFETY: as above.
    unsafe { close_fds_from(first) }
}

/// The pid (as this process's /proc sees it) of the process behind `pidfd`.
pub fn pid_of_pidfd(pidfd: &OwnedFd) -> crate::Result<i32> {
    let path = format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd());
    let text = std::fs::read_to_string(&path).map_err(crate::RuntimeError::io("read", &path))?;
    text.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| crate::RuntimeError::Failed(format!("no pid in {path}")))
}

/// Leave the caller's session and terminal; stdio to /dev/null.
pub(crate) fn become_daemon() {
    // setsid fails only for a process group leader, which a forked child is
    // not; chdir("/") cannot fail for a process that has a root. Neither
    // failure would keep the daemon from working.
    let _ = nix::unistd::setsid();
    let _ = nix::unistd::chdir("/");
    stdio_to_dev_null();
}

/// How long a pool refill waits before it starts: boxes and clones often come
/// in bursts, and a refill takes locks (the kernel's RTNL for a network
/// namespace, a template's clone lock and a ptrace stop for a clone) and CPU
/// time that the next requests of the burst need.
const REFILL_DELAY: Duration = Duration::from_millis(100);

/// Run the pool refill `work` in a detached child process (its own session,
/// stdio on /dev/null, none of the caller's descriptors) and return at once.
/// The child waits [`REFILL_DELAY`] and runs under SCHED_IDLE, so it takes no
/// CPU time from the request that drew from the pool or from the next ones; on
/// a machine with no idle time the pool stays empty and requests are served
/// the slow way. The child exits 0 if `work` succeeds.
pub(crate) fn spawn_refill(work: impl FnOnce() -> crate::Result<()>) {
    // Forked twice, so that the refill is nobody's child to reap (a long-lived
    // caller such as `nestbox serve` would otherwise collect zombies).
    // SAFETY: the callers (the CLI, a box's monitor, `nestbox serve`) are
    // single-threaded, so the children may run arbitrary code.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            // Reaps the intermediate child, which exits at once; it is our
            // own child, so the wait cannot fail but for EINTR, after which
            // the kernel reaps nothing and a zombie stays until we exit.
            let _ = nix::sys::wait::waitpid(child, None);
            return;
        }
        Ok(nix::unistd::ForkResult::Child) => {}
        Err(_) => return,
    }
    // SAFETY: as above: this intermediate child is single-threaded too.
    let second = unsafe { nix::unistd::fork() };
    if !matches!(second, Ok(nix::unistd::ForkResult::Child)) {
        nestbox_sys::process::exit_now(0)
    }
    // SAFETY: this child never returns to its caller (it ends with exit below),
    // so no object up the stack uses a descriptor again; `work` opens its own.
    if unsafe { close_fds_from(3) }.is_err() {
        nestbox_sys::process::exit_now(1)
    }
    crate::diag::descriptors_closed();
    become_daemon();
    // Failing leaves the work at normal priority: it still runs, sooner.
    let _ = nestbox_sys::process::set_scheduling(nestbox_sys::process::Scheduling::Idle);
    std::thread::sleep(REFILL_DELAY);
    std::process::exit(i32::from(work().is_err()))
}
