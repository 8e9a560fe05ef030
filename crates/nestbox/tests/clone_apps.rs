//! Freeze and clone of real multi-threaded servers, seen from outside: a
//! Node.js HTTP server, a Go `net/http` server, a Java server on
//! `com.sun.net.httpserver` with a fixed thread pool, and a Python server that
//! hands requests to a pre-started `ThreadPoolExecutor`. Each is warmed up with
//! requests that count in memory, frozen and cloned 20 times; every clone
//! answers with the template's count continued, then counts on its own, and the
//! template is untouched (a clone made afterwards starts from the frozen
//! count). Plus 100 clones of a threaded template, removed without a trace.
//!
//! The servers are those of `common/apps.rs`.

mod common;

use std::path::Path;
use std::time::Duration;

use common::apps::*;
use common::*;

/// Host pid of the process of box `name` (a template or a clone).
fn process_of(root: &TestRoot, name: &str) -> ProcId {
    let v = root.inspect(name);
    let state = &v["state"];
    let process = if state["clone"]["process"].is_object() {
        &state["clone"]["process"]
    } else {
        &state["template"]["process"]
    };
    ProcId {
        pid: process["pid"]
            .as_i64()
            .unwrap_or_else(|| panic!("pid of {name}: {v}")) as i32,
        start_time: process["start_time"].as_u64().unwrap(),
    }
}

/// Start `app` as box `tpl`, warm it with 3 requests, freeze it, make 20
/// clones and check that each continues from the frozen state on its own.
fn clone_twenty(root: &TestRoot, app: &App) {
    let volume = app.volume();
    let mut args = vec!["run", "-d", "--name", "tpl", "-v", &volume, "--"];
    args.extend(app.cmd.iter().map(String::as_str));
    root.ok(&args);
    root.wait_logged("tpl", "ready", Duration::from_secs(60));
    for i in 1..=3 {
        assert_eq!(get(root, "tpl"), (i, "tpl".to_string()));
    }
    root.ok(&["freeze", "tpl"]);
    let template = process_of(root, "tpl");
    let threads = threads_of(template.pid);
    assert!(
        threads >= app.min_threads,
        "the template has {threads} threads, expected at least {}",
        app.min_threads
    );
    println!("template with {threads} threads");
    let names = root
        .run_timeout(
            &["clone", "tpl", "-n", "20", "-d", "--name", "c"],
            Duration::from_secs(180),
        )
        .ok()
        .stdout;
    let names: Vec<&str> = names.lines().collect();
    assert_eq!(names.len(), 20);
    for n in &names {
        assert_eq!(get(root, n), (4, n.to_string()), "clone {n} continues");
        let p = process_of(root, n);
        assert!(
            threads_of(p.pid) >= app.min_threads,
            "clone {n} runs with its threads"
        );
    }
    // Each goes on alone.
    assert_eq!(get(root, "c-1").0, 5);
    assert_eq!(get(root, "c-1").0, 6);
    assert_eq!(get(root, "c-2").0, 5);
    assert_eq!(get(root, "c-20").0, 5);
    assert_eq!(get(root, "c-1").0, 7);
    // The template is untouched: frozen with its threads, and a clone made now
    // starts from its count.
    assert!(template.alive());
    assert_eq!(threads_of(template.pid), threads);
    // The forks kept the template's thread state (for root only); a later
    // `clone` takes it from there rather than reading the threads again (the
    // file is not written anew), and its clone continues all the same.
    let kept = root
        .path()
        .join(format!("run/boxes/tpl/threads-{}.json", template.pid));
    let stamp = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        (m.ino(), m.mtime_nsec(), m.mode() & 0o777)
    };
    let before = stamp(&kept);
    assert_eq!(before.2, 0o600, "the kept state is for root only");
    root.ok(&["clone", "tpl", "-d", "--name", "late"]);
    assert_eq!(get(root, "late"), (4, "late".to_string()));
    assert_eq!(
        stamp(&kept),
        before,
        "the kept state was used, not read again"
    );
    // A damaged file is not used: the state is read again and kept anew.
    std::fs::write(&kept, b"{not json").unwrap();
    root.ok(&["clone", "tpl", "-d", "--name", "late2"]);
    assert_eq!(get(root, "late2"), (4, "late2".to_string()));
    let again: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&kept).unwrap()).expect("kept anew");
    assert_eq!(again["process"]["pid"], template.pid);
    let mut rm = vec!["rm", "-f", "late", "late2", "tpl"];
    rm.extend(names.iter().copied());
    root.run_timeout(&rm, Duration::from_secs(180)).ok();
}

#[test]
fn node_http_server_clones_continue() {
    let node = Path::new("/usr/bin/node");
    app_test(
        "node_http_server_clones_continue",
        Some(node),
        App::node,
        clone_twenty,
    );
}

#[test]
fn go_http_server_clones_continue() {
    let go = go_binary();
    app_test(
        "go_http_server_clones_continue",
        Some(&go),
        || go_app(&go),
        clone_twenty,
    );
}

#[test]
fn java_http_server_with_a_thread_pool_clones_continue() {
    let java = Path::new("/usr/bin/java");
    app_test(
        "java_http_server_with_a_thread_pool_clones_continue",
        Some(java),
        App::java,
        clone_twenty,
    );
}

#[test]
fn python_thread_pool_server_clones_continue() {
    app_test(
        "python_thread_pool_server_clones_continue",
        None,
        App::python_pool,
        clone_twenty,
    );
}

/// Clones of the template's pool (forked ahead, stopped with SIGSTOP, a
/// signal for the whole thread group) are claimed with every thread going on,
/// and the pool refills. Timing-sensitive (`serial_`): a refill runs at idle
/// priority, so on a machine kept busy by other tests it never starts.
#[test]
fn serial_pooled_clones_of_a_threaded_template_are_claimed_and_refilled() {
    let Some(root) =
        TestRoot::new("serial_pooled_clones_of_a_threaded_template_are_claimed_and_refilled")
    else {
        return;
    };
    let _app = started_pool_server(&root);
    root.ok(&["freeze", "tpl", "--pool", "3"]);
    let pooled = || -> u64 {
        let list: serde_json::Value =
            serde_json::from_str(&root.ok(&["template", "ls", "--json"])).unwrap();
        list[0]["pooled"].as_u64().unwrap()
    };
    // One claim at a time, each after the refill of the one before: refills
    // started together each count the same deficit outside the clone lock
    // (templates/clone.rs fill_pool) and overfill the pool, a runtime matter
    // this test is not about.
    let refill = std::time::Instant::now();
    for n in ["a", "b", "c", "d"] {
        // Idle priority: after a test that removed many boxes, the kernel's
        // network namespace clean-up may keep the CPU busy for a while.
        wait_for("the pool to be full", Duration::from_secs(120), || {
            pooled() == 3
        });
        root.ok(&["clone", "tpl", "-d", "--name", n]);
        assert_eq!(get(&root, n), (2, n.to_string()), "clone {n} continues");
        assert_eq!(threads_of(process_of(&root, n).pid), 5);
    }
    assert_eq!(get(&root, "a").0, 3);
    wait_for("the pool to refill", Duration::from_secs(120), || {
        pooled() == 3
    });
    println!("four claims and refills in {:?}", refill.elapsed());
    root.run_timeout(
        &["rm", "-f", "a", "b", "c", "d", "tpl"],
        Duration::from_secs(120),
    )
    .ok();
}

#[test]
fn serial_hundred_clones_of_a_threaded_template_then_rm_leave_nothing() {
    let test = "serial_hundred_clones_of_a_threaded_template_then_rm_leave_nothing";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    let _app = started_pool_server(&root);
    root.ok(&["freeze", "tpl"]);
    let names = root
        .run_timeout(
            &["clone", "tpl", "-n", "100", "-d", "--name", "c"],
            Duration::from_secs(600),
        )
        .ok()
        .stdout;
    let names: Vec<String> = names.lines().map(str::to_string).collect();
    assert_eq!(names.len(), 100);
    let mut processes = vec![process_of(&root, "tpl")];
    for n in &names {
        let p = process_of(&root, n);
        assert_eq!(
            threads_of(p.pid),
            5,
            "clone {n} has the template's 5 threads"
        );
        processes.push(p);
    }
    for n in ["c-1", "c-50", "c-100"] {
        assert_eq!(get(&root, n), (2, n.to_string()));
    }
    let mut rm = vec!["rm", "-f", "tpl"];
    rm.extend(names.iter().map(String::as_str));
    root.run_timeout(&rm, Duration::from_secs(600)).ok();
    // Nothing left: no box, record, process, cgroup or mount of this root.
    root.assert_no_boxes();
    for p in &processes {
        assert!(!p.alive(), "process {} is gone", p.pid);
    }
    let cgroups = root.cgroup_dirs();
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
    let root_path = root.path().display().to_string();
    let mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .filter(|l| l.contains(&root_path))
        .map(str::to_string)
        .collect();
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
}

/// A process whose main thread has exited while another runs on (a zombie
/// leader) has lost its main thread's state: freeze refuses it in one line
/// and leaves the box running.
#[test]
fn freeze_refuses_a_process_whose_main_thread_has_exited() {
    let Some(root) = TestRoot::new("freeze_refuses_a_process_whose_main_thread_has_exited") else {
        return;
    };
    // SYS_exit (60) ends the calling thread only.
    let code = "import ctypes, threading, time\n\
                threading.Thread(target=time.sleep, args=(300,)).start()\n\
                print('ready', flush=True)\n\
                ctypes.CDLL(None).syscall(60, 0)";
    root.ok(&["run", "-d", "--name", "zl", "--", "python3", "-c", code]);
    wait_for("the main thread to exit", Duration::from_secs(20), || {
        root.ok(&["logs", "zl"]).contains("ready")
            && root
                .ok(&[
                    "exec",
                    "zl",
                    "--",
                    "sh",
                    "-c",
                    "grep -l '^State:.*Z' /proc/[0-9]*/status",
                ])
                .lines()
                .count()
                > 0
    });
    let out = root.run(&["freeze", "zl"]);
    assert_error(&out, 125, "main thread");
    assert_eq!(out.stderr.lines().count(), 1, "one line: {out}");
    assert_eq!(root.status("zl").as_deref(), Some("running"));
    root.ok(&["rm", "-f", "zl"]);
}
