//! Copying the data buffered in a template's pipe or socket into the clone's
//! new one, without consuming it: `tee(2)` for a pipe; for a socket, reads
//! with `MSG_PEEK` (message by message, `SO_PEEK_OFF` set to 0 and put back as
//! it was) sent again from the new object's other end. The same peek finds
//! data in flight that carries fds (`SCM_RIGHTS`), which no clone can copy.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Copy what is buffered in the pipe behind `from` (a read end) into the pipe
/// behind `to` (a write end), without consuming it: `tee` of all of it at once
/// (a second `tee` would copy the same bytes again), into a pipe of the same
/// capacity.
pub(crate) fn copy_pipe(from: &OwnedFd, to: &OwnedFd) -> io::Result<()> {
    // SAFETY: fcntl with integer arguments on fds we own.
    let size = unsafe { libc::fcntl(from.as_raw_fd(), libc::F_GETPIPE_SZ) };
    if size < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(to.as_raw_fd(), libc::F_SETPIPE_SZ, size) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let avail = queued_bytes(from)?;
    if avail <= 0 {
        return Ok(());
    }
    // SAFETY: tee takes fds and integers; it duplicates pipe buffers only.
    let n = unsafe {
        libc::tee(
            from.as_raw_fd(),
            to.as_raw_fd(),
            avail as usize,
            libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n != avail as isize {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("tee copied {n} of {avail} buffered bytes"),
        ));
    }
    Ok(())
}

#[derive(Debug)]
pub(crate) enum CopyError {
    FdsInFlight,
    EmptyDatagram,
    Io(&'static str, io::Error),
}

fn sockopt(fd: &OwnedFd, name: i32) -> io::Result<i32> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: value/len are valid out-pointers for an int option.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            std::ptr::addr_of_mut!(value).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

fn set_sockopt(fd: &OwnedFd, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: a pointer to one int of the given length.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            std::ptr::addr_of!(value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Copy the receive queue of the template's socket `from` (read with
/// `MSG_PEEK`, so it stays) by sending it from `sender`, the new peer of the
/// socket that replaces `from`: a stream's bytes, each datagram or packet as
/// one message. `from`'s `SO_PEEK_OFF` is put back as it was.
pub(crate) fn copy_queue(
    from: &OwnedFd,
    sock_type: i32,
    sender: &OwnedFd,
) -> std::result::Result<(), CopyError> {
    scan_queue(from, sock_type, Some(sender))
}

/// Whether data queued for the socket `from` carries fds (`SCM_RIGHTS`),
/// which no clone can copy: read with `MSG_PEEK` as [`copy_queue`] does, so
/// the queue stays as it was.
pub(crate) fn queue_carries_fds(from: &OwnedFd, sock_type: i32) -> io::Result<bool> {
    match scan_queue(from, sock_type, None) {
        Ok(()) | Err(CopyError::EmptyDatagram) => Ok(false),
        Err(CopyError::FdsInFlight) => Ok(true),
        Err(CopyError::Io(_, e)) => Err(e),
    }
}

/// Bytes queued for reading in pipe or socket `fd` (`FIONREAD`).
fn queued_bytes(fd: &OwnedFd) -> io::Result<libc::c_int> {
    let mut avail: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int to the valid pointer.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut avail) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(avail)
}

fn scan_queue(
    from: &OwnedFd,
    sock_type: i32,
    sender: Option<&OwnedFd>,
) -> std::result::Result<(), CopyError> {
    // An empty stream is not read at all: a read of it would return, and
    // clear, the error a reset left pending on the socket (a connection
    // reset by its peer, a clone's placeholder), which its owner is still
    // to see.
    if sock_type == libc::SOCK_STREAM
        && queued_bytes(from).map_err(|e| CopyError::Io("ioctl(FIONREAD)", e))? == 0
    {
        return Ok(());
    }
    let old_peek = sockopt(from, libc::SO_PEEK_OFF)
        .map_err(|e| CopyError::Io("getsockopt(SO_PEEK_OFF)", e))?;
    set_sockopt(from, libc::SO_PEEK_OFF, 0)
        .map_err(|e| CopyError::Io("setsockopt(SO_PEEK_OFF)", e))?;
    let copied = peek_and_send(from, sock_type, sender);
    let restored = set_sockopt(from, libc::SO_PEEK_OFF, old_peek)
        .map_err(|e| CopyError::Io("setsockopt(SO_PEEK_OFF)", e));
    copied?;
    restored
}

fn peek_and_send(
    from: &OwnedFd,
    sock_type: i32,
    sender: Option<&OwnedFd>,
) -> std::result::Result<(), CopyError> {
    let stream = sock_type == libc::SOCK_STREAM;
    let mut buf = vec![0u8; 256 * 1024];
    let mut control = vec![0u8; 4096];
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data; zeroed is a valid empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len();
        // SAFETY: msg points at live buffers of the lengths it states.
        let n = unsafe {
            libc::recvmsg(
                from.as_raw_fd(),
                &mut msg,
                libc::MSG_PEEK | libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) => Ok(()),
                _ => Err(CopyError::Io("recvmsg(MSG_PEEK)", e)),
            };
        }
        if carries_fds(&msg) {
            return Err(CopyError::FdsInFlight);
        }
        if msg.msg_flags & libc::MSG_TRUNC != 0 {
            return Err(CopyError::Io(
                "recvmsg(MSG_PEEK)",
                io::Error::new(io::ErrorKind::InvalidData, "a message longer than 256 KiB"),
            ));
        }
        let n = n as usize;
        if n == 0 {
            if stream {
                // End of file: the peer shut down; nothing more is queued.
                return Ok(());
            }
            return Err(CopyError::EmptyDatagram);
        }
        if let Some(sender) = sender {
            send_all(sender, &buf[..n], stream)?;
        }
    }
}

/// Whether a received message's control data holds `SCM_RIGHTS`; the fds it
/// brought into this process are closed.
fn carries_fds(msg: &libc::msghdr) -> bool {
    let mut found = false;
    // SAFETY: msg's control buffer was filled by recvmsg and msg_controllen
    // says how much of it; CMSG_FIRSTHDR/NXTHDR stay within it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                found = true;
                let data = libc::CMSG_DATA(cmsg).cast::<i32>();
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    libc::close(data.add(i).read_unaligned());
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    found
}

fn send_all(sender: &OwnedFd, data: &[u8], stream: bool) -> std::result::Result<(), CopyError> {
    let mut grown = false;
    let mut at = 0;
    while at < data.len() {
        // SAFETY: a valid buffer of the stated length.
        let n = unsafe {
            libc::send(
                sender.as_raw_fd(),
                data[at..].as_ptr().cast(),
                data.len() - at,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EAGAIN) && !grown {
                // The template's queue was allowed to hold this much: give the
                // new sender room for it (root may exceed wmem_max).
                let want = (data.len() as i32).saturating_mul(4).max(4 << 20);
                set_sockopt(sender, libc::SO_SNDBUFFORCE, want)
                    .map_err(|e| CopyError::Io("setsockopt(SO_SNDBUFFORCE)", e))?;
                grown = true;
                continue;
            }
            return Err(CopyError::Io("send (copying buffered data)", e));
        }
        at += n as usize;
        if !stream && at < data.len() {
            return Err(CopyError::Io(
                "send (copying buffered data)",
                io::Error::new(io::ErrorKind::WriteZero, "a message was cut"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// A Unix stream whose peer was closed while a byte it had not read
    /// was queued in it: the kernel's reset, pending on the socket.
    fn reset_socket() -> UnixStream {
        let (ours, peer) = UnixStream::pair().unwrap();
        (&ours).write_all(b"x").unwrap();
        drop(peer);
        ours
    }

    #[test]
    fn an_empty_reset_stream_is_scanned_without_taking_its_reset() {
        let sock = reset_socket();
        let fd = OwnedFd::from(sock.try_clone().unwrap());
        assert!(!queue_carries_fds(&fd, libc::SOCK_STREAM).unwrap());
        // Its owner still sees the reset first, then the end.
        let mut buf = [0u8; 4];
        let first = (&sock).read(&mut buf);
        assert_eq!(
            first.map_err(|e| e.raw_os_error()),
            Err(Some(libc::ECONNRESET))
        );
        assert_eq!((&sock).read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn queued_bytes_of_a_stream_are_still_scanned() {
        let (ours, peer) = UnixStream::pair().unwrap();
        (&peer).write_all(b"abc").unwrap();
        let fd = OwnedFd::from(ours);
        assert!(!queue_carries_fds(&fd, libc::SOCK_STREAM).unwrap());
        assert_eq!(queued_bytes(&fd).unwrap(), 3, "the queue is left as it was");
    }
}
