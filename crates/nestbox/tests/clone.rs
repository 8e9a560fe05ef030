//! Freeze and clone, seen from outside: a warmed-up Python HTTP server is frozen
//! into a template and cloned; every clone answers on the same port in its own
//! network namespace, keeps its own copy of the server's memory, files, logs,
//! hostname and machine id, and outlives its template. Bad requests fail with a
//! clear error and leave nothing behind.

mod common;

use std::time::Duration;

use common::*;

/// A small HTTP server holding state in memory: a request counter, a flag set by
/// SIGUSR1, a log file kept open for appending, files written on request.
const SERVER: &str = r#"
import http.server, os, signal
count = 0
reseeded = 0
def on_usr1(*a):
    global reseeded
    reseeded = 1
signal.signal(signal.SIGUSR1, on_usr1)
log = open('/tmp/server.log', 'a')
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        if self.path.startswith('/write/'):
            with open('/tmp/' + self.path[7:], 'w') as f:
                f.write('written')
        log.write(f'{count} {self.path}\n')
        log.flush()
        body = f'{count} {os.uname().nodename} {reseeded}\n'.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        print('request', count, self.path, flush=True)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(('127.0.0.1', 8080), H)
print('ready', flush=True)
server.serve_forever()
"#;

/// Ask the server in box `name` for `path`; its answer (count, hostname, reseeded).
fn get(root: &TestRoot, name: &str, path: &str) -> (u64, String, u64) {
    let fields = box_http_get(root, name, path);
    assert_eq!(fields.len(), 3, "answer of {name}: {fields:?}");
    (
        fields[0].parse().unwrap(),
        fields[1].to_string(),
        fields[2].parse().unwrap(),
    )
}

/// Start the server as box `name`, wait until it listens, warm it with `warm`
/// requests, and freeze it into a template of the same name.
fn frozen_server(root: &TestRoot, name: &str, warm: u64) {
    frozen_server_with(root, name, warm, &[]);
}

/// [`frozen_server`] with extra `run` options.
fn frozen_server_with(root: &TestRoot, name: &str, warm: u64, opts: &[&str]) {
    warmed_server(root, name, warm, opts);
    root.ok(&["freeze", name]);
}

/// [`frozen_server`] frozen with a pool of `pool` clones forked ahead.
fn frozen_pooled_server(root: &TestRoot, name: &str, warm: u64, pool: u32) {
    warmed_server(root, name, warm, &[]);
    root.ok(&["freeze", name, "--pool", &pool.to_string()]);
}

/// Start the server as box `name` with `run` options `opts`, wait until it
/// listens and warm it with `warm` requests.
fn warmed_server(root: &TestRoot, name: &str, warm: u64, opts: &[&str]) {
    let mut args = vec!["run", "-d", "--name", name];
    args.extend_from_slice(opts);
    args.extend_from_slice(&["--", "python3", "-c", SERVER]);
    let out = root.run(&args).ok();
    assert_eq!(out.stdout.trim(), name);
    root.wait_logged(name, "ready", Duration::from_secs(20));
    for i in 1..=warm {
        assert_eq!(get(root, name, "/").0, i);
    }
}

/// Clones waiting in the pool of the (only) template.
fn pooled(root: &TestRoot) -> u64 {
    let list: serde_json::Value =
        serde_json::from_str(&root.ok(&["template", "ls", "--json"])).unwrap();
    list[0]["pooled"].as_u64().unwrap()
}

/// Names of all boxes, sorted.
fn box_names(root: &TestRoot) -> Vec<String> {
    let all: serde_json::Value = serde_json::from_str(&root.ok(&["ps", "-a", "--json"])).unwrap();
    let mut names: Vec<String> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn clones_continue_from_the_frozen_state_independently() {
    let Some(root) = TestRoot::new("clones_continue_from_the_frozen_state_independently") else {
        return;
    };
    frozen_server(&root, "tpl", 3);
    let names = root.ok(&["clone", "tpl", "-n", "20", "-d", "--name", "c"]);
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 20);
    assert_eq!(names[..3], ["c-1", "c-2", "c-3"]);
    // All 20 answer, each from its own state, under its own hostname.
    for n in &names[3..] {
        let (count, host, _) = get(&root, n, "/");
        assert_eq!((count, host.as_str()), (4, *n));
    }
    // Every clone answers on the template's port in its own network namespace,
    // continuing the template's counter (3 requests before the freeze).
    assert_eq!(get(&root, "c-1", "/").0, 4);
    assert_eq!(get(&root, "c-1", "/").0, 5);
    assert_eq!(get(&root, "c-2", "/").0, 4);
    assert_eq!(get(&root, "c-1", "/").0, 6);
    assert_eq!(get(&root, "c-3", "/").0, 4);
    // Each is a full box in ps and inspect, with its own cgroup and process.
    let ps = root.ok(&["ps"]);
    for n in ["tpl", "c-1", "c-2", "c-3"] {
        assert!(ps.contains(n), "{n} in ps:\n{ps}");
    }
    let inspect: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", "c-2"])).unwrap();
    assert_eq!(inspect["state"]["status"], "running");
    assert_eq!(inspect["spec"]["clone_of"]["template"], "tpl");
    assert!(
        inspect["memory_sharing"]["shared_with_template_bytes"]
            .as_u64()
            .unwrap()
            > 0
    );
    root.rm_all(names.iter().copied().chain(["tpl"]));
}

/// `clone --network none`: clones of a bridged template with loopback only
/// continue the template's state and answer on their loopback; they are forked
/// (the pooled clone, which has the template's network, is left in the pool).
#[test]
fn clones_without_network_have_loopback_only() {
    let Some(root) = TestRoot::new("clones_without_network_have_loopback_only") else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 3, 1);
    wait_for("the pool to fill", Duration::from_secs(20), || {
        pooled(&root) == 1
    });
    let names = root.ok(&[
        "clone",
        "tpl",
        "-n",
        "2",
        "-d",
        "--network",
        "none",
        "--name",
        "lo",
    ]);
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names, ["lo-1", "lo-2"]);
    assert_eq!(pooled(&root), 1, "the pooled clone was not taken");
    for n in &names {
        assert_eq!(
            get(&root, n, "/").0,
            4,
            "{n} continues the template's count"
        );
        let v = root.inspect(n);
        assert_eq!(v["spec"]["network"]["mode"], "none", "{v}");
        assert!(v["state"]["network"].is_null(), "{v}");
        let dev = root.ok(&["exec", n, "--", "cat", "/proc/net/dev"]);
        let ifaces: Vec<&str> = dev
            .lines()
            .skip(2)
            .filter_map(|l| l.split(':').next())
            .map(str::trim)
            .collect();
        assert_eq!(ifaces, ["lo"], "{dev}");
    }
    assert_eq!(get(&root, "lo-1", "/").0, 5);
    assert_eq!(get(&root, "lo-2", "/").0, 5);
    let out = root.run(&["clone", "tpl", "--network", "host"]);
    assert_eq!(out.code, 125, "{out}");
    assert!(
        out.stderr.contains("unknown clone --network \"host\""),
        "{out}"
    );
    root.rm_all(names.iter().copied().chain(["tpl"]));
}

#[test]
fn clone_files_logs_and_identity_are_their_own() {
    let Some(root) = TestRoot::new("clone_files_logs_and_identity_are_their_own") else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    root.ok(&[
        "clone", "tpl", "-d", "--name", "a", "--name", "b", "-n", "2",
    ]);
    // A file written by the server in clone a exists there only.
    get(&root, "a", "/write/only-a");
    let cat = |name: &str, path: &str| root.run(&["exec", name, "--", "cat", path]);
    assert_eq!(cat("a", "/tmp/only-a").ok().stdout, "written");
    cat("b", "/tmp/only-a").code(1);
    let tpid = template_pid(&root, "tpl");
    assert!(
        !std::path::Path::new(&format!("/proc/{tpid}/root/tmp/only-a")).exists(),
        "the template does not see the clone's file"
    );
    // The log file the template held open for appending was reopened in each
    // clone's own layer: clone a's lines are not in b's copy nor the template's.
    let log_a = cat("a", "/tmp/server.log").ok().stdout;
    let log_b = cat("b", "/tmp/server.log").ok().stdout;
    assert!(log_a.contains("/write/only-a"), "{log_a}");
    assert!(!log_b.contains("/write/only-a"), "{log_b}");
    let log_t = std::fs::read_to_string(format!("/proc/{tpid}/root/tmp/server.log")).unwrap();
    assert!(!log_t.contains("/write/only-a"), "{log_t}");
    // Standard output goes to each clone's own log.
    assert!(root.ok(&["logs", "a"]).contains("/write/only-a"));
    assert!(!root.ok(&["logs", "b"]).contains("/write/only-a"));
    assert!(!root.ok(&["logs", "tpl"]).contains("/write/only-a"));
    // Hostname and machine id are fresh.
    let (_, host_a, _) = get(&root, "a", "/");
    let (_, host_b, _) = get(&root, "b", "/");
    assert_eq!((host_a.as_str(), host_b.as_str()), ("a", "b"));
    let id_a = cat("a", "/etc/machine-id").ok().stdout;
    let id_b = cat("b", "/etc/machine-id").ok().stdout;
    let id_t = std::fs::read_to_string(format!("/proc/{tpid}/root/etc/machine-id")).unwrap();
    assert_eq!(id_a.trim().len(), 32);
    assert!(id_a != id_b && id_a != id_t && id_b != id_t);
    root.ok(&["rm", "-f", "a", "b", "tpl"]);
}

#[test]
fn on_clone_signal_reaches_the_clone_only() {
    let Some(root) = TestRoot::new("on_clone_signal_reaches_the_clone_only") else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    root.ok(&["clone", "tpl", "-d", "--name", "plain"]);
    root.ok(&[
        "clone",
        "tpl",
        "-d",
        "--name",
        "signalled",
        "--on-clone-signal",
        "USR1",
    ]);
    assert_eq!(get(&root, "plain", "/").2, 0);
    wait_for("the on-clone signal", Duration::from_secs(5), || {
        get(&root, "signalled", "/").2 == 1
    });
    root.ok(&["rm", "-f", "plain", "signalled", "tpl"]);
}

#[test]
fn clones_outlive_their_template() {
    let Some(root) = TestRoot::new("clones_outlive_their_template") else {
        return;
    };
    frozen_server(&root, "tpl", 2);
    root.ok(&["clone", "tpl", "-d", "--name", "c", "-n", "2"]);
    let tpid = template_pid(&root, "tpl");
    root.ok(&["template", "rm", "tpl"]);
    wait_for(
        "the template's process to end",
        Duration::from_secs(10),
        || !pid_alive(tpid),
    );
    // The clones go on undisturbed.
    assert_eq!(get(&root, "c-1", "/").0, 3);
    assert_eq!(get(&root, "c-2", "/").0, 3);
    assert_eq!(get(&root, "c-1", "/").0, 4);
    // A removed template cannot be cloned any more.
    assert_error(
        &root.run(&["clone", "tpl", "-d"]),
        125,
        "template \"tpl\" has been removed",
    );
    root.ok(&["rm", "-f", "c-1", "c-2"]);
    // With its last clone gone, the template's box goes too.
    wait_for("the template box to go", Duration::from_secs(10), || {
        box_names(&root).is_empty()
    });
}

#[test]
fn clone_limits_and_stats() {
    let Some(root) = TestRoot::new("clone_limits_and_stats") else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    root.ok(&[
        "clone", "tpl", "-d", "--name", "small", "--memory", "96m", "--pids", "20",
    ]);
    let inspect: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", "small"])).unwrap();
    assert_eq!(inspect["limits"]["memory"], 96 * 1024 * 1024);
    let limit = cgroup_file(&inspect, "memory.limit_in_bytes")
        .or_else(|| cgroup_file(&inspect, "memory.max"))
        .expect("memory limit file");
    assert_eq!(read_trimmed(&limit), (96u64 * 1024 * 1024).to_string());
    let stats: serde_json::Value =
        serde_json::from_str(&root.ok(&["stats", "--json", "small"])).unwrap();
    assert_eq!(stats["sharing"]["role"], "clone");
    assert!(stats["sharing"]["private_bytes"].as_u64().unwrap() > 0);
    let tstats: serde_json::Value =
        serde_json::from_str(&root.ok(&["stats", "--json", "tpl"])).unwrap();
    assert_eq!(tstats["sharing"]["clones"], 1);
    assert!(tstats["sharing"]["sharing_ratio"].as_f64().unwrap() > 1.0);
    root.ok(&["rm", "-f", "small", "tpl"]);
}

// ---------------------------------------------------------------- bad input

#[test]
fn freeze_refuses_what_cannot_be_cloned() {
    let Some(root) = TestRoot::new("freeze_refuses_what_cannot_be_cloned") else {
        return;
    };
    root.ok(&["run", "--name", "done", "--", "true"]);
    assert_error(&root.run(&["freeze", "done"]), 125, "has exited");
    // A job left behind by a shell that exited is adopted by the box's init
    // but stays in the box's first session: no clone can give it that session.
    root.detached_sh("two", &[], "sh -c 'sleep 300 &'; sleep 300");
    wait_for("the orphaned job", Duration::from_secs(10), || {
        root.run(&[
            "exec",
            "two",
            "--",
            "sh",
            "-c",
            "ls /proc | grep -c '^[0-9]'",
        ])
        .stdout
        .trim()
        .parse::<u32>()
        .unwrap_or(0)
            >= 4
    });
    assert_error(
        &root.run(&["freeze", "two"]),
        125,
        "is a child of the box's init but does not lead its own session",
    );
    // Nothing was frozen.
    assert_eq!(root.ok(&["template", "ls", "--json"]).trim(), "[]");
    assert_error(&root.run(&["clone", "two"]), 125, "is not a template");
    assert_error(
        &root.run(&["clone", "nothing"]),
        125,
        "no template named \"nothing\"",
    );
    root.ok(&["rm", "-f", "done", "two"]);
}

#[test]
fn clone_refuses_bad_counts_and_leaves_nothing() {
    let Some(root) = TestRoot::new("clone_refuses_bad_counts_and_leaves_nothing") else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    assert_error(&root.run(&["clone", "tpl", "-n", "0"]), 125, "at least 1");
    assert_error(
        &root.run(&["clone", "tpl", "-n", "100000000", "-d"]),
        125,
        "clones need about",
    );
    root.ok(&["clone", "tpl", "-d", "--name", "taken"]);
    assert_error(
        &root.run(&["clone", "tpl", "-d", "--name", "taken"]),
        125,
        "already exists",
    );
    assert_error(
        &root.run(&["clone", "tpl", "-d", "--name", "pool.mine"]),
        125,
        "reserved for template pools",
    );
    // Only the template and the one good clone exist.
    assert_eq!(box_names(&root), ["taken", "tpl"]);
    // The template was left frozen and still clones.
    assert_eq!(get(&root, "taken", "/").0, 2);
    root.ok(&["clone", "tpl", "-d", "--name", "again"]);
    assert_eq!(get(&root, "again", "/").0, 2);
    root.ok(&["rm", "-f", "taken", "again", "tpl"]);
}

/// A burst whose shells cannot all start (its network runs out of addresses
/// midway, with four shells up) fails with the network's one line and leaves
/// no clone, no shell and no lease; the template still clones.
#[test]
fn a_clone_burst_that_runs_out_of_addresses_leaves_nothing() {
    let Some(root) = TestRoot::new("a_clone_burst_that_runs_out_of_addresses_leaves_nothing")
    else {
        return;
    };
    // A /29: the gateway and five box addresses, one of them the template's.
    root.ok(&["network", "create", "tiny", "--subnet", "10.234.17.0/29"]);
    frozen_server_with(&root, "tpl", 1, &["--network", "tiny"]);
    assert_error(
        &root.run(&["clone", "tpl", "-d", "-n", "7", "--name", "b"]),
        125,
        "is exhausted",
    );
    assert_eq!(box_names(&root), ["tpl"]);
    let state = std::fs::read_to_string(root.path().join("lib/network/tiny/state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    assert_eq!(
        state["boxes"].as_object().map(|b| b.len()),
        Some(1),
        "only the template holds an address: {state}"
    );
    root.ok(&["clone", "tpl", "-d", "-n", "4", "--name", "c"]);
    for i in 1..=4 {
        assert_eq!(get(&root, &format!("c-{i}"), "/").0, 2);
    }
    root.ok(&["rm", "-f", "c-1", "c-2", "c-3", "c-4", "tpl"]);
    root.ok(&["network", "rm", "tiny"]);
}

#[test]
fn serial_hundred_clones_then_rm_leaves_nothing() {
    let Some(root) = TestRoot::new("serial_hundred_clones_then_rm_leaves_nothing") else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    let out = root.run_timeout(
        &["clone", "tpl", "-n", "100", "-d", "--name", "h"],
        Duration::from_secs(240),
    );
    let names: Vec<String> = out.ok().stdout.lines().map(String::from).collect();
    assert_eq!(names.len(), 100);
    assert_eq!(get(&root, "h-1", "/").0, 2);
    assert_eq!(get(&root, "h-100", "/").0, 2);
    root.rm_all(names.iter().map(String::as_str).chain(["tpl"]));
    assert!(box_names(&root).is_empty());
    // TestRoot's drop asserts that no process, cgroup or directory of these boxes is left.
}

#[test]
fn clones_of_clones() {
    let Some(root) = TestRoot::new("clones_of_clones") else {
        return;
    };
    frozen_server(&root, "tpl", 2);
    root.ok(&["clone", "tpl", "-d", "--name", "first"]);
    assert_eq!(get(&root, "first", "/").0, 3);
    // The clone, warmed further, becomes a template of its own.
    root.ok(&["freeze", "first", "--as", "second-tpl"]);
    root.ok(&[
        "clone",
        "second-tpl",
        "-d",
        "--name",
        "grandchild",
        "-n",
        "2",
    ]);
    assert_eq!(get(&root, "grandchild-1", "/").0, 4);
    assert_eq!(get(&root, "grandchild-2", "/").0, 4);
    assert_eq!(get(&root, "grandchild-1", "/").0, 5);
    let (_, host, _) = get(&root, "grandchild-2", "/");
    assert_eq!(host, "grandchild-2");
    root.ok(&["rm", "-f", "grandchild-1", "grandchild-2", "first", "tpl"]);
    assert_eq!(
        box_names(&root),
        Vec::<String>::new(),
        "boxes left after rm"
    );
}

/// A chain of templates and clones removed in one `rm -f`, the templates
/// named first: the templates stay while their clones live, and all of the
/// chain is gone once `rm` returns.
#[test]
fn a_chain_of_clones_removed_templates_first_is_gone_when_rm_returns() {
    let Some(root) =
        TestRoot::new("a_chain_of_clones_removed_templates_first_is_gone_when_rm_returns")
    else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    root.ok(&["clone", "tpl", "-d", "--name", "first"]);
    root.ok(&["freeze", "first", "--as", "second-tpl"]);
    root.ok(&["clone", "second-tpl", "-d", "--name", "grandchild"]);
    assert_eq!(get(&root, "grandchild", "/").0, 2);
    root.ok(&["rm", "-f", "tpl", "first", "grandchild"]);
    assert_eq!(
        box_names(&root),
        Vec::<String>::new(),
        "boxes left after rm"
    );
}

#[test]
fn clones_of_a_user_namespace_template() {
    let Some(root) = TestRoot::new("clones_of_a_user_namespace_template") else {
        return;
    };
    frozen_server_with(&root, "tpl", 1, &["--userns"]);
    root.ok(&["clone", "tpl", "-d", "--name", "u"]);
    assert_eq!(get(&root, "u", "/").0, 2);
    // Box root is still an unprivileged host uid in the clone.
    let map = root.ok(&["exec", "u", "--", "cat", "/proc/self/uid_map"]);
    let fields: Vec<&str> = map.split_whitespace().collect();
    assert_eq!(
        fields,
        ["0", "0", "65536"],
        "identity over the template's ids"
    );
    let pid = serde_json::from_str::<serde_json::Value>(&root.ok(&["inspect", "u"])).unwrap()
        ["state"]["clone"]["process"]["pid"]
        .as_i64()
        .unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status_field(&status, "Uid").unwrap();
    assert!(
        uid.split_whitespace().all(|u| u == "1000000000"),
        "host uids {uid}"
    );
    root.ok(&["rm", "-f", "u", "tpl"]);
}

#[test]
fn pooled_clones_are_claimed_and_refilled() {
    let Some(root) = TestRoot::new("pooled_clones_are_claimed_and_refilled") else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 1, 2);
    assert_eq!(pooled(&root), 2);
    // Pooled clones are not boxes yet.
    assert_eq!(box_names(&root), ["tpl"]);
    // A claimed clone is a full box under its own name, continuing the template.
    root.ok(&[
        "clone",
        "tpl",
        "-d",
        "--name",
        "first",
        "--on-clone-signal",
        "USR1",
    ]);
    let (count, host, reseeded) = get(&root, "first", "/");
    assert_eq!((count, host.as_str(), reseeded), (2, "first", 1));
    let out = root
        .run(&["run", "--rm", "--", "getent", "hosts", "first"])
        .ok();
    assert!(out.stdout.contains("first"), "name on the network: {out}");
    // The pool is refilled in the background.
    wait_for("the pool to refill", Duration::from_secs(20), || {
        pooled(&root) == 2
    });
    root.ok(&["clone", "tpl", "-d", "--name", "second", "-n", "1"]);
    assert_eq!(get(&root, "second", "/").0, 2);
    assert_eq!(get(&root, "first", "/").0, 3);
    wait_for("the pool to refill", Duration::from_secs(20), || {
        pooled(&root) == 2
    });
    // Removing the template takes its pool along; the claimed clones stay.
    root.ok(&["template", "rm", "tpl"]);
    assert_eq!(get(&root, "second", "/").0, 3);
    root.ok(&["rm", "-f", "first", "second"]);
    wait_for("the template box to go", Duration::from_secs(10), || {
        box_names(&root).is_empty()
    });
}

/// Minor page faults of process `pid` so far.
fn minor_faults(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[7].parse().unwrap()
}

fn clone_pid(root: &TestRoot, name: &str) -> i32 {
    let v: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", name])).unwrap();
    v["state"]["clone"]["process"]["pid"].as_i64().unwrap() as i32
}

#[test]
fn pooled_clones_get_the_working_set_of_earlier_clones_copied_ahead() {
    let Some(root) = TestRoot::new("pooled_clones_get_the_working_set_copied_ahead") else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 1, 1);
    // The first clone comes from the pool made at freeze time: nothing is
    // known yet of what a clone touches, so its first request faults for
    // every page it writes (a copy each) and every page of code it runs.
    root.ok(&["clone", "tpl", "-d", "--name", "first"]);
    let pid = clone_pid(&root, "first");
    let before = minor_faults(pid);
    assert_eq!(get(&root, "first", "/").0, 2);
    let first_faults = minor_faults(pid) - before;
    // It serves one request and goes, as a serverless clone does (mostly
    // before the refill after its claim runs): its removal teaches the pool.
    root.ok(&["rm", "-f", "first"]);
    wait_for("the pool to refill", Duration::from_secs(60), || {
        pooled(&root) == 1
    });
    // The refill after `first`'s claim may have made the pooled clone before
    // the removal taught it: claim once more.
    root.ok(&["clone", "tpl", "-d", "--name", "second"]);
    wait_for("the pool to refill", Duration::from_secs(60), || {
        pooled(&root) == 1
    });
    root.ok(&["clone", "tpl", "-d", "--name", "third"]);
    let pid = clone_pid(&root, "third");
    let before = minor_faults(pid);
    // Same answer: the copy changed when pages were copied, not what they hold.
    assert_eq!(get(&root, "third", "/").0, 2);
    let third_faults = minor_faults(pid) - before;
    eprintln!("first request faults: first clone {first_faults}, prefetched clone {third_faults}");
    assert!(
        third_faults * 10 < first_faults,
        "the prefetched clone's first request faulted {third_faults} times, \
         the first clone's {first_faults}"
    );
    root.ok(&["rm", "-f", "second", "third", "tpl"]);
}

#[test]
fn serve_answers_clone_requests_on_its_socket() {
    use std::io::{BufRead, BufReader, Write};
    let Some(root) = TestRoot::new("serve_answers_clone_requests_on_its_socket") else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 1, 1);
    let socket = root.path().join("api.sock");
    let mut server = root.spawn(&["serve", "--socket", socket.to_str().unwrap()]);
    wait_for("the socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    // A second server on the same socket is refused.
    assert_error(
        &root.run(&["serve", "--socket", socket.to_str().unwrap()]),
        125,
        "already answers",
    );
    let mut api = ApiClient::connect(&socket);
    let mut call = |req: &str| api.call(req);
    assert_eq!(call(r#"{"op":"ping"}"#)["ok"], true);
    // A second connection is served while the first stays open, also when
    // it closes its side right after its request.
    {
        let mut other = std::os::unix::net::UnixStream::connect(&socket).unwrap();
        other.write_all(b"{\"op\":\"ping\"}\n").unwrap();
        other.shutdown(std::net::Shutdown::Write).unwrap();
        let mut line = String::new();
        BufReader::new(&other).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), r#"{"ok":true}"#);
    }
    // Two clones on one connection: the pooled one, then one forked on demand.
    for name in ["api-a", "api-b"] {
        let answer = call(&format!(
            r#"{{"op":"clone","template":"tpl","name":"{name}"}}"#
        ));
        assert_eq!(answer["ok"], true, "{answer}");
        assert_eq!(answer["name"], name);
        let v: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", name])).unwrap();
        assert_eq!(answer["address"], v["state"]["network"]["address"], "{v}");
        assert_eq!(answer["pid"], v["state"]["clone"]["process"]["pid"], "{v}");
        let (count, host, _) = get(&root, name, "/");
        assert_eq!((count, host.as_str()), (2, name), "continues the template");
    }
    // Bad requests get one-line errors with their kind, and the connection
    // stays usable.
    for (req, fragment, kind) in [
        ("not json", "not JSON", "invalid"),
        (r#"{"op":"fly"}"#, "unknown op", "invalid"),
        (r#"{"op":"clone"}"#, "needs \"template\"", "invalid"),
        (
            r#"{"op":"clone","template":"nosuch"}"#,
            "no template named",
            "not_found",
        ),
        (
            r#"{"op":"clone","template":"tpl","name":"api-a"}"#,
            "api-a",
            "conflict",
        ),
    ] {
        let answer = call(req);
        assert_eq!(answer["ok"], false, "{req}: {answer}");
        assert!(
            answer["error"].as_str().unwrap().contains(fragment),
            "{req}: {answer}"
        );
        assert_eq!(answer["kind"], kind, "{req}: {answer}");
    }
    assert_eq!(call(r#"{"op":"ping"}"#)["ok"], true);
    // Once the server is idle, the claimed clone is known by its name on the
    // network too (the answer came before that bookkeeping).
    wait_for("api-a in the hosts file", Duration::from_secs(10), || {
        root.run(&["run", "--rm", "--", "getent", "hosts", "api-a"])
            .stdout
            .contains("api-a")
    });
    // Idle, the server prepares its next claim of `tpl` once the pool is
    // refilled; a clone made through it is a full clone like the others.
    wait_for("the pool to refill", Duration::from_secs(20), || {
        pooled(&root) == 1
    });
    std::thread::sleep(Duration::from_millis(400));
    let answer = call(r#"{"op":"clone","template":"tpl","name":"api-c"}"#);
    assert_eq!(answer["ok"], true, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", "api-c"])).unwrap();
    assert_eq!(answer["pid"], v["state"]["clone"]["process"]["pid"], "{v}");
    assert_eq!(get(&root, "api-c", "/").0, 2, "continues the template");
    // A claim prepared before the template was removed is not used after.
    wait_for("the pool to refill", Duration::from_secs(20), || {
        pooled(&root) == 1
    });
    std::thread::sleep(Duration::from_millis(400));
    root.ok(&["template", "rm", "tpl"]);
    let answer = call(r#"{"op":"clone","template":"tpl","name":"api-d"}"#);
    assert_eq!(answer["ok"], false, "{answer}");
    assert!(
        answer["error"].as_str().unwrap().contains("removed"),
        "{answer}"
    );
    assert_eq!(answer["kind"], "not_found", "{answer}");
    assert_ne!(root.run(&["inspect", "api-d"]).code, 0, "no box api-d");
    // SIGTERM ends the server and removes its socket.
    // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let status = server.wait().unwrap();
    assert!(status.success(), "{status:?}");
    assert!(!socket.exists());
    root.ok(&["rm", "-f", "api-a", "api-b", "api-c"]);
    wait_for("the template box to go", Duration::from_secs(10), || {
        box_names(&root).is_empty()
    });
}

/// A clone that ends while `nestbox serve` still has to name it in the hosts
/// file is no error: its address is released before its record says it ended
/// (the monitor releases, then records the end), so the follow-up must not
/// report "has no address" for it.
#[test]
fn serve_follow_up_of_a_clone_that_ended_meanwhile_is_no_error() {
    use std::os::fd::AsRawFd;
    let Some(root) = TestRoot::new("serve_follow_up_of_a_clone_that_ended_meanwhile_is_no_error")
    else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 1, 1);
    let hosts = root.path().join("lib/network/default/hosts");
    assert!(hosts.exists(), "{}", hosts.display());
    let socket = root.path().join("api.sock");
    let mut server = root.spawn(&["serve", "--socket", socket.to_str().unwrap()]);
    let server_pid = server.id() as i32;
    wait_for("the socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let mut api = ApiClient::connect(&socket);
    let mut call = |req: &str| api.call(req);
    // Claim a pooled clone and stop the server before its follow-up (5 ms
    // of idleness later) names the clone in the hosts file; if the follow-up
    // was quicker, try again with the next pooled clone.
    let mut stopped_in_time = None;
    for attempt in 0..5 {
        wait_for("the pool to fill", Duration::from_secs(20), || {
            pooled(&root) == 1
        });
        let name = format!("fu-{attempt}");
        let answer = call(&format!(
            r#"{{"op":"clone","template":"tpl","name":"{name}"}}"#
        ));
        // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
        unsafe { libc::kill(server_pid, libc::SIGSTOP) };
        assert_eq!(answer["ok"], true, "{answer}");
        let named = std::fs::read_to_string(&hosts)
            .unwrap()
            .lines()
            .any(|l| l.split_whitespace().any(|w| w == name));
        if !named {
            stopped_in_time = Some((name, answer["address"].as_str().unwrap().to_string()));
            break;
        }
        root.ok(&["rm", "-f", &name]);
        // SAFETY: as above.
        unsafe { libc::kill(server_pid, libc::SIGCONT) };
    }
    let (name, address) =
        stopped_in_time.expect("the server stopped before a follow-up in 5 tries");
    // Hold the clone's record lock: its monitor then releases the address and
    // waits to record the end, the state in which the follow-up finds it.
    let lock = std::fs::File::open(root.path().join(format!("run/boxes/{name}/lock"))).unwrap();
    // SAFETY: flock on a descriptor we own; no memory is involved.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let id = root.inspect(&name)["id"].as_str().unwrap().to_string();
    root.ok(&["kill", &name]);
    let state = root.path().join("lib/network/default/state.json");
    let released = wait_until(Duration::from_secs(10), || {
        !std::fs::read_to_string(&state).unwrap().contains(&id)
    });
    assert!(
        released,
        "the address of {name} (id {id}, {address}) was not released: {}",
        std::fs::read_to_string(&state).unwrap()
    );
    // SAFETY: as above.
    unsafe { libc::kill(server_pid, libc::SIGCONT) };
    // The follow-up is overdue: it runs at once; a ping answered after it.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(call(r#"{"op":"ping"}"#)["ok"], true);
    let log = std::fs::read_to_string(root.path().join("run/serve.log")).unwrap_or_default();
    assert!(!log.contains("has no address"), "{log}");
    assert!(!log.contains("ERROR"), "{log}");
    drop(lock);
    wait_for(
        "the clone's end to be recorded",
        Duration::from_secs(10),
        || root.status(&name).as_deref() == Some("exited"),
    );
    // SAFETY: as above.
    unsafe { libc::kill(server_pid, libc::SIGTERM) };
    assert!(server.wait().unwrap().success());
    root.ok(&["rm", "-f", &name]);
}

/// A field of `/proc/PID/smaps_rollup`, in bytes.
fn rollup_bytes(pid: i32, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .unwrap_or_else(|| panic!("{key} in smaps_rollup of {pid}: {text}"))
        * 1024
}

/// Freezing collapses the template's filled anonymous memory into huge pages
/// (fewer page-table entries for each fork to copy): the template's resident
/// memory does not grow, a clone reads the same bytes, and a clone writing a
/// byte in eight different 2 MiB ranges gets eight small pages, not eight huge ones.
#[test]
fn freeze_collapses_the_templates_memory_into_huge_pages() {
    let Some(root) = TestRoot::new("freeze_collapses_the_templates_memory_into_huge_pages") else {
        return;
    };
    let code = r#"
import signal, time, zlib
data = bytearray(range(256)) * (32 << 12)
open('/tmp/expected', 'w').write(str(zlib.crc32(data)))
def on_usr1(*a):
    seen = zlib.crc32(data)
    for i in range(8):
        data[i * (2 << 20) + 7] ^= 1
    open('/tmp/seen', 'w').write(str(seen))
signal.signal(signal.SIGUSR1, on_usr1)
print('ready', flush=True)
while True:
    time.sleep(3600)
"#;
    root.ok(&["run", "-d", "--name", "tpl", "--", "python3", "-c", code]);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    // The program is pid 2 of its box; it sleeps, so its memory stays put.
    let rollup = root.ok(&["exec", "tpl", "--", "cat", "/proc/2/smaps_rollup"]);
    let rss_before = rollup
        .lines()
        .find_map(|l| l.strip_prefix("Rss:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .unwrap()
        * 1024;
    root.ok(&["freeze", "tpl"]);
    let tpid = template_pid(&root, "tpl");
    let rss_frozen = rollup_bytes(tpid, "Rss:");
    // Only fully populated ranges are collapsed: no page is added (the slack
    // is for the exec above, whose pages the kernel may still account).
    assert!(
        rss_frozen <= rss_before + (512 << 10),
        "resident memory {rss_before} before the freeze, {rss_frozen} after"
    );
    let huge = rollup_bytes(tpid, "AnonHugePages:");
    assert!(
        huge >= 16 << 20,
        "template's anonymous memory in huge pages: {huge} bytes"
    );
    root.ok(&[
        "clone",
        "tpl",
        "-d",
        "--name",
        "c1",
        "--on-clone-signal",
        "USR1",
    ]);
    wait_for("the clone's checksum", Duration::from_secs(10), || {
        root.run(&["exec", "c1", "--", "cat", "/tmp/seen"]).code == 0
    });
    let expected = root.ok(&["exec", "c1", "--", "cat", "/tmp/expected"]);
    let seen = root.ok(&["exec", "c1", "--", "cat", "/tmp/seen"]);
    assert_eq!(seen, expected, "the clone reads the template's bytes");
    let private = rollup_bytes(clone_pid(&root, "c1"), "Private_Dirty:");
    assert!(
        private < 8 << 20,
        "a clone that wrote into eight huge pages holds {private} bytes of its own"
    );
    root.ok(&["rm", "-f", "c1", "tpl"]);
}

/// A server that holds connections it is asked to hold and, asked anything
/// else, tells what reading each held connection gives now.
const HOLDER: &str = r#"
import socket
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind(('0.0.0.0', 8080))
l.listen(8)
held = []
print('ready', flush=True)
while True:
    c, _ = l.accept()
    if c.recv(100).startswith(b'hold'):
        held.append(c)
        continue
    out = []
    for h in held:
        h.setblocking(False)
        try:
            out.append('eof' if h.recv(10) == b'' else 'data')
        except ConnectionResetError:
            out.append('reset')
        except BlockingIOError:
            out.append('open')
        except OSError as e:
            out.append(type(e).__name__)
    c.sendall((' '.join(out) + '\n').encode())
    c.close()
"#;

/// A TCP connection that was reset while the template held it keeps its local
/// address (the template's own bridge address): the clone gets a reset
/// placeholder for it (its first read fails with ECONNRESET), not a socket
/// bound again to an address the clone does not have.
#[test]
fn a_reset_connection_held_by_the_template_is_a_reset_placeholder_in_clones() {
    use std::io::Write;
    let Some(root) =
        TestRoot::new("a_reset_connection_held_by_the_template_is_a_reset_placeholder_in_clones")
    else {
        return;
    };
    root.ok(&["run", "-d", "--name", "tpl", "--", "python3", "-c", HOLDER]);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    let v: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", "tpl"])).unwrap();
    let addr = v["state"]["network"]["address"]
        .as_str()
        .unwrap()
        .to_string();
    let mut conn = std::net::TcpStream::connect((addr.as_str(), 8080)).unwrap();
    conn.write_all(b"hold").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    // SO_LINGER 0: closing sends a reset.
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads one linger struct from a live local.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&conn),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
    drop(conn);
    std::thread::sleep(Duration::from_millis(200));
    root.ok(&["freeze", "tpl"]);
    root.ok(&["clone", "tpl", "-d", "--name", "c1"]);
    let ask = "import socket; s = socket.create_connection(('127.0.0.1', 8080)); \
               s.sendall(b'ask'); print(s.recv(100).decode().strip())";
    let out = root.ok(&["exec", "c1", "--", "python3", "-c", ask]);
    assert_eq!(
        out.trim(),
        "reset",
        "the held connection reads as reset in the clone"
    );
    root.ok(&["rm", "-f", "c1", "tpl"]);
}

/// Pool records on disk (`pool.*` names), whether their clone has a process
/// yet or not (box shells of the root's pool, `pool.shell.*`, are not clones).
fn pool_records(root: &TestRoot) -> usize {
    std::fs::read_dir(root.path().join("run/boxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| {
                    n.starts_with("pool.")
                        && !n.starts_with("pool.shell.")
                        && !n.starts_with("pool.mk.")
                })
                .count()
        })
        .unwrap_or(0)
}

/// Claims made at once each start a refill; the refills take turns, so the
/// pool comes back to its size, not to its size times the claims.
#[test]
fn serial_concurrent_claims_refill_the_pool_to_its_size_only() {
    let Some(root) = TestRoot::new("serial_concurrent_claims_refill_the_pool_to_its_size_only")
    else {
        return;
    };
    frozen_pooled_server(&root, "tpl", 1, 3);
    assert_eq!(pooled(&root), 3);
    let claims: Vec<_> = (0..3)
        .map(|i| root.spawn(&["clone", "tpl", "-d", "--name", &format!("c{i}")]))
        .collect();
    for claim in claims {
        let out = claim.wait_with_output().unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    wait_for("the pool to refill", Duration::from_secs(60), || {
        pooled(&root) == 3
    });
    // Every refill has run (each waits 100 ms, then for the one before it).
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(pooled(&root), 3, "pooled clones once the refills are done");
    assert_eq!(
        pool_records(&root),
        3,
        "pool records once the refills are done"
    );
    root.ok(&["rm", "-f", "c0", "c1", "c2", "tpl"]);
}

/// A clone frozen in turn is a template like any other: its clones see the
/// files of every template below it (its template's layer under its own),
/// not only of the one they were cloned from.
#[test]
fn a_clone_of_a_frozen_clone_sees_every_layer_below() {
    let Some(root) = TestRoot::new("a_clone_of_a_frozen_clone_sees_every_layer_below") else {
        return;
    };
    root.detached_sh("first", &[], "echo one > /tmp/one; exec sleep infinity");
    wait_for("/tmp/one", Duration::from_secs(10), || {
        root.run(&["exec", "first", "--", "cat", "/tmp/one"]).code == 0
    });
    root.ok(&["freeze", "first"]);
    root.ok(&["clone", "first", "-d", "--name", "second"]);
    root.ok(&["exec", "second", "--", "sh", "-c", "echo two > /tmp/two"]);
    root.ok(&["freeze", "second"]);
    root.ok(&["clone", "second", "-d", "--name", "third"]);
    let out = root.ok(&["exec", "third", "--", "sh", "-c", "cat /tmp/one /tmp/two"]);
    assert_eq!(out, "one\ntwo\n");
    // Its writes stay its own.
    root.ok(&["exec", "third", "--", "sh", "-c", "echo three > /tmp/one"]);
    root.ok(&["clone", "second", "-d", "--name", "fourth"]);
    assert_eq!(
        root.ok(&["exec", "fourth", "--", "cat", "/tmp/one"]),
        "one\n"
    );
    root.ok(&["rm", "-f", "third", "fourth", "second", "first"]);
    wait_for("the templates to go", Duration::from_secs(20), || {
        box_names(&root).is_empty()
    });
}

/// A clone's pid namespace is made below its template's, and Linux nests pid
/// namespaces at most 32 deep: a line of clones of clones (each frozen and
/// cloned in turn, as repeated E2B forks of one sandbox do) ends at 31
/// generations with a refusal that names the limit and makes nothing, while
/// the templates before it still clone.
#[test]
fn a_line_of_clones_of_clones_ends_at_the_kernels_pid_namespace_depth() {
    let Some(root) =
        TestRoot::new("a_line_of_clones_of_clones_ends_at_the_kernels_pid_namespace_depth")
    else {
        return;
    };
    root.detached_sh("g0", &["--network", "none"], "exec sleep infinity");
    let mut made = 0;
    loop {
        root.ok(&["freeze", &format!("g{made}")]);
        let next = format!("g{}", made + 1);
        let out = root.run(&["clone", &format!("g{made}"), "-d", "--name", &next]);
        if out.code != 0 {
            assert_error(
                &out,
                125,
                "pid namespaces deep, and Linux nests them at most 32 deep: it cannot be cloned again",
            );
            assert!(!box_names(&root).contains(&next), "{next} was not made");
            break;
        }
        made += 1;
        assert!(made <= 40, "no limit met after {made} generations");
    }
    // The first box's namespace is one below the host's.
    assert_eq!(made, 31, "generations of clones");
    root.ok(&["clone", "g30", "-d", "--name", "side"]);
    assert_eq!(root.ok(&["exec", "side", "--", "echo", "ok"]), "ok\n");
    let mut all: Vec<String> = (0..=made).rev().map(|g| format!("g{g}")).collect();
    all.insert(0, "side".into());
    let mut args = vec!["rm", "-f"];
    args.extend(all.iter().map(String::as_str));
    root.ok(&args);
    wait_for("the templates to go", Duration::from_secs(60), || {
        box_names(&root).is_empty()
    });
}

/// Each clone's fork leaves intermediate processes to its template's init,
/// one of them with a pid in the clone's pid namespace. The init reaps them
/// before the template is frozen again: a zombie left there would keep the
/// clone's pid namespace alive, and the clone could not end (`rm -f` would
/// wait for it) until the template ran again.
#[test]
fn a_clone_leaves_no_unreaped_process_to_its_frozen_template() {
    let Some(root) = TestRoot::new("a_clone_leaves_no_unreaped_process_to_its_frozen_template")
    else {
        return;
    };
    frozen_server(&root, "tpl", 1);
    let init = root.inspect("tpl")["state"]["init"]["pid"]
        .as_i64()
        .expect("the template's init pid");
    let zombies = || -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|p| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).ok()?;
                let state = &stat[stat.rfind(')')? + 2..];
                state.starts_with('Z').then(|| stat.trim().to_string())
            })
            .collect()
    };
    // Busy threads on every CPU: the template's init competes for one while
    // the clone is made (the window in which it must reap).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let spinners: Vec<_> = (0..cpus + 1)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    for i in 0..20 {
        let name = format!("c{i}");
        root.ok(&["clone", "tpl", "-d", "--name", &name]);
        assert_eq!(
            zombies(),
            Vec::<String>::new(),
            "unreaped children of the frozen template's init after clone {name}"
        );
        // The clone ends at once while its template stays frozen.
        root.ok(&["rm", "-f", &name]);
        assert_eq!(box_names(&root), vec!["tpl".to_string()]);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in spinners {
        s.join().unwrap();
    }
    root.ok(&["rm", "-f", "tpl"]);
}
