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

/// Wait (10 s at most) until `state()` is `want`; the last state. podman
/// 4.3 may still say `stopping` right after `podman stop` returned, under
/// load: it takes the container's pid being gone as stopped, and reads the
/// exit status conmon writes a moment later.
fn settled(state: &dyn Fn() -> String, want: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let now = state();
        if now == want || std::time::Instant::now() >= deadline {
            return now;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
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
    assert_eq!(settled(&|| state("c1"), "exited 143"), "exited 143");
    p.run(&["rm", "c1"]).ok();
    assert_eq!(
        t.boxes(),
        vec!["tpl".to_string()],
        "the clone's box is left"
    );
}

/// The `count N` lines of `podman logs NAME`, as numbers.
fn logged_counts(p: &Podman, name: &str) -> Vec<u64> {
    p.run(&["logs", name])
        .ok()
        .stdout
        .lines()
        .filter_map(|l| l.strip_prefix("count ")?.trim().parse().ok())
        .collect()
}

/// Wait until `podman logs NAME` has a count above `above`; the counts.
#[track_caller]
fn wait_logged(p: &Podman, name: &str, above: u64) -> Vec<u64> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let counts = logged_counts(p, name);
        if counts.last().is_some_and(|n| *n > above) {
            return counts;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{name} never logged a count above {above}: {counts:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn podman_checkpoints_and_restores_a_container_started_cold() {
    let test = "podman_checkpoints_and_restores_a_container_started_cold";
    if !ready(test) || !podman_present(test) {
        return;
    }
    let p = Podman::new();
    p.import_busybox();
    // A shell counting in a variable, printing each count; its TERM trap
    // (a signal disposition, part of the saved state) exits 7.
    let counter =
        "trap 'exit 7' TERM; i=0; while true; do i=$((i+1)); echo count $i; sleep 0.05; done";
    p.run_container(
        &["-d", "--name", "c1"],
        "localhost/nb-busybox:1",
        &["sh", "-c", counter],
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
    wait_logged(&p, "c1", 10);

    // --leave-running: it goes on. (podman passes --leave-running twice.)
    p.run(&["container", "checkpoint", "--leave-running", "c1"])
        .ok();
    assert_eq!(state("c1"), "running 0");
    let n = *logged_counts(&p, "c1").last().unwrap();
    wait_logged(&p, "c1", n + 3);

    // Checkpointed (into the directory of the first image: replaced) and
    // stopped; restored: running again, counting on from its memory.
    p.run(&["container", "checkpoint", "c1"]).ok();
    assert!(state("c1").starts_with("exited"), "{}", state("c1"));
    let before = *logged_counts(&p, "c1").last().unwrap();
    p.run(&["container", "restore", "c1"]).ok();
    assert_eq!(state("c1"), "running 0");
    let counts = wait_logged(&p, "c1", before + 10);
    assert!(
        counts.windows(2).all(|w| w[1] == w[0] + 1),
        "the count did not go on from where it was saved ({before}): {counts:?}"
    );
    // Its pid 1 is the restored shell, in the container's pid namespace.
    let comm = p.run(&["exec", "c1", "cat", "/proc/1/comm"]).ok().stdout;
    assert_eq!(comm.trim(), "sh");
    let top = p.run(&["top", "c1"]).ok().stdout;
    assert!(
        top.lines().any(|l| l.contains("sh -c")),
        "podman top: {top}"
    );
    // stop: SIGTERM through nestbox-runc kill reaches the restored trap;
    // conmon reaps the restored pid 1 and reports its status.
    p.run(&["stop", "-t", "10", "c1"]).ok();
    assert_eq!(settled(&|| state("c1"), "exited 7"), "exited 7");

    // Another container, exported with a checkpoint (--leave-running) and
    // restored from the archive as a new container c2: c2's log is c3's
    // until the export, then its own counts, going on from the image's
    // (c3 ran on meanwhile, so the count at the junction may repeat).
    p.run_container(
        &["-d", "--name", "c3"],
        "localhost/nb-busybox:1",
        &["sh", "-c", counter],
    )
    .ok();
    wait_logged(&p, "c3", 5);
    let archive = p.path("c3.tar");
    p.run(&[
        "container",
        "checkpoint",
        "--leave-running",
        "--export",
        archive.to_str().unwrap(),
        "c3",
    ])
    .ok();
    p.run(&[
        "container",
        "restore",
        "--import",
        archive.to_str().unwrap(),
        "--name",
        "c2",
    ])
    .ok();
    assert_eq!(state("c2"), "running 0");
    let exported = *logged_counts(&p, "c2").last().unwrap();
    let counts = wait_logged(&p, "c2", exported + 10);
    assert!(
        counts.first() == Some(&1) && counts.windows(2).all(|w| w[1] == w[0] + 1 || w[1] == w[0]),
        "c2 did not go on from the exported state: {counts:?}"
    );
    p.run(&["stop", "-t", "10", "c2"]).ok();
    assert_eq!(settled(&|| state("c2"), "exited 7"), "exited 7");
    p.run(&["rm", "-f", "c1", "c2", "c3"]).ok();
    assert_eq!(p.run(&["ps", "-aq"]).ok().stdout.trim(), "");
}
