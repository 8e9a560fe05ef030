//! The server's records of its sandboxes and snapshots, kept on disk so that
//! a restarted `serve --http` knows the sandboxes of the one before: one JSON
//! file a sandbox, `LIB/e2b/sandboxes/ID.json` (id, template, metadata,
//! environment, access token, end of life, box, phase), and
//! `LIB/e2b/snapshots.json`. Each is written whole to a temporary file and
//! renamed over the old one, so a reader never sees half of one; they are
//! not synced (a crash of the machine may lose the last change: its box is
//! then nestbox's alone, `nestbox rm -f` removes it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{json, Value};

use crate::error::{E2bError, Result};
use crate::sandbox::{Live, Phase, Sandbox};
use crate::Snapshot;

/// Where the records of one root are.
#[derive(Debug)]
pub struct Records {
    dir: PathBuf,
    /// Serializes the writes (one file may be saved by two threads).
    write: Mutex<()>,
}

impl Records {
    /// The records under `lib` (the root's data directory).
    pub fn new(lib: &Path) -> Self {
        Records {
            dir: lib.join("e2b"),
            write: Mutex::new(()),
        }
    }

    fn sandboxes_dir(&self) -> PathBuf {
        self.dir.join("sandboxes")
    }

    fn write_file(&self, path: &Path, value: &Value) -> Result<()> {
        let _guard = self.write.lock().unwrap_or_else(|p| p.into_inner());
        let dir = path.parent().unwrap_or(&self.dir);
        std::fs::create_dir_all(dir).map_err(E2bError::io("create", dir))?;
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, value.to_string()).map_err(E2bError::io("write", &tmp))?;
        std::fs::rename(&tmp, path).map_err(E2bError::io("rename", path))
    }

    /// Write the record of `s` as it is now.
    pub fn save(&self, s: &Sandbox) -> Result<()> {
        let path = self.sandboxes_dir().join(format!("{}.json", s.id));
        self.write_file(&path, &to_json(s))
    }

    /// Remove the record of sandbox `id` (none: nothing to do).
    pub fn remove(&self, id: &str) -> Result<()> {
        let path = self.sandboxes_dir().join(format!("{id}.json"));
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(E2bError::io("remove", path)(e))
            }
            _ => Ok(()),
        }
    }

    /// Every sandbox recorded (a record that cannot be read is skipped, with
    /// a log line).
    pub fn load(&self) -> Vec<Sandbox> {
        let Ok(entries) = std::fs::read_dir(self.sandboxes_dir()) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                .and_then(|v| from_json(&v));
            match parsed {
                Some(s) => out.push(s),
                None => tracing::error!("e2b: unreadable sandbox record {}", path.display()),
            }
        }
        out
    }

    /// Write the list of snapshots.
    pub fn save_snapshots(&self, list: &[Snapshot]) -> Result<()> {
        let value: Vec<Value> = list
            .iter()
            .map(|s| json!({"id": s.id, "name": s.name, "sandboxID": s.sandbox_id}))
            .collect();
        self.write_file(&self.dir.join("snapshots.json"), &Value::Array(value))
    }

    /// The snapshots recorded.
    pub fn load_snapshots(&self) -> Vec<Snapshot> {
        let text = std::fs::read(self.dir.join("snapshots.json")).unwrap_or_default();
        let list: Vec<Value> = serde_json::from_slice(&text).unwrap_or_default();
        list.iter()
            .filter_map(|v| {
                Some(Snapshot {
                    id: v.get("id")?.as_str()?.to_string(),
                    name: v.get("name").and_then(Value::as_str).map(String::from),
                    sandbox_id: v.get("sandboxID")?.as_str()?.to_string(),
                })
            })
            .collect()
    }
}

fn to_json(s: &Sandbox) -> Value {
    let live = s.live();
    json!({
        "id": s.id,
        "template": s.template,
        "startedAt": s.started_at,
        "metadata": s.metadata,
        "env": s.env,
        "token": s.token,
        "autoPause": s.auto_pause,
        "box": live.box_name,
        "phase": live.phase.name(),
        "endAt": live.end_at,
        "generation": live.generation,
        "previous": live.previous,
    })
}

fn from_json(v: &Value) -> Option<Sandbox> {
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(String::from);
    let phase = match v.get("phase")?.as_str()? {
        "running" => Phase::Running,
        "paused" => Phase::Paused,
        _ => return None,
    };
    let metadata: BTreeMap<String, String> =
        serde_json::from_value(v.get("metadata")?.clone()).ok()?;
    let env: Vec<(String, String)> = serde_json::from_value(v.get("env")?.clone()).ok()?;
    let previous: Vec<String> = serde_json::from_value(v.get("previous")?.clone()).ok()?;
    Some(Sandbox {
        id: text("id")?,
        template: text("template")?,
        started_at: v.get("startedAt")?.as_f64()?,
        metadata,
        env,
        token: text("token")?,
        auto_pause: v.get("autoPause")?.as_bool()?,
        live: Mutex::new(Live {
            box_name: text("box")?,
            phase,
            end_at: v.get("endAt")?.as_f64()?,
            generation: v.get("generation")?.as_u64()? as u32,
            previous,
        }),
        procs: Default::default(),
        watchers: Default::default(),
        init: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_back_as_written() {
        let dir = std::env::temp_dir().join(format!("nestbox-e2b-records-{}", std::process::id()));
        let records = Records::new(&dir);
        let s = Sandbox {
            id: "e2b-0011".into(),
            template: "base".into(),
            started_at: 1.5,
            metadata: [("k".to_string(), "v".to_string())].into(),
            env: vec![("A".into(), "1".into())],
            token: "t0k".into(),
            auto_pause: true,
            live: Mutex::new(Live {
                box_name: "e2b-0011-r2".into(),
                phase: Phase::Paused,
                end_at: 99.25,
                generation: 2,
                previous: vec!["e2b-0011".into(), "e2b-0011-r1".into()],
            }),
            procs: Default::default(),
            watchers: Default::default(),
            init: Default::default(),
        };
        records.save(&s).unwrap();
        let back = records.load();
        assert_eq!(back.len(), 1);
        let b = &back[0];
        assert_eq!((b.id.as_str(), b.template.as_str()), ("e2b-0011", "base"));
        assert_eq!(
            (b.started_at, b.token.as_str(), b.auto_pause),
            (1.5, "t0k", true)
        );
        assert_eq!(
            (b.metadata.clone(), b.env.clone()),
            (s.metadata.clone(), s.env.clone())
        );
        let (l, m) = (b.live(), s.live());
        assert_eq!(
            (l.box_name, l.phase, l.end_at),
            (m.box_name, m.phase, m.end_at)
        );
        assert_eq!((l.generation, l.previous), (m.generation, m.previous));
        records.remove("e2b-0011").unwrap();
        records.remove("e2b-0011").unwrap();
        assert!(records.load().is_empty());

        let snaps = vec![Snapshot {
            id: "e2b-1-r1".into(),
            name: Some("named".into()),
            sandbox_id: "e2b-1".into(),
        }];
        records.save_snapshots(&snaps).unwrap();
        assert_eq!(records.load_snapshots(), snaps);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
