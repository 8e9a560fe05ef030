//! The errors of the OCI runtime: each names the container, the file or the
//! call it is about, so the command line prints one clear line.

use std::path::PathBuf;

/// An error of an OCI runtime operation.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The container id is not acceptable.
    #[error("invalid container id {id:?}: {reason}")]
    InvalidId {
        /// The id given.
        id: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A container of that id exists already.
    #[error("container {0:?} already exists")]
    Exists(String),
    /// No container of that id exists.
    #[error("container {0:?} does not exist")]
    NotFound(String),
    /// The container is in the wrong state for the operation.
    #[error("container {id:?} is {status}: {why}")]
    WrongState {
        /// The container.
        id: String,
        /// Its status.
        status: &'static str,
        /// What could not be done.
        why: &'static str,
    },
    /// The bundle's config.json could not be read or is invalid.
    #[error("bundle config {path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A container record cannot be parsed.
    #[error("corrupt state {path}: {message}")]
    Corrupt {
        /// The record.
        path: PathBuf,
        /// The parse error.
        message: String,
    },
    /// A config field holds a value this runtime refuses.
    #[error("config: {0}")]
    Unsupported(String),
    /// A command-line value is invalid.
    #[error("{0}")]
    Usage(String),
    /// A file operation failed.
    #[error("{what} {path}: {error}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// On which path.
        path: PathBuf,
        /// The error.
        error: std::io::Error,
    },
    /// A system call failed.
    #[error("{call}: {errno}")]
    Sys {
        /// The call and what it acted on.
        call: String,
        /// The kernel's error.
        errno: nix::errno::Errno,
    },
    /// The container's process failed while it was set up.
    #[error("container {id:?} could not be created: {message}")]
    Setup {
        /// The container.
        id: String,
        /// The report of its process.
        message: String,
    },
    /// An error reported by a container's waiting process (a container
    /// forked from a template), as it printed it.
    #[error("{0}")]
    Relayed(String),
    /// A hook failed.
    #[error("{stage} hook {path}: {message}")]
    Hook {
        /// The hook stage (createRuntime, poststart, …).
        stage: &'static str,
        /// The hook's program.
        path: PathBuf,
        /// How it failed.
        message: String,
    },
    /// A cgroup operation failed.
    #[error("{0}")]
    Cgroup(nestbox_cgroup::CgroupError),
    /// A seccomp section could not be translated.
    #[error("linux.seccomp: {0}")]
    Seccomp(nestbox_seccomp::SeccompError),
    /// A nestbox operation (a clone from a template, its removal) failed.
    #[error("{what}: {error}")]
    Nestbox {
        /// What it was about (the template, the clone).
        what: String,
        /// The nestbox error (boxed: it is large).
        error: Box<nestbox_runtime::RuntimeError>,
    },
    /// An isolation step failed.
    #[error("{0}")]
    Isolation(nestbox_isolation::IsolationError),
}

// The errors a variant wraps are part of its message and not given as its
// source: the command line prints an error with its chain of sources, which
// would repeat them.
impl From<nestbox_cgroup::CgroupError> for OciError {
    fn from(e: nestbox_cgroup::CgroupError) -> Self {
        OciError::Cgroup(e)
    }
}

impl From<nestbox_seccomp::SeccompError> for OciError {
    fn from(e: nestbox_seccomp::SeccompError) -> Self {
        OciError::Seccomp(e)
    }
}

impl From<nestbox_isolation::IsolationError> for OciError {
    fn from(e: nestbox_isolation::IsolationError) -> Self {
        OciError::Isolation(e)
    }
}

impl OciError {
    /// An I/O error of `what` on `path`.
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OciError::Io {
            what,
            path: path.into(),
            error: source,
        }
    }

    /// A failed system call.
    pub fn sys(call: impl Into<String>, errno: nix::errno::Errno) -> Self {
        OciError::Sys {
            call: call.into(),
            errno,
        }
    }
}

/// Result of OCI runtime operations.
pub type Result<T> = std::result::Result<T, OciError>;
