//! Small process helpers shared by the monitor, init, exec and the detached
//! start: shell-style exit codes from wait statuses, waiting for one child,
//! pointing stdio at `/dev/null`, becoming a daemon, and running a pool refill in
//! a detached idle-priority process.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

use crate::error::EXIT_NESTBOX_ERROR;

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
