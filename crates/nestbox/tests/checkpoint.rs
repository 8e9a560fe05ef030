//! Checkpoint and restore, seen from outside: real servers (Node.js, Go,
//! Java, a Python thread pool) counting requests in memory are checkpointed,
//! their boxes removed, and restored, possibly many times: every restored box
//! answers with the count continued and its threads running, on its own.
//! Plus: pages stored once across checkpoints, a corrupt page file refused
//! before anything runs, bad input in one line, and a checkpoint killed
//! midway neither listed nor left behind.

mod common;

use std::path::Path;
use std::time::Duration;

use common::apps::*;
use common::*;
use serde_json::Value;

/// Host pid of box `name`'s main process (the only child of its init).
fn main_pid(name: &str, root: &TestRoot) -> i32 {
    let v = root.inspect(name);
    let init = v["state"]["init"]["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("init of {name}: {v}"));
    let children =
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).expect("children");
    children
        .split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("{name}'s init has no child"))
        .parse()
        .unwrap()
}

fn threads_in(name: &str, root: &TestRoot) -> usize {
    threads_of(main_pid(name, root))
}

/// Start `app` as box `srv`, count 3 requests, checkpoint it as `ck` (the box
/// stops), remove the box, restore it twice: each restored box continues
/// from 3 with the app's threads, and counts on its own.
fn checkpoint_then_restore(root: &TestRoot, app: &App) {
    let volume = app.volume();
    let mut args = vec!["run", "-d", "--name", "srv", "-v", &volume, "--"];
    args.extend(app.cmd.iter().map(String::as_str));
    root.ok(&args);
    root.wait_logged("srv", "ready", Duration::from_secs(60));
    for i in 1..=3 {
        assert_eq!(get(root, "srv"), (i, "srv".to_string()));
    }
    let threads = threads_in("srv", root);
    assert!(threads >= app.min_threads, "{threads} threads");
    let out = root.ok(&["checkpoint", "srv", "--as", "ck", "--json"]);
    let summary: Value = serde_json::from_str(&out).expect("checkpoint --json");
    assert_eq!(
        summary["processes"][0]["threads"].as_u64(),
        Some(threads as u64)
    );
    assert_ne!(
        root.status("srv").as_deref(),
        Some("running"),
        "stopped once saved"
    );
    root.ok(&["rm", "srv"]);
    for r in ["r1", "r2"] {
        root.ok(&["restore", "ck", "--name", r]);
        // The process keeps its box's hostname (it may have it cached).
        assert_eq!(get(root, r), (4, "srv".to_string()), "{r} continues");
        assert_eq!(threads_in(r, root), threads, "{r} runs with its threads");
    }
    assert_eq!(get(root, "r1").0, 5);
    assert_eq!(get(root, "r1").0, 6);
    assert_eq!(get(root, "r2").0, 5);
    // The checkpoint is in use by the restored boxes' roots.
    let out = root.run(&["checkpoint", "rm", "ck"]);
    assert_error(&out, 125, "in use");
    root.ok(&["rm", "-f", "r1", "r2"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    assert_eq!(root.ok(&["checkpoint", "ls", "--json"]).trim(), "[]");
    // Its pages are collected.
    let gc = root.ok(&["gc"]);
    assert!(gc.contains("page pack"), "gc: {gc}");
    let df = root.ok(&["store", "df"]);
    assert!(
        df.contains("checkpoint pages: 0 distinct"),
        "store df: {df}"
    );
}

#[test]
fn node_http_server_is_restored_from_a_checkpoint() {
    let node = Path::new("/usr/bin/node");
    app_test(
        "node_http_server_is_restored_from_a_checkpoint",
        Some(node),
        App::node,
        checkpoint_then_restore,
    );
}

#[test]
fn go_http_server_is_restored_from_a_checkpoint() {
    let go = go_binary();
    app_test(
        "go_http_server_is_restored_from_a_checkpoint",
        Some(&go),
        || go_app(&go),
        checkpoint_then_restore,
    );
}

#[test]
fn java_http_server_is_restored_from_a_checkpoint() {
    let java = Path::new("/usr/bin/java");
    app_test(
        "java_http_server_is_restored_from_a_checkpoint",
        Some(java),
        App::java,
        checkpoint_then_restore,
    );
}

#[test]
fn python_thread_pool_server_is_restored_from_a_checkpoint() {
    app_test(
        "python_thread_pool_server_is_restored_from_a_checkpoint",
        None,
        App::python_pool,
        checkpoint_then_restore,
    );
}

/// A template saved on disk (`freeze --persist`) whose box is removed is
/// started again from there by the next `clone`: the clones continue from
/// the template's state; the checkpoint it runs on cannot be removed
/// meanwhile.
#[test]
fn a_saved_template_is_revived_by_clone_when_its_box_is_gone() {
    let Some(root) = TestRoot::new("a_saved_template_is_revived_by_clone_when_its_box_is_gone")
    else {
        return;
    };
    let _app = started_pool_server(&root);
    for i in 2..=3 {
        assert_eq!(get(&root, "tpl").0, i);
    }
    root.ok(&["freeze", "tpl", "--as", "web", "--persist"]);
    root.ok(&["clone", "web", "-d", "--name", "a"]);
    assert_eq!(get(&root, "a"), (4, "a".to_string()));
    // The live template goes.
    root.ok(&["rm", "-f", "a", "tpl"]);
    assert!(!root.ok(&["template", "ls"]).contains("web"));
    let names = root.ok(&["clone", "web", "-d", "-n", "3", "--name", "c"]);
    assert_eq!(names.lines().count(), 3);
    for n in names.lines() {
        assert_eq!(get(&root, n), (4, n.to_string()), "{n} continues");
        assert_eq!(threads_in(n, &root), 5, "{n} has the template's threads");
    }
    assert!(root.ok(&["template", "ls"]).contains("web"), "revived");
    let out = root.run(&["checkpoint", "rm", "web"]);
    assert_error(&out, 125, "in use");
    root.rm_all(["c-1", "c-2", "c-3", "tpl"]);
    root.ok(&["checkpoint", "rm", "web"]);
    // Nothing to revive from any more.
    let out = root.run(&["clone", "web"]);
    assert_error(&out, 125, "no template named \"web\"");
}

/// Checkpoints of a template while it is being cloned: each waits for the
/// clone under way and the clone for the checkpoint, so all of them succeed
/// and every clone continues the template. Before, a checkpoint seized the
/// template's processes without the template's clone lock, and a clone then
/// failed with "already being traced" (met by the stress suite).
#[test]
fn checkpoints_and_clones_of_one_template_at_once_all_succeed() {
    let Some(root) = TestRoot::new("checkpoints_and_clones_of_one_template_at_once_all_succeed")
    else {
        return;
    };
    let _app = started_pool_server(&root);
    root.ok(&["freeze", "tpl", "--as", "web"]);
    const CLONES: usize = 8;
    const CHECKPOINTS: usize = 4;
    std::thread::scope(|s| {
        let cloner = s.spawn(|| {
            for i in 0..CLONES {
                root.ok(&["clone", "web", "-d", "--name", &format!("c{i}")]);
            }
        });
        for i in 0..CHECKPOINTS {
            root.ok(&["checkpoint", "tpl", "--as", &format!("k{i}")]);
        }
        cloner.join().expect("the clones");
    });
    for i in 0..CLONES {
        let name = format!("c{i}");
        assert_eq!(get(&root, &name), (2, name.clone()), "{name} continues");
    }
    let listed = root.ok(&["checkpoint", "ls"]);
    for i in 0..CHECKPOINTS {
        assert!(listed.contains(&format!("k{i}")), "k{i} in {listed}");
    }
    // The last checkpoint restores the template's state.
    root.ok(&[
        "restore",
        &format!("k{}", CHECKPOINTS - 1),
        "--name",
        "r",
        "-d",
    ]);
    // Its process keeps the template box's hostname, as any restored box.
    assert_eq!(get(&root, "r"), (2, "tpl".to_string()));
    // The template stayed frozen through its checkpoints: it still clones.
    root.ok(&["clone", "web", "-d", "--name", "after"]);
    assert_eq!(get(&root, "after"), (2, "after".to_string()));
    let boxes: Vec<String> = (0..CLONES).map(|i| format!("c{i}")).collect();
    root.rm_all(
        boxes
            .iter()
            .map(String::as_str)
            .chain(["r", "after", "tpl"]),
    );
    for i in 0..CHECKPOINTS {
        root.ok(&["checkpoint", "rm", &format!("k{i}")]);
    }
}

/// A clone (a sandbox of a service) is checkpointed like any box: restored
/// after its template and the clone are removed, it continues from the
/// clone's state, with the files of the template's layer and its own.
#[test]
fn a_clone_is_checkpointed_and_restored_after_its_template_is_gone() {
    let Some(root) =
        TestRoot::new("a_clone_is_checkpointed_and_restored_after_its_template_is_gone")
    else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/")[0], "1");
    root.ok(&["freeze", "st"]);
    root.ok(&["clone", "st", "-d", "--name", "c"]);
    assert_eq!(box_http_get(&root, "c", "/"), ["2", "0", "4", "queued"]);
    root.ok(&["exec", "c", "--", "sh", "-c", "echo mine > /tmp/clone.txt"]);
    root.ok(&["checkpoint", "c", "--as", "ck"]);
    root.ok(&["rm", "-f", "c", "st"]);
    assert!(root.names().is_empty(), "{:?}", root.names());
    root.ok(&["restore", "ck", "--name", "r"]);
    assert_eq!(box_http_get(&root, "r", "/"), ["3", "0", "6", "queued"]);
    let files = root.ok(&["exec", "r", "--", "cat", "/tmp/log.txt", "/tmp/clone.txt"]);
    assert_eq!(files, "1\n2\n3\nmine\n");
    root.ok(&["rm", "-f", "r"]);
    root.ok(&["checkpoint", "rm", "ck"]);
}

/// A prefork server (a master and two workers sharing a listening socket,
/// a report pipe and a counter in shared memory) comes back whole: same
/// pids, parents, session and group; the counter and the pipe continue.
#[test]
fn prefork_server_is_restored_with_its_tree_pipe_and_shared_counter() {
    let Some(root) =
        TestRoot::new("prefork_server_is_restored_with_its_tree_pipe_and_shared_counter")
    else {
        return;
    };
    root.ok(&["run", "-d", "--name", "pf", "--", "python3", "-c", PREFORK]);
    root.wait_logged("pf", "ready", Duration::from_secs(20));
    for i in 1..=4 {
        assert_eq!(box_http_get(&root, "pf", "/")[0], i.to_string());
    }
    let reports = |name: &str| {
        root.run(&["exec", name, "--", "cat", "/tmp/reports"])
            .stdout
    };
    wait_for("4 reports", Duration::from_secs(10), || {
        reports("pf") == "4"
    });
    let out = root.ok(&["checkpoint", "pf", "--as", "ck", "--json"]);
    let summary: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(summary["processes"].as_array().unwrap().len(), 3);
    root.ok(&["rm", "pf"]);
    for r in ["r1", "r2"] {
        root.ok(&["restore", "ck", "--name", r]);
        let tree = root.ok(&[
            "exec",
            r,
            "--",
            "sh",
            "-c",
            "for p in 2 3 4; do cut -d' ' -f1,4,6,5 /proc/$p/stat; done",
        ]);
        // pid, parent, group, session: the master leads, the workers follow.
        assert_eq!(tree, "2 1 2 2\n3 2 2 2\n4 2 2 2\n", "{r}'s processes");
        let first = box_http_get(&root, r, "/");
        assert_eq!(first[0], "5", "{r} continues the shared counter: {first:?}");
        assert_eq!(box_http_get(&root, r, "/")[0], "6");
        wait_for(
            "the master to count the reports",
            Duration::from_secs(10),
            || reports(r) == "6",
        );
    }
    root.ok(&["rm", "-f", "r1", "r2"]);
    root.ok(&["checkpoint", "rm", "ck"]);
}

/// A shell whose background child serves, and a parent holding a pidfd of
/// its child: restored with their trees; the restored shell still waits for
/// its child, the restored pidfd still names the (restored) child.
#[test]
fn a_shell_and_its_child_and_a_pidfd_of_a_child_are_restored() {
    let Some(root) = TestRoot::new("a_shell_and_its_child_and_a_pidfd_of_a_child_are_restored")
    else {
        return;
    };
    root.detached_sh("sh", &[], SHELL);
    root.wait_logged("sh", "ready", Duration::from_secs(20));
    assert_eq!(box_http_get(&root, "sh", "/")[0], "1");
    root.ok(&["checkpoint", "sh", "--as", "shell"]);
    root.ok(&["rm", "sh"]);
    root.ok(&["restore", "shell", "--name", "sh2"]);
    assert_eq!(
        box_http_get(&root, "sh2", "/")[0],
        "2",
        "the child continues"
    );
    root.ok(&["exec", "sh2", "--", "sh", "-c", "kill -TERM 3"]);
    wait_for(
        "the restored shell to see its child end",
        Duration::from_secs(10),
        || root.ok(&["logs", "sh2"]).contains("child ended: 143"),
    );
    root.ok(&["rm", "-f", "sh2"]);
    root.ok(&["checkpoint", "rm", "shell"]);

    root.ok(&[
        "run",
        "-d",
        "--name",
        "pp",
        "--",
        "python3",
        "-c",
        PIDFD_PARENT,
    ]);
    root.wait_logged("pp", "ready", Duration::from_secs(20));
    root.ok(&["checkpoint", "pp", "--as", "pidfd"]);
    root.ok(&["rm", "pp"]);
    for r in ["p1", "p2"] {
        root.ok(&["restore", "pidfd", "--name", r]);
        // The parent kills its child through its pidfd and reaps it.
        assert_eq!(box_http_get(&root, r, "/"), ["-15", "3"], "{r}");
    }
    root.ok(&["rm", "-f", "p1", "p2"]);
    root.ok(&["checkpoint", "rm", "pidfd"]);
}

/// A Python server that also keeps a file open, a pipe to itself with bytes
/// in it, and, on `/grow`, 1 MiB of new random data.
const PYTHON_STATE_SERVER: &str = r#"
import http.server, os
count = 0
blob = []
log = open('/tmp/log.txt', 'a+')
r, w = os.pipe()
os.write(w, b'queued')
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        if self.path == '/grow':
            blob.append(os.urandom(1 << 20))
        count += 1
        log.write(f'{count}\n'); log.flush()
        body = f'{count} {len(blob)} {log.tell()} {os.read(r, 6).decode()}\n'.encode()
        os.write(w, b'queued')
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(('127.0.0.1', 8080), H)
print('ready', flush=True)
server.serve_forever()
"#;

fn start_state_server(root: &TestRoot) -> App {
    let app = App::new(
        &[("server.py", PYTHON_STATE_SERVER)],
        &["python3", "/app/server.py"],
        1,
    );
    let volume = app.volume();
    root.ok(&[
        "run",
        "-d",
        "--name",
        "st",
        "-v",
        &volume,
        "--",
        "python3",
        "/app/server.py",
    ]);
    root.wait_logged("st", "ready", Duration::from_secs(30));
    app
}

fn checkpoint_stats(root: &TestRoot, args: &[&str]) -> Value {
    let out = root.ok(args);
    let v: Value = serde_json::from_str(&out).expect("checkpoint --json");
    v["stats"].clone()
}

/// Files (open, with their offsets), the writable root layer and bytes
/// buffered in a pipe come back; a second checkpoint of a box that changed
/// 1 MiB writes about 1 MiB of pages (the rest is in the pool already).
#[test]
fn restored_state_includes_files_pipes_and_only_new_pages_are_written() {
    let Some(root) =
        TestRoot::new("restored_state_includes_files_pipes_and_only_new_pages_are_written")
    else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/"), ["1", "0", "2", "queued"]);
    let first = checkpoint_stats(
        &root,
        &[
            "checkpoint",
            "st",
            "--as",
            "one",
            "--leave-running",
            "--json",
        ],
    );
    assert_eq!(root.status("st").as_deref(), Some("running"));
    // The box's memory is for root only.
    use std::os::unix::fs::PermissionsExt;
    for path in [
        "lib/pages",
        "lib/pages/pack-1",
        "lib/checkpoints/one/checkpoint.json",
        "lib/checkpoints/one/pages-2",
    ] {
        let mode = std::fs::metadata(root.path().join(path))
            .expect(path)
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{path} has mode {mode:o}");
    }
    assert_eq!(
        box_http_get(&root, "st", "/grow"),
        ["2", "1", "4", "queued"]
    );
    let second = checkpoint_stats(&root, &["checkpoint", "st", "--as", "two", "--json"]);
    let written = second["pages_written"].as_u64().unwrap() * 4096;
    println!(
        "first checkpoint: {} pages, {} written; second: {} pages, {} written",
        first["pages"], first["pages_written"], second["pages"], second["pages_written"]
    );
    assert!(first["pages_written"].as_u64().unwrap() > 500);
    assert!(
        (1 << 20..=2 << 20).contains(&written),
        "the second checkpoint wrote {written} bytes of pages after 1 MiB changed"
    );
    root.ok(&["rm", "st"]);
    root.ok(&["restore", "one", "--name", "a"]);
    // Right after the restore its box holds its init and its process only:
    // no helper of the restore is left there, not even as a zombie (one the
    // host's init reaps late held the box's end for a second).
    let init = root.inspect("a")["state"]["init"]["pid"]
        .as_i64()
        .expect("a's init");
    let ns = std::fs::read_link(format!("/proc/{init}/ns/pid")).unwrap();
    let mut in_box: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| std::fs::read_link(e.path().join("ns/pid")).is_ok_and(|n| n == ns))
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    in_box.sort();
    assert_eq!(
        in_box,
        ["nestbox-init", "python3"],
        "processes in the restored box"
    );
    root.ok(&["restore", "two", "--name", "b"]);
    // The log file and its offset are each checkpoint's.
    assert_eq!(box_http_get(&root, "a", "/"), ["2", "0", "4", "queued"]);
    assert_eq!(box_http_get(&root, "b", "/"), ["3", "1", "6", "queued"]);
    let log = root.ok(&["exec", "b", "--", "cat", "/tmp/log.txt"]);
    assert_eq!(log, "1\n2\n3\n");
    root.ok(&["rm", "-f", "a", "b"]);
    root.ok(&["checkpoint", "rm", "one", "two"]);
}

/// `checkpoint -o DIR` writes a checkpoint with its pages and layers, which
/// another nestbox root (standing for another host) restores; a checkpoint
/// of the restored box there stands on the first one's layers (files of
/// both are in its restored root).
#[test]
fn a_self_contained_checkpoint_moves_to_another_root() {
    let Some(root) = TestRoot::new("a_self_contained_checkpoint_moves_to_another_root") else {
        return;
    };
    let Some(other) = TestRoot::new("a_self_contained_checkpoint_moves_to_another_root-2") else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/"), ["1", "0", "2", "queued"]);
    let out = tempfile::tempdir().expect("tempdir");
    let dir = out.path().join("ck");
    let dir_arg = dir.display().to_string();
    root.ok(&["checkpoint", "st", "-o", &dir_arg]);
    assert!(dir.join("pages").is_dir() && dir.join("layer-0").is_dir());
    assert_eq!(root.ok(&["checkpoint", "ls", "--json"]).trim(), "[]");
    let again = root.run(&["checkpoint", "st", "-o", &dir_arg]);
    assert_error(&again, 125, "already exists");
    root.ok(&["rm", "st"]);
    other.ok(&["restore", &dir_arg, "--name", "moved"]);
    assert_eq!(
        box_http_get(&other, "moved", "/"),
        ["2", "0", "4", "queued"]
    );
    other.ok(&[
        "exec",
        "moved",
        "--",
        "sh",
        "-c",
        "echo later > /tmp/new.txt",
    ]);
    other.ok(&["checkpoint", "moved", "--as", "two"]);
    other.ok(&["rm", "moved"]);
    other.ok(&["restore", "two", "--name", "again"]);
    assert_eq!(
        box_http_get(&other, "again", "/"),
        ["3", "0", "6", "queued"]
    );
    let files = other.ok(&["exec", "again", "--", "cat", "/tmp/log.txt", "/tmp/new.txt"]);
    assert_eq!(files, "1\n2\n3\nlater\n");
    other.ok(&["rm", "-f", "again"]);
    other.ok(&["checkpoint", "rm", "two"]);
}

fn private_dirty_kib(pid: i32) -> u64 {
    let rollup =
        std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).expect("smaps_rollup");
    status_field(&rollup, "Private_Dirty")
        .and_then(|v| v.trim_end_matches(" kB").trim().parse().ok())
        .expect("Private_Dirty")
}

/// `restore --shared`: the checkpoint is restored once as its template and
/// each box is a clone of it, continuing from the checkpoint with its
/// memory shared copy-on-write (its own dirty memory a fraction of a box
/// restored on its own); `checkpoint rm` takes the template with it once
/// its boxes are gone.
#[test]
fn boxes_restored_shared_continue_and_share_their_memory() {
    let Some(root) = TestRoot::new("boxes_restored_shared_continue_and_share_their_memory") else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/")[0], "1");
    root.ok(&["checkpoint", "st", "--as", "ck"]);
    root.ok(&["rm", "st"]);
    root.ok(&["restore", "ck", "--name", "alone"]);
    let names: Vec<String> = (1..=10).map(|i| format!("s{i}")).collect();
    for n in &names {
        root.ok(&["restore", "ck", "--shared", "--name", n]);
    }
    for n in &names {
        assert_eq!(
            box_http_get(&root, n, "/"),
            ["2", "0", "4", "queued"],
            "{n} continues"
        );
    }
    assert_eq!(box_http_get(&root, "s3", "/")[0], "3", "s3 goes on alone");
    assert_eq!(box_http_get(&root, "s4", "/")[0], "3");
    let alone = private_dirty_kib(main_pid("alone", &root));
    for n in &names {
        let own = private_dirty_kib(main_pid(n, &root));
        assert!(
            own * 2 < alone,
            "{n} has {own} KiB of its own dirty memory, a box restored alone {alone} KiB"
        );
    }
    let out = root.run(&["checkpoint", "rm", "ck"]);
    assert_error(&out, 125, "in use");
    let mut all: Vec<&str> = names.iter().map(String::as_str).collect();
    all.push("alone");
    root.rm_all(all);
    root.ok(&["checkpoint", "rm", "ck"]);
    assert!(
        root.names().is_empty(),
        "its template went with it: {:?}",
        root.names()
    );
}

/// A box in a user namespace whose server runs as uid 1000 is restored with
/// the same ids in its new user namespace, no capabilities, and its state.
#[test]
fn a_non_root_server_in_a_user_namespace_is_restored_with_its_ids() {
    let Some(root) =
        TestRoot::new("a_non_root_server_in_a_user_namespace_is_restored_with_its_ids")
    else {
        return;
    };
    let app = App::new(
        &[("server.py", PYTHON_STATE_SERVER)],
        &["python3", "/app/server.py"],
        1,
    );
    let volume = app.volume();
    root.ok(&[
        "run",
        "-d",
        "--userns",
        "-u",
        "1000:1000",
        "-w",
        "/tmp",
        "--name",
        "u",
        "-v",
        &volume,
        "--",
        "python3",
        "/app/server.py",
    ]);
    root.wait_logged("u", "ready", Duration::from_secs(30));
    assert_eq!(box_http_get(&root, "u", "/")[0], "1");
    let ids = |name: &str| {
        root.ok(&[
            "exec",
            name,
            "--",
            "sh",
            "-c",
            "grep -E '^(Uid|Gid|CapEff|CapPrm):' /proc/2/status | tr -s '\\t' ' '",
        ])
    };
    let before = ids("u");
    assert!(before.contains("Uid: 1000 1000 1000 1000"), "{before}");
    root.ok(&["checkpoint", "u", "--as", "ck"]);
    root.ok(&["rm", "u"]);
    root.ok(&["restore", "ck", "--name", "r"]);
    assert_eq!(ids("r"), before, "the same ids and capabilities");
    assert_eq!(box_http_get(&root, "r", "/"), ["2", "0", "4", "queued"]);
    root.ok(&["rm", "-f", "r"]);
    root.ok(&["checkpoint", "rm", "ck"]);
}

/// `checkpoint -o -` piped into `restore -` of another root moves a box
/// through a stream; the receiving root keeps the checkpoint under its name.
#[test]
fn a_checkpoint_stream_moves_a_box_between_roots() {
    let Some(root) = TestRoot::new("a_checkpoint_stream_moves_a_box_between_roots") else {
        return;
    };
    let Some(other) = TestRoot::new("a_checkpoint_stream_moves_a_box_between_roots-2") else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/")[0], "1");
    root.ok(&[
        "exec",
        "st",
        "--",
        "sh",
        "-c",
        "mkdir -p /tmp/d && echo kept > /tmp/d/f",
    ]);
    let mut sender = root
        .command(&["checkpoint", "st", "-o", "-"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("checkpoint -o -");
    let stream = sender.stdout.take().expect("stdout");
    let receiver = other
        .command(&["restore", "-", "--name", "moved"])
        .stdin(stream)
        .output()
        .expect("restore -");
    let sent = sender.wait_with_output().expect("checkpoint -o -");
    assert!(
        sent.status.success(),
        "checkpoint -o -: {}",
        String::from_utf8_lossy(&sent.stderr)
    );
    assert!(
        receiver.status.success(),
        "restore -: {}",
        String::from_utf8_lossy(&receiver.stderr)
    );
    assert_ne!(
        root.status("st").as_deref(),
        Some("running"),
        "the sender stopped"
    );
    assert_eq!(
        box_http_get(&other, "moved", "/"),
        ["2", "0", "4", "queued"]
    );
    assert_eq!(
        other.ok(&["exec", "moved", "--", "cat", "/tmp/d/f"]),
        "kept\n"
    );
    assert!(other.ok(&["checkpoint", "ls"]).contains("st"));
    root.ok(&["rm", "st"]);
    assert_eq!(root.ok(&["checkpoint", "ls", "--json"]).trim(), "[]");
    other.ok(&["rm", "-f", "moved"]);
    other.ok(&["checkpoint", "rm", "st"]);
}

/// Fifty boxes restored from one checkpoint, each on its own.
#[test]
fn fifty_boxes_are_restored_from_one_checkpoint() {
    let Some(root) = TestRoot::new("fifty_boxes_are_restored_from_one_checkpoint") else {
        return;
    };
    let _app = start_state_server(&root);
    assert_eq!(box_http_get(&root, "st", "/")[0], "1");
    root.ok(&["checkpoint", "st", "--as", "ck"]);
    root.ok(&["rm", "st"]);
    let names: Vec<String> = (1..=50).map(|i| format!("r{i}")).collect();
    for n in &names {
        root.ok(&["restore", "ck", "--name", n]);
    }
    for n in &names {
        assert_eq!(box_http_get(&root, n, "/")[0], "2", "{n} continues");
    }
    assert_eq!(box_http_get(&root, "r7", "/")[0], "3");
    assert_eq!(box_http_get(&root, "r8", "/")[0], "3");
    root.rm_all(names.iter().map(String::as_str));
    root.ok(&["checkpoint", "rm", "ck"]);
    root.ok(&["gc"]);
    root.assert_no_boxes();
}

/// A page file whose contents do not match their digests is found before
/// the restored process runs: one line, no box left.
#[test]
fn a_corrupt_page_file_is_refused_before_anything_runs() {
    let Some(root) = TestRoot::new("a_corrupt_page_file_is_refused_before_anything_runs") else {
        return;
    };
    let _app = start_state_server(&root);
    root.ok(&["checkpoint", "st", "--as", "ck"]);
    root.ok(&["rm", "st"]);
    let pack = root.path().join("lib/pages/pack-1");
    let original = std::fs::read(&pack).expect("pack");
    let mut data = original.clone();
    for b in data.iter_mut().step_by(4096) {
        *b ^= 0x55;
    }
    std::fs::write(&pack, &data).expect("corrupt the pack");
    let out = root.run(&["restore", "ck", "--name", "bad"]);
    assert_error(&out, 125, "corrupt");
    assert_eq!(out.stderr.lines().count(), 1, "one line: {out}");
    assert!(
        root.names().is_empty(),
        "nothing half-restored: {:?}",
        root.names()
    );
    // Truncated: also refused.
    std::fs::write(&pack, &original[..4096]).expect("truncate the pack");
    let out = root.run(&["restore", "ck", "--name", "bad"]);
    assert_error(&out, 125, "truncated");
    assert!(root.names().is_empty());
    root.ok(&["checkpoint", "rm", "ck"]);
}

#[test]
fn checkpoint_and_restore_refuse_bad_input_in_one_line() {
    let Some(root) = TestRoot::new("checkpoint_and_restore_refuse_bad_input_in_one_line") else {
        return;
    };
    let one_line = |out: &Out| assert_eq!(out.stderr.lines().count(), 1, "one line: {out}");
    let out = root.run(&["restore", "nope"]);
    assert_error(&out, 125, "no checkpoint named \"nope\"");
    one_line(&out);
    let out = root.run(&["checkpoint", "nobox"]);
    assert_error(&out, 125, "no box named \"nobox\"");
    one_line(&out);
    let _app = start_state_server(&root);
    let out = root.run(&["checkpoint", "st", "--as", "bad/name"]);
    assert_error(&out, 125, "checkpoint name");
    one_line(&out);
    root.ok(&["checkpoint", "st", "--as", "ck", "--leave-running"]);
    let out = root.run(&["checkpoint", "st", "--as", "ck", "--leave-running"]);
    assert_error(&out, 125, "already exists");
    one_line(&out);
    // A name in use.
    let out = root.run(&["restore", "ck", "--name", "st"]);
    assert_error(&out, 125, "already exists");
    one_line(&out);
    // A box that is not running.
    root.ok(&["run", "-d", "--name", "sh", "--", "true"]);
    root.wait_exited("sh", Duration::from_secs(10));
    let out = root.run(&["checkpoint", "sh"]);
    assert_error(&out, 125, "box \"sh\" is not running");
    one_line(&out);
    root.ok(&["rm", "-f", "sh", "st"]);
    // A truncated record file, then a corrupt checkpoint.json.
    let dir = root.path().join("lib/checkpoints/ck");
    let pages = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("pages-"))
        .expect("a pages file")
        .path();
    let records = std::fs::read(&pages).unwrap();
    std::fs::write(&pages, &records[..records.len() - 7]).unwrap();
    let out = root.run(&["restore", "ck", "--name", "x"]);
    assert_error(&out, 125, "truncated");
    one_line(&out);
    std::fs::write(&pages, &records).unwrap();
    let json = dir.join("checkpoint.json");
    let text = std::fs::read(&json).unwrap();
    std::fs::write(&json, &text[..text.len() / 2]).unwrap();
    let out = root.run(&["restore", "ck", "--name", "x"]);
    assert_error(&out, 125, "is corrupt");
    one_line(&out);
    // A checkpoint from another kernel.
    let mut meta: Value = serde_json::from_slice(&text).unwrap();
    meta["kernel"] = Value::from("2.6.32-other");
    std::fs::write(&json, serde_json::to_vec(&meta).unwrap()).unwrap();
    let out = root.run(&["restore", "ck", "--name", "x"]);
    assert_error(&out, 125, "was taken on kernel 2.6.32-other");
    one_line(&out);
    // ... and from a CPU with features this one lacks.
    let mut meta: Value = serde_json::from_slice(&text).unwrap();
    meta["cpu_flags"]
        .as_array_mut()
        .unwrap()
        .push(Value::from("quantum_entanglement"));
    std::fs::write(&json, serde_json::to_vec(&meta).unwrap()).unwrap();
    let out = root.run(&["restore", "ck", "--name", "x"]);
    assert_error(&out, 125, "quantum_entanglement");
    one_line(&out);
    assert!(
        root.names().is_empty(),
        "nothing half-restored: {:?}",
        root.names()
    );
    std::fs::write(&json, &text).unwrap();
    root.ok(&["checkpoint", "rm", "ck"]);
}

/// Whether box `st` answers (its server runs).
fn st_answers(root: &TestRoot) -> bool {
    root.status("st").as_deref() == Some("running")
        && root
            .run(&[
                "exec",
                "st",
                "--",
                "python3",
                "-c",
                "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/', timeout=10)",
            ])
            .code
            == 0
}

/// Every listed checkpoint restores and answers; then it is removed. How many.
fn restore_every_listed(root: &TestRoot) -> usize {
    let list: Value = serde_json::from_str(&root.ok(&["checkpoint", "ls", "--json"])).unwrap();
    for c in list.as_array().unwrap() {
        let n = c["name"].as_str().unwrap().to_string();
        root.ok(&["restore", &n, "--name", "whole"]);
        assert!(box_http_get(root, "whole", "/")[0].parse::<u64>().unwrap() >= 1);
        root.ok(&["rm", "-f", "whole"]);
        root.ok(&["checkpoint", "rm", &n]);
    }
    list.as_array().unwrap().len()
}

/// kill -9 of `checkpoint` and of `restore` at many points. The command's
/// checkpoint runs in a worker of its own process group, which finishes it:
/// the checkpoint is whole and the box goes on. The worker itself killed
/// (a crash): no partial checkpoint is ever listed, and `gc` removes what
/// it left and thaws the box. (A worker killed while a call it injected in a
/// thread of the box is in flight, microseconds each, leaves that thread with
/// the call's registers, which crashes the box's process: docs/checkpoint.md,
/// "Known limits"; the box is then started again for the next round.)
#[test]
fn checkpoint_and_restore_killed_midway_leave_nothing() {
    let Some(root) = TestRoot::new("checkpoint_and_restore_killed_midway_leave_nothing") else {
        return;
    };
    let mut apps = vec![start_state_server(&root)];
    let delays = [5u64, 20, 40, 60, 80, 120, 200, 400];
    for (i, delay) in delays.iter().enumerate() {
        let name = format!("k{i}");
        let mut command = root.spawn(&["checkpoint", "st", "--as", &name, "--leave-running"]);
        std::thread::sleep(Duration::from_millis(*delay));
        let worker = worker_of(command.id());
        let _ = command.kill();
        let _ = command.wait();
        if let Some(w) = worker {
            wait_for("the worker to finish", Duration::from_secs(30), || {
                !pid_alive(w)
            });
        }
        assert_eq!(
            restore_every_listed(&root),
            1,
            "the checkpoint of round {i} finished"
        );
        assert!(st_answers(&root), "the box goes on after round {i}");
    }
    let (mut listed, mut survived) = (0, 0);
    for (i, delay) in delays.iter().enumerate() {
        let name = format!("w{i}");
        let mut command = root.spawn(&["checkpoint", "st", "--as", &name, "--leave-running"]);
        let worker = worker_of(command.id()).expect("the checkpoint's worker");
        std::thread::sleep(Duration::from_millis(*delay));
        let _ = std::process::Command::new("kill")
            .args(["-9", &worker.to_string()])
            .status();
        let _ = command.wait();
        listed += restore_every_listed(&root);
        root.ok(&["gc"]);
        if st_answers(&root) {
            survived += 1;
        } else {
            root.ok(&["rm", "-f", "st"]);
            apps.push(start_state_server(&root));
        }
    }
    println!(
        "{listed} of 8 killed workers had finished their checkpoint; the box went on after {survived}"
    );
    let leftovers: Vec<_> = std::fs::read_dir(root.path().join("lib/checkpoints"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(leftovers.is_empty(), "left: {leftovers:?}");
    // restore killed midway.
    root.ok(&["checkpoint", "st", "--as", "ck", "--leave-running"]);
    for (i, delay) in [5u64, 30, 60, 100, 150].iter().enumerate() {
        let name = format!("r{i}");
        let mut child = root.spawn(&["restore", "ck", "--name", &name]);
        std::thread::sleep(Duration::from_millis(*delay));
        let _ = child.kill();
        let _ = child.wait();
        root.run(&["rm", "-f", &name]);
    }
    root.ok(&["rm", "-f", "st"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    root.ok(&["gc"]);
    root.assert_no_boxes();
}

/// `checkpoint ls` running while checkpoints are removed sees each one whole
/// or not at all (a removal takes the checkpoint out of the list in one
/// step), and `gc` finishes a removal that was cut short.
#[test]
fn checkpoints_being_removed_are_never_listed_half_removed() {
    let Some(root) = TestRoot::new("checkpoints_being_removed_are_never_listed_half_removed")
    else {
        return;
    };
    root.ok(&["run", "-d", "--name", "sl", "--", "sleep", "600"]);
    let names: Vec<String> = (0..6).map(|i| format!("r{i}")).collect();
    for n in &names {
        root.ok(&["checkpoint", "sl", "--as", n, "--leave-running"]);
    }
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let lister = s.spawn(|| {
            let mut runs = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let out = root.run(&["checkpoint", "ls"]).ok();
                assert!(
                    out.stderr.trim().is_empty(),
                    "checkpoint ls during removals said: {}",
                    out.stderr
                );
                runs += 1;
            }
            runs
        });
        for n in &names[..5] {
            root.ok(&["checkpoint", "rm", n]);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(lister.join().unwrap() > 0, "ls ran during the removals");
    });
    // A removal cut short (its process gone) after the checkpoint left the
    // list: gc finishes it.
    let dir = root.path().join("lib/checkpoints");
    std::fs::rename(dir.join("r5"), dir.join(".removing-r5-999999999")).unwrap();
    assert!(!root.ok(&["checkpoint", "ls"]).contains("r5"));
    root.ok(&["gc"]);
    assert!(
        !dir.join(".removing-r5-999999999").exists(),
        "gc finished the removal"
    );
    root.ok(&["rm", "-f", "sl"]);
}
