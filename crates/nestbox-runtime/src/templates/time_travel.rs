//! Time travel of a box's disk: `snapshot` records the box's writable layer
//! (content-addressed in the store, reading only files changed since the last
//! snapshot), `rollback` puts the box's files back as a snapshot had them (a
//! running box is stopped and started again), `diff` lists the paths the box
//! sees differently from its image or from a snapshot, `snapshot ls|rm`
//! manage them. See `docs/snapshots.md`; the records are [`crate::snapshots`].
//!
//! A box rolled back gets the snapshot's layer as a read-only overlay layer
//! (hardlinks into the store, made in milliseconds) under a fresh, empty
//! writable layer: nothing is copied, and what the box writes afterwards is
//! copied up as usual. Its next snapshot is that layer with the new writable
//! layer stacked on it ([`LayerManifest::compose`]).

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nestbox_store::{Change, Contents, LayerManifest, LowerDirs, Store, Txn};
use serde::Serialize;

use crate::registry::{BoxRecord, Registry};
use crate::snapshots::{self, SnapshotRecord};
use crate::state::Status;
use crate::{Result, RuntimeError};

/// What `snapshot ls` shows of one snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotInfo {
    /// Its name.
    pub name: String,
    /// The box.
    #[serde(rename = "box")]
    pub box_name: String,
    /// When it was taken (seconds since the epoch).
    pub created: f64,
    /// The snapshot it was taken after.
    pub parent: Option<String>,
    /// Regular files in the layer.
    pub files: u64,
    /// Their content bytes.
    pub bytes: u64,
    /// Files read for it.
    pub files_read: u64,
    /// Objects it added to the store.
    pub new_objects: u64,
    /// Bytes it added to the store.
    pub new_bytes: u64,
    /// Milliseconds it took.
    pub ms: f64,
    /// Of which: making its new objects durable and visible in the store.
    pub publish_ms: f64,
    /// Whether its processes were checkpointed with it (`--checkpoint`).
    pub processes: bool,
}

impl From<&SnapshotRecord> for SnapshotInfo {
    fn from(s: &SnapshotRecord) -> Self {
        SnapshotInfo {
            name: s.name.clone(),
            box_name: s.box_name.clone(),
            created: s.created,
            parent: s.parent.clone(),
            files: s.files,
            bytes: s.bytes,
            files_read: s.files_read,
            new_objects: s.new_objects,
            new_bytes: s.new_bytes,
            ms: s.ms,
            publish_ms: s.publish_ms,
            processes: s.processes,
        }
    }
}

/// What a rollback did.
#[derive(Debug, Clone, Serialize)]
pub struct RollbackReport {
    /// The box.
    #[serde(rename = "box")]
    pub box_name: String,
    /// The snapshot.
    pub snapshot: String,
    /// Whether the box was running, and so was stopped and started again.
    pub restarted: bool,
    /// Whether its processes were put back as the snapshot had them
    /// (`snapshot --checkpoint`): the box runs them now, whether it ran
    /// before or not.
    pub processes: bool,
    /// Milliseconds to make the snapshot's layer (before the box is stopped).
    pub materialise_ms: f64,
    /// Milliseconds the box's files took to change (the layer swap).
    pub swap_ms: f64,
    /// Milliseconds from the stop of a running box to its command running
    /// again (stop, swap, start); the swap alone for a box not running.
    pub downtime_ms: f64,
    /// Milliseconds of the whole rollback (stop and start included).
    pub total_ms: f64,
}

fn store(reg: &Registry) -> Result<Store> {
    Store::open(&nestbox_image::store_dir(&reg.roots().images())).map_err(|source| {
        RuntimeError::Snapshot {
            box_name: String::new(),
            source,
        }
    })
}

fn in_store<T>(record: &BoxRecord, r: nestbox_store::Result<T>) -> Result<T> {
    r.map_err(|source| RuntimeError::Snapshot {
        box_name: record.name().to_string(),
        source,
    })
}

/// Take a snapshot of box `box_name`'s writable layer, named `name` (default:
/// `snap-N`). A running box is frozen while its layer is read, so the snapshot
/// is one instant of it. With `processes` (`--checkpoint`), the box's
/// processes are checkpointed in the same freeze (the box must run, as for
/// `checkpoint --leave-running`), and a rollback to the snapshot puts them
/// back too.
pub fn snapshot(
    reg: &Registry,
    box_name: &str,
    name: Option<&str>,
    processes: bool,
) -> Result<SnapshotRecord> {
    let started = Instant::now();
    let record = reg.load(box_name)?;
    if let Some(n) = name {
        snapshots::validate_name(n)?;
    }
    // One at a time with the box's clones, freezes and checkpoints (taken
    // before the snapshot lock, as `rollback` never takes it), and the box
    // read again under it.
    let _box_lock = match processes {
        true => Some(crate::clone::box_lock(&record)?),
        false => None,
    };
    let record = reg.load(box_name)?;
    if processes {
        refuse_checkpoint(&record)?;
    }
    let _lock = snapshots::lock(&record)?;
    let (upper, _) = record.layer_dirs(0);
    snapshots::recover(record.lib_dir(), &upper)?;
    // Only the newest snapshot is read: its stamps tell which files changed.
    let existing = snapshots::names(&record)?;
    let name = match name {
        Some(n) => n.to_string(),
        None => (existing.len() + 1..)
            .map(|i| format!("snap-{i}"))
            .find(|n| !existing.contains(n))
            .expect("an unused name"),
    };
    if existing.contains(&name) {
        return Err(RuntimeError::SnapshotExists {
            box_name: box_name.to_string(),
            name,
        });
    }
    let previous = match existing.last() {
        Some(n) => Some(snapshots::load(reg, &record, n)?),
        None => None,
    };
    let previous = previous.as_ref();
    crate::phases::mark("snapshot: locked, newest snapshot read");
    let base = snapshots::rollback_layer(record.lib_dir())?;
    let store = store(reg)?;
    let txn = in_store(&record, Txn::begin(&store))?;
    let scan = || {
        let scanned = if upper.is_dir() {
            nestbox_store::scan_upper(&upper, previous.map(|p| &p.layer), Contents::Store(&txn))
        } else {
            Ok((LayerManifest::empty(), Default::default()))
        };
        in_store(&record, scanned)
    };
    let processes_dir = snapshots::processes_dir(&record, &name);
    let (upper_layer, scan) = if processes {
        // The layer is read while the checkpoint has the box frozen.
        let dir = snapshots::dir(&record);
        std::fs::create_dir_all(&dir).map_err(RuntimeError::io("mkdir", &dir))?;
        let mut scanned = None;
        crate::checkpoint::checkpoint_processes(
            reg,
            &record,
            &format!("{}.{name}", record.state.id),
            &processes_dir,
            false,
            &mut || {
                scanned = Some(scan()?);
                Ok(())
            },
        )?;
        scanned.expect("the layer scanned in the checkpoint's freeze")
    } else {
        let frozen = match (&record.state.cgroup, record.state.effective_status()) {
            (Some(cg), Status::Running) => match cg.set_frozen(true, Duration::from_secs(5)) {
                Ok(()) => Some(cg),
                Err(e) => {
                    tracing::warn!(
                        box_name,
                        "snapshot of a running box without freezing it: {e}"
                    );
                    None
                }
            },
            _ => None,
        };
        crate::phases::mark("snapshot: box frozen");
        let scanned = scan();
        crate::phases::mark("snapshot: layer read and staged");
        if let Some(cg) = frozen {
            crate::diag::warn_on_err(
                Some(box_name),
                "thawing after the snapshot",
                cg.set_frozen(false, Duration::from_secs(5)),
            );
        }
        scanned?
    };
    let layer = base.compose(&upper_layer);
    // A snapshot that fails after its checkpoint of processes was put in
    // place takes it out again.
    let or_drop_processes = |r: Result<()>| {
        if r.is_err() && processes {
            crate::diag::warn_on_err(
                Some(box_name),
                "removing the checkpoint of a failed snapshot",
                std::fs::remove_dir_all(&processes_dir)
                    .map_err(RuntimeError::io("remove", &processes_dir)),
            );
        }
        r
    };
    let publish = Instant::now();
    or_drop_processes(in_store(&record, txn.publish()))?;
    let publish_ms = publish.elapsed().as_secs_f64() * 1000.0;
    crate::phases::mark("snapshot: contents published");
    let stats = txn.stats();
    let (files, bytes) = layer.file_stats();
    let snap = SnapshotRecord {
        name,
        box_name: box_name.to_string(),
        box_id: record.state.id.clone(),
        created: crate::state::now(),
        parent: previous.map(|p| p.name.clone()),
        files,
        bytes,
        files_read: scan.files_read,
        new_objects: stats.new_objects,
        new_bytes: stats.new_bytes,
        ms: started.elapsed().as_secs_f64() * 1000.0,
        publish_ms,
        processes,
        layer,
    };
    // The record last, while the transaction still holds the store's shared
    // lock: `store gc` sees either no snapshot or a whole one. (A checkpoint
    // of processes left without it is removed by the next `recover`.)
    or_drop_processes(snapshots::write_new(&record, &snap))?;
    crate::phases::mark("snapshot: record written");
    drop(txn);
    Ok(snap)
}

/// Refuse `snapshot --checkpoint` of box `record` for what a rollback could
/// not put back: a template (frozen: `template save` keeps it on disk), a
/// clone or a restored box (their root stands on another box's or a
/// checkpoint's layers, and they are not started again), a box not running.
fn refuse_checkpoint(record: &BoxRecord) -> Result<()> {
    let wrong = |problem: &str| RuntimeError::WrongState {
        name: record.name().to_string(),
        problem: problem.to_string(),
    };
    if record.state.template.is_some() {
        return Err(wrong(
            "is a template: its processes are kept by `template save`, not by a snapshot",
        ));
    }
    if record.spec.clone_of.is_some() || record.spec.restore_of.is_some() {
        return Err(wrong(
            "is a clone or a restored box: a snapshot of it records its files only (without --checkpoint)",
        ));
    }
    if record.spec.remove_on_exit {
        return Err(wrong(
            "was started with --rm: a rollback could not stop it without removing it",
        ));
    }
    if record.state.effective_status() != Status::Running {
        return Err(RuntimeError::NotRunning(record.name().to_string()));
    }
    Ok(())
}

/// Put box `box_name`'s files back as snapshot `name` had them. A running box
/// is stopped (SIGTERM, SIGKILL after `stop_timeout`) and started again from
/// its spec; a box that is not running stays so, its layer rolled back. A
/// snapshot taken with `--checkpoint` puts the processes back too: the box's
/// processes are killed and the snapshot's restored in their place, the box
/// running them afterwards (also when it was not running).
pub fn rollback(
    reg: &Registry,
    box_name: &str,
    name: &str,
    stop_timeout: Duration,
) -> Result<RollbackReport> {
    let started = Instant::now();
    let record = reg.load(box_name)?;
    let _lock = snapshots::lock(&record)?;
    let snap = snapshots::load(reg, &record, name)?;
    crate::phases::mark("rollback: snapshot record read");
    let status = record.state.effective_status();
    let wrong = |problem: &str| RuntimeError::WrongState {
        name: box_name.to_string(),
        problem: problem.to_string(),
    };
    if record.state.template.is_some() || status == Status::Frozen {
        return Err(wrong(
            "is a template: its clones see its layer, which cannot be rolled back",
        ));
    }
    if status == Status::Creating {
        return Err(wrong("is being created: roll it back once it runs"));
    }
    let running = status == Status::Running;
    if running && record.spec.remove_on_exit {
        return Err(wrong(
            "was started with --rm: stopping it for the rollback would remove it",
        ));
    }
    if running
        && !snap.processes
        && (record.spec.clone_of.is_some() || record.spec.restore_of.is_some())
    {
        return Err(wrong(
            "is a clone or a restored box, which cannot be started again: stop it first (its files can then be rolled back)",
        ));
    }
    let lib = record.lib_dir().to_path_buf();
    let (upper, work) = record.layer_dirs(0);
    snapshots::recover(&lib, &upper)?;
    let staging = snapshots::staging_dir(&lib);
    let store = store(reg)?;
    let made = std::fs::create_dir(&staging)
        .map_err(RuntimeError::io("mkdir", &staging))
        .and_then(|()| {
            in_store(
                &record,
                nestbox_store::materialise(
                    &store,
                    &snap.layer,
                    &staging.join("tree"),
                    // A box in a user namespace mounts its overlay with
                    // `userxattr`: its opaque marker is a user xattr.
                    record.spec.userns || record.state.idmap.is_some(),
                ),
            )
        })
        .and_then(|()| {
            crate::phases::mark("rollback: tree made");
            crate::state::write_json(&staging.join("layer.json"), &snap.layer)
        });
    if let Err(e) = made {
        crate::diag::warn_on_err(
            Some(box_name),
            "removing a half-made rollback layer",
            crate::registry::remove_tree(&staging),
        );
        return Err(e);
    }
    let materialise_ms = started.elapsed().as_secs_f64() * 1000.0;
    crate::phases::mark("rollback: layer materialised");
    let down = Instant::now();
    // The box's mount namespace, held while it stops: its root overlay is
    // then not unmounted in its last process's exit (where overlayfs syncs
    // the whole filesystem under its upper layer, the old layer's dirty
    // files included, and the stop waits for it), but once the box runs
    // again, in the background (see `docs/snapshots.md`).
    let held_ns = if running {
        record
            .state
            .init
            .as_ref()
            .and_then(crate::process::hold_mount_ns)
    } else {
        None
    };
    if running {
        // Processes put back from the snapshot replace the box's: nothing of
        // their state is kept, so they are not asked to end but killed.
        let killed = match (&record.state.cgroup, snap.processes) {
            (Some(cg), true) => cg.kill_all().map_err(RuntimeError::from),
            _ => Ok(()),
        };
        let stopped = killed
            .and_then(|()| crate::lifecycle::ops::stop(reg, box_name, stop_timeout))
            .and_then(|()| {
                // A stop returns once the monitor recorded the end or gave up
                // waiting for it: a box whose init outlived even SIGKILL (stuck
                // in the kernel) still uses its layer, which is not swapped then.
                match record.state.init {
                    Some(init) if init.alive() => Err(wrong(
                        "did not end (its init outlived SIGKILL): its files were not rolled back",
                    )),
                    _ => Ok(()),
                }
            });
        if let Err(e) = stopped {
            // Nothing changed but the layer staged: removed (what cannot be
            // is dropped by the next `recover`); the box's files are as they
            // were, whatever state the stop left it in.
            crate::diag::warn_on_err(
                Some(box_name),
                "removing the staged rollback layer",
                crate::registry::remove_tree(&staging),
            );
            return Err(e);
        }
        crate::phases::mark("rollback: box stopped");
    }
    let owner = std::fs::symlink_metadata(&upper)
        .map(|m| (m.uid(), m.gid()))
        .unwrap_or((0, 0));
    let swap_start = Instant::now();
    snapshots::swap_in(&lib, &upper, &work, owner)?;
    let swap_ms = swap_start.elapsed().as_secs_f64() * 1000.0;
    crate::phases::mark("rollback: layers swapped");
    let restarted = if snap.processes {
        // Its processes as the snapshot had them, in place of its command.
        let processes = snapshots::processes_dir(&record, name);
        reg.load(box_name)
            .and_then(|r| crate::checkpoint::restore_in_place(reg, &r, &processes).map(|_| ()))
    } else if running {
        crate::lifecycle::ops::restart_detached(reg, &reg.load(box_name)?)
    } else {
        Ok(())
    };
    let downtime_ms = down.elapsed().as_secs_f64() * 1000.0;
    crate::phases::mark("rollback: box started again");
    // The old layers (and the old root, still mounted in the held
    // namespace) go in the background: the box runs on its new ones.
    crate::process::discard_in_background(snapshots::set_aside_replaced(&lib, &upper), held_ns);
    crate::phases::mark("rollback: replaced layers handed off");
    restarted?;
    Ok(RollbackReport {
        box_name: box_name.to_string(),
        snapshot: name.to_string(),
        restarted: running,
        processes: snap.processes,
        materialise_ms,
        swap_ms,
        downtime_ms,
        total_ms: started.elapsed().as_secs_f64() * 1000.0,
    })
}

/// The paths box `box_name` sees differently now than with snapshot `name`
/// (or than its image, without one), sorted, as `docker diff` lists them.
pub fn diff(reg: &Registry, box_name: &str, name: Option<&str>) -> Result<Vec<(Change, String)>> {
    let record = reg.load(box_name)?;
    let _lock = snapshots::lock(&record)?;
    let (upper, _) = record.layer_dirs(0);
    snapshots::recover(record.lib_dir(), &upper)?;
    let from = match name {
        Some(n) => snapshots::load(reg, &record, n)?.layer,
        None => LayerManifest::empty(),
    };
    let newest = match snapshots::names(&record)?.last() {
        Some(n) => Some(snapshots::load(reg, &record, n)?),
        None => None,
    };
    let base = snapshots::rollback_layer(record.lib_dir())?;
    let scanned = if upper.is_dir() {
        nestbox_store::scan_upper(
            &upper,
            newest.as_ref().map(|s| &s.layer),
            Contents::HashOnly,
        )
    } else {
        Ok((LayerManifest::empty(), Default::default()))
    };
    let (upper_layer, _) = in_store(&record, scanned)?;
    let now = base.compose(&upper_layer);
    let image = nestbox_image::open_image(&record.spec.image, &reg.roots().images())?;
    let lowers: Vec<PathBuf> = image
        .root_view(None)?
        .layers
        .into_iter()
        .next()
        .map(|l| l.lowers)
        .unwrap_or_default();
    // Mount points the runtime makes in the layer for what it binds into
    // every box (and for the box's volumes and tmpfs) are not the box's
    // changes, as `docker diff` leaves out /etc/hosts and the like.
    let mounts: Vec<String> = RUNTIME_MOUNTS
        .iter()
        .map(|p| p.to_string())
        .chain(record.spec.volumes.iter().map(|v| rel(&v.target)))
        .chain(record.spec.tmpfs.iter().map(|t| rel(t)))
        .collect();
    Ok(nestbox_store::diff_layers(&from, &now, &LowerDirs(lowers))
        .into_iter()
        .filter(|(_, p)| !mounts.contains(p))
        .collect())
}

/// Files the runtime binds over in every box (their mount points appear in
/// the writable layer when the image lacks them).
const RUNTIME_MOUNTS: &[&str] = &[
    "etc/machine-id",
    "etc/hosts",
    "etc/resolv.conf",
    "etc/hostname",
];

fn rel(p: &std::path::Path) -> String {
    p.to_string_lossy().trim_start_matches('/').to_string()
}

/// The snapshots of box `box_name`, or of every box, oldest first per box.
pub fn list(reg: &Registry, box_name: Option<&str>) -> Result<Vec<SnapshotInfo>> {
    let records = match box_name {
        Some(n) => vec![reg.load(n)?],
        None => reg.list()?,
    };
    let mut out = Vec::new();
    for r in &records {
        out.extend(snapshots::list(r)?.iter().map(SnapshotInfo::from));
    }
    Ok(out)
}

/// Remove snapshot `name` of box `box_name` (its objects go at `store gc`
/// unless another snapshot or image has them).
pub fn remove(reg: &Registry, box_name: &str, name: &str) -> Result<()> {
    let record = reg.load(box_name)?;
    let _lock = snapshots::lock(&record)?;
    snapshots::remove(reg, &record, name)
}
