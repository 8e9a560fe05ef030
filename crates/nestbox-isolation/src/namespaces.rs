//! Namespaces: creating a child in new ones, and joining those of a running box.

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};

use nix::errno::Errno;
use nix::sched::{setns, CloneFlags};
use nix::unistd::Pid;

use crate::{IsolationError, Result};

/// The namespaces every box gets, except the user and cgroup namespaces: the
/// cgroup namespace is entered by the child after it was moved into the box's
/// cgroup (so that cgroup becomes its root), the user namespace only on request.
pub const BOX_NAMESPACES: CloneFlags = CloneFlags::CLONE_NEWPID
    .union(CloneFlags::CLONE_NEWNS)
    .union(CloneFlags::CLONE_NEWUTS)
    .union(CloneFlags::CLONE_NEWIPC)
    .union(CloneFlags::CLONE_NEWNET);

/// What a fork in new namespaces returned, like `fork(2)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forked {
    /// In the parent, with the child's pid (as seen from the parent).
    Parent(Pid),
    /// In the child.
    Child,
}

/// Fork the calling process into new namespaces (`clone(2)` with no new stack, so
/// it behaves like `fork(2)`). With `CLONE_NEWPID` the child is pid 1 of its pid
/// namespace.
///
/// The caller must be single-threaded, as for `fork`.
pub fn fork_into(flags: CloneFlags) -> Result<Forked> {
    let raw = flags.bits() as libc::c_ulong | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: clone with a null stack and no CLONE_VM/CLONE_SETTLS duplicates the
    // address space exactly like fork(2); the caller is single-threaded (documented
    // contract), so no lock can be held by another thread in the child.
    let ret = unsafe { libc::syscall(libc::SYS_clone, raw, 0usize, 0usize, 0usize, 0usize) };
    match ret {
        -1 => Err(IsolationError::call(
            format!("clone({flags:?})"),
            Errno::last(),
        )),
        0 => Ok(Forked::Child),
        pid => Ok(Forked::Parent(Pid::from_raw(pid as i32))),
    }
}

/// [`fork_into`], also returning (in the parent) a pidfd of the child
/// (`CLONE_PIDFD`): the way to name the child when it was created in a pid
/// namespace other than the one the caller's `/proc` shows.
pub fn fork_into_with_pidfd(flags: CloneFlags) -> Result<(Forked, Option<OwnedFd>)> {
    let raw = flags.bits() as libc::c_ulong
        | libc::CLONE_PIDFD as libc::c_ulong
        | libc::SIGCHLD as libc::c_ulong;
    let mut pidfd: libc::c_int = -1;
    // SAFETY: as in fork_into (no new stack, no CLONE_VM: fork semantics, single-
    // threaded caller); with CLONE_PIDFD the kernel stores the child's pidfd in
    // `pidfd`, a live local passed as the parent-tid pointer.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone,
            raw,
            0usize,
            &mut pidfd as *mut libc::c_int,
            0usize,
            0usize,
        )
    };
    match ret {
        -1 => Err(IsolationError::call(
            format!("clone({flags:?} | CLONE_PIDFD)"),
            Errno::last(),
        )),
        0 => Ok((Forked::Child, None)),
        pid => {
            // SAFETY: the kernel just created this descriptor for the caller.
            let fd = (pidfd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(pidfd) });
            Ok((Forked::Parent(Pid::from_raw(pid as i32)), fd))
        }
    }
}

/// Namespace kinds in the order they must be joined: the user namespace first (it
/// grants the rights for the others), the mount namespace last (it changes root).
pub const JOIN_ORDER: &[(&str, CloneFlags)] = &[
    ("user", CloneFlags::CLONE_NEWUSER),
    ("ipc", CloneFlags::CLONE_NEWIPC),
    ("uts", CloneFlags::CLONE_NEWUTS),
    ("net", CloneFlags::CLONE_NEWNET),
    ("pid", CloneFlags::CLONE_NEWPID),
    ("cgroup", CloneFlags::CLONE_NEWCGROUP),
    ("mnt", CloneFlags::CLONE_NEWNS),
];

/// Open handles on the namespaces of a process, ready to be joined.
#[derive(Debug)]
pub struct NamespaceHandles {
    handles: Vec<(&'static str, CloneFlags, File)>,
}

impl NamespaceHandles {
    /// Open every namespace of `pid` that differs from the caller's own.
    pub fn open(pid: Pid) -> Result<Self> {
        let mut handles = Vec::new();
        for (name, flag) in JOIN_ORDER {
            let theirs = format!("/proc/{pid}/ns/{name}");
            let ours = format!("/proc/self/ns/{name}");
            let same = match (std::fs::metadata(&theirs), std::fs::metadata(&ours)) {
                (Ok(a), Ok(b)) => {
                    use std::os::unix::fs::MetadataExt;
                    a.ino() == b.ino() && a.dev() == b.dev()
                }
                (Err(e), _) => return Err(IsolationError::io("stat namespace", theirs, e)),
                _ => false,
            };
            if same {
                continue;
            }
            let file = File::open(&theirs)
                .map_err(|e| IsolationError::io("open namespace", &theirs, e))?;
            handles.push((*name, *flag, file));
        }
        Ok(NamespaceHandles { handles })
    }

    /// Whether the target is in a user namespace other than the caller's.
    pub fn has_user(&self) -> bool {
        self.handles.iter().any(|(n, _, _)| *n == "user")
    }

    /// Join all of them, in [`JOIN_ORDER`]. Joining a pid namespace only affects
    /// children forked afterwards.
    pub fn join(&self) -> Result<()> {
        for (name, flag, file) in &self.handles {
            setns(file.as_fd(), *flag)
                .map_err(|e| IsolationError::call(format!("setns({name})"), e))?;
        }
        Ok(())
    }
}
