//! An E2B-compatible HTTP API: `nestbox serve --http ADDR:PORT` answers the
//! E2B SDK (Python and JavaScript, versions 2.x) on one plain-HTTP port, both
//! its control plane (`/sandboxes`, `/v2/sandboxes`: [`control`]) and the
//! in-sandbox API "envd" ([`envd`]), which the SDK reaches at
//! `E2B_SANDBOX_URL` and this server routes by the `E2b-Sandbox-Id` header.
//! A sandbox is a box: a clone of a nestbox template (the built-in
//! [`base`], or any template by its name), or a box of an image started cold.
//!
//! Processes: `serve` forks before any thread exists. The parent is the
//! clone server of `nestbox_runtime::api` on the Unix socket, unchanged and
//! single-threaded (it forks monitors and clones, which a multi-threaded
//! process must not do). The child is the HTTP server, a thread per
//! connection; it asks the clone server for clones, the in-box agent
//! ([`envd::agent`]) for commands, and runs the `nestbox` binary for
//! everything else ([`nestbox`]). SIGTERM or SIGINT to the parent ends both;
//! the sandboxes stay, and their records ([`records`]) let the next server
//! of the root take them up.

pub mod base;
pub mod control;
pub mod envd;
pub mod error;
pub mod http;
pub mod nestbox;
pub mod records;
pub mod sandbox;
pub mod util;

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nestbox_runtime::registry::Registry;
use nix::sys::signal::{SigSet, Signal};
use nix::unistd::{fork, ForkResult};

pub use error::{E2bError, Result};

use crate::http::{Request, Response};
use crate::sandbox::Sandbox;

/// How the HTTP server is set up.
#[derive(Debug, Clone)]
pub struct Config {
    /// `ADDR:PORT` to listen on.
    pub addr: String,
    /// API keys accepted in `X-API-KEY` (none: every request is accepted).
    pub api_keys: Vec<String>,
    /// The root given to the CLI (`--root`), passed on to `nestbox` commands.
    pub root: Option<PathBuf>,
    /// Clones kept ready in the `base` template's pool when it is made.
    pub base_pool: u32,
}

/// The pool of the `base` template made by `serve`.
pub const DEFAULT_BASE_POOL: u32 = 4;

/// The state of the HTTP server.
#[derive(Debug)]
pub struct Server {
    /// The root's registry (read only: box records).
    pub reg: Registry,
    /// Acts on boxes.
    pub nestbox: nestbox::Nestbox,
    /// Accepted API keys.
    pub keys: Vec<String>,
    /// The base template's readiness.
    pub base: base::Base,
    /// CPUs of the host (what a sandbox may use at most).
    pub cpu_count: u64,
    /// Memory of the host, in MiB.
    pub memory_mb: u64,
    sandboxes: Mutex<HashMap<String, Arc<Sandbox>>>,
    /// Templates made by snapshots (kept until deleted).
    snapshots: Mutex<Vec<Snapshot>>,
    /// The records on disk of both.
    records: records::Records,
}

/// A snapshot: the frozen box a sandbox's state was kept in, a template
/// sandboxes are created from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Its id: the template's name.
    pub id: String,
    /// The name given at its making, if any (also usable as a template id).
    pub name: Option<String>,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
}

impl Snapshot {
    /// The names the API shows for it.
    pub fn names(&self) -> Vec<String> {
        vec![self.name.clone().unwrap_or_else(|| self.id.clone())]
    }
}

impl Server {
    /// The sandbox `id`.
    pub fn sandbox(&self, id: &str) -> Result<Arc<Sandbox>> {
        self.lock()
            .get(id)
            .cloned()
            .ok_or_else(|| E2bError::NoSuchSandbox(id.to_string()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Sandbox>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn insert(&self, s: Arc<Sandbox>) {
        self.persist(&s);
        self.lock().insert(s.id.clone(), s);
    }

    fn take(&self, id: &str) -> Option<Arc<Sandbox>> {
        let s = self.lock().remove(id)?;
        if let Err(e) = self.records.remove(id) {
            tracing::error!("e2b: record of sandbox {id}: {e}");
        }
        Some(s)
    }

    /// Write the record of `s` as it is now (a failure is logged: the
    /// sandbox works on, a restarted server would not know this change).
    fn persist(&self, s: &Sandbox) {
        if let Err(e) = self.records.save(s) {
            tracing::error!("e2b: record of sandbox {}: {e}", s.id);
        }
    }

    /// Take up the sandboxes and snapshots recorded by a server before this
    /// one whose boxes are still there (the others' records are removed).
    /// Those whose time is up are then the reaper's.
    fn restore(&self) {
        for s in self.records.load() {
            let live = s.live();
            if self.reg.load(&live.box_name).is_ok() {
                if live.phase == sandbox::Phase::Running {
                    // Its commands go on, their output to this server now
                    // (a paused one's are taken up when it resumes).
                    control::follow_commands(self, &s.procs, &live.box_name, false);
                }
                self.lock().insert(s.id.clone(), Arc::new(s));
            } else {
                tracing::info!("e2b: sandbox {} is gone since the last server", s.id);
                let _ = self.records.remove(&s.id);
            }
        }
        let snapshots: Vec<Snapshot> = self
            .records
            .load_snapshots()
            .into_iter()
            .filter(|s| self.reg.load(&s.id).is_ok())
            .collect();
        *self.snapshot_list() = snapshots;
        self.persist_snapshots();
    }

    fn persist_snapshots(&self) {
        let list = self.all_snapshots();
        if let Err(e) = self.records.save_snapshots(&list) {
            tracing::error!("e2b: record of snapshots: {e}");
        }
    }

    fn snapshot_list(&self) -> std::sync::MutexGuard<'_, Vec<Snapshot>> {
        self.snapshots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn keep_snapshot(&self, snapshot: Snapshot) {
        self.snapshot_list().push(snapshot);
        self.persist_snapshots();
    }

    /// Every snapshot, oldest first.
    fn all_snapshots(&self) -> Vec<Snapshot> {
        self.snapshot_list().clone()
    }

    /// Forget the snapshot of id (or name) `key`, if there is one.
    fn take_snapshot(&self, key: &str) -> Option<Snapshot> {
        let mut list = self.snapshot_list();
        let i = list
            .iter()
            .position(|s| s.id == key || s.name.as_deref() == Some(key))?;
        let taken = list.remove(i);
        drop(list);
        self.persist_snapshots();
        Some(taken)
    }

    /// The template behind template id `key`: a snapshot's name is taken for
    /// its id; anything else is itself.
    fn template_of(&self, key: &str) -> String {
        self.snapshot_list()
            .iter()
            .find(|s| s.name.as_deref() == Some(key))
            .map_or_else(|| key.to_string(), |s| s.id.clone())
    }

    /// Every sandbox.
    pub fn all(&self) -> Vec<Arc<Sandbox>> {
        self.lock().values().cloned().collect()
    }

    /// Answer one request: envd if it names a sandbox, else the control plane.
    pub fn handle(self: &Arc<Self>, req: Request) -> Response {
        match req.header("e2b-sandbox-id").map(String::from) {
            Some(id) => envd::handle(self, &id, &req),
            None if req.path == "/files" && req.query("signature").is_some() => {
                envd::signed_files(self, &req)
            }
            None if envd_route(&req.path) => {
                let e = E2bError::NoSandboxHeader;
                Response::json(
                    e.status(),
                    &serde_json::json!({"code": e.status(), "message": e.to_string()}),
                )
            }
            None => control::handle(self, &req),
        }
    }
}

fn envd_route(path: &str) -> bool {
    path == "/files"
        || path == "/health"
        || path.starts_with("/process.")
        || path.starts_with("/filesystem.")
}

/// Serve the clone socket (this process) and the HTTP API (a child process)
/// until SIGTERM or SIGINT.
pub fn serve(reg: &Registry, socket: &Path, config: Config) -> Result<()> {
    let listener =
        TcpListener::bind(&config.addr).map_err(E2bError::io("listen on", &config.addr))?;
    let exe = std::env::current_exe().map_err(E2bError::io("find", "/proc/self/exe"))?;
    let server = Server {
        reg: Registry::new(reg.roots().clone()),
        nestbox: nestbox::Nestbox {
            exe,
            root: config.root.clone(),
            socket: socket.to_path_buf(),
        },
        keys: config.api_keys.clone(),
        base: base::Base::default(),
        cpu_count: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        memory_mb: host_memory_mb(),
        sandboxes: Mutex::new(HashMap::new()),
        snapshots: Mutex::new(Vec::new()),
        records: records::Records::new(&reg.roots().lib),
    };
    // SAFETY: the CLI is single-threaded here; the child only sets its
    // signal mask and then runs ordinary Rust code (its own threads).
    let forked = unsafe { fork() }
        .map_err(|e| E2bError::io("fork", "nestbox serve")(std::io::Error::from(e)))?;
    match forked {
        ForkResult::Child => http_main(server, listener, config.base_pool),
        ForkResult::Parent { child } => {
            drop(listener);
            let result = nestbox_runtime::api::serve(reg, socket);
            let _ = nix::sys::signal::kill(child, Signal::SIGTERM);
            let _ = nix::sys::wait::waitpid(child, None);
            result.map_err(E2bError::from)
        }
    }
}

/// The HTTP server's process. Never returns.
fn http_main(server: Server, listener: TcpListener, base_pool: u32) -> ! {
    let mut mask = SigSet::empty();
    mask.add(Signal::SIGTERM);
    mask.add(Signal::SIGINT);
    // Blocked here, inherited by every thread; one thread waits for them.
    let _ = mask.thread_block();
    // The parent's end is this one's too.
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGTERM);
    let server = Arc::new(server);
    if let Err(e) = server
        .nestbox
        .wait_for_clone_server(Duration::from_secs(30))
    {
        tracing::error!("e2b: {e}");
        nestbox_sys_exit(1);
    }
    server.restore();
    {
        let server = server.clone();
        std::thread::spawn(move || base::ensure(&server, base_pool));
    }
    {
        let server = server.clone();
        std::thread::spawn(move || control::reaper(server, Duration::from_millis(250)));
    }
    {
        let server = server.clone();
        std::thread::spawn(move || {
            let _ = mask.wait();
            // The sandboxes and snapshots stay, with their records: the next
            // server takes them up (and removes those whose time is up).
            // Commands started through envd go on in their boxes, their
            // streams end here.
            drop(server);
            nestbox_sys_exit(0);
        });
    }
    let handler_server = server.clone();
    http::serve(listener, Arc::new(move |req| handler_server.handle(req)));
    nestbox_sys_exit(0)
}

fn nestbox_sys_exit(code: i32) -> ! {
    std::process::exit(code)
}

fn host_memory_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}
