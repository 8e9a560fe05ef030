//! The crate's error type.
//!
//! Every variant renders as one line that names what is wrong and where (a profile
//! file path such as `syscalls[3].action`, a rule index, the kernel's errno).

use std::io;

/// Everything that can go wrong while building, compiling or installing a filter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SeccompError {
    /// A Docker/OCI profile file is not valid JSON or does not have the expected shape.
    #[error("seccomp profile: invalid JSON: {0}")]
    Json(#[source] serde_json::Error),

    /// A Docker/OCI profile file is well-formed JSON but a field has a bad value.
    ///
    /// `path` locates the field, e.g. `syscalls[3].args[0].op`.
    #[error("seccomp profile: {path}: {message}")]
    ProfileField {
        /// Location of the offending field inside the file.
        path: String,
        /// What is wrong with it.
        message: String,
    },

    /// A rule of a [`Profile`](crate::Profile) cannot be turned into BPF.
    #[error("seccomp rule {index} (syscall {syscall}): {message}")]
    InvalidRule {
        /// Position of the rule in [`Profile::rules`](crate::Profile::rules).
        index: usize,
        /// Syscall name, or its number when the x86_64 table does not know it.
        syscall: String,
        /// What is wrong with it.
        message: String,
    },

    /// An action carries a value the kernel cannot represent.
    #[error("seccomp action {action}: {message}")]
    InvalidAction {
        /// The action as written in the profile.
        action: String,
        /// What is wrong with it.
        message: String,
    },

    /// The generated program is longer than the kernel accepts.
    #[error("seccomp program has {len} instructions, the kernel accepts at most {max}")]
    ProgramTooLong {
        /// Instructions generated.
        len: usize,
        /// The kernel's limit (`BPF_MAXINSNS`).
        max: usize,
    },

    /// The filter can only be installed on an x86_64 kernel.
    #[error("seccomp filters are only supported on x86_64, this build targets {arch}")]
    UnsupportedArch {
        /// The compile-time target architecture.
        arch: &'static str,
    },

    /// The `seccomp(2)` call failed.
    #[error("installing the seccomp filter failed: {hint}: {source}")]
    Install {
        /// A short explanation of the likely cause, chosen from the errno.
        hint: &'static str,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
}

impl SeccompError {
    /// Build a [`SeccompError::ProfileField`].
    pub(crate) fn field(path: impl Into<String>, message: impl Into<String>) -> Self {
        SeccompError::ProfileField {
            path: path.into(),
            message: message.into(),
        }
    }
}
