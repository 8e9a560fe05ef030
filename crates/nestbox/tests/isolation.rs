//! What a process inside a box can see and do: its pid namespace, hostname,
//! filesystem (image only, private writes, no chroot escape), capabilities,
//! no_new_privs, seccomp, the /proc and /sys masks, /dev, mounts and volumes,
//! environment, user and user namespace. Every property is checked from inside.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;

const EPERM: &str = "1";
const EROFS: &str = "30";
const ENOENT: &str = "2";
const ENOSYS: &str = "38";

/// Python that prints the errno of opening `path` for writing ("ok" if it worked).
fn write_errno_py(paths: &[&str]) -> String {
    format!(
        "import os\nfor p in {paths:?}:\n    try:\n        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)\n        os.close(fd)\n        print(p, 'ok')\n    except OSError as e:\n        print(p, e.errno)\n"
    )
}

/// Python preamble giving `libc` (ctypes, with errno) to call raw system calls.
const CTYPES: &str = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n";

// ---------------------------------------------------------------- pid namespace

#[test]
fn init_is_pid_1_and_the_command_is_pid_2() {
    let Some(root) = TestRoot::new("init_is_pid_1_and_the_command_is_pid_2") else {
        return;
    };
    let out = root.py(&[], "import os; print(os.getpid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))").ok();
    assert_eq!(
        out.stdout.trim(),
        "2 [1, 2]",
        "the box sees only its init and its command\n{out}"
    );
}

#[test]
fn host_processes_cannot_be_signalled() {
    let Some(root) = TestRoot::new("host_processes_cannot_be_signalled") else {
        return;
    };
    let me = std::process::id();
    let code = format!(
        "import os\ntry:\n    os.kill({me}, 0)\n    print('visible')\nexcept ProcessLookupError:\n    print('invisible')\n"
    );
    let out = root.py(&[], &code).ok();
    assert_eq!(
        out.stdout.trim(),
        "invisible",
        "pid {me} of the host test must not exist in the box\n{out}"
    );
}

// ---------------------------------------------------------------- uts namespace

#[test]
fn hostname_defaults_to_the_box_name() {
    let Some(root) = TestRoot::new("hostname_defaults_to_the_box_name") else {
        return;
    };
    let out = root
        .sh(&["--name", "iso-default-host"], "uname -n; echo $HOSTNAME")
        .ok();
    assert_eq!(
        out.lines(),
        ["iso-default-host", "iso-default-host"],
        "{out}"
    );
}

#[test]
fn hostname_option_sets_the_box_hostname_only() {
    let Some(root) = TestRoot::new("hostname_option_sets_the_box_hostname_only") else {
        return;
    };
    let host_before = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let out = root
        .sh(&["--hostname", "custom-box.example"], "uname -n")
        .ok();
    assert_eq!(out.stdout.trim(), "custom-box.example", "{out}");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        host_before,
        "host hostname changed"
    );
}

// ---------------------------------------------------------------- filesystem

#[test]
fn host_files_outside_the_image_are_invisible() {
    let Some(root) = TestRoot::new("host_files_outside_the_image_are_invisible") else {
        return;
    };
    let in_var = HostMarker::new("/var/tmp");
    let in_root = HostMarker::new("/root");
    let paths = [
        in_var.path(),
        in_root.path(),
        root.path().to_str().unwrap(),
        "/work",
        "/old_root",
    ];
    let script: String = paths
        .iter()
        .map(|p| format!("test -e '{p}' && echo 'visible {p}'; "))
        .collect();
    let out = root.sh(&[], &format!("{script} echo done")).ok();
    assert_eq!(
        out.stdout.trim(),
        "done",
        "host paths visible in the box\n{out}"
    );
}

#[test]
fn root_holds_only_the_image_entries() {
    let Some(root) = TestRoot::new("root_holds_only_the_image_entries") else {
        return;
    };
    let out = root.sh(&[], "ls -A /").ok();
    let extra: Vec<&str> = out
        .stdout
        .split_whitespace()
        .filter(|e| !IMAGE_ROOT_ENTRIES.contains(e))
        .collect();
    assert!(
        extra.is_empty(),
        "unexpected top-level entries {extra:?} in the box root\n{out}"
    );
}

#[test]
fn private_dirs_start_empty() {
    let Some(root) = TestRoot::new("private_dirs_start_empty") else {
        return;
    };
    let out = root
        .sh(
            &[],
            "ls -A /tmp /var /home /root | grep -v ':$' | grep -v '^$'; echo end",
        )
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "end",
        "/tmp /var /home /root of a new box must be empty\n{out}"
    );
}

#[test]
fn system_dirs_are_read_only_and_writes_elsewhere_do_not_reach_the_host() {
    let Some(root) =
        TestRoot::new("system_dirs_are_read_only_and_writes_elsewhere_do_not_reach_the_host")
    else {
        return;
    };
    let name = unique("nestbox-leak");
    // The host's system directories are shared read-only: every write is refused.
    let system = [
        format!("/etc/{name}"),
        format!("/usr/{name}"),
        format!("/usr/lib/{name}"),
    ];
    let script: String = system
        .iter()
        .map(|t| {
            format!(
                "if echo leak > {t} 2>/dev/null; then echo wrote {t}; else echo refused {t}; fi; "
            )
        })
        .collect();
    let out = root.sh(&[], &script).ok();
    for t in &system {
        assert!(
            out.stdout.contains(&format!("refused {t}")),
            "a write to {t} was not refused\n{out}"
        );
        assert!(
            !std::path::Path::new(t).exists(),
            "a write to {t} in the box reached the host"
        );
    }
    // Everywhere else the box writes to its private layer, never to the host.
    let private = [
        format!("/tmp/{name}"),
        format!("/root/{name}"),
        format!("/var/{name}"),
        format!("/{name}"),
    ];
    let script: String = private
        .iter()
        .map(|t| format!("echo data > {t} && cat {t} && "))
        .collect();
    let out = root.sh(&[], &format!("{script} echo written")).ok();
    assert_eq!(
        out.stdout.lines().last(),
        Some("written"),
        "the box can write its private dirs\n{out}"
    );
    for t in &private {
        assert!(
            !std::path::Path::new(t).exists(),
            "a write to {t} in the box reached the host"
        );
    }
}

#[test]
fn writes_in_one_box_are_invisible_to_another() {
    let Some(root) = TestRoot::new("writes_in_one_box_are_invisible_to_another") else {
        return;
    };
    let file = format!("/root/{}", unique("nestbox-shared"));
    root.detached_sh(
        "iso-writer",
        &[],
        &format!("echo secret > {file} && echo secret > /tmp/secret && echo ready; sleep 60"),
    );
    root.wait_log("iso-writer", "ready", Duration::from_secs(20));
    let out = root
        .sh(
            &["--name", "iso-reader"],
            &format!(
                "test -e {file} && echo seen-root; test -e /tmp/secret && echo seen-tmp; echo done"
            ),
        )
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "done",
        "a running box's writes are visible in another box\n{out}"
    );
}

#[test]
fn chroot_escape_does_not_reach_the_host() {
    let Some(root) = TestRoot::new("chroot_escape_does_not_reach_the_host") else {
        return;
    };
    let marker = HostMarker::new("/var/tmp");
    // The classic escape: chroot into a subdirectory while keeping the working
    // directory outside it, climb with "..", then chroot to where we ended up.
    let code = format!(
        "import os\nos.makedirs('/tmp/jail/inner', exist_ok=True)\nkeep = os.open('/', os.O_RDONLY)\nos.chroot('/tmp/jail')\nos.fchdir(keep)\nfor _ in range(256):\n    os.chdir('..')\nos.chroot('.')\nprint(os.path.exists({m:?}))\nprint(' '.join(sorted(os.listdir('/'))))\n",
        m = marker.path()
    );
    let out = root.py(&[], &code).ok();
    let lines = out.lines();
    assert_eq!(
        lines.first(),
        Some(&"False"),
        "the chroot escape reached a host-only file\n{out}"
    );
    let extra: Vec<&str> = lines
        .get(1)
        .unwrap_or(&"")
        .split_whitespace()
        .filter(|e| !IMAGE_ROOT_ENTRIES.contains(e))
        .collect();
    assert!(
        extra.is_empty(),
        "after the escape attempt / shows host entries {extra:?}\n{out}"
    );
}

#[test]
fn proc_root_links_do_not_lead_to_the_host() {
    let Some(root) = TestRoot::new("proc_root_links_do_not_lead_to_the_host") else {
        return;
    };
    let marker = HostMarker::new("/var/tmp");
    let code = format!(
        "import os\nfor p in ['/proc/1/root', '/proc/1/cwd', '/proc/self/root', '/proc/2/root']:\n    try:\n        names = os.listdir(p)\n    except OSError as e:\n        print(p, 'denied', e.errno)\n        continue\n    print(p, os.path.exists(p + {m:?}), ' '.join(sorted(names)))\n",
        m = marker.path()
    );
    let out = root.py(&[], &code).ok();
    for line in out.lines() {
        let mut f = line.split_whitespace();
        let (path, verdict) = (f.next().unwrap_or(""), f.next().unwrap_or(""));
        if verdict == "denied" {
            continue;
        }
        assert_eq!(verdict, "False", "{path} leads to a host-only file\n{out}");
        let extra: Vec<&str> = f.filter(|e| !IMAGE_ROOT_ENTRIES.contains(e)).collect();
        assert!(
            extra.is_empty(),
            "{path} shows host entries {extra:?}\n{out}"
        );
    }
}

// ---------------------------------------------------------------- capabilities, nnp, seccomp

#[test]
fn capabilities_are_dockers_default_set() {
    let Some(root) = TestRoot::new("capabilities_are_dockers_default_set") else {
        return;
    };
    let out = root.sh(&[], "cat /proc/self/status").ok();
    for key in ["CapBnd", "CapEff", "CapPrm"] {
        assert_eq!(
            cap_field(&out.stdout, key),
            DOCKER_DEFAULT_CAPS,
            "{key} is not Docker's default set"
        );
    }
    assert_eq!(
        cap_field(&out.stdout, "CapAmb"),
        0,
        "no ambient capabilities"
    );
}

#[test]
fn cap_drop_removes_a_capability() {
    let Some(root) = TestRoot::new("cap_drop_removes_a_capability") else {
        return;
    };
    let out = root
        .sh(&["--cap-drop", "NET_RAW"], "cat /proc/self/status")
        .ok();
    let expected = DOCKER_DEFAULT_CAPS & !(1 << 13);
    assert_eq!(
        cap_field(&out.stdout, "CapBnd"),
        expected,
        "CAP_NET_RAW (13) still in the bounding set"
    );
    assert_eq!(cap_field(&out.stdout, "CapEff"), expected);
}

#[test]
fn cap_add_adds_a_capability() {
    let Some(root) = TestRoot::new("cap_add_adds_a_capability") else {
        return;
    };
    let out = root
        .sh(&["--cap-add", "NET_ADMIN"], "cat /proc/self/status")
        .ok();
    let expected = DOCKER_DEFAULT_CAPS | (1 << 12);
    assert_eq!(
        cap_field(&out.stdout, "CapBnd"),
        expected,
        "CAP_NET_ADMIN (12) missing from the bounding set"
    );
    assert_eq!(cap_field(&out.stdout, "CapEff"), expected);
}

#[test]
fn cap_drop_all_leaves_no_capability() {
    let Some(root) = TestRoot::new("cap_drop_all_leaves_no_capability") else {
        return;
    };
    let out = root
        .sh(&["--cap-drop", "ALL"], "cat /proc/self/status")
        .ok();
    assert_eq!(cap_field(&out.stdout, "CapBnd"), 0);
    assert_eq!(cap_field(&out.stdout, "CapEff"), 0);
    assert_eq!(cap_field(&out.stdout, "CapPrm"), 0);
}

#[test]
fn non_root_user_has_no_effective_capabilities() {
    let Some(root) = TestRoot::new("non_root_user_has_no_effective_capabilities") else {
        return;
    };
    let out = root.sh(&["-u", "1000"], "cat /proc/self/status").ok();
    assert_eq!(cap_field(&out.stdout, "CapEff"), 0);
    assert_eq!(cap_field(&out.stdout, "CapPrm"), 0);
    assert_eq!(cap_field(&out.stdout, "CapBnd"), DOCKER_DEFAULT_CAPS);
}

#[test]
fn no_new_privs_is_set() {
    let Some(root) = TestRoot::new("no_new_privs_is_set") else {
        return;
    };
    let out = root.sh(&[], "cat /proc/self/status").ok();
    assert_eq!(status_field(&out.stdout, "NoNewPrivs"), Some("1"), "{out}");
}

#[test]
fn seccomp_filter_is_active_by_default() {
    let Some(root) = TestRoot::new("seccomp_filter_is_active_by_default") else {
        return;
    };
    let out = root.sh(&[], "cat /proc/self/status").ok();
    assert_eq!(
        status_field(&out.stdout, "Seccomp"),
        Some("2"),
        "expected filter mode\n{out}"
    );
}

#[test]
fn seccomp_unconfined_runs_without_a_filter() {
    let Some(root) = TestRoot::new("seccomp_unconfined_runs_without_a_filter") else {
        return;
    };
    let out = root
        .sh(
            &["--security-opt", "seccomp=unconfined"],
            "cat /proc/self/status",
        )
        .ok();
    assert_eq!(status_field(&out.stdout, "Seccomp"), Some("0"), "{out}");
}

#[test]
fn creating_a_user_namespace_is_refused() {
    let Some(root) = TestRoot::new("creating_a_user_namespace_is_refused") else {
        return;
    };
    let code = format!("{CTYPES}r = libc.unshare(0x10000000)\nprint(r, ctypes.get_errno())\n");
    let out = root.py(&[], &code).ok();
    assert_eq!(
        out.stdout.trim(),
        format!("-1 {EPERM}"),
        "unshare(CLONE_NEWUSER) must fail with EPERM\n{out}"
    );
    let out = root
        .sh(&[], "unshare -U true && echo created || echo refused")
        .ok();
    assert_eq!(out.stdout.trim(), "refused", "{out}");
    // Control: the same call works without the filter, so the filter is what refuses it.
    let out = root
        .py(&["--security-opt", "seccomp=unconfined"], &code)
        .ok();
    assert_eq!(
        out.stdout.trim(),
        "0 0",
        "without seccomp unshare(CLONE_NEWUSER) works\n{out}"
    );
}

#[test]
fn mount_is_refused() {
    let Some(root) = TestRoot::new("mount_is_refused") else {
        return;
    };
    let code = format!(
        "{CTYPES}os.makedirs('/tmp/m', exist_ok=True)\nr = libc.mount(b'none', b'/tmp/m', b'tmpfs', 0, None)\nprint(r, ctypes.get_errno())\n"
    );
    let out = root.py(&[], &code).ok();
    assert_eq!(out.stdout.trim(), format!("-1 {EPERM}"), "{out}");
}

#[test]
fn keyctl_is_refused() {
    let Some(root) = TestRoot::new("keyctl_is_refused") else {
        return;
    };
    // keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, 0)
    let code = format!("{CTYPES}r = libc.syscall(250, 0, -3, 0)\nprint(r, ctypes.get_errno())\n");
    let out = root.py(&[], &code).ok();
    assert_eq!(out.stdout.trim(), format!("-1 {EPERM}"), "{out}");
}

#[test]
fn clone3_fails_with_enosys() {
    let Some(root) = TestRoot::new("clone3_fails_with_enosys") else {
        return;
    };
    let code = format!("{CTYPES}r = libc.syscall(435, None, 0)\nprint(r, ctypes.get_errno())\n");
    let out = root.py(&[], &code).ok();
    assert_eq!(
        out.stdout.trim(),
        format!("-1 {ENOSYS}"),
        "clone3 must fail with ENOSYS (libc falls back to clone)\n{out}"
    );
}

#[test]
fn seccomp_profile_file_is_enforced() {
    let Some(root) = TestRoot::new("seccomp_profile_file_is_enforced") else {
        return;
    };
    let mut profile = tempfile::Builder::new()
        .prefix("nestbox-seccomp-")
        .suffix(".json")
        .tempfile()
        .unwrap();
    std::io::Write::write_all(
        &mut profile,
        br#"{"defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13}]}"#,
    )
    .unwrap();
    let opt = format!("seccomp={}", profile.path().display());
    let code = "import os\ntry:\n    os.mkdir('/tmp/d')\n    print('made')\nexcept OSError as e:\n    print(e.errno)\nprint(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])\n";
    let out = root.py(&["--security-opt", &opt], code).ok();
    assert_eq!(
        out.lines(),
        ["13", "2"],
        "mkdir must fail with the profile's errno 13 under a filter\n{out}"
    );
}

// ---------------------------------------------------------------- /proc, /sys, /dev

#[test]
fn masked_proc_files_read_as_null() {
    let Some(root) = TestRoot::new("masked_proc_files_read_as_null") else {
        return;
    };
    let code = "import os, stat\nfor n in ['kcore', 'keys', 'timer_list', 'sched_debug', 'latency_stats', 'timer_stats']:\n    p = '/proc/' + n\n    if not os.path.exists(p):\n        continue\n    st = os.stat(p)\n    with open(p, 'rb') as f:\n        data = f.read(4096)\n    print(n, stat.S_ISCHR(st.st_mode), os.major(st.st_rdev), os.minor(st.st_rdev), len(data))\n";
    let out = root.py(&[], code).ok();
    let checked: Vec<&str> = out
        .lines()
        .iter()
        .map(|l| l.split_whitespace().next().unwrap_or(""))
        .collect();
    assert!(
        checked.contains(&"timer_list"),
        "/proc/timer_list (present on this host) was not found in the box\n{out}"
    );
    for line in out.lines() {
        let name = line.split_whitespace().next().unwrap();
        assert!(
            line.ends_with(" True 1 3 0"),
            "/proc/{name} is not masked by /dev/null: {line}\n{out}"
        );
    }
}

#[test]
fn masked_proc_dirs_are_empty_read_only_tmpfs() {
    let Some(root) = TestRoot::new("masked_proc_dirs_are_empty_read_only_tmpfs") else {
        return;
    };
    if !nestbox_testkit::require(
        std::path::Path::new("/proc/acpi").exists(),
        "masked_proc_dirs_are_empty_read_only_tmpfs",
        "this kernel has no /proc/acpi",
    ) {
        return;
    }
    let code = "import os\nfor line in open('/proc/self/mountinfo'):\n    f = line.split()\n    if f[4] == '/proc/acpi':\n        print(f[f.index('-') + 1], f[5].split(',')[0])\nprint(len(os.listdir('/proc/acpi')))\n";
    let out = root.py(&[], code).ok();
    assert_eq!(
        out.lines(),
        ["tmpfs ro", "0"],
        "/proc/acpi must be covered by an empty read-only tmpfs\n{out}"
    );
}

#[test]
fn proc_sys_is_read_only() {
    let Some(root) = TestRoot::new("proc_sys_is_read_only") else {
        return;
    };
    let out = root
        .py(
            &[],
            &write_errno_py(&["/proc/sys/kernel/hostname", "/proc/sys/vm/drop_caches"]),
        )
        .ok();
    for line in out.lines() {
        assert!(
            line.ends_with(&format!(" {EROFS}")),
            "writable /proc/sys file: {line}\n{out}"
        );
    }
}

#[test]
fn sysrq_trigger_is_read_only() {
    let Some(root) = TestRoot::new("sysrq_trigger_is_read_only") else {
        return;
    };
    // A kernel built without magic SysRq has no trigger file: then the box
    // must not have one either (nothing may stand in its place), otherwise
    // it must be read-only. Opening only: never write a key to the trigger.
    let expected = if std::path::Path::new("/proc/sysrq-trigger").exists() {
        EROFS
    } else {
        ENOENT
    };
    let code = "import os\ntry:\n    os.close(os.open('/proc/sysrq-trigger', os.O_WRONLY))\n    print('writable')\nexcept OSError as e:\n    print(e.errno)\n";
    let out = root.py(&[], code).ok();
    assert_eq!(out.stdout.trim(), expected, "{out}");
}

#[test]
fn sys_is_read_only() {
    let Some(root) = TestRoot::new("sys_is_read_only") else {
        return;
    };
    let code = "import os\nprint(bool(os.statvfs('/sys').f_flag & os.ST_RDONLY))\ntry:\n    open('/sys/kernel/uevent_helper', 'w').close()\n    print('writable')\nexcept OSError as e:\n    print(e.errno)\n";
    let out = root.py(&[], code).ok();
    assert_eq!(
        out.lines().first(),
        Some(&"True"),
        "/sys is not mounted read-only\n{out}"
    );
    assert_ne!(out.lines().get(1), Some(&"writable"), "{out}");
}

#[test]
fn dev_holds_only_the_minimal_nodes() {
    let Some(root) = TestRoot::new("dev_holds_only_the_minimal_nodes") else {
        return;
    };
    let code = "import os, stat\nfor top, dirs, files in os.walk('/dev'):\n    if top.startswith('/dev/pts') or top.startswith('/dev/shm'):\n        continue\n    for n in dirs + files:\n        p = os.path.join(top, n)\n        st = os.lstat(p)\n        kind = 'blk' if stat.S_ISBLK(st.st_mode) else 'chr' if stat.S_ISCHR(st.st_mode) else 'lnk' if stat.S_ISLNK(st.st_mode) else 'dir' if stat.S_ISDIR(st.st_mode) else 'file'\n        print(p, kind)\n";
    let out = root.py(&[], code).ok();
    let entries: BTreeSet<&str> = out
        .lines()
        .iter()
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    let blocks: Vec<&str> = out.stdout.lines().filter(|l| l.ends_with(" blk")).collect();
    assert!(
        blocks.is_empty(),
        "block devices in the box's /dev: {blocks:?}"
    );
    let allowed = [
        "null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm", "fd", "stdin",
        "stdout", "stderr", "console", "mqueue", "core",
    ];
    let extra: Vec<&&str> = entries
        .iter()
        .filter(|p| !allowed.iter().any(|a| **p == format!("/dev/{a}")))
        .collect();
    assert!(
        extra.is_empty(),
        "unexpected entries in the box's /dev: {extra:?}\n{out}"
    );
    for needed in [
        "null", "zero", "full", "random", "urandom", "tty", "ptmx", "pts", "shm",
    ] {
        assert!(
            entries.contains(format!("/dev/{needed}").as_str()),
            "/dev/{needed} missing\n{out}"
        );
    }
}

#[test]
fn dev_nodes_work() {
    let Some(root) = TestRoot::new("dev_nodes_work") else {
        return;
    };
    let code = "import os, errno\nopen('/dev/null', 'w').write('x')\nprint(len(open('/dev/urandom', 'rb').read(16)), open('/dev/zero', 'rb').read(4) == bytes(4))\ntry:\n    with open('/dev/full', 'w') as f:\n        f.write('x')\nexcept OSError as e:\n    print(e.errno == errno.ENOSPC)\nm, s = os.openpty()\nprint(os.ttyname(s).startswith('/dev/pts/'))\n";
    let out = root.py(&[], code).ok();
    assert_eq!(out.lines(), ["16 True", "True", "True"], "{out}");
}

#[test]
fn network_namespace_has_only_loopback_and_its_own_veth() {
    let Some(root) = TestRoot::new("network_namespace_has_only_loopback_and_its_own_veth") else {
        return;
    };
    let links = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '";
    let out = root.sh(&["--network", "none"], links).ok();
    assert_eq!(
        out.stdout.trim(),
        "lo",
        "with --network none the box has no interface but loopback\n{out}"
    );
    let out = root.sh(&[], links).ok();
    assert_eq!(
        out.stdout.trim(),
        "eth0 lo",
        "a bridged box sees only loopback and its own end of its veth\n{out}"
    );
}

#[test]
fn cgroup_namespace_hides_host_cgroup_paths() {
    let Some(root) = TestRoot::new("cgroup_namespace_hides_host_cgroup_paths") else {
        return;
    };
    let out = root.sh(&[], "cat /proc/self/cgroup").ok();
    assert!(!out.stdout.trim().is_empty(), "{out}");
    for line in out.lines() {
        assert!(
            line.ends_with(":/"),
            "the box sees a host cgroup path: {line}\n{out}"
        );
    }
}

// ---------------------------------------------------------------- mounts and volumes

#[test]
fn read_only_root_refuses_writes() {
    let Some(root) = TestRoot::new("read_only_root_refuses_writes") else {
        return;
    };
    let out = root
        .py(
            &["--read-only"],
            &write_errno_py(&["/etc/x", "/usr/x", "/x", "/tmp/x", "/root/x"]),
        )
        .ok();
    assert_eq!(out.lines().len(), 5, "{out}");
    for line in out.lines() {
        assert!(
            line.ends_with(&format!(" {EROFS}")),
            "writable with --read-only: {line}\n{out}"
        );
    }
}

#[test]
fn read_only_root_with_tmpfs_keeps_tmp_writable() {
    let Some(root) = TestRoot::new("read_only_root_with_tmpfs_keeps_tmp_writable") else {
        return;
    };
    let out = root
        .py(
            &["--read-only", "--tmpfs", "/tmp"],
            &write_errno_py(&["/tmp/x", "/etc/x"]),
        )
        .ok();
    assert_eq!(
        out.lines(),
        ["/tmp/x ok", &format!("/etc/x {EROFS}")],
        "{out}"
    );
}

#[test]
fn tmpfs_option_mounts_an_empty_writable_tmpfs() {
    let Some(root) = TestRoot::new("tmpfs_option_mounts_an_empty_writable_tmpfs") else {
        return;
    };
    let script = "awk '$5 == \"/scratch\" {for (i = 7; $i != \"-\"; i++); print $(i+1)}' /proc/self/mountinfo; ls -A /scratch; echo hi > /scratch/f && cat /scratch/f";
    let out = root.sh(&["--tmpfs", "/scratch"], script).ok();
    assert_eq!(out.lines(), ["tmpfs", "hi"], "{out}");
}

#[test]
fn volume_is_shared_read_write_with_the_host() {
    let Some(root) = TestRoot::new("volume_is_shared_read_write_with_the_host") else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("nestbox-vol-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::write(dir.path().join("in.txt"), "from-host\n").unwrap();
    let vol = format!("{}:/data", dir.path().display());
    let out = root
        .sh(
            &["-v", &vol],
            "cat /data/in.txt && echo from-box > /data/out.txt",
        )
        .ok();
    assert_eq!(out.stdout.trim(), "from-host", "{out}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("out.txt")).unwrap(),
        "from-box\n"
    );
}

#[test]
fn read_only_volume_refuses_writes() {
    let Some(root) = TestRoot::new("read_only_volume_refuses_writes") else {
        return;
    };
    let dir = tempfile::Builder::new()
        .prefix("nestbox-vol-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::fs::write(dir.path().join("in.txt"), "from-host\n").unwrap();
    let vol = format!("{}:/data:ro", dir.path().display());
    let code = format!(
        "print(open('/data/in.txt').read().strip())\n{}",
        write_errno_py(&["/data/in.txt", "/data/new.txt"])
    );
    let out = root.py(&["-v", &vol], &code).ok();
    assert_eq!(
        out.lines(),
        [
            "from-host",
            &format!("/data/in.txt {EROFS}"),
            &format!("/data/new.txt {EROFS}")
        ],
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("in.txt")).unwrap(),
        "from-host\n"
    );
    assert!(!dir.path().join("new.txt").exists());
}

// ---------------------------------------------------------------- environment, user, user namespace

#[test]
fn env_option_sets_variables() {
    let Some(root) = TestRoot::new("env_option_sets_variables") else {
        return;
    };
    let out = root
        .sh(
            &["-e", "FOO=bar baz", "-e", "EMPTY="],
            "echo \"$FOO|${EMPTY-unset}|\"",
        )
        .ok();
    assert_eq!(out.stdout.trim(), "bar baz||", "{out}");
}

#[test]
fn default_environment_has_path_home_and_hostname() {
    let Some(root) = TestRoot::new("default_environment_has_path_home_and_hostname") else {
        return;
    };
    let out = root
        .sh(
            &["--name", "iso-env"],
            "echo $PATH; echo $HOME; echo $HOSTNAME",
        )
        .ok();
    assert_eq!(
        out.lines(),
        [
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "/root",
            "iso-env"
        ],
        "{out}"
    );
}

#[test]
fn host_environment_does_not_leak_into_the_box() {
    let Some(root) = TestRoot::new("host_environment_does_not_leak_into_the_box") else {
        return;
    };
    let mut cmd = root.command(&[
        "run",
        "--",
        "sh",
        "-c",
        "echo \"${NESTBOX_TEST_SECRET-unset}\"",
    ]);
    cmd.env("NESTBOX_TEST_SECRET", "host-value");
    let out = finish(
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
        None,
        COMMAND_TIMEOUT,
        "nestbox run -- sh -c 'echo $NESTBOX_TEST_SECRET'".into(),
    )
    .ok();
    assert_eq!(out.stdout.trim(), "unset", "{out}");
}

#[test]
fn workdir_option_sets_the_working_directory() {
    let Some(root) = TestRoot::new("workdir_option_sets_the_working_directory") else {
        return;
    };
    let out = root.sh(&["-w", "/tmp/work/dir"], "pwd").ok();
    assert_eq!(out.stdout.trim(), "/tmp/work/dir", "{out}");
}

#[test]
fn user_option_sets_uid_and_gid() {
    let Some(root) = TestRoot::new("user_option_sets_uid_and_gid") else {
        return;
    };
    let out = root.sh(&["-u", "1000:1001"], "id -u; id -g; id -G").ok();
    assert_eq!(out.lines(), ["1000", "1001", "1001"], "{out}");
}

#[test]
fn userns_option_maps_box_root_to_an_unprivileged_host_uid() {
    let Some(root) = TestRoot::new("userns_option_maps_box_root_to_an_unprivileged_host_uid")
    else {
        return;
    };
    let out = root
        .sh(
            &["--userns"],
            "id -u; cat /proc/self/uid_map; cat /proc/self/gid_map",
        )
        .ok();
    let lines = out.lines();
    assert_eq!(lines.first(), Some(&"0"), "root in the box\n{out}");
    for map in &lines[1..] {
        let f: Vec<u64> = map.split_whitespace().map(|x| x.parse().unwrap()).collect();
        assert_eq!(f.len(), 3, "{out}");
        assert_eq!(f[0], 0, "the map starts at id 0 in the box\n{out}");
        assert_ne!(f[1], 0, "box root must not be host root\n{out}");
        assert!(f[2] >= 1, "{out}");
    }
    assert_eq!(lines.len(), 3, "one uid and one gid range\n{out}");
}

#[test]
fn userns_box_processes_are_unprivileged_on_the_host() {
    let Some(root) = TestRoot::new("userns_box_processes_are_unprivileged_on_the_host") else {
        return;
    };
    root.detached_sh("iso-userns", &["--userns"], "echo ready; sleep 60");
    root.wait_log("iso-userns", "ready", Duration::from_secs(20));
    let v = root.inspect("iso-userns");
    let pids: Vec<i64> = v["pids"]
        .as_array()
        .expect("pids")
        .iter()
        .filter_map(|p| p.as_i64())
        .collect();
    assert!(!pids.is_empty(), "inspect lists no pids: {v}");
    for pid in pids {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let uid = status_field(&status, "Uid").unwrap();
        assert!(
            uid.split_whitespace().all(|u| u != "0"),
            "box process {pid} runs as host root: Uid {uid}"
        );
    }
}
