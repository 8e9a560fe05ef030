//! The network's nftables rules, two tables per network:
//!
//! - `ip nestbox-BRIDGE`: NAT, the masquerade of outbound traffic and the DNAT
//!   rules of published ports;
//! - `inet nestbox-BRIDGE`: the host is not a destination. In the `input` hook,
//!   whatever arrives from the bridge for the host itself (the gateway, every
//!   other host address, the host's loopback reached through `route_localnet`,
//!   broadcasts) is refused unless it belongs to a connection the host made or
//!   accepted, or goes to a host port the box was allowed
//!   (`--allow-host-port`, on the gateway's address only). Published ports are
//!   DNATed before this hook, and replies to the host's connections are
//!   established, so both keep working. In the `forward` hook, a connection
//!   routed into the bridge from any other interface (another nestbox
//!   network, another machine) is dropped unless it goes to a published port
//!   (DNATed): boxes of different networks cannot reach each other. A new
//!   connection a box with an egress policy other than allow-all
//!   ([`crate::egress`]) forwards out of the bridge goes through that box's
//!   chain `egress_A_B_C_D`: accepted if it matches an entry, else refused;
//!   both decisions are logged to the kernel log (at most 20 a second each).
//!   Established traffic never reaches the chains, so the list's length costs
//!   only connection set-up. A network with an egress policy of its own
//!   (`network create --egress`) has a chain `egress_network` that every new
//!   connection leaving the bridge passes after its box's chain (which then
//!   hands what it admits on with `goto` instead of accepting it); its
//!   decisions are logged with the network's name (the kernel log line's
//!   `SRC=` names the box). Host names in a policy are resolved before the
//!   script is written ([`crate::egress::Egress::resolved`]).
//!
//! A nestbox in a user namespace (inside a nest box) cannot load the BPF
//! guard ([`crate::guard`]), so there a third table does its work:
//!
//! - `bridge nestbox-BRIDGE` ([`Guards`]): in the bridge's `prerouting` hook,
//!   which every frame a box sends passes (its veth is a bridge port and the
//!   shortcut is not used there), a frame from a box's host veth jumps to the
//!   box's chain, which accepts only frames with the box's source MAC that
//!   carry IPv4 from the box's address (not UDP from port 67) or ARP for
//!   IPv4 over Ethernet whose sender is the box (MAC and address, or 0.0.0.0
//!   for a probe); all else is dropped (another box's or a made-up address or
//!   MAC, IPv6, VLAN tags, other EtherTypes). On an isolated network the chain
//!   also drops IPv4 to any address of the subnet but the gateway, to
//!   255.255.255.255 and multicast, and ARP requests for anything but the
//!   gateway. The same checks as the BPF program's, by nftables in the
//!   namespace the nested nestbox owns. Written with the other two, on
//!   every attach and detach of such a box.
//!
//! [`RULES_VERSION`] numbers this layout: a network whose state records an
//! older one (made by an older nestbox) gets its tables replaced on the next
//! attach.
//!
//! Both tables are a pure function of the network's state: every change
//! replaces them whole in one atomic `nft -f -` transaction (exception to
//! "netlink, not shell", see docs/network.md). Nothing is run for boxes that
//! publish no port and are allowed no host port, so it stays off the common
//! path.

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use crate::egress::Egress;
use crate::error::{NetError, Result};
use crate::port::{HostPort, PortMapping};
use crate::subnet::Subnet;

/// The version of the tables' layout (see the module documentation).
pub const RULES_VERSION: u32 = 3;

/// Name of the tables (`ip`: NAT; `inet`: the host guard) of the network on
/// bridge `bridge`.
pub fn table_name(bridge: &str) -> String {
    format!("nestbox-{bridge}")
}

/// The rules of one network: its bridge, subnet and published ports.
#[derive(Debug, Clone)]
pub struct Ruleset<'a> {
    /// Bridge name.
    pub bridge: &'a str,
    /// Subnet of the boxes.
    pub subnet: Subnet,
    /// Published ports: mapping and the box address it goes to.
    pub published: Vec<(PortMapping, Ipv4Addr)>,
    /// Host ports boxes may reach on the gateway: port and the box's address.
    pub host_allowed: Vec<(HostPort, Ipv4Addr)>,
    /// Egress policies other than allow-all: box id, address, policy
    /// (host names resolved).
    pub egress: Vec<(String, Ipv4Addr, Egress)>,
    /// The network's own egress policy (host names resolved) and its name,
    /// when it is not allow-all.
    pub network_egress: Option<(String, Egress)>,
    /// The guard as nftables rules (a nestbox in a user namespace): the
    /// `bridge` table is written (empty without boxes); `None` on the host,
    /// where the guard is BPF and no `bridge` table is made.
    pub guards: Option<Guards>,
}

/// The boxes whose guard is the `bridge` table (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct Guards {
    /// Whether the network's policy is isolated.
    pub isolated: bool,
    /// Each box's host veth, MAC address (`aa:bb:…`) and IPv4 address.
    pub boxes: Vec<(String, String, Ipv4Addr)>,
}

impl Guards {
    /// The `bridge` table's part of the script: create, delete, create.
    fn script(&self, t: &str, subnet: Subnet) -> String {
        let gw = subnet.gateway();
        let mut jumps = String::new();
        let mut chains = String::new();
        for (i, (veth, mac, addr)) in self.boxes.iter().enumerate() {
            jumps.push_str(&format!("    iifname \"{veth}\" jump box_{i}\n"));
            chains.push_str(&format!(
                "  chain box_{i} {{\n\
                 \x20   ether saddr != {mac} drop\n\
                 \x20   ip saddr {addr} udp sport 67 drop\n"
            ));
            if self.isolated {
                chains.push_str(&format!(
                    "    ip daddr {subnet} ip daddr != {gw} drop\n\
                     \x20   ip daddr {{ 255.255.255.255, 224.0.0.0/4 }} drop\n\
                     \x20   arp operation request arp daddr ip != {gw} drop\n"
                ));
            }
            chains.push_str(&format!(
                "    ether type ip ip saddr {addr} accept\n\
                 \x20   ether type arp arp htype 1 arp ptype ip arp hlen 6 arp plen 4 arp saddr ether {mac} arp saddr ip {{ {addr}, 0.0.0.0 }} accept\n\
                 \x20   drop\n\
                 \x20 }}\n"
            ));
        }
        format!(
            "table bridge {t} {{}}\n\
             delete table bridge {t}\n\
             table bridge {t} {{\n\
             \x20 chain prerouting {{\n\
             \x20   type filter hook prerouting priority -200; policy accept;\n\
             {jumps}\
             \x20 }}\n\
             {chains}\
             }}\n"
        )
    }
}

/// The nft match of one egress rule (host names must be resolved first).
fn egress_match(r: &crate::egress::EgressRule) -> String {
    match r.port {
        Some(p) => format!(
            "ip daddr {}/{} meta l4proto {{ tcp, udp }} th dport {p}",
            r.addr, r.prefix
        ),
        None => format!("ip daddr {}/{}", r.addr, r.prefix),
    }
}

impl Ruleset<'_> {
    /// The nft script that (re)creates the table.
    pub fn script(&self) -> String {
        let t = table_name(self.bridge);
        let br = self.bridge;
        let net = self.subnet;
        let mut publish = String::new();
        for (m, addr) in &self.published {
            let p = m.proto.as_str();
            publish.push_str(&format!(
                "    {p} dport {} dnat to {addr}:{}\n",
                m.host_port, m.box_port
            ));
        }
        let gw = net.gateway();
        let mut allowed = String::new();
        for (p, addr) in &self.host_allowed {
            allowed.push_str(&format!(
                "    ip saddr {addr} ip daddr {gw} {} dport {} accept\n",
                p.proto.as_str(),
                p.port
            ));
        }
        // Egress: new connections a box forwards out of the bridge go through
        // its chain; each decision is logged (rate-limited).
        let mut egress_jumps = String::new();
        let mut egress_chains = String::new();
        let network_policy = self.network_egress.is_some();
        for (id, addr, policy) in &self.egress {
            let chain = format!("egress_{}", addr.to_string().replace('.', "_"));
            let short: String = id.chars().take(24).collect();
            egress_jumps.push_str(&format!(
                "    iifname \"{br}\" oifname != \"{br}\" ip saddr {addr} ct state new jump {chain}\n"
            ));
            egress_chains.push_str(&format!("  chain {chain} {{\n"));
            if let Egress::Allow(rules) = policy {
                for r in rules {
                    let m = egress_match(r);
                    if network_policy {
                        // The network's policy decides (and logs) the rest.
                        egress_chains.push_str(&format!("    {m} goto egress_network\n"));
                    } else {
                        egress_chains.push_str(&format!(
                            "    {m} limit rate 20/second log prefix \"nestbox-egress allow box={short} \"\n    {m} accept\n"
                        ));
                    }
                }
            }
            egress_chains.push_str(&format!(
                "    limit rate 20/second log prefix \"nestbox-egress deny box={short} \"\n\
                 \x20   reject with icmpx admin-prohibited\n  }}\n"
            ));
        }
        if let Some((name, policy)) = &self.network_egress {
            let short: String = name.chars().take(24).collect();
            egress_jumps.push_str(&format!(
                "    iifname \"{br}\" oifname != \"{br}\" ct state new jump egress_network\n"
            ));
            egress_chains.push_str("  chain egress_network {\n");
            match policy {
                Egress::Allow(rules) => {
                    for r in rules {
                        let m = egress_match(r);
                        egress_chains.push_str(&format!(
                            "    {m} limit rate 20/second log prefix \"nestbox-egress allow network={short} \"\n    {m} accept\n"
                        ));
                    }
                }
                Egress::AllowAll => egress_chains.push_str("    accept\n"),
                Egress::DenyAll => {}
            }
            egress_chains.push_str(&format!(
                "    limit rate 20/second log prefix \"nestbox-egress deny network={short} \"\n\
                 \x20   reject with icmpx admin-prohibited\n  }}\n"
            ));
        }
        // `table` first makes the `delete` valid when the table did not exist.
        format!(
            "table ip {t} {{}}\n\
             delete table ip {t}\n\
             table ip {t} {{\n\
             \x20 chain prerouting {{\n\
             \x20   type nat hook prerouting priority dstnat; policy accept;\n\
             \x20   fib daddr type local jump publish\n\
             \x20 }}\n\
             \x20 chain output {{\n\
             \x20   type nat hook output priority -100; policy accept;\n\
             \x20   fib daddr type local jump publish\n\
             \x20 }}\n\
             \x20 chain publish {{\n\
             {publish}\
             \x20 }}\n\
             \x20 chain postrouting {{\n\
             \x20   type nat hook postrouting priority srcnat; policy accept;\n\
             \x20   ip saddr {net} oifname != \"{br}\" masquerade\n\
             \x20   oifname \"{br}\" ip saddr 127.0.0.0/8 masquerade\n\
             \x20   oifname \"{br}\" ip saddr {net} ct status dnat masquerade\n\
             \x20 }}\n\
             }}\n\
             table inet {t} {{}}\n\
             delete table inet {t}\n\
             table inet {t} {{\n\
             \x20 chain input {{\n\
             \x20   type filter hook input priority filter; policy accept;\n\
             \x20   iifname \"{br}\" jump from_boxes\n\
             \x20 }}\n\
             \x20 chain forward {{\n\
             \x20   type filter hook forward priority filter; policy accept;\n\
             \x20   oifname \"{br}\" iifname != \"{br}\" ct status dnat accept\n\
             \x20   oifname \"{br}\" iifname != \"{br}\" ct state new drop\n\
             {egress_jumps}\
             \x20 }}\n\
             {egress_chains}\
             \x20 chain from_boxes {{\n\
             \x20   ct state established,related accept\n\
             {allowed}\
             \x20   meta l4proto tcp reject with tcp reset\n\
             \x20   reject with icmpx admin-prohibited\n\
             \x20 }}\n\
             }}\n"
        )
    }

    /// Replace the network's tables with this ruleset, atomically.
    pub fn apply(&self, what: &str) -> Result<()> {
        let mut script = self.script();
        if let Some(g) = &self.guards {
            script.push_str(&g.script(&table_name(self.bridge), self.subnet));
        }
        run(&script, what)
    }
}

/// Delete the tables of the network on `bridge`, if they exist.
pub fn delete_table(bridge: &str) -> Result<()> {
    let t = table_name(bridge);
    let mut script = format!(
        "table ip {t} {{}}\ndelete table ip {t}\ntable inet {t} {{}}\ndelete table inet {t}\n"
    );
    if crate::netns::in_user_namespace() {
        // The guard's table (see `Guards`).
        script.push_str(&format!("table bridge {t} {{}}\ndelete table bridge {t}\n"));
    }
    run(&script, &format!("delete tables {t}"))
}

/// The guard table (`bridge` family, made only by a nestbox in a user
/// namespace) of `bridge` as `nft list` prints it, or `None`.
pub fn list_bridge_guard_table(bridge: &str) -> Result<Option<String>> {
    list(bridge, "bridge")
}

/// The NAT table of `bridge` as `nft list` prints it, or `None` if there is none.
pub fn list_table(bridge: &str) -> Result<Option<String>> {
    list(bridge, "ip")
}

/// The host guard table of `bridge` as `nft list` prints it, or `None` if
/// there is none.
pub fn list_guard_table(bridge: &str) -> Result<Option<String>> {
    list(bridge, "inet")
}

fn list(bridge: &str, family: &str) -> Result<Option<String>> {
    let t = table_name(bridge);
    let out = Command::new("nft")
        .args(["list", "table", family, &t])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| spawn_error(&format!("list table {t}"), e))?;
    if out.status.success() {
        Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()))
    } else {
        // nft fails this way when the table does not exist.
        tracing::debug!(
            "nft list table {family} {t}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(None)
    }
}

fn spawn_error(what: &str, e: std::io::Error) -> NetError {
    let message = if e.kind() == std::io::ErrorKind::NotFound {
        "the nft command is missing: install the nftables package (scripts/setup.sh does)".into()
    } else {
        format!("cannot run nft: {e}")
    };
    NetError::Nft {
        what: what.to_string(),
        message,
    }
}

fn run(script: &str, what: &str) -> Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| spawn_error(what, e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| spawn_error(what, e))?;
    }
    let out = child.wait_with_output().map_err(|e| spawn_error(what, e))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let line = err
        .lines()
        .find(|l| l.contains("Error"))
        .or_else(|| err.lines().next())
        .unwrap_or("failed")
        .trim()
        .to_string();
    Err(NetError::Nft {
        what: what.to_string(),
        message: line,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ruleset(network: Option<&str>) -> String {
        Ruleset {
            bridge: "nbu0",
            subnet: Subnet::parse("10.64.0.0/24").unwrap(),
            published: Vec::new(),
            host_allowed: Vec::new(),
            egress: vec![(
                "box-a".into(),
                Ipv4Addr::new(10, 64, 0, 2),
                Egress::parse("192.0.2.0/24").unwrap(),
            )],
            network_egress: network.map(|p| ("net".into(), Egress::parse(p).unwrap())),
            guards: None,
        }
        .script()
    }

    #[test]
    fn the_nftables_guard_admits_only_each_boxs_mac_and_address() {
        let subnet = Subnet::parse("10.64.0.0/24").unwrap();
        let mut g = Guards {
            isolated: false,
            boxes: vec![(
                "nbvaaaa".into(),
                "02:00:00:00:00:02".into(),
                Ipv4Addr::new(10, 64, 0, 2),
            )],
        };
        let open = g.script("nestbox-nbu0", subnet);
        assert!(
            open.starts_with("table bridge nestbox-nbu0 {}\ndelete table bridge nestbox-nbu0\n")
        );
        assert!(open.contains("iifname \"nbvaaaa\" jump box_0"), "{open}");
        assert!(
            open.contains("ether saddr != 02:00:00:00:00:02 drop"),
            "{open}"
        );
        assert!(
            open.contains("ip saddr 10.64.0.2 udp sport 67 drop"),
            "{open}"
        );
        assert!(
            open.contains("ether type ip ip saddr 10.64.0.2 accept"),
            "{open}"
        );
        assert!(
            open.contains(
                "arp saddr ether 02:00:00:00:00:02 arp saddr ip { 10.64.0.2, 0.0.0.0 } accept"
            ),
            "{open}"
        );
        // Everything else a box sends is dropped at the end of its chain.
        let chain = open.split("chain box_0").nth(1).unwrap();
        assert!(chain.trim_end().ends_with("drop\n  }\n}"), "{chain}");
        assert!(!open.contains("ip daddr 10.64.0.0/24"), "{open}");
        g.isolated = true;
        let iso = g.script("nestbox-nbu0", subnet);
        assert!(
            iso.contains("ip daddr 10.64.0.0/24 ip daddr != 10.64.0.1 drop"),
            "{iso}"
        );
        assert!(
            iso.contains("arp operation request arp daddr ip != 10.64.0.1 drop"),
            "{iso}"
        );
        // Without boxes the table is made empty (and so replaced).
        let empty = Guards::default().script("nestbox-nbu0", subnet);
        assert!(!empty.contains("jump"), "{empty}");
    }

    #[test]
    fn a_networks_policy_follows_its_boxes_own() {
        // Without one, a box's list accepts and logs with the box's id.
        let alone = ruleset(None);
        assert!(alone.contains("ip daddr 192.0.2.0/24 accept"), "{alone}");
        assert!(!alone.contains("egress_network"), "{alone}");
        // With one, what the box's list admits goes on to the network's chain,
        // which every new connection leaving the bridge passes.
        let both = ruleset(Some("198.51.100.7:443"));
        assert!(
            both.contains("ip daddr 192.0.2.0/24 goto egress_network"),
            "{both}"
        );
        assert!(!both.contains("ip daddr 192.0.2.0/24 accept"), "{both}");
        assert!(both.contains("ct state new jump egress_network"), "{both}");
        assert!(
            both.contains("ip daddr 198.51.100.7/32 meta l4proto { tcp, udp } th dport 443 accept"),
            "{both}"
        );
        assert!(both.contains("nestbox-egress deny network=net "), "{both}");
        // Deny-all: the chain refuses everything.
        let deny = ruleset(Some("deny-all"));
        let chain = deny.split("chain egress_network").nth(1).unwrap();
        let chain = &chain[..chain.find("  }").unwrap()];
        assert!(!chain.contains("accept"), "{chain}");
        assert!(chain.contains("reject"), "{chain}");
    }
}
