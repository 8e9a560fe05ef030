//! The fresh images of a box's monitor and init, seen from outside: a
//! detached box's monitor, once the box is idle, and a clone's init, from
//! the start, replace their image with a fresh one of the nestbox binary
//! (they no longer hold the heap of the command that forked them), and the
//! box goes on exactly as before: output reaches the log, signals reach the
//! box, `stop` records the exit code, a killed monitor takes its box with it,
//! `rm` leaves nothing. The clone test uses the Node.js server of issue 12.

mod common;

use std::time::Duration;

use common::*;

/// The arguments of process `pid`.
fn cmdline(pid: i64) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// Whether process `pid` runs a fresh image taken by a monitor.
fn renewed_monitor(pid: i64) -> bool {
    cmdline(pid).get(1).map(String::as_str) == Some("--nestbox-lean-monitor")
}

/// The monitor's and init's pids of box `name`.
fn monitor_and_init(root: &TestRoot, name: &str) -> (i64, i64) {
    let st = &root.inspect(name)["state"];
    (
        st["monitor_pid"].as_i64().unwrap(),
        st["init_pid"].as_i64().unwrap(),
    )
}

/// The environment of process `pid` (read as root: init is not dumpable).
fn environ(pid: i64) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap()).into_owned()
}

#[test]
fn an_idle_detached_monitor_renews_its_image_and_supervises_on() {
    let Some(root) = TestRoot::new("an_idle_detached_monitor_renews_its_image_and_supervises_on")
    else {
        return;
    };
    // Prints, then on SIGUSR1 prints again; SIGTERM ends it with 143.
    root.detached_sh(
        "idle",
        &["--network", "none"],
        "trap 'echo got-usr1' USR1; trap 'exit 143' TERM; echo started; \
         while :; do sleep 0.1; done",
    );
    root.wait_logged("idle", "started", Duration::from_secs(10));
    let (monitor, init) = monitor_and_init(&root, "idle");
    wait_for(
        "the idle monitor's fresh image",
        Duration::from_secs(10),
        || renewed_monitor(monitor),
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{monitor}/comm"))
            .unwrap()
            .trim(),
        "nestbox-monitor"
    );
    // The same process supervises it: ps shows the box running, not dead.
    assert_eq!(root.status("idle").as_deref(), Some("running"));
    assert_eq!(monitor_and_init(&root, "idle"), (monitor, init));
    // A signal to the box, and its output after the renewal, in the log.
    root.ok(&["kill", "-s", "USR1", "idle"]);
    root.wait_logged("idle", "got-usr1", Duration::from_secs(10));
    // The monitor records the end and releases the box.
    root.ok(&["stop", "idle"]);
    assert_eq!(root.wait_exited("idle", Duration::from_secs(20)), 143);
    wait_for("the monitor's exit", Duration::from_secs(10), || {
        !pid_alive(monitor as i32)
    });
    assert!(
        root.cgroup_dirs().is_empty(),
        "cgroups left: {:?}",
        root.cgroup_dirs()
    );
    root.ok(&["rm", "idle"]);
}

#[test]
fn a_clones_monitor_and_init_take_fresh_images_of_the_static_build() {
    let Some(root) =
        TestRoot::new("a_clones_monitor_and_init_take_fresh_images_of_the_static_build")
    else {
        return;
    };
    // Only a statically linked binary may be exec'd inside a box (a dynamic
    // one would load the image's C library): the release build.
    let root = root.with_binary(&static_release_binary());
    // The multi-threaded Node.js server of the whole-box cloning tests.
    let app = apps::App::node();
    let mut run = vec!["run", "-d", "--name", "tpl", "-v"];
    let volume = app.volume();
    run.push(&volume);
    run.push("--");
    run.extend(app.cmd.iter().map(String::as_str));
    root.ok(&run);
    root.wait_logged("tpl", "ready", Duration::from_secs(30));
    assert_eq!(apps::get(&root, "tpl").0, 1);
    root.ok(&["freeze", "tpl"]);
    let names = root.ok(&["clone", "tpl", "-d", "-n", "3", "--name", "c"]);
    let names: Vec<&str> = names.split_whitespace().collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for name in &names {
        let (monitor, init) = monitor_and_init(&root, name);
        // Init's fresh image has no environment (a fork of the monitor
        // inherited the nestbox command's): nothing of the host's.
        assert_eq!(environ(init), "", "environment of {name}'s init");
        assert_eq!(
            std::fs::read_to_string(format!("/proc/{init}/comm"))
                .unwrap()
                .trim(),
            "nestbox-init"
        );
        wait_for(
            &format!("{name}'s monitor's fresh image"),
            Duration::from_secs(10),
            || renewed_monitor(monitor),
        );
        // The clone continues the template's state, then its own, under
        // its own name.
        assert_eq!(apps::get(&root, name), (2, name.to_string()));
        assert_eq!(apps::get(&root, name).0, 3, "{name}");
    }
    // The template is untouched.
    root.ok(&["rm", "-f", "tpl"]);
    // Stopped: the exit code is recorded by the renewed monitor.
    root.ok(&["stop", names[0]]);
    assert_eq!(root.wait_exited(names[0], Duration::from_secs(20)), 143);
    // A killed monitor takes its box with it (init's parent-death signal
    // survived init's fresh image).
    let (monitor, init) = monitor_and_init(&root, names[1]);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for(
        "the clone's init to die with its monitor",
        Duration::from_secs(10),
        || !pid_alive(init as i32),
    );
    wait_for("ps to show the box dead", Duration::from_secs(10), || {
        root.status(names[1]).as_deref() == Some("dead")
    });
    root.ok(&["rm", "-f", names[0], names[1], names[2]]);
    root.ok(&["gc"]);
    drop(app);
}
