//! The fds between a template's objects, seen through the CLI: a plain Python
//! `asyncio` server (its event loop's self-pipe is a socket pair, re-created in
//! each clone) is frozen and cloned 20 times, and every clone answers from the
//! template's state and goes its own way; a server holding a TCP connection to
//! a service outside its box finds that connection reset in its clones (a
//! placeholder on the same fd) and reconnects, while the template's connection
//! stays as it was.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

/// An `asyncio` HTTP server: a request counter, and a SIGUSR1 handler run by
/// the event loop (delivered through its self-pipe socket pair).
const ASYNCIO_SERVER: &str = r#"
import asyncio, os, signal, socket
count = 0
reseeded = 0
async def handle(reader, writer):
    global count
    await reader.readuntil(b'\r\n\r\n')
    count += 1
    body = f'{count} {os.uname().nodename} {reseeded}\n'.encode()
    writer.write(b'HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n' % len(body) + body)
    await writer.drain()
    writer.close()
def on_usr1():
    global reseeded
    reseeded = 1
async def main():
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_usr1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(('0.0.0.0', 8080))
    sock.listen(128)
    server = await asyncio.start_server(handle, sock=sock)
    print('ready', flush=True)
    await server.serve_forever()
asyncio.run(main())
"#;

/// A service that greets each connection with its number and keeps it open.
const SERVICE: &str = r#"
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', 9000))
s.listen(64)
print('ready', flush=True)
n = 0
held = []
while True:
    c, _ = s.accept()
    n += 1
    c.sendall(f'svc-{n}\n'.encode())
    held.append(c)
"#;

/// An `asyncio` HTTP server that keeps a connection to the service (address in
/// argv[1]) and reconnects whenever it fails; it answers with its request
/// count, hostname, number of reconnections and the service's last greeting.
const CONNECTED_SERVER: &str = r#"
import asyncio, os, socket, sys
svc = sys.argv[1]
count = 0
reconnects = 0
greeting = '-'
async def keep():
    global reconnects, greeting
    first = True
    while True:
        try:
            reader, writer = await asyncio.open_connection(svc, 9000)
            greeting = (await reader.readline()).decode().strip()
            if not first:
                reconnects += 1
            first = False
            print('connected', greeting, flush=True)
            while await reader.read(100):
                pass
            print('lost: end of file', flush=True)
        except OSError as e:
            print('lost:', e, flush=True)
        await asyncio.sleep(0.05)
async def handle(reader, writer):
    global count
    await reader.readuntil(b'\r\n\r\n')
    count += 1
    body = f'{count} {os.uname().nodename} {reconnects} {greeting}\n'.encode()
    writer.write(b'HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n' % len(body) + body)
    await writer.drain()
    writer.close()
async def main():
    asyncio.get_running_loop().create_task(keep())
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(('0.0.0.0', 8080))
    sock.listen(128)
    server = await asyncio.start_server(handle, sock=sock)
    while greeting == '-':
        await asyncio.sleep(0.01)
    print('ready', flush=True)
    await server.serve_forever()
asyncio.run(main())
"#;

/// The server's answer in box `name`, split at whitespace.
fn get(root: &TestRoot, name: &str) -> Vec<String> {
    box_http_get(root, name, "/")
}

fn start(root: &TestRoot, name: &str, code: &str, args: &[&str]) {
    let mut run = vec!["run", "-d", "--name", name, "--", "python3", "-c", code];
    run.extend_from_slice(args);
    root.run(&run).ok();
    root.wait_logged(name, "ready", Duration::from_secs(20));
}

/// The template process's fds: (number, link text), sorted.
fn fds_of(pid: i32) -> Vec<(String, String)> {
    let mut fds: Vec<(String, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .map(|e| {
            let link = std::fs::read_link(e.path()).unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                link.display().to_string(),
            )
        })
        .collect();
    fds.sort();
    fds
}

#[test]
fn asyncio_server_clones_answer_and_diverge() {
    let Some(root) = TestRoot::new("asyncio_server_clones_answer_and_diverge") else {
        return;
    };
    start(&root, "tpl", ASYNCIO_SERVER, &[]);
    for i in 1..=3 {
        assert_eq!(get(&root, "tpl")[0], i.to_string());
    }
    root.ok(&["freeze", "tpl"]);
    let tpid = template_pid(&root, "tpl");
    let before = fds_of(tpid);
    assert!(
        before
            .iter()
            .filter(|(_, l)| l.starts_with("socket:"))
            .count()
            >= 3,
        "listener and self-pipe pair: {before:?}"
    );
    let names = root.ok(&[
        "clone",
        "tpl",
        "-n",
        "20",
        "-d",
        "--name",
        "c",
        "--on-clone-signal",
        "USR1",
    ]);
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 20);
    // Every clone continues the template's counter under its own name, and its
    // event loop ran the SIGUSR1 handler through the re-created self-pipe.
    for n in &names {
        let answer = get(&root, n);
        assert_eq!((answer[0].as_str(), answer[1].as_str()), ("4", *n));
        wait_for("the signal handler", Duration::from_secs(10), || {
            get(&root, n)[2] == "1"
        });
    }
    // They diverge: each count is its own.
    let count = |n: &str| get(&root, n)[0].parse::<u64>().unwrap();
    let (a, b) = (count(names[0]), count(names[1]));
    for i in 1..=3 {
        assert_eq!(count(names[0]), a + i);
    }
    assert_eq!(count(names[1]), b + 1);
    // The template is untouched: the same fds on the same objects.
    assert_eq!(fds_of(tpid), before);
    root.rm_all(names.iter().copied().chain(["tpl"]));
}

#[test]
fn clones_reconnect_to_a_service_outside_their_box() {
    let Some(root) = TestRoot::new("clones_reconnect_to_a_service_outside_their_box") else {
        return;
    };
    start(&root, "svc", SERVICE, &[]);
    let inspect: serde_json::Value = serde_json::from_str(&root.ok(&["inspect", "svc"])).unwrap();
    let addr = inspect["state"]["network"]["address"]
        .as_str()
        .expect("the service's address")
        .to_string();
    start(&root, "app", CONNECTED_SERVER, &[&addr]);
    assert_eq!(get(&root, "app"), ["1", "app", "0", "svc-1"]);
    assert_eq!(get(&root, "app"), ["2", "app", "0", "svc-1"]);
    root.ok(&["freeze", "app"]);
    let tpid = template_pid(&root, "app");
    let before = fds_of(tpid);
    let names = root.ok(&["clone", "app", "-n", "3", "-d", "--name", "k"]);
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 3);
    // Each clone finds its connection reset, reconnects, and gets a greeting
    // of its own; the counter continues from the template's.
    let mut greetings = BTreeSet::new();
    for n in &names {
        let answer = get(&root, n);
        assert_eq!((answer[0].as_str(), answer[1].as_str()), ("3", *n));
        wait_for("the clone to reconnect", Duration::from_secs(10), || {
            get(&root, n)[2] == "1"
        });
        let answer = get(&root, n);
        assert_ne!(answer[3], "svc-1", "{n} reconnected: {answer:?}");
        greetings.insert(answer[3].clone());
        let log = root.ok(&["logs", n]);
        assert!(log.contains("lost:"), "{n} saw its connection fail: {log}");
    }
    assert_eq!(
        greetings.len(),
        3,
        "one new connection per clone: {greetings:?}"
    );
    // The template's connection is untouched.
    assert_eq!(fds_of(tpid), before);
    root.rm_all(names.iter().copied().chain(["app", "svc"]));
}

/// Watches with a gap in their wds, on directories of the box's own layer
/// (overlayfs: found by inode, not by file handle); events printed.
const WATCHER: &str = r#"
import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
for d in ('/tmp/w', '/tmp/gap', '/tmp/v'):
    os.makedirs(d, exist_ok=True)
a = libc.inotify_add_watch(fd, b'/tmp/w', 0x100)
g = libc.inotify_add_watch(fd, b'/tmp/gap', 0x100)
v = libc.inotify_add_watch(fd, b'/tmp/v', 0x100)
libc.inotify_rm_watch(fd, g)
os.read(fd, 4096)
print('ready', a, v, flush=True)
while True:
    buf = os.read(fd, 4096)
    at = 0
    while at < len(buf):
        wd, mask, cookie, n = struct.unpack_from('iIII', buf, at)
        name = buf[at + 16:at + 16 + n].rstrip(b'\0').decode()
        print('event', wd, name, flush=True)
        at += 16 + n
"#;

#[test]
fn inotify_watches_of_a_box_are_watched_again_in_its_clones() {
    let Some(root) = TestRoot::new("inotify_watches_of_a_box_are_watched_again_in_its_clones")
    else {
        return;
    };
    start(&root, "ino", WATCHER, &[]);
    assert!(root.ok(&["logs", "ino"]).contains("ready 1 3"));
    root.ok(&["freeze", "ino"]);
    root.ok(&[
        "clone", "ino", "-d", "--name", "a", "--name", "b", "-n", "2",
    ]);
    root.ok(&["exec", "a", "--", "touch", "/tmp/w/x", "/tmp/v/y"]);
    wait_for("the clone's events", Duration::from_secs(10), || {
        let log = root.ok(&["logs", "a"]);
        log.contains("event 1 x") && log.contains("event 3 y")
    });
    // The other clone and the template saw nothing of it.
    root.ok(&["exec", "b", "--", "touch", "/tmp/w/z"]);
    wait_for("the other clone's event", Duration::from_secs(10), || {
        root.ok(&["logs", "b"]).contains("event 1 z")
    });
    assert!(!root.ok(&["logs", "b"]).contains("event 1 x"));
    assert!(!root.ok(&["logs", "a"]).contains("event 1 z"));
    assert!(!root.ok(&["logs", "ino"]).contains("event"));
    root.run_timeout(&["rm", "-f", "a", "b", "ino"], Duration::from_secs(60))
        .ok();
}
