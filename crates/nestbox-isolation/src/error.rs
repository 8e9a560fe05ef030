//! The isolation error: which call failed, on what path, with which errno.

use std::fmt;
use std::path::PathBuf;

use nix::errno::Errno;

/// A failed kernel call made while isolating a box.
#[derive(Debug, thiserror::Error)]
pub struct IsolationError {
    /// The call or step ("mount overlay", "pivot_root", "setns", ...).
    pub call: String,
    /// The path it acted on, when there is one.
    pub path: Option<PathBuf>,
    /// The error number the kernel returned.
    pub errno: Errno,
}

impl fmt::Display for IsolationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(p) => write!(f, "{} {}: {}", self.call, p.display(), self.errno.desc()),
            None => write!(f, "{}: {}", self.call, self.errno.desc()),
        }
    }
}

impl IsolationError {
    /// An error of `call` on `path`.
    pub fn at(call: impl Into<String>, path: impl Into<PathBuf>, errno: Errno) -> Self {
        IsolationError {
            call: call.into(),
            path: Some(path.into()),
            errno,
        }
    }
    /// An error of `call` with no path.
    pub fn call(call: impl Into<String>, errno: Errno) -> Self {
        IsolationError {
            call: call.into(),
            path: None,
            errno,
        }
    }
    /// From an `io::Error` of `call` on `path`.
    pub fn io(call: impl Into<String>, path: impl Into<PathBuf>, e: std::io::Error) -> Self {
        let errno = Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO));
        Self::at(call, path, errno)
    }
}

/// Result of isolation steps.
pub type Result<T> = std::result::Result<T, IsolationError>;
