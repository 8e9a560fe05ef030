//! IPv4 routes through rtnetlink: a box's default route, and the host's routes
//! that a new network's subnet must not overlap.

use std::net::Ipv4Addr;

use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use crate::error::Result;
use crate::netlink::{Netlink, NLM_F_CREATE, NLM_F_EXCL};

/// One IPv4 route of the main table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSummary {
    /// Destination network (0.0.0.0 for the default route).
    pub dst: Ipv4Addr,
    /// Its prefix length.
    pub prefix: u8,
    /// Output interface index, if any.
    pub oif: Option<u32>,
}

/// Add a default route via `gateway` on interface `oif` (`name` for messages).
pub fn add_default(nl: &mut Netlink, gateway: Ipv4Addr, oif: u32, name: &str) -> Result<()> {
    let mut msg = RouteMessage::default();
    msg.header.address_family = AddressFamily::Inet;
    msg.header.table = RouteHeader::RT_TABLE_MAIN;
    msg.header.protocol = RouteProtocol::Boot;
    msg.header.scope = RouteScope::Universe;
    msg.header.kind = RouteType::Unicast;
    msg.attributes
        .push(RouteAttribute::Gateway(RouteAddress::Inet(gateway)));
    msg.attributes.push(RouteAttribute::Oif(oif));
    nl.request(
        RouteNetlinkMessage::NewRoute(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add default route via {gateway} dev {name}"),
    )
}

/// The IPv4 routes of the main table.
pub fn list_main(nl: &mut Netlink) -> Result<Vec<RouteSummary>> {
    let mut req = RouteMessage::default();
    req.header.address_family = AddressFamily::Inet;
    let msgs = nl.dump(RouteNetlinkMessage::GetRoute(req), &|| {
        "dump routes".to_string()
    })?;
    let mut out = Vec::new();
    for m in msgs {
        let RouteNetlinkMessage::NewRoute(m) = m else {
            continue;
        };
        let mut table = u32::from(m.header.table);
        let mut r = RouteSummary {
            dst: Ipv4Addr::UNSPECIFIED,
            prefix: m.header.destination_prefix_length,
            oif: None,
        };
        for a in &m.attributes {
            match a {
                RouteAttribute::Destination(RouteAddress::Inet(d)) => r.dst = *d,
                RouteAttribute::Oif(i) => r.oif = Some(*i),
                RouteAttribute::Table(t) => table = *t,
                _ => {}
            }
        }
        if table == u32::from(RouteHeader::RT_TABLE_MAIN) && m.header.kind == RouteType::Unicast {
            out.push(r);
        }
    }
    Ok(out)
}
