//! Attaching a monitor filter to a running process (`nestbox monitor
//! attach`): the process is seized (every thread stopped), the filter program
//! is written into an anonymous mapping injected into it, and an injected
//! `seccomp(SECCOMP_SET_MODE_FILTER, NEW_LISTENER | TSYNC | TSYNC_ESRCH)`
//! gives the filter to every one of its threads. The listener fd the call
//! returns in the process is taken with `pidfd_getfd` and closed there, the
//! mapping is unmapped, the registers are put back and the process is let go.
//! Its later children and threads inherit the filter.

use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use nestbox_sys::seccomp_notify as notify;

use crate::error::{RemoteError, Result};
use crate::memory::Scratch;
use crate::procfs::Status;
use crate::tracee::Tracee;

/// How long the threads of a process may take to stop.
const STOP_WAIT: Duration = Duration::from_secs(5);

/// Refuse a process a monitor filter cannot be attached to, before anything
/// is done to it: one without `no_new_privs` (the kernel would refuse the
/// filter; giving it `no_new_privs` would change what it may exec) or one
/// already traced (a debugger, a freeze or checkpoint in progress).
pub fn check_attachable(pid: i32) -> Result<()> {
    let status = Status::read(pid)?;
    if status.get("NoNewPrivs")?.trim() != "1" {
        return Err(RemoteError::NotAttachable {
            pid,
            why: "runs without no_new_privs (a privileged box): no filter can be attached to it"
                .into(),
        });
    }
    let tracer = status.tracer_pid()?;
    if tracer != 0 {
        return Err(RemoteError::NotAttachable {
            pid,
            why: format!(
                "is already traced by pid {tracer} (a debugger, or a freeze or checkpoint of the box)"
            ),
        });
    }
    Ok(())
}

/// Attach `filter` (a monitor program) to every thread of process `pid` and
/// return its listener. The process is stopped meanwhile and resumes as it
/// was; on an error before the filter is installed it is left unchanged.
pub fn install_listener(pid: i32, filter: &[libc::sock_filter]) -> Result<OwnedFd> {
    let len = u16::try_from(filter.len())
        .map_err(|_| RemoteError::Plan("the monitor filter is too long".into()))?;
    let mut tracee = Tracee::seize_and_interrupt(pid)?;
    tracee.wait_stopped(STOP_WAIT)?;
    let mut scratch = Scratch::map(&mut tracee)?;
    let installed = install_in(&mut tracee, &mut scratch, filter, len);
    let unmapped = scratch.unmap(&mut tracee);
    let remote_fd = match installed {
        Ok(fd) => fd,
        Err(e) => {
            if let Err(u) = unmapped {
                tracing::warn!("monitor attach: unmapping the scratch area of {pid}: {u}");
            }
            return Err(e);
        }
    };
    let taken = nestbox_sys::pidfd::pidfd_open(pid)
        .and_then(|p| nestbox_sys::pidfd::pidfd_getfd(p.as_fd(), remote_fd as i32));
    let closed = tracee.inject_syscall(libc::SYS_close, &[remote_fd]);
    if let Err(e) = unmapped {
        tracing::warn!("monitor attach: unmapping the scratch area of {pid}: {e}");
    }
    if let Err(e) = closed {
        tracing::warn!("monitor attach: closing the listener in {pid}: {e}");
    }
    let listener = taken.map_err(|e| RemoteError::Sys {
        op: "pidfd_getfd (the monitor listener)",
        pid,
        source: e.into(),
    })?;
    tracee.detach()?;
    Ok(listener)
}

/// Write the program and its `sock_fprog` into the scratch area and install
/// it; the listener's fd number in the process.
fn install_in(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    filter: &[libc::sock_filter],
    len: u16,
) -> Result<u64> {
    let pid = tracee.pid();
    let insns = scratch.put(tracee, &notify::filter_bytes(filter))?;
    let prog = scratch.put(tracee, &notify::fprog_bytes(len, insns))?;
    let rax = tracee.inject_syscall(
        libc::SYS_seccomp,
        &[notify::SET_MODE_FILTER, notify::ATTACH_FLAGS, prog],
    )?;
    if (-4095..0).contains(&rax) {
        let errno = -rax as i32;
        let why = match errno {
            libc::ENOMEM => {
                "its seccomp filters are at the kernel's limit: no other can be attached".into()
            }
            libc::ESRCH => {
                "its threads have different seccomp filters: none can be attached to all of them"
                    .into()
            }
            libc::EBUSY => {
                "already has a monitor filter with a listener (--monitor or an earlier attach)"
                    .into()
            }
            libc::EACCES => "runs without no_new_privs: no filter can be attached to it".into(),
            _ => format!(
                "seccomp(2) refused the monitor filter: {}",
                std::io::Error::from_raw_os_error(errno)
            ),
        };
        return Err(RemoteError::NotAttachable { pid, why });
    }
    Ok(rax as u64)
}

/// Let go of the processes among `pids` (and their threads) that are traced
/// by this process without being held: a child that a process forked while
/// it was being seized is attached to its tracer automatically, and would
/// stay stopped once its parent is let go. Each is waited for (its first
/// stop) and detached; it runs on without the filter, which the next listing
/// of the box gives it. Returns how many were let go.
pub fn let_go_of_strays(pids: &[i32]) -> usize {
    let me = std::process::id() as i32;
    let mut n = 0;
    for &pid in pids {
        for tid in crate::tracee::task_ids(pid).unwrap_or_default() {
            let ours = Status::read(tid)
                .and_then(|s| s.tracer_pid())
                .is_ok_and(|t| t == me);
            if !ours {
                continue;
            }
            // Its first stop is on its way (PTRACE_EVENT_STOP of an
            // auto-attached child): wait for it, at most a second.
            let flags = nix::sys::wait::WaitPidFlag::__WALL | nix::sys::wait::WaitPidFlag::WNOHANG;
            let deadline = std::time::Instant::now() + Duration::from_secs(1);
            loop {
                match nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(tid), Some(flags)) {
                    Ok(nix::sys::wait::WaitStatus::StillAlive)
                        if std::time::Instant::now() < deadline =>
                    {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    _ => break,
                }
            }
            match nestbox_sys::ptrace::detach(tid, 0) {
                Ok(()) => n += 1,
                Err(e) => {
                    tracing::warn!("monitor attach: letting go of {tid} (forked meanwhile): {e}")
                }
            }
        }
    }
    n
}
