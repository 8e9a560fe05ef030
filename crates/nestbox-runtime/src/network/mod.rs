//! A box's place on the network: the runtime's side of [`nestbox_net`]. Before
//! the box's first process exists its address is leased and the network's hosts
//! and resolver files are added to its mounts; once the process (and so its
//! network namespace) exists, the veth pair, address, routes, published ports and
//! bandwidth classes are set up; when the box ends, all of it is released.
//! [`pool`] holds network namespaces made and attached ahead of time.
//!
//! A root has its default network (made on the first bridged box) and the
//! user-defined networks made by `nestbox network create` ([`create`]); a box
//! whose spec names one (`--network NAME`) is put on it, and what it holds
//! there is found again by looking through the root's networks.
//!
//! This layer imports only the records (spec, paths, registry, process): the
//! life of a box and the templates build on it.

pub mod packets;
pub mod pool;

use std::os::fd::AsFd;
use std::path::PathBuf;

use nestbox_isolation::rootfs::Volume;
use nestbox_net::{AttachOptions, Egress, Lease, NetError, Network, NetworkConfig, Subnet};
use nix::unistd::Pid;

use crate::paths::Roots;
use crate::spec::{BoxSpec, NetworkMode};
use crate::Result;

/// Where the networks of a root keep their state.
pub fn state_dir(roots: &Roots) -> PathBuf {
    roots.lib.join("network")
}

/// The runtime state directory of the machine-wide root.
const SYSTEM_RUN_DIR: &str = "/run/nestbox";

/// Whether `roots` is the machine-wide root.
pub fn is_system_root(roots: &Roots) -> bool {
    roots.run == std::path::Path::new(SYSTEM_RUN_DIR)
}

/// The default network of `roots`. The machine-wide root's is bridge `nbx0` with
/// IP forwarding (for outbound NAT); any other root (`--root`: tests, nested
/// nestbox) gets a bridge and a /24 of its own, named after the root's tag, and
/// leaves the host's forwarding switch alone.
pub fn open(roots: &Roots) -> Result<Network> {
    let dir = state_dir(roots);
    // Boxes starting at the same time must agree on one configuration: the first
    // chooses (and saves) it under this lock, the others load it.
    let _guard = lock_root(roots)?;
    let config = if is_system_root(roots) {
        NetworkConfig::default_in(&dir)?
    } else {
        let tag = roots.tag();
        let seed = u32::from_str_radix(&tag, 16).unwrap_or(0);
        let mut c = NetworkConfig::private_in(&dir, &private_bridge(roots), seed)?;
        c.ip_forward = false;
        c
    };
    Ok(Network::open(config)?)
}

/// Take the root's network lock: networks are chosen and made under it, so
/// two at a time cannot take one name or one subnet.
fn lock_root(roots: &Roots) -> Result<nix::fcntl::Flock<std::fs::File>> {
    std::fs::create_dir_all(&roots.lib).map_err(crate::RuntimeError::io("mkdir", &roots.lib))?;
    let lock_path = roots.lib.join("network.lock");
    crate::state::lock_file(&lock_path, true)?.ok_or_else(|| {
        // A wait for the lock ends with it.
        crate::RuntimeError::Failed(format!("flock {}", lock_path.display()))
    })
}

/// Make the user-defined network `name` of `roots` on the host (`nestbox
/// network create`): its own bridge, IFB device and tables, on `subnet` or a
/// free /24, with the isolated policy if asked, and `egress` for all its
/// boxes. Forwarding is set as for the root's default network.
pub fn create(
    roots: &Roots,
    name: &str,
    subnet: Option<Subnet>,
    isolated: bool,
    egress: Egress,
) -> Result<Network> {
    let _guard = lock_root(roots)?;
    let mut config = NetworkConfig::user_in(&state_dir(roots), name, subnet)?;
    config.isolated = isolated;
    config.egress = egress;
    config.ip_forward = is_system_root(roots);
    Ok(Network::create(config)?)
}

/// The network `name` of `roots` (`None`, `default` or `bridge`: the
/// default network, made if needed); a user-defined one must exist.
pub fn open_named(roots: &Roots, name: Option<&str>) -> Result<Network> {
    match name {
        None | Some(nestbox_net::config::DEFAULT_NETWORK) | Some("bridge") => open(roots),
        Some(n) => {
            let config = NetworkConfig::load(&state_dir(roots).join(n))?.ok_or_else(|| {
                crate::RuntimeError::InvalidInput(format!(
                    "unknown --network {n:?}: no network of that name (make it with nestbox network create)"
                ))
            })?;
            Ok(Network::open(config)?)
        }
    }
}

/// Every network of `roots`, for bookkeeping only (no netlink).
pub fn views(roots: &Roots) -> Result<Vec<Network>> {
    Ok(nestbox_net::list_networks(&state_dir(roots))?
        .into_iter()
        .map(Network::view)
        .collect())
}

/// The network of `roots` on which box `box_id` holds an address, if any.
pub fn view_of_box(roots: &Roots, box_id: &str) -> Result<Option<Network>> {
    for net in views(roots)? {
        if net.leases()?.iter().any(|l| l.box_id == box_id) {
            return Ok(Some(net));
        }
    }
    Ok(None)
}

/// Remove the network `name` of `roots` (the default one for `None`,
/// `default` or `bridge`; see [`remove`]), refusing while a box holds an
/// address on it. A user-defined network that does not exist is an error.
pub fn remove_named(roots: &Roots, name: Option<&str>) -> Result<bool> {
    match name {
        None | Some(nestbox_net::config::DEFAULT_NETWORK) | Some("bridge") => remove(roots),
        Some(n) => {
            let _guard = lock_root(roots)?;
            let config = NetworkConfig::load(&state_dir(roots).join(n))?
                .ok_or_else(|| NetError::UnknownNetwork(n.to_string()))?;
            Network::view(config).destroy_unused(|_| false)?;
            Ok(true)
        }
    }
}

/// Set the policy of the default network of `roots`: isolated (a box reaches
/// only the gateway) or open (boxes reach each other). Refused while boxes,
/// the pool's namespaces included, are on the network (each box's guard
/// carries the policy).
pub fn set_isolated(roots: &Roots, isolated: bool) -> Result<Network> {
    let net = open(roots)?;
    if net.config().isolated == isolated {
        return Ok(net);
    }
    let mut config = net.config().clone();
    config.isolated = isolated;
    Ok(Network::open(config)?)
}

/// The existing default network of `roots`, for bookkeeping only (leases, names,
/// hosts file: no netlink); `None` if there is none yet.
pub fn view(roots: &Roots) -> Result<Option<Network>> {
    Ok(NetworkConfig::load(&state_dir(roots).join("default"))?.map(Network::view))
}

/// The existing network `name` of `roots` (the default one for `None`,
/// `default` or `bridge`), for bookkeeping only; `None` if there is none.
pub fn view_named(roots: &Roots, name: Option<&str>) -> Result<Option<Network>> {
    let dir = match name {
        None | Some(nestbox_net::config::DEFAULT_NETWORK) | Some("bridge") => "default",
        Some(n) => n,
    };
    Ok(NetworkConfig::load(&state_dir(roots).join(dir))?.map(Network::view))
}

/// Bridge name of a private root's network.
pub fn private_bridge(roots: &Roots) -> String {
    format!("nb{}", roots.tag())
}

/// Remove the default network of `roots` from the host (bridge, IFB, NAT table,
/// state), refusing while a box still holds an address on it. `false` when there
/// was none.
pub fn remove(roots: &Roots) -> Result<bool> {
    let Some(config) = NetworkConfig::load(&state_dir(roots).join("default"))? else {
        return Ok(false);
    };
    let net = Network::view(config);
    let leases: Vec<_> = net
        .leases()?
        .into_iter()
        .filter(|l| !crate::network_pool::is_pool_id(&l.box_id))
        .collect();
    if let Some(l) = leases.first() {
        return Err(crate::RuntimeError::NetworkInUse {
            network: net.config().name.clone(),
            count: leases.len(),
            box_id: l.box_id.clone(),
        });
    }
    // Checked again under the network's lock: a box given an address since stops it.
    crate::network_pool::remove_with(roots, || {
        Ok(net.destroy_unused(crate::network_pool::is_pool_id)?)
    })?;
    Ok(true)
}

/// `network`'s hosts and resolver files, read-only in a box.
pub fn volumes(network: &Network) -> Vec<Volume> {
    vec![
        Volume {
            source: network.hosts_path(),
            target: "/etc/hosts".into(),
            read_only: true,
        },
        Volume {
            source: network.resolv_path(),
            target: "/etc/resolv.conf".into(),
            read_only: true,
        },
    ]
}

/// A leased address, waiting for the box's network namespace.
#[derive(Debug)]
pub struct Pending {
    network: Network,
    lease: Lease,
}

impl Pending {
    /// Lease an address for bridge-mode box `box_id`, named `names` in the
    /// hosts file (its name and hostname; none for a pooled shell, named when
    /// claimed); `None` for other modes. `prefer`: the address it had (a box
    /// started again), given when free.
    pub fn lease(
        roots: &Roots,
        box_id: &str,
        spec: &BoxSpec,
        names: &[&str],
        prefer: Option<std::net::Ipv4Addr>,
    ) -> Result<Option<Pending>> {
        if spec.network.mode != NetworkMode::Bridge {
            return Ok(None);
        }
        let network = open_named(roots, spec.network.name.as_deref())?;
        let lease = network.allocate_preferring(box_id, names, prefer)?;
        Ok(Some(Pending { network, lease }))
    }

    /// The network's hosts and resolver files, read-only in the box.
    pub fn volumes(&self) -> Vec<Volume> {
        volumes(&self.network)
    }

    /// Connect the network namespace of `pid`; what `inspect` shows of it.
    pub fn attach(&self, pid: Pid, spec: &BoxSpec) -> Result<serde_json::Value> {
        let ns = nestbox_net::netns::of_pid(pid.as_raw())?;
        let opts = AttachOptions {
            publish: spec.network.publish.clone(),
            rate: spec.network.rate,
            reserve: spec.network.reserve,
            share: spec.network.share,
            ingress_rate: spec.network.ingress_rate,
            allow_host: spec.network.allow_host.clone(),
            egress: spec.network.egress.clone(),
        };
        let attachment = self.network.attach(&self.lease, ns.as_fd(), &opts)?;
        Ok(serde_json::to_value(&attachment).unwrap_or_default())
    }

    /// Give the lease back (the box did not start).
    pub fn release(self) {
        crate::diag::warn_on_err(
            None,
            &format!("releasing the lease of box id {}", self.lease.box_id),
            self.network.detach(&self.lease.box_id),
        );
    }
}

/// Release everything box `box_id` holds on its network (idempotent).
pub fn release(roots: &Roots, box_id: &str) -> Result<()> {
    crate::network_pool::release(roots, box_id);
    // The saved configuration is enough: detaching opens its own netlink
    // socket; it is idempotent, so every network of the root is asked.
    for net in views(roots)? {
        net.detach(box_id)?;
    }
    Ok(())
}

/// Release what box `box_id`, whose processes have all exited, holds on its
/// network; its veth pair goes with its network namespace, by the kernel.
pub fn release_exited(roots: &Roots, box_id: &str) -> Result<()> {
    crate::network_pool::release(roots, box_id);
    for net in views(roots)? {
        net.detach_exited(box_id)?;
    }
    Ok(())
}

/// Release what boxes not `live` still hold; the ids released. `live` is
/// asked under the network's lock (see `Network::gc_with`); `live_now` are the
/// boxes live when the pool's entries are looked at.
pub fn gc(roots: &Roots, live_now: &[String], live: &dyn Fn(&str) -> bool) -> Result<Vec<String>> {
    if !state_dir(roots).exists() {
        return Ok(Vec::new());
    }
    // Namespaces waiting in the pool are no leftovers; a pool id's address
    // that no entry of the pool holds is.
    crate::network_pool::clear_then(roots, live_now, |pooled| {
        let mut dead = Vec::new();
        for net in views(roots)? {
            dead.extend(net.gc_with(&|id| {
                if crate::network_pool::is_pool_id(id) {
                    pooled(id)
                } else {
                    live(id)
                }
            })?);
        }
        Ok(dead)
    })
}
