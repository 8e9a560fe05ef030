//! Rows of `docs/security.md` that the other suites do not prove, each checked
//! from where an attacker would stand: inside a box (its init cannot be traced,
//! read or killed; a device node made in the box cannot be opened) or as an
//! unprivileged user on the host (the API socket refuses them).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::*;

const EACCES: &str = "13";
const EPERM: &str = "1";

#[test]
fn init_cannot_be_traced_read_or_killed_from_the_box() {
    let Some(root) = TestRoot::new("init_cannot_be_traced_read_or_killed_from_the_box") else {
        return;
    };
    // Box root (Docker's capabilities, no CAP_SYS_PTRACE) against pid 1.
    let code = r#"
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
for name, request in (('attach', 16), ('seize', 0x4206)):
    ctypes.set_errno(0)
    r = libc.ptrace(request, 1, None, None)
    print(name, r, ctypes.get_errno())
for f in ('mem', 'environ', 'maps'):
    try:
        open('/proc/1/' + f, 'rb').read(1)
        print(f, 'readable')
    except OSError as e:
        print(f, e.errno)
os.kill(1, signal.SIGKILL)
time.sleep(0.3)
os.kill(1, 0)
print('init alive')
"#;
    let out = root.py(&[], code).ok();
    assert_eq!(
        out.lines(),
        [
            format!("attach -1 {EPERM}"),
            format!("seize -1 {EPERM}"),
            format!("mem {EACCES}"),
            format!("environ {EACCES}"),
            format!("maps {EACCES}"),
            "init alive".to_string(),
        ],
        "the box's init must be untraceable, unreadable and unkillable from inside\n{out}"
    );
}

#[test]
fn device_nodes_made_in_the_box_cannot_be_opened() {
    let Some(root) = TestRoot::new("device_nodes_made_in_the_box_cannot_be_opened") else {
        return;
    };
    let volume = tempfile::Builder::new()
        .prefix("nestbox-test-volume-")
        .tempdir_in("/tmp")
        .expect("volume dir");
    let bind = format!("{}:/vol", volume.path().display());
    // Box root keeps CAP_MKNOD (Docker's set): making a node of /dev/null
    // (char 1:3) succeeds on every writable filesystem of the box, and
    // opening it must fail there because each of them is mounted nodev.
    let code = r#"
import os, stat
for d in ('/', '/tmp', '/root', '/var', '/dev', '/dev/shm', '/scratch', '/vol'):
    p = os.path.join(d, 'nbnull')
    os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    try:
        os.close(os.open(p, os.O_RDWR))
        print(d, 'opened')
    except OSError as e:
        print(d, e.errno)
"#;
    let out = root.py(&["--tmpfs", "/scratch", "-v", &bind], code).ok();
    let expected: Vec<String> = [
        "/", "/tmp", "/root", "/var", "/dev", "/dev/shm", "/scratch", "/vol",
    ]
    .iter()
    .map(|d| format!("{d} {EACCES}"))
    .collect();
    assert_eq!(
        out.lines(),
        expected,
        "a writable filesystem is not nodev\n{out}"
    );
}

#[test]
fn api_socket_is_for_root_only() {
    let Some(root) = TestRoot::new("api_socket_is_for_root_only") else {
        return;
    };
    let socket = root.path().join("run").join("nestbox.sock");
    let mut server = root.spawn(&["serve"]);
    wait_for("the API socket", Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let meta = std::fs::metadata(&socket).expect("stat the socket");
    let mode = meta.permissions().mode() & 0o7777;
    let owner = meta.uid();
    // An unprivileged user on the host cannot connect. The directories on the
    // way are opened up for this test, so that only the socket's own mode
    // decides; the control afterwards shows the path is then reachable.
    for dir in [root.path().to_path_buf(), root.path().join("run")] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    let connect_as_nobody = || {
        let out = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n    print('connected')\nexcept OSError as e:\n    print(e.errno)\n",
                socket.to_str().unwrap(),
            ])
            .uid(65534)
            .gid(65534)
            .output()
            .expect("run python3 as nobody");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let refused = connect_as_nobody();
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    let control = connect_as_nobody();
    server.kill().expect("stop serve");
    server.wait().expect("reap serve");
    assert_eq!(
        (mode, owner),
        (0o600, 0),
        "socket mode {mode:o}, owner {owner}"
    );
    assert_eq!(refused, EACCES, "nobody must not reach the API");
    assert_eq!(
        control, "connected",
        "control: with mode 0666 the socket is reachable"
    );
}

#[test]
fn no_host_fd_reaches_the_box() {
    let Some(root) = TestRoot::new("no_host_fd_reaches_the_box") else {
        return;
    };
    // The caller leaves inheritable fds 5 (a host file) and 6 (a directory)
    // open when it execs nestbox, as a careless parent would.
    let box_code = "import os\nopen_fds = []\nfor fd in range(3, 64):\n    try:\n        os.fstat(fd)\n        open_fds.append(fd)\n    except OSError:\n        pass\nprint(open_fds)\n";
    let wrapper = "import os, sys\nf = os.open('/etc/hostname', os.O_RDONLY)\nd = os.open('/', os.O_RDONLY)\nos.dup2(f, 5)\nos.dup2(d, 6)\nos.execv(sys.argv[1], sys.argv[1:])\n";
    let out = std::process::Command::new("python3")
        .args(["-c", wrapper, NESTBOX, "--root"])
        .arg(root.path())
        .args(["run", "--", "python3", "-c", box_code])
        .output()
        .expect("run the wrapper");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "[]",
        "a host fd reached the box: {out:?}"
    );
}

#[test]
fn the_clone_door_stays_shut_without_the_boxs_cookie() {
    let Some(root) = TestRoot::new("the_clone_door_stays_shut_without_the_boxs_cookie") else {
        return;
    };
    root.detached_sh("door", &[], "sleep 600");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.path().join("run/boxes/door/state.json"))
            .expect("the box's state"),
    )
    .expect("state is JSON");
    let cookie = &state["setns_cookie"];
    let (a, b) = (cookie[0].as_u64().unwrap(), cookie[1].as_u64().unwrap());
    // setns(-1, 0) and clone3(NULL, 0): the kernel would answer EBADF and
    // EINVAL; the box's filter answers EPERM and ENOSYS unless the two unused
    // arguments carry the cookie, which only nestbox (outside the box) knows.
    let code = format!(
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nU = ctypes.c_ulong\n\
         def call(nr, x, y):\n    ctypes.set_errno(0)\n    r = libc.syscall(U(nr), U(2**64 - 1 if nr == 308 else 0), U(0), U(x), U(y))\n    return ctypes.get_errno()\n\
         for nr in (308, 435):\n    print(nr, call(nr, 0, 0), call(nr, {a} ^ 1, {b}), call(nr, {a}, {b}))\n"
    );
    let out = root.run(&["exec", "door", "python3", "-c", &code]).ok();
    root.run(&["rm", "-f", "door"]).ok();
    // EPERM 1, EBADF 9, ENOSYS 38, EINVAL 22 (clone3 with size 0).
    assert_eq!(
        out.lines(),
        ["308 1 1 9", "435 38 38 22"],
        "without the cookie setns and clone3 must stay blocked (the last column is the control with the cookie)\n{out}"
    );
}

/// Every test `docs/security.md` names as proof exists, in the file it names.
#[test]
fn every_test_named_in_the_security_model_exists() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(repo.join("docs/security.md")).expect("docs/security.md");
    let mut checked = 0;
    for row in doc
        .lines()
        .filter(|l| l.starts_with("| ") && l.ends_with(" |"))
    {
        let proof = row
            .trim_end_matches(" |")
            .rsplit(" | ")
            .next()
            .unwrap_or("");
        for group in proof.split("; ") {
            let Some((place, names)) = group.split_once(": ") else {
                continue;
            };
            let file = match place.split_once(' ') {
                // "nestbox-net `shaping`" → crates/nestbox-net/tests/shaping.rs
                Some((krate, test)) => {
                    format!("crates/{krate}/tests/{}.rs", test.trim_matches('`'))
                }
                None => format!("crates/nestbox/tests/{place}.rs"),
            };
            let source = std::fs::read_to_string(repo.join(&file))
                .unwrap_or_else(|e| panic!("{file} (named in docs/security.md): {e}"));
            for name in names.split(", ") {
                let name = name.trim_matches('`');
                assert!(
                    source.contains(&format!("fn {name}(")),
                    "docs/security.md names test {name} in {file}, which has no such test"
                );
                checked += 1;
            }
        }
    }
    assert!(
        checked >= 30,
        "only {checked} tests named: is the table still there?"
    );
}
