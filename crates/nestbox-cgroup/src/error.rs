//! Error and warning types of the crate.
//!
//! [`CgroupError`] keeps the context of every failure (the file or directory,
//! the operation, the value written, the underlying OS error and, where we
//! know one, a hint for the human) and renders it as a single line such as
//!
//! ```text
//! cgroup: write /sys/fs/cgroup/memory/x/memory.limit_in_bytes = "1024": Device or resource busy
//! ```
//!
//! [`CgroupWarning`] records things that went wrong but did not matter for the
//! limits that were asked for (for example a cgroup v2 controller that could
//! not be enabled although no limit needs it).

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The filesystem operation that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Reading a control file.
    Read,
    /// Writing a control file.
    Write,
    /// Creating a cgroup directory.
    Mkdir,
    /// Removing a cgroup directory.
    Rmdir,
    /// Listing a cgroup directory.
    ReadDir,
    /// Reading or writing an extended attribute of a cgroup directory.
    Xattr,
    /// Taking the lock of a cgroup directory.
    Lock,
    /// Giving a cgroup directory or file to a delegated box's root.
    Chown,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Mkdir => "mkdir",
            Op::Rmdir => "rmdir",
            Op::ReadDir => "readdir",
            Op::Xattr => "xattr",
            Op::Lock => "lock",
            Op::Chown => "chown",
        })
    }
}

/// Everything that can go wrong while detecting, creating, controlling or
/// removing cgroups. `Display` is always one line starting with `cgroup:`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupError {
    /// A filesystem operation on a cgroup file or directory failed.
    #[error(
        "cgroup: {op} {}{}: {}{}",
        path.display(),
        value.as_ref().map(|v| format!(" = {v:?}")).unwrap_or_default(),
        describe_io(err),
        hint.as_ref().map(|h| format!(" ({h})")).unwrap_or_default()
    )]
    Io {
        /// The operation.
        op: Op,
        /// The file or directory.
        path: PathBuf,
        /// The value being written, for [`Op::Write`].
        value: Option<String>,
        /// The OS error.
        err: io::Error,
        /// An explanation for humans, when we know a likely cause.
        hint: Option<String>,
    },
    /// A CPU reservation does not fit in what is left to reserve.
    #[error(
        "cgroup: --cpu-reserve {wanted}: the boxes under {} already reserve {reserved} of {cpus} CPUs and at most {max} may be reserved",
        parent.display()
    )]
    Overcommitted {
        /// The reservation asked for, in CPUs.
        wanted: f64,
        /// What the parent's other boxes reserve, in CPUs.
        reserved: f64,
        /// The CPUs there are.
        cpus: f64,
        /// The most that may be reserved in all.
        max: f64,
        /// The parent cgroup directory.
        parent: PathBuf,
    },
    /// A limit failed validation.
    #[error("cgroup: invalid {option}={value}: {reason}")]
    InvalidLimit {
        /// The option name (the [`crate::Limits`] field).
        option: &'static str,
        /// The offending value.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A CPU list (`"0-2,4"`) could not be parsed.
    #[error("cgroup: invalid CPU list {value:?}: {reason}")]
    CpuList {
        /// The text that was parsed.
        value: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A box id is not usable as part of a directory name.
    #[error("cgroup: invalid box id {id:?}: {reason}")]
    InvalidId {
        /// The id.
        id: String,
        /// Why it is invalid.
        reason: String,
    },
    /// A cgroup path chosen by the caller is not usable.
    #[error("cgroup: invalid cgroup path {}: {reason}", path.display())]
    InvalidPath {
        /// The path.
        path: PathBuf,
        /// Why it is invalid.
        reason: String,
    },
    /// The box cgroup directory already exists.
    #[error("cgroup: box cgroup {} already exists", path.display())]
    AlreadyExists {
        /// The existing directory.
        path: PathBuf,
    },
    /// A limit was requested but the controller enforcing it is not usable.
    #[error("cgroup: {option} requested but the {controller} controller is not usable: {reason}")]
    ControllerUnavailable {
        /// The option name (the [`crate::Limits`] field).
        option: &'static str,
        /// The controller (`memory`, `cpu`, `io`, ...).
        controller: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The kernel does not offer what a requested limit needs.
    #[error("cgroup: {option}: {reason}")]
    Unsupported {
        /// The option name (the [`crate::Limits`] field) or feature.
        option: &'static str,
        /// What is missing.
        reason: String,
    },
    /// A control file had unexpected content.
    #[error("cgroup: parse {}: {reason} (content {content:?})", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was read (possibly truncated).
        content: String,
        /// What was wrong with it.
        reason: String,
    },
    /// The cgroup layout could not be detected.
    #[error("cgroup: detect: {reason}")]
    Detect {
        /// What was wrong.
        reason: String,
    },
    /// A state change did not complete in time.
    #[error("cgroup: timed out after {waited:?} waiting for {what} in {}", path.display())]
    Timeout {
        /// What we waited for.
        what: String,
        /// The cgroup directory.
        path: PathBuf,
        /// How long we waited.
        waited: Duration,
    },
    /// Sending a signal to a process of the box failed.
    #[error("cgroup: kill pid {pid}: {}", err.desc())]
    Signal {
        /// The process.
        pid: i32,
        /// The error.
        err: nix::errno::Errno,
    },
    /// A directory of a (possibly deserialised) box is not named
    /// `nestbox-<id>`; refused before killing or removing anything there.
    #[error("cgroup: {} is not the directory of box {id:?} (expected a directory named nestbox-{id})", path.display())]
    NotBoxDir {
        /// The directory.
        path: PathBuf,
        /// The box id.
        id: String,
    },
    /// A pid that cannot be moved into a box (`<= 0`).
    #[error("cgroup: invalid pid {pid}")]
    InvalidPid {
        /// The pid.
        pid: i32,
    },
    /// The box has no cgroup carrying the needed controller.
    #[error("cgroup: {what}: no cgroup of this box carries it")]
    NoController {
        /// The controller or feature (`freezer`, ...).
        what: &'static str,
    },
}

/// Renders an `io::Error` without the `(os error N)` suffix.
fn describe_io(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(n) => nix::errno::Errno::from_raw(n).desc().to_string(),
        None => err.to_string(),
    }
}

impl CgroupError {
    /// Builds an [`CgroupError::Io`] error without value or hint.
    pub(crate) fn io(op: Op, path: impl Into<PathBuf>, err: io::Error) -> Self {
        CgroupError::Io {
            op,
            path: path.into(),
            value: None,
            err,
            hint: None,
        }
    }

    /// The underlying OS error, if this is a filesystem error.
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            CgroupError::Io { err, .. } => Some(err),
            _ => None,
        }
    }

    /// The errno of the underlying OS error, if any.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            CgroupError::Io { err, .. } => err.raw_os_error(),
            CgroupError::Signal { err, .. } => Some(*err as i32),
            _ => None,
        }
    }

    /// True when the error is a missing file or directory, or a file of a
    /// cgroup removed while it was open (`ENODEV`): the cgroup is gone.
    pub fn is_not_found(&self) -> bool {
        self.io_error().is_some_and(|e| {
            e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(libc::ENODEV)
        })
    }
}

/// A non-fatal problem met while creating a box cgroup.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case", tag = "kind")]
#[non_exhaustive]
pub enum CgroupWarning {
    /// The controller is not available anywhere (not mounted as v1, not in
    /// the v2 `cgroup.controllers`), so the box is not accounted/limited by it.
    ControllerUnavailable {
        /// The controller.
        controller: String,
    },
    /// The controller is available in cgroup v2 but enabling it in the parent's
    /// `cgroup.subtree_control` failed.
    ControllerNotEnabled {
        /// The controller.
        controller: String,
        /// The `cgroup.subtree_control` file.
        path: PathBuf,
        /// The error, as text.
        reason: String,
    },
}

impl fmt::Display for CgroupWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CgroupWarning::ControllerUnavailable { controller } => write!(
                f,
                "cgroup controller {controller} is not available; the box is not limited or accounted by it"
            ),
            CgroupWarning::ControllerNotEnabled {
                controller,
                path,
                reason,
            } => write!(
                f,
                "could not enable cgroup controller {controller} in {}: {reason}",
                path.display()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_error_is_one_line_with_value() {
        let e = CgroupError::Io {
            op: Op::Write,
            path: "/sys/fs/cgroup/memory/x/memory.limit_in_bytes".into(),
            value: Some("1024".into()),
            err: io::Error::from_raw_os_error(libc::EBUSY),
            hint: None,
        };
        assert_eq!(
            e.to_string(),
            "cgroup: write /sys/fs/cgroup/memory/x/memory.limit_in_bytes = \"1024\": Device or resource busy"
        );
        assert_eq!(e.raw_os_error(), Some(libc::EBUSY));
    }

    #[test]
    fn parse_error_escapes_newlines() {
        let e = CgroupError::Parse {
            path: "/x/cpu.stat".into(),
            content: "a\nb\n".into(),
            reason: "missing usage_usec".into(),
        };
        assert!(!e.to_string().contains('\n'));
    }
}
