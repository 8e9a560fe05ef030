//! IPv4 subnets (`10.88.0.0/16`): parsing, overlap, and the host addresses a
//! network hands out (the first one is the gateway on the bridge).

use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};

/// An IPv4 network: base address (host bits zero) and prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Subnet {
    base: Ipv4Addr,
    prefix: u8,
}

impl Subnet {
    /// The subnet `base/prefix`; host bits of `base` must be zero.
    pub fn new(base: Ipv4Addr, prefix: u8) -> Result<Subnet> {
        let text = format!("{base}/{prefix}");
        if prefix > 32 {
            return Err(NetError::InvalidSubnet {
                subnet: text,
                reason: "prefix length above 32".into(),
            });
        }
        if u32::from(base) & !mask(prefix) != 0 {
            return Err(NetError::InvalidSubnet {
                subnet: text,
                reason: format!(
                    "host bits set (did you mean {}/{prefix}?)",
                    Ipv4Addr::from(u32::from(base) & mask(prefix))
                ),
            });
        }
        Ok(Subnet { base, prefix })
    }

    /// Parse `a.b.c.d/n`.
    pub fn parse(text: &str) -> Result<Subnet> {
        let bad = |reason: &str| NetError::InvalidSubnet {
            subnet: text.to_string(),
            reason: reason.to_string(),
        };
        let (a, p) = text
            .split_once('/')
            .ok_or_else(|| bad("expected ADDRESS/PREFIX"))?;
        let base: Ipv4Addr = a.parse().map_err(|_| bad("not an IPv4 address"))?;
        let prefix: u8 = p.parse().map_err(|_| bad("prefix is not a number"))?;
        Subnet::new(base, prefix)
    }

    /// Base address.
    pub fn base(&self) -> Ipv4Addr {
        self.base
    }

    /// Prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Number of addresses in the subnet.
    pub fn size(&self) -> u64 {
        1u64 << (32 - self.prefix)
    }

    /// Whether `addr` is inside.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.base)
    }

    /// Whether the two subnets share any address.
    pub fn overlaps(&self, other: &Subnet) -> bool {
        let p = self.prefix.min(other.prefix);
        u32::from(self.base) & mask(p) == u32::from(other.base) & mask(p)
    }

    /// The address at `offset` from the base (offset 1 is the gateway).
    pub fn host(&self, offset: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.base).wrapping_add(offset))
    }

    /// Offset of `addr` from the base.
    pub fn offset(&self, addr: Ipv4Addr) -> u32 {
        u32::from(addr).wrapping_sub(u32::from(self.base))
    }

    /// The gateway: the first host address, held by the bridge.
    pub fn gateway(&self) -> Ipv4Addr {
        self.host(1)
    }

    /// Offsets that boxes may get: from 2 (after the gateway) to the last
    /// before the broadcast address.
    pub fn box_offsets(&self) -> std::ops::RangeInclusive<u32> {
        2..=(self.size() as u32).wrapping_sub(2)
    }

    /// Refuse subnets a box network cannot use: it needs a gateway and at least
    /// one box (prefix ≤ 30), and class ids of the shaping tree are 16 bits
    /// (prefix ≥ 16).
    pub fn check_usable(&self) -> Result<()> {
        if !(16..=30).contains(&self.prefix) {
            return Err(NetError::InvalidSubnet {
                subnet: self.to_string(),
                reason: "prefix length must be between 16 and 30".into(),
            });
        }
        let first = self.base.octets()[0];
        if self.base.is_loopback() || self.base.is_multicast() || first == 0 || first >= 240 {
            return Err(NetError::InvalidSubnet {
                subnet: self.to_string(),
                reason: "not a unicast range".into(),
            });
        }
        Ok(())
    }
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.base, self.prefix)
    }
}

impl FromStr for Subnet {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Subnet> {
        Subnet::parse(s)
    }
}

impl TryFrom<String> for Subnet {
    type Error = NetError;
    fn try_from(s: String) -> Result<Subnet> {
        Subnet::parse(&s)
    }
}

impl From<Subnet> for String {
    fn from(s: Subnet) -> String {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_overlap() {
        let a = Subnet::parse("10.88.0.0/16").unwrap();
        assert_eq!(a.gateway(), Ipv4Addr::new(10, 88, 0, 1));
        assert!(a.contains(Ipv4Addr::new(10, 88, 255, 3)));
        assert!(!a.contains(Ipv4Addr::new(10, 89, 0, 1)));
        assert!(a.overlaps(&Subnet::parse("10.88.4.0/24").unwrap()));
        assert!(a.overlaps(&Subnet::parse("10.0.0.0/8").unwrap()));
        assert!(!a.overlaps(&Subnet::parse("10.89.0.0/16").unwrap()));
        assert!(Subnet::parse("10.88.0.1/16").is_err());
        assert!(Subnet::parse("10.88.0.0").is_err());
        let s = Subnet::parse("10.9.0.0/30").unwrap();
        assert_eq!(s.box_offsets(), 2..=2);
        assert!(Subnet::parse("10.0.0.0/8").unwrap().check_usable().is_err());
        assert!(Subnet::parse("127.1.0.0/16")
            .unwrap()
            .check_usable()
            .is_err());
    }
}
