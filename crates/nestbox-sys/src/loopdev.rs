//! Loop devices: attach a regular file as a block device (`/dev/loop-control`
//! `LOOP_CTL_GET_FREE`, then `LOOP_CONFIGURE` on the free device).
//!
//! Used for a box's size-limited writable layer (`--disk`): the device is
//! configured with `LO_FLAGS_AUTOCLEAR`, so the kernel detaches it by itself
//! when its last user goes — the caller's descriptor if nothing was mounted,
//! else the last mount of the filesystem on it. No detach call exists here on
//! purpose: nothing can be left attached by a caller that forgets one.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

use nix::errno::Errno;

use crate::Result;

/// `LOOP_CTL_GET_FREE` (linux/loop.h).
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `LOOP_CONFIGURE` (linux/loop.h, Linux 5.8+).
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
/// Detach the device when its last user closes it.
const LO_FLAGS_AUTOCLEAR: u32 = 4;
/// Read and write the backing file with direct I/O (no second copy of the
/// data in the page cache); the kernel falls back to buffered I/O where the
/// backing filesystem cannot.
const LO_FLAGS_DIRECT_IO: u32 = 16;
/// How many times a device taken by someone else between the two calls is
/// skipped for the next free one.
const ATTEMPTS: usize = 16;

/// `struct loop_info64` (linux/loop.h).
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` (linux/loop.h).
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// A loop device attached to a file: its path and an open descriptor. The
/// device stays attached while the descriptor is open or a filesystem on it
/// is mounted, and detaches itself after both are gone.
#[derive(Debug)]
pub struct Attached {
    /// `/dev/loopN`.
    pub path: String,
    /// The open device.
    pub device: OwnedFd,
}

/// Attach `backing` (an open regular file, read-write) to a free loop device
/// with `LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO`. Needs `CAP_SYS_ADMIN` in
/// the initial user namespace.
pub fn attach(backing: BorrowedFd<'_>) -> Result<Attached> {
    let control = File::open("/dev/loop-control").map_err(io_errno)?;
    let mut last = Errno::EBUSY;
    for _ in 0..ATTEMPTS {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a number.
        let n = Errno::result(unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) })?;
        let path = format!("/dev/loop{n}");
        let device: OwnedFd = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(f) => f.into(),
            Err(e) => return Err(io_errno(e)),
        };
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO,
                lo_file_name: [0; 64],
                lo_crypt_name: [0; 64],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which
        // `config` is (repr(C), the kernel's layout), alive for the call.
        match Errno::result(unsafe { libc::ioctl(device.as_raw_fd(), LOOP_CONFIGURE, &config) }) {
            Ok(_) => return Ok(Attached { path, device }),
            // Taken by another process between the two calls: the next one.
            Err(Errno::EBUSY) => last = Errno::EBUSY,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

fn io_errno(e: std::io::Error) -> Errno {
    Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_kernel() {
        // linux/loop.h: loop_info64 is 232 bytes, loop_config 304.
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
