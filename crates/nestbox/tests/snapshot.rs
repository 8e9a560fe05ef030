//! The time-travel disk through the CLI: `snapshot`, `diff`, `rollback`,
//! `snapshot ls|rm`, with whiteouts and opaque directories, incremental
//! storage of changed files only, bad input, a snapshot killed midway, and
//! removal plus `store gc` leaving nothing.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::{assert_error, TestRoot};
use serde_json::Value;

const BUSYBOX: &str = "/bin/busybox";
const APPLETS: &[&str] = &[
    "sh", "cat", "ls", "echo", "sleep", "mkdir", "rm", "head", "chmod", "seq", "true",
];

fn busybox_present(test: &str) -> bool {
    nestbox_testkit::require(
        Path::new(BUSYBOX).is_file(),
        test,
        &format!("{BUSYBOX} missing (scripts/setup.sh installs busybox-static)"),
    )
}

/// A test root with the busybox image `bb` imported (see [`import_image`]);
/// `None` where the test cannot run (a failure under CI).
fn busybox_root(test: &str) -> Option<TestRoot> {
    let root = TestRoot::new(test)?;
    if !busybox_present(test) {
        return None;
    }
    import_image(&root);
    Some(root)
}

/// Start box `name` of the `bb` image, without a network, sleeping, with
/// `opts` besides.
fn run_sleeping(root: &TestRoot, name: &str, opts: &[&str]) {
    let mut args = vec!["run", "-d", "--name", name, "--network", "none"];
    args.extend_from_slice(opts);
    args.extend(["--image", "bb", "--", "sleep", "100000"]);
    root.ok(&args);
}

/// Import a busybox image `bb` with /etc/hello, /etc/keep and a directory
/// /etc/d holding one and sub/deep.
fn import_image(root: &TestRoot) {
    let src = tempfile::tempdir().unwrap();
    let dir = src.path();
    for d in ["bin", "etc/d/sub", "tmp"] {
        fs::create_dir_all(dir.join(d)).unwrap();
    }
    fs::set_permissions(dir.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy(BUSYBOX, dir.join("bin/busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    fs::write(dir.join("etc/hello"), "hello\n").unwrap();
    fs::write(dir.join("etc/keep"), "keep\n").unwrap();
    fs::write(dir.join("etc/d/one"), "one\n").unwrap();
    fs::write(dir.join("etc/d/sub/deep"), "deep\n").unwrap();
    root.ok(&[
        "image",
        "import",
        "-q",
        dir.to_str().unwrap(),
        "--name",
        "bb",
    ]);
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The lines of `nestbox diff ARGS`, sorted.
fn diff(root: &TestRoot, args: &[&str]) -> Vec<String> {
    let mut a = vec!["diff"];
    a.extend_from_slice(args);
    root.ok(&a).lines().map(str::to_string).collect()
}

/// What the box sees of the files the test touches: every name in the
/// directories and the content of every regular file in them.
const VIEW: &str = r#"for d in /etc /etc/d /etc/d/sub /data; do
  echo "[$d]"
  ls -A "$d" 2>/dev/null | while read f; do
    case "$f" in machine-id|hosts|resolv.conf|hostname) continue;; esac
    if [ -f "$d/$f" ]; then echo "$f=$(cat "$d/$f")"; else echo "$f/"; fi
  done
done"#;

fn view(root: &TestRoot, name: &str) -> String {
    root.ok(&["exec", name, "--", "sh", "-c", VIEW])
}

fn objects(root: &TestRoot) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let base = root.path().join("lib/images/store/objects");
    let Ok(dirs) = fs::read_dir(&base) else {
        return out;
    };
    for d in dirs.flatten() {
        for f in fs::read_dir(d.path()).unwrap().flatten() {
            out.insert(f.file_name().to_string_lossy().to_string());
        }
    }
    out
}

fn init_pid(root: &TestRoot, name: &str) -> i64 {
    root.inspect(name)["state"]["init"]["pid"]
        .as_i64()
        .unwrap_or(-1)
}

#[test]
fn snapshot_diff_rollback_round_trip() {
    let test = "snapshot_diff_rollback_round_trip";
    let Some(root) = busybox_root(test) else {
        return;
    };
    run_sleeping(&root, "tt", &[]);
    // Add, modify, delete a lower file (a whiteout), replace a lower
    // directory (an opaque one), and a new directory.
    root.ok(&[
        "exec",
        "tt",
        "--",
        "sh",
        "-c",
        "echo new > /etc/new; echo changed > /etc/keep; rm /etc/hello; \
         rm -r /etc/d; mkdir /etc/d; echo two > /etc/d/two; \
         mkdir /data; echo f1 > /data/f1; echo f2 > /data/f2",
    ]);
    let from_image = diff(&root, &["tt"]);
    assert_eq!(
        from_image,
        [
            "A /data",
            "A /data/f1",
            "A /data/f2",
            "C /etc",
            "C /etc/d",
            "D /etc/d/one",
            "D /etc/d/sub",
            "A /etc/d/two",
            "D /etc/hello",
            "C /etc/keep",
            "A /etc/new",
        ],
        "diff against the image"
    );
    let at_s1 = view(&root, "tt");
    assert!(
        at_s1.contains("new=new") && !at_s1.contains("hello=") && at_s1.contains("two=two"),
        "{at_s1}"
    );

    let s1 = json(&root.ok(&["snapshot", "--json", "tt", "s1"]));
    assert_eq!(s1["name"], "s1");
    assert_eq!(s1["parent"], Value::Null);

    // A snapshot right after reads nothing and stores nothing.
    let same = json(&root.ok(&["snapshot", "--json", "tt", "same"]));
    assert_eq!(same["files_read"], 0, "{same}");
    assert_eq!(same["new_objects"], 0, "{same}");
    assert_eq!(same["files"], s1["files"], "{same}");
    assert!(diff(&root, &["tt", "s1"]).is_empty());

    // More changes after s1.
    root.ok(&[
        "exec",
        "tt",
        "--",
        "sh",
        "-c",
        "echo again > /etc/new; rm /data/f1; echo later > /etc/later; rm -r /etc/d; echo back > /etc/hello",
    ]);
    assert_eq!(
        diff(&root, &["tt", "s1"]),
        [
            "C /data",
            "D /data/f1",
            "C /etc",
            "D /etc/d",
            "A /etc/hello",
            "A /etc/later",
            "C /etc/new",
        ],
        "diff against s1"
    );
    let s2 = json(&root.ok(&["snapshot", "--json", "tt", "s2"]));
    assert_eq!(s2["parent"], "same");
    // Only the files written since: /etc/new, /etc/later, /etc/hello.
    assert_eq!(s2["files_read"], 3, "{s2}");
    let at_s2 = view(&root, "tt");

    // Roll back to s1: the box is restarted and sees exactly s1's files.
    let pid_before = init_pid(&root, "tt");
    let rb = json(&root.ok(&["rollback", "--json", "tt", "s1"]));
    assert_eq!(rb["restarted"], true, "{rb}");
    assert_eq!(root.status("tt").as_deref(), Some("running"));
    assert_ne!(init_pid(&root, "tt"), pid_before, "a new init");
    assert_eq!(view(&root, "tt"), at_s1);
    assert!(diff(&root, &["tt", "s1"]).is_empty());
    assert_eq!(diff(&root, &["tt"]), from_image);

    // A rolled-back box commits as the files it sees, and is checkpointed
    // with them (the snapshot's layer carried under its own: see also
    // `a_rolled_back_box_is_checkpointed_moved_and_cloned_with_its_snapshot_files`).
    root.ok(&["commit", "tt", "img2"]);
    root.ok(&[
        "run",
        "-d",
        "--name",
        "c2",
        "--network",
        "none",
        "--image",
        "img2",
        "--",
        "sleep",
        "100000",
    ]);
    assert_eq!(view(&root, "c2"), at_s1);
    root.ok(&["rm", "-f", "c2"]);
    root.ok(&["image", "rm", "img2"]);
    root.ok(&["checkpoint", "tt", "--as", "tt-ck", "--leave-running"]);
    root.ok(&["restore", "tt-ck", "--name", "c3"]);
    assert_eq!(view(&root, "c3"), at_s1);
    root.ok(&["rm", "-f", "c3"]);
    root.ok(&["checkpoint", "rm", "tt-ck"]);
    assert_eq!(root.status("tt").as_deref(), Some("running"));

    // Changes after a rollback stack on the snapshot's layer; a snapshot of
    // them stores only what is new: 64 KiB of new content, one object.
    let before = objects(&root);
    root.ok(&[
        "exec",
        "tt",
        "--",
        "sh",
        "-c",
        "head -c 65536 /bin/busybox > /data/big; rm /data/f2; echo third > /etc/d/three",
    ]);
    assert_eq!(
        diff(&root, &["tt", "s1"]),
        [
            "C /data",
            "A /data/big",
            "D /data/f2",
            "C /etc/d",
            "A /etc/d/three",
        ]
    );
    let s3 = json(&root.ok(&["snapshot", "--json", "tt", "s3"]));
    assert_eq!(s3["new_bytes"], 65536 + 6, "{s3}");
    assert_eq!(s3["new_objects"], 2, "{s3}");
    assert_eq!(objects(&root).difference(&before).count(), 2);
    let at_s3 = view(&root, "tt");

    // Rolling forward to s2 (taken before the rollback), then back to s3.
    root.ok(&["rollback", "tt", "s2"]);
    assert_eq!(view(&root, "tt"), at_s2);
    root.ok(&["rollback", "tt", "s3"]);
    assert_eq!(view(&root, "tt"), at_s3);

    // A stopped box is rolled back without being started.
    root.ok(&["stop", "-t", "1", "tt"]);
    root.ok(&["rollback", "tt", "s1"]);
    assert_eq!(root.status("tt").as_deref(), Some("exited"));
    assert!(diff(&root, &["tt", "s1"]).is_empty());

    let ls = json(&root.ok(&["snapshot", "ls", "--json", "tt"]));
    let names: Vec<&str> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["s1", "same", "s2", "s3"]);
    let df = json(&root.ok(&["store", "df", "--json"]));
    assert_eq!(df["snapshots"]["count"], 4, "{df}");

    // Removing snapshots: gc keeps what the others (and the rollback layer)
    // still name; nothing is lost.
    root.ok(&["snapshot", "rm", "tt", "same", "s2", "s3"]);
    root.ok(&["store", "gc"]);
    root.ok(&["rollback", "tt", "s1"]);
    root.ok(&["store", "verify"]);

    // Removing the box takes its snapshots; gc then leaves only the image.
    let image_only = {
        let r = TestRoot::new(test).unwrap();
        import_image(&r);
        objects(&r).len()
    };
    root.ok(&["rm", "-f", "tt"]);
    root.ok(&["store", "gc"]);
    assert!(root.ok(&["snapshot", "ls"]).lines().count() <= 1);
    assert_eq!(objects(&root).len(), image_only);
    root.ok(&["image", "rm", "bb"]);
    root.ok(&["store", "gc"]);
    assert!(objects(&root).is_empty(), "{:?}", objects(&root));
    root.assert_no_boxes();
}

#[test]
fn bad_input_is_one_line_and_changes_nothing() {
    let test = "bad_input_is_one_line_and_changes_nothing";
    let Some(root) = busybox_root(test) else {
        return;
    };
    for name in ["a", "b"] {
        run_sleeping(&root, name, &[]);
    }
    root.ok(&["exec", "a", "--", "sh", "-c", "echo x > /etc/x"]);
    root.ok(&["snapshot", "a", "sa"]);
    root.ok(&["snapshot", "b", "sb"]);
    let listing = root.ok(&["snapshot", "ls"]);
    let objs = objects(&root);

    assert_error(
        &root.run(&["snapshot", "nope"]),
        125,
        "no box named \"nope\"",
    );
    assert_error(
        &root.run(&["snapshot", "a", "sa"]),
        125,
        "box \"a\" already has a snapshot named \"sa\"",
    );
    assert_error(
        &root.run(&["snapshot", "a", "../x"]),
        125,
        "invalid snapshot name",
    );
    assert_error(
        &root.run(&["rollback", "a", "missing"]),
        125,
        "box \"a\" has no snapshot named \"missing\"",
    );
    assert_error(
        &root.run(&["rollback", "a", "sb"]),
        125,
        "snapshot \"sb\" is of box \"b\", not of box \"a\"",
    );
    assert_error(&root.run(&["rollback", "nope", "sa"]), 125, "no box named");
    assert_error(
        &root.run(&["diff", "a", "missing"]),
        125,
        "has no snapshot named",
    );
    assert_error(
        &root.run(&["snapshot", "rm", "a", "sb"]),
        125,
        "is of box \"b\"",
    );
    assert_eq!(root.ok(&["snapshot", "ls"]), listing);
    assert_eq!(objects(&root), objs);
    // The box was not touched by the failed rollbacks.
    assert_eq!(root.status("a").as_deref(), Some("running"));
    assert_eq!(diff(&root, &["a"]), ["C /etc", "A /etc/x"]);

    // A running --rm box would be removed by the stop of a rollback.
    run_sleeping(&root, "r", &["--rm"]);
    root.ok(&["snapshot", "r", "sr"]);
    assert_error(
        &root.run(&["rollback", "r", "sr"]),
        125,
        "was started with --rm",
    );
    assert_eq!(root.status("r").as_deref(), Some("running"));
    root.ok(&["snapshot", "rm", "r", "sr"]);
    // A --rm box removes itself once killed.
    root.ok(&["kill", "r"]);
    common::wait_for("box r to go", Duration::from_secs(10), || {
        !root.names().iter().any(|n| n == "r")
    });
    root.rm_all(["a", "b"]);
}

#[test]
fn a_killed_snapshot_leaves_a_whole_one_or_none() {
    let test = "a_killed_snapshot_leaves_a_whole_one_or_none";
    let Some(root) = busybox_root(test) else {
        return;
    };
    run_sleeping(&root, "k", &[]);
    root.ok(&[
        "exec",
        "k",
        "--",
        "sh",
        "-c",
        "mkdir /many; for i in $(seq 1 3000); do echo $i > /many/f$i; done",
    ]);
    let mut listed: Vec<Value> = Vec::new();
    let delays = [2u64, 5, 10, 20, 40, 80, 300, 1000, 3000];
    for (i, delay_ms) in delays.iter().enumerate() {
        let name = format!("k{i}");
        let mut child = root.spawn(&["snapshot", "k", &name]);
        std::thread::sleep(Duration::from_millis(*delay_ms));
        // Our own child, by its pid (ESRCH only if it already ended).
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = child.wait();
        let ls = json(&root.ok(&["snapshot", "ls", "--json", "k"]));
        if let Some(s) = ls.as_array().unwrap().iter().find(|s| s["name"] == name) {
            // It can be used.
            assert!(diff(&root, &["k", &name]).is_empty());
            listed.push(s.clone());
        }
    }
    // The name of a killed snapshot is free again; a full one lists every
    // file (the 3000 and the runtime's /etc/machine-id mount point).
    let last = json(&root.ok(&["snapshot", "--json", "k", "final"]));
    assert_eq!(last["files"], 3001, "{last}");
    for s in &listed {
        assert_eq!(s["files"], last["files"], "a listed snapshot is whole: {s}");
    }
    root.ok(&["store", "verify"]);
    // What the killed ones staged goes at gc.
    root.ok(&["store", "gc"]);
    let staging: Vec<_> = fs::read_dir(root.path().join("lib/images/store/tmp"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(staging.is_empty(), "staging left: {staging:?}");
    eprintln!(
        "{test}: {} of {} killed snapshots had finished",
        listed.len(),
        delays.len()
    );
    root.rm_all(["k"]);
    root.ok(&["image", "rm", "bb"]);
    root.ok(&["store", "gc"]);
    assert!(objects(&root).is_empty());
}

/// The box's data directory.
fn box_dir(root: &TestRoot, name: &str) -> std::path::PathBuf {
    let id = root.inspect(name)["state"]["id"]
        .as_str()
        .expect("a box id")
        .to_string();
    root.path().join("lib/boxes").join(id)
}

/// What a rollback moves aside and removes once the box runs again, as
/// left in the box's data directory.
fn replaced_left(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| {
            n.starts_with(".replaced-")
                || [".upper-old", ".work-old", ".rollback-old", ".rollback-new"]
                    .contains(&n.as_str())
        })
        .collect()
}

/// The mount namespaces (of any process) in which an overlay whose upper
/// directory is `upper` is mounted.
fn namespaces_mounting(upper: &Path) -> BTreeSet<String> {
    let needle = format!("upperdir={}", upper.display());
    let mut out = BTreeSet::new();
    for p in fs::read_dir("/proc").unwrap().flatten() {
        let dir = p.path();
        if !p
            .file_name()
            .to_string_lossy()
            .bytes()
            .all(|b| b.is_ascii_digit())
        {
            continue;
        }
        // A process that ended meanwhile has nothing to read.
        let Ok(info) = fs::read_to_string(dir.join("mountinfo")) else {
            continue;
        };
        if info.contains(&needle) {
            if let Ok(ns) = fs::read_link(dir.join("ns/mnt")) {
                out.insert(ns.to_string_lossy().to_string());
            }
        }
    }
    out
}

/// Whether `done` holds within `limit` (checked every 50 ms): for work a
/// command leaves to a background process, whose end is what is checked.
fn eventually(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + limit;
    while std::time::Instant::now() < end {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

#[test]
fn rollback_of_a_running_box_leaves_nothing_of_its_old_layer() {
    let test = "rollback_of_a_running_box_leaves_nothing_of_its_old_layer";
    let Some(root) = busybox_root(test) else {
        return;
    };
    run_sleeping(&root, "w", &[]);
    root.ok(&[
        "exec",
        "w",
        "--",
        "sh",
        "-c",
        "mkdir /w; for i in $(seq 1 300); do echo $i > /w/f$i; done; echo keep > /w/keep",
    ]);
    root.ok(&["snapshot", "w", "s1"]);
    let listing = "ls /w | wc -l; cat /w/keep /w/f7 /w/f300; ls /w/new 2>&1 || true";
    let at_s1 = root.ok(&["exec", "w", "--", "sh", "-c", listing]);
    // The box changes every file (dirty, unwritten data in its layer when
    // it is stopped), adds one and deletes one.
    root.ok(&[
        "exec",
        "w",
        "--",
        "sh",
        "-c",
        "for i in $(seq 1 300); do echo more >> /w/f$i; done; echo new > /w/new; rm /w/keep",
    ]);
    let dir = box_dir(&root, "w");
    let upper = dir.join("upper-0");
    assert_eq!(namespaces_mounting(&upper).len(), 1, "the box's root, once");
    let pid_before = init_pid(&root, "w");
    let rb = json(&root.ok(&["rollback", "--json", "w", "s1"]));
    assert_eq!(rb["restarted"], true, "{rb}");
    assert_eq!(root.status("w").as_deref(), Some("running"));
    assert_ne!(init_pid(&root, "w"), pid_before, "a new init");
    assert_eq!(root.ok(&["exec", "w", "--", "sh", "-c", listing]), at_s1);
    // The replaced layers and the old root (kept mounted in the old mount
    // namespace while the box stopped) go in a background process: once it
    // is done, nothing of them is left, and only the new root is mounted.
    assert!(
        eventually(Duration::from_secs(30), || replaced_left(&dir).is_empty()
            && namespaces_mounting(&upper).len() == 1),
        "left: {:?}, overlays of the layer mounted in {:?}",
        replaced_left(&dir),
        namespaces_mounting(&upper)
    );
    assert!(diff(&root, &["w", "s1"]).is_empty());

    // Two rollbacks in a row (the first one's removal may still run) and
    // one of the box stopped.
    root.ok(&["exec", "w", "--", "sh", "-c", "echo two > /w/keep"]);
    root.ok(&["snapshot", "w", "s2"]);
    root.ok(&["rollback", "w", "s1"]);
    root.ok(&["rollback", "w", "s2"]);
    assert_eq!(
        root.ok(&["exec", "w", "--", "cat", "/w/keep"]).trim(),
        "two"
    );
    root.ok(&["stop", "-t", "1", "w"]);
    root.ok(&["rollback", "w", "s1"]);
    assert_eq!(root.status("w").as_deref(), Some("exited"));
    assert!(
        eventually(Duration::from_secs(30), || replaced_left(&dir).is_empty()
            && namespaces_mounting(&upper).is_empty()),
        "left: {:?}, overlays of the layer mounted in {:?}",
        replaced_left(&dir),
        namespaces_mounting(&upper)
    );
    assert!(diff(&root, &["w", "s1"]).is_empty());

    // Trash of replaced layers whose remover died goes at the next snapshot
    // operation; trash whose remover lives (holds its lock) is left to it.
    let dead = dir.join(".replaced-1-0");
    fs::create_dir_all(dead.join("upper/d")).unwrap();
    fs::write(dead.join("upper/d/f"), "x").unwrap();
    let live = dir.join(".replaced-2-0");
    fs::create_dir(&live).unwrap();
    let lock = nix::fcntl::Flock::lock(
        fs::File::open(&live).unwrap(),
        nix::fcntl::FlockArg::LockExclusiveNonblock,
    )
    .unwrap();
    diff(&root, &["w"]);
    assert!(!dead.exists(), "dead remover's trash removed");
    assert!(live.exists(), "a live remover's trash left to it");
    drop(lock);
    root.ok(&["snapshot", "w", "s3"]);
    assert!(!live.exists());
    root.rm_all(["w"]);
    root.ok(&["image", "rm", "bb"]);
    root.ok(&["store", "gc"]);
    assert!(objects(&root).is_empty());
}

/// A Python server on port 8080 of the box's address: a request count in
/// memory, each count appended to /srv/log.txt, which it keeps open; the
/// answer is the count and the file's offset.
const COUNTER: &str = r#"
import http.server, os
os.makedirs('/srv', exist_ok=True)
count = 0
log = open('/srv/log.txt', 'a+')
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        log.write(f'{count}\n'); log.flush()
        body = f'{count} {log.tell()}'.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(('0.0.0.0', 8080), H)
print('ready', flush=True)
server.serve_forever()
"#;

/// The box's address, port 8080.
fn counter_address(root: &TestRoot, name: &str) -> std::net::SocketAddr {
    let ip = root.inspect(name)["state"]["network"]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("{name} has no address"))
        .to_string();
    format!("{ip}:8080").parse().unwrap()
}

/// The counter's answer from the host.
fn count(addr: std::net::SocketAddr) -> String {
    common::http_get(addr, "/").unwrap_or_else(|| panic!("no answer from {addr}"))
}

/// `snapshot --checkpoint` records the processes with the files in one
/// freeze; a rollback to it puts both back, whether the box runs or not,
/// as often as asked, on the box's own address; `gc` keeps the pages a
/// snapshot names and frees them once it is removed.
#[test]
fn a_snapshot_with_a_checkpoint_rolls_the_processes_back_too() {
    let test = "a_snapshot_with_a_checkpoint_rolls_the_processes_back_too";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    root.ok(&["run", "-d", "--name", "ctr", "--", "python3", "-c", COUNTER]);
    root.wait_logged("ctr", "ready", Duration::from_secs(30));
    let addr = counter_address(&root, "ctr");
    assert_eq!(count(addr), "1 2");
    assert_eq!(count(addr), "2 4");
    let out = root.ok(&["snapshot", "ctr", "s1", "--checkpoint"]);
    assert!(out.contains("processes checkpointed"), "{out}");
    let listed = json(&root.ok(&["snapshot", "ls", "ctr", "--json"]));
    assert_eq!(listed[0]["processes"], true, "{listed}");
    let processes = box_dir(&root, "ctr").join("snapshots/s1.processes");
    assert!(processes.join("checkpoint.json").is_file());
    // Later: more requests, a new file, the log grown.
    assert_eq!(count(addr), "3 6");
    root.ok(&["exec", "ctr", "--", "sh", "-c", "echo later > /srv/later"]);
    let pid_before = init_pid(&root, "ctr");
    let mac =
        |root: &TestRoot| root.ok(&["exec", "ctr", "--", "cat", "/sys/class/net/eth0/address"]);
    let mac_before = mac(&root);
    let std::net::IpAddr::V4(ip) = addr.ip() else {
        panic!("{addr}")
    };
    let [a, b, c, d] = ip.octets();
    assert_eq!(
        mac_before.trim(),
        format!("06:00:{a:02x}:{b:02x}:{c:02x}:{d:02x}"),
        "the box's MAC is its address's"
    );

    let report = json(&root.ok(&["rollback", "ctr", "s1", "--json"]));
    assert_eq!(report["processes"], true, "{report}");
    assert_eq!(report["restarted"], true, "{report}");
    assert_ne!(init_pid(&root, "ctr"), pid_before, "a new box around them");
    assert_eq!(
        counter_address(&root, "ctr"),
        addr,
        "the box keeps its address"
    );
    assert_eq!(
        mac(&root),
        mac_before,
        "and its MAC: neighbours' entries stay right"
    );
    // The count goes on from the snapshot's 2, the open log file at its
    // offset then, with the snapshot's contents.
    assert_eq!(count(addr), "3 6");
    let files = root.ok(&["exec", "ctr", "--", "sh", "-c", "cat /srv/log.txt; ls /srv"]);
    assert_eq!(files, "1\n2\n3\nlog.txt\n");

    // Again from the same snapshot, and into a box that had stopped.
    assert_eq!(count(addr), "4 8");
    root.ok(&["rollback", "ctr", "s1"]);
    assert_eq!(count(addr), "3 6");
    root.ok(&["stop", "ctr"]);
    assert_eq!(root.status("ctr").as_deref(), Some("exited"));
    let out = root.ok(&["rollback", "ctr", "s1"]);
    assert!(out.contains("its processes put back"), "{out}");
    assert_eq!(root.status("ctr").as_deref(), Some("running"));
    assert_eq!(count(addr), "3 6");

    // gc keeps what the snapshot names; its removal frees it.
    root.ok(&["gc"]);
    root.ok(&["rollback", "ctr", "s1"]);
    assert_eq!(count(addr), "3 6");
    let pages = |root: &TestRoot| {
        let df = root.ok(&["store", "df"]);
        df.lines()
            .find(|l| l.starts_with("checkpoint pages:"))
            .map(str::to_string)
            .unwrap_or_default()
    };
    assert!(
        !pages(&root).starts_with("checkpoint pages: 0 "),
        "{}",
        pages(&root)
    );
    root.ok(&["snapshot", "rm", "ctr", "s1"]);
    assert!(
        !processes.exists(),
        "the snapshot's checkpoint went with it"
    );
    root.ok(&["gc"]);
    assert!(
        pages(&root).starts_with("checkpoint pages: 0 "),
        "{}",
        pages(&root)
    );
    // The box runs on, its processes its own now.
    assert_eq!(count(addr), "4 8");
    root.ok(&["rm", "-f", "ctr"]);
    root.assert_no_boxes();
}

/// `snapshot --checkpoint` of what a rollback could not put back is one
/// line and leaves no snapshot; a checkpoint left without its snapshot
/// record (a snapshot killed after it) is removed by the next snapshot.
#[test]
fn a_snapshot_with_a_checkpoint_refuses_what_it_cannot_put_back() {
    let test = "a_snapshot_with_a_checkpoint_refuses_what_it_cannot_put_back";
    let Some(root) = busybox_root(test) else {
        return;
    };
    run_sleeping(&root, "sl", &[]);
    root.ok(&["stop", "-t", "0", "sl"]);
    let out = root.run(&["snapshot", "sl", "s", "--checkpoint"]);
    assert_error(&out, 125, "is not running");
    root.ok(&[
        "run",
        "-d",
        "--name",
        "t",
        "--network",
        "none",
        "--image",
        "bb",
        "--",
        "sleep",
        "100000",
    ]);
    root.ok(&["freeze", "t", "--as", "tpl"]);
    let out = root.run(&["snapshot", "t", "s", "--checkpoint"]);
    assert_error(&out, 125, "is a template");
    root.ok(&["clone", "tpl", "--name", "c", "-d"]);
    let out = root.run(&["snapshot", "c", "s", "--checkpoint"]);
    assert_error(&out, 125, "is a clone or a restored box");
    for b in ["sl", "t", "c"] {
        assert!(
            root.ok(&["snapshot", "ls", b]).lines().count() == 1,
            "no snapshot of {b}"
        );
    }
    let orphan = box_dir(&root, "sl").join("snapshots/gone.processes");
    fs::create_dir_all(&orphan).unwrap();
    root.ok(&["snapshot", "sl", "s"]);
    assert!(
        !orphan.exists(),
        "a checkpoint without its snapshot is removed"
    );
    root.ok(&["rm", "-f", "c", "t", "sl"]);
    root.assert_no_boxes();
}

/// `snapshot --checkpoint` killed (SIGKILL) at any point: after `gc` the box
/// runs (thawed, its processes let go), no staging is left, a snapshot is
/// listed whole (with its processes, and a rollback to it works) or not at
/// all, and a checkpoint left without its record goes at the next snapshot.
#[test]
fn a_killed_snapshot_with_a_checkpoint_leaves_the_box_running_and_nothing_half_made() {
    let test = "a_killed_snapshot_with_a_checkpoint_leaves_the_box_running_and_nothing_half_made";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    // 64 MiB of memory of its own makes the checkpoint long enough to be
    // killed in each of its parts.
    let server = COUNTER.replace("count = 0", "count = 0\nblob = os.urandom(64 << 20)");
    root.ok(&[
        "run",
        "-d",
        "--name",
        "kc",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        &server,
    ]);
    root.wait_logged("kc", "ready", Duration::from_secs(30));
    let answers = |root: &TestRoot| common::box_http_get(root, "kc", "/").len() == 2;
    assert!(answers(&root));
    let delays = [5u64, 20, 50, 100, 200, 400, 800, 3000];
    let mut listed = Vec::new();
    for (i, delay_ms) in delays.iter().enumerate() {
        let name = format!("k{i}");
        let mut child = root.spawn(&["snapshot", "kc", &name, "--checkpoint"]);
        std::thread::sleep(Duration::from_millis(*delay_ms));
        // Our own child, by its pid (ESRCH only if it already ended).
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = child.wait();
        root.ok(&["gc"]);
        assert!(
            answers(&root),
            "the box answers after snapshot {name} was killed"
        );
        let ls = json(&root.ok(&["snapshot", "ls", "--json", "kc"]));
        if let Some(s) = ls.as_array().unwrap().iter().find(|s| s["name"] == name) {
            assert_eq!(s["processes"], true, "{s}");
            listed.push(name);
        }
    }
    let staging: Vec<_> = fs::read_dir(root.path().join("lib/checkpoints"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(staging.is_empty(), "checkpoint staging left: {staging:?}");
    root.ok(&["diff", "kc"]);
    let snapshots = box_dir(&root, "kc").join("snapshots");
    for e in fs::read_dir(&snapshots).unwrap().flatten() {
        let file = e.file_name().to_string_lossy().to_string();
        if let Some(name) = file.strip_suffix(".processes") {
            assert!(
                listed.iter().any(|l| l == name),
                "{file} without its snapshot"
            );
        }
    }
    eprintln!(
        "{test}: {} of {} killed snapshots had finished",
        listed.len(),
        delays.len()
    );
    if let Some(last) = listed.last() {
        root.ok(&["rollback", "kc", last]);
        assert!(answers(&root), "the box answers after a rollback to {last}");
    }
    root.ok(&["rm", "-f", "kc"]);
    root.ok(&["gc"]);
    root.assert_no_boxes();
}

/// A box rolled back to a snapshot has part of its files in the snapshot's
/// layer: a checkpoint (local and self-contained, restored in another root)
/// and a freeze carry that layer, so restored boxes and clones see the
/// snapshot's files under what the box wrote since.
#[test]
fn a_rolled_back_box_is_checkpointed_moved_and_cloned_with_its_snapshot_files() {
    let test = "a_rolled_back_box_is_checkpointed_moved_and_cloned_with_its_snapshot_files";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    let Some(other) = TestRoot::new(&format!("{test}-there")) else {
        return;
    };
    root.ok(&[
        "run",
        "-d",
        "--name",
        "rb",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        COUNTER,
    ]);
    root.wait_logged("rb", "ready", Duration::from_secs(30));
    let get = |root: &TestRoot, name: &str| common::box_http_get(root, name, "/").join(" ");
    assert_eq!(get(&root, "rb"), "1 2");
    root.ok(&["exec", "rb", "--", "sh", "-c", "echo A > /srv/a"]);
    root.ok(&["snapshot", "rb", "s1", "--checkpoint"]);
    root.ok(&["exec", "rb", "--", "sh", "-c", "rm /srv/a; echo B > /srv/b"]);
    root.ok(&["rollback", "rb", "s1"]);
    // Written after the rollback: in the box's own (upper) layer.
    root.ok(&["exec", "rb", "--", "sh", "-c", "echo C > /srv/c"]);
    assert_eq!(get(&root, "rb"), "2 4");
    let files = "cat /srv/log.txt; ls /srv; cat /srv/a /srv/c";
    let expected = "1\n2\nlog.txt\na\nc\nA\nC\n";
    // `ls` order aside: the log, the names, then the contents.
    let sorted = |s: &str| {
        let mut lines: Vec<&str> = s.lines().collect();
        lines[2..5].sort();
        lines.join("\n") + "\n"
    };
    let seen =
        |root: &TestRoot, name: &str| sorted(&root.ok(&["exec", name, "--", "sh", "-c", files]));
    assert_eq!(seen(&root, "rb"), sorted(expected));

    root.ok(&["checkpoint", "rb", "--as", "ck", "--leave-running"]);
    root.ok(&["restore", "ck", "--name", "r1"]);
    assert_eq!(seen(&root, "r1"), sorted(expected));
    assert_eq!(get(&root, "r1"), "3 6");

    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ck");
    root.ok(&[
        "checkpoint",
        "rb",
        "-o",
        out.to_str().unwrap(),
        "--leave-running",
    ]);
    other.ok(&["restore", out.to_str().unwrap(), "--name", "far"]);
    assert_eq!(seen(&other, "far"), sorted(expected));
    assert_eq!(get(&other, "far"), "3 6");

    root.ok(&["freeze", "rb", "--as", "tpl"]);
    root.ok(&["clone", "tpl", "--name", "c1", "-d"]);
    assert_eq!(seen(&root, "c1"), sorted(expected));
    assert_eq!(get(&root, "c1"), "3 6");

    other.ok(&["rm", "-f", "far"]);
    other.assert_no_boxes();
    root.ok(&["rm", "-f", "c1", "r1", "rb"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    root.assert_no_boxes();
}
