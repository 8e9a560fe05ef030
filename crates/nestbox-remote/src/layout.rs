//! Kernel structures as bytes, for the arguments of syscalls injected into a
//! tracee: each one is written (and read back) field by field at the offsets
//! of the kernel's x86_64 layout, with every padding byte zero. No struct is
//! ever viewed as bytes in place, since reading its padding would be
//! undefined behaviour.

use std::mem::{offset_of, size_of};

/// Write `v` at `at` in `buf`.
fn put_u64(buf: &mut [u8], at: usize, v: u64) {
    buf[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

fn put_i32(buf: &mut [u8], at: usize, v: i32) {
    buf[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u32(buf: &mut [u8], at: usize, v: u32) {
    buf[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

/// The `u64` at `at` in `buf` (0 past its end).
fn get_u64(buf: &[u8], at: usize) -> u64 {
    buf.get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_ne_bytes)
}

fn get_i32(buf: &[u8], at: usize) -> i32 {
    buf.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, i32::from_ne_bytes)
}

/// `struct iovec { iov_base, iov_len }` for an address in the tracee.
pub(crate) fn iovec(base: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; size_of::<libc::iovec>()];
    put_u64(&mut out, offset_of!(libc::iovec, iov_base), base);
    put_u64(&mut out, offset_of!(libc::iovec, iov_len), len);
    out
}

/// A `struct msghdr` with no name, `iovlen` iovecs at `iov` and `controllen`
/// bytes of control buffer at `control` (addresses in the tracee).
pub(crate) fn msghdr(iov: u64, iovlen: u64, control: u64, controllen: u64) -> Vec<u8> {
    let mut out = vec![0u8; size_of::<libc::msghdr>()];
    put_u64(&mut out, offset_of!(libc::msghdr, msg_name), 0);
    put_u32(&mut out, offset_of!(libc::msghdr, msg_namelen), 0);
    put_u64(&mut out, offset_of!(libc::msghdr, msg_iov), iov);
    put_u64(&mut out, offset_of!(libc::msghdr, msg_iovlen), iovlen);
    put_u64(&mut out, offset_of!(libc::msghdr, msg_control), control);
    put_u64(
        &mut out,
        offset_of!(libc::msghdr, msg_controllen),
        controllen,
    );
    put_i32(&mut out, offset_of!(libc::msghdr, msg_flags), 0);
    out
}

/// What the kernel wrote back into a `msghdr` after `recvmsg`: (control
/// length, flags).
pub(crate) fn msghdr_result(bytes: &[u8]) -> (u64, i32) {
    (
        get_u64(bytes, offset_of!(libc::msghdr, msg_controllen)),
        get_i32(bytes, offset_of!(libc::msghdr, msg_flags)),
    )
}

/// Length of a `struct cmsghdr` (`CMSG_LEN(0)`: `cmsg_len`, level, type).
pub(crate) const CMSG_HDR_LEN: usize = size_of::<libc::cmsghdr>();

/// `CMSG_SPACE(payload)`: header plus payload rounded up to 8 bytes.
pub(crate) const fn cmsg_space(payload: usize) -> usize {
    CMSG_HDR_LEN + payload.next_multiple_of(size_of::<usize>())
}

/// The header of the first control message in `control`: (`cmsg_len`,
/// `cmsg_level`, `cmsg_type`); `None` when `control` is too short.
pub(crate) fn cmsghdr(control: &[u8]) -> Option<(usize, i32, i32)> {
    (control.len() >= CMSG_HDR_LEN).then(|| {
        (
            get_u64(control, offset_of!(libc::cmsghdr, cmsg_len)) as usize,
            get_i32(control, offset_of!(libc::cmsghdr, cmsg_level)),
            get_i32(control, offset_of!(libc::cmsghdr, cmsg_type)),
        )
    })
}

/// `struct clone_args` of `clone3` up to `cgroup` (`CLONE_ARGS_SIZE_VER2`,
/// 88 bytes: eleven `u64`s, so no padding at all).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CloneArgs {
    pub flags: u64,
    pub pidfd: u64,
    pub child_tid: u64,
    pub parent_tid: u64,
    pub exit_signal: u64,
    pub stack: u64,
    pub stack_size: u64,
    pub tls: u64,
    pub set_tid: u64,
    pub set_tid_size: u64,
    pub cgroup: u64,
}

/// `CLONE_ARGS_SIZE_VER2`.
pub(crate) const CLONE_ARGS_SIZE: usize = 88;

impl CloneArgs {
    /// The kernel's bytes: the fields in declaration order, 8 bytes each.
    pub fn to_bytes(self) -> Vec<u8> {
        [
            self.flags,
            self.pidfd,
            self.child_tid,
            self.parent_tid,
            self.exit_signal,
            self.stack,
            self.stack_size,
            self.tls,
            self.set_tid,
            self.set_tid_size,
            self.cgroup,
        ]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect()
    }
}

/// `stack_t { ss_sp, ss_flags, ss_size }` as bytes.
pub(crate) fn stack_t(ss: &libc::stack_t) -> Vec<u8> {
    let mut out = vec![0u8; size_of::<libc::stack_t>()];
    put_u64(&mut out, offset_of!(libc::stack_t, ss_sp), ss.ss_sp as u64);
    put_i32(&mut out, offset_of!(libc::stack_t, ss_flags), ss.ss_flags);
    put_u64(
        &mut out,
        offset_of!(libc::stack_t, ss_size),
        ss.ss_size as u64,
    );
    out
}

/// A `stack_t` from the bytes the kernel wrote.
pub(crate) fn parse_stack_t(bytes: &[u8]) -> libc::stack_t {
    libc::stack_t {
        ss_sp: get_u64(bytes, offset_of!(libc::stack_t, ss_sp)) as *mut libc::c_void,
        ss_flags: get_i32(bytes, offset_of!(libc::stack_t, ss_flags)),
        ss_size: get_u64(bytes, offset_of!(libc::stack_t, ss_size)) as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's x86_64 ABI, written out: these are what the tracee's kernel
    /// reads, whatever libc's definitions say.
    #[test]
    fn sizes_and_offsets_match_the_kernel_abi() {
        assert_eq!(size_of::<libc::iovec>(), 16);
        assert_eq!(offset_of!(libc::iovec, iov_len), 8);
        assert_eq!(size_of::<libc::msghdr>(), 56);
        assert_eq!(offset_of!(libc::msghdr, msg_namelen), 8);
        assert_eq!(offset_of!(libc::msghdr, msg_iov), 16);
        assert_eq!(offset_of!(libc::msghdr, msg_iovlen), 24);
        assert_eq!(offset_of!(libc::msghdr, msg_control), 32);
        assert_eq!(offset_of!(libc::msghdr, msg_controllen), 40);
        assert_eq!(offset_of!(libc::msghdr, msg_flags), 48);
        assert_eq!(CMSG_HDR_LEN, 16);
        assert_eq!(offset_of!(libc::cmsghdr, cmsg_level), 8);
        assert_eq!(offset_of!(libc::cmsghdr, cmsg_type), 12);
        assert_eq!(size_of::<libc::stack_t>(), 24);
        assert_eq!(offset_of!(libc::stack_t, ss_flags), 8);
        assert_eq!(offset_of!(libc::stack_t, ss_size), 16);
        assert_eq!(CloneArgs::default().to_bytes().len(), CLONE_ARGS_SIZE);
    }

    #[test]
    fn cmsg_space_agrees_with_libc() {
        for payload in [0usize, 4, 8, 12, 4 * 253] {
            // SAFETY: CMSG_SPACE/CMSG_LEN are pure size computations.
            let (space, len) = unsafe {
                (
                    libc::CMSG_SPACE(payload as u32) as usize,
                    libc::CMSG_LEN(payload as u32) as usize,
                )
            };
            assert_eq!(cmsg_space(payload), space, "payload {payload}");
            assert_eq!(CMSG_HDR_LEN + payload, len, "payload {payload}");
        }
    }

    /// The bytes, read back as the C struct, give the fields that were written:
    /// every field is where the struct has it.
    #[test]
    fn msghdr_round_trips_through_the_c_struct() {
        let bytes = msghdr(0x1000, 1, 0x2000, 24);
        assert_eq!(bytes.len(), size_of::<libc::msghdr>());
        // SAFETY: `bytes` holds size_of::<msghdr>() initialised bytes; a msghdr may
        // hold any bit pattern (integers and raw pointers).
        let m: libc::msghdr = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
        assert_eq!(m.msg_name as u64, 0);
        assert_eq!(m.msg_namelen, 0);
        assert_eq!(m.msg_iov as u64, 0x1000);
        assert_eq!(m.msg_iovlen, 1);
        assert_eq!(m.msg_control as u64, 0x2000);
        assert_eq!(m.msg_controllen, 24);
        assert_eq!(m.msg_flags, 0);
        // Padding after msg_namelen and after msg_flags is zero.
        assert_eq!(&bytes[12..16], &[0; 4]);
        assert_eq!(&bytes[52..56], &[0; 4]);
        let mut back = bytes.clone();
        put_i32(&mut back, 48, libc::MSG_CTRUNC);
        assert_eq!(msghdr_result(&back), (24, libc::MSG_CTRUNC));
    }

    #[test]
    fn iovec_and_stack_t_round_trip() {
        let v = iovec(0xdead_b000, 7);
        // SAFETY: 16 initialised bytes; an iovec may hold any bit pattern.
        let iov: libc::iovec = unsafe { std::ptr::read_unaligned(v.as_ptr().cast()) };
        assert_eq!((iov.iov_base as u64, iov.iov_len), (0xdead_b000, 7));
        let ss = libc::stack_t {
            ss_sp: 0x7000_0000 as *mut libc::c_void,
            ss_flags: libc::SS_ONSTACK,
            ss_size: 65536,
        };
        let b = stack_t(&ss);
        assert_eq!(&b[12..16], &[0; 4]);
        let back = parse_stack_t(&b);
        assert_eq!(
            (back.ss_sp as u64, back.ss_flags, back.ss_size),
            (0x7000_0000, libc::SS_ONSTACK, 65536)
        );
    }

    #[test]
    fn clone_args_fields_in_kernel_order() {
        let a = CloneArgs {
            flags: 1,
            exit_signal: 17,
            set_tid: 0xabc,
            set_tid_size: 1,
            cgroup: 9,
            ..CloneArgs::default()
        };
        let b = a.to_bytes();
        let word = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(
            (word(0), word(4), word(8), word(9), word(10)),
            (1, 17, 0xabc, 1, 9)
        );
    }

    #[test]
    fn cmsghdr_reads_the_header() {
        let mut c = vec![0u8; cmsg_space(8)];
        put_u64(&mut c, 0, (CMSG_HDR_LEN + 8) as u64);
        put_i32(&mut c, 8, libc::SOL_SOCKET);
        put_i32(&mut c, 12, libc::SCM_RIGHTS);
        assert_eq!(
            cmsghdr(&c),
            Some((CMSG_HDR_LEN + 8, libc::SOL_SOCKET, libc::SCM_RIGHTS))
        );
        assert_eq!(cmsghdr(&c[..8]), None);
    }
}
