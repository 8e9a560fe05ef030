//! The configuration of one box network: its name, bridge, subnet, link
//! rate and policies, kept as `config.json` in the network's state directory.
//! A root has its default network and any number of user-defined ones
//! ([`NetworkConfig::user_in`], `nestbox network create`).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::egress::Egress;
use crate::error::{NetError, Result};
use crate::rate::Rate;
use crate::subnet::Subnet;

/// Name of the default network.
pub const DEFAULT_NETWORK: &str = "default";
/// Bridge of the default network.
pub const DEFAULT_BRIDGE: &str = "nbx0";
/// Link rate of the default network (100gbit): the parent class every box's
/// egress class borrows from. High enough not to slow box-to-box traffic on a
/// fast machine; set it to the real uplink rate for shares to divide it.
pub const DEFAULT_LINK_RATE: u64 = 100_000_000_000;
/// Subnets tried in order for a new default network; the first that overlaps
/// neither a host route nor another network of the same root is taken.
const CANDIDATES: &[&str] = &[
    "10.88.0.0/16",
    "10.89.0.0/16",
    "10.90.0.0/16",
    "10.91.0.0/16",
    "172.30.0.0/16",
    "172.29.0.0/16",
    "192.168.232.0/22",
];

/// Names that are not network names: `--network` takes them as modes.
const RESERVED: &[&str] = &["default", "bridge", "none", "host"];

/// FNV-1a of `a`, `/` and `b`.
fn fnv(a: &[u8], b: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in a.iter().chain(b"/").chain(b) {
        h ^= u64::from(*x);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The first of `candidates` that overlaps no host route and no network
/// under `root`.
fn free_subnet(root: &Path, candidates: &[Subnet]) -> Result<Option<Subnet>> {
    let routes = {
        let mut nl = crate::netlink::Netlink::open()?;
        crate::route::list_main(&mut nl)?
    };
    let others: Vec<Subnet> = crate::network::list_networks(root)?
        .into_iter()
        .map(|c| c.subnet)
        .collect();
    Ok(candidates.iter().copied().find(|s| {
        !routes
            .iter()
            .any(|r| r.prefix > 0 && Subnet::new(r.dst, r.prefix).is_ok_and(|rs| rs.overlaps(s)))
            && !others.iter().any(|o| o.overlaps(s))
    }))
}

/// Why `subnet` cannot be a new network's under `root`: it overlaps another
/// network of the root or a host route.
fn clash(root: &Path, subnet: Subnet) -> Result<Option<NetError>> {
    for o in crate::network::list_networks(root)? {
        if o.subnet.overlaps(&subnet) {
            return Ok(Some(NetError::Conflict(format!(
                "subnet {subnet} overlaps network {:?} ({}): choose another subnet",
                o.name, o.subnet
            ))));
        }
    }
    let mut nl = crate::netlink::Netlink::open()?;
    let links = crate::link::list(&mut nl)?;
    for r in crate::route::list_main(&mut nl)? {
        if r.prefix == 0 {
            continue;
        }
        if let Ok(rs) = Subnet::new(r.dst, r.prefix) {
            if rs.overlaps(&subnet) {
                return Ok(Some(NetError::SubnetOverlap {
                    subnet: subnet.to_string(),
                    route: rs.to_string(),
                    dev: links
                        .iter()
                        .find(|l| Some(l.index) == r.oif)
                        .map(|l| l.name.clone())
                        .unwrap_or_else(|| "?".into()),
                }));
            }
        }
    }
    Ok(None)
}

/// Configuration of one network.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetworkConfig {
    /// Network name (the name of its state directory under the root).
    pub name: String,
    /// Bridge interface on the host (at most 12 characters: the IFB device is
    /// named after it with `ifb` appended).
    pub bridge: String,
    /// Addresses of the boxes; the first host address is the gateway on the bridge.
    pub subnet: Subnet,
    /// Rate of the parent class of the egress tree: what all boxes together may
    /// send, and what shares divide.
    pub link_rate: Rate,
    /// Turn on the host's global IPv4 forwarding (`net.ipv4.ip_forward`) when the
    /// bridge is created, as outbound traffic and published ports reached from
    /// other machines need. Forwarding on the bridge itself is always on.
    #[serde(default = "yes")]
    pub ip_forward: bool,
    /// The isolated policy: a box reaches only the gateway (the host's allowed
    /// ports and published ports, and beyond the network through it), never
    /// another box directly. Off (open: boxes reach each other) by default.
    /// Can change only while no box is attached (each box's guard program
    /// carries it).
    #[serde(default)]
    pub isolated: bool,
    /// Egress policy of every box of the network (`network create
    /// --egress`): a connection leaving the network must pass it, and the
    /// box's own policy too. Allow-all by default.
    #[serde(default, skip_serializing_if = "Egress::is_allow_all")]
    pub egress: Egress,
    /// Where the network keeps its state (not serialized: it is where the file is).
    #[serde(skip)]
    pub state_dir: PathBuf,
}

fn yes() -> bool {
    true
}

impl NetworkConfig {
    /// A configuration with the default link rate and forwarding on.
    pub fn new(name: &str, bridge: &str, subnet: Subnet, state_dir: PathBuf) -> NetworkConfig {
        NetworkConfig {
            name: name.to_string(),
            bridge: bridge.to_string(),
            subnet,
            link_rate: Rate::from_bits(DEFAULT_LINK_RATE).unwrap_or(Rate::MIN),
            ip_forward: true,
            isolated: false,
            egress: Egress::AllowAll,
            state_dir,
        }
    }

    /// The default network under `root` (`root/default`): its saved
    /// configuration if there is one, else bridge `nbx0` on the first candidate
    /// subnet that overlaps no host route and no other network under `root`.
    pub fn default_in(root: &Path) -> Result<NetworkConfig> {
        let candidates: Vec<Subnet> = CANDIDATES
            .iter()
            .map(|c| Subnet::parse(c))
            .collect::<Result<_>>()?;
        NetworkConfig::default_with(root, DEFAULT_BRIDGE, &candidates)
    }

    /// The default network of a private root (a test's, a nested nestbox's):
    /// bridge `bridge`, and a /24 of 10.192.0.0/10 chosen from `seed` (then the
    /// next ones) that overlaps no host route and no other network under `root`,
    /// so roots that exist side by side get distinct bridges and subnets.
    pub fn private_in(root: &Path, bridge: &str, seed: u32) -> Result<NetworkConfig> {
        let candidates: Vec<Subnet> = (0..64u32)
            .map(|i| {
                let idx = seed.wrapping_add(i) % 16384;
                let addr =
                    std::net::Ipv4Addr::new(10, 192 + (idx / 256) as u8, (idx % 256) as u8, 0);
                Subnet::new(addr, 24)
            })
            .collect::<Result<_>>()?;
        NetworkConfig::default_with(root, bridge, &candidates)
    }

    fn default_with(root: &Path, bridge: &str, candidates: &[Subnet]) -> Result<NetworkConfig> {
        let dir = root.join(DEFAULT_NETWORK);
        if let Some(c) = NetworkConfig::load(&dir)? {
            return Ok(c);
        }
        let s = free_subnet(root, candidates)?.ok_or_else(|| NetError::NoFreeSubnet {
            tried: candidates.len(),
            first: candidates
                .first()
                .map(|c| c.to_string())
                .unwrap_or_default(),
        })?;
        Ok(NetworkConfig::new(DEFAULT_NETWORK, bridge, s, dir))
    }

    /// A new user-defined network `name` under `root` (`nestbox network
    /// create`): bridge `nbu` + 8 hex digits of a hash of the root and the
    /// name, and `subnet`, or else a /24 of 10.64.0.0/10 chosen from that hash
    /// (then the next ones) that overlaps no host route and no other network
    /// under `root`. A given subnet is refused if it overlaps one of those.
    /// Nothing is saved: [`crate::Network::create`] does that. The name must
    /// be new under `root` and is not one of the modes of `--network`.
    pub fn user_in(root: &Path, name: &str, subnet: Option<Subnet>) -> Result<NetworkConfig> {
        if RESERVED.contains(&name) {
            return Err(NetError::Invalid(format!(
                "network name {name:?} is reserved (default, bridge, none and host name the modes of --network)"
            )));
        }
        let h = fnv(root.to_string_lossy().as_bytes(), name.as_bytes());
        let bridge = format!("nbu{:08x}", h as u32);
        let dir = root.join(name);
        // Validated before anything is looked up.
        let placeholder = Subnet::parse("10.64.0.0/24")?;
        NetworkConfig::new(name, &bridge, subnet.unwrap_or(placeholder), dir.clone()).validate()?;
        if NetworkConfig::load(&dir)?.is_some() {
            return Err(NetError::Conflict(format!(
                "network {name:?} already exists"
            )));
        }
        let subnet = match subnet {
            Some(s) => {
                if let Some(clash) = clash(root, s)? {
                    return Err(clash);
                }
                s
            }
            None => {
                let candidates: Vec<Subnet> = (0..256u32)
                    .map(|i| {
                        let idx = (h as u32).wrapping_add(i) % 16384;
                        let addr = std::net::Ipv4Addr::new(
                            10,
                            64 + (idx / 256) as u8,
                            (idx % 256) as u8,
                            0,
                        );
                        Subnet::new(addr, 24)
                    })
                    .collect::<Result<_>>()?;
                free_subnet(root, &candidates)?.ok_or_else(|| {
                    NetError::Conflict(format!(
                        "no free subnet for network {name:?} (tried {} candidates from {}): give one with --subnet",
                        candidates.len(),
                        candidates[0]
                    ))
                })?
            }
        };
        Ok(NetworkConfig::new(name, &bridge, subnet, dir))
    }

    /// The IFB device carrying the egress tree.
    pub fn ifb(&self) -> String {
        format!("{}ifb", self.bridge)
    }

    /// Check names and subnet.
    pub fn validate(&self) -> Result<()> {
        let ok_name = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.')
        };
        if !ok_name(&self.name) || self.name.starts_with('.') {
            return Err(NetError::Invalid(format!(
                "invalid network name {:?}: use letters, digits, '-', '_' and '.'",
                self.name
            )));
        }
        if !ok_name(&self.bridge) || self.bridge.len() > 12 || self.bridge.contains('.') {
            return Err(NetError::Invalid(format!(
                "invalid bridge name {:?}: 1-12 letters, digits, '-' or '_'",
                self.bridge
            )));
        }
        self.subnet.check_usable()
    }

    /// Load `state_dir/config.json`, if it exists.
    pub fn load(state_dir: &Path) -> Result<Option<NetworkConfig>> {
        let path = state_dir.join("config.json");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(NetError::io("read", path, e)),
        };
        let mut c: NetworkConfig = serde_json::from_str(&text).map_err(|e| NetError::State {
            path: path.clone(),
            message: e.to_string(),
        })?;
        c.state_dir = state_dir.to_path_buf();
        Ok(Some(c))
    }

    /// Save to `state_dir/config.json` (atomically).
    pub fn save(&self) -> Result<()> {
        fs::create_dir_all(&self.state_dir)
            .map_err(|e| NetError::io("create", &self.state_dir, e))?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| NetError::State {
            path: self.state_dir.join("config.json"),
            message: e.to_string(),
        })?;
        crate::state::write_atomic(&self.state_dir.join("config.json"), &json)
    }
}
