//! The anti-spoofing guard: the classifier on the ingress of a box's host veth
//! (the first thing every frame a box sends meets, before the box-to-box
//! shortcut, the redirect to the egress tree and the bridge) lets through only
//! frames that carry the box's own MAC address as their source and are
//!
//! - IPv4 from the box's own address, not a DHCP server's reply (UDP source
//!   port 67), or
//! - ARP for IPv4 over Ethernet whose sender is the box's own MAC and its own
//!   address (or 0.0.0.0, an address probe).
//!
//! Everything else is dropped (`TC_ACT_SHOT`): other source addresses and MACs,
//! ARP claiming another box's address, IPv6 (boxes have IPv4 only, so router
//! advertisements, DHCPv6 and link-local IPv6 towards the host go too), VLAN
//! tags and other EtherTypes. Headers are read with `bpf_skb_load_bytes`, so a
//! frame whose headers are not in the linear part of the buffer is checked
//! like any other, and one too short for its headers is dropped.
//!
//! A frame that passes goes on to the shortcut ([`crate::bpf`]) when the box has
//! one (IPv4 to a box of the network's map goes straight there), else to the
//! next filter. One program is loaded per box: its MAC and address are
//! immediates of the program, so the guard costs no map lookup.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, BorrowedFd};

use crate::bpf::insn;

/// What a box may send as: its MAC and IPv4 address; and, on an isolated
/// network, where it may send to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    /// MAC of the box's `eth0`.
    pub mac: [u8; 6],
    /// The box's address.
    pub addr: Ipv4Addr,
    /// On an isolated network: its subnet and gateway.
    pub isolated: Option<Isolation>,
}

/// The isolated policy: IPv4 from the box to an address of its network other
/// than the gateway (another box, the subnet's broadcast), to the limited
/// broadcast or to a multicast group is dropped, and so is ARP asking for
/// anything but the gateway. Addresses beyond the network pass (through the
/// gateway; published ports of other boxes are reached there, DNATed by the
/// host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isolation {
    /// The network's subnet.
    pub subnet: crate::subnet::Subnet,
}

// Opcodes (eBPF).
const LDXW: u8 = 0x61;
const LDXH: u8 = 0x69;
const LDXB: u8 = 0x71;
const MOV64X: u8 = 0xbf;
const MOV64K: u8 = 0xb7;
const ADD64K: u8 = 0x07;
const AND64K: u8 = 0x57;
const AND32K: u8 = 0x54;
const LSH64K: u8 = 0x67;
const OR64X: u8 = 0x4f;
const JA: u8 = 0x05;
const JEQK: u8 = 0x15;
const JNEK: u8 = 0x55;
const JSETK: u8 = 0x45;
const JEQ32K: u8 = 0x16;
const JNE32K: u8 = 0x56;
const LDDW: u8 = 0x18;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;

const FN_MAP_LOOKUP_ELEM: i32 = 1;
const FN_REDIRECT: i32 = 23;
const FN_SKB_LOAD_BYTES: i32 = 26;
const FN_REDIRECT_PEER: i32 = 155;
const BPF_PSEUDO_MAP_FD: u8 = 1;
/// `TC_ACT_UNSPEC`: not classified here, try the next filter.
const TC_ACT_UNSPEC: i32 = -1;
/// `TC_ACT_SHOT`: drop.
const TC_ACT_SHOT: i32 = 2;

/// Stack layout (offsets from the frame pointer r10; stack reads must be
/// aligned to their size, so each buffer starts where its fields align).
/// Ethernet header, 14 bytes: source MAC at -16 (4 + 2 bytes), EtherType at -10.
const ETH: i16 = -22;
/// IPv4 header (20 bytes) or ARP body (28 bytes) at -56: IPv4 fragment field at
/// -50, protocol at -47, source at -44, destination at -40; ARP hardware and
/// protocol types at -56, lengths at -52, sender MAC at -48 (4 + 2 bytes),
/// sender address at -42 (2 + 2 bytes).
const L3: i16 = -56;
/// The UDP source port of an IPv4 packet.
const UDP_SPORT: i16 = -60;

/// A jump target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Label {
    Drop,
    Pass,
    Ipv4,
    Ipv4Ok,
    Redirect,
    Reachable,
}

/// Instructions with jumps to labels, resolved by [`Asm::finish`].
#[derive(Debug, Default)]
struct Asm {
    code: Vec<[u8; 8]>,
    jumps: Vec<(usize, Label)>,
    labels: Vec<(Label, usize)>,
}

impl Asm {
    fn op(&mut self, code: u8, dst: u8, src: u8, off: i16, imm: i32) {
        self.code.push(insn(code, dst, src, off, imm));
    }

    /// A conditional (or, with `JA`, unconditional) jump to `to`.
    fn jump(&mut self, code: u8, dst: u8, imm: i32, to: Label) {
        self.jumps.push((self.code.len(), to));
        self.code.push(insn(code, dst, 0, 0, imm));
    }

    fn label(&mut self, l: Label) {
        self.labels.push((l, self.code.len()));
    }

    /// `bpf_skb_load_bytes(ctx (r6), offset (r2, set by the caller), r10 + to,
    /// len)`; drops the frame if it is too short.
    fn load_bytes(&mut self, to: i16, len: i32) {
        self.op(MOV64X, 1, 6, 0, 0);
        self.op(MOV64X, 3, 10, 0, 0);
        self.op(ADD64K, 3, 0, 0, i32::from(to));
        self.op(MOV64K, 4, 0, 0, len);
        self.op(CALL, 0, 0, 0, FN_SKB_LOAD_BYTES);
        self.jump(JNEK, 0, 0, Label::Drop);
    }

    /// Drop unless the stack holds `mac` at `at` (a 4-aligned offset).
    fn expect_mac(&mut self, at: i16, mac: &[u8; 6]) {
        self.op(LDXW, 1, 10, at, 0);
        self.jump(JNE32K, 1, ne32(&mac[..4]), Label::Drop);
        self.op(LDXH, 1, 10, at + 4, 0);
        self.jump(JNE32K, 1, ne16(&mac[4..]), Label::Drop);
    }

    fn finish(mut self) -> Vec<[u8; 8]> {
        for (at, to) in std::mem::take(&mut self.jumps) {
            let target = self
                .labels
                .iter()
                .find(|(l, _)| *l == to)
                .map(|(_, i)| *i)
                .unwrap_or_else(|| unreachable!("label {to:?} is placed by program()"));
            let off = (target as i64 - at as i64 - 1) as i16;
            self.code[at][2..4].copy_from_slice(&off.to_le_bytes());
        }
        self.code
    }
}

/// Bytes as the program loads them from memory (a 32-bit immediate).
fn ne32(b: &[u8]) -> i32 {
    i32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

fn ne16(b: &[u8]) -> i32 {
    i32::from(u16::from_ne_bytes([b[0], b[1]]))
}

/// The program of a box's host veth: the guard of `guard`, then, with `map`,
/// the box-to-box shortcut through that map.
pub fn program(guard: &Guard, map: Option<BorrowedFd<'_>>) -> Vec<[u8; 8]> {
    let mut a = Asm::default();
    let mac = guard.mac;
    let ip = guard.addr.octets();
    // r6: the context, kept across helper calls.
    a.op(MOV64X, 6, 1, 0, 0);
    // Ethernet header: the source MAC, then by EtherType.
    a.op(MOV64K, 2, 0, 0, 0);
    a.load_bytes(ETH, 14);
    a.expect_mac(ETH + 6, &mac);
    a.op(LDXH, 1, 10, ETH + 12, 0);
    a.jump(JEQ32K, 1, ne16(&[0x08, 0x00]), Label::Ipv4);
    a.jump(JNE32K, 1, ne16(&[0x08, 0x06]), Label::Drop);

    // ARP: Ethernet and IPv4, the sender is the box (or an address probe).
    a.op(MOV64K, 2, 0, 0, 14);
    a.load_bytes(L3, 28);
    a.op(LDXW, 1, 10, L3, 0);
    a.jump(JNE32K, 1, ne32(&[0, 1, 8, 0]), Label::Drop);
    a.op(LDXH, 1, 10, L3 + 4, 0);
    a.jump(JNE32K, 1, ne16(&[6, 4]), Label::Drop);
    a.expect_mac(L3 + 8, &mac);
    a.op(LDXH, 1, 10, L3 + 14, 0);
    a.op(LDXH, 2, 10, L3 + 16, 0);
    a.op(MOV64X, 3, 1, 0, 0);
    a.op(OR64X, 3, 2, 0, 0);
    a.jump(JEQK, 3, 0, Label::Pass);
    a.jump(JNE32K, 1, ne16(&ip[..2]), Label::Drop);
    a.jump(JNE32K, 2, ne16(&ip[2..]), Label::Drop);
    if let Some(iso) = &guard.isolated {
        // Only the gateway may be asked for.
        let gw = iso.subnet.gateway().octets();
        a.op(LDXH, 1, 10, L3 + 24, 0);
        a.jump(JNE32K, 1, ne16(&gw[..2]), Label::Drop);
        a.op(LDXH, 1, 10, L3 + 26, 0);
        a.jump(JNE32K, 1, ne16(&gw[2..]), Label::Drop);
    }
    a.jump(JA, 0, 0, Label::Pass);

    // IPv4 from the box's address; UDP from port 67 (a DHCP server) is not
    // for a box to send. Only a first fragment carries the UDP header.
    a.label(Label::Ipv4);
    a.op(MOV64K, 2, 0, 0, 14);
    a.load_bytes(L3, 20);
    a.op(LDXW, 1, 10, L3 + 12, 0);
    a.jump(JNE32K, 1, ne32(&ip), Label::Drop);
    if let Some(iso) = &guard.isolated {
        let gw = iso.subnet.gateway().octets();
        let base = iso.subnet.base().octets();
        let mask = (u32::MAX << (32 - u32::from(iso.subnet.prefix()))).to_be_bytes();
        a.op(LDXW, 1, 10, L3 + 16, 0);
        a.jump(JEQ32K, 1, ne32(&gw), Label::Reachable);
        a.op(MOV64X, 2, 1, 0, 0);
        a.op(AND32K, 2, 0, 0, ne32(&mask));
        a.jump(JEQ32K, 2, ne32(&base), Label::Drop);
        a.jump(JEQ32K, 1, -1, Label::Drop);
        a.op(MOV64X, 2, 1, 0, 0);
        a.op(AND32K, 2, 0, 0, ne32(&[0xf0, 0, 0, 0]));
        a.jump(JEQ32K, 2, ne32(&[0xe0, 0, 0, 0]), Label::Drop);
    }
    a.label(Label::Reachable);
    a.op(LDXB, 1, 10, L3 + 9, 0);
    a.jump(JNEK, 1, 17, Label::Ipv4Ok);
    a.op(LDXH, 1, 10, L3 + 6, 0);
    a.jump(JSETK, 1, ne16(&[0x1f, 0xff]), Label::Ipv4Ok);
    a.op(LDXB, 2, 10, L3, 0);
    a.op(AND64K, 2, 0, 0, 0x0f);
    a.op(LSH64K, 2, 0, 0, 2);
    a.op(ADD64K, 2, 0, 0, 14);
    a.load_bytes(UDP_SPORT, 2);
    a.op(LDXH, 1, 10, UDP_SPORT, 0);
    a.jump(JEQ32K, 1, ne16(&67u16.to_be_bytes()), Label::Drop);
    a.label(Label::Ipv4Ok);

    // The shortcut: the destination address is the key.
    if let Some(map) = map {
        a.op(MOV64X, 2, 10, 0, 0);
        a.op(ADD64K, 2, 0, 0, i32::from(L3 + 16));
        a.op(LDDW, 1, BPF_PSEUDO_MAP_FD, 0, map.as_raw_fd());
        a.op(0, 0, 0, 0, 0);
        a.op(CALL, 0, 0, 0, FN_MAP_LOOKUP_ELEM);
        a.jump(JEQK, 0, 0, Label::Pass);
        a.op(LDXW, 1, 0, 0, 0); // ifindex
        a.op(LDXW, 3, 0, 4, 0); // flags
        a.op(MOV64K, 2, 0, 0, 0);
        a.jump(JEQK, 3, 0, Label::Redirect);
        a.op(CALL, 0, 0, 0, FN_REDIRECT_PEER);
        a.op(EXIT, 0, 0, 0, 0);
        a.label(Label::Redirect);
        a.op(CALL, 0, 0, 0, FN_REDIRECT);
        a.op(EXIT, 0, 0, 0, 0);
    } else {
        // Placed so that every label exists.
        a.label(Label::Redirect);
    }
    a.label(Label::Pass);
    a.op(MOV64K, 0, 0, 0, TC_ACT_UNSPEC);
    a.op(EXIT, 0, 0, 0, 0);
    a.label(Label::Drop);
    a.op(MOV64K, 0, 0, 0, TC_ACT_SHOT);
    a.op(EXIT, 0, 0, 0, 0);
    a.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every jump lands inside the program, and the program ends in an exit.
    #[test]
    fn jumps_stay_inside() {
        let subnet = crate::subnet::Subnet::parse("10.0.0.0/24").unwrap();
        for isolated in [None, Some(Isolation { subnet })] {
            let g = Guard {
                mac: [2, 0, 0, 0, 0, 1],
                addr: Ipv4Addr::new(10, 0, 0, 2),
                isolated,
            };
            check_jumps(&program(&g, None));
        }
    }

    fn check_jumps(code: &[[u8; 8]]) {
        for (i, ins) in code.iter().enumerate() {
            let class = ins[0] & 0x07;
            if (class == 0x05 || class == 0x06) && ins[0] != CALL && ins[0] != EXIT {
                let off = i16::from_le_bytes([ins[2], ins[3]]) as i64;
                let to = i as i64 + 1 + off;
                assert!((0..code.len() as i64).contains(&to), "jump at {i} to {to}");
            }
        }
        assert_eq!(code.last().unwrap()[0], EXIT);
    }
}
