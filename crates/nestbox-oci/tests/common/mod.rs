//! Helpers of the nestbox-runc tests: a private runtime root and a busybox
//! bundle per test (the rootfs is the static busybox of Debian's
//! `busybox-static`, installed by `scripts/setup.sh`; no registry), commands
//! with a bounded run time, and a drop that force-deletes every container of
//! the root and checks that neither its record nor its cgroup is left.

#![allow(dead_code)]

pub mod template;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nestbox_oci::state::Root;
use serde_json::Value;

/// The binary under test.
pub const RUNC: &str = env!("CARGO_BIN_EXE_nestbox-runc");
/// The static busybox the rootfs is made of.
pub const BUSYBOX: &str = "/bin/busybox";
/// Longest a command may take.
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub use nestbox_testkit::Out;

/// Stdout of a command as JSON.
pub trait StdoutJson {
    /// Parse it (a failure names the command).
    fn json(&self) -> Value;
}

impl StdoutJson for Out {
    #[track_caller]
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("{}: {e}: {}", self.what, self.stdout))
    }
}

/// Whether the test can run here (root and busybox); under CI a missing
/// requirement is a failure.
pub fn ready(test: &str) -> bool {
    nestbox_testkit::require_root(test)
        && nestbox_testkit::require(
            Path::new(BUSYBOX).is_file(),
            test,
            "needs /bin/busybox (Debian busybox-static, scripts/setup.sh)",
        )
}

/// A runtime root and a bundle, removed with everything in them on drop.
pub struct Env {
    dir: tempfile::TempDir,
    /// `--root` of every command.
    pub root: PathBuf,
    /// The bundle directory.
    pub bundle: PathBuf,
}

/// Make a busybox root filesystem at `rootfs`.
pub fn make_rootfs(rootfs: &Path) {
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc", "root"] {
        std::fs::create_dir_all(rootfs.join(d)).unwrap();
    }
    std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).unwrap();
    for applet in [
        "sh", "cat", "echo", "sleep", "hostname", "id", "ls", "mkdir", "grep", "ps", "readlink",
        "true", "touch", "tty", "kill", "stat", "head", "wc", "ulimit", "env",
    ] {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
    }
    std::fs::write(rootfs.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
}

impl Env {
    /// A bundle whose config is `nestbox-runc spec`'s default with no
    /// terminal, running `args`.
    pub fn new(args: &[&str]) -> Env {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-oci-")
            .tempdir()
            .unwrap();
        let root = dir.path().join("root");
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(&bundle).unwrap();
        make_rootfs(&bundle.join("rootfs"));
        let env = Env { dir, root, bundle };
        env.runc(&["spec", "--bundle", env.bundle.to_str().unwrap()])
            .ok();
        env.edit(|c| {
            c["process"]["terminal"] = Value::Bool(false);
            c["process"]["args"] = serde_json::json!(args);
        });
        env
    }

    /// Change the bundle's config.json.
    pub fn edit(&self, f: impl FnOnce(&mut Value)) {
        let path = self.bundle.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        f(&mut c);
        std::fs::write(&path, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    }

    /// The temporary directory (for pid files, hook outputs...).
    pub fn tmp(&self) -> &Path {
        self.dir.path()
    }

    /// Run `nestbox-runc --root ROOT args...`.
    pub fn runc(&self, args: &[&str]) -> Out {
        let mut full = vec!["--root", self.root.to_str().unwrap()];
        full.extend_from_slice(args);
        run(RUNC, &full, Some(&self.bundle))
    }

    /// [`Env::runc`] with its standard output appended to `stdout`.
    pub fn runc_to(&self, stdout: &Path, args: &[&str]) -> Out {
        let mut full = vec!["--root", self.root.to_str().unwrap()];
        full.extend_from_slice(args);
        run_to(RUNC, &full, Some(&self.bundle), Some(stdout))
    }

    /// `run` in the bundle.
    pub fn run(&self, id: &str) -> Out {
        self.runc(&["run", "--bundle", self.bundle.to_str().unwrap(), id])
    }

    /// `create` in the bundle with a console socket (its `process.terminal`
    /// set), which must succeed: the terminal's master side it sent.
    pub fn create_on_terminal(&self, id: &str) -> std::os::fd::OwnedFd {
        let sock = self.tmp().join(format!("console-{id}.sock"));
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        self.runc(&[
            "create",
            "--bundle",
            self.bundle.to_str().unwrap(),
            "--console-socket",
            sock.to_str().unwrap(),
            id,
        ])
        .ok();
        receive_terminal(&listener)
    }

    /// `create` in the bundle.
    pub fn create(&self, id: &str) -> Out {
        self.runc(&["create", "--bundle", self.bundle.to_str().unwrap(), id])
    }

    /// The state JSON of `id`.
    pub fn state(&self, id: &str) -> Value {
        self.runc(&["state", id]).ok().json()
    }

    /// Wait until `id` reports `status`.
    #[track_caller]
    pub fn wait_status(&self, id: &str, status: &str) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let s = self.state(id);
            if s["status"] == status {
                return;
            }
            assert!(Instant::now() < deadline, "{id} never became {status}: {s}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The name of the cgroup directory of container `id`.
    pub fn cgroup_name(&self, id: &str) -> String {
        nestbox_cgroup::dir_name(&nestbox_oci::create::cgroup_id(&Root::new(&self.root), id))
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let ids = if self.root.exists() {
            std::fs::read_dir(&self.root)
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        for id in &ids {
            let _ = self.runc(&["delete", "--force", id]);
        }
        let left: Vec<String> = ids
            .iter()
            .map(|id| self.cgroup_name(id))
            .filter(|name| cgroup_exists(name))
            .collect();
        let records = std::fs::read_dir(&self.root)
            .map(|d| d.count())
            .unwrap_or(0);
        if !std::thread::panicking() {
            assert!(left.is_empty(), "cgroups left: {left:?}");
            assert_eq!(
                records,
                0,
                "container records left in {}",
                self.root.display()
            );
        }
    }
}

/// Whether a cgroup directory named `name` exists in any hierarchy.
pub fn cgroup_exists(name: &str) -> bool {
    let out = Command::new("find")
        .args([
            "/sys/fs/cgroup",
            "-mindepth",
            "1",
            "-maxdepth",
            "8",
            "-type",
            "d",
            "-name",
            name,
        ])
        .output()
        .unwrap();
    !out.stdout.is_empty()
}

/// Run `prog args` in `dir` with a bounded time. Its output goes to files,
/// not pipes: a container made by `create` keeps the caller's stdio open
/// after the command returned.
pub fn run(prog: &str, args: &[&str], dir: Option<&Path>) -> Out {
    run_to(prog, args, dir, None)
}

/// Reap `pid` (a child of this process, or re-parented to it as a
/// subreaper) and give its exit code (128 + N when killed by signal N).
pub fn reap(pid: i64) -> i32 {
    use nix::sys::wait::{waitpid, WaitStatus};
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match waitpid(
            nix::unistd::Pid::from_raw(pid as i32),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        ) {
            Ok(WaitStatus::Exited(_, code)) => return code,
            Ok(WaitStatus::Signaled(_, sig, _)) => return 128 + sig as i32,
            Ok(_) => {}
            Err(e) => panic!("waitpid({pid}): {e} (not re-parented to the test's subreaper?)"),
        }
        assert!(
            Instant::now() < deadline,
            "{pid} never exited: {}",
            std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// [`run`], its standard output going to `stdout` when given (the file a
/// container made by the command keeps writing to) instead of a temporary
/// file read back.
pub fn run_to(prog: &str, args: &[&str], dir: Option<&Path>, stdout: Option<&Path>) -> Out {
    let what = format!("{prog} {}", args.join(" "));
    let mut out_f = match stdout {
        Some(p) => std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(p)
            .unwrap(),
        None => tempfile::tempfile().unwrap(),
    };
    let mut err_f = tempfile::tempfile().unwrap();
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(out_f.try_clone().unwrap())
        .stderr(err_f.try_clone().unwrap());
    if let Some(d) = dir {
        cmd.current_dir(d);
    }
    let mut child = cmd.spawn().unwrap();
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: timed out");
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    use std::io::{Seek, SeekFrom};
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let read = |f: &mut std::fs::File| {
        let mut s = String::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_string(&mut s).unwrap();
        s
    };
    Out {
        stdout: read(&mut out_f),
        stderr: read(&mut err_f),
        code,
        what,
    }
}

/// The terminal master a runtime sends over the console socket `listener`
/// (one connection, the fd as `SCM_RIGHTS`).
pub fn receive_terminal(listener: &std::os::unix::net::UnixListener) -> std::os::fd::OwnedFd {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let (conn, _) = listener.accept().unwrap();
    let mut buf = [0u8; 256];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let msg = nix::sys::socket::recvmsg::<()>(
        conn.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        nix::sys::socket::MsgFlags::empty(),
    )
    .unwrap();
    let fd = msg
        .cmsgs()
        .unwrap()
        .find_map(|c| match c {
            nix::sys::socket::ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
            _ => None,
        })
        .expect("a terminal fd");
    // SAFETY: the fd was just received and is owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
