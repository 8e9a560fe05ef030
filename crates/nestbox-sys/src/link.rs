//! Interface flags with the classic `SIOCGIFFLAGS`/`SIOCSIFFLAGS` ioctls on
//! any socket of the namespace (netlink is used elsewhere; these two are what
//! a box's first process needs to bring its loopback up before exec).

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

use crate::Result;

/// An `ifreq` naming interface `name` (`EINVAL` when it does not fit
/// `IFNAMSIZ` with its NUL).
fn ifreq(name: &str) -> Result<libc::ifreq> {
    if name.len() >= libc::IFNAMSIZ || name.as_bytes().contains(&0) {
        return Err(Errno::EINVAL);
    }
    // SAFETY: ifreq is plain old data (a name and a union of integers and
    // plain structs); all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    Ok(req)
}

/// The flags (`IFF_*`) of interface `name`, through socket `sock`.
pub fn flags(sock: BorrowedFd<'_>, name: &str) -> Result<libc::c_short> {
    let mut req = ifreq(name)?;
    // SAFETY: SIOCGIFFLAGS writes into the ifreq we pass, a live local.
    Errno::result(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: the flags member of the union is the one SIOCGIFFLAGS filled in.
    Ok(unsafe { req.ifr_ifru.ifru_flags })
}

/// Set the flags (`IFF_*`) of interface `name` to `value`, through socket `sock`.
pub fn set_flags(sock: BorrowedFd<'_>, name: &str, value: libc::c_short) -> Result<()> {
    let mut req = ifreq(name)?;
    req.ifr_ifru.ifru_flags = value;
    // SAFETY: SIOCSIFFLAGS reads the ifreq we pass, a live local.
    Errno::result(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) }).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    use std::os::fd::AsFd;

    #[test]
    fn loopback_is_loopback() {
        let sock = socket(
            AddressFamily::Inet,
            SockType::Datagram,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .unwrap();
        let f = flags(sock.as_fd(), "lo").unwrap();
        assert_ne!(f & libc::IFF_LOOPBACK as libc::c_short, 0);
        assert_eq!(
            flags(sock.as_fd(), "nb-no-such-if").unwrap_err(),
            Errno::ENODEV
        );
        assert_eq!(
            flags(sock.as_fd(), "a-name-far-too-long").unwrap_err(),
            Errno::EINVAL
        );
    }
}
