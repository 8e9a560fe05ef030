//! Placeholders for connections to outside the box ([`FdAction::Placeholder`]):
//! a socket on the same fd number that behaves as a connection reset by its
//! peer, so that the application's own error handling (reconnect) runs and the
//! number is never free for its next `open` or `accept` to take.
//!
//! * TCP (v4 or v6): a loopback connection made and reset inside the forked
//!   process, in the clone's network namespace: a listener on 127.0.0.1, a
//!   `connect` to it, the accepted end closed with `SO_LINGER` 0 (an RST).
//!   One listener serves every TCP placeholder of a process ([`TcpResets`]).
//!   The placeholder is the connecting end: its first `read` fails with
//!   `ECONNRESET`, later ones return end of file; a `write` fails with
//!   `ECONNRESET`, then `EPIPE`; `epoll` reports `EPOLLIN | EPOLLERR |
//!   EPOLLHUP | EPOLLRDHUP` at once. It is an `AF_INET` socket whatever the
//!   template's family was.
//! * Unix stream or seqpacket: a socket pair whose other end is closed while a
//!   byte it has not read is queued in it, which is how the kernel reports a
//!   reset on a Unix connection: the data the template had received and not
//!   yet read is still read first, then `ECONNRESET`, then end of file;
//!   writes fail with `EPIPE`.
//! * Unix datagram: a socket pair whose other end is closed: sends fail with
//!   `ECONNREFUSED`, as to a peer that went away; the data queued for the
//!   template's socket is still read first.
//!
//! The epoll registrations of the template's fd are made on the placeholder
//! (retarget's last pass), so an event loop notices the failure at once.

use std::os::fd::OwnedFd;

use crate::buffered::{copy_queue, CopyError};
use crate::error::Result;
use crate::fdinfo::{pidfd_getfd, pidfd_open, FdEntry, SocketInfo};
use crate::memory::Scratch;
use crate::objects::make_pair;
use crate::tracee::Tracee;

/// The loopback listener that TCP placeholders are made with, one per
/// forked process (created at the first TCP placeholder, closed after the
/// last).
#[derive(Debug)]
pub(crate) struct TcpResets {
    listener: u64,
    /// Its `sockaddr_in` (127.0.0.1 and the port the kernel chose).
    addr: Vec<u8>,
}

impl TcpResets {
    /// A listener on 127.0.0.1 (any port) in `tracee`'s network namespace.
    pub(crate) fn open(tracee: &mut Tracee, scratch: &mut Scratch) -> Result<TcpResets> {
        let ctx = || "listener for reset placeholders".to_string();
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        let listener = tracee.syscall(
            "socket",
            ctx,
            libc::SYS_socket,
            &[libc::AF_INET as u64, stream, 0],
        )?;
        // struct sockaddr_in { sa_family_t AF_INET; port 0; 127.0.0.1; zero[8] }
        let mut addr = vec![0u8; 16];
        addr[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        addr[4..8].copy_from_slice(&[127, 0, 0, 1]);
        scratch.reset();
        let addr_at = scratch.put(tracee, &addr)?;
        let len_at = scratch.put(tracee, &16u32.to_ne_bytes())?;
        let made = (|| -> Result<()> {
            tracee.syscall("bind", ctx, libc::SYS_bind, &[listener, addr_at, 16])?;
            tracee.syscall("listen", ctx, libc::SYS_listen, &[listener, 1])?;
            tracee.syscall(
                "getsockname",
                ctx,
                libc::SYS_getsockname,
                &[listener, addr_at, len_at],
            )?;
            tracee.read_mem(addr_at, &mut addr)?;
            Ok(())
        })();
        if let Err(e) = made {
            // Failing already; the process is killed with the fd.
            let _ = tracee.syscall("close", ctx, libc::SYS_close, &[listener]);
            return Err(e);
        }
        Ok(TcpResets { listener, addr })
    }

    /// A reset TCP connection for fd `fd`: its (temporary) number in `tracee`.
    pub(crate) fn make(&self, tracee: &mut Tracee, scratch: &mut Scratch, fd: i32) -> Result<i32> {
        let ctx = || format!("reset placeholder for fd {fd}");
        let stream = (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u64;
        scratch.reset();
        let addr_at = scratch.put(tracee, &self.addr)?;
        let conn = tracee.syscall(
            "socket",
            ctx,
            libc::SYS_socket,
            &[libc::AF_INET as u64, stream, 0],
        )?;
        // Loopback: the handshake completes within connect.
        tracee.syscall("connect", ctx, libc::SYS_connect, &[conn, addr_at, 16])?;
        let accepted = tracee.syscall(
            "accept4",
            ctx,
            libc::SYS_accept4,
            &[self.listener, 0, 0, libc::SOCK_CLOEXEC as u64],
        )?;
        // struct linger { l_onoff 1, l_linger 0 }: close sends an RST.
        let mut linger = [0u8; 8];
        linger[..4].copy_from_slice(&1i32.to_ne_bytes());
        let linger_at = scratch.put(tracee, &linger)?;
        tracee.syscall(
            "setsockopt(SO_LINGER)",
            ctx,
            libc::SYS_setsockopt,
            &[
                accepted,
                libc::SOL_SOCKET as u64,
                libc::SO_LINGER as u64,
                linger_at,
                8,
            ],
        )?;
        tracee.syscall("close", ctx, libc::SYS_close, &[accepted])?;
        Ok(conn as i32)
    }

    /// Close the listener.
    pub(crate) fn close(self, tracee: &mut Tracee) -> Result<()> {
        tracee.syscall(
            "close",
            || "listener for reset placeholders".into(),
            libc::SYS_close,
            &[self.listener],
        )?;
        Ok(())
    }
}

/// Make the placeholder of a connected Unix socket `entry` (of template
/// process `template_pid`) in `tracee` and return its (temporary) fd number.
pub(crate) fn unix(
    tracee: &mut Tracee,
    scratch: &mut Scratch,
    template_pid: i32,
    entry: &FdEntry,
    sock: &SocketInfo,
) -> Result<i32> {
    let fd = entry.fd;
    let ctx = || format!("reset placeholder for fd {fd}");
    let [ours, other] = make_pair(tracee, scratch, Some(sock.sock_type))?;
    // The data the template's socket holds, sent again from the other end.
    let creator = pidfd_open(tracee.pid())?;
    let sender: OwnedFd = pidfd_getfd(&creator, tracee.pid(), other)?;
    let template = pidfd_open(template_pid)?;
    let from = pidfd_getfd(&template, template_pid, fd)?;
    copy_queue(&from, sock.sock_type, &sender).map_err(|e| match e {
        CopyError::FdsInFlight => crate::RemoteError::UnsupportedFd {
            pid: template_pid,
            fd,
            kind: entry.target.clone(),
            reason: "data buffered in it carries fds (SCM_RIGHTS), which a clone cannot copy"
                .into(),
        },
        CopyError::EmptyDatagram => crate::RemoteError::UnsupportedFd {
            pid: template_pid,
            fd,
            kind: entry.target.clone(),
            reason: "a zero-length datagram is buffered in it; its boundary cannot be copied"
                .into(),
        },
        CopyError::Io(op, source) => crate::RemoteError::Sys {
            op,
            pid: template_pid,
            source,
        },
    })?;
    drop(sender);
    if sock.sock_type != libc::SOCK_DGRAM {
        // A byte the closing end has not read makes its close a reset.
        scratch.reset();
        let byte = scratch.put(tracee, &[0u8])?;
        tracee.syscall(
            "sendto",
            ctx,
            libc::SYS_sendto,
            &[
                ours as u64,
                byte,
                1,
                (libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) as u64,
                0,
                0,
            ],
        )?;
    }
    tracee.syscall("close", ctx, libc::SYS_close, &[other as u64])?;
    Ok(ours)
}
