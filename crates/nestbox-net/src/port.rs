//! Published ports: `HOSTPORT:BOXPORT[/tcp|udp]`, and the check that a host port
//! is free before a box claims it; host ports a box may open connections to
//! (`PORT[/tcp|udp]`, `--allow-host-port`).

use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};

/// Transport protocol of a published port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    /// TCP.
    Tcp,
    /// UDP.
    Udp,
}

impl Proto {
    /// `tcp` or `udp`.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

/// A host port forwarded to a port of the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PortMapping {
    /// Port on the host.
    pub host_port: u16,
    /// Port in the box.
    pub box_port: u16,
    /// Protocol.
    pub proto: Proto,
}

/// Split an optional `/tcp` or `/udp` off `text` (TCP when there is none);
/// `None` for any other protocol.
fn split_proto(text: &str) -> Option<(&str, Proto)> {
    match text.split_once('/') {
        Some((p, "tcp")) => Some((p, Proto::Tcp)),
        Some((p, "udp")) => Some((p, Proto::Udp)),
        Some(_) => None,
        None => Some((text, Proto::Tcp)),
    }
}

impl PortMapping {
    /// Parse `8080:80`, `8080:80/tcp` or `53:53/udp`.
    pub fn parse(text: &str) -> Result<PortMapping> {
        let bad = || NetError::InvalidPort(text.to_string());
        let (ports, proto) = split_proto(text).ok_or_else(bad)?;
        let (h, b) = ports.split_once(':').ok_or_else(bad)?;
        let port = |s: &str| -> Result<u16> {
            if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            match s.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(bad()),
            }
        };
        Ok(PortMapping {
            host_port: port(h)?,
            box_port: port(b)?,
            proto,
        })
    }

    /// Whether the host port can be taken now: binds it on all addresses and
    /// lets it go. A listener anywhere on the host (any address) makes this fail.
    pub fn check_host_port_free(&self) -> Result<()> {
        let addr = SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, self.host_port);
        let res = match self.proto {
            Proto::Tcp => TcpListener::bind(addr).map(drop),
            Proto::Udp => UdpSocket::bind(addr).map(drop),
        };
        match res {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(NetError::PortInUse {
                port: self.host_port,
                proto: self.proto.as_str(),
                by: None,
            }),
            Err(e) => Err(NetError::Sys {
                call: format!("bind(0.0.0.0:{}/{})", self.host_port, self.proto.as_str()),
                source: e,
            }),
        }
    }
}

/// A port of the host (on the network's gateway address) that a box may open
/// connections to, although the host is otherwise no destination for boxes
/// (`--allow-host-port PORT[/tcp|udp]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct HostPort {
    /// The port.
    pub port: u16,
    /// Protocol.
    pub proto: Proto,
}

impl HostPort {
    /// Parse `53`, `8080/tcp` or `53/udp` (TCP when no protocol is given).
    pub fn parse(text: &str) -> Result<HostPort> {
        let bad = || NetError::InvalidHostPort(text.to_string());
        let (port, proto) = split_proto(text).ok_or_else(bad)?;
        if port.is_empty() || !port.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => Ok(HostPort { port: p, proto }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.port, self.proto.as_str())
    }
}

impl FromStr for HostPort {
    type Err = NetError;
    fn from_str(s: &str) -> Result<HostPort> {
        HostPort::parse(s)
    }
}

impl fmt::Display for PortMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}/{}",
            self.host_port,
            self.box_port,
            self.proto.as_str()
        )
    }
}

impl FromStr for PortMapping {
    type Err = NetError;
    fn from_str(s: &str) -> Result<PortMapping> {
        PortMapping::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        let m = PortMapping::parse("8080:80/tcp").unwrap();
        assert_eq!((m.host_port, m.box_port, m.proto), (8080, 80, Proto::Tcp));
        assert_eq!(PortMapping::parse("8080:80").unwrap(), m);
        assert_eq!(PortMapping::parse("53:5353/udp").unwrap().proto, Proto::Udp);
        assert_eq!(m.to_string(), "8080:80/tcp");
    }

    #[test]
    fn host_ports_parse_and_reject() {
        assert_eq!(
            HostPort::parse("53/udp").unwrap(),
            HostPort {
                port: 53,
                proto: Proto::Udp
            }
        );
        assert_eq!(HostPort::parse("8080").unwrap().proto, Proto::Tcp);
        assert_eq!(HostPort::parse("8080/tcp").unwrap().to_string(), "8080/tcp");
        for bad in ["", "0", "70000", "80/sctp", "a", "+80", "80/", "80:80"] {
            assert!(
                matches!(HostPort::parse(bad), Err(NetError::InvalidHostPort(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn rejects() {
        for bad in [
            "",
            "80",
            "0:80",
            "80:0",
            "70000:80",
            "80:80/sctp",
            "a:80",
            ":80",
            "80:",
            "+80:80",
            "80:80/",
        ] {
            assert!(
                matches!(PortMapping::parse(bad), Err(NetError::InvalidPort(_))),
                "{bad}"
            );
        }
    }
}
