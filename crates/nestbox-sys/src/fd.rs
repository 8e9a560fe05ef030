//! Closing descriptors in bulk: a checked `close_range(2)`, with a fallback
//! that closes (or marks) descriptors one by one on kernels without it.
//!
//! `close_range` appeared in Linux 5.9 and its `CLOSE_RANGE_CLOEXEC` flag in
//! 5.11; where the kernel answers `ENOSYS` (no such call) or `EINVAL` (unknown
//! flag) the same effect is reached with `close(2)` / `fcntl(F_SETFD)` on every
//! descriptor number from `first` up to `last` or the soft `RLIMIT_NOFILE`
//! limit, whichever is lower. The fallback makes plain system calls only, with
//! no allocation and no lock, so it may run in a forked child before `exec`.
//! Its one blind spot: a descriptor numbered above the soft limit (possible
//! only if the limit was lowered after it was opened) is left alone.

use std::os::fd::RawFd;

use nix::errno::Errno;

use crate::Result;

/// The `close_range` syscall number, for callers that inject the call into
/// another process (remote fork) rather than make it themselves.
pub const SYS_CLOSE_RANGE: libc::c_long = libc::SYS_close_range;

/// `close_range` flag: mark the descriptors close-on-exec instead of closing them.
pub const CLOSE_RANGE_CLOEXEC: libc::c_uint = libc::CLOSE_RANGE_CLOEXEC;

/// The three syscall arguments of `close_range(first, last, flags)`, in the
/// order the kernel takes them, for injection into another process.
pub const fn close_range_args(first: u32, last: u32, flags: libc::c_uint) -> [u64; 3] {
    [first as u64, last as u64, flags as u64]
}

/// Grow this process's descriptor table so that descriptors up to number
/// `count - 1` fit (within the soft `RLIMIT_NOFILE`), by duplicating `fd` (any
/// open descriptor) to the highest such number and closing the copy.
///
/// The kernel grows the table by doubling as descriptors are opened, and in
/// a process whose table is shared by several threads each growth waits for
/// an RCU grace period (milliseconds on a virtual machine). A caller about to
/// open many descriptors from several threads calls this first, so that the
/// table grows once, while nothing else waits on it. Best effort: returns
/// whether the table now holds `count` descriptors.
pub fn reserve_table(fd: &impl std::os::fd::AsFd, count: u32) -> bool {
    use std::os::fd::AsRawFd;
    // The highest number wanted, and at most the highest the limit allows.
    let want = count.saturating_sub(1).min(fd_limit());
    match nix::fcntl::fcntl(
        fd.as_fd().as_raw_fd(),
        nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(want as RawFd),
    ) {
        Ok(copy) => {
            // SAFETY: `copy` was just made by F_DUPFD and is owned by nothing
            // else; closing it frees the number, not the table's size.
            unsafe { libc::close(copy) };
            want + 1 >= count
        }
        Err(_) => false,
    }
}

/// Close every descriptor of this process numbered `first..=last`.
///
/// Checked: an error of the kernel other than "not supported" is returned, and
/// on a kernel without `close_range` the descriptors are closed one by one (see
/// the module documentation). Async-signal-safe and allocation-free.
///
/// # Safety
/// No live object of this process (an `OwnedFd`, `File`, socket, ...) may own
/// a descriptor in the range and use or close it afterwards: its number could
/// by then name another object (I/O safety). In practice: call it in a forked
/// child that is about to `exec` or `_exit`, after forgetting what it owned.
pub unsafe fn close_range(first: u32, last: u32) -> Result<()> {
    if first > last {
        return Ok(());
    }
    match raw_close_range(first, last, 0) {
        // SAFETY: the caller upholds the same condition for the same range.
        Err(Errno::ENOSYS | Errno::EINVAL) => unsafe { close_each(first, last) },
        other => other,
    }
}

/// The fallback of [`close_range`]: `close(2)` on every number of the range
/// up to [`fd_limit`].
///
/// # Safety
/// As for [`close_range`].
unsafe fn close_each(first: u32, last: u32) -> Result<()> {
    for fd in first..=last.min(fd_limit()) {
        // SAFETY: the caller guarantees no live object owns a descriptor in the
        // range; close on a number that is not open fails with EBADF, and any
        // other failure of close still frees the number (Linux).
        unsafe { libc::close(fd as RawFd) };
    }
    Ok(())
}

/// Mark every descriptor of this process numbered `first..=last` close-on-exec
/// (`close_range` with `CLOSE_RANGE_CLOEXEC`), so none of them survives the next
/// `exec`. Falls back to `fcntl(F_SETFD, FD_CLOEXEC)` on each descriptor where
/// the kernel lacks the flag. Async-signal-safe and allocation-free.
pub fn set_cloexec_range(first: u32, last: u32) -> Result<()> {
    if first > last {
        return Ok(());
    }
    match raw_close_range(first, last, CLOSE_RANGE_CLOEXEC) {
        Err(Errno::ENOSYS | Errno::EINVAL) => cloexec_each(first, last),
        other => other,
    }
}

/// The fallback of [`set_cloexec_range`]: `fcntl(F_SETFD, FD_CLOEXEC)` on every
/// number of the range up to [`fd_limit`].
fn cloexec_each(first: u32, last: u32) -> Result<()> {
    for fd in first..=last.min(fd_limit()) {
        // SAFETY: F_SETFD takes an integer and only changes the close-on-exec
        // flag of the descriptor (EBADF when not open).
        let rc = unsafe { libc::fcntl(fd as RawFd, libc::F_SETFD, libc::FD_CLOEXEC) };
        if rc < 0 && Errno::last() != Errno::EBADF {
            return Err(Errno::last());
        }
    }
    Ok(())
}

fn raw_close_range(first: u32, last: u32, flags: libc::c_uint) -> Result<()> {
    // SAFETY: integer arguments only. With flags 0 this closes descriptors: both
    // callers state (close_range: as its # Safety section; set_cloexec_range
    // passes CLOSE_RANGE_CLOEXEC, which closes nothing) why that is sound.
    let rc = unsafe { libc::syscall(SYS_CLOSE_RANGE, first, last, flags) };
    Errno::result(rc).map(drop)
}

/// The highest descriptor number the fallback visits: one below the soft
/// `RLIMIT_NOFILE` limit (at most `i32::MAX`; 1,048,576 when unknown).
fn fd_limit() -> u32 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer for one rlimit.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    let soft = if rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
        lim.rlim_cur
    } else {
        1 << 20
    };
    soft.clamp(1, i32::MAX as u64) as u32 - 1
}

/// `struct open_how` of `openat2(2)`.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `RESOLVE_IN_ROOT`: resolve as if `dirfd` were the root (`..` and absolute
/// symlinks stay below it).
const RESOLVE_IN_ROOT: u64 = 0x10;

/// Open `path` below directory `root` as if `root` were `/` (`openat2` with
/// `RESOLVE_IN_ROOT`): a path or symlink of a box cannot lead out of the
/// box's root. `flags` and `mode` as for `open(2)`; the result is
/// close-on-exec.
pub fn open_in_root(
    root: std::os::fd::BorrowedFd<'_>,
    path: &std::ffi::CStr,
    flags: i32,
    mode: u32,
) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let how = OpenHow {
        flags: (flags | libc::O_CLOEXEC) as u32 as u64,
        mode: if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 {
            u64::from(mode & 0o7777)
        } else {
            0
        },
        resolve: RESOLVE_IN_ROOT,
    };
    // SAFETY: `path` is NUL-terminated and `how` is a valid `open_how` of the
    // size passed; both live for the call, which only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            root.as_raw_fd(),
            path.as_ptr(),
            std::ptr::addr_of!(how),
            std::mem::size_of::<OpenHow>(),
        )
    };
    let fd = Errno::result(rc)?;
    // SAFETY: openat2 returned a new descriptor nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, IntoRawFd};

    #[test]
    fn reserve_table_grows_the_table_without_keeping_a_descriptor() {
        let table = || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find_map(|l| l.strip_prefix("FDSize:"));
            line.unwrap().trim().parse::<u32>().unwrap()
        };
        assert!(fd_limit() >= 900, "the test needs RLIMIT_NOFILE >= 900");
        let file = std::fs::File::open("/proc/self/status").unwrap();
        assert!(reserve_table(&file, 900));
        assert!(table() >= 900, "table of {} descriptors", table());
        // The copy (number 899) is closed again.
        assert_eq!(
            nix::fcntl::fcntl(899, nix::fcntl::FcntlArg::F_GETFD),
            Err(Errno::EBADF)
        );
    }

    #[test]
    fn open_in_root_keeps_symlinks_and_dotdot_below_the_root() {
        let base =
            std::env::temp_dir().join(format!("nestbox-sys-openroot-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("etc")).unwrap();
        std::fs::write(base.join("etc/hostname"), "inside\n").unwrap();
        std::os::unix::fs::symlink("/etc/hostname", base.join("abs")).unwrap();
        std::os::unix::fs::symlink("../../../../etc/hostname", base.join("rel")).unwrap();
        let root = std::fs::File::open(&base).unwrap();
        for name in ["abs", "rel", "../../etc/hostname", "etc/hostname"] {
            let path = std::ffi::CString::new(name).unwrap();
            let fd = open_in_root(std::os::fd::AsFd::as_fd(&root), &path, libc::O_RDONLY, 0)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let text = std::io::read_to_string(std::fs::File::from(fd)).unwrap();
            assert_eq!(text, "inside\n", "{name} resolves below the root");
        }
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn args_are_in_kernel_order() {
        assert_eq!(
            close_range_args(3, u32::MAX, CLOSE_RANGE_CLOEXEC),
            [3, u32::MAX as u64, 4]
        );
    }

    #[test]
    fn cloexec_marks_and_close_closes() {
        let fd = std::fs::File::open("/dev/null").unwrap().into_raw_fd();
        set_cloexec_range(fd as u32, fd as u32).unwrap();
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        // SAFETY: `fd` was released from its File above; nothing else owns it.
        unsafe { close_range(fd as u32, fd as u32) }.unwrap();
        // SAFETY: F_GETFD on a number that is now closed.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFD) }, -1);
        assert_eq!(Errno::last(), Errno::EBADF);
        // An empty range is nothing to do, not an error.
        let keep = std::fs::File::open("/dev/null").unwrap();
        // SAFETY: the range is empty.
        unsafe { close_range(10, 9) }.unwrap();
        assert!(is_open(keep.as_raw_fd()));
    }

    /// The one-by-one fallbacks (what an old kernel gets) on a few descriptors
    /// released from their owners, with a gap in the range.
    #[test]
    fn fallbacks_mark_and_close_each_descriptor() {
        let fds: Vec<RawFd> = (0..3)
            .map(|_| std::fs::File::open("/dev/null").unwrap().into_raw_fd())
            .collect();
        let (lo, hi) = (*fds.iter().min().unwrap(), *fds.iter().max().unwrap());
        cloexec_each(lo as u32, hi as u32 + 2).unwrap();
        for &fd in &fds {
            // SAFETY: F_GETFD on a descriptor we own.
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        }
        // The test harness's other threads may open descriptors meanwhile: close
        // only ours, each as a range of one.
        for &fd in &fds {
            // SAFETY: `fd` was released from its File; nothing else owns it.
            unsafe { close_each(fd as u32, fd as u32) }.unwrap();
            assert!(!is_open(fd));
        }
    }

    #[test]
    fn fallback_limit_is_below_the_soft_limit() {
        assert!(fd_limit() >= 2);
    }

    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD takes an integer and reads only the descriptor's flags.
        unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
    }
}
