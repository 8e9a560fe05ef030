//! The processes of the scenario, run by re-executing the test binary with
//! `NESTBOX_REMOTE_ROLE` set:
//!
//! * `pns`: started in new pid and network namespaces (P_ns, N_P); brings `lo` up
//!   and forks the init of P_ns, which starts the template and reaps orphans;
//! * `template`: the process that is forked. It holds one fd of every kind of the
//!   clone fd matrix, drops to Docker's capabilities, sets `no_new_privs` and
//!   installs nestbox's default seccomp filter plus the cookie rules, then serves
//!   line commands on 127.0.0.1:7777 (and on Unix sockets, UDP 7778) from an
//!   epoll loop, or from a blocking `accept`, or just prints ticks (`sleeper`);
//! * `shell`: builds a clone shell: joins P_ns as pid namespace for children,
//!   forks; the child makes a user namespace owned by root (the test's parent
//!   writes an identity map), then mount/net/uts/ipc/cgroup/pid namespaces, mounts
//!   an overlay over the data directory and tmpfs over `run/` and `gone/`, and
//!   forks the shell's init (pid 1), which reaps orphans.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, IntoRawFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub const ROLE: &str = "NESTBOX_REMOTE_ROLE";
pub const TCP_PORT: u16 = 7777;
pub const UDP_PORT: u16 = 7778;

/// Docker's default capabilities, by number.
pub const DOCKER_CAPS: &[u32] = &[0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31];

pub fn docker_caps_mask() -> u64 {
    DOCKER_CAPS.iter().fold(0, |m, c| m | (1u64 << c))
}

fn die(what: &str) -> ! {
    eprintln!("role failed: {what}: {}", std::io::Error::last_os_error());
    std::process::exit(101)
}

fn check(rc: libc::c_long, what: &str) -> libc::c_long {
    if rc < 0 {
        die(what)
    }
    rc
}

pub fn run(role: &str) -> ! {
    // Fds inherited from cargo (its jobserver pipe) are not part of the scenario.
    // SAFETY: close_range with plain integers; nothing in this fresh process owns
    // fds above 2 yet.
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    match role {
        "pns" => pns(),
        "template" => template(),
        "shell" => shell(),
        other => {
            eprintln!("unknown role {other}");
            std::process::exit(2)
        }
    }
}

/// Bring `lo` up in the current network namespace.
pub fn loopback_up() {
    // SAFETY: plain socket/ioctl calls on a zeroed ifreq whose name we fill in.
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            die("socket for SIOCSIFFLAGS");
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[0] = b'l' as libc::c_char;
        req.ifr_name[1] = b'o' as libc::c_char;
        if libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) < 0 {
            die("SIOCGIFFLAGS lo");
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(sock, libc::SIOCSIFFLAGS, &req) < 0 {
            die("SIOCSIFFLAGS lo");
        }
        libc::close(sock);
    }
}

/// Reap children forever (an init).
fn reap_forever(report: bool) -> ! {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid < 0 {
            std::thread::sleep(Duration::from_millis(20));
        } else if report {
            println!("reaped {pid} {status}");
        }
    }
}

fn fork() -> libc::pid_t {
    // SAFETY: the roles are single-threaded when they fork, so the child may keep
    // running ordinary Rust code.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        die("fork");
    }
    pid
}

fn pns() -> ! {
    loopback_up();
    if fork() == 0 {
        // pid 1 of P_ns: start the template, then reap.
        let exe = std::env::current_exe().unwrap_or_else(|_| die("current_exe"));
        // The child is reaped by reap_forever (waitpid(-1)), not through Child.
        let child = Command::new(exe)
            .env(ROLE, "template")
            .spawn()
            .unwrap_or_else(|_| die("spawn template"));
        std::mem::forget(child);
        reap_forever(false);
    }
    let mut status = 0;
    // SAFETY: waitpid with a valid status pointer.
    unsafe { libc::waitpid(-1, &mut status, 0) };
    std::process::exit(0)
}

fn host_pid() -> i32 {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| die("readlink /proc/self"))
}

fn dir() -> PathBuf {
    PathBuf::from(std::env::var("NBR_DIR").unwrap_or_else(|_| die("NBR_DIR")))
}

fn modes() -> Vec<String> {
    std::env::var("NBR_MODE")
        .unwrap_or_default()
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn cookie() -> [u64; 2] {
    let text = std::env::var("NBR_COOKIE").unwrap_or_else(|_| die("NBR_COOKIE"));
    let (a, b) = text
        .split_once(',')
        .unwrap_or_else(|| die("NBR_COOKIE format"));
    [
        u64::from_str_radix(a, 16).unwrap_or_else(|_| die("cookie")),
        u64::from_str_radix(b, 16).unwrap_or_else(|_| die("cookie")),
    ]
}

/// Drop to Docker's capability set (bounding, effective, permitted).
fn drop_caps() {
    let keep = docker_caps_mask();
    let last: u32 = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    for cap in 0..=last {
        if keep & (1 << cap) == 0 {
            // SAFETY: prctl with integer arguments.
            check(
                unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) }.into(),
                "PR_CAPBSET_DROP",
            );
        }
    }
    let header = [0x2008_0522u32, 0];
    let data = [
        keep as u32,
        keep as u32,
        0u32,
        (keep >> 32) as u32,
        (keep >> 32) as u32,
        0u32,
    ];
    // SAFETY: capset with a v3 header and two data structs (6 u32s).
    check(
        unsafe { libc::syscall(libc::SYS_capset, header.as_ptr(), data.as_ptr()) },
        "capset",
    );
}

fn confine() {
    drop_caps();
    use nestbox_seccomp::{default_profile, Action, CmpOp, DefaultOpts, Rule};
    let [c0, c1] = cookie();
    let mut profile =
        default_profile(DefaultOpts::default().with(nestbox_seccomp::Capability::SysChroot));
    for name in ["setns", "clone3"] {
        let rule = Rule::named(name, Action::Allow)
            .unwrap_or_else(|| die("syscall name"))
            .when(2, CmpOp::Eq, c0)
            .when(3, CmpOp::Eq, c1);
        profile.rules.insert(0, rule);
    }
    let program = profile.compile().unwrap_or_else(|e| {
        eprintln!("{e}");
        die("compile seccomp")
    });
    nestbox_seccomp::set_no_new_privs().unwrap_or_else(|_| die("no_new_privs"));
    program.install().unwrap_or_else(|e| {
        eprintln!("{e}");
        die("install seccomp")
    });
}

/// Whether `setns` is refused without the cookie (it must be).
fn setns_blocked() -> bool {
    let Ok(ns) = File::open("/proc/self/ns/net") else {
        return false;
    };
    // SAFETY: setns with an fd we own.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

struct State {
    counter: u64,
    /// Events seen on the watched outside connection (mode `pairs`).
    noticed: u32,
    log: File,
    eventfd: RawFd,
    timerfd: RawFd,
}

fn template() -> ! {
    let modes = modes();
    let has = |m: &str| modes.iter().any(|x| x == m);
    let dir = dir();
    if has("sleeper") {
        confine();
        println!("ready {} sleeper", host_pid());
        let mut n = 0u64;
        loop {
            std::thread::sleep(Duration::from_millis(30));
            n += 1;
            println!("tick {n}");
        }
    }
    let mut ballast = Vec::new();
    if has("big") {
        ballast = vec![1u8; 50 << 20];
        for i in (0..ballast.len()).step_by(4096) {
            ballast[i] = (i % 251) as u8;
        }
    }
    std::hint::black_box(&ballast);
    let tcp = TcpListener::bind(("127.0.0.1", TCP_PORT)).unwrap_or_else(|_| die("bind tcp"));
    let udp = UdpSocket::bind(("127.0.0.1", UDP_PORT)).unwrap_or_else(|_| die("bind udp"));
    let unix_path = dir.join("run/sock");
    let _ = std::fs::remove_file(&unix_path);
    let unix = UnixListener::bind(&unix_path).unwrap_or_else(|_| die("bind unix"));
    let abstract_name = std::env::var("NBR_ABSTRACT").unwrap_or_else(|_| die("NBR_ABSTRACT"));
    let abs_addr = SocketAddr::from_abstract_name(abstract_name.as_bytes())
        .unwrap_or_else(|_| die("abstract"));
    let abs = UnixListener::bind_addr(&abs_addr).unwrap_or_else(|_| die("bind abstract"));
    let mut log = OpenOptions::new()
        .append(true)
        .create(true)
        .open(dir.join("data/log"))
        .unwrap_or_else(|_| die("open log"));
    log.write_all(b"template\n")
        .unwrap_or_else(|_| die("write log"));
    let ro = File::open(dir.join("data/ro")).unwrap_or_else(|_| die("open ro"));
    let null = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .unwrap_or_else(|_| die("open null"));
    let dirfd = File::open(&dir).unwrap_or_else(|_| die("open dir"));
    // SAFETY: plain fd-creating calls with valid arguments.
    let eventfd = unsafe {
        libc::eventfd(
            5,
            libc::EFD_NONBLOCK | libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC,
        )
    };
    // SAFETY: as above.
    let timerfd = unsafe {
        libc::timerfd_create(
            libc::CLOCK_MONOTONIC,
            libc::TFD_NONBLOCK | libc::TFD_CLOEXEC,
        )
    };
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 7,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: 1000,
            tv_nsec: 0,
        },
    };
    // SAFETY: spec is a valid itimerspec.
    check(
        unsafe { libc::timerfd_settime(timerfd, 0, &spec, std::ptr::null_mut()) }.into(),
        "timerfd_settime",
    );
    // SAFETY: sigset manipulation on a local, then blocking SIGUSR1 for this
    // single-threaded process.
    let signalfd = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR1);
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC)
    };
    if eventfd < 0 || timerfd < 0 || signalfd < 0 {
        die("eventfd/timerfd/signalfd");
    }
    let client = TcpStream::connect(("127.0.0.1", TCP_PORT)).unwrap_or_else(|_| die("connect"));
    let (server, _) = tcp.accept().unwrap_or_else(|_| die("accept"));
    let (pair_a, pair_b) = UnixStream::pair().unwrap_or_else(|_| die("socketpair"));
    let extra = if has("unsupported") {
        // A pidfd of another process (the namespace's init): no clone has it.
        // SAFETY: pidfd_open takes integers only.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getppid(), 0) };
        format!(" otherpidfd={fd}")
    } else if has("pairs") {
        pairs(&dir)
    } else if has("scmrights") {
        // A socket pair with an fd in flight: the clone must be refused.
        let (a, b) = csocketpair(libc::SOCK_STREAM);
        let rights = [null.as_raw_fd()];
        let byte = [b'x'];
        let iov = [std::io::IoSlice::new(&byte)];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&rights)];
        nix::sys::socket::sendmsg::<()>(a, &iov, &cmsg, nix::sys::socket::MsgFlags::empty(), None)
            .unwrap_or_else(|_| die("sendmsg SCM_RIGHTS"));
        format!(" rights_a={a} rights_b={b}")
    } else if has("gone") {
        let f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("gone/file"))
            .unwrap_or_else(|_| die("open gone/file"));
        format!(" gone={}", f.into_raw_fd())
    } else {
        String::new()
    };
    if has("threads") {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_secs(3600));
        });
    }
    let blocking = has("blocking");
    tcp.set_nonblocking(!blocking)
        .unwrap_or_else(|_| die("nonblocking"));
    udp.set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    unix.set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    abs.set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    // SAFETY: epoll_create1 takes flags only.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    let watch = |fd: RawFd, events: u32, data: u64| {
        let mut ev = libc::epoll_event { events, u64: data };
        // SAFETY: ev is a valid epoll_event.
        check(
            unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, fd, &mut ev) }.into(),
            "epoll_ctl",
        );
    };
    let inn = libc::EPOLLIN as u32;
    watch(tcp.as_raw_fd(), inn, 1);
    watch(udp.as_raw_fd(), inn, 2);
    watch(unix.as_raw_fd(), inn, 3);
    watch(abs.as_raw_fd(), inn, 4);
    watch(signalfd, inn, 5);
    watch(eventfd, inn | libc::EPOLLET as u32, 6);
    watch(timerfd, inn, 7);
    if has("pairs") {
        // The outside connection: its placeholder must wake the clone's loop.
        watch(client.as_raw_fd(), inn | libc::EPOLLRDHUP as u32, 8);
    }

    confine();
    println!(
        "ready {} setns_blocked={} tcp={} udp={} unix={} abstract={} log={} ro={} null={} dir={} eventfd={} timerfd={} signalfd={} client={} server={} pair_a={} pair_b={} epoll={}{}",
        host_pid(),
        setns_blocked(),
        tcp.as_raw_fd(),
        udp.as_raw_fd(),
        unix.as_raw_fd(),
        abs.as_raw_fd(),
        log.as_raw_fd(),
        ro.as_raw_fd(),
        null.as_raw_fd(),
        dirfd.as_raw_fd(),
        eventfd,
        timerfd,
        signalfd,
        client.as_raw_fd(),
        server.as_raw_fd(),
        pair_a.as_raw_fd(),
        pair_b.as_raw_fd(),
        epoll,
        extra
    );
    let mut state = State {
        counter: 0,
        noticed: 0,
        log,
        eventfd,
        timerfd,
    };
    if blocking {
        loop {
            if let Ok((conn, _)) = tcp.accept() {
                serve(&mut state, conn);
            }
        }
    }
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
    loop {
        // SAFETY: events is a valid buffer of 16 epoll_events.
        let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), 16, -1) };
        for ev in events.iter().take(n.max(0) as usize) {
            match ev.u64 {
                1 => {
                    while let Ok((conn, _)) = tcp.accept() {
                        serve(&mut state, conn);
                    }
                }
                2 => {
                    let mut buf = [0u8; 256];
                    while let Ok((len, from)) = udp.recv_from(&mut buf) {
                        let text = String::from_utf8_lossy(&buf[..len]).into_owned();
                        let reply = format!("udp {} {}", state.counter, text);
                        let _ = udp.send_to(reply.as_bytes(), from);
                    }
                }
                3 => {
                    while let Ok((conn, _)) = unix.accept() {
                        serve(&mut state, conn);
                    }
                }
                4 => {
                    while let Ok((conn, _)) = abs.accept() {
                        serve(&mut state, conn);
                    }
                }
                8 => {
                    // Reset: noticed once, then no longer watched.
                    state.noticed = ev.events;
                    let mut none = libc::epoll_event { events: 0, u64: 0 };
                    // SAFETY: removing a registration of our own epoll.
                    unsafe {
                        libc::epoll_ctl(epoll, libc::EPOLL_CTL_DEL, client.as_raw_fd(), &mut none)
                    };
                }
                5 => {
                    let mut info = [0u8; 128];
                    // SAFETY: reading a signalfd_siginfo into a 128-byte buffer.
                    while unsafe { libc::read(signalfd, info.as_mut_ptr().cast(), 128) } == 128 {
                        state.counter += 1000;
                    }
                }
                _ => {}
            }
        }
    }
}

trait Conn: Read + Write {
    fn blocking(&self);
}
impl Conn for TcpStream {
    fn blocking(&self) {
        let _ = self.set_nonblocking(false);
    }
}
impl Conn for UnixStream {
    fn blocking(&self) {
        let _ = self.set_nonblocking(false);
    }
}

fn serve(state: &mut State, mut conn: impl Conn) {
    conn.blocking();
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while conn.read(&mut byte).map(|n| n == 1).unwrap_or(false) && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    let (cmd, arg) = line.split_once(' ').unwrap_or((line.as_str(), ""));
    let reply = match cmd {
        "inc" => {
            state.counter += 1;
            state.counter.to_string()
        }
        "get" => state.counter.to_string(),
        // SAFETY: getpid/getppid take no arguments.
        "pid" => unsafe { libc::getpid() }.to_string(),
        // SAFETY: as above.
        "ppid" => unsafe { libc::getppid() }.to_string(),
        "write" => {
            let _ = state.log.write_all(format!("{arg}\n").as_bytes());
            // SAFETY: lseek on our own fd.
            unsafe { libc::lseek(state.log.as_raw_fd(), 0, libc::SEEK_CUR) }.to_string()
        }
        "out" => {
            println!("{arg}");
            "ok".into()
        }
        "hostname" => {
            let mut buf = [0u8; 65];
            // SAFETY: buffer of 65 bytes for a hostname.
            unsafe { libc::gethostname(buf.as_mut_ptr().cast(), 65) };
            String::from_utf8_lossy(buf.split(|b| *b == 0).next().unwrap_or(&[])).into_owned()
        }
        "eventfd" => {
            // Semaphore mode: each read takes 1; count the reads, then put them back.
            let mut reads = 0u64;
            let mut value = 0u64;
            // SAFETY: reading/writing 8 bytes on our eventfd.
            while unsafe { libc::read(state.eventfd, std::ptr::addr_of_mut!(value).cast(), 8) } == 8
            {
                reads += 1;
            }
            if reads > 0 {
                // SAFETY: as above.
                unsafe { libc::write(state.eventfd, std::ptr::addr_of!(reads).cast(), 8) };
            }
            format!("reads={reads} value={value}")
        }
        "timer" => {
            // SAFETY: itimerspec is plain data; timerfd_gettime fills it.
            let mut spec: libc::itimerspec = unsafe { std::mem::zeroed() };
            // SAFETY: as above.
            unsafe { libc::timerfd_gettime(state.timerfd, &mut spec) };
            format!("{} {}", spec.it_value.tv_sec, spec.it_interval.tv_sec)
        }
        "noticed" => format!("{:#x}", state.noticed),
        "read" => read_fd(arg.parse().unwrap_or(-1)),
        "recvs" => recv_all(arg.parse().unwrap_or(-1)),
        "send" => {
            let (fd, text) = arg.split_once(' ').unwrap_or((arg, ""));
            send_fd(fd.parse().unwrap_or(-1), text)
        }
        "socket" => {
            // The number a new socket gets (then closed again).
            // SAFETY: socket/close with integer arguments.
            unsafe {
                let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
                libc::close(fd);
                fd.to_string()
            }
        }
        "touch" => match File::create(arg) {
            Ok(_) => "ok".into(),
            Err(e) => format!("error {e}"),
        },
        "inotify" => inotify_events(arg.parse().unwrap_or(-1)),
        "pidfd" => {
            // SAFETY: pidfd_send_signal with signal 0 only checks the target.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    arg.parse::<i32>().unwrap_or(-1),
                    0,
                    std::ptr::null::<u8>(),
                    0,
                )
            };
            if rc == 0 {
                "ok".into()
            } else {
                format!("err {}", errno())
            }
        }
        "fd" => std::fs::read_link(format!("/proc/self/fd/{arg}"))
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("error {}", e.raw_os_error().unwrap_or(0))),
        other => format!("unknown {other}"),
    };
    let _ = conn.write_all(format!("{reply}\n").as_bytes());
}

fn write_file(path: &str, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|_| die(path));
}

fn mount(src: &str, target: &Path, fstype: &str, flags: libc::c_ulong, data: &str) -> bool {
    let c = |s: &str| CString::new(s).unwrap_or_else(|_| die("nul"));
    let (src, fstype, data) = (c(src), c(fstype), c(data));
    let target = c(target.to_str().unwrap_or_else(|| die("path")));
    // SAFETY: all pointers are NUL-terminated strings alive for the call.
    unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            flags,
            data.as_ptr().cast(),
        ) == 0
    }
}

fn shell() -> ! {
    let pns_init: i32 = std::env::var("NBR_PNS_INIT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die("NBR_PNS_INIT"));
    let dir = dir();
    let ns = File::open(format!("/proc/{pns_init}/ns/pid")).unwrap_or_else(|_| die("open P_ns"));
    // SAFETY: setns with an fd we own.
    check(
        unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWPID) }.into(),
        "setns P_ns",
    );
    let (mut to_child_r, mut to_child_w) = pipe();
    let (mut from_child_r, mut from_child_w) = pipe();
    let child = fork();
    if child > 0 {
        // Parent (root in the initial user namespace): map the child's user namespace.
        drop(to_child_r);
        drop(from_child_w);
        let mut byte = [0u8; 1];
        from_child_r
            .read_exact(&mut byte)
            .unwrap_or_else(|_| die("sync"));
        write_file(&format!("/proc/{child}/uid_map"), "0 0 4294967295");
        write_file(&format!("/proc/{child}/gid_map"), "0 0 4294967295");
        to_child_w.write_all(b"g").unwrap_or_else(|_| die("sync"));
        let mut status = 0;
        // SAFETY: waitpid with a valid status pointer.
        unsafe { libc::waitpid(child, &mut status, 0) };
        std::process::exit(0);
    }
    drop(to_child_w);
    drop(from_child_r);
    // SAFETY: unshare with flags only; this process is single-threaded.
    check(
        unsafe { libc::unshare(libc::CLONE_NEWUSER) }.into(),
        "unshare user",
    );
    from_child_w.write_all(b"u").unwrap_or_else(|_| die("sync"));
    let mut byte = [0u8; 1];
    to_child_r
        .read_exact(&mut byte)
        .unwrap_or_else(|_| die("sync"));
    let flags = libc::CLONE_NEWNS
        | libc::CLONE_NEWNET
        | libc::CLONE_NEWUTS
        | libc::CLONE_NEWIPC
        | libc::CLONE_NEWCGROUP
        | libc::CLONE_NEWPID;
    // SAFETY: unshare with flags only.
    check(unsafe { libc::unshare(flags) }.into(), "unshare namespaces");
    if !mount(
        "none",
        Path::new("/"),
        "",
        libc::MS_REC | libc::MS_PRIVATE,
        "",
    ) {
        die("make / private");
    }
    let data = dir.join("data");
    let lower = data.display().to_string();
    let upper = dir.join("upper").display().to_string();
    let work = dir.join("work").display().to_string();
    let opts = format!("lowerdir={lower},upperdir={upper},workdir={work},userxattr");
    let overlay = mount("overlay", &data, "overlay", 0, &opts);
    if !overlay {
        // Fall back to a private copy of the data directory.
        let copy = dir.join("datacopy");
        let _ = std::fs::create_dir_all(&copy);
        for entry in std::fs::read_dir(&data).into_iter().flatten().flatten() {
            let _ = std::fs::copy(entry.path(), copy.join(entry.file_name()));
        }
        if !mount(&copy.display().to_string(), &data, "", libc::MS_BIND, "") {
            die("bind data copy");
        }
    }
    for sub in ["run", "gone"] {
        if !mount("tmpfs", &dir.join(sub), "tmpfs", 0, "") {
            die("tmpfs");
        }
    }
    let name = b"clone-shell";
    // SAFETY: name is a valid buffer of its length.
    check(
        unsafe { libc::sethostname(name.as_ptr().cast(), name.len()) }.into(),
        "sethostname",
    );
    loopback_up();
    if fork() == 0 {
        println!("shell {} overlay={overlay}", host_pid());
        reap_forever(true);
    }
    let mut status = 0;
    // SAFETY: waitpid with a valid status pointer.
    unsafe { libc::waitpid(-1, &mut status, 0) };
    std::process::exit(0)
}

fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-int buffer.
    check(
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }.into(),
        "pipe2",
    );
    // SAFETY: the fds were just created and are owned by nothing else.
    unsafe {
        use std::os::fd::FromRawFd;
        (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
    }
}

/// Read lines from `reader` into a channel (for the test side).
pub fn line_channel(reader: impl Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(reader).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn cpipe(flags: libc::c_int) -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-int buffer.
    check(
        unsafe { libc::pipe2(fds.as_mut_ptr(), flags) }.into(),
        "pipe2",
    );
    (fds[0], fds[1])
}

fn csocketpair(ty: libc::c_int) -> (RawFd, RawFd) {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid 2-int buffer.
    check(
        unsafe { libc::socketpair(libc::AF_UNIX, ty | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) }
            .into(),
        "socketpair",
    );
    (fds[0], fds[1])
}

fn put(fd: RawFd, text: &str) {
    // SAFETY: writing a valid buffer to our own fd.
    let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    if n != text.len() as isize {
        die("write");
    }
}

/// Mode `pairs`: the connected objects of the fd matrix, with data buffered in
/// them, and an inotify instance and a pidfd. Returns the ready line's part.
fn pairs(dir: &Path) -> String {
    // A pipe with data, its read end non-blocking and dup'd.
    let (pipe_r, pipe_w) = cpipe(libc::O_CLOEXEC | libc::O_NONBLOCK);
    // SAFETY: fcntl on our own fd.
    unsafe { libc::fcntl(pipe_w, libc::F_SETFL, 0) };
    put(pipe_w, "pipe-data\n");
    // SAFETY: dup of our own fd.
    let pipe_r2 = unsafe { libc::dup(pipe_r) };
    // A pipe whose write end is gone: data, then end of file.
    let (half_r, half_w) = cpipe(libc::O_CLOEXEC | libc::O_NONBLOCK);
    put(half_w, "last words");
    // SAFETY: closing our own fd.
    unsafe { libc::close(half_w) };
    // A stream socket pair with data both ways.
    let (s_a, s_b) = csocketpair(libc::SOCK_STREAM | libc::SOCK_NONBLOCK);
    put(s_a, "to-b\n");
    put(s_b, "to-a\n");
    // A datagram socket pair: three messages one way, one the other.
    let (d_a, d_b) = csocketpair(libc::SOCK_DGRAM | libc::SOCK_NONBLOCK);
    for m in ["m1", "msg2", "third"] {
        put(d_a, m);
    }
    put(d_b, "back");
    // A Unix connection made by connect and accept inside the box.
    let path = dir.join("run/pairsock");
    let listener = UnixListener::bind(&path).unwrap_or_else(|_| die("bind pairsock"));
    let client = UnixStream::connect(&path).unwrap_or_else(|_| die("connect pairsock"));
    let (server, _) = listener.accept().unwrap_or_else(|_| die("accept pairsock"));
    drop(listener);
    let _ = std::fs::remove_file(&path);
    (&client)
        .write_all(b"from-client\n")
        .unwrap_or_else(|_| die("write"));
    (&server)
        .write_all(b"from-server\n")
        .unwrap_or_else(|_| die("write"));
    client
        .set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    server
        .set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    // A FIFO opened for reading and writing, with data.
    let fifo_path = CString::new(dir.join("run/fifo").to_str().unwrap_or_else(|| die("path")))
        .unwrap_or_else(|_| die("nul"));
    // SAFETY: NUL-terminated paths; plain calls.
    let fifo = unsafe {
        check(libc::mkfifo(fifo_path.as_ptr(), 0o600).into(), "mkfifo");
        libc::open(
            fifo_path.as_ptr(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    put(fifo, "fifo-data");
    // A Unix connection to a listener outside the box (the test accepts it
    // and sends data), and one whose data carries an fd (mode scmrights).
    let outside =
        UnixStream::connect(dir.join("outside.sock")).unwrap_or_else(|_| die("connect outside"));
    outside
        .set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    // A datagram server of the box and a client connected to it.
    let dsock = dir.join("run/dsock");
    let dsrv = std::os::unix::net::UnixDatagram::bind(&dsock).unwrap_or_else(|_| die("bind dsock"));
    let dcli = std::os::unix::net::UnixDatagram::unbound().unwrap_or_else(|_| die("dgram"));
    dcli.connect(&dsock)
        .unwrap_or_else(|_| die("connect dsock"));
    dsrv.set_nonblocking(true)
        .unwrap_or_else(|_| die("nonblocking"));
    // inotify: wds 1 and 3 (2 removed: a gap).
    for sub in ["wa", "wb", "wc"] {
        let _ = std::fs::create_dir_all(dir.join("data").join(sub));
    }
    // SAFETY: inotify_init1 takes flags only.
    let ino = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    let add = |sub: &str, mask: u32| -> i32 {
        let p = CString::new(
            dir.join("data")
                .join(sub)
                .to_str()
                .unwrap_or_else(|| die("path")),
        )
        .unwrap_or_else(|_| die("nul"));
        // SAFETY: a NUL-terminated path.
        unsafe { libc::inotify_add_watch(ino, p.as_ptr(), mask) }
    };
    let wa = add("wa", libc::IN_CREATE);
    let wb = add("wb", libc::IN_CREATE);
    let wc = add("wc", libc::IN_CREATE | libc::IN_DELETE);
    // SAFETY: removing a watch of our own instance.
    unsafe { libc::inotify_rm_watch(ino, wb) };
    // Read the IN_IGNORED event of the removal: the queue is empty.
    let _ = inotify_events(ino);
    // A pidfd of this very process.
    // SAFETY: pidfd_open takes integers only.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) } as RawFd;
    let line = format!(
        " fifo={fifo} outside={} dsrv={} dcli={} pipe_r={pipe_r} pipe_r2={pipe_r2} pipe_w={pipe_w} half_r={half_r} s_a={s_a} s_b={s_b} d_a={d_a} d_b={d_b} c_client={} c_server={} inotify={ino} wa={wa} wc={wc} pidfd={pidfd}",
        outside.as_raw_fd(),
        dsrv.as_raw_fd(),
        dcli.as_raw_fd(),
        client.as_raw_fd(),
        server.as_raw_fd()
    );
    std::mem::forget(outside);
    std::mem::forget(dsrv);
    std::mem::forget(dcli);
    std::mem::forget(client);
    std::mem::forget(server);
    line
}

/// Read what is available on `fd` without waiting long: `data TEXT` (newlines
/// as `|`), `eof`, `none` or `err ERRNO`.
fn read_fd(fd: RawFd) -> String {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut pfd, 1, 200) } == 0 {
        return "none".into();
    }
    let mut buf = [0u8; 4096];
    // SAFETY: reading into a valid buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    match n {
        0 => "eof".into(),
        n if n < 0 => format!("err {}", errno()),
        n => format!(
            "data {}",
            String::from_utf8_lossy(&buf[..n as usize]).replace('\n', "|")
        ),
    }
}

/// Every datagram queued on `fd`, comma-separated.
fn recv_all(fd: RawFd) -> String {
    let mut msgs = Vec::new();
    loop {
        let mut buf = [0u8; 256];
        // SAFETY: receiving into a valid buffer.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            break;
        }
        msgs.push(String::from_utf8_lossy(&buf[..n as usize]).into_owned());
    }
    format!("msgs {}", msgs.join(","))
}

fn send_fd(fd: RawFd, text: &str) -> String {
    // SAFETY: writing a valid buffer (SIGPIPE is ignored by Rust's runtime).
    let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    if n < 0 {
        format!("err {}", errno())
    } else {
        format!("ok {n}")
    }
}

/// The events queued on inotify fd `fd`: `wd:mask:name` separated by commas.
fn inotify_events(fd: RawFd) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    // SAFETY: reading into a valid buffer.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    let mut at = 0usize;
    while n > 0 && at + 16 <= n as usize {
        let word = |i: usize| u32::from_ne_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let (wd, mask, len) = (word(at) as i32, word(at + 4), word(at + 12) as usize);
        let name = &buf[at + 16..at + 16 + len];
        let name =
            String::from_utf8_lossy(name.split(|b| *b == 0).next().unwrap_or(&[])).into_owned();
        out.push(format!("{wd}:{mask:x}:{name}"));
        at += 16 + len;
    }
    format!("events {}", out.join(","))
}
