//! Seccomp-BPF filters for nestbox boxes, generated and installed without libseccomp.
//!
//! * [`Profile`] describes a filter: a default [`Action`], an action for x32-ABI
//!   calls, and ordered per-syscall [`Rule`]s with optional 64-bit argument
//!   conditions ([`ArgCondition`], [`CmpOp`]);
//! * [`default_profile`] builds nestbox's default for a box, given the capabilities
//!   it holds ([`DefaultOpts`]); `docs/seccomp.md` lists what it blocks and why;
//! * [`Profile::from_docker_json`] loads a Docker/OCI profile file;
//! * [`Profile::compile`] produces a classic BPF [`Program`], and
//!   [`Program::install`] loads it into the kernel (after [`set_no_new_privs`]).
//!
//! Only x86_64 is supported: the filter checks `seccomp_data.arch` and kills any
//! other architecture's calls, and [`Program::install`] refuses to run elsewhere.
//!
//! ```no_run
//! use nestbox_seccomp::{default_profile, set_no_new_privs, DefaultOpts};
//!
//! let program = default_profile(DefaultOpts::default()).compile()?;
//! // ... in the box's init process, before exec:
//! set_no_new_privs()?;
//! program.install()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod bpf;
mod codegen;
mod default;
mod docker;
mod error;
mod install;
#[cfg(test)]
mod interp;
mod monitor;
mod profile;
mod sysno;

pub use bpf::{Program, AUDIT_ARCH_X86_64, MAX_INSNS};
pub use default::{
    blocked_syscall_names, default_profile, Blocked, Capability, DefaultOpts, ARGUMENT_FILTERED,
    BLOCKED, BLOCKED_SOCKET_FAMILIES, CLONE_NAMESPACE_FLAGS, SAFE_PERSONAS,
};
pub use error::SeccompError;
pub use install::set_no_new_privs;
pub use monitor::monitor_profile;
pub use profile::{
    Action, ArgCondition, CmpOp, Profile, Rule, ENOSYS, EPERM, MAX_ERRNO, X32_SYSCALL_BIT,
};
pub use sysno::{syscall_name, syscall_number};
