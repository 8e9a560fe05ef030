//! Boxes in boxes (`run --nest`, see `docs/nesting.md`): what a box gets so
//! that nestbox runs inside it as on a host, and how the boxes it runs are
//! seen from outside (`ps --tree`) and collected (`gc`).
//!
//! A nest box has a user namespace (its root is an unprivileged id of the
//! host), its cgroups delegated to its root and mounted at `/sys/fs/cgroup`
//! from its cgroup namespace (`nestbox_cgroup::BoxCgroup::prepare_delegated`),
//! a hidden unmasked procfs and sysfs (`nestbox_isolation::procfs::
//! mount_hidden_for_nesting`), a state directory of its own bound at
//! `/var/lib/nestbox` (the writable layers of its boxes: an overlay's upper
//! directory cannot be on the box's own overlay root), the running nestbox
//! binary bound read-only at [`crate::spec::NESTED_BINARY`], and a seccomp
//! filter that lets it make namespaces and mount in them
//! (`nestbox_seccomp::DefaultOpts::nest`). Its boxes' records stay in its own
//! `/run/nestbox`, read from outside through its root (`openat2` with
//! `RESOLVE_IN_ROOT`, which keeps every path and symlink of the box below
//! the box's root).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nestbox_cgroup::BoxCgroup;
use nestbox_isolation::rootfs::{CgroupMount, NestMounts, Volume};

pub use nestbox_isolation::idmap::in_user_namespace;

use crate::registry::BoxRecord;
use crate::spec::NESTED_BINARY;
use crate::state::Status;
use crate::{Result, RuntimeError};

/// Where a nest box's state directory is bound: the persistent data
/// (`$ROOT/lib`) of the nestbox inside.
pub const STATE_DIR_IN_BOX: &str = "/var/lib/nestbox";
/// A nest box's state directory in a checkpoint of it.
pub const IN_CHECKPOINT: &str = "nest";
/// The records of the boxes of the nestbox inside a nest box, below its root.
const RECORDS_IN_BOX: &str = "run/nestbox/boxes";
/// The largest record file read from inside a box.
const MAX_RECORD: u64 = 1 << 20;
/// How deep `ps --tree` and `gc` go.
const MAX_DEPTH: usize = 16;

/// The host directory of a nest box's state (`$ROOT/lib/boxes/<id>/nest`),
/// removed with the box's data.
pub fn state_dir(record: &BoxRecord) -> PathBuf {
    record.lib_dir().join("nest")
}

/// The binds a nest box gets: its state directory at
/// [`STATE_DIR_IN_BOX`], owned by the box's root (`owner`), and the running
/// nestbox binary (this process's), read-only, at [`NESTED_BINARY`]. A
/// clone's state directory starts as a copy of its template's (`template`),
/// a restored box's as a copy of the one in its checkpoint
/// ([`IN_CHECKPOINT`]): what the nestbox inside kept there (images, its
/// store) is the box's own from then on.
pub fn volumes(
    record: &BoxRecord,
    template: Option<&BoxRecord>,
    owner: Option<(u32, u32)>,
) -> Result<Vec<Volume>> {
    let dir = state_dir(record);
    let saved = match (template, &record.spec.restore_of) {
        (Some(t), _) => Some(state_dir(t)),
        (None, Some(checkpoint)) => Some(Path::new(checkpoint).join(IN_CHECKPOINT)),
        (None, None) => None,
    };
    match saved.filter(|t| t.is_dir()) {
        Some(from) if !dir.exists() => crate::copy::copy_tree(&from, &dir)?,
        _ => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&dir)
            .map_err(RuntimeError::io("mkdir", &dir))?,
    }
    if let Some((uid, gid)) = owner {
        nix::unistd::chown(&dir, Some(uid.into()), Some(gid.into()))
            .map_err(RuntimeError::sys(format!("chown {}", dir.display())))?;
    }
    Ok(vec![
        Volume {
            source: dir,
            target: STATE_DIR_IN_BOX.into(),
            read_only: false,
        },
        Volume {
            source: running_binary()?,
            target: NESTED_BINARY.into(),
            read_only: true,
        },
    ])
}

/// The path of the running nestbox binary (the target of `/proc/self/exe`:
/// a magic link cannot be bound from another mount namespace).
fn running_binary() -> Result<PathBuf> {
    let exe = std::fs::read_link("/proc/self/exe")
        .map_err(RuntimeError::io("readlink", "/proc/self/exe"))?;
    if !exe.exists() {
        return Err(RuntimeError::Failed(format!(
            "the running nestbox binary {} was removed or replaced: start the box with the one now installed",
            exe.display()
        )));
    }
    Ok(exe)
}

/// The cgroup mounts of a nest box, from its delegated cgroup.
pub fn mounts(cg: &BoxCgroup) -> NestMounts {
    NestMounts {
        cgroups: cg
            .delegation()
            .map(|d| {
                d.mounts
                    .iter()
                    .map(|m| CgroupMount {
                        dir: m.dir.clone(),
                        fstype: m.fstype.clone(),
                        options: m.options.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// A box run by a nestbox inside a box (at any depth), as seen from outside.
#[derive(Debug, Clone, PartialEq)]
pub struct NestedBox {
    /// `parent/child[/grandchild…]`: the names from the outermost box down.
    pub path: String,
    /// The box's id in its parent.
    pub id: String,
    /// Its status, checked against its monitor as from inside.
    pub status: Status,
    /// Its exit code, once exited.
    pub exit_code: Option<i32>,
    /// Its init's pid as this process sees it, while it runs.
    pub pid: Option<i32>,
    /// When it was made (seconds since the epoch).
    pub created: f64,
    /// Its command.
    pub command: String,
}

/// The boxes inside the running nest box `record`, depth first (each box
/// followed by its own boxes). A box that is not a nest box or not running
/// has none; a record that cannot be read is skipped.
pub fn tree(record: &BoxRecord) -> Vec<NestedBox> {
    let mut out = Vec::new();
    if !record.spec.nest || record.state.effective_status() != Status::Running {
        return out;
    }
    if let Some(init) = record.state.init.filter(|i| i.alive()) {
        walk(init.pid, record.name(), 1, &mut out);
    }
    out
}

/// The boxes of the nestbox inside the box whose init is `init` (a pid of
/// this process's namespace), named below `prefix`.
fn walk(init: i32, prefix: &str, depth: usize, out: &mut Vec<NestedBox>) {
    if depth > MAX_DEPTH {
        return;
    }
    let Ok(root) = std::fs::File::open(format!("/proc/{init}/root")) else {
        return;
    };
    let root: OwnedFd = root.into();
    // The pids the box's records hold are of its own pid namespace: its
    // processes, found below its init, say which of ours they are.
    let procs = descendants(init);
    let level = nspids(init).map(|n| n.len().saturating_sub(1)).unwrap_or(0);
    let ours = |p: i32, start: u64| -> Option<i32> {
        procs.iter().find_map(|(host, ns)| {
            (ns.len() > level && ns[level] == p && start_time(*host) == Some(start))
                .then_some(*host)
        })
    };
    let mut records = Vec::new();
    for name in list_dir(&root, RECORDS_IN_BOX) {
        if name.starts_with('.') || name.starts_with(crate::spec::POOL_NAME_PREFIX) {
            continue;
        }
        if crate::spec::validate_name(&name).is_err() {
            continue;
        }
        let dir = format!("{RECORDS_IN_BOX}/{name}");
        let (Some(state), Some(spec)) = (
            read_json_in(&root, &format!("{dir}/state.json")),
            read_json_in(&root, &format!("{dir}/spec.json")),
        ) else {
            continue;
        };
        records.push((name, state, spec));
    }
    records.sort_by(|a, b| {
        let t = |v: &serde_json::Value| v["created_at"].as_f64().unwrap_or(0.0);
        t(&a.1).total_cmp(&t(&b.1))
    });
    for (name, state, spec) in records {
        let proc_ref = |key: &str| {
            let v = &state[key];
            Some((
                i32::try_from(v["pid"].as_i64()?).ok()?,
                v["start_time"].as_u64()?,
            ))
        };
        let recorded: Status =
            serde_json::from_value(state["status"].clone()).unwrap_or(Status::Dead);
        let monitor_alive = proc_ref("monitor").and_then(|(p, s)| ours(p, s)).is_some();
        let status = match recorded {
            Status::Creating | Status::Running | Status::Frozen if !monitor_alive => Status::Dead,
            s => s,
        };
        let init_host = match status {
            Status::Running | Status::Frozen => proc_ref("init").and_then(|(p, s)| ours(p, s)),
            _ => None,
        };
        let path = format!("{prefix}/{name}");
        let command = spec["command"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        out.push(NestedBox {
            path: path.clone(),
            id: state["id"].as_str().unwrap_or_default().to_string(),
            status,
            exit_code: state["exit_code"]
                .as_i64()
                .and_then(|c| i32::try_from(c).ok()),
            pid: init_host,
            created: state["created_at"].as_f64().unwrap_or(0.0),
            command: sanitize(&command),
        });
        if let (true, Some(host), Status::Running) =
            (spec["nest"].as_bool().unwrap_or(false), init_host, status)
        {
            walk(host, &path, depth + 1, out);
        }
    }
}

/// Every process below `pid` (its children, theirs, …), each with its pids
/// in the namespaces from ours down (`NSpid`).
fn descendants(pid: i32) -> Vec<(i32, Vec<i32>)> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        if out.len() > 100_000 {
            break;
        }
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Ok(text) = std::fs::read_to_string(t.path().join("children")) else {
                continue;
            };
            for c in text
                .split_whitespace()
                .filter_map(|c| c.parse::<i32>().ok())
            {
                if let Some(ns) = nspids(c) {
                    out.push((c, ns));
                }
                todo.push(c);
            }
        }
    }
    out
}

fn nspids(pid: i32) -> Option<Vec<i32>> {
    crate::process::ns_pids(Path::new(&format!("/proc/{pid}")))
}

fn start_time(pid: i32) -> Option<u64> {
    crate::liveness::ProcRef::of(pid).map(|r| r.start_time)
}

/// The names in directory `rel` below `root`, resolved in the box's root.
fn list_dir(root: &OwnedFd, rel: &str) -> Vec<String> {
    let Ok(path) = CString::new(rel) else {
        return Vec::new();
    };
    let Ok(fd) =
        nestbox_sys::fd::open_in_root(root.as_fd(), &path, libc::O_RDONLY | libc::O_DIRECTORY, 0)
    else {
        return Vec::new();
    };
    let Ok(mut dir) = nix::dir::Dir::from_fd(fd.as_raw_fd()) else {
        return Vec::new();
    };
    // The Dir owns the descriptor from here on.
    std::mem::forget(fd);
    dir.iter()
        .flatten()
        .filter_map(|e| e.file_name().to_str().ok().map(str::to_string))
        .filter(|n| n != "." && n != "..")
        .take(10_000)
        .collect()
}

/// A JSON file below `root`, resolved in the box's root and read up to
/// [`MAX_RECORD`] bytes; `None` if missing, too large or not JSON.
fn read_json_in(root: &OwnedFd, rel: &str) -> Option<serde_json::Value> {
    use std::io::Read;
    let path = CString::new(rel).ok()?;
    let fd = nestbox_sys::fd::open_in_root(
        root.as_fd(),
        &path,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK,
        0,
    )
    .ok()?;
    let file = std::fs::File::from(fd);
    if !file.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = Vec::new();
    file.take(MAX_RECORD).read_to_end(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// Text from inside a box, safe to print on the host's terminal: control
/// characters become `?`.
pub fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() && c != '\t' { '?' } else { c })
        .collect()
}

/// Run `nestbox gc` inside the running nest box `record` (through `exec`,
/// with the box's own nestbox at [`NESTED_BINARY`], which in turn does the
/// same in its nest boxes), so what a nested box killed with SIGKILL left —
/// its cgroups below the box's, its record and layers — is collected too.
/// Returns the lines it printed, each prefixed with the box's name; gives up
/// after `timeout` (the box's processes are then killed).
pub fn gc_inside(
    reg: &crate::registry::Registry,
    record: &BoxRecord,
    timeout: Duration,
) -> Result<Vec<String>> {
    let (code, text) = run_nested(reg, record, &["gc"], timeout)?;
    let mut lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty() && l.trim() != "nothing to collect")
        .map(|l| format!("{}: {}", record.name(), sanitize(l)))
        .collect();
    if code != 0 {
        lines.push(format!(
            "{}: gc inside the box failed (exit code {code})",
            record.name()
        ));
    }
    Ok(lines)
}

/// Run the nestbox inside the running nest box `record` with `args` (through
/// `exec`, as the box's root, whose nestbox owns the boxes inside: the box's
/// own command may run as another user). Returns its exit code and what it
/// printed (standard output and error together, at most 1 MiB); gives up
/// after `timeout`, killing what it ran (exit code 137 then).
pub fn run_nested(
    reg: &crate::registry::Registry,
    record: &BoxRecord,
    args: &[&str],
    timeout: Duration,
) -> Result<(i32, String)> {
    use nix::unistd::{fork, pipe, ForkResult};
    let (r, w) = pipe().map_err(RuntimeError::sys("pipe"))?;
    let mut command = vec![NESTED_BINARY.to_string()];
    command.extend(args.iter().map(|a| a.to_string()));
    // SAFETY: the CLI is single-threaded, so the child may run arbitrary code.
    match unsafe { fork() }.map_err(RuntimeError::sys("fork"))? {
        ForkResult::Child => {
            drop(r);
            // Its own process group, which a timeout kills whole (the exec
            // helper and the command inside stay in it).
            let _ =
                nix::unistd::setpgid(nix::unistd::Pid::from_raw(0), nix::unistd::Pid::from_raw(0));
            // SAFETY: dup2 onto this child's own stdout and stderr.
            unsafe {
                libc::dup2(w.as_raw_fd(), 1);
                libc::dup2(w.as_raw_fd(), 2);
            }
            drop(w);
            let opts = crate::exec::ExecOptions {
                command,
                user: Some(crate::spec::User::default()),
                ..Default::default()
            };
            let code = match crate::exec::exec(reg, record.name(), &opts) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    e.exit_code()
                }
            };
            nestbox_sys::process::exit_now(code)
        }
        ForkResult::Parent { child } => {
            drop(w);
            let text = read_until(r, Instant::now() + timeout);
            let done = wait_for(child, Instant::now() + Duration::from_millis(500));
            let code = match done {
                Some(c) => c,
                None => {
                    // It ran out of time: its whole group goes.
                    let _ = nix::sys::signal::killpg(child, nix::sys::signal::Signal::SIGKILL);
                    crate::process::wait_exit_code(child)
                }
            };
            Ok((code, text))
        }
    }
}

/// The exit code of child `pid` if it ends before `deadline`.
fn wait_for(pid: nix::unistd::Pid, deadline: Instant) -> Option<i32> {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(_, c)) => return Some(c),
            Ok(WaitStatus::Signaled(_, s, _)) => return Some(128 + s as i32),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return Some(crate::error::EXIT_NESTBOX_ERROR),
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Read `fd` to its end or until `deadline`, at most 1 MiB.
fn read_until(fd: OwnedFd, deadline: Instant) -> String {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || out.len() > (1 << 20) {
            break;
        }
        let ms = u16::try_from(left.as_millis().min(10_000)).unwrap_or(10_000);
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(0) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => break,
            Ok(_) => {}
        }
        match nix::unistd::read(fd.as_raw_fd(), &mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The nest boxes among `records` that run, by name.
pub fn running_nest_boxes(records: &[BoxRecord]) -> BTreeMap<String, BoxRecord> {
    records
        .iter()
        .filter(|r| r.spec.nest && r.state.effective_status() == Status::Running)
        .map(|r| (r.name().to_string(), r.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_a_box_cannot_drive_the_terminal() {
        assert_eq!(sanitize("a\x1b[2Jb\nc\td"), "a?[2Jb?c\td");
    }
}
