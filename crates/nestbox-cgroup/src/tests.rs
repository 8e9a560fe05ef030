//! Unit tests of box cgroups on fake cgroup trees (v1, v2 and this machine's
//! hybrid layout): created files and their exact contents, rollback, stats,
//! freezing, killing, removal and stale-cgroup discovery.

use std::fs;
use std::path::Path;
use std::time::Duration;

use crate::testfs::{self, read};
use crate::*;

fn full_limits() -> Limits {
    Limits {
        memory: Some(64 << 20),
        memory_reserve: Some(16 << 20),
        memory_swap: Some(128 << 20),
        pids: Some(10),
        cpus: Some(0.5),
        cpu_shares: Some(512),
        cpuset_cpus: Some("0-1".into()),
        io_weight: Some(500),
        cpu_reserve: None,
        cpu_period_us: None,
        memory_swappiness: None,
        oom_kill_disable: false,
        io_devices: Vec::new(),
        net_class_id: None,
        net_priorities: Vec::new(),
        hugepage_limits: Vec::new(),
    }
}

#[test]
fn per_device_io_limits_on_v1_and_v2() {
    let limits = Limits {
        io_devices: vec![IoDeviceLimit {
            major: 7,
            minor: 0,
            read_bps: Some(1024),
            write_iops: Some(50),
            ..IoDeviceLimit::default()
        }],
        ..Limits::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let cg = BoxCgroup::create(&h, "io-1", &limits).unwrap();
    let p = cg.paths();
    assert_eq!(
        read(p["blkio"].join("blkio.throttle.read_bps_device")),
        "7:0 1024"
    );
    assert_eq!(
        read(p["blkio"].join("blkio.throttle.write_iops_device")),
        "7:0 50"
    );
    cg.remove().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let cg = BoxCgroup::create(&h, "io-2", &limits).unwrap();
    let dir = tmp.path().join(testfs::V2_REL).join("nestbox-io-2");
    assert_eq!(read(dir.join("io.max")), "7:0 rbps=1024 wiops=50");
    cg.remove().unwrap();
    // A per-device weight where the kernel has no per-device weight file.
    let weighted = Limits {
        io_devices: vec![IoDeviceLimit {
            major: 7,
            minor: 0,
            weight: Some(100),
            ..IoDeviceLimit::default()
        }],
        ..Limits::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let e = BoxCgroup::create(&h, "io-3", &weighted)
        .unwrap_err()
        .to_string();
    assert!(e.contains("no per-device weight file"), "{e}");
    assert_no_box_dirs(&h, "io-3");
}

#[test]
fn network_class_and_priorities_on_v1_only_when_asked() {
    let limits = Limits {
        net_class_id: Some(0x10001),
        net_priorities: vec![NetPriority {
            interface: "eth0".into(),
            priority: 5,
        }],
        ..Limits::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let cg = BoxCgroup::create(&h, "net-1", &limits).unwrap();
    let p = cg.paths();
    assert_eq!(read(p["net_cls"].join("net_cls.classid")), "65537");
    assert_eq!(read(p["net_prio"].join("net_prio.ifpriomap")), "eth0 5");
    cg.remove().unwrap();
    // Without them, no net_cls/net_prio cgroup is made.
    let cg = BoxCgroup::create(&h, "net-2", &Limits::default()).unwrap();
    assert!(!cg.paths().contains_key("net_cls"));
    cg.remove().unwrap();
    // No v1 net_cls hierarchy, and v2 has none: refused, nothing made.
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let e = BoxCgroup::create(&h, "net-3", &limits)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("net_class_id requested but the net_cls controller is not usable"),
        "{e}"
    );
    assert_no_box_dirs(&h, "net-3");
    let e = Limits {
        net_priorities: vec![NetPriority {
            interface: "a b".into(),
            priority: 1,
        }],
        ..Limits::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("is not an interface name"), "{e}");
}

#[test]
fn swappiness_and_oom_kill_disable_on_v1_refused_on_v2() {
    let limits = Limits {
        memory: Some(1 << 20),
        memory_swappiness: Some(17),
        oom_kill_disable: true,
        ..Limits::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let cg = BoxCgroup::create(&h, "swp-1", &limits).unwrap();
    let p = cg.paths();
    assert_eq!(read(p["memory"].join("memory.swappiness")), "17");
    assert_eq!(read(p["memory"].join("memory.oom_control")), "1");
    cg.remove().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let e = BoxCgroup::create(&h, "swp-2", &limits)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("memory_swappiness") && e.contains("no per-cgroup swappiness"),
        "{e}"
    );
    assert_no_box_dirs(&h, "swp-2");
    let e = Limits {
        memory_swappiness: Some(101),
        ..Limits::default()
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("invalid memory_swappiness=101: must be in 0..=100"),
        "{e}"
    );
}

fn assert_no_box_dirs(h: &Hierarchies, id: &str) {
    for hi in h.hierarchies() {
        let d = hi.invoking_dir().join(dir_name(id));
        assert!(!d.exists(), "{} left behind", d.display());
    }
}

#[test]
fn create_v1_writes_exact_files() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let cg = BoxCgroup::create(&h, "abc-1", &full_limits()).unwrap();
    assert!(cg.warnings().is_empty(), "{:?}", cg.warnings());
    let p = cg.paths();
    let base = tmp.path().join("sys/fs/cgroup");
    assert_eq!(p["cpu"], base.join("cpu,cpuacct/docker/abc/nestbox-abc-1"));
    assert_eq!(p["cpuacct"], p["cpu"]);
    assert_eq!(p["memory"], base.join("memory/nestbox-abc-1"));
    assert!(!p.contains_key("unified"));
    assert!(!p.contains_key("net_cls"));
    assert_eq!(
        p.keys().cloned().collect::<Vec<_>>(),
        ["blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer", "memory", "pids"]
    );
    // One dir per hierarchy: cpu,cpuacct is a single one.
    assert_eq!(cg.dirs().len(), 7);
    assert_eq!(read(p["memory"].join("memory.limit_in_bytes")), "67108864");
    assert_eq!(
        read(p["memory"].join("memory.soft_limit_in_bytes")),
        "16777216"
    );
    assert_eq!(
        read(p["memory"].join("memory.memsw.limit_in_bytes")),
        "134217728"
    );
    assert_eq!(read(p["cpu"].join("cpu.cfs_period_us")), "100000");
    assert_eq!(read(p["cpu"].join("cpu.cfs_quota_us")), "50000");
    assert_eq!(read(p["cpu"].join("cpu.shares")), "512");
    assert_eq!(read(p["pids"].join("pids.max")), "10");
    assert_eq!(read(p["cpuset"].join("cpuset.cpus")), "0-1");
    assert_eq!(read(p["cpuset"].join("cpuset.mems")), "0");
    assert_eq!(read(p["blkio"].join("blkio.bfq.weight")), "500");
    assert_eq!(read(p["devices"].join("devices.deny")), "a");
    // Rules are written one at a time; the fake file keeps the last one.
    assert_eq!(read(p["devices"].join("devices.allow")), "b *:* m");
    // Untouched files stay as the "kernel" made them.
    assert_eq!(read(p["freezer"].join("freezer.state")), "");

    // Already exists → error, and the existing dirs are left alone.
    let e = BoxCgroup::create(&h, "abc-1", &Limits::default()).unwrap_err();
    assert!(matches!(e, CgroupError::AlreadyExists { .. }), "{e}");
    assert!(p["memory"].exists());

    cg.remove().unwrap();
    assert!(!cg.exists());
    assert_no_box_dirs(&h, "abc-1");
    cg.remove().unwrap();
}

#[test]
fn v1_cpuset_only_with_a_cpu_list_and_mems_copied_from_parent() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    // No CPU list: the box stays in the caller's cpuset (no directory).
    let cg = BoxCgroup::create(&h, "c", &Limits::default()).unwrap();
    let p = cg.paths();
    assert!(!p.contains_key("cpuset"), "{p:?}");
    assert!(!h
        .find("cpuset")
        .unwrap()
        .invoking_dir()
        .join("nestbox-c")
        .exists());
    // No limits → limit files untouched.
    assert_eq!(read(p["memory"].join("memory.limit_in_bytes")), "");
    assert_eq!(read(p["pids"].join("pids.max")), "");
    cg.remove().unwrap();

    let limits = Limits {
        cpuset_cpus: Some("1-2".into()),
        ..Default::default()
    };
    let cg = BoxCgroup::create(&h, "d", &limits).unwrap();
    let p = cg.paths();
    assert_eq!(read(p["cpuset"].join("cpuset.cpus")), "1-2");
    assert_eq!(read(p["cpuset"].join("cpuset.mems")), "0");
    cg.remove().unwrap();
}

#[test]
fn create_hybrid_layout_of_this_machine() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let limits = Limits {
        memory: Some(1 << 20),
        cpus: Some(1.0),
        ..Default::default()
    };
    let cg = BoxCgroup::create(&h, "h1", &limits).unwrap();
    let p = cg.paths();
    // Everything is v1 here; the v2 hierarchy only has hugetlb: no v2 dir.
    assert!(cg.dirs().iter().all(|d| d.version == Version::V1));
    // All eight v1 hierarchies but cpuset (no CPU list).
    assert_eq!(cg.dirs().len(), 7);
    assert!(!tmp.path().join("sys/fs/cgroup/unified/nestbox-h1").exists());
    assert_eq!(
        p["memory"],
        tmp.path()
            .join("sys/fs/cgroup/memory/process_api/8a4fc6f47409c39973b09d59b9138c45/nestbox-h1")
    );
    assert_eq!(p["cpu"], tmp.path().join("sys/fs/cgroup/cpu/nestbox-h1"));
    assert_ne!(p["cpu"], p["cpuacct"]);
    assert_eq!(read(p["memory"].join("memory.limit_in_bytes")), "1048576");
    assert_eq!(read(p["cpu"].join("cpu.cfs_quota_us")), "100000");
    cg.remove().unwrap();
    assert_no_box_dirs(&h, "h1");
}

#[test]
fn create_v2_writes_exact_files() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let cg = BoxCgroup::create(&h, "v2box", &full_limits()).unwrap();
    assert!(cg.warnings().is_empty(), "{:?}", cg.warnings());
    let parent = tmp.path().join(testfs::V2_REL);
    let dir = parent.join("nestbox-v2box");
    assert_eq!(
        read(parent.join("cgroup.subtree_control")),
        "+cpu +cpuset +io +memory +pids"
    );
    assert_eq!(cg.dirs().len(), 1);
    assert_eq!(cg.dirs()[0].version, Version::V2);
    let p = cg.paths();
    assert_eq!(
        p.keys().cloned().collect::<Vec<_>>(),
        ["cpu", "cpuset", "io", "memory", "pids", "unified"]
    );
    assert!(p.values().all(|v| *v == dir));
    assert_eq!(read(dir.join("memory.max")), "67108864");
    assert_eq!(read(dir.join("memory.low")), "16777216");
    assert_eq!(read(dir.join("memory.swap.max")), "67108864");
    assert_eq!(read(dir.join("cpu.max")), "50000 100000");
    assert_eq!(read(dir.join("cpu.weight")), "20");
    assert_eq!(read(dir.join("pids.max")), "10");
    assert_eq!(read(dir.join("cpuset.cpus")), "0-1");
    assert_eq!(read(dir.join("io.weight")), "default 500");
    cg.remove().unwrap();
    assert!(!dir.exists());
}

#[test]
fn v2_unlimited_swap_and_enabled_controllers_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let parent = tmp.path().join(testfs::V2_REL);
    fs::write(parent.join("cgroup.subtree_control"), "cpu memory\n").unwrap();
    let cg = BoxCgroup::create(
        &h,
        "s",
        &Limits {
            memory: Some(4096),
            memory_swap: Some(-1),
            ..Default::default()
        },
    )
    .unwrap();
    // Only the missing ones are enabled.
    assert_eq!(
        read(parent.join("cgroup.subtree_control")),
        "+cpuset +io +pids"
    );
    let dir = &cg.dirs()[0].path;
    assert_eq!(read(dir.join("memory.swap.max")), "max");
    assert_eq!(read(dir.join("memory.max")), "4096");
    cg.remove().unwrap();
}

#[test]
fn v2_unavailable_controller_warns_or_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let parent = tmp.path().join(testfs::V2_REL);
    fs::write(parent.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
    // Not requested → warnings.
    let cg = BoxCgroup::create(&h, "w", &Limits::default()).unwrap();
    assert_eq!(
        cg.warnings(),
        [
            CgroupWarning::ControllerUnavailable {
                controller: "cpuset".into()
            },
            CgroupWarning::ControllerUnavailable {
                controller: "io".into()
            },
        ]
    );
    assert_eq!(
        cg.paths().keys().cloned().collect::<Vec<_>>(),
        ["cpu", "memory", "pids", "unified"]
    );
    cg.remove().unwrap();
    // Requested → error, nothing made.
    let e = BoxCgroup::create(
        &h,
        "w",
        &Limits {
            io_weight: Some(100),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "cgroup: io_weight requested but the io controller is not usable: no cgroup v1 hierarchy carries it and it is not listed in {}",
            parent.join("cgroup.controllers").display()
        )
    );
    assert!(!parent.join("nestbox-w").exists());
}

/// Replaces `parent/cgroup.subtree_control` with a file that reads fine but
/// rejects every write (`/proc/version` fails writes with EIO).
fn unwritable_subtree_control(parent: &Path) {
    let sc = parent.join("cgroup.subtree_control");
    let _ = fs::remove_file(&sc);
    std::os::unix::fs::symlink("/proc/version", sc).unwrap();
}

#[test]
fn v2_enable_failure_is_error_only_when_requested() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let parent = tmp.path().join(testfs::V2_REL);
    unwritable_subtree_control(&parent);
    // Requested → error naming the file, the value and the rule; nothing made.
    let e = BoxCgroup::create(
        &h,
        "e",
        &Limits {
            pids: Some(5),
            ..Default::default()
        },
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("cgroup.subtree_control = \"+pids\": "),
        "{msg}"
    );
    assert!(msg.contains("no internal processes"), "{msg}");
    assert!(!parent.join("nestbox-e").exists());
    // Not requested → typed warnings; the box is still made (freezer, stats).
    let cg = BoxCgroup::create(&h, "e", &Limits::default()).unwrap();
    let names: Vec<&str> = cg
        .warnings()
        .iter()
        .map(|w| match w {
            CgroupWarning::ControllerNotEnabled { controller, .. } => controller.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(names, ["cpu", "cpuset", "io", "memory", "pids"]);
    assert_eq!(cg.dirs()[0].controllers, Vec::<String>::new());
    assert_eq!(cg.paths().keys().cloned().collect::<Vec<_>>(), ["unified"]);
    cg.remove().unwrap();
}

#[test]
fn enable_controllers_mixed_required_and_optional() {
    let tmp = tempfile::tempdir().unwrap();
    unwritable_subtree_control(tmp.path());
    let mut warnings = Vec::new();
    let required = ["memory"].into_iter().collect();
    let e = crate::v2::enable_controllers(tmp.path(), &["cpu", "memory"], &required, &mut warnings)
        .unwrap_err();
    assert!(e.to_string().contains("= \"+memory\": I/O error"), "{e}");
    assert!(matches!(
        &warnings[..],
        [CgroupWarning::ControllerNotEnabled { controller, .. }] if controller == "cpu"
    ));
}

#[test]
fn rollback_removes_every_dir_made() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    // pids is the last hierarchy: every other dir is made before it fails.
    let pids_parent = h.find("pids").unwrap().invoking_dir().to_path_buf();
    fs::remove_file(pids_parent.join("pids.max")).unwrap();
    let limits = Limits {
        memory: Some(1 << 20),
        pids: Some(3),
        ..Default::default()
    };
    let e = BoxCgroup::create(&h, "rb", &limits).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert!(e.to_string().starts_with("cgroup: write "), "{e}");
    assert!(e.to_string().contains("pids.max = \"3\""), "{e}");
    assert_no_box_dirs(&h, "rb");

    // A directory in place of a control file.
    let h = testfs::hybrid(&tmp.path().join("hy"));
    let mem = h.find("memory").unwrap().invoking_dir().to_path_buf();
    fs::remove_file(mem.join("memory.limit_in_bytes")).unwrap();
    let e = BoxCgroup::create(&h, "rb", &limits).unwrap_err();
    assert!(e.is_not_found(), "{e}");
    assert_no_box_dirs(&h, "rb");
}

#[test]
fn v1_missing_swap_accounting_and_blkio_weight() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let mem = h.find("memory").unwrap().invoking_dir().to_path_buf();
    fs::remove_file(mem.join("memory.memsw.limit_in_bytes")).unwrap();
    let e = BoxCgroup::create(
        &h,
        "sw",
        &Limits {
            memory: Some(1 << 20),
            memory_swap: Some(2 << 20),
            ..Default::default()
        },
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("cgroup: memory_swap: the kernel has no swap accounting"),
        "{msg}"
    );
    assert!(
        msg.contains("memory.memsw.limit_in_bytes is missing"),
        "{msg}"
    );
    assert_no_box_dirs(&h, "sw");

    let blkio = h.find("blkio").unwrap().invoking_dir().to_path_buf();
    fs::remove_file(blkio.join("blkio.bfq.weight")).unwrap();
    let e = BoxCgroup::create(
        &h,
        "io",
        &Limits {
            io_weight: Some(300),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("the kernel's blkio controller offers no weight file"),
        "{e}"
    );
    assert_no_box_dirs(&h, "io");

    // blkio.weight is preferred when present.
    fs::write(blkio.join("blkio.weight"), "500").unwrap();
    fs::write(blkio.join("blkio.bfq.weight"), "100").unwrap();
    let cg = BoxCgroup::create(
        &h,
        "io",
        &Limits {
            io_weight: Some(300),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(read(cg.paths()["blkio"].join("blkio.weight")), "300");
    assert_eq!(read(cg.paths()["blkio"].join("blkio.bfq.weight")), "");
    cg.remove().unwrap();
}

#[test]
fn invalid_input_creates_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    for id in ["", "UPPER", "a/b", "a_b", "..", &"x".repeat(129)] {
        let e = BoxCgroup::create(&h, id, &Limits::default()).unwrap_err();
        assert!(matches!(e, CgroupError::InvalidId { .. }), "{id}: {e}");
    }
    let e = BoxCgroup::create(
        &h,
        "ok",
        &Limits {
            cpuset_cpus: Some("7".into()),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("not in the parent's cpuset \"0-3\""),
        "{e}"
    );
    let e = BoxCgroup::create(
        &h,
        "ok",
        &Limits {
            pids: Some(0),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "cgroup: invalid pids=0: must be >= 1");
    assert_no_box_dirs(&h, "ok");
}

#[test]
fn v1_missing_controller_is_error_when_requested() {
    let tmp = tempfile::tempdir().unwrap();
    // Only memory is mounted, no cgroup2.
    let mi = "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";
    let h = Hierarchies::from_proc_text(mi, "4:memory:/\n", tmp.path()).unwrap();
    fs::create_dir_all(h.find("memory").unwrap().invoking_dir()).unwrap();
    let e = BoxCgroup::create(
        &h,
        "m",
        &Limits {
            pids: Some(4),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cgroup: pids requested but the pids controller is not usable: no cgroup v1 hierarchy carries it and cgroup v2 is not mounted"
    );
    let cg = BoxCgroup::create(&h, "m", &Limits::default()).unwrap();
    assert!(cg
        .warnings()
        .contains(&CgroupWarning::ControllerUnavailable {
            controller: "freezer".into()
        }));
    assert!(matches!(
        cg.freeze().unwrap_err(),
        CgroupError::NoController { what: "freezer" }
    ));
    cg.remove().unwrap();
}

#[test]
fn json_roundtrip_reopens() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let cg = BoxCgroup::create(&h, "j", &Limits::default()).unwrap();
    let json = serde_json::to_string(&cg).unwrap();
    assert!(json.contains("\"version\":\"v1\""), "{json}");
    let back: BoxCgroup = serde_json::from_str(&json).unwrap();
    assert_eq!(back, cg);
    assert_eq!(back.paths(), cg.paths());
    back.remove().unwrap();
    assert!(!cg.exists());
}

#[test]
fn add_process_and_procs() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(&h, "p", &Limits::default()).unwrap();
    cg.add_process(424_242).unwrap();
    for d in cg.dirs() {
        assert_eq!(read(d.path.join("cgroup.procs")), "424242");
    }
    // One dir with a different list: the union is returned.
    fs::write(cg.paths()["pids"].join("cgroup.procs"), "7\n424242\n").unwrap();
    assert_eq!(cg.procs().unwrap(), vec![7, 424_242]);
    assert!(matches!(
        cg.add_process(0).unwrap_err(),
        CgroupError::InvalidPid { pid: 0 }
    ));
    fs::write(cg.paths()["pids"].join("cgroup.procs"), "x\n").unwrap();
    assert!(matches!(cg.procs().unwrap_err(), CgroupError::Parse { .. }));
    cg.remove().unwrap();
    assert_eq!(cg.procs().unwrap(), Vec::<i32>::new());
}

#[test]
fn stats_v1() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(&h, "st", &Limits::default()).unwrap();
    let p = cg.paths();
    fs::write(p["cpuacct"].join("cpuacct.usage"), "123456789\n").unwrap();
    fs::write(p["memory"].join("memory.usage_in_bytes"), "4096\n").unwrap();
    fs::write(p["memory"].join("memory.max_usage_in_bytes"), "8192\n").unwrap();
    fs::write(
        p["memory"].join("memory.oom_control"),
        "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
    )
    .unwrap();
    fs::write(p["pids"].join("pids.current"), "2\n").unwrap();
    assert_eq!(
        cg.stats().unwrap(),
        Stats {
            cpu_usage_ns: 123_456_789,
            memory_current: 4096,
            memory_peak: 8192,
            pids_current: 2,
            oom_kills: 3,
        }
    );
    // Older kernels: no oom_kill line.
    fs::write(
        p["memory"].join("memory.oom_control"),
        "oom_kill_disable 0\n",
    )
    .unwrap();
    assert_eq!(cg.oom_kills().unwrap(), 0);
    fs::write(p["pids"].join("pids.current"), "lots\n").unwrap();
    let e = cg.stats().unwrap_err().to_string();
    assert!(
        e.contains("pids.current: expected an unsigned number"),
        "{e}"
    );
    cg.remove().unwrap();
}

#[test]
fn stats_v2() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let cg = BoxCgroup::create(&h, "st", &Limits::default()).unwrap();
    let d = cg.paths()["unified"].clone();
    fs::write(d.join("cpu.stat"), "usage_usec 2500\nuser_usec 2000\n").unwrap();
    fs::write(d.join("memory.current"), "1000\n").unwrap();
    fs::write(d.join("memory.peak"), "5000\n").unwrap();
    fs::write(d.join("memory.events"), "low 0\nmax 4\noom 2\noom_kill 2\n").unwrap();
    fs::write(d.join("pids.current"), "1\n").unwrap();
    assert_eq!(
        cg.stats().unwrap(),
        Stats {
            cpu_usage_ns: 2_500_000,
            memory_current: 1000,
            memory_peak: 5000,
            pids_current: 1,
            oom_kills: 2,
        }
    );
    // No memory.peak on older kernels → current.
    fs::remove_file(d.join("memory.peak")).unwrap();
    assert_eq!(cg.stats().unwrap().memory_peak, 1000);
    cg.remove().unwrap();
}

#[test]
fn freeze_thaw_v1_and_v2() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(&h, "f", &Limits::default()).unwrap();
    cg.freeze().unwrap();
    assert_eq!(read(cg.paths()["freezer"].join("freezer.state")), "FROZEN");
    cg.thaw().unwrap();
    assert_eq!(read(cg.paths()["freezer"].join("freezer.state")), "THAWED");
    cg.remove().unwrap();

    let h = testfs::pure_v2(&tmp.path().join("v2"));
    let cg = BoxCgroup::create(&h, "f", &Limits::default()).unwrap();
    let d = cg.paths()["unified"].clone();
    fs::write(d.join("cgroup.events"), "populated 0\nfrozen 1\n").unwrap();
    cg.freeze().unwrap();
    assert_eq!(read(d.join("cgroup.freeze")), "1");
    fs::write(d.join("cgroup.events"), "populated 0\nfrozen 0\n").unwrap();
    cg.thaw().unwrap();
    assert_eq!(read(d.join("cgroup.freeze")), "0");
    // The "kernel" never confirms: timeout, and the freeze is undone.
    let e = cg
        .set_frozen(true, Duration::from_millis(50))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("timed out after 50ms waiting for \"frozen 1\""),
        "{e}"
    );
    assert_eq!(read(d.join("cgroup.freeze")), "0");
    cg.remove().unwrap();
}

#[test]
fn thawing_a_removed_cgroup_succeeds_and_freezing_it_fails() {
    let tmp = tempfile::tempdir().unwrap();
    for h in [
        testfs::hybrid(&tmp.path().join("hybrid")),
        testfs::pure_v2(&tmp.path().join("v2")),
    ] {
        let cg = BoxCgroup::create(&h, "gone", &Limits::default()).unwrap();
        cg.remove().unwrap();
        cg.set_frozen(false, Duration::from_millis(50))
            .expect("nothing of a removed cgroup is frozen");
        let e = cg.set_frozen(true, Duration::from_millis(50)).unwrap_err();
        assert!(e.is_not_found(), "{e}");
    }
}

#[test]
fn kill_all_on_fake_trees() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let cg = BoxCgroup::create(&h, "k", &Limits::default()).unwrap();
    cg.kill_all().unwrap();
    assert_eq!(read(cg.paths()["unified"].join("cgroup.kill")), "1");
    cg.remove().unwrap();

    let h = testfs::hybrid(&tmp.path().join("hy"));
    let cg = BoxCgroup::create(&h, "k", &Limits::default()).unwrap();
    cg.kill_all().unwrap();
    cg.remove().unwrap();
}

#[test]
fn find_stale_groups_by_id() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let live = BoxCgroup::create(&h, "live1", &Limits::default()).unwrap();
    let dead = BoxCgroup::create(&h, "dead1", &Limits::default()).unwrap();
    // A half-removed box: only in memory.
    let mem = h.find("memory").unwrap().invoking_dir().to_path_buf();
    fs::create_dir(mem.join("nestbox-dead2")).unwrap();
    // Not ours / not a valid id / a file.
    fs::create_dir(mem.join("other")).unwrap();
    fs::create_dir(mem.join("nestbox-BAD")).unwrap();
    fs::write(mem.join("nestbox-file"), "").unwrap();
    let stale = find_stale(&h, &|id| id == "live1");
    let ids: Vec<&str> = stale.iter().map(|b| b.id()).collect();
    assert_eq!(ids, ["dead1", "dead2"]);
    assert_eq!(stale[0].paths(), dead.paths());
    assert_eq!(stale[1].dirs().len(), 1);
    assert_eq!(stale[1].dirs()[0].controllers, ["memory"]);
    for s in &stale {
        s.kill_all().unwrap();
        s.remove().unwrap();
    }
    assert!(find_stale(&h, &|id| id == "live1").is_empty());
    assert!(live.exists());
    live.remove().unwrap();

    let h = testfs::pure_v2(&tmp.path().join("v2"));
    let cg = BoxCgroup::create(&h, "gone", &Limits::default()).unwrap();
    let stale = find_stale(&h, &|_| false);
    assert_eq!(stale.len(), 1);
    assert_eq!(stale[0].paths(), cg.paths());
    stale[0].remove().unwrap();
    assert!(!cg.exists());
}

#[test]
fn foreign_dirs_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let victim = tmp.path().join("precious");
    fs::create_dir(&victim).unwrap();
    fs::write(victim.join("cgroup.procs"), "1\n").unwrap();
    let json = format!(
        r#"{{"id":"x","dirs":[{{"version":"v1","controllers":["memory"],"path":{:?}}}]}}"#,
        victim
    );
    let cg: BoxCgroup = serde_json::from_str(&json).unwrap();
    let e = cg.remove().unwrap_err();
    assert!(matches!(e, CgroupError::NotBoxDir { .. }), "{e}");
    assert!(matches!(
        cg.kill_all().unwrap_err(),
        CgroupError::NotBoxDir { .. }
    ));
    assert!(victim.join("cgroup.procs").exists());
}

#[test]
fn remove_is_idempotent_and_ignores_missing() {
    let tmp = tempfile::tempdir().unwrap();
    let cg = BoxCgroup::from_dirs(
        "x",
        vec![CgroupDir {
            version: Version::V1,
            controllers: vec!["memory".into()],
            path: tmp.path().join("nope/nestbox-x"),
        }],
    )
    .unwrap();
    cg.remove().unwrap();
    assert!(!Path::new(&tmp.path().join("nope")).exists());
}

#[test]
fn prepare_makes_nothing_and_knows_the_join_files() {
    let tmp = tempfile::tempdir().unwrap();
    for (label, h) in [
        ("v2", testfs::pure_v2(&tmp.path().join("v2"))),
        ("hybrid", testfs::hybrid(&tmp.path().join("hy"))),
    ] {
        let pending = BoxCgroup::prepare(&h, "p", &Limits::default()).unwrap();
        let files = pending.self_join_files();
        assert!(!files.is_empty(), "{label}");
        for f in &files {
            assert!(!f.parent().unwrap().exists(), "{label}: {f:?} made early");
        }
        // A second box of the same id is refused only once the first exists.
        let again = BoxCgroup::prepare(&h, "p", &Limits::default()).unwrap();
        let cg = pending.create().unwrap();
        assert_eq!(cg.self_join_files(), files, "{label}");
        assert!(
            files.iter().all(|f| f.parent().unwrap().is_dir()),
            "{label}"
        );
        // Made meanwhile by the first: the second fails and removes nothing.
        assert!(again.create().is_err(), "{label}");
        assert!(
            files.iter().all(|f| f.parent().unwrap().is_dir()),
            "{label}"
        );
        assert!(matches!(
            BoxCgroup::prepare(&h, "p", &Limits::default()),
            Err(CgroupError::AlreadyExists { .. })
        ));
        cg.remove().unwrap();
    }
}

/// The reservation recorded on a fake cgroup directory, and the parent's marker.
fn reservation(dir: &Path) -> Option<String> {
    nestbox_sys::xattr::get(dir, crate::reserve::XATTR)
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap())
}

fn marked(dir: &Path) -> bool {
    nestbox_sys::xattr::get(dir, crate::reserve::MARKER)
        .unwrap()
        .is_some()
}

#[test]
fn v2_cpu_reservation_is_weighed_against_siblings_and_admitted() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let parent = tmp.path().join(testfs::V2_REL);
    let cpus = online_cpus() as f64;
    // Four heavy siblings first, then the reserved box.
    let heavy: Vec<BoxCgroup> = (0..4)
        .map(|i| {
            let limits = Limits {
                cpu_shares: Some(4096),
                ..Default::default()
            };
            BoxCgroup::create(&h, &format!("heavy{i}"), &limits).unwrap()
        })
        .collect();
    assert!(!marked(&parent));
    let limits = Limits {
        cpu_reserve: Some(0.5),
        ..Default::default()
    };
    let r = BoxCgroup::create(&h, "reserved", &limits).unwrap();
    let dir = parent.join("nestbox-reserved");
    assert_eq!(reservation(&dir).as_deref(), Some("0.5 100"));
    assert!(marked(&parent));
    let weight = |d: &Path| read(d.join("cpu.weight")).trim().parse::<f64>().unwrap();
    // Its share when every sibling and `cpus` parent processes are busy.
    let share = |extra: f64| {
        let others: f64 = (0..4)
            .map(|i| weight(&parent.join(format!("nestbox-heavy{i}"))))
            .sum::<f64>()
            + extra;
        weight(&dir) / (weight(&dir) + others + 100.0 * cpus) * cpus
    };
    assert!(share(0.0) >= 0.5, "share {}", share(0.0));
    // A new heavy sibling re-weighs it.
    let late = BoxCgroup::create(
        &h,
        "late",
        &Limits {
            cpu_shares: Some(8192),
            ..Default::default()
        },
    )
    .unwrap();
    let late_w = weight(&parent.join("nestbox-late"));
    assert!(share(late_w) >= 0.5, "share {}", share(late_w));
    // Over-commit is refused and leaves nothing.
    let too_much = Limits {
        cpu_reserve: Some(0.9 * cpus - 0.25),
        ..Default::default()
    };
    let e = BoxCgroup::create(&h, "greedy", &too_much).unwrap_err();
    assert!(
        e.to_string().contains(&format!(
            "already reserve 0.5 of {cpus} CPUs and at most {} may be reserved",
            (0.9 * cpus * 100.0).round() / 100.0
        )),
        "{e}"
    );
    assert!(!parent.join("nestbox-greedy").exists());
    // Removing the last reserved box drops the parent's marker.
    late.remove().unwrap();
    r.remove().unwrap();
    assert!(!marked(&parent));
    for cg in heavy {
        cg.remove().unwrap();
    }
}

#[test]
fn v1_cpu_reservation_with_its_own_shares_keeps_the_larger() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let limits = Limits {
        cpu_reserve: Some(0.25),
        cpu_shares: Some(100_000),
        ..Default::default()
    };
    let r = BoxCgroup::create(&h, "own", &limits).unwrap();
    let dir = r.paths()["cpu"].clone();
    assert_eq!(reservation(&dir).as_deref(), Some("0.25 100000"));
    assert_eq!(read(dir.join("cpu.shares")), "100000");
    r.remove().unwrap();
    assert!(!marked(dir.parent().unwrap()));
}

#[test]
fn prepare_at_puts_the_cgroup_at_the_path_given() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    // (The fake tree has control files only in the invoking cgroups and the
    // cpuset root, so the limit checked here is the cpuset's.)
    let limits = Limits {
        cpuset_cpus: Some("0".into()),
        ..Default::default()
    };
    let base = tmp.path().join("sys/fs/cgroup");
    // Absolute: from each hierarchy's mount point, parents made (the cpuset
    // ones initialised from theirs).
    let cg = BoxCgroup::prepare_at(&h, "p1", Path::new("/pods/a/ctr"), &limits)
        .unwrap()
        .create()
        .unwrap();
    let p = cg.paths();
    assert_eq!(p["memory"], base.join("memory/pods/a/ctr"));
    assert_eq!(p["cpu"], base.join("cpu/pods/a/ctr"));
    assert_eq!(read(base.join("cpuset/pods/a/cpuset.mems")), "0");
    assert_eq!(read(p["cpuset"].join("cpuset.cpus")), "0");
    // The record round-trips and removal takes the last directory only.
    let cg: BoxCgroup = serde_json::from_str(&serde_json::to_string(&cg).unwrap()).unwrap();
    cg.remove().unwrap();
    assert!(!base.join("memory/pods/a/ctr").exists());
    assert!(base.join("memory/pods/a").is_dir());
    // Relative: under the invoking process's cgroup.
    let cg = BoxCgroup::prepare_at(&h, "p2", Path::new("ctr2"), &Limits::default())
        .unwrap()
        .create()
        .unwrap();
    assert_eq!(
        cg.paths()["memory"],
        base.join("memory/process_api/8a4fc6f47409c39973b09d59b9138c45/ctr2")
    );
    assert_eq!(cg.paths()["cpu"], base.join("cpu/ctr2"));
    cg.remove().unwrap();
    for bad in ["/a/../b", "/", ""] {
        let e = BoxCgroup::prepare_at(&h, "p3", Path::new(bad), &Limits::default()).unwrap_err();
        assert!(e.to_string().contains("invalid cgroup path"), "{bad}: {e}");
    }
}

#[test]
fn update_rewrites_only_the_limits_given() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(
        &h,
        "u1",
        &Limits {
            memory: Some(1 << 20),
            pids: Some(10),
            ..Default::default()
        },
    )
    .unwrap();
    let p = cg.paths();
    // Marks that a full set-up would overwrite.
    fs::write(p["devices"].join("devices.allow"), "mark").unwrap();
    cg.update(&Limits {
        pids: Some(20),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(read(p["pids"].join("pids.max")), "20");
    assert_eq!(read(p["memory"].join("memory.limit_in_bytes")), "1048576");
    assert_eq!(read(p["devices"].join("devices.allow")), "mark");
    let e = cg
        .update(&Limits {
            pids: Some(0),
            ..Default::default()
        })
        .unwrap_err();
    assert!(e.to_string().contains("pids"), "{e}");
    cg.remove().unwrap();
}

#[test]
fn device_rules_go_to_the_v1_devices_controller_in_order() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(&h, "dev-1", &Limits::default()).unwrap();
    let rules = [
        DeviceRule::new(false, 'a', None, None, "rwm"),
        DeviceRule::new(true, 'c', Some(1), Some(3), "rwm"),
        DeviceRule::new(false, 'c', Some(1), Some(5), "rw"),
        DeviceRule::new(true, 'b', Some(8), None, "m"),
    ];
    assert_eq!(rules[0].v1_text(), "a *:* rwm");
    assert_eq!(rules[3].v1_text(), "b 8:* m");
    cg.set_device_rules(&rules).unwrap();
    let d = &cg.paths()["devices"];
    // The fake files keep the last line written to each.
    assert_eq!(read(d.join("devices.deny")), "c 1:5 rw");
    assert_eq!(read(d.join("devices.allow")), "b 8:* m");
    // Nothing went to the v2 (hugetlb) directory.
    for dir in cg.dirs().iter().filter(|d| d.version == Version::V2) {
        assert!(!dir.path.join("devices.allow").exists());
        assert!(!dir.path.join("devices.deny").exists());
    }
    // No rules: every device denied.
    cg.set_device_rules(&[]).unwrap();
    assert_eq!(read(d.join("devices.deny")), "a");
    cg.remove().unwrap();
}

#[test]
fn device_rules_on_pure_v2_go_to_a_device_program_not_to_files() {
    // Loading a device program needs CAP_BPF (root).
    if !nestbox_testkit::require_root("device_rules_on_pure_v2_go_to_a_device_program_not_to_files")
    {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let cg = BoxCgroup::create(&h, "dev-2", &Limits::default()).unwrap();
    let dir = cg.dirs()[0].path.clone();
    let before: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    // The program loads (it is checked by the kernel's verifier), and
    // attaching it to a directory of a fake tree, no cgroup, is refused by
    // the kernel: the v2 path was taken and wrote no file.
    let e = cg
        .set_device_rules(&[DeviceRule::new(true, 'c', Some(1), Some(3), "rwm")])
        .unwrap_err();
    assert!(
        e.to_string().contains("BPF_PROG_ATTACH, BPF_CGROUP_DEVICE"),
        "{e}"
    );
    let after: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after);
    cg.remove().unwrap();
}

fn hugepages(sizes: &[(&str, u64)]) -> Limits {
    Limits {
        hugepage_limits: sizes
            .iter()
            .map(|(size, limit)| HugepageLimit {
                page_size: size.to_string(),
                limit: *limit,
            })
            .collect(),
        ..Limits::default()
    }
}

#[test]
fn hugepage_sizes_are_named_as_the_kernel_names_them() {
    for (given, name) in [
        ("2MB", "2MB"),
        ("2048KB", "2MB"),
        ("2048kb", "2MB"),
        ("1GB", "1GB"),
        ("1024MB", "1GB"),
        ("64KB", "64KB"),
        ("16GB", "16GB"),
    ] {
        assert_eq!(hugepage_size_name(given).unwrap(), name, "{given}");
    }
    for bad in ["", "2", "MB", "2M", "3XB", "0MB", "-2MB", "2.5MB"] {
        assert!(hugepage_size_name(bad).is_err(), "{bad:?}");
    }
    // Limits hold the kernel's names, each once.
    let e = hugepages(&[("2048KB", 1)])
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("the kernel names it 2MB"), "{e}");
    let e = hugepages(&[("2MB", 1), ("2MB", 2)])
        .validate()
        .unwrap_err()
        .to_string();
    assert!(e.contains("given twice"), "{e}");
    hugepages(&[("2MB", 1), ("1GB", 2)]).validate().unwrap();
    // The kernel's sizes, from its hugepages-<n>kB directories.
    let tmp = tempfile::tempdir().unwrap();
    for d in ["hugepages-2048kB", "hugepages-1048576kB", "hugepages-64kB"] {
        fs::create_dir(tmp.path().join(d)).unwrap();
    }
    fs::write(tmp.path().join("README"), "").unwrap();
    assert_eq!(kernel_hugepage_sizes(tmp.path()), ["1GB", "2MB", "64KB"]);
    assert!(kernel_hugepage_sizes(&tmp.path().join("none")).is_empty());
}

#[test]
fn hugepage_limits_on_v1_with_rsvd_only_for_a_box_that_asks() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1_with_hugetlb(tmp.path());
    // Without hugepage limits the box stays in the caller's hugetlb cgroup.
    let plain = BoxCgroup::create(&h, "hp-0", &Limits::default()).unwrap();
    assert!(!plain.paths().contains_key("hugetlb"));
    plain.remove().unwrap();
    let cg = BoxCgroup::create(
        &h,
        "hp-1",
        &hugepages(&[("2MB", 4 << 20), ("1GB", 2 << 30)]),
    )
    .unwrap();
    let dir = cg.paths()["hugetlb"].clone();
    assert_eq!(
        dir,
        tmp.path()
            .join("sys/fs/cgroup/hugetlb/docker/abc/nestbox-hp-1")
    );
    assert_eq!(read(dir.join("hugetlb.2MB.limit_in_bytes")), "4194304");
    assert_eq!(read(dir.join("hugetlb.2MB.rsvd.limit_in_bytes")), "4194304");
    assert_eq!(read(dir.join("hugetlb.1GB.limit_in_bytes")), "2147483648");
    assert_eq!(
        read(dir.join("hugetlb.1GB.rsvd.limit_in_bytes")),
        "2147483648"
    );
    // update: rewritten.
    cg.update(&hugepages(&[("2MB", 8 << 20)])).unwrap();
    assert_eq!(read(dir.join("hugetlb.2MB.limit_in_bytes")), "8388608");
    assert_eq!(read(dir.join("hugetlb.1GB.limit_in_bytes")), "2147483648");
    cg.remove().unwrap();
    // A size the kernel does not have: refused naming the ones it has,
    // nothing left.
    let e = BoxCgroup::create(&h, "hp-2", &hugepages(&[("64KB", 1 << 20)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no 64KB huge pages"), "{e}");
    assert!(e.contains("it has: 1GB, 2MB"), "{e}");
    assert_no_box_dirs(&h, "hp-2");
    // A v1 system without a hugetlb hierarchy (nor cgroup v2): refused.
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let e = BoxCgroup::create(&h, "hp-3", &hugepages(&[("2MB", 1 << 21)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("hugetlb"), "{e}");
    assert_no_box_dirs(&h, "hp-3");
}

#[test]
fn hugepage_limits_on_v2_enable_hugetlb_only_for_a_box_that_asks() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let parent = tmp.path().join(testfs::V2_REL);
    let plain = BoxCgroup::create(&h, "hq-0", &Limits::default()).unwrap();
    assert!(!plain.dirs()[0].controllers.iter().any(|c| c == "hugetlb"));
    assert!(!read(parent.join("cgroup.subtree_control")).contains("hugetlb"));
    plain.remove().unwrap();
    let cg = BoxCgroup::create(&h, "hq-1", &hugepages(&[("1GB", 3 << 30)])).unwrap();
    assert!(read(parent.join("cgroup.subtree_control")).contains("+hugetlb"));
    let dir = parent.join("nestbox-hq-1");
    assert!(cg.dirs()[0].controllers.iter().any(|c| c == "hugetlb"));
    assert_eq!(read(dir.join("hugetlb.1GB.max")), "3221225472");
    assert_eq!(read(dir.join("hugetlb.1GB.rsvd.max")), "3221225472");
    assert_eq!(
        read(dir.join("hugetlb.2MB.max")),
        "",
        "not asked: untouched"
    );
    cg.remove().unwrap();
    let e = BoxCgroup::create(&h, "hq-2", &hugepages(&[("16GB", 1 << 34)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no 16GB huge pages"), "{e}");
    assert!(e.contains("it has: 1GB, 2MB"), "{e}");
    assert!(!parent.join("nestbox-hq-2").exists());
}

#[test]
fn hugepage_limits_on_this_hybrid_machine_go_to_its_v2_hierarchy() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let unified = tmp.path().join("sys/fs/cgroup/unified");
    let limits = Limits {
        memory: Some(1 << 20),
        ..hugepages(&[("2MB", 6 << 20)])
    };
    // The v1 controllers as always, and a v2 directory for hugetlb only,
    // enabled in the v2 root's subtree_control (it had none).
    let cg = BoxCgroup::create(&h, "hh-1", &limits).unwrap();
    let p = cg.paths();
    let v2 = cg
        .dirs()
        .iter()
        .find(|d| d.version == Version::V2)
        .expect("a v2 directory");
    assert_eq!(v2.path, unified.join("nestbox-hh-1"));
    assert_eq!(v2.controllers, ["hugetlb"]);
    assert_eq!(read(unified.join("cgroup.subtree_control")), "+hugetlb");
    assert_eq!(read(v2.path.join("hugetlb.2MB.max")), "6291456");
    assert_eq!(read(p["memory"].join("memory.limit_in_bytes")), "1048576");
    // Its processes join both.
    assert!(cg
        .self_join_files()
        .contains(&unified.join("nestbox-hh-1/cgroup.procs")));
    // update reaches it; a box made without hugepage limits has none to
    // update.
    cg.update(&hugepages(&[("2MB", 2 << 20)])).unwrap();
    assert_eq!(read(v2.path.join("hugetlb.2MB.max")), "2097152");
    let plain = BoxCgroup::create(&h, "hh-0", &Limits::default()).unwrap();
    assert!(plain.dirs().iter().all(|d| d.version == Version::V1));
    let e = plain
        .update(&hugepages(&[("2MB", 1)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("created without hugepage limits"), "{e}");
    plain.remove().unwrap();
    cg.remove().unwrap();
    assert!(!unified.join("nestbox-hh-1").exists());
    // At an absolute cgroupsPath two levels down: enabled along the path
    // (the root and the directory between), as runc does on v2.
    // (Hugepage limits only: the fake v1 roots have no control files.)
    fs::write(unified.join("cgroup.subtree_control"), "").unwrap();
    let only = hugepages(&[("2MB", 6 << 20)]);
    let cg = BoxCgroup::prepare_at(&h, "hh-2", Path::new("/testdir/ctr"), &only)
        .unwrap()
        .create()
        .unwrap();
    assert_eq!(read(unified.join("cgroup.subtree_control")), "+hugetlb");
    assert_eq!(
        read(unified.join("testdir/cgroup.subtree_control")),
        "+hugetlb"
    );
    assert_eq!(read(unified.join("testdir/ctr/hugetlb.2MB.max")), "6291456");
    cg.remove().unwrap();
    assert!(!unified.join("testdir/ctr").exists());
    // A size the kernel does not have.
    let e = BoxCgroup::create(&h, "hh-3", &hugepages(&[("1MB", 1 << 20)]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no 1MB huge pages"), "{e}");
    assert_no_box_dirs(&h, "hh-3");
    assert!(!unified.join("nestbox-hh-3").exists());
}

/// The (uid, gid) delegation tests give cgroups to: a box root's as root,
/// else the caller's own (the only owner a non-root caller may chown to).
fn delegate_owner() -> (u32, u32) {
    if nix::unistd::geteuid().is_root() {
        (1_000_000_000, 1_000_000_000)
    } else {
        (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        )
    }
}

fn owner_of(p: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let m = fs::metadata(p).unwrap_or_else(|e| panic!("stat {}: {e}", p.display()));
    (m.uid(), m.gid())
}

#[test]
fn delegated_v2_box_owns_its_membership_files_and_keeps_its_processes_in_a_leaf() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v2(tmp.path());
    let owner = delegate_owner();
    let limits = Limits {
        memory: Some(64 << 20),
        pids: Some(50),
        ..Limits::default()
    };
    let pending = BoxCgroup::prepare_delegated(&h, "nest-1", &limits, owner).unwrap();
    let parent = tmp.path().join(testfs::V2_REL);
    let dir = parent.join("nestbox-nest-1");
    let leaf = dir.join(V2_LEAF);
    // The box's processes belong in the leaf; its first process joins the
    // box's cgroup first (the root of its cgroup namespace), then the leaf.
    assert_eq!(pending.self_join_files(), vec![leaf.join("cgroup.procs")]);
    let cg = pending.create().unwrap();
    assert_eq!(cg.self_join_files(), vec![leaf.join("cgroup.procs")]);
    assert_eq!(cg.ns_root_join_files(), vec![dir.join("cgroup.procs")]);
    assert_eq!(cg.leaf_join_files(), vec![leaf.join("cgroup.procs")]);
    assert!(leaf.is_dir());
    // The limits are the parent's to set: written, and root's.
    assert_eq!(read(dir.join("memory.max")), (64u64 << 20).to_string());
    assert_eq!(read(dir.join("pids.max")), "50");
    assert_eq!(
        read(parent.join("cgroup.subtree_control")),
        "+cpu +cpuset +io +memory +pids"
    );
    let me = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    assert_eq!(owner_of(&dir.join("memory.max")), me);
    assert_eq!(owner_of(&dir.join("pids.max")), me);
    // What moves processes and makes children is the box's.
    for p in [
        dir.clone(),
        dir.join("cgroup.procs"),
        dir.join("cgroup.subtree_control"),
        leaf.clone(),
        leaf.join("cgroup.procs"),
    ] {
        assert_eq!(owner_of(&p), owner, "{}", p.display());
    }
    let d = cg.delegation().unwrap();
    assert_eq!(d.owner, owner);
    assert_eq!(
        d.mounts,
        vec![BoxMount {
            dir: String::new(),
            fstype: "cgroup2".into(),
            options: None,
        }]
    );
    // The state round-trips with the delegation.
    let back: BoxCgroup = serde_json::from_str(&serde_json::to_string(&cg).unwrap()).unwrap();
    assert_eq!(back, cg);

    // Inside the box: its cgroup namespace's root is the box's cgroup and
    // its processes are in the leaf. A nestbox there makes its boxes beside
    // the leaf, enabling the controllers in the box's own (process-free)
    // cgroup.
    let inner = tempfile::tempdir().unwrap();
    let root = inner.path().join("sys/fs/cgroup");
    fs::create_dir_all(&root).unwrap();
    for e in fs::read_dir(&dir).unwrap().flatten() {
        if e.file_type().unwrap().is_file() {
            fs::copy(e.path(), root.join(e.file_name())).unwrap();
        }
    }
    fs::write(
        root.join("cgroup.controllers"),
        "cpuset cpu io memory pids\n",
    )
    .unwrap();
    fs::write(root.join("cgroup.subtree_control"), "").unwrap();
    let inside_mountinfo =
        "30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw\n";
    let inside =
        Hierarchies::from_proc_text(inside_mountinfo, &format!("0::/{V2_LEAF}\n"), inner.path())
            .unwrap();
    assert_eq!(inside.v2().unwrap().invoking_dir(), root);
    let child = BoxCgroup::create(
        &inside,
        "child-1",
        &Limits {
            memory: Some(1 << 30),
            ..Limits::default()
        },
    )
    .unwrap();
    assert_eq!(
        child.paths()["memory"],
        root.join("nestbox-child-1"),
        "a nested box's cgroup is the box's cgroup's child"
    );
    assert_eq!(
        read(root.join("cgroup.subtree_control")),
        "+cpu +cpuset +io +memory +pids"
    );
    child.remove().unwrap();

    // Processes of the leaf are the box's; those of the cgroups below (its
    // own boxes) are in its tree, which removal takes with it.
    fs::write(leaf.join("cgroup.procs"), "41\n").unwrap();
    let nested = dir.join("nestbox-ab-c1");
    fs::create_dir(&nested).unwrap();
    fs::write(nested.join("cgroup.procs"), "42\n").unwrap();
    fs::create_dir(nested.join(V2_LEAF)).unwrap();
    fs::write(nested.join(V2_LEAF).join("cgroup.procs"), "43\n").unwrap();
    assert_eq!(cg.procs().unwrap(), vec![41]);
    assert_eq!(cg.procs_tree().unwrap(), vec![41, 42, 43]);
    assert_eq!(
        cg.procs_below().unwrap(),
        vec![42, 43],
        "the leaf's processes are the box's own"
    );
    for f in [
        leaf.join("cgroup.procs"),
        nested.join("cgroup.procs"),
        nested.join(V2_LEAF).join("cgroup.procs"),
    ] {
        fs::write(f, "").unwrap();
    }
    cg.kill_all().unwrap();
    cg.remove().unwrap();
    assert!(!dir.exists());
}

#[test]
fn delegated_v1_box_gets_every_hierarchy_and_mounts_all_but_devices() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let owner = delegate_owner();
    let cg = BoxCgroup::prepare_delegated(&h, "nest-2", &Limits::default(), owner)
        .unwrap()
        .create()
        .unwrap();
    let p = cg.paths();
    // A cpuset of its own even without a CPU list, initialised from the parent.
    assert_eq!(read(p["cpuset"].join("cpuset.cpus")), "0-3");
    assert_eq!(read(p["cpuset"].join("cpuset.mems")), "0");
    // The devices cgroup restricts the box as any box's does, and stays root's.
    assert_eq!(read(p["devices"].join("devices.deny")), "a");
    let me = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    assert_eq!(owner_of(&p["devices"]), me);
    for c in ["cpu", "cpuset", "memory", "freezer", "blkio", "pids"] {
        let d = &p[c];
        assert_eq!(owner_of(d), owner, "{}", d.display());
        assert_eq!(owner_of(&d.join("tasks")), owner, "{}", d.display());
        assert_eq!(owner_of(&d.join("cgroup.procs")), owner, "{}", d.display());
    }
    assert_eq!(owner_of(&p["memory"].join("memory.limit_in_bytes")), me);
    // v1 has no leaf: the box's processes are in its cgroup.
    assert_eq!(cg.self_join_files(), cg.ns_root_join_files());
    assert!(cg.leaf_join_files().is_empty());
    let mounts: Vec<(String, Option<String>)> = cg
        .delegation()
        .unwrap()
        .mounts
        .iter()
        .map(|m| {
            assert_eq!(m.fstype, "cgroup");
            (m.dir.clone(), m.options.clone())
        })
        .collect();
    let want = |d: &str, o: &str| (d.to_string(), Some(o.to_string()));
    assert_eq!(
        mounts,
        vec![
            want("cpu,cpuacct", "cpu,cpuacct"),
            want("cpuset", "cpuset"),
            want("memory", "memory"),
            want("freezer", "freezer"),
            want("blkio", "blkio"),
            want("pids", "pids"),
        ]
    );
    // A box below it (made by a nestbox inside) goes with it.
    let nested = p["memory"].join("nestbox-ab-c2");
    fs::create_dir(&nested).unwrap();
    fs::write(nested.join("cgroup.procs"), "").unwrap();
    cg.remove().unwrap();
    assert!(!p["memory"].exists() && !nested.exists());
    assert_no_box_dirs(&h, "nest-2");
}

/// A clone's cgroup inside a box: its v1 `tasks` files (and nothing else)
/// belong to the template's root, who moves the clone's processes in.
#[test]
fn giving_the_tasks_files_changes_only_their_owner() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::create(&h, "clone-1", &Limits::default()).unwrap();
    let owner = delegate_owner();
    cg.give_tasks_files_to(owner).unwrap();
    let me = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    let mut v1 = 0;
    for d in cg.dirs() {
        match d.version {
            Version::V1 => {
                v1 += 1;
                assert_eq!(
                    owner_of(&d.path.join("tasks")),
                    owner,
                    "{}",
                    d.path.display()
                );
                assert_eq!(owner_of(&d.path.join("cgroup.procs")), me);
            }
            Version::V2 => assert_eq!(owner_of(&d.path.join("cgroup.procs")), me),
        }
        assert_eq!(owner_of(&d.path), me, "{}", d.path.display());
    }
    assert!(v1 > 0);
    cg.remove().unwrap();
}

#[test]
fn delegated_box_on_this_machines_hybrid_layout_mounts_its_v1_hierarchies() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::hybrid(tmp.path());
    let cg = BoxCgroup::prepare_delegated(&h, "nest-3", &Limits::default(), delegate_owner())
        .unwrap()
        .create()
        .unwrap();
    let dirs: Vec<String> = cg
        .delegation()
        .unwrap()
        .mounts
        .iter()
        .map(|m| m.dir.clone())
        .collect();
    // The v2 hierarchy here carries only hugetlb, which boxes do not use:
    // the box has no v2 cgroup and mounts none.
    assert_eq!(
        dirs,
        ["cpu", "cpuacct", "cpuset", "memory", "freezer", "blkio", "pids"]
    );
    cg.remove().unwrap();
}

#[test]
fn the_v2_leaf_is_not_where_boxes_go() {
    let mi = "30 24 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
    let root = Path::new("/x");
    let at = |cgroup: &str| {
        Hierarchies::from_proc_text(mi, cgroup, root)
            .unwrap()
            .v2()
            .unwrap()
            .invoking_dir()
            .to_path_buf()
    };
    assert_eq!(at("0::/nestbox.init\n"), root.join("sys/fs/cgroup"));
    assert_eq!(at("0::/a/b/nestbox.init\n"), root.join("sys/fs/cgroup/a/b"));
    assert_eq!(
        at("0::/a/xnestbox.init\n"),
        root.join("sys/fs/cgroup/a/xnestbox.init")
    );
    assert_eq!(at("0::/a\n"), root.join("sys/fs/cgroup/a"));
}

/// v1 refuses a CPU cap above an enclosing cgroup's (EINVAL): a box asking
/// for more than its parent (a box inside a box with `--cpus`) gets its
/// parent's share, as v2 would bound it; below it, what it asked.
#[test]
fn v1_cpu_cap_above_an_enclosing_cgroups_is_capped_at_it() {
    let tmp = tempfile::tempdir().unwrap();
    let h = testfs::pure_v1(tmp.path());
    let parent = tmp.path().join("sys/fs/cgroup/cpu,cpuacct/docker/abc");
    // The parent allows half a CPU (with another period); its parent a whole one.
    testfs::file(&parent, "cpu.cfs_period_us", "200000\n");
    testfs::file(&parent, "cpu.cfs_quota_us", "100000\n");
    testfs::file(parent.parent().unwrap(), "cpu.cfs_period_us", "100000\n");
    testfs::file(parent.parent().unwrap(), "cpu.cfs_quota_us", "100000\n");
    let asked = |cpus: f64| Limits {
        cpus: Some(cpus),
        ..Limits::default()
    };
    let cg = BoxCgroup::create(&h, "cap-1", &asked(2.0)).unwrap();
    assert_eq!(read(cg.paths()["cpu"].join("cpu.cfs_quota_us")), "50000");
    assert_eq!(read(cg.paths()["cpu"].join("cpu.cfs_period_us")), "100000");
    let cg = BoxCgroup::create(&h, "cap-2", &asked(0.25)).unwrap();
    assert_eq!(read(cg.paths()["cpu"].join("cpu.cfs_quota_us")), "25000");
    assert_eq!(v1::cfs_ceiling(&parent, 100_000), Some(50_000));
    assert_eq!(v1::cfs_ceiling(tmp.path(), 100_000), None);
}

#[test]
fn procs_below_finds_the_boxes_inside_where_a_hierarchy_is_not_divided() {
    // A v1 nest box: its freezer cgroup has a child (a box inside), its
    // devices cgroup has none and lists every process of the box and of the
    // box inside together.
    let tmp = tempfile::tempdir().unwrap();
    let freezer = tmp.path().join("freezer/nestbox-a-b");
    let devices = tmp.path().join("devices/nestbox-a-b");
    let inner = freezer.join("nestbox-c-d");
    for d in [&freezer, &devices, &inner] {
        fs::create_dir_all(d).unwrap();
    }
    fs::write(freezer.join("cgroup.procs"), "10\n11\n").unwrap();
    fs::write(inner.join("cgroup.procs"), "20\n21\n").unwrap();
    fs::write(devices.join("cgroup.procs"), "10\n11\n20\n21\n").unwrap();
    let dir = |path: &Path, c: &str| CgroupDir {
        version: Version::V1,
        controllers: vec![c.to_string()],
        path: path.to_path_buf(),
    };
    let cg = BoxCgroup::from_dirs(
        "a-b",
        vec![dir(&freezer, "freezer"), dir(&devices, "devices")],
    )
    .unwrap();
    assert_eq!(
        cg.procs().unwrap(),
        vec![10, 11, 20, 21],
        "the union hides them"
    );
    assert_eq!(cg.procs_below().unwrap(), vec![20, 21]);
    fs::write(inner.join("cgroup.procs"), "").unwrap();
    assert!(cg.procs_below().unwrap().is_empty(), "none inside");
}
