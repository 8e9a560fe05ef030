//! Network namespaces given as file descriptors: making a new one, running
//! code inside one on a short-lived thread (a network namespace is per thread,
//! so the caller's own thread never changes namespace), and opening an
//! rtnetlink socket inside one, also from a nestbox nested in a user
//! namespace ([`netlink_in`]).

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

/// Whether this nestbox runs in a user namespace (its `uid_map` is not the
/// initial namespace's identity map): a nestbox inside a nest box, root of
/// the box's user namespace only. It then cannot `setns` into its boxes'
/// network namespaces from a thread, load BPF programs or touch the host's
/// network; see [`netlink_in`] and the nftables guard ([`crate::nft`]).
pub fn in_user_namespace() -> bool {
    match std::fs::read_to_string("/proc/self/uid_map") {
        Ok(map) => {
            let fields: Vec<&str> = map.split_whitespace().collect();
            fields != ["0", "0", "4294967295"]
        }
        // No procfs to tell: assume the host.
        Err(_) => false,
    }
}

/// An rtnetlink socket in network namespace `ns`. On the host it is opened
/// on a thread that joins `ns` ([`run_in`]); in a user namespace
/// ([`in_user_namespace`]), where joining needs `CAP_SYS_ADMIN` the caller
/// lacks, by a child that joins `ns`'s owning user namespace first
/// ([`nestbox_sys::ns::socket_in_owned_netns`]: `ns` must be owned by a user
/// namespace the caller's uid created, as a nested box's is).
pub fn netlink_in(ns: BorrowedFd<'_>) -> Result<crate::netlink::Netlink> {
    if !in_user_namespace() {
        return run_in(ns, crate::netlink::Netlink::open);
    }
    let fd = nestbox_sys::ns::socket_in_owned_netns(
        ns,
        libc::AF_NETLINK,
        libc::SOCK_RAW,
        libc::NETLINK_ROUTE,
    )
    .map_err(|e| {
        NetError::sys(
            "open a netlink socket in the box's network namespace (through its user namespace)",
            e,
        )
    })?;
    crate::netlink::Netlink::from_fd(fd)
}
