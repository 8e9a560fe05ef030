//! Network namespaces given as file descriptors: making a new one, and running
//! code inside one on a short-lived thread (a network namespace is per thread,
//! so the caller's own thread never changes namespace).

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::sched::{unshare, CloneFlags};

use crate::error::{NetError, Result};

/// Create a new, empty network namespace and return a descriptor that keeps it
/// alive (the namespace disappears, with its interfaces, when the last
/// descriptor and process are gone). Its loopback is brought up.
pub fn create() -> Result<OwnedFd> {
    std::thread::scope(|s| {
        s.spawn(|| -> Result<OwnedFd> {
            unshare(CloneFlags::CLONE_NEWNET)
                .map_err(|e| NetError::sys("unshare(CLONE_NEWNET)", e))?;
            let f = File::open("/proc/thread-self/ns/net")
                .map_err(|e| NetError::io("open", "/proc/thread-self/ns/net", e))?;
            let mut nl = crate::netlink::Netlink::open()?;
            crate::link::set_up_by_name(&mut nl, "lo")?;
            Ok(f.into())
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// Open the network namespace of process `pid` (`/proc/PID/ns/net`).
pub fn of_pid(pid: i32) -> Result<OwnedFd> {
    let path = format!("/proc/{pid}/ns/net");
    File::open(&path)
        .map(OwnedFd::from)
        .map_err(|e| NetError::io("open", path, e))
}

/// Run `f` on a new thread that has joined the network namespace `ns`, and
/// return its result. Sockets `f` creates belong to that namespace.
pub fn run_in<T: Send>(ns: BorrowedFd<'_>, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || -> Result<T> {
            // For good: the thread ends with `f`.
            nestbox_sys::ns::enter(ns.as_fd(), nestbox_sys::ns::Namespace::Net)
                .map_err(|e| NetError::sys("setns(CLONE_NEWNET)", e))?;
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}
