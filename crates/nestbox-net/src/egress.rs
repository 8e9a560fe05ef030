//! A box's egress policy (`--egress`): where beyond its network it may open
//! connections. `allow-all` (the default), `deny-all`, or a list of
//! `ADDRESS[/PREFIX][:PORT]` entries (a port applies to TCP and UDP). It is
//! enforced by the network's guard table ([`crate::nft`]) on traffic the host
//! forwards out of the bridge; every refused and every admitted new
//! connection is logged to the kernel log (rate-limited), prefixed
//! `nestbox-egress deny` or `nestbox-egress allow` and the box's id.

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};

/// One allowed destination: a network and, optionally, a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EgressRule {
    /// Network address (host bits clear).
    pub addr: Ipv4Addr,
    /// Prefix length (32: one address).
    pub prefix: u8,
    /// Destination port (TCP and UDP); any when `None`.
    pub port: Option<u16>,
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
    /// Parse `allow-all`, `deny-all` or `CIDR[:PORT],...`.
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
            });
        }
        Ok(Egress::Allow(rules))
    }

    /// Whether this is the default (no rule needed).
    pub fn is_allow_all(&self) -> bool {
        *self == Egress::AllowAll
    }
}

impl fmt::Display for EgressRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)?;
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
    fn rejects() {
        for bad in [
            "",
            "all",
            "10.0.0.0/33",
            "10.0.0.1:0",
            "10.0.0.1:x",
            "1.2.3",
            ",",
        ] {
            assert!(
                matches!(Egress::parse(bad), Err(NetError::InvalidEgress { .. })),
                "{bad}"
            );
        }
    }
}
