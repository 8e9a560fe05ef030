//! What `--monitor NAME[:ARGS]` asks for, parsed and checked before a box is
//! made. The forms:
//!
//! | form | subscribes to | does |
//! |---|---|---|
//! | `trace:CALL,CALL…` | the calls named | logs each call (pid, name, arguments, path or address) |
//! | `files:deny=PATH,redirect=PATH=>OTHER,errno=E` | the `open` family | fails an open of a denied path (or below it) with E (default `EACCES`); opens OTHER (in the box) instead of PATH |
//! | `net:allow=CIDR[:PORT],…,errno=E` | `connect` | lets IPv4/IPv6 connects to allowed destinations through (made by the monitor with the address it checked), fails the others with E (default `ECONNREFUSED`) |
//! | `null:CALL,…` | the calls named | lets them through (for measuring) |
//! | `socket:PATH:CALL,…` | the calls named | asks the program listening on Unix socket PATH (see `docs/monitors.md`) |
//! | `packets:drop=TEXT,log=TEXT,hex=HEX,dir=out\|in\|both` | no call: the box's packets (an NFQUEUE queue) | drops the packets whose payload holds a `drop` pattern, logs those holding a `log` pattern |
//!
//! Monitors stack in the order given: each sees the calls the ones before it
//! let through.

use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::InterposeError;

/// The calls `files` subscribes to.
pub const OPEN_CALLS: &[&str] = &["open", "openat", "openat2", "creat"];

/// One monitor of a stack.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MonitorSpec {
    /// Log the calls named.
    Trace {
        /// Subscribed calls.
        calls: Vec<String>,
    },
    /// Deny or redirect opens by path.
    Files {
        /// Paths (and everything below them) whose open fails.
        deny: Vec<PathBuf>,
        /// `(path, instead)`: an open of `path` opens `instead`.
        redirect: Vec<(PathBuf, PathBuf)>,
        /// The errno of a denied open.
        errno: i32,
    },
    /// Allow-list of connect destinations.
    Net {
        /// Allowed networks and ports (`None`: any port).
        allow: Vec<(IpAddr, u8, Option<u16>)>,
        /// The errno of a refused connect.
        errno: i32,
    },
    /// Let the calls named through.
    Null {
        /// Subscribed calls.
        calls: Vec<String>,
    },
    /// The packet inspector: no system call, the box's IP packets.
    Packets {
        /// Patterns whose packets are dropped.
        drop: Vec<Vec<u8>>,
        /// Patterns whose packets pass and are logged.
        log: Vec<Vec<u8>>,
        /// Inspect what the box sends.
        outbound: bool,
        /// Inspect what the box receives.
        inbound: bool,
    },
    /// A monitor program on a Unix socket.
    Socket {
        /// The socket's path on the host.
        path: PathBuf,
        /// Subscribed calls.
        calls: Vec<String>,
    },
}

fn bad(spec: &str, why: impl std::fmt::Display) -> InterposeError {
    InterposeError::Spec {
        spec: spec.to_string(),
        why: why.to_string(),
    }
}

/// An errno by name (`EACCES`) or number.
pub fn parse_errno(text: &str) -> Option<i32> {
    if let Ok(n) = text.parse::<i32>() {
        return (1..4096).contains(&n).then_some(n);
    }
    (1..134).find(|&n| format!("{:?}", nix::errno::Errno::from_raw(n)) == text)
}

fn calls(spec: &str, list: &str) -> Result<Vec<String>, InterposeError> {
    let names: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if names.is_empty() {
        return Err(bad(spec, "names no system call"));
    }
    for n in &names {
        if nestbox_seccomp::syscall_number(n).is_none() {
            return Err(bad(spec, format!("{n:?} is not an x86_64 system call")));
        }
    }
    Ok(names)
}

/// `path` without `.` and `..` (`..` above `/` stays at `/`); `None` if not absolute.
pub fn normalize(path: &Path) -> Option<PathBuf> {
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    Some(out)
}

fn box_path(spec: &str, text: &str) -> Result<PathBuf, InterposeError> {
    normalize(Path::new(text))
        .ok_or_else(|| bad(spec, format!("{text:?} is not an absolute path in the box")))
}

fn cidr(spec: &str, text: &str) -> Result<(IpAddr, u8, Option<u16>), InterposeError> {
    // ADDR[/BITS][:PORT]; an IPv6 address with a port is written [ADDR]/BITS:PORT.
    let (net, port) = match text.rsplit_once(':') {
        Some((n, p))
            if !n.is_empty() && (n.contains('.') || n.ends_with(']') || n.contains(']')) =>
        {
            let port: u16 = p
                .parse()
                .map_err(|_| bad(spec, format!("{p:?} is not a port")))?;
            (n, Some(port))
        }
        _ => (text, None),
    };
    let net = net.replace(['[', ']'], "");
    let (addr, bits) = match net.split_once('/') {
        Some((a, b)) => (a.to_string(), Some(b)),
        None => (net.clone(), None),
    };
    let ip: IpAddr = addr
        .parse()
        .map_err(|_| bad(spec, format!("{addr:?} is not an IP address")))?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let bits = match bits {
        Some(b) => b
            .parse::<u8>()
            .ok()
            .filter(|b| *b <= max)
            .ok_or_else(|| bad(spec, format!("/{b} is not a prefix length of {ip}")))?,
        None => max,
    };
    Ok((ip, bits, port))
}

impl MonitorSpec {
    /// Parse one `--monitor` value.
    pub fn parse(spec: &str) -> Result<MonitorSpec, InterposeError> {
        let (name, args) = spec.split_once(':').unwrap_or((spec, ""));
        match name {
            "trace" => Ok(MonitorSpec::Trace {
                calls: calls(spec, args)?,
            }),
            "null" => Ok(MonitorSpec::Null {
                calls: calls(spec, args)?,
            }),
            "socket" => {
                let (path, list) = args
                    .rsplit_once(':')
                    .ok_or_else(|| bad(spec, "expected socket:PATH:CALL,CALL..."))?;
                if !path.starts_with('/') {
                    return Err(bad(spec, format!("{path:?} is not an absolute path")));
                }
                Ok(MonitorSpec::Socket {
                    path: PathBuf::from(path),
                    calls: calls(spec, list)?,
                })
            }
            "files" => {
                let (mut deny, mut redirect, mut errno) = (Vec::new(), Vec::new(), libc::EACCES);
                for item in args.split(',').filter(|s| !s.is_empty()) {
                    match item.split_once('=') {
                        Some(("deny", p)) => deny.push(box_path(spec, p)?),
                        Some(("redirect", r)) => {
                            let (from, to) = r
                                .split_once("=>")
                                .ok_or_else(|| bad(spec, "expected redirect=PATH=>OTHER"))?;
                            redirect.push((box_path(spec, from)?, box_path(spec, to)?));
                        }
                        Some(("errno", e)) => {
                            errno = parse_errno(e)
                                .ok_or_else(|| bad(spec, format!("{e:?} is not an errno")))?
                        }
                        _ => return Err(bad(spec, format!("unknown item {item:?}"))),
                    }
                }
                if deny.is_empty() && redirect.is_empty() {
                    return Err(bad(spec, "expected deny=PATH or redirect=PATH=>OTHER"));
                }
                Ok(MonitorSpec::Files {
                    deny,
                    redirect,
                    errno,
                })
            }
            "net" => {
                let (mut allow, mut errno) = (Vec::new(), libc::ECONNREFUSED);
                for item in args.split(',').filter(|s| !s.is_empty()) {
                    match item.split_once('=') {
                        Some(("allow", c)) => allow.push(cidr(spec, c)?),
                        Some(("errno", e)) => {
                            errno = parse_errno(e)
                                .ok_or_else(|| bad(spec, format!("{e:?} is not an errno")))?
                        }
                        _ => return Err(bad(spec, format!("unknown item {item:?}"))),
                    }
                }
                Ok(MonitorSpec::Net { allow, errno })
            }
            "packets" => packets(spec, args),
            _ => Err(bad(
                spec,
                format!("unknown monitor {name:?} (trace, files, net, null, socket, packets)"),
            )),
        }
    }

    /// The calls this monitor subscribes to.
    pub fn calls(&self) -> Vec<String> {
        match self {
            MonitorSpec::Trace { calls }
            | MonitorSpec::Null { calls }
            | MonitorSpec::Socket { calls, .. } => calls.clone(),
            MonitorSpec::Files { .. } => OPEN_CALLS.iter().map(|s| s.to_string()).collect(),
            MonitorSpec::Net { .. } => vec!["connect".into()],
            MonitorSpec::Packets { .. } => Vec::new(),
        }
    }

    /// Whether this is the packet inspector (no system call; see
    /// `docs/monitors.md`).
    pub fn is_packets(&self) -> bool {
        matches!(self, MonitorSpec::Packets { .. })
    }
}

/// Bytes from hexadecimal digits (`hex=534543`).
fn unhex(spec: &str, text: &str) -> Result<Vec<u8>, InterposeError> {
    let not = || {
        bad(
            spec,
            format!("{text:?} is not an even number of hex digits"),
        )
    };
    if text.is_empty() || !text.len().is_multiple_of(2) {
        return Err(not());
    }
    (0..text.len())
        .step_by(2)
        .map(|i| {
            text.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(not)
        })
        .collect()
}

/// `packets:drop=TEXT,log=TEXT,hex=HEX,loghex=HEX,dir=out|in|both`.
fn packets(spec: &str, args: &str) -> Result<MonitorSpec, InterposeError> {
    let (mut drop, mut log) = (Vec::new(), Vec::new());
    let (mut outbound, mut inbound) = (true, true);
    for item in args.split(',').filter(|s| !s.is_empty()) {
        match item.split_once('=') {
            Some(("drop", t)) | Some(("log", t)) if t.is_empty() => {
                return Err(bad(
                    spec,
                    format!("{item:?}: an empty pattern matches everything"),
                ))
            }
            Some(("drop", t)) => drop.push(t.as_bytes().to_vec()),
            Some(("log", t)) => log.push(t.as_bytes().to_vec()),
            Some(("hex", h)) => drop.push(unhex(spec, h)?),
            Some(("loghex", h)) => log.push(unhex(spec, h)?),
            Some(("dir", d)) => {
                (outbound, inbound) = match d {
                    "out" => (true, false),
                    "in" => (false, true),
                    "both" => (true, true),
                    _ => return Err(bad(spec, format!("dir={d:?}: expected out, in or both"))),
                }
            }
            _ => return Err(bad(spec, format!("unknown item {item:?}"))),
        }
    }
    if drop.is_empty() && log.is_empty() {
        return Err(bad(
            spec,
            "expected drop=TEXT, log=TEXT, hex=HEX or loghex=HEX",
        ));
    }
    Ok(MonitorSpec::Packets {
        drop,
        log,
        outbound,
        inbound,
    })
}

/// The packet inspector of a stack, if it has one (the last one given wins;
/// see `docs/monitors.md`), and the stack's other monitors' texts.
pub fn split_packets(texts: &[String]) -> (Option<MonitorSpec>, Vec<String>) {
    let mut packets = None;
    let mut rest = Vec::new();
    for t in texts {
        match MonitorSpec::parse(t) {
            Ok(m) if m.is_packets() => packets = Some(m),
            _ => rest.push(t.clone()),
        }
    }
    (packets, rest)
}

/// The x86_64 numbers of every call a stack subscribes to.
pub fn subscribed(stack: &[MonitorSpec]) -> Vec<u32> {
    let mut nrs: Vec<u32> = stack
        .iter()
        .flat_map(MonitorSpec::calls)
        .filter_map(|c| nestbox_seccomp::syscall_number(&c))
        .collect();
    nrs.sort_unstable();
    nrs.dedup();
    nrs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_form() {
        assert_eq!(
            MonitorSpec::parse("trace:openat,connect").unwrap(),
            MonitorSpec::Trace {
                calls: vec!["openat".into(), "connect".into()]
            }
        );
        let f = MonitorSpec::parse("files:deny=/etc/sec/../secret,redirect=/a=>/b,errno=EPERM")
            .unwrap();
        assert_eq!(
            f,
            MonitorSpec::Files {
                deny: vec!["/etc/secret".into()],
                redirect: vec![("/a".into(), "/b".into())],
                errno: libc::EPERM
            }
        );
        let n =
            MonitorSpec::parse("net:allow=10.0.0.0/8:443,allow=192.0.2.1,errno=EACCES").unwrap();
        assert_eq!(
            n,
            MonitorSpec::Net {
                allow: vec![
                    ("10.0.0.0".parse().unwrap(), 8, Some(443)),
                    ("192.0.2.1".parse().unwrap(), 32, None)
                ],
                errno: libc::EACCES
            }
        );
        assert_eq!(
            MonitorSpec::parse("socket:/run/m.sock:openat").unwrap(),
            MonitorSpec::Socket {
                path: "/run/m.sock".into(),
                calls: vec!["openat".into()]
            }
        );
        assert_eq!(
            subscribed(&[n, f]),
            vec![2, 42, 85, 257, 437],
            "open, connect, creat, openat, openat2"
        );
    }

    #[test]
    fn bad_forms_say_what_is_wrong() {
        for (spec, why) in [
            ("bogus:x", "unknown monitor \"bogus\""),
            ("trace:", "names no system call"),
            (
                "trace:frobnicate",
                "\"frobnicate\" is not an x86_64 system call",
            ),
            (
                "files:deny=etc",
                "\"etc\" is not an absolute path in the box",
            ),
            ("files:", "expected deny=PATH or redirect=PATH=>OTHER"),
            ("files:deny=/x,errno=EWHAT", "\"EWHAT\" is not an errno"),
            ("net:allow=10.0.0.0/40", "/40 is not a prefix length"),
            ("net:allow=nothere", "\"nothere\" is not an IP address"),
            ("socket:rel:openat", "\"rel\" is not an absolute path"),
            ("packets:", "expected drop=TEXT"),
            ("packets:drop=", "an empty pattern"),
            ("packets:hex=5", "not an even number of hex digits"),
            ("packets:hex=zz", "not an even number of hex digits"),
            ("packets:drop=x,dir=up", "expected out, in or both"),
        ] {
            let e = MonitorSpec::parse(spec).unwrap_err().to_string();
            assert!(e.contains(why), "{spec}: {e}");
            assert!(e.starts_with(&format!("--monitor {spec}: ")), "{e}");
        }
    }

    #[test]
    fn packets_form() {
        let p = MonitorSpec::parse("packets:drop=SECRET,log=HELLO,hex=00ff,dir=out").unwrap();
        assert_eq!(
            p,
            MonitorSpec::Packets {
                drop: vec![b"SECRET".to_vec(), vec![0, 255]],
                log: vec![b"HELLO".to_vec()],
                outbound: true,
                inbound: false
            }
        );
        assert!(p.calls().is_empty());
        let (found, rest) =
            split_packets(&["trace:openat".to_string(), "packets:log=x".to_string()]);
        assert!(found.is_some_and(|f| f.is_packets()));
        assert_eq!(rest, vec!["trace:openat".to_string()]);
    }

    #[test]
    fn errno_names_and_numbers() {
        assert_eq!(parse_errno("EACCES"), Some(libc::EACCES));
        assert_eq!(parse_errno("ECONNREFUSED"), Some(libc::ECONNREFUSED));
        assert_eq!(parse_errno("13"), Some(13));
        assert_eq!(parse_errno("0"), None);
    }
}
