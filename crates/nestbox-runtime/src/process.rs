//! Small process helpers shared by the monitor, init, exec and the detached
//! start: shell-style exit codes from wait statuses, waiting for one child, and
//! pointing stdio at `/dev/null`.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

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
    unsafe { nestbox_sys::fd::close_range(first, u32::MAX) }.map_err(crate::RuntimeError::sys(
        format!("close_range({first}, ~0)"),
    ))
}

/// Point stdin, stdout and stderr at `/dev/null` (best effort).
pub fn stdio_to_dev_null() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
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
        .ok_or_else(|| crate::RuntimeError::Invalid(format!("no pid in {path}")))
}
