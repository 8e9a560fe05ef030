//! Credentials of the calling thread for one call: opening a file as another
//! user without changing the rest of the process.
//!
//! The kernel keeps credentials per thread. glibc's `setresuid` changes them
//! in every thread of the process (POSIX semantics); the raw system call
//! changes the calling thread's only, which is what is wanted here. An open
//! file keeps the credentials it was opened with (`f_cred`), and some files
//! judge a write by them rather than by the writer's: a cgroup v1 `tasks` or
//! `cgroup.procs` file lets an opener that is not the initial user
//! namespace's root move only processes whose uid or saved uid is the
//! opener's effective uid. nestbox inside a box (root of the box's user
//! namespace only) opens them as the owner of the processes it moves.

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::Result;

/// Open `path` for writing (`O_WRONLY | O_CLOEXEC`) with the calling thread's
/// effective uid (and with it its file-system uid) set to `euid` for the
/// `open` only; the thread's uid is set back right after, before this returns.
/// The file is checked against `euid` (its owner must let `euid` write; the
/// effective capabilities are dropped while the uid is not 0) and keeps
/// `euid` as its opener's. When the effective uid was 0, the kernel gives the
/// thread its permitted capabilities as effective ones again on the way
/// back (a caller whose effective set was smaller gets the permitted one).
///
/// Needs `CAP_SETUID` in the caller's user namespace (or `euid` equal to its
/// real or saved uid), and `euid` mapped there. Refused with `EPERM` when the
/// thread's effective uid is neither its real nor its saved uid: it could not
/// be set back without the capability the switch drops. Should setting it
/// back fail anyway, the process is aborted rather than let a thread go on
/// under the wrong identity.
pub fn open_for_writing_as(path: &Path, euid: u32) -> Result<OwnedFd> {
    let flags = OFlag::O_WRONLY | OFlag::O_CLOEXEC;
    let (ruid, own, suid) = thread_resuid()?;
    if own == euid {
        return open(path, flags);
    }
    if own != ruid && own != suid {
        return Err(Errno::EPERM);
    }
    set_thread_euid(euid)?;
    let opened = open(path, flags);
    if let Err(e) = set_thread_euid(own) {
        eprintln!(
            "nestbox: cannot set the thread's effective uid back to {own} ({e}); aborting rather than go on as {euid}"
        );
        std::process::abort();
    }
    opened
}

fn open(path: &Path, flags: OFlag) -> Result<OwnedFd> {
    let fd = nix::fcntl::open(path, flags, Mode::empty())?;
    // SAFETY: open just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The calling thread's real, effective and saved uids.
fn thread_resuid() -> Result<(u32, u32, u32)> {
    let (mut r, mut e, mut s): (libc::uid_t, libc::uid_t, libc::uid_t) = (0, 0, 0);
    // SAFETY: getresuid writes three uid_t through pointers to live locals.
    let ret = unsafe { libc::getresuid(&mut r, &mut e, &mut s) };
    Errno::result(ret)?;
    Ok((r, e, s))
}

/// Set the calling thread's effective uid only (real and saved unchanged).
fn set_thread_euid(euid: u32) -> Result<()> {
    // -1: unchanged.
    let keep = libc::uid_t::MAX;
    // SAFETY: the raw setresuid changes the calling thread's credentials only
    // and touches no memory; glibc's wrapper is avoided on purpose, as it
    // would change every thread of the process.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_setresuid,
            keep as libc::c_long,
            euid as libc::c_long,
            keep as libc::c_long,
        )
    };
    Errno::result(ret).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// As root: a file only uid 4242 may write is opened as 4242 (not as
    /// root, whose capabilities are dropped meanwhile: a root-only file is
    /// refused), and the thread is root again afterwards.
    #[test]
    fn opens_as_another_uid_and_comes_back() {
        if !nestbox_testkit::require_root("opens_as_another_uid_and_comes_back") {
            return;
        }
        let dir = tempfile_dir();
        let theirs = dir.join("theirs");
        let roots = dir.join("roots");
        for (p, owner) in [(&theirs, 4242), (&roots, 0)] {
            std::fs::write(p, "").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
            std::os::unix::fs::chown(p, Some(owner), Some(0)).unwrap();
        }
        // In a thread of its own, so that a failure leaves the test's other
        // threads alone.
        std::thread::spawn(move || {
            assert!(open_for_writing_as(&theirs, 4242).is_ok());
            assert_eq!(
                open_for_writing_as(&roots, 4242).unwrap_err(),
                Errno::EACCES
            );
            assert_eq!(thread_resuid().unwrap(), (0, 0, 0));
            // The effective capabilities are back too.
            assert!(open_for_writing_as(&roots, 0).is_ok());
            std::fs::remove_dir_all(dir).unwrap();
        })
        .join()
        .unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("nestbox-sys-creds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir
    }
}
