//! A box network: [`Network`], its public types and opening it. What a
//! network does is in one module per concept, each adding to `impl Network`;
//! they import one way, from the top of this list to the bottom:
//!
//! - [`hosts`]: the network-wide hosts file and the boxes' resolv.conf;
//! - `lease`: handing out, renaming and moving addresses;
//! - `shortcut`: upkeep of the box-to-box BPF map;
//! - `bridge`: the network's shared devices (bridge, IFB shaping tree, NAT
//!   table), made on demand and removed with the network; its rules;
//! - `create`: making a user-defined network on the host at once;
//! - `attach`: attaching a box's namespace (veth pair, address, route, egress
//!   class and redirects, shortcut, ingress cap, published ports), rolled back
//!   on failure, and detaching it;
//! - `gc`: removing what dead boxes left, and the whole network.

mod attach;
mod bridge;
mod create;
mod gc;
pub mod hosts;
mod lease;
mod shortcut;

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::addr;
use crate::config::NetworkConfig;
use crate::egress::Egress;
use crate::error::{NetError, Result};
use crate::link;
use crate::netlink::{is_errno, Netlink};
use crate::port::{HostPort, PortMapping};
use crate::rate::Rate;
use crate::state;

pub use bridge::{ResolvedNames, DEFAULT_CLASS_MINOR};

/// Default share weight of a box (`--net-share`).
pub const DEFAULT_SHARE: u32 = 100;
/// Largest share weight.
pub const MAX_SHARE: u32 = 1000;
/// Name of the box side of the veth pair.
pub const BOX_IFNAME: &str = "eth0";

/// A box's address in the network, handed out before the box exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lease {
    /// The box.
    pub box_id: String,
    /// Names the box is known by in the hosts file.
    pub names: Vec<String>,
    /// Its address.
    pub address: Ipv4Addr,
    /// Prefix length of the subnet.
    pub prefix: u8,
    /// The gateway (the bridge's address).
    pub gateway: Ipv4Addr,
}

/// How a box is attached: published ports and bandwidth.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AttachOptions {
    /// Host ports forwarded to the box.
    pub publish: Vec<PortMapping>,
    /// Hard cap of the box's egress (`--net-rate`); at most the link rate.
    pub rate: Option<Rate>,
    /// Guaranteed egress (`--net-reserve`).
    pub reserve: Option<Rate>,
    /// Weight of the box in dividing what is left of the link rate
    /// (`--net-share`, 1-1000, default 100).
    pub share: Option<u32>,
    /// Cap of the box's ingress.
    pub ingress_rate: Option<Rate>,
    /// Host ports the box may open connections to, on the gateway's address
    /// (`--allow-host-port`); every other connection to the host is refused.
    pub allow_host: Vec<HostPort>,
    /// Where beyond the network the box may send (`--egress`).
    pub egress: Egress,
}

/// A box attached to the network: what `nestbox network inspect` shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Attachment {
    /// The lease.
    #[serde(flatten)]
    pub lease: Lease,
    /// The network's bridge.
    pub bridge: String,
    /// Host side of the box's veth pair.
    pub host_veth: String,
    /// The box's egress class on the IFB device (`1:N`).
    pub class: String,
    /// Published ports.
    pub publish: Vec<PortMapping>,
    /// Egress cap.
    pub rate: Option<Rate>,
    /// Egress reservation.
    pub reserve: Option<Rate>,
    /// Share weight.
    pub share: u32,
    /// Ingress cap.
    pub ingress_rate: Option<Rate>,
    /// Host ports the box may reach on the gateway (all others are refused).
    pub allow_host_ports: Vec<HostPort>,
    /// Egress policy.
    pub egress: Egress,
}

/// An open network.
#[derive(Debug)]
pub struct Network {
    config: NetworkConfig,
}

/// Every network saved under `root` (one directory per network).
pub fn list_networks(root: &Path) -> Result<Vec<NetworkConfig>> {
    let entries = match fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NetError::io("read directory", root, e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|e| NetError::io("read directory", root, e))?;
        if let Some(c) = NetworkConfig::load(&e.path())? {
            out.push(c);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Name of the host side of the veth of box `box_id` on `bridge`: `nbv` and 12
/// hex digits of a hash of both (unique on the host, at most 15 characters).
pub fn host_veth_name(bridge: &str, box_id: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bridge.bytes().chain([b'/']).chain(box_id.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("nbv{:012x}", h & 0xffff_ffff_ffff)
}

impl Network {
    /// Open the network `config` describes: validate it and save it under its
    /// state directory. Nothing is created on the host until the first attach.
    /// Fails if the bridge exists without the network's gateway address (it
    /// belongs to someone else) or if the saved configuration has boxes and a
    /// different bridge or subnet.
    pub fn open(config: NetworkConfig) -> Result<Network> {
        config.validate()?;
        // Under the state lock: `ensure_infra` holds it while it creates the
        // bridge and then gives it the gateway address, so a bridge seen here
        // without its address is never one of ours half-made.
        let held = state::hold(&config.state_dir)?;
        if let Some(saved) = NetworkConfig::load(&config.state_dir)? {
            if saved != config {
                let boxes = held.state()?.boxes;
                if !boxes.is_empty()
                    && (saved.bridge != config.bridge || saved.subnet != config.subnet)
                {
                    return Err(NetError::Conflict(format!(
                        "network {} has boxes on bridge {} subnet {}: cannot change them",
                        saved.name, saved.bridge, saved.subnet
                    )));
                }
                if saved.isolated != config.isolated && !boxes.is_empty() {
                    return Err(NetError::Conflict(format!(
                        "network {} has {} box(es) (the pool's namespaces count): its policy cannot change while boxes are on it",
                        saved.name,
                        boxes.len()
                    )));
                }
                config.save()?;
            }
        } else {
            config.save()?;
        }
        let net = Network { config };
        let mut nl = Netlink::open()?;
        if let Some(idx) = link::index(&mut nl, &net.config.bridge)? {
            let gw = net.config.subnet.gateway();
            if !addr::list(&mut nl, idx)?.iter().any(|(a, _)| *a == gw) {
                return Err(NetError::Conflict(format!(
                    "bridge {} exists but does not carry {gw}: it belongs to another network",
                    net.config.bridge
                )));
            }
        }
        drop(held);
        Ok(net)
    }

    /// The network's state, locked; [`NetError::NoNetwork`] if it was
    /// removed (also while this waited for the lock).
    fn lock_existing(&self) -> Result<state::Locked> {
        state::lock_existing(&self.config.state_dir)?
            .ok_or_else(|| NetError::NoNetwork(self.config.name.clone()))
    }

    /// A handle for reading the network's state only (leases, attachments,
    /// paths): no validation, nothing saved, no netlink.
    pub fn view(config: NetworkConfig) -> Network {
        Network { config }
    }

    /// The configuration.
    pub fn config(&self) -> &NetworkConfig {
        &self.config
    }

    /// The network-wide hosts file (every box by name), to bind-mount read-only
    /// at `/etc/hosts`. It is rewritten in place on every allocate and detach.
    pub fn hosts_path(&self) -> PathBuf {
        self.config.state_dir.join("hosts")
    }

    /// The resolv.conf for the boxes, to bind-mount read-only at `/etc/resolv.conf`.
    pub fn resolv_path(&self) -> PathBuf {
        self.config.state_dir.join("resolv.conf")
    }
}

/// Whether an error means "no such device" (for callers probing links).
pub fn is_no_device(e: &NetError) -> bool {
    is_errno(e, libc::ENODEV)
}
