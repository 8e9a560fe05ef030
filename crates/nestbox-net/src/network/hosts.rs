//! Names on the network: the network-wide `/etc/hosts` (every box by name) and the `/etc/resolv.conf`
//! the boxes get. The hosts file is bind-mounted read-only into every box, so it
//! is rewritten in place (same inode) rather than replaced by a rename, which
//! the boxes' bind mounts would not see.

use std::fs::{self, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::net::Ipv4Addr;
use std::path::Path;

use super::Network;
use crate::error::{NetError, Result};
use crate::state::Locked;

/// Name under which the boxes find the host (the gateway address).
pub const HOST_NAME: &str = "host.nestbox.internal";

/// Render the hosts file: localhost, the gateway, then each box with its names.
pub fn render_hosts<'a>(
    gateway: Ipv4Addr,
    boxes: impl IntoIterator<Item = (Ipv4Addr, &'a [String])>,
) -> String {
    let mut s = String::from(
        "# written by nestbox: every box of this network\n\
         127.0.0.1\tlocalhost\n\
         ::1\tlocalhost ip6-localhost ip6-loopback\n",
    );
    s.push_str(&format!("{gateway}\t{HOST_NAME}\n"));
    for (addr, names) in boxes {
        if !names.is_empty() {
            s.push_str(&format!("{addr}\t{}\n", names.join(" ")));
        }
    }
    s
}

/// Rewrite `path` in place (created if missing) with `content`.
pub fn write_in_place(path: &Path, content: &str) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| NetError::io("open", path, e))?;
    f.seek(SeekFrom::Start(0))
        .and_then(|_| f.write_all(content.as_bytes()))
        .and_then(|_| f.set_len(content.len() as u64))
        .map_err(|e| NetError::io("write", path, e))
}

/// The boxes' resolv.conf, made from the host's: loopback name servers (a
/// local resolver such as systemd-resolved's 127.0.0.53) cannot be reached from
/// a box's namespace and are dropped; `search` and `options` lines are kept.
pub fn render_resolv(host: &str) -> String {
    let mut s = String::from("# written by nestbox from the host's resolv.conf\n");
    let mut servers = 0;
    for line in host.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("nameserver") {
            let addr = rest.trim();
            let local = addr
                .parse::<std::net::IpAddr>()
                .map(|a| a.is_loopback())
                .unwrap_or(true);
            if !local {
                s.push_str(&format!("nameserver {addr}\n"));
                servers += 1;
            }
        } else if t.starts_with("search") || t.starts_with("options") || t.starts_with("domain") {
            s.push_str(t);
            s.push('\n');
        }
    }
    if servers == 0 {
        s.push_str("# the host has no name server a box can reach\n");
    }
    s
}

/// Whether `name` may appear in the hosts file.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'-' || c == b'.' || c == b'_')
}

impl Network {
    /// Rewrite the hosts file from the state (in place: see the module doc).
    pub(super) fn write_hosts(&self, locked: &Locked) -> Result<()> {
        let content = render_hosts(
            self.config.subnet.gateway(),
            locked
                .state
                .boxes
                .values()
                .map(|e| (e.address, e.names.as_slice())),
        );
        write_in_place(&self.hosts_path(), &content)
    }

    /// Write the boxes' resolv.conf from the host's (a host without one
    /// gives boxes no name server, which the file then says).
    pub(super) fn write_resolv(&self) -> Result<()> {
        let host = fs::read_to_string("/etc/resolv.conf").unwrap_or_else(|e| {
            // A host without a resolver configuration: the boxes get none
            // either, and the file says so (see `render_resolv`).
            tracing::warn!(
                "cannot read the host's /etc/resolv.conf ({e}): boxes get no name server"
            );
            String::new()
        });
        write_in_place(&self.resolv_path(), &render_resolv(&host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_drops_loopback() {
        let r =
            render_resolv("nameserver 127.0.0.53\nnameserver 192.0.2.53\nsearch example\n# c\n");
        assert!(r.contains("nameserver 192.0.2.53"));
        assert!(!r.contains("127.0.0.53"));
        assert!(r.contains("search example"));
    }

    #[test]
    fn hosts_lists_boxes() {
        let names = ["web".to_string(), "web.local".to_string()];
        let h = render_hosts(
            Ipv4Addr::new(10, 0, 0, 1),
            [(Ipv4Addr::new(10, 0, 0, 2), &names[..])],
        );
        assert!(h.contains("10.0.0.2\tweb web.local\n"));
        assert!(h.contains("10.0.0.1\thost.nestbox.internal\n"));
        assert!(valid_name("a-b.c"));
        assert!(!valid_name("a b"));
        assert!(!valid_name("-x"));
    }
}
