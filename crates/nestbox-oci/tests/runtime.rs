//! nestbox-runc driven from outside, as podman or containerd drive runc:
//! the lifecycle and its state JSON, exit codes, pid files, errors, and what
//! the process inside a container sees of the config it was given.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{ready, Env, StdoutJson};
use serde_json::{json, Value};

#[test]
fn lifecycle_create_start_state_kill_delete() {
    if !ready("lifecycle_create_start_state_kill_delete") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    let pid_file = env.tmp().join("pid");
    env.runc(&[
        "create",
        "--bundle",
        env.bundle.to_str().unwrap(),
        "--pid-file",
        pid_file.to_str().unwrap(),
        "c1",
    ])
    .ok();
    let s = env.state("c1");
    assert_eq!(s["status"], "created");
    assert_eq!(s["id"], "c1");
    assert_eq!(s["ociVersion"], "1.2.0");
    assert_eq!(s["bundle"], env.bundle.to_str().unwrap());
    assert_eq!(s["rootfs"], env.bundle.join("rootfs").to_str().unwrap());
    let pid = s["pid"].as_i64().unwrap();
    assert_eq!(std::fs::read_to_string(&pid_file).unwrap(), pid.to_string());
    // Created: the process waits, the program has not run.
    let comm = |pid: i64| std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert_ne!(comm(pid).trim(), "sleep");
    env.runc(&["start", "c1"]).ok();
    let s = env.state("c1");
    assert_eq!(s["status"], "running");
    assert_eq!(comm(pid).trim(), "sleep");
    env.runc(&["start", "c1"]).fails_with("already running");
    env.runc(&["delete", "c1"]).fails_with("not stopped");
    assert_eq!(env.state("c1")["status"], "running");
    // SIGKILL: pid 1 of a pid namespace ignores signals it has no handler
    // for (sleep has none for SIGTERM).
    env.runc(&["kill", "c1", "9"]).ok();
    env.wait_status("c1", "stopped");
    assert_eq!(env.state("c1")["pid"], 0);
    env.runc(&["kill", "c1", "KILL"]).fails_with("not running");
    env.runc(&["delete", "c1"]).ok();
    env.runc(&["state", "c1"]).fails_with("does not exist");
    assert!(!common::cgroup_exists(&env.cgroup_name("c1")));
    env.runc(&["delete", "--force", "c1"]).ok();
}

#[test]
fn run_returns_the_exit_code_and_removes_the_container() {
    if !ready("run_returns_the_exit_code_and_removes_the_container") {
        return;
    }
    let env = Env::new(&["sh", "-c", "echo out; echo err >&2; exit 7"]);
    let out = env.run("r1");
    assert_eq!(out.code, 7, "{out:?}");
    assert_eq!(out.stdout, "out\n");
    assert_eq!(out.stderr, "err\n");
    // Killed by a signal: 128 + the signal, as a shell reports it.
    env.edit(|c| c["process"]["args"] = json!(["sleep", "1000"]));
    let runner = {
        let (root, bundle) = (env.root.clone(), env.bundle.clone());
        std::thread::spawn(move || {
            common::run(
                common::RUNC,
                &[
                    "--root",
                    root.to_str().unwrap(),
                    "run",
                    "--bundle",
                    bundle.to_str().unwrap(),
                    "r2",
                ],
                None,
            )
        })
    };
    let deadline = Instant::now() + common::TIMEOUT;
    while env.runc(&["state", "r2"]).stdout.find("running").is_none() {
        assert!(Instant::now() < deadline, "r2 never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    env.runc(&["kill", "r2", "KILL"]).ok();
    assert_eq!(runner.join().unwrap().code, 137);
    assert_eq!(env.runc(&["list", "-q"]).ok().stdout, "");
    assert!(!common::cgroup_exists(&env.cgroup_name("r1")));
}

#[test]
fn run_detached_then_delete_force() {
    if !ready("run_detached_then_delete_force") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    env.runc(&["run", "-d", "--bundle", env.bundle.to_str().unwrap(), "d1"])
        .ok();
    assert_eq!(env.state("d1")["status"], "running");
    let list = env.runc(&["list", "--format", "json"]).ok().json();
    assert_eq!(list[0]["id"], "d1");
    env.runc(&["delete", "--force", "d1"]).ok();
    env.runc(&["state", "d1"]).fails_with("does not exist");
}

#[test]
fn bad_input_fails_clearly_and_leaves_nothing() {
    if !ready("bad_input_fails_clearly_and_leaves_nothing") {
        return;
    }
    let env = Env::new(&["no-such-program"]);
    env.create("b1").fails_with("executable file not found");
    assert!(!env.root.join("b1").exists());
    // An I/O error is said once (not repeated as its source).
    let out = common::run(
        common::RUNC,
        &[
            "--root",
            "/proc/nestbox-no-such-dir",
            "create",
            "--bundle",
            env.bundle.to_str().unwrap(),
            "b0",
        ],
        None,
    )
    .fails_with("/proc/nestbox-no-such-dir");
    assert_eq!(out.stderr.matches("No such file").count(), 1, "{out}");
    assert!(!common::cgroup_exists(&env.cgroup_name("b1")));
    env.edit(|c| c["process"]["args"] = json!(["sleep", "100"]));
    env.create("b/1").fails_with("invalid container id");
    env.runc(&["--systemd-cgroup", "create", "b2"])
        .fails_with("--systemd-cgroup is not supported");
    env.runc(&["start", "nope"]).fails_with("does not exist");
    env.edit(|c| c["process"]["capabilities"]["bounding"] = json!(["CAP_FLY"]));
    env.create("b3").fails_with("CAP_FLY");
    env.edit(|c| {
        c["process"]["capabilities"]["bounding"] =
            json!(["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]);
        c["root"]["path"] = json!("no-such-rootfs");
    });
    env.create("b4").fails_with("root.path");
    env.edit(|c| {
        c["root"]["path"] = json!("rootfs");
        c["linux"]["sysctl"] = json!({"vm.swappiness": "10"});
    });
    env.create("b5").fails_with("not namespaced");
    env.edit(|c| {
        c["linux"]["sysctl"] = json!({});
        c["process"]["terminal"] = json!(true);
    });
    env.create("b6").fails_with("--console-socket is required");
    env.edit(|c| {
        c["process"]["terminal"] = json!(false);
        c["mounts"].as_array_mut().unwrap().push(
            json!({"destination": "/x", "type": "bind", "source": "/no/such", "options": ["bind"]}),
        );
    });
    env.create("b7")
        .fails_with("bind source /no/such does not exist");
    assert_eq!(env.runc(&["list", "-q"]).ok().stdout, "");
    env.edit(|c| {
        c["mounts"].as_array_mut().unwrap().pop();
    });
    env.create("b8").ok();
    env.create("b8").fails_with("already exists");
}

#[test]
fn errors_go_to_the_log_file_as_json() {
    if !ready("errors_go_to_the_log_file_as_json") {
        return;
    }
    let env = Env::new(&["true"]);
    let log = env.tmp().join("log.json");
    env.runc(&[
        "--log",
        log.to_str().unwrap(),
        "--log-format",
        "json",
        "state",
        "nope",
    ])
    .fails_with("does not exist");
    let line: Value = serde_json::from_str(std::fs::read_to_string(&log).unwrap().trim()).unwrap();
    assert_eq!(line["level"], "error");
    assert!(line["msg"]
        .as_str()
        .unwrap()
        .contains("\"nope\" does not exist"));
    assert!(line["time"].as_str().unwrap().ends_with('Z'));
}

/// Run `script` in a container made from `env`'s config changed by `edit`;
/// its stdout.
fn inside(env: &Env, script: &str, edit: impl FnOnce(&mut Value)) -> String {
    env.edit(|c| {
        c["process"]["args"] = json!(["sh", "-c", script]);
        edit(c);
    });
    env.run("in").ok().stdout
}

#[test]
fn config_hostname_namespaces_mounts_and_paths() {
    if !ready("config_hostname_namespaces_mounts_and_paths") {
        return;
    }
    let env = Env::new(&["true"]);
    let shared = env.tmp().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("f"), "from host").unwrap();
    let out = inside(
        &env,
        "hostname; echo pid=$$; cat /data/f; echo; touch /data/g 2>/dev/null || echo ro-bind; \
         grep ' /scratch ' /proc/mounts; touch /scratch/x && echo scratch-rw; \
         cat /proc/kcore 2>/dev/null | wc -c; echo 1 > /proc/sys/kernel/ostype 2>/dev/null || echo ro-proc-sys; \
         ls /proc/acpi 2>/dev/null | wc -l; ls /dev | grep -c -E '^(null|zero|full|random|urandom|tty)$'",
        |c| {
            c["hostname"] = json!("oci-box");
            let mounts = c["mounts"].as_array_mut().unwrap();
            mounts.push(json!({"destination": "/data", "type": "bind",
                "source": shared.to_str().unwrap(), "options": ["rbind", "ro"]}));
            mounts.push(json!({"destination": "/scratch", "type": "tmpfs", "source": "tmpfs",
                "options": ["nosuid", "nodev", "size=1m", "mode=1777"]}));
            c["linux"]["maskedPaths"] = json!(["/proc/kcore", "/proc/acpi"]);
            c["linux"]["readonlyPaths"] = json!(["/proc/sys"]);
        },
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "oci-box");
    assert_eq!(lines[1], "pid=1");
    assert_eq!(lines[2], "from host");
    assert_eq!(lines[3], "ro-bind");
    assert!(
        lines[4].contains("tmpfs /scratch tmpfs rw,nosuid,nodev")
            && lines[4].contains("size=1024k"),
        "{}",
        lines[4]
    );
    assert_eq!(lines[5], "scratch-rw");
    assert_eq!(lines[6], "0");
    assert_eq!(lines[7], "ro-proc-sys");
    assert_eq!(lines[8], "0");
    assert_eq!(lines[9], "6");
    assert!(!shared.join("g").exists());
    assert_ne!(
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .unwrap()
            .trim(),
        "oci-box"
    );
}

#[test]
fn config_process_user_rlimits_caps_nnp_oom_sysctl() {
    if !ready("config_process_user_rlimits_caps_nnp_oom_sysctl") {
        return;
    }
    let env = Env::new(&["true"]);
    // The container's sysctl is set to the opposite of the host's (which
    // bridged boxes of other tests may have turned on), and the host's must
    // stay as it was.
    let host_forward = || {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim()
            .to_string()
    };
    let before = host_forward();
    let wanted = if before == "1" { "0" } else { "1" };
    let out = inside(
        &env,
        "id -u; id -g; id -G; ulimit -n; ulimit -Hn; grep -E '^(CapBnd|CapEff|CapPrm|CapAmb|NoNewPrivs)' /proc/self/status; \
         cat /proc/self/oom_score_adj; cat /proc/sys/net/ipv4/ip_forward; pwd; echo $FOO",
        |c| {
            c["process"]["user"] = json!({"uid": 1000, "gid": 1001, "additionalGids": [1002, 1003]});
            c["process"]["rlimits"] = json!([{"type": "RLIMIT_NOFILE", "soft": 100, "hard": 200}]);
            c["process"]["capabilities"] = json!({
                "bounding": ["CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_CHOWN"],
                "effective": ["CAP_KILL"], "permitted": ["CAP_KILL", "CAP_CHOWN"],
                "inheritable": ["CAP_KILL"], "ambient": ["CAP_KILL"]});
            c["process"]["noNewPrivileges"] = json!(true);
            c["process"]["oomScoreAdj"] = json!(500);
            c["process"]["cwd"] = json!("/tmp/work");
            c["process"]["env"] = json!(["PATH=/bin", "FOO=bar"]);
            c["linux"]["sysctl"] = json!({"net.ipv4.ip_forward": wanted});
        },
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        &lines[..5],
        &["1000", "1001", "1001 1002 1003", "100", "200"],
        "{out}"
    );
    // CAP_KILL is bit 5 (0x20), CAP_CHOWN bit 0, CAP_NET_BIND_SERVICE bit 10.
    assert_eq!(lines[5], "CapPrm:\t0000000000000020", "{out}");
    assert_eq!(lines[6], "CapEff:\t0000000000000020");
    assert_eq!(lines[7], "CapBnd:\t0000000000000421");
    assert_eq!(lines[8], "CapAmb:\t0000000000000020");
    assert_eq!(lines[9], "NoNewPrivs:\t1");
    assert_eq!(lines[10], "500");
    assert_eq!(lines[11], wanted);
    assert_eq!(lines[12], "/tmp/work");
    assert_eq!(lines[13], "bar");
    assert_eq!(host_forward(), before, "the host's ip_forward is untouched");
}

#[test]
fn config_seccomp_section_is_enforced() {
    if !ready("config_seccomp_section_is_enforced") {
        return;
    }
    let env = Env::new(&["true"]);
    let out = inside(
        &env,
        "mkdir /dev/shm/d 2>&1; echo rc=$?; touch /dev/shm/f && echo touched",
        |c| {
            c["linux"]["seccomp"] = json!({
                "defaultAction": "SCMP_ACT_ALLOW",
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]
            });
        },
    );
    assert!(out.contains("Operation not permitted"), "{out}");
    assert!(out.contains("rc=1") && out.contains("touched"), "{out}");
}

#[test]
fn config_user_namespace_mappings() {
    if !ready("config_user_namespace_mappings") {
        return;
    }
    let env = Env::new(&["true"]);
    let out = inside(
        &env,
        "cat /proc/self/uid_map /proc/self/gid_map; id -u; stat -c %u /bin/busybox",
        |c| {
            c["linux"]["namespaces"]
                .as_array_mut()
                .unwrap()
                .push(json!({"type": "user"}));
            c["linux"]["uidMappings"] =
                json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
            c["linux"]["gidMappings"] =
                json!([{"containerID": 0, "hostID": 200000, "size": 65536}]);
        },
    );
    let words: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(
        &words[..6],
        &["0", "200000", "65536", "0", "200000", "65536"],
        "{out}"
    );
    assert_eq!(words[6], "0");
    // Host root is not mapped: its files show as the overflow id.
    assert_eq!(words[7], "65534");
}

#[test]
fn namespaces_joined_by_path() {
    if !ready("namespaces_joined_by_path") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    env.edit(|c| c["hostname"] = json!("first"));
    env.runc(&["run", "-d", "--bundle", env.bundle.to_str().unwrap(), "a"])
        .ok();
    let pid = env.state("a")["pid"].as_i64().unwrap();
    let ns = |kind: &str| std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap();
    let out = inside(
        &env,
        "hostname; for n in net uts ipc; do readlink /proc/self/ns/$n; done",
        |c| {
            c["hostname"] = Value::Null;
            for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
                if n["type"] == "network" || n["type"] == "uts" {
                    let kind = if n["type"] == "network" { "net" } else { "uts" };
                    n["path"] = json!(format!("/proc/{pid}/ns/{kind}"));
                }
            }
        },
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "first");
    assert_eq!(lines[1], ns("net").to_str().unwrap());
    assert_eq!(lines[2], ns("uts").to_str().unwrap());
    assert_ne!(lines[3], ns("ipc").to_str().unwrap());
}

#[test]
fn exec_pause_resume_ps_and_stats() {
    if !ready("exec_pause_resume_ps_and_stats") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    env.runc(&["run", "-d", "--bundle", env.bundle.to_str().unwrap(), "e1"])
        .ok();
    let out = env
        .runc(&[
            "exec",
            "e1",
            "sh",
            "-c",
            "cat /proc/1/comm; echo $$; hostname",
        ])
        .ok();
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines[0], "sleep");
    assert_ne!(lines[1], "1");
    assert_eq!(env.runc(&["exec", "e1", "sh", "-c", "exit 3"]).code, 3);
    let process = env.tmp().join("process.json");
    std::fs::write(
        &process,
        json!({"args": ["sh", "-c", "id -u; echo $X"], "cwd": "/", "env": ["X=y", "PATH=/bin"],
               "user": {"uid": 7, "gid": 7}})
        .to_string(),
    )
    .unwrap();
    let out = env
        .runc(&["exec", "--process", process.to_str().unwrap(), "e1"])
        .ok();
    assert_eq!(out.stdout, "7\ny\n");
    env.runc(&["exec", "e1", "no-such-program"])
        .fails_with("executable file not found");
    let pid_file = env.tmp().join("exec.pid");
    env.runc(&[
        "exec",
        "-d",
        "--pid-file",
        pid_file.to_str().unwrap(),
        "e1",
        "sleep",
        "500",
    ])
    .ok();
    let exec_pid: i32 = std::fs::read_to_string(&pid_file).unwrap().parse().unwrap();
    let pids: Vec<i32> =
        serde_json::from_str(&env.runc(&["ps", "--format", "json", "e1"]).ok().stdout).unwrap();
    let init = env.state("e1")["pid"].as_i64().unwrap() as i32;
    assert!(pids.contains(&init) && pids.contains(&exec_pid), "{pids:?}");
    env.runc(&["pause", "e1"]).ok();
    assert_eq!(env.state("e1")["status"], "paused");
    env.runc(&["exec", "e1", "true"]).fails_with("not running");
    env.runc(&["resume", "e1"]).ok();
    assert_eq!(env.state("e1")["status"], "running");
    let stats = env.runc(&["events", "--stats", "e1"]).ok().json();
    assert_eq!(stats["type"], "stats");
    assert_eq!(stats["data"]["pids"]["current"], 2);
    assert!(stats["data"]["memory"]["usage"]["usage"].as_u64().unwrap() > 0);
    env.runc(&["kill", "--all", "e1", "KILL"]).ok();
    env.wait_status("e1", "stopped");
    env.runc(&["delete", "e1"]).ok();
}

#[test]
fn cgroup_limits_from_resources() {
    if !ready("cgroup_limits_from_resources") {
        return;
    }
    let env = Env::new(&["true"]);
    let out = inside(
        &env,
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max; \
         cat /proc/self/cgroup | grep memory; \
         cat /sys/fs/cgroup/memory/memory.swappiness; \
         grep oom_kill_disable /sys/fs/cgroup/memory/memory.oom_control",
        |c| {
            c["linux"]["resources"] = json!({"memory": {"limit": 67108864, "swappiness": 17,
                "disableOOMKiller": true}, "pids": {"limit": 20}});
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/sys/fs/cgroup",
                "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "ro"]}));
        },
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "67108864", "{out}");
    assert_eq!(lines[1], "20");
    assert!(lines[2].ends_with(":memory:/"), "{out}");
    assert_eq!(lines[3], "17", "memory.swappiness: {out}");
    assert_eq!(lines[4], "oom_kill_disable 1", "{out}");
    // A swappiness above 100 is refused, naming it; nothing is left.
    env.edit(|c| {
        c["linux"]["resources"] = json!({"memory": {"swappiness": 101}});
    });
    env.create("m2")
        .fails_with("invalid memory_swappiness=101: must be in 0..=100");
    env.runc(&["state", "m2"]).fails_with("does not exist");
    // linux.resources.network goes to the v1 net_cls/net_prio controllers;
    // where there is none (cgroup v2 has no such controller), the config is
    // refused naming what is missing, and nothing is left.
    if !std::path::Path::new("/sys/fs/cgroup/net_cls").exists() {
        env.edit(|c| {
            c["linux"]["resources"] = json!({"network": {"classID": 1048577,
                "priorities": [{"name": "lo", "priority": 3}]}});
        });
        let out = env
            .create("m3")
            .fails_with("net_class_id requested but the net_cls controller is not usable");
        // Said once: the wrapped error is not repeated as its source.
        assert!(
            out.stderr.starts_with("nestbox-runc: cgroup: net_class_id"),
            "{out}"
        );
        assert_eq!(out.stderr.matches("net_class_id").count(), 1, "{out}");
        env.runc(&["state", "m3"]).fails_with("does not exist");
    }
}

/// Huge pages of 2 MiB reserved on the host for a test (the per-size
/// `nr_hugepages`, raised by `n`), given back on drop.
struct HugePages {
    file: std::path::PathBuf,
    before: String,
}

impl HugePages {
    fn reserve(n: u64) -> HugePages {
        let file =
            Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages").to_path_buf();
        let before = std::fs::read_to_string(&file).unwrap().trim().to_string();
        let want = before.parse::<u64>().unwrap() + n;
        std::fs::write(&file, want.to_string()).unwrap();
        let free =
            std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
                .unwrap();
        assert!(
            free.trim().parse::<u64>().unwrap() >= n,
            "the kernel could not reserve {n} huge pages of 2 MiB (free: {free})"
        );
        HugePages { file, before }
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.file, &self.before);
    }
}

/// The v2 hierarchy's `hugetlb` controller as it was before a test: enabled
/// along the containers' path by nestbox-runc (as runc does), it is disabled
/// again on drop, deepest directory first, where the test enabled it.
struct V2Hugetlb {
    mount: std::path::PathBuf,
    was_on: bool,
}

impl V2Hugetlb {
    fn note(mount: &Path) -> V2Hugetlb {
        let file = mount.join("cgroup.subtree_control");
        let text = std::fs::read_to_string(file).unwrap_or_default();
        V2Hugetlb {
            mount: mount.to_path_buf(),
            was_on: text.split_whitespace().any(|c| c == "hugetlb"),
        }
    }
}

impl Drop for V2Hugetlb {
    fn drop(&mut self) {
        if self.was_on {
            return;
        }
        fn off(dir: &Path) {
            for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    off(&entry.path());
                }
            }
            let file = dir.join("cgroup.subtree_control");
            let on = std::fs::read_to_string(&file)
                .unwrap_or_default()
                .split_whitespace()
                .any(|c| c == "hugetlb");
            if on {
                if let Err(e) = std::fs::write(&file, "-hugetlb") {
                    eprintln!("could not disable hugetlb in {}: {e}", file.display());
                }
            }
        }
        off(&self.mount);
    }
}

#[test]
fn hugepage_limits_are_enforced_through_the_hugetlb_controller() {
    let test = "hugepage_limits_are_enforced_through_the_hugetlb_controller";
    if !ready(test) {
        return;
    }
    if !Path::new("/sys/kernel/mm/hugepages/hugepages-2048kB").is_dir() {
        return nestbox_testkit::skip(test, "needs 2 MiB huge pages");
    }
    let h = nestbox_cgroup::Hierarchies::detect().unwrap();
    let Some(hugetlb) = h.find("hugetlb") else {
        return nestbox_testkit::skip(test, "needs a hugetlb controller (v1 or v2)");
    };
    let _pages = HugePages::reserve(4);
    let _controller = (hugetlb.version() == nestbox_cgroup::Version::V2)
        .then(|| V2Hugetlb::note(hugetlb.mount_point()));
    // Two files of one 2 MiB page each on a hugetlbfs of the container's:
    // fallocate takes the pages, charged to the container's hugetlb cgroup.
    let script = "fallocate -l 2M /hp/a && echo a-ok; fallocate -l 2M /hp/b && echo b-ok; true";
    let env = Env::new(&["sh", "-c", script]);
    let rootfs = env.bundle.join("rootfs");
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/fallocate")).unwrap();
    std::fs::create_dir(rootfs.join("hp")).unwrap();
    env.edit(|c| {
        c["mounts"]
            .as_array_mut()
            .unwrap()
            .push(json!({"destination": "/hp",
            "type": "hugetlbfs", "source": "none", "options": ["pagesize=2M"]}));
    });
    // Without a limit: both pages.
    let out = env.run("h0").ok();
    assert_eq!(out.stdout, "a-ok\nb-ok\n", "{out}");
    // Limited to one page: the second is refused by the kernel.
    env.edit(|c| {
        c["linux"]["resources"] =
            json!({"hugepageLimits": [{"pageSize": "2MB", "limit": 2097152}]});
    });
    let out = env.run("h1").ok();
    assert_eq!(out.stdout, "a-ok\n", "{out}");
    assert!(out.stderr.contains("No space left on device"), "{out}");
    // The limit, read in the container's cgroup of the hierarchy that has
    // hugetlb (on this hybrid machine, its cgroup v2 hierarchy, whose root
    // nestbox had enable hugetlb for it).
    env.edit(|c| c["process"]["args"] = json!(["sleep", "100"]));
    env.runc(&["run", "-d", "--bundle", env.bundle.to_str().unwrap(), "h2"])
        .ok();
    let pid = env.state("h2")["pid"].as_i64().unwrap();
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let rel = cgroup
        .lines()
        .find_map(|l| {
            let (_, rest) = l.split_once(':')?;
            let (controllers, path) = rest.split_once(':')?;
            let here = match hugetlb.version() {
                nestbox_cgroup::Version::V2 => controllers.is_empty(),
                nestbox_cgroup::Version::V1 => controllers.split(',').any(|c| c == "hugetlb"),
            };
            here.then(|| path.trim_start_matches('/').to_string())
        })
        .expect("the container's hugetlb cgroup");
    let dir = hugetlb.mount_point().join(&rel);
    let (max, rsvd) = match hugetlb.version() {
        nestbox_cgroup::Version::V2 => ("hugetlb.2MB.max", "hugetlb.2MB.rsvd.max"),
        nestbox_cgroup::Version::V1 => (
            "hugetlb.2MB.limit_in_bytes",
            "hugetlb.2MB.rsvd.limit_in_bytes",
        ),
    };
    assert_eq!(
        std::fs::read_to_string(dir.join(max)).unwrap().trim(),
        "2097152"
    );
    if dir.join(rsvd).exists() {
        assert_eq!(
            std::fs::read_to_string(dir.join(rsvd)).unwrap().trim(),
            "2097152"
        );
    }
    env.runc(&["delete", "--force", "h2"]).ok();
    assert!(!dir.exists(), "{} left", dir.display());
    // A page size the kernel does not have: one line, nothing left.
    env.edit(|c| {
        c["linux"]["resources"] =
            json!({"hugepageLimits": [{"pageSize": "3MB", "limit": 3145728}]});
    });
    env.create("h3")
        .fails_with("linux.resources.hugepageLimits: page size \"3MB\": the kernel has no huge pages of that size");
    env.runc(&["state", "h3"]).fails_with("does not exist");
}

#[test]
fn block_io_limits_per_device() {
    if !ready("block_io_limits_per_device") {
        return;
    }
    // loop0 (7:0) exists on these machines whether attached or not.
    if !std::path::Path::new("/sys/block/loop0").exists() {
        return nestbox_testkit::skip("block_io_limits_per_device", "needs /dev/loop0");
    }
    let env = Env::new(&["true"]);
    let out = inside(
        &env,
        "cd /sys/fs/cgroup/blkio; cat blkio.throttle.read_bps_device blkio.throttle.write_bps_device \
         blkio.throttle.read_iops_device blkio.throttle.write_iops_device",
        |c| {
            c["linux"]["resources"] = json!({"blockIO": {
                "throttleReadBpsDevice": [{"major": 7, "minor": 0, "rate": 1048576}],
                "throttleWriteBpsDevice": [{"major": 7, "minor": 0, "rate": 2097152}],
                "throttleReadIOPSDevice": [{"major": 7, "minor": 0, "rate": 300}],
                "throttleWriteIOPSDevice": [{"major": 7, "minor": 0, "rate": 400}]}});
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/sys/fs/cgroup",
                "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "ro"]}));
        },
    );
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["7:0 1048576", "7:0 2097152", "7:0 300", "7:0 400"],
        "{out}"
    );
    // Leaf weights: the kernel has none; refused, nothing left.
    env.edit(|c| {
        c["linux"]["resources"] = json!({"blockIO": {"leafWeight": 300}});
    });
    env.create("b2")
        .fails_with("blockIO.leafWeight is not supported");
    env.runc(&["state", "b2"]).fails_with("does not exist");
    // A device number that is not one: refused, naming the field.
    env.edit(|c| {
        c["linux"]["resources"] = json!({"blockIO": {
            "throttleReadBpsDevice": [{"major": -1, "minor": 0, "rate": 1}]}});
    });
    env.create("b3")
        .fails_with("blockIO.throttleReadBpsDevice: device -1:0 is not a device number");
    env.runc(&["state", "b3"]).fails_with("does not exist");
}

#[test]
fn hooks_run_at_their_stages_with_the_state() {
    if !ready("hooks_run_at_their_stages_with_the_state") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    let dir = env.tmp().join("hooks");
    std::fs::create_dir(&dir).unwrap();
    // Each hook saves its state and its mount namespace. createContainer
    // runs in the container's namespaces but resolves paths in the
    // runtime's file system (before the pivot): it writes to the host's
    // directory. startContainer runs in the container after the pivot: it
    // writes through /hookout, a bind mount of that directory.
    let hook_in = |name: &str, out: &str| {
        json!([{"path": "/bin/sh", "args": ["sh", "-c",
            format!("cat > {out}/{name}.json; readlink /proc/self/ns/mnt > {out}/{name}.ns")]}])
    };
    let host = dir.display().to_string();
    let hook = |name: &str| hook_in(name, &host);
    env.edit(|c| {
        c["hooks"] = json!({
            "createRuntime": hook("createRuntime"), "createContainer": hook("createContainer"),
            "startContainer": hook_in("startContainer", "/hookout"), "poststart": hook("poststart"),
            // A failing poststop hook is a warning; the next one still runs.
            "poststop": [{"path": "/bin/false"}, hook("poststop")[0]]});
        c["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/hookout", "type": "bind", "source": host,
            "options": ["rbind", "rw"]}));
    });
    let read = |name: &str| -> Option<Value> {
        std::fs::read_to_string(dir.join(format!("{name}.json")))
            .ok()
            .map(|t| serde_json::from_str(&t).unwrap())
    };
    let ns = |name: &str| std::fs::read_to_string(dir.join(format!("{name}.ns"))).unwrap();
    env.create("h1").ok();
    let cr = read("createRuntime").unwrap();
    assert_eq!(cr["id"], "h1");
    assert_eq!(cr["status"], "created");
    let pid = cr["pid"].as_i64().unwrap();
    assert!(pid > 0);
    let cc = read("createContainer").unwrap();
    assert_eq!(cc["id"], "h1");
    assert_eq!(cc["pid"], pid);
    let container_mnt = format!(
        "{}\n",
        std::fs::read_link(format!("/proc/{pid}/ns/mnt"))
            .unwrap()
            .display()
    );
    let own_mnt = format!(
        "{}\n",
        std::fs::read_link("/proc/self/ns/mnt").unwrap().display()
    );
    assert_ne!(container_mnt, own_mnt);
    assert_eq!(ns("createRuntime"), own_mnt, "createRuntime: the runtime's");
    assert_eq!(
        ns("createContainer"),
        container_mnt,
        "createContainer: the container's"
    );
    assert!(read("startContainer").is_none() && read("poststart").is_none());
    env.runc(&["start", "h1"]).ok();
    assert_eq!(read("poststart").unwrap()["status"], "running");
    let sc = read("startContainer").unwrap();
    assert_eq!(sc["status"], "created");
    assert_eq!(
        ns("startContainer"),
        container_mnt,
        "startContainer: the container's"
    );
    // The program runs (the hook did not fail it).
    assert_eq!(env.state("h1")["status"], "running");
    assert!(read("poststop").is_none());
    env.runc(&["delete", "--force", "h1"]).ok();
    let stop = read("poststop").unwrap();
    assert_eq!(stop["status"], "stopped");
    assert_eq!(stop["id"], "h1");

    // A failing createContainer hook fails create; nothing is left.
    env.edit(|c| c["hooks"] = json!({"createContainer": [{"path": "/bin/false"}]}));
    env.create("h2")
        .fails_with("createContainer hook /bin/false: exited with");
    env.runc(&["state", "h2"]).fails_with("does not exist");
}

#[test]
fn terminal_goes_over_the_console_socket() {
    if !ready("terminal_goes_over_the_console_socket") {
        return;
    }
    let env = Env::new(&["sh", "-c", "tty; echo hi-from-tty; sleep 1000"]);
    env.edit(|c| c["process"]["terminal"] = json!(true));
    let master = env.create_on_terminal("t1");
    env.runc(&["start", "t1"]).ok();
    let mut seen = String::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut master = std::fs::File::from(master);
    while !seen.contains("hi-from-tty") && Instant::now() < deadline {
        use std::io::Read;
        let mut b = [0u8; 256];
        let n = master.read(&mut b).unwrap();
        seen.push_str(&String::from_utf8_lossy(&b[..n]));
    }
    assert!(seen.contains("/dev/pts/0"), "{seen:?}");
    assert!(seen.contains("hi-from-tty"), "{seen:?}");
    env.runc(&["delete", "--force", "t1"]).ok();
}

#[test]
fn features_and_spec() {
    if !ready("features_and_spec") {
        return;
    }
    let env = Env::new(&["true"]);
    let f = env.runc(&["features"]).ok().json();
    assert_eq!(f["linux"]["cgroup"]["systemd"], false);
    assert!(f["linux"]["namespaces"]
        .as_array()
        .unwrap()
        .contains(&json!("user")));
    assert!(f["hooks"]
        .as_array()
        .unwrap()
        .contains(&json!("createContainer")));
    env.runc(&["spec", "--bundle", env.bundle.to_str().unwrap()])
        .fails_with("exists already");
}

#[test]
fn cgroups_path_is_honoured() {
    if !ready("cgroups_path_is_honoured") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    // Named nestbox-… so that scripts/check-leaks.sh would see a leak.
    let parent = format!("nestbox-test-oci-{}", std::process::id());
    env.edit(|c| {
        c["linux"]["cgroupsPath"] = json!(format!("/{parent}/ctr"));
        c["linux"]["resources"] = json!({"pids": {"limit": 30}});
    });
    env.create("p1").ok();
    let pid = env.state("p1")["pid"].as_i64().unwrap();
    let dir = Path::new("/sys/fs/cgroup/pids").join(&parent).join("ctr");
    assert_eq!(
        std::fs::read_to_string(dir.join("pids.max"))
            .unwrap()
            .trim(),
        "30"
    );
    let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
    assert!(procs.lines().any(|l| l == pid.to_string()), "{procs}");
    env.runc(&["delete", "--force", "p1"]).ok();
    assert!(!dir.exists());
    // The parents made for it stay (as runc leaves them): remove them here.
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
        let _ = std::fs::remove_dir(hierarchy.path().join(&parent));
    }
    assert!(!common::cgroup_exists(&parent));
    env.edit(|c| c["linux"]["cgroupsPath"] = json!("system.slice:nestbox:p2"));
    env.create("p2").fails_with("systemd slice paths");
}

#[test]
fn without_a_mount_namespace_nothing_is_mounted() {
    if !ready("without_a_mount_namespace_nothing_is_mounted") {
        return;
    }
    let env = Env::new(&["true"]);
    let out = inside(&env, "ls /; ls /proc | wc -l", |c| {
        let ns = c["linux"]["namespaces"].as_array_mut().unwrap();
        ns.retain(|n| n["type"] != "mount");
        c["root"]["readonly"] = json!(false);
    });
    // The root is the bundle's rootfs (a chroot); its /proc stays empty.
    assert!(out.lines().any(|l| l == "bin"), "{out}");
    assert_eq!(out.lines().last(), Some("0"));
    // Nothing was mounted on the host: no mount under the bundle, and the
    // host's /proc, /dev and /sys are each mounted once, as before.
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!info.contains(env.bundle.to_str().unwrap()), "{info}");
    for point in ["/proc", "/dev", "/sys"] {
        let n = info
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(point))
            .count();
        assert_eq!(n, 1, "{point} mounted {n} times:\n{info}");
    }
}

#[test]
fn config_without_process_is_created_but_not_started() {
    if !ready("config_without_process_is_created_but_not_started") {
        return;
    }
    let env = Env::new(&["true"]);
    env.edit(|c| {
        c.as_object_mut().unwrap().remove("process");
    });
    env.create("n1").ok();
    assert_eq!(env.state("n1")["status"], "created");
    env.runc(&["start", "n1"])
        .fails_with("has no process: nothing to start");
    env.wait_status("n1", "stopped");
    env.runc(&["delete", "n1"]).ok();
}

#[test]
fn update_changes_the_limits_of_a_running_container() {
    if !ready("update_changes_the_limits_of_a_running_container") {
        return;
    }
    let env = Env::new(&["sleep", "1000"]);
    env.edit(|c| c["linux"]["resources"] = json!({"pids": {"limit": 20}}));
    env.runc(&["run", "-d", "--bundle", env.bundle.to_str().unwrap(), "u1"])
        .ok();
    let pid = env.state("u1")["pid"].as_i64().unwrap();
    let cgroup_file = |controller: &str, file: &str| {
        let line = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let path = line
            .lines()
            .find_map(|l| {
                l.split_once(&format!(":{controller}:"))
                    .map(|(_, p)| p.to_string())
            })
            .unwrap();
        let full = Path::new("/sys/fs/cgroup")
            .join(controller)
            .join(path.trim_start_matches('/'))
            .join(file);
        std::fs::read_to_string(full).unwrap().trim().to_string()
    };
    assert_eq!(cgroup_file("pids", "pids.max"), "20");
    env.runc(&["update", "--pids-limit", "50", "--memory", "64m", "u1"])
        .ok();
    assert_eq!(cgroup_file("pids", "pids.max"), "50");
    assert_eq!(cgroup_file("memory", "memory.limit_in_bytes"), "67108864");
    let file = env.tmp().join("resources.json");
    std::fs::write(&file, json!({"pids": {"limit": 70}}).to_string()).unwrap();
    env.runc(&["update", "--resources", file.to_str().unwrap(), "u1"])
        .ok();
    assert_eq!(cgroup_file("pids", "pids.max"), "70");
    assert_eq!(cgroup_file("memory", "memory.limit_in_bytes"), "67108864");
    env.runc(&["update", "--memory", "lots", "u1"])
        .fails_with("invalid size");
    env.runc(&["kill", "u1", "KILL"]).ok();
    env.wait_status("u1", "stopped");
    env.runc(&["update", "--pids-limit", "5", "u1"])
        .fails_with("cannot update a stopped container");
    env.runc(&["delete", "u1"]).ok();
}

/// Run nestbox-runc with `--root` of `env` and `args`, its descriptor 3
/// appending to `out3` and its descriptor 4 reading `in4` (set up by a shell
/// that then execs the runtime, as a caller passing descriptors would).
fn runc_with_fds(env: &Env, out3: &Path, in4: &Path, args: &[&str]) -> common::Out {
    let mut full = vec![
        "-c",
        "exec 3>>\"$1\" 4<\"$2\"; shift 2; exec \"$@\"",
        "sh",
        out3.to_str().unwrap(),
        in4.to_str().unwrap(),
        common::RUNC,
        "--root",
        env.root.to_str().unwrap(),
    ];
    full.extend_from_slice(args);
    common::run("sh", &full, Some(&env.bundle))
}

#[test]
fn preserve_fds_and_exec_cap() {
    if !ready("preserve_fds_and_exec_cap") {
        return;
    }
    // The program writes to descriptor 3, reads descriptor 4, and names any
    // descriptor from 5 to 9 it has (none may leak).
    let env = Env::new(&[
        "sh",
        "-c",
        "echo through-3 >&3; cat <&4; for i in 3 4 5 6 7 8 9; do [ -e /proc/$$/fd/$i ] && echo has-$i; done; true",
    ]);
    let out3 = env.tmp().join("out3");
    let in4 = env.tmp().join("in4");
    std::fs::write(&in4, "from-4\n").unwrap();
    let bundle = env.bundle.to_str().unwrap().to_string();
    let out = runc_with_fds(
        &env,
        &out3,
        &in4,
        &["run", "--preserve-fds", "2", "--bundle", &bundle, "p1"],
    )
    .ok();
    assert_eq!(out.stdout, "from-4\nhas-3\nhas-4\n", "{out}");
    assert_eq!(std::fs::read_to_string(&out3).unwrap(), "through-3\n");
    // Without --preserve-fds the runtime's descriptors stay out.
    let out = runc_with_fds(&env, &out3, &in4, &["run", "--bundle", &bundle, "p2"]);
    assert!(!out.stdout.contains("has-"), "{out}");
    assert!(!out.stdout.contains("from-4"), "{out}");
    assert_eq!(std::fs::read_to_string(&out3).unwrap(), "through-3\n");
    // More than are open: refused before anything is made.
    runc_with_fds(
        &env,
        &out3,
        &in4,
        &["run", "--preserve-fds", "3", "--bundle", &bundle, "p3"],
    )
    .fails_with("--preserve-fds 3: descriptor 5 is not open");
    env.runc(&["state", "p3"]).fails_with("does not exist");

    // exec --preserve-fds and --cap in a running container.
    env.edit(|c| c["process"]["args"] = json!(["sleep", "1000"]));
    env.runc(&["run", "-d", "--bundle", &bundle, "e1"]).ok();
    runc_with_fds(
        &env,
        &out3,
        &in4,
        &[
            "exec",
            "--preserve-fds",
            "1",
            "e1",
            "sh",
            "-c",
            "echo via-exec >&3; [ -e /proc/$$/fd/4 ] && echo has-4; true",
        ],
    )
    .ok();
    assert_eq!(
        std::fs::read_to_string(&out3).unwrap(),
        "through-3\nvia-exec\n"
    );
    let caps = |extra: &[&str]| -> (u64, u64, u64) {
        let mut args = vec!["exec"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["e1", "cat", "/proc/self/status"]);
        let out = env.runc(&args).ok();
        let field = |k: &str| {
            let v = out
                .stdout
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .unwrap_or_else(|| panic!("no {k} in {out}"));
            u64::from_str_radix(v.trim(), 16).unwrap()
        };
        (field("CapBnd:"), field("CapEff:"), field("CapPrm:"))
    };
    let sys_admin = 1u64 << 21;
    let net_admin = 1u64 << 12;
    let (bnd, eff, prm) = caps(&[]);
    assert_eq!((bnd | eff | prm) & (sys_admin | net_admin), 0);
    let (bnd2, eff2, prm2) = caps(&["--cap", "CAP_SYS_ADMIN", "--cap", "net_admin"]);
    for (before, after) in [(bnd, bnd2), (eff, eff2), (prm, prm2)] {
        assert_eq!(after, before | sys_admin | net_admin);
    }
    env.runc(&["exec", "--cap", "CAP_NOPE", "e1", "true"])
        .fails_with("exec --cap CAP_NOPE");
}

#[test]
fn device_cgroup_rules_of_the_config_are_enforced() {
    if !ready("device_cgroup_rules_of_the_config_are_enforced") {
        return;
    }
    // /dev/net/tun (c 10:200) is made inside (in the /dev tmpfs) with mknod (allowed: `m` of
    // every device), then opened: the device cgroup decides. Opened, tun
    // answers a read with EBADFD ("File descriptor in bad state").
    let script = "busybox mknod /dev/tun c 10 200 2>&1; cat /dev/tun 2>&1; cat /dev/null && echo null-ok; true";
    let caps = json!(["CAP_MKNOD", "CAP_AUDIT_WRITE", "CAP_KILL"]);
    let env = Env::new(&["true"]);
    let with_rules = |rules: Value| {
        let caps = caps.clone();
        inside(&env, script, move |c| {
            for set in [
                "bounding",
                "effective",
                "permitted",
                "inheritable",
                "ambient",
            ] {
                c["process"]["capabilities"][set] = caps.clone();
            }
            c["linux"]["resources"]["devices"] = rules;
        })
    };
    // Every device denied but the standard ones: tun cannot be opened.
    let out = with_rules(json!([{"allow": false, "access": "rwm"}]));
    assert!(out.contains("Operation not permitted"), "{out}");
    assert!(out.contains("null-ok"), "{out}");
    // Allowed by the config: it opens.
    let out = with_rules(json!([
        {"allow": false, "access": "rwm"},
        {"allow": true, "type": "c", "major": 10, "minor": 200, "access": "rw"}
    ]));
    assert!(out.contains("bad state"), "{out}");
    assert!(!out.contains("Operation not permitted"), "{out}");
    // Allowed for mknod only: not opened.
    let out = with_rules(json!([
        {"allow": false, "access": "rwm"},
        {"allow": true, "type": "c", "major": 10, "minor": 200, "access": "m"}
    ]));
    assert!(out.contains("Operation not permitted"), "{out}");
    // A bad rule: refused, nothing made.
    env.edit(|c| {
        c["linux"]["resources"]["devices"] = json!([{"allow": true, "type": "c", "access": "rwx"}])
    });
    env.run("bad")
        .fails_with("linux.resources.devices[0]: access \"rwx\" must be made of r, w and m");
    env.runc(&["state", "bad"]).fails_with("does not exist");
}
