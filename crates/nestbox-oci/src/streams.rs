//! The standard streams a container forked from a template gets: those the
//! caller gave `create` (conmon's pipes, the containerd shim's fifos), or,
//! when `process.terminal` is true, the slave side of a new terminal whose
//! master goes to the caller over `--console-socket`.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use crate::{OciError, Result};

/// The clone's stdin, stdout and stderr: new descriptors (close-on-exec)
/// for this process's own 0, 1 and 2 (`/dev/null` for one that is not
/// open), or three for a terminal's slave whose master is sent over
/// `console_socket`.
pub fn for_clone(console_socket: Option<&Path>) -> Result<[OwnedFd; 3]> {
    if let Some(path) = console_socket {
        let socket = crate::console::connect(path)?;
        let slave = crate::console::open_and_send(&socket)?;
        let copy = |fd: &OwnedFd| fd.try_clone().map_err(|e| OciError::io("dup", path, e));
        return Ok([copy(&slave)?, copy(&slave)?, slave]);
    }
    let own = |fd: i32| -> Result<OwnedFd> {
        // SAFETY: fds 0 to 2 are this process's for its whole life; the
        // borrow lasts only for the duplication below, and a closed one
        // fails it with EBADF (then /dev/null stands in).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        match borrowed.try_clone_to_owned() {
            Ok(dup) => Ok(dup),
            Err(e) if e.raw_os_error() == Some(libc::EBADF) => std::fs::OpenOptions::new()
                .read(fd == 0)
                .write(fd != 0)
                .open("/dev/null")
                .map(OwnedFd::from)
                .map_err(|e| OciError::io("open", "/dev/null", e)),
            Err(e) => Err(OciError::io("dup", format!("descriptor {fd}"), e)),
        }
    };
    Ok([own(0)?, own(1)?, own(2)?])
}

/// Point this process's descriptors 0, 1 and 2 at `/dev/null`, so that it
/// keeps none of the streams its caller gave it (best effort: one that
/// cannot be replaced stays).
pub fn release_own() {
    let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    else {
        return;
    };
    for fd in 0..=2 {
        let _ = nix::unistd::dup2(null.as_raw_fd(), fd);
    }
}
