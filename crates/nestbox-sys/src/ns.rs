//! Joining namespaces with `setns(2)`: for good ([`enter`]) or for a while
//! ([`NsGuard`], which returns the calling thread to where it was).
//!
//! `setns` acts on the calling thread only. A pid namespace changes only where
//! the thread's next children are born (`pid_for_children`), not the thread
//! itself. A user namespace cannot be left again (nobody holds rights in the
//! parent namespace from inside it), so it is joined only with [`enter`].

use std::os::fd::{AsFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sched::CloneFlags;
use nix::sys::stat::Mode;

use crate::Result;

/// A kind of namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Namespace {
    /// User namespace (`CLONE_NEWUSER`).
    User,
    /// IPC namespace (`CLONE_NEWIPC`).
    Ipc,
    /// UTS (hostname) namespace (`CLONE_NEWUTS`).
    Uts,
    /// Network namespace (`CLONE_NEWNET`).
    Net,
    /// Pid namespace (`CLONE_NEWPID`), for children born afterwards.
    Pid,
    /// Cgroup namespace (`CLONE_NEWCGROUP`).
    Cgroup,
    /// Mount namespace (`CLONE_NEWNS`).
    Mnt,
}

impl Namespace {
    /// The `CLONE_NEW*` flag `setns` takes for it.
    pub fn flag(self) -> CloneFlags {
        match self {
            Namespace::User => CloneFlags::CLONE_NEWUSER,
            Namespace::Ipc => CloneFlags::CLONE_NEWIPC,
            Namespace::Uts => CloneFlags::CLONE_NEWUTS,
            Namespace::Net => CloneFlags::CLONE_NEWNET,
            Namespace::Pid => CloneFlags::CLONE_NEWPID,
            Namespace::Cgroup => CloneFlags::CLONE_NEWCGROUP,
            Namespace::Mnt => CloneFlags::CLONE_NEWNS,
        }
    }

    /// Its name under `/proc/PID/ns/`.
    pub fn name(self) -> &'static str {
        match self {
            Namespace::User => "user",
            Namespace::Ipc => "ipc",
            Namespace::Uts => "uts",
            Namespace::Net => "net",
            Namespace::Pid => "pid",
            Namespace::Cgroup => "cgroup",
            Namespace::Mnt => "mnt",
        }
    }

    /// The calling thread's current namespace of this kind (for a pid
    /// namespace: the one its next children are born in).
    fn own_path(self) -> &'static str {
        match self {
            Namespace::User => "/proc/thread-self/ns/user",
            Namespace::Ipc => "/proc/thread-self/ns/ipc",
            Namespace::Uts => "/proc/thread-self/ns/uts",
            Namespace::Net => "/proc/thread-self/ns/net",
            Namespace::Pid => "/proc/thread-self/ns/pid_for_children",
            Namespace::Cgroup => "/proc/thread-self/ns/cgroup",
            Namespace::Mnt => "/proc/thread-self/ns/mnt",
        }
    }
}

/// Join namespace `ns` (an open `/proc/PID/ns/*` file or a pidfd's namespace
/// of kind `kind`) on the calling thread, for good.
pub fn enter(ns: BorrowedFd<'_>, kind: Namespace) -> Result<()> {
    nix::sched::setns(ns, kind.flag())
}

/// Set the hostname of uts namespace `uts` from a short-lived child process
/// that joins user namespace `userns` (the one owning `uts`, or an ancestor
/// of it), then `uts`, and calls `sethostname`; waits for it. For a caller
/// without `CAP_SYS_ADMIN` in its own user namespace (root of a box's user
/// namespace only), which `setns` of a uts namespace needs as well as the
/// capability over the namespace's owner: the owner of `userns` gets every
/// capability in it by joining it, and a user namespace cannot be left
/// again, hence the child. The calling process does not move.
///
/// The child makes system calls only (no allocation, no lock), so the caller
/// may have other threads. The child's error comes back as its exit status.
pub fn set_hostname_from_child(
    userns: BorrowedFd<'_>,
    uts: BorrowedFd<'_>,
    name: &str,
) -> Result<()> {
    // SAFETY: the child below only calls setns, sethostname and _exit (raw
    // system calls through libc, no allocation and no lock), which is safe
    // after a fork of any process; no clone flags.
    match unsafe { crate::process::fork_into(CloneFlags::empty()) }? {
        crate::process::Forked::Child => {
            let set = enter(userns, Namespace::User)
                .and_then(|()| enter(uts, Namespace::Uts))
                .and_then(|()| nix::unistd::sethostname(name));
            crate::process::exit_now(match set {
                Ok(()) => 0,
                Err(e) => e as i32,
            })
        }
        crate::process::Forked::Parent(child) => {
            let status = crate::process::waitpid_raw(child.as_raw(), 0)?.unwrap_or(-1);
            match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
                (true, 0) => Ok(()),
                (true, code) => Err(Errno::from_raw(code)),
                // Killed: nothing says what it did.
                (false, _) => Err(Errno::ECHILD),
            }
        }
    }
}

/// `NS_GET_USERNS` (`_IO(0xb7, 0x1)`): a descriptor of the user namespace
/// that owns a namespace.
const NS_GET_USERNS: libc::c_ulong = 0xb701;

/// The user namespace that owns namespace `ns` (`ioctl(NS_GET_USERNS)`).
pub fn owner(ns: BorrowedFd<'_>) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: NS_GET_USERNS takes no argument and returns a new descriptor
    // (or -1); `ns` is a valid open descriptor for the call.
    let fd = unsafe { libc::ioctl(ns.as_raw_fd(), NS_GET_USERNS as _) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the ioctl just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the calling thread's network namespace is owned by its own user
/// namespace (false, e.g., for a box in a user namespace that shares the
/// host's network): only then does root of that user namespace hold
/// `CAP_NET_ADMIN` over it.
pub fn own_netns_is_owned_by_own_userns() -> Result<bool> {
    let net = open_own(Namespace::Net)?;
    let owner = owner(net.as_fd())?;
    let a = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&owner))?;
    let b = nix::sys::stat::stat("/proc/thread-self/ns/user")?;
    Ok(a.st_ino == b.st_ino && a.st_dev == b.st_dev)
}

/// Open a socket (`socket(domain, ty | SOCK_CLOEXEC, protocol)`) in network
/// namespace `netns`, which the caller cannot join itself: `setns` of a
/// network namespace needs `CAP_SYS_ADMIN` in the caller's own user namespace
/// as well as over the namespace's owner, and root of a box's user namespace
/// (a nestbox inside a nest box) has the second only. A short-lived child
/// joins the user namespace that owns `netns` (created by the caller's uid,
/// so the child gets every capability there), then `netns`, opens the socket
/// and hands it back over a socket pair (`SCM_RIGHTS`); the caller does not
/// move. A socket stays in the namespace it was opened in, and its
/// privileged requests are judged by the credentials it was opened with
/// (those of the child, full over `netns`).
///
/// The child makes system calls only, on buffers made before the fork (no
/// allocation, no lock), so the caller may have other threads.
pub fn socket_in_owned_netns(
    netns: BorrowedFd<'_>,
    domain: libc::c_int,
    ty: libc::c_int,
    protocol: libc::c_int,
) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let (ours, theirs) = nix::sys::socket::socketpair(
        nix::sys::socket::AddressFamily::Unix,
        nix::sys::socket::SockType::Datagram,
        None,
        nix::sys::socket::SockFlag::SOCK_CLOEXEC,
    )?;
    let netns_raw = netns.as_raw_fd();
    let theirs_raw = theirs.as_raw_fd();
    // Everything the child writes into is made here, before the fork.
    let mut byte = [0u8; 1];
    // CMSG_SPACE(sizeof(int)) is 24 bytes on 64-bit Linux; 8-byte aligned.
    let mut control = [0u64; 4];
    // SAFETY: msghdr is plain data; all-zero is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    assert!(space <= std::mem::size_of_val(&control));
    // SAFETY: the child below only calls ioctl, setns, socket, sendmsg and
    // _exit (raw system calls through libc on memory prepared above, no
    // allocation and no lock), which is safe after a fork of any process; no
    // clone flags.
    match unsafe { crate::process::fork_into(CloneFlags::empty()) }? {
        crate::process::Forked::Child => {
            // SAFETY: raw system calls on descriptors valid in this process
            // and on the stack buffers above, which outlive the calls.
            let code = unsafe {
                let userns = libc::ioctl(netns_raw, NS_GET_USERNS as _);
                if userns < 0
                    || libc::setns(userns, libc::CLONE_NEWUSER) != 0
                    || libc::setns(netns_raw, libc::CLONE_NEWNET) != 0
                {
                    *libc::__errno_location()
                } else {
                    let sock = libc::socket(domain, ty | libc::SOCK_CLOEXEC, protocol);
                    if sock < 0 {
                        *libc::__errno_location()
                    } else {
                        msg.msg_iov = &mut iov;
                        msg.msg_iovlen = 1;
                        msg.msg_control = control.as_mut_ptr().cast();
                        msg.msg_controllen = space as _;
                        let cmsg = libc::CMSG_FIRSTHDR(&msg);
                        (*cmsg).cmsg_level = libc::SOL_SOCKET;
                        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                        (*cmsg).cmsg_len =
                            libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
                        std::ptr::write_unaligned(
                            libc::CMSG_DATA(cmsg).cast::<libc::c_int>(),
                            sock,
                        );
                        if libc::sendmsg(theirs_raw, &msg, 0) < 0 {
                            *libc::__errno_location()
                        } else {
                            0
                        }
                    }
                }
            };
            crate::process::exit_now(code)
        }
        crate::process::Forked::Parent(child) => {
            drop(theirs);
            let status = crate::process::waitpid_raw(child.as_raw(), 0)?.unwrap_or(-1);
            match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
                (true, 0) => {}
                (true, code) => return Err(Errno::from_raw(code)),
                (false, _) => return Err(Errno::ECHILD),
            }
            let mut buf = [0u8; 1];
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!(libc::c_int);
            let got = nix::sys::socket::recvmsg::<()>(
                ours.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                nix::sys::socket::MsgFlags::MSG_CMSG_CLOEXEC
                    | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            )?;
            for c in got.cmsgs()? {
                if let nix::sys::socket::ControlMessageOwned::ScmRights(fds) = c {
                    if let Some(&fd) = fds.first() {
                        // SAFETY: the kernel just installed this descriptor
                        // for us; nothing else owns it.
                        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
                    }
                }
            }
            Err(Errno::EBADMSG)
        }
    }
}

/// A thread's stay in another namespace: [`NsGuard::enter`] joins it and
/// keeps a handle on the namespace the thread was in; [`NsGuard::leave`] (or
/// dropping the guard) returns there.
///
/// A thread that cannot return must not go on silently: it would act on the
/// box's links, hostname or mounts as if they were the host's. So
///
/// * [`NsGuard::leave`] returns the error; the thread is then still in the
///   entered namespace and the caller must end what it was doing (nestbox's
///   callers propagate the error to the end of the process);
/// * dropping a guard that fails to return prints one line to stderr and
///   **aborts the process** (a drop cannot return an error);
/// * [`NsGuard::stay`] is for a forked child that is meant to keep the entered
///   namespace: it forgets the way back without moving.
#[derive(Debug)]
#[must_use = "dropping the guard returns the thread to its namespace at once"]
pub struct NsGuard {
    kind: Namespace,
    original: Option<OwnedFd>,
}

impl NsGuard {
    /// Join `ns` (of kind `kind`) on the calling thread, remembering where it
    /// was. Fails with `EINVAL` for [`Namespace::User`], which cannot be left.
    pub fn enter(ns: BorrowedFd<'_>, kind: Namespace) -> Result<NsGuard> {
        if kind == Namespace::User {
            return Err(Errno::EINVAL);
        }
        let original = open_own(kind)?;
        enter(ns, kind)?;
        Ok(NsGuard {
            kind,
            original: Some(original),
        })
    }

    /// The kind of namespace entered.
    pub fn kind(&self) -> Namespace {
        self.kind
    }

    /// Return the thread to the namespace it was in. On error the thread is
    /// still in the entered namespace (see the type's documentation).
    pub fn leave(mut self) -> Result<()> {
        match self.original.take() {
            Some(fd) => enter(fd.as_fd(), self.kind),
            None => Ok(()),
        }
    }

    /// Stay in the entered namespace for good (in a forked child that is meant
    /// to live there): the way back is closed, nothing moves.
    pub fn stay(mut self) {
        self.original = None;
    }
}

impl Drop for NsGuard {
    fn drop(&mut self) {
        let Some(fd) = self.original.take() else {
            return;
        };
        if let Err(e) = enter(fd.as_fd(), self.kind) {
            eprintln!(
                "nestbox: cannot return to the original {} namespace ({e}); aborting rather than go on in the wrong one",
                self.kind.name()
            );
            std::process::abort();
        }
    }
}

fn open_own(kind: Namespace) -> Result<OwnedFd> {
    let fd = nix::fcntl::open(
        kind.own_path(),
        OFlag::O_RDONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: open just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn uts_ino() -> u64 {
        std::fs::metadata("/proc/thread-self/ns/uts").unwrap().ino()
    }

    #[test]
    fn user_namespaces_are_not_guarded() {
        let own = open_own(Namespace::User).unwrap();
        assert_eq!(
            NsGuard::enter(own.as_fd(), Namespace::User).unwrap_err(),
            Errno::EINVAL
        );
    }

    /// Enter a fresh uts namespace (made by a child thread) and come back.
    #[test]
    fn guard_returns_to_the_original() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        let before = uts_ino();
        // A thread of its own: unshare affects the calling thread only.
        let other = std::thread::spawn(|| {
            nix::sched::unshare(CloneFlags::CLONE_NEWUTS).unwrap();
            open_own(Namespace::Uts).unwrap()
        })
        .join()
        .unwrap();
        let guard = NsGuard::enter(other.as_fd(), Namespace::Uts).unwrap();
        assert_ne!(uts_ino(), before);
        guard.leave().unwrap();
        assert_eq!(uts_ino(), before);
        {
            let _g = NsGuard::enter(other.as_fd(), Namespace::Uts).unwrap();
            assert_ne!(uts_ino(), before);
        }
        assert_eq!(uts_ino(), before);
    }
}
