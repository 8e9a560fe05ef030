//! A pid namespace saved whole, without a box: the second capture root and
//! restore root of nestbox's checkpoint engine, for an OCI container started
//! cold (`nestbox-runc checkpoint`/`restore`).
//!
//! A box's checkpoint ([`crate::checkpoint`]) saves the processes *under*
//! nestbox's init (pid 1 of the box, not saved) and restores them under a
//! new box's init. In a cold OCI container there is no such init: pid 1 of
//! the container's pid namespace is the container's program, a child of the
//! runtime's caller (conmon, the containerd shim). So here the tree saved is
//! the whole namespace, its pid 1 included ([`nestbox_remote::tree::read_pid_namespace`]:
//! pid 1's parent is [`nestbox_remote::tree::OUTSIDE_PID`]), and the restore
//! makes pid 1 from a stub the caller has set up as the pid 1 of a new pid
//! namespace (its other namespaces, mounts, root and cgroup made from the
//! container's config, as `create` makes them); its children are forked by
//! it, as in a box. The rest is the engine's: the same process images,
//! page pool, fd rules, thread re-creation.
//!
//! What the image holds: the processes (as a box checkpoint's), their pages
//! in a page pool of the image's own, and no root file system (an OCI
//! container's rootfs is its bundle's, as with runc and CRIU), no spec:
//!
//! ```text
//! DIR/namespace.json   version, kernel, CPU flags, processes, stats
//! DIR/pages-PID        the page records of each process
//! DIR/pages/           the page pool
//! ```

use std::collections::HashMap;
use std::fs;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::time::Instant;

use nestbox_remote::{PageStore, ProcessImage};
use nestbox_store::{Digest, PagePool};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    check_compatible, cpu_flags, kernel_release, now, problem, program_bytes, read_page_records,
    save_all, save_tree, write_private, CheckpointStats, ProcessPages, FREEZER_TIMEOUT,
};
use crate::{Result, RuntimeError};

/// The file of an image of a pid namespace.
pub const IMAGE_FILE: &str = "namespace.json";

/// An image of a pid namespace, as `namespace.json` holds it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NamespaceCheckpoint {
    /// [`nestbox_remote::IMAGE_VERSION`] of the writer.
    pub version: u32,
    /// What it was taken of (for messages: "container c1").
    pub source: String,
    /// Seconds since the epoch.
    pub created_at: f64,
    /// The kernel release it was taken on.
    pub kernel: String,
    /// The CPU's feature flags.
    pub cpu_flags: Vec<String>,
    /// Its processes, pid 1 first, every parent before its children.
    pub processes: Vec<ProcessImage>,
    /// What it took.
    pub stats: CheckpointStats,
}

/// What [`checkpoint`] is asked.
#[derive(Debug)]
pub struct NamespaceRequest<'a> {
    /// What is saved, for messages ("container \"c1\"").
    pub what: &'a str,
    /// Host pid of the namespace's pid 1.
    pub pid1: i32,
    /// The cgroup that holds the tree (frozen while it is saved; every
    /// process in it must be pid 1 or one of its descendants).
    pub cgroup: &'a nestbox_cgroup::BoxCgroup,
    /// The image directory to make (it must not exist; its parent must).
    pub output: &'a Path,
    /// Leave the processes running (default: killed once saved).
    pub leave_running: bool,
}

/// Save the pid namespace of `req.pid1` (the processes of `req.cgroup`) as
/// an image in `req.output`, then kill them unless `req.leave_running`.
///
/// # Errors
/// What the engine cannot save (named: the process and its fd, mapping or
/// place in the tree), a process not in the tree of pid 1, an output that
/// exists: one line; then no image is left and the processes go on as they
/// were (thawed), whatever `leave_running`.
pub fn checkpoint(req: &NamespaceRequest<'_>) -> Result<NamespaceCheckpoint> {
    let start = Instant::now();
    let out = std::path::absolute(req.output).map_err(RuntimeError::io("resolve", req.output))?;
    let parent = out
        .parent()
        .filter(|p| p.is_dir())
        .ok_or_else(|| {
            RuntimeError::InvalidInput(format!(
                "checkpoint image {}: its parent directory does not exist",
                out.display()
            ))
        })?
        .to_path_buf();
    if out.exists() {
        return Err(RuntimeError::CheckpointExists(out.display().to_string()));
    }
    let tmp = parent.join(format!(
        ".tmp-{}-{}",
        out.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(RuntimeError::io("create", &tmp))?;
    }
    let what = req.what.to_string();
    let ended = || !alive(req.pid1);
    // An engine error while the tree ended (stopped, killed) says so.
    let remote = |e: nestbox_remote::RemoteError| match e {
        nestbox_remote::RemoteError::NoSuchProcess { .. }
        | nestbox_remote::RemoteError::Exited { .. }
        | nestbox_remote::RemoteError::ZombieLeader { .. } => {
            problem(&what, "cannot be saved: its processes ended meanwhile")
        }
        nestbox_remote::RemoteError::AlreadyTraced { pid, tracer } => problem(
            &what,
            format!("cannot be saved now: its process {pid} is traced by pid {tracer}"),
        ),
        e if ended() => {
            let _ = e;
            problem(&what, "cannot be saved: its processes ended meanwhile")
        }
        e => RuntimeError::Remote {
            what: "checkpointing",
            name: what.clone(),
            source: e,
        },
    };
    let frozen_at = Instant::now();
    let cgroup = req.cgroup;
    let result = cgroup
        .set_frozen(true, FREEZER_TIMEOUT)
        .map_err(RuntimeError::from)
        .and_then(|()| tree_of(req, &remote))
        .and_then(|steps| {
            save_tree(&steps, cgroup, &remote, &mut |tracees, steps| {
                save_all(&tmp.join("pages"), tracees, steps, &tmp, &what)
            })
        });
    let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
    let finish = result.and_then(|(processes, mut stats)| {
        stats.frozen_ms = frozen_ms;
        stats.total_ms = start.elapsed().as_secs_f64() * 1e3;
        let meta = NamespaceCheckpoint {
            version: nestbox_remote::IMAGE_VERSION,
            source: what.clone(),
            created_at: now(),
            kernel: kernel_release(),
            cpu_flags: cpu_flags(),
            processes,
            stats,
        };
        serde_json::to_vec(&meta)
            .map_err(|e| problem(&what, format!("encoding {IMAGE_FILE}: {e}")))
            .and_then(|json| write_private(&tmp.join(IMAGE_FILE), &json))
            .and_then(|()| {
                fs::rename(&tmp, &out).map_err(|e| {
                    if out.exists() {
                        RuntimeError::CheckpointExists(out.display().to_string())
                    } else {
                        RuntimeError::io("rename", &out)(e)
                    }
                })
            })
            .map(|()| meta)
    });
    match finish {
        Ok(meta) => {
            if req.leave_running {
                cgroup.set_frozen(false, FREEZER_TIMEOUT)?;
            } else {
                // Killed while frozen: a killed process thawed dies before
                // it runs again (kill_all thaws).
                cgroup.kill_all()?;
            }
            Ok(meta)
        }
        Err(e) => {
            crate::diag::warn_on_err(
                None,
                "thawing a tree whose checkpoint failed",
                cgroup
                    .set_frozen(false, FREEZER_TIMEOUT)
                    .map_err(RuntimeError::from),
            );
            if tmp.exists() {
                crate::diag::warn_on_err(
                    None,
                    "removing a failed checkpoint's directory",
                    fs::remove_dir_all(&tmp).map_err(RuntimeError::io("remove", &tmp)),
                );
            }
            Err(e)
        }
    }
}

/// Whether process `pid` lives (and is not a zombie).
fn alive(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rfind(')')
            .and_then(|i| stat.get(i + 2..i + 3))
            .is_some_and(|state| state != "Z" && state != "X")
    })
}

/// The tree of the (frozen) namespace of `req.pid1`, in the order it is
/// made again: every process of the cgroup, which must all be in it.
fn tree_of(
    req: &NamespaceRequest<'_>,
    remote: &dyn Fn(nestbox_remote::RemoteError) -> RuntimeError,
) -> Result<Vec<nestbox_remote::tree::Step>> {
    let pids = req.cgroup.procs()?;
    if !pids.contains(&req.pid1) {
        return Err(problem(
            req.what,
            format!(
                "cannot be saved: its pid 1 (host pid {}) is not in its cgroup",
                req.pid1
            ),
        ));
    }
    let refused = |e: nestbox_remote::RemoteError| match e {
        nestbox_remote::RemoteError::Unclonable(why) | nestbox_remote::RemoteError::Plan(why) => {
            problem(req.what, format!("cannot be saved: {why}"))
        }
        e => remote(e),
    };
    let processes = nestbox_remote::tree::read_pid_namespace(&pids).map_err(refused)?;
    let root = processes
        .iter()
        .find(|p| p.pid == nestbox_remote::tree::INIT_PID)
        .map(|p| p.host_pid);
    if root != Some(req.pid1) {
        return Err(problem(
            req.what,
            format!(
                "cannot be saved: host pid {} is not pid 1 of the pid namespace of its cgroup's processes",
                req.pid1
            ),
        ));
    }
    nestbox_remote::tree::plan(&processes).map_err(refused)
}

/// An image of a pid namespace opened for a restore: checked (version,
/// kernel, CPU, every page in its pool) before anything is made.
pub struct NamespaceImage {
    /// What `namespace.json` says.
    pub meta: NamespaceCheckpoint,
    dir: PathBuf,
    pages: Vec<HashMap<u64, Digest>>,
    pool: PagePool,
}

impl std::fmt::Debug for NamespaceImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamespaceImage")
            .field("dir", &self.dir)
            .field("processes", &self.meta.processes.len())
            .finish()
    }
}

/// Whether `dir` holds an image of a pid namespace (its `namespace.json`).
pub fn is_image(dir: &Path) -> bool {
    dir.join(IMAGE_FILE).is_file()
}

/// Open the image in `dir` for a restore.
///
/// # Errors
/// No image there, a corrupt or incompatible one (another kernel, a CPU
/// feature missing, another image version), a page missing from its pool,
/// an image whose first process is not a pid 1: one line.
pub fn open(dir: &Path) -> Result<NamespaceImage> {
    let dir = std::path::absolute(dir).map_err(RuntimeError::io("resolve", dir))?;
    let name = dir.display().to_string();
    let path = dir.join(IMAGE_FILE);
    let data = match fs::read(&path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RuntimeError::NoSuchCheckpoint(name))
        }
        Err(e) => return Err(RuntimeError::io("read", &path)(e)),
    };
    let meta: NamespaceCheckpoint = serde_json::from_slice(&data)
        .map_err(|e| problem(&name, format!("is corrupt: {}: {e}", path.display())))?;
    check_compatible(&name, meta.version, &meta.kernel, &meta.cpu_flags)?;
    match meta.processes.first() {
        Some(p)
            if p.ns_pid == nestbox_remote::tree::INIT_PID
                && p.parent == nestbox_remote::tree::OUTSIDE_PID => {}
        _ => {
            return Err(problem(
                &name,
                "is corrupt: its first process is not the pid 1 of its namespace",
            ))
        }
    }
    let mut pages = Vec::with_capacity(meta.processes.len());
    for p in &meta.processes {
        let records = read_page_records(&dir.join(format!("pages-{}", p.ns_pid)))?;
        pages.push(records.into_iter().collect::<HashMap<u64, Digest>>());
    }
    if !dir.join("pages").is_dir() {
        return Err(problem(
            &name,
            "is incomplete: it has no page pool (pages/)",
        ));
    }
    let pool = PagePool::open(&dir.join("pages"))
        .map_err(|e| problem(&name, format!("page pool: {e}")))?;
    for (digest, addr) in pages.iter().flat_map(|m| m.iter().map(|(a, d)| (d, a))) {
        if !pool.contains(digest) {
            return Err(problem(
                &name,
                format!(
                    "is incomplete: page {addr:#x} ({}) is not in the page pool",
                    digest.short()
                ),
            ));
        }
    }
    Ok(NamespaceImage {
        meta,
        dir,
        pages,
        pool,
    })
}

impl NamespaceImage {
    /// Make the image's processes: pid 1 from `stub` (host pid of a process
    /// that is pid 1 of a new pid namespace, in the namespaces, root and
    /// cgroup the processes are to have, blocked or stopped, not traced),
    /// the others forked by their restored parents. Their fds 0–2 that were
    /// pid 1's standard streams become `stdio`; `seccomp` is the filter of a
    /// process that had one (installed with the filter suspended while the
    /// restore's own calls run). Returns the host pids, pid 1 first, running.
    ///
    /// # Errors
    /// A failed call, naming it; a page whose contents do not match their
    /// digest (found before any process runs); a process that had a seccomp
    /// filter when `seccomp` is `None`. The stub and every process made are
    /// killed.
    pub fn restore(
        &self,
        stub: i32,
        stdio: [BorrowedFd<'_>; 3],
        seccomp: Option<&nestbox_seccomp::Program>,
    ) -> Result<Vec<i32>> {
        let plan = nestbox_remote::RestorePlan {
            stdio,
            setns_cookie: [0, 0],
            seccomp: seccomp.map(program_bytes),
            lazy: None,
            suspend_seccomp: true,
        };
        let stores: Vec<ProcessPages<'_>> = self
            .pages
            .iter()
            .map(|p| ProcessPages::new(p, &self.pool, None))
            .collect();
        let refs: Vec<&dyn PageStore> = stores.iter().map(|s| s as &dyn PageStore).collect();
        let stubs = [(nestbox_remote::tree::INIT_PID, stub)];
        nestbox_remote::restore_box(&stubs, &self.meta.processes, &refs, &plan)
            .map(|(pids, _)| pids)
            .map_err(|e| {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(stub),
                    nix::sys::signal::Signal::SIGKILL,
                );
                RuntimeError::Remote {
                    what: "restoring",
                    name: self.dir.display().to_string(),
                    source: e,
                }
            })
    }
}
