//! Lazy restore (`restore --lazy`), seen from outside: a Python server
//! holding memory whose every page is different and known is checkpointed
//! and restored lazily; it answers at once, its memory's checksum is the
//! original's (pages read while the page server fills them, pages read long
//! after, pages moved by `mremap`, a child forked during the fill); the
//! box killed -9 during the fill leaves nothing (a checkpoint of it during
//! the fill is refused); the page server killed
//! takes the box with it (no process left hung, none running on zeros).

mod common;

use std::time::Duration;

use common::apps::App;
use common::*;
use serde_json::Value;

/// MIB MiB of pages, page i filled with sha256(i); `/sum` the sha256 of it
/// all, `/page/N` of page N, `/two` of two adjacent mappings, `/growsum` grows the buffer by a page (a
/// `realloc` that moves it with `mremap`), sums the original part and shrinks
/// it back, `/forksum` sums it in a forked child, `/` counts requests.
const SERVER: &str = r#"
import hashlib, http.server, os
MIB = int(os.environ.get('MIB', '32'))
PAGE = 4096
buf = bytearray(MIB << 20)
for i in range(len(buf) // PAGE):
    buf[i*PAGE:(i+1)*PAGE] = hashlib.sha256(str(i).encode()).digest() * (PAGE // 32)
n = len(buf)
# Two adjacent mappings holding data (one made read-only at a page no copy
# run is aligned on): a copy must not cross from one into the other.
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
TWO = 200 * PAGE
two = libc.mmap(None, TWO, 3, 0x22, -1, 0)
ctypes.memmove(two, bytes(buf[PAGE:PAGE + TWO]), TWO)
assert libc.mprotect(two + 103 * PAGE, TWO - 103 * PAGE, 1) == 0
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count, buf
        count += 1
        if self.path.startswith('/page/'):
            i = int(self.path[6:])
            body = hashlib.sha256(bytes(buf[i*PAGE:(i+1)*PAGE])).hexdigest()
        elif self.path == '/sum':
            body = hashlib.sha256(buf).hexdigest()
        elif self.path == '/two':
            body = hashlib.sha256(ctypes.string_at(two, TWO)).hexdigest()
        elif self.path == '/growsum':
            buf.extend(b'x' * PAGE * 64)
            body = hashlib.sha256(memoryview(buf)[:n]).hexdigest()
            del buf[n:]
        elif self.path == '/forksum':
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, hashlib.sha256(buf).hexdigest().encode())
                os._exit(0)
            os.close(w)
            body = os.read(r, 100).decode()
            os.close(r)
            os.waitpid(pid, 0)
        else:
            body = str(count)
        b = body.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a):
        pass
print('ready', flush=True)
http.server.HTTPServer(('127.0.0.1', 8080), H).serve_forever()
"#;

/// Start the server as box `name` with `mib` MiB, checkpoint it as `ck`
/// (the box stops) and remove the box. Returns the app (its directory) and
/// the checksums of the whole memory, of its last page and of the two
/// adjacent mappings.
fn checkpointed(root: &TestRoot, mib: u32, ck: &str) -> (App, String, String, String) {
    checkpointed_with(root, mib, ck, &[])
}

/// [`checkpointed`], with more options of `run`.
fn checkpointed_with(
    root: &TestRoot,
    mib: u32,
    ck: &str,
    opts: &[&str],
) -> (App, String, String, String) {
    let app = App::new(&[("server.py", SERVER)], &["python3", "/app/server.py"], 1);
    let volume = app.volume();
    let env = format!("MIB={mib}");
    let mut args = vec!["run", "-d", "--name", "src", "-e", &env, "-v", &volume];
    args.extend_from_slice(opts);
    args.extend_from_slice(&["--", "python3", "/app/server.py"]);
    root.ok(&args);
    root.wait_logged("src", "ready", Duration::from_secs(120));
    let sum = one(root, "src", "/sum");
    let last = one(root, "src", &format!("/page/{}", mib * 256 - 1));
    let two = one(root, "src", "/two");
    assert_eq!(sum.len(), 64, "a checksum: {sum}");
    root.ok(&["checkpoint", "src", "--as", ck]);
    root.ok(&["rm", "src"]);
    (app, sum, last, two)
}

/// The one field of the server's answer to `path`.
fn one(root: &TestRoot, name: &str, path: &str) -> String {
    box_http_get(root, name, path).join(" ")
}

/// `restore --lazy`: the restored box and its page server.
fn restore_lazily(root: &TestRoot, ck: &str, name: &str) -> (i32, i32) {
    let out = root.ok(&["restore", ck, "--lazy", "--name", name, "--json"]);
    let v: Value = serde_json::from_str(&out).expect("restore --json");
    let server = &v["page_server"];
    assert!(
        server["pages"].as_u64().unwrap_or(0) > 1000,
        "restored lazily: {v}"
    );
    (
        v["pid"].as_i64().unwrap() as i32,
        server["pid"].as_i64().unwrap() as i32,
    )
}

/// The children of process `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Processes whose command line names this test's root (its boxes'
/// monitors, a page server, a guardian).
fn processes_of(root: &TestRoot) -> Vec<i32> {
    let mark = root.path().to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            pid_alive(*pid)
                && std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| String::from_utf8_lossy(&c).contains(&mark))
                    .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_lazily_restored_server_answers_with_its_memory_intact() {
    let Some(root) = TestRoot::new("a_lazily_restored_server_answers_with_its_memory_intact")
    else {
        return;
    };
    let (_app, sum, last, two) = checkpointed(&root, 256, "ck");
    let last_page = format!("/page/{}", 256 * 256 - 1);

    // Asked at once, while the page server fills the memory: the last page
    // (a fault ahead of the fill), a child forked now (its memory has a
    // userfaultfd of its own, served from the same image), the memory moved
    // by mremap, then the whole.
    let (_, server) = restore_lazily(&root, "ck", "a");
    assert_eq!(one(&root, "a", &last_page), last, "the last page, at once");
    assert!(pid_alive(server), "the page server still fills at the fork");
    assert_eq!(one(&root, "a", "/forksum"), sum, "in a child forked");
    assert_eq!(one(&root, "a", "/growsum"), sum, "after an mremap");
    assert_eq!(one(&root, "a", "/sum"), sum, "the whole memory");
    assert_eq!(one(&root, "a", "/two"), two, "two adjacent mappings");
    wait_for("the page server to finish", Duration::from_secs(60), || {
        !pid_alive(server)
    });
    assert_eq!(one(&root, "a", "/sum"), sum, "once filled");
    assert_eq!(one(&root, "a", "/"), "10", "the count continues");

    // Touched only once the fill is over: pages the background pass put in.
    let (_, server) = restore_lazily(&root, "ck", "b");
    wait_for("the page server to finish", Duration::from_secs(60), || {
        !pid_alive(server)
    });
    assert_eq!(one(&root, "b", &last_page), last, "the last page, late");
    assert_eq!(one(&root, "b", "/sum"), sum, "the whole memory, late");
    assert_eq!(one(&root, "b", "/two"), two, "two adjacent mappings, late");
    assert_eq!(one(&root, "b", "/"), "7", "the count continues");

    root.ok(&["rm", "-f", "a", "b"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    assert!(processes_of(&root).is_empty(), "{:?}", processes_of(&root));
}

#[test]
fn a_lazily_restored_box_killed_during_the_fill_leaves_nothing() {
    let Some(root) = TestRoot::new("a_lazily_restored_box_killed_during_the_fill_leaves_nothing")
    else {
        return;
    };
    let (_app, _, _, _) = checkpointed(&root, 256, "ck");
    let (pid, server) = restore_lazily(&root, "ck", "k");
    let guardian = children_of(server);
    // The page server is held (SIGSTOP) so that the fill cannot end before
    // the checkpoint looks (on a loaded machine it could, and the checkpoint
    // then rightly succeeds): its memory is not all in, so a checkpoint now
    // is refused in one line, before it reads any page.
    let signal = |sig: &str, pid: i32| {
        let status = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {sig} {pid}");
    };
    signal("-STOP", server);
    let out = root.run(&["checkpoint", "k", "--as", "early", "--leave-running"]);
    signal("-CONT", server);
    assert_error(
        &out,
        125,
        "a lazy restore's page server is still filling it",
    );
    assert!(
        pid_alive(server) && guardian.len() == 1,
        "the page server (and its guardian) still filling when the box is killed"
    );
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status();
    wait_for("the page server to end", Duration::from_secs(30), || {
        !pid_alive(server) && !pid_alive(guardian[0])
    });
    root.wait_exited("k", Duration::from_secs(30));
    root.ok(&["rm", "k"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    root.assert_no_boxes();
    assert!(processes_of(&root).is_empty(), "{:?}", processes_of(&root));
}

#[test]
fn a_killed_page_server_takes_its_box_with_it() {
    let Some(root) = TestRoot::new("a_killed_page_server_takes_its_box_with_it") else {
        return;
    };
    let (_app, _, _, _) = checkpointed(&root, 256, "ck");
    let (pid, server) = restore_lazily(&root, "ck", "k");
    let guardian = children_of(server);
    assert!(
        pid_alive(server) && guardian.len() == 1,
        "the page server (and its guardian) still filling when it is killed"
    );
    let _ = std::process::Command::new("kill")
        .args(["-9", &server.to_string()])
        .status();
    // The guardian kills the box: its process ends (not hung in a fault,
    // not running on zero pages), then the guardian goes.
    let code = root.wait_exited("k", Duration::from_secs(30));
    assert_eq!(code, 137, "the box was killed");
    // Said in the box's monitor log (the restore command is gone).
    let log = std::fs::read_dir(root.path().join("lib/boxes"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("monitor.log")).ok())
        .collect::<String>();
    assert!(
        log.contains("the page server ended before every page was in"),
        "monitor log: {log}"
    );
    wait_for(
        "the box's process and the guardian to end",
        Duration::from_secs(30),
        || !pid_alive(pid) && !pid_alive(guardian[0]),
    );
    root.ok(&["rm", "k"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    root.assert_no_boxes();
    assert!(processes_of(&root).is_empty(), "{:?}", processes_of(&root));
}

/// A box in a user namespace of its own cannot have a userfaultfd that
/// serves faults in system calls (its process lacks CAP_SYS_PTRACE of the
/// host): `restore --lazy` restores it at once, correctly.
#[test]
fn a_box_in_a_user_namespace_is_restored_at_once_under_lazy() {
    let Some(root) = TestRoot::new("a_box_in_a_user_namespace_is_restored_at_once_under_lazy")
    else {
        return;
    };
    let (_app, sum, _, two) = checkpointed_with(&root, 32, "ck", &["--userns"]);
    let out = root.ok(&["restore", "ck", "--lazy", "--name", "u", "--json"]);
    let v: Value = serde_json::from_str(&out).expect("restore --json");
    assert!(v["page_server"].is_null(), "restored at once: {v}");
    assert_eq!(one(&root, "u", "/sum"), sum, "the whole memory");
    assert_eq!(one(&root, "u", "/two"), two, "two adjacent mappings");
    assert_eq!(one(&root, "u", "/"), "6", "the count continues");
    root.ok(&["rm", "-f", "u"]);
    root.ok(&["checkpoint", "rm", "ck"]);
    root.assert_no_boxes();
}
