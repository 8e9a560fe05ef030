//! Monitors seen from inside a box (`run --monitor`): a trace log holds
//! exactly the subscribed calls; a denied open fails with the chosen errno and
//! a redirected one reads the other file; a connect outside the allow-list
//! fails with the chosen errno while an allowed one connects; three monitors
//! apply in order; a monitor written in Python with the repo's client library
//! answers the box's calls; bad input and boxes that cannot carry monitors
//! fail in one line and leave nothing.

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
