//! A small synchronous rtnetlink client: one `NETLINK_ROUTE` socket, requests
//! sent one at a time and answered by an ack (or a dump), with the kernel's
//! extended-ack message put into the error. The socket belongs to the network
//! namespace of the thread that opened it, so one opened on a thread that joined
//! a box's namespace configures that box.

use std::io;

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP,
    NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use crate::error::{NetError, Result};

pub(crate) use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};

/// `NLMSGERR_ATTR_MSG`: the extended-ack text attribute.
const NLMSGERR_ATTR_MSG: u16 = 1;
/// Length of a netlink message header.
const NLMSG_HDRLEN: usize = 16;

/// An rtnetlink socket of the current thread's network namespace.
#[derive(Debug)]
pub struct Netlink {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Netlink {
    /// Open a socket in the calling thread's network namespace.
    pub fn open() -> Result<Netlink> {
        let sys = |call: &str, e: io::Error| NetError::Sys {
            call: call.to_string(),
            source: e,
        };
        let sock = Socket::new(NETLINK_ROUTE).map_err(|e| sys("socket(NETLINK_ROUTE)", e))?;
        Netlink::set_up(sock)
    }

    /// Use `fd`, a `NETLINK_ROUTE` socket opened elsewhere (in another
    /// network namespace: [`crate::netns::netlink_in`]).
    pub fn from_fd(fd: std::os::fd::OwnedFd) -> Result<Netlink> {
        use std::os::fd::{FromRawFd, IntoRawFd};
        // SAFETY: `fd` is an open socket we own; the Socket takes it over.
        Netlink::set_up(unsafe { Socket::from_raw_fd(fd.into_raw_fd()) })
    }

    fn set_up(mut sock: Socket) -> Result<Netlink> {
        let sys = |call: &str, e: io::Error| NetError::Sys {
            call: call.to_string(),
            source: e,
        };
        sock.bind_auto().map_err(|e| sys("bind(netlink)", e))?;
        sock.connect(&SocketAddr::new(0, 0))
            .map_err(|e| sys("connect(netlink)", e))?;
        // Best effort: older kernels lack these; errors are still reported
        // without them, only without the kernel's extended message.
        if let Err(e) = sock.set_ext_ack(true) {
            tracing::debug!("netlink: no extended acks (NETLINK_EXT_ACK): {e}");
        }
        if let Err(e) = sock.set_cap_ack(true) {
            tracing::debug!("netlink: acks not capped (NETLINK_CAP_ACK): {e}");
        }
        Ok(Netlink {
            sock,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    fn send(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
        what: &dyn Fn() -> String,
    ) -> Result<u32> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::from(msg));
        packet.finalize();
        let mut bytes = vec![0; packet.buffer_len()];
        packet.serialize(&mut bytes);
        self.sock.send(&bytes, 0).map_err(|e| NetError::Netlink {
            what: what(),
            source: e,
            detail: None,
        })?;
        Ok(self.seq)
    }

    /// Receive the next datagram and hand each of its messages that answers
    /// `seq` to `each`; stop when `each` returns `Some`.
    fn recv_until<T>(
        &mut self,
        seq: u32,
        what: &dyn Fn() -> String,
        mut each: impl FnMut(NetlinkMessage<RouteNetlinkMessage>) -> Result<Option<T>>,
    ) -> Result<T> {
        loop {
            let n = loop {
                match self.sock.recv(&mut &mut self.buf[..], 0) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(NetError::Netlink {
                            what: what(),
                            source: e,
                            detail: None,
                        })
                    }
                }
            };
            let mut off = 0;
            while off + NLMSG_HDRLEN <= n {
                let chunk = &self.buf[off..n];
                let len = NetlinkBuffer::new_checked(chunk)
                    .map_err(|e| NetError::Decode {
                        what: what(),
                        message: e.to_string(),
                    })?
                    .length() as usize;
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(NetError::Decode {
                        what: what(),
                        message: format!("bad message length {len}"),
                    });
                }
                let raw = &chunk[..len];
                off += (len + 3) & !3;
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(raw).map_err(|e| {
                    NetError::Decode {
                        what: what(),
                        message: e.to_string(),
                    }
                })?;
                if msg.header.sequence_number != seq {
                    continue; // a late answer to an earlier request
                }
                if let NetlinkPayload::Error(err) = &msg.payload {
                    if let Some(code) = err.code {
                        return Err(NetError::Netlink {
                            what: what(),
                            source: io::Error::from_raw_os_error(-code.get()),
                            detail: ext_ack_message(&err.header),
                        });
                    }
                }
                if let Some(v) = each(msg)? {
                    return Ok(v);
                }
            }
        }
    }

    /// Send a request and wait for its acknowledgement. `what` describes it for errors.
    pub fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let seq = self.send(msg, NLM_F_ACK | flags, what)?;
        self.recv_until(seq, what, |m| {
            Ok(matches!(m.payload, NetlinkPayload::Error(_)).then_some(()))
        })
    }

    /// Send a request expecting one answer message (e.g. `RTM_GETLINK` by name).
    pub fn get(
        &mut self,
        msg: RouteNetlinkMessage,
        what: &dyn Fn() -> String,
    ) -> Result<RouteNetlinkMessage> {
        let seq = self.send(msg, 0, what)?;
        self.recv_until(seq, what, |m| match m.payload {
            NetlinkPayload::InnerMessage(inner) => Ok(Some(inner)),
            NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => Err(NetError::Decode {
                what: what(),
                message: "no answer".into(),
            }),
            _ => Ok(None),
        })
    }

    /// Send a dump request and collect every answer.
    pub fn dump(
        &mut self,
        msg: RouteNetlinkMessage,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        let seq = self.send(msg, NLM_F_DUMP, what)?;
        let mut out = Vec::new();
        self.recv_until(seq, what, |m| match m.payload {
            NetlinkPayload::InnerMessage(inner) => {
                out.push(inner);
                Ok(None)
            }
            NetlinkPayload::Done(_) | NetlinkPayload::Error(_) => Ok(Some(())),
            _ => Ok(None),
        })?;
        Ok(out)
    }

    /// [`Netlink::dump`] with the kernel's strict checking of the request
    /// (`NETLINK_GET_STRICT_CHK`) on for this one dump, so that the filter
    /// fields of the request's header (an interface index) are applied by
    /// the kernel: it then walks one interface instead of all of them (with
    /// a thousand boxes, a thousand host veths). The option stays off
    /// otherwise: strict checking refuses header fields other dumps leave
    /// set. A kernel without the option (before 4.20) ignores the filter and
    /// answers with everything, so the caller still checks each message.
    pub fn dump_filtered(
        &mut self,
        msg: RouteNetlinkMessage,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        let strict = match self.sock.set_netlink_get_strict_chk(true) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("netlink: no strict checking (NETLINK_GET_STRICT_CHK): {e}");
                false
            }
        };
        let out = self.dump(msg, what);
        if strict {
            self.sock
                .set_netlink_get_strict_chk(false)
                .map_err(|e| NetError::Sys {
                    call: "setsockopt(NETLINK_GET_STRICT_CHK, 0)".to_string(),
                    source: e,
                })?;
        }
        out
    }
}

/// The extended-ack text in the payload of an error message: the payload is
/// the (capped) request header followed by attributes.
fn ext_ack_message(payload: &[u8]) -> Option<String> {
    let mut rest = payload.get(NLMSG_HDRLEN..)?;
    while rest.len() >= 4 {
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        if len < 4 || len > rest.len() {
            return None;
        }
        if kind == NLMSGERR_ATTR_MSG {
            let text = &rest[4..len];
            let text = text.split(|b| *b == 0).next().unwrap_or_default();
            return Some(String::from_utf8_lossy(text).into_owned());
        }
        rest = &rest[((len + 3) & !3).min(rest.len())..];
    }
    None
}

/// Whether an error is the errno `code` (for idempotent deletes and creates).
pub(crate) fn is_errno(e: &NetError, code: i32) -> bool {
    e.errno() == Some(code)
}
