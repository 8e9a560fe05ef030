//! Shared memory of a clone, seen from outside: a box whose one process keeps a
//! counter in shared anonymous memory, in a memfd (mapped, and read back
//! through its fd), in a `/dev/shm` file and in a System V segment is frozen and
//! cloned 20 times; every clone continues from the
//! template's values and then diverges on its own, and the template's memory is
//! untouched.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::*;

/// A single-threaded HTTP server with one counter in shared anonymous memory, one
/// in a memfd (mapped; also read through the fd) and one in a mapped `/dev/shm`
/// file (also read by path: the clone's must be its own file in its own
/// `/dev/shm`) and one in a System V segment: the box's first, so its id in the
/// box's fresh IPC namespace is 0, which is also the inode number
/// `/proc/PID/maps` shows for it (a clone once kept the template's segment
/// because of that 0). `/inc` adds one to each, `/get` reads them.
const SERVER: &str = r#"
import ctypes, http.server, mmap, os, struct
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget(0, 4096, 0o600)
assert shmid == 0, f"the box's first System V segment has id {shmid}"
sysv = ctypes.c_uint64.from_address(libc.shmat(shmid, None, 0))
anon = mmap.mmap(-1, 4096)
fd = os.memfd_create('nbcount')
os.ftruncate(fd, 1 << 20)
mem = mmap.mmap(fd, 1 << 20)
sfd = os.open('/dev/shm/nbcount', os.O_RDWR | os.O_CREAT, 0o640)
os.ftruncate(sfd, 4096)
# Only the mapping stays: Python's mmap keeps a duplicate of the fd (on the
# lowest free number, found first), closed too.
dup = os.dup(sfd)
os.close(dup)
shm = mmap.mmap(sfd, 4096)
os.close(dup)
os.close(sfd)
def values():
    a = struct.unpack_from('Q', anon, 0)[0]
    m = struct.unpack_from('Q', mem, 0)[0]
    f = struct.unpack('Q', os.pread(fd, 8, 0))[0]
    s = struct.unpack_from('Q', shm, 0)[0]
    with open('/dev/shm/nbcount', 'rb') as g:
        p = struct.unpack('Q', g.read(8))[0]
    return f'{a} {m} {f} {s} {p} {sysv.value}'
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == '/inc':
            struct.pack_into('Q', anon, 0, struct.unpack_from('Q', anon, 0)[0] + 1)
            struct.pack_into('Q', mem, 0, struct.unpack_from('Q', mem, 0)[0] + 1)
            struct.pack_into('Q', shm, 0, struct.unpack_from('Q', shm, 0)[0] + 1)
            sysv.value += 1
        body = (values() + '\n').encode()
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

/// Ask box `name` for `path`: (anon, memfd, memfd through its fd, System V
/// segment); the `/dev/shm` file's counter, through its mapping and read by
/// path, must agree with the anonymous one.
fn get(root: &TestRoot, name: &str, path: &str) -> (u64, u64, u64, u64) {
    let fields = box_http_get(root, name, path);
    let v: Vec<u64> = fields.iter().map(|w| w.parse().unwrap()).collect();
    assert_eq!(v.len(), 6, "answer of {name}: {fields:?}");
    assert_eq!(
        (v[3], v[4]),
        (v[0], v[0]),
        "/dev/shm file of {name}: {fields:?}"
    );
    (v[0], v[1], v[2], v[5])
}

/// The counters in the template's shared memory, read from the host through
/// `/proc/PID/map_files` (the template is frozen and cannot answer).
fn template_values(pid: i32) -> (u64, u64, u64) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let read = |needle: &str| -> u64 {
        let line = maps
            .lines()
            .find(|l| l.contains(needle) && l.split_whitespace().nth(1).unwrap().ends_with('s'))
            .unwrap_or_else(|| panic!("{needle} mapped in the template:\n{maps}"));
        let range = line.split_whitespace().next().unwrap();
        let file = File::open(format!("/proc/{pid}/map_files/{range}")).unwrap();
        let mut b = [0u8; 8];
        file.read_exact_at(&mut b, 0).unwrap();
        u64::from_ne_bytes(b)
    };
    (
        read("/dev/zero (deleted)"),
        read("/memfd:nbcount"),
        read("/SYSV00000000 (deleted)"),
    )
}

#[test]
fn clones_get_their_own_shared_memory() {
    let Some(root) = TestRoot::new("clones_get_their_own_shared_memory") else {
        return;
    };
    let out = root
        .run(&["run", "-d", "--name", "shm", "--", "python3", "-c", SERVER])
        .ok();
    assert_eq!(out.stdout.trim(), "shm");
    root.wait_logged("shm", "ready", Duration::from_secs(20));
    for i in 1..=3 {
        assert_eq!(get(&root, "shm", "/inc"), (i, i, i, i));
    }
    root.ok(&["freeze", "shm"]);
    let tpid = template_pid(&root, "shm");
    assert_eq!(template_values(tpid), (3, 3, 3));
    let names = root.ok(&["clone", "shm", "-n", "20", "-d", "--name", "m"]);
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 20);
    // Every clone continues from the template's values and writes its own.
    for (i, n) in names.iter().enumerate() {
        assert_eq!(get(&root, n, "/get"), (3, 3, 3, 3), "{n}");
        let times = 1 + (i as u64 % 3);
        for k in 1..=times {
            let want = 3 + k;
            assert_eq!(get(&root, n, "/inc"), (want, want, want, want), "{n}");
        }
    }
    // Each clone's values are its own: no clone saw another's writes.
    for (i, n) in names.iter().enumerate() {
        let want = 3 + 1 + (i as u64 % 3);
        assert_eq!(get(&root, n, "/get"), (want, want, want, want), "{n}");
    }
    // The template's memory is as it was frozen.
    assert_eq!(template_values(tpid), (3, 3, 3));
    root.rm_all(names.iter().copied().chain(["shm"]));
}

/// A file of the box's /dev/shm kept open for writing (not mapped): each clone
/// has the file in its own /dev/shm with the template's contents, and its
/// writes through the fd stay its own.
#[test]
fn a_dev_shm_file_open_for_writing_is_each_clones_own() {
    let Some(root) = TestRoot::new("a_dev_shm_file_open_for_writing_is_each_clones_own") else {
        return;
    };
    let code = r#"
import signal, time
f = open('/dev/shm/counter', 'w+')
f.write('template')
f.flush()
def on_usr1(*a):
    f.write(' clone')
    f.flush()
signal.signal(signal.SIGUSR1, on_usr1)
print('ready', flush=True)
while True:
    time.sleep(3600)
"#;
    root.ok(&[
        "run",
        "-d",
        "--network",
        "none",
        "--name",
        "tpl",
        "--",
        "python3",
        "-c",
        code,
    ]);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    root.ok(&["freeze", "tpl"]);
    root.ok(&[
        "clone",
        "tpl",
        "-d",
        "--name",
        "c1",
        "--on-clone-signal",
        "USR1",
    ]);
    root.ok(&["clone", "tpl", "-d", "--name", "c2"]);
    wait_for("the clone's write", Duration::from_secs(10), || {
        root.ok(&["exec", "c1", "--", "cat", "/dev/shm/counter"]) == "template clone"
    });
    assert_eq!(
        root.ok(&["exec", "c2", "--", "cat", "/dev/shm/counter"]),
        "template"
    );
    root.ok(&["rm", "-f", "c1", "c2", "tpl"]);
}
