//! The packet inspector (`--monitor packets:drop=TEXT,log=TEXT,…`), after
//! μDenali's IDS: each IP packet of the box (from the queue that
//! `nestbox_net::queue` reads) is looked at once; a packet whose payload
//! holds a `drop` pattern is dropped, one holding a `log` pattern passes and
//! is written to the box's trace log, every other passes untouched.
//!
//! The payload is what follows the TCP, UDP or ICMP header (the whole IP
//! packet after its IP header for other protocols). A pattern split across
//! two packets (TCP segments, IP fragments) is not found.

use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;

use crate::spec::MonitorSpec;
use crate::InterposeError;

/// What the inspector does with a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PacketVerdict {
    /// Let it through, unlogged.
    Pass,
    /// Let it through; a log line was written.
    Logged,
    /// Drop it (and a log line was written).
    Drop,
}

/// The inspector of one box.
#[derive(Debug)]
pub struct Inspector {
    drop: Vec<Vec<u8>>,
    log: Vec<Vec<u8>>,
    out: File,
}

/// The addresses, ports and payload of an IP packet.
#[derive(Debug, PartialEq, Eq)]
pub struct Dissected<'a> {
    /// `tcp`, `udp`, `icmp`, `icmpv6` or the protocol's number.
    pub proto: String,
    /// Source address and port (0 without ports).
    pub src: (IpAddr, u16),
    /// Destination address and port.
    pub dst: (IpAddr, u16),
    /// What follows the transport header.
    pub payload: &'a [u8],
}

/// Take an IPv4 or IPv6 packet apart; `None` if it is neither or too short.
pub fn dissect(p: &[u8]) -> Option<Dissected<'_>> {
    let (proto, src, dst, rest) = match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < ihl || ihl < 20 {
                return None;
            }
            let s: [u8; 4] = p[12..16].try_into().ok()?;
            let d: [u8; 4] = p[16..20].try_into().ok()?;
            // A fragment after the first has no transport header.
            let offset = u16::from_be_bytes([p[6], p[7]]) & 0x1fff;
            let proto = if offset != 0 { 255 } else { p[9] };
            (
                proto,
                IpAddr::V4(Ipv4Addr::from(s)),
                IpAddr::V4(Ipv4Addr::from(d)),
                &p[ihl..],
            )
        }
        6 => {
            if p.len() < 40 {
                return None;
            }
            let s: [u8; 16] = p[8..24].try_into().ok()?;
            let d: [u8; 16] = p[24..40].try_into().ok()?;
            (
                p[6],
                IpAddr::V6(Ipv6Addr::from(s)),
                IpAddr::V6(Ipv6Addr::from(d)),
                &p[40..],
            )
        }
        _ => return None,
    };
    let ports = |r: &[u8]| {
        (
            u16::from_be_bytes([r[0], r[1]]),
            u16::from_be_bytes([r[2], r[3]]),
        )
    };
    let (name, sp, dp, payload) = match proto {
        6 if rest.len() >= 20 => {
            let off = (usize::from(rest[12] >> 4) * 4).clamp(20, rest.len());
            let (s, d) = ports(rest);
            ("tcp".to_string(), s, d, &rest[off..])
        }
        17 if rest.len() >= 8 => {
            let (s, d) = ports(rest);
            ("udp".to_string(), s, d, &rest[8..])
        }
        1 if rest.len() >= 8 => ("icmp".to_string(), 0, 0, &rest[8..]),
        58 if rest.len() >= 8 => ("icmpv6".to_string(), 0, 0, &rest[8..]),
        n => (n.to_string(), 0, 0, rest),
    };
    Some(Dissected {
        proto: name,
        src: (src, sp),
        dst: (dst, dp),
        payload,
    })
}

fn holds(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

fn show(p: &[u8]) -> String {
    p.iter()
        .flat_map(|b| std::ascii::escape_default(*b))
        .map(char::from)
        .collect()
}

fn endpoint((a, p): (IpAddr, u16)) -> String {
    match a {
        IpAddr::V4(a) => format!("{a}:{p}"),
        IpAddr::V6(a) => format!("[{a}]:{p}"),
    }
}

impl Inspector {
    /// The inspector `spec` (a `packets` monitor) asks for, writing to `log`.
    pub fn open(spec: &MonitorSpec, log: &Path) -> Result<Inspector, InterposeError> {
        let MonitorSpec::Packets {
            drop, log: pats, ..
        } = spec
        else {
            return Err(InterposeError::Spec {
                spec: format!("{spec:?}"),
                why: "not a packets monitor".into(),
            });
        };
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(|source| InterposeError::Io {
                what: format!("open the trace log {}", log.display()),
                source,
            })?;
        Ok(Inspector {
            drop: drop.clone(),
            log: pats.clone(),
            out,
        })
    }

    /// Judge one IP packet (`inbound`: received by the box). A packet that
    /// is not IP, or not understood, passes.
    pub fn judge(&mut self, inbound: bool, packet: &[u8]) -> PacketVerdict {
        let Some(d) = dissect(packet) else {
            return PacketVerdict::Pass;
        };
        let (verdict, pattern) = if let Some(p) = self.drop.iter().find(|p| holds(d.payload, p)) {
            (PacketVerdict::Drop, p)
        } else if let Some(p) = self.log.iter().find(|p| holds(d.payload, p)) {
            (PacketVerdict::Logged, p)
        } else {
            return PacketVerdict::Pass;
        };
        let line = format!(
            "{:.6} packet {} dir={} proto={} src={} dst={} len={} pattern=\"{}\"\n",
            crate::monitors::now(),
            if verdict == PacketVerdict::Drop {
                "drop"
            } else {
                "log"
            },
            if inbound { "in" } else { "out" },
            d.proto,
            endpoint(d.src),
            endpoint(d.dst),
            d.payload.len(),
            show(pattern),
        );
        if let Err(e) = self.out.write_all(line.as_bytes()) {
            tracing::warn!("packet inspector: cannot write the trace log: {e}");
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn udp4(payload: &[u8]) -> Vec<u8> {
        let mut p = vec![
            0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0, 10, 0, 0, 2, 10, 0, 0, 3,
        ];
        p.extend_from_slice(&[0x30, 0x39, 0x1f, 0x90, 0, 0, 0, 0]);
        p.extend_from_slice(payload);
        p
    }

    #[test]
    fn dissects_udp() {
        let p = udp4(b"hi");
        let d = dissect(&p).unwrap();
        assert_eq!(d.proto, "udp");
        assert_eq!(endpoint(d.src), "10.0.0.2:12345");
        assert_eq!(endpoint(d.dst), "10.0.0.3:8080");
        assert_eq!(d.payload, b"hi");
    }

    #[test]
    fn drops_logs_and_passes() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("trace.log");
        let spec = MonitorSpec::parse("packets:drop=SECRET,log=HELLO").unwrap();
        let mut i = Inspector::open(&spec, &log).unwrap();
        assert_eq!(i.judge(false, &udp4(b"a SECRET b")), PacketVerdict::Drop);
        assert_eq!(i.judge(false, &udp4(b"HELLO 1")), PacketVerdict::Logged);
        assert_eq!(i.judge(true, &udp4(b"plain")), PacketVerdict::Pass);
        assert_eq!(i.judge(true, b"junk"), PacketVerdict::Pass);
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(lines[0].contains("packet drop dir=out proto=udp src=10.0.0.2:12345 dst=10.0.0.3:8080 len=10 pattern=\"SECRET\""), "{text}");
        assert!(lines[1].contains("packet log dir=out"), "{text}");
    }
}
