//! A box's snapshots and rollback layer on disk (see `docs/snapshots.md`).
//!
//! ```text
//! $ROOT/lib/boxes/<id>/snapshots/NAME.json   one snapshot: its layer manifest and figures
//! $ROOT/lib/boxes/<id>/snapshot.lock         flock: one snapshot, rollback or rm at a time
//! $ROOT/lib/boxes/<id>/rollback/layer.json   the snapshot layer the box was rolled back to,
//!                              /tree/        materialised (hardlinks into the store): the
//!                                            read-only layer between the image and upper-0
//! ```
//!
//! Everything lives in the box's data directory, so it goes with the box
//! (`rm`, `gc`); the objects a snapshot names stay in the store until
//! `store gc`, which keeps every object a snapshot or a rollback layer of a
//! live box names ([`referenced_inodes`]).
//!
//! A snapshot record is written to a temporary file, synced and linked into
//! place under its name (`RENAME_NOREPLACE`): killed at any instant, a snapshot
//! either exists whole or not at all. A rollback swaps directories with
//! renames; [`recover`] finishes (or undoes) a swap a crash interrupted, and runs
//! before anything reads the layers (a box's start only finishes it:
//! [`finish_swap`]). The layers a swap replaced wait in a locked trash
//! directory ([`set_aside_replaced`]) for a detached remover; `recover`
//! removes trash whose remover is gone.

use std::fs;
use std::io::Write;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nestbox_store::{Digest, LayerManifest};
use nix::fcntl::Flock;
use serde::{Deserialize, Serialize};

use crate::registry::{BoxRecord, Registry};
use crate::{Result, RuntimeError};

/// One snapshot of a box's writable layer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotRecord {
    /// Its name (unique per box).
    pub name: String,
    /// The box's name when it was taken.
    #[serde(rename = "box")]
    pub box_name: String,
    /// The box's id.
    pub box_id: String,
    /// When it was taken (seconds since the epoch).
    pub created: f64,
    /// The snapshot it was taken incrementally after, if any.
    pub parent: Option<String>,
    /// Regular files in the layer.
    pub files: u64,
    /// Their content bytes.
    pub bytes: u64,
    /// Files read and hashed for it (the others were unchanged since `parent`).
    pub files_read: u64,
    /// Objects it added to the store.
    pub new_objects: u64,
    /// Content bytes it added to the store.
    pub new_bytes: u64,
    /// Milliseconds it took (up to writing its record).
    pub ms: f64,
    /// Of which: making its new objects durable and visible in the store
    /// (`syncfs`, renames into `objects/`, `syncfs`).
    #[serde(default)]
    pub publish_ms: f64,
    /// Whether the box's processes were checkpointed with it
    /// (`snapshot --checkpoint`: [`processes_dir`]); a rollback to it then
    /// puts them back too.
    #[serde(default)]
    pub processes: bool,
    /// The layer: every path of the box's writable layer.
    pub layer: LayerManifest,
}

/// The directory of `record`'s snapshots.
pub fn dir(record: &BoxRecord) -> PathBuf {
    record.lib_dir().join("snapshots")
}

/// The rollback layer directory of the box whose data directory is `lib`.
pub fn rollback_dir(lib: &Path) -> PathBuf {
    lib.join("rollback")
}

/// The materialised rollback layer of the box whose data directory is `lib`
/// (the overlay's top lower directory), if the box was rolled back.
pub fn rollback_tree(lib: &Path) -> Option<PathBuf> {
    let t = rollback_dir(lib).join("tree");
    t.is_dir().then_some(t)
}

/// The layer the box was rolled back to (empty if it never was).
pub fn rollback_layer(lib: &Path) -> Result<LayerManifest> {
    let path = rollback_dir(lib).join("layer.json");
    if !path.exists() {
        return Ok(LayerManifest::empty());
    }
    crate::state::read_json(&path)
}

/// Take `record`'s snapshot lock (released on drop).
pub fn lock(record: &BoxRecord) -> Result<Flock<fs::File>> {
    let path = record.lib_dir().join("snapshot.lock");
    match crate::state::lock_file(&path, true) {
        Ok(Some(lock)) => Ok(lock),
        // A wait for the lock ends with it.
        Ok(None) => Err(RuntimeError::Failed(format!("flock {}", path.display()))),
        // The box's data directory is gone: the box is.
        Err(RuntimeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Err(RuntimeError::NoSuchBox(record.name().to_string()))
        }
        Err(e) => Err(e),
    }
}

/// Check a snapshot name: the rules of image names.
pub fn validate_name(name: &str) -> Result<()> {
    nestbox_store::validate_name(name).map_err(|e| {
        RuntimeError::InvalidInput(
            e.to_string()
                .replacen("invalid image name", "invalid snapshot name", 1)
                .replace(": \"host\" is the built-in host image", ": reserved"),
        )
    })
}

/// Every snapshot of `record`, oldest first.
pub fn list(record: &BoxRecord) -> Result<Vec<SnapshotRecord>> {
    let d = dir(record);
    let mut out: Vec<SnapshotRecord> = Vec::new();
    let entries = match fs::read_dir(&d) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(RuntimeError::io("read directory", &d)(e)),
    };
    for e in entries {
        let e = e.map_err(RuntimeError::io("read directory", &d))?;
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        match crate::state::read_json::<SnapshotRecord>(&e.path()) {
            Ok(s) => out.push(s),
            // Removed meanwhile by `snapshot rm`.
            Err(RuntimeError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
    }
    out.sort_by(|a, b| a.created.total_cmp(&b.created).then(a.name.cmp(&b.name)));
    Ok(out)
}

/// The names of `record`'s snapshots, oldest first (by the time their record
/// was written), without reading them.
pub fn names(record: &BoxRecord) -> Result<Vec<String>> {
    let d = dir(record);
    let entries = match fs::read_dir(&d) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(RuntimeError::io("read directory", &d)(e)),
    };
    let mut out: Vec<(std::time::SystemTime, String)> = Vec::new();
    for e in entries {
        let e = e.map_err(RuntimeError::io("read directory", &d))?;
        let file = e.file_name().to_string_lossy().to_string();
        let Some(name) = file.strip_suffix(".json") else {
            continue;
        };
        if file.starts_with('.') {
            continue;
        }
        // Removed meanwhile by `snapshot rm`: not listed.
        if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
            out.push((t, name.to_string()));
        }
    }
    out.sort();
    Ok(out.into_iter().map(|(_, n)| n).collect())
}

/// Snapshot `name` of `record`. Unknown: the error says whose it is if another
/// box of the registry has one of that name.
pub fn load(reg: &Registry, record: &BoxRecord, name: &str) -> Result<SnapshotRecord> {
    validate_name(name)?;
    let path = dir(record).join(format!("{name}.json"));
    match crate::state::read_json(&path) {
        Ok(s) => Ok(s),
        Err(RuntimeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            let owner = reg.list().ok().and_then(|all| {
                all.into_iter()
                    .find(|r| dir(r).join(format!("{name}.json")).exists())
            });
            Err(match owner {
                Some(o) => RuntimeError::SnapshotOfOtherBox {
                    box_name: record.name().to_string(),
                    name: name.to_string(),
                    owner: o.name().to_string(),
                },
                None => RuntimeError::NoSuchSnapshot {
                    box_name: record.name().to_string(),
                    name: name.to_string(),
                },
            })
        }
        Err(e) => Err(e),
    }
}

/// Whether `record` has a snapshot `name`.
pub fn exists(record: &BoxRecord, name: &str) -> bool {
    dir(record).join(format!("{name}.json")).exists()
}

/// Write a new snapshot record: whole or not at all, never over another.
pub fn write_new(record: &BoxRecord, snap: &SnapshotRecord) -> Result<()> {
    let d = dir(record);
    match fs::create_dir(&d) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(RuntimeError::io("mkdir", &d)(e)),
    }
    let fin = d.join(format!("{}.json", snap.name));
    let tmp = d.join(format!(".{}.{}.tmp", snap.name, std::process::id()));
    let data = serde_json::to_vec(snap).map_err(|source| RuntimeError::State {
        path: fin.clone(),
        source,
    })?;
    let written = (|| {
        let mut f = fs::File::create(&tmp).map_err(RuntimeError::io("create", &tmp))?;
        f.write_all(&data)
            .map_err(RuntimeError::io("write", &tmp))?;
        f.sync_all().map_err(RuntimeError::io("fsync", &tmp))?;
        nix::fcntl::renameat2(
            None,
            &tmp,
            None,
            &fin,
            nix::fcntl::RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|e| match e {
            nix::errno::Errno::EEXIST => RuntimeError::SnapshotExists {
                box_name: record.name().to_string(),
                name: snap.name.clone(),
            },
            e => RuntimeError::sys(format!("rename {}", fin.display()))(e),
        })
    })();
    if written.is_err() {
        // The write's error is the one to report; a leftover temporary file
        // is hidden from `list` and goes with the box.
        let _ = fs::remove_file(&tmp);
    }
    written?;
    fs::File::open(&d)
        .and_then(|f| f.sync_all())
        .map_err(RuntimeError::io("fsync", &d))
}

/// Remove snapshot `name` of `record` (the record first: a removal cut short
/// leaves an unlisted checkpoint of processes, which [`recover`] removes).
pub fn remove(reg: &Registry, record: &BoxRecord, name: &str) -> Result<()> {
    load(reg, record, name)?;
    let path = dir(record).join(format!("{name}.json"));
    fs::remove_file(&path).map_err(RuntimeError::io("remove", &path))?;
    let processes = processes_dir(record, name);
    if processes.exists() {
        fs::remove_dir_all(&processes).map_err(RuntimeError::io("remove", &processes))?;
    }
    Ok(())
}

/// What ends the name of a snapshot's checkpoint of processes.
const PROCESSES: &str = ".processes";

/// The checkpoint of the processes of snapshot `name` of `record`, taken with
/// it (`snapshot --checkpoint`): a checkpoint directory without layers (its
/// files are the snapshot's layer), its pages in the host's page pool.
pub fn processes_dir(record: &BoxRecord, name: &str) -> PathBuf {
    dir(record).join(format!("{name}{PROCESSES}"))
}

/// The checkpoints of processes of every snapshot of every box of `reg`
/// (`gc` keeps their pages).
pub fn processes_dirs(reg: &Registry) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for r in reg.list()? {
        let Ok(entries) = fs::read_dir(dir(&r)) else {
            continue;
        };
        out.extend(
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(PROCESSES))
                .map(|e| e.path()),
        );
    }
    Ok(out)
}

/// Remove the checkpoints of processes in snapshot directory `snapshots`
/// whose snapshot has no record: a snapshot killed after its checkpoint was
/// in place, or a removal cut short (called under the snapshot lock, so no
/// snapshot is being written).
fn remove_orphan_processes(snapshots: &Path) {
    let Ok(entries) = fs::read_dir(snapshots) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        let Some(name) = file.strip_suffix(PROCESSES) else {
            continue;
        };
        if !snapshots.join(format!("{name}.json")).exists() {
            crate::diag::warn_on_err(
                None,
                "removing the checkpoint of an unfinished snapshot",
                fs::remove_dir_all(e.path()).map_err(RuntimeError::io("remove", e.path())),
            );
        }
    }
}

/// Every store inode a snapshot or a rollback layer of a box of `reg` names
/// (what `store gc` must keep).
pub fn referenced_inodes(reg: &Registry) -> Result<Vec<(Digest, String)>> {
    let mut out = Vec::new();
    for r in reg.list()? {
        for s in list(&r)? {
            out.extend(s.layer.inodes());
        }
        out.extend(rollback_layer(r.lib_dir())?.inodes());
    }
    Ok(out)
}

/// Names of the directories a rollback swap moves through.
const NEW: &str = ".rollback-new";
const OLD_LAYER: &str = ".rollback-old";
const OLD_UPPER: &str = ".upper-old";
const OLD_WORK: &str = ".work-old";

/// Where a rollback materialises the snapshot layer before [`swap_in`].
pub fn staging_dir(lib: &Path) -> PathBuf {
    lib.join(NEW)
}

/// Make the materialised layer in [`staging_dir`] the box's rollback layer
/// under a fresh, empty writable layer (`upper`, `work`: the box's layer 0,
/// owned as `owner`). The box must not be running.
///
/// The order makes every crash recoverable: the old upper and work
/// directories are renamed away first (from then on [`recover`] completes the
/// swap), then the layers are exchanged, then the empty ones made. The
/// replaced directories are left for [`set_aside_replaced`] (after the box
/// has started again).
pub fn swap_in(lib: &Path, upper: &Path, work: &Path, owner: (u32, u32)) -> Result<()> {
    let rename = |a: &Path, b: &Path| fs::rename(a, b).map_err(RuntimeError::io("rename", b));
    let base = upper.parent().unwrap_or(lib);
    for (from, to) in [(work, base.join(OLD_WORK)), (upper, base.join(OLD_UPPER))] {
        if from.exists() {
            rename(from, &to)?;
        }
    }
    complete(lib, base)?;
    for d in [upper, work] {
        fs::DirBuilder::new()
            .mode(0o755)
            .create(d)
            .map_err(RuntimeError::io("mkdir", d))?;
        nix::unistd::chown(d, Some(owner.0.into()), Some(owner.1.into()))
            .map_err(RuntimeError::sys(format!("chown {}", d.display())))?;
    }
    Ok(())
}

/// Where the layers one rollback replaced wait for their removal: a
/// directory `.replaced-<pid>-<n>` beside them (one per filesystem: a box's
/// layers may be on its own disk), flocked by whoever removes it.
const REPLACED: &str = ".replaced-";

/// The layers a [`swap_in`] replaced, moved out of the way under names no
/// later rollback uses, each trash directory open and flocked (the lock goes
/// with a process that inherits the descriptors: see
/// [`crate::process::discard_in_background`]).
#[derive(Debug)]
pub struct Replaced {
    /// The trash directories and their locks.
    pub dirs: Vec<(PathBuf, Flock<fs::File>)>,
}

/// Move what [`swap_in`] replaced into locked trash directories (renames
/// only: the box's next snapshot, rollback or start need not wait for the
/// removal, and [`recover`] leaves a locked trash directory to its remover).
/// What cannot be moved is removed here.
pub fn set_aside_replaced(lib: &Path, upper: &Path) -> Replaced {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let base = upper.parent().unwrap_or(lib);
    let mut dirs: Vec<(PathBuf, Flock<fs::File>)> = Vec::new();
    let mut left = Vec::new();
    for d in [
        lib.join(OLD_LAYER),
        base.join(OLD_UPPER),
        base.join(OLD_WORK),
    ] {
        if !d.exists() {
            continue;
        }
        let parent = d.parent().unwrap_or(lib).to_path_buf();
        let trash = match dirs.iter().position(|(t, _)| t.parent() == Some(&parent)) {
            Some(i) => Some(i),
            None => {
                let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let t = parent.join(format!("{REPLACED}{}-{n}", std::process::id()));
                let made = fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&t)
                    .and_then(|()| fs::File::open(&t))
                    .ok()
                    .and_then(|f| Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).ok());
                match made {
                    Some(lock) => {
                        dirs.push((t, lock));
                        Some(dirs.len() - 1)
                    }
                    None => {
                        // Empty if made: removed with the leftovers below.
                        let _ = fs::remove_dir(&t);
                        None
                    }
                }
            }
        };
        let moved = trash.is_some_and(|i| {
            let name = d.file_name().expect("a named directory");
            fs::rename(&d, dirs[i].0.join(name)).is_ok()
        });
        if !moved {
            left.push(d);
        }
    }
    for d in left {
        crate::diag::warn_on_err(
            None,
            "removing a replaced layer",
            crate::registry::remove_tree(&d),
        );
    }
    Replaced { dirs }
}

/// After the old upper was moved away: exchange the rollback layers.
fn complete(lib: &Path, base: &Path) -> Result<()> {
    let new = lib.join(NEW);
    if !new.exists() || !base.join(OLD_UPPER).exists() {
        return Ok(());
    }
    let cur = rollback_dir(lib);
    if cur.exists() {
        fs::rename(&cur, lib.join(OLD_LAYER)).map_err(RuntimeError::io("rename", &cur))?;
    }
    fs::rename(&new, &cur).map_err(RuntimeError::io("rename", &cur))
}

fn remove_leftovers(lib: &Path, base: &Path) {
    // Trash of rollbacks whose remover is gone (its lock can be taken).
    for dir in [lib, base] {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.file_name().to_string_lossy().starts_with(REPLACED) {
                continue;
            }
            let t = e.path();
            let free = fs::File::open(&t)
                .ok()
                .and_then(|f| Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock).ok());
            if free.is_some() {
                crate::diag::warn_on_err(
                    None,
                    "removing a replaced layer",
                    crate::registry::remove_tree(&t),
                );
            }
        }
        if base == lib {
            break;
        }
    }
    for d in [
        lib.join(NEW),
        lib.join(OLD_LAYER),
        base.join(OLD_UPPER),
        base.join(OLD_WORK),
    ] {
        if d.exists() {
            crate::diag::warn_on_err(
                None,
                "removing a replaced layer",
                crate::registry::remove_tree(&d),
            );
        }
    }
}

/// Finish a swap a crash interrupted, if one did, for the box whose data
/// directory is `lib` and layer-0 upper directory is `upper`, without
/// removing anything: what a box's start needs (the box then sees the layers
/// the swap put in place). [`recover`] removes the rest later.
pub fn finish_swap(lib: &Path, upper: &Path) -> Result<()> {
    complete(lib, upper.parent().unwrap_or(lib))
}

/// Finish a rollback a crash interrupted (or drop one that had not begun to
/// swap) for the box whose data directory is `lib` and layer-0 upper
/// directory is `upper`.
pub fn recover(lib: &Path, upper: &Path) -> Result<()> {
    remove_orphan_processes(&lib.join("snapshots"));
    let base = upper.parent().unwrap_or(lib);
    if !has_trash(lib)
        && !has_trash(base)
        && !lib.join(NEW).exists()
        && !lib.join(OLD_LAYER).exists()
        && !base.join(OLD_UPPER).exists()
        && !base.join(OLD_WORK).exists()
    {
        return Ok(());
    }
    complete(lib, base)?;
    remove_leftovers(lib, base);
    Ok(())
}

/// Whether directory `dir` holds a trash directory of replaced layers.
fn has_trash(dir: &Path) -> bool {
    fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(REPLACED))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A box data directory with a layer 0 (`upper-0/f`, `work-0`), a
    /// rollback layer (`rollback/tree/old`) and a staged one.
    fn layout() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let lib = t.path().to_path_buf();
        let (upper, work) = (lib.join("upper-0"), lib.join("work-0"));
        fs::create_dir_all(&upper).unwrap();
        fs::write(upper.join("f"), "written by the box").unwrap();
        fs::create_dir_all(work.join("work")).unwrap();
        fs::create_dir_all(rollback_dir(&lib).join("tree")).unwrap();
        fs::write(rollback_dir(&lib).join("tree/old"), "old layer").unwrap();
        fs::create_dir_all(staging_dir(&lib).join("tree")).unwrap();
        fs::write(staging_dir(&lib).join("tree/new"), "new layer").unwrap();
        (t, lib, upper, work)
    }

    fn owner() -> (u32, u32) {
        (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        )
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        n.sort();
        n
    }

    /// What a swap replaced goes into one locked trash directory; `recover`
    /// leaves it while its lock is held and removes it once it is free.
    #[test]
    fn replaced_layers_wait_in_locked_trash() {
        let (_t, lib, upper, work) = layout();
        swap_in(&lib, &upper, &work, owner()).unwrap();
        assert!(lib.join("rollback/tree/new").exists());
        assert_eq!(fs::read_dir(&upper).unwrap().count(), 0, "a fresh upper");
        let replaced = set_aside_replaced(&lib, &upper);
        assert_eq!(replaced.dirs.len(), 1);
        let trash = replaced.dirs[0].0.clone();
        assert_eq!(names(&trash), [".rollback-old", ".upper-old", ".work-old"]);
        assert_eq!(
            fs::read_to_string(trash.join(".upper-old/f")).unwrap(),
            "written by the box"
        );
        assert_eq!(
            names(&lib),
            [
                trash.file_name().unwrap().to_string_lossy().to_string(),
                "rollback".into(),
                "upper-0".into(),
                "work-0".into()
            ]
        );
        // Its remover lives: left to it.
        recover(&lib, &upper).unwrap();
        assert!(trash.exists());
        // Its remover is gone: removed by the next recover, and nothing else.
        drop(replaced);
        recover(&lib, &upper).unwrap();
        assert!(!trash.exists());
        assert_eq!(names(&lib), ["rollback", "upper-0", "work-0"]);
        assert!(lib.join("rollback/tree/new").exists());
    }

    /// A swap interrupted after the old upper was moved away is finished
    /// by a box's start (`finish_swap`), which removes nothing; `recover`
    /// removes the rest.
    #[test]
    fn an_interrupted_swap_is_finished_by_a_start_without_removals() {
        let (_t, lib, upper, work) = layout();
        fs::rename(&work, lib.join(OLD_WORK)).unwrap();
        fs::rename(&upper, lib.join(OLD_UPPER)).unwrap();
        finish_swap(&lib, &upper).unwrap();
        assert!(lib.join("rollback/tree/new").exists(), "the new layer in");
        assert!(lib.join(OLD_LAYER).join("tree/old").exists());
        assert!(lib.join(OLD_UPPER).join("f").exists());
        // Again: nothing more to do.
        finish_swap(&lib, &upper).unwrap();
        recover(&lib, &upper).unwrap();
        assert_eq!(names(&lib), ["rollback"]);
        assert!(lib.join("rollback/tree/new").exists());
    }
}
