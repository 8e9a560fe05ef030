//! Installs real filters in forked children and checks the kernel's verdicts.
//!
//! Each child sets `no_new_privs`, installs a filter, makes raw syscalls and reports
//! the first failed check through its exit status (0: all passed). Children only do
//! async-signal-safe work (raw syscalls, no allocation): the test harness is
//! multi-threaded and only the forking thread exists in the child. The checks are
//! chosen so that, if the filter did not work, the calls would fail differently (or
//! harmlessly succeed) rather than change the host.

use nestbox_seccomp::{
    default_profile, set_no_new_privs, Action, CmpOp, DefaultOpts, Profile, Program, Rule,
};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

/// Result of a raw syscall: `Ok(return value)` or `Err(errno)`.
fn sys(nr: libc::c_long, args: [u64; 5]) -> Result<i64, i32> {
    // SAFETY: every call made through here passes only integers or pointers to
    // NUL-terminated static strings, and none of them writes to memory we own; an
    // unexpectedly successful `clone` is handled by the caller (`_exit` in the child).
    let rc = unsafe { libc::syscall(nr, args[0], args[1], args[2], args[3], args[4]) };
    if rc == -1 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(rc)
    }
}

/// Terminate the child immediately (no atexit handlers, no unwinding).
fn exit_now(code: i32) -> ! {
    // SAFETY: `_exit` is async-signal-safe and never returns.
    unsafe { libc::_exit(code) }
}

/// Wait for `pid` and return its exit code (or 1000 + signal number).
fn wait_code(pid: Pid) -> i32 {
    match waitpid(pid, None).expect("waitpid") {
        WaitStatus::Exited(_, code) => code,
        WaitStatus::Signaled(_, sig, _) => 1000 + sig as i32,
        other => panic!("unexpected wait status {other:?}"),
    }
}

/// Fork; in the child run `prepare` then `check` and exit with the result.
fn in_child(prepare: impl FnOnce() -> i32, check: fn() -> i32) -> i32 {
    // SAFETY: the child only runs async-signal-safe code (`prepare` and `check` are
    // raw syscalls without allocation) and leaves through `_exit`.
    match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let code = prepare();
            if code != 0 {
                exit_now(code);
            }
            exit_now(check())
        }
        pid => wait_code(Pid::from_raw(pid)),
    }
}

/// Fork a child that sets `no_new_privs`, installs `program` and runs `check`.
fn run_filtered(program: &Program, check: fn() -> i32) -> i32 {
    in_child(
        || {
            if set_no_new_privs().is_err() {
                return 90;
            }
            if program.install().is_err() {
                return 91;
            }
            0
        },
        check,
    )
}

const CLONE_NEWUSER: u64 = 0x1000_0000;
const SIGCHLD: u64 = libc::SIGCHLD as u64;
const AF_VSOCK: u64 = 40;
const ADDR_NO_RANDOMIZE: u64 = 0x004_0000;

fn c(s: &'static [u8]) -> u64 {
    s.as_ptr() as u64
}

/// The default profile's promises, checked against the kernel.
fn default_checks() -> i32 {
    // unshare(CLONE_NEWUSER): EPERM (it would succeed unfiltered).
    if sys(libc::SYS_unshare, [CLONE_NEWUSER, 0, 0, 0, 0]) != Err(libc::EPERM) {
        return 1;
    }
    // mount onto a path that does not exist: EPERM (ENOENT unfiltered).
    let m = sys(
        libc::SYS_mount,
        [
            c(b"none\0"),
            c(b"/nonexistent-nestbox-seccomp\0"),
            c(b"tmpfs\0"),
            0,
            0,
        ],
    );
    if m != Err(libc::EPERM) {
        return 2;
    }
    match sys(libc::SYS_getpid, [0; 5]) {
        Ok(pid) if pid > 0 => {}
        _ => return 3,
    }
    // clone3(NULL, 0): ENOSYS (EINVAL unfiltered).
    if sys(libc::SYS_clone3, [0; 5]) != Err(libc::ENOSYS) {
        return 4;
    }
    // clone(CLONE_NEWUSER | SIGCHLD): EPERM.
    match sys(libc::SYS_clone, [CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0]) {
        Err(libc::EPERM) => {}
        Ok(0) => exit_now(0),
        Ok(pid) => {
            let _ = wait_code(Pid::from_raw(pid as i32));
            return 5;
        }
        Err(_) => return 5,
    }
    // A plain fork through clone still works.
    match sys(libc::SYS_clone, [SIGCHLD, 0, 0, 0, 0]) {
        Ok(0) => exit_now(42),
        Ok(pid) => {
            if wait_code(Pid::from_raw(pid as i32)) != 42 {
                return 6;
            }
        }
        Err(_) => return 6,
    }
    // personality: query allowed, ADDR_NO_RANDOMIZE refused.
    if sys(libc::SYS_personality, [0xffff_ffff, 0, 0, 0, 0]).is_err() {
        return 7;
    }
    if sys(libc::SYS_personality, [ADDR_NO_RANDOMIZE, 0, 0, 0, 0]) != Err(libc::EPERM) {
        return 8;
    }
    // socket(AF_VSOCK): EPERM; socket(AF_UNIX) fine.
    if sys(
        libc::SYS_socket,
        [AF_VSOCK, libc::SOCK_STREAM as u64, 0, 0, 0],
    ) != Err(libc::EPERM)
    {
        return 9;
    }
    match sys(
        libc::SYS_socket,
        [libc::AF_UNIX as u64, libc::SOCK_STREAM as u64, 0, 0, 0],
    ) {
        Ok(fd) => {
            let _ = sys(libc::SYS_close, [fd as u64, 0, 0, 0, 0]);
        }
        Err(_) => return 10,
    }
    // ptrace(PTRACE_PEEKUSER, 1): EPERM (ESRCH unfiltered).
    if sys(libc::SYS_ptrace, [libc::PTRACE_PEEKUSER as u64, 1, 0, 0, 0]) != Err(libc::EPERM) {
        return 11;
    }
    // x32 ABI getpid: EPERM.
    if sys(0x4000_0000 | libc::SYS_getpid, [0; 5]) != Err(libc::EPERM) {
        return 12;
    }
    0
}

#[test]
fn default_profile_in_the_kernel() {
    let program = default_profile(DefaultOpts::default()).compile().unwrap();
    assert_eq!(
        run_filtered(&program, default_checks),
        0,
        "see the numbered checks in default_checks"
    );
}

#[test]
fn allowlist_from_docker_json_in_the_kernel() {
    let text = r#"{
        "defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 13,
        "syscalls": [
            {"names": ["exit", "exit_group", "getpid", "nonexistent_call"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["getuid"], "action": "SCMP_ACT_ERRNO", "errnoRet": 77}
        ]
    }"#;
    let program = Profile::from_docker_json(text).unwrap().compile().unwrap();
    fn checks() -> i32 {
        if sys(libc::SYS_getpid, [0; 5]).is_err() {
            return 1;
        }
        if sys(libc::SYS_getppid, [0; 5]) != Err(libc::EACCES) {
            return 2;
        }
        if sys(libc::SYS_getuid, [0; 5]) != Err(77) {
            return 3;
        }
        0
    }
    assert_eq!(run_filtered(&program, checks), 0);
}

/// A program long enough that conditional jumps had to be widened: the kernel must
/// accept it and agree with the interpreter.
#[test]
fn long_program_in_the_kernel() {
    let getuid = libc::SYS_getuid as u32;
    let getgid = libc::SYS_getgid as u32;
    let mut p = Profile::new(Action::Allow);
    for i in 0..200u64 {
        p.push(Rule::new(getuid, Action::Errno(100 + i as u16)).when(0, CmpOp::Eq, i | (i << 32)));
    }
    p.push(Rule::new(getgid, Action::Errno(99)).when(1, CmpOp::Gt, 0x1_0000_0000));
    let program = p.compile().unwrap();
    assert!(program.len() > 600, "{}", program.len());
    fn checks() -> i32 {
        for i in [0u64, 1, 77, 199] {
            if sys(libc::SYS_getuid, [i | (i << 32), 0, 0, 0, 0]) != Err(100 + i as i32) {
                return 1;
            }
        }
        // Right low word, wrong high word: no rule matches.
        if sys(libc::SYS_getuid, [5, 0, 0, 0, 0]).is_err() {
            return 2;
        }
        if sys(libc::SYS_getgid, [0, 0x1_0000_0001, 0, 0, 0]) != Err(99) {
            return 3;
        }
        if sys(libc::SYS_getgid, [0, 0x1_0000_0000, 0, 0, 0]).is_err() {
            return 4;
        }
        0
    }
    assert_eq!(run_filtered(&program, checks), 0);
}

/// Without `no_new_privs` and without CAP_SYS_ADMIN the kernel refuses the filter and
/// `install` says why. As root, the child first becomes `nobody`.
#[test]
fn install_without_no_new_privs_is_refused() {
    static PROGRAM: std::sync::OnceLock<Program> = std::sync::OnceLock::new();
    PROGRAM.get_or_init(|| Profile::new(Action::Allow).compile().unwrap());
    fn checks() -> i32 {
        // SAFETY: plain integer syscalls; the child drops its privileges only.
        if unsafe { libc::geteuid() } == 0 && unsafe { libc::setresuid(65534, 65534, 65534) } != 0 {
            return 1;
        }
        match PROGRAM.get().expect("initialised before fork").install() {
            Err(nestbox_seccomp::SeccompError::Install { hint, source }) => {
                if source.raw_os_error() == Some(libc::EACCES) && hint.contains("no_new_privs") {
                    0
                } else {
                    2
                }
            }
            _ => 3,
        }
    }
    assert_eq!(in_child(|| 0, checks), 0);
}
