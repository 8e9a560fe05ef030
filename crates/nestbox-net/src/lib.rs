//! Box networking for nestbox: each box's network namespace joined to a host
//! bridge by a veth pair, with an address from the network's subnet, a default
//! route, a shared hosts file naming every box, published ports and outbound
//! masquerade (nftables), and bandwidth control as Linux-VServer does it with
//! HTB: what a box sends out of the network (to the host and beyond; with a
//! cap, everything it sends) is redirected into one IFB device whose HTB tree
//! gives each box a class with its reservation as rate, its cap as ceil and its
//! share as quantum, under a parent class of the link rate; an ingress cap is an
//! HTB on the host side of the box's veth. IPv4 between boxes without a cap
//! takes a BPF shortcut from one box's veth to the other's ([`bpf`]).
//!
//! Boxes are not trusted: the first thing on each box's veth is a guard
//! ([`guard`]) that lets only the box's own MAC and IPv4 address out (and, on an
//! isolated network, only towards the gateway); the network's `inet` nftables
//! table ([`nft`]) keeps the host from being a destination (but for allowed host
//! ports), keeps other networks out (but for published ports) and applies each
//! box's egress policy ([`egress`]).
//!
//! Links, addresses, routes, qdiscs, classes and filters go through rtnetlink
//! ([`netlink`]); the shortcut's map and program through `bpf(2)` ([`bpf`]);
//! the NAT table through the `nft` binary ([`nft`]). See
//! `docs/network.md`.
//!
//! A box run with the packet inspector (`--monitor packets:…`) has its IP
//! packets sent to an NFQUEUE queue in its own namespace and judged by its
//! monitor ([`queue`]: the rules through `iptables-nft`, the queue socket
//! through nfnetlink).
//!
//! ```no_run
//! # fn main() -> nestbox_net::Result<()> {
//! use nestbox_net::{AttachOptions, Network, NetworkConfig, PortMapping};
//! let net = Network::open(NetworkConfig::default_in("/var/lib/nestbox/network".as_ref())?)?;
//! let lease = net.allocate("0123abcd", &["web"])?;
//! // ... bind-mount net.hosts_path() and net.resolv_path() into the box, start it ...
//! let ns = nestbox_net::netns::of_pid(1234)?;
//! let opts = AttachOptions { publish: vec![PortMapping::parse("8080:80")?], ..Default::default() };
//! let attachment = net.attach(&lease, std::os::fd::AsFd::as_fd(&ns), &opts)?;
//! net.detach("0123abcd")?;
//! # let _ = attachment; Ok(()) }
//! ```

pub mod addr;
pub mod bpf;
pub mod config;
pub mod egress;
pub mod error;
pub mod guard;
pub mod link;
pub mod netlink;
pub mod netns;
pub mod network;
pub use network::hosts;
pub mod nft;
pub mod port;
pub mod queue;
pub mod rate;
pub mod route;
mod state;
pub mod subnet;
pub mod tc;

pub use config::NetworkConfig;
pub use egress::{Egress, EgressRule};
pub use error::{NetError, NetErrorKind, Result};
pub use network::{list_networks, AttachOptions, Attachment, Lease, Network};
pub use port::{HostPort, PortMapping, Proto};
pub use rate::{parse_rate, Rate};
pub use subnet::Subnet;
