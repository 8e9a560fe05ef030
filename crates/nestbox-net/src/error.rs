//! Typed errors of box networking. Every variant carries its context (the
//! netlink request and the object it was about, the path, the box) and displays
//! as one line a person can act on. [`NetError::kind`] tells a user's mistake
//! (bad input), a missing object, a conflict with what exists and a failure
//! of the system apart.

use std::io;
use std::path::PathBuf;

/// A networking error.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A netlink request failed; `what` names the request and its object,
    /// `detail` is the kernel's extended-ack message when it gave one.
    #[error("netlink: {what}: {source}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Netlink {
        /// The request and its object, e.g. `create veth nbv0a1b2c3d4e5f on bridge nbx0`.
        what: String,
        /// The errno the kernel answered with.
        #[source]
        source: io::Error,
        /// Extended ack message.
        detail: Option<String>,
    },
    /// A netlink answer could not be decoded.
    #[error("netlink: {what}: cannot decode the kernel's answer: {message}")]
    Decode {
        /// The request.
        what: String,
        /// What went wrong.
        message: String,
    },
    /// A system call failed.
    #[error("{call}: {source}")]
    Sys {
        /// The call and its object, e.g. `setns(/proc/123/ns/net)`.
        call: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// A file could not be read or written.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done: `read`, `write`, `lock`...
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A state file holds something we cannot parse.
    #[error("corrupt network state {}: {message}", path.display())]
    State {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// `nft` failed.
    #[error("nft: {what}: {message}")]
    Nft {
        /// What the ruleset change was for.
        what: String,
        /// nft's own message (first line of its stderr) or the spawn error.
        message: String,
    },
    /// A rate could not be parsed or is out of range.
    #[error("invalid rate {0:?}: expected a number and a unit such as 100mbit, 1gbit, 10mbps")]
    InvalidRate(String),
    /// A port mapping could not be parsed.
    #[error("invalid port mapping {0:?}: expected HOSTPORT:BOXPORT[/tcp|udp] with ports 1-65535")]
    InvalidPort(String),
    /// A host port a box may reach could not be parsed.
    #[error("invalid host port {0:?}: expected PORT[/tcp|udp] with a port 1-65535")]
    InvalidHostPort(String),
    /// An egress policy could not be parsed.
    #[error("invalid egress policy {text:?} ({reason}): expected allow-all, deny-all or ADDRESS[/PREFIX][:PORT] and HOSTNAME[:PORT] entries, comma-separated")]
    InvalidEgress {
        /// The policy as given.
        text: String,
        /// What is wrong.
        reason: String,
    },
    /// A host name of an egress policy does not resolve to an IPv4 address.
    #[error("egress host name {name:?} does not resolve: {reason}")]
    Unresolved {
        /// The name.
        name: String,
        /// The resolver's answer.
        reason: String,
    },
    /// A subnet could not be parsed or is unsuitable.
    #[error("invalid subnet {subnet:?}: {reason}")]
    InvalidSubnet {
        /// The subnet as given.
        subnet: String,
        /// Why it is refused.
        reason: String,
    },
    /// Some other invalid input from the user (a name, an option such as a
    /// share or reservation, a configuration); never a system failure.
    #[error("{0}")]
    Invalid(String),
    /// What was asked contradicts what exists (a bridge of another network,
    /// a network's subnet while boxes use it, an address already held).
    #[error("{0}")]
    Conflict(String),
    /// The lease a caller holds is not the one the network recorded for the box.
    #[error(
        "lease address {lease} of box {box_id} does not match the network's record {recorded}"
    )]
    LeaseMismatch {
        /// The box.
        box_id: String,
        /// The address of the caller's lease.
        lease: std::net::Ipv4Addr,
        /// The address the network recorded.
        recorded: std::net::Ipv4Addr,
    },
    /// No subnet is free for a new network.
    #[error("no free subnet for the default network (tried {tried} candidates from {first}): configure one")]
    NoFreeSubnet {
        /// How many candidates were tried.
        tried: usize,
        /// The first candidate.
        first: String,
    },
    /// The network does not exist (never made, or removed meanwhile).
    #[error("network {0:?} does not exist (it was removed)")]
    NoNetwork(String),
    /// No network of that name was made (`nestbox network create`).
    #[error("no network named {0:?} (make it with nestbox network create)")]
    UnknownNetwork(String),
    /// The network still has boxes, so it is not removed.
    #[error("network {network:?} still has {boxes} box(es) (box id {first}): remove them first")]
    InUse {
        /// The network.
        network: String,
        /// How many boxes hold an address on it.
        boxes: usize,
        /// One of them.
        first: String,
    },
    /// The host port of a published port is taken.
    #[error("host port {port}/{proto} is already in use{}", by.as_deref().map(|b| format!(" by {b}")).unwrap_or_default())]
    PortInUse {
        /// The host port.
        port: u16,
        /// `tcp` or `udp`.
        proto: &'static str,
        /// Who holds it, when known (another box).
        by: Option<String>,
    },
    /// The network's subnet overlaps a route of the host.
    #[error("subnet {subnet} overlaps host route {route} (dev {dev}): choose another subnet")]
    SubnetOverlap {
        /// Our subnet.
        subnet: String,
        /// The host's route.
        route: String,
        /// Its device.
        dev: String,
    },
    /// No free address is left.
    #[error("address pool {subnet} of network {network} is exhausted ({used} addresses in use)")]
    PoolExhausted {
        /// The network.
        network: String,
        /// Its subnet.
        subnet: String,
        /// Leases held.
        used: usize,
    },
    /// The network's bridge has as many ports as Linux lets a bridge have
    /// (1,023: `BR_MAX_PORTS` less the reserved port 0).
    #[error("network {network} is full: its bridge {bridge} has {} ports, the most a Linux bridge takes; put more boxes on another network (nestbox network create)", crate::link::BRIDGE_MAX_PORTS)]
    BridgeFull {
        /// The network.
        network: String,
        /// Its bridge.
        bridge: String,
    },
    /// The box has no lease in this network.
    #[error("box {0} has no address in this network (allocate first)")]
    NoLease(String),
    /// The box has an address but is not attached.
    #[error("box {0} is not attached")]
    NotAttached(String),
    /// The box is already attached.
    #[error("box {0} is already attached")]
    AlreadyAttached(String),
    /// An error about one box, with the box named.
    #[error("box {box_id}: {source}")]
    Box {
        /// The box.
        box_id: String,
        /// The error.
        #[source]
        source: Box<NetError>,
    },
}

/// What kind of error a [`NetError`] is, for callers that answer differently
/// (an API's status, a CLI's exit code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NetErrorKind {
    /// The user's input is invalid: a rate, port, subnet, name or option.
    Input,
    /// A network, box, lease or attachment that was named does not exist.
    NotFound,
    /// The request conflicts with what exists (a port or address in use, a
    /// full pool, a bridge of another network, a network with boxes).
    Conflict,
    /// The system failed: netlink, a system call, a file, nft, BPF.
    System,
}

impl NetError {
    /// The kind of this error.
    pub fn kind(&self) -> NetErrorKind {
        use NetError::*;
        match self {
            Netlink { .. } | Decode { .. } | Sys { .. } | Io { .. } | State { .. } | Nft { .. } => {
                NetErrorKind::System
            }
            InvalidRate(_)
            | InvalidPort(_)
            | InvalidHostPort(_)
            | InvalidEgress { .. }
            | Unresolved { .. }
            | InvalidSubnet { .. }
            | Invalid(_) => NetErrorKind::Input,
            NoLease(_) | NotAttached(_) | NoNetwork(_) | UnknownNetwork(_) => {
                NetErrorKind::NotFound
            }
            Conflict(_)
            | LeaseMismatch { .. }
            | NoFreeSubnet { .. }
            | InUse { .. }
            | PortInUse { .. }
            | SubnetOverlap { .. }
            | PoolExhausted { .. }
            | BridgeFull { .. }
            | AlreadyAttached(_) => NetErrorKind::Conflict,
            Box { source, .. } => source.kind(),
        }
    }

    /// A failed system call.
    pub(crate) fn sys(call: impl Into<String>, errno: nix::errno::Errno) -> Self {
        NetError::Sys {
            call: call.into(),
            source: io::Error::from_raw_os_error(errno as i32),
        }
    }

    /// A failed file operation.
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        NetError::Io {
            what,
            path: path.into(),
            source,
        }
    }

    /// This error, said about box `box_id`.
    pub(crate) fn for_box(self, box_id: &str) -> Self {
        match self {
            e @ NetError::Box { .. } => e,
            e => NetError::Box {
                box_id: box_id.to_string(),
                source: Box::new(e),
            },
        }
    }

    /// The errno of a failed netlink request or system call, if that is what this is.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NetError::Netlink { source, .. } | NetError::Sys { source, .. } => {
                source.raw_os_error()
            }
            NetError::Box { source, .. } => source.errno(),
            _ => None,
        }
    }
}

/// Result with [`NetError`].
pub type Result<T, E = NetError> = std::result::Result<T, E>;
