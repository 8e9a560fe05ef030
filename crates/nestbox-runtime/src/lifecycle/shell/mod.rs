//! The pool of box shells: boxes made ahead of time up to the point where
//! only their command is missing (namespaces made, cgroup made and joined,
//! root assembled and pivoted into, network attached, an init waiting), so
//! that `nestbox run` claims one and has its command started instead of
//! making a box.
//!
//! * A shell is an ordinary box record named `pool.shell.<key>.<suffix>`
//!   (`pool.mk.…` while it is being made), hidden from `ps`, with a detached
//!   monitor that listens on `sock` in the record directory. `<key>` is the
//!   [`Shape`]'s: what of a box's spec shapes what is made ahead (image,
//!   network, limits, tmpfs, read-only root). A request takes a shell only of
//!   exactly its shape; any other request, or one that finds no shell, is
//!   started the ordinary (cold) way.
//! * The claim is a message to the shell's monitor (the spec, and the
//!   caller's stdin/stdout/stderr as descriptors); the monitor serves one
//!   claim and then stops listening, so of two callers racing for a shell one
//!   gets it and the other is refused and tries the next. The monitor renames
//!   the record to the box's name (no-replace: a taken name is refused as a
//!   cold start refuses it), writes the box's spec, and tells init the
//!   command; init sets the hostname and starts the command as a cold box's
//!   first process does. From then on the box is an ordinary box of that
//!   monitor (logs, exit code, `ps`, `inspect`, `rm`, limits, `--rm`). A
//!   foreground caller gets the output on its own descriptors and the exit
//!   code in a last message; the signals it gets are passed on; if it goes
//!   away, the box is killed, as a cold box dies with its foreground `run`.
//! * After a claim the monitor starts a refill of the shell's shape in a
//!   detached idle-priority process (as the network pool's). A request that
//!   found no shell of its shape registers the shape (when the pool is on) so
//!   that the next ones find shells.
//! * Size: `nestbox pool size N` (shells kept ready per shape, 0-16; the
//!   machine-wide root keeps 2 unless told, other roots 0: tests and benches
//!   turn it on in their own roots). Shells and shapes unused for
//!   [`IDLE_TTL`] go away by themselves; `pool drain` (and `pool size 0`)
//!   remove every shell at once, `network rm` those on the network, `gc`
//!   those whose monitor died.

pub mod serve;
pub mod wire;

use std::fs;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nestbox_cgroup::Limits;
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType, UnixAddr};
use serde::{Deserialize, Serialize};

use crate::monitor::Outcome;
use crate::paths::Roots;
use crate::registry::{BoxRecord, Registry};
use crate::spec::{BoxSpec, NetSpec, NetworkMode};
use crate::{Result, RuntimeError};

use wire::{FromMonitor, Stdio, ToMonitor};

/// Name prefix of ready shells.
pub const READY_PREFIX: &str = "pool.shell.";
/// Name prefix of shells being made.
pub const MAKING_PREFIX: &str = "pool.mk.";
/// The monitor's listening socket, in the record directory.
const SOCKET: &str = "sock";
/// Largest pool size (shells per shape).
pub const MAX_SIZE: usize = 16;
/// Pool size when none was set: the machine-wide root keeps two shells of
/// each shape in use ready; other roots (`--root`: tests, benches, nested
/// nestbox) keep none unless told.
const DEFAULT_SIZE_SYSTEM: usize = 2;
/// A shell not claimed for this long goes away, and so does a shape not
/// asked for for this long: an idle machine keeps nothing.
pub const IDLE_TTL: Duration = Duration::from_secs(600);

/// Whether `name` is a shell's record (ready or being made).
pub fn is_shell_name(name: &str) -> bool {
    name.starts_with(READY_PREFIX) || name.starts_with(MAKING_PREFIX)
}

/// What of a box's spec is made ahead in a shell: two requests of one shape
/// can use the same shell. Everything else (command, environment, user,
/// working directory, capabilities, seccomp, hostname, name, `--rm`, `-i`,
/// `--ksm`) is applied when the shell is claimed, as a cold start applies it
/// to the command.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    /// The image (only the host image is pooled: see [`Shape::of`]).
    pub image: String,
    /// Network mode.
    pub network: NetworkMode,
    /// The user-defined network, for bridge mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_name: Option<String>,
    /// Resource limits (the cgroup is made with them).
    pub limits: Limits,
    /// Paths with a fresh tmpfs.
    pub tmpfs: Vec<PathBuf>,
    /// Read-only root.
    pub read_only: bool,
    /// The caller's cgroups (`/proc/self/cgroup`): a box's cgroup is made
    /// under its creator's, so a shell made under other cgroups is another
    /// shape.
    pub cgroup: String,
}

impl Shape {
    /// The shape of `spec`, if a box of it may come from the pool: a box of
    /// the host image started by root without a user namespace, volume,
    /// disk, monitor, CPU reservation, published or allowed port, egress
    /// policy or rate (what is made for those is tied to the host or to
    /// state that may change while a shell waits), and not a clone or a
    /// restore.
    pub fn of(spec: &BoxSpec) -> Option<Shape> {
        let plain = spec.image == nestbox_image::HOST_IMAGE
            && !spec.userns
            && spec.clone_of.is_none()
            && spec.restore_of.is_none()
            && spec.monitors.is_empty()
            && spec.disk.is_none()
            && spec.volumes.is_empty()
            && !spec.network.has_bridge_options()
            && spec.limits.cpu_reserve.is_none()
            && !spec.nest
            && nix::unistd::geteuid().is_root();
        plain.then(|| Shape {
            image: spec.image.clone(),
            network: spec.network.mode,
            network_name: spec.network.name.clone(),
            limits: spec.limits.clone(),
            tmpfs: spec.tmpfs.clone(),
            read_only: spec.read_only,
            cgroup: std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default(),
        })
    }

    /// The shape's key (16 hex digits, FNV-1a of its JSON), part of its
    /// shells' names.
    pub fn key(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in json {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }

    /// The spec a shell of this shape is made from.
    fn shell_spec(&self, name: &str) -> BoxSpec {
        BoxSpec {
            name: name.to_string(),
            image: self.image.clone(),
            command: vec!["nestbox-shell".to_string()],
            env: Vec::new(),
            workdir: PathBuf::from("/"),
            user: Default::default(),
            hostname: "nestbox-shell".to_string(),
            read_only: self.read_only,
            volumes: Vec::new(),
            tmpfs: self.tmpfs.clone(),
            capabilities: Default::default(),
            seccomp: Default::default(),
            userns: false,
            limits: self.limits.clone(),
            interactive: false,
            remove_on_exit: false,
            clone_of: None,
            restore_of: None,
            network: NetSpec {
                mode: self.network,
                name: self.network_name.clone(),
                ..NetSpec::default()
            },
            ksm: false,
            disk: None,
            monitors: Vec::new(),
            nest: false,
        }
    }
}

/// The key in a shell's name.
pub(crate) fn key_of_name(name: &str) -> Option<&str> {
    name.strip_prefix(READY_PREFIX)
        .or_else(|| name.strip_prefix(MAKING_PREFIX))
        .and_then(|rest| rest.split('.').next())
}

fn size_file(roots: &Roots) -> PathBuf {
    roots.lib.join("shell-pool-size")
}

fn shapes_dir(roots: &Roots) -> PathBuf {
    roots.run.join("shellpool")
}

fn shape_file(roots: &Roots, key: &str) -> PathBuf {
    shapes_dir(roots).join(format!("{key}.json"))
}

/// How many shells of each shape `roots` keeps ready.
pub fn size(roots: &Roots) -> usize {
    match fs::read_to_string(size_file(roots)) {
        Ok(s) => s.trim().parse().unwrap_or(0),
        Err(_) if crate::network::is_system_root(roots) => DEFAULT_SIZE_SYSTEM,
        Err(_) => 0,
    }
}

/// Set the pool size of `reg`'s root. 0 drains the pool; otherwise the
/// shapes known (and `default`, the shape of a box with no options) are
/// filled at once. Returns the shells made.
pub fn set_size(reg: &Registry, n: usize, default: Option<&Shape>) -> Result<usize> {
    if n > MAX_SIZE {
        return Err(RuntimeError::InvalidInput(format!(
            "pool size {n} is too large (at most {MAX_SIZE})"
        )));
    }
    let path = size_file(reg.roots());
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(RuntimeError::io("mkdir", dir))?;
    }
    fs::write(&path, format!("{n}\n")).map_err(RuntimeError::io("write", &path))?;
    if n == 0 {
        drain(reg, &|_: &Shape| true)?;
        return Ok(0);
    }
    if let Some(shape) = default {
        remember(reg.roots(), shape)?;
    }
    let mut made = 0;
    for (key, _) in known_shapes(reg.roots()) {
        made += fill(reg, &key)?;
    }
    // Shells beyond the new size go.
    for (key, _) in known_shapes(reg.roots()) {
        let extra: Vec<String> = live_shells(reg, &key)
            .into_iter()
            .filter(|r| r.name().starts_with(READY_PREFIX))
            .skip(n)
            .map(|r| r.name().to_string())
            .collect();
        for name in extra {
            drain_one(reg, &name);
        }
    }
    Ok(made)
}

/// Record `shape` as one the pool keeps shells of (touching it if known:
/// a shape not asked for within [`IDLE_TTL`] is forgotten).
fn remember(roots: &Roots, shape: &Shape) -> Result<String> {
    let key = shape.key();
    let dir = shapes_dir(roots);
    fs::create_dir_all(&dir).map_err(RuntimeError::io("mkdir", &dir))?;
    let path = shape_file(roots, &key);
    let touched = fs::File::options()
        .append(true)
        .open(&path)
        .and_then(|f| f.set_modified(std::time::SystemTime::now()));
    if touched.is_err() {
        crate::state::write_json(&path, shape)?;
    }
    Ok(key)
}

/// Note that a box of `key`'s shape was claimed: the shape stays wanted.
pub(crate) fn touch(roots: &Roots, key: &str) {
    // Best effort: a shape file gone (drained) is not made again here.
    let _ = fs::File::options()
        .append(true)
        .open(shape_file(roots, key))
        .and_then(|f| f.set_modified(std::time::SystemTime::now()));
}

/// The shapes the pool keeps shells of: (key, shape).
pub fn known_shapes(roots: &Roots) -> Vec<(String, Shape)> {
    let mut out: Vec<(String, Shape)> = fs::read_dir(shapes_dir(roots))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let key = name.strip_suffix(".json")?.to_string();
            let shape = crate::state::read_json(&e.path()).ok()?;
            Some((key, shape))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Whether `key` is still wanted: its shape is known and was asked for
/// within [`IDLE_TTL`], and the pool is on.
pub(crate) fn wanted(roots: &Roots, key: &str) -> bool {
    let fresh = fs::metadata(shape_file(roots, key))
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.elapsed().ok())
        .is_some_and(|age| age < IDLE_TTL);
    fresh && size(roots) > 0
}

/// The refill lock of `key`: one refill of a shape at a time.
fn refill_lock(
    roots: &Roots,
    key: &str,
    wait: bool,
) -> Result<Option<nix::fcntl::Flock<fs::File>>> {
    let dir = shapes_dir(roots);
    fs::create_dir_all(&dir).map_err(RuntimeError::io("mkdir", &dir))?;
    crate::state::lock_file(&dir.join(format!("{key}.lock")), wait)
}

/// The shells of `key` (ready or being made) whose monitor lives, oldest first.
fn live_shells(reg: &Registry, key: &str) -> Vec<BoxRecord> {
    let mut out = Vec::new();
    for prefix in [READY_PREFIX, MAKING_PREFIX] {
        out.extend(
            reg.list_prefixed(&format!("{prefix}{key}."))
                .unwrap_or_default()
                .into_iter()
                .filter(|r| r.state.monitor.is_some_and(|m| m.alive())),
        );
    }
    out.sort_by(|a, b| a.state.created_at.total_cmp(&b.state.created_at));
    out
}

/// Make shells of `key` until the pool holds its size of them; the number
/// made. Returns at once if another refill of the shape runs.
pub fn fill(reg: &Registry, key: &str) -> Result<usize> {
    let roots = reg.roots();
    let Some(_lock) = refill_lock(roots, key, false)? else {
        return Ok(0);
    };
    let mut made = 0;
    loop {
        if !wanted(roots, key) {
            return Ok(made);
        }
        let Ok(shape) = crate::state::read_json::<Shape>(&shape_file(roots, key)) else {
            return Ok(made);
        };
        if live_shells(reg, key).len() >= size(roots) {
            return Ok(made);
        }
        make_one(reg, &shape, key)?;
        made += 1;
    }
}

/// [`fill`] in a detached idle-priority process, off the caller's path.
pub(crate) fn spawn_fill(reg: &Registry, key: &str) {
    let key = key.to_string();
    crate::process::spawn_refill(|| fill(reg, &key).map(|_| ()));
}

/// Make one shell of `shape` and wait until it is ready.
fn make_one(reg: &Registry, shape: &Shape, key: &str) -> Result<()> {
    let name = format!("{MAKING_PREFIX}{key}.{}", crate::registry::new_id());
    let record = reg.create(&shape.shell_spec(&name))?;
    crate::lifecycle::ops::start_shell(reg, record)
}

/// A request of `spec`'s shape found no shell: with the pool on, remember
/// the shape and start a refill, so that the next requests find shells.
fn missed(reg: &Registry, shape: &Shape) {
    if size(reg.roots()) == 0 {
        return;
    }
    match remember(reg.roots(), shape) {
        Ok(key) => spawn_fill(reg, &key),
        Err(e) => tracing::warn!("remembering a shape for the pool of box shells: {e}"),
    }
}

/// Where the socket of the shell whose record directory is `dir` is, as an
/// address to bind or connect (through `/proc/self/fd` when the path is too
/// long for a socket address; the returned descriptor must then stay open
/// while the address is used).
fn socket_addr(dir: &Path) -> std::io::Result<(Option<OwnedFd>, UnixAddr)> {
    let path = dir.join(SOCKET);
    if path.as_os_str().len() < 100 {
        return Ok((None, UnixAddr::new(&path)?));
    }
    let dirfd: OwnedFd = fs::File::options()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY)
        .open(dir)?
        .into();
    let addr = UnixAddr::new(format!("/proc/self/fd/{}/{SOCKET}", dirfd.as_raw_fd()).as_str())?;
    Ok((Some(dirfd), addr))
}

use std::os::unix::fs::OpenOptionsExt;

/// Connect to the monitor of the shell whose record directory is `dir`.
fn connect(dir: &Path) -> std::io::Result<OwnedFd> {
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let (_dirfd, addr) = socket_addr(dir)?;
    nix::sys::socket::connect(sock.as_raw_fd(), &addr)?;
    Ok(sock)
}

/// Bind and listen on the socket of the shell whose record directory is `dir`.
pub(crate) fn listen(dir: &Path) -> std::io::Result<OwnedFd> {
    let sock = socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    let (_dirfd, addr) = socket_addr(dir)?;
    nix::sys::socket::bind(sock.as_raw_fd(), &addr)?;
    nix::sys::socket::listen(&sock, nix::sys::socket::Backlog::new(16)?)?;
    Ok(sock)
}

/// A box started from a shell: the connection to its monitor.
#[derive(Debug)]
pub struct Claimed {
    conn: OwnedFd,
    /// The signals passed on to the box, blocked before the claim (as a
    /// cold start blocks them before it forks the box) so that none sent
    /// once the command runs is lost.
    signals: Option<nix::sys::signalfd::SignalFd>,
    name: String,
    /// Host pid of the box's init (a detached claim: its command runs).
    pub init_pid: Option<i32>,
}

/// Start box `spec` from a shell of its shape: `None` when there is none
/// (or every one was taken meanwhile): start it the ordinary way then. A
/// foreground caller (`detach` false) then waits with [`Claimed::wait`].
pub fn claim(reg: &Registry, spec: &BoxSpec, detach: bool) -> Result<Option<Claimed>> {
    let Some(shape) = Shape::of(spec) else {
        return Ok(None);
    };
    let key = shape.key();
    let mut names = reg.names_prefixed(&format!("{READY_PREFIX}{key}."))?;
    if !names.is_empty() {
        // Callers racing for shells start at different ones.
        let start = std::process::id() as usize % names.len();
        names.rotate_left(start);
    }
    let mut stdio = Vec::new();
    let mut fds = Vec::new();
    if spec.interactive {
        stdio.push(Stdio::Stdin);
        fds.push(0);
    }
    if !detach {
        stdio.extend([Stdio::Stdout, Stdio::Stderr]);
        fds.extend([1, 2]);
    }
    let signals = match detach {
        false => Some(crate::monitor::block_forwarded_signals()?),
        true => None,
    };
    let request = ToMonitor::Claim {
        spec: Box::new(spec.clone()),
        detach,
        stdio,
        phases: crate::phases::enabled(),
        inherited: wire::Inherited::of_this_process(),
    };
    for name in names {
        // A shell whose monitor died (gc removes it), or is going away.
        crate::phases::mark("cli: shell chosen");
        let Ok(conn) = connect(&reg.roots().box_run(&name)) else {
            continue;
        };
        if wire::send(conn.as_fd(), &request, &fds).is_err() {
            continue;
        }
        crate::phases::mark("cli: claim sent");
        match wire::recv::<FromMonitor>(conn.as_fd()) {
            Ok(Some((FromMonitor::Started { init_pid, marks }, _))) => {
                record_marks(marks);
                crate::phases::mark("cli: shell claimed, command runs");
                return Ok(Some(Claimed {
                    conn,
                    signals,
                    name: spec.name.clone(),
                    init_pid: Some(init_pid),
                }));
            }
            Ok(Some((FromMonitor::Taken, _))) => {
                crate::phases::mark("cli: shell claimed");
                return Ok(Some(Claimed {
                    conn,
                    signals,
                    name: spec.name.clone(),
                    init_pid: None,
                }));
            }
            Ok(Some((
                FromMonitor::Failed {
                    name_in_use: true, ..
                },
                _,
            ))) => return Err(RuntimeError::NameInUse(spec.name.clone())),
            Ok(Some((FromMonitor::Failed { code, message, .. }, _))) => {
                return Err(RuntimeError::Launch { code, message })
            }
            // Refused (taken by another caller, leaving), or gone.
            _ => continue,
        }
    }
    missed(reg, &shape);
    Ok(None)
}

/// Put a shell monitor's marks into this process's table (a measurement
/// run only: the names are leaked).
fn record_marks(marks: Vec<(String, i32, u64)>) {
    for (name, pid, ns) in marks {
        crate::phases::record(Box::leak(name.into_boxed_str()), pid, ns);
    }
}

impl Claimed {
    /// Wait for the box to end (its output goes to this process's stdout and
    /// stderr, written by the monitor); the signals the monitor of a cold
    /// box would pass on are passed on.
    pub fn wait(self) -> Result<Outcome> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        let signals = match &self.signals {
            Some(s) => s,
            None => &crate::monitor::block_forwarded_signals()?,
        };
        loop {
            let mut fds = [
                PollFd::new(self.conn.as_fd(), PollFlags::POLLIN),
                PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            ];
            if poll(&mut fds, PollTimeout::NONE).is_err() {
                continue;
            }
            let [conn, sig] = fds.map(|f| f.revents().is_some_and(|r| !r.is_empty()));
            if sig {
                while let Ok(Some(info)) = signals.read_signal() {
                    // The monitor gone shows on the connection below.
                    let _ = wire::send(
                        self.conn.as_fd(),
                        &ToMonitor::Signal {
                            signo: info.ssi_signo as i32,
                        },
                        &[],
                    );
                }
            }
            if conn {
                return match wire::recv::<FromMonitor>(self.conn.as_fd()) {
                    Ok(Some((
                        FromMonitor::Exited {
                            code,
                            oom_killed,
                            marks,
                        },
                        _,
                    ))) => {
                        record_marks(marks);
                        crate::phases::mark("cli: exit reported");
                        Ok(Outcome {
                            exit_code: code,
                            oom_killed,
                        })
                    }
                    // The command could not start; nothing of the box is left.
                    Ok(Some((FromMonitor::Failed { code, message, .. }, _))) => {
                        Err(RuntimeError::Launch { code, message })
                    }
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => Err(RuntimeError::Failed(format!(
                        "the monitor of box {:?} died",
                        self.name
                    ))),
                };
            }
        }
    }
}

/// Tear down the shell `name` (ready: through its monitor, refused if a
/// caller claimed it meanwhile; its monitor dead: here). Best effort.
fn drain_one(reg: &Registry, name: &str) {
    let Ok(record) = reg.load(name) else {
        return;
    };
    if !record.state.monitor.is_some_and(|m| m.alive()) {
        let cleaned =
            crate::lifecycle::ops::cleanup_dead(reg, &record).and_then(|()| reg.remove(&record));
        crate::diag::warn_on_err(Some(name), "removing a dead shell", cleaned);
        return;
    }
    if let Ok(conn) = connect(record.run_dir()) {
        if wire::send(conn.as_fd(), &ToMonitor::Drain, &[]).is_ok() {
            // The answer comes once the shell is gone.
            let _ = wire::recv::<FromMonitor>(conn.as_fd());
        }
    }
}

/// Remove the shells whose shape `which` selects (all: `&|_| true`), and
/// forget those shapes so that no refill makes more; waits (at most 10 s)
/// until they are gone. Returns how many were removed.
pub fn drain(reg: &Registry, which: &dyn Fn(&Shape) -> bool) -> Result<usize> {
    let roots = reg.roots();
    // Forget the shapes first, then wait out a refill making a shell of one
    // right now (it stops after that shell: its shape is gone).
    let mut keys: Vec<String> = Vec::new();
    for (key, shape) in known_shapes(roots) {
        if which(&shape) {
            // Gone already is fine.
            let _ = fs::remove_file(shape_file(roots, &key));
            keys.push(key);
        }
    }
    for key in &keys {
        drop(refill_lock(roots, key, true)?);
    }
    let selected =
        |r: &BoxRecord| is_shell_name(r.name()) && Shape::of(&r.spec).is_none_or(|s| which(&s));
    let mut removed = 0;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let shells: Vec<BoxRecord> = reg
            .list_prefixed(crate::spec::POOL_NAME_PREFIX)?
            .into_iter()
            .filter(selected)
            .collect();
        if shells.is_empty() || Instant::now() >= end {
            return Ok(removed);
        }
        for r in &shells {
            // One being made is drained once ready.
            if r.name().starts_with(READY_PREFIX) || !r.state.monitor.is_some_and(|m| m.alive()) {
                drain_one(reg, r.name());
                removed += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The box ids of the shells of `reg`'s root (ready or being made): they
/// hold addresses and cgroups, but are no boxes (`network ls` does not count
/// them).
pub fn ids(reg: &Registry) -> Vec<String> {
    reg.list_prefixed(crate::spec::POOL_NAME_PREFIX)
        .unwrap_or_default()
        .into_iter()
        .filter(|r| is_shell_name(r.name()))
        .map(|r| r.state.id)
        .collect()
}

/// Drain the shells on the bridge network `name` (the default one: `None`,
/// `default`, `bridge`): before the network is removed or its policy changes
/// (a shell's address and guard are the network's as it was when made).
pub fn drain_network(reg: &Registry, name: Option<&str>) -> Result<usize> {
    let name = name.filter(|n| !matches!(*n, "default" | "bridge"));
    drain(reg, &|s: &Shape| {
        s.network == NetworkMode::Bridge && s.network_name.as_deref() == name
    })
}

/// What `nestbox pool` shows.
#[derive(Debug, Serialize)]
pub struct PoolView {
    /// Shells kept ready per shape.
    pub size: usize,
    /// The shapes known.
    pub shapes: Vec<ShapeView>,
}

/// One shape of the pool.
#[derive(Debug, Serialize)]
pub struct ShapeView {
    /// Its key.
    pub key: String,
    /// What it is.
    pub shape: Shape,
    /// Shells ready to be claimed.
    pub ready: usize,
    /// Shells being made.
    pub making: usize,
}

/// The pool of `reg`'s root.
pub fn view(reg: &Registry) -> Result<PoolView> {
    let mut shapes = Vec::new();
    for (key, shape) in known_shapes(reg.roots()) {
        let live = live_shells(reg, &key);
        let ready = live
            .iter()
            .filter(|r| r.name().starts_with(READY_PREFIX))
            .count();
        shapes.push(ShapeView {
            making: live.len() - ready,
            ready,
            key,
            shape,
        });
    }
    Ok(PoolView {
        size: size(reg.roots()),
        shapes,
    })
}
