//! `nestbox checkpoint` and `nestbox restore`: a box written to disk as plain
//! data, and a running box made from it again, on this host or another.
//!
//! A checkpoint is a directory `$LIB/checkpoints/NAME` with
//! `checkpoint.json` (the box's spec, the kernel and CPU it was taken on, and
//! every process as a [`nestbox_remote::ProcessImage`]: threads, registers,
//! signal state, fds, mappings) and one `pages-PID` file per process (records
//! of 40 bytes: address, u64 LE, then the BLAKE3 digest of the page's
//! contents). The pages themselves go to the host's page pool
//! (`$LIB/pages`, [`nestbox_store::PagePool`]): a page already there, from
//! any checkpoint of any box, is not written again, and zero pages are not
//! written at all. The box's writable root layers (its overlay upper
//! directories) are copied as `layer-N` (whiteouts, xattrs, owners and
//! hardlinks kept), while the box is frozen. The directory is written under a temporary name and renamed when
//! complete: a checkpoint killed midway is never listed, and `gc` removes
//! what it left.
//!
//! Restore starts a box from the checkpoint's spec, each `layer-N` a
//! read-only lower layer under the new box's own writable one (so boxes
//! restored from one checkpoint share its files), whose init waits for its process (as a clone shell's does), makes a stub
//! process in it with the image's pid (`nestbox_sys::process::spawn_stub`),
//! and hands it to [`nestbox_remote::restore_box`], which rebuilds it from the
//! image: memory from the page pool (every page checked against its digest
//! before the process runs), threads, fds, credentials, capabilities and the
//! box's seccomp filter.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nestbox_remote::{PageStore, ProcessImage, Tracee};
use nestbox_store::{Digest, PagePool};
use serde::{Deserialize, Serialize};

use crate::paths::layer_chain;
use crate::registry::{BoxRecord, Registry};
use crate::spec::BoxSpec;
use crate::{Result, RuntimeError};

/// How long the box's freezer may take.
pub(crate) const FREEZER_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of one record of a `pages-PID` file.
const PAGE_RECORD: usize = 40;

/// What `nestbox checkpoint` was asked.
#[derive(Debug, Clone, Default)]
pub struct CheckpointRequest {
    /// The checkpoint's name (default: the box's).
    pub name: Option<String>,
    /// Leave the box running afterwards (default: it is stopped).
    pub leave_running: bool,
    /// Write a self-contained checkpoint to this directory (with its own
    /// page pool and every layer), to move or keep outside this host's state.
    pub output: Option<PathBuf>,
}

/// A checkpoint as `checkpoint.json` holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Checkpoint {
    /// [`nestbox_remote::IMAGE_VERSION`] of the writer.
    pub version: u32,
    /// Its name.
    pub name: String,
    /// The box it was taken of.
    pub box_name: String,
    /// Seconds since the epoch.
    pub created_at: f64,
    /// The box's spec.
    pub spec: BoxSpec,
    /// Root layers copied (`layer-N`).
    pub layers: usize,
    /// The kernel release it was taken on (`uname -r`).
    pub kernel: String,
    /// The CPU's feature flags (`/proc/cpuinfo`).
    pub cpu_flags: Vec<String>,
    /// The template the box was, when it was one (`template save`,
    /// `freeze --persist`): `clone` revives it from here when it is gone.
    #[serde(default)]
    pub template: Option<String>,
    /// Its processes (the first is the box's main process).
    pub processes: Vec<ProcessImage>,
    /// What it took.
    pub stats: CheckpointStats,
}

/// Figures of one checkpoint.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CheckpointStats {
    /// Pages with contents (not zero).
    pub pages: u64,
    /// Of those, pages the pool did not have yet (written).
    pub pages_written: u64,
    /// Time the box was stopped, in milliseconds.
    pub frozen_ms: f64,
    /// Time of the whole checkpoint, in milliseconds.
    pub total_ms: f64,
}

/// Make `dir` (and its parents) if needed, listable by its owner only when
/// this makes it.
pub(crate) fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o711)
        .create(dir)
        .map_err(RuntimeError::io("create", dir))
}

/// Write `data` to a new file `path` readable by its owner only.
pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(data))
        .map_err(RuntimeError::io("write", path))
}

/// Where checkpoints live.
pub(crate) fn checkpoints_dir(reg: &Registry) -> PathBuf {
    reg.roots().lib.join("checkpoints")
}

/// The host's page pool.
pub(crate) fn pool_dir(reg: &Registry) -> PathBuf {
    reg.roots().lib.join("pages")
}

pub(crate) fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub(crate) fn problem(name: &str, problem: impl Into<String>) -> RuntimeError {
    RuntimeError::Checkpoint {
        name: name.to_string(),
        problem: problem.into(),
    }
}

pub(crate) fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

pub(crate) fn cpu_flags() -> Vec<String> {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find(|l| l.starts_with("flags"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.split_whitespace().map(str::to_string).collect())
        })
        .unwrap_or_default()
}

/// Checkpoint box `box_name`.
///
/// # Errors
/// A name in use or invalid, a box that is not running, a clone (checkpoint
/// its template instead), a process the engine cannot save (named); nothing
/// is left behind and the box continues as it was.
pub fn checkpoint(reg: &Registry, box_name: &str, req: &CheckpointRequest) -> Result<Checkpoint> {
    let start = Instant::now();
    let record = reg.load(box_name)?;
    // One at a time with clones, freezes and other checkpoints of the box,
    // and the box read again under the lock (it may have been frozen, made a
    // template or removed meanwhile).
    let _lock = crate::clone::box_lock(&record)?;
    let record = reg.load(box_name)?;
    crate::template::refuse_monitored(&record, "checkpointed")?;
    let name = req.name.clone().unwrap_or_else(|| box_name.to_string());
    nestbox_store::validate_name(&name)
        .map_err(|e| RuntimeError::InvalidInput(format!("checkpoint name: {e}")))?;
    let (dir, parent) = match &req.output {
        Some(out) => {
            let out = std::path::absolute(out).map_err(RuntimeError::io("resolve", out))?;
            let parent = out
                .parent()
                .filter(|p| p.is_dir())
                .ok_or_else(|| {
                    RuntimeError::InvalidInput(format!(
                        "checkpoint -o {}: its parent directory does not exist",
                        out.display()
                    ))
                })?
                .to_path_buf();
            (out, parent)
        }
        None => (checkpoints_dir(reg).join(&name), checkpoints_dir(reg)),
    };
    if dir.exists() {
        return Err(RuntimeError::CheckpointExists(if req.output.is_some() {
            dir.display().to_string()
        } else {
            name
        }));
    }
    let cgroup = running_cgroup(&record)?;
    let template = record.state.template.is_some();
    refuse_lazily_filled(&record, &cgroup)?;
    // The boxes inside a nest box are saved first, each with its processes
    // (in the nest box's state directory, which the checkpoint copies), and
    // stopped (`subtree`); resumed below unless the box stops.
    let suspended = crate::subtree::suspend_inside(reg, &record)?;
    let resume = || {
        if suspended {
            crate::subtree::resume_inside_or_warn(reg, box_name);
        }
    };
    let tmp = staging_dir(&parent, &name).inspect_err(|_| resume())?;
    // A self-contained checkpoint has its own page pool.
    let pool = match &req.output {
        Some(_) => tmp.join("pages"),
        None => pool_dir(reg),
    };
    let own_layers = req.output.is_some();
    // Which box this unfinished checkpoint froze: `gc` thaws it if we die
    // (for `-o`, a marker of its own in this host's checkpoints).
    let marker_dir = if req.output.is_some() {
        let m = checkpoints_dir(reg).join(format!(".tmp-{name}-{}", std::process::id()));
        fs::create_dir_all(&m)
            .map_err(RuntimeError::io("create", &m))
            .inspect_err(|_| {
                let _ = fs::remove_dir_all(&tmp);
                resume();
            })?;
        Some(m)
    } else {
        None
    };
    let marker = marker_dir.as_ref().unwrap_or(&tmp).join("box");
    if let Err(e) = fs::write(&marker, box_name) {
        let _ = fs::remove_dir_all(&tmp);
        if let Some(m) = &marker_dir {
            let _ = fs::remove_dir_all(m);
        }
        resume();
        return Err(RuntimeError::io("write", &marker)(e));
    }
    let frozen_at = Instant::now();
    let result = cgroup
        .set_frozen(true, FREEZER_TIMEOUT)
        .map_err(RuntimeError::from)
        .and_then(|()| crate::template::refuse_boxes_inside(&record, &cgroup, false))
        .and_then(|()| {
            save_processes(&record, &cgroup, &mut |tracees, steps| {
                save_all(&pool, tracees, steps, &tmp, &name)
            })
        })
        .and_then(|saved| Ok((saved, copy_layers(reg, &record, &tmp, own_layers)?)))
        .and_then(|done| copy_nest_state(&record, &tmp).map(|()| done));
    // A template stays frozen; so does a box stopped by its checkpoint until
    // it is killed below (run again, it could answer a request whose effect
    // the checkpoint does not hold); any other box runs again.
    let keep_frozen = template || !req.leave_running;
    let thawed = if keep_frozen {
        Ok(())
    } else {
        cgroup.set_frozen(false, FREEZER_TIMEOUT)
    };
    let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
    let finish = result.and_then(|((processes, mut stats), layers)| {
        thawed?;
        stats.frozen_ms = frozen_ms;
        stats.total_ms = start.elapsed().as_secs_f64() * 1e3;
        let meta = describe(&record, &name, layers, processes, stats);
        publish(&tmp, &dir, &meta).map(|()| meta)
    });
    if let Some(m) = &marker_dir {
        crate::diag::warn_on_err(
            Some(box_name),
            "removing a checkpoint's marker",
            fs::remove_dir_all(m).map_err(RuntimeError::io("remove", m)),
        );
    }
    match finish {
        Ok(meta) => {
            // A template stays as it was, frozen, whatever `--leave-running`
            // says: it answers no request, and its clones and pool go on.
            if !req.leave_running && !template {
                // Killed while frozen: a killed process thawed dies before it
                // runs again.
                cgroup.kill_all()?;
                crate::templates::ops::stop(reg, box_name, Duration::from_secs(0))?;
            } else if suspended {
                crate::subtree::resume_inside(reg, box_name)?;
            }
            Ok(meta)
        }
        Err(e) => {
            if keep_frozen && !template {
                crate::diag::warn_on_err(
                    Some(box_name),
                    "thawing a box whose checkpoint failed",
                    cgroup
                        .set_frozen(false, FREEZER_TIMEOUT)
                        .map_err(RuntimeError::from),
                );
            }
            crate::diag::warn_on_err(
                Some(box_name),
                "removing a failed checkpoint's directory",
                fs::remove_dir_all(&tmp).map_err(RuntimeError::io("remove", &tmp)),
            );
            resume();
            // The box stopped or was removed while it was being saved (a
            // racing stop or rm): what failed then (its cgroup, its
            // processes) went with it.
            let ended = record.state.init.is_some_and(|i| !i.alive());
            if ended && !matches!(e, RuntimeError::NotRunning(_)) {
                tracing::debug!(box_name, "checkpoint failed as the box ended: {e}");
                return Err(RuntimeError::NotRunning(box_name.to_string()));
            }
            Err(e)
        }
    }
}

/// Refuse box `record`, running in `cgroup`, while a lazy restore still fills
/// one of its processes (checked before the box is frozen).
fn refuse_lazily_filled(record: &BoxRecord, cgroup: &nestbox_cgroup::BoxCgroup) -> Result<()> {
    let init = record.state.init.map(|i| i.pid);
    for pid in cgroup.procs()?.into_iter().filter(|p| Some(*p) != init) {
        nestbox_remote::ensure_not_lazily_filled(pid).map_err(|source| RuntimeError::Remote {
            what: "checkpointing box",
            name: record.name().to_string(),
            source,
        })?;
    }
    Ok(())
}

/// Make the directory a checkpoint `name` is written in, `.tmp-NAME-PID` in
/// `parent` (made if needed): never listed, and removed by `gc` once its
/// writer is gone.
fn staging_dir(parent: &Path, name: &str) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    private_dir(parent)?;
    let tmp = parent.join(format!(".tmp-{name}-{}", std::process::id()));
    // Mode 0711: its files (registers, the box's memory map) are the
    // owner's; a restored box's overlay reaches its layers through it.
    fs::DirBuilder::new()
        .mode(0o711)
        .create(&tmp)
        .map_err(RuntimeError::io("create", &tmp))?;
    Ok(tmp)
}

/// The `checkpoint.json` of checkpoint `name` of box `record`.
fn describe(
    record: &BoxRecord,
    name: &str,
    layers: usize,
    processes: Vec<ProcessImage>,
    stats: CheckpointStats,
) -> Checkpoint {
    Checkpoint {
        version: nestbox_remote::IMAGE_VERSION,
        name: name.to_string(),
        box_name: record.name().to_string(),
        created_at: now(),
        spec: record.spec.clone(),
        layers,
        template: record.state.template.as_ref().map(|t| t.name.clone()),
        kernel: kernel_release(),
        cpu_flags: cpu_flags(),
        processes,
        stats,
    }
}

/// Write `meta` into the staging directory `tmp` and rename it to `dir`,
/// which must not exist: the checkpoint is then whole.
fn publish(tmp: &Path, dir: &Path, meta: &Checkpoint) -> Result<()> {
    let json = serde_json::to_vec(meta)
        .map_err(|e| problem(&meta.name, format!("encoding checkpoint.json: {e}")))?;
    write_private(&tmp.join("checkpoint.json"), &json)?;
    fs::rename(tmp, dir).map_err(|e| {
        if dir.exists() {
            RuntimeError::CheckpointExists(meta.name.clone())
        } else {
            RuntimeError::io("rename", dir)(e)
        }
    })
}

/// Save the processes of running box `record` (the caller holds its clone
/// lock) as checkpoint `name` in directory `into`, which must not exist,
/// without its files: `while_frozen` records them, once the box is frozen
/// and before its processes are saved, so that both are one instant of the
/// box (`snapshot --checkpoint`: the files are the snapshot's layer). The
/// box runs on afterwards, or, with `then_stop`, is killed while still
/// frozen and stopped (a box suspended with the nest box it runs in:
/// [`crate::subtree`], which then first suspends the boxes inside it, if it
/// is a nest box). Staged in the host's checkpoints directory like any
/// checkpoint (so `gc` thaws the box and removes the staging should this
/// process be killed); on error nothing is left and the box runs.
pub(crate) fn checkpoint_processes(
    reg: &Registry,
    record: &BoxRecord,
    name: &str,
    into: &Path,
    then_stop: bool,
    while_frozen: &mut dyn FnMut() -> Result<()>,
) -> Result<Checkpoint> {
    let start = Instant::now();
    crate::template::refuse_monitored(record, "checkpointed")?;
    let cgroup = running_cgroup(record)?;
    refuse_lazily_filled(record, &cgroup)?;
    // The boxes inside a nest box stopped so are saved first, each with its
    // processes, and stopped (`subtree`). (A snapshot's checkpoint of a nest
    // box, which runs on, is refused with a box inside: its boxes' data is in
    // its state directory, which a snapshot does not hold.)
    let suspended = then_stop && crate::subtree::suspend_inside(reg, record)?;
    let tmp = match staging_dir(&checkpoints_dir(reg), name) {
        Ok(tmp) => tmp,
        Err(e) => {
            if suspended {
                crate::subtree::resume_inside_or_warn(reg, record.name());
            }
            return Err(e);
        }
    };
    let marker = tmp.join("box");
    let frozen_at = Instant::now();
    let result = fs::write(&marker, record.name())
        .map_err(RuntimeError::io("write", &marker))
        .and_then(|()| {
            cgroup
                .set_frozen(true, FREEZER_TIMEOUT)
                .map_err(RuntimeError::from)
        })
        .and_then(|()| crate::template::refuse_boxes_inside(record, &cgroup, !then_stop))
        .and_then(|()| while_frozen())
        .and_then(|()| {
            save_processes(record, &cgroup, &mut |tracees, steps| {
                save_all(&pool_dir(reg), tracees, steps, &tmp, name)
            })
        });
    // A box stopped by this checkpoint is killed while frozen: a killed
    // process thawed dies before it runs again.
    let killed = match (&result, then_stop) {
        (Ok(_), true) => cgroup.kill_all().map_err(RuntimeError::from),
        _ => Ok(()),
    };
    let thawed = cgroup.set_frozen(false, FREEZER_TIMEOUT);
    let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
    let finish = result.and_then(|(processes, mut stats)| {
        killed?;
        thawed?;
        stats.frozen_ms = frozen_ms;
        stats.total_ms = start.elapsed().as_secs_f64() * 1e3;
        let meta = describe(record, name, 0, processes, stats);
        publish(&tmp, into, &meta).map(|()| meta)
    });
    if finish.is_err() && tmp.exists() {
        crate::diag::warn_on_err(
            Some(record.name()),
            "removing a failed checkpoint's directory",
            fs::remove_dir_all(&tmp).map_err(RuntimeError::io("remove", &tmp)),
        );
    }
    if finish.is_ok() && then_stop {
        crate::templates::ops::stop(reg, record.name(), Duration::from_secs(0))?;
    } else if suspended {
        // It runs on after a failure: so do the boxes inside it.
        crate::subtree::resume_inside_or_warn(reg, record.name());
    }
    finish
}

/// The cgroup of box `record`, which must be running.
pub(crate) fn running_cgroup(record: &BoxRecord) -> Result<nestbox_cgroup::BoxCgroup> {
    record
        .state
        .cgroup
        .clone()
        .filter(|_| record.state.init.is_some_and(|i| i.alive()))
        .ok_or_else(|| RuntimeError::NotRunning(record.name().to_string()))
}

/// Stop the box's processes under ptrace (the box is frozen: thawed only to
/// let the stop requests through), save each, let them go again frozen.
pub(crate) fn save_processes(
    record: &BoxRecord,
    cgroup: &nestbox_cgroup::BoxCgroup,
    save: &mut SaveFn<'_>,
) -> Result<(Vec<ProcessImage>, CheckpointStats)> {
    let steps = crate::template::template_tree(record)?;
    if steps[0].process.pid != crate::init::ADOPTED_PID {
        return Err(RuntimeError::Unsupported {
            name: record.name().to_string(),
            problem: format!(
                "has its process as pid {} in the box: a checkpoint restores a box whose process is pid {} (a box started with run -d, or a template)",
                steps[0].process.pid,
                crate::init::ADOPTED_PID
            ),
        });
    }
    // A box stopped or removed meanwhile (its processes gone) is said so;
    // a process another tracer holds (a clone or checkpoint racing) too.
    let remote = |e: nestbox_remote::RemoteError| {
        match e {
        nestbox_remote::RemoteError::NoSuchProcess { .. }
        | nestbox_remote::RemoteError::Exited { .. }
        | nestbox_remote::RemoteError::ZombieLeader { .. } => {
            RuntimeError::NotRunning(record.name().to_string())
        }
        nestbox_remote::RemoteError::AlreadyTraced { pid, tracer } => RuntimeError::WrongState {
            name: record.name().to_string(),
            problem: format!("is busy: its process {pid} is traced by pid {tracer} (a clone or checkpoint of it is under way)"),
        },
        e if record.state.init.is_some_and(|i| !i.alive()) => {
            let _ = e;
            RuntimeError::NotRunning(record.name().to_string())
        }
        e => RuntimeError::Remote {
            what: "checkpointing box",
            name: record.name().to_string(),
            source: e,
        },
    }
    };
    save_tree(&steps, cgroup, &remote, save)
}

/// Stop the processes of `steps` (all of frozen `cgroup`) under ptrace (the
/// cgroup thawed only to let the stop requests through), save them with
/// `save`, let them go again frozen. `remote` says what an engine error
/// means.
pub(crate) fn save_tree(
    steps: &[nestbox_remote::tree::Step],
    cgroup: &nestbox_cgroup::BoxCgroup,
    remote: &dyn Fn(nestbox_remote::RemoteError) -> RuntimeError,
    save: &mut SaveFn<'_>,
) -> Result<(Vec<ProcessImage>, CheckpointStats)> {
    let mut tracees = Vec::with_capacity(steps.len());
    for step in steps {
        tracees.push(Tracee::seize_and_interrupt(step.process.host_pid).map_err(remote)?);
    }
    let saved = cgroup
        .set_frozen(false, FREEZER_TIMEOUT)
        .map_err(RuntimeError::from)
        .and_then(|()| {
            for tracee in &mut tracees {
                tracee
                    .wait_stopped(Duration::from_secs(5))
                    .map_err(remote)?;
            }
            save(&mut tracees, steps).map_err(|e| match e {
                SaveError::Remote(e) => remote(e),
                SaveError::Runtime(e) => e,
            })
        });
    let refrozen = cgroup.set_frozen(true, FREEZER_TIMEOUT);
    let mut detached = Ok(());
    for tracee in tracees {
        if let Err(e) = tracee.detach() {
            detached = Err(remote(e));
        }
    }
    let saved = saved?;
    refrozen?;
    detached?;
    Ok(saved)
}

/// What saves a box's stopped processes for [`save_processes`]: their
/// images and figures.
pub(crate) type SaveFn<'a> = dyn FnMut(
        &mut [Tracee],
        &[nestbox_remote::tree::Step],
    ) -> std::result::Result<(Vec<ProcessImage>, CheckpointStats), SaveError>
    + 'a;

/// Why saving a box's processes failed: in the engine (said with the box's
/// name and state by [`save_processes`]) or in the saving of their pages.
pub(crate) enum SaveError {
    Remote(nestbox_remote::RemoteError),
    Runtime(RuntimeError),
}

pub(crate) fn save_all(
    pool: &Path,
    tracees: &mut [Tracee],
    steps: &[nestbox_remote::tree::Step],
    dir: &Path,
    name: &str,
) -> std::result::Result<(Vec<ProcessImage>, CheckpointStats), SaveError> {
    let pool_error =
        |e: nestbox_store::StoreError| SaveError::Runtime(problem(name, format!("page pool: {e}")));
    let mut pool = PagePool::open(pool).map_err(pool_error)?;
    let mut writer = pool.writer().map_err(pool_error)?;
    let mut records = PageRecords::default();
    let mut pages = 0u64;
    let images = nestbox_remote::capture_box(tracees, steps, &mut |pid, addr, page| {
        let nestbox_remote::PageData::Bytes(page) = page else {
            return Err(std::io::Error::other(
                "a page not read in a full checkpoint",
            ));
        };
        let (digest, _) = writer.put(page).map_err(std::io::Error::other)?;
        records.add(pid, addr, &digest);
        pages += 1;
        Ok(())
    })
    .map_err(SaveError::Remote)?;
    let written = writer.added() as u64;
    writer.finish().map_err(pool_error)?;
    write_page_records(dir, &images, records).map_err(SaveError::Runtime)?;
    Ok((
        images,
        CheckpointStats {
            pages,
            pages_written: written,
            ..CheckpointStats::default()
        },
    ))
}

/// The `pages-PID` files of a checkpoint being written: per process (pid in
/// the box), its records of address and digest.
#[derive(Debug, Default)]
pub(crate) struct PageRecords(HashMap<i32, Vec<u8>>);

impl PageRecords {
    /// Page `addr` of process `pid` holds the page of digest `digest`.
    pub(crate) fn add(&mut self, pid: i32, addr: u64, digest: &Digest) {
        let r = self.0.entry(pid).or_default();
        r.extend_from_slice(&addr.to_le_bytes());
        r.extend_from_slice(&digest.0);
    }
}

/// Write the `pages-PID` file of every process of `images` into `dir`.
pub(crate) fn write_page_records(
    dir: &Path,
    images: &[ProcessImage],
    mut records: PageRecords,
) -> Result<()> {
    for image in images {
        let path = dir.join(format!("pages-{}", image.ns_pid));
        let data = records.0.remove(&image.ns_pid).unwrap_or_default();
        write_private(&path, &data)?;
    }
    Ok(())
}

/// Copy the box's writable root layers (`upper-N`) into `dir` as `layer-N`
/// with `cp -a` (see docs/checkpoint.md: one of the documented uses of an
/// outside program: it keeps overlayfs whiteouts, opaque-directory xattrs,
/// owners, hardlinks and times). Returns how many.
pub(crate) fn copy_layers(
    reg: &Registry,
    record: &BoxRecord,
    dir: &Path,
    self_contained: bool,
) -> Result<usize> {
    let mut lines: Vec<String> = Vec::new();
    let mut k = 0;
    // Each layer set of the root below the box's own, top first, copied as
    // `base-K` and named in `lowers`.
    let copy_base =
        |layer: &dyn Fn(usize) -> PathBuf, k: &mut usize, lines: &mut Vec<String>| -> Result<()> {
            copy_layer_set(record.name(), layer, &dir.join(format!("base-{k}")))?;
            lines.push(format!("base-{k}"));
            *k += 1;
            Ok(())
        };
    // A box rolled back to a snapshot has the snapshot's layer (its
    // materialised tree) right under its own upper layer.
    let rollback_tree = |lib: &Path| {
        crate::snapshots::rollback_tree(lib)
            .map(|tree| move |i: usize| if i == 0 { tree.clone() } else { PathBuf::new() })
    };
    if let Some(tree) = rollback_tree(record.lib_dir()) {
        copy_base(&tree, &mut k, &mut lines)?;
    }
    // A clone's root has its template's layers under its own (and, for a
    // clone of a frozen clone, every template's below, top first): copied as
    // `base-K`, as the templates may go before the checkpoint does.
    let mut next = record
        .spec
        .clone_of
        .as_ref()
        .map(|s| s.template_box.clone());
    while let Some(template_box) = next.take() {
        let template = reg.load(&template_box)?;
        copy_base(&|i| template.layer_dirs(i).0, &mut k, &mut lines)?;
        if let Some(tree) = rollback_tree(template.lib_dir()) {
            copy_base(&tree, &mut k, &mut lines)?;
        }
        if k < 64 {
            next = template
                .spec
                .clone_of
                .as_ref()
                .map(|s| s.template_box.clone());
        }
    }
    // A restored box's root (and a clone's of a restored template) also holds
    // the layers of the checkpoint it was restored from, and of those below
    // it: named, or for a self-contained checkpoint copied as `base-K`.
    if let Some(base) = &record.spec.restore_of {
        for below in layer_chain(Path::new(base)) {
            if !self_contained {
                lines.push(below.display().to_string());
                continue;
            }
            copy_base(&|i| below.join(format!("layer-{i}")), &mut k, &mut lines)?;
        }
    }
    if !lines.is_empty() {
        let path = dir.join("lowers");
        fs::write(&path, lines.join("\n") + "\n").map_err(RuntimeError::io("write", &path))?;
    }
    let n = copy_layer_set(record.name(), |i| record.layer_dirs(i).0, dir)?;
    Ok(n)
}

/// Copy the layers `layer(0)`, `layer(1)`, … that exist into `into` as
/// `layer-N`; how many.
fn copy_layer_set(name: &str, layer: impl Fn(usize) -> PathBuf, into: &Path) -> Result<usize> {
    if !into.is_dir() {
        fs::create_dir(into).map_err(RuntimeError::io("create", into))?;
    }
    let mut n = 0;
    loop {
        let from = layer(n);
        if !from.is_dir() {
            return Ok(n);
        }
        cp_a(name, &from, &into.join(format!("layer-{n}")))?;
        n += 1;
    }
}

/// A box for boxes' state directory (what the nestbox inside keeps at
/// `/var/lib/nestbox`) copied into the checkpoint as
/// [`crate::lifecycle::nest::IN_CHECKPOINT`]: a box restored from it starts
/// with a copy of that (`nest::volumes`).
pub(crate) fn copy_nest_state(record: &BoxRecord, dir: &Path) -> Result<()> {
    let from = crate::lifecycle::nest::state_dir(record);
    if !record.spec.nest || !from.is_dir() {
        return Ok(());
    }
    crate::copy::copy_tree(&from, &dir.join(crate::lifecycle::nest::IN_CHECKPOINT))
}

/// `cp -a FROM TO` (see [`copy_layers`]).
fn cp_a(name: &str, from: &Path, to: &Path) -> Result<()> {
    crate::copy::copy_tree(from, to).map_err(|e| match e {
        RuntimeError::Failed(m) => problem(name, format!("copying its root layer: {m}")),
        other => other,
    })
}

/// Load checkpoint `name`, or the checkpoint in directory `name` when it is a
/// path.
pub fn load(reg: &Registry, name: &str) -> Result<(Checkpoint, PathBuf)> {
    let dir = if name.contains('/') {
        std::path::absolute(name).map_err(RuntimeError::io("resolve", name))?
    } else {
        checkpoints_dir(reg).join(name)
    };
    let path = dir.join("checkpoint.json");
    let data = match fs::read(&path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RuntimeError::NoSuchCheckpoint(name.to_string()))
        }
        Err(e) => return Err(RuntimeError::io("read", &path)(e)),
    };
    let meta: Checkpoint = serde_json::from_slice(&data)
        .map_err(|e| problem(name, format!("is corrupt: {}: {e}", path.display())))?;
    Ok((meta, dir))
}

/// Every checkpoint, by name.
pub fn list(reg: &Registry) -> Result<Vec<Checkpoint>> {
    let dir = checkpoints_dir(reg);
    let mut out = Vec::new();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(RuntimeError::io("read", &dir)(e)),
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        match load(reg, &name) {
            Ok((meta, _)) => out.push(meta),
            // Removed since the directory was read (`checkpoint rm`).
            Err(RuntimeError::NoSuchCheckpoint(_)) => {}
            Err(e) => tracing::warn!("checkpoint {name}: {e}"),
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Save template `template` on disk as the checkpoint of the same name
/// (replacing an earlier save of it), so that `clone` can start clones from
/// it when the live template is gone (a reboot, its box removed). The
/// template stays frozen.
pub fn save_template(reg: &Registry, template: &str) -> Result<Checkpoint> {
    let t = crate::template::load_frozen(reg, template)?;
    if let Ok((old, dir)) = load(reg, template) {
        if old.template.as_deref() != Some(template) {
            return Err(RuntimeError::CheckpointExists(template.to_string()));
        }
        // A template revived from this very checkpoint is saved already (it
        // is frozen: it has not changed since).
        if t.spec.restore_of.as_deref() == Some(dir.display().to_string().as_str()) {
            return Ok(old);
        }
        remove(reg, template)?;
    }
    checkpoint(
        reg,
        t.name(),
        &CheckpointRequest {
            name: Some(template.to_string()),
            leave_running: true,
            output: None,
        },
    )
}

/// Start template `template` again from its saved checkpoint (see
/// [`save_template`]): restored as its box, then frozen. `None` when no
/// checkpoint holds it. One revival at a time per template.
pub fn revive_template(reg: &Registry, template: &str) -> Result<Option<BoxRecord>> {
    let Ok((meta, _)) = load(reg, template) else {
        return Ok(None);
    };
    if meta.template.as_deref() != Some(template) {
        return Ok(None);
    }
    let _lock = template_lock(reg, template)?;
    // Another command may have revived it while this one waited.
    if let Ok(t) = crate::template::load_frozen(reg, template) {
        return Ok(Some(t));
    }
    tracing::info!(template, "reviving the template from its checkpoint");
    start_template(reg, template, &meta.box_name, template, 0)?;
    crate::template::load_frozen(reg, template).map(Some)
}

/// Restore checkpoint `source` as box `box_name` and freeze it as template
/// `template` keeping `pool` clones forked ahead.
fn start_template(
    reg: &Registry,
    source: &str,
    box_name: &str,
    template: &str,
    pool: usize,
) -> Result<()> {
    restore(reg, source, Some(box_name))?;
    crate::template::freeze(reg, box_name, Some(template), pool)?;
    if pool > 0 {
        crate::clone::fill_pool(reg, template)?;
    }
    Ok(())
}

/// `checkpoint -o -`: a self-contained checkpoint of box `box_name` written
/// to standard output as a tar stream (GNU `tar` with xattrs: overlayfs
/// whiteouts and opaque directories survive), for `restore -` elsewhere
/// (`nestbox checkpoint web -o - | ssh host nestbox restore -`).
pub fn checkpoint_to_stdout(
    reg: &Registry,
    box_name: &str,
    req: &CheckpointRequest,
) -> Result<Checkpoint> {
    let staging = checkpoints_dir(reg).join(format!(".tmp-stream-{}", std::process::id()));
    private_dir(&staging)?;
    let dir = staging.join("checkpoint");
    let result = checkpoint(
        reg,
        box_name,
        &CheckpointRequest {
            output: Some(dir.clone()),
            ..req.clone()
        },
    )
    .and_then(|meta| {
        run_tar(
            &["-C", &dir.display().to_string(), "-cf", "-", "."],
            std::process::Stdio::null(),
        )?;
        Ok(meta)
    });
    remove_staging(
        box_name,
        "removing a streamed checkpoint's staging directory",
        &staging,
    );
    result
}

/// Remove the staging directory `dir` of box `box_name`'s checkpoint or
/// migration, logging a failure as `what`.
pub(crate) fn remove_staging(box_name: &str, what: &str, dir: &Path) {
    crate::diag::warn_on_err(
        Some(box_name),
        what,
        fs::remove_dir_all(dir).map_err(RuntimeError::io("remove", dir)),
    );
}

/// `restore -`: read a checkpoint stream (from `checkpoint -o -`) on
/// standard input, keep it as the checkpoint of its name (listed, restorable
/// again, removed with `checkpoint rm`), and restore it as box `name`. If the
/// restore fails, the checkpoint goes too.
pub fn restore_from_stdin(reg: &Registry, name: Option<&str>) -> Result<Restored> {
    restore_incoming(reg, name, None, false, true, &mut |staging| {
        untar(staging, std::process::Stdio::inherit())
    })
}

/// Unpack a checkpoint's tar stream from `from` into directory `into`.
pub(crate) fn untar(into: &Path, from: std::process::Stdio) -> Result<()> {
    run_tar(
        &[
            "-C",
            &into.display().to_string(),
            "-xf",
            "-",
            "--numeric-owner",
        ],
        from,
    )
}

/// Keep the checkpoint `unpack` writes into the directory it is given as
/// the checkpoint of its name, and restore it as box `name` (with the boxes
/// suspended inside it running again if `boxes_inside`: see
/// [`with_boxes_inside`]); if the restore fails, the checkpoint goes too.
pub(crate) fn restore_incoming(
    reg: &Registry,
    name: Option<&str>,
    preloaded: Option<&Preloaded>,
    lazy: bool,
    boxes_inside: bool,
    unpack: &mut dyn FnMut(&Path) -> Result<()>,
) -> Result<Restored> {
    let staging = checkpoints_dir(reg).join(format!(".tmp-incoming-{}", std::process::id()));
    private_dir(&staging)?;
    let unpacked = unpack(&staging)
        .and_then(|()| load(reg, &staging.display().to_string()))
        .and_then(|(meta, _)| {
            let dest = checkpoints_dir(reg).join(&meta.name);
            if dest.exists() {
                return Err(RuntimeError::CheckpointExists(meta.name));
            }
            fs::rename(&staging, &dest).map_err(RuntimeError::io("rename", &dest))?;
            Ok(meta.name)
        });
    let checkpoint = match unpacked {
        Ok(c) => c,
        Err(e) => {
            let _ = fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    restore_preloaded(reg, &checkpoint, name, preloaded, lazy)
        .and_then(|r| {
            if boxes_inside {
                with_boxes_inside(reg, r)
            } else {
                Ok(r)
            }
        })
        .inspect_err(|_| remove_received(reg, &checkpoint))
}

/// Remove checkpoint `checkpoint`, received for a restore that failed.
pub(crate) fn remove_received(reg: &Registry, checkpoint: &str) {
    crate::diag::warn_on_err(
        None,
        "removing a checkpoint received for a failed restore",
        remove(reg, checkpoint),
    );
}

/// Run GNU `tar` with `args` (xattrs kept) on our standard input and
/// output (see docs/architecture.md, exceptions to "no shell-out").
pub(crate) fn run_tar(args: &[&str], stdin: std::process::Stdio) -> Result<()> {
    let out = std::process::Command::new("tar")
        .args(["--xattrs", "--xattrs-include=*", "--acls"])
        .args(args)
        .stdin(stdin)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|c| c.wait_with_output())
        .map_err(RuntimeError::io("running", "tar"))?;
    if !out.status.success() {
        return Err(problem(
            "stream",
            format!("tar: {}", String::from_utf8_lossy(&out.stderr).trim()),
        ));
    }
    Ok(())
}

/// The lock under which template `template` is started from a checkpoint
/// (one command at a time makes it).
fn template_lock(reg: &Registry, template: &str) -> Result<nix::fcntl::Flock<fs::File>> {
    private_dir(&checkpoints_dir(reg))?;
    crate::state::wait_for_lock(&checkpoints_dir(reg).join(format!(".revive-{template}.lock")))
}

/// The template name of checkpoint `name`'s template (see [`restore_shared`]).
pub fn template_of(name: &str) -> String {
    format!("ckpt-{name}")
}

/// Whether a checkpoint of image version `version`, taken on kernel
/// `kernel` with CPU features `flags`, can be restored on this host.
pub(crate) fn check_compatible(
    source: &str,
    version: u32,
    kernel: &str,
    flags: &[String],
) -> Result<()> {
    if version != nestbox_remote::IMAGE_VERSION {
        return Err(problem(
            source,
            format!(
                "was written by image version {}; this nestbox reads version {}",
                version,
                nestbox_remote::IMAGE_VERSION
            ),
        ));
    }
    let here = kernel_release();
    if kernel != here {
        return Err(problem(
            source,
            format!("was taken on kernel {kernel} and this host runs {here}"),
        ));
    }
    let ours: HashSet<String> = cpu_flags().into_iter().collect();
    let missing: Vec<&String> = flags.iter().filter(|f| !ours.contains(*f)).collect();
    if !missing.is_empty() {
        return Err(problem(
            source,
            format!(
                "needs CPU features this host lacks: {}",
                missing
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        ));
    }
    Ok(())
}

/// Restore checkpoint `source` as box `name` sharing memory with every
/// other box restored so from it: the checkpoint is restored once as its
/// template (`ckpt-NAME`, frozen; made on first use), and each box is a
/// clone of that template, its memory shared copy-on-write. The box's
/// hostname is its name, as a clone's. A template made here keeps `pool`
/// clones forked ahead (see `freeze --pool`).
pub fn restore_shared(
    reg: &Registry,
    source: &str,
    name: Option<&str>,
    pool: usize,
) -> Result<Restored> {
    let start = Instant::now();
    let (meta, dir) = load(reg, source)?;
    let template = template_of(&meta.name);
    let name = name.unwrap_or(&meta.box_name).to_string();
    crate::clone::check_new_name(reg, &name)?;
    {
        let _lock = template_lock(reg, &template)?;
        match crate::template::load_frozen(reg, &template) {
            Ok(t) => {
                if t.spec.restore_of.as_deref() != Some(dir.display().to_string().as_str()) {
                    return Err(problem(
                        source,
                        format!("has a template {template:?} made from another checkpoint of that name: remove it first"),
                    ));
                }
            }
            Err(_) => start_template(reg, source, &template, &template, pool)?,
        }
    }
    let made = crate::clone::clone_template(
        reg,
        &template,
        &crate::clone::CloneRequest {
            names: vec![name.clone()],
            count: 1,
            ..Default::default()
        },
    )?;
    let pid = made.first().map(|c| c.pid).unwrap_or(0);
    Ok(Restored {
        name,
        pid,
        restore_ms: start.elapsed().as_secs_f64() * 1e3,
        shell_ms: 0.0,
        page_server: None,
    })
}

/// Remove checkpoint `name` (its directory; its pages go at the next `gc`
/// when no other checkpoint has them). Refused while a box restored from it
/// runs on its layers.
pub fn remove(reg: &Registry, name: &str) -> Result<()> {
    let (meta, dir) = load(reg, name)?;
    let key = dir.display().to_string();
    let on_it: Vec<BoxRecord> = reg
        .list()?
        .into_iter()
        .filter(|r| r.spec.restore_of.as_deref() == Some(key.as_str()))
        .collect();
    // Its own template (`restore --shared`) goes with it once it has no
    // clones left.
    let own_template = template_of(&meta.name);
    if let [only] = on_it.as_slice() {
        if only.name() == own_template
            && only
                .state
                .template
                .as_ref()
                .is_some_and(|t| t.name == own_template)
        {
            crate::templates::ops::remove(reg, only.name(), true)?;
        }
    }
    let mut users: Vec<String> = on_it
        .iter()
        .filter(|r| reg.load(r.name()).is_ok())
        .map(|r| r.name().to_string())
        .collect();
    // Checkpoints of boxes restored from it stand on its layers too.
    for other in list(reg)? {
        let below = layer_chain(&checkpoints_dir(reg).join(&other.name));
        if below.iter().skip(1).any(|d| *d == dir) {
            users.push(format!("checkpoint {}", other.name));
        }
    }
    if !users.is_empty() {
        return Err(problem(
            name,
            format!(
                "is in use by box(es) {}: remove them first",
                users.join(", ")
            ),
        ));
    }
    // Out of the list first, in one step (a `list` running meanwhile must
    // not meet it half-removed), then removed; `gc` finishes a removal that
    // was killed.
    let listed = checkpoints_dir(reg);
    if dir.parent() != Some(listed.as_path()) {
        // A checkpoint given by its path, in a directory of its own.
        return fs::remove_dir_all(&dir).map_err(RuntimeError::io("remove", &dir));
    }
    let doomed = listed.join(format!(
        "{REMOVING_PREFIX}{}-{}",
        meta.name,
        std::process::id()
    ));
    match fs::rename(&dir, &doomed) {
        Ok(()) => {}
        // Removed meanwhile by another `checkpoint rm`.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RuntimeError::NoSuchCheckpoint(name.to_string()))
        }
        Err(e) => return Err(RuntimeError::io("rename", &dir)(e)),
    }
    fs::remove_dir_all(&doomed).map_err(RuntimeError::io("remove", &doomed))
}

/// The name a checkpoint's directory takes while it is removed.
const REMOVING_PREFIX: &str = ".removing-";

/// What `gc` does for checkpoints: remove directories left by checkpoints
/// that did not finish, and the pages no checkpoint refers to (packs
/// removed, or compacted: see [`PagePool::gc`]).
/// Returns (directories removed, packs removed, bytes freed).
pub fn gc(reg: &Registry) -> Result<(u64, u64, u64)> {
    let dir = checkpoints_dir(reg);
    let mut dirs = 0;
    if let Ok(entries) = fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix(REMOVING_PREFIX) {
                // A removal that was cut short: finished.
                let remover = rest
                    .rsplit_once('-')
                    .and_then(|(_, pid)| pid.parse::<i32>().ok());
                if !remover.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists()) {
                    fs::remove_dir_all(entry.path())
                        .map_err(RuntimeError::io("remove", entry.path()))?;
                    dirs += 1;
                }
                continue;
            }
            let Some(rest) = name.strip_prefix(".tmp-") else {
                continue;
            };
            let writer = rest
                .rsplit_once('-')
                .and_then(|(_, pid)| pid.parse::<i32>().ok());
            let alive = writer.is_some_and(|p| Path::new(&format!("/proc/{p}")).exists());
            if !alive {
                thaw_left_frozen(reg, &entry.path());
                fs::remove_dir_all(entry.path())
                    .map_err(RuntimeError::io("remove", entry.path()))?;
                dirs += 1;
            }
        }
    }
    let pool_path = pool_dir(reg);
    if !pool_path.exists() {
        return Ok((dirs, 0, 0));
    }
    // A checkpoint still being written refers to pages no finished one
    // lists yet: the pool is collected another time.
    let writing = fs::read_dir(&dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
    });
    if writing {
        return Ok((dirs, 0, 0));
    }
    let mut referenced = HashSet::new();
    let names: Vec<String> = list(reg)?.into_iter().map(|c| c.name).collect();
    // Snapshots' checkpoints of processes (`snapshot --checkpoint`) too.
    let snapshots = crate::snapshots::processes_dirs(reg)?;
    // And the boxes suspended with the nest box they run in (`subtree`).
    let suspended = crate::subtree::suspended_dirs(reg)?;
    for d in names
        .iter()
        .map(|n| dir.join(n))
        .chain(snapshots)
        .chain(suspended)
    {
        for entry in fs::read_dir(&d)
            .map_err(RuntimeError::io("read", &d))?
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with("pages-") {
                for (_, digest) in read_page_records(&entry.path())? {
                    referenced.insert(digest);
                }
            }
        }
    }
    let mut pool =
        PagePool::open(&pool_path).map_err(|e| problem("gc", format!("page pool: {e}")))?;
    let (packs, bytes) = pool
        .gc(&referenced)
        .map_err(|e| problem("gc", format!("page pool: {e}")))?;
    Ok((dirs, packs, bytes))
}

/// A checkpoint that died (kill -9) while its box was frozen left it frozen:
/// thaw the box again unless it is a template (frozen by design).
fn thaw_left_frozen(reg: &Registry, unfinished: &Path) {
    let Ok(box_name) = fs::read_to_string(unfinished.join("box")) else {
        return;
    };
    let Ok(record) = reg.load(box_name.trim()) else {
        return;
    };
    if record.state.template.is_some() {
        return;
    }
    // A migration whose target had answered that the box runs there: the
    // copy here must not run again.
    if unfinished.join("moved").exists() {
        let killed = record
            .state
            .cgroup
            .as_ref()
            .map_or(Ok(()), |c| c.kill_all().map_err(RuntimeError::from))
            .and_then(|()| crate::templates::ops::remove(reg, record.name(), true));
        crate::diag::warn_on_err(
            Some(record.name()),
            "removing a box an unfinished migration moved away",
            killed,
        );
        return;
    }
    if let Some(cgroup) = &record.state.cgroup {
        let thawed = cgroup
            .set_frozen(false, FREEZER_TIMEOUT)
            .map_err(RuntimeError::from);
        crate::diag::warn_on_err(
            Some(record.name()),
            "thawing a box an unfinished checkpoint left frozen",
            thawed,
        );
    }
}

/// What the page pool holds (for `store df`).
pub fn pool_usage(reg: &Registry) -> Result<nestbox_store::PoolUsage> {
    let path = pool_dir(reg);
    if !path.exists() {
        return Ok(nestbox_store::PoolUsage::default());
    }
    PagePool::open(&path)
        .and_then(|p| p.usage())
        .map_err(|e| problem("page pool", e.to_string()))
}

pub(crate) fn read_page_records(path: &Path) -> Result<Vec<(u64, Digest)>> {
    let data = fs::read(path).map_err(RuntimeError::io("read", path))?;
    if data.len() % PAGE_RECORD != 0 {
        return Err(RuntimeError::Checkpoint {
            name: path.display().to_string(),
            problem: format!(
                "is truncated ({} bytes, not a whole number of {PAGE_RECORD}-byte records)",
                data.len()
            ),
        });
    }
    Ok(data
        .chunks_exact(PAGE_RECORD)
        .map(|r| {
            let addr = u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
            let mut d = [0u8; 32];
            d.copy_from_slice(&r[8..]);
            (addr, Digest(d))
        })
        .collect())
}

/// Pages a restore has in memory already, checked against their digests
/// (a migration's receiver holds the pages it was sent).
pub(crate) type Preloaded = HashMap<Digest, Box<[u8]>>;

/// A restored process's pages: its records, read from the pool.
/// A page whose contents occur at more than one address is read from the
/// pool (and checked) once, then copied from memory.
pub(crate) struct ProcessPages<'a> {
    pages: &'a HashMap<u64, Digest>,
    pool: &'a PagePool,
    preloaded: Option<&'a Preloaded>,
    repeated: HashSet<Digest>,
    cache: std::cell::RefCell<HashMap<Digest, Vec<u8>>>,
}

impl<'a> ProcessPages<'a> {
    pub(crate) fn new(
        pages: &'a HashMap<u64, Digest>,
        pool: &'a PagePool,
        preloaded: Option<&'a Preloaded>,
    ) -> ProcessPages<'a> {
        let mut seen = HashSet::new();
        let repeated = pages
            .values()
            .filter(|d| !seen.insert(**d))
            .copied()
            .collect();
        ProcessPages {
            pages,
            pool,
            preloaded,
            repeated,
            cache: Default::default(),
        }
    }
}

impl PageStore for ProcessPages<'_> {
    fn id(&self, addr: u64) -> Option<[u8; 32]> {
        self.pages.get(&addr).map(|d| d.0)
    }

    fn held(&self) -> Vec<u64> {
        let mut addrs: Vec<u64> = self.pages.keys().copied().collect();
        addrs.sort_unstable();
        addrs
    }

    fn read_page(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let digest = self.pages.get(&addr).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such page in the image")
        })?;
        if let Some(page) = self.preloaded.and_then(|p| p.get(digest)) {
            buf[..page.len()].copy_from_slice(page);
            return Ok(());
        }
        if let Some(page) = self.cache.borrow().get(digest) {
            buf[..page.len()].copy_from_slice(page);
            return Ok(());
        }
        self.pool.read(digest, buf)?;
        if self.repeated.contains(digest) {
            self.cache
                .borrow_mut()
                .insert(*digest, buf[..nestbox_store::PAGE_SIZE].to_vec());
        }
        Ok(())
    }
}

/// One restored box.
#[derive(Debug, Clone, Serialize)]
pub struct Restored {
    /// Its name.
    pub name: String,
    /// Host pid of its main process.
    pub pid: i32,
    /// Milliseconds from the call to the process running.
    pub restore_ms: f64,
    /// Of those, milliseconds to start the box (namespaces, cgroups, root,
    /// network) before its processes were rebuilt in it.
    #[serde(default)]
    pub shell_ms: f64,
    /// A lazy restore's page server (host pid, pages it puts in), when the
    /// box was restored lazily.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_server: Option<nestbox_remote::LazyServer>,
}

/// Restore checkpoint `source` (a name, or a directory) as box `name`
/// (default: the checkpoint's box name).
///
/// # Errors
/// An unknown, corrupt or incompatible checkpoint, a name in use, a port
/// taken, a page whose contents do not match its digest: one line, and
/// nothing of the new box is left.
pub fn restore(reg: &Registry, source: &str, name: Option<&str>) -> Result<Restored> {
    restore_with(reg, source, name, false)
}

/// [`restore`], lazily when `lazy` (`restore --lazy`): a box of one process
/// runs before its private anonymous memory is filled, a page server of its
/// own filling it (faults first, the rest in the background;
/// `nestbox_remote`'s lazy.rs). Its pages are then checked against their
/// digests as they are read: a damaged one kills the box.
///
/// # Errors
/// As [`restore`].
pub fn restore_with(
    reg: &Registry,
    source: &str,
    name: Option<&str>,
    lazy: bool,
) -> Result<Restored> {
    restore_preloaded(reg, source, name, None, lazy).and_then(|r| with_boxes_inside(reg, r))
}

/// Restored box `restored` with the boxes suspended inside it (a nest box
/// saved with its boxes: [`crate::subtree`]) running again; if they cannot
/// be, the box is removed and the restore fails.
pub(crate) fn with_boxes_inside(reg: &Registry, restored: Restored) -> Result<Restored> {
    match crate::subtree::resume_inside(reg, &restored.name) {
        Ok(()) => Ok(restored),
        Err(e) => {
            crate::diag::warn_on_err(
                Some(&restored.name),
                "removing a restored box whose boxes inside could not be resumed",
                crate::templates::ops::remove(reg, &restored.name, true),
            );
            Err(e)
        }
    }
}

/// [`restore`], with pages in memory already (checked) taken from there
/// rather than read from the pool.
pub(crate) fn restore_preloaded(
    reg: &Registry,
    source: &str,
    name: Option<&str>,
    preloaded: Option<&Preloaded>,
    lazy: bool,
) -> Result<Restored> {
    let start = Instant::now();
    let (meta, dir) = load(reg, source)?;
    check_compatible(source, meta.version, &meta.kernel, &meta.cpu_flags)?;
    let name = name.unwrap_or(&meta.box_name).to_string();
    crate::clone::check_new_name(reg, &name)?;
    crate::phases::mark("restore: checkpoint loaded, checked");
    let mut spec = meta.spec.clone();
    spec.name = name.clone();
    spec.interactive = false;
    spec.remove_on_exit = false;
    spec.clone_of = None;
    spec.restore_of = Some(dir.display().to_string());
    let shell_at = Instant::now();
    // The box is started, and while its monitor makes it (a process of its
    // own) the page records and the pool's index are read and every page
    // looked up. (A restore is never served by the pool of box shells:
    // `Shape::of`.) A checkpoint found incomplete there fails the restore
    // as a failed start does: the new box is removed, nothing runs.
    let (started, read) = match crate::lifecycle::ops::begin_detached(reg, &spec) {
        Err(e) => (Err(e), None),
        Ok(pending) => {
            let read = open_pages(reg, source, &meta, &dir, preloaded);
            crate::phases::mark("restore: pages found in the pool");
            (pending.wait(reg).map_err(|e| e.in_box(&name)), Some(read))
        }
    };
    let shell_ms = shell_at.elapsed().as_secs_f64() * 1e3;
    crate::phases::mark("restore: box started");
    let result = started.and_then(|()| {
        let (pages, pool) = read.unwrap_or_else(|| Err(problem(source, "pages not read")))?;
        let shell = reg.load(&name)?;
        let (pids, page_server) =
            restore_into(&shell, &meta.processes, &pages, &pool, preloaded, lazy)?;
        let pid = pids[0];
        Ok(Restored {
            name: name.clone(),
            pid,
            restore_ms: start.elapsed().as_secs_f64() * 1e3,
            shell_ms,
            page_server,
        })
    });
    if result.is_err() && reg.load(&name).is_ok() {
        let removed = crate::templates::ops::remove(reg, &name, true);
        crate::diag::warn_on_err(Some(&name), "removing a failed restore's box", removed);
    }
    result
}

/// The page records of every process of checkpoint `meta` (in `dir`, named
/// `source` in errors) and the page pool that holds them, every page checked
/// to be there (or in `preloaded`) before any process of the checkpoint is
/// made.
fn open_pages(
    reg: &Registry,
    source: &str,
    meta: &Checkpoint,
    dir: &Path,
    preloaded: Option<&Preloaded>,
) -> Result<(Vec<HashMap<u64, Digest>>, PagePool)> {
    let mut pages = Vec::with_capacity(meta.processes.len());
    for p in &meta.processes {
        let records = read_page_records(&dir.join(format!("pages-{}", p.ns_pid)))?;
        pages.push(records.into_iter().collect::<HashMap<u64, Digest>>());
    }
    // A self-contained checkpoint (`-o DIR`) has its pages with it.
    let pool_path = if dir.join("pages").is_dir() {
        dir.join("pages")
    } else {
        pool_dir(reg)
    };
    let pool =
        PagePool::open(&pool_path).map_err(|e| problem(source, format!("page pool: {e}")))?;
    for (digest, addr) in pages.iter().flat_map(|m| m.iter().map(|(a, d)| (d, a))) {
        if !pool.contains(digest) && !preloaded.is_some_and(|p| p.contains_key(digest)) {
            return Err(problem(
                source,
                format!(
                    "is incomplete: page {addr:#x} ({}) is not in the page pool",
                    digest.short()
                ),
            ));
        }
    }
    Ok((pages, pool))
}

/// Start box `record` again (it is not running; its files are already those
/// of the checkpoint in `dir`, which has no layers: a snapshot's, see
/// [`checkpoint_processes`]) with the checkpoint's processes in place of its
/// command: the box then runs on from the checkpoint's instant. Returns the
/// host pid of its main process.
///
/// # Errors
/// A corrupt or incompatible checkpoint, a page missing or damaged, a start
/// or rebuild that fails: one line; the box is then stopped (its files stay
/// as they are).
pub(crate) fn restore_in_place(reg: &Registry, record: &BoxRecord, dir: &Path) -> Result<i32> {
    let source = dir.display().to_string();
    let (meta, dir) = load(reg, &source)?;
    check_compatible(&source, meta.version, &meta.kernel, &meta.cpu_flags)?;
    let (pages, pool) = open_pages(reg, &source, &meta, &dir, None)?;
    // The box starts as a restored box does (its init waits for the
    // processes), from its own record: only this start's copy of its spec
    // names the checkpoint, which has no layers to add to its root.
    let mut shell = record.clone();
    shell.spec.restore_of = Some(source);
    let name = record.name();
    let result = crate::lifecycle::ops::restart_detached(reg, &shell).and_then(|()| {
        let mut started = reg.load(name)?;
        started.spec = shell.spec.clone();
        let (pids, _) = restore_into(&started, &meta.processes, &pages, &pool, None, false)?;
        Ok(pids[0])
    });
    if result.is_err() {
        let stopped = reg.load(name).and_then(|r| {
            if let Some(cg) = &r.state.cgroup {
                cg.kill_all()?;
            }
            crate::lifecycle::ops::stop(reg, name, Duration::from_secs(0))
        });
        crate::diag::warn_on_err(Some(name), "stopping a box whose restore failed", stopped);
    }
    let pid = result?;
    // A nest box suspended with its boxes (`subtree`) runs them again.
    crate::subtree::resume_inside(reg, name)?;
    Ok(pid)
}

/// A seccomp program as the kernel reads it (`struct sock_filter` array),
/// for [`nestbox_remote::RestorePlan::seccomp`].
pub(crate) fn program_bytes(p: &nestbox_seccomp::Program) -> Vec<u8> {
    p.instructions()
        .iter()
        .flat_map(|i| {
            let mut b = Vec::with_capacity(8);
            b.extend_from_slice(&i.code.to_ne_bytes());
            b.push(i.jt);
            b.push(i.jf);
            b.extend_from_slice(&i.k.to_ne_bytes());
            b
        })
        .collect()
}

/// Make the images' processes in the started box `shell`.
fn restore_into(
    shell: &BoxRecord,
    images: &[ProcessImage],
    pages: &[HashMap<u64, Digest>],
    pool: &PagePool,
    preloaded: Option<&Preloaded>,
    lazy: bool,
) -> Result<(Vec<i32>, Option<nestbox_remote::LazyServer>)> {
    let name = shell.name();
    let init = shell
        .state
        .init
        .ok_or_else(|| RuntimeError::NotRunning(name.to_string()))?;
    let mut namespaces = Vec::new();
    for kind in nestbox_remote::NsKind::SHELL {
        let path = format!("/proc/{}/ns/{}", init.pid, kind.proc_name());
        let ours = format!("/proc/self/ns/{}", kind.proc_name());
        let same = match (fs::metadata(&path), fs::metadata(&ours)) {
            (Ok(a), Ok(b)) => {
                use std::os::unix::fs::MetadataExt;
                a.ino() == b.ino() && a.dev() == b.dev()
            }
            _ => false,
        };
        if same {
            continue;
        }
        let f = fs::File::open(&path).map_err(RuntimeError::io("open", &path))?;
        namespaces.push((kind.clone_flag(), f));
    }
    let cgroup_files = shell
        .state
        .cgroup
        .as_ref()
        .map(|c| c.self_join_files())
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            fs::OpenOptions::new()
                .write(true)
                .open(&p)
                .map_err(RuntimeError::io("open", &p))
        })
        .collect::<Result<Vec<_>>>()?;
    let ns: Vec<(libc::c_int, BorrowedFd<'_>)> =
        namespaces.iter().map(|(k, f)| (*k, f.as_fd())).collect();
    let cg: Vec<BorrowedFd<'_>> = cgroup_files.iter().map(|f| f.as_fd()).collect();
    // Helpers' pids: above every pid the images' threads take, one each (a
    // helper's pid stays taken until its zombie is reaped).
    let first_helper = images
        .iter()
        .flat_map(|i| i.tids())
        .max()
        .unwrap_or(crate::init::ADOPTED_PID)
        + 1;
    let mut stubs = Vec::new();
    let roots = images
        .iter()
        .filter(|i| i.parent == nestbox_remote::tree::INIT_PID);
    for (helper, image) in (first_helper..).zip(roots) {
        // SAFETY: the child forked there runs raw syscalls only and exits; we
        // are root, and the new box's pid namespace holds only its init and
        // the stubs made here, so the image's pid and the helper's are free.
        let stub = unsafe { nestbox_sys::process::spawn_stub(&ns, &cg, image.ns_pid, helper) }
            .map_err(RuntimeError::sys(
                "spawning the restore stub (setns, clone3)",
            ))?;
        stubs.push((image.ns_pid, stub));
    }
    drop(cgroup_files);
    crate::phases::mark("restore: stubs spawned");
    let stdio = crate::clone::shell_stdio(init.pid)?;
    let cookie = shell.state.setns_cookie.unwrap_or_default();
    let seccomp =
        crate::monitor::seccomp_program(&shell.spec, Some(cookie))?.map(|p| program_bytes(&p));
    let plan = nestbox_remote::RestorePlan {
        stdio: [stdio[0].as_fd(), stdio[1].as_fd(), stdio[2].as_fd()],
        setns_cookie: cookie,
        seccomp,
        lazy: lazy.then_some(nestbox_remote::LazyPlan { box_init: init.pid }),
        // The box's filter lets the injected calls through (its cookie).
        suspend_seccomp: false,
    };
    let stores: Vec<ProcessPages<'_>> = pages
        .iter()
        .map(|p| ProcessPages::new(p, pool, preloaded))
        .collect();
    let refs: Vec<&dyn PageStore> = stores.iter().map(|s| s as &dyn PageStore).collect();
    // A lazy restore's page server (forked in there) logs to the box's
    // monitor log: the restore command's stderr may be gone by then.
    let _log = lazy.then(|| crate::diag::file_for_now(shell.monitor_log_path()));
    nestbox_remote::restore_box(&stubs, images, &refs, &plan).map_err(|e| {
        for (_, stub) in &stubs {
            // Killed with their tracer's handle already; make sure.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*stub),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        RuntimeError::Remote {
            what: "restoring box",
            name: name.to_string(),
            source: e,
        }
    })
}
