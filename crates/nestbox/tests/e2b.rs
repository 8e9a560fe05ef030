//! `nestbox serve --http`, driven by the real E2B Python SDK (the `e2b`
//! package `scripts/setup.sh` installs): unmodified SDK calls create
//! sandboxes as clones of the built-in `base` template (or cold boxes of an
//! image), run commands and stream their output, move files, pause, resume,
//! fork and kill sandboxes, and get the SDK's own exceptions for a bad key,
//! an unknown sandbox or template. Each test has its own root and server on
//! a free loopback port; the server's SIGTERM leaves its sandboxes to the
//! next server of the root (they and their records are the root's), and the
//! root's clean-up removes them and checks that nothing is left.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// The API key the servers of these tests accept.
const KEY: &str = "nestbox-test-key";

/// Whether `python3` can import the E2B SDK.
fn sdk_available() -> bool {
    Command::new("python3")
        .args(["-c", "import e2b"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A `nestbox serve --http` of a test root.
struct Server<'a> {
    root: &'a TestRoot,
    child: Option<Child>,
    url: String,
}

impl<'a> Server<'a> {
    /// Start one on a free port and wait until it answers.
    fn start(root: &'a TestRoot) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let socket = root.path().join("api.sock");
        let log = std::fs::File::create(root.path().join("serve-http.log")).unwrap();
        let child = root
            .command(&[
                "serve",
                "--socket",
                socket.to_str().unwrap(),
                "--http",
                &addr,
                "--api-key",
                KEY,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn nestbox serve --http");
        wait_for("the HTTP port", Duration::from_secs(20), || {
            std::net::TcpStream::connect(&addr).is_ok()
        });
        Server {
            root,
            child: Some(child),
            url: format!("http://{addr}"),
        }
    }

    /// Run Python `code` with the SDK pointed at this server (only the
    /// environment variables an E2B user sets).
    fn py(&self, code: &str) -> Out {
        let child = Command::new("python3")
            .args(["-c", code])
            .env("E2B_API_URL", &self.url)
            .env("E2B_SANDBOX_URL", &self.url)
            .env("E2B_API_KEY", KEY)
            .env_remove("E2B_DOMAIN")
            .env_remove("E2B_DEBUG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn python3");
        finish(
            child,
            None,
            Duration::from_secs(240),
            "python3 (e2b)".into(),
        )
    }

    /// [`Server::py`], which must succeed; its stdout.
    #[track_caller]
    fn ok(&self, code: &str) -> String {
        let out = self.py(code);
        assert_eq!(
            out.code,
            0,
            "the SDK program failed\n{out}\nserver log:\n{}",
            std::fs::read_to_string(self.root.path().join("serve-http.log")).unwrap_or_default()
        );
        out.stdout
    }

    /// SIGTERM, and wait for the server to end (its sandboxes stay).
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill has no memory-safety preconditions; the pid is our child's.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let ended = wait_until(Duration::from_secs(60), || {
                child.try_wait().ok().flatten().is_some()
            });
            if !ended {
                let _ = child.kill();
            }
            let status = child.wait().unwrap();
            assert!(ended && status.success(), "serve ended with {status:?}");
        }
    }
}

impl Drop for Server<'_> {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: as in stop.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = wait_until(Duration::from_secs(60), || {
                child.try_wait().ok().flatten().is_some()
            });
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A root and its server, or `None` (skipped: not root, or no SDK).
fn setup(test: &str) -> Option<TestRoot> {
    if !nestbox_testkit::require(
        sdk_available(),
        test,
        "the e2b Python package is not installed (scripts/setup.sh installs it)",
    ) {
        return None;
    }
    TestRoot::new(test)
}

/// Run the SDK program `code` against a server of a fresh root (skipped
/// where it cannot run); it must succeed and print `done`.
fn sdk_test(test: &str, code: &str) {
    let Some(root) = setup(test) else {
        return;
    };
    let mut server = Server::start(&root);
    let out = server.ok(code);
    assert!(out.contains("done"), "{out}");
    server.stop();
}

#[test]
fn e2b_sdk_runs_commands_and_streams_their_output() {
    sdk_test(
        "e2b_sdk_runs_commands_and_streams_their_output",
        r#"
import time
from e2b import Sandbox, CommandExitException, TimeoutException
sb = Sandbox.create(envs={"FROM_CREATE": "c1"})
r = sb.commands.run("echo out; echo err >&2; id -un; pwd; echo $HOME $FROM_CREATE $EXTRA",
                    envs={"EXTRA": "x2"})
assert r.exit_code == 0, r
assert r.stdout == "out\nuser\n/home/user\n/home/user c1 x2\n", repr(r.stdout)
assert r.stderr == "err\n", repr(r.stderr)
# Run by the in-box agent (a process of the sandbox, as E2B's envd), which
# reports in-box pids.
assert sb.commands.run("cat /proc/$PPID/comm").stdout == "e2b-agent\n"
# The sandbox's own hostname: the command ran in the box, not on the host.
import socket
host = sb.commands.run("hostname").stdout.strip()
assert host != socket.gethostname(), host
assert sb.commands.run("echo $HOSTNAME").stdout.strip() == host
# A failing command raises with its exit code and output.
try:
    sb.commands.run("echo before; exit 3")
    raise SystemExit("no exception for exit 3")
except CommandExitException as e:
    assert e.exit_code == 3 and e.stdout == "before\n", (e.exit_code, e.stdout)
# cwd, and root when asked.
assert sb.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
assert sb.commands.run("id -u", user="root").stdout == "0\n"
# Output streams as it is written, not at the end.
seen = []
sb.commands.run("for i in 1 2 3; do echo $i; sleep 0.3; done",
                on_stdout=lambda line: seen.append((time.monotonic(), line)))
assert [l for _, l in seen] == ["1\n", "2\n", "3\n"], seen
assert seen[2][0] - seen[0][0] > 0.4, seen
# A background command: listed, then killed.
h = sb.commands.run("sleep 300", background=True)
assert h.pid in [p.pid for p in sb.commands.list()], sb.commands.list()
assert h.kill()
try:
    h.wait()
    raise SystemExit("a killed command reported success")
except CommandExitException as e:
    assert e.exit_code == 137, e.exit_code
assert h.pid not in [p.pid for p in sb.commands.list()]
# stdin of a background command.
h = sb.commands.run("cat", background=True, stdin=True)
sb.commands.send_stdin(h.pid, "piped in\n")
sb.commands.close_stdin(h.pid)
assert h.wait().stdout == "piped in\n"
# Input a command does not read (more than its pipe holds) and a close of
# its stdin wait for it without holding up the sandbox's other commands.
import threading
h = sb.commands.run("sleep 60", background=True, stdin=True)
def stuff():
    try:
        sb.commands.send_stdin(h.pid, "x" * (256 << 10))
    except Exception:
        pass
threading.Thread(target=stuff, daemon=True).start()
time.sleep(0.5)
threading.Thread(target=lambda: sb.commands.close_stdin(h.pid), daemon=True).start()
time.sleep(0.3)
assert sb.commands.run("echo still").stdout == "still\n"
assert h.kill()
# Connect to a running command and see its later output.
h = sb.commands.run("sleep 0.5; echo late", background=True)
assert sb.commands.connect(h.pid).wait().stdout == "late\n"
# A command that outlives its timeout is ended.
t = time.monotonic()
try:
    sb.commands.run("sleep 30", timeout=1)
    raise SystemExit("no timeout")
except TimeoutException:
    pass
assert time.monotonic() - t < 10
print("pid-is-int", isinstance(h.pid, int))
sb.kill()
print("done")
"#,
    );
}

#[test]
fn e2b_sdk_writes_reads_and_lists_files_in_the_sandbox() {
    let Some(root) = setup("e2b_sdk_writes_reads_and_lists_files_in_the_sandbox") else {
        return;
    };
    let mut server = Server::start(&root);
    let marker = HostMarker::new("/tmp");
    let out = server.ok(&format!(
        r#"
from e2b import Sandbox, NotFoundException, FileType
sb = Sandbox.create()
info = sb.files.write("notes/hello.txt", "hello world\n")
assert info.path == "/home/user/notes/hello.txt", info
assert sb.files.read("notes/hello.txt") == "hello world\n"
# What a command sees, owned by the sandbox user.
assert sb.commands.run("cat notes/hello.txt; stat -c %U notes/hello.txt notes").stdout == "hello world\nuser\nuser\n"
# Binary data, octet-stream upload, and several files in one multipart request.
data = bytes(range(256)) * 100
sb.files.write("bin.dat", data, use_octet_stream=True)
assert bytes(sb.files.read("bin.dat", format="bytes")) == data
sb.files.write_files([{{"path": "multi/a.txt", "data": "A"}}, {{"path": "/tmp/b.txt", "data": b"B"}}])
assert sb.commands.run("cat multi/a.txt /tmp/b.txt").stdout == "AB"
names = sorted(e.name for e in sb.files.list("."))
assert names == ["bin.dat", "multi", "notes"], names
deep = sorted(e.path for e in sb.files.list(".", depth=2))
assert "/home/user/notes/hello.txt" in deep and "/home/user/multi/a.txt" in deep, deep
st = sb.files.get_info("notes/hello.txt")
assert (st.type, st.size, st.owner) == (FileType.FILE, 12, "user"), st
assert sb.files.get_info("notes").type == FileType.DIR
assert sb.files.make_dir("x/y") is True and sb.files.make_dir("x/y") is False
sb.files.rename("notes/hello.txt", "x/y/moved.txt")
assert not sb.files.exists("notes/hello.txt") and sb.files.exists("x/y/moved.txt")
sb.files.remove("x")
assert not sb.files.exists("x")
try:
    sb.files.read("nosuch.txt")
    raise SystemExit("no exception for a missing file")
except NotFoundException:
    pass
# Paths resolve inside the box: a symlink to / and .. lead to the box's root,
# never to the host's files.
sb.commands.run("ln -s / rootlink")
assert not sb.files.exists("rootlink{marker}"), "a host file is visible"
assert not sb.files.exists("../../..{marker}"), "a host file is visible"
assert sb.files.read("rootlink/etc/hostname") == sb.commands.run("cat /etc/hostname").stdout
# Watching a directory (recursive: a new subdirectory is watched too).
sb.files.make_dir("watched")
w = sb.files.watch_dir("watched", recursive=True)
sb.files.write("watched/new.txt", "x")
sb.commands.run("mkdir watched/sub")
ev = [(e.name, e.type.name) for e in w.get_new_events()]
assert ("new.txt", "CREATE") in ev and ("sub", "CREATE") in ev, ev
sb.commands.run("touch watched/sub/deep; rm watched/new.txt")
ev = [(e.name, e.type.name) for e in w.get_new_events()]
assert ("sub/deep", "CREATE") in ev and ("new.txt", "REMOVE") in ev, ev
assert w.get_new_events() == []
w.stop()
sb.kill()
print("done")
"#,
        marker = marker.path()
    ));
    assert!(out.contains("done"), "{out}");
    server.stop();
}

#[test]
fn e2b_sdk_sandboxes_survive_a_server_restart() {
    let test = "e2b_sdk_sandboxes_survive_a_server_restart";
    let Some(root) = setup(test) else {
        return;
    };
    let mut server = Server::start(&root);
    let out = server.ok(r#"
from e2b import Sandbox
a = Sandbox.create(metadata={"who": "a"}, timeout=300)
a.files.write("kept.txt", "still here")
snap = a.create_snapshot(name="kept-snap")
a.commands.run("sleep 600", background=True)
# A command that waits for its input: the next server reaches it.
w = a.commands.run("read x; echo got $x", background=True, stdin=True)
b = Sandbox.create(metadata={"who": "b"})
b.commands.run("echo paused > state.txt")
# (A pause freezes the box where it is: its commands stay, also across a
# restart of the server.)
bw = b.commands.run("sleep 700", background=True)
assert b.pause() is True
c = Sandbox.create(metadata={"who": "c"}, timeout=2)
print("ids", a.sandbox_id, b.sandbox_id, c.sandbox_id, snap.snapshot_id, w.pid, bw.pid)
print("done")
"#);
    let ids: Vec<String> = out
        .lines()
        .find_map(|l| l.strip_prefix("ids "))
        .expect("the ids")
        .split(' ')
        .map(String::from)
        .collect();
    server.stop();
    // c's time is up while no server runs.
    std::thread::sleep(Duration::from_secs(3));
    let mut server = Server::start(&root);
    let out = server.ok(&format!(
        r#"
import time
from e2b import Sandbox, SandboxQuery, SandboxState, SandboxNotFoundException
a_id, b_id, c_id, snap_id, w_pid, bw_pid = {ids:?}
w_pid, bw_pid = int(w_pid), int(bw_pid)
time.sleep(1)  # the reaper's first rounds
both = [SandboxState.RUNNING, SandboxState.PAUSED]
listed = {{s.sandbox_id: s for s in Sandbox.list(query=SandboxQuery(state=both)).next_items()}}
assert sorted(listed) == sorted([a_id, b_id]), listed
assert listed[a_id].state == SandboxState.RUNNING and listed[a_id].metadata == {{"who": "a"}}
assert listed[b_id].state == SandboxState.PAUSED and listed[b_id].metadata == {{"who": "b"}}
try:
    Sandbox.get_info(c_id)
    raise SystemExit("a sandbox that expired while no server ran is still known")
except SandboxNotFoundException:
    pass
# The same sandbox: its files, its processes, its access token.
a = Sandbox.connect(a_id)
assert a.files.read("kept.txt") == "still here"
assert a.commands.run("cat kept.txt; pgrep -x sleep >/dev/null && echo sleeping").stdout == "still here" + "sleeping\n"
# Its commands started through the server before are this server's now.
assert w_pid in [p.pid for p in a.commands.list()], a.commands.list()
wh = a.commands.connect(w_pid)
a.commands.send_stdin(w_pid, "after\n")
assert wh.wait().stdout == "got after\n"
b = Sandbox.connect(b_id)
assert b.commands.run("cat state.txt; pgrep -x -f 'sleep 700' >/dev/null && echo sleeping").stdout == "paused\nsleeping\n"
assert bw_pid in [p.pid for p in b.commands.list()], b.commands.list()
assert b.get_info().state == SandboxState.RUNNING
# The snapshot too: listed, created from by its name, deleted.
assert snap_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
d = Sandbox.create("kept-snap")
assert d.files.read("kept.txt") == "still here"
d.kill()
assert Sandbox.delete_snapshot(snap_id) is True
a.kill()
b.kill()
assert Sandbox.list(query=SandboxQuery(state=both)).next_items() == []
print("done")
"#,
    ));
    assert!(out.contains("done"), "{out}");
    server.stop();
    // Nothing of them is left: c's box went with its record.
    let ps = root.ok(&["ps", "-a"]);
    for id in &ids[..4] {
        assert!(!ps.contains(id.as_str()), "{id} is left:\n{ps}");
    }
}

#[test]
fn e2b_sdk_pauses_resumes_forks_and_ends_sandboxes() {
    sdk_test(
        "e2b_sdk_pauses_resumes_forks_and_ends_sandboxes",
        r#"
import time
from e2b import Sandbox, SandboxQuery, SandboxState, SandboxNotFoundException
sb = Sandbox.create(metadata={"suite": "lifecycle"}, timeout=120)
other = Sandbox.create(metadata={"suite": "other"})
sb.commands.run("echo kept > state.txt")
info = sb.get_info()
assert info.template_id == "base" and info.state == SandboxState.RUNNING, info
assert info.metadata == {"suite": "lifecycle"}, info.metadata
found = Sandbox.list(query=SandboxQuery(metadata={"suite": "lifecycle"})).next_items()
assert [s.sandbox_id for s in found] == [sb.sandbox_id], found
# Pause: listed as paused; commands refused until it is resumed.
assert sb.pause() is True
paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
assert [s.sandbox_id for s in paused] == [sb.sandbox_id], paused
assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
# Connect resumes it, files kept.
again = Sandbox.connect(sb.sandbox_id)
assert again.commands.run("cat state.txt").stdout == "kept\n"
assert again.get_info().state == SandboxState.RUNNING
# Pause and resume once more.
again.pause()
again = Sandbox.connect(sb.sandbox_id)
assert again.commands.run("cat state.txt; ls -d /home/user").stdout == "kept\n/home/user\n"
assert again.commands.run("cat /proc/$PPID/comm").stdout == "e2b-agent\n", "no agent after resume"
# Fork: a new sandbox with the same files; the two go their own ways.
(fork,) = again.fork()
assert fork.sandbox_id != sb.sandbox_id
assert fork.commands.run("cat state.txt").stdout == "kept\n"
fork.commands.run("echo fork > state.txt")
assert again.commands.run("cat state.txt").stdout == "kept\n"
assert fork.commands.run("cat state.txt").stdout == "fork\n"
fork.kill()
# A timeout removes the sandbox.
other.set_timeout(1)
time.sleep(2.5)
assert not other.is_running()
try:
    Sandbox.get_info(other.sandbox_id)
    raise SystemExit("an expired sandbox is still known")
except SandboxNotFoundException:
    pass
again.kill()
assert Sandbox.list().next_items() == []
print("done")
"#,
    );
}

#[test]
fn e2b_sdk_background_commands_survive_pause_and_resume() {
    sdk_test(
        "e2b_sdk_background_commands_survive_pause_and_resume",
        r#"
import time
from e2b import Sandbox, CommandExitException
sb = Sandbox.create(timeout=120)
# A background command that counts for 4 s, into a file and on stdout.
h = sb.commands.run(
    "for i in $(seq 1 20); do echo $i; echo $i > count; sleep 0.2; done; echo finished",
    background=True)
time.sleep(1)
before = int(sb.commands.run("cat count").stdout)
assert sb.pause() is True
time.sleep(1.5)
again = Sandbox.connect(sb.sandbox_id)
# Frozen while paused: the count did not go on (7 more if it had run).
resumed = int(again.commands.run("cat count").stdout)
assert before <= resumed <= before + 2, (before, resumed)
# Still running, listed, and it can be connected to after the resume.
assert h.pid in [p.pid for p in again.commands.list()], again.commands.list()
later = again.commands.connect(h.pid).wait()
assert later.exit_code == 0 and later.stdout.endswith("finished\n"), later
# The stream opened before the pause got every line, in order.
whole = h.wait()
assert whole.stdout == "".join(f"{i}\n" for i in range(1, 21)) + "finished\n", whole.stdout
assert h.pid not in [p.pid for p in again.commands.list()]
# A fork: the commands go on in the sandbox forked and in the fork, each
# copy with its own output and stdin (the agent relays them through pipes
# of the box, which a clone copies with the bytes in them).
h2 = again.commands.run(
    "for i in $(seq 1 25); do echo $i; sleep 0.1; done; echo finished", background=True)
c = again.commands.run("cat", background=True, stdin=True)
again.commands.send_stdin(c.pid, "one\n")
time.sleep(0.5)
(twin,) = again.fork()
assert sorted(p.pid for p in twin.commands.list()) == sorted([h2.pid, c.pid]), twin.commands.list()
twin_h2 = twin.commands.connect(h2.pid)
twin_c = twin.commands.connect(c.pid)
again.commands.send_stdin(c.pid, "two\n")
twin.commands.send_stdin(c.pid, "deux\n")
# The original's stream opened before the fork gets every line, in order.
whole = h2.wait()
assert whole.exit_code == 0, whole
assert whole.stdout == "".join(f"{i}\n" for i in range(1, 26)) + "finished\n", whole.stdout
# The fork's copy goes on to its own end.
later = twin_h2.wait()
assert later.exit_code == 0 and later.stdout.endswith("24\n25\nfinished\n"), later.stdout
again.commands.close_stdin(c.pid)
twin.commands.close_stdin(c.pid)
assert c.wait().stdout == "one\ntwo\n", "the original's cat"
assert twin_c.wait().stdout == "deux\n", "the fork's cat"
assert again.commands.list() == [] and twin.commands.list() == []
# A snapshot keeps running commands too: a sandbox made from it has them.
h3 = again.commands.run("read x; echo got $x", background=True, stdin=True)
snap = again.create_snapshot()
again.commands.send_stdin(h3.pid, "orig\n")
assert h3.wait().stdout == "got orig\n"
made = Sandbox.create(snap.snapshot_id)
assert [p.pid for p in made.commands.list()] == [h3.pid], made.commands.list()
mh = made.commands.connect(h3.pid)
made.commands.send_stdin(h3.pid, "copy\n")
assert mh.wait().stdout == "got copy\n"
made.kill()
Sandbox.delete_snapshot(snap.snapshot_id)
twin.kill()
again.kill()
print("done")
"#,
    );
}

/// Each fork makes the sandbox that goes on a clone of a clone, one pid
/// namespace deeper, and Linux nests them at most 32 deep: forks of one
/// sandbox end with a 400 naming the limit, refused before anything is
/// frozen, so the sandbox and its running command go on.
#[test]
fn e2b_sdk_forks_of_one_sandbox_end_at_the_kernels_depth_and_it_goes_on() {
    sdk_test(
        "e2b_sdk_forks_of_one_sandbox_end_at_the_kernels_depth_and_it_goes_on",
        r#"
from e2b import Sandbox
from e2b.exceptions import SandboxException
sb = Sandbox.create(timeout=300)
# The count is replaced whole (a reader between `>`'s truncation and its
# write would see an empty file).
h = sb.commands.run("for i in $(seq 1 600); do echo $i > n.new; mv n.new n; sleep 0.1; done",
                    background=True)
forks = 0
while True:
    try:
        (twin,) = sb.fork()
    except SandboxException as e:
        assert "400" in str(e) and "Linux nests them at most 32 deep" in str(e), str(e)
        break
    twin.kill()
    forks += 1
    assert forks <= 40, forks
# The base template's box is one below the host's, a sandbox one below it.
assert forks == 30, forks
assert h.pid in [p.pid for p in sb.commands.list()], sb.commands.list()
a = int(sb.commands.run("cat n").stdout)
b = int(sb.commands.run("sleep 0.5; cat n").stdout)
assert b > a, (a, b)
sb.kill()
print("done")
"#,
    );
}

#[test]
fn e2b_sdk_gets_its_errors_for_bad_keys_and_unknown_names() {
    sdk_test(
        "e2b_sdk_gets_its_errors_for_bad_keys_and_unknown_names",
        r#"
from e2b import Sandbox, AuthenticationException, SandboxException, SandboxNotFoundException
def expect(kind, f, fragment):
    try:
        f()
    except kind as e:
        assert fragment in str(e), (fragment, str(e))
        print("ok", kind.__name__)
        return
    raise SystemExit(f"expected {kind.__name__}")
expect(AuthenticationException, lambda: Sandbox.create(api_key="wrong"), "401")
expect(AuthenticationException, lambda: Sandbox.list(api_key="wrong").next_items(), "401")
expect(SandboxException, lambda: Sandbox.create(template="no-such-template"), "404")
expect(SandboxNotFoundException, lambda: Sandbox.connect("e2b-nosuch"), "not found")
expect(SandboxNotFoundException, lambda: Sandbox.get_info("e2b-nosuch"), "not found")
assert Sandbox.kill("e2b-nosuch") is False
# A killed sandbox's envd answers as E2B's does for a gone sandbox.
sb = Sandbox.create()
sb.kill()
from e2b import SandboxNotRunningException
expect(SandboxNotRunningException, lambda: sb.commands.run("true"), "was not found")
print("done")
"#,
    );
}

#[test]
fn e2b_sdk_makes_cold_sandboxes_of_an_image() {
    sdk_test(
        "e2b_sdk_makes_cold_sandboxes_of_an_image",
        r#"
from e2b import Sandbox
sb = Sandbox.create(template="host")
assert sb.commands.run("id -un; pwd").stdout == "user\n/home/user\n"
assert sb.get_info().template_id == "host"
sb.files.write("f.txt", "cold")
assert sb.files.read("f.txt") == "cold"
sb.kill()
print("done")
"#,
    );
}

#[test]
fn e2b_sdk_fifty_sandboxes_at_once() {
    sdk_test(
        "e2b_sdk_fifty_sandboxes_at_once",
        r#"
from concurrent.futures import ThreadPoolExecutor
from e2b import Sandbox
def one(i):
    sb = Sandbox.create()
    r = sb.commands.run(f"echo {i} $(hostname)")
    sb.files.write("i.txt", str(i))
    assert sb.files.read("i.txt") == str(i)
    return sb, r.stdout
with ThreadPoolExecutor(50) as pool:
    made = list(pool.map(one, range(50)))
ids = {sb.sandbox_id for sb, _ in made}
hosts = {out.split()[1] for _, out in made}
assert len(ids) == 50 and len(hosts) == 50, (len(ids), len(hosts))
assert all(out.split()[0] == str(i) for i, (_, out) in enumerate(made))
assert len(Sandbox.list().next_items()) == 50
with ThreadPoolExecutor(50) as pool:
    list(pool.map(lambda m: m[0].kill(), made))
assert Sandbox.list().next_items() == []
print("done")
"#,
    );
}

#[test]
fn e2b_async_sdk_streams_commands_and_directory_events() {
    let Some(root) = setup("e2b_async_sdk_streams_commands_and_directory_events") else {
        return;
    };
    let mut server = Server::start(&root);
    let out = server.ok(r#"
import asyncio
from e2b import AsyncSandbox
async def main():
    sb = await AsyncSandbox.create()
    await sb.files.make_dir("w")
    seen = []
    h = await sb.files.watch_dir("w", on_event=lambda e: seen.append((e.name, e.type.name)))
    await sb.files.write("w/a.txt", "1")
    await sb.commands.run("rm w/a.txt")
    for _ in range(100):
        if ("a.txt", "REMOVE") in seen:
            break
        await asyncio.sleep(0.05)
    assert ("a.txt", "CREATE") in seen and ("a.txt", "REMOVE") in seen, seen
    await h.stop()
    lines = []
    r = await sb.commands.run("echo one; sleep 0.2; echo two", on_stdout=lambda l: lines.append(l))
    assert r.stdout == "one\ntwo\n" and lines == ["one\n", "two\n"], (r.stdout, lines)
    await sb.kill()
    # (The SDK's HTTP client, pyqwest 0.12, aborts the interpreter when a
    # connection of its pool closes while Python finalizes: a program that
    # exits right after a kill does so about one time in five. Known issue,
    # docs/e2b.md; let its threads see the close first.)
    await asyncio.sleep(0.5)
    print("done")
asyncio.run(main())
"#);
    assert!(out.contains("done"), "{out}");
    server.stop();
}

/// Where `scripts/setup.sh` installs the E2B JavaScript SDK.
const E2B_JS: &str = "/opt/nestbox/e2b-js/node_modules";

#[test]
fn e2b_js_sdk_smoke() {
    let test = "e2b_js_sdk_smoke";
    let installed = std::path::Path::new(E2B_JS)
        .join("e2b/package.json")
        .exists()
        && Command::new("node")
            .arg("--version")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if !nestbox_testkit::require(
        installed,
        test,
        "node or the e2b npm package (scripts/setup.sh installs it in /opt/nestbox/e2b-js) is missing",
    ) {
        return;
    }
    let Some(root) = setup(test) else {
        return;
    };
    let mut server = Server::start(&root);
    let script = r#"
const { Sandbox } = require('e2b');
(async () => {
  const sbx = await Sandbox.create();
  const r = await sbx.commands.run('echo hello from js; id -un; pwd');
  if (r.stdout !== 'hello from js\nuser\n/home/user\n') throw new Error(JSON.stringify(r.stdout));
  await sbx.files.write('js.txt', 'written by node');
  if (await sbx.files.read('/home/user/js.txt') !== 'written by node') throw new Error('read');
  const names = (await sbx.files.list('.')).map(e => e.name);
  if (JSON.stringify(names) !== '["js.txt"]') throw new Error(JSON.stringify(names));
  const h = await sbx.commands.run('sleep 100', { background: true });
  if (!(await h.kill())) throw new Error('kill');
  await sbx.kill();
  if ((await Sandbox.list().nextItems()).length !== 0) throw new Error('still listed');
  console.log('done');
})().catch(e => { console.error(e); process.exit(1); });
"#;
    let child = Command::new("node")
        .args(["-e", script])
        .env("NODE_PATH", E2B_JS)
        .env("E2B_API_URL", &server.url)
        .env("E2B_SANDBOX_URL", &server.url)
        .env("E2B_API_KEY", KEY)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn node");
    let out = finish(child, None, Duration::from_secs(120), "node (e2b)".into());
    assert_eq!(out.code, 0, "{out}");
    assert!(out.stdout.contains("done"), "{out}");
    server.stop();
}

#[test]
fn e2b_sdk_clones_any_nestbox_template_by_name() {
    let Some(root) = setup("e2b_sdk_clones_any_nestbox_template_by_name") else {
        return;
    };
    // A template of its own, without the agent: its commands go through
    // `nestbox exec`, as root (the host's passwd has no `user`).
    root.detached_sh("plain", &[], "echo warm > /tmp/warm; exec sleep infinity");
    wait_for("/tmp/warm", Duration::from_secs(10), || {
        root.run(&["exec", "plain", "--", "cat", "/tmp/warm"]).code == 0
    });
    root.ok(&["freeze", "plain", "--pool", "1"]);
    let mut server = Server::start(&root);
    let out = server.ok(r#"
from e2b import Sandbox, CommandExitException
sb = Sandbox.create(template="plain")
assert sb.get_info().template_id == "plain"
# Started by `nestbox exec`: its parent is outside the box (pid 0 there).
r = sb.commands.run("cat /tmp/warm; id -u; echo $PPID")
assert r.stdout == "warm\n0\n0\n", r.stdout
try:
    sb.commands.run("echo e >&2; exit 4")
    raise SystemExit("no exception")
except CommandExitException as e:
    assert (e.exit_code, e.stderr) == (4, "e\n"), (e.exit_code, e.stderr)
h = sb.commands.run("sleep 100", background=True)
assert h.kill()
sb.files.write("/tmp/f", "x")
assert sb.commands.run("cat /tmp/f").stdout == "x"
sb.kill()
print("done")
"#);
    assert!(out.contains("done"), "{out}");
    server.stop();
}

#[test]
fn e2b_sdk_terminals_have_their_size_and_take_input() {
    sdk_test(
        "e2b_sdk_terminals_have_their_size_and_take_input",
        r#"
from e2b import Sandbox, PtySize, CommandExitException
sb = Sandbox.create()
h = sb.pty.create(PtySize(rows=30, cols=100))
sb.pty.resize(h.pid, PtySize(rows=40, cols=120))
sb.pty.send_stdin(h.pid, b"stty size; tty; echo $TERM; id -un; exit 3\n")
data = []
try:
    h.wait(on_pty=lambda d: data.append(d))
    raise SystemExit("exit 3 reported as success")
except CommandExitException as e:
    assert e.exit_code == 3, e.exit_code
out = b"".join(data).decode(errors="replace")
assert "40 120" in out, out
assert "/dev/pts/" in out and "xterm-256color" in out and "user" in out, out
sb.kill()
print("done")
"#,
    );
}
