//! `process.terminal`: a pseudo-terminal for the container's process whose
//! master side is handed to the caller over `--console-socket` (a Unix
//! socket; the master travels as `SCM_RIGHTS`, as runc sends it), and whose
//! slave side becomes the process's stdin, stdout, stderr and controlling
//! terminal.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;

use nix::fcntl::OFlag;
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

use crate::{OciError, Result};

/// Connect to the console socket (done on the runtime side, before the
/// container's process loses sight of the host's paths).
pub fn connect(path: &Path) -> Result<UnixStream> {
    UnixStream::connect(path).map_err(|e| OciError::io("connect to console socket", path, e))
}

/// Open a terminal (through the calling process's `/dev/ptmx`), send its
/// master over `socket` and give its slave side.
pub fn open_and_send(socket: &UnixStream) -> Result<OwnedFd> {
    let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)
        .map_err(|e| OciError::sys("open /dev/ptmx", e))?;
    grantpt(&master).map_err(|e| OciError::sys("grantpt", e))?;
    unlockpt(&master).map_err(|e| OciError::sys("unlockpt", e))?;
    let name = ptsname_r(&master).map_err(|e| OciError::sys("ptsname", e))?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(&name)
        .map_err(|e| OciError::io("open terminal", &name, e))?
        .into();
    let fds = [master.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let iov = [IoSlice::new(name.as_bytes())];
    sendmsg::<()>(socket.as_raw_fd(), &iov, &cmsg, MsgFlags::empty(), None)
        .map_err(|e| OciError::sys("send the terminal over the console socket", e))?;
    Ok(slave)
}

/// Open a terminal (through the calling process's `/dev/ptmx`), send its
/// master over `socket`, and make its slave the caller's stdio and
/// controlling terminal (the caller must lead a new session).
pub fn attach(socket: &UnixStream) -> Result<()> {
    let slave = open_and_send(socket)?;
    for target in 0..=2 {
        nix::unistd::dup2(slave.as_raw_fd(), target)
            .map_err(|e| OciError::sys("dup2 terminal", e))?;
    }
    nestbox_sys::tty::set_controlling_tty(slave.as_raw_fd())
        .map_err(|e| OciError::sys("ioctl(TIOCSCTTY)", e))
}
