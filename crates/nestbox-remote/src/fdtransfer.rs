//! Handing fds of the tracer to a tracee: the tracee makes a socketpair (injected),
//! the tracer takes one end with `pidfd_getfd`, sends its fds over it with
//! `SCM_RIGHTS`, and the tracee receives them all with one injected `recvmsg`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use crate::error::{RemoteError, Result};
use crate::fdinfo::{pidfd_getfd, pidfd_open};
use crate::layout;
use crate::memory::Scratch;
use crate::tracee::Tracee;

/// Most fds one `SCM_RIGHTS` message carries (`SCM_MAX_FD`).
pub const MAX_FDS: usize = 253;

/// Install duplicates of `fds` in the tracee and return their numbers there, in
/// order. They are close-on-exec (`MSG_CMSG_CLOEXEC`).
///
/// Maps a scratch area in the tracee for the call and unmaps it afterwards.
pub fn install_fds(tracee: &mut Tracee, fds: &[BorrowedFd<'_>]) -> Result<Vec<i32>> {
    let mut scratch = Scratch::map(tracee)?;
    let result = install_fds_with(tracee, &mut scratch, fds);
    let unmapped = scratch.unmap(tracee);
    let fds = result?;
    unmapped?;
    Ok(fds)
}

pub(crate) fn install_fds_with(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    fds: &[BorrowedFd<'_>],
) -> Result<Vec<i32>> {
    if fds.is_empty() {
        return Ok(Vec::new());
    }
    if fds.len() > MAX_FDS {
        return Err(RemoteError::Plan(format!(
            "{} fds to hand over; at most {MAX_FDS} fit in one message",
            fds.len()
        )));
    }
    let pid = tracee.pid();
    scratch.reset();
    let pair_addr = scratch.reserve(8)?;
    tracee.syscall(
        "socketpair",
        || "fd hand-over".into(),
        libc::SYS_socketpair,
        &[
            libc::AF_UNIX as u64,
            (libc::SOCK_DGRAM | libc::SOCK_CLOEXEC) as u64,
            0,
            pair_addr,
        ],
    )?;
    let mut pair = [0u8; 8];
    tracee.read_mem(pair_addr, &mut pair)?;
    let ours_in_tracee = i32::from_ne_bytes([pair[0], pair[1], pair[2], pair[3]]);
    let theirs = i32::from_ne_bytes([pair[4], pair[5], pair[6], pair[7]]);

    let result = (|| -> Result<Vec<i32>> {
        let pidfd = pidfd_open(pid)?;
        let sender = pidfd_getfd(&pidfd, pid, ours_in_tracee)?;
        send_fds(&sender, pid, fds)?;
        receive(tracee, scratch, theirs, fds.len())
    })();

    for fd in [ours_in_tracee, theirs] {
        let closed = tracee.syscall(
            "close",
            || "fd hand-over socket".into(),
            libc::SYS_close,
            &[fd as u64],
        );
        if result.is_ok() {
            closed?;
        }
    }
    result
}

fn send_fds(sender: &OwnedFd, pid: i32, fds: &[BorrowedFd<'_>]) -> Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let raw: Vec<i32> = fds.iter().map(|fd| fd.as_raw_fd()).collect();
    let byte = [0u8; 1];
    let iov = [io::IoSlice::new(&byte)];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    match sendmsg::<()>(
        sender.as_raw_fd(),
        &iov,
        &cmsg,
        MsgFlags::MSG_DONTWAIT,
        None,
    ) {
        Ok(1) => Ok(()),
        Ok(n) => Err(RemoteError::Sys {
            op: "sendmsg(SCM_RIGHTS)",
            pid,
            source: io::Error::new(io::ErrorKind::WriteZero, format!("sent {n} of 1 bytes")),
        }),
        Err(e) => Err(RemoteError::Sys {
            op: "sendmsg(SCM_RIGHTS)",
            pid,
            source: e.into(),
        }),
    }
}

fn receive(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    sock: i32,
    count: usize,
) -> Result<Vec<i32>> {
    let payload = count * 4;
    let control_len = layout::cmsg_space(payload);
    let byte_addr = scratch.reserve(8)?;
    let control_addr = scratch.reserve(control_len)?;
    let iov_addr = scratch.put(tracee, &layout::iovec(byte_addr, 1))?;
    let msg_addr = scratch.put(
        tracee,
        &layout::msghdr(iov_addr, 1, control_addr, control_len as u64),
    )?;
    let n = tracee.syscall(
        "recvmsg",
        || "fd hand-over".into(),
        libc::SYS_recvmsg,
        &[
            sock as u64,
            msg_addr,
            (libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) as u64,
        ],
    )?;
    let mut header = vec![0u8; std::mem::size_of::<libc::msghdr>()];
    tracee.read_mem(msg_addr, &mut header)?;
    let (got_controllen, got_flags) = layout::msghdr_result(&header);
    let mut control = vec![0u8; control_len];
    tracee.read_mem(control_addr, &mut control)?;
    let mut received = Vec::with_capacity(count);
    let header_len = layout::CMSG_HDR_LEN;
    if got_controllen >= header_len as u64 {
        if let Some((cmsg_len, level, kind)) = layout::cmsghdr(&control) {
            if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
                let n_fds = cmsg_len.saturating_sub(header_len) / 4;
                for i in 0..n_fds.min(count) {
                    let at = header_len + i * 4;
                    received.push(i32::from_ne_bytes([
                        control[at],
                        control[at + 1],
                        control[at + 2],
                        control[at + 3],
                    ]));
                }
            }
        }
    }
    if n != 1 || got_flags & libc::MSG_CTRUNC != 0 || received.len() != count {
        // The failure below is reported; an fd that could not be closed in the
        // tracee (it is already failing) is logged.
        for fd in &received {
            if let Err(e) = tracee.syscall("close", String::new, libc::SYS_close, &[*fd as u64]) {
                tracing::warn!("closing fd {fd} in the tracee after a failed transfer: {e}");
            }
        }
        return Err(RemoteError::Injected {
            syscall: "recvmsg",
            pid: tracee.pid(),
            context: format!("fd hand-over received {} of {count} fds", received.len()),
            source: io::Error::from_raw_os_error(libc::EMFILE),
        });
    }
    Ok(received)
}
