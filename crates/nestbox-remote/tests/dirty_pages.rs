//! The dirty-page tracker of a migration, on a real running process from
//! outside: a Python program holding 64 pages of a private anonymous mapping at a
//! known address writes the pages it is told to (from its own code, and from
//! the kernel through `read(2)`), under a seccomp filter that refuses
//! `userfaultfd(2)`; the tracker reports exactly those pages of the mapping,
//! and the process runs on between rounds.
//!
//! Runs on libtest-mimic (`harness = false`) as root (ptrace with
//! `PTRACE_O_SUSPEND_SECCOMP` needs `CAP_SYS_ADMIN`).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use nestbox_remote::{in_ranges, unwritten_ranges, DirtyTracker};

/// Maps 64 pages, fills them, prints their address, then for each line
/// `w N` writes page N in Python, `r N` has the kernel write it (a read from
/// a pipe), and answers `ok`.
const PROGRAM: &str = r#"
import ctypes, mmap, os, sys
m = mmap.mmap(-1, 64 * 4096, flags=mmap.MAP_PRIVATE)
m.write(b"x" * (64 * 4096))
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
libc = ctypes.CDLL(None, use_errno=True)
# A seccomp filter refusing userfaultfd (as a box's does): the tracker's
# injected call must not go through it.
import struct
SYS_userfaultfd = 323
prog = [
    (0x20, 0, 0, 0),                       # ld nr
    (0x15, 0, 1, SYS_userfaultfd),         # jeq userfaultfd
    (0x06, 0, 0, 0x00050000 | 1),          # ret ERRNO(EPERM)
    (0x06, 0, 0, 0x7fff0000),              # ret ALLOW
]
code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
fprog = struct.pack("HL", len(prog), ctypes.addressof(code))
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
assert libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
keep = ctypes.create_string_buffer(fprog)
assert libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, keep, 0, 0) == 0, ctypes.get_errno()
assert libc.syscall(SYS_userfaultfd, 0) == -1
print(addr, flush=True)
r, w = os.pipe()
for line in sys.stdin:
    op, n = line.split()
    n = int(n)
    if op == "w":
        m[n * 4096 + 7] = (m[n * 4096 + 7] + 1) % 256
    else:
        os.write(w, b"k")
        libc.read(r, ctypes.c_void_p(addr + n * 4096 + 9), 1)
    print("ok", flush=True)
"#;

fn main() {
    nestbox_testkit::run_root_cases(&[(
        "written_pages_of_a_running_process_are_reported_exactly",
        written_pages,
    )]);
}

fn written_pages() {
    let mut child = Command::new("python3")
        .args(["-c", PROGRAM])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut input = child.stdin.take().expect("stdin");
    let mut output = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    output.read_line(&mut line).expect("address");
    let base: u64 = line.trim().parse().expect("an address");
    let mut ask = |cmds: &[(&str, u64)]| {
        for (op, n) in cmds {
            writeln!(input, "{op} {n}").expect("write");
            let mut ok = String::new();
            output.read_line(&mut ok).expect("answer");
            assert_eq!(ok.trim(), "ok");
        }
    };
    let pid = child.id() as i32;
    let mut tracker = DirtyTracker::start(pid).expect("tracking starts");
    let region = |pages: &BTreeSet<u64>| -> BTreeSet<u64> {
        pages
            .iter()
            .filter(|a| **a >= base && **a < base + 64 * 4096)
            .map(|a| (a - base) / 4096)
            .collect()
    };
    let round = |tracker: &mut DirtyTracker| {
        let mut read = BTreeSet::new();
        tracker
            .round(&mut |addr, page| {
                if page.is_some() {
                    read.insert(addr);
                }
                Ok(())
            })
            .expect("a round");
        read
    };
    // The first round reads every page of the mapping.
    assert_eq!(region(&round(&mut tracker)), (0..64).collect());
    ask(&[("w", 3), ("w", 7), ("r", 40)]);
    assert_eq!(
        region(&round(&mut tracker)),
        BTreeSet::from([3, 7, 40]),
        "the pages written since the first round"
    );
    assert!(
        region(&round(&mut tracker)).is_empty(),
        "nothing written since"
    );
    ask(&[("w", 5)]);
    // The process runs on between rounds; at the last stop the pages
    // written since the last round are not among the unwritten ones.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .expect("stop");
    let unwritten = unwritten_ranges(pid).expect("unwritten ranges");
    let page = |n: u64| base + n * 4096;
    assert!(!in_ranges(&unwritten, page(5)), "page 5 was written");
    for n in [0, 3, 7, 40, 63] {
        assert!(
            in_ranges(&unwritten, page(n)),
            "page {n} was not written since"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}
