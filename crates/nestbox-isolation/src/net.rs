//! The network of a box with no network interfaces of its own: just loopback,
//! brought up in the new network namespace.

use std::os::fd::AsRawFd;

use nix::errno::Errno;
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};

use crate::{IsolationError, Result};

/// Set the `lo` interface of the caller's network namespace up.
pub fn loopback_up() -> Result<()> {
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| IsolationError::call("socket for interface ioctl", e))?;
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads into the ifreq we own, on a socket we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(IsolationError::call(
            "ioctl(SIOCGIFFLAGS lo)",
            Errno::last(),
        ));
    }
    // A namespace made ahead of time (the network pool) has it up already:
    // setting the flags takes the kernel's RTNL lock, which namespaces being
    // made or destroyed meanwhile may hold for a while; reading them does not.
    // SAFETY: the flags member of the union is the one SIOCGIFFLAGS filled in.
    if unsafe { req.ifr_ifru.ifru_flags } & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    // SAFETY: as above.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(IsolationError::call(
            "ioctl(SIOCSIFFLAGS lo up)",
            Errno::last(),
        ));
    }
    Ok(())
}
