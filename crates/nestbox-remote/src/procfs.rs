//! Reading what the kernel shows about a process in `/proc/PID`: `status` fields
//! (threads, tracer, namespace pids, capabilities), the working directory
//! (the memory map is `maps.rs`'s).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{RemoteError, Result};

/// Path of `/proc/PID/<name>`.
pub(crate) fn proc_path(pid: i32, name: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/{name}"))
}

pub(crate) fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| RemoteError::Proc {
        path: path.to_path_buf(),
        source,
    })
}

/// `/proc/PID/status` as key/value pairs (values trimmed).
#[derive(Debug, Clone)]
pub struct Status {
    path: PathBuf,
    fields: HashMap<String, String>,
}

impl Status {
    /// Read `/proc/PID/status`; a missing process is [`RemoteError::NoSuchProcess`].
    pub fn read(pid: i32) -> Result<Status> {
        let path = proc_path(pid, "status");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(RemoteError::NoSuchProcess { pid })
            }
            Err(source) => return Err(RemoteError::Proc { path, source }),
        };
        let fields = text
            .lines()
            .filter_map(|line| line.split_once(':'))
            .map(|(k, v)| (k.to_string(), v.trim().to_string()))
            .collect();
        Ok(Status { path, fields })
    }

    /// A raw field.
    pub fn get(&self, key: &str) -> Result<&str> {
        self.fields
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| RemoteError::Parse {
                path: self.path.clone(),
                message: format!("no {key} field"),
            })
    }

    fn parse<T: std::str::FromStr>(&self, key: &str, text: &str) -> Result<T> {
        text.parse().map_err(|_| RemoteError::Parse {
            path: self.path.clone(),
            message: format!("{key}: {text:?} is not a number"),
        })
    }

    /// A decimal field.
    pub fn decimal<T: std::str::FromStr>(&self, key: &str) -> Result<T> {
        let text = self.get(key)?;
        self.parse(key, text)
    }

    /// A hexadecimal field (the capability sets).
    pub fn hex(&self, key: &str) -> Result<u64> {
        let text = self.get(key)?;
        u64::from_str_radix(text, 16).map_err(|_| RemoteError::Parse {
            path: self.path.clone(),
            message: format!("{key}: {text:?} is not hexadecimal"),
        })
    }

    /// `Threads:`.
    pub fn threads(&self) -> Result<usize> {
        self.decimal("Threads")
    }

    /// `TracerPid:` (0: not traced).
    pub fn tracer_pid(&self) -> Result<i32> {
        self.decimal("TracerPid")
    }

    /// The pid in the innermost pid namespace (last field of `NSpid:`).
    pub fn innermost_pid(&self) -> Result<i32> {
        let text = self.get("NSpid")?;
        let last = text.split_whitespace().last().unwrap_or("");
        self.parse("NSpid", last)
    }
}

/// The working directory of `pid`, as `/proc/PID/cwd` shows it.
pub fn cwd(pid: i32) -> Result<PathBuf> {
    let path = proc_path(pid, "cwd");
    std::fs::read_link(&path).map_err(|source| RemoteError::Proc { path, source })
}
