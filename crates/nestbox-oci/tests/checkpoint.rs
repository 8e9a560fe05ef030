//! `checkpoint` and `restore` of containers started cold (the usual OCI
//! container, whose pid 1 is its program): the whole pid namespace is saved
//! with nestbox's checkpoint engine and restored as a container again,
//! continuing from its saved state. The test process is a subreaper, as
//! conmon and the containerd shim are: it reaps the container's pid 1 after
//! `create`/`restore` have exited, and checks the exit status it gets.
//!
//! The container is a busybox shell counting in a shell variable (its
//! memory): each step writes the count to `/count` (renamed into place) and
//! runs `sleep` as a child, so the tree saved is often pid 1 and a child;
//! every tenth step it prints `count N` on its standard output.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{ready, reap, Env, StdoutJson};
use serde_json::json;

/// The counting shell (its state is the variable `i`).
const COUNTER: &str =
    "i=0; while true; do i=$((i+1)); echo $i > /count.tmp; mv /count.tmp /count; \
                       if [ $((i % 10)) = 0 ]; then echo count $i; fi; sleep 0.02; done";

/// A bundle whose container counts, its root writable (the count is a file
/// of it), with a seccomp section (an errno rule for `chroot`) and an OOM
/// score adjustment, which the restored pid 1 must have again.
fn counting_env() -> Env {
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let env = Env::new(&["sh", "-c", COUNTER]);
    more_applets(&env);
    env.edit(|c| {
        c["root"]["readonly"] = json!(false);
        c["process"]["oomScoreAdj"] = json!(123);
        c["linux"]["seccomp"] = json!({
            "defaultAction": "SCMP_ACT_ALLOW",
            "architectures": ["SCMP_ARCH_X86_64"],
            "syscalls": [
                {"names": ["chroot"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                // As Docker's default profile: the restore's own clone3
                // calls must not meet it (the filter is suspended for them).
                {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}
            ]
        });
    });
    env
}

/// The applets the containers here need beyond the common ones.
fn more_applets(env: &Env) {
    for applet in ["mv", "rm"] {
        std::os::unix::fs::symlink("busybox", env.bundle.join("rootfs/bin").join(applet)).unwrap();
    }
}

/// Wait until the count is other than `was`; the count then.
#[track_caller]
fn wait_change(env: &Env, was: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(n) = count(env).filter(|n| *n != was) {
            return n;
        }
        assert!(Instant::now() < deadline, "the count stayed at {was}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The count the container of `env` last wrote.
fn count(env: &Env) -> Option<u64> {
    std::fs::read_to_string(env.bundle.join("rootfs/count"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Wait until the count is at least `at_least`; the count then.
#[track_caller]
fn wait_count(env: &Env, at_least: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(n) = count(env).filter(|n| *n >= at_least) {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "the count never reached {at_least} (at {:?})",
            count(env)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A field of `/proc/PID/status`.
fn status_field(pid: i64, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

/// The `count N` lines a container printed into `file`, as numbers.
fn printed(file: &Path) -> Vec<u64> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("count ")?.trim().parse().ok())
        .collect()
}

#[test]
fn cold_container_checkpointed_and_restored_goes_on_counting() {
    let test = "cold_container_checkpointed_and_restored_goes_on_counting";
    if !ready(test) {
        return;
    }
    let env = counting_env();
    // Where the kernel has hugetlb, with a hugepage limit too: on this
    // hybrid machine the container then also has a v2 cgroup (hugetlb's)
    // beside its v1 ones, frozen by the v1 freezer while it is saved, and
    // killed through cgroup.kill after (which a v1-frozen process survives
    // until thawed).
    let hugetlb = nestbox_cgroup::Hierarchies::detect()
        .unwrap()
        .find("hugetlb")
        .is_some()
        && Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB").is_dir();
    if hugetlb {
        env.edit(|c| {
            c["linux"]["resources"] =
                json!({"hugepageLimits": [{"pageSize": "2MB", "limit": 2097152}]});
        });
    }
    let bundle = env.bundle.to_str().unwrap().to_string();
    let out1 = env.tmp().join("c1.out");
    env.runc_to(&out1, &["run", "-d", "--bundle", &bundle, "c1"])
        .ok();
    let pid1 = env.state("c1")["pid"].as_i64().unwrap();
    wait_count(&env, 25);

    // --leave-running, into an empty directory (podman makes one): the image
    // is written, the container goes on counting.
    let img1 = env.tmp().join("img1");
    std::fs::create_dir(&img1).unwrap();
    env.runc(&[
        "checkpoint",
        "--image-path",
        img1.to_str().unwrap(),
        "--work-path",
        env.tmp().to_str().unwrap(),
        "--leave-running",
        "c1",
    ])
    .ok();
    assert!(img1.join("namespace.json").is_file());
    assert!(img1.join("inventory.img").is_file(), "podman's marker");
    let image: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(img1.join("namespace.json")).unwrap())
            .unwrap();
    let procs = image["processes"].as_array().unwrap();
    assert_eq!(procs[0]["ns_pid"], 1, "pid 1 saved first: {image}");
    assert_eq!(procs[0]["parent"], 0);
    let at_img1 = count(&env).unwrap();
    assert_eq!(env.state("c1")["status"], "running");
    wait_count(&env, at_img1 + 5);

    // Without it, into the same directory (replaced, as podman checkpoints
    // a container into one directory each time): saved, then stopped and
    // deleted, as runc does; pid 1 is reaped here with SIGKILL's status.
    env.runc(&["checkpoint", "--image-path", img1.to_str().unwrap(), "c1"])
        .ok();
    assert_eq!(reap(pid1), 128 + libc::SIGKILL);
    let saved = count(&env).unwrap();
    env.runc(&["state", "c1"]).fails_with("does not exist");
    assert!(!common::cgroup_exists(&env.cgroup_name("c1")));
    assert!(
        std::fs::read_dir(env.tmp())
            .unwrap()
            .flatten()
            .all(|e| !e.file_name().to_string_lossy().starts_with('.')),
        "a replaced image or a temporary directory left"
    );

    // Restored under the same id: running, its pid 1 the image's (a shell,
    // pid 1 of its namespace, its seccomp filter and OOM score back), the
    // caller's to reap (this subreaper adopted it when restore exited), its
    // output on restore's standard output, counting on from the number it
    // was saved at (its memory), not from 1.
    let pid_file = env.tmp().join("c1.pid");
    let out2 = env.tmp().join("c1-restored.out");
    env.runc_to(
        &out2,
        &[
            "restore",
            "--image-path",
            img1.to_str().unwrap(),
            "--work-path",
            env.tmp().to_str().unwrap(),
            "--bundle",
            &bundle,
            "--detach",
            "--pid-file",
            pid_file.to_str().unwrap(),
            "c1",
        ],
    )
    .ok();
    let s = env.state("c1");
    assert_eq!(s["status"], "running", "{s}");
    let restored = s["pid"].as_i64().unwrap();
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap().trim(),
        restored.to_string()
    );
    assert_eq!(
        status_field(restored, "PPid:"),
        std::process::id().to_string()
    );
    assert_eq!(status_field(restored, "Name:"), "sh");
    assert_eq!(
        status_field(restored, "NSpid:").split_whitespace().last(),
        Some("1")
    );
    assert_eq!(status_field(restored, "Seccomp:"), "2");
    assert_eq!(status_field(restored, "TracerPid:"), "0");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{restored}/oom_score_adj"))
            .unwrap()
            .trim(),
        "123"
    );
    // (The count file, read a little after the restore, has moved on a few
    // steps; the first line printed, every tenth step, is exact: the next
    // multiple of 10 from the saved count on: the saved one itself when the
    // shell was frozen between writing it and printing it.)
    let first = wait_change(&env, saved);
    assert!(
        first > saved && first < saved + 100,
        "restored at {first}, saved at {saved}"
    );
    let later = wait_count(&env, first + 20);
    let lines = printed(&out2);
    assert!(
        lines
            .first()
            .is_some_and(|n| *n >= saved && *n <= saved + 10 && *n <= later),
        "restore's output {lines:?} (saved at {saved}, now {later})"
    );
    // The container's other commands act on it: ps, exec, pause/resume.
    let ps = env.runc(&["ps", "--format", "json", "c1"]).ok().json();
    assert!(ps.as_array().unwrap().contains(&json!(restored)), "{ps}");
    let comm = env.runc(&["exec", "c1", "cat", "/proc/1/comm"]).ok().stdout;
    assert_eq!(comm.trim(), "sh", "exec sees the restored shell as pid 1");
    env.runc(&["pause", "c1"]).ok();
    assert_eq!(env.state("c1")["status"], "paused");
    env.runc(&["resume", "c1"]).ok();

    // Another container from the image, under a new id, beside it: it goes
    // on from the number of that image too (its output says so; both write
    // the same /count).
    let out3 = env.tmp().join("c2.out");
    env.runc_to(
        &out3,
        &[
            "restore",
            "--image-path",
            img1.to_str().unwrap(),
            "--bundle",
            &bundle,
            "-d",
            "c2",
        ],
    )
    .ok();
    let second = env.state("c2")["pid"].as_i64().unwrap();
    assert_ne!(second, restored);
    let deadline = Instant::now() + Duration::from_secs(30);
    while printed(&out3).is_empty() {
        assert!(Instant::now() < deadline, "c2 printed nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    let from = printed(&out3)[0];
    assert!(
        from >= saved && from <= saved + 10,
        "c2 printed {from} first, its image saved at {saved}"
    );
    env.runc(&["kill", "c2", "KILL"]).ok();
    assert_eq!(reap(second), 128 + libc::SIGKILL);
    env.runc(&["delete", "c2"]).ok();

    // kill and delete of the restored container.
    env.runc(&["kill", "c1", "KILL"]).ok();
    assert_eq!(reap(restored), 128 + libc::SIGKILL);
    env.wait_status("c1", "stopped");
    env.runc(&["delete", "c1"]).ok();
    assert!(!common::cgroup_exists(&env.cgroup_name("c1")));

    // A foreground restore waits for the container and exits with its
    // status, then deletes it (as run).
    let img2 = env.tmp().join("img2");
    env.runc(&["run", "-d", "--bundle", &bundle, "c3"]).ok();
    let pid3 = env.state("c3")["pid"].as_i64().unwrap();
    std::fs::remove_file(env.bundle.join("rootfs/count")).unwrap();
    wait_count(&env, 5);
    env.runc(&["checkpoint", "--image-path", img2.to_str().unwrap(), "c3"])
        .ok();
    assert_eq!(reap(pid3), 128 + libc::SIGKILL);
    let root = env.root.to_str().unwrap().to_string();
    let img2s = img2.to_str().unwrap().to_string();
    let fg = std::thread::spawn({
        let bundle = bundle.clone();
        let root = root.clone();
        move || {
            common::run(
                common::RUNC,
                &[
                    "--root",
                    &root,
                    "restore",
                    "--image-path",
                    &img2s,
                    "--bundle",
                    &bundle,
                    "c3",
                ],
                None,
            )
        }
    });
    // (Its record is made once its process is restored.)
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.runc(&["state", "c3"]).code != 0 {
        assert!(Instant::now() < deadline, "c3 was never restored");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(env.state("c3")["status"], "running");
    env.runc(&["kill", "c3", "KILL"]).ok();
    fg.join().unwrap().code(128 + libc::SIGKILL);
    env.runc(&["state", "c3"]).fails_with("does not exist");
    assert!(!common::cgroup_exists(&env.cgroup_name("c3")));
    // The first container's output went to run's standard output.
    assert!(!printed(&out1).is_empty());
}

#[test]
fn cold_checkpoint_and_restore_refusals_leave_nothing() {
    let test = "cold_checkpoint_and_restore_refusals_leave_nothing";
    if !ready(test) {
        return;
    }
    let env = counting_env();
    let bundle = env.bundle.to_str().unwrap().to_string();
    env.runc(&["run", "-d", "--bundle", &bundle, "c1"]).ok();
    let pid1 = env.state("c1")["pid"].as_i64().unwrap();
    wait_count(&env, 3);
    let img = env.tmp().join("img");
    env.runc(&[
        "checkpoint",
        "--image-path",
        img.to_str().unwrap(),
        "--leave-running",
        "c1",
    ])
    .ok();

    // Restore: no image there; a directory that is no image; an id in use;
    // a config with a terminal; a config without a pid namespace of its own;
    // a corrupt image; an image without its pages.
    let gone = env.tmp().join("nonexistent");
    env.runc(&[
        "restore",
        "--image-path",
        gone.to_str().unwrap(),
        "--bundle",
        &bundle,
        "r1",
    ])
    .fails_with("no such directory");
    let empty = env.tmp().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("notes"), "x").unwrap();
    env.runc(&[
        "restore",
        "--image-path",
        empty.to_str().unwrap(),
        "--bundle",
        &bundle,
        "r1",
    ])
    .fails_with("not a checkpoint image");
    env.runc(&[
        "restore",
        "--image-path",
        img.to_str().unwrap(),
        "--bundle",
        &bundle,
        "c1",
    ])
    .fails_with("already exists");
    assert_eq!(env.state("c1")["pid"].as_i64(), Some(pid1));
    assert_eq!(env.state("c1")["status"], "running");
    let other = Env::new(&["true"]);
    other.edit(|c| c["process"]["terminal"] = json!(true));
    other
        .runc(&[
            "restore",
            "--image-path",
            img.to_str().unwrap(),
            "--bundle",
            other.bundle.to_str().unwrap(),
            "--console-socket",
            "/nonexistent.sock",
            "r1",
        ])
        .fails_with("process.terminal");
    other.edit(|c| {
        c["process"]["terminal"] = json!(false);
        let ns = c["linux"]["namespaces"].as_array_mut().unwrap();
        ns.retain(|n| n["type"] != "pid");
    });
    other
        .runc(&[
            "restore",
            "--image-path",
            img.to_str().unwrap(),
            "--bundle",
            other.bundle.to_str().unwrap(),
            "r1",
        ])
        .fails_with("pid namespace");
    let corrupt = env.tmp().join("corrupt");
    std::fs::create_dir(&corrupt).unwrap();
    std::fs::write(corrupt.join("namespace.json"), "{").unwrap();
    env.runc(&[
        "restore",
        "--image-path",
        corrupt.to_str().unwrap(),
        "--bundle",
        &bundle,
        "r1",
    ])
    .fails_with("is corrupt");
    let partial = env.tmp().join("partial");
    std::fs::create_dir(&partial).unwrap();
    for entry in std::fs::read_dir(&img).unwrap().flatten() {
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), partial.join(entry.file_name())).unwrap();
        }
    }
    env.runc(&[
        "restore",
        "--image-path",
        partial.to_str().unwrap(),
        "--bundle",
        &bundle,
        "r1",
    ])
    .fails_with("no page pool");
    // (Its pool there but a page gone from it.)
    std::fs::create_dir(partial.join("pages")).unwrap();
    env.runc(&[
        "restore",
        "--image-path",
        partial.to_str().unwrap(),
        "--bundle",
        &bundle,
        "r1",
    ])
    .fails_with("is incomplete");
    env.runc(&["state", "r1"]).fails_with("does not exist");
    assert!(!common::cgroup_exists(&env.cgroup_name("r1")));
    assert!(!other.root.join("r1").exists());

    // Checkpoint: a created container (not running); a directory holding
    // something else; CRIU options; a process holding what the engine does
    // not save (a deleted file open for writing), with and without
    // --leave-running: one line, no image, the container counting on.
    env.runc(&["create", "--bundle", &bundle, "k1"]).ok();
    let kpid = env.state("k1")["pid"].as_i64().unwrap();
    env.runc(&[
        "checkpoint",
        "--image-path",
        env.tmp().join("k1img").to_str().unwrap(),
        "k1",
    ])
    .fails_with("only a running container can be checkpointed");
    assert!(!env.tmp().join("k1img").exists());
    env.runc(&["delete", "--force", "k1"]).ok();
    assert_eq!(reap(kpid), 128 + libc::SIGKILL);
    env.runc(&["checkpoint", "--image-path", empty.to_str().unwrap(), "c1"])
        .fails_with("not empty");
    assert!(empty.join("notes").is_file());
    env.runc(&["checkpoint", "--tcp-established", "c1"])
        .fails_with("--tcp-established is a CRIU option");
    assert_eq!(env.state("c1")["status"], "running");

    let holder = Env::new(&[
        "sh",
        "-c",
        "exec 3>/tmp/held; rm /tmp/held; while true; do echo x > /tick; sleep 0.05; done",
    ]);
    more_applets(&holder);
    holder.edit(|c| c["root"]["readonly"] = json!(false));
    holder
        .runc(&[
            "run",
            "-d",
            "--bundle",
            holder.bundle.to_str().unwrap(),
            "h1",
        ])
        .ok();
    let hpid = holder.state("h1")["pid"].as_i64().unwrap();
    let tick = holder.bundle.join("rootfs/tick");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tick.exists() {
        assert!(Instant::now() < deadline, "the holder never ticked");
        std::thread::sleep(Duration::from_millis(10));
    }
    for leave in [true, false] {
        let himg = holder.tmp().join(format!("himg-{leave}"));
        let mut args = vec!["checkpoint", "--image-path", himg.to_str().unwrap()];
        if leave {
            args.push("--leave-running");
        }
        args.push("h1");
        holder
            .runc(&args)
            .fails_with("a writable memfd or deleted file");
        assert!(!himg.exists(), "an image was left");
        let s = holder.state("h1");
        assert_eq!(s["status"], "running", "{s}");
        assert_eq!(s["pid"].as_i64(), Some(hpid));
        // Thawed: it goes on.
        std::fs::remove_file(&tick).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !tick.exists() {
            assert!(Instant::now() < deadline, "the holder was left frozen");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    assert!(std::fs::read_dir(holder.tmp())
        .unwrap()
        .flatten()
        .all(|e| !e.file_name().to_string_lossy().starts_with(".tmp-")));
    holder.runc(&["delete", "--force", "h1"]).ok();
    assert_eq!(reap(hpid), 128 + libc::SIGKILL);
    env.runc(&["delete", "--force", "c1"]).ok();
    assert_eq!(reap(pid1), 128 + libc::SIGKILL);
}
