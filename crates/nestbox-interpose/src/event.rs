//! One stopped call as monitors see it: the caller, the call's name and raw
//! arguments, and what its pointer arguments point at (a path, a socket
//! address), read from the caller's memory.
//!
//! What is read may change after it is read (another thread of the caller
//! writes it): a decision that lets the call run with its own arguments is
//! only as good as that read. See `docs/monitors.md` for which decisions are
//! free of that race (a denial, a redirect, a connect the monitor makes
//! itself) and which are not.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use nestbox_sys::seccomp_notify::Notification;
use serde::Serialize;

/// A socket address a call names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Address {
    /// IPv4 or IPv6.
    Inet(SocketAddr),
    /// A Unix socket's path (`@name` for an abstract one).
    Unix(String),
    /// Another family, by number.
    Other(u16),
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Inet(a) => write!(f, "{a}"),
            Address::Unix(p) => write!(f, "unix:{p}"),
            Address::Other(fam) => write!(f, "family {fam}"),
        }
    }
}

/// One stopped call.
#[derive(Debug, Clone, Serialize)]
pub struct Event {
    /// The notification id (answers refer to it).
    pub id: u64,
    /// The calling thread, as the host sees it.
    pub pid: u32,
    /// The calling thread as the box sees it (its pid namespace), when the
    /// monitors want it (a trace or a socket monitor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub box_pid: Option<u32>,
    /// The call's name.
    pub syscall: String,
    /// The call's number.
    pub nr: u32,
    /// Its raw arguments.
    pub args: [u64; 6],
    /// The path it names, made absolute (relative paths resolved against
    /// the caller's working directory or its directory fd), if it names one.
    pub path: Option<PathBuf>,
    /// The socket address it names, if it names one.
    pub addr: Option<Address>,
}

/// Which argument of call `name` is a path, and which one (if any) is the
/// directory fd it is relative to.
fn path_arg(name: &str) -> Option<(usize, Option<usize>)> {
    Some(match name {
        "open" | "creat" | "execve" | "stat" | "lstat" | "access" | "unlink" | "mkdir"
        | "rmdir" | "chdir" | "readlink" | "truncate" | "chmod" | "chown" | "lchown" => (0, None),
        "openat" | "openat2" | "execveat" | "newfstatat" | "faccessat" | "faccessat2"
        | "unlinkat" | "mkdirat" | "readlinkat" | "statx" | "fchmodat" | "fchownat" => (1, Some(0)),
        _ => return None,
    })
}

/// Which arguments of call `name` are a socket address and its length.
fn addr_args(name: &str) -> Option<(usize, usize)> {
    match name {
        "connect" | "bind" => Some((1, 2)),
        "sendto" => Some((4, 5)),
        _ => None,
    }
}

/// Read `len` bytes at `addr` in thread `pid`, page by page, stopping at the
/// first page that cannot be read.
fn read_memory(pid: u32, addr: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    let mut at = addr;
    while out.len() < len {
        let in_page = (4096 - (at % 4096)) as usize;
        let want = in_page.min(len - out.len());
        let mut buf = vec![0u8; want];
        let local = [std::io::IoSliceMut::new(&mut buf)];
        let remote = [nix::sys::uio::RemoteIoVec {
            base: at as usize,
            len: want,
        }];
        match nix::sys::uio::process_vm_readv(
            nix::unistd::Pid::from_raw(pid as i32),
            &mut { local },
            &remote,
        ) {
            Ok(n) if n > 0 => {
                out.extend_from_slice(&buf[..n]);
                at += n as u64;
                if n < want {
                    break;
                }
            }
            _ => break,
        }
    }
    out
}

/// The NUL-terminated string at `addr` in `pid` (at most 4096 bytes).
fn read_string(pid: u32, addr: u64) -> Option<String> {
    let mut out = Vec::new();
    let mut at = addr;
    while out.len() < 4096 {
        let chunk = read_memory(pid, at, (4096 - (at % 4096)) as usize);
        if chunk.is_empty() {
            return None;
        }
        if let Some(end) = chunk.iter().position(|&b| b == 0) {
            out.extend_from_slice(&chunk[..end]);
            return Some(String::from_utf8_lossy(&out).into_owned());
        }
        at += chunk.len() as u64;
        out.extend_from_slice(&chunk);
    }
    None
}

/// A socket address from its bytes.
pub fn decode_address(raw: &[u8]) -> Option<Address> {
    let family = u16::from_ne_bytes(raw.get(..2)?.try_into().ok()?);
    match i32::from(family) {
        libc::AF_INET if raw.len() >= 8 => {
            let port = u16::from_be_bytes([raw[2], raw[3]]);
            let ip = Ipv4Addr::new(raw[4], raw[5], raw[6], raw[7]);
            Some(Address::Inet(SocketAddr::new(IpAddr::V4(ip), port)))
        }
        libc::AF_INET6 if raw.len() >= 24 => {
            let port = u16::from_be_bytes([raw[2], raw[3]]);
            let octets: [u8; 16] = raw[8..24].try_into().ok()?;
            Some(Address::Inet(SocketAddr::new(
                IpAddr::V6(Ipv6Addr::from(octets)),
                port,
            )))
        }
        libc::AF_UNIX => {
            let path = &raw[2..];
            Some(Address::Unix(match path.first() {
                Some(0) => format!(
                    "@{}",
                    String::from_utf8_lossy(&path[1..]).trim_end_matches('\0')
                ),
                _ => String::from_utf8_lossy(path.split(|&b| b == 0).next().unwrap_or(&[]))
                    .into_owned(),
            }))
        }
        _ => Some(Address::Other(family)),
    }
}

/// The innermost pid of thread `tid` (the last of `NSpid` in its status).
fn ns_pid(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// Make `path` of a call by `pid` absolute: against its working directory,
/// or against directory fd `dirfd` (`AT_FDCWD`: the working directory), as
/// the caller's root sees them.
fn absolute(pid: u32, path: &str, dirfd: Option<u64>) -> PathBuf {
    if path.starts_with('/') {
        return crate::spec::normalize(std::path::Path::new(path)).unwrap_or_else(|| path.into());
    }
    let base = match dirfd.map(|d| d as i32) {
        Some(fd) if fd != libc::AT_FDCWD => format!("/proc/{pid}/fd/{fd}"),
        _ => format!("/proc/{pid}/cwd"),
    };
    // The link reads as the host sees it; the caller's root is cut off.
    let root = std::fs::read_link(format!("/proc/{pid}/root")).unwrap_or_else(|_| "/".into());
    let dir = std::fs::read_link(&base).unwrap_or_else(|_| "/".into());
    let dir = dir
        .strip_prefix(&root)
        .map(|d| std::path::Path::new("/").join(d))
        .unwrap_or(dir);
    crate::spec::normalize(&dir.join(path)).unwrap_or_else(|| path.into())
}

impl Event {
    /// Decode notification `n`; with `box_pid`, look up the caller's pid in
    /// the box too (one more read of `/proc`).
    pub fn decode(n: &Notification, box_pid: bool) -> Event {
        let nr = n.data.nr as u32;
        let syscall = nestbox_seccomp::syscall_name(nr)
            .map(String::from)
            .unwrap_or_else(|| format!("#{nr}"));
        let args = n.data.args;
        let path = path_arg(&syscall).and_then(|(p, dirfd)| {
            read_string(n.pid, args[p]).map(|s| absolute(n.pid, &s, dirfd.map(|d| args[d])))
        });
        let addr = addr_args(&syscall).and_then(|(a, l)| {
            let len = (args[l] as usize).min(128);
            (args[a] != 0 && len >= 2)
                .then(|| decode_address(&read_memory(n.pid, args[a], len)))
                .flatten()
        });
        let box_pid = box_pid.then(|| ns_pid(n.pid)).flatten();
        Event {
            id: n.id,
            pid: n.pid,
            box_pid,
            syscall,
            nr,
            args,
            path,
            addr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_decode() {
        let mut v4 = vec![0u8; 16];
        v4[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
        v4[2..4].copy_from_slice(&8080u16.to_be_bytes());
        v4[4..8].copy_from_slice(&[10, 1, 2, 3]);
        assert_eq!(
            decode_address(&v4),
            Some(Address::Inet("10.1.2.3:8080".parse().unwrap()))
        );
        let mut unix = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
        unix.extend_from_slice(b"/run/x.sock\0\0\0");
        assert_eq!(
            decode_address(&unix),
            Some(Address::Unix("/run/x.sock".into()))
        );
        let mut abs = (libc::AF_UNIX as u16).to_ne_bytes().to_vec();
        abs.extend_from_slice(b"\0name");
        assert_eq!(decode_address(&abs), Some(Address::Unix("@name".into())));
    }

    #[test]
    fn strings_and_paths_are_read_from_a_live_process() {
        // Our own memory, through process_vm_readv, as for a box's process.
        let s = std::ffi::CString::new("/etc/../etc/hostname").unwrap();
        let me = std::process::id();
        assert_eq!(
            read_string(me, s.as_ptr() as u64).as_deref(),
            Some("/etc/../etc/hostname")
        );
        assert_eq!(
            absolute(me, "/etc/../etc/hostname", None),
            PathBuf::from("/etc/hostname")
        );
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(absolute(me, "a/../b", None), cwd.join("b"));
    }
}
