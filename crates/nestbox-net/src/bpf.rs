//! The box-to-box shortcut: a BPF hash map per network from a box's address to
//! the host side of its veth, and a tc classifier (`cls_bpf`, direct action) on
//! the ingress of a sender's host veth that hands an IPv4 packet addressed to a
//! box of the map straight to that box — into its namespace
//! (`bpf_redirect_peer`), or, when it has an ingress cap, to the egress of its
//! host veth where the cap's HTB is (`bpf_redirect`). Anything else goes on to
//! the next filter. The bridge (and the host's netfilter hooks on bridged
//! traffic) are skipped: measured here, that path gives about 0.9 of a plain
//! veth pair's TCP throughput, the shortcut about 0.98.
//!
//! The program (the box's anti-spoofing guard, then the shortcut) is a few
//! instructions encoded in [`crate::guard`] (no compiler, no object file); maps
//! and programs are made with the `bpf(2)` system call here. The map
//! lives as long as a program refers to it, so a network keeps its map's id in
//! a file and makes a new map (filled from its state) when the old one is gone.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use crate::error::{NetError, Result};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_F_NO_PREALLOC: u32 = 1;
/// Size of `union bpf_attr` passed (larger than every command's part we use).
const ATTR_SIZE: usize = nestbox_sys::bpf::ATTR_SIZE;
/// Key and value sizes of the map: an IPv4 address (network order); the host
/// veth's index and [`Target`] flags.
const KEY_SIZE: u32 = 4;
const VALUE_SIZE: u32 = 8;
/// Value flag: deliver into the box's namespace directly.
const FLAG_PEER: u32 = 1;

/// Where the shortcut delivers a box's packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Index of the box's host veth.
    pub ifindex: u32,
    /// Into the box's namespace (`bpf_redirect_peer`); else to the egress of the
    /// host veth, through its qdisc (an ingress cap).
    pub peer: bool,
}

fn sys_err(what: &str) -> impl FnOnce(nix::errno::Errno) -> NetError + '_ {
    move |e| NetError::Sys {
        call: what.to_string(),
        source: e.into(),
    }
}

/// `bpf(cmd, attr)`, its error naming `what`.
///
/// # Safety
/// As for [`nestbox_sys::bpf::bpf`]: every pointer stored in `attr` points to
/// live memory of the size `cmd` uses there.
unsafe fn sys_bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE], what: &str) -> Result<i64> {
    // SAFETY: the caller upholds the conditions of nestbox_sys::bpf::bpf.
    unsafe { nestbox_sys::bpf::bpf(cmd, attr) }.map_err(sys_err(what))
}

/// [`sys_bpf`] for a command that returns a new descriptor.
///
/// # Safety
/// As for [`sys_bpf`]; `cmd` returns a new descriptor.
unsafe fn sys_bpf_fd(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE], what: &str) -> Result<OwnedFd> {
    // SAFETY: the caller upholds the conditions of nestbox_sys::bpf::bpf_fd.
    unsafe { nestbox_sys::bpf::bpf_fd(cmd, attr) }.map_err(sys_err(what))
}

fn put_u32(attr: &mut [u8; ATTR_SIZE], off: usize, v: u32) {
    attr[off..off + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(attr: &mut [u8; ATTR_SIZE], off: usize, v: u64) {
    attr[off..off + 8].copy_from_slice(&v.to_ne_bytes());
}

fn put_name(attr: &mut [u8; ATTR_SIZE], off: usize, name: &str) {
    let n = name.len().min(15);
    attr[off..off + n].copy_from_slice(&name.as_bytes()[..n]);
}

/// A BPF object name for network `bridge` (at most 15 characters of
/// `[A-Za-z0-9_.]`).
pub fn object_name(bridge: &str) -> String {
    let mut s = String::from("nb_");
    s.extend(bridge.chars().map(|c| {
        if c.is_ascii_alphanumeric() || c == '.' {
            c
        } else {
            '_'
        }
    }));
    s.truncate(15);
    s
}

/// Make an empty shortcut map named `name` for up to `max` boxes. Entries are
/// allocated as they are added.
pub fn create_map(name: &str, max: u32) -> Result<OwnedFd> {
    let mut attr = [0u8; ATTR_SIZE];
    put_u32(&mut attr, 0, BPF_MAP_TYPE_HASH);
    put_u32(&mut attr, 4, KEY_SIZE);
    put_u32(&mut attr, 8, VALUE_SIZE);
    put_u32(&mut attr, 12, max.max(1));
    put_u32(&mut attr, 16, BPF_F_NO_PREALLOC);
    put_name(&mut attr, 28, name);
    let what = format!("bpf(BPF_MAP_CREATE {name})");
    // SAFETY: the attribute holds integers and a name only; MAP_CREATE returns
    // a new descriptor.
    unsafe { sys_bpf_fd(BPF_MAP_CREATE, &mut attr, &what) }
}

/// The shortcut map with id `id`, if it still exists and is one (a hash map
/// named `name` with our key and value sizes); `Ok(None)` if not.
pub fn open_map(id: u32, name: &str) -> Result<Option<OwnedFd>> {
    let mut attr = [0u8; ATTR_SIZE];
    put_u32(&mut attr, 0, id);
    let what = format!("bpf(BPF_MAP_GET_FD_BY_ID {id})");
    // SAFETY: the attribute holds an id only; GET_FD_BY_ID returns a new descriptor.
    let fd = match unsafe { sys_bpf_fd(BPF_MAP_GET_FD_BY_ID, &mut attr, &what) } {
        Ok(fd) => fd,
        Err(e) if e.errno() == Some(libc::ENOENT) => return Ok(None),
        Err(e) => return Err(e),
    };
    let info = map_info(fd.as_fd(), &format!("map {id}"))?;
    let u = |o: usize| u32::from_ne_bytes([info[o], info[o + 1], info[o + 2], info[o + 3]]);
    let got_name = info[24..40].split(|b| *b == 0).next().unwrap_or_default();
    let ours = u(0) == BPF_MAP_TYPE_HASH
        && u(8) == KEY_SIZE
        && u(12) == VALUE_SIZE
        && got_name == name.as_bytes();
    Ok(ours.then_some(fd))
}

/// The id of map `map` (what [`open_map`] takes).
pub fn map_id(map: BorrowedFd<'_>) -> Result<u32> {
    let info = map_info(map, "map")?;
    Ok(u32::from_ne_bytes([info[4], info[5], info[6], info[7]]))
}

/// The start of `struct bpf_map_info` of map `map` (type, id, key_size,
/// value_size, max_entries, map_flags, name[16], ...); `what` names it in errors.
fn map_info(map: BorrowedFd<'_>, what: &str) -> Result<[u8; 64]> {
    let mut info = [0u8; 64];
    let mut attr = [0u8; ATTR_SIZE];
    put_u32(&mut attr, 0, map.as_raw_fd() as u32);
    put_u32(&mut attr, 4, info.len() as u32);
    put_u64(&mut attr, 8, info.as_mut_ptr() as u64);
    // SAFETY: the one pointer is to `info`, a live local of the length given
    // at offset 4, which the kernel writes at most.
    unsafe {
        sys_bpf(
            BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
            &format!("bpf(BPF_OBJ_GET_INFO_BY_FD {what})"),
        )
    }?;
    Ok(info)
}

/// Add or replace the entry of the box at `addr`.
pub fn map_set(map: BorrowedFd<'_>, addr: std::net::Ipv4Addr, target: Target) -> Result<()> {
    let key = addr.octets();
    let mut value = [0u8; VALUE_SIZE as usize];
    value[..4].copy_from_slice(&target.ifindex.to_ne_bytes());
    let flags = if target.peer { FLAG_PEER } else { 0 };
    value[4..].copy_from_slice(&flags.to_ne_bytes());
    let mut attr = [0u8; ATTR_SIZE];
    put_u32(&mut attr, 0, map.as_raw_fd() as u32);
    put_u64(&mut attr, 8, key.as_ptr() as u64);
    put_u64(&mut attr, 16, value.as_ptr() as u64);
    // SAFETY: the pointers are to `key` and `value`, live locals of the map's
    // key and value sizes, which the kernel only reads.
    unsafe {
        sys_bpf(
            BPF_MAP_UPDATE_ELEM,
            &mut attr,
            &format!("bpf(BPF_MAP_UPDATE_ELEM {addr})"),
        )
    }?;
    Ok(())
}

/// Remove the entry of the box at `addr`; `Ok(false)` if there was none.
pub fn map_remove(map: BorrowedFd<'_>, addr: std::net::Ipv4Addr) -> Result<bool> {
    let key = addr.octets();
    let mut attr = [0u8; ATTR_SIZE];
    put_u32(&mut attr, 0, map.as_raw_fd() as u32);
    put_u64(&mut attr, 8, key.as_ptr() as u64);
    // SAFETY: the one pointer is to `key`, a live local of the map's key size,
    // which the kernel only reads.
    match unsafe {
        sys_bpf(
            BPF_MAP_DELETE_ELEM,
            &mut attr,
            &format!("bpf(BPF_MAP_DELETE_ELEM {addr})"),
        )
    } {
        Ok(_) => Ok(true),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// One instruction: opcode, destination and source registers, offset, immediate.
pub(crate) use nestbox_sys::bpf::insn;

/// Load the classifier `code` (a box's guard and shortcut, see
/// [`crate::guard`]), named `name`. The returned descriptor is needed only
/// until the program is attached (the filter then holds it, and it holds the
/// map).
pub fn load_program(code: &[[u8; 8]], name: &str) -> Result<OwnedFd> {
    let what = format!("bpf(BPF_PROG_LOAD {name})");
    let load = |log: Option<&mut Vec<u8>>| {
        nestbox_sys::bpf::prog_load(
            BPF_PROG_TYPE_SCHED_CLS,
            code,
            name,
            log.map(|l| l.as_mut_slice()),
        )
        .map_err(sys_err(&what))
    };
    match load(None) {
        Ok(fd) => Ok(fd),
        Err(first) => {
            // Again with the verifier's log, for its last line in the error.
            let mut log = vec![0u8; 16 * 1024];
            if let Ok(fd) = load(Some(&mut log)) {
                // Loaded on the second try (a transient failure): use it.
                tracing::debug!("{what}: loaded on the second try; the first failed: {first}");
                return Ok(fd);
            }
            let text = String::from_utf8_lossy(&log);
            let last = text.trim_end_matches('\0').trim().lines().last();
            match (first, last) {
                (NetError::Sys { call, source }, Some(l)) if !l.is_empty() => Err(NetError::Sys {
                    call: format!("{call} (verifier: {l})"),
                    source,
                }),
                (e, _) => Err(e),
            }
        }
    }
}
