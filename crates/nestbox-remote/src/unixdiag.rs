//! The peers of Unix sockets, from the kernel's sock_diag interface
//! (`NETLINK_SOCK_DIAG`, `unix_diag(7)`): one dump of every Unix socket of a
//! network namespace with `UDIAG_SHOW_PEER`, giving for each socket inode the
//! inode of the socket it is connected to.
//!
//! sock_diag answers about the sockets of the network namespace the netlink
//! socket was created in, so that socket is created by a short-lived thread
//! that has joined the inspected process's network namespace
//! ([`nestbox_sys::ns::NsGuard`]); the calling thread never moves.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use nestbox_sys::ns::{Namespace, NsGuard};

use crate::error::{RemoteError, Result};
use crate::procfs::proc_path;

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const UDIAG_SHOW_PEER: u32 = 0x4;
const UNIX_DIAG_PEER: u16 = 2;
const NLMSG_HDR: usize = 16;
/// `struct unix_diag_msg`: family, type, state, pad, ino, cookie[2].
const UNIX_DIAG_MSG: usize = 16;

fn sys_err(op: &'static str, pid: i32) -> impl FnOnce(io::Error) -> RemoteError {
    move |source| RemoteError::Sys { op, pid, source }
}

/// Map of socket inode to peer inode for every connected Unix socket in the
/// network namespace of `pid`.
pub(crate) fn peers(pid: i32) -> Result<HashMap<u64, u64>> {
    let sock = netlink_in_netns_of(pid)?;
    let mut request = Vec::with_capacity(NLMSG_HDR + 24);
    let len = (NLMSG_HDR + 24) as u32;
    request.extend_from_slice(&len.to_ne_bytes());
    request.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    request.extend_from_slice(&flags.to_ne_bytes());
    request.extend_from_slice(&1u32.to_ne_bytes()); // seq
    request.extend_from_slice(&0u32.to_ne_bytes()); // port id

    // struct unix_diag_req
    request.push(libc::AF_UNIX as u8);
    request.push(0); // protocol
    request.extend_from_slice(&0u16.to_ne_bytes()); // pad
    request.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    request.extend_from_slice(&0u32.to_ne_bytes()); // ino
    request.extend_from_slice(&UDIAG_SHOW_PEER.to_ne_bytes());
    request.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
    request.extend_from_slice(&u32::MAX.to_ne_bytes());
    // SAFETY: `request` is a valid buffer of its length; the socket is ours.
    let sent = unsafe { libc::send(sock.as_raw_fd(), request.as_ptr().cast(), request.len(), 0) };
    if sent < 0 {
        return Err(sys_err("send(sock_diag dump)", pid)(
            io::Error::last_os_error(),
        ));
    }
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: `buf` is a writable buffer of its length.
        let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(sys_err("recv(sock_diag dump)", pid)(
                io::Error::last_os_error(),
            ));
        }
        let n = n as usize;
        if n == 0 {
            return Ok(out);
        }
        let mut at = 0;
        while at + NLMSG_HDR <= n {
            let msg_len = u32_at(&buf, at) as usize;
            let msg_type = u16_at(&buf, at + 4);
            if msg_len < NLMSG_HDR || at + msg_len > n {
                return Err(bad_reply(pid, "truncated netlink message"));
            }
            match i32::from(msg_type) {
                libc::NLMSG_DONE => return Ok(out),
                libc::NLMSG_ERROR => {
                    let errno = -(u32_at(&buf, at + NLMSG_HDR) as i32);
                    return Err(sys_err("sock_diag dump", pid)(
                        io::Error::from_raw_os_error(errno),
                    ));
                }
                _ => {}
            }
            if msg_type == SOCK_DIAG_BY_FAMILY && msg_len >= NLMSG_HDR + UNIX_DIAG_MSG {
                let body = &buf[at + NLMSG_HDR..at + msg_len];
                let ino = u64::from(u32_at(body, 4));
                let mut attr = UNIX_DIAG_MSG;
                while attr + 4 <= body.len() {
                    let attr_len = usize::from(u16_at(body, attr));
                    let attr_type = u16_at(body, attr + 2);
                    if attr_len < 4 || attr + attr_len > body.len() {
                        break;
                    }
                    if attr_type == UNIX_DIAG_PEER && attr_len >= 8 {
                        out.insert(ino, u64::from(u32_at(body, attr + 4)));
                    }
                    attr += attr_len.next_multiple_of(4);
                }
            }
            at += msg_len.next_multiple_of(4);
        }
    }
}

fn bad_reply(pid: i32, what: &str) -> RemoteError {
    RemoteError::Sys {
        op: "sock_diag dump",
        pid,
        source: io::Error::new(io::ErrorKind::InvalidData, what.to_string()),
    }
}

fn u32_at(buf: &[u8], at: usize) -> u32 {
    buf.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_ne_bytes)
}

fn u16_at(buf: &[u8], at: usize) -> u16 {
    buf.get(at..at + 2)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u16::from_ne_bytes)
}

/// A `NETLINK_SOCK_DIAG` socket in `pid`'s network namespace, made by a thread
/// that joins it and returns.
fn netlink_in_netns_of(pid: i32) -> Result<OwnedFd> {
    let path = proc_path(pid, "ns/net");
    let ns = std::fs::File::open(&path).map_err(|source| RemoteError::Proc { path, source })?;
    let made = std::thread::scope(|scope| {
        scope
            .spawn(|| -> io::Result<OwnedFd> {
                let guard = NsGuard::enter(ns.as_fd(), Namespace::Net)?;
                // SAFETY: socket takes integers and returns a new fd or -1.
                let fd = unsafe {
                    libc::socket(
                        libc::AF_NETLINK,
                        libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                        libc::NETLINK_SOCK_DIAG,
                    )
                };
                let made = if fd < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    // SAFETY: the kernel just returned this fd; nothing else owns it.
                    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
                };
                guard.leave()?;
                made
            })
            .join()
    });
    match made {
        Ok(result) => result.map_err(sys_err("socket(NETLINK_SOCK_DIAG) in the netns", pid)),
        Err(_) => Err(sys_err("socket(NETLINK_SOCK_DIAG) in the netns", pid)(
            io::Error::other("the thread that joins the network namespace panicked"),
        )),
    }
}
