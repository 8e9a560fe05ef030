//! The recorded state of a box (status, processes, cgroup, exit) and how it is
//! stored: JSON written to a temporary file and renamed into place, so a reader
//! sees either the old or the new state, never half of one; read-modify-write
//! under the box's lock.

use std::fs;
use std::path::Path;

use nestbox_cgroup::{BoxCgroup, Stats};
use nestbox_isolation::idmap::IdMap;
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::liveness::ProcRef;
use crate::{Result, RuntimeError};

/// Where a box is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Being set up; its monitor (or the creating command) is alive.
    Creating,
    /// Its command runs.
    Running,
    /// Frozen by `nestbox freeze`: a template clones are forked from.
    Frozen,
    /// It ended and its exit status is recorded.
    Exited,
    /// Its monitor died without recording an end (found by a later command).
    Dead,
}

impl Status {
    /// Lower-case name, as shown by `ps`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Creating => "creating",
            Status::Running => "running",
            Status::Frozen => "frozen",
            Status::Exited => "exited",
            Status::Dead => "dead",
        }
    }
}

/// The mutable record of a box.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BoxState {
    /// Unique id (names of its cgroups and data directory).
    pub id: String,
    /// Lifecycle status.
    pub status: Status,
    /// Unix time of creation, start and end (seconds).
    pub created_at: f64,
    /// When the command started.
    pub started_at: Option<f64>,
    /// When the box ended.
    pub finished_at: Option<f64>,
    /// The monitor process (the process that owns the box while it runs).
    pub monitor: Option<ProcRef>,
    /// Host pid of the box's init (pid 1 inside).
    pub init: Option<ProcRef>,
    /// The box's cgroup while it exists.
    pub cgroup: Option<BoxCgroup>,
    /// The user-namespace id maps, when the box has a user namespace.
    pub idmap: Option<IdMap>,
    /// Exit code of the command (128+N when killed by signal N).
    pub exit_code: Option<i32>,
    /// The command was killed by the kernel's OOM killer.
    pub oom_killed: bool,
    /// Why the box failed to start or ended abnormally.
    pub error: Option<String>,
    /// Last resource figures, taken just before the cgroup was removed.
    pub final_stats: Option<Stats>,
    /// Secret that lets nestbox's injected `setns` calls through the box's seccomp
    /// filter (arguments 3 and 4 of the call); never visible inside the box.
    #[serde(default)]
    pub setns_cookie: Option<[u64; 2]>,
    /// Set when the box was frozen into a template.
    #[serde(default)]
    pub template: Option<TemplateInfo>,
    /// Set when the box is a clone: its process forked from the template.
    #[serde(default)]
    pub clone: Option<CloneInfo>,
    /// The box's attachment to its network (address, veth, ports, rates).
    #[serde(default)]
    pub network: Option<serde_json::Value>,
    /// Set when the overload watchdog stopped the box: why, and when.
    #[serde(default)]
    pub watchdog: Option<WatchdogStop>,
}

/// The overload watchdog's decision to stop a box (`nestbox watchdog`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchdogStop {
    /// When, in seconds since the epoch.
    pub at: u64,
    /// The host's available memory then, in bytes.
    pub available_bytes: u64,
    /// The watchdog's threshold, in bytes.
    pub min_available_bytes: u64,
    /// The box's memory use then, in bytes.
    pub memory_bytes: u64,
    /// The box's reservation (`--memory-reserve`), in bytes.
    pub reserve_bytes: u64,
}

/// What freezing a box recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TemplateInfo {
    /// The name clones are made from (the box name unless `--as` gave another).
    pub name: String,
    /// The process clones are forked from (host pid).
    pub process: ProcRef,
    /// When it was frozen.
    pub frozen_at: f64,
    /// How long quiescing took, in milliseconds.
    pub freeze_ms: f64,
    /// Clones kept forked ahead of time, ready to be claimed (`freeze --pool N`).
    #[serde(default)]
    pub pool: usize,
    /// Removed by the user while clones still depended on its pid namespace: only
    /// its init is left, and it goes when the last clone does.
    #[serde(default)]
    pub removed: bool,
}

/// The clone's process once it was forked (its template is in the spec:
/// `BoxSpec::clone_of`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloneInfo {
    /// The clone's process (host pid), once forked.
    pub process: Option<ProcRef>,
    /// Its other processes, when its template has a process tree.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub others: Vec<ProcRef>,
    /// Time from the start of the fork to the clone running, in milliseconds.
    pub fork_ms: Option<f64>,
}

impl BoxState {
    /// A fresh record for a box being created by the calling process.
    pub fn creating(id: String) -> Self {
        BoxState {
            id,
            status: Status::Creating,
            created_at: now(),
            started_at: None,
            finished_at: None,
            monitor: Some(ProcRef::current()),
            init: None,
            cgroup: None,
            idmap: None,
            exit_code: None,
            oom_killed: false,
            error: None,
            final_stats: None,
            setns_cookie: None,
            template: None,
            clone: None,
            network: None,
            watchdog: None,
        }
    }

    /// The status as it really is: a creating/running box whose monitor is gone is dead.
    pub fn effective_status(&self) -> Status {
        match self.status {
            Status::Creating | Status::Running | Status::Frozen
                if !self.monitor.is_some_and(|m| m.alive()) =>
            {
                Status::Dead
            }
            s => s,
        }
    }
}

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Write `value` as JSON to `path` atomically (temporary file + rename,
/// see [`nestbox_sys::replace`]). No fsync: runtime state only has to
/// survive the death of a process, not of the machine.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let data = serde_json::to_vec_pretty(value).map_err(|source| RuntimeError::State {
        path: path.into(),
        source,
    })?;
    nestbox_sys::replace::replace_file(path, &tmp, &data)
        .map_err(|e| RuntimeError::io(e.what, &e.path)(e.source))
}

/// An exclusive `flock` on `path` (created if missing): waiting for it with
/// `wait`, else `None` when another holds it. Held until the lock is dropped,
/// or its holder dies (SIGKILL too). The file is opened close-on-exec, so the
/// holder's children do not hold it.
pub fn lock_file(path: &Path, wait: bool) -> Result<Option<nix::fcntl::Flock<fs::File>>> {
    use nix::fcntl::{Flock, FlockArg};
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(RuntimeError::io("open", path))?;
    let how = if wait {
        FlockArg::LockExclusive
    } else {
        FlockArg::LockExclusiveNonblock
    };
    match Flock::lock(file, how) {
        Ok(l) => Ok(Some(l)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) if !wait => Ok(None),
        Err((_, e)) => Err(RuntimeError::sys(format!("flock {}", path.display()))(e)),
    }
}

/// [`lock_file`], waiting for it.
pub fn wait_for_lock(path: &Path) -> Result<nix::fcntl::Flock<fs::File>> {
    lock_file(path, true)?.ok_or_else(|| {
        RuntimeError::Failed(format!("flock {}: not taken while waiting", path.display()))
    })
}

/// Read JSON from `path`.
pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<T> {
    let data = fs::read(path).map_err(RuntimeError::io("read", path))?;
    serde_json::from_slice(&data).map_err(|source| RuntimeError::State {
        path: path.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trip_is_atomic_and_leaves_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        let s = BoxState::creating("abc".into());
        write_json(&p, &s).unwrap();
        let back: BoxState = read_json(&p).unwrap();
        assert_eq!(back.id, "abc");
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn dead_monitor_means_dead_box() {
        let mut s = BoxState::creating("x".into());
        assert_eq!(s.effective_status(), Status::Creating);
        s.monitor = Some(ProcRef {
            pid: i32::MAX,
            start_time: 1,
        });
        s.status = Status::Running;
        assert_eq!(s.effective_status(), Status::Dead);
        s.status = Status::Exited;
        assert_eq!(s.effective_status(), Status::Exited);
    }
}
