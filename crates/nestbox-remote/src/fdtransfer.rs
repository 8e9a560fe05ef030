//! Handing fds of the tracer to a tracee: the tracee makes a socketpair (injected),
//! the tracer takes one end with `pidfd_getfd`, sends its fds over it with
//! `SCM_RIGHTS`, and the tracee receives them all with one injected `recvmsg`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use crate::error::{RemoteError, Result};
use crate::fdinfo::{pidfd_getfd, pidfd_open};
use crate::memory::{bytes_of, Scratch};
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

fn cmsg_space(payload: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE(payload as u32) as usize }
}

fn send_fds(sender: &OwnedFd, pid: i32, fds: &[BorrowedFd<'_>]) -> Result<()> {
    let payload = std::mem::size_of_val(fds);
    let mut control = vec![0u8; cmsg_space(payload)];
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: msg_control points at `control`, large enough for one cmsg carrying
    // `payload` bytes, so CMSG_FIRSTHDR is non-null and CMSG_DATA has room for
    // every fd; all pointers stay within `control`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as usize;
        let data = libc::CMSG_DATA(cmsg).cast::<i32>();
        for (i, fd) in fds.iter().enumerate() {
            data.add(i).write_unaligned(fd.as_raw_fd());
        }
    }
    // SAFETY: msg and everything it points to are alive for the call.
    let n = unsafe { libc::sendmsg(sender.as_raw_fd(), &msg, libc::MSG_DONTWAIT) };
    if n != 1 {
        return Err(RemoteError::Sys {
            op: "sendmsg(SCM_RIGHTS)",
            pid,
            source: io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn receive(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    sock: i32,
    count: usize,
) -> Result<Vec<i32>> {
    let payload = count * 4;
    let control_len = cmsg_space(payload);
    let byte_addr = scratch.reserve(8)?;
    let control_addr = scratch.reserve(control_len)?;
    let iov = libc::iovec {
        iov_base: byte_addr as *mut libc::c_void,
        iov_len: 1,
    };
    let iov_addr = scratch.put(tracee, &bytes_of(&iov))?;
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov_addr as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = control_addr as *mut libc::c_void;
    msg.msg_controllen = control_len;
    let msg_addr = scratch.put(tracee, &bytes_of(&msg))?;
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
    // SAFETY: `header` holds size_of::<msghdr>() bytes copied from a msghdr.
    let got: libc::msghdr = unsafe { std::ptr::read_unaligned(header.as_ptr().cast()) };
    let mut control = vec![0u8; control_len];
    tracee.read_mem(control_addr, &mut control)?;
    let mut received = Vec::with_capacity(count);
    if got.msg_controllen >= std::mem::size_of::<libc::cmsghdr>() {
        // SAFETY: the control buffer starts with the cmsghdr the kernel wrote.
        let cmsg: libc::cmsghdr = unsafe { std::ptr::read_unaligned(control.as_ptr().cast()) };
        if cmsg.cmsg_level == libc::SOL_SOCKET && cmsg.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: CMSG_LEN is a pure size computation.
            let header_len = unsafe { libc::CMSG_LEN(0) } as usize;
            let n_fds = (cmsg.cmsg_len.saturating_sub(header_len)) / 4;
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
    if n != 1 || got.msg_flags & libc::MSG_CTRUNC != 0 || received.len() != count {
        for fd in &received {
            let _ = tracee.syscall("close", String::new, libc::SYS_close, &[*fd as u64]);
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
