//! Loading a compiled [`Program`] into the kernel with `seccomp(2)`.
//!
//! The filter applies to the calling thread and everything it later forks or execs;
//! it cannot be removed. The kernel only accepts it from a thread that has set
//! `no_new_privs` (`prctl(PR_SET_NO_NEW_PRIVS, 1)`) or has `CAP_SYS_ADMIN`; setting
//! that is the caller's job (see [`set_no_new_privs`]).
//!
//! [`Program::install`] makes exactly one syscall and does not allocate, even on
//! failure, so it may be called between `fork` and `exec`.

use std::io;

use crate::bpf::Program;
use crate::error::SeccompError;

/// `SECCOMP_SET_MODE_FILTER`.
const SECCOMP_SET_MODE_FILTER: libc::c_uint = 1;

/// `SECCOMP_FILTER_FLAG_NEW_LISTENER`: the call returns a notification fd.
const SECCOMP_FILTER_FLAG_NEW_LISTENER: libc::c_ulong = 1 << 3;

impl Program {
    /// Install this filter on the calling thread with
    /// `seccomp(SECCOMP_SET_MODE_FILTER, 0, prog)`.
    ///
    /// No flags are passed: other threads of the process are not affected (install
    /// before spawning threads, or in the single-threaded child before `exec`).
    ///
    /// # Errors
    /// [`SeccompError::UnsupportedArch`] when not built for x86_64;
    /// [`SeccompError::Install`] when the kernel refuses, with a hint chosen from the
    /// errno (`EACCES`: `no_new_privs` is not set; `EINVAL`: the kernel lacks
    /// seccomp filters or rejected the program; `ENOMEM`: too many or too long
    /// filters are already stacked).
    pub fn install(&self) -> Result<(), SeccompError> {
        self.install_with(0).map(|_| ())
    }

    /// Install this filter like [`Program::install`], with
    /// `SECCOMP_FILTER_FLAG_NEW_LISTENER`: the calls it answers with
    /// [`crate::Action::Notify`] wait for an answer on the returned fd
    /// (close-on-exec; see `nestbox_sys::seccomp_notify`). Makes one syscall and
    /// does not allocate.
    ///
    /// # Errors
    /// As [`Program::install`]; `EBUSY` when a filter with a listener is
    /// already installed on this thread.
    pub fn install_with_listener(&self) -> Result<std::os::fd::OwnedFd, SeccompError> {
        let fd = self.install_with(SECCOMP_FILTER_FLAG_NEW_LISTENER)?;
        // SAFETY: with NEW_LISTENER the kernel returned a new descriptor that
        // nothing else owns.
        Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
    }

    fn install_with(&self, flags: libc::c_ulong) -> Result<libc::c_long, SeccompError> {
        if !cfg!(target_arch = "x86_64") {
            return Err(SeccompError::UnsupportedArch {
                arch: std::env::consts::ARCH,
            });
        }
        let len =
            libc::c_ushort::try_from(self.insns.len()).map_err(|_| SeccompError::Install {
                hint: "program too long",
                source: io::Error::from_raw_os_error(libc::EINVAL),
            })?;
        let prog = libc::sock_fprog {
            len,
            // The kernel only reads through this pointer (the uapi type is not const).
            filter: self.insns.as_ptr().cast_mut(),
        };
        // SAFETY: `prog` points at `len` initialised `sock_filter`s owned by `self`,
        // which outlives the call; the kernel copies the program before returning and
        // never writes through the pointer. The call affects only the seccomp state of
        // this thread (and, with NEW_LISTENER, adds a descriptor the caller takes
        // ownership of), which cannot violate any Rust invariant.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_seccomp,
                libc::c_ulong::from(SECCOMP_SET_MODE_FILTER),
                flags,
                std::ptr::addr_of!(prog),
            )
        };
        if rc >= 0 {
            return Ok(rc);
        }
        let source = io::Error::last_os_error();
        let hint = match source.raw_os_error() {
            Some(libc::EACCES) => "no_new_privs is not set and the caller lacks CAP_SYS_ADMIN",
            Some(libc::EINVAL) => "the kernel rejected the program or lacks seccomp filter support",
            Some(libc::ENOMEM) => "the kernel's limit on stacked filter size was reached",
            Some(libc::EFAULT) => "the program address was invalid",
            Some(libc::ENOSYS) => "the kernel has no seccomp(2) syscall",
            Some(libc::EBUSY) => "a filter with a listener is installed already",
            _ => "the kernel refused the filter",
        };
        Err(SeccompError::Install { hint, source })
    }
}

/// Set `no_new_privs` on the calling thread (`prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)`),
/// which lets an unprivileged thread install a filter. Irreversible; inherited by
/// children and kept across `execve`. Does not allocate.
pub fn set_no_new_privs() -> io::Result<()> {
    // The kernel insists on arg2 == 1 and zero arg3..5 as full `unsigned long`s, so
    // they are passed at that width through the variadic call.
    let (one, zero): (libc::c_ulong, libc::c_ulong) = (1, 0);
    // SAFETY: PR_SET_NO_NEW_PRIVS takes integer arguments only and just sets a flag
    // on the calling thread; no memory is passed to the kernel.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
