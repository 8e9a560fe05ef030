//! IPv4 addresses of interfaces through rtnetlink.

use std::net::{IpAddr, Ipv4Addr};

use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::error::Result;
use crate::netlink::{is_errno, Netlink, NLM_F_CREATE, NLM_F_EXCL};

/// Add `addr/prefix` to interface `index` (`name` is for messages). An address
/// that is already there is not an error.
pub fn add(nl: &mut Netlink, index: u32, name: &str, addr: Ipv4Addr, prefix: u8) -> Result<()> {
    let mut msg = AddressMessage::default();
    msg.header.family = AddressFamily::Inet;
    msg.header.prefix_len = prefix;
    msg.header.index = index;
    msg.attributes
        .push(AddressAttribute::Local(IpAddr::V4(addr)));
    msg.attributes
        .push(AddressAttribute::Address(IpAddr::V4(addr)));
    let bcast =
        Ipv4Addr::from(u32::from(addr) | (u32::MAX.checked_shr(u32::from(prefix)).unwrap_or(0)));
    msg.attributes.push(AddressAttribute::Broadcast(bcast));
    match nl.request(
        RouteNetlinkMessage::NewAddress(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add address {addr}/{prefix} to {name}"),
    ) {
        Err(e) if is_errno(&e, libc::EEXIST) => Ok(()),
        r => r,
    }
}

/// IPv4 addresses (with prefix) of interface `index`: a dump the kernel
/// filters by interface (the messages are still checked here).
pub fn list(nl: &mut Netlink, index: u32) -> Result<Vec<(Ipv4Addr, u8)>> {
    let mut req = AddressMessage::default();
    req.header.family = AddressFamily::Inet;
    req.header.index = index;
    let msgs = nl.dump_filtered(RouteNetlinkMessage::GetAddress(req), &|| {
        format!("dump addresses of interface {index}")
    })?;
    let mut out = Vec::new();
    for m in msgs {
        let RouteNetlinkMessage::NewAddress(m) = m else {
            continue;
        };
        if m.header.index != index {
            continue;
        }
        for a in &m.attributes {
            if let AddressAttribute::Local(IpAddr::V4(v4)) = a {
                out.push((*v4, m.header.prefix_len));
            }
        }
    }
    Ok(out)
}
