//! Services seen from outside: K clones of a template behind one host port;
//! a load of new connections for 60 s through many rejuvenations fails no
//! request; a replica that dies is replaced; scale and rm; bad input fails
//! clearly and leaves nothing.

mod common;

use std::time::Duration;

use common::*;

const START: Duration = Duration::from_secs(20);

/// An HTTP server answering its hostname (the replica's box name).
const SERVER: &str = "import http.server, socket
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.0'
    def do_GET(self):
        body = socket.gethostname().encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer(('0.0.0.0', 8080), H)
print('ready', flush=True)
s.serve_forever()
";

/// A bounded load: THREADS threads, each opening a new connection per
/// request, for SECONDS; prints `ok N failed M hosts H` and the failures.
const CLIENT: &str = "import sys, threading, time, urllib.request
port, seconds, threads = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
ok, failed, hosts, errors = [0], [0], set(), []
lock = threading.Lock()
end = time.time() + seconds
def work():
    while time.time() < end:
        try:
            with urllib.request.urlopen(f'http://127.0.0.1:{port}/', timeout=10) as r:
                body = r.read().decode()
                good = r.status == 200 and body.startswith('svc.r')
        except Exception as e:
            good, body = False, repr(e)
        with lock:
            if good:
                ok[0] += 1
                hosts.add(body)
            else:
                failed[0] += 1
                errors.append(body)
ts = [threading.Thread(target=work) for _ in range(threads)]
for t in ts: t.start()
for t in ts: t.join()
print('ok', ok[0], 'failed', failed[0], 'hosts', len(hosts))
for e in errors[:10]: print('error', e)
";

/// Removes service NAME when dropped, so that a failing test leaves no
/// supervisor behind.
struct ServiceGuard<'a>(&'a TestRoot, &'a str);

impl Drop for ServiceGuard<'_> {
    fn drop(&mut self) {
        let _ = self
            .0
            .run_timeout(&["service", "rm", self.1], Duration::from_secs(90));
    }
}

fn service_json(root: &TestRoot, name: &str) -> serde_json::Value {
    serde_json::from_str(&root.ok(&["service", "inspect", name])).unwrap()
}

/// The number in a replica's name (`svc.r7` → 7).
fn replica_number(name: &str) -> u64 {
    name.rsplit_once(".r")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or_else(|| panic!("replica name {name:?}"))
}

fn active(v: &serde_json::Value) -> Vec<String> {
    v["state"]["replicas"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["role"] == "active")
        .map(|r| r["name"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn serial_service_rejuvenates_replicas_without_failing_a_request() {
    let Some(root) = TestRoot::new("serial_service_rejuvenates_replicas_without_failing_a_request")
    else {
        return;
    };
    let server = root.path().join("server.py");
    std::fs::write(&server, SERVER).unwrap();
    let volume = format!("{}:/srv.py:ro", server.display());
    root.run(&[
        "run", "-d", "--name", "svc-t", "-v", &volume, "--", "python3", "/srv.py",
    ])
    .ok();
    root.wait_log("svc-t", "ready", START);
    root.ok(&["freeze", "svc-t", "--as", "svc"]);
    let port = nestbox_testkit::unused_port(27000, 1000);
    let publish = format!("{port}:8080");
    let out = root
        .run_timeout(
            &[
                "service",
                "create",
                "svc",
                "--template",
                "svc",
                "--replicas",
                "3",
                "--rejuvenate",
                "9s",
                "-p",
                &publish,
            ],
            Duration::from_secs(120),
        )
        .ok();
    assert_eq!(out.stdout.trim(), "svc");
    let _guard = ServiceGuard(&root, "svc");
    let v = service_json(&root, "svc");
    assert_eq!(active(&v).len(), 3, "{v}");
    assert!(root.ok(&["service", "ls"]).contains("3/3"));
    for r in active(&v) {
        root.inspect(&r); // remembered for the final leak checks
    }

    // 60 s of new connections: a replica is replaced every 3 s.
    let client = std::process::Command::new("python3")
        .args(["-c", CLIENT, &port.to_string(), "60", "4"])
        .output()
        .expect("run the client");
    let report = String::from_utf8_lossy(&client.stdout).to_string();
    eprintln!("service load: {report}");
    let v = service_json(&root, "svc");
    let field = |k: &str| -> u64 {
        report
            .split_whitespace()
            .skip_while(|w| *w != k)
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{k} in {report:?}"))
    };
    let log = std::fs::read_to_string(root.path().join("run/services/svc/log")).unwrap_or_default();
    assert_eq!(
        field("failed"),
        0,
        "no request may fail: {report}\n{v}\nsupervisor log:\n{log}"
    );
    assert!(field("ok") >= 600, "{report}");
    eprintln!("supervisor log:\n{log}");
    let rejuvenated = v["state"]["rejuvenated"].as_u64().unwrap();
    assert!(rejuvenated >= 12, "a replica every 3 s for 60 s: {v}");
    assert!(
        field("hosts") >= rejuvenated,
        "the answers come from the fresh replicas: {report}\n{v}"
    );
    assert_eq!(v["state"]["failed"], 0, "{v}");

    // A replica that dies is replaced. Rejuvenation goes on meanwhile and
    // retires the oldest replica, so the victim is the newest one, looked up
    // right before the kill (again if rejuvenation removed it in between).
    let mut victim = String::new();
    for _ in 0..10 {
        let v = service_json(&root, "svc");
        victim = active(&v)
            .into_iter()
            .max_by_key(|n| replica_number(n))
            .expect("an active replica");
        let out = root.run(&["inspect", &victim]);
        if out.code != 0 {
            victim.clear();
            continue;
        }
        let state: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
        let init = state["state"]["init_pid"].as_i64().unwrap() as i32;
        match nix::sys::signal::kill(nix::unistd::Pid::from_raw(init), nix::sys::signal::SIGKILL) {
            Ok(()) => break,
            Err(nix::errno::Errno::ESRCH) => victim.clear(),
            Err(e) => panic!("kill {victim}'s init {init}: {e}"),
        }
    }
    assert!(
        !victim.is_empty(),
        "no replica stayed long enough to be killed"
    );
    wait_for("the dead replica to be replaced", START, || {
        let v = service_json(&root, "svc");
        v["state"]["replaced_dead"].as_u64() >= Some(1) && active(&v).len() == 3
    });
    assert!(!active(&service_json(&root, "svc")).contains(&victim));
    assert_eq!(
        root.status(&victim),
        None,
        "the dead replica's box is removed"
    );

    // Scale down and up.
    root.run_timeout(&["service", "scale", "svc", "2"], Duration::from_secs(60))
        .ok();
    assert_eq!(active(&service_json(&root, "svc")).len(), 2);
    root.run_timeout(&["service", "scale", "svc", "4"], Duration::from_secs(60))
        .ok();
    let v = service_json(&root, "svc");
    assert_eq!(active(&v).len(), 4);
    for r in active(&v) {
        root.inspect(&r);
    }

    // rm: the supervisor, every replica and the record go; the port is free.
    let supervisor = v["state"]["supervisor"]["pid"].as_i64().unwrap() as i32;
    root.run_timeout(&["service", "rm", "svc"], Duration::from_secs(90))
        .ok();
    assert!(!pid_alive(supervisor));
    let left: Vec<String> = root
        .names()
        .into_iter()
        .filter(|n| n.starts_with("svc.r"))
        .collect();
    assert!(left.is_empty(), "replicas left: {left:?}");
    assert!(!root.path().join("run/services/svc").exists());
    std::net::TcpListener::bind(("0.0.0.0", port)).expect("the port is free again");
    root.rm_all(["svc-t"]);
}

#[test]
fn service_bad_input_fails_clearly_and_leaves_nothing() {
    let Some(root) = TestRoot::new("service_bad_input_fails_clearly_and_leaves_nothing") else {
        return;
    };
    let port = nestbox_testkit::unused_port(28000, 1000).to_string();
    let publish = format!("{port}:8080");
    let out = root.run(&[
        "service",
        "create",
        "s",
        "--template",
        "nope",
        "-p",
        &publish,
    ]);
    assert_error(&out, 125, "no template named \"nope\"");
    root.detached_sh("plain", &["--network", "none"], "sleep 60");
    root.ok(&["freeze", "plain", "--as", "plain-t"]);
    let cases: [(&[&str], &str); 4] = [
        (&[], "has no network address to reach replicas on"),
        (&["--replicas", "0"], "--replicas 0 is out of range"),
        (&["--rejuvenate", "10q"], "--rejuvenate: invalid duration"),
        (&["-p", "1:2/udp"], "a service publishes a TCP port"),
    ];
    for (extra, message) in cases {
        let mut args = vec!["service", "create", "s", "--template", "plain-t"];
        args.extend_from_slice(extra);
        if !extra.contains(&"-p") {
            args.extend_from_slice(&["-p", &publish]);
        }
        assert_error(&root.run(&args), 125, message);
    }
    let out = root.run(&["service", "rm", "s"]);
    assert_error(&out, 125, "no service named \"s\"");
    assert!(!root.path().join("run/services/s").exists());
    root.rm_all(["plain"]);
}

/// One request through the service's port: the replica's name, or the error.
fn get(port: u16) -> Result<String, String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| e.to_string())?;
    answer
        .split("\r\n\r\n")
        .nth(1)
        .map(String::from)
        .filter(|b| b.starts_with("svc2.r"))
        .ok_or(answer)
}

#[test]
fn gc_restarts_a_service_whose_supervisor_was_killed() {
    let Some(root) = TestRoot::new("gc_restarts_a_service_whose_supervisor_was_killed") else {
        return;
    };
    let server = root.path().join("server.py");
    std::fs::write(&server, SERVER).unwrap();
    let volume = format!("{}:/srv.py:ro", server.display());
    root.run(&[
        "run", "-d", "--name", "svc2-t", "-v", &volume, "--", "python3", "/srv.py",
    ])
    .ok();
    root.wait_log("svc2-t", "ready", START);
    root.ok(&["freeze", "svc2-t", "--as", "svc2"]);
    let port = nestbox_testkit::unused_port(29000, 1000);
    let publish = format!("{port}:8080");
    root.run_timeout(
        &[
            "service",
            "create",
            "svc2",
            "--template",
            "svc2",
            "--replicas",
            "2",
            "-p",
            &publish,
        ],
        Duration::from_secs(120),
    )
    .ok();
    let _guard = ServiceGuard(&root, "svc2");
    let v = service_json(&root, "svc2");
    let old = active(&v);
    assert_eq!(old.len(), 2, "{v}");
    // Box ids (remembered for the final leak checks too).
    let ids = |names: &[String]| -> Vec<String> {
        names
            .iter()
            .map(|r| root.inspect(r)["id"].as_str().unwrap().to_string())
            .collect()
    };
    let old_ids = ids(&old);
    get(port).expect("the service answers");

    // SIGKILL: the supervisor removes nothing, records nothing.
    let supervisor = v["state"]["supervisor"]["pid"].as_i64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(supervisor),
        nix::sys::signal::SIGKILL,
    )
    .unwrap();
    wait_for("the supervisor to end", START, || !pid_alive(supervisor));
    assert!(get(port).is_err(), "no proxy, no answer");
    assert!(root.ok(&["service", "ls"]).contains("svc2"));

    let out = root.run_timeout(&["gc"], Duration::from_secs(120)).ok();
    assert!(
        out.stdout
            .contains("restarted the supervisor of service svc2"),
        "{out}"
    );
    let v = service_json(&root, "svc2");
    let new = active(&v);
    assert_eq!(new.len(), 2, "{v}");
    let new_ids = ids(&new);
    let new_supervisor = v["state"]["supervisor"]["pid"].as_i64().unwrap() as i32;
    assert_ne!(new_supervisor, supervisor);
    assert!(pid_alive(new_supervisor));
    // The old replicas are gone (their names may be taken again).
    let listed: Vec<String> = root
        .ps_all()
        .iter()
        .filter_map(|r| r["id"].as_str().map(String::from))
        .collect();
    for id in &old_ids {
        assert!(
            !new_ids.contains(id),
            "replicas made anew: {old_ids:?} {new_ids:?}"
        );
        assert!(!listed.contains(id), "the old replica {id} is removed");
    }
    let answer = get(port).expect("the service answers again");
    assert!(new.contains(&answer), "{answer} is one of {new:?}");

    // A second gc finds nothing to do; rm leaves nothing.
    let out = root.run(&["gc"]).ok();
    assert!(!out.stdout.contains("restarted"), "{out}");
    root.run_timeout(&["service", "rm", "svc2"], Duration::from_secs(90))
        .ok();
    assert!(!pid_alive(new_supervisor));
    assert!(!root.path().join("run/services/svc2").exists());
    root.rm_all(["svc2-t"]);
}
