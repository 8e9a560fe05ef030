//! An egress policy (`--egress`, of a box or of a whole network): where
//! beyond its network a box may open connections. `allow-all` (the default),
//! `deny-all`, or a list of `ADDRESS[/PREFIX][:PORT]` and `HOSTNAME[:PORT]`
//! entries (a port applies to TCP and UDP). It is enforced by the network's
//! guard table ([`crate::nft`]) on traffic the host forwards out of the
//! bridge; every refused and every admitted new connection is logged to the
//! kernel log (rate-limited), prefixed `nestbox-egress deny` or
//! `nestbox-egress allow` and the box's id (or the network's name).
//!
//! Host names are resolved with the system resolver (`getaddrinfo`: the
//! host's `/etc/hosts`, then DNS, as `/etc/nsswitch.conf` says) whenever the
//! rules are written ([`Egress::resolved`]), never by the kernel: a name
//! admits the IPv4 addresses it had then. A name that does not resolve then
//! admits nothing (fail closed); [`Egress::check_resolvable`] is the check at
//! the time a policy is given.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};

/// One allowed destination: a network or a host name and, optionally, a port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRule {
    /// Network address (host bits clear); `0.0.0.0` for a host name.
    pub addr: Ipv4Addr,
    /// Prefix length (32: one address, and for a host name).
    pub prefix: u8,
    /// Destination port (TCP and UDP); any when `None`.
    pub port: Option<u16>,
    /// A host name standing for the addresses it resolves to (then `addr`
    /// and `prefix` are unused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// The addresses each host name of a policy resolved to.
pub type Resolved = BTreeMap<String, Vec<Ipv4Addr>>;

/// Whether `s` is a host name a policy accepts: dot-separated labels of
/// letters, digits and `-`, with at least one dot and one letter (so a
/// mistyped keyword or a truncated address is not taken for a name).
fn is_host_name(s: &str) -> bool {
    s.len() <= 253
        && s.contains('.')
        && s.bytes().any(|b| b.is_ascii_alphabetic())
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

/// The IPv4 addresses of `name`, by the system resolver.
pub fn resolve_host(name: &str) -> std::io::Result<Vec<Ipv4Addr>> {
    let mut out: Vec<Ipv4Addr> = (name, 0)
        .to_socket_addrs()?
        .filter_map(|a| match a {
            SocketAddr::V4(v4) => Some(*v4.ip()),
            SocketAddr::V6(_) => None,
        })
        .collect();
    out.sort();
    out.dedup();
    Ok(out)
}

/// Where a box may send beyond its network.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    /// Anywhere (the default).
    #[default]
    AllowAll,
    /// Nowhere.
    DenyAll,
    /// Only the listed destinations.
    Allow(Vec<EgressRule>),
}

impl Egress {
    /// Parse `allow-all`, `deny-all` or `CIDR[:PORT]`/`HOSTNAME[:PORT]`,....
    pub fn parse(text: &str) -> Result<Egress> {
        let bad = |why: &str| NetError::InvalidEgress {
            text: text.to_string(),
            reason: why.to_string(),
        };
        match text {
            "allow-all" => return Ok(Egress::AllowAll),
            "deny-all" => return Ok(Egress::DenyAll),
            "" => return Err(bad("empty")),
            _ => {}
        }
        let mut rules = Vec::new();
        for item in text.split(',') {
            let (net, port) = match item.split_once(':') {
                Some((n, p)) => {
                    let port = p
                        .parse::<u16>()
                        .ok()
                        .filter(|p| *p > 0)
                        .ok_or_else(|| bad(&format!("bad port in {item:?}")))?;
                    (n, Some(port))
                }
                None => (item, None),
            };
            if net.parse::<Ipv4Addr>().is_err() && !net.contains('/') && is_host_name(net) {
                rules.push(EgressRule {
                    addr: Ipv4Addr::UNSPECIFIED,
                    prefix: 32,
                    port,
                    host: Some(net.to_ascii_lowercase()),
                });
                continue;
            }
            let (addr, prefix) = match net.split_once('/') {
                Some((a, p)) => (
                    a,
                    p.parse::<u8>()
                        .ok()
                        .filter(|p| *p <= 32)
                        .ok_or_else(|| bad(&format!("bad prefix in {item:?}")))?,
                ),
                None => (net, 32),
            };
            let addr: Ipv4Addr = addr
                .parse()
                .map_err(|_| bad(&format!("bad address in {item:?}")))?;
            let mask = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            rules.push(EgressRule {
                addr: Ipv4Addr::from(u32::from(addr) & mask),
                prefix,
                port,
                host: None,
            });
        }
        Ok(Egress::Allow(rules))
    }

    /// The host names of the policy.
    pub fn host_names(&self) -> Vec<&str> {
        match self {
            Egress::Allow(rules) => rules.iter().filter_map(|r| r.host.as_deref()).collect(),
            _ => Vec::new(),
        }
    }

    /// Check that every host name of the policy resolves to an IPv4 address
    /// now (when a policy is given: a name that does not is a mistake).
    pub fn check_resolvable(&self) -> Result<()> {
        for name in self.host_names() {
            match resolve_host(name) {
                Ok(a) if !a.is_empty() => {}
                Ok(_) => {
                    return Err(NetError::Unresolved {
                        name: name.to_string(),
                        reason: "no IPv4 address".into(),
                    })
                }
                Err(e) => {
                    return Err(NetError::Unresolved {
                        name: name.to_string(),
                        reason: e.to_string(),
                    })
                }
            }
        }
        Ok(())
    }

    /// The policy with every host name replaced by the addresses it resolves
    /// to now (one rule per address, with the name's port), and those
    /// addresses by name. A name that does not resolve admits nothing (it is
    /// logged).
    pub fn resolved(&self) -> (Egress, Resolved) {
        let mut names = Resolved::new();
        let Egress::Allow(rules) = self else {
            return (self.clone(), names);
        };
        let mut out = Vec::new();
        for r in rules {
            let Some(name) = &r.host else {
                out.push(r.clone());
                continue;
            };
            let addrs = names
                .entry(name.clone())
                .or_insert_with(|| match resolve_host(name) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(host = %name, "egress host name does not resolve ({e}): it admits nothing");
                        Vec::new()
                    }
                })
                .clone();
            out.extend(addrs.into_iter().map(|addr| EgressRule {
                addr,
                prefix: 32,
                port: r.port,
                host: None,
            }));
        }
        (Egress::Allow(out), names)
    }

    /// Whether this is the default (no rule needed).
    pub fn is_allow_all(&self) -> bool {
        *self == Egress::AllowAll
    }
}

impl fmt::Display for EgressRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Some(h) => f.write_str(h)?,
            None => write!(f, "{}/{}", self.addr, self.prefix)?,
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Egress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Egress::AllowAll => f.write_str("allow-all"),
            Egress::DenyAll => f.write_str("deny-all"),
            Egress::Allow(rules) => {
                let list: Vec<String> = rules.iter().map(ToString::to_string).collect();
                f.write_str(&list.join(","))
            }
        }
    }
}

impl FromStr for Egress {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Egress> {
        Egress::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!(Egress::parse("allow-all").unwrap(), Egress::AllowAll);
        assert_eq!(Egress::parse("deny-all").unwrap(), Egress::DenyAll);
        let e = Egress::parse("10.1.2.3/8,192.0.2.7:443").unwrap();
        assert_eq!(e.to_string(), "10.0.0.0/8,192.0.2.7/32:443");
        assert_eq!(Egress::parse(&e.to_string()).unwrap(), e);
    }

    #[test]
    fn host_names_parse_print_and_resolve() {
        let e = Egress::parse("Example.Internal:443,10.0.0.0/8").unwrap();
        assert_eq!(e.to_string(), "example.internal:443,10.0.0.0/8");
        assert_eq!(Egress::parse(&e.to_string()).unwrap(), e);
        assert_eq!(e.host_names(), vec!["example.internal"]);
        // A name with no address admits nothing; addresses are kept.
        let gone = Egress::parse("nothing-here.invalid:80,192.0.2.1").unwrap();
        assert!(matches!(
            gone.check_resolvable(),
            Err(NetError::Unresolved { .. })
        ));
        let (r, names) = gone.resolved();
        assert_eq!(r.to_string(), "192.0.2.1/32");
        assert_eq!(names["nothing-here.invalid"], Vec::<Ipv4Addr>::new());
    }

    #[test]
    fn rejects() {
        for bad in [
            "",
            "all",
            "10.0.0.0/33",
            "10.0.0.1:0",
            "10.0.0.1:x",
            "1.2.3",
            ",",
            "localhost",
            "db.internal/24",
            "-bad.example",
            "a..b",
        ] {
            assert!(
                matches!(Egress::parse(bad), Err(NetError::InvalidEgress { .. })),
                "{bad}"
            );
        }
    }
}
