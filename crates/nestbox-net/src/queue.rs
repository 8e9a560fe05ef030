//! Packet interposition (`--monitor packets:…`): a box's IP packets go to an
//! NFQUEUE queue in the box's own network namespace, and a thread of the box's
//! monitor process gives each one a verdict.
//!
//! - [`install_rules`]: the rules, in the box's network namespace (the box has
//!   no `CAP_NET_ADMIN` there, so it cannot remove them). The running kernel
//!   may lack nftables' own `queue` expression (`CONFIG_NFT_QUEUE`), so the
//!   rules are made with `iptables-nft`/`ip6tables-nft`, whose `NFQUEUE`
//!   target goes through nftables' xtables compatibility and shows in
//!   `nft list ruleset` as `queue num N`. A shell-out (exception to "netlink,
//!   not shell", see docs/network.md), run only for boxes that ask for the
//!   inspector. The rules have no `--queue-bypass`: with no reader bound,
//!   the kernel drops the packets (fail closed).
//! - [`PacketQueue`]: the nfnetlink queue socket (a few netlink messages,
//!   written here): bind the queue, copy whole packets, read them, answer.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use crate::error::{NetError, Result};

/// The queue number the rules send packets to (the namespace is the box's own).
pub const QUEUE: u16 = 0;

const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_PACKET: u8 = 2;
const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_PAYLOAD: u16 = 10;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
const NF_DROP: u32 = 0;
const NF_ACCEPT: u32 = 1;
/// `NF_INET_LOCAL_IN`: the hook of a packet the box receives.
const HOOK_LOCAL_IN: u8 = 1;

fn sys(call: &str) -> impl FnOnce(io::Error) -> NetError + '_ {
    move |source| NetError::Sys {
        call: call.to_string(),
        source,
    }
}

/// Put the queue rules into the network namespace of process `pid`: every
/// IPv4 and IPv6 packet it sends (`outbound`, the `OUTPUT` hook) and receives
/// (`inbound`, `INPUT`), loopback excepted, goes to queue [`QUEUE`], without
/// bypass. Runs `iptables-nft` and `ip6tables-nft` in that namespace.
pub fn install_rules(pid: i32, outbound: bool, inbound: bool) -> Result<()> {
    change_rules(pid, outbound, inbound, "-A")
}

/// Take the rules [`install_rules`] put in (with the same directions) out of
/// the network namespace of process `pid`: its packets go straight through
/// again (`monitor detach`).
pub fn remove_rules(pid: i32, outbound: bool, inbound: bool) -> Result<()> {
    change_rules(pid, outbound, inbound, "-D")
}

/// Append (`-A`) or delete (`-D`) the queue rules of each direction asked
/// for, IPv4 then IPv6.
fn change_rules(pid: i32, outbound: bool, inbound: bool, action: &'static str) -> Result<()> {
    let path = format!("/proc/{pid}/ns/net");
    let ns: OwnedFd = std::fs::File::open(&path)
        .map_err(|source| NetError::Io {
            what: "open",
            path: path.clone().into(),
            source,
        })?
        .into();
    let mut rules = Vec::new();
    if outbound {
        rules.push([action, "OUTPUT", "!", "-o", "lo"]);
    }
    if inbound {
        rules.push([action, "INPUT", "!", "-i", "lo"]);
    }
    for tool in ["iptables-nft", "ip6tables-nft"] {
        for rule in &rules {
            let what = format!("the packet queue rule {tool} {}", rule.join(" "));
            let raw = ns.as_raw_fd();
            let mut cmd = Command::new(tool);
            cmd.arg("-w")
                .args(rule)
                .args(["-j", "NFQUEUE", "--queue-num", &QUEUE.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            // SAFETY: the closure runs in the forked child before exec and
            // makes one system call (setns, async-signal-safe); `raw` is the
            // namespace file held open by `ns` for the whole spawn.
            unsafe {
                cmd.pre_exec(move || {
                    let fd = std::os::fd::BorrowedFd::borrow_raw(raw);
                    nestbox_sys::ns::enter(fd, nestbox_sys::ns::Namespace::Net)
                        .map_err(io::Error::from)
                });
            }
            let out = cmd.output().map_err(|e| NetError::Nft {
                what: what.clone(),
                message: if e.kind() == io::ErrorKind::NotFound {
                    format!(
                        "{tool} is missing: install the iptables package (scripts/setup.sh does)"
                    )
                } else {
                    format!("cannot run {tool}: {e}")
                },
            })?;
            if !out.status.success() {
                let err = String::from_utf8_lossy(&out.stderr);
                return Err(NetError::Nft {
                    what,
                    message: err.lines().next().unwrap_or("failed").trim().to_string(),
                });
            }
        }
    }
    Ok(())
}

/// One queued packet.
#[derive(Debug, Clone)]
pub struct QueuedPacket {
    /// The kernel's id of the packet (for the verdict).
    pub id: u32,
    /// Received by the box (`INPUT`), else sent by it.
    pub inbound: bool,
    /// The IP packet, from its IP header on.
    pub payload: Vec<u8>,
}

/// A bound nfnetlink queue socket (in the network namespace of the thread
/// that opened it).
#[derive(Debug)]
pub struct PacketQueue {
    sock: OwnedFd,
    queue: u16,
    seq: u32,
    buf: Vec<u8>,
}

fn attr(out: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(data);
    out.resize(out.len() + (4 - len % 4) % 4, 0);
}

impl PacketQueue {
    /// Make the socket in the calling thread's network namespace and bind
    /// queue `queue`, asking for whole packets.
    pub fn open(queue: u16) -> Result<PacketQueue> {
        // SAFETY: socket(2) with constant arguments; the result is checked
        // and owned at once.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(sys("socket(NETLINK_NETFILTER)")(io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        let big: libc::c_int = 4 << 20;
        // SAFETY: setsockopt with a pointer to a live c_int and its size.
        let set = unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&big as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
        if set != 0 {
            // The default buffer works; bursts overflow it sooner.
            tracing::warn!(
                "packet queue: SO_RCVBUF not set: {}",
                io::Error::last_os_error()
            );
        }
        let mut q = PacketQueue {
            sock,
            queue,
            seq: 0,
            buf: vec![0; 0x10000 + 4096],
        };
        // Command BIND: struct nfqnl_msg_config_cmd { u8 command; u8 pad; be16 pf }.
        q.request(
            NFQNL_MSG_CONFIG,
            &[(NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, 0, 0])],
            "bind the packet queue",
        )?;
        // Params: struct nfqnl_msg_config_params { be32 copy_range; u8 copy_mode } (packed).
        let mut params = 0xffffu32.to_be_bytes().to_vec();
        params.push(NFQNL_COPY_PACKET);
        q.request(
            NFQNL_MSG_CONFIG,
            &[(NFQA_CFG_PARAMS, &params)],
            "ask the packet queue for whole packets",
        )?;
        Ok(q)
    }

    fn message(&mut self, msg: u16, flags: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        self.seq = self.seq.wrapping_add(1);
        let mut body = vec![libc::AF_UNSPEC as u8, 0];
        body.extend_from_slice(&self.queue.to_be_bytes());
        for (k, d) in attrs {
            attr(&mut body, *k, d);
        }
        let mut out = Vec::with_capacity(16 + body.len());
        out.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
        out.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg).to_ne_bytes());
        out.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        out.extend_from_slice(&self.seq.to_ne_bytes());
        out.extend_from_slice(&0u32.to_ne_bytes());
        out.extend_from_slice(&body);
        out
    }

    fn send(&self, msg: &[u8], what: &str) -> Result<()> {
        nix::sys::socket::sendto(
            self.sock.as_raw_fd(),
            msg,
            &nix::sys::socket::NetlinkAddr::new(0, 0),
            nix::sys::socket::MsgFlags::empty(),
        )
        .map_err(|e| sys(what)(io::Error::from(e)))?;
        Ok(())
    }

    /// Send a configuration message and wait for its acknowledgement.
    fn request(&mut self, msg: u16, attrs: &[(u16, &[u8])], what: &str) -> Result<()> {
        let m = self.message(msg, NLM_F_ACK, attrs);
        let seq = self.seq;
        self.send(&m, what)?;
        loop {
            let n = nix::sys::socket::recv(
                self.sock.as_raw_fd(),
                &mut self.buf,
                nix::sys::socket::MsgFlags::empty(),
            )
            .map_err(|e| sys(what)(io::Error::from(e)))?;
            let b = &self.buf[..n];
            if n < 20 {
                continue;
            }
            let kind = u16::from_ne_bytes([b[4], b[5]]);
            let got = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
            if kind == NLMSG_ERROR && got == seq {
                let err = i32::from_ne_bytes([b[16], b[17], b[18], b[19]]);
                return if err == 0 {
                    Ok(())
                } else {
                    Err(sys(what)(io::Error::from_raw_os_error(-err)))
                };
            }
        }
    }

    /// Wait for the next packet. A receive buffer that overflowed
    /// (`ENOBUFS`: the kernel dropped packets it could not queue) is
    /// reported as such.
    pub fn receive(&mut self) -> Result<QueuedPacket> {
        loop {
            let n = match nix::sys::socket::recv(
                self.sock.as_raw_fd(),
                &mut self.buf,
                nix::sys::socket::MsgFlags::empty(),
            ) {
                Ok(n) => n,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(sys("receive a queued packet")(io::Error::from(e))),
            };
            let b = &self.buf[..n];
            if let Some(p) = parse_packet(b) {
                return Ok(p);
            }
            // A verdict the kernel refused comes back as an error message.
            if n >= 20 && u16::from_ne_bytes([b[4], b[5]]) == NLMSG_ERROR {
                let err = i32::from_ne_bytes([b[16], b[17], b[18], b[19]]);
                if err != 0 {
                    tracing::warn!(
                        "packet queue: the kernel refused a verdict: {}",
                        io::Error::from_raw_os_error(-err)
                    );
                }
            }
        }
    }

    /// Let packet `id` through (`accept`) or drop it.
    pub fn verdict(&mut self, id: u32, accept: bool) -> Result<()> {
        let mut hdr = (if accept { NF_ACCEPT } else { NF_DROP })
            .to_be_bytes()
            .to_vec();
        hdr.extend_from_slice(&id.to_be_bytes());
        let m = self.message(NFQNL_MSG_VERDICT, 0, &[(NFQA_VERDICT_HDR, &hdr)]);
        self.send(&m, "give a packet's verdict")
    }

    /// The socket (to poll it).
    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.sock.as_fd()
    }
}

/// The packet in one netlink message from the queue, if it is one.
fn parse_packet(b: &[u8]) -> Option<QueuedPacket> {
    if b.len() < 20 {
        return None;
    }
    let len = (u32::from_ne_bytes(b[0..4].try_into().ok()?) as usize).min(b.len());
    let kind = u16::from_ne_bytes([b[4], b[5]]);
    if kind != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET {
        return None;
    }
    let (mut id, mut hook, mut payload) = (None, 0u8, Vec::new());
    let mut at = 20; // nlmsghdr (16) + nfgenmsg (4)
    while at + 4 <= len {
        let alen = u16::from_ne_bytes([b[at], b[at + 1]]) as usize;
        let akind = u16::from_ne_bytes([b[at + 2], b[at + 3]]) & 0x3fff;
        if alen < 4 || at + alen > len {
            break;
        }
        let data = &b[at + 4..at + alen];
        match akind {
            NFQA_PACKET_HDR if data.len() >= 7 => {
                id = Some(u32::from_be_bytes(data[0..4].try_into().ok()?));
                hook = data[6];
            }
            NFQA_PAYLOAD => payload = data.to_vec(),
            _ => {}
        }
        at += (alen + 3) & !3;
    }
    Some(QueuedPacket {
        id: id?,
        inbound: hook == HOOK_LOCAL_IN,
        payload,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_message_is_decoded() {
        let mut body = vec![2u8, 0, 0, 0];
        let mut hdr = 7u32.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[0x08, 0x00, HOOK_LOCAL_IN]);
        attr(&mut body, NFQA_PACKET_HDR, &hdr);
        attr(&mut body, NFQA_PAYLOAD, b"\x45abc");
        let mut m = ((16 + body.len()) as u32).to_ne_bytes().to_vec();
        m.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET).to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&body);
        let p = parse_packet(&m).unwrap();
        assert_eq!(p.id, 7);
        assert!(p.inbound);
        assert_eq!(p.payload, b"\x45abc");
    }
}
