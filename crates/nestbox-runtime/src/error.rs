//! Runtime errors. Each keeps its context (the box, the path, the call) and
//! displays as one line a person can act on; each maps to the CLI's exit code.

use std::path::PathBuf;

/// Exit code for an error of nestbox itself (as Docker uses).
pub const EXIT_NESTBOX_ERROR: i32 = 125;
/// Exit code when the command exists but cannot be executed.
pub const EXIT_CANNOT_EXECUTE: i32 = 126;
/// Exit code when the command is not found in the box.
pub const EXIT_NOT_FOUND: i32 = 127;

/// Everything that can go wrong managing a box.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// Invalid user input (option, size, name...).
    #[error("{0}")]
    Invalid(String),
    /// No box of that name.
    #[error("no box named {0:?}")]
    NoSuchBox(String),
    /// The name is taken.
    #[error("a box named {0:?} already exists")]
    NameInUse(String),
    /// The operation needs a running box.
    #[error("box {0:?} is not running")]
    NotRunning(String),
    /// The operation needs a stopped box.
    #[error("box {0:?} is running: stop it first, or use rm -f")]
    StillRunning(String),
    /// The command could not be started in the box.
    #[error("{message}")]
    Launch {
        /// 126 (cannot execute), 127 (not found) or 125.
        code: i32,
        /// What went wrong, one line.
        message: String,
    },
    /// A filesystem operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A kernel call failed.
    #[error("{call}: {errno}")]
    Sys {
        /// The call, with its subject.
        call: String,
        /// The errno.
        errno: nix::errno::Errno,
    },
    /// Stored state could not be read.
    #[error("corrupt state {path}: {source}")]
    State {
        /// The state file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// Cgroup failure.
    #[error(transparent)]
    Cgroup(#[from] nestbox_cgroup::CgroupError),
    /// Seccomp failure.
    #[error(transparent)]
    Seccomp(#[from] nestbox_seccomp::SeccompError),
    /// Namespace, mount or capability failure.
    #[error(transparent)]
    Isolation(#[from] nestbox_isolation::IsolationError),
    /// Image failure.
    #[error(transparent)]
    Image(#[from] nestbox_image::ImageError),
    /// Networking failure.
    #[error(transparent)]
    Network(#[from] nestbox_net::NetError),
}

impl RuntimeError {
    /// A closure turning an `io::Error` of `op` on `path` into a `RuntimeError`.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| RuntimeError::Io { op, path, source }
    }

    /// A closure turning an errno of `call` into a `RuntimeError`.
    pub fn sys(call: impl Into<String>) -> impl FnOnce(nix::errno::Errno) -> Self {
        let call = call.into();
        move |errno| RuntimeError::Sys { call, errno }
    }

    /// The process exit code the CLI should use for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            RuntimeError::Launch { code, .. } => *code,
            _ => EXIT_NESTBOX_ERROR,
        }
    }
}

/// Result of runtime operations.
pub type Result<T> = std::result::Result<T, RuntimeError>;
