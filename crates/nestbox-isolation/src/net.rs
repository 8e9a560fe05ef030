//! The network of a box with no network interfaces of its own: just loopback,
//! brought up in the new network namespace.

use std::os::fd::AsFd;

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
    let flags = nestbox_sys::link::flags(sock.as_fd(), "lo")
        .map_err(|e| IsolationError::call("ioctl(SIOCGIFFLAGS lo)", e))?;
    // A namespace made ahead of time (the network pool) has it up already:
    // setting the flags takes the kernel's RTNL lock, which namespaces being
    // made or destroyed meanwhile may hold for a while; reading them does not.
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    let up = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    nestbox_sys::link::set_flags(sock.as_fd(), "lo", up)
        .map_err(|e| IsolationError::call("ioctl(SIOCSIFFLAGS lo up)", e))
}
