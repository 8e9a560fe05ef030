//! Small process helpers shared by the monitor, init, exec and the detached
//! start: shell-style exit codes from wait statuses, waiting for one child, and
//! pointing stdio at `/dev/null`.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

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
/// must not keep its parent's pipes, locks or box descriptors open).
pub fn close_fds_from(first: u32) {
    // SAFETY: close_range only closes descriptors of this process; the caller
    // holds no Rust object owning one of them that it will use again.
    unsafe {
        libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32);
    }
}

/// Close the descriptors `first..=last` of this process (see [`close_fds_from`]).
pub fn close_fds_range(first: u32, last: u32) {
    // SAFETY: close_range only closes descriptors of this process; the caller
    // holds no Rust object owning one of them that it will use again.
    unsafe {
        libc::syscall(libc::SYS_close_range, first, last, 0u32);
    }
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
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(crate::RuntimeError::sys(format!("pidfd_open({pid})"))(
            nix::errno::Errno::last(),
        ));
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A duplicate of descriptor `target` of the process behind `pidfd` (`pid`, for
/// the error message).
pub fn pidfd_getfd(pidfd: &OwnedFd, target: i32, pid: i32) -> crate::Result<OwnedFd> {
    // SAFETY: pidfd_getfd duplicates descriptor `target` of the process behind the
    // pidfd into this process and returns the new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    if fd < 0 {
        return Err(crate::RuntimeError::sys(format!(
            "pidfd_getfd(pid {pid}, fd {target})"
        ))(nix::errno::Errno::last()));
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
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
