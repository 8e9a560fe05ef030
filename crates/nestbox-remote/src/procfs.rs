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

/// `PF_EXITING` of `include/linux/sched.h`: the task has begun to exit.
const PF_EXITING: u64 = 0x4;

/// Whether process `pid` is exiting or gone: its main thread has begun to
/// exit (`PF_EXITING` in the flags of `/proc/PID/stat`) or is a zombie, or
/// there is no such process.
pub(crate) fn exiting(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(proc_path(pid, "stat")) else {
        return true;
    };
    // After the command name, which may hold anything but ends at the last ')':
    // state (field 3), then ppid, pgrp, session, tty, tpgid, flags (field 9).
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next().unwrap_or("");
    let flags = fields
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or(0);
    matches!(state, "Z" | "X" | "x") || flags & PF_EXITING != 0
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

#[cfg(test)]
mod tests {
    use super::exiting;

    #[test]
    fn a_running_process_is_not_exiting() {
        assert!(!exiting(std::process::id() as i32));
    }

    #[test]
    fn a_zombie_and_a_reaped_process_are_exiting() {
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id() as i32;
        let zombie = (0..5000).any(|_| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if stat
                .rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            false
        });
        assert!(zombie, "child {pid} did not become a zombie");
        assert!(exiting(pid), "a zombie is exiting");
        child.wait().expect("reap");
        assert!(exiting(pid), "a reaped process is gone");
    }
}
