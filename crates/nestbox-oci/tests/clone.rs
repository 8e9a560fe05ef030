//! Containers forked from a nestbox template through the annotation
//! `nestbox.template`: nestbox-runc `create` forks the container from a
//! frozen box whose process counts in a variable, and the container's
//! process goes on counting from the template's number (the template's
//! continued state), stopped until `start`. The test process is a subreaper,
//! as conmon and the containerd shim are, and collects the container's exit
//! status from the pid `create` reported.
//!
//! The template is made with the `nestbox` binary built next to
//! `nestbox-runc` (`cargo build -p nestbox`); its nestbox root is private to
//! the test and removed with everything in it.

mod common;

use std::time::{Duration, Instant};

use common::template::{counting_template, nestbox_present, read_count, template_pid, Template};
use common::{ready, reap, Env, StdoutJson};
use serde_json::json;

/// The process state letter of `pid`.
fn proc_state(pid: i64) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rfind(')')
        .and_then(|i| stat[i + 2..].chars().next())
        .unwrap_or('?')
}

/// Children of this process that live in a nested pid namespace (orphans
/// of a box adopted by this subreaper), with their states.
fn adopted_from_boxes() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        if field("PPid:") == me && field("NSpid:").split_whitespace().count() > 1 {
            found.push(format!("{} {}", field("Pid:"), field("State:")));
        }
    }
    found
}

/// The counting template, and a bundle annotated to be forked from it; this
/// process made a subreaper first, as conmon and the containerd shim are
/// (orphans of the runtime come here).
fn annotated_bundle() -> (Template, u64, Env) {
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let (t, frozen) = counting_template();
    let env = Env::new(&["sh"]);
    env.edit(|c| {
        c["annotations"] = json!({"nestbox.template": "tpl", "nestbox.root": t.root()});
    });
    (t, frozen, env)
}

#[test]
fn clone_from_template_through_the_annotation() {
    let test = "clone_from_template_through_the_annotation";
    if !ready(test) || !nestbox_present(test) {
        return;
    }
    let (t, frozen, env) = annotated_bundle();
    let pid_file = env.tmp().join("pid");
    // create's standard output is a file read later: the clone's output
    // must arrive there, as conmon's pipe gets it.
    let out_path = env.tmp().join("c1.out");
    let created = Instant::now();
    let status = std::process::Command::new(common::RUNC)
        .args([
            "--root",
            env.root.to_str().unwrap(),
            "create",
            "--bundle",
            env.bundle.to_str().unwrap(),
            "--pid-file",
            pid_file.to_str().unwrap(),
            "c1",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .status()
        .unwrap();
    assert!(status.success(), "create: {status}");
    eprintln!("create from the template: {:?}", created.elapsed());
    let s = env.state("c1");
    assert_eq!(s["status"], "created", "{s}");
    assert_eq!(s["annotations"]["nestbox.template"], "tpl");
    let monitor = s["pid"].as_i64().unwrap();
    assert_eq!(
        std::fs::read_to_string(&pid_file).unwrap(),
        monitor.to_string()
    );
    // The reported pid is the container's waiter, now this subreaper's child.
    let ppid = std::fs::read_to_string(format!("/proc/{monitor}/stat")).unwrap();
    let ppid: i64 = ppid[ppid.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        ppid,
        i64::from(std::process::id() as i32),
        "waiter's parent"
    );
    // The clone is a box of the template's root; its processes are the
    // container's.
    let boxes = t.boxes();
    assert_eq!(boxes.len(), 2, "{boxes:?}");
    let procs: Vec<i64> = env
        .runc(&["ps", "--format", "json", "c1"])
        .ok()
        .json()
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_i64().unwrap())
        .collect();
    let process = *procs
        .iter()
        .find(|p| read_count(**p).is_some() && proc_state(**p) == 'T')
        .unwrap_or_else(|| panic!("no stopped counting process among {procs:?}"));
    // The reported pid is in the clone's mount namespace, whose /proc lists
    // the clone's processes (what `podman top` reads): its root is the
    // clone's root, and its /proc shows the clone's process as pid 2.
    let mnt = |pid: i64| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    assert_eq!(mnt(monitor), mnt(process), "the waiter's mount namespace");
    let comm =
        std::fs::read_to_string(format!("/proc/{monitor}/root/proc/2/comm")).unwrap_or_default();
    assert_eq!(comm.trim(), "python3", "pid 2 in the waiter's /proc");
    // Created: stopped, the count where the template left it.
    // (The template runs for a moment while it is forked: its count may
    // have moved on by a step or two since it was frozen.)
    let before = read_count(process).unwrap();
    assert!(
        before + 1 >= frozen && before <= frozen + 5,
        "clone's count {before}, template's {frozen}"
    );
    let template_count = read_count(template_pid(&t)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(read_count(process), Some(before), "counted before start");
    assert_eq!(
        std::fs::read_to_string(&out_path).unwrap(),
        "",
        "output before start"
    );
    env.runc(&["start", "c1"]).ok();
    assert_eq!(env.state("c1")["status"], "running");
    // What the clone prints reaches create's standard output, counted on
    // from the template's number.
    let deadline = Instant::now() + Duration::from_secs(10);
    let printed = loop {
        let text = std::fs::read_to_string(&out_path).unwrap();
        let last = text
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("count ")?.parse::<u64>().ok());
        if let Some(n) = last.filter(|n| *n > before) {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "no output of the clone on create's stdout: {text:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(printed >= frozen, "printed {printed}, template's {frozen}");
    // Running: it goes on from the template's number (a cold start would
    // begin at 1).
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_count(process).unwrap_or(0) < before + 5 {
        assert!(Instant::now() < deadline, "the clone does not count");
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = env.runc(&["exec", "c1", "cat", "/count"]).ok();
    let seen: u64 = out.stdout.trim().parse().unwrap();
    assert!(seen > before, "exec saw {seen}, start was {before}");
    env.runc(&["start", "c1"]).fails_with("already running");
    env.runc(&["delete", "c1"]).fails_with("not stopped");
    // Pause and resume act on the clone's cgroup.
    env.runc(&["pause", "c1"]).ok();
    assert_eq!(env.state("c1")["status"], "paused");
    env.runc(&["resume", "c1"]).ok();
    // The template is untouched: still frozen at its number.
    assert_eq!(read_count(template_pid(&t)), Some(template_count));
    // SIGTERM to the container reaches the clone's process; the exit status
    // comes back through the monitor the caller reaps.
    env.runc(&["kill", "c1", "TERM"]).ok();
    let code = reap(monitor);
    assert_eq!(code, 128 + libc::SIGTERM, "exit status relayed");
    env.wait_status("c1", "stopped");
    env.runc(&["delete", "c1"]).ok();
    env.runc(&["state", "c1"]).fails_with("does not exist");
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "clone box left");

    // A second clone, killed while created and deleted by force.
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c2"])
        .ok();
    let monitor = env.state("c2")["pid"].as_i64().unwrap();
    env.runc(&["delete", "--force", "c2"]).ok();
    assert_eq!(reap(monitor), 128 + libc::SIGKILL);
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "clone box left");

    // A signal sent to the reported pid itself (not through `kill`) reaches
    // the clone's process, as it would reach runc's container process.
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c7"])
        .ok();
    env.runc(&["start", "c7"]).ok();
    let waiter = env.state("c7")["pid"].as_i64().unwrap();
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(env.root.join("c7").join("state.json")).unwrap(),
    )
    .unwrap();
    let process = record["clone"]["process"].as_i64().unwrap();
    let waiter_pid = nix::unistd::Pid::from_raw(waiter as i32);
    nix::sys::signal::kill(waiter_pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    // The waiter exits (it is not killed) with the status of the clone,
    // which SIGTERM ended.
    assert_eq!(
        nix::sys::wait::waitpid(waiter_pid, None).unwrap(),
        nix::sys::wait::WaitStatus::Exited(waiter_pid, 128 + libc::SIGTERM),
        "the waiter's status"
    );
    assert!(
        !std::path::Path::new(&format!("/proc/{process}")).exists(),
        "the clone's process lives on"
    );
    env.runc(&["delete", "c7"]).ok();
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "clone box left");

    // A foreground `run`: it waits for the waiter (its child), prints what
    // the clone prints, exits with the clone's status and deletes it.
    let run_out = env.tmp().join("c5.out");
    let mut run = std::process::Command::new(common::RUNC)
        .args([
            "--root",
            env.root.to_str().unwrap(),
            "run",
            "--bundle",
            env.bundle.to_str().unwrap(),
            "c5",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&run_out).unwrap())
        .spawn()
        .unwrap();
    // (It does not exist until run's create has made it.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while !env.runc(&["state", "c5"]).stdout.contains("\"running\"") {
        assert!(Instant::now() < deadline, "c5 never ran");
        std::thread::sleep(Duration::from_millis(10));
    }
    while !std::fs::read_to_string(&run_out)
        .unwrap()
        .contains("count ")
    {
        assert!(
            Instant::now() < deadline,
            "run printed nothing of the clone"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    env.runc(&["kill", "c5", "TERM"]).ok();
    let status = run.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "run's status");
    env.runc(&["state", "c5"]).fails_with("does not exist");
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "clone box left");

    // Bad annotations: one line, nothing left.
    env.edit(|c| c["annotations"]["nestbox.template"] = json!("nope"));
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c3"])
        .fails_with("nestbox.template \"nope\"");
    env.edit(|c| c["annotations"]["nestbox.template"] = json!(""));
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c3"])
        .fails_with("must name a template");
    // The waiter killed while it makes the container (by a createRuntime
    // hook, which it runs): create fails in one line and removes what the
    // waiter had made (the clone's box, the record).
    env.edit(|c| {
        c["annotations"]["nestbox.template"] = json!("tpl");
        c["hooks"] = json!({"createRuntime": [
            {"path": "/bin/sh", "args": ["sh", "-c", "kill -9 $PPID"]}]});
    });
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c6"])
        .fails_with("the container's process exited during set-up");
    env.runc(&["state", "c6"]).fails_with("does not exist");
    assert!(!env.root.join("c6").exists(), "record left");
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "box left");
    env.edit(|c| {
        c.as_object_mut().unwrap().remove("hooks");
        c["process"]["terminal"] = json!(true);
    });
    env.runc(&["create", "--bundle", env.bundle.to_str().unwrap(), "c3"])
        .fails_with("process.terminal is true: --console-socket is required");
    env.runc(&["state", "c3"]).fails_with("does not exist");
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "box left");

    // With a terminal: the clone writes on the terminal whose master came
    // over the console socket.
    let mut master = std::fs::File::from(env.create_on_terminal("c4"));
    env.runc(&["start", "c4"]).ok();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.contains("count ") && Instant::now() < deadline {
        use std::io::Read;
        let mut b = [0u8; 256];
        let n = master.read(&mut b).unwrap();
        seen.push_str(&String::from_utf8_lossy(&b[..n]));
    }
    assert!(seen.contains("count "), "{seen:?}");
    let waiter = env.state("c4")["pid"].as_i64().unwrap();
    env.runc(&["delete", "--force", "c4"]).ok();
    assert_eq!(reap(waiter), 128 + libc::SIGKILL);
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "box left");
}

/// Wait until the count in the root of `pid` reaches `at_least`.
#[track_caller]
fn wait_count(pid: i64, at_least: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = read_count(pid).unwrap_or(0);
        if n >= at_least {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "{pid} counts no further than {n}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn checkpoint_and_restore_through_the_oci_command_line() {
    let test = "checkpoint_and_restore_through_the_oci_command_line";
    if !ready(test) || !nestbox_present(test) {
        return;
    }
    let (t, frozen, env) = annotated_bundle();
    let bundle = env.bundle.to_str().unwrap().to_string();
    env.runc(&["run", "-d", "--bundle", &bundle, "c1"]).ok();
    let rec = |id: &str| -> serde_json::Value {
        let path = env.root.join(id).join("state.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let process = rec("c1")["clone"]["process"].as_i64().unwrap();
    let monitor = env.state("c1")["pid"].as_i64().unwrap();
    wait_count(process, frozen + 5);

    // --leave-running: the image is written, the container goes on.
    let img1 = env.tmp().join("img1");
    std::fs::create_dir(&img1).unwrap(); // podman makes it, empty
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
    assert!(img1.join("checkpoint.json").is_file());
    assert_eq!(env.state("c1")["status"], "running");
    let n = read_count(process).unwrap();
    wait_count(process, n + 3);

    // Without it: saved, then stopped (the monitor exits, killed) and
    // deleted, as runc does.
    let img2 = env.tmp().join("img2");
    env.runc(&["checkpoint", "--image-path", img2.to_str().unwrap(), "c1"])
        .ok();
    assert_eq!(reap(monitor), 128 + libc::SIGKILL);
    env.runc(&["state", "c1"]).fails_with("does not exist");
    // The count saved is the one in the image's copy of the container's
    // writable layer (the process, killed once saved, is gone).
    let saved: u64 = std::fs::read_to_string(img2.join("layer-0").join("count"))
        .expect("the count file in the image's writable layer")
        .trim()
        .parse()
        .unwrap();
    assert!(saved >= n + 3, "saved {saved}, counted {n} before");

    // Restored (detached) under a new id: running, counting on from the
    // checkpoint's number.
    env.runc(&[
        "restore",
        "--image-path",
        img2.to_str().unwrap(),
        "--bundle",
        &bundle,
        "--detach",
        "r1",
    ])
    .ok();
    let s = env.state("r1");
    assert_eq!(s["status"], "running", "{s}");
    // The restore's helper (forked into the box's pid namespace, killed
    // once the restore is done) was reaped by nestbox-runc, not left to the
    // caller's subreaper: the box's init could not finish until it is.
    assert_eq!(adopted_from_boxes(), Vec::<String>::new());
    let restored = rec("r1")["clone"]["process"].as_i64().unwrap();
    let first = read_count(restored).unwrap();
    assert!(
        first + 1 >= saved && first < saved + 50,
        "restored at {first}, saved at {saved}"
    );
    wait_count(restored, first + 5);
    let monitor = s["pid"].as_i64().unwrap();
    env.runc(&["kill", "r1", "KILL"]).ok();
    assert_eq!(reap(monitor), 128 + libc::SIGKILL);
    env.runc(&["delete", "r1"]).ok();
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "box left");

    // Refused, one line each, nothing changed.
    env.runc(&[
        "checkpoint",
        "--image-path",
        img2.to_str().unwrap(),
        "--tcp-established",
        "c9",
    ])
    .fails_with("--tcp-established is a CRIU option");
    env.runc(&[
        "restore",
        "--image-path",
        img2.to_str().unwrap(),
        "--shell-job",
        "r2",
    ])
    .fails_with("--shell-job is a CRIU option");
    env.runc(&[
        "restore",
        "--image-path",
        "/nonexistent/img",
        "--bundle",
        &bundle,
        "r2",
    ])
    .fails_with("restore of /nonexistent/img");
    env.runc(&["state", "r2"]).fails_with("does not exist");
    assert_eq!(t.boxes(), vec!["tpl".to_string()], "box left");
}
