//! containerd driving nestbox-runc through its runc shim
//! (`io.containerd.runc.v2`, `--runc-binary`): a private containerd daemon
//! with its own config, state and socket, `ctr run` of a busybox root
//! (`--rootfs`, no registry): run, exit status, detached run, `task exec`,
//! pause/resume, kill, delete. Everything the test started or made (the
//! daemon, its shims, the namespace's cgroup parents and runc-shim state) is
//! ended or removed when it ends.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ready, Out, RUNC};

struct Containerd {
    dir: tempfile::TempDir,
    daemon: Child,
    namespace: String,
}

impl Containerd {
    fn start() -> Containerd {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-oci-containerd-")
            .tempdir()
            .unwrap();
        let d = dir.path().display();
        let config = dir.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{d}/root\"\nstate = \"{d}/state\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{d}/sock\"\n[ttrpc]\n  address = \"{d}/sock.ttrpc\"\n"
            ),
        )
        .unwrap();
        let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
        let daemon = Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let c = Containerd {
            // One per daemon: the runc shim's state (/run/containerd/runc/NS)
            // and the cgroup parents are named by it, and two tests of this
            // binary run at once.
            namespace: {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                format!("nbtest-{}-{n}", std::process::id())
            },
            dir,
            daemon,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !c.path("sock").exists() {
            assert!(Instant::now() < deadline, "containerd did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn ctr(&self, args: &[&str]) -> Out {
        let sock = self.path("sock");
        let mut full = vec!["--address", sock.to_str().unwrap(), "-n", &self.namespace];
        full.extend_from_slice(args);
        common::run("ctr", &full, None)
    }

    /// `ctr run` through the runc shim with nestbox-runc as its runc.
    fn run(&self, opts: &[&str], id: &str, cmd: &[&str]) -> Out {
        let rootfs = self.path("rootfs");
        let mut args = vec!["run"];
        args.extend_from_slice(opts);
        args.extend_from_slice(&[
            "--runtime",
            "io.containerd.runc.v2",
            "--runc-binary",
            RUNC,
            "--rootfs",
            rootfs.to_str().unwrap(),
            id,
        ]);
        args.extend_from_slice(cmd);
        self.ctr(&args)
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        for id in self.ctr(&["container", "ls", "-q"]).stdout.lines() {
            let _ = self.ctr(&["task", "kill", "-s", "SIGKILL", id]);
            let _ = self.ctr(&["task", "delete", "-f", id]);
            let _ = self.ctr(&["container", "delete", id]);
        }
        // Shims of this test's namespace that are still there (only after a
        // failure): they name the namespace on their command line.
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("containerd-shim") && cmdline.contains(&self.namespace) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        for h in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(h.path().join(&self.namespace));
        }
        let _ = std::fs::remove_dir_all(Path::new("/run/containerd/runc").join(&self.namespace));
    }
}

fn containerd_present(test: &str) -> bool {
    let found = ["containerd", "ctr", "containerd-shim-runc-v2"]
        .iter()
        .all(|p| {
            Command::new("sh")
                .args(["-c", &format!("command -v {p}")])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        });
    nestbox_testkit::require(
        found,
        test,
        "needs containerd (Debian containerd, scripts/setup.sh)",
    )
}

#[test]
fn containerd_runs_tasks_with_nestbox_runc() {
    let test = "containerd_runs_tasks_with_nestbox_runc";
    if !ready(test) || !containerd_present(test) {
        return;
    }
    let c = Containerd::start();
    common::make_rootfs(&c.path("rootfs"));

    let out = c
        .run(&["--rm"], "c1", &["sh", "-c", "echo hi; echo $$"])
        .ok();
    assert_eq!(out.stdout, "hi\n1\n", "{out:?}");
    assert_eq!(c.run(&["--rm"], "c0", &["sh", "-c", "exit 5"]).code, 5);

    c.run(&["-d"], "c2", &["sleep", "1000"]).ok();
    let out = c.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "c2",
        "sh",
        "-c",
        "cat /proc/1/comm; exit 4",
    ]);
    assert_eq!((out.code, out.stdout.as_str()), (4, "sleep\n"), "{out:?}");
    let status = |id: &str| {
        c.ctr(&["task", "ls"])
            .ok()
            .stdout
            .lines()
            .find(|l| l.starts_with(id))
            .map(|l| l.split_whitespace().last().unwrap_or("").to_string())
            .unwrap_or_default()
    };
    c.ctr(&["task", "pause", "c2"]).ok();
    assert_eq!(status("c2"), "PAUSED");
    c.ctr(&["task", "resume", "c2"]).ok();
    assert_eq!(status("c2"), "RUNNING");
    c.ctr(&["task", "kill", "-s", "SIGKILL", "c2"]).ok();
    let deadline = Instant::now() + Duration::from_secs(10);
    while status("c2") != "STOPPED" {
        assert!(Instant::now() < deadline, "c2 never stopped");
        std::thread::sleep(Duration::from_millis(20));
    }
    c.ctr(&["task", "delete", "c2"]).ok();
    c.ctr(&["container", "delete", "c2"]).ok();
    assert_eq!(c.ctr(&["container", "ls", "-q"]).ok().stdout, "");
}

#[test]
fn containerd_runs_a_task_forked_from_a_template() {
    let test = "containerd_runs_a_task_forked_from_a_template";
    if !ready(test) || !containerd_present(test) || !common::template::nestbox_present(test) {
        return;
    }
    let (t, frozen) = common::template::counting_template();
    let c = Containerd::start();
    common::make_rootfs(&c.path("rootfs"));
    let template = "nestbox.template=tpl".to_string();
    let root = format!("nestbox.root={}", t.root());
    let opts = [
        "--annotation",
        template.as_str(),
        "--annotation",
        root.as_str(),
    ];
    // In the foreground: `ctr run` returns with the task's exit status, which
    // the shim reads from the clone's monitor it reaped.
    std::thread::scope(|s| {
        let fg = s.spawn(|| c.run(&opts, "c1", &["sh"]));
        let n = std::sync::atomic::AtomicU32::new(0);
        let count = |c: &Containerd| -> Option<u64> {
            let exec_id = format!("x{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let out = c.ctr(&["task", "exec", "--exec-id", &exec_id, "c1", "cat", "/count"]);
            (out.code == 0).then(|| out.stdout.trim().parse().ok())?
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let first = loop {
            if let Some(n) = count(&c) {
                break n;
            }
            assert!(Instant::now() < deadline, "the task never answered");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The template's process going on, not a cold start from 1.
        assert!(first + 1 >= frozen, "count {first}, template's {frozen}");
        std::thread::sleep(Duration::from_millis(200));
        let later = count(&c);
        assert!(
            later.is_some_and(|l| l > first),
            "the task does not count: {later:?} after {first}"
        );
        c.ctr(&["task", "kill", "-s", "SIGTERM", "c1"]).ok();
        let out = fg.join().unwrap();
        assert_eq!(out.code, 143, "{out:?}");
    });
    c.ctr(&["task", "delete", "c1"]);
    c.ctr(&["container", "delete", "c1"]).ok();
    assert_eq!(c.ctr(&["container", "ls", "-q"]).ok().stdout, "");
    assert_eq!(
        t.boxes(),
        vec!["tpl".to_string()],
        "the clone's box is left"
    );
}
