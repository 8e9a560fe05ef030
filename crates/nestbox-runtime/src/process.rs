//! Small process helpers shared by the monitor, init, exec and the detached
//! start: shell-style exit codes from wait statuses, waiting for one child, and
//! pointing stdio at `/dev/null`.

use std::os::fd::AsRawFd;

use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

use crate::error::EXIT_NESTBOX_ERROR;

/// The shell-style exit code of a wait status: the code, or 128+N when killed by
/// signal N; `None` while the process is merely stopped or continued.
pub fn exit_code(status: WaitStatus) -> Option<i32> {
    match status {
        WaitStatus::Exited(_, code) => Some(code),
        WaitStatus::Signaled(_, sig, _) => Some(128 + sig as i32),
        _ => None,
    }
}

/// Wait until the child `pid` ends and return its exit code (125 if it cannot be waited for).
pub fn wait_exit_code(pid: Pid) -> i32 {
    loop {
        match waitpid(pid, None) {
            Ok(status) => {
                if let Some(code) = exit_code(status) {
                    return code;
                }
            }
            Err(nix::errno::Errno::EINTR) => continue,
            Err(_) => return EXIT_NESTBOX_ERROR,
        }
    }
}

/// Point stdin, stdout and stderr at `/dev/null` (best effort).
pub fn stdio_to_dev_null() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        for fd in 0..3 {
            let _ = nix::unistd::dup2(null.as_raw_fd(), fd);
        }
    }
}
