//! The network's shared devices: the bridge (with the gateway address,
//! forwarding and `route_localnet`), the IFB device carrying the egress HTB
//! tree, and the NAT table; made by the first attach, whichever are missing,
//! and removed with the network. Also the layout of the egress tree (class
//! and filter numbering) that attaching and gc follow, and the network's
//! nftables rules: built from its state ([`Network::apply_rules`], which
//! resolves the host names of egress policies and records what they
//! resolved to in `egress-names.json`) and refreshed ([`Network::refresh`]).

use std::fs;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

use super::{host_veth_name, Network};
use crate::egress::Resolved;
use crate::error::{NetError, Result};
use crate::netlink::Netlink;
use crate::nft::Ruleset;
use crate::port::PortMapping;
use crate::rate::Rate;
use crate::state::Locked;
use crate::subnet::Subnet;
use crate::tc::{self, HtbClass};
use crate::{addr, link, route};

/// Bytes of HTB quantum per unit of share: the default share gets 50 000 bytes
/// per round, about one large GSO packet.
pub(super) const QUANTUM_PER_SHARE: u32 = 500;
/// Guaranteed rate of a box class without a reservation (HTB needs one).
pub(super) const MIN_CLASS_RATE: u64 = 8_000;
/// HTB major number of the egress tree on the IFB and of the ingress cap on a veth.
pub(super) const HTB_MAJOR: u16 = 1;
/// Queue length of the IFB device (its default of 32 drops TCP bursts).
const IFB_TXQLEN: u32 = 1000;
/// Class of egress packets no box filter claims (non-IP, or a source address
/// that is no box's): it borrows like a box with the smallest share.
pub const DEFAULT_CLASS_MINOR: u16 = 0xffff;
/// Priority of the classifying filters on the IFB.
pub(super) const FILTER_PRIO: u16 = 1;
/// u32 hash table (keyed on the source's last octet) of the IFB filters.
pub(super) const HASH_TABLE: u32 = 2;

/// Where the names of egress policies and their addresses are recorded.
const NAMES_FILE: &str = "egress-names.json";

/// What the host names of a network's egress policies resolved to, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResolvedNames {
    /// Each name's IPv4 addresses (none: it did not resolve and admits nothing).
    pub names: Resolved,
    /// When, in seconds since the epoch.
    pub at: u64,
}

fn write_sysctl(path: &str, value: &str) -> Result<()> {
    fs::write(path, value).map_err(|e| NetError::io("write", path, e))
}

/// HTB quantum of a class of rate `rate`.
pub(super) fn quantum_for(rate: Rate) -> u32 {
    (rate.bytes() / 10).clamp(1514, 200_000) as u32
}

/// The network's shared devices, as an attach needs them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Infra {
    /// Index of the bridge.
    pub bridge: u32,
    /// The bridge's hardware address: frames to it leave the network (to the
    /// host, or routed by it beyond).
    pub bridge_mac: Option<[u8; 6]>,
    /// Index of the IFB device carrying the egress tree.
    pub ifb: u32,
    /// Whether the bridge (and with it the nftables tables) was made now.
    pub made_bridge: bool,
}

/// Handle of the IFB filter of the box at `addr` (`offset` in the subnet): in
/// the bucket of the address's last octet, with a node number unique there.
pub(super) fn filter_handle(addr: Ipv4Addr, offset: u32) -> u32 {
    tc::u32_handle(HASH_TABLE, addr.octets()[3], filter_node(offset))
}

pub(super) fn filter_node(offset: u32) -> u16 {
    ((offset >> 8) + 1) as u16
}

impl Network {
    /// Make the bridge (with the gateway address, forwarding and
    /// `route_localnet` on), the IFB device with its HTB root and link class,
    /// and the NAT table, whichever are missing.
    pub(super) fn ensure_infra(&self, nl: &mut Netlink, locked: &Locked) -> Result<Infra> {
        let c = &self.config;
        let mut made_bridge = false;
        let (bridge, bridge_mac) = match link::index_and_mac(nl, &c.bridge)? {
            Some(found) => found,
            None => {
                for r in route::list_main(nl)? {
                    if r.prefix == 0 {
                        continue;
                    }
                    if let Ok(rs) = Subnet::new(r.dst, r.prefix) {
                        if rs.overlaps(&c.subnet) {
                            let dev = link::list(nl)?
                                .into_iter()
                                .find(|l| Some(l.index) == r.oif)
                                .map(|l| l.name)
                                .unwrap_or_else(|| "?".into());
                            return Err(NetError::SubnetOverlap {
                                subnet: c.subnet.to_string(),
                                route: rs.to_string(),
                                dev,
                            });
                        }
                    }
                }
                let mut mac = [0x02u8, 0, 0, 0, 0, 0];
                let h = host_veth_name(&c.bridge, "");
                for (i, m) in mac.iter_mut().enumerate().skip(1) {
                    *m = u8::from_str_radix(&h[3 + 2 * i..5 + 2 * i], 16).unwrap_or(0);
                }
                let idx = link::create_bridge(nl, &c.bridge, mac)?;
                let setup = (|| -> Result<()> {
                    addr::add(nl, idx, &c.bridge, c.subnet.gateway(), c.subnet.prefix())?;
                    let conf = format!("/proc/sys/net/ipv4/conf/{}", c.bridge);
                    write_sysctl(&format!("{conf}/forwarding"), "1")?;
                    write_sysctl(&format!("{conf}/route_localnet"), "1")?;
                    if c.ip_forward {
                        write_sysctl("/proc/sys/net/ipv4/ip_forward", "1")?;
                    }
                    self.apply_rules(locked, "create the network's NAT table")
                })();
                if let Err(e) = setup {
                    if let Err(undo) = link::delete(nl, &c.bridge) {
                        tracing::warn!(bridge = %c.bridge, "after a failed set-up ({e}), removing the bridge failed too: {undo}");
                    }
                    return Err(e);
                }
                made_bridge = true;
                (idx, Some(mac))
            }
        };
        let ifb_name = c.ifb();
        let ifb = match link::index(nl, &ifb_name)? {
            Some(i) => i,
            None => {
                let idx = link::create_ifb(nl, &ifb_name, IFB_TXQLEN)?;
                let setup = (|| -> Result<()> {
                    tc::add_htb_qdisc(nl, idx, &ifb_name, HTB_MAJOR, DEFAULT_CLASS_MINOR)?;
                    let link_class = HtbClass {
                        rate: c.link_rate,
                        ceil: c.link_rate,
                        quantum: quantum_for(c.link_rate),
                    };
                    tc::set_htb_class(
                        nl,
                        idx,
                        &ifb_name,
                        tc::handle(HTB_MAJOR, 0),
                        tc::handle(HTB_MAJOR, 1),
                        &link_class,
                        true,
                    )?;
                    let other = HtbClass {
                        rate: Rate::from_bits(MIN_CLASS_RATE).unwrap_or(Rate::MIN),
                        ceil: c.link_rate,
                        quantum: QUANTUM_PER_SHARE,
                    };
                    tc::set_htb_class(
                        nl,
                        idx,
                        &ifb_name,
                        tc::handle(HTB_MAJOR, 1),
                        tc::handle(HTB_MAJOR, DEFAULT_CLASS_MINOR),
                        &other,
                        true,
                    )?;
                    tc::add_source_hash(
                        nl,
                        idx,
                        &ifb_name,
                        tc::handle(HTB_MAJOR, 0),
                        FILTER_PRIO,
                        HASH_TABLE,
                        (c.subnet.base(), c.subnet.prefix()),
                    )
                })();
                if let Err(e) = setup {
                    if let Err(undo) = link::delete(nl, &ifb_name) {
                        tracing::warn!(ifb = %ifb_name, "after a failed set-up ({e}), removing the IFB device failed too: {undo}");
                    }
                    return Err(e);
                }
                idx
            }
        };
        Ok(Infra {
            bridge,
            bridge_mac,
            ifb,
            made_bridge,
        })
    }

    /// Write the network's nftables rules as its state says (host names of
    /// egress policies resolved now), and record what each name resolved to.
    pub(super) fn apply_rules(&self, locked: &Locked, what: &str) -> Result<()> {
        let (rules, names) = self.ruleset(locked, None);
        rules.apply(what)?;
        self.record_names(&names)
    }

    /// Resolve the host names of the network's egress policies again and,
    /// if any now stands for other addresses, rewrite the rules. Returns what
    /// each name resolves to. Nothing is done for a network that is not on
    /// the host (no bridge: its rules are written when it is).
    pub fn refresh(&self) -> Result<Resolved> {
        let locked = self.lock_existing()?;
        let (rules, names) = self.ruleset(&locked, None);
        let mut nl = Netlink::open()?;
        if link::index(&mut nl, &self.config.bridge)?.is_none() {
            return Ok(names);
        }
        if self.resolved_names()?.map(|r| r.names) != Some(names.clone()) {
            rules.apply("refresh the egress host names")?;
        }
        self.record_names(&names)?;
        Ok(names)
    }

    /// What the host names of the network's egress policies resolved to when
    /// its rules were last written, if any policy has names.
    pub fn resolved_names(&self) -> Result<Option<ResolvedNames>> {
        let path = self.config.state_dir.join(NAMES_FILE);
        match fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| NetError::State {
                    path,
                    message: e.to_string(),
                }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(NetError::io("read", path, e)),
        }
    }

    fn record_names(&self, names: &Resolved) -> Result<()> {
        let path = self.config.state_dir.join(NAMES_FILE);
        if names.is_empty() {
            return match fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(NetError::io("remove", path, e))
                }
                _ => Ok(()),
            };
        }
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let record = ResolvedNames {
            names: names.clone(),
            at,
        };
        let json = serde_json::to_vec_pretty(&record).map_err(|e| NetError::State {
            path: path.clone(),
            message: e.to_string(),
        })?;
        crate::state::write_atomic(&path, &json)
    }

    /// The ruleset of the network, with box `extra` (not yet recorded)
    /// publishing its ports too, host names resolved; and what they
    /// resolved to.
    pub(super) fn ruleset<'a>(
        &'a self,
        locked: &Locked,
        extra: Option<(&[PortMapping], Ipv4Addr)>,
    ) -> (Ruleset<'a>, Resolved) {
        let mut names = Resolved::new();
        let host_allowed = locked
            .state
            .boxes
            .values()
            .filter_map(|e| e.attachment.as_ref().map(|a| (a, e.address)))
            .flat_map(|(a, addr)| a.allow_host.iter().map(move |p| (*p, addr)))
            .collect();
        let egress = locked
            .state
            .boxes
            .iter()
            .filter_map(|(id, e)| e.attachment.as_ref().map(|a| (id, a, e.address)))
            .filter(|(_, a, _)| !a.egress.is_allow_all())
            .map(|(id, a, addr)| {
                let (policy, n) = a.egress.resolved();
                names.extend(n);
                (id.clone(), addr, policy)
            })
            .collect();
        let network_egress = (!self.config.egress.is_allow_all()).then(|| {
            let (policy, n) = self.config.egress.resolved();
            names.extend(n);
            (self.config.name.clone(), policy)
        });
        let mut published: Vec<(PortMapping, Ipv4Addr)> = locked
            .state
            .boxes
            .values()
            .filter_map(|e| e.attachment.as_ref().map(|a| (a, e.address)))
            .flat_map(|(a, addr)| a.publish.iter().map(move |m| (*m, addr)))
            .collect();
        if let Some((ports, addr)) = extra {
            published.extend(ports.iter().map(|m| (*m, addr)));
        }
        // Inside a user namespace the guard is the `bridge` table: one chain
        // per box whose guard is there (see `crate::nft`), with the policy
        // as saved now (it may have changed since this handle was opened,
        // while the network had no box).
        let guards = crate::netns::in_user_namespace().then(|| crate::nft::Guards {
            isolated: crate::config::NetworkConfig::load(&self.config.state_dir)
                .ok()
                .flatten()
                .map_or(self.config.isolated, |c| c.isolated),
            boxes: locked
                .state
                .boxes
                .values()
                .filter_map(|e| {
                    let a = e.attachment.as_ref()?;
                    Some((a.host_veth.clone(), a.nft_guard.clone()?, e.address))
                })
                .collect(),
        });
        let rules = Ruleset {
            bridge: &self.config.bridge,
            subnet: self.config.subnet,
            published,
            host_allowed,
            egress,
            network_egress,
            guards,
        };
        (rules, names)
    }
}
