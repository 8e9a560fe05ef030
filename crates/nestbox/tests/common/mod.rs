//! Helpers shared by the integration tests.
//!
//! Every test makes its own [`TestRoot`]: a hermetic nestbox root directory
//! (`/tmp/nestbox-test-XXXX`) passed to every command with `--root`, so tests run in
//! parallel without seeing each other's boxes. Dropping it removes every box of
//! that root (`rm -f`, then `gc`), checks that nothing is left (cgroup
//! directories of every box it saw, box records and data, box processes) and
//! deletes the directory, so a failing test leaves nothing behind either.
//!
//! All waits are bounded: every nestbox command gets a timeout, and conditions are
//! polled with [`wait_until`] / [`wait_for`].

#![allow(dead_code)]

pub mod apps;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

/// The nestbox binary under test.
pub const NESTBOX: &str = env!("CARGO_BIN_EXE_nestbox");

/// The statically linked release build `scripts/setup.sh` makes (and the
/// test command runs first), for what only such a binary does; the test
/// fails, saying so, if it is missing or linked dynamically.
pub fn static_release_binary() -> PathBuf {
    let debug = Path::new(NESTBOX);
    let path = debug
        .parent()
        .and_then(Path::parent)
        .map(|target| target.join("release/nestbox"))
        .expect("the target directory of the nestbox binary");
    let elf = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}: build it with scripts/setup.sh (scripts/test.sh does)",
            path.display()
        )
    });
    // A dynamically linked executable has a program header naming its
    // interpreter (PT_INTERP, type 3). ELF64: the table's offset at byte 32,
    // entry size at 54, count at 56; each entry starts with its type.
    let field = |at: usize, len: usize| -> usize {
        elf[at..at + len]
            .iter()
            .rev()
            .fold(0, |n, &b| (n << 8) | usize::from(b))
    };
    let (offset, size, count) = (field(32, 8), field(54, 2), field(56, 2));
    assert!(
        !(0..count).any(|i| field(offset + i * size, 4) == 3),
        "{} is linked dynamically: build it with scripts/setup.sh (scripts/test.sh does)",
        path.display()
    );
    path
}

/// Longest any single nestbox command may take before the test fails.
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// Docker's default capability set, as /proc/PID/status shows it.
pub const DOCKER_DEFAULT_CAPS: u64 = 0x0000_0000_a804_25fb;

/// Top-level names the root of a box made from the host image may contain.
pub const IMAGE_ROOT_ENTRIES: &[&str] = &[
    "bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "tmp", "var", "run", "home",
    "root", "proc", "sys", "dev",
];

pub use nestbox_testkit::require_root;
pub use nestbox_testkit::Out;

/// Poll `cond` until it holds or `limit` passes; whether it held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    let mut pause = Duration::from_millis(5);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Like [`wait_until`], but fail the test naming `what` on timeout.
#[track_caller]
pub fn wait_for(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    assert!(
        wait_until(limit, cond),
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Assert that `out` is a nestbox error: exit `code`, exactly one line on stderr,
/// starting with `nestbox: error:` and mentioning `fragment` (case-insensitive).
#[track_caller]
pub fn assert_error(out: &Out, code: i32, fragment: &str) {
    assert_eq!(out.code, code, "unexpected exit code\n{out}");
    let lines: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "expected exactly one line on stderr\n{out}");
    assert!(
        lines[0].starts_with("nestbox: error:"),
        "stderr must start with 'nestbox: error:'\n{out}"
    );
    assert!(
        lines[0].to_lowercase().contains(&fragment.to_lowercase()),
        "the error should mention {fragment:?}\n{out}"
    );
}

/// The value of `key:` in a /proc/PID/status text.
pub fn status_field<'a>(status: &'a str, key: &str) -> Option<&'a str> {
    status.lines().find_map(|l| {
        l.strip_prefix(key)
            .and_then(|r| r.strip_prefix(':'))
            .map(str::trim)
    })
}

/// A hexadecimal capability mask field (CapBnd, CapEff...) of a /proc/PID/status text.
#[track_caller]
pub fn cap_field(status: &str, key: &str) -> u64 {
    let v = status_field(status, key).unwrap_or_else(|| panic!("no {key} in {status:?}"));
    u64::from_str_radix(v, 16).unwrap_or_else(|_| panic!("bad {key} value {v:?}"))
}

/// A uniquely named file on the host that only the test knows about, deleted on drop.
#[derive(Debug)]
pub struct HostMarker {
    file: tempfile::NamedTempFile,
}

impl HostMarker {
    /// Create one in `dir` (which must exist on the host).
    pub fn new(dir: &str) -> Self {
        let mut file = tempfile::Builder::new()
            .prefix("nestbox-marker-")
            .tempfile_in(dir)
            .unwrap_or_else(|e| panic!("create a marker file in {dir}: {e}"));
        file.write_all(b"host-only secret\n").unwrap();
        HostMarker { file }
    }

    /// Its path on the host.
    pub fn path(&self) -> &str {
        self.file.path().to_str().unwrap()
    }
}

/// A unique name for something the test creates on the host.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A recorded process identity (pid + start time), as state.json stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcId {
    pub pid: i32,
    pub start_time: u64,
}

impl ProcId {
    fn from_json(v: &Value) -> Option<Self> {
        Some(ProcId {
            pid: v.get("pid")?.as_i64()? as i32,
            start_time: v.get("start_time")?.as_u64()?,
        })
    }

    /// Whether this very process still runs (not a zombie, not a recycled pid).
    pub fn alive(&self) -> bool {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)) else {
            return false;
        };
        let Some(close) = stat.rfind(')') else {
            return false;
        };
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let state = fields.first().copied().unwrap_or("X");
        let start: u64 = fields.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
        start == self.start_time && state != "Z" && state != "X"
    }
}

/// Whether process `pid` exists and is not a zombie.
pub fn pid_alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .map(|i| s[i + 2..].starts_with(|c| c != 'Z' && c != 'X'))
        })
        .unwrap_or(false)
}

/// Whether `name` is the cgroup directory name of box `id`: `nestbox-<id>`, or
/// `nestbox-<root tag>-<id>`.
pub fn is_box_cgroup_name(name: &str, id: &str) -> bool {
    name.strip_prefix("nestbox-")
        .is_some_and(|rest| rest == id || rest.ends_with(&format!("-{id}")))
}

/// Every existing cgroup directory under this process's cgroups, in every mounted
/// hierarchy (where nestbox creates box cgroups for its callers), whose name
/// satisfies `wanted`.
pub fn cgroup_dirs_named(wanted: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let own: BTreeSet<String> = std::fs::read_to_string("/proc/self/cgroup")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            l.splitn(3, ':')
                .nth(2)
                .map(|p| p.trim_start_matches('/').to_string())
        })
        .collect();
    let mut hierarchies = vec![PathBuf::from("/sys/fs/cgroup")];
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        hierarchies.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
    }
    let mut found = BTreeSet::new();
    for h in &hierarchies {
        for p in &own {
            for e in std::fs::read_dir(h.join(p)).into_iter().flatten().flatten() {
                if wanted(&e.file_name().to_string_lossy()) && e.path().is_dir() {
                    found.insert(e.path().canonicalize().unwrap_or(e.path()));
                }
            }
        }
    }
    found.into_iter().collect()
}

/// Every existing cgroup directory of box `id`.
pub fn cgroup_dirs_of(id: &str) -> Vec<PathBuf> {
    cgroup_dirs_named(|n| is_box_cgroup_name(n, id))
}

/// The cgroup paths of a box from its `inspect` JSON (controller → directory).
pub fn cgroup_paths(inspect: &Value) -> BTreeMap<String, PathBuf> {
    match &inspect["cgroup"] {
        Value::Object(m) => m
            .iter()
            .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), PathBuf::from(s))))
            .collect(),
        Value::Array(a) => a
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.as_str().map(|s| (i.to_string(), PathBuf::from(s))))
            .collect(),
        _ => BTreeMap::new(),
    }
}

/// The first cgroup directory of a box that holds control file `file`.
pub fn cgroup_file(inspect: &Value, file: &str) -> Option<PathBuf> {
    cgroup_paths(inspect)
        .into_values()
        .map(|d| d.join(file))
        .find(|p| p.exists())
}

/// Read a cgroup control file, trimmed.
#[track_caller]
pub fn read_trimmed(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
        .trim()
        .to_string()
}

/// A hermetic nestbox root for one test. See the module documentation.
#[derive(Debug)]
pub struct TestRoot {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    /// The nestbox binary its commands run ([`NESTBOX`] unless told).
    binary: PathBuf,
    user: Option<(u32, u32)>,
    test: String,
    /// Ids of every box seen (their cgroups must be gone at the end).
    ids: Mutex<BTreeSet<String>>,
    /// Monitor and init processes of every box seen (they must be gone at the end).
    procs: Mutex<BTreeSet<ProcId>>,
    /// Root tags seen in box cgroup names (`nestbox-<tag>-<id>`): every cgroup with
    /// one of them belongs to this root and must be gone at the end.
    tags: Mutex<BTreeSet<String>>,
}

impl TestRoot {
    /// A fresh root for `test`, or `None` (after printing SKIP) without root.
    pub fn new(test: &str) -> Option<Self> {
        if !require_root(test) {
            return None;
        }
        Some(Self::make(test, None))
    }

    /// A fresh root whose commands run as `uid`:`gid` (the directory is theirs).
    /// Setting it up needs root; `None` (after printing SKIP) without.
    pub fn as_user(test: &str, uid: u32, gid: u32) -> Option<Self> {
        if !require_root(test) {
            return None;
        }
        Some(Self::make(test, Some((uid, gid))))
    }

    fn make(test: &str, user: Option<(u32, u32)>) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-")
            .tempdir_in("/tmp")
            .expect("create test root");
        let path = dir.path().to_path_buf();
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid)).expect("chown test root");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let root = TestRoot {
            dir: Some(dir),
            path,
            binary: PathBuf::from(NESTBOX),
            user,
            test: test.to_string(),
            ids: Mutex::new(BTreeSet::new()),
            procs: Mutex::new(BTreeSet::new()),
            tags: Mutex::new(BTreeSet::new()),
        };
        // NESTBOX_TEST_SHELL_POOL=N: every root keeps N box shells of each
        // shape ready, so that the suites run their boxes from the pool
        // (what a pooled box does must be what a cold one does).
        if let Some(n) = std::env::var("NESTBOX_TEST_SHELL_POOL")
            .ok()
            .filter(|n| n != "0" && user.is_none())
        {
            root.run(&["pool", "size", &n]).ok();
        }
        root
    }

    /// Run this root's commands with `binary` instead of [`NESTBOX`].
    pub fn with_binary(mut self, binary: &Path) -> Self {
        self.binary = binary.to_path_buf();
        self
    }

    /// The root directory (`--root`).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `nestbox --root DIR ARGS...`, not started yet.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(&self.binary);
        c.arg("--root")
            .arg(&self.path)
            .args(args)
            .current_dir("/")
            .env_remove("NESTBOX_ROOT");
        if let Some((uid, gid)) = self.user {
            c.uid(uid)
                .gid(gid)
                .env("HOME", "/")
                .env_remove("XDG_RUNTIME_DIR");
        }
        c
    }

    /// Run `nestbox ARGS...` to completion (bounded by [`COMMAND_TIMEOUT`]).
    pub fn run(&self, args: &[&str]) -> Out {
        self.run_full(args, None, COMMAND_TIMEOUT)
    }

    /// Same, feeding `input` on stdin.
    pub fn run_with_stdin(&self, args: &[&str], input: &[u8]) -> Out {
        self.run_full(args, Some(input), COMMAND_TIMEOUT)
    }

    /// Same, with its own time limit.
    pub fn run_timeout(&self, args: &[&str], limit: Duration) -> Out {
        self.run_full(args, None, limit)
    }

    /// Run `nestbox ARGS...` and expect success; its stdout.
    #[track_caller]
    pub fn ok(&self, args: &[&str]) -> String {
        self.run(args).ok().stdout
    }

    /// Wait (at most `limit`) until box `name`'s log holds `text` (a program
    /// saying it is ready).
    pub fn wait_logged(&self, name: &str, text: &str, limit: Duration) {
        wait_for(&format!("{name:?} to log {text:?}"), limit, || {
            self.ok(&["logs", name]).contains(text)
        });
    }

    /// `nestbox rm -f NAMES...`, which must succeed, given up to 4 minutes
    /// (hundreds of boxes).
    pub fn rm_all<'a>(&self, names: impl IntoIterator<Item = &'a str>) {
        let mut args = vec!["rm", "-f"];
        args.extend(names);
        self.run_timeout(&args, Duration::from_secs(240)).ok();
    }

    /// `nestbox run OPTS... -- sh -c SCRIPT`.
    pub fn sh(&self, opts: &[&str], script: &str) -> Out {
        let mut args = vec!["run"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&["--", "sh", "-c", script]);
        self.run(&args)
    }

    /// `nestbox run OPTS... -- python3 -c CODE`.
    pub fn py(&self, opts: &[&str], code: &str) -> Out {
        let mut args = vec!["run"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&["--", "python3", "-c", code]);
        self.run(&args)
    }

    /// `nestbox run -d --name NAME OPTS... -- sh -c SCRIPT`, expecting success.
    #[track_caller]
    pub fn detached_sh(&self, name: &str, opts: &[&str], script: &str) {
        let mut args = vec!["run", "-d", "--name", name];
        args.extend_from_slice(opts);
        args.extend_from_slice(&["--", "sh", "-c", script]);
        let out = self.run(&args).ok();
        assert_eq!(out.stdout.trim(), name, "run -d prints the box name\n{out}");
    }

    /// Start `nestbox ARGS...` without waiting (stdout and stderr piped).
    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nestbox")
    }

    fn run_full(&self, args: &[&str], input: Option<&[u8]>, limit: Duration) -> Out {
        let what = format!("nestbox {}", args.join(" "));
        let mut cmd = self.command(args);
        cmd.stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        finish(child, input, limit, what)
    }

    /// `inspect NAME` as JSON (the box's id and processes are remembered for the final checks).
    #[track_caller]
    pub fn inspect(&self, name: &str) -> Value {
        let out = self.run(&["inspect", name]).ok();
        let v: Value = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("inspect is not JSON: {e}\n{out}"));
        self.remember(&v);
        v
    }

    fn remember(&self, v: &Value) {
        if let Some(id) = v["id"].as_str() {
            self.ids.lock().unwrap().insert(id.to_string());
            for dir in cgroup_paths(v).values() {
                let name = dir.file_name().unwrap_or_default().to_string_lossy();
                let tag = name
                    .strip_prefix("nestbox-")
                    .and_then(|r| r.strip_suffix(&format!("-{id}")));
                if let Some(tag) = tag.filter(|t| !t.is_empty()) {
                    self.tags.lock().unwrap().insert(tag.to_string());
                }
            }
        }
        let state = if v["state"].is_object() {
            &v["state"]
        } else {
            v
        };
        for key in ["monitor", "init"] {
            if let Some(p) = ProcId::from_json(&state[key]) {
                self.procs.lock().unwrap().insert(p);
            }
        }
    }

    /// `ps -a --json` rows.
    #[track_caller]
    pub fn ps_all(&self) -> Vec<Value> {
        let out = self.run(&["ps", "-a", "--json"]).ok();
        let v: Value = serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("ps --json is not JSON: {e}\n{out}"));
        let rows = v
            .as_array()
            .cloned()
            .unwrap_or_else(|| panic!("ps --json is not an array\n{out}"));
        for r in &rows {
            self.remember(r);
        }
        rows
    }

    /// The names `ps -a` lists.
    #[track_caller]
    pub fn names(&self) -> Vec<String> {
        self.ps_all()
            .iter()
            .filter_map(|r| r["name"].as_str().map(String::from))
            .collect()
    }

    /// The `ps -a --json` row of `name`, if listed.
    #[track_caller]
    pub fn row(&self, name: &str) -> Option<Value> {
        self.ps_all().into_iter().find(|r| r["name"] == name)
    }

    /// The status `ps -a` shows for `name` ("running", "exited", "dead"...).
    #[track_caller]
    pub fn status(&self, name: &str) -> Option<String> {
        self.row(name)
            .and_then(|r| r["status"].as_str().map(String::from))
    }

    /// Wait (bounded) until `name` has exited; its exit code.
    #[track_caller]
    pub fn wait_exited(&self, name: &str, limit: Duration) -> i64 {
        let mut last = None;
        let done = wait_until(limit, || {
            last = self.row(name);
            last.as_ref().is_some_and(|r| r["status"] == "exited")
        });
        assert!(
            done,
            "box {name} did not exit within {limit:?}; last ps row: {last:?}"
        );
        last.unwrap()["exit_code"]
            .as_i64()
            .unwrap_or_else(|| panic!("exited box {name} has no exit code"))
    }

    /// Wait (bounded) until the box log of `name` (stdout) contains `text`.
    #[track_caller]
    pub fn wait_log(&self, name: &str, text: &str, limit: Duration) -> String {
        let mut last = String::new();
        let seen = wait_until(limit, || {
            last = self.run(&["logs", name]).stdout;
            last.contains(text)
        });
        assert!(
            seen,
            "box {name} did not print {text:?} within {limit:?}; its log: {last:?}"
        );
        last
    }

    /// `stats --json NAME`.
    #[track_caller]
    pub fn stats(&self, name: &str) -> Value {
        let out = self.run(&["stats", "--json", name]).ok();
        serde_json::from_str(&out.stdout)
            .unwrap_or_else(|e| panic!("stats --json is not JSON: {e}\n{out}"))
    }

    /// Every existing cgroup directory of this root's boxes (those seen by
    /// `inspect` and, through the root tag their names carry, all others),
    /// but the box shells' of the root's pool.
    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let shells = self.shell_ids();
        self.all_cgroup_dirs()
            .into_iter()
            .filter(|d| {
                let n = d.file_name().unwrap_or_default().to_string_lossy();
                !shells.iter().any(|id| is_box_cgroup_name(&n, id))
            })
            .collect()
    }

    /// Every existing cgroup directory of this root, the shells' included.
    pub fn all_cgroup_dirs(&self) -> Vec<PathBuf> {
        let ids: Vec<String> = self.ids.lock().unwrap().iter().cloned().collect();
        let tags: Vec<String> = self.tags.lock().unwrap().iter().cloned().collect();
        cgroup_dirs_named(|n| {
            ids.iter().any(|id| is_box_cgroup_name(n, id))
                || tags.iter().any(|t| {
                    n.strip_prefix("nestbox-")
                        .is_some_and(|r| r.starts_with(&format!("{t}-")))
                })
        })
    }

    /// Entries of the root's box record and box data directories (should be empty
    /// when no box exists); the box shells of the root's pool (`pool size`),
    /// which are no boxes, are not counted.
    pub fn state_entries(&self) -> Vec<PathBuf> {
        let shells = self.shell_ids();
        self.all_state_entries()
            .into_iter()
            .filter(|p| {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                !name.starts_with("pool.shell.")
                    && !name.starts_with("pool.mk.")
                    && !shells.contains(name.as_ref())
            })
            .collect()
    }

    /// The ids of the box shells in the root's pool.
    pub fn shell_ids(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.path.join("run/boxes"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let n = e.file_name().to_string_lossy().to_string();
                n.starts_with("pool.shell.") || n.starts_with("pool.mk.")
            })
            .filter_map(|e| std::fs::read_to_string(e.path().join("state.json")).ok())
            .filter_map(|s| serde_json::from_str::<Value>(&s).ok())
            .filter_map(|v| v["id"].as_str().map(String::from))
            .collect()
    }

    /// Every entry of the root's box record and box data directories. A box
    /// being removed by its monitor after it answered (`run --rm` of a box
    /// from the pool: record and data renamed to `.rm-ID`, removed a moment
    /// later) is waited for (at most 5 s), then counted if still there.
    pub fn all_state_entries(&self) -> Vec<PathBuf> {
        let tombs = || {
            [self.path.join("run/boxes"), self.path.join("lib/boxes")]
                .iter()
                .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
                .any(|e| e.file_name().to_string_lossy().starts_with(".rm-"))
        };
        wait_until(Duration::from_secs(5), || !tombs());
        let mut out = Vec::new();
        for d in [self.path.join("run/boxes"), self.path.join("lib/boxes")] {
            if let Ok(entries) = std::fs::read_dir(&d) {
                out.extend(entries.flatten().map(|e| e.path()));
            }
        }
        out
    }

    /// Assert that this root holds no box at all: none listed, no record or data
    /// directory (not even a half-made or half-removed one).
    #[track_caller]
    pub fn assert_no_boxes(&self) {
        let names = self.names();
        assert!(names.is_empty(), "boxes left in the root: {names:?}");
        let entries = self.state_entries();
        assert!(entries.is_empty(), "state left in the root: {entries:?}");
    }

    /// Remove everything, then report what could not be removed.
    /// Remove this root's network and check that its bridge, IFB device, NAT
    /// table and guard table are gone from the host.
    fn remove_network(&self) -> Vec<String> {
        let mut left = Vec::new();
        let networks: Vec<Value> = serde_json::from_str::<Value>(
            &self
                .run_timeout(&["network", "ls", "--json"], Duration::from_secs(30))
                .stdout,
        )
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default();
        let bridges: Vec<String> = networks
            .iter()
            .filter_map(|n| n["bridge"].as_str().map(String::from))
            .collect();
        // Boxes whose removal is still under way (a removed template goes
        // once its last clone has) keep their leases a moment: a failed test
        // can leave a chain of them. Retried for a while; what stays is told.
        let mut out = self.run_timeout(&["network", "rm"], Duration::from_secs(60));
        let until = Instant::now() + Duration::from_secs(20);
        while out.code != 0 && out.stderr.contains("still has") && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(500));
            let _ = self.run_timeout(&["gc"], Duration::from_secs(60));
            out = self.run_timeout(&["network", "rm"], Duration::from_secs(60));
        }
        if out.code != 0 {
            left.push(format!("network rm failed: {out}"));
        }
        // User-defined networks a test left (`network create`).
        for name in networks.iter().filter_map(|n| n["name"].as_str()) {
            if name == "default" {
                continue;
            }
            let out = self.run_timeout(&["network", "rm", name], Duration::from_secs(60));
            if out.code != 0 {
                left.push(format!("network rm {name} failed: {out}"));
            }
        }
        for bridge in bridges {
            for link in [bridge.clone(), format!("{bridge}ifb")] {
                if Path::new("/sys/class/net").join(&link).exists() {
                    left.push(format!("network link {link}"));
                }
            }
            for family in ["ip", "inet"] {
                let table = std::process::Command::new("nft")
                    .args(["list", "table", family, &format!("nestbox-{bridge}")])
                    .output();
                if table.is_ok_and(|o| o.status.success()) {
                    left.push(format!("nft table {family} nestbox-{bridge}"));
                }
            }
        }
        left
    }

    fn clean_up(&mut self) -> Vec<String> {
        let mut left = Vec::new();
        // Box shells a test's pool keeps ready are not listed by ps.
        let out = self.run_timeout(&["pool", "drain"], Duration::from_secs(60));
        if out.code != 0 {
            left.push(format!("pool drain failed: {out}"));
        }
        let names: Vec<String> =
            match self.run_timeout(&["ps", "-a", "--json"], Duration::from_secs(30)) {
                out if out.code == 0 => match serde_json::from_str::<Value>(&out.stdout) {
                    Ok(Value::Array(rows)) => {
                        for r in &rows {
                            self.remember(r);
                        }
                        rows.iter()
                            .filter_map(|r| r["name"].as_str().map(String::from))
                            .collect()
                    }
                    _ => {
                        left.push(format!("ps -a --json printed no JSON array: {out}"));
                        vec![]
                    }
                },
                out => {
                    left.push(format!("ps -a --json failed: {out}"));
                    vec![]
                }
            };
        if !names.is_empty() {
            let mut args = vec!["rm", "-f"];
            args.extend(names.iter().map(String::as_str));
            let out = self.run_timeout(&args, Duration::from_secs(60));
            if out.code != 0 {
                left.push(format!("rm -f of the remaining boxes failed: {out}"));
            }
        }
        let out = self.run_timeout(&["gc"], Duration::from_secs(60));
        if out.code != 0 {
            left.push(format!("gc failed: {out}"));
        }
        left.extend(self.remove_network());
        let procs: Vec<ProcId> = self.procs.lock().unwrap().iter().copied().collect();
        let gone = wait_until(Duration::from_secs(10), || {
            self.all_cgroup_dirs().is_empty() && procs.iter().all(|p| !p.alive())
        });
        if !gone {
            for d in self.all_cgroup_dirs() {
                left.push(format!("cgroup {}", d.display()));
            }
            for p in procs.iter().filter(|p| p.alive()) {
                left.push(format!("process {} still runs", p.pid));
            }
        }
        for e in self.all_state_entries() {
            left.push(format!("state {}", e.display()));
        }
        if let Some(dir) = self.dir.take() {
            if let Err(e) = dir.close() {
                left.push(format!(
                    "cannot delete the test root {}: {e}",
                    self.path.display()
                ));
            }
        }
        left
    }
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        let left = self.clean_up();
        if !left.is_empty() {
            let msg = format!(
                "{}: nestbox left things behind:\n  {}",
                self.test,
                left.join("\n  ")
            );
            if std::thread::panicking() {
                eprintln!("{msg}");
            } else {
                panic!("{msg}");
            }
        }
    }
}

/// Wait for a started nestbox process, bounded by `limit` (killed after it), feeding
/// `input` to its stdin if given.
/// `nestbox run OPTS -- sh -c …` in the foreground, whose command traps
/// SIGTERM to exit 9: once it runs, SIGTERM is sent to `nestbox run`; its
/// outcome (the command's status when the signal was passed on).
pub fn sigterm_to_a_foreground_run(root: &TestRoot, opts: &[&str]) -> Out {
    use std::io::BufRead;
    let mut args = vec!["run"];
    args.extend_from_slice(opts);
    args.extend([
        "--",
        "sh",
        "-c",
        "trap 'exit 9' TERM; echo ready; while :; do sleep 0.1; done",
    ]);
    let mut child = root.spawn(&args);
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    assert_eq!(line, "ready\n");
    // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    finish(
        child,
        None,
        Duration::from_secs(20),
        format!("nestbox run {} (sent SIGTERM)", opts.join(" ")),
    )
}

pub fn finish(mut child: Child, input: Option<&[u8]>, limit: Duration, what: String) -> Out {
    if let Some(data) = input {
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = stdin.write_all(&data);
        });
    }
    let out_rx = reader(child.stdout.take());
    let err_rx = reader(child.stderr.take());
    let end = Instant::now() + limit;
    let status = loop {
        match child.try_wait().expect("wait for nestbox") {
            Some(st) => break Some(st),
            None if Instant::now() >= end => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    // The pipes close when the process exits, unless something it started kept them.
    let stdout = out_rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| "<stdout still open>".into());
    let stderr = err_rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| "<stderr still open>".into());
    let Some(status) = status else {
        panic!("timed out after {limit:?}: {what}\nstdout so far: {stdout:?}\nstderr so far: {stderr:?}");
    };
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    Out {
        stdout,
        stderr,
        code,
        what,
    }
}

fn reader(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        let _ = tx.send(String::from_utf8_lossy(&buf).into_owned());
    });
    rx
}

/// A connection to `nestbox serve`'s socket: one JSON request per line, one
/// JSON answer per line.
pub struct ApiClient {
    reader: std::io::BufReader<std::os::unix::net::UnixStream>,
    writer: std::os::unix::net::UnixStream,
}

impl ApiClient {
    /// Connect to the server at `socket`.
    #[track_caller]
    pub fn connect(socket: &Path) -> Self {
        let stream = std::os::unix::net::UnixStream::connect(socket).expect("connect to serve");
        let reader = std::io::BufReader::new(stream.try_clone().expect("clone the stream"));
        ApiClient {
            reader,
            writer: stream,
        }
    }

    /// Send request `req` (one JSON object) and read its answer.
    #[track_caller]
    pub fn call(&mut self, req: &str) -> Value {
        use std::io::{BufRead, Write};
        self.writer
            .write_all(format!("{req}\n").as_bytes())
            .expect("send a request");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read an answer");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("answer is not JSON ({e}): {line}"))
    }
}

/// GET `path` from port 8080 on the loopback of box `name`, by a Python client
/// exec'd into the box: the answer's body, whitespace-separated fields.
pub fn box_http_get(root: &TestRoot, name: &str, path: &str) -> Vec<String> {
    let code = "import sys, urllib.request; \
                print(urllib.request.urlopen('http://127.0.0.1:8080' + sys.argv[1], timeout=10).read().decode().strip())";
    let out = root
        .run(&["exec", name, "--", "python3", "-c", code, path])
        .ok();
    out.stdout.split_whitespace().map(str::to_string).collect()
}

/// GET `path` from `addr` over HTTP/1.0 from the host; the body, or `None`
/// on any failure (refused, reset, timed out, cut, not 200).
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut reply = String::new();
    s.read_to_string(&mut reply).ok()?;
    let (head, body) = reply.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200").then(|| body.to_string())
}

/// Host pid of the process of template `name` (`template ls`).
pub fn template_pid(root: &TestRoot, name: &str) -> i32 {
    let list: Value = serde_json::from_str(&root.ok(&["template", "ls", "--json"])).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("template {name} listed: {list}"))["pid"]
        .as_i64()
        .unwrap() as i32
}

/// The worker process of a `checkpoint` or `migrate` command (its only
/// child: the command runs its work in a process group of its own).
pub fn worker_of(command: u32) -> Option<i32> {
    let mut worker = None;
    wait_until(Duration::from_secs(5), || {
        worker = std::fs::read_to_string(format!("/proc/{command}/task/{command}/children"))
            .ok()
            .and_then(|t| t.split_whitespace().next().and_then(|p| p.parse().ok()));
        worker.is_some()
    });
    worker
}
