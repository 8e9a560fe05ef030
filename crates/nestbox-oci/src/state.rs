//! A container's record under the runtime root (`--root`, default
//! `/run/nestbox-oci`): one directory per container holding `state.json`
//! (written atomically) and, between `create` and `start`, the `exec.fifo` the
//! container's process waits on. The status is never stored: it is derived
//! from the process (alive, same start time), the fifo and the freezer, as
//! runc does, so a container whose process died is `stopped` without anyone
//! having to notice.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nestbox_cgroup::BoxCgroup;
use serde::{Deserialize, Serialize};

use crate::{OciError, Result};

/// Default runtime root.
pub const DEFAULT_ROOT: &str = "/run/nestbox-oci";
/// The OCI runtime spec version this runtime implements.
pub const OCI_VERSION: &str = "1.2.0";

/// What is recorded of a container.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// Container id.
    pub id: String,
    /// Host pid of the container's process.
    pub pid: i32,
    /// Its start time (field 22 of `/proc/PID/stat`), to tell a reused pid.
    pub start_time: u64,
    /// Bundle directory.
    pub bundle: PathBuf,
    /// Root filesystem.
    pub rootfs: PathBuf,
    /// Creation time, RFC 3339.
    pub created: String,
    /// Annotations of the config.
    pub annotations: BTreeMap<String, String>,
    /// The container's cgroup.
    pub cgroup: Option<BoxCgroup>,
    /// config.json had no process: `start` refuses the container.
    #[serde(default)]
    pub no_process: bool,
    /// The hooks still to run (startContainer, poststart, poststop).
    #[serde(default)]
    pub hooks: crate::hooks::Hooks,
    /// Forked from a nestbox template (`nestbox.template`): the clone; `pid`
    /// is then its box's monitor, the process the caller waits on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clone: Option<crate::clone::CloneLink>,
}

/// The status of a container, as the OCI spec names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Made, waiting for `start`.
    Created,
    /// Its process runs.
    Running,
    /// Frozen.
    Paused,
    /// Its process has exited.
    Stopped,
}

impl Status {
    /// The spec's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Created => "created",
            Status::Running => "running",
            Status::Paused => "paused",
            Status::Stopped => "stopped",
        }
    }
}

/// The runtime root and the containers in it.
#[derive(Debug, Clone)]
pub struct Root {
    dir: PathBuf,
}

/// Check a container id as runc does: letters, digits, `_`, `+`, `-`, `.`,
/// and not `.` or `..`.
pub fn validate_id(id: &str) -> Result<()> {
    let bad = |reason| {
        Err(OciError::InvalidId {
            id: id.to_string(),
            reason,
        })
    };
    if id.is_empty() {
        return bad("must not be empty");
    }
    if id.len() > 1024 {
        return bad("is longer than 1024 characters");
    }
    if id == "." || id == ".." {
        return bad("must not be . or ..");
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_+-.".contains(&b))
    {
        return bad("may only contain letters, digits, '_', '+', '-' and '.'");
    }
    Ok(())
}

impl Root {
    /// The root at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Root {
        Root { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Directory of container `id`.
    pub fn container_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    /// Reserve the directory of a new container `id`.
    pub fn reserve(&self, id: &str) -> Result<PathBuf> {
        validate_id(id)?;
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| OciError::io("create runtime root", &self.dir, e))?;
        let dir = self.container_dir(id);
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(OciError::Exists(id.to_string()))
            }
            Err(e) => Err(OciError::io("create container directory", dir, e)),
        }
    }

    /// Load container `id`.
    pub fn load(&self, id: &str) -> Result<Record> {
        validate_id(id)?;
        let path = self.container_dir(id).join("state.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OciError::NotFound(id.to_string()))
            }
            Err(e) => return Err(OciError::io("read", path, e)),
        };
        serde_json::from_str(&text).map_err(|e| OciError::Corrupt {
            path,
            message: e.to_string(),
        })
    }

    /// Save `rec` atomically.
    pub fn save(&self, rec: &Record) -> Result<()> {
        let dir = self.container_dir(&rec.id);
        let tmp = dir.join("state.json.tmp");
        let path = dir.join("state.json");
        let text = serde_json::to_string(rec).unwrap_or_default();
        std::fs::write(&tmp, text).map_err(|e| OciError::io("write", &tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| OciError::io("rename", &path, e))
    }

    /// The ids of every container, sorted.
    pub fn list(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ids),
            Err(e) => return Err(OciError::io("read", &self.dir, e)),
        };
        for e in entries.flatten() {
            if e.path().join("state.json").exists() {
                ids.push(e.file_name().to_string_lossy().into_owned());
            }
        }
        ids.sort();
        Ok(ids)
    }

    /// The fifo `start` opens to let the process of `id` exec.
    pub fn fifo(&self, id: &str) -> PathBuf {
        self.container_dir(id).join("exec.fifo")
    }

    /// The file that marks a container forked from a template as `created`
    /// (its processes stopped) until `start`.
    pub fn clone_created_marker(&self, id: &str) -> PathBuf {
        self.container_dir(id).join("clone.created")
    }

    /// The status of `rec`.
    pub fn status(&self, rec: &Record) -> Status {
        if !alive(rec.pid, rec.start_time) || rec.clone.as_ref().is_some_and(|c| !c.alive()) {
            return Status::Stopped;
        }
        if self.fifo(&rec.id).exists()
            || (rec.clone.is_some() && self.clone_created_marker(&rec.id).exists())
        {
            return Status::Created;
        }
        if rec.cgroup.as_ref().is_some_and(frozen) {
            return Status::Paused;
        }
        Status::Running
    }
}

/// Whether the freezer of `cg` holds its processes frozen.
fn frozen(cg: &BoxCgroup) -> bool {
    cg.dirs().iter().any(|d| {
        let v1 = std::fs::read_to_string(d.path.join("freezer.state"));
        let v2 = std::fs::read_to_string(d.path.join("cgroup.freeze"));
        v1.is_ok_and(|s| s.trim() == "FROZEN") || v2.is_ok_and(|s| s.trim() == "1")
    })
}

/// State letter and start time of `pid` from `/proc/PID/stat`.
pub fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// Whether `pid` is still the process that started at `start_time` and has
/// not exited (a zombie has).
pub fn alive(pid: i32, start_time: u64) -> bool {
    pid > 0
        && matches!(proc_stat(pid), Some((state, start)) if start == start_time && state != 'Z' && state != 'X')
}

/// The state JSON `state` prints and hooks read, as runc gives it.
pub fn state_json(rec: &Record, status: Status) -> serde_json::Value {
    let mut v = serde_json::json!({
        "ociVersion": OCI_VERSION,
        "id": rec.id,
        "pid": if status == Status::Stopped { 0 } else { rec.pid },
        "status": status.as_str(),
        "bundle": rec.bundle,
        "rootfs": rec.rootfs,
        "created": rec.created,
        "owner": "",
    });
    if !rec.annotations.is_empty() {
        v["annotations"] = serde_json::json!(rec.annotations);
    }
    v
}

/// Now as RFC 3339 UTC with nanoseconds (`2026-01-02T03:04:05.123456789Z`).
pub fn now_rfc3339() -> String {
    nestbox_runtime::diag::rfc3339(std::time::SystemTime::now(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_like_runc() {
        assert!(validate_id("abc-1.2_x+y").is_ok());
        assert!(validate_id("").is_err());
        assert!(validate_id("..").is_err());
        assert!(validate_id("a/b").is_err());
        assert!(validate_id("a b").is_err());
    }

    #[test]
    fn timestamps_are_rfc3339() {
        let t = now_rfc3339();
        assert_eq!(t.len(), 30, "{t}");
        assert!(t.starts_with("20") && t.ends_with('Z') && t.as_bytes()[10] == b'T');
    }

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let pid = std::process::id() as i32;
        let (_, start) = proc_stat(pid).unwrap();
        assert!(alive(pid, start));
        assert!(!alive(pid, start + 1));
    }
}
