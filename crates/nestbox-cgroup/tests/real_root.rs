//! Tests against the real cgroup filesystem of the machine. They need root
//! and are skipped (with a printed reason) otherwise; under `CI=true` a skip
//! is a failure (`nestbox_testkit`). Box ids contain the
//! test process's pid so parallel runs do not collide, and every test cleans
//! up even when it fails.

use std::fs;
use std::path::Path;
use std::process::{Child, Command};

use nestbox_cgroup::{find_stale, BoxCgroup, CgroupError, Hierarchies, Limits, Version};

/// The detected hierarchies, or `None` (with a printed reason; a failure
/// under CI) when `test` cannot run here.
fn setup(test: &str) -> Option<Hierarchies> {
    if !nestbox_testkit::require_root(test) {
        return None;
    }
    match Hierarchies::detect() {
        Ok(h) => {
            eprintln!("cgroups: {}", h.summary());
            Some(h)
        }
        Err(e) => {
            nestbox_testkit::skip(test, &format!("no usable cgroups: {e}"));
            None
        }
    }
}

fn id(name: &str) -> String {
    format!("t{}-{name}", std::process::id())
}

/// Kills the child and removes the box when the test ends, however it ends.
struct Cleanup {
    cg: Option<BoxCgroup>,
    child: Option<Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(c) = &mut self.child {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(cg) = &self.cg {
            let _ = cg.thaw();
            let _ = cg.kill_all();
            let _ = cg.remove();
        }
    }
}

fn read(p: &Path) -> String {
    fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
        .trim()
        .to_string()
}

#[test]
fn real_lifecycle() {
    let Some(h) = setup("real_lifecycle") else {
        return;
    };
    let limits = Limits {
        memory: Some(64 << 20),
        pids: Some(10),
        cpus: Some(0.5),
        cpu_shares: Some(512),
        ..Default::default()
    };
    let cg = BoxCgroup::create(&h, &id("life"), &limits).unwrap();
    let mut guard = Cleanup {
        cg: Some(cg.clone()),
        child: None,
    };
    for w in cg.warnings() {
        eprintln!("warning: {w}");
    }
    // Every box dir sits under the invoking process's cgroup.
    for d in cg.dirs() {
        let parent = d.path.parent().unwrap();
        assert!(
            h.hierarchies().iter().any(|hi| hi.invoking_dir() == parent),
            "{} is not under an invoking cgroup",
            d.path.display()
        );
    }
    let p = cg.paths();
    let v2 = cg.dirs().iter().find(|d| d.version == Version::V2);
    let mem_v1 = cg
        .dirs()
        .iter()
        .any(|d| d.version == Version::V1 && d.controllers.iter().any(|c| c == "memory"));
    if mem_v1 {
        assert_eq!(read(&p["memory"].join("memory.limit_in_bytes")), "67108864");
    } else {
        assert_eq!(read(&p["memory"].join("memory.max")), "67108864");
    }
    assert_eq!(read(&p["pids"].join("pids.max")), "10");
    if p["cpu"].join("cpu.cfs_quota_us").exists() {
        assert_eq!(read(&p["cpu"].join("cpu.cfs_quota_us")), "50000");
        assert_eq!(read(&p["cpu"].join("cpu.cfs_period_us")), "100000");
        assert_eq!(read(&p["cpu"].join("cpu.shares")), "512");
    } else {
        assert_eq!(read(&p["cpu"].join("cpu.max")), "50000 100000");
        assert_eq!(read(&p["cpu"].join("cpu.weight")), "20");
    }

    // A child process joins the box.
    let child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id() as i32;
    guard.child = Some(child);
    cg.add_process(pid).unwrap();
    assert_eq!(cg.procs().unwrap(), vec![pid]);
    let own = fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(own.contains(&format!("nestbox-{}", id("life"))), "{own}");
    let stats = cg.stats().unwrap();
    eprintln!("stats: {stats:?}");
    assert_eq!(stats.pids_current, 1);
    assert_eq!(stats.oom_kills, 0);
    assert_eq!(cg.oom_kills().unwrap(), 0);

    // Freeze and thaw.
    cg.freeze().unwrap();
    match p.get("freezer") {
        Some(f) if !(v2.is_some() && *f == v2.unwrap().path) => {
            assert_eq!(read(&f.join("freezer.state")), "FROZEN")
        }
        _ => assert!(read(&p["unified"].join("cgroup.events")).contains("frozen 1")),
    }
    cg.thaw().unwrap();

    // Kill everything; the child is gone from the box and dies of SIGKILL.
    cg.kill_all().unwrap();
    assert!(cg.procs().unwrap().is_empty());
    let status = guard.child.take().unwrap().wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(9));

    // Re-open from JSON and remove; twice is fine.
    let saved: BoxCgroup = serde_json::from_str(&serde_json::to_string(&cg).unwrap()).unwrap();
    saved.remove().unwrap();
    saved.remove().unwrap();
    for d in cg.dirs() {
        assert!(!d.path.exists(), "{} still exists", d.path.display());
    }
    guard.cg = None;
}

#[test]
fn real_cpuset_devices_io_swap() {
    let Some(h) = setup("real_cpuset_devices_io_swap") else {
        return;
    };
    let memsw = h.find("memory").is_some_and(|m| {
        m.version() == Version::V1
            && m.invoking_dir()
                .join("memory.memsw.limit_in_bytes")
                .exists()
    });
    let limits = Limits {
        cpuset_cpus: Some("0".into()),
        memory: Some(32 << 20),
        memory_swap: memsw.then_some(64 << 20),
        ..Default::default()
    };
    let cg = BoxCgroup::create(&h, &id("cpuset"), &limits).unwrap();
    let mut guard = Cleanup {
        cg: Some(cg.clone()),
        child: None,
    };
    let p = cg.paths();
    assert_eq!(read(&p["cpuset"].join("cpuset.cpus")), "0");
    if let Some(d) = cg
        .dirs()
        .iter()
        .find(|d| d.version == Version::V1 && d.controllers.iter().any(|c| c == "cpuset"))
    {
        assert!(!read(&d.path.join("cpuset.mems")).is_empty());
    }
    if memsw {
        assert_eq!(
            read(&p["memory"].join("memory.memsw.limit_in_bytes")),
            "67108864"
        );
    }
    if let Some(dev) = p.get("devices") {
        let list = read(&dev.join("devices.list"));
        let mut got: Vec<&str> = list.lines().collect();
        got.sort_unstable();
        let mut want = nestbox_cgroup::DEFAULT_DEVICE_RULES.to_vec();
        want.sort_unstable();
        assert_eq!(got, want);
    }
    // Joining works because the cpuset was initialised.
    let child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id() as i32;
    guard.child = Some(child);
    cg.add_process(pid).unwrap();
    assert_eq!(cg.procs().unwrap(), vec![pid]);
    cg.kill_all().unwrap();
    cg.remove().unwrap();
    assert!(!cg.exists());
}

#[test]
fn real_io_weight() {
    let Some(h) = setup("real_io_weight") else {
        return;
    };
    let limits = Limits {
        io_weight: Some(300),
        ..Default::default()
    };
    let name = id("io");
    match BoxCgroup::create(&h, &name, &limits) {
        Ok(cg) => {
            let _guard = Cleanup {
                cg: Some(cg.clone()),
                child: None,
            };
            let p = cg.paths();
            let dir = p.get("blkio").or_else(|| p.get("io")).unwrap();
            let written = [
                "blkio.weight",
                "blkio.bfq.weight",
                "io.weight",
                "io.bfq.weight",
            ]
            .iter()
            .map(|f| dir.join(f))
            .find(|f| f.exists())
            .unwrap();
            assert!(read(&written).ends_with("300"), "{}", written.display());
        }
        Err(e @ (CgroupError::Unsupported { .. } | CgroupError::ControllerUnavailable { .. })) => {
            eprintln!("io weight not supported here: {e}");
            for hi in h.hierarchies() {
                assert!(!hi.invoking_dir().join(format!("nestbox-{name}")).exists());
            }
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn real_rollback_on_kernel_rejection() {
    let Some(h) = setup("real_rollback_on_kernel_rejection") else {
        return;
    };
    // The kernel rejects pids.max above PID_MAX_LIMIT with EINVAL, after the
    // other hierarchies' dirs were made.
    let name = id("rollback");
    let e = BoxCgroup::create(
        &h,
        &name,
        &Limits {
            memory: Some(16 << 20),
            pids: Some(1 << 40),
            ..Default::default()
        },
    )
    .unwrap_err();
    eprintln!("{e}");
    assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    assert!(
        e.to_string().contains("pids.max = \"1099511627776\""),
        "{e}"
    );
    for hi in h.hierarchies() {
        let d = hi.invoking_dir().join(format!("nestbox-{name}"));
        assert!(!d.exists(), "{} left behind", d.display());
    }
}

#[test]
fn real_find_stale() {
    let Some(h) = setup("real_find_stale") else {
        return;
    };
    let name = id("stale");
    let cg = BoxCgroup::create(&h, &name, &Limits::default()).unwrap();
    let _guard = Cleanup {
        cg: Some(cg.clone()),
        child: None,
    };
    // Only look at our own box: other tests' boxes may exist concurrently.
    let stale = find_stale(&h, &|i| i != name);
    assert_eq!(stale.len(), 1);
    assert_eq!(stale[0].paths(), cg.paths());
    stale[0].kill_all().unwrap();
    stale[0].remove().unwrap();
    assert!(!cg.exists());
    assert!(find_stale(&h, &|i| i != name).is_empty());
}

/// A device program on a real cgroup v2 directory (the kernel's device
/// control of v2, which pure-v2 hosts use for a box's device rules) allows
/// and denies exactly what the rules say, seen from a process in it.
#[test]
fn a_device_program_on_a_v2_cgroup_enforces_the_rules() {
    let test = "a_device_program_on_a_v2_cgroup_enforces_the_rules";
    let Some(h) = setup(test) else {
        return;
    };
    let Some(v2) = h.hierarchies().iter().find(|x| x.version() == Version::V2) else {
        nestbox_testkit::skip(test, "no cgroup v2 hierarchy is mounted");
        return;
    };
    // Not named like a box: the leak checks look for those.
    let dir = v2
        .invoking_dir()
        .join(format!("devprog-test-{}", std::process::id()));
    fs::create_dir(&dir).unwrap();
    struct Remove(std::path::PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = fs::remove_dir(&self.0);
        }
    }
    let _remove = Remove(dir.clone());
    let rule = nestbox_cgroup::DeviceRule::new;
    // Everything, but /dev/null (c 1:3) only for reading.
    nestbox_cgroup::devfilter::attach(
        &dir,
        &[
            rule(true, 'a', None, None, "rwm"),
            rule(false, 'c', Some(1), Some(3), "rwm"),
            rule(true, 'c', Some(1), Some(3), "r"),
        ],
    )
    .unwrap();
    // The shell moves itself into the directory, then opens devices.
    let script = format!(
        "echo 0 > {procs} || exit 9\n\
         if head -c 1 /dev/zero | od -An -tx1 | grep -q 00; then echo zero-read; fi\n\
         if cat /dev/null; then echo null-read; fi\n\
         if ( : > /dev/null ) 2>/dev/null; then echo null-write; else echo null-write-denied; fi",
        procs = dir.join("cgroup.procs").display()
    );
    let out = Command::new("sh").args(["-c", &script]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "zero-read\nnull-read\nnull-write-denied\n",
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
