//! Network interfaces through rtnetlink: the bridge, the IFB device that carries
//! the egress shaping tree, and the veth pair of each box (created with its peer
//! directly inside the box's namespace, already named `eth0` and up, and its
//! host side already enslaved to the bridge and up: one request).

use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::RouteNetlinkMessage;

use crate::error::Result;
use crate::netlink::{is_errno, Netlink, NLM_F_CREATE, NLM_F_EXCL};

/// What a link dump tells about one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkSummary {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// Index of the bridge it is enslaved to.
    pub master: Option<u32>,
    /// Link kind (`veth`, `bridge`, `ifb`...), when it has one.
    pub kind: Option<String>,
    /// Whether it is administratively up.
    pub up: bool,
}

fn by_name(name: &str) -> LinkMessage {
    let mut msg = LinkMessage::default();
    msg.attributes.push(LinkAttribute::IfName(name.to_string()));
    msg
}

fn up(msg: &mut LinkMessage) {
    msg.header.flags = LinkFlags::Up;
    msg.header.change_mask = LinkFlags::Up;
}

/// Index of interface `name`, or `None` if there is none.
pub fn index(nl: &mut Netlink, name: &str) -> Result<Option<u32>> {
    let what = || format!("get link {name}");
    match nl.get(RouteNetlinkMessage::GetLink(by_name(name)), &what) {
        Ok(RouteNetlinkMessage::NewLink(m)) => Ok(Some(m.header.index)),
        Ok(_) => Ok(None),
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Index and hardware address of interface `name` (one request), or `None` if
/// there is none. The address is `None` for a link without a 6-byte one.
pub fn index_and_mac(nl: &mut Netlink, name: &str) -> Result<Option<(u32, Option<[u8; 6]>)>> {
    let what = || format!("get link {name}");
    match nl.get(RouteNetlinkMessage::GetLink(by_name(name)), &what) {
        Ok(RouteNetlinkMessage::NewLink(m)) => {
            let mac = m.attributes.iter().find_map(|a| match a {
                // Not an error to report: a link whose address is not 6
                // bytes (not Ethernet) has no MAC.
                LinkAttribute::Address(a) => <[u8; 6]>::try_from(a.as_slice()).ok(),
                _ => None,
            });
            Ok(Some((m.header.index, mac)))
        }
        Ok(_) => Ok(None),
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Set interface `index` up (`name` for messages).
pub fn set_up(nl: &mut Netlink, index: u32, name: &str) -> Result<()> {
    let mut msg = LinkMessage::default();
    msg.header.index = index;
    up(&mut msg);
    nl.request(RouteNetlinkMessage::SetLink(msg), 0, &|| {
        format!("set link {name} up")
    })
}

/// Set interface `name` up.
pub fn set_up_by_name(nl: &mut Netlink, name: &str) -> Result<()> {
    let mut msg = by_name(name);
    up(&mut msg);
    nl.request(RouteNetlinkMessage::SetLink(msg), 0, &|| {
        format!("set link {name} up")
    })
}

/// The MAC address of the box with IPv4 address `address` on a bridge:
/// locally administered and unicast (`06:00:` and the address's four bytes;
/// bridges' own start with `02:`), the same whenever a box has that address,
/// so that the neighbour entries the host and other boxes keep for the
/// address stay right when a box is started again with it (a rollback, a
/// restart) instead of sending to a MAC that is gone until they expire.
pub fn box_mac(address: std::net::Ipv4Addr) -> [u8; 6] {
    let [a, b, c, d] = address.octets();
    [0x06, 0x00, a, b, c, d]
}

/// Create bridge `name` with a fixed MAC address (so that it does not change as
/// ports come and go, which would leave stale gateway entries in the boxes' ARP
/// caches) and set it up. Returns its index.
pub fn create_bridge(nl: &mut Netlink, name: &str, mac: [u8; 6]) -> Result<u32> {
    let mut msg = by_name(name);
    up(&mut msg);
    msg.attributes.push(LinkAttribute::Address(mac.to_vec()));
    msg.attributes
        .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(
            InfoKind::Bridge,
        )]));
    nl.request(
        RouteNetlinkMessage::NewLink(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("create bridge {name}"),
    )?;
    must_index(nl, name)
}

/// Create IFB device `name` (queue length `txqlen`) and set it up. Returns its index.
pub fn create_ifb(nl: &mut Netlink, name: &str, txqlen: u32) -> Result<u32> {
    let mut msg = by_name(name);
    up(&mut msg);
    msg.attributes.push(LinkAttribute::TxQueueLen(txqlen));
    msg.attributes
        .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Ifb)]));
    nl.request(
        RouteNetlinkMessage::NewLink(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("create ifb {name}"),
    )?;
    must_index(nl, name)
}

fn must_index(nl: &mut Netlink, name: &str) -> Result<u32> {
    index(nl, name)?.ok_or_else(|| crate::error::NetError::Netlink {
        what: format!("get link {name}"),
        source: std::io::Error::from_raw_os_error(libc::ENODEV),
        detail: Some("created but not found".into()),
    })
}

/// How many boxes a bridge holds at most: the kernel numbers a bridge's
/// ports from 1 to 1,023 (`BR_MAX_PORTS` is 1,024, port 0 is reserved) and
/// refuses one more with `EXFULL`.
pub const BRIDGE_MAX_PORTS: u32 = 1023;

/// Create the veth pair of a box: `host` in this namespace, enslaved to the
/// bridge with index `master` (if given) and up; its peer `peer` (usually `eth0`) created
/// directly in the namespace `peer_ns`, down. Returns the host side's index.
pub fn create_veth(
    nl: &mut Netlink,
    host: &str,
    master: Option<u32>,
    peer: &str,
    peer_ns: BorrowedFd<'_>,
    peer_mac: Option<[u8; 6]>,
) -> Result<u32> {
    // The peer cannot be set up in this request: the kernel opens it before
    // the pair is linked (and veth_open fails with ENOTCONN).
    let mut peer_msg = by_name(peer);
    peer_msg
        .attributes
        .push(LinkAttribute::NetNsFd(peer_ns.as_raw_fd()));
    if let Some(mac) = peer_mac {
        peer_msg
            .attributes
            .push(LinkAttribute::Address(mac.to_vec()));
    }
    let mut msg = by_name(host);
    up(&mut msg);
    if let Some(master) = master {
        msg.attributes.push(LinkAttribute::Controller(master));
    }
    msg.attributes.push(LinkAttribute::LinkInfo(vec![
        LinkInfo::Kind(InfoKind::Veth),
        LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer_msg))),
    ]));
    nl.request(
        RouteNetlinkMessage::NewLink(msg),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("create veth {host} (peer {peer} in the box's namespace)"),
    )?;
    must_index(nl, host)
}

/// Turn IPv6 off on interface `name` of this process's network namespace
/// (`net.ipv6.conf.NAME.disable_ipv6`, a file write: netlink cannot set it).
/// A box's host veth is a bridge port of an IPv4 network and needs no IPv6:
/// without this each one gets a link-local address and two routes in the
/// host's IPv6 table, which the kernel walks on every link change (the cost
/// of each box start and removal then grows with the number of boxes). A
/// kernel without IPv6 has nothing to turn off.
pub fn disable_ipv6(name: &str) -> Result<()> {
    let path = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    match std::fs::write(&path, b"1") {
        Ok(()) => Ok(()),
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                && !std::path::Path::new("/proc/sys/net/ipv6").exists() =>
        {
            Ok(())
        }
        Err(e) => Err(crate::error::NetError::io("write", path, e)),
    }
}

/// Delete interface `name`; `Ok(false)` if there was none.
pub fn delete(nl: &mut Netlink, name: &str) -> Result<bool> {
    match nl.request(RouteNetlinkMessage::DelLink(by_name(name)), 0, &|| {
        format!("delete link {name}")
    }) {
        Ok(()) => Ok(true),
        Err(e) if is_errno(&e, libc::ENODEV) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Every interface of this namespace.
pub fn list(nl: &mut Netlink) -> Result<Vec<LinkSummary>> {
    let msgs = nl.dump(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        &|| "dump links".to_string(),
    )?;
    let mut out = Vec::new();
    for m in msgs {
        let RouteNetlinkMessage::NewLink(m) = m else {
            continue;
        };
        let mut s = LinkSummary {
            index: m.header.index,
            name: String::new(),
            master: None,
            kind: None,
            up: m.header.flags.contains(LinkFlags::Up),
        };
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => s.name = n.clone(),
                LinkAttribute::Controller(i) => s.master = Some(*i),
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        if let LinkInfo::Kind(k) = i {
                            s.kind = Some(k.to_string());
                        }
                    }
                }
                _ => {}
            }
        }
        out.push(s);
    }
    Ok(out)
}
