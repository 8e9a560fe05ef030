//! Every error is one line on stderr starting `nestbox: error:`, exits 125 (or the
//! command's 126/127), and leaves nothing behind: no box listed, no record or data
//! directory, no cgroup.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::*;

/// Run `args`, expect the error, and expect the root to hold no box afterwards.
#[track_caller]
fn refused(root: &TestRoot, args: &[&str], code: i32, fragment: &str) {
    let out = root.run(args);
    assert_error(&out, code, fragment);
    root.assert_no_boxes();
}

#[test]
fn duplicate_name_is_refused() {
    let Some(root) = TestRoot::new("duplicate_name_is_refused") else {
        return;
    };
    root.detached_sh("err-dup", &[], "sleep 60");
    let out = root.run(&["run", "--name", "err-dup", "--", "true"]);
    assert_error(&out, 125, "err-dup");
    assert_eq!(root.names(), ["err-dup"], "exactly the first box exists");
    assert_eq!(
        root.status("err-dup").as_deref(),
        Some("running"),
        "the first box is untouched"
    );
    let out = root.run(&["run", "-d", "--name", "err-dup", "--", "true"]);
    assert_error(&out, 125, "err-dup");
    assert_eq!(root.names(), ["err-dup"]);
}

#[test]
fn unknown_box_is_reported_by_every_command() {
    let Some(root) = TestRoot::new("unknown_box_is_reported_by_every_command") else {
        return;
    };
    let commands: [&[&str]; 7] = [
        &["inspect", "err-nope"],
        &["logs", "err-nope"],
        &["stop", "err-nope"],
        &["kill", "err-nope"],
        &["rm", "err-nope"],
        &["stats", "err-nope"],
        &["exec", "err-nope", "--", "true"],
    ];
    for args in commands {
        refused(&root, args, 125, "err-nope");
    }
}

#[test]
fn invalid_memory_size_is_refused() {
    let Some(root) = TestRoot::new("invalid_memory_size_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--memory", "12zz", "--", "true"],
        125,
        "--memory",
    );
}

#[test]
fn memory_below_the_minimum_is_refused() {
    let Some(root) = TestRoot::new("memory_below_the_minimum_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--memory", "1k", "--", "true"],
        125,
        "minimum",
    );
}

#[test]
fn missing_command_is_refused() {
    let Some(root) = TestRoot::new("missing_command_is_refused") else {
        return;
    };
    refused(&root, &["run"], 125, "missing command");
    refused(
        &root,
        &["run", "--name", "err-nocmd", "--"],
        125,
        "missing command",
    );
    refused(&root, &["run", "--", ""], 125, "missing command");
}

#[test]
fn command_not_found_is_one_line_with_127() {
    let Some(root) = TestRoot::new("command_not_found_is_one_line_with_127") else {
        return;
    };
    refused(
        &root,
        &["run", "--rm", "--", "nestbox-no-such-command"],
        127,
        "nestbox-no-such-command",
    );
    // Without --rm the box stays, exited with 127, like any other box.
    let out = root.run(&[
        "run",
        "--name",
        "err-notfound",
        "--",
        "nestbox-no-such-command",
    ]);
    assert_error(&out, 127, "nestbox-no-such-command");
}

#[test]
fn missing_volume_source_is_refused() {
    let Some(root) = TestRoot::new("missing_volume_source_is_refused") else {
        return;
    };
    let missing = format!("/var/tmp/{}", unique("nestbox-missing"));
    refused(
        &root,
        &["run", "-v", &format!("{missing}:/data"), "--", "true"],
        125,
        "does not exist",
    );
}

#[test]
fn malformed_volume_is_refused() {
    let Some(root) = TestRoot::new("malformed_volume_is_refused") else {
        return;
    };
    refused(&root, &["run", "-v", "/tmp", "--", "true"], 125, "--volume");
    refused(
        &root,
        &["run", "-v", "/tmp:/data:xx", "--", "true"],
        125,
        "--volume",
    );
    refused(
        &root,
        &["run", "-v", "/tmp:relative", "--", "true"],
        125,
        "absolute",
    );
}

#[test]
fn exec_into_a_stopped_box_is_refused() {
    let Some(root) = TestRoot::new("exec_into_a_stopped_box_is_refused") else {
        return;
    };
    root.run(&["run", "--name", "err-stopped", "--", "true"])
        .ok();
    let out = root.run(&["exec", "err-stopped", "--", "true"]);
    assert_error(&out, 125, "not running");
}

#[test]
fn rm_of_a_running_box_without_force_is_refused() {
    let Some(root) = TestRoot::new("rm_of_a_running_box_without_force_is_refused") else {
        return;
    };
    root.detached_sh("err-rm-running", &[], "sleep 60");
    let out = root.run(&["rm", "err-rm-running"]);
    assert_error(&out, 125, "running");
    assert_eq!(
        root.status("err-rm-running").as_deref(),
        Some("running"),
        "the box must survive a refused rm"
    );
}

#[test]
fn zero_cpus_is_refused() {
    let Some(root) = TestRoot::new("zero_cpus_is_refused") else {
        return;
    };
    refused(&root, &["run", "--cpus", "0", "--", "true"], 125, "cpus");
    refused(&root, &["run", "--cpus=-1", "--", "true"], 125, "cpus");
}

#[test]
fn cpuset_outside_this_machine_is_refused() {
    let Some(root) = TestRoot::new("cpuset_outside_this_machine_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--cpuset-cpus", "999", "--", "true"],
        125,
        "cpu",
    );
    refused(
        &root,
        &["run", "--cpuset-cpus", "zero", "--", "true"],
        125,
        "cpu",
    );
}

#[test]
fn unknown_capability_is_refused() {
    let Some(root) = TestRoot::new("unknown_capability_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--cap-add", "FLY", "--", "true"],
        125,
        "FLY",
    );
    refused(
        &root,
        &["run", "--cap-drop", "CAP_NOPE", "--", "true"],
        125,
        "CAP_NOPE",
    );
}

#[test]
fn non_numeric_user_is_refused() {
    let Some(root) = TestRoot::new("non_numeric_user_is_refused") else {
        return;
    };
    refused(&root, &["run", "-u", "bob", "--", "true"], 125, "--user");
    refused(
        &root,
        &["run", "-u", "1000:staff", "--", "true"],
        125,
        "--user",
    );
}

#[test]
fn invalid_box_name_is_refused() {
    let Some(root) = TestRoot::new("invalid_box_name_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--name", "../escape", "--", "true"],
        125,
        "name",
    );
    refused(&root, &["run", "--name=-dash", "--", "true"], 125, "name");
    // Pooled clones are told apart by this prefix: no box may take it.
    refused(
        &root,
        &["run", "--name", "pool.x", "--", "true"],
        125,
        "reserved for template pools",
    );
}

#[test]
fn invalid_hostname_is_refused() {
    let Some(root) = TestRoot::new("invalid_hostname_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--hostname", "bad_host!", "--", "true"],
        125,
        "hostname",
    );
}

#[test]
fn env_without_equals_is_refused() {
    let Some(root) = TestRoot::new("env_without_equals_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "-e", "NOEQUALS", "--", "true"],
        125,
        "KEY=VALUE",
    );
}

#[test]
fn relative_workdir_is_refused() {
    let Some(root) = TestRoot::new("relative_workdir_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "-w", "relative/dir", "--", "true"],
        125,
        "absolute",
    );
}

#[test]
fn unsupported_security_option_is_refused() {
    let Some(root) = TestRoot::new("unsupported_security_option_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--security-opt", "apparmor=foo", "--", "true"],
        125,
        "security-opt",
    );
}

#[test]
fn missing_seccomp_profile_is_refused() {
    let Some(root) = TestRoot::new("missing_seccomp_profile_is_refused") else {
        return;
    };
    let missing = format!("/var/tmp/{}.json", unique("nestbox-missing"));
    refused(
        &root,
        &[
            "run",
            "--security-opt",
            &format!("seccomp={missing}"),
            "--",
            "true",
        ],
        125,
        "seccomp",
    );
}

#[test]
fn malformed_seccomp_profile_is_refused() {
    let Some(root) = TestRoot::new("malformed_seccomp_profile_is_refused") else {
        return;
    };
    let mut f = tempfile::Builder::new()
        .prefix("nestbox-bad-")
        .suffix(".json")
        .tempfile()
        .unwrap();
    std::io::Write::write_all(
        &mut f,
        b"{\"defaultAction\": \"SCMP_ACT_NONSENSE\", \"syscalls\": [",
    )
    .unwrap();
    refused(
        &root,
        &[
            "run",
            "--security-opt",
            &format!("seccomp={}", f.path().display()),
            "--",
            "true",
        ],
        125,
        "",
    );
}

#[test]
fn unknown_image_is_refused() {
    let Some(root) = TestRoot::new("unknown_image_is_refused") else {
        return;
    };
    refused(
        &root,
        &["run", "--image", "debian-nope", "--", "true"],
        125,
        "debian-nope",
    );
}

#[test]
fn unknown_signal_is_refused() {
    let Some(root) = TestRoot::new("unknown_signal_is_refused") else {
        return;
    };
    root.detached_sh("err-signal", &[], "sleep 60");
    let out = root.run(&["kill", "-s", "NOPE", "err-signal"]);
    assert_error(&out, 125, "NOPE");
    assert_eq!(root.status("err-signal").as_deref(), Some("running"));
}

#[test]
fn kill_of_an_exited_box_is_refused() {
    let Some(root) = TestRoot::new("kill_of_an_exited_box_is_refused") else {
        return;
    };
    root.run(&["run", "--name", "err-kill-exited", "--", "true"])
        .ok();
    let out = root.run(&["kill", "err-kill-exited"]);
    assert_error(&out, 125, "not running");
}

#[test]
fn malformed_option_value_is_one_error_line_with_125() {
    let Some(root) = TestRoot::new("malformed_option_value_is_one_error_line_with_125") else {
        return;
    };
    refused(&root, &["run", "--pids", "many", "--", "true"], 125, "pids");
}

#[test]
fn failure_after_creating_the_cgroup_leaves_no_cgroup() {
    let Some(root) = TestRoot::new("failure_after_creating_the_cgroup_leaves_no_cgroup") else {
        return;
    };
    // A running box of the same root shows how this root names its cgroups.
    root.detached_sh("err-witness", &[], "sleep 60");
    let witness: BTreeSet<PathBuf> = cgroup_paths(&root.inspect("err-witness"))
        .into_values()
        .map(|p| p.canonicalize().unwrap())
        .collect();
    // The workdir is a file in the box, so the command fails after the cgroup and
    // layers exist; whatever was made for the failed box must be gone again.
    let out = root.run(&[
        "run",
        "--name",
        "err-late",
        "--memory",
        "64m",
        "-w",
        "/etc/passwd",
        "--",
        "true",
    ]);
    assert_error(&out, 125, "/etc/passwd");
    assert_eq!(
        root.names(),
        ["err-witness"],
        "the failed box must not be recorded"
    );
    let left: BTreeSet<PathBuf> = root.cgroup_dirs().into_iter().collect();
    let extra: Vec<&PathBuf> = left.difference(&witness).collect();
    assert!(
        extra.is_empty(),
        "cgroups of the failed box are left: {extra:?}"
    );
}
