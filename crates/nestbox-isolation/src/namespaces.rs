//! Namespaces: creating a child in new ones, and joining those of a running box.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};

use nestbox_sys::ns::Namespace;
use nix::sched::CloneFlags;
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

pub use nestbox_sys::process::Forked;

/// Fork the calling process into new namespaces (`clone(2)` with no new stack, so
/// it behaves like `fork(2)`). With `CLONE_NEWPID` the child is pid 1 of its pid
/// namespace. See [`nestbox_sys::process::fork_into`].
///
/// # Safety
/// As for `fork(2)`: the caller is single-threaded, and until it `exec`s or
/// `_exit`s the child only does what is async-signal-safe; `flags` holds only
/// `CLONE_NEW*` (and `CLONE_PARENT`) flags, never `CLONE_VM`/`CLONE_SETTLS`.
pub unsafe fn fork_into(flags: CloneFlags) -> Result<Forked> {
    // SAFETY: the caller upholds the conditions of this function, which are those
    // of nestbox_sys::process::fork_into.
    unsafe { nestbox_sys::process::fork_into(flags) }
        .map_err(|e| IsolationError::call(format!("clone({flags:?})"), e))
}

/// [`fork_into`], also returning (in the parent) a pidfd of the child
/// (`CLONE_PIDFD`): the way to name the child when it was created in a pid
/// namespace other than the one the caller's `/proc` shows.
///
/// # Safety
/// As for [`fork_into`].
pub unsafe fn fork_into_with_pidfd(flags: CloneFlags) -> Result<(Forked, Option<OwnedFd>)> {
    // SAFETY: as in fork_into (conditions upheld by the caller).
    unsafe { nestbox_sys::process::fork_into_with_pidfd(flags) }
        .map_err(|e| IsolationError::call(format!("clone({flags:?} | CLONE_PIDFD)"), e))
}

/// Namespace kinds in the order they must be joined: the user namespace first (it
/// grants the rights for the others), the mount namespace last (it changes root).
pub const JOIN_ORDER: &[Namespace] = &[
    Namespace::User,
    Namespace::Ipc,
    Namespace::Uts,
    Namespace::Net,
    Namespace::Pid,
    Namespace::Cgroup,
    Namespace::Mnt,
];

/// Open handles on the namespaces of a process, ready to be joined.
#[derive(Debug)]
pub struct NamespaceHandles {
    handles: Vec<(Namespace, File)>,
}

impl NamespaceHandles {
    /// Open every namespace of `pid` that differs from the caller's own.
    pub fn open(pid: Pid) -> Result<Self> {
        let mut handles = Vec::new();
        for &kind in JOIN_ORDER {
            let name = kind.name();
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
            handles.push((kind, file));
        }
        Ok(NamespaceHandles { handles })
    }

    /// Whether the target is in a user namespace other than the caller's.
    pub fn has_user(&self) -> bool {
        self.handles.iter().any(|(n, _)| *n == Namespace::User)
    }

    /// Join all of them, in [`JOIN_ORDER`]. Joining a pid namespace only affects
    /// children forked afterwards.
    pub fn join(&self) -> Result<()> {
        for (kind, file) in &self.handles {
            nestbox_sys::ns::enter(file.as_fd(), *kind)
                .map_err(|e| IsolationError::call(format!("setns({})", kind.name()), e))?;
        }
        Ok(())
    }
}
