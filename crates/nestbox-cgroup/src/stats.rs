//! Resource usage of a box and the parsing of the stat files it comes from.
//!
//! | field          | v1                           | v2                                   |
//! |----------------|------------------------------|--------------------------------------|
//! | `cpu_usage_ns` | `cpuacct.usage`              | `cpu.stat` `usage_usec` × 1000       |
//! | `memory_current` | `memory.usage_in_bytes`    | `memory.current`                     |
//! | `memory_peak`  | `memory.max_usage_in_bytes`  | `memory.peak` (else `memory.current`) |
//! | `pids_current` | `pids.current`               | `pids.current`                       |
//! | `oom_kills`    | `memory.oom_control` `oom_kill` | `memory.events` `oom_kill`        |
//!
//! A controller the box has no cgroup for reports 0.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::CgroupError;
use crate::fsutil;

/// Resource usage of a box.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// CPU time used, nanoseconds.
    pub cpu_usage_ns: u64,
    /// Memory in use, bytes.
    pub memory_current: u64,
    /// Highest memory use seen, bytes.
    pub memory_peak: u64,
    /// Number of tasks.
    pub pids_current: u64,
    /// Number of processes killed by the OOM killer.
    pub oom_kills: u64,
}

/// The value of `key` in a flat keyed file (`key value` per line), such as
/// `cpu.stat`, `memory.events`, `cgroup.events` or v1 `memory.oom_control`.
pub(crate) fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next().and_then(|v| v.parse().ok()))
            .flatten()
    })
}

/// Reads a file holding one unsigned number.
pub(crate) fn read_u64(path: &Path) -> Result<u64, CgroupError> {
    let text = fsutil::read(path)?;
    parse_u64(path, &text)
}

/// Parses a file's content holding one unsigned number.
pub(crate) fn parse_u64(path: &Path, text: &str) -> Result<u64, CgroupError> {
    text.trim().parse().map_err(|_| CgroupError::Parse {
        path: path.to_path_buf(),
        content: text.chars().take(200).collect(),
        reason: "expected an unsigned number".into(),
    })
}

/// Reads `key` from a flat keyed file; a missing key is 0 (older kernels
/// lack e.g. `oom_kill`).
pub(crate) fn read_keyed(path: &Path, key: &str) -> Result<u64, CgroupError> {
    Ok(keyed(&fsutil::read(path)?, key).unwrap_or(0))
}

/// v2 CPU usage in nanoseconds from `cpu.stat`.
pub(crate) fn v2_cpu_usage_ns(path: &Path) -> Result<u64, CgroupError> {
    let text = fsutil::read(path)?;
    keyed(&text, "usage_usec")
        .map(|us| us.saturating_mul(1000))
        .ok_or_else(|| CgroupError::Parse {
            path: path.to_path_buf(),
            content: text.chars().take(200).collect(),
            reason: "no usage_usec line".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keyed_files() {
        let oom = "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n";
        assert_eq!(keyed(oom, "oom_kill"), Some(7));
        assert_eq!(keyed(oom, "oom"), None);
        let ev = "low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(keyed(ev, "oom_kill"), Some(1));
        assert_eq!(keyed("populated 1\nfrozen 1\n", "frozen"), Some(1));
    }

    #[test]
    fn numbers_and_cpu_stat() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("cpu.stat");
        std::fs::write(&f, "usage_usec 1500\nuser_usec 1000\n").unwrap();
        assert_eq!(v2_cpu_usage_ns(&f).unwrap(), 1_500_000);
        std::fs::write(&f, "user_usec 1000\n").unwrap();
        assert!(v2_cpu_usage_ns(&f)
            .unwrap_err()
            .to_string()
            .contains("no usage_usec"));
        assert_eq!(parse_u64(&f, "42\n").unwrap(), 42);
        assert!(parse_u64(&f, "max\n").is_err());
    }
}
