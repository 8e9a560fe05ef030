//! Test helpers: fake cgroup trees in a temp dir and `/proc` texts of real
//! layouts (this machine's hybrid layout, a pure v2 and a pure v1 system).

use std::fs;
use std::path::{Path, PathBuf};

use crate::detect::Hierarchies;

/// `/proc/self/mountinfo` of the development machine (hybrid layout).
pub(crate) const HYBRID_MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime - sysfs sysfs rw
24 27 0:6 / /dev rw,relatime - devtmpfs devtmpfs rw,size=12334460k,nr_inodes=3083615,mode=755
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
26 24 0:24 / /dev/pts rw,relatime - devpts devpts rw,mode=600,ptmxmode=000
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard,resv_strict,resuid=65534,resgid=65534
28 27 0:25 / /mnt/sandboxing/model_tools_env/v1/python ro,nosuid,nodev,relatime - tmpfs model_tools_unavailable ro,size=4k,mode=755
29 26 0:26 / /dev/pts rw,relatime - devpts devpts rw,mode=600,ptmxmode=000
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
37 31 0:34 / /sys/fs/cgroup/freezer rw,relatime - cgroup cgroup rw,freezer
38 31 0:35 / /sys/fs/cgroup/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

/// `/proc/self/cgroup` of the development machine.
pub(crate) const HYBRID_CGROUP: &str = "\
9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/8a4fc6f47409c39973b09d59b9138c45
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
";

/// A pure cgroup v2 system (systemd, unified).
pub(crate) const V2_MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
24 22 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw
30 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

/// `/proc/self/cgroup` on the pure v2 system.
pub(crate) const V2_CGROUP: &str = "0::/user.slice/user-1000.slice/session-3.scope\n";

/// The invoking cgroup of [`V2_CGROUP`], relative to the mount.
pub(crate) const V2_REL: &str = "sys/fs/cgroup/user.slice/user-1000.slice/session-3.scope";

/// A pure cgroup v1 system (no cgroup2 mount) with co-mounted `cpu,cpuacct`
/// and `net_cls,net_prio`, SELinux's `seclabel` option, and the memory
/// hierarchy mounted at a sub-path (as inside a container).
pub(crate) const V1_MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
25 22 0:23 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
26 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid,nodev,noexec,relatime shared:9 - cgroup cgroup rw,xattr,release_agent=/usr/lib/systemd/systemd-cgroups-agent,name=systemd
27 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:10 - cgroup cgroup rw,cpu,cpuacct
28 25 0:26 / /sys/fs/cgroup/cpuset rw,nosuid,nodev,noexec,relatime shared:11 - cgroup cgroup rw,cpuset
29 25 0:27 /docker/abc /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:12 - cgroup cgroup rw,memory
30 25 0:28 / /sys/fs/cgroup/devices rw,nosuid,nodev,noexec,relatime shared:13 - cgroup cgroup rw,devices
31 25 0:29 / /sys/fs/cgroup/freezer rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,freezer
32 25 0:30 / /sys/fs/cgroup/blkio rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,blkio
33 25 0:31 / /sys/fs/cgroup/pids rw,nosuid,nodev,noexec,relatime shared:16 - cgroup cgroup rw,seclabel,pids
34 25 0:32 / /sys/fs/cgroup/net_cls,net_prio rw,nosuid,nodev,noexec,relatime shared:17 - cgroup cgroup rw,net_cls,net_prio
";

/// `/proc/self/cgroup` on the pure v1 system.
pub(crate) const V1_CGROUP: &str = "\
10:net_cls,net_prio:/docker/abc
9:pids:/docker/abc
8:blkio:/docker/abc
7:freezer:/docker/abc
6:devices:/docker/abc
5:memory:/docker/abc
4:cpuset:/docker/abc
3:cpu,cpuacct:/docker/abc
1:name=systemd:/docker/abc
";

/// Writes `content` to `root/rel`, creating parent directories.
pub(crate) fn file(root: &Path, rel: &str, content: &str) -> PathBuf {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(&p, content).unwrap();
    p
}

/// Reads `path` (panics when missing).
pub(crate) fn read(path: impl AsRef<Path>) -> String {
    let path = path.as_ref();
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The control files of a non-root v1 cgroup per hierarchy, with contents.
fn v1_files(ctrl: &str) -> Vec<(&'static str, &'static str)> {
    let mut v = vec![("cgroup.procs", ""), ("tasks", "")];
    v.extend(match ctrl {
        "cpu" => vec![
            ("cpu.cfs_period_us", "100000\n"),
            ("cpu.cfs_quota_us", "-1\n"),
            ("cpu.shares", "1024\n"),
        ],
        "cpuacct" => vec![("cpuacct.usage", "123456789\n")],
        "cpuset" => vec![
            ("cpuset.cpus", "0-3\n"),
            ("cpuset.mems", "0\n"),
            ("cpuset.effective_cpus", "0-3\n"),
        ],
        "memory" => vec![
            ("memory.limit_in_bytes", "9223372036854771712\n"),
            ("memory.soft_limit_in_bytes", "9223372036854771712\n"),
            ("memory.memsw.limit_in_bytes", "9223372036854771712\n"),
            ("memory.usage_in_bytes", "4096\n"),
            ("memory.max_usage_in_bytes", "8192\n"),
            ("memory.swappiness", "60\n"),
            (
                "memory.oom_control",
                "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
            ),
        ],
        "devices" => vec![
            ("devices.allow", ""),
            ("devices.deny", ""),
            ("devices.list", "a *:* rwm\n"),
        ],
        "freezer" => vec![("freezer.state", "THAWED\n")],
        "blkio" => vec![
            ("blkio.bfq.weight", "100\n"),
            ("blkio.throttle.read_bps_device", ""),
            ("blkio.throttle.write_bps_device", ""),
            ("blkio.throttle.read_iops_device", ""),
            ("blkio.throttle.write_iops_device", ""),
        ],
        "pids" => vec![("pids.max", "max\n"), ("pids.current", "2\n")],
        "net_cls" => vec![("net_cls.classid", "0\n")],
        "hugetlb" => vec![
            ("hugetlb.2MB.limit_in_bytes", "9223372036854771712\n"),
            ("hugetlb.2MB.rsvd.limit_in_bytes", "9223372036854771712\n"),
            ("hugetlb.2MB.usage_in_bytes", "0\n"),
            ("hugetlb.1GB.limit_in_bytes", "9223372036854771712\n"),
            ("hugetlb.1GB.rsvd.limit_in_bytes", "9223372036854771712\n"),
            ("hugetlb.1GB.usage_in_bytes", "0\n"),
        ],
        "net_prio" => vec![("net_prio.ifpriomap", "lo 0\n")],
        _ => vec![],
    });
    v
}

/// Builds a fake tree for this machine's hybrid layout under `root` and
/// returns the detected hierarchies.
pub(crate) fn hybrid(root: &Path) -> Hierarchies {
    let h0 = Hierarchies::from_proc_text(HYBRID_MOUNTINFO, HYBRID_CGROUP, root).unwrap();
    file(
        root,
        "sys/fs/cgroup/unified/cgroup.controllers",
        "hugetlb\n",
    );
    file(root, "sys/fs/cgroup/unified/cgroup.subtree_control", "");
    file(root, "sys/fs/cgroup/unified/cgroup.procs", "");
    // (The kernel gives a child cgroup the hugetlb files once the root
    // enables the controller; the fake seeds a child with its parent's
    // files, so the root holds them here. No rsvd files: as a kernel
    // before 5.7.)
    for size in ["2MB", "1GB"] {
        file(
            root,
            &format!("sys/fs/cgroup/unified/hugetlb.{size}.max"),
            "max\n",
        );
    }
    for h in h0.v1() {
        for c in h.controllers() {
            for (name, content) in v1_files(c) {
                fs::create_dir_all(h.invoking_dir()).unwrap();
                fs::write(h.invoking_dir().join(name), content).unwrap();
            }
        }
    }
    Hierarchies::from_proc_text(HYBRID_MOUNTINFO, HYBRID_CGROUP, root).unwrap()
}

/// Builds a fake pure v1 tree (co-mounted cpu,cpuacct) under `root`.
pub(crate) fn pure_v1(root: &Path) -> Hierarchies {
    let h = Hierarchies::from_proc_text(V1_MOUNTINFO, V1_CGROUP, root).unwrap();
    for h in h.v1() {
        fs::create_dir_all(h.invoking_dir()).unwrap();
        for c in h.controllers() {
            for (name, content) in v1_files(c) {
                fs::write(h.invoking_dir().join(name), content).unwrap();
            }
        }
    }
    h
}

/// [`pure_v1`] with a v1 hugetlb hierarchy too (2MB and 1GB pages, with
/// their `rsvd` files).
pub(crate) fn pure_v1_with_hugetlb(root: &Path) -> Hierarchies {
    let mountinfo = format!(
        "{V1_MOUNTINFO}35 25 0:33 / /sys/fs/cgroup/hugetlb rw,nosuid,nodev,noexec,relatime shared:18 - cgroup cgroup rw,hugetlb\n"
    );
    let cgroup = format!("11:hugetlb:/docker/abc\n{V1_CGROUP}");
    let h = Hierarchies::from_proc_text(&mountinfo, &cgroup, root).unwrap();
    for h in h.v1() {
        fs::create_dir_all(h.invoking_dir()).unwrap();
        for c in h.controllers() {
            for (name, content) in v1_files(c) {
                fs::write(h.invoking_dir().join(name), content).unwrap();
            }
        }
    }
    h
}

/// Builds a fake pure v2 tree under `root`: the invoking cgroup has every
/// control file of a non-root v2 cgroup with the usual controllers.
pub(crate) fn pure_v2(root: &Path) -> Hierarchies {
    let all = "cpuset cpu io memory hugetlb pids rdma misc\n";
    file(root, "sys/fs/cgroup/cgroup.controllers", all);
    let d = root.join(V2_REL);
    fs::create_dir_all(&d).unwrap();
    for (name, content) in [
        ("cgroup.controllers", all),
        ("cgroup.subtree_control", ""),
        ("cgroup.procs", ""),
        ("cgroup.events", "populated 0\nfrozen 0\n"),
        ("cgroup.freeze", "0\n"),
        ("cgroup.kill", ""),
        ("cpu.max", "max 100000\n"),
        ("cpu.weight", "100\n"),
        (
            "cpu.stat",
            "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\nnr_periods 0\n",
        ),
        ("cpuset.cpus", ""),
        ("cpuset.cpus.effective", "0-3\n"),
        ("cpuset.mems", ""),
        ("io.weight", "default 100\n"),
        ("io.max", ""),
        ("memory.max", "max\n"),
        ("memory.low", "0\n"),
        ("memory.swap.max", "max\n"),
        ("memory.current", "1000\n"),
        ("memory.peak", "5000\n"),
        (
            "memory.events",
            "low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n",
        ),
        ("pids.max", "max\n"),
        ("pids.current", "1\n"),
        ("hugetlb.2MB.max", "max\n"),
        ("hugetlb.2MB.rsvd.max", "max\n"),
        ("hugetlb.1GB.max", "max\n"),
        ("hugetlb.1GB.rsvd.max", "max\n"),
    ] {
        fs::write(d.join(name), content).unwrap();
    }
    Hierarchies::from_proc_text(V2_MOUNTINFO, V2_CGROUP, root).unwrap()
}
