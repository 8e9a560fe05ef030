//! The `bpf(2)` system call, for the maps and programs of the network's
//! box-to-box shortcut. The attribute (`union bpf_attr`) is a byte buffer the
//! caller fills at the kernel's offsets; some commands take pointers inside it.

use std::os::fd::{FromRawFd, OwnedFd};

use nix::errno::Errno;

use crate::Result;

/// Size of the `union bpf_attr` passed (larger than every command's part
/// nestbox uses; the rest stays zero, as the kernel requires).
pub const ATTR_SIZE: usize = 128;

/// `bpf(cmd, attr, ATTR_SIZE)`: the command's non-negative result.
///
/// # Safety
/// Every pointer the caller stored in `attr` for `cmd` (keys, values, program
/// text, license, log or info buffers) points to live memory of the size the
/// command reads or writes there, and a buffer the kernel writes to is not
/// otherwise borrowed during the call.
pub unsafe fn bpf(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE]) -> Result<i64> {
    // SAFETY: `attr` is a buffer of ATTR_SIZE bytes and the size passed bounds
    // what the kernel reads or writes of it; the pointers inside are valid by
    // the caller's guarantee.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), ATTR_SIZE) };
    Errno::result(r)
}

/// [`bpf`] for a command that returns a new descriptor (map or program
/// creation, `*_GET_FD_BY_ID`), which the caller then owns.
///
/// # Safety
/// As for [`bpf`]; and `cmd` is a command whose result is a new descriptor.
pub unsafe fn bpf_fd(cmd: libc::c_long, attr: &mut [u8; ATTR_SIZE]) -> Result<OwnedFd> {
    // SAFETY: the caller upholds bpf's conditions.
    let fd = unsafe { bpf(cmd, attr) }?;
    let fd = i32::try_from(fd).map_err(|_| Errno::EBADF)?;
    // SAFETY: the command returned a new descriptor (caller's guarantee) that
    // nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;

/// One eBPF instruction: opcode, destination and source registers, offset,
/// immediate.
pub fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | (dst & 0x0f);
    b[2..4].copy_from_slice(&off.to_le_bytes());
    b[4..8].copy_from_slice(&imm.to_le_bytes());
    b
}

/// Load program `code` of type `prog_type` (`BPF_PROG_TYPE_*`) named `name`
/// (at most 15 bytes are kept), under the Apache-2.0 license. With `log`,
/// the verifier writes its log there (for the error of a refused program).
pub fn prog_load(
    prog_type: u32,
    code: &[[u8; 8]],
    name: &str,
    log: Option<&mut [u8]>,
) -> Result<OwnedFd> {
    let code: Vec<u8> = code.concat();
    let license = b"Apache-2.0\0";
    let mut attr = [0u8; ATTR_SIZE];
    let put32 = |a: &mut [u8; ATTR_SIZE], off: usize, v: u32| {
        a[off..off + 4].copy_from_slice(&v.to_ne_bytes())
    };
    let put64 = |a: &mut [u8; ATTR_SIZE], off: usize, v: u64| {
        a[off..off + 8].copy_from_slice(&v.to_ne_bytes())
    };
    put32(&mut attr, 0, prog_type);
    put32(&mut attr, 4, (code.len() / 8) as u32);
    put64(&mut attr, 8, code.as_ptr() as u64);
    put64(&mut attr, 16, license.as_ptr() as u64);
    if let Some(log) = log {
        put32(&mut attr, 24, 1);
        put32(&mut attr, 28, log.len() as u32);
        put64(&mut attr, 32, log.as_mut_ptr() as u64);
    }
    let n = name.len().min(15);
    attr[48..48 + n].copy_from_slice(&name.as_bytes()[..n]);
    // SAFETY: the pointers are to `code` and `license` (read by the kernel,
    // lengths given) and to `log` (written within the length given), all
    // alive for the call; PROG_LOAD returns a new descriptor.
    unsafe { bpf_fd(BPF_PROG_LOAD, &mut attr) }
}

/// Attach program `prog` to `target` (a cgroup directory for the cgroup
/// attach types) as `attach_type` (`BPF_CGROUP_*`) with `flags`
/// (`BPF_F_ALLOW_MULTI`…). The attachment holds the program: `prog` may be
/// closed afterwards.
pub fn prog_attach(
    target: std::os::fd::BorrowedFd<'_>,
    prog: std::os::fd::BorrowedFd<'_>,
    attach_type: u32,
    flags: u32,
) -> Result<()> {
    use std::os::fd::AsRawFd;
    let mut attr = [0u8; ATTR_SIZE];
    attr[0..4].copy_from_slice(&(target.as_raw_fd() as u32).to_ne_bytes());
    attr[4..8].copy_from_slice(&(prog.as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&attach_type.to_ne_bytes());
    attr[12..16].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: PROG_ATTACH's attribute holds descriptors and numbers only, no
    // pointers.
    unsafe { bpf(BPF_PROG_ATTACH, &mut attr) }.map(|_| ())
}
