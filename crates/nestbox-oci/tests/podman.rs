//! podman driving nestbox-runc (`--runtime`), with the flags that work on
//! these machines (`--cgroup-manager=cgroupfs --events-backend=file`, and
//! ulimits podman can set without CAP_SYS_RESOURCE): run, run from a
//! docker-archive, detached run, exec, pause/unpause, stop, kill, rm, logs.
//! Images are made locally from a busybox root in a tar (no registry); the
//! storage, run and temporary directories of podman are private to the test
//! and removed (mounts first) when it ends. A container forked from a nestbox
//! template (`--annotation nestbox.template=NAME`) runs, execs, stops with
//! its status and is removed through podman too.

mod common;

use std::path::{Path, PathBuf};

use common::{ready, Out, RUNC};

/// podman with a private store under `dir`.
struct Podman {
    dir: tempfile::TempDir,
    libpod_parent_existed: bool,
}

const LIMITS: &[&str] = &[
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
    "--network",
    "none",
];

impl Podman {
    fn new() -> Podman {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-oci-podman-")
            .tempdir()
            .unwrap();
        let libpod_parent_existed = Path::new("/sys/fs/cgroup/pids/libpod_parent").exists();
        Podman {
            dir,
            libpod_parent_existed,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn run(&self, args: &[&str]) -> Out {
        let (storage, run, tmp) = (self.path("storage"), self.path("run"), self.path("tmp"));
        let mut full = vec![
            "--root",
            storage.to_str().unwrap(),
            "--runroot",
            run.to_str().unwrap(),
            "--tmpdir",
            tmp.to_str().unwrap(),
            "--cgroup-manager=cgroupfs",
            "--events-backend=file",
            "--runtime",
            RUNC,
        ];
        full.extend_from_slice(args);
        common::run("podman", &full, None)
    }

    /// The busybox root of the tests as the image `localhost/nb-busybox:1`
    /// (a tar of it, imported).
    fn import_busybox(&self) {
        let rootfs = self.path("rootfs");
        common::make_rootfs(&rootfs);
        let tar = self.path("bb.tar");
        common::run(
            "tar",
            &[
                "-C",
                rootfs.to_str().unwrap(),
                "-cf",
                tar.to_str().unwrap(),
                ".",
            ],
            None,
        );
        self.run(&["import", tar.to_str().unwrap(), "localhost/nb-busybox:1"])
            .ok();
    }

    /// `podman run` with the limits these machines need.
    fn run_container(&self, opts: &[&str], image: &str, cmd: &[&str]) -> Out {
        let mut args = vec!["run"];
        args.extend_from_slice(opts);
        args.extend_from_slice(LIMITS);
        args.push(image);
        args.extend_from_slice(cmd);
        self.run(&args)
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.run(&["rm", "-af", "-t", "0"]);
        let _ = self.run(&["rmi", "-af"]);
        let _ = self.run(&["system", "reset", "-f"]);
        // Whatever podman still has mounted under its private directories.
        let me = self.dir.path().to_str().unwrap().to_string();
        let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> = info
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&me))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
        if !self.libpod_parent_existed {
            // conmon's and the containers' parents that podman made.
            for h in std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
            {
                let parent = h.path().join("libpod_parent");
                let _ = std::fs::remove_dir(parent.join("conmon"));
                let _ = std::fs::remove_dir(&parent);
            }
        }
    }
}

fn podman_present(test: &str) -> bool {
    let found = std::process::Command::new("podman")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    nestbox_testkit::require(
        found,
        test,
        "needs podman (Debian podman, scripts/setup.sh)",
    )
}

#[test]
fn podman_runs_containers_with_nestbox_runc() {
    let test = "podman_runs_containers_with_nestbox_runc";
    if !ready(test) || !podman_present(test) {
        return;
    }
    let p = Podman::new();
    p.import_busybox();

    // run --rm: output and exit status.
    let out = p
        .run_container(
            &["--rm"],
            "localhost/nb-busybox:1",
            &["sh", "-c", "echo hello; echo $$"],
        )
        .ok();
    // The program is pid 1 of the container's own pid namespace.
    assert_eq!(out.stdout, "hello\n1\n", "{out:?}");
    let out = p.run_container(&["--rm"], "localhost/nb-busybox:1", &["sh", "-c", "exit 3"]);
    assert_eq!(out.code, 3, "{out:?}");

    // run from a docker-archive.
    let archive = p.path("archive.tar");
    p.run(&[
        "save",
        "--format",
        "docker-archive",
        "-o",
        archive.to_str().unwrap(),
        "localhost/nb-busybox:1",
    ])
    .ok();
    let image = format!("docker-archive:{}", archive.display());
    let out = p
        .run_container(&["--rm"], &image, &["echo", "from-archive"])
        .ok();
    assert!(out.stdout.contains("from-archive"), "{out:?}");

    // Detached: exec, pause/unpause, logs, stop, rm.
    p.run_container(
        &["-d", "--name", "d1"],
        "localhost/nb-busybox:1",
        &["sh", "-c", "echo started; sleep 1000"],
    )
    .ok();
    // exec: another process of the same pid namespace.
    let out = p
        .run(&["exec", "d1", "sh", "-c", "cat /proc/1/comm; echo $$"])
        .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(
        matches!(lines[0], "sh" | "sleep") && lines[1] != "1",
        "{out:?}"
    );
    assert_eq!(p.run(&["exec", "d1", "sh", "-c", "exit 4"]).code, 4);
    p.run(&["pause", "d1"]).ok();
    let state = |name: &str| {
        p.run(&["inspect", "--format", "{{.State.Status}}", name])
            .ok()
            .stdout
    };
    assert_eq!(state("d1").trim(), "paused");
    p.run(&["unpause", "d1"]).ok();
    assert_eq!(state("d1").trim(), "running");
    assert!(p.run(&["logs", "d1"]).ok().stdout.contains("started"));
    p.run(&["stop", "-t", "1", "d1"]).ok();
    assert_eq!(state("d1").trim(), "exited");
    p.run(&["rm", "d1"]).ok();

    // kill.
    p.run_container(
        &["-d", "--name", "k1"],
        "localhost/nb-busybox:1",
        &["sleep", "1000"],
    )
    .ok();
    p.run(&["kill", "k1"]).ok();
    p.run(&["wait", "k1"]).ok();
    assert_eq!(state("k1").trim(), "exited");
    p.run(&["rm", "k1"]).ok();
    assert_eq!(p.run(&["ps", "-aq"]).ok().stdout.trim(), "");
}

#[test]
fn podman_runs_a_container_forked_from_a_template() {
    let test = "podman_runs_a_container_forked_from_a_template";
    if !ready(test) || !podman_present(test) || !common::template::nestbox_present(test) {
        return;
    }
    let (t, frozen) = common::template::counting_template();
    let p = Podman::new();
    p.import_busybox();
    let template = "nestbox.template=tpl".to_string();
    let root = format!("nestbox.root={}", t.root());
    p.run_container(
        &[
            "-d",
            "--name",
            "c1",
            "--annotation",
            &template,
            "--annotation",
            &root,
        ],
        "localhost/nb-busybox:1",
        &["sh"],
    )
    .ok();
    let state = |name: &str| {
        p.run(&[
            "inspect",
            "--format",
            "{{.State.Status}} {{.State.ExitCode}}",
            name,
        ])
        .ok()
        .stdout
        .trim()
        .to_string()
    };
    assert_eq!(state("c1"), "running 0");
    // The container is the template's process going on: its count starts
    // where the template's stopped (a cold start would begin at 1) and grows.
    let count = |p: &Podman| -> u64 {
        let out = p.run(&["exec", "c1", "cat", "/count"]).ok();
        out.stdout.trim().parse().unwrap()
    };
    let first = count(&p);
    assert!(first >= frozen, "count {first}, template's {frozen}");
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(count(&p) > first, "the clone does not count");
    assert_eq!(t.boxes().len(), 2, "the clone's box");
    // What the clone prints after start reaches conmon, so `podman logs`
    // has it: counts from the template's number on.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let logs = p.run(&["logs", "c1"]).ok().stdout;
        let printed: Vec<u64> = logs
            .lines()
            .filter_map(|l| l.strip_prefix("count ")?.parse().ok())
            .collect();
        if printed.iter().any(|n| *n >= first) {
            assert!(printed.iter().all(|n| *n >= frozen), "{logs}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "podman logs shows no output of the clone: {logs:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // `podman top` lists the clone's processes: its program among them.
    let top = p.run(&["top", "c1"]).ok().stdout;
    eprintln!("podman top c1:\n{top}");
    // `podman cp` out of the running container enters the mount namespace
    // of the container's pid: it reads the clone's /count (the waiter is in
    // the clone's mount namespace), not a host path.
    let copied = p.path("count-copied");
    p.run(&["cp", "c1:/count", copied.to_str().unwrap()]).ok();
    let n: u64 = std::fs::read_to_string(&copied)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        n >= first,
        "podman cp read {n}, the clone counted {first} before"
    );
    assert!(
        top.lines().any(|l| l.contains("python3")),
        "podman top: {top}"
    );
    // stop: SIGTERM through nestbox-runc kill; conmon reaps the container's
    // waiter, whose status is the clone's.
    p.run(&["stop", "-t", "5", "c1"]).ok();
    assert_eq!(state("c1"), "exited 143");
    p.run(&["rm", "c1"]).ok();
    assert_eq!(
        t.boxes(),
        vec!["tpl".to_string()],
        "the clone's box is left"
    );
}
