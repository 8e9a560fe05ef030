//! Monitors seen from inside a box (`run --monitor`): a trace log holds
//! exactly the subscribed calls; a denied open fails with the chosen errno and
//! a redirected one reads the other file; a connect outside the allow-list
//! fails with the chosen errno while an allowed one connects; three monitors
//! apply in order; a monitor written in Python with the repo's client library
//! answers the box's calls; bad input and boxes that cannot carry monitors
//! fail in one line and leave nothing. Monitors attached to a running box
//! (`monitor attach`) act from then on, on every process and thread and on
//! later children; `monitor detach` lets every call through while the filter
//! stays; refusals and a failure halfway say so in one line. The packet
//! inspector runs from the start or attached later, alone or with call
//! monitors, and its rules go on `detach`.

mod common;

use std::time::Duration;

use common::*;

/// A directory with a secret, a public file and another file, mounted at /v.
fn files(root: &TestRoot) -> String {
    let dir = root.path().join("v");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("secret"), "the secret\n").unwrap();
    std::fs::write(dir.join("public"), "public\n").unwrap();
    std::fs::write(dir.join("other"), "the other file\n").unwrap();
    format!("{}:/v", dir.display())
}

#[test]
fn trace_logs_exactly_the_subscribed_calls() {
    let Some(root) = TestRoot::new("trace_logs_exactly_the_subscribed_calls") else {
        return;
    };
    let v = files(&root);
    let script = "cat /v/public; \
        python3 -c 'import socket; socket.socket().connect_ex((\"192.0.2.1\", 80))'; \
        sleep 60";
    root.run(&[
        "run",
        "-d",
        "--name",
        "tr",
        "-v",
        &v,
        "--network",
        "none",
        "--monitor",
        "trace:openat,connect",
        "--",
        "sh",
        "-c",
        script,
    ])
    .ok();
    let v = root.inspect("tr");
    let log = std::path::PathBuf::from(
        v["trace_log"]
            .as_str()
            .expect("inspect names the trace log"),
    );
    assert_eq!(log, root.path().join("run/boxes/tr/trace.log"));
    let mut text = String::new();
    wait_for(
        "the connect in the trace log",
        Duration::from_secs(20),
        || {
            text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains(" connect(")
        },
    );
    let lines: Vec<&str> = text.lines().collect();
    for l in &lines {
        let call = l.split_whitespace().nth(2).unwrap_or("");
        assert!(
            call.starts_with("openat(") || call.starts_with("connect("),
            "only subscribed calls are logged: {l}\n{text}"
        );
    }
    assert!(
        lines.iter().any(|l| l.ends_with(" path=/v/public")),
        "{text}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" connect(") && l.ends_with(" addr=192.0.2.1:80")),
        "{text}"
    );
    // Pids as the box sees them (its command is pid 2).
    let pids: Vec<u32> = lines
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1)?.parse().ok())
        .collect();
    assert!(pids.iter().all(|p| *p < 100), "box pids: {pids:?}");
    root.rm_all(["tr"]);
}

#[test]
fn files_deny_and_redirect_opens() {
    let Some(root) = TestRoot::new("files_deny_and_redirect_opens") else {
        return;
    };
    let v = files(&root);
    let out = root
        .run(&[
            "run",
            "--rm",
            "-v",
            &v,
            "-w",
            "/v",
            "--network",
            "none",
            "--monitor",
            "files:deny=/v/secret,redirect=/v/alias=>/v/other,errno=EPERM",
            "--",
            "python3",
            "-c",
            "import errno, os\n\
             for p in ['/v/secret', '/v/../v/secret', 'secret']:\n\
             \x20   try:\n\
             \x20       open(p).read(); print(p, 'read')\n\
             \x20   except OSError as e: print(p, errno.errorcode[e.errno])\n\
             print('alias', open('/v/alias').read().strip())\n\
             print('public', open('/v/public').read().strip())\n\
             print('listed', sorted(os.listdir('/v')))",
        ])
        .ok();
    // `secret` is relative to the working directory, /v.
    let want = "/v/secret EPERM\n/v/../v/secret EPERM\nsecret EPERM\n\
        alias the other file\npublic public\nlisted ['other', 'public', 'secret']\n";
    assert_eq!(out.stdout, want, "{out}");
}

#[test]
fn net_allows_listed_destinations_and_refuses_the_others() {
    let Some(root) = TestRoot::new("net_allows_listed_destinations_and_refuses_the_others") else {
        return;
    };
    // A server in the box on loopback (allowed), and a destination outside
    // the list; the allowed connect is made by the monitor with the address
    // it checked, so the server sees a real connection.
    let out = root
        .run(&[
            "run",
            "--rm",
            "--monitor",
            "net:allow=127.0.0.0/8:8080,errno=EACCES",
            "--",
            "python3",
            "-c",
            "import errno, socket, threading\n\
             srv = socket.socket(); srv.bind(('127.0.0.1', 8080)); srv.listen()\n\
             got = []\n\
             t = threading.Thread(target=lambda: got.append(srv.accept()[0].recv(5))); t.start()\n\
             c = socket.socket(); print('allowed', c.connect_ex(('127.0.0.1', 8080)))\n\
             c.sendall(b'hello'); t.join(); print('server got', got[0])\n\
             for a in [('127.0.0.1', 8081), ('192.0.2.1', 8080)]:\n\
             \x20   print(a, errno.errorcode[socket.socket().connect_ex(a)])",
        ])
        .ok();
    assert_eq!(
        out.stdout,
        "allowed 0\nserver got b'hello'\n('127.0.0.1', 8081) EACCES\n('192.0.2.1', 8080) EACCES\n",
        "{out}"
    );
}

#[test]
fn a_stack_of_three_monitors_applies_in_order() {
    let Some(root) = TestRoot::new("a_stack_of_three_monitors_applies_in_order") else {
        return;
    };
    let v = files(&root);
    // Both traces write one log: the first sees every open, the third only
    // what the second (files) let through.
    root.run(&[
        "run",
        "-d",
        "--name",
        "st",
        "-v",
        &v,
        "--network",
        "none",
        "--monitor",
        "trace:openat",
        "--monitor",
        "files:deny=/v/secret",
        "--monitor",
        "trace:openat",
        "--",
        "sh",
        "-c",
        "cat /v/secret; cat /v/public; echo done; sleep 60",
    ])
    .ok();
    root.inspect("st");
    root.wait_log("st", "done", Duration::from_secs(20));
    let text = std::fs::read_to_string(root.path().join("run/boxes/st/trace.log")).unwrap();
    let count = |p: &str| {
        text.lines()
            .filter(|l| l.ends_with(&format!(" path={p}")))
            .count()
    };
    assert_eq!(
        count("/v/secret"),
        1,
        "only the first trace saw it:\n{text}"
    );
    assert_eq!(count("/v/public"), 2, "both traces saw it:\n{text}");
    let logs = root.run(&["logs", "st"]).ok();
    assert!(
        logs.stderr.contains("/v/secret: Permission denied"),
        "{logs}"
    );
    assert!(logs.stdout.contains("public"), "{logs}");
    root.rm_all(["st"]);
}

#[test]
fn a_python_monitor_answers_the_box_through_the_client_library() {
    let Some(root) = TestRoot::new("a_python_monitor_answers_the_box_through_the_client_library")
    else {
        return;
    };
    let v = files(&root);
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let sock = root.path().join("m.sock");
    let events = root.path().join("events.log");
    let program = format!(
        "import sys; sys.path.insert(0, {lib:?})\n\
         import nestbox_monitor as nm\n\
         log = open({events:?}, 'a', buffering=1)\n\
         def decide(e):\n\
         \x20   log.write(f'{{e.box_pid}} {{e.syscall}} {{e.path}} {{e.writes}}\\n')\n\
         \x20   if e.path == '/v/secret': return nm.deny('EACCES')\n\
         \x20   if e.path == '/v/alias': return nm.open_instead('/v/other')\n\
         \x20   if e.path == '/v/public' and e.writes: return nm.deny('EROFS')\n\
         \x20   return nm.CONTINUE\n\
         nm.serve({sock:?}, decide, ready=lambda: print('listening', flush=True))\n",
        lib = repo.join("clients/python").display().to_string(),
        events = events.display().to_string(),
        sock = sock.display().to_string(),
    );
    let mut monitor = std::process::Command::new("python3")
        .args(["-c", &program])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(monitor.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line, "listening\n");
    let _monitor = Kill(monitor);
    let spec = format!("socket:{}:open,openat", sock.display());
    let out = root
        .run(&[
            "run",
            "--rm",
            "-v",
            &v,
            "--network",
            "none",
            "--monitor",
            &spec,
            "--",
            "sh",
            "-c",
            "cat /v/secret; cat /v/alias; echo x >> /v/public; cat /v/public",
        ])
        .ok();
    assert_eq!(out.stdout, "the other file\npublic\n", "{out}");
    assert!(out.stderr.contains("/v/secret: Permission denied"), "{out}");
    assert!(
        out.stderr.contains("/v/public: Read-only file system"),
        "{out}"
    );
    let text = std::fs::read_to_string(&events).unwrap();
    assert!(text.contains(" openat /v/secret False\n"), "{text}");
    assert!(text.contains(" openat /v/public True\n"), "{text}");
    assert!(text.lines().all(|l| l.contains(" open")), "{text}");
}

#[test]
fn monitor_bad_input_fails_clearly_and_leaves_nothing() {
    let Some(root) = TestRoot::new("monitor_bad_input_fails_clearly_and_leaves_nothing") else {
        return;
    };
    let missing = root.path().join("nobody.sock");
    let missing = format!("socket:{}:openat", missing.display());
    for (spec, message) in [
        ("bogus", "--monitor bogus: unknown monitor \"bogus\""),
        (
            "trace:nosuchcall",
            "\"nosuchcall\" is not an x86_64 system call",
        ),
        (
            "files:deny=rel",
            "\"rel\" is not an absolute path in the box",
        ),
        ("net:allow=300.1.1.1", "\"300.1.1.1\" is not an IP address"),
        (missing.as_str(), "nobody.sock: No such file or directory"),
    ] {
        let out = root.run(&["run", "--rm", "--monitor", spec, "--", "true"]);
        assert_error(&out, 125, message);
    }
    assert!(root.names().is_empty(), "no box is left");
    // A monitored box cannot be frozen, cloned, checkpointed or migrated.
    root.run(&[
        "run",
        "-d",
        "--name",
        "mb",
        "--network",
        "none",
        "--monitor",
        "null:getppid",
        "--",
        "sleep",
        "60",
    ])
    .ok();
    root.inspect("mb");
    assert_error(
        &root.run(&["freeze", "mb"]),
        125,
        "box \"mb\" runs under monitors (--monitor): it cannot be frozen or cloned",
    );
    assert_error(
        &root.run(&["checkpoint", "mb"]),
        125,
        "box \"mb\" runs under monitors (--monitor): it cannot be checkpointed",
    );
    assert_eq!(root.status("mb").as_deref(), Some("running"));
    root.rm_all(["mb"]);
}

#[test]
fn node_under_the_net_monitor_reaches_allowed_servers_only() {
    let Some(root) = TestRoot::new("node_under_the_net_monitor_reaches_allowed_servers_only")
    else {
        return;
    };
    // Node connects without blocking (EINPROGRESS, then epoll): the allowed
    // connect made by the monitor must behave the same for it.
    let program = r#"
const http = require("http");
const server = http.createServer((req, res) => res.end("hello from " + req.url));
server.listen(8080, "127.0.0.1", () => {
  http.get("http://127.0.0.1:8080/allowed", (res) => {
    let body = "";
    res.on("data", (d) => (body += d));
    res.on("end", () => {
      console.log("allowed:", body);
      const req = http.get("http://127.0.0.2:8080/refused");
      req.on("error", (e) => {
        console.log("refused:", e.code);
        server.close();
      });
    });
  });
});
"#;
    let out = root
        .run(&[
            "run",
            "--rm",
            "--monitor",
            "net:allow=127.0.0.1:8080",
            "--monitor",
            "trace:connect",
            "--",
            "node",
            "-e",
            program,
        ])
        .ok();
    assert_eq!(
        out.stdout, "allowed: hello from /allowed\nrefused: ECONNREFUSED\n",
        "{out}"
    );
}

#[test]
fn debug_attaches_gdb_from_outside_without_weakening_the_box() {
    let Some(root) = TestRoot::new("debug_attaches_gdb_from_outside_without_weakening_the_box")
    else {
        return;
    };
    let caps = |name: &str| root.ok(&["exec", name, "--", "grep", "^CapEff", "/proc/2/status"]);
    root.run(&[
        "run",
        "-d",
        "--name",
        "dbg",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        "import time\nprint('ready', flush=True)\nwhile True: time.sleep(0.2)",
    ])
    .ok();
    root.inspect("dbg");
    root.wait_log("dbg", "ready", Duration::from_secs(20));
    let before = caps("dbg");
    let out = root
        .run_timeout(
            &[
                "debug",
                "dbg",
                "--",
                "-batch",
                "-ex",
                "info sharedlibrary",
                "-ex",
                "bt 1",
            ],
            Duration::from_secs(120),
        )
        .ok();
    // The program's libraries, read from the box's root; where it sleeps.
    assert!(
        out.stdout.contains("/root/lib/x86_64-linux-gnu/libc.so.6"),
        "{out}"
    );
    assert!(out.stdout.contains("nanosleep"), "{out}");
    // gdb detached: the box goes on, with the capabilities it had.
    assert_eq!(root.status("dbg").as_deref(), Some("running"));
    assert_eq!(caps("dbg"), before);
    let eff = u64::from_str_radix(before.trim().trim_start_matches("CapEff:").trim(), 16).unwrap();
    assert_eq!(
        eff & (1 << 19),
        0,
        "the box has no CAP_SYS_PTRACE: {before}"
    );
    assert_error(
        &root.run(&["debug", "--pid", "77", "dbg"]),
        125,
        "box \"dbg\" has no process 77",
    );
    assert_error(
        &root.run(&["debug", "nobox"]),
        125,
        "no box named \"nobox\"",
    );
    root.rm_all(["dbg"]);
}

/// `monitor ls --json NAME`: the attached stack (null when none).
fn attached(root: &TestRoot, name: &str) -> serde_json::Value {
    let out = root.run(&["monitor", "ls", "--json", name]).ok();
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("ls is not JSON: {e}\n{out}"))
}

/// The host pids of the processes of box `name` (its cgroup's).
fn box_pids(root: &TestRoot, name: &str) -> Vec<i32> {
    let v = root.inspect(name);
    v["pids"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_i64())
                .map(|p| p as i32)
                .collect()
        })
        .unwrap_or_default()
}

/// `Seccomp_filters` of `/proc/PID/status` (or of one of its threads).
fn seccomp_filters(path: &str) -> u32 {
    let status = std::fs::read_to_string(format!("{path}/status")).unwrap_or_default();
    status_field(&status, "Seccomp_filters")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn attach_traces_the_opens_of_a_running_box_from_then_on() {
    let Some(root) = TestRoot::new("attach_traces_the_opens_of_a_running_box_from_then_on") else {
        return;
    };
    let v = files(&root);
    root.detached_sh(
        "at",
        &["-v", &v, "--network", "none"],
        "cat /v/other >/dev/null; echo started; \
         while :; do cat /v/public >/dev/null; echo tick; sleep 0.1; done",
    );
    root.wait_logged("at", "tick", Duration::from_secs(20));
    let log = root.path().join("run/boxes/at/trace.log");
    assert!(!log.exists(), "no trace before the attach");
    assert_eq!(attached(&root, "at"), serde_json::Value::Null);
    let out = root
        .run(&["monitor", "attach", "at", "--monitor", "trace:openat"])
        .ok();
    assert!(out.stdout.starts_with("attached\ttrace:openat"), "{out}");
    let a = attached(&root, "at");
    assert_eq!(a["state"], "attached", "{a}");
    assert_eq!(a["monitors"], serde_json::json!(["trace:openat"]), "{a}");
    let server = a["server_pid"].as_i64().unwrap() as i32;
    assert!(pid_alive(server), "{a}");
    let v = root.inspect("at");
    assert_eq!(
        v["attached_monitors"], a,
        "inspect shows the attached stack"
    );
    assert_eq!(v["trace_log"].as_str(), log.to_str(), "{v}");
    let mut text = String::new();
    wait_for("opens in the trace log", Duration::from_secs(20), || {
        text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines()
            .filter(|l| l.ends_with(" path=/v/public"))
            .count()
            >= 3
    });
    assert!(
        !text.contains("/v/other"),
        "an open before the attach is not logged: {text}"
    );
    for l in text.lines() {
        let call = l.split_whitespace().nth(2).unwrap_or("");
        assert!(call.starts_with("openat("), "only openat: {l}");
    }
    // The box keeps running and looping.
    let ticks = root.ok(&["logs", "at"]).matches("tick").count();
    wait_for("the box to go on", Duration::from_secs(20), || {
        root.ok(&["logs", "at"]).matches("tick").count() > ticks + 3
    });
    assert_eq!(root.status("at").as_deref(), Some("running"));
    // A second attach while one is on is refused in one line.
    assert_error(
        &root.run(&["monitor", "attach", "at", "--monitor", "null:getppid"]),
        125,
        "box \"at\" already has monitors attached (trace:openat): detach them first",
    );
    // An attached box cannot be frozen (its copies would share the filter).
    assert_error(
        &root.run(&["freeze", "at"]),
        125,
        "box \"at\" has monitors attached (nestbox monitor attach): it cannot be frozen or cloned",
    );
    assert_eq!(root.status("at").as_deref(), Some("running"));
    root.rm_all(["at"]);
    wait_for(
        "the attached server to end",
        Duration::from_secs(20),
        || !pid_alive(server),
    );
}

/// A Python loop that reads /v/secret every 0.1 s and prints `read` or the
/// errno's name.
const SECRET_LOOP: &str = "import errno, time\n\
while True:\n\
\x20   try:\n\
\x20       open('/v/secret').read(); r = 'read'\n\
\x20   except OSError as e:\n\
\x20       r = errno.errorcode[e.errno]\n\
\x20   print(r, flush=True); time.sleep(0.1)\n";

/// The lines of box `name`'s log.
fn log_lines(root: &TestRoot, name: &str) -> Vec<String> {
    root.ok(&["logs", name])
        .lines()
        .map(str::to_string)
        .collect()
}

/// Wait until box `name` printed `count` lines after its first `from`, and
/// return those (the one in flight at `from` skipped).
fn lines_after(root: &TestRoot, name: &str, from: usize, count: usize) -> Vec<String> {
    let mut lines = Vec::new();
    wait_for("new lines in the log", Duration::from_secs(20), || {
        lines = log_lines(root, name);
        lines.len() >= from + 1 + count
    });
    lines[from + 1..].to_vec()
}

#[test]
fn attach_files_deny_fails_opens_of_a_running_box_with_the_errno() {
    let Some(root) = TestRoot::new("attach_files_deny_fails_opens_of_a_running_box_with_the_errno")
    else {
        return;
    };
    let v = files(&root);
    root.run(&[
        "run",
        "-d",
        "--name",
        "fd",
        "-v",
        &v,
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        SECRET_LOOP,
    ])
    .ok();
    root.wait_logged("fd", "read", Duration::from_secs(20));
    assert!(log_lines(&root, "fd").iter().all(|l| l == "read"));
    root.run(&[
        "monitor",
        "attach",
        "fd",
        "--monitor",
        "files:deny=/v/secret,errno=EPERM",
    ])
    .ok();
    let from = log_lines(&root, "fd").len();
    let after = lines_after(&root, "fd", from, 5);
    assert!(after.iter().all(|l| l == "EPERM"), "{after:?}");
    assert_eq!(root.status("fd").as_deref(), Some("running"));
    root.rm_all(["fd"]);
}

#[test]
fn detach_lets_every_call_through_and_the_filter_stays() {
    let Some(root) = TestRoot::new("detach_lets_every_call_through_and_the_filter_stays") else {
        return;
    };
    let v = files(&root);
    root.run(&[
        "run",
        "-d",
        "--name",
        "dt",
        "-v",
        &v,
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        SECRET_LOOP,
    ])
    .ok();
    root.wait_logged("dt", "read", Duration::from_secs(20));
    let py = box_pids(&root, "dt")
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.starts_with("python"))
        })
        .expect("the box's python");
    let before = seccomp_filters(&format!("/proc/{py}"));
    assert_error(
        &root.run(&["monitor", "detach", "dt"]),
        125,
        "box \"dt\" has no monitors attached",
    );
    root.run(&[
        "monitor",
        "attach",
        "dt",
        "--monitor",
        "trace:openat",
        "--monitor",
        "files:deny=/v/secret,errno=EACCES",
    ])
    .ok();
    let from = log_lines(&root, "dt").len();
    let after = lines_after(&root, "dt", from, 3);
    assert!(after.iter().all(|l| l == "EACCES"), "{after:?}");
    let log = root.path().join("run/boxes/dt/trace.log");
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("path=/v/secret"));
    let out = root.run(&["monitor", "detach", "dt"]).ok();
    assert!(out.stdout.starts_with("detached\t"), "{out}");
    assert_eq!(attached(&root, "dt")["state"], "detached");
    let from = log_lines(&root, "dt").len();
    let after = lines_after(&root, "dt", from, 5);
    assert!(after.iter().all(|l| l == "read"), "{after:?}");
    // The trace log grows no more.
    let size = std::fs::metadata(&log).unwrap().len();
    let from = log_lines(&root, "dt").len();
    lines_after(&root, "dt", from, 5);
    assert_eq!(
        std::fs::metadata(&log).unwrap().len(),
        size,
        "nothing logged after detach"
    );
    assert_eq!(root.status("dt").as_deref(), Some("running"));
    // The filter stays (it cannot be removed): one more than before.
    assert_eq!(seccomp_filters(&format!("/proc/{py}")), before + 1);
    // A new stack on the same filter: only the calls it stops.
    assert_error(
        &root.run(&["monitor", "attach", "dt", "--monitor", "trace:connect"]),
        125,
        "box \"dt\" keeps the monitor filter of an earlier attach, which does not stop connect",
    );
    root.run(&[
        "monitor",
        "attach",
        "dt",
        "--monitor",
        "files:deny=/v/secret,errno=ENOENT",
    ])
    .ok();
    let from = log_lines(&root, "dt").len();
    let after = lines_after(&root, "dt", from, 3);
    assert!(after.iter().all(|l| l == "ENOENT"), "{after:?}");
    assert_eq!(seccomp_filters(&format!("/proc/{py}")), before + 1);
    root.rm_all(["dt"]);
}

#[test]
fn attach_covers_every_process_and_thread_and_later_children() {
    let Some(root) = TestRoot::new("attach_covers_every_process_and_thread_and_later_children")
    else {
        return;
    };
    let v = files(&root);
    // A parent with two threads and a child process; once /v/fork exists the
    // parent forks one more child. Each loop prints its tag and what the
    // open of /v/secret gave, with one unbuffered write: a child forked
    // while another thread was inside `print` would find the lock of
    // Python's stdout buffer taken for ever.
    let code = "import errno, os, threading, time\n\
def loop(tag):\n\
\x20   while True:\n\
\x20       try:\n\
\x20           open('/v/secret').read(); r = 'read'\n\
\x20       except OSError as e:\n\
\x20           r = errno.errorcode[e.errno]\n\
\x20       os.write(1, f'{tag} {r}\\n'.encode()); time.sleep(0.1)\n\
if os.fork() == 0:\n\
\x20   loop('child')\n\
for t in ('t1', 't2'):\n\
\x20   threading.Thread(target=loop, args=(t,), daemon=True).start()\n\
def forker():\n\
\x20   while not os.path.exists('/v/fork'):\n\
\x20       time.sleep(0.05)\n\
\x20   if os.fork() == 0:\n\
\x20       loop('late')\n\
threading.Thread(target=forker, daemon=True).start()\n\
loop('main')\n";
    root.run(&[
        "run",
        "-d",
        "--name",
        "mp",
        "-v",
        &v,
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        code,
    ])
    .ok();
    for tag in ["main", "t1", "t2", "child"] {
        root.wait_logged("mp", &format!("{tag} read"), Duration::from_secs(20));
    }
    let init = root.inspect("mp")["state"]["init_pid"].as_i64().unwrap() as i32;
    root.run(&[
        "monitor",
        "attach",
        "mp",
        "--monitor",
        "files:deny=/v/secret,errno=EPERM",
    ])
    .ok();
    let a = attached(&root, "mp");
    assert_eq!(a["processes"].as_array().map(Vec::len), Some(2), "{a}");
    std::fs::write(root.path().join("v/fork"), "").unwrap();
    let from = log_lines(&root, "mp").len();
    let mut after = Vec::new();
    let tags = ["main", "t1", "t2", "child", "late"];
    let denied =
        |after: &[String], t: &str| after.iter().filter(|l| **l == format!("{t} EPERM")).count();
    let all_denied = wait_until(Duration::from_secs(20), || {
        after = log_lines(&root, "mp")[from..].to_vec();
        tags.iter().all(|t| denied(&after, t) >= 2)
    });
    if !all_denied {
        // What each process of the box is doing, to tell a stuck one.
        let states: Vec<String> = box_pids(&root, "mp")
            .iter()
            .flat_map(|p| {
                std::fs::read_dir(format!("/proc/{p}/task"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(move |t| {
                        let dir = t.path();
                        let status =
                            std::fs::read_to_string(dir.join("status")).unwrap_or_default();
                        let wchan = std::fs::read_to_string(dir.join("wchan")).unwrap_or_default();
                        format!(
                            "{p}/{}: {} {} wchan={wchan}",
                            t.file_name().to_string_lossy(),
                            status_field(&status, "Name").unwrap_or_default(),
                            status_field(&status, "State").unwrap_or_default(),
                        )
                    })
            })
            .collect();
        panic!(
            "not every loop was denied twice within 20 s: {:?}\nthe box's threads: {states:#?}\nthe lines after the attach: {after:?}",
            tags.map(|t| (t, denied(&after, t)))
        );
    }
    // Once a loop is denied it is never let through again.
    for tag in ["main", "t1", "t2", "child", "late"] {
        let mine: Vec<&String> = after
            .iter()
            .filter(|l| l.starts_with(&format!("{tag} ")))
            .collect();
        let first = mine.iter().position(|l| l.ends_with(" EPERM")).unwrap();
        assert!(
            mine[first..].iter().all(|l| l.ends_with(" EPERM")),
            "{tag}: {mine:?}"
        );
    }
    // Every thread of every process but the init carries the filter.
    let pids = box_pids(&root, "mp");
    assert!(pids.len() >= 4, "{pids:?}");
    for p in pids.iter().filter(|p| **p != init) {
        for t in std::fs::read_dir(format!("/proc/{p}/task")).unwrap() {
            let t = t.unwrap().path();
            assert_eq!(
                seccomp_filters(t.to_str().unwrap()),
                2,
                "{}: the box's filter and the monitor filter",
                t.display()
            );
        }
    }
    assert_eq!(
        seccomp_filters(&format!("/proc/{init}")),
        0,
        "the init is not monitored"
    );
    root.rm_all(["mp"]);
}

/// The attached servers of `root` still running (found by their command
/// line, which names the root).
fn servers_of(root: &TestRoot) -> Vec<i32> {
    let want = root.path().to_string_lossy().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm"))
                .is_ok_and(|c| c.trim() == "nestbox-attach")
                && std::fs::read(format!("/proc/{p}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&want))
        })
        .collect()
}

#[test]
fn attach_refusals_fail_in_one_line_and_leave_the_box_as_it_was() {
    let Some(root) = TestRoot::new("attach_refusals_fail_in_one_line_and_leave_the_box_as_it_was")
    else {
        return;
    };
    let attach = |name: &str, spec: &str| root.run(&["monitor", "attach", name, "--monitor", spec]);
    root.run(&["run", "--name", "ex", "--network", "none", "--", "true"])
        .ok();
    assert_error(
        &attach("ex", "trace:openat"),
        125,
        "box \"ex\" is not running",
    );
    assert_error(
        &attach("nobox", "trace:openat"),
        125,
        "no box named \"nobox\"",
    );
    root.detached_sh("rb", &["--network", "none"], "exec sleep 60");
    let pids = box_pids(&root, "rb");
    let filters: Vec<u32> = pids
        .iter()
        .map(|p| seccomp_filters(&format!("/proc/{p}")))
        .collect();
    for (spec, message) in [
        ("bogus", "--monitor bogus: unknown monitor \"bogus\""),
        (
            "trace:nosuchcall",
            "\"nosuchcall\" is not an x86_64 system call",
        ),
        (
            "files:deny=rel",
            "\"rel\" is not an absolute path in the box",
        ),
    ] {
        assert_error(&attach("rb", spec), 125, message);
    }
    // A box under monitors from its start: the kernel allows one listener.
    root.run(&[
        "run",
        "-d",
        "--name",
        "rm0",
        "--network",
        "none",
        "--monitor",
        "null:getppid",
        "--",
        "sleep",
        "60",
    ])
    .ok();
    assert_error(
        &attach("rm0", "trace:openat"),
        125,
        "box \"rm0\" runs under monitors from its start (--monitor)",
    );
    // A process already traced (a debugger): refused before anything is done.
    let sleeper = pids
        .iter()
        .copied()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "sleep")
        })
        .expect("the box's sleep");
    let mut gdb = std::process::Command::new("gdb")
        .args([
            "-q",
            "-batch",
            "-p",
            &sleeper.to_string(),
            "-ex",
            "shell sleep 30",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("gdb (scripts/setup.sh installs it)");
    let traced = || {
        let s = std::fs::read_to_string(format!("/proc/{sleeper}/status")).unwrap_or_default();
        status_field(&s, "TracerPid").is_some_and(|t| t != "0")
    };
    wait_for("gdb to attach", Duration::from_secs(20), traced);
    assert_error(
        &attach("rb", "trace:openat"),
        125,
        &format!("attaching monitors to box \"rb\": process {sleeper}: is already traced by pid"),
    );
    let _ = gdb.kill();
    let _ = gdb.wait();
    wait_for("gdb to let go", Duration::from_secs(20), || !traced());
    // A frozen box (a template).
    root.detached_sh("fz", &["--network", "none"], "sleep 60");
    root.run(&["freeze", "fz"]).ok();
    assert_error(
        &attach("fz", "trace:openat"),
        125,
        "box \"fz\" is frozen (a template): monitors cannot be attached to its processes",
    );
    // Nothing was done: no server, no state, no extra filter, still running.
    assert!(servers_of(&root).is_empty(), "no attached server is left");
    for name in ["rb", "rm0"] {
        assert_eq!(attached(&root, name), serde_json::Value::Null);
        assert_eq!(root.status(name).as_deref(), Some("running"));
    }
    let now: Vec<u32> = pids
        .iter()
        .map(|p| seccomp_filters(&format!("/proc/{p}")))
        .collect();
    assert_eq!(now, filters, "no filter was added");
    root.rm_all(["ex", "rb", "rm0", "fz"]);
}

#[test]
fn rm_f_of_a_box_with_monitors_attached_ends_its_server() {
    let Some(root) = TestRoot::new("rm_f_of_a_box_with_monitors_attached_ends_its_server") else {
        return;
    };
    root.detached_sh(
        "rf",
        &["--network", "none"],
        "while :; do cat /etc/hostname >/dev/null; sleep 0.1; done",
    );
    root.run(&["monitor", "attach", "rf", "--monitor", "trace:openat"])
        .ok();
    let server = attached(&root, "rf")["server_pid"].as_i64().unwrap() as i32;
    assert_eq!(servers_of(&root), vec![server]);
    root.rm_all(["rf"]);
    wait_for(
        "the attached server to end",
        Duration::from_secs(20),
        || servers_of(&root).is_empty(),
    );
    assert!(!root.path().join("run/boxes/rf").exists());
    assert!(root.names().is_empty());
}

#[test]
fn attach_failing_halfway_serves_the_processes_done_pass_through() {
    let Some(root) = TestRoot::new("attach_failing_halfway_serves_the_processes_done_pass_through")
    else {
        return;
    };
    let v = files(&root);
    // The parent loops on /v/secret; its child (a higher pid, attached to
    // after it) has a thread with a seccomp filter of its own, so the
    // kernel refuses a filter for all its threads (TSYNC: ESRCH).
    let code = "import ctypes, errno, os, struct, threading, time\n\
def own_filter():\n\
\x20   libc = ctypes.CDLL(None, use_errno=True)\n\
\x20   insn = ctypes.create_string_buffer(struct.pack('HBBI', 6, 0, 0, 0x7fff0000))\n\
\x20   class Prog(ctypes.Structure):\n\
\x20       _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]\n\
\x20   prog = Prog(1, ctypes.addressof(insn))\n\
\x20   assert libc.prctl(22, 2, ctypes.byref(prog)) == 0, ctypes.get_errno()\n\
\x20   print('own filter', flush=True)\n\
\x20   time.sleep(600)\n\
if os.fork() == 0:\n\
\x20   threading.Thread(target=own_filter).start()\n\
\x20   time.sleep(600)\n\
while True:\n\
\x20   try:\n\
\x20       open('/v/secret').read(); r = 'read'\n\
\x20   except OSError as e:\n\
\x20       r = errno.errorcode[e.errno]\n\
\x20   print(r, flush=True); time.sleep(0.1)\n";
    root.run(&[
        "run",
        "-d",
        "--name",
        "hw",
        "-v",
        &v,
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        code,
    ])
    .ok();
    root.wait_logged("hw", "own filter", Duration::from_secs(20));
    root.wait_logged("hw", "read", Duration::from_secs(20));
    let out = root.run(&[
        "monitor",
        "attach",
        "hw",
        "--monitor",
        "files:deny=/v/secret,errno=EPERM",
    ]);
    assert_error(
        &out,
        125,
        "monitors attached to 1 of the box's processes only (a filter cannot be removed: those are served pass-through until the box ends): attaching monitors to box \"hw\": process",
    );
    assert!(
        out.stderr
            .contains("its threads have different seccomp filters"),
        "{out}"
    );
    let a = attached(&root, "hw");
    assert_eq!(a["state"], "detached", "{a}");
    assert_eq!(a["complete"], false, "{a}");
    assert_eq!(a["processes"].as_array().map(Vec::len), Some(1), "{a}");
    // The process done is served pass-through: its opens go on.
    let from = log_lines(&root, "hw").len();
    let after = lines_after(&root, "hw", from, 5);
    assert!(
        after.iter().all(|l| l == "read" || l == "own filter"),
        "{after:?}"
    );
    assert_eq!(root.status("hw").as_deref(), Some("running"));
    // Such a filter is never switched on again.
    assert_error(
        &root.run(&[
            "monitor",
            "attach",
            "hw",
            "--monitor",
            "files:deny=/v/secret",
        ]),
        125,
        "box \"hw\" keeps a monitor filter attached to only some of its processes",
    );
    root.rm_all(["hw"]);
    wait_for(
        "the attached server to end",
        Duration::from_secs(20),
        || servers_of(&root).is_empty(),
    );
}

#[test]
fn two_attaches_at_once_one_serves_the_other_is_refused() {
    let Some(root) = TestRoot::new("two_attaches_at_once_one_serves_the_other_is_refused") else {
        return;
    };
    root.detached_sh(
        "tw",
        &["--network", "none"],
        "while :; do cat /etc/hostname >/dev/null; sleep 0.1; done",
    );
    let spawn = |spec: &str| root.spawn(&["monitor", "attach", "tw", "--monitor", spec]);
    let (a, b) = (spawn("trace:openat"), spawn("null:openat"));
    let outs = [
        finish(a, None, Duration::from_secs(60), "attach a".into()),
        finish(b, None, Duration::from_secs(60), "attach b".into()),
    ];
    let ok: Vec<&Out> = outs.iter().filter(|o| o.code == 0).collect();
    assert_eq!(ok.len(), 1, "exactly one attach serves: {outs:?}");
    let refused = outs.iter().find(|o| o.code != 0).unwrap();
    assert_error(refused, 125, "box \"tw\" already has monitors attached");
    assert_eq!(servers_of(&root).len(), 1, "one server");
    assert_eq!(root.status("tw").as_deref(), Some("running"));
    root.rm_all(["tw"]);
    wait_for(
        "the attached server to end",
        Duration::from_secs(20),
        || servers_of(&root).is_empty(),
    );
}

/// `nft list ruleset` in the network namespace of box `name`, from the host.
fn box_ruleset(root: &TestRoot, name: &str) -> String {
    let pid = root.inspect(name)["state"]["init"]["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("box {name} has an init pid"));
    let out = std::process::Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-n", "nft", "list", "ruleset"])
        .output()
        .expect("nsenter nft");
    assert!(out.status.success(), "nft list ruleset in {name}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn packets_drops_and_logs_by_pattern_between_two_bridged_boxes() {
    let Some(root) = TestRoot::new("packets_drops_and_logs_by_pattern_between_two_bridged_boxes")
    else {
        return;
    };
    // The receiver prints every datagram, and every TCP connection's data
    // once it ends (or after 4 s of silence), in arrival order.
    let receiver = "import socket, sys, threading\n\
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 9000))\n\
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
t.bind(('0.0.0.0', 9001)); t.listen()\n\
lock = threading.Lock()\n\
def say(s):\n\
\x20   with lock: print(s, flush=True)\n\
def udp():\n\
\x20   while True: say('udp ' + u.recv(100).decode())\n\
def conn(c):\n\
\x20   c.settimeout(4); data = b''\n\
\x20   try:\n\
\x20       while True:\n\
\x20           d = c.recv(100)\n\
\x20           if not d: break\n\
\x20           data += d\n\
\x20   except OSError: pass\n\
\x20   say('tcp ' + repr(data.decode()))\n\
def tcp():\n\
\x20   while True: threading.Thread(target=conn, args=(t.accept()[0],)).start()\n\
threading.Thread(target=udp).start(); threading.Thread(target=tcp).start()\n\
say('listening')\n";
    // The receiver logs what it receives holding HELLO (dir=in).
    root.ok(&[
        "run",
        "-d",
        "--name",
        "rx",
        "--monitor",
        "packets:log=HELLO,dir=in",
        "--",
        "python3",
        "-c",
        receiver,
    ]);
    // A box without the inspector.
    root.ok(&["run", "-d", "--name", "plain", "--", "sleep", "600"]);
    root.wait_logged("rx", "listening", Duration::from_secs(30));
    let rx = root.inspect("rx")["state"]["network"]["address"]
        .as_str()
        .expect("rx has an address")
        .to_string();
    // The sender: datagrams, one TCP stream of three writes (the middle one
    // logged), and a second stream whose only data holds SECRET.
    let sender = format!(
        "import socket, time\n\
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
for m in ['u1 plain', 'u2 HELLO', 'u3 SECRET', 'u4 plain', 'u5 a SECRET and a HELLO']:\n\
\x20   u.sendto(m.encode(), ('{rx}', 9000)); time.sleep(0.2)\n\
c = socket.create_connection(('{rx}', 9001)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n\
for m in ['t1 plain;', 't2 HELLO;', 't3 plain;']:\n\
\x20   c.sendall(m.encode()); time.sleep(0.3)\n\
c.close()\n\
s = socket.create_connection(('{rx}', 9001)); s.sendall(b't4 SECRET;'); time.sleep(0.5); s.close()\n\
u.sendto(b'u6 plain', ('{rx}', 9000))\n\
print('done', flush=True)\n\
time.sleep(600)\n"
    );
    root.ok(&[
        "run",
        "-d",
        "--name",
        "tx",
        "--monitor",
        "packets:drop=SECRET,log=HELLO",
        "--",
        "python3",
        "-c",
        &sender,
    ]);
    root.wait_logged("tx", "done", Duration::from_secs(30));
    root.wait_logged("rx", "udp u6 plain", Duration::from_secs(10));
    // The receiver's TCP connections end (the second by its timeout).
    root.wait_logged("rx", "tcp ''", Duration::from_secs(15));
    let got: Vec<String> = root
        .ok(&["logs", "rx"])
        .lines()
        .filter(|l| *l != "listening")
        .map(String::from)
        .collect();
    // Datagrams in order; the streams in the order they ended (the second,
    // whose data never came, by the receiver's timeout).
    let of = |kind: &str| -> Vec<&str> {
        got.iter()
            .map(String::as_str)
            .filter(|l| l.starts_with(kind))
            .collect()
    };
    assert_eq!(
        of("udp "),
        [
            "udp u1 plain",
            "udp u2 HELLO",
            "udp u4 plain",
            "udp u6 plain"
        ],
        "SECRET never arrives, the rest does, in order: {got:?}"
    );
    assert_eq!(
        of("tcp "),
        ["tcp 't1 plain;t2 HELLO;t3 plain;'", "tcp ''"],
        "{got:?}"
    );
    assert_eq!(got.len(), 6, "{got:?}");
    // The log names the HELLO packets (a datagram, a segment) and the drops,
    // and nothing else.
    let v = root.inspect("tx");
    let log = std::fs::read_to_string(v["trace_log"].as_str().expect("tx has a trace log"))
        .expect("read the trace log");
    let logged: Vec<&str> = log.lines().filter(|l| l.contains(" packet log ")).collect();
    let dropped: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(" packet drop "))
        .collect();
    assert_eq!(
        logged.len() + dropped.len(),
        log.lines().count(),
        "only packet lines: {log}"
    );
    assert!(
        logged
            .iter()
            .all(|l| l.contains("dir=out") && l.ends_with("pattern=\"HELLO\"")),
        "{log}"
    );
    assert!(
        logged.iter().any(|l| l.contains("proto=udp")
            && l.contains(&format!("dst={rx}:9000"))
            && l.contains("len=8 ")),
        "the HELLO datagram is logged: {log}"
    );
    assert!(
        logged.iter().any(|l| l.contains("proto=tcp")
            && l.contains(&format!("dst={rx}:9001"))
            && l.contains("len=9 ")),
        "the HELLO segment is logged: {log}"
    );
    assert_eq!(
        logged.len(),
        2,
        "one line per HELLO packet (u5 holds SECRET too: dropped, not logged): {log}"
    );
    assert!(
        dropped.len() >= 3 && dropped.iter().all(|l| l.ends_with("pattern=\"SECRET\"")),
        "u3, u5 and the SECRET segment (and its retransmissions) are dropped: {log}"
    );
    // The receiver (dir=in) logged the two HELLO packets as it got them.
    let rx_log = std::fs::read_to_string(
        root.inspect("rx")["trace_log"]
            .as_str()
            .expect("rx has a trace log"),
    )
    .expect("read rx's trace log");
    let rx_lines: Vec<&str> = rx_log.lines().collect();
    assert_eq!(rx_lines.len(), 2, "{rx_log}");
    assert!(
        rx_lines.iter().all(|l| l.contains(" packet log dir=in ")
            && l.contains(&format!("dst={rx}:"))
            && l.ends_with("pattern=\"HELLO\"")),
        "{rx_log}"
    );
    // The queue rules are where they were asked for: both ways in the
    // sender's namespace (the default), inbound in the receiver's, none in
    // the plain box.
    let tx_rules = box_ruleset(&root, "tx");
    assert!(
        tx_rules.contains("chain OUTPUT")
            && tx_rules.contains("chain INPUT")
            && tx_rules.contains("oifname != \"lo\" counter")
            && tx_rules.contains("queue num 0"),
        "{tx_rules}"
    );
    assert!(!tx_rules.contains("bypass"), "fail closed: {tx_rules}");
    let rx_rules = box_ruleset(&root, "rx");
    assert!(
        rx_rules.contains("chain INPUT") && !rx_rules.contains("chain OUTPUT"),
        "{rx_rules}"
    );
    let plain_rules = box_ruleset(&root, "plain");
    assert!(!plain_rules.contains("queue"), "{plain_rules}");
    // rm -f ends the monitor process (and its queue thread with it); the
    // rules go with the namespace.
    let monitors =
        [&v, &root.inspect("rx")].map(|b| b["state"]["monitor"]["pid"].as_i64().unwrap() as i32);
    root.rm_all(["tx", "rx", "plain"]);
    assert!(
        wait_until(Duration::from_secs(10), || !monitors
            .iter()
            .any(|m| pid_alive(*m))),
        "the boxes' monitors (the queues' readers) are gone"
    );
    assert!(root.names().is_empty());
}

#[test]
fn packets_refusals_fail_in_one_line_and_leave_nothing() {
    let Some(root) = TestRoot::new("packets_refusals_fail_in_one_line_and_leave_nothing") else {
        return;
    };
    for (opts, message) in [
        (
            &["--network", "none", "--monitor", "packets:drop=SECRET"][..],
            "--monitor packets:drop=SECRET: the packet inspector needs --network bridge",
        ),
        (
            &["--network", "host", "--monitor", "packets:log=x"][..],
            "--monitor packets:log=x: the packet inspector needs --network bridge",
        ),
        (
            &["--monitor", "packets:hex=zz"][..],
            "--monitor packets:hex=zz: \"zz\" is not an even number of hex digits",
        ),
        (
            &["--monitor", "packets:drop="][..],
            "an empty pattern matches everything",
        ),
        (&["--monitor", "packets:dir=out"][..], "expected drop=TEXT"),
    ] {
        let mut args = vec!["run", "--rm"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&["--", "true"]);
        assert_error(&root.run(&args), 125, message);
    }
    assert!(root.names().is_empty(), "no box is left");
    // Attaching it to a running box is refused too.
    root.ok(&[
        "run",
        "-d",
        "--name",
        "p",
        "--network",
        "none",
        "--",
        "sleep",
        "60",
    ]);
    assert_error(
        &root.run(&["monitor", "attach", "p", "--monitor", "packets:drop=x"]),
        125,
        "monitor attach --monitor packets:drop=x: the packet inspector needs a box with --network bridge (box \"p\" has --network none",
    );
    assert_eq!(attached(&root, "p"), serde_json::Value::Null);
    assert!(servers_of(&root).is_empty(), "no server is left");
    root.rm_all(["p"]);
}

/// A UDP receiver on port 9000 that prints `udp MESSAGE` for each datagram.
const UDP_RECEIVER: &str = "import socket\n\
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0', 9000))\n\
print('listening', flush=True)\n\
while True: print('udp ' + u.recv(100).decode(), flush=True)\n";

/// The receiver box `rx` (bridged) started and listening; its address.
fn start_receiver(root: &TestRoot) -> String {
    root.ok(&[
        "run",
        "-d",
        "--name",
        "rx",
        "--",
        "python3",
        "-c",
        UDP_RECEIVER,
    ]);
    root.wait_logged("rx", "listening", Duration::from_secs(30));
    root.inspect("rx")["state"]["network"]["address"]
        .as_str()
        .expect("rx has an address")
        .to_string()
}

/// `rm -f` boxes `names`: the attached server `server` ends with them and
/// no box is left.
fn rm_all_ends_server(root: &TestRoot, names: &[&str], server: i32) {
    root.rm_all(names.iter().copied());
    wait_for(
        "the attached server to end",
        Duration::from_secs(20),
        || !pid_alive(server),
    );
    assert!(root.names().is_empty());
}

/// The datagrams `rx` printed.
fn received(root: &TestRoot) -> Vec<String> {
    log_lines(root, "rx")
        .into_iter()
        .filter_map(|l| l.strip_prefix("udp ").map(str::to_string))
        .collect()
}

/// The lines of box `name`'s trace log that hold `what`.
fn trace_lines(root: &TestRoot, name: &str, what: &str) -> Vec<String> {
    std::fs::read_to_string(root.path().join(format!("run/boxes/{name}/trace.log")))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(what))
        .map(str::to_string)
        .collect()
}

#[test]
fn attach_packets_inspects_a_running_box_and_detach_takes_its_rules_out() {
    let Some(root) =
        TestRoot::new("attach_packets_inspects_a_running_box_and_detach_takes_its_rules_out")
    else {
        return;
    };
    let rx = start_receiver(&root);
    root.ok(&["run", "-d", "--name", "tx", "--", "sleep", "600"]);
    // One datagram from a process started in the box now (`exec`).
    let send = |msg: &str| {
        let code = format!(
            "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'{msg}', ('{rx}', 9000))"
        );
        root.ok(&["exec", "tx", "--", "python3", "-c", &code]);
    };
    let wait_received = |msg: &str| {
        wait_for(
            &format!("rx to receive {msg:?}"),
            Duration::from_secs(20),
            || received(&root).iter().any(|m| m == msg),
        )
    };
    send("e1 SECRET");
    wait_received("e1 SECRET");
    assert!(
        !box_ruleset(&root, "tx").contains("queue"),
        "no rule before"
    );

    let out = root
        .run(&[
            "monitor",
            "attach",
            "tx",
            "--monitor",
            "packets:drop=SECRET,log=HELLO",
        ])
        .ok();
    assert!(
        out.stdout
            .starts_with("attached\tpackets:drop=SECRET,log=HELLO\tprocesses []"),
        "{out}"
    );
    let a = attached(&root, "tx");
    assert_eq!(a["state"], "attached", "{a}");
    assert_eq!(a["processes"], serde_json::json!([]), "no call filter: {a}");
    let server = a["server_pid"].as_i64().unwrap() as i32;
    assert!(pid_alive(server), "{a}");
    let rules = box_ruleset(&root, "tx");
    assert!(
        rules.matches("queue num 0").count() == 4
            && rules.matches("oifname != \"lo\" counter").count() == 2
            && rules.matches("iifname != \"lo\" counter").count() == 2
            && !rules.contains("bypass"),
        "both ways, IPv4 and IPv6, fail closed: {rules}"
    );
    assert!(
        !box_ruleset(&root, "rx").contains("queue"),
        "the other box is not inspected"
    );
    assert_error(
        &root.run(&["freeze", "tx"]),
        125,
        "box \"tx\" has monitors attached (nestbox monitor attach): it cannot be frozen or cloned",
    );
    send("e2 SECRET");
    send("e3 HELLO");
    send("e4 plain");
    wait_received("e4 plain");
    assert_eq!(
        received(&root),
        ["e1 SECRET", "e3 HELLO", "e4 plain"],
        "SECRET is dropped once attached"
    );
    let drops = trace_lines(&root, "tx", " packet drop ");
    let logs = trace_lines(&root, "tx", " packet log ");
    assert!(
        drops.len() == 1
            && drops[0].contains("dir=out proto=udp")
            && drops[0].contains(&format!("dst={rx}:9000"))
            && drops[0].ends_with("pattern=\"SECRET\""),
        "{drops:?}"
    );
    assert!(
        logs.len() == 1 && logs[0].ends_with("pattern=\"HELLO\""),
        "{logs:?}"
    );

    // Detach: the rules go, and with no call filter to keep, the server.
    let out = root.run(&["monitor", "detach", "tx"]).ok();
    assert!(
        out.stdout
            .starts_with("detached\tpackets:drop=SECRET,log=HELLO"),
        "{out}"
    );
    wait_for("the server to end", Duration::from_secs(10), || {
        !pid_alive(server)
    });
    assert_eq!(attached(&root, "tx"), serde_json::Value::Null);
    assert!(
        !box_ruleset(&root, "tx").contains("queue"),
        "the rules are out"
    );
    send("e5 SECRET");
    wait_received("e5 SECRET");

    // Attached again, outbound only, a pattern in hex (SECRET).
    root.run(&[
        "monitor",
        "attach",
        "tx",
        "--monitor",
        "packets:hex=534543524554,dir=out",
    ])
    .ok();
    // (A chain emptied by detach stays, empty.)
    let rules = box_ruleset(&root, "tx");
    assert!(
        rules.matches("queue num 0").count() == 2
            && rules.matches("oifname != \"lo\" counter").count() == 2
            && !rules.contains("iifname"),
        "outbound only, IPv4 and IPv6: {rules}"
    );
    send("e6 SECRET");
    send("e7 plain");
    wait_received("e7 plain");
    assert!(
        !received(&root).iter().any(|m| m == "e6 SECRET"),
        "{:?}",
        received(&root)
    );
    assert_eq!(trace_lines(&root, "tx", " packet drop ").len(), 2);
    let server = attached(&root, "tx")["server_pid"].as_i64().unwrap() as i32;
    rm_all_ends_server(&root, &["tx", "rx"], server);
}

#[test]
fn attach_packets_stacks_with_call_monitors_and_detach_keeps_the_call_filter() {
    let Some(root) =
        TestRoot::new("attach_packets_stacks_with_call_monitors_and_detach_keeps_the_call_filter")
    else {
        return;
    };
    let rx = start_receiver(&root);
    // The sender: a datagram holding SECRET every 0.1 s.
    let sender = format!(
        "import socket, time\n\
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
i = 0\n\
while True:\n\
\x20   i += 1; u.sendto(b'n%d SECRET' % i, ('{rx}', 9000)); time.sleep(0.1)\n"
    );
    root.ok(&["run", "-d", "--name", "tx", "--", "python3", "-c", &sender]);
    let count = || received(&root).len();
    wait_for("datagrams to arrive", Duration::from_secs(20), || {
        count() >= 3
    });
    // Until `n` more `what` lines are in tx's trace log, from `from`.
    let wait_trace = |what: &str, n: usize| {
        let from = trace_lines(&root, "tx", what).len();
        wait_for(
            &format!("{n} more {what:?} lines"),
            Duration::from_secs(20),
            || trace_lines(&root, "tx", what).len() >= from + n,
        );
    };
    // Nothing arrives while `what` lines grow by 5 in the trace log.
    let nothing_arrives = |what: &str| {
        wait_trace(what, 2);
        let before = received(&root);
        wait_trace(what, 5);
        assert_eq!(received(&root), before, "every datagram is dropped");
    };

    let out = root
        .run(&[
            "monitor",
            "attach",
            "tx",
            "--monitor",
            "trace:sendto",
            "--monitor",
            "packets:drop=SECRET",
        ])
        .ok();
    assert!(
        out.stdout
            .starts_with("attached\ttrace:sendto packets:drop=SECRET\t"),
        "{out}"
    );
    let a = attached(&root, "tx");
    assert_ne!(a["processes"], serde_json::json!([]), "a call filter: {a}");
    let server = a["server_pid"].as_i64().unwrap() as i32;
    // Both act: each sendto is logged, each datagram dropped.
    nothing_arrives(" packet drop ");
    assert!(
        trace_lines(&root, "tx", " sendto(").len() >= 5,
        "the calls are traced"
    );

    // Detach: the packets pass, the calls are let through unlogged; the
    // server stays (the call filter cannot be removed).
    root.run(&["monitor", "detach", "tx"]).ok();
    assert!(pid_alive(server), "the server keeps the filter's listener");
    assert_eq!(attached(&root, "tx")["state"], "detached");
    assert!(!box_ruleset(&root, "tx").contains("queue"));
    let logged = std::fs::read_to_string(root.path().join("run/boxes/tx/trace.log")).unwrap();
    let before = count();
    wait_for("datagrams to arrive again", Duration::from_secs(20), || {
        count() >= before + 5
    });
    assert_eq!(
        std::fs::read_to_string(root.path().join("run/boxes/tx/trace.log")).unwrap(),
        logged,
        "nothing is logged once detached"
    );

    // Attached again on the same filter: the inspector alone (it subscribes
    // to no call).
    root.run(&[
        "monitor",
        "attach",
        "tx",
        "--monitor",
        "packets:drop=SECRET",
    ])
    .ok();
    assert_eq!(
        attached(&root, "tx")["server_pid"].as_i64(),
        Some(server as i64)
    );
    let sendto = trace_lines(&root, "tx", " sendto(").len();
    nothing_arrives(" packet drop ");
    assert_eq!(
        trace_lines(&root, "tx", " sendto(").len(),
        sendto,
        "the calls are no longer traced"
    );
    rm_all_ends_server(&root, &["tx", "rx"], server);
}
