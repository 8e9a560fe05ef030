//! Terminals: making one the controlling terminal of the calling process.

use std::os::fd::RawFd;

use crate::{Errno, Result};

/// Make the terminal `fd` the controlling terminal of the calling process
/// (`ioctl(TIOCSCTTY, 0)`); the caller must lead a session that has none.
pub fn set_controlling_tty(fd: RawFd) -> Result<()> {
    // SAFETY: TIOCSCTTY takes an integer argument (0: do not steal a terminal
    // another session holds) and touches no memory of this process.
    let r = unsafe { libc::ioctl(fd, libc::TIOCSCTTY, 0) };
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}
