//! Boxes in boxes (`run --nest`, docs/nesting.md): nestbox run, ps, exec and
//! rm three levels deep without host root inside; the parent's memory and
//! pids limits bound its boxes through the cgroup hierarchy; removing,
//! stopping or SIGKILLing any level leaves nothing (processes, cgroups,
//! mounts, veth) once `gc` has run; networking and freeze inside.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use serde_json::Value;

const START: Duration = Duration::from_secs(30);

/// The arguments of `nestbox ARGS...` run by the nestbox inside the box at
/// `path` (outermost first): `exec A -- nestbox exec B -- nestbox ARGS...`.
fn inside<'a>(path: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    for (i, b) in path.iter().enumerate() {
        if i > 0 {
            out.push("nestbox");
        }
        out.extend(["exec", b, "--"]);
    }
    if !path.is_empty() {
        out.push("nestbox");
    }
    out.extend_from_slice(args);
    out
}

/// Start `nestbox run -d --name NAME OPTS... -- sleep 1000` inside the box at
/// `path` (the host for an empty path).
#[track_caller]
fn start(root: &TestRoot, path: &[&str], name: &str, opts: &[&str]) {
    let mut args = vec!["run", "-d", "--name", name];
    args.extend_from_slice(opts);
    args.extend(["--", "sleep", "1000"]);
    let out = root.run_timeout(&inside(path, &args), START).ok();
    assert_eq!(out.stdout.trim(), name, "{out}");
}

/// The `ps --tree --json` rows from the host, by name.
fn tree(root: &TestRoot, all: bool) -> Vec<Value> {
    let mut args = vec!["ps", "--tree", "--json"];
    if all {
        args.push("-a");
    }
    let out = root.run(&args).ok();
    match serde_json::from_str(&out.stdout) {
        Ok(Value::Array(rows)) => rows,
        _ => panic!("ps --tree --json printed no array\n{out}"),
    }
}

fn row<'a>(rows: &'a [Value], name: &str) -> Option<&'a Value> {
    rows.iter().find(|r| r["name"] == name)
}

/// The host pid of the init of the box shown as `name` by `ps --tree`.
#[track_caller]
fn host_pid(root: &TestRoot, name: &str) -> i32 {
    let rows = tree(root, false);
    let r = row(&rows, name).unwrap_or_else(|| panic!("no {name} in {rows:?}"));
    r["pid"]
        .as_i64()
        .unwrap_or_else(|| panic!("{name} has no pid: {r}")) as i32
}

/// A /proc/PID/status field of a host process.
fn status_of(pid: i32, key: &str) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field(&s, key).map(str::to_string)
}

/// The parent of host process `pid`.
fn parent_of(pid: i32) -> i32 {
    status_of(pid, "PPid")
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no parent of {pid}"))
}

/// Every cgroup directory at or below `dirs` (a box's, with the boxes inside it).
fn subtree(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo: Vec<PathBuf> = dirs.iter().filter(|d| d.exists()).cloned().collect();
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(e.path());
            }
        }
        out.push(d);
    }
    out
}

fn box_dirs(root: &TestRoot, name: &str) -> Vec<PathBuf> {
    cgroup_paths(&root.inspect(name)).into_values().collect()
}

/// Normalise the whitespace of `uid_map` lines.
fn squeeze(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether any mount of the host's namespace lies under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.to_string_lossy().to_string();
    info.lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|m| m.starts_with(&d)))
        .map(str::to_string)
        .collect()
}

#[test]
fn three_levels_run_ps_exec_rm_without_host_root() {
    let Some(root) = TestRoot::new("three_levels_run_ps_exec_rm_without_host_root") else {
        return;
    };
    // Level 1 on the host's default (bridge) network, so that its removal
    // has a veth to release too.
    start(&root, &[], "n1", &["--nest"]);
    start(&root, &["n1"], "n2", &["--nest"]);
    start(&root, &["n1", "n2"], "n3", &[]);

    // Each level's root is uid 0 in its box and an unprivileged id outside:
    // box ids map into the upper half of the parent's.
    let maps = [
        (vec!["n1"], "0 1000000000 65536"),
        (vec!["n1", "n2"], "0 32768 32768"),
        (vec!["n1", "n2", "n3"], "0 16384 16384"),
    ];
    for (path, want) in &maps {
        let mut args = inside(
            &path[..path.len() - 1],
            &["exec", path[path.len() - 1], "--"],
        );
        args.extend(["sh", "-c", "cat /proc/self/uid_map; id -u"]);
        let out = root.run(&args).ok();
        let mut lines = out.stdout.lines();
        assert_eq!(
            squeeze(lines.next().unwrap_or("")),
            *want,
            "{path:?}\n{out}"
        );
        assert_eq!(lines.next(), Some("0"), "{path:?}\n{out}");
    }
    // Seen from the host, the level-3 box's root is host uid 1000049152.
    let n3 = host_pid(&root, "n1/n2/n3");
    assert_eq!(
        status_of(n3, "Uid").map(|u| squeeze(&u)).as_deref(),
        Some("1000049152 1000049152 1000049152 1000049152")
    );
    assert_eq!(
        squeeze(&std::fs::read_to_string(format!("/proc/{n3}/uid_map")).unwrap()),
        "0 1000049152 16384"
    );

    // ps inside each level lists that level's boxes by their own names.
    let ps1 = root.run(&inside(&["n1"], &["ps"])).ok().stdout;
    assert!(
        ps1.lines()
            .any(|l| l.starts_with("n2 ") && l.contains("running")),
        "{ps1}"
    );
    let ps2 = root
        .run(&inside(&["n1", "n2"], &["ps", "--json"]))
        .ok()
        .stdout;
    let rows: Value = serde_json::from_str(&ps2).unwrap();
    assert_eq!(rows[0]["name"], "n3", "{ps2}");
    // From the host, the whole tree as parent/child.
    let rows = tree(&root, false);
    let names: Vec<&str> = rows.iter().filter_map(|r| r["name"].as_str()).collect();
    assert_eq!(names, ["n1", "n1/n2", "n1/n2/n3"]);
    assert!(rows.iter().all(|r| r["status"] == "running"), "{rows:?}");
    let plain = root.ok(&["ps", "--tree"]);
    assert!(plain.lines().any(|l| l.starts_with("n1/n2/n3 ")), "{plain}");

    // Real programs three levels down: busybox sh and python3.
    let out = root
        .run(&inside(
            &["n1", "n2"],
            &["exec", "n3", "--", "busybox", "sh", "-c", "echo $((6 * 7))"],
        ))
        .ok();
    assert_eq!(out.stdout, "42\n", "{out}");
    let out = root
        .run(&inside(
            &["n1", "n2"],
            &[
                "exec",
                "n3",
                "--",
                "python3",
                "-c",
                "import os; print(os.getpid())",
            ],
        ))
        .ok();
    assert!(
        out.stdout.trim().parse::<i32>().is_ok_and(|p| p > 1),
        "{out}"
    );

    // The boxes' cgroups nest as the boxes do, below the host's box cgroup.
    let n1_dirs = box_dirs(&root, "n1");
    let pids_dir = n1_dirs
        .iter()
        .find(|d| d.join("pids.max").exists())
        .expect("n1 has a pids cgroup")
        .clone();
    let deep: Vec<PathBuf> = subtree(std::slice::from_ref(&pids_dir))
        .into_iter()
        .filter(|d| {
            d.strip_prefix(&pids_dir)
                .is_ok_and(|r| r.components().count() == 2)
                && d.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("nestbox-"))
        })
        .collect();
    assert_eq!(deep.len(), 1, "n3's cgroup below n2's below n1's: {deep:?}");
    // The unmasked procfs and sysfs a nest box keeps for its boxes are out of reach.
    let out = root
        .run(&inside(
            &[],
            &[
                "exec",
                "n1",
                "--",
                "sh",
                "-c",
                "ls -A /dev/.nestbox; umount /dev/.nestbox 2>/dev/null && echo unmounted; true",
            ],
        ))
        .ok();
    assert_eq!(out.stdout, "", "{out}");

    // rm inside removes that box only.
    root.run(&inside(&["n1", "n2"], &["rm", "-f", "n3"])).ok();
    let rows = tree(&root, true);
    assert!(row(&rows, "n1/n2/n3").is_none(), "{rows:?}");
    assert!(!pid_alive(n3));
    start(&root, &["n1", "n2"], "n3", &[]);

    // rm of the outermost box removes its whole subtree.
    let pids: Vec<i32> = ["n1", "n1/n2", "n1/n2/n3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let monitors: Vec<i32> = pids.iter().map(|p| parent_of(*p)).collect();
    let all_dirs = subtree(&n1_dirs);
    assert!(all_dirs.len() >= 3, "{all_dirs:?}");
    let veth = root.inspect("n1")["state"]["network"]["host_veth"]
        .as_str()
        .map(str::to_string);
    root.run(&["rm", "-f", "n1"]).ok();
    wait_for(
        "the boxes' processes to end",
        Duration::from_secs(10),
        || pids.iter().chain(&monitors).all(|p| !pid_alive(*p)),
    );
    let left: Vec<&PathBuf> = all_dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(
        mounts_under(root.path()).is_empty(),
        "{:?}",
        mounts_under(root.path())
    );
    if let Some(v) = veth {
        assert!(
            !Path::new("/sys/class/net").join(&v).exists(),
            "veth {v} left"
        );
    }
    assert!(tree(&root, true).is_empty());
}

#[test]
fn limits_carved_from_the_parent_hold() {
    let Some(root) = TestRoot::new("limits_carved_from_the_parent_hold") else {
        return;
    };
    start(
        &root,
        &[],
        "lim",
        &[
            "--nest",
            "--network",
            "none",
            "--memory",
            "128m",
            "--pids",
            "64",
        ],
    );
    // A box inside asks for 1 GiB and takes 300 MiB: the parent's 128 MiB
    // bounds it, and the OOM killer ends it there.
    let out = root.run(&inside(
        &["lim"],
        &[
            "run",
            "--rm",
            "--memory",
            "1g",
            "--",
            "python3",
            "-c",
            "b = bytearray(300 << 20)\nprint('allocated')",
        ],
    ));
    assert_eq!(out.code, 137, "killed by the OOM killer\n{out}");
    assert!(!out.stdout.contains("allocated"), "{out}");
    assert!(out.stderr.contains("OOM"), "{out}");
    assert_eq!(root.status("lim").as_deref(), Some("running"));
    // A fork bomb in a box inside, with a pids limit above the parent's (or
    // none), stops at the parent's 64.
    let bomb = "import os, time
kids, err = [], None
for _ in range(500):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
print(len(kids), err, flush=True)
for k in kids:
    os.kill(k, 9)
";
    for extra in [&[][..], &["--pids", "10000"][..]] {
        let mut args = vec!["run", "--rm"];
        args.extend_from_slice(extra);
        args.extend(["--", "python3", "-c", bomb]);
        let out = root.run(&inside(&["lim"], &args)).ok();
        let mut f = out.stdout.split_whitespace();
        let forks: usize = f.next().and_then(|n| n.parse().ok()).unwrap_or(999);
        assert!(
            forks < 64,
            "forks {forks}: the parent's pids limit must stop it\n{out}"
        );
        assert_eq!(f.next(), Some("11"), "EAGAIN\n{out}");
    }
    assert_eq!(root.status("lim").as_deref(), Some("running"));
    // The box's own limits stay root's: its root cannot raise them.
    let out = root.run(&inside(
        &[],
        &[
            "exec",
            "lim",
            "--",
            "sh",
            "-c",
            "echo max > /sys/fs/cgroup/pids/pids.max",
        ],
    ));
    assert_ne!(out.code, 0, "{out}");
    let dir = box_dirs(&root, "lim")
        .into_iter()
        .find(|d| d.join("pids.max").exists())
        .unwrap();
    assert_eq!(read_trimmed(&dir.join("pids.max")), "64");
}

#[test]
fn gc_after_kill_9_at_any_level_leaves_nothing() {
    let Some(root) = TestRoot::new("gc_after_kill_9_at_any_level_leaves_nothing") else {
        return;
    };
    start(&root, &[], "g1", &["--nest", "--network", "none"]);
    let g1_dirs = box_dirs(&root, "g1");
    let nested_dirs = || -> Vec<PathBuf> {
        subtree(&g1_dirs)
            .into_iter()
            .filter(|d| !g1_dirs.contains(d))
            .collect()
    };
    for victim in ["g1/g2/g3", "g1/g2"] {
        start(&root, &["g1"], "g2", &["--nest"]);
        start(&root, &["g1", "g2"], "g3", &[]);
        assert!(!nested_dirs().is_empty());
        let inits: Vec<i32> = ["g1/g2", "g1/g2/g3"]
            .iter()
            .map(|n| host_pid(&root, n))
            .collect();
        // SIGKILL the victim's monitor: its box (and the boxes in it) end
        // with it, and leave their cgroups, records and layers behind.
        let monitor = parent_of(host_pid(&root, victim));
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(monitor),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let dead_inits: Vec<i32> = if victim == "g1/g2" {
            inits.clone()
        } else {
            inits[1..].to_vec()
        };
        wait_for("the killed box to end", Duration::from_secs(10), || {
            dead_inits.iter().all(|p| !pid_alive(*p))
        });
        assert_eq!(
            row(&tree(&root, true), victim).map(|r| r["status"].clone()),
            Some(Value::from("dead"))
        );
        // gc on the host reaches into the running box (and deeper).
        let out = root.run(&["gc"]).ok();
        let leaf = victim.rsplit('/').next().unwrap();
        assert!(
            out.stdout.contains(&format!("removed dead box {leaf}")),
            "{out}"
        );
        let rows = tree(&root, true);
        assert!(row(&rows, victim).is_none(), "{rows:?}");
        if victim == "g1/g2/g3" {
            // Its parent is untouched.
            assert_eq!(row(&rows, "g1/g2").unwrap()["status"], "running");
            root.run(&inside(&["g1"], &["rm", "-f", "g2"])).ok();
        }
        assert!(nested_dirs().is_empty(), "{:?}", nested_dirs());
        // Nothing of the boxes inside is left in g1's state directory.
        let out = root
            .run(&inside(
                &[],
                &[
                    "exec",
                    "g1",
                    "--",
                    "sh",
                    "-c",
                    "ls /var/lib/nestbox/boxes /run/nestbox/boxes",
                ],
            ))
            .ok();
        assert_eq!(
            out.stdout
                .split_whitespace()
                .filter(|l| !l.ends_with(':'))
                .count(),
            0,
            "{out}"
        );
    }
    // SIGKILL the outermost monitor: everything ends; gc takes it all.
    start(&root, &["g1"], "g2", &["--nest"]);
    start(&root, &["g1", "g2"], "g3", &[]);
    let inits: Vec<i32> = ["g1", "g1/g2", "g1/g2/g3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let all_dirs = subtree(&g1_dirs);
    let monitor = parent_of(inits[0]);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(monitor),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("every level to end", Duration::from_secs(10), || {
        inits.iter().all(|p| !pid_alive(*p))
    });
    let out = root.run(&["gc"]).ok();
    assert!(out.stdout.contains("removed dead box g1"), "{out}");
    let left: Vec<&PathBuf> = all_dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert!(mounts_under(root.path()).is_empty());
    assert!(root.names().is_empty());
}

#[test]
fn stopping_a_parent_ends_its_subtree() {
    let Some(root) = TestRoot::new("stopping_a_parent_ends_its_subtree") else {
        return;
    };
    start(&root, &[], "s1", &["--nest", "--network", "none"]);
    start(&root, &["s1"], "s2", &["--nest"]);
    start(&root, &["s1", "s2"], "s3", &[]);
    let pids: Vec<i32> = ["s1", "s1/s2", "s1/s2/s3"]
        .iter()
        .map(|n| host_pid(&root, n))
        .collect();
    let dirs = subtree(&box_dirs(&root, "s1"));
    root.run(&["stop", "-t", "1", "s1"]).ok();
    assert_eq!(root.status("s1").as_deref(), Some("exited"));
    assert!(pids.iter().all(|p| !pid_alive(*p)));
    let left: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
    assert!(left.is_empty(), "cgroups left: {left:?}");
    assert_eq!(tree(&root, false).len(), 0);
}

#[test]
fn inside_a_box_the_network_defaults_to_none_and_freeze_works() {
    let Some(root) = TestRoot::new("inside_a_box_the_network_defaults_to_none_and_freeze_works")
    else {
        return;
    };
    start(&root, &[], "w1", &["--nest", "--network", "none"]);
    // The default inside: loopback only.
    let out = root
        .run(&inside(
            &["w1"],
            &["run", "--rm", "--", "sh", "-c", "ls /sys/class/net"],
        ))
        .ok();
    assert_eq!(
        out.stdout.split_whitespace().collect::<Vec<_>>(),
        ["lo"],
        "{out}"
    );
    // A bridge inside needs the host's root: one clear line.
    let out = root.run(&inside(
        &["w1"],
        &["run", "--rm", "--network", "bridge", "--", "true"],
    ));
    assert_error(&out, 125, "not available in a box inside a box");
    // freeze inside: ptrace and the freezer cgroup work in the box's user
    // namespace.
    start(&root, &["w1"], "f2", &[]);
    let out = root
        .run(&inside(&["w1"], &["freeze", "f2", "--as", "t2"]))
        .ok();
    assert_eq!(out.stdout.trim(), "t2", "{out}");
    let out = root.run(&inside(&["w1"], &["ps", "--json"])).ok();
    assert!(out.stdout.contains("\"frozen\""), "{out}");
    // Clones inside are not made yet: one clear line.
    let out = root.run(&inside(&["w1"], &["clone", "t2", "-d"]));
    assert_error(&out, 125, "clones cannot be made in a box yet");
    // A box with boxes inside cannot be frozen itself (yet).
    let out = root.run(&["freeze", "w1"]);
    assert_error(&out, 125, "runs boxes of its own");
}
