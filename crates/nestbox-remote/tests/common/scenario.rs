//! The test side of the scenario: start the template in its own pid and network
//! namespaces, build clone shells, fork, talk to the processes from the outside,
//! and clean everything up (Drop) even when a test panics.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use nestbox_remote::{remote_fork, FdEntry, ForkPlan, Forked, NsKind, RemoteError, Tracee};
use nix::sys::signal::Signal;

use super::roles::{line_channel, ROLE, TCP_PORT, UDP_PORT};

static COUNTER: AtomicU32 = AtomicU32::new(0);

pub const NS_KINDS: [NsKind; 7] = NsKind::SHELL;

/// A running template and everything made for it.
pub struct Scenario {
    pub dir: PathBuf,
    pub template: i32,
    pub tinit: i32,
    pub ready: HashMap<String, String>,
    pub lines: Receiver<String>,
    pub cookie: [u64; 2],
    pub abstract_name: String,
    pub cgroups: Vec<PathBuf>,
    /// A Unix listener outside the template's box (`outside.sock` in the
    /// scenario directory), which mode `pairs` connects to.
    pub outside: std::os::unix::net::UnixListener,
    pns: Child,
    shells: Vec<Shell>,
}

/// A clone shell.
pub struct Shell {
    pub init: i32,
    pub overlay: bool,
    pub lines: Receiver<String>,
    builder: Child,
}

fn random_u64() -> u64 {
    let mut buf = [0u8; 8];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("read /dev/urandom");
    u64::from_ne_bytes(buf)
}

/// Wait for a line starting with `prefix`.
pub fn expect_line(rx: &Receiver<String>, prefix: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with(prefix) => return line,
            Ok(_) => {}
            Err(_) => panic!("no line starting with {prefix:?} within {timeout:?}"),
        }
    }
}

pub fn status_field(pid: i32, key: &str) -> String {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

impl Scenario {
    pub fn start(mode: &str) -> Scenario {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = PathBuf::from(format!("/tmp/nbr-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["data", "upper", "work", "run", "gone"] {
            std::fs::create_dir_all(dir.join(sub)).expect("mkdir");
        }
        std::fs::write(dir.join("data/ro"), "readonly\n").expect("write ro");
        let cookie = [random_u64(), random_u64()];
        let abstract_name = format!("nbr-{}-{n}", std::process::id());
        let outside = std::os::unix::net::UnixListener::bind(dir.join("outside.sock"))
            .expect("bind outside.sock");
        let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
        cmd.env(ROLE, "pns")
            .env("NBR_DIR", &dir)
            .env("NBR_MODE", mode)
            .env("NBR_COOKIE", format!("{:x},{:x}", cookie[0], cookie[1]))
            .env("NBR_ABSTRACT", &abstract_name)
            .stdin(Stdio::null())
            .stdout(Stdio::piped());
        // SAFETY: the closure only calls unshare, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut pns = cmd.spawn().expect("spawn pns");
        let lines = line_channel(pns.stdout.take().expect("stdout"));
        let mut scenario = Scenario {
            dir,
            template: 0,
            tinit: 0,
            ready: HashMap::new(),
            lines,
            cookie,
            abstract_name,
            cgroups: Vec::new(),
            outside,
            pns,
            shells: Vec::new(),
        };
        let ready = expect_line(&scenario.lines, "ready ", Duration::from_secs(20));
        let mut words = ready.split_whitespace().skip(1);
        scenario.template = words
            .next()
            .and_then(|w| w.parse().ok())
            .expect("template pid");
        scenario.ready = words
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        scenario.tinit = status_field(scenario.template, "PPid")
            .parse()
            .expect("PPid");
        for controller in ["pids", "memory"] {
            let path = PathBuf::from(format!(
                "/sys/fs/cgroup/{controller}/nbr-{}-{n}",
                std::process::id()
            ));
            if std::fs::create_dir(&path).is_ok() {
                scenario.cgroups.push(path);
            }
        }
        scenario
    }

    /// The template's fd number for `name`.
    pub fn fd(&self, name: &str) -> i32 {
        self.ready
            .get(name)
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no fd {name}"))
    }

    pub fn shell(&mut self) -> usize {
        let mut builder = Command::new(std::env::current_exe().expect("current_exe"))
            .env(ROLE, "shell")
            .env("NBR_DIR", &self.dir)
            .env("NBR_PNS_INIT", self.tinit.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn shell");
        let lines = line_channel(builder.stdout.take().expect("stdout"));
        let line = expect_line(&lines, "shell ", Duration::from_secs(20));
        let mut words = line.split_whitespace().skip(1);
        let init = words
            .next()
            .and_then(|w| w.parse().ok())
            .expect("shell init pid");
        let overlay = words.next() == Some("overlay=true");
        self.shells.push(Shell {
            init,
            overlay,
            lines,
            builder,
        });
        self.shells.len() - 1
    }

    pub fn shell_ref(&self, i: usize) -> &Shell {
        &self.shells[i]
    }

    pub fn task_files(&self) -> Vec<PathBuf> {
        self.cgroups.iter().map(|c| c.join("tasks")).collect()
    }

    /// Seize the template, remote-fork it into shell `i`, detach it.
    pub fn fork(
        &self,
        shell: usize,
        stdio: [&OwnedFd; 3],
        signal: Option<Signal>,
    ) -> Result<Forked, RemoteError> {
        self.fork_with(shell, stdio, signal, None)
    }

    /// [`Scenario::fork`] with an inventory taken beforehand.
    pub fn fork_with(
        &self,
        shell: usize,
        stdio: [&OwnedFd; 3],
        signal: Option<Signal>,
        inventory: Option<Vec<FdEntry>>,
    ) -> Result<Forked, RemoteError> {
        let init = self.shells[shell].init;
        let files: Vec<(NsKind, File)> = NS_KINDS
            .iter()
            .map(|k| {
                let f = File::open(format!("/proc/{init}/ns/{}", k.proc_name())).expect("open ns");
                (*k, f)
            })
            .collect();
        let mut template = Tracee::seize_and_interrupt(self.template)?;
        template.wait_stopped(Duration::from_secs(2))?;
        let plan = ForkPlan {
            namespaces: files.iter().map(|(k, f)| (*k, f.as_fd())).collect(),
            setns_cookie: self.cookie,
            cgroup_task_files: self.task_files(),
            tasks_files_opener: None,
            stdio: [stdio[0].as_fd(), stdio[1].as_fd(), stdio[2].as_fd()],
            on_clone_signal: signal,
            inventory,
        };
        let result = remote_fork(&mut template, &plan);
        template.detach()?;
        result
    }
}

impl Drop for Scenario {
    fn drop(&mut self) {
        // Killing P_ns's init kills every process of P_ns and of the shells'
        // pid namespaces (they are descendants of P_ns).
        // SAFETY: kill with plain integers.
        unsafe { libc::kill(self.tinit, libc::SIGKILL) };
        let _ = self.pns.kill();
        let _ = self.pns.wait();
        for shell in &mut self.shells {
            let _ = shell.builder.kill();
            let _ = shell.builder.wait();
        }
        for cg in &self.cgroups {
            for _ in 0..100 {
                if std::fs::remove_dir(cg).is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Run `f` in a thread that has joined the network namespace of `pid`.
pub fn in_netns<T: Send + 'static>(pid: i32, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = File::open(format!("/proc/{pid}/ns/net")).expect("open netns");
    std::thread::spawn(move || {
        // SAFETY: setns on a thread of our own with an fd we own.
        let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns net: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("netns thread")
}

fn exchange(mut conn: impl Read + Write, cmd: &str) -> String {
    conn.write_all(format!("{cmd}\n").as_bytes()).expect("send");
    let mut reply = String::new();
    conn.read_to_string(&mut reply).expect("recv");
    reply.trim_end().to_string()
}

/// Send a command over TCP 127.0.0.1:7777 in `pid`'s network namespace.
pub fn ask(pid: i32, cmd: &str) -> String {
    let cmd = cmd.to_string();
    in_netns(pid, move || {
        let conn = TcpStream::connect(("127.0.0.1", TCP_PORT)).expect("connect tcp");
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok();
        exchange(conn, &cmd)
    })
}

/// Like [`ask`] but `None` when nothing listens.
pub fn try_ask(pid: i32, cmd: &str) -> Option<String> {
    let cmd = cmd.to_string();
    in_netns(pid, move || {
        let conn = TcpStream::connect(("127.0.0.1", TCP_PORT)).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok();
        Some(exchange(conn, &cmd))
    })
}

pub fn ask_unix(path: &Path, cmd: &str) -> String {
    let conn =
        UnixStream::connect(path).unwrap_or_else(|e| panic!("connect {}: {e}", path.display()));
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok();
    exchange(conn, cmd)
}

pub fn ask_abstract(pid: i32, name: &str, cmd: &str) -> String {
    let (name, cmd) = (name.to_string(), cmd.to_string());
    in_netns(pid, move || {
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).expect("abstract");
        let conn = UnixStream::connect_addr(&addr).expect("connect abstract");
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok();
        exchange(conn, &cmd)
    })
}

pub fn ask_udp(pid: i32, payload: &str) -> String {
    let payload = payload.to_string();
    in_netns(pid, move || {
        let sock = UdpSocket::bind(("127.0.0.1", 0)).expect("bind udp");
        sock.set_read_timeout(Some(Duration::from_secs(5))).ok();
        sock.send_to(payload.as_bytes(), ("127.0.0.1", UDP_PORT))
            .expect("send udp");
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).expect("recv udp");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    })
}

/// Whether two processes' fds refer to the same open file description.
pub fn same_file(pid1: i32, fd1: i32, pid2: i32, fd2: i32) -> bool {
    const KCMP_FILE: libc::c_int = 0;
    // SAFETY: kcmp takes plain integers.
    let rc = unsafe { libc::syscall(libc::SYS_kcmp, pid1, pid2, KCMP_FILE, fd1, fd2) };
    assert!(rc >= 0, "kcmp: {}", std::io::Error::last_os_error());
    rc == 0
}

pub fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-int buffer.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: the fds were just created and are owned by nothing else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

pub fn dev_null() -> OwnedFd {
    File::options()
        .read(true)
        .write(true)
        .open("/dev/null")
        .expect("/dev/null")
        .into()
}

/// Host pids of the live processes whose pid namespace is `pid`'s.
pub fn processes_in_pidns_of(pid: i32) -> Vec<i32> {
    let target = std::fs::read_link(format!("/proc/{pid}/ns/pid")).expect("ns/pid");
    std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()))
        .filter(|p| {
            std::fs::read_link(format!("/proc/{p}/ns/pid"))
                .ok()
                .as_ref()
                == Some(&target)
        })
        .filter(|p| !status_field(*p, "State").starts_with('Z'))
        .collect()
}

pub fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub fn kill_and_wait_gone(pid: i32) {
    // SAFETY: kill with plain integers.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    wait_until("the clone to be reaped", Duration::from_secs(5), || {
        !Path::new(&format!("/proc/{pid}")).exists()
    });
}
