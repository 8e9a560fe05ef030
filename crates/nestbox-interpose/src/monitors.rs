//! The monitors of a stack and their decisions: the built-in ones (`trace`,
//! `files`, `net`, `null`) and a program on a Unix socket (`socket`).

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use crate::event::{Address, Event};
use crate::spec::{parse_errno, MonitorSpec};
use crate::InterposeError;

/// What a monitor decides for a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No objection: the next monitor decides, or the kernel runs the call.
    Continue,
    /// Fail the call with this errno.
    Errno(i32),
    /// Answer the call with this value without running it.
    Value(i64),
    /// An `open`: open this path (in the box's root) instead, with the
    /// call's own flags and mode.
    Open(PathBuf),
    /// A `connect`: the monitor connects the caller's socket to this address
    /// (the one it checked) and answers with the result.
    Connect(SocketAddr),
}

/// One monitor of a stack: what it was asked to do, and what it holds.
#[derive(Debug)]
pub struct Monitor {
    spec: MonitorSpec,
    /// A `trace` monitor's log.
    log: Option<std::fs::File>,
    /// A `socket` monitor's connection, and whether it broke.
    socket: Option<(BufReader<UnixStream>, bool)>,
    calls: Vec<u32>,
    /// Its `--monitor` text, for messages.
    pub text: String,
}

/// An answer of a socket monitor.
#[derive(Debug, Deserialize)]
struct Answer {
    action: String,
    #[serde(default)]
    errno: Option<serde_json::Value>,
    #[serde(default)]
    value: Option<i64>,
    #[serde(default)]
    path: Option<PathBuf>,
}

fn in_network(ip: IpAddr, net: IpAddr, bits: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        // An IPv4-mapped IPv6 destination is the IPv4 one.
        (IpAddr::V6(a), IpAddr::V4(_)) => a
            .to_ipv4_mapped()
            .is_some_and(|v4| in_network(IpAddr::V4(v4), net, bits)),
        _ => false,
    }
}

pub(crate) fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Monitor {
    /// Make the monitor `spec` asks for; `trace_log` is where `trace` writes.
    pub fn open(
        spec: &MonitorSpec,
        text: &str,
        trace_log: &Path,
    ) -> Result<Monitor, InterposeError> {
        let (mut log, mut socket) = (None, None);
        match spec {
            MonitorSpec::Trace { .. } => {
                log = Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(trace_log)
                        .map_err(|source| InterposeError::Io {
                            what: format!("open the trace log {}", trace_log.display()),
                            source,
                        })?,
                )
            }
            MonitorSpec::Socket { path, .. } => {
                let s = UnixStream::connect(path).map_err(|source| InterposeError::Io {
                    what: format!("--monitor {text}: connect to {}", path.display()),
                    source,
                })?;
                socket = Some((BufReader::new(s), false));
            }
            _ => {}
        }
        Ok(Monitor {
            spec: spec.clone(),
            log,
            socket,
            calls: crate::spec::subscribed(std::slice::from_ref(spec)),
            text: text.to_string(),
        })
    }

    /// Whether this monitor shows the caller's pid in the box (a trace or a
    /// socket monitor).
    pub fn shows_box_pid(&self) -> bool {
        self.log.is_some() || self.socket.is_some()
    }

    /// Whether this monitor subscribed to call number `nr`.
    pub fn wants(&self, nr: u32) -> bool {
        self.calls.binary_search(&nr).is_ok()
    }

    /// Decide `e`.
    pub fn decide(&mut self, e: &Event) -> Verdict {
        if let Some(log) = &mut self.log {
            let mut line = format!(
                "{:.6} {} {}({:#x}, {:#x}, {:#x})",
                now(),
                e.box_pid.unwrap_or(e.pid),
                e.syscall,
                e.args[0],
                e.args[1],
                e.args[2]
            );
            if let Some(p) = &e.path {
                line.push_str(&format!(" path={}", p.display()));
            }
            if let Some(a) = &e.addr {
                line.push_str(&format!(" addr={a}"));
            }
            line.push('\n');
            if let Err(err) = log.write_all(line.as_bytes()) {
                tracing::warn!("trace monitor: writing its log: {err}");
            }
            return Verdict::Continue;
        }
        if let Some((stream, broken)) = &mut self.socket {
            if *broken {
                return Verdict::Errno(libc::EPERM);
            }
            return match ask(stream, e) {
                Ok(v) => v,
                Err(why) => {
                    tracing::warn!(
                        "monitor {}: {why}; its calls are refused (EPERM) from now on",
                        self.text
                    );
                    *broken = true;
                    Verdict::Errno(libc::EPERM)
                }
            };
        }
        match &self.spec {
            MonitorSpec::Files {
                deny,
                redirect,
                errno,
            } => {
                let Some(path) = &e.path else {
                    return Verdict::Continue;
                };
                if let Some((_, instead)) = redirect.iter().find(|(from, _)| from == path) {
                    return Verdict::Open(instead.clone());
                }
                if deny.iter().any(|d| path.starts_with(d)) {
                    return Verdict::Errno(*errno);
                }
                Verdict::Continue
            }
            MonitorSpec::Net { allow, errno } => match &e.addr {
                Some(Address::Inet(a)) => {
                    let ok = allow.iter().any(|(net, bits, port)| {
                        in_network(a.ip(), *net, *bits) && port.is_none_or(|p| p == a.port())
                    });
                    if ok {
                        Verdict::Connect(*a)
                    } else {
                        Verdict::Errno(*errno)
                    }
                }
                _ => Verdict::Continue,
            },
            // null (and trace and socket, handled above).
            _ => Verdict::Continue,
        }
    }
}

/// One request and its answer on a socket monitor's connection.
fn ask(stream: &mut BufReader<UnixStream>, e: &Event) -> Result<Verdict, String> {
    let mut line = serde_json::to_vec(e).map_err(|x| x.to_string())?;
    line.push(b'\n');
    stream
        .get_mut()
        .write_all(&line)
        .map_err(|x| format!("sending: {x}"))?;
    let mut answer = String::new();
    match stream.read_line(&mut answer) {
        Ok(0) => return Err("it closed the connection".into()),
        Ok(_) => {}
        Err(x) => return Err(format!("reading its answer: {x}")),
    }
    let a: Answer =
        serde_json::from_str(&answer).map_err(|x| format!("a bad answer {answer:?}: {x}"))?;
    match a.action.as_str() {
        "continue" => Ok(Verdict::Continue),
        "errno" => {
            let n = match &a.errno {
                Some(serde_json::Value::Number(n)) => n.as_i64().map(|n| n as i32),
                Some(serde_json::Value::String(s)) => parse_errno(s),
                _ => None,
            }
            .filter(|n| (1..4096).contains(n))
            .ok_or_else(|| format!("a bad errno in {answer:?}"))?;
            Ok(Verdict::Errno(n))
        }
        "value" => a
            .value
            .map(Verdict::Value)
            .ok_or_else(|| format!("no value in {answer:?}")),
        "open" => match (&a.path, e.path.is_some()) {
            (Some(p), true) if p.is_absolute() => Ok(Verdict::Open(p.clone())),
            _ => Err(format!(
                "\"open\" needs an absolute path and an open call: {answer:?}"
            )),
        },
        other => Err(format!("an unknown action {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_match_by_prefix() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(in_network(ip("10.1.2.3"), ip("10.0.0.0"), 8));
        assert!(!in_network(ip("11.1.2.3"), ip("10.0.0.0"), 8));
        assert!(in_network(ip("192.0.2.7"), ip("192.0.2.7"), 32));
        assert!(in_network(ip("::ffff:10.1.1.1"), ip("10.0.0.0"), 8));
        assert!(in_network(ip("2001:db8::1"), ip("2001:db8::"), 32));
        assert!(in_network(ip("8.8.8.8"), ip("0.0.0.0"), 0));
    }

    fn event(syscall: &str, path: Option<&str>, addr: Option<&str>) -> Event {
        Event {
            id: 1,
            pid: 1,
            box_pid: None,
            syscall: syscall.into(),
            nr: nestbox_seccomp::syscall_number(syscall).unwrap(),
            args: [0; 6],
            path: path.map(PathBuf::from),
            addr: addr.map(|a| Address::Inet(a.parse().unwrap())),
        }
    }

    #[test]
    fn files_and_net_decide() {
        let log = tempfile::NamedTempFile::new().unwrap();
        let text = "files:deny=/secret,redirect=/a=>/b";
        let mut files =
            Monitor::open(&MonitorSpec::parse(text).unwrap(), text, log.path()).unwrap();
        assert!(files.wants(257) && !files.wants(42));
        assert_eq!(
            files.decide(&event("openat", Some("/secret/x"), None)),
            Verdict::Errno(13)
        );
        assert_eq!(
            files.decide(&event("openat", Some("/secretary"), None)),
            Verdict::Continue
        );
        assert_eq!(
            files.decide(&event("openat", Some("/a"), None)),
            Verdict::Open("/b".into())
        );
        let text = "net:allow=10.0.0.0/8:80";
        let mut net = Monitor::open(&MonitorSpec::parse(text).unwrap(), text, log.path()).unwrap();
        assert_eq!(
            net.decide(&event("connect", None, Some("10.9.9.9:80"))),
            Verdict::Connect("10.9.9.9:80".parse().unwrap())
        );
        assert_eq!(
            net.decide(&event("connect", None, Some("10.9.9.9:81"))),
            Verdict::Errno(libc::ECONNREFUSED)
        );
        let text = "trace:openat";
        let mut trace =
            Monitor::open(&MonitorSpec::parse(text).unwrap(), text, log.path()).unwrap();
        assert_eq!(
            trace.decide(&event("openat", Some("/etc/x"), None)),
            Verdict::Continue
        );
        let logged = std::fs::read_to_string(log.path()).unwrap();
        assert!(
            logged.contains(" 1 openat(0x0, 0x0, 0x0) path=/etc/x\n"),
            "{logged}"
        );
    }
}
