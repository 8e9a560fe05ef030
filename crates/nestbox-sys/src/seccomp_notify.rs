//! Seccomp user notification (`seccomp_unotify(2)`): receiving the calls a
//! filter stopped with `SECCOMP_RET_USER_NOTIF` and answering them, and the
//! hand-over of the listener from the box's first process to its monitor.
//!
//! A notification names the calling process by its pid in the listener
//! holder's pid namespace, the call's number and raw arguments. Anything read
//! from the caller's memory (a path, a socket address) may change after it is
//! read: [`id_valid`] after the read tells that the caller is still the one
//! waiting (not a reused pid), and an answer that lets the call run
//! ([`respond_continue`]) makes the kernel read the memory again.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use crate::Result;
use nix::errno::Errno;

/// `struct seccomp_data`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SeccompData {
    /// The call's number.
    pub nr: i32,
    /// `AUDIT_ARCH_*` of the call.
    pub arch: u32,
    /// Where the call was made.
    pub instruction_pointer: u64,
    /// The raw arguments.
    pub args: [u64; 6],
}

/// `struct seccomp_notif`: one stopped call.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Notification {
    /// The notification's id (for the answer and [`id_valid`]).
    pub id: u64,
    /// The caller's thread id, in the listener holder's pid namespace.
    pub pid: u32,
    flags: u32,
    /// The call.
    pub data: SeccompData,
}

#[repr(C)]
#[derive(Debug, Default)]
struct Response {
    id: u64,
    val: i64,
    error: i32,
    flags: u32,
}

#[repr(C)]
#[derive(Debug, Default)]
struct AddFd {
    id: u64,
    flags: u32,
    srcfd: u32,
    newfd: u32,
    newfd_flags: u32,
}

const RECV: libc::c_ulong = 0xc050_2100; // _IOWR('!', 0, struct seccomp_notif)
const SEND: libc::c_ulong = 0xc018_2101; // _IOWR('!', 1, struct seccomp_notif_resp)
const ID_VALID: libc::c_ulong = 0x4008_2102; // _IOW('!', 2, __u64)
const ADDFD: libc::c_ulong = 0x4018_2103; // _IOW('!', 3, struct seccomp_notif_addfd)
const SET_FLAGS: libc::c_ulong = 0x4008_2104; // _IOW('!', 4, __u64)
const FD_SYNC_WAKE_UP: u64 = 1;
const FLAG_CONTINUE: u32 = 1;
const ADDFD_FLAG_SEND: u32 = 1 << 1;

fn ioctl<T>(listener: BorrowedFd<'_>, request: libc::c_ulong, arg: &mut T) -> Result<i32> {
    // SAFETY: each request of this module is passed the struct the kernel's
    // uapi defines for it (`repr(C)`, same layout), which lives for the call;
    // the kernel reads or fills only that struct.
    let rc = unsafe { libc::ioctl(listener.as_raw_fd(), request, std::ptr::from_mut(arg)) };
    Errno::result(rc)
}

/// Wait for and take the next notification. `ENOENT`: the caller went away
/// before it was read (take the next one).
pub fn receive(listener: BorrowedFd<'_>) -> Result<Notification> {
    // The kernel insists on a zeroed buffer.
    let mut n = Notification::default();
    ioctl(listener, RECV, &mut n)?;
    Ok(n)
}

/// Ask the kernel to wake the listener's reader on the caller's CPU and the
/// caller on the reader's (`SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP`, Linux 6.6):
/// a call and its answer then hand over like a synchronous call instead of
/// two scheduler wake-ups. `EINVAL` on older kernels (nothing changes).
pub fn sync_wake_up(listener: BorrowedFd<'_>) -> Result<()> {
    // SAFETY: this request takes its flags by value (no memory is passed);
    // it only sets a flag of the listener.
    let rc = unsafe { libc::ioctl(listener.as_raw_fd(), SET_FLAGS, FD_SYNC_WAKE_UP) };
    Errno::result(rc).map(|_| ())
}

/// Whether notification `id` still waits for its answer (its caller is alive
/// and in the call).
pub fn id_valid(listener: BorrowedFd<'_>, id: u64) -> bool {
    let mut id = id;
    ioctl(listener, ID_VALID, &mut id).is_ok()
}

fn send(listener: BorrowedFd<'_>, mut r: Response) -> Result<()> {
    ioctl(listener, SEND, &mut r).map(|_| ())
}

/// Let the call run in the kernel as if no filter had stopped it (the
/// filters after it still apply). `ENOENT`: the caller went away.
pub fn respond_continue(listener: BorrowedFd<'_>, id: u64) -> Result<()> {
    send(
        listener,
        Response {
            id,
            flags: FLAG_CONTINUE,
            ..Response::default()
        },
    )
}

/// Fail the call with `errno` (positive) without running it.
pub fn respond_error(listener: BorrowedFd<'_>, id: u64, errno: i32) -> Result<()> {
    send(
        listener,
        Response {
            id,
            error: -errno,
            ..Response::default()
        },
    )
}

/// Answer the call with `value` (success) without running it.
pub fn respond_value(listener: BorrowedFd<'_>, id: u64, value: i64) -> Result<()> {
    send(
        listener,
        Response {
            id,
            val: value,
            ..Response::default()
        },
    )
}

/// Install a copy of `fd` in the caller (a free number, close-on-exec when
/// `cloexec`) and answer the call with that number, in one step
/// (`SECCOMP_ADDFD_FLAG_SEND`).
pub fn respond_with_fd(
    listener: BorrowedFd<'_>,
    id: u64,
    fd: BorrowedFd<'_>,
    cloexec: bool,
) -> Result<i32> {
    let mut a = AddFd {
        id,
        flags: ADDFD_FLAG_SEND,
        srcfd: fd.as_raw_fd() as u32,
        newfd: 0,
        newfd_flags: if cloexec { libc::O_CLOEXEC as u32 } else { 0 },
    };
    ioctl(listener, ADDFD, &mut a)
}

/// `CMSG_SPACE(sizeof(int))` on x86-64: room for one fd.
const SPACE: usize = 24;

/// A one-byte message with room for one fd of control data, the buffers it
/// points at owned with it (so the pointers stay valid while it lives).
#[repr(C)]
struct OneFdMessage {
    msg: libc::msghdr,
    iov: libc::iovec,
    byte: [u8; 1],
    control: Control,
}

#[repr(C, align(8))]
struct Control([u8; SPACE]);

impl OneFdMessage {
    /// Boxed, so that the pointers set here stay valid when it moves.
    fn new(byte: u8) -> Box<OneFdMessage> {
        let mut m = Box::new(OneFdMessage {
            // SAFETY: all-zero is a valid msghdr and iovec.
            msg: unsafe { std::mem::zeroed() },
            // SAFETY: as above.
            iov: unsafe { std::mem::zeroed() },
            byte: [byte],
            control: Control([0; SPACE]),
        });
        m.iov.iov_base = m.byte.as_mut_ptr().cast();
        m.iov.iov_len = 1;
        m.msg.msg_iov = &mut m.iov;
        m.msg.msg_iovlen = 1;
        m.msg.msg_control = m.control.0.as_mut_ptr().cast();
        m.msg.msg_controllen = SPACE;
        m
    }
}

/// Send `fd` over the Unix socket `sock` (`SCM_RIGHTS`, one byte of data),
/// with `cookie` in the unused arguments 3 and 4 of `sendmsg` (see
/// `nestbox_seccomp::monitor_profile`). Called between `fork` and `exec` of
/// a single-threaded process (it allocates once).
pub fn send_listener(sock: RawFd, fd: RawFd, cookie: [u64; 2]) -> Result<()> {
    let mut m = OneFdMessage::new(b'L');
    // SAFETY: msg_control points at SPACE bytes, room for one header and one
    // int; CMSG_FIRSTHDR returns a pointer into it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&m.msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<i32>(), fd);
    }
    // SAFETY: the message and everything it points at live for the call; the
    // kernel reads them only. Arguments 3 and 4 are ignored by sendmsg.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_sendmsg,
            sock,
            std::ptr::addr_of_mut!(m.msg),
            libc::MSG_NOSIGNAL,
            cookie[0],
            cookie[1],
            0u64,
        )
    };
    Errno::result(rc).map(|_| ())
}

/// Receive the fd [`send_listener`] sent on `sock`; `None` at end of file
/// (the sender closed the socket without sending: it failed before).
pub fn receive_listener(sock: BorrowedFd<'_>) -> Result<Option<OwnedFd>> {
    let mut m = OneFdMessage::new(0);
    let msg = &mut m.msg;
    let n = loop {
        // SAFETY: as in send_listener; the kernel writes at most SPACE bytes of
        // control data and one byte of data into our buffers.
        let rc = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut *msg, libc::MSG_CMSG_CLOEXEC) };
        match Errno::result(rc) {
            Err(Errno::EINTR) => continue,
            r => break r?,
        }
    };
    if n == 0 {
        return Ok(None);
    }
    // SAFETY: the kernel filled msg_control (msg_controllen says how much);
    // CMSG_FIRSTHDR returns null when there is no header.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&*msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(Errno::EBADMSG);
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<i32>());
        Ok(Some(OwnedFd::from_raw_fd(fd)))
    }
}

/// `SECCOMP_SET_MODE_FILTER`, the first argument of `seccomp(2)`.
pub const SET_MODE_FILTER: u64 = 1;

/// The flags of a monitor filter attached to a running process
/// (`nestbox monitor attach`): a listener is returned
/// (`SECCOMP_FILTER_FLAG_NEW_LISTENER`, 1 << 3), every thread of the process
/// gets the filter (`SECCOMP_FILTER_FLAG_TSYNC`, 1 << 0), and a thread whose
/// filters differ makes the call fail with `ESRCH`
/// (`SECCOMP_FILTER_FLAG_TSYNC_ESRCH`, 1 << 4) instead of returning its tid
/// (which the kernel requires when a listener is asked for with TSYNC).
pub const ATTACH_FLAGS: u64 = (1 << 3) | (1 << 0) | (1 << 4);

/// The bytes of `struct sock_fprog` for a program of `len` instructions at
/// `filter` in another process (x86-64 layout: a 16-bit length, padding, a
/// 64-bit pointer), to be written there for an injected `seccomp(2)`.
pub fn fprog_bytes(len: u16, filter: u64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..2].copy_from_slice(&len.to_ne_bytes());
    b[8..].copy_from_slice(&filter.to_ne_bytes());
    b
}

/// The bytes of the instructions `insns` (`struct sock_filter`: a 16-bit
/// code, two 8-bit jumps, a 32-bit constant), to be written into another
/// process.
pub fn filter_bytes(insns: &[libc::sock_filter]) -> Vec<u8> {
    let mut out = Vec::with_capacity(insns.len() * 8);
    for i in insns {
        out.extend_from_slice(&i.code.to_ne_bytes());
        out.push(i.jt);
        out.push(i.jf);
        out.extend_from_slice(&i.k.to_ne_bytes());
    }
    out
}

#[cfg(test)]
mod attach_tests {
    use super::*;

    #[test]
    fn fprog_and_filter_bytes_have_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<libc::sock_fprog>(), 16);
        let b = fprog_bytes(3, 0x1122_3344_5566_7788);
        assert_eq!(&b[..2], &3u16.to_ne_bytes());
        assert_eq!(&b[8..], &0x1122_3344_5566_7788u64.to_ne_bytes());
        let insn = libc::sock_filter {
            code: 0x15,
            jt: 1,
            jf: 2,
            k: 0xdead_beef,
        };
        let bytes = filter_bytes(&[insn, insn]);
        assert_eq!(bytes.len(), 2 * std::mem::size_of::<libc::sock_filter>());
        // SAFETY: sock_filter is plain old data of 8 bytes; reading it as
        // bytes is how the kernel reads it.
        let raw: [u8; 8] = unsafe { std::mem::transmute(insn) };
        assert_eq!(&bytes[..8], &raw);
    }
}
