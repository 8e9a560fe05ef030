//! Attaching a box's network namespace to the network: the veth pair (host
//! side on the bridge, `eth0` inside with the lease's address and a default
//! route), the box's egress class and the redirects into it, the box-to-box
//! shortcut, its ingress cap and published ports, all recorded before they are
//! made and rolled back on failure; and detaching, which removes them again.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, BorrowedFd};

use super::bridge::{
    filter_handle, filter_node, quantum_for, Infra, FILTER_PRIO, HASH_TABLE, HTB_MAJOR,
    MIN_CLASS_RATE, QUANTUM_PER_SHARE,
};
use super::shortcut::unsupported_is_none;
use super::{
    host_veth_name, AttachOptions, Attachment, Lease, Network, BOX_IFNAME, DEFAULT_SHARE, MAX_SHARE,
};
use crate::error::{NetError, Result};
use crate::netlink::Netlink;
use crate::rate::Rate;
use crate::state::{self, AttachRecord, BoxEntry, Locked};
use crate::tc::{self, HtbClass};
use crate::{addr, bpf, guard, link, netns, route};

/// Priority of the guard (with the box-to-box shortcut) on a host veth's
/// ingress, and of the redirects to the IFB that come after it.
const GUARD_PRIO: u16 = 1;
const REDIRECT_PRIO: u16 = 2;

/// What attaching has made so far, undone in reverse on failure.
#[derive(Debug, Default)]
struct Made {
    veth: Option<String>,
    class: Option<(u32, u32)>,
    filter: Option<(u32, u32)>,
    shortcut: Option<Ipv4Addr>,
    nft: bool,
}

/// What of a box's traffic goes through the egress tree (the redirects to the
/// IFB, after the shortcut on the host veth's ingress). The tree shapes what
/// leaves the network, so for a box without a cap that is what it sends to the
/// bridge's own address (the host, and beyond through it) and its broadcasts
/// and multicasts (which reach the host too); its unicast to other boxes of the
/// network is not shaped and not counted against the link rate: IPv4 takes the
/// shortcut ([`crate::bpf`]) straight to the other box, the rest goes over the
/// bridge. The receiver's ingress cap still applies (the shortcut then delivers
/// through it). A box with a cap (`--net-rate`) has no shortcut and everything
/// it sends shaped, box-to-box traffic included.
///
/// Measured on a 2-core VM (iperf3, medians): box-to-box TCP through the IFB
/// and the bridge was 0.80–0.85 of a plain veth pair's; over the bridge alone
/// about 0.90; with the shortcut 0.97–1.1.
fn redirects(record: &AttachRecord, bridge_mac: Option<[u8; 6]>) -> Vec<tc::Redirect> {
    match bridge_mac {
        Some(mac) if record.rate.is_none() => {
            vec![tc::Redirect::ToMac(mac), tc::Redirect::Group]
        }
        _ => vec![tc::Redirect::All],
    }
}
impl Network {
    fn check_options(&self, box_id: &str, locked: &Locked, opts: &AttachOptions) -> Result<()> {
        let link = self.config.link_rate;
        if let Some(s) = opts.share {
            if !(1..=MAX_SHARE).contains(&s) {
                return Err(NetError::Invalid(format!(
                    "invalid network share {s}: expected 1-{MAX_SHARE}"
                )));
            }
        }
        if let (Some(r), Some(c)) = (opts.reserve, opts.rate) {
            if r > c {
                return Err(NetError::Invalid(format!(
                    "network reservation {r} exceeds the network rate cap {c}"
                )));
            }
        }
        if let Some(r) = opts.reserve {
            let reserved: u64 = locked
                .state
                .boxes
                .iter()
                .filter(|(id, _)| id.as_str() != box_id)
                .filter_map(|(_, e)| e.attachment.as_ref()?.reserve)
                .map(Rate::bits)
                .sum();
            if reserved + r.bits() > link.bits() {
                return Err(NetError::Conflict(format!(
                    "network reservation {r} does not fit: link rate {link}, {} already reserved by other boxes",
                    Rate::from_bits(reserved).map_or("0bit".to_string(), |x| x.to_string())
                )));
            }
        }
        let mut seen = BTreeSet::new();
        for m in &opts.publish {
            if !seen.insert((m.host_port, m.proto)) {
                return Err(NetError::Invalid(format!(
                    "host port {}/{} is published twice",
                    m.host_port,
                    m.proto.as_str()
                )));
            }
            for (other, e) in &locked.state.boxes {
                let Some(a) = &e.attachment else { continue };
                if other != box_id
                    && a.publish
                        .iter()
                        .any(|p| p.host_port == m.host_port && p.proto == m.proto)
                {
                    return Err(NetError::PortInUse {
                        port: m.host_port,
                        proto: m.proto.as_str(),
                        by: Some(format!("box {other}")),
                    });
                }
            }
            m.check_host_port_free()?;
        }
        Ok(())
    }

    /// Attach the network namespace `netns` (e.g. of `/proc/PID/ns/net`) of the
    /// box holding `lease`: create what the network lacks, the veth pair (host
    /// side on the bridge, `eth0` inside with the lease's address and a default
    /// route), the box's egress class, its ingress cap and published ports. On
    /// any failure everything made for the box is removed again.
    pub fn attach(
        &self,
        lease: &Lease,
        netns: BorrowedFd<'_>,
        opts: &AttachOptions,
    ) -> Result<Attachment> {
        self.attach_inner(lease, netns, opts)
            .map_err(|e| e.for_box(&lease.box_id))
    }

    fn attach_inner(
        &self,
        lease: &Lease,
        netns: BorrowedFd<'_>,
        opts: &AttachOptions,
    ) -> Result<Attachment> {
        let id = lease.box_id.as_str();
        // A network removed meanwhile has no lease for the box: nothing is made.
        let mut locked = self.lock_existing()?;
        let entry = locked
            .state
            .boxes
            .get(id)
            .cloned()
            .ok_or_else(|| NetError::NoLease(id.to_string()))?;
        if entry.address != lease.address {
            return Err(NetError::LeaseMismatch {
                box_id: id.to_string(),
                lease: lease.address,
                recorded: entry.address,
            });
        }
        if entry.attachment.is_some() {
            return Err(NetError::AlreadyAttached(id.to_string()));
        }
        self.check_options(id, &locked, opts)?;
        let mut nl = Netlink::open()?;
        let infra = self.ensure_infra(&mut nl, &locked)?;
        if !infra.made_bridge && locked.state.rules != crate::nft::RULES_VERSION {
            // Tables of an older layout (saved with the record below).
            self.apply_rules(&locked, "update the network's nftables tables")?;
        }
        locked.state.rules = crate::nft::RULES_VERSION;

        let link_rate = self.config.link_rate;
        let share = opts.share.unwrap_or(DEFAULT_SHARE);
        let class = tc::handle(HTB_MAJOR, self.config.subnet.offset(entry.address) as u16);
        let record = AttachRecord {
            host_veth: host_veth_name(&self.config.bridge, id),
            class,
            publish: opts.publish.clone(),
            rate: opts.rate,
            reserve: opts.reserve,
            share,
            ingress_rate: opts.ingress_rate,
            allow_host: opts.allow_host.clone(),
            egress: opts.egress.clone(),
            nft_guard: None,
        };
        // Record first: whatever is made below has an owner even if we crash.
        locked.state.boxes.insert(
            id.to_string(),
            BoxEntry {
                attachment: Some(record.clone()),
                ..entry.clone()
            },
        );
        locked.save()?;

        let mut made = Made::default();
        let res = self.attach_steps(
            &mut nl,
            &mut locked,
            lease,
            netns,
            &record,
            &infra,
            link_rate,
            &mut made,
        );
        if let Err(e) = res {
            self.undo(&mut nl, id, &made);
            locked.state.boxes.insert(id.to_string(), entry);
            // The attach's own error is the one reported; what the roll-back
            // could not undo is logged (and left to `detach`/`gc`).
            if made.nft {
                if let Err(undo) = self.apply_rules(&locked, "roll back published ports") {
                    tracing::warn!(
                        box_id = id,
                        "attach failed ({e}); restoring the NAT table failed: {undo}"
                    );
                }
            }
            if let Err(undo) = locked.save() {
                tracing::warn!(
                    box_id = id,
                    "attach failed ({e}); saving the rolled-back state failed: {undo}"
                );
            }
            return Err(e);
        }
        Ok(self.attachment_of(id, locked.state.boxes.get(id).unwrap_or(&entry), &record))
    }

    #[allow(clippy::too_many_arguments)]
    fn attach_steps(
        &self,
        nl: &mut Netlink,
        locked: &mut Locked,
        lease: &Lease,
        netns: BorrowedFd<'_>,
        record: &AttachRecord,
        infra: &Infra,
        link_rate: Rate,
        made: &mut Made,
    ) -> Result<()> {
        let (bridge, ifb) = (infra.bridge, infra.ifb);
        let veth = record.host_veth.as_str();
        // Remove a stale host veth left by a crash (ours by its name).
        link::delete(nl, veth)?;
        let mac = Some(link::box_mac(lease.address));
        let vidx = link::create_veth(nl, veth, Some(bridge), BOX_IFNAME, netns, mac).map_err(
            |e| match e {
                NetError::Netlink { ref source, .. }
                    if source.raw_os_error() == Some(libc::EXFULL) =>
                {
                    NetError::BridgeFull {
                        network: self.config.name.clone(),
                        bridge: self.config.bridge.clone(),
                    }
                }
                e => e,
            },
        )?;
        made.veth = Some(veth.to_string());
        // Before the box's end is up (the pair has no carrier until then, so
        // no link-local address has been made yet).
        link::disable_ipv6(veth)?;

        let (address, prefix, gateway) = (lease.address, lease.prefix, lease.gateway);
        // Inside a nest box (a user namespace) there is no BPF: no shortcut,
        // and the guard is nftables rules (`crate::nft::Guards`).
        let nested = netns::in_user_namespace();
        let configure = |inner: &mut Netlink| -> Result<[u8; 6]> {
            let missing = |what: &str| NetError::Netlink {
                what: format!("get link {BOX_IFNAME} in the box ({what})"),
                source: std::io::Error::from_raw_os_error(libc::ENODEV),
                detail: None,
            };
            let (idx, mac) =
                link::index_and_mac(inner, BOX_IFNAME)?.ok_or_else(|| missing("no such link"))?;
            let mac = mac.ok_or_else(|| missing("no MAC address"))?;
            addr::add(inner, idx, BOX_IFNAME, address, prefix)?;
            link::set_up(inner, idx, BOX_IFNAME)?;
            route::add_default(inner, gateway, idx, BOX_IFNAME)?;
            Ok(mac)
        };
        let box_mac = if nested {
            configure(&mut netns::netlink_in(netns)?)?
        } else {
            netns::run_in(netns, || configure(&mut Netlink::open()?))?
        };

        // Egress: the box's class in the tree on the IFB, and the redirect of
        // what it sends there (see `redirects`).
        let ifb_name = self.config.ifb();
        let ceil = record.rate.map_or(link_rate, |r| r.min(link_rate));
        let rate = record
            .reserve
            .unwrap_or_else(|| Rate::from_bits(MIN_CLASS_RATE).unwrap_or(Rate::MIN))
            .min(ceil);
        let class = HtbClass {
            rate,
            ceil,
            quantum: record.share * QUANTUM_PER_SHARE,
        };
        // A filter and class left by a crashed attach of a box with this address.
        let offset = self.config.subnet.offset(lease.address);
        let parent = tc::handle(HTB_MAJOR, 0);
        let fh = filter_handle(lease.address, offset);
        tc::del_u32_filter(nl, ifb, &ifb_name, parent, FILTER_PRIO, fh)?;
        tc::del_class(nl, ifb, &ifb_name, record.class)?;
        tc::set_htb_class(
            nl,
            ifb,
            &ifb_name,
            tc::handle(HTB_MAJOR, 1),
            record.class,
            &class,
            false,
        )?;
        made.class = Some((ifb, record.class));
        tc::add_source_filter(
            nl,
            ifb,
            &ifb_name,
            parent,
            FILTER_PRIO,
            HASH_TABLE,
            filter_node(offset),
            lease.address,
            record.class,
        )?;
        made.filter = Some((ifb, fh));
        tc::add_ingress_qdisc(nl, vidx, veth)?;
        // The box-to-box shortcut (see `redirects`): other boxes reach this one
        // through the map; an uncapped box reaches them through its program.
        // Where BPF is not available or not permitted (a kernel without it, a
        // nested nestbox in a user namespace), traffic takes the bridge.
        let uncapped = record.rate.is_none();
        let map = if nested {
            None
        } else if uncapped {
            unsupported_is_none(self.shortcut_map(nl, locked))?
        } else {
            self.existing_shortcut_map()?
        };
        if let Some(map) = &map {
            let target = bpf::Target {
                ifindex: vidx,
                peer: record.ingress_rate.is_none(),
            };
            bpf::map_set(map.as_fd(), lease.address, target)?;
            made.shortcut = Some(lease.address);
        }
        // The guard (only the box's own MAC and address leave its veth), then
        // the shortcut for an uncapped box: one program, first on the ingress.
        // The policy as saved now (under the lock): it may have changed since
        // this handle was opened, while the network had no box.
        let isolated = crate::config::NetworkConfig::load(&self.config.state_dir)?
            .map_or(self.config.isolated, |c| c.isolated);
        let g = guard::Guard {
            mac: box_mac,
            addr: lease.address,
            isolated: isolated.then_some(guard::Isolation {
                subnet: self.config.subnet,
            }),
        };
        let code = guard::program(&g, map.as_ref().filter(|_| uncapped).map(|m| m.as_fd()));
        let name = bpf::object_name(&self.config.bridge);
        let guarded = nested
            || match unsupported_is_none(bpf::load_program(&code, &name))? {
                Some(prog) => unsupported_is_none(tc::add_bpf_filter(
                    nl,
                    vidx,
                    veth,
                    GUARD_PRIO,
                    prog.as_fd(),
                    &name,
                ))?
                .is_some(),
                None => false,
            };
        if !guarded {
            tracing::warn!(
                box_id = lease.box_id.as_str(),
                "BPF is not available here: the box's source addresses are not checked (it can spoof)"
            );
        }
        for what in redirects(record, infra.bridge_mac) {
            tc::add_redirect_filter(nl, vidx, veth, REDIRECT_PRIO, what, ifb)?;
        }

        // Ingress cap: HTB on the host side's egress, i.e. towards the box.
        if let Some(cap) = record.ingress_rate {
            tc::add_htb_qdisc(nl, vidx, veth, HTB_MAJOR, 1)?;
            let c = HtbClass {
                rate: cap,
                ceil: cap,
                quantum: quantum_for(cap),
            };
            tc::set_htb_class(
                nl,
                vidx,
                veth,
                tc::handle(HTB_MAJOR, 0),
                tc::handle(HTB_MAJOR, 1),
                &c,
                false,
            )?;
        }

        if nested {
            // The guard's rules name the box's MAC: recorded, then written
            // with the other tables below.
            let mac = box_mac.map(|b| format!("{b:02x}")).join(":");
            if let Some(a) = locked
                .state
                .boxes
                .get_mut(lease.box_id.as_str())
                .and_then(|e| e.attachment.as_mut())
            {
                a.nft_guard = Some(mac);
            }
            locked.save()?;
        }
        if record.has_rules() || nested {
            made.nft = true;
            self.apply_rules(locked, "publish ports and allow host ports")?;
        }
        Ok(())
    }

    /// Undo what a failed attach of `box_id` made, in reverse. Best effort:
    /// the attach's error is the one reported, and what cannot be undone is
    /// logged; it keeps an owner in the state (the record is restored only
    /// after this), so `gc` removes it later.
    fn undo(&self, nl: &mut Netlink, box_id: &str, made: &Made) {
        let warn = |what: &str, e: NetError| {
            tracing::warn!(box_id, "rolling back a failed attach: {what}: {e}");
        };
        if let Some(addr) = made.shortcut {
            match self.existing_shortcut_map() {
                Ok(Some(map)) => {
                    if let Err(e) = bpf::map_remove(map.as_fd(), addr) {
                        warn("remove the shortcut entry", e);
                    }
                }
                Ok(None) => {}
                Err(e) => warn("open the shortcut map", e),
            }
        }
        if let Some(v) = &made.veth {
            if let Err(e) = link::delete(nl, v) {
                warn("delete the veth", e);
            }
        }
        if let Some((ifb, fh)) = made.filter {
            let ifb_name = self.config.ifb();
            if let Err(e) = tc::del_u32_filter(
                nl,
                ifb,
                &ifb_name,
                tc::handle(HTB_MAJOR, 0),
                FILTER_PRIO,
                fh,
            ) {
                warn("delete the egress filter", e);
            }
        }
        if let Some((ifb, class)) = made.class {
            if let Err(e) = tc::del_class(nl, ifb, &self.config.ifb(), class) {
                warn("delete the egress class", e);
            }
        }
    }

    pub(super) fn attachment_of(&self, id: &str, e: &BoxEntry, a: &AttachRecord) -> Attachment {
        Attachment {
            lease: self.lease_of(id, e),
            bridge: self.config.bridge.clone(),
            host_veth: a.host_veth.clone(),
            class: tc::handle_str(a.class),
            publish: a.publish.clone(),
            rate: a.rate,
            reserve: a.reserve,
            share: a.share,
            ingress_rate: a.ingress_rate,
            allow_host_ports: a.allow_host.clone(),
            egress: a.egress.clone(),
        }
    }

    /// Remove what box `id` has in the network (veth, class, published
    /// ports) from the host; the caller removes the entry and saves.
    pub(super) fn teardown(
        &self,
        nl: &mut Netlink,
        id: &str,
        entry: Option<&BoxEntry>,
        delete_link: bool,
    ) -> Result<bool> {
        let veth = entry
            .and_then(|e| e.attachment.as_ref())
            .map(|a| a.host_veth.clone())
            .unwrap_or_else(|| host_veth_name(&self.config.bridge, id));
        // Other boxes' shortcut to it first: the veth's index is about to be free.
        if let Some(e) = entry.filter(|e| e.attachment.is_some()) {
            if let Some(map) = self.existing_shortcut_map()? {
                bpf::map_remove(map.as_fd(), e.address)?;
            }
        }
        // Deleting the host side deletes the peer and the veth's qdiscs and filters.
        let mut removed = delete_link && link::delete(nl, &veth)?;
        if let Some(e) = entry {
            let offset = self.config.subnet.offset(e.address);
            let class = tc::handle(HTB_MAJOR, offset as u16);
            let ifb_name = self.config.ifb();
            if let Some(ifb) = link::index(nl, &ifb_name)? {
                // The filter first: a class a filter points to cannot be deleted.
                let fh = filter_handle(e.address, offset);
                let parent = tc::handle(HTB_MAJOR, 0);
                removed |= tc::del_u32_filter(nl, ifb, &ifb_name, parent, FILTER_PRIO, fh)?;
                removed |= tc::del_class(nl, ifb, &ifb_name, class)?;
            }
        }
        Ok(removed || entry.is_some())
    }

    /// Detach box `box_id` and release its address: remove its veth pair, its
    /// class, its published ports and its hosts entry. Idempotent: returns
    /// whether there was anything to remove.
    pub fn detach(&self, box_id: &str) -> Result<bool> {
        self.detach_inner(box_id, true)
            .map_err(|e| e.for_box(box_id))
    }

    /// [`Network::detach`] for a box whose network namespace is already gone
    /// (its last process exited): the kernel destroys the veth pair with the
    /// namespace, in the background, so it is not deleted here (deleting it
    /// waits for the kernel's unregistration, tens of milliseconds).
    pub fn detach_exited(&self, box_id: &str) -> Result<bool> {
        self.detach_inner(box_id, false)
            .map_err(|e| e.for_box(box_id))
    }

    fn detach_inner(&self, box_id: &str, delete_link: bool) -> Result<bool> {
        // A network removed meanwhile (`destroy`) took the box's things with it.
        let Some(mut locked) = state::lock_existing(&self.config.state_dir)? else {
            return Ok(false);
        };
        let entry = locked.state.boxes.get(box_id).cloned();
        let mut nl = Netlink::open()?;
        let removed = self.teardown(&mut nl, box_id, entry.as_ref(), delete_link)?;
        if let Some(e) = &entry {
            locked.state.boxes.remove(box_id);
            if e.attachment.as_ref().is_some_and(AttachRecord::has_rules) {
                self.apply_rules(&locked, "unpublish ports and host ports")?;
            }
            locked.save()?;
            self.write_hosts(&locked)?;
        }
        Ok(removed)
    }

    /// Every attached box.
    pub fn attachments(&self) -> Result<Vec<Attachment>> {
        let s = state::read(&self.config.state_dir.join("state.json"))?;
        Ok(s.boxes
            .iter()
            .filter_map(|(id, e)| e.attachment.as_ref().map(|a| self.attachment_of(id, e, a)))
            .collect())
    }
}
