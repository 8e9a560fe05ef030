//! Transparent remote fork of a stopped process, for nestbox's `clone`.
//!
//! Linux has no call to fork another process, so the template process is made to
//! fork itself: the tracer attaches with ptrace ([`Tracee`]), injects syscalls at a
//! `syscall` instruction of the template's vDSO, and steers the children it makes
//! into a prepared clone shell's namespaces, cgroup and working directory, with
//! every fd that must not stay shared re-targeted ([`inspect_fds`], the clone fd
//! matrix in `docs/clone-fds.md`). The clone resumes with the template's exact
//! registers, so an interrupted syscall is restarted as if nothing happened.
//! Every thread of the template is seized with it and re-created in the clone
//! with its tid and state ([`ThreadState`]).
//!
//! x86_64 only; the caller runs as root in the initial namespaces.
//!
//! ```no_run
//! use std::os::fd::AsFd;
//! use std::time::Duration;
//! use nestbox_remote::{remote_fork, ForkPlan, NsKind, Tracee};
//!
//! # fn demo(template_pid: i32, shell_init: i32, cookie: [u64; 2]) -> Result<(), Box<dyn std::error::Error>> {
//! let ns: Vec<(NsKind, std::fs::File)> = [NsKind::User, NsKind::Mount, NsKind::Net, NsKind::Uts,
//!     NsKind::Ipc, NsKind::Cgroup, NsKind::Pid]
//!     .into_iter()
//!     .map(|k| Ok((k, std::fs::File::open(format!("/proc/{shell_init}/ns/{}", k.proc_name()))?)))
//!     .collect::<std::io::Result<_>>()?;
//! let log = std::fs::File::create("/tmp/clone.log")?;
//! let null = std::fs::File::open("/dev/null")?;
//!
//! let mut template = Tracee::seize_and_interrupt(template_pid)?;
//! // (thaw the template's cgroup here)
//! template.wait_stopped(Duration::from_secs(1))?;
//! let plan = ForkPlan {
//!     namespaces: ns.iter().map(|(k, f)| (*k, f.as_fd())).collect(),
//!     setns_cookie: cookie,
//!     cgroup_task_files: vec!["/sys/fs/cgroup/pids/clone-1/tasks".into()],
//!     tasks_files_opener: None,
//!     stdio: [null.as_fd(), log.as_fd(), log.as_fd()],
//!     on_clone_signal: None,
//!     inventory: None,
//! };
//! let forked = remote_fork(&mut template, &plan)?;
//! template.detach()?; // (and refreeze the template's cgroup)
//! println!("clone runs as pid {} ({} in its shell)", forked.pid, forked.ns_pid);
//! # Ok(()) }
//! ```

mod attach;
mod batch;
mod buffered;
mod caps;
mod dirty;
mod dontfork;
mod error;
mod fdinfo;
mod fdtransfer;
mod fork;
mod hugepages;
mod inject;
mod inotify;
mod layout;
mod lazy;
pub mod maps;
mod marks;
mod memory;
mod objects;
mod placeholder;
mod procfs;
mod procimage;
mod procstate;
pub mod rebuild;
mod retarget;
mod shmem;
mod threads;
mod tracee;
pub mod tree;
mod treefork;
mod unixdiag;

pub use attach::{check_attachable, install_listener, let_go_of_strays};
pub use caps::CapState;
pub use dirty::{in_ranges, unwritten_ranges, DirtyTracker};
pub use error::{RemoteError, Result};
pub use fdinfo::{
    ensure_clonable, inspect_fds, mark_peers_inside, mark_pidfds_inside, refresh_volatile,
    EpollWatch, FdAction, FdEntry, FdKind, InotifyWatch, SocketInfo,
};
pub use fdtransfer::{install_fds, MAX_FDS};
pub use fork::{remote_fork, ForkPlan, Forked, NsKind};
pub use hugepages::{collapse_anonymous, collapsible_ranges, Collapsed};
pub use lazy::{LazyPlan, LazyServer};
pub use marks::set_hook as set_phase_hook;
pub use objects::{object_of, CloneObjects, ObjectKey, TemplateEnd};
pub use procimage::{
    capture_box, capture_box_incremental, ensure_not_lazily_filled, restore_box, PageData,
    PageStore, ProcessImage, RestorePlan, IMAGE_VERSION,
};
pub use procstate::ProcessState;
pub use retarget::FdOutcome;
pub use shmem::{ensure_memory_clonable, SharedCopy, SharedKind, SharedObjects};
pub use threads::ThreadState;
pub use tracee::{Regs, Tracee};
pub use treefork::{check_box_fds, remote_fork_tree, ForkedProcess, ForkedTree};
