//! `nestbox network create|ls|inspect|rm|refresh|policy|pool`: the box
//! networks of this root (the default one and user-defined ones; their state
//! lives under `<lib>/network/<name>/`), the boxes attached to them, the
//! egress policies' host names, and the pool of network namespaces kept
//! ready for new boxes of the default network.

use anyhow::{bail, Result};
use clap::Subcommand;
use nestbox_net::{list_networks, Egress, Network, NetworkConfig, Subnet};
use nestbox_runtime::network_pool as pool;
use nestbox_runtime::registry::Registry;
use serde_json::{json, Value};

/// `nestbox network ...`
#[derive(Debug, Subcommand)]
pub enum NetworkCommand {
    /// List networks: name, bridge, subnet, link rate, boxes.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a network (configuration, files, boxes) or a box's address and
    /// attachment, as JSON.
    Inspect {
        /// A network name, or a box id or name.
        name: String,
    },
    /// Make a network of its own (bridge, IFB device, nftables tables) for
    /// boxes started or cloned with `--network NAME`. Boxes of different
    /// networks reach each other only through published ports.
    Create {
        /// The network's name.
        name: String,
        /// Its subnet, e.g. 10.70.1.0/24 (default: a free /24 of 10.64.0.0/10).
        #[arg(long, value_name = "CIDR")]
        subnet: Option<String>,
        /// Each box reaches only the gateway (the host's allowed ports,
        /// published ports, and beyond the network), never another box.
        #[arg(long)]
        isolated: bool,
        /// Where beyond the network its boxes may open connections: allow-all
        /// (the default), deny-all, or ADDRESS[/PREFIX][:PORT] and
        /// HOSTNAME[:PORT] entries, comma-separated; a box's own --egress
        /// applies too.
        #[arg(long, value_name = "POLICY")]
        egress: Option<String>,
    },
    /// Remove a network from the host (bridge, IFB device, nftables tables,
    /// state); refused while boxes hold addresses on it. Without a name, the
    /// default network (made again on the next bridged box).
    Rm {
        /// A network made by `network create` (default: the default network).
        name: Option<String>,
    },
    /// Resolve the host names of the egress policies again (of one network,
    /// or of all) and rewrite the rules where a name's addresses changed.
    Refresh {
        /// Keep running, refreshing every SECONDS (until SIGTERM or SIGINT):
        /// a line is printed for a network whose names moved.
        #[arg(long, value_name = "SECONDS")]
        every: Option<u64>,
        /// The network (default: all).
        name: Option<String>,
    },
    /// Show or set the default network's policy: open (boxes reach each
    /// other) or isolated (a box reaches only the gateway: the host's allowed
    /// ports, published ports, and beyond the network). It can change only
    /// while no box (and no pooled namespace) is on the network.
    Policy {
        /// open or isolated.
        policy: Option<String>,
    },
    /// Show or set how many network namespaces (veth, address, class) the
    /// default network keeps ready for new boxes; setting it fills the pool now.
    Pool {
        /// The new size (0 turns the pool off).
        size: Option<usize>,
    },
}

/// Run a `network` subcommand.
pub fn network(reg: &Registry, cmd: NetworkCommand) -> Result<i32> {
    let root = reg.roots().lib.join("network");
    let roots = reg.roots();
    match cmd {
        NetworkCommand::Ls { json } => ls(reg, &root, json),
        NetworkCommand::Inspect { name } => inspect(reg, &root, &name),
        NetworkCommand::Pool { size } => {
            if let Some(n) = size {
                pool::set_size(roots, n)?;
                if n > 0 {
                    // The pool belongs to the default network: make it if needed.
                    nestbox_runtime::network::open(roots)?;
                    pool::fill(roots)?;
                }
            }
            println!(
                "pool size {}, {} ready",
                pool::size(roots),
                pool::ready_count(roots)
            );
            Ok(0)
        }
        NetworkCommand::Policy { policy } => {
            if policy.is_some() {
                // A shell's guard carries the policy it was made under.
                nestbox_runtime::shell::drain_network(reg, None)?;
            }
            let net = match policy.as_deref() {
                None => nestbox_runtime::network::open(roots)?,
                Some("open") => nestbox_runtime::network::set_isolated(roots, false)?,
                Some("isolated") => nestbox_runtime::network::set_isolated(roots, true)?,
                Some(other) => bail!("unknown network policy {other:?} (use open or isolated)"),
            };
            println!("policy {}", policy_name(net.config()));
            Ok(0)
        }
        NetworkCommand::Create {
            name,
            subnet,
            isolated,
            egress,
        } => {
            let subnet = subnet.as_deref().map(Subnet::parse).transpose()?;
            let egress = egress
                .as_deref()
                .map(Egress::parse)
                .transpose()?
                .unwrap_or_default();
            let net = nestbox_runtime::network::create(roots, &name, subnet, isolated, egress)?;
            let c = net.config();
            println!(
                "network {} bridge {} subnet {} policy {} egress {}",
                c.name,
                c.bridge,
                c.subnet,
                policy_name(c),
                c.egress
            );
            Ok(0)
        }
        NetworkCommand::Rm { name } => {
            // Pooled box shells on the network hold addresses on it: they go
            // first (and their shapes with them).
            nestbox_runtime::shell::drain_network(reg, name.as_deref())?;
            if !nestbox_runtime::network::remove_named(reg.roots(), name.as_deref())? {
                println!("no network to remove");
            }
            Ok(0)
        }
        NetworkCommand::Refresh { name, every } => {
            let configs = list_networks(&root)?;
            if let Some(n) = &name {
                if !configs.iter().any(|c| &c.name == n) {
                    bail!(nestbox_net::NetError::UnknownNetwork(n.clone()));
                }
            }
            let Some(seconds) = every else {
                refresh_pass(&root, name.as_deref(), &mut None)?;
                return Ok(0);
            };
            if seconds == 0 {
                bail!("--every 0: give an interval of at least 1 second");
            }
            // Until killed: each pass prints the networks whose names moved.
            let mut last = Some(std::collections::BTreeMap::new());
            loop {
                // A network removed meanwhile, a resolver down: said, and the
                // next pass tries again.
                if let Err(e) = refresh_pass(&root, name.as_deref(), &mut last) {
                    eprintln!("nestbox: warning: network refresh: {e:#}");
                }
                std::thread::sleep(std::time::Duration::from_secs(seconds));
            }
        }
    }
}

/// One `network refresh` over the networks (or the one named): each prints
/// its names' addresses; with `last` (a watch), only those that moved since
/// the previous pass (a network made meanwhile is refreshed too).
fn refresh_pass(
    root: &std::path::Path,
    name: Option<&str>,
    last: &mut Option<std::collections::BTreeMap<String, String>>,
) -> Result<()> {
    for cfg in list_networks(root)? {
        if name.is_some_and(|n| n != cfg.name) {
            continue;
        }
        let names = serde_json::to_string(&Network::view(cfg.clone()).refresh()?)?;
        let moved = match last {
            Some(seen) => seen.insert(cfg.name.clone(), names.clone()).as_ref() != Some(&names),
            None => true,
        };
        if moved {
            println!("{} {names}", cfg.name);
        }
    }
    Ok(())
}

fn ls(reg: &Registry, root: &std::path::Path, as_json: bool) -> Result<i32> {
    let mut rows = Vec::new();
    let shells = nestbox_runtime::shell::ids(reg);
    for cfg in list_networks(root)? {
        let boxes = Network::view(cfg.clone())
            .leases()?
            .iter()
            .filter(|l| !pool::is_pool_id(&l.box_id) && !shells.contains(&l.box_id))
            .count();
        rows.push(json!({
            "name": cfg.name,
            "bridge": cfg.bridge,
            "subnet": cfg.subnet,
            "link_rate": cfg.link_rate,
            "boxes": boxes,
            "policy": policy_name(&cfg),
            "egress": cfg.egress.to_string(),
            "pool": if cfg.name == nestbox_net::config::DEFAULT_NETWORK { pool_json(reg) } else { json!({"size": 0, "ready": 0}) },
        }));
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(0);
    }
    println!(
        "{:<16} {:<14} {:<20} {:<12} {:<6} POOL",
        "NAME", "BRIDGE", "SUBNET", "LINK RATE", "BOXES"
    );
    for r in rows {
        let s = |k: &str| r[k].as_str().unwrap_or_default().to_string();
        println!(
            "{:<16} {:<14} {:<20} {:<12} {:<6} {}/{}",
            s("name"),
            s("bridge"),
            s("subnet"),
            s("link_rate"),
            r["boxes"],
            r["pool"]["ready"],
            r["pool"]["size"]
        );
    }
    Ok(0)
}

/// The box-to-box policy of a network.
fn policy_name(cfg: &NetworkConfig) -> &'static str {
    if cfg.isolated {
        "isolated"
    } else {
        "open"
    }
}

/// The pool of the root's default network: size and namespaces ready.
fn pool_json(reg: &Registry) -> Value {
    json!({
        "size": pool::size(reg.roots()),
        "ready": pool::ready_count(reg.roots()),
    })
}

fn network_json(reg: &Registry, net: &Network) -> Result<Value> {
    let cfg: &NetworkConfig = net.config();
    let attachments = net.attachments()?;
    let shells = nestbox_runtime::shell::ids(reg);
    let boxes: Vec<Value> = net
        .leases()?
        .into_iter()
        .filter(|l| !pool::is_pool_id(&l.box_id) && !shells.contains(&l.box_id))
        .map(|lease| {
            match attachments.iter().find(|a| a.lease.box_id == lease.box_id) {
                Some(a) => serde_json::to_value(a),
                None => serde_json::to_value(&lease),
            }
            .unwrap_or(Value::Null)
        })
        .collect();
    Ok(json!({
        "name": cfg.name,
        "bridge": cfg.bridge,
        "ifb": cfg.ifb(),
        "subnet": cfg.subnet,
        "gateway": cfg.subnet.gateway(),
        "link_rate": cfg.link_rate,
        "ip_forward": cfg.ip_forward,
        "policy": {
            "box_to_box": policy_name(cfg),
            "host": "refused but allowed host ports (per box) and published ports",
            "other_networks": "published ports only",
            "anti_spoofing": "own MAC and IPv4 address only (BPF guard)",
            "egress": cfg.egress.to_string(),
            "egress_boxes": "a box's own --egress applies too: see each box's egress",
        },
        "egress_names": net.resolved_names()?,
        "hosts_file": net.hosts_path(),
        "resolv_conf": net.resolv_path(),
        "boxes": boxes,
        "pool": if cfg.name == nestbox_net::config::DEFAULT_NETWORK { pool_json(reg) } else { json!({"size": 0, "ready": 0}) },
    }))
}

fn inspect(reg: &Registry, root: &std::path::Path, name: &str) -> Result<i32> {
    let networks = list_networks(root)?;
    if let Some(cfg) = networks.iter().find(|c| c.name == name) {
        let net = Network::view(cfg.clone());
        println!(
            "{}",
            serde_json::to_string_pretty(&network_json(reg, &net)?)?
        );
        return Ok(0);
    }
    // A box: by id, or by one of the names it was given.
    for cfg in networks {
        let net = Network::view(cfg.clone());
        let attachments = net.attachments()?;
        for lease in net.leases()? {
            if lease.box_id != name && !lease.names.iter().any(|n| n == name) {
                continue;
            }
            let mut v = match attachments.iter().find(|a| a.lease.box_id == lease.box_id) {
                Some(a) => serde_json::to_value(a)?,
                None => serde_json::to_value(&lease)?,
            };
            v["network"] = json!(cfg.name);
            println!("{}", serde_json::to_string_pretty(&v)?);
            return Ok(0);
        }
    }
    bail!("no network or box named {name}")
}
