//! The one home of nestbox's privileged and raw system calls.
//!
//! One module per concept, each call behind a small function whose conditions
//! are written down: a function is `unsafe fn` exactly when its caller must
//! uphold a condition the types cannot express (listed in its `# Safety`
//! section); every other function is safe to call in any state.
//!
//! Functions return the kernel's `errno` ([`nix::errno::Errno`]); callers add
//! the context (the call, the path, the box) in their own typed errors.
//! Policy (what to mount where, which namespaces a box gets) stays with the
//! callers; this crate only makes the calls.

pub mod at;
pub mod bpf;
pub mod creds;
pub mod fd;
pub mod inode_flags;
pub mod link;
pub mod loopdev;
pub mod mount;
pub mod node;
pub mod ns;
pub mod pidfd;
pub mod process;
pub mod ptrace;
pub mod replace;
pub mod seccomp_notify;
pub mod tty;
pub mod uffd;
pub mod xattr;

pub use nix::errno::Errno;

/// Result of a system call: the value, or the kernel's `errno`.
pub type Result<T> = std::result::Result<T, Errno>;
