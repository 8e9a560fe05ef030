//! Process file descriptors: `pidfd_open(2)`, `pidfd_getfd(2)`,
//! `pidfd_send_signal(2)`, and waiting for the process behind one to end.
//!
//! A pidfd names one process for as long as it is held, so signals and
//! descriptor copies cannot reach a process that reused the pid. All of these
//! are safe: they take integers and return new descriptors the caller owns.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use crate::Result;

/// A pidfd for process `pid` (`pidfd_open(pid, 0)`), close-on-exec.
pub fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: integer arguments only; returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = Errno::result(fd)?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// A duplicate, in this process, of descriptor `target` of the process behind
/// `pidfd` (`pidfd_getfd(pidfd, target, 0)`; needs ptrace rights over it).
pub fn pidfd_getfd(pidfd: BorrowedFd<'_>, target: i32) -> Result<OwnedFd> {
    // SAFETY: integer arguments only; returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    let fd = Errno::result(fd)?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Send signal `sig` (a raw number: real-time signals included) to the process
/// behind `pidfd`.
pub fn pidfd_send_signal(pidfd: BorrowedFd<'_>, sig: i32) -> Result<()> {
    // SAFETY: a null siginfo makes the kernel fill in the default; integers otherwise.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    };
    Errno::result(rc).map(drop)
}

/// Wait until the process behind `pidfd` has ended (the pidfd turns readable),
/// at most `timeout` (`None`: without limit). `Ok(true)` when it ended.
pub fn wait_ended(pidfd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<bool> {
    let timeout = match timeout {
        None => PollTimeout::NONE,
        Some(t) => PollTimeout::try_from(t).unwrap_or(PollTimeout::MAX),
    };
    loop {
        let mut fds = [PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, timeout) {
            Ok(n) => return Ok(n > 0),
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn signal_and_wait_through_a_pidfd() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = pidfd_open(child.id() as i32).unwrap();
        assert!(!wait_ended(fd.as_fd(), Some(Duration::from_millis(10))).unwrap());
        pidfd_send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
        assert!(wait_ended(fd.as_fd(), Some(Duration::from_secs(10))).unwrap());
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn getfd_of_self() {
        let me = pidfd_open(std::process::id() as i32).unwrap();
        let dup = pidfd_getfd(me.as_fd(), me.as_raw_fd()).unwrap();
        assert_ne!(dup.as_raw_fd(), me.as_raw_fd());
        assert_eq!(pidfd_open(-1).unwrap_err(), Errno::EINVAL);
    }
}
