//! Cloning boxes with more than one process, seen from outside: a prefork
//! server (a Python master and two workers accepting on one listening socket,
//! reporting to the master through a pipe, counting in shared memory) and a
//! shell whose background child serves. Every clone has the template's
//! processes with the same pids, parents, session and groups, continues from
//! the frozen state and then diverges; the template is untouched. Every clone has the template's
//! processes with the same pids, parents, session and groups, continues from
//! the frozen state and then diverges; the template is untouched.

mod common;

use std::time::Duration;

use common::apps::{PIDFD_PARENT, PREFORK, SHELL};
use common::*;

/// GET / from the box's port 8080 (from a process exec'd into the box): the
/// answer's fields.
fn get(root: &TestRoot, name: &str) -> Vec<i64> {
    box_http_get(root, name, "/")
        .iter()
        .map(|f| {
            f.parse()
                .unwrap_or_else(|_| panic!("answer of {name}: {f}"))
        })
        .collect()
}

/// `(pid, ppid, sid, pgid)` of every process of box `name` but its init and
/// the reader itself, as the box's own /proc shows them.
fn tree(root: &TestRoot, name: &str) -> Vec<(i64, i64, i64, i64)> {
    let code = "import os\n\
                me = os.getpid()\n\
                for p in sorted(int(d) for d in os.listdir('/proc') if d.isdigit()):\n\
                \x20   if p in (1, me): continue\n\
                \x20   try: f = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()\n\
                \x20   except OSError: continue\n\
                \x20   if int(f[1]) == me or int(f[1]) == 0: continue\n\
                \x20   print(p, f[1], f[3], f[2])";
    let out = root.run(&["exec", name, "--", "python3", "-c", code]).ok();
    out.stdout
        .lines()
        .map(|l| {
            let v: Vec<i64> = l.split_whitespace().map(|x| x.parse().unwrap()).collect();
            (v[0], v[1], v[2], v[3])
        })
        .collect()
}

fn reports(root: &TestRoot, name: &str) -> i64 {
    let out = root.run(&["exec", name, "--", "cat", "/tmp/reports"]);
    out.stdout.trim().parse().unwrap_or(-1)
}

#[test]
fn prefork_server_clones_keep_their_tree_pipe_and_shared_counter() {
    let Some(root) = TestRoot::new("prefork_server_clones_keep_their_tree_pipe_and_shared_counter")
    else {
        return;
    };
    root.ok(&["run", "-d", "--name", "tpl", "--", "python3", "-c", PREFORK]);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    for i in 1..=4 {
        assert_eq!(get(&root, "tpl")[0], i);
    }
    wait_for(
        "the master to count 4 reports",
        Duration::from_secs(10),
        || reports(&root, "tpl") == 4,
    );
    // master 2 (child of init, leads its session), workers 3 and 4.
    let template_tree = tree(&root, "tpl");
    assert_eq!(
        template_tree,
        vec![(2, 1, 2, 2), (3, 2, 2, 2), (4, 2, 2, 2)],
        "the template's processes"
    );
    root.ok(&["freeze", "tpl"]);
    let names: Vec<String> = root
        .ok(&["clone", "tpl", "-d", "-n", "20", "--name", "c"])
        .split_whitespace()
        .map(str::to_string)
        .collect();
    assert_eq!(names.len(), 20);
    for name in &names {
        assert_eq!(tree(&root, name), template_tree, "processes of {name}");
        let first = get(&root, name);
        assert_eq!(
            first[0], 5,
            "{name} continues the shared counter: {first:?}"
        );
        assert!([3, 4].contains(&first[1]), "a worker answers: {first:?}");
        assert_eq!(
            (first[2], first[3]),
            (2, 2),
            "its parent and session: {first:?}"
        );
        let second = get(&root, name);
        assert_eq!(second[0], 6, "{name} counts on: {second:?}");
        wait_for(
            "the master of the clone to count the reports",
            Duration::from_secs(10),
            || reports(&root, name) == 6,
        );
    }
    // The template's counter is where it was: a new clone starts from 4 again.
    root.ok(&["clone", "tpl", "-d", "--name", "late"]);
    assert_eq!(get(&root, "late")[0], 5);
    assert_eq!(reports(&root, "late"), 5);
    let mut all: Vec<&str> = names.iter().map(String::as_str).collect();
    all.extend(["late", "tpl"]);
    root.rm_all(all);
}

#[test]
fn shell_with_a_background_child_clones_and_still_waits_for_it() {
    let Some(root) = TestRoot::new("shell_with_a_background_child_clones_and_still_waits_for_it")
    else {
        return;
    };
    root.detached_sh("tpl", &[], SHELL);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    assert_eq!(get(&root, "tpl")[0], 1);
    assert_eq!(get(&root, "tpl")[0], 2);
    let template_tree = tree(&root, "tpl");
    assert_eq!(template_tree, vec![(2, 1, 2, 2), (3, 2, 2, 2)]);
    root.ok(&["freeze", "tpl"]);
    for i in 0..20 {
        let name = format!("c{i}");
        root.ok(&["clone", "tpl", "-d", "--name", &name]);
        assert_eq!(tree(&root, &name), template_tree, "processes of {name}");
        assert_eq!(get(&root, &name)[0], 3, "{name} continues the count");
        assert_eq!(get(&root, &name)[0], 4, "{name} counts on");
    }
    // The clone's shell is the child's parent: it sees its child end.
    root.ok(&["exec", "c0", "--", "sh", "-c", "kill -TERM 3"]);
    wait_for(
        "the clone's shell to end after its child",
        Duration::from_secs(10),
        || root.ok(&["logs", "c0"]).contains("child ended: 143"),
    );
    root.ok(&["clone", "tpl", "-d", "--name", "late"]);
    assert_eq!(
        get(&root, "late")[0],
        3,
        "the template's count is untouched"
    );
    let clones: Vec<String> = (0..20).map(|i| format!("c{i}")).collect();
    root.rm_all(clones.iter().map(String::as_str).chain(["late", "tpl"]));
}

#[test]
fn a_pidfd_of_a_child_points_to_the_clones_child() {
    let Some(root) = TestRoot::new("a_pidfd_of_a_child_points_to_the_clones_child") else {
        return;
    };
    root.ok(&[
        "run",
        "-d",
        "--name",
        "tpl",
        "--",
        "python3",
        "-c",
        PIDFD_PARENT,
    ]);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    let template_tree = tree(&root, "tpl");
    assert_eq!(template_tree, vec![(2, 1, 2, 2), (3, 2, 2, 2)]);
    root.ok(&["freeze", "tpl"]);
    root.ok(&[
        "clone", "tpl", "-d", "-n", "2", "--name", "c1", "--name", "c2",
    ]);
    // The clone's parent kills its own child through its pidfd and reaps it.
    assert_eq!(get(&root, "c1"), vec![-15, 3]);
    assert_eq!(tree(&root, "c1"), vec![(2, 1, 2, 2)]);
    // The other clone's child, and so the template's, lives on.
    assert_eq!(tree(&root, "c2"), template_tree);
    assert_eq!(get(&root, "c2"), vec![-15, 3]);
    root.ok(&["rm", "-f", "c1", "c2", "tpl"]);
}

/// A root server whose worker runs as another user (uid 1000, no groups):
/// each clone's worker has the worker's ids and capability sets (none), and
/// continues its count; the root master still reads it through their pipe.
#[test]
fn a_worker_running_as_another_user_is_cloned_with_its_ids() {
    let Some(root) = TestRoot::new("a_worker_running_as_another_user_is_cloned_with_its_ids")
    else {
        return;
    };
    let server = "import os, time\n\
        r, w = os.pipe()\n\
        if os.fork() == 0:\n\
        \x20   os.setgroups([]); os.setgid(1000); os.setuid(1000)\n\
        \x20   n = 0\n\
        \x20   while True:\n\
        \x20       n += 1\n\
        \x20       os.write(w, f'{n}\\n'.encode())\n\
        \x20       time.sleep(0.05)\n\
        print('ready', flush=True)\n\
        f = os.fdopen(r)\n\
        while True:\n\
        \x20   line = f.readline()\n\
        \x20   open('/tmp/last', 'w').write(line)\n";
    root.run(&[
        "run",
        "-d",
        "--name",
        "ut",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        server,
    ])
    .ok();
    root.inspect("ut");
    root.wait_log("ut", "ready", Duration::from_secs(20));
    let last = |name: &str| -> i64 {
        root.ok(&["exec", name, "--", "cat", "/tmp/last"])
            .trim()
            .parse()
            .unwrap_or(0)
    };
    wait_for("the worker to count", Duration::from_secs(10), || {
        last("ut") >= 3
    });
    root.ok(&["freeze", "ut", "--as", "ut-t"]);
    let status = |name: &str, pid: i64| -> String {
        root.ok(&["exec", name, "--", "cat", &format!("/proc/{pid}/status")])
    };
    let field = |text: &str, key: &str| -> String {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .unwrap_or("")
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    for i in 0..3 {
        let name = format!("uc{i}");
        root.ok(&["clone", "-d", "--name", &name, "ut-t"]);
        root.inspect(&name);
        // The worker is pid 3 in the clone, as in the template.
        let s = status(&name, 3);
        assert_eq!(field(&s, "Uid:"), "1000 1000 1000 1000", "{s}");
        assert_eq!(field(&s, "Gid:"), "1000 1000 1000 1000", "{s}");
        assert_eq!(field(&s, "Groups:"), "", "{s}");
        assert_eq!(field(&s, "CapEff:"), "0000000000000000", "{s}");
        assert_eq!(field(&s, "CapPrm:"), "0000000000000000", "{s}");
        let master = status(&name, 2);
        assert_eq!(field(&master, "Uid:"), "0 0 0 0", "{master}");
        // It goes on counting, and its root master reads it.
        let first = last(&name);
        wait_for(
            "the clone's worker to go on",
            Duration::from_secs(10),
            || last(&name) > first,
        );
    }
    let names = ["uc0", "uc1", "uc2", "ut"];
    root.rm_all(names);
}

/// A pipeline of the box: a producer whose stdout is a pipe to a consumer's
/// stdin (both children of the box's shell). In every clone the two go on
/// through a pipe of the clone's own: the consumer keeps receiving the
/// producer's count, and nothing of it reaches the clone's own stdout (the
/// box's log), which only the box's stdio writes to.
#[test]
fn a_pipeline_in_the_box_keeps_its_pipe_in_clones() {
    let Some(root) = TestRoot::new("a_pipeline_in_the_box_keeps_its_pipe_in_clones") else {
        return;
    };
    let script = "i=0\n\
                  (while :; do i=$((i+1)); echo n$i; sleep 0.05; done) | \
                  (while read n; do echo $n > /tmp/last; done) &\n\
                  echo ready\n\
                  wait\n";
    root.detached_sh("tpl", &[], script);
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    let last = |name: &str| -> i64 {
        let out = root.run(&["exec", name, "--", "cat", "/tmp/last"]);
        out.stdout
            .trim()
            .trim_start_matches('n')
            .parse()
            .unwrap_or(-1)
    };
    wait_for("the template's consumer", Duration::from_secs(10), || {
        last("tpl") > 2
    });
    let before = last("tpl");
    root.ok(&["freeze", "tpl"]);
    for i in 0..3 {
        let name = format!("c{i}");
        root.ok(&["clone", "tpl", "-d", "--name", &name]);
        let first = last(&name);
        wait_for(
            &format!("{name}'s consumer to receive its producer's count"),
            Duration::from_secs(10),
            || last(&name) > first + 3,
        );
        assert!(
            first >= before,
            "{name} continues from {before}, read {first}"
        );
        let log = root.ok(&["logs", &name]);
        assert!(
            !log.lines().any(|l| l.starts_with('n')),
            "the producer of {name} writes to its pipe, not to the box's stdout:\n{log}"
        );
    }
    root.rm_all(["c0", "c1", "c2", "tpl"]);
}

/// A process of a multi-process box writes to a FIFO whose reader is on the
/// host, outside the box. In a clone that end is closed (docs/clone-fds.md):
/// from the clone's first instruction on, every write fails with `EPIPE`.
/// None may succeed into the clone's new pipe while the clone is still being
/// finished (the tracer held a duplicate of its read end until then, so the
/// first writes of a clone went into a pipe nobody would ever read: E2B's
/// relay lost the line written at the fork).
///
/// The writer reads its hostname before and after each write: a write that
/// straddles the fork (the template froze between the two) may have been
/// made by the template, so it is logged as `tpl>cN` and not counted as
/// the clone's.
#[test]
fn a_pipe_whose_reader_is_outside_the_box_is_closed_from_the_clones_start() {
    let test = "a_pipe_whose_reader_is_outside_the_box_is_closed_from_the_clones_start";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    std::fs::write(
        dir.path().join("w.py"),
        "import os, signal, time\n\
         signal.signal(signal.SIGPIPE, signal.SIG_IGN)\n\
         w = os.open('/g/fifo', os.O_WRONLY)\n\
         log = open('/tmp/writes', 'a', buffering=1)\n\
         while True:\n\
         \x20   before = os.uname().nodename\n\
         \x20   try:\n\
         \x20       os.write(w, b'x\\n')\n\
         \x20       r = 'ok'\n\
         \x20   except OSError as e:\n\
         \x20       r = 'err%d' % e.errno\n\
         \x20   after = os.uname().nodename\n\
         \x20   log.write('%s %s\\n' % (after if before == after else before + '>' + after, r))\n\
         \x20   time.sleep(0.001)\n",
    )
    .unwrap();
    // The host's reader: it drains the FIFO until every writer is gone.
    let reader_path = fifo.clone();
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::open(reader_path).unwrap();
        std::io::copy(&mut f, &mut std::io::sink()).unwrap()
    });
    let volume = format!("{}:/g", dir.path().display());
    root.detached_sh(
        "tpl",
        &["-v", &volume],
        "python3 /g/w.py & echo ready\nwait\n",
    );
    root.wait_logged("tpl", "ready", Duration::from_secs(20));
    // Lines of `name`'s log that its own processes wrote (the clone's
    // hostname is its name), with the outcome of each write.
    let own_writes = |name: &str| -> Vec<String> {
        let out = root.run(&["exec", name, "--", "cat", "/tmp/writes"]);
        out.stdout
            .lines()
            .filter_map(|l| l.strip_prefix(&format!("{name} ")))
            .map(str::to_string)
            .collect()
    };
    wait_for("the template's writes", Duration::from_secs(20), || {
        own_writes("tpl").len() > 50
    });
    assert!(own_writes("tpl").iter().all(|r| r == "ok"));
    root.ok(&["freeze", "tpl"]);
    for i in 0..3 {
        let name = format!("c{i}");
        root.ok(&["clone", "tpl", "-d", "--name", &name]);
        wait_for(&format!("{name}'s writes"), Duration::from_secs(20), || {
            own_writes(&name).len() > 20
        });
        let writes = own_writes(&name);
        let errno = format!("err{}", libc::EPIPE);
        assert!(
            writes.iter().all(|r| *r == errno),
            "every write of {name} to the pipe whose reader is outside fails with EPIPE: {writes:?}"
        );
    }
    root.rm_all(["c0", "c1", "c2", "tpl"]);
    reader.join().unwrap();
}
