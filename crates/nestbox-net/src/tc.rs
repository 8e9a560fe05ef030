//! Traffic control through rtnetlink: HTB qdiscs and classes, the ingress
//! qdisc, the u32 filters that redirect a box's frames to the IFB device
//! (`mirred`) — all of them, or those addressed to the bridge's hardware address
//! and the broadcast/multicast ones ([`Redirect`]) —, the BPF classifier of the
//! box-to-box shortcut ([`crate::bpf`]), and the u32 hash table on the IFB that
//! puts each packet in the class of the box it came from (by source address).
//!
//! Only u32 and BPF classifiers and the mirred action are assumed: that is what
//! kernels built for small VMs carry (this machine has no matchall, no
//! skbedit). HTB options are not modelled by netlink-packet-route, so this
//! module encodes `tc_htb_glob` and `tc_htb_opt` itself (layouts from the
//! kernel's `pkt_sched.h`). Rate specs say "Ethernet link layer", which lets
//! the kernel compute rates itself, without rate tables.

use std::os::fd::{AsRawFd, BorrowedFd};

use netlink_packet_core::DefaultNla;
use netlink_packet_route::tc::{
    TcAction, TcActionAttribute, TcActionGeneric, TcActionMirrorOption, TcActionOption,
    TcActionType, TcAttribute, TcFilterU32Option, TcHandle, TcMessage, TcMirror,
    TcMirrorActionType, TcOption, TcU32Key, TcU32Selector, TcU32SelectorFlags,
};
use netlink_packet_route::RouteNetlinkMessage;

use crate::error::Result;
use crate::netlink::{is_errno, Netlink, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use crate::rate::Rate;

const TCA_HTB_PARMS: u16 = 1;
const TCA_HTB_INIT: u16 = 2;
const TCA_HTB_RATE64: u16 = 6;
const TCA_HTB_CEIL64: u16 = 7;
const TC_LINKLAYER_ETHERNET: u8 = 1;
const TCA_BPF_FD: u16 = 6;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
/// Handle of the ingress qdisc (`ffff:`).
pub const INGRESS_HANDLE: u32 = 0xffff_0000;
/// Nanoseconds per scheduler tick (`PSCHED_TICKS2NS(1)`).
const NS_PER_TICK: u64 = 64;

/// A class handle `major:minor` as one number.
pub fn handle(major: u16, minor: u16) -> u32 {
    (u32::from(major) << 16) | u32::from(minor)
}

/// `major:minor` in hex, as `tc` prints it.
pub fn handle_str(h: u32) -> String {
    format!("{:x}:{:x}", h >> 16, h & 0xffff)
}

/// Parameters of one HTB class.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HtbClass {
    /// Guaranteed rate.
    pub rate: Rate,
    /// Rate it may borrow up to.
    pub ceil: Rate,
    /// Bytes served per round when borrowing (the share weight).
    pub quantum: u32,
}

fn ratespec(rate: Rate) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[1] = TC_LINKLAYER_ETHERNET;
    let r = u32::try_from(rate.bytes()).unwrap_or(u32::MAX);
    b[8..12].copy_from_slice(&r.to_ne_bytes());
    b
}

/// Burst time in scheduler ticks: about one millisecond of the rate plus a
/// 64 KiB (one GSO packet), as `tc` would choose for a 1000 Hz timer.
fn burst_ticks(rate: Rate) -> u32 {
    let bytes = rate.bytes().max(1);
    let burst = bytes / 1000 + 65_536;
    let ns = (burst as u128 * 1_000_000_000u128 / bytes as u128) as u64;
    u32::try_from(ns / NS_PER_TICK).unwrap_or(u32::MAX)
}

fn htb_opt(c: &HtbClass) -> Vec<TcOption> {
    let mut b = Vec::with_capacity(44);
    b.extend_from_slice(&ratespec(c.rate));
    b.extend_from_slice(&ratespec(c.ceil));
    b.extend_from_slice(&burst_ticks(c.rate).to_ne_bytes());
    b.extend_from_slice(&burst_ticks(c.ceil).to_ne_bytes());
    b.extend_from_slice(&c.quantum.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes()); // level
    b.extend_from_slice(&0u32.to_ne_bytes()); // prio
    let mut opts = vec![TcOption::Other(DefaultNla::new(TCA_HTB_PARMS, b))];
    if c.rate.bytes() > u64::from(u32::MAX) {
        opts.push(TcOption::Other(DefaultNla::new(
            TCA_HTB_RATE64,
            c.rate.bytes().to_ne_bytes().to_vec(),
        )));
    }
    if c.ceil.bytes() > u64::from(u32::MAX) {
        opts.push(TcOption::Other(DefaultNla::new(
            TCA_HTB_CEIL64,
            c.ceil.bytes().to_ne_bytes().to_vec(),
        )));
    }
    opts
}

fn msg(ifindex: u32, handle: u32, parent: u32) -> TcMessage {
    let mut m = TcMessage::with_index(ifindex as i32);
    m.header.handle = TcHandle::from(handle);
    m.header.parent = TcHandle::from(parent);
    m
}

/// Add the ingress qdisc (`ffff:`) to interface `ifindex` (`name` for messages).
pub fn add_ingress_qdisc(nl: &mut Netlink, ifindex: u32, name: &str) -> Result<()> {
    let mut m = msg(ifindex, INGRESS_HANDLE, u32::from(TcHandle::INGRESS));
    m.attributes.push(TcAttribute::Kind("ingress".into()));
    nl.request(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add ingress qdisc to {name}"),
    )
}

/// Add an HTB root qdisc `major:` to `ifindex`; unclassified packets go to
/// `major:default_minor` (0: sent unshaped).
pub fn add_htb_qdisc(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    major: u16,
    default_minor: u16,
) -> Result<()> {
    let mut m = msg(ifindex, handle(major, 0), u32::from(TcHandle::ROOT));
    m.attributes.push(TcAttribute::Kind("htb".into()));
    let mut glob = Vec::with_capacity(20);
    for v in [3u32, 10, u32::from(default_minor), 0, 0] {
        glob.extend_from_slice(&v.to_ne_bytes());
    }
    m.attributes.push(TcAttribute::Options(vec![TcOption::Other(
        DefaultNla::new(TCA_HTB_INIT, glob),
    )]));
    nl.request(
        RouteNetlinkMessage::NewQueueDiscipline(m),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add htb qdisc {major:x}: to {name}"),
    )
}

/// Create HTB class `classid` under `parent` on `ifindex`, or (with `replace`)
/// create or change it.
pub fn set_htb_class(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    parent: u32,
    classid: u32,
    class: &HtbClass,
    replace: bool,
) -> Result<()> {
    let mut m = msg(ifindex, classid, parent);
    m.attributes.push(TcAttribute::Kind("htb".into()));
    m.attributes.push(TcAttribute::Options(htb_opt(class)));
    let flags = if replace {
        NLM_F_CREATE | NLM_F_REPLACE
    } else {
        NLM_F_CREATE | NLM_F_EXCL
    };
    nl.request(RouteNetlinkMessage::NewTrafficClass(m), flags, &|| {
        format!(
            "add htb class {} (rate {} ceil {} quantum {}) to {name}",
            handle_str(classid),
            class.rate,
            class.ceil,
            class.quantum
        )
    })
}

/// Delete class `classid` of `ifindex`; `Ok(false)` if it was not there.
pub fn del_class(nl: &mut Netlink, ifindex: u32, name: &str, classid: u32) -> Result<bool> {
    let m = msg(ifindex, classid, 0);
    match nl.request(RouteNetlinkMessage::DelTrafficClass(m), 0, &|| {
        format!("delete class {} of {name}", handle_str(classid))
    }) {
        Ok(()) => Ok(true),
        Err(e) if is_errno(&e, libc::ENOENT) || is_errno(&e, libc::ENODEV) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `info` of a filter message: priority and protocol (network byte order).
fn filter_info(prio: u16, protocol: u16) -> u32 {
    (u32::from(prio) << 16) | u32::from(protocol.to_be())
}

fn u32_msg(ifindex: u32, parent: u32, prio: u16, protocol: u16, handle: u32) -> TcMessage {
    let mut m = msg(ifindex, handle, parent);
    m.header.info = filter_info(prio, protocol);
    m.attributes.push(TcAttribute::Kind("u32".into()));
    m
}

fn key(mask: u32, val: u32, off: i32) -> TcU32Key {
    let mut k = TcU32Key::default();
    k.mask = mask;
    k.val = val;
    k.off = off;
    k
}

fn selector(keys: Vec<TcU32Key>, terminal: bool) -> TcU32Selector {
    let mut sel = TcU32Selector::default();
    if terminal {
        sel.flags = TcU32SelectorFlags::Terminal;
    }
    sel.nkeys = keys.len() as u8;
    sel.keys = keys;
    sel
}

/// Which frames arriving from a box a redirect filter sends to the IFB device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirect {
    /// Every frame.
    All,
    /// Frames addressed to this hardware address (the bridge's: what the box
    /// sends to the host and, routed by it, beyond).
    ToMac([u8; 6]),
    /// Broadcast and multicast frames (the group bit of the destination set):
    /// they reach the host too.
    Group,
}

impl Redirect {
    /// The u32 keys. At ingress u32 offsets count from the network header, so
    /// the Ethernet destination is the 6 bytes at -14; keys are aligned 32-bit
    /// words, hence the words at -16 (its first two bytes are the low half) and -12.
    fn keys(self) -> Vec<TcU32Key> {
        match self {
            Redirect::All => vec![key(0, 0, 0)],
            Redirect::ToMac(m) => vec![
                key(0x0000_ffff, u32::from_be_bytes([0, 0, m[0], m[1]]), -16),
                key(u32::MAX, u32::from_be_bytes([m[2], m[3], m[4], m[5]]), -12),
            ],
            Redirect::Group => vec![key(0x0000_0100, 0x0000_0100, -16)],
        }
    }
}

/// Add to the ingress qdisc of `ifindex` a u32 filter (priority `prio`) that
/// redirects the frames `what` selects to the egress of `ifb`, where they queue
/// in the shaping tree; frames no filter selects go on to the bridge unshaped.
/// Filters of one priority share one u32 table, each a node of it.
pub fn add_redirect_filter(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    prio: u16,
    what: Redirect,
    ifb: u32,
) -> Result<()> {
    let mut m = u32_msg(ifindex, INGRESS_HANDLE, prio, libc::ETH_P_ALL as u16, 0);
    let mut mirror = TcMirror::default();
    let mut generic = TcActionGeneric::default();
    generic.action = TcActionType::Stolen;
    mirror.generic = generic;
    mirror.eaction = TcMirrorActionType::EgressRedir;
    mirror.ifindex = ifb;
    let mut mirred = TcAction::default();
    mirred.tab = 1;
    mirred.attributes = vec![
        TcActionAttribute::Kind("mirred".into()),
        TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(
            mirror,
        ))]),
    ];
    m.attributes.push(TcAttribute::Options(vec![
        TcOption::U32(TcFilterU32Option::Selector(selector(what.keys(), true))),
        TcOption::U32(TcFilterU32Option::Action(vec![mirred])),
    ]));
    nl.request(
        RouteNetlinkMessage::NewTrafficFilter(m),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add redirect filter ({what:?}) to {name}"),
    )
}

/// Add to the ingress qdisc of `ifindex` a BPF classifier (`cls_bpf`, direct
/// action: the program's return value is the verdict) at priority `prio`,
/// running program `prog` (named `prog_name`).
pub fn add_bpf_filter(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    prio: u16,
    prog: BorrowedFd<'_>,
    prog_name: &str,
) -> Result<()> {
    let mut m = msg(ifindex, 0, INGRESS_HANDLE);
    m.header.info = filter_info(prio, libc::ETH_P_ALL as u16);
    m.attributes.push(TcAttribute::Kind("bpf".into()));
    let mut pname = prog_name.as_bytes().to_vec();
    pname.push(0);
    m.attributes.push(TcAttribute::Options(vec![
        TcOption::Other(DefaultNla::new(
            TCA_BPF_FD,
            (prog.as_raw_fd() as u32).to_ne_bytes().to_vec(),
        )),
        TcOption::Other(DefaultNla::new(TCA_BPF_NAME, pname)),
        TcOption::Other(DefaultNla::new(
            TCA_BPF_FLAGS,
            TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes().to_vec(),
        )),
    ]));
    nl.request(
        RouteNetlinkMessage::NewTrafficFilter(m),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add bpf filter {prog_name} to {name}"),
    )
}

/// The u32 handle of hash table `htid` (12 bits), bucket `bucket`, node `node`.
pub fn u32_handle(htid: u32, bucket: u8, node: u16) -> u32 {
    (htid << 20) | (u32::from(bucket) << 12) | (u32::from(node) & 0xfff)
}

/// Classify IPv4 packets on `ifindex` (under qdisc `parent`, priority `prio`)
/// by source address through a 256-bucket hash table `htid` keyed on the last
/// octet of the source: a box's filter is then found in one short bucket, not
/// by walking one filter per box. Creates the table and the root filter that
/// hashes packets from `subnet` into it.
pub fn add_source_hash(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    parent: u32,
    prio: u16,
    htid: u32,
    subnet: (std::net::Ipv4Addr, u8),
) -> Result<()> {
    let ip = libc::ETH_P_IP as u16;
    let mut table = u32_msg(ifindex, parent, prio, ip, u32_handle(htid, 0, 0));
    table
        .attributes
        .push(TcAttribute::Options(vec![TcOption::U32(
            TcFilterU32Option::Divisor(256),
        )]));
    nl.request(
        RouteNetlinkMessage::NewTrafficFilter(table),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add u32 hash table {htid:x}: to {name}"),
    )?;
    let (base, plen) = subnet;
    let mask = if plen == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(plen))
    };
    let mut sel = selector(vec![key(mask, u32::from(base), 12)], false);
    sel.hmask = 0xff;
    sel.hoff = 12;
    let mut link = u32_msg(ifindex, parent, prio, ip, 0);
    link.attributes.push(TcAttribute::Options(vec![
        TcOption::U32(TcFilterU32Option::Link(u32_handle(htid, 0, 0))),
        TcOption::U32(TcFilterU32Option::Selector(sel)),
    ]));
    nl.request(
        RouteNetlinkMessage::NewTrafficFilter(link),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| format!("add u32 source hash filter to {name}"),
    )
}

/// Put IPv4 packets from `addr` into class `classid`: a filter in the bucket of
/// `addr`'s last octet of hash table `htid`, node `node` (unique in the bucket).
#[allow(clippy::too_many_arguments)]
pub fn add_source_filter(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    parent: u32,
    prio: u16,
    htid: u32,
    node: u16,
    addr: std::net::Ipv4Addr,
    classid: u32,
) -> Result<()> {
    let bucket = addr.octets()[3];
    let handle = u32_handle(htid, bucket, node);
    let mut m = u32_msg(ifindex, parent, prio, libc::ETH_P_IP as u16, handle);
    m.attributes.push(TcAttribute::Options(vec![
        TcOption::U32(TcFilterU32Option::Hash(u32_handle(htid, bucket, 0))),
        TcOption::U32(TcFilterU32Option::ClassId(TcHandle::from(classid))),
        TcOption::U32(TcFilterU32Option::Selector(selector(
            vec![key(u32::MAX, u32::from(addr), 12)],
            true,
        ))),
    ]));
    nl.request(
        RouteNetlinkMessage::NewTrafficFilter(m),
        NLM_F_CREATE | NLM_F_EXCL,
        &|| {
            format!(
                "add filter src {addr} -> class {} to {name}",
                handle_str(classid)
            )
        },
    )
}

/// Delete the u32 filter `handle` (priority `prio`) under `parent` of
/// `ifindex`; `Ok(false)` if it was not there.
pub fn del_u32_filter(
    nl: &mut Netlink,
    ifindex: u32,
    name: &str,
    parent: u32,
    prio: u16,
    handle: u32,
) -> Result<bool> {
    let m = u32_msg(ifindex, parent, prio, libc::ETH_P_IP as u16, handle);
    match nl.request(RouteNetlinkMessage::DelTrafficFilter(m), 0, &|| {
        format!("delete filter {handle:x} of {name}")
    }) {
        Ok(()) => Ok(true),
        Err(e)
            if is_errno(&e, libc::ENOENT)
                || is_errno(&e, libc::ENODEV)
                || is_errno(&e, libc::EINVAL) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Handles of the filters under `parent` of `ifindex` that classify into a
/// class (those with a class id: one per box on the IFB).
pub fn list_class_filters(nl: &mut Netlink, ifindex: u32, parent: u32) -> Result<Vec<(u32, u32)>> {
    let msgs = nl.dump(
        RouteNetlinkMessage::GetTrafficFilter(msg(ifindex, 0, parent)),
        &|| format!("dump filters of interface {ifindex}"),
    )?;
    let mut out = Vec::new();
    for m in msgs {
        let RouteNetlinkMessage::NewTrafficFilter(m) = m else {
            continue;
        };
        for a in &m.attributes {
            if let TcAttribute::Options(opts) = a {
                for o in opts {
                    if let TcOption::U32(TcFilterU32Option::ClassId(c)) = o {
                        out.push((u32::from(m.header.handle), u32::from(*c)));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// A qdisc or class found by a dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcSummary {
    /// Handle (`major:minor`).
    pub handle: u32,
    /// Parent handle.
    pub parent: u32,
    /// Kind (`htb`, `ingress`, `pfifo`...).
    pub kind: String,
}

fn summaries(msgs: Vec<RouteNetlinkMessage>, ifindex: u32) -> Vec<TcSummary> {
    msgs.into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewQueueDiscipline(m)
            | RouteNetlinkMessage::NewTrafficClass(m)
                if m.header.index == ifindex as i32 =>
            {
                let kind = m
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        TcAttribute::Kind(k) => Some(k.clone()),
                        _ => None,
                    })
                    .unwrap_or_default();
                Some(TcSummary {
                    handle: u32::from(m.header.handle),
                    parent: u32::from(m.header.parent),
                    kind,
                })
            }
            _ => None,
        })
        .collect()
}

/// The classes of interface `ifindex`.
pub fn list_classes(nl: &mut Netlink, ifindex: u32) -> Result<Vec<TcSummary>> {
    let msgs = nl.dump(
        RouteNetlinkMessage::GetTrafficClass(TcMessage::with_index(ifindex as i32)),
        &|| format!("dump classes of interface {ifindex}"),
    )?;
    Ok(summaries(msgs, ifindex))
}

/// The qdiscs of interface `ifindex`.
pub fn list_qdiscs(nl: &mut Netlink, ifindex: u32) -> Result<Vec<TcSummary>> {
    let msgs = nl.dump(
        RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
        &|| "dump qdiscs".to_string(),
    )?;
    Ok(summaries(msgs, ifindex))
}
