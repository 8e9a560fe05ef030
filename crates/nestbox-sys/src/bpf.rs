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
