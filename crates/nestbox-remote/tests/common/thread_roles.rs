//! The multi-threaded template of `remote_threads.rs`, run as the `template`
//! role when `NBR_MODE` names `mt` (or `zombie`). Confined like a box (nestbox's
//! default seccomp filter plus the setns/clone3 cookie rules, `no_new_privs`)
//! before its threads start, so that they all carry the filter.
//!
//! Each worker thread sits, most of the time, in a different blocking state,
//! blocks its own real-time signal, runs with its own MXCSR (the SSE control
//! register, part of the XSAVE area), and counts its rounds in memory; the main
//! thread serves line commands on 127.0.0.1:7777 from a blocking `accept`:
//!
//! * `get`: `counts=c0,c1,… mxcsr=m0,m1,… onstack=N`
//! * `ids`: `cached0/live0,cached1/live1,…`: each worker's tid as read at its
//!   start and at its last round (the clone must have the same);
//! * `inc`: a counter of the main thread, +1.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// The workers, by index.
pub const WORKERS: [&str; 8] = [
    "condvar",
    "mutex_holder",
    "mutex_waiter",
    "nanosleep",
    "timed_futex",
    "eventfd",
    "timerfd",
    "altstack",
];
/// Index of the worker with an alternate signal stack and a SIGUSR1 handler.
pub const ALTSTACK: usize = 7;

static COUNTS: [AtomicU64; 8] = [const { AtomicU64::new(0) }; 8];
static MXCSR: [AtomicU32; 8] = [const { AtomicU32::new(0) }; 8];
static TIDS: [AtomicI32; 8] = [const { AtomicI32::new(0) }; 8];
static LIVE: [AtomicI32; 8] = [const { AtomicI32::new(0) }; 8];
static ONSTACK: AtomicU64 = AtomicU64::new(0);
static ALT_BASE: AtomicUsize = AtomicUsize::new(0);
const ALT_SIZE: usize = 64 * 1024;
static WAKE: (Mutex<u64>, Condvar) = (Mutex::new(0), Condvar::new());
static EVENTFD: AtomicI32 = AtomicI32::new(-1);
static ROBUST: AtomicUsize = AtomicUsize::new(0);
static NEVER: AtomicU32 = AtomicU32::new(0);
/// A counter in a mapping marked `MADV_DONTFORK` (as V8 marks its heap).
static DONTFORK: AtomicUsize = AtomicUsize::new(0);
/// Rounds of the `long` thread (mode `long`) and how many of its hour-long
/// sleeps ended with EINTR.
static LONG_ROUNDS: AtomicU64 = AtomicU64::new(0);
static LONG_EINTR: AtomicU64 = AtomicU64::new(0);

/// The thread of mode `long`: sleeps an hour at a time, counting early ends.
fn long_sleeper() {
    LONG_ROUNDS.fetch_add(1, Ordering::SeqCst);
    loop {
        let ts = libc::timespec {
            tv_sec: 3600,
            tv_nsec: 0,
        };
        // SAFETY: ts is a valid timespec; no remainder wanted.
        let rc = unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
        if rc == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            LONG_EINTR.fetch_add(1, Ordering::SeqCst);
        }
        LONG_ROUNDS.fetch_add(1, Ordering::SeqCst);
    }
}

/// The word at the start of the third page of that mapping.
pub const MARKER: u64 = 0x5eed_f00d_cafe_d00d;

fn dontfork_counter() -> &'static AtomicU64 {
    // SAFETY: DONTFORK holds the address of a page-aligned mapping that lives
    // forever (set before the workers start), so an AtomicU64 there is valid.
    unsafe { &*(DONTFORK.load(Ordering::SeqCst) as *const AtomicU64) }
}

/// The MXCSR worker `i` runs with: all exceptions masked, rounding mode
/// `i % 4`, flush-to-zero for odd `i`.
pub fn mxcsr_of(i: usize) -> u32 {
    0x1f80 | (((i % 4) as u32) << 13) | if i % 2 == 1 { 0x8000 } else { 0 }
}

fn die(what: &str) -> ! {
    eprintln!(
        "thread template failed: {what}: {}",
        std::io::Error::last_os_error()
    );
    std::process::exit(101)
}

fn cookie() -> [u64; 2] {
    let text = std::env::var("NBR_COOKIE").unwrap_or_else(|_| die("NBR_COOKIE"));
    let (a, b) = text.split_once(',').unwrap_or_else(|| die("cookie"));
    [
        u64::from_str_radix(a, 16).unwrap_or_else(|_| die("cookie")),
        u64::from_str_radix(b, 16).unwrap_or_else(|_| die("cookie")),
    ]
}

fn confine() {
    use nestbox_seccomp::{default_profile, Action, CmpOp, DefaultOpts, Rule};
    let [c0, c1] = cookie();
    let mut profile = default_profile(DefaultOpts::default());
    for name in ["setns", "clone3"] {
        let rule = Rule::named(name, Action::Allow)
            .unwrap_or_else(|| die("syscall name"))
            .when(2, CmpOp::Eq, c0)
            .when(3, CmpOp::Eq, c1);
        profile.rules.insert(0, rule);
    }
    let program = profile.compile().unwrap_or_else(|_| die("compile seccomp"));
    nestbox_seccomp::set_no_new_privs().unwrap_or_else(|_| die("no_new_privs"));
    program.install().unwrap_or_else(|_| die("install seccomp"));
}

fn host_pid() -> i32 {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| die("readlink /proc/self"))
}

fn gettid() -> i32 {
    // SAFETY: gettid takes no arguments.
    unsafe { libc::gettid() }
}

fn sleep_ms(ms: i64) {
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: ms * 1_000_000,
    };
    // SAFETY: ts is a valid timespec; no remainder wanted.
    unsafe { libc::nanosleep(&ts, std::ptr::null_mut()) };
}

fn read_mxcsr() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: stmxcsr stores the 4-byte MXCSR at a valid address.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) std::ptr::addr_of_mut!(v)) };
    v
}

/// Per-thread setup: own signal mask, own MXCSR, tid recorded.
fn setup(i: usize) {
    // SAFETY: sigset manipulation on a local, applied to this thread only.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGRTMIN() + i as i32);
        if i != ALTSTACK {
            libc::sigaddset(&mut set, libc::SIGUSR1);
        }
        libc::pthread_sigmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
    }
    let m = mxcsr_of(i);
    // SAFETY: ldmxcsr loads a valid MXCSR value (no reserved bit set).
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) std::ptr::addr_of!(m)) };
    TIDS[i].store(gettid(), Ordering::SeqCst);
}

/// One round of worker `i` done.
fn round(i: usize) {
    LIVE[i].store(gettid(), Ordering::SeqCst);
    MXCSR[i].store(read_mxcsr(), Ordering::SeqCst);
    COUNTS[i].fetch_add(1, Ordering::SeqCst);
}

fn robust_mutex() -> *mut libc::pthread_mutex_t {
    ROBUST.load(Ordering::SeqCst) as *mut libc::pthread_mutex_t
}

extern "C" fn on_usr1(_: libc::c_int) {
    let local = 0u8;
    let at = std::ptr::addr_of!(local) as usize;
    let base = ALT_BASE.load(Ordering::SeqCst);
    if at >= base && at < base + ALT_SIZE {
        ONSTACK.fetch_add(1, Ordering::SeqCst);
    }
}

fn worker(i: usize) {
    setup(i);
    match WORKERS[i] {
        "condvar" => {
            let (m, cv) = &WAKE;
            let mut seen = m.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                seen = cv.wait(seen).unwrap_or_else(|e| e.into_inner());
                round(i);
            }
        }
        "mutex_holder" => loop {
            // SAFETY: the robust mutex was initialised before the workers started.
            let rc = unsafe { libc::pthread_mutex_lock(robust_mutex()) };
            if rc == libc::EOWNERDEAD {
                // SAFETY: as above; we own it now.
                unsafe { libc::pthread_mutex_consistent(robust_mutex()) };
            }
            sleep_ms(40);
            round(i);
            // SAFETY: as above; locked by this thread.
            unsafe { libc::pthread_mutex_unlock(robust_mutex()) };
            sleep_ms(2);
        },
        "mutex_waiter" => loop {
            // SAFETY: as above.
            let rc = unsafe { libc::pthread_mutex_lock(robust_mutex()) };
            if rc == libc::EOWNERDEAD {
                // SAFETY: as above.
                unsafe { libc::pthread_mutex_consistent(robust_mutex()) };
            }
            round(i);
            // SAFETY: as above.
            unsafe { libc::pthread_mutex_unlock(robust_mutex()) };
            sleep_ms(2);
        },
        "nanosleep" => loop {
            sleep_ms(50);
            round(i);
            dontfork_counter().fetch_add(1, Ordering::SeqCst);
            let (m, cv) = &WAKE;
            *m.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            cv.notify_all();
            let one = 1u64;
            // SAFETY: writing 8 bytes to our eventfd.
            unsafe {
                libc::write(
                    EVENTFD.load(Ordering::SeqCst),
                    std::ptr::addr_of!(one).cast(),
                    8,
                )
            };
        },
        "timed_futex" => loop {
            // A relative FUTEX_WAIT on a word nobody wakes: it times out.
            let ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 60_000_000,
            };
            // SAFETY: NEVER is a live u32; ts a valid timespec.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    NEVER.as_ptr(),
                    libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                    0u32,
                    std::ptr::addr_of!(ts),
                )
            };
            round(i);
        },
        "eventfd" => loop {
            let mut v = 0u64;
            // SAFETY: reading 8 bytes into a live u64 from our blocking eventfd.
            let n = unsafe {
                libc::read(
                    EVENTFD.load(Ordering::SeqCst),
                    std::ptr::addr_of_mut!(v).cast(),
                    8,
                )
            };
            if n == 8 {
                round(i);
            }
        },
        "timerfd" => {
            // SAFETY: timerfd_create takes flags only.
            let fd = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_CLOEXEC) };
            let period = libc::timespec {
                tv_sec: 0,
                tv_nsec: 45_000_000,
            };
            let spec = libc::itimerspec {
                it_interval: period,
                it_value: period,
            };
            // SAFETY: spec is a valid itimerspec.
            if fd < 0 || unsafe { libc::timerfd_settime(fd, 0, &spec, std::ptr::null_mut()) } < 0 {
                die("timerfd");
            }
            loop {
                let mut v = 0u64;
                // SAFETY: reading 8 bytes into a live u64 from our blocking timerfd.
                if unsafe { libc::read(fd, std::ptr::addr_of_mut!(v).cast(), 8) } == 8 {
                    round(i);
                }
            }
        }
        "altstack" => {
            let stack: &'static mut [u8] = Vec::leak(vec![0u8; ALT_SIZE]);
            ALT_BASE.store(stack.as_ptr() as usize, Ordering::SeqCst);
            let ss = libc::stack_t {
                ss_sp: stack.as_mut_ptr().cast(),
                ss_flags: 0,
                ss_size: ALT_SIZE,
            };
            // SAFETY: ss describes a leaked buffer that lives forever; the
            // handler is an extern "C" fn that only touches atomics.
            unsafe {
                if libc::sigaltstack(&ss, std::ptr::null_mut()) != 0 {
                    die("sigaltstack");
                }
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
                sa.sa_flags = libc::SA_ONSTACK | libc::SA_RESTART;
                if libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) != 0 {
                    die("sigaction");
                }
            }
            loop {
                // SAFETY: poll with no fds and a timeout.
                unsafe { libc::poll(std::ptr::null_mut(), 0, 70) };
                round(i);
            }
        }
        _ => unreachable!(),
    }
}

fn serve(listener: &TcpListener) -> ! {
    let mut own = 0u64;
    loop {
        let Ok((mut conn, _)) = listener.accept() else {
            continue;
        };
        let mut line = Vec::new();
        let mut byte = [0u8; 1];
        while conn.read(&mut byte).map(|n| n == 1).unwrap_or(false) && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        let join =
            |f: &dyn Fn(usize) -> String| (0..WORKERS.len()).map(f).collect::<Vec<_>>().join(",");
        let reply = match String::from_utf8_lossy(&line).as_ref() {
            "get" => format!(
                "counts={} mxcsr={} onstack={} dontfork={:#x}:{} long={}:{}",
                join(&|i| COUNTS[i].load(Ordering::SeqCst).to_string()),
                join(&|i| format!("{:#x}", MXCSR[i].load(Ordering::SeqCst))),
                ONSTACK.load(Ordering::SeqCst),
                DONTFORK.load(Ordering::SeqCst),
                dontfork_counter().load(Ordering::SeqCst),
                LONG_ROUNDS.load(Ordering::SeqCst),
                LONG_EINTR.load(Ordering::SeqCst)
            ),
            "ids" => join(&|i| {
                format!(
                    "{}/{}",
                    TIDS[i].load(Ordering::SeqCst),
                    LIVE[i].load(Ordering::SeqCst)
                )
            }),
            "inc" => {
                own += 1;
                own.to_string()
            }
            other => format!("unknown {other}"),
        };
        let _ = conn.write_all(format!("{reply}\n").as_bytes());
    }
}

/// The `template` role in modes `mt` (with `long`: one more thread, in an
/// hour-long `nanosleep`) and `zombie`.
pub fn template(zombie: bool, long: bool) -> ! {
    let listener =
        TcpListener::bind(("127.0.0.1", super::roles::TCP_PORT)).unwrap_or_else(|_| die("bind"));
    // SAFETY: eventfd takes flags only (blocking: a worker sleeps in read).
    let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if efd < 0 {
        die("eventfd");
    }
    EVENTFD.store(efd, Ordering::SeqCst);
    let mutex: &'static mut libc::pthread_mutex_t =
        // SAFETY: an all-zero pthread_mutex_t is valid storage for init below.
        Box::leak(Box::new(unsafe { std::mem::zeroed() }));
    // SAFETY: attr is initialised before use and the mutex storage lives forever.
    unsafe {
        let mut attr: libc::pthread_mutexattr_t = std::mem::zeroed();
        libc::pthread_mutexattr_init(&mut attr);
        libc::pthread_mutexattr_setrobust(&mut attr, libc::PTHREAD_MUTEX_ROBUST);
        if libc::pthread_mutex_init(mutex, &attr) != 0 {
            die("pthread_mutex_init");
        }
    }
    ROBUST.store(std::ptr::from_mut(mutex) as usize, Ordering::SeqCst);
    // Three pages: the first and the last marked MADV_DONTFORK, the middle one
    // not (two separate ranges around an ordinary mapping); the last holds a
    // marker word.
    // SAFETY: a fresh anonymous mapping, kept for the life of the process.
    let region = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            3 * 4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if region == libc::MAP_FAILED {
        die("mmap");
    }
    let last = (region as usize + 2 * 4096) as *mut libc::c_void;
    // SAFETY: advising the first page of the mapping just made.
    let first_advised = unsafe { libc::madvise(region, 4096, libc::MADV_DONTFORK) };
    // SAFETY: advising its last page.
    let last_advised = unsafe { libc::madvise(last, 4096, libc::MADV_DONTFORK) };
    if first_advised != 0 || last_advised != 0 {
        die("dontfork region");
    }
    // SAFETY: the last page is mapped read-write and page-aligned.
    unsafe { *(last as *mut u64) = MARKER };
    DONTFORK.store(region as usize, Ordering::SeqCst);
    confine();
    if zombie {
        std::thread::spawn(move || serve(&listener));
        println!("ready {} zombie", host_pid());
        std::thread::sleep(Duration::from_millis(50));
        // SAFETY: ends the main thread only; the server thread runs on.
        unsafe { libc::syscall(libc::SYS_exit, 0) };
        unreachable!();
    }
    for (i, name) in WORKERS.iter().enumerate() {
        std::thread::Builder::new()
            .name((*name).into())
            .spawn(move || worker(i))
            .unwrap_or_else(|_| die("spawn"));
    }
    if long {
        std::thread::spawn(long_sleeper);
    }
    // Every worker has made a round: each is in its state.
    while COUNTS.iter().any(|c| c.load(Ordering::SeqCst) == 0)
        || (long && LONG_ROUNDS.load(Ordering::SeqCst) == 0)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "ready {} threads={}",
        host_pid(),
        WORKERS.len() + 1 + usize::from(long)
    );
    serve(&listener)
}
