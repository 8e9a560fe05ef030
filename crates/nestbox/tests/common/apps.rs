//! Real servers the tests run in boxes: a Node.js HTTP server, a Go
//! `net/http` server, a Java server on `com.sun.net.httpserver` with a fixed
//! thread pool, and a Python server that hands requests to a pre-started
//! `ThreadPoolExecutor`. Each counts requests in memory and answers
//! `COUNT HOSTNAME` on 127.0.0.1:8080, printing `ready` once it listens.
//!
//! The programs come from the host (`/usr` is bound read-only into boxes; the
//! Go server is built on the host and given to the box through a volume). A
//! missing program skips the test, which under `CI=true` is a failure
//! (`scripts/setup.sh` installs them).

use std::path::{Path, PathBuf};

use super::*;

pub const NODE_SERVER: &str = r#"
const http = require('http'), os = require('os'), crypto = require('crypto');
let count = 0;
http.createServer((req, res) => {
  const n = ++count;
  // Answered from libuv's thread pool: its threads must run in the clone.
  crypto.pbkdf2('key', 'salt', 1, 16, 'sha256', () => {
    const body = `${n} ${os.hostname()}\n`;
    res.writeHead(200, {'Content-Length': Buffer.byteLength(body)});
    res.end(body);
  });
}).listen(8080, '127.0.0.1', () => {
  crypto.pbkdf2('key', 'salt', 1, 16, 'sha256', () => console.log('ready'));
});
"#;

pub const GO_SERVER: &str = r#"package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"sync/atomic"
)

var count atomic.Int64

func main() {
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		n := count.Add(1)
		host, _ := os.Hostname()
		fmt.Fprintf(w, "%d %s\n", n, host)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:8080")
	if err != nil {
		panic(err)
	}
	fmt.Println("ready")
	http.Serve(ln, nil)
}
"#;

pub const JAVA_SERVER: &str = r#"
import com.sun.net.httpserver.HttpServer;
import java.net.InetSocketAddress;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.concurrent.Executors;
import java.util.concurrent.ThreadPoolExecutor;
import java.util.concurrent.atomic.AtomicLong;

public class Server {
    public static void main(String[] args) throws Exception {
        AtomicLong count = new AtomicLong();
        HttpServer server = HttpServer.create(new InetSocketAddress("127.0.0.1", 8080), 0);
        server.createContext("/", ex -> {
            long n = count.incrementAndGet();
            String host = Files.readString(Path.of("/proc/sys/kernel/hostname")).trim();
            byte[] body = (n + " " + host + "\n").getBytes();
            ex.sendResponseHeaders(200, body.length);
            ex.getResponseBody().write(body);
            ex.close();
        });
        ThreadPoolExecutor pool = (ThreadPoolExecutor) Executors.newFixedThreadPool(4);
        pool.prestartAllCoreThreads();
        server.setExecutor(pool);
        server.start();
        System.out.println("ready");
    }
}
"#;

/// Requests counted by the executor's threads (all four started before
/// `ready`), answered by the server's thread.
pub const PYTHON_POOL_SERVER: &str = r#"
import concurrent.futures, http.server, os, threading
pool = concurrent.futures.ThreadPoolExecutor(4)
started = threading.Barrier(5)
for _ in range(4):
    pool.submit(started.wait)
started.wait()
count = 0
lock = threading.Lock()
def work():
    global count
    with lock:
        count += 1
        return count
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        n = pool.submit(work).result(timeout=10)
        body = f'{n} {os.uname().nodename}\n'.encode()
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

/// A server program: its files (put in a host directory mounted at `/app`),
/// its command in the box, and how many threads it has at least once ready.
pub struct App {
    pub dir: tempfile::TempDir,
    pub cmd: Vec<String>,
    pub min_threads: usize,
}

impl App {
    pub fn new(files: &[(&str, &str)], cmd: &[&str], min_threads: usize) -> App {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-app-")
            .tempdir_in("/tmp")
            .expect("app dir");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("write app file");
        }
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod app dir");
        App {
            dir,
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            min_threads,
        }
    }

    /// The Node.js server (7 threads once ready).
    pub fn node() -> App {
        App::new(
            &[("server.js", NODE_SERVER)],
            &["node", "/app/server.js"],
            7,
        )
    }

    /// The Java server (10 threads at least).
    pub fn java() -> App {
        // Without the perf data file (a MAP_SHARED file in /tmp, shared memory).
        App::new(
            &[("Server.java", JAVA_SERVER)],
            &["java", "-XX:-UsePerfData", "/app/Server.java"],
            10,
        )
    }

    /// The Python thread-pool server (5 threads).
    pub fn python_pool() -> App {
        App::new(
            &[("server.py", PYTHON_POOL_SERVER)],
            &["python3", "/app/server.py"],
            5,
        )
    }

    pub fn volume(&self) -> String {
        format!("{}:/app:ro", self.dir.path().display())
    }
}

/// Whether `program` is installed (a skip otherwise, a failure under CI).
pub fn have(test: &str, program: &Path) -> bool {
    nestbox_testkit::require(
        program.exists(),
        test,
        &format!(
            "{} is not installed (scripts/setup.sh installs it)",
            program.display()
        ),
    )
}

/// The Go toolchain: /usr/local/go or the one on PATH.
pub fn go_binary() -> PathBuf {
    let local = PathBuf::from("/usr/local/go/bin/go");
    if local.exists() {
        return local;
    }
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|p| p.join("go"))
                .find(|p| p.exists())
        })
        .unwrap_or(local)
}

/// Ask the server in box `name`: (count, hostname).
/// The Python thread-pool server started as box `tpl` of `root`, warmed with
/// one request; the returned app (its files) must live as long as the box.
pub fn started_pool_server(root: &TestRoot) -> App {
    let app = App::python_pool();
    let volume = app.volume();
    root.ok(&[
        "run",
        "-d",
        "--name",
        "tpl",
        "-v",
        &volume,
        "--",
        "python3",
        "/app/server.py",
    ]);
    root.wait_logged("tpl", "ready", std::time::Duration::from_secs(30));
    assert_eq!(get(root, "tpl").0, 1);
    app
}

pub fn get(root: &TestRoot, name: &str) -> (u64, String) {
    let fields = box_http_get(root, name, "/");
    assert_eq!(fields.len(), 2, "answer of {name}: {fields:?}");
    (fields[0].parse().unwrap(), fields[1].to_string())
}

pub fn threads_of(pid: i32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status_field(&status, "Threads")
        .and_then(|t| t.parse().ok())
        .expect("Threads")
}

/// The Go server, built on the host into the app's directory.
pub fn go_app(go: &Path) -> App {
    let app = App::new(
        &[
            ("main.go", GO_SERVER),
            ("go.mod", "module server\n\ngo 1.22\n"),
        ],
        &["/app/server"],
        3,
    );
    let mut build = std::process::Command::new(go);
    build
        .args(["build", "-o", "server", "."])
        .current_dir(app.dir.path())
        .env("CGO_ENABLED", "0");
    if std::env::var_os("HOME").is_none() {
        build.env("GOCACHE", app.dir.path().join("cache"));
    }
    let out = build.output().expect("run go build");
    assert!(
        out.status.success(),
        "go build: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    app
}

/// The prefork server. The master (pid 2) makes the shared counter, the
/// listening socket and the report pipe, forks two workers, then blocks
/// reading reports and writes their number to /tmp/reports. Each answer
/// carries the counter after the request, the worker's pid and its parent's.
pub const PREFORK: &str = r#"
import mmap, os, socket, struct
shared = mmap.mmap(-1, 4096)
lsock = socket.socket()
lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lsock.bind(('0.0.0.0', 8080))
lsock.listen(64)
r, w = os.pipe()
for _ in range(2):
    if os.fork() == 0:
        os.close(r)
        while True:
            conn, _ = lsock.accept()
            conn.recv(4096)
            n = struct.unpack('Q', shared[:8])[0] + 1
            shared[:8] = struct.pack('Q', n)
            body = f'{n} {os.getpid()} {os.getppid()} {os.getsid(0)}\n'.encode()
            os.write(w, b'.')
            conn.sendall(b'HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n' % len(body) + body)
            conn.close()
os.close(w)
reports = 0
print('ready', flush=True)
while True:
    reports += len(os.read(r, 4096))
    with open('/tmp/reports.new', 'w') as f:
        f.write(str(reports))
    os.rename('/tmp/reports.new', '/tmp/reports')
"#;

/// A shell whose background child serves HTTP and which waits for it.
pub const SHELL: &str = "python3 -c \"
import http.server
count = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global count
        count += 1
        body = ('%d\\n' % count).encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print('ready', flush=True)
http.server.HTTPServer(('127.0.0.1', 8080), H).serve_forever()
\" & wait $!; echo \"child ended: $?\"";

/// A parent holding a pidfd of its child: asked, it kills the child through
/// the pidfd and answers with what `waitpid` says of it.
pub const PIDFD_PARENT: &str = r#"
import http.server, os, signal
child = os.fork()
if child == 0:
    while True:
        signal.pause()
pidfd = os.pidfd_open(child)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        _, status = os.waitpid(child, 0)
        body = f'{os.waitstatus_to_exitcode(status)} {child}\n'.encode()
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
print('ready', flush=True)
http.server.HTTPServer(('127.0.0.1', 8080), H).serve_forever()
"#;

/// A test of an app server: its own root, the app's program checked
/// installed (a skip otherwise, a failure under CI), the app made, then
/// `body`.
pub fn app_test(
    test: &str,
    program: Option<&Path>,
    make: impl FnOnce() -> App,
    body: impl FnOnce(&TestRoot, &App),
) {
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if program.is_some_and(|p| !have(test, p)) {
        return;
    }
    body(&root, &make());
}
