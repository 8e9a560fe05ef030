//! Live migration between two nestbox hosts, seen from outside: two roots,
//! the second in a network namespace of its own joined to the host by a veth
//! pair (two hosts on one machine). A Python server holding 24 MiB it keeps
//! rewriting, and counting requests by id in memory, is moved while a client
//! sends it requests without a pause; every request the client saw answered
//! is counted exactly once by the server on its new host, and the server's
//! memory and files came along. Refusals (bad target, a name taken there)
//! leave the box running where it was.

mod common;

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

/// The server: a dict of request ids seen (a retried request counts once),
/// 24 MiB of random bytes, a thread rewriting 1 MiB of it every 100 ms,
/// and a checksum of the bytes as they were at start.
const SERVER: &str = r#"
import hashlib, http.server, os, threading, time
mem = bytearray(os.urandom(24 << 20))
fixed = bytes(mem[: 8 << 20])
digest = hashlib.sha256(fixed).hexdigest()
seen = {}
lock = threading.Lock()
def dirty():
    i = 0
    while True:
        for _ in range(256):
            at = (8 << 20) + (i % (16 << 8)) * 4096
            mem[at] = (mem[at] + 1) % 256
            i += 1
        time.sleep(0.1)
threading.Thread(target=dirty, daemon=True).start()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def do_GET(self):
        if self.path.startswith("/req/"):
            with lock:
                seen.setdefault(int(self.path[5:]), len(seen))
            body = "ok"
        else:
            intact = hashlib.sha256(bytes(mem[: 8 << 20])).hexdigest() == digest
            body = f"{len(seen)} {max(seen) if seen else -1} {intact} {open('/tmp/mark').read()}"
        b = body.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
open("/tmp/mark", "w").write("here")
print("ready", flush=True)
http.server.ThreadingHTTPServer(("0.0.0.0", 8080), H).serve_forever()
"#;

/// A network namespace standing for a second host, linked to this one by a
/// veth pair: this host is `.1`, the other `.2` of a /30. Removed on drop.
struct OtherHost {
    name: String,
    veth: String,
    addr: String,
}

impl OtherHost {
    fn new(tag: u8) -> OtherHost {
        let name = format!("nbmig{}", std::process::id());
        let veth = format!("nbmv{}", std::process::id());
        let peer = format!("{veth}p");
        let (host, other) = (format!("198.18.{tag}.1"), format!("198.18.{tag}.2"));
        let ip = |args: &[&str]| {
            let out = Command::new("ip").args(args).output().expect("ip");
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let made = OtherHost {
            name: name.clone(),
            veth: veth.clone(),
            addr: other.clone(),
        };
        ip(&["netns", "add", &name]);
        ip(&["link", "add", &veth, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &peer, "netns", &name]);
        ip(&["addr", "add", &format!("{host}/30"), "dev", &veth]);
        ip(&["link", "set", &veth, "up"]);
        let inside = |args: &[&str]| {
            let mut all = vec!["netns", "exec", &name, "ip"];
            all.extend_from_slice(args);
            ip(&all);
        };
        inside(&["addr", "add", &format!("{other}/30"), "dev", &peer]);
        inside(&["link", "set", &peer, "up"]);
        inside(&["link", "set", "lo", "up"]);
        // As on a host whose published ports are reached from other machines.
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &name,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ])
            .output()
            .expect("sysctl");
        assert!(out.status.success(), "ip_forward in {name}");
        made
    }

    /// `nestbox --root ROOT ARGS` run on the other host (in its network
    /// namespace only: mounts and cgroups are the machine's).
    fn nestbox(&self, root: &TestRoot, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.name))
            .arg(NESTBOX)
            .arg("--root")
            .arg(root.path())
            .args(args)
            .env_remove("NESTBOX_ROOT")
            .current_dir("/");
        c
    }

    fn ok(&self, root: &TestRoot, args: &[&str]) -> String {
        let out = self.nestbox(root, args).output().expect("nsenter nestbox");
        assert!(
            out.status.success(),
            "nestbox {args:?} on the other host: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Start `nestbox receive --listen ADDR:PORT` there; returns once it listens.
    fn receive(&self, root: &TestRoot, port: u16) -> std::process::Child {
        let mut child = self
            .nestbox(
                root,
                &["receive", "--listen", &format!("{}:{port}", self.addr)],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("receive");
        let mut out = child.stdout.take().expect("stdout");
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while !line.ends_with(b"\n") {
            assert_eq!(
                out.read(&mut b).expect("receive's output"),
                1,
                "receive ended"
            );
            line.push(b[0]);
        }
        assert!(String::from_utf8_lossy(&line).starts_with("listening on"));
        std::thread::spawn(move || {
            let mut rest = String::new();
            let _ = out.read_to_string(&mut rest);
        });
        child
    }
}

impl Drop for OtherHost {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth])
            .stderr(Stdio::null())
            .status();
    }
}

/// Two roots for `test` (the second's directory named after it too).
fn two_roots(test: &str) -> Option<(TestRoot, TestRoot)> {
    let here = TestRoot::new(test)?;
    let there = TestRoot::new(&format!("{test}-there"))?;
    Some((here, there))
}

/// Box `web` running [`SERVER`], its port 8080 published on `port` (or no
/// network at all with `None`).
fn start_server(root: &TestRoot, port: Option<u16>) -> tempfile::TempDir {
    let app = tempfile::tempdir().expect("app dir");
    std::fs::write(app.path().join("server.py"), SERVER).expect("write server");
    let volume = format!("{}:/app:ro", app.path().display());
    let publish = port.map(|p| format!("{p}:8080"));
    let mut args = vec!["run", "-d", "--name", "web"];
    match &publish {
        Some(p) => args.extend(["-p", p.as_str()]),
        None => args.extend(["--network", "none"]),
    }
    args.extend(["-v", &volume, "--", "python3", "/app/server.py"]);
    root.ok(&args);
    root.wait_logged("web", "ready", Duration::from_secs(30));
    app
}

#[test]
fn a_server_under_a_request_loop_migrates_to_another_host_without_losing_a_request() {
    migrate_under_a_request_loop(
        "a_server_under_a_request_loop_migrates_to_another_host_without_losing_a_request",
        false,
    );
}

/// The same with `migrate --lazy`: the target runs the box before its
/// memory is filled (a page server fills it), and everything holds.
#[test]
fn a_server_migrated_lazily_loses_no_request_and_keeps_its_memory() {
    migrate_under_a_request_loop(
        "a_server_migrated_lazily_loses_no_request_and_keeps_its_memory",
        true,
    );
}

fn migrate_under_a_request_loop(test: &str, lazy: bool) {
    let Some((here, there)) = two_roots(test) else {
        return;
    };
    let other = OtherHost::new(7);
    // (Both tests of this loop run at once in this process: each its port.)
    let port = 18600 + 2 * (std::process::id() % 100) as u16 + u16::from(lazy);
    let _app = start_server(&here, Some(port));
    let source: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let target: SocketAddr = format!("{}:{port}", other.addr).parse().unwrap();
    assert!(http_get(source, "/").is_some(), "the server answers here");

    // The client: request ids 0, 1, 2 … each retried until answered, to
    // this host until the migration returned, then to the other.
    let moved = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(Mutex::new(0u64));
    let client = {
        let (moved, stop, answered) = (moved.clone(), stop.clone(), answered.clone());
        std::thread::spawn(move || {
            let mut id = 0u64;
            let mut retries = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let to = if moved.load(Ordering::SeqCst) {
                    target
                } else {
                    source
                };
                let started = Instant::now();
                loop {
                    let to = if moved.load(Ordering::SeqCst) {
                        target
                    } else {
                        to
                    };
                    if http_get(to, &format!("/req/{id}")).is_some() {
                        break;
                    }
                    retries += 1;
                    assert!(
                        started.elapsed() < Duration::from_secs(30),
                        "request {id} unanswered for 30 s"
                    );
                    std::thread::sleep(Duration::from_millis(5));
                }
                id += 1;
                *answered.lock().unwrap() = id;
            }
            retries
        })
    };
    std::thread::sleep(Duration::from_millis(700));
    let mut receiver = other.receive(&there, 7070);
    let to = format!("tcp:{}:7070", other.addr);
    let mut args = vec!["migrate", "web", "--to", &to, "--json"];
    if lazy {
        args.push("--lazy");
    }
    let out = here.ok(&args);
    moved.store(true, Ordering::SeqCst);
    assert!(receiver.wait().expect("receive").success(), "receive");
    std::thread::sleep(Duration::from_millis(700));
    stop.store(true, Ordering::SeqCst);
    let retries = client.join().expect("client");
    let answered = *answered.lock().unwrap();

    eprintln!("migrate: {out}");
    let stats: Value = serde_json::from_str(&out).expect("migrate --json");
    let rounds = stats["rounds"].as_array().expect("rounds");
    assert!(rounds.len() >= 2, "pre-copy ran in rounds: {stats}");
    let server = &stats["arrived"]["page_server"];
    if lazy {
        assert!(
            server["pages"].as_u64().unwrap_or(0) > 24 * 256,
            "restored lazily there: {stats}"
        );
    } else {
        assert!(server.is_null(), "restored at once there: {stats}");
    }
    assert!(
        rounds[0]["sent"].as_u64().unwrap() > 24 * 256 / 2,
        "the first round sent the memory: {stats}"
    );
    assert!(
        stats["last_read"].as_u64().unwrap() < rounds[0]["written"].as_u64().unwrap() / 4,
        "the last stop read only what changed: {stats}"
    );
    // Every answered request counted once, on the new host; memory intact,
    // the root's files there.
    let body = http_get(target, "/").expect("the server answers on the other host");
    let f: Vec<&str> = body.split_whitespace().collect();
    assert_eq!(
        f,
        [
            answered.to_string().as_str(),
            (answered - 1).to_string().as_str(),
            "True",
            "here"
        ],
        "after {answered} requests ({retries} retries): {stats}"
    );
    assert!(answered > 20, "the client kept sending: {answered}");
    assert!(here.names().is_empty(), "the box left this host");
    assert!(
        http_get(source, "/").is_none(),
        "nothing answers here any more"
    );
    let listed = other.ok(&there, &["checkpoint", "ls", "--json"]);
    assert!(listed.contains("web-migrated-"), "{listed}");
    other.ok(&there, &["rm", "-f", "web"]);
    let ckpts: Value = serde_json::from_str(&listed).unwrap();
    for c in ckpts.as_array().unwrap() {
        other.ok(&there, &["checkpoint", "rm", c["name"].as_str().unwrap()]);
    }
    other.ok(&there, &["gc"]);
    here.ok(&["gc"]);
}

#[test]
fn refused_migrations_leave_the_box_running_where_it_was() {
    let Some((here, there)) = two_roots("refused_migrations_leave_the_box_running_where_it_was")
    else {
        return;
    };
    let port = 18400 + (std::process::id() % 200) as u16;
    let _app = start_server(&here, Some(port));
    let source: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(http_get(source, "/req/1").is_some());

    let out = here.run(&["migrate", "web", "--to", "ftp:x"]);
    assert_error(&out, 125, "expected tcp:HOST:PORT or exec:COMMAND");

    // The name is taken on the target.
    there.ok(&[
        "run",
        "-d",
        "--name",
        "web",
        "--network",
        "none",
        "--",
        "sleep",
        "600",
    ]);
    let receive = format!(
        "exec:{NESTBOX} --root {} receive --stdio",
        there.path().display()
    );
    let out = here.run(&["migrate", "web", "--to", &receive]);
    assert_error(
        &out,
        125,
        "the target refused it: a box named \"web\" already exists",
    );
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    assert_eq!(here.status("web").as_deref(), Some("running"));
    assert_eq!(
        http_get(source, "/")
            .as_deref()
            .map(|b| b.split(' ').next().unwrap().to_string()),
        Some("1".to_string()),
        "the box answers where it was, with its state"
    );
    assert_eq!(there.ok(&["checkpoint", "ls", "--json"]).trim(), "[]");

    // A target that is not there.
    let out = here.run(&["migrate", "web", "--to", "tcp:127.0.0.1:1"]);
    assert_error(&out, 125, "connecting to the target");
    assert_eq!(here.status("web").as_deref(), Some("running"));
    assert!(http_get(source, "/req/2").is_some());

    there.ok(&["rm", "-f", "web"]);
    here.ok(&["rm", "-f", "web"]);
}

/// Send request `id` to box `web` of `root` and read how many distinct
/// requests it has counted, if it runs and answers.
fn count_of(root: &TestRoot, id: u64) -> Option<u64> {
    if root.status("web").as_deref() != Some("running") {
        return None;
    }
    let code = "import sys, urllib.request as u; u.urlopen('http://127.0.0.1:8080/req/' + sys.argv[1], timeout=5).read(); print(u.urlopen('http://127.0.0.1:8080/', timeout=5).read().decode().split()[0])";
    let out = root.run(&["exec", "web", "--", "python3", "-c", code, &id.to_string()]);
    (out.code == 0)
        .then(|| out.stdout.trim().parse().ok())
        .flatten()
}

#[test]
fn a_migrate_command_killed_midway_leaves_one_box_and_nothing_else() {
    let Some((a, b)) = two_roots("a_migrate_command_killed_midway_leaves_one_box_and_nothing_else")
    else {
        return;
    };
    let _app = start_server(&a, None);
    let receive = |to: &TestRoot| {
        format!(
            "exec:{NESTBOX} --root {} receive --stdio",
            to.path().display()
        )
    };
    let mut count = count_of(&a, 100).expect("the server answers");
    let mut at_a = true;
    for (i, delay) in [10u64, 150, 400, 900].iter().enumerate() {
        let (from, to) = if at_a { (&a, &b) } else { (&b, &a) };
        let mut command = from.spawn(&["migrate", "web", "--to", &receive(to)]);
        let worker = worker_of(command.id());
        std::thread::sleep(Duration::from_millis(*delay));
        let _ = command.kill();
        let _ = command.wait();
        if let Some(w) = worker {
            wait_for(
                "the migration's worker to finish",
                Duration::from_secs(60),
                || !pid_alive(w),
            );
        }
        from.ok(&["gc"]);
        to.ok(&["gc"]);
        let id = i as u64;
        let (here, there) = (count_of(from, id), count_of(to, id));
        assert!(
            here.is_none() || there.is_none(),
            "round {i}: the box runs on both roots"
        );
        let now = here
            .or(there)
            .unwrap_or_else(|| panic!("round {i}: the box runs nowhere"));
        assert_eq!(now, count + 1, "round {i}: its state went on");
        count = now;
        if there.is_some() {
            at_a = !at_a;
        }
        for root in [&a, &b] {
            let left: Vec<_> = std::fs::read_dir(root.path().join("lib/checkpoints"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .filter(|n| n.starts_with('.') && !n.ends_with(".lock"))
                        .collect()
                })
                .unwrap_or_default();
            assert!(left.is_empty(), "round {i}: left {left:?}");
        }
    }
    let holder = if at_a { &a } else { &b };
    holder.ok(&["rm", "-f", "web"]);
    for root in [&a, &b] {
        let list: Value = serde_json::from_str(&root.ok(&["checkpoint", "ls", "--json"])).unwrap();
        for c in list.as_array().unwrap() {
            root.ok(&["checkpoint", "rm", c["name"].as_str().unwrap()]);
        }
        root.ok(&["gc"]);
    }
}
