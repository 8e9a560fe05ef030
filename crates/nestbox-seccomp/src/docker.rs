//! Loading Docker / OCI-format seccomp profile files (the format of moby's
//! `profiles/seccomp/default.json` and of `docker run --security-opt seccomp=FILE`).
//!
//! Supported:
//! * `defaultAction`, `defaultErrnoRet`;
//! * `syscalls[]` entries with `names` (or the old single `name`), `action`,
//!   `errnoRet`, `args[]` (`index`, `value`, `valueTwo`, `op`);
//! * actions `SCMP_ACT_ALLOW`, `SCMP_ACT_ERRNO`, `SCMP_ACT_KILL` (kills the thread, as
//!   in libseccomp), `SCMP_ACT_KILL_THREAD`, `SCMP_ACT_KILL_PROCESS`, `SCMP_ACT_TRAP`,
//!   `SCMP_ACT_LOG`; ops `SCMP_CMP_EQ`, `_NE`, `_LT`, `_LE`, `_GT`, `_GE`,
//!   `_MASKED_EQ` (`value` is the mask, `valueTwo` the expected result);
//! * `includes` / `excludes` with `caps` and `arches`, evaluated like Docker does for
//!   a box holding the given capabilities on `amd64`.
//!
//! Semantics and limits, as Docker/runc would apply the file, except where noted:
//! * `SCMP_ACT_ERRNO` without `errnoRet` returns `EPERM` (per entry and default);
//! * an entry's conditions are ANDed, unless one argument index appears twice, in
//!   which case each condition becomes its own rule (runc's behaviour);
//! * syscall names unknown on x86_64 are skipped, like libseccomp does;
//! * entries are tried in file order and the first match wins (libseccomp merges
//!   rules instead; the two agree unless entries for one syscall overlap);
//! * `minKernel` in `includes`/`excludes` is taken as satisfied (the running kernel is
//!   assumed to be newer than any version the file names);
//! * `architectures`, `archMap`, `flags`, `listenerPath`, `listenerMetadata` and
//!   `comment` are ignored: the filter always checks for native x86_64, kills
//!   foreign-architecture calls and gives x32 calls [`Profile::x32_action`];
//! * `SCMP_ACT_TRACE` and `SCMP_ACT_NOTIFY` are rejected (no tracer or listener).

use std::collections::BTreeSet;

use serde::Deserialize;

use crate::error::SeccompError;
use crate::profile::{Action, ArgCondition, CmpOp, Profile, Rule, EPERM, MAX_ERRNO};
use crate::sysno::syscall_number;

/// Top level of the file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileProfile {
    default_action: Option<String>,
    default_errno_ret: Option<u64>,
    syscalls: Option<Vec<FileSyscall>>,
}

/// One `syscalls[]` entry.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileSyscall {
    names: Option<Vec<String>>,
    name: Option<String>,
    action: Option<String>,
    errno_ret: Option<u64>,
    args: Option<Vec<FileArg>>,
    includes: Option<FileFilter>,
    excludes: Option<FileFilter>,
}

/// One `args[]` condition.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileArg {
    index: Option<u64>,
    value: Option<u64>,
    value_two: Option<u64>,
    op: Option<String>,
}

/// `includes` / `excludes`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileFilter {
    caps: Option<Vec<String>>,
    arches: Option<Vec<String>>,
}

/// Architecture names an `includes`/`excludes` `arches` list uses for us.
const NATIVE_ARCHES: [&str; 2] = ["amd64", "x86_64"];

impl Profile {
    /// Load a Docker/OCI-format profile for a box holding no capabilities that the
    /// file gates on (see the module documentation for what is supported).
    ///
    /// # Errors
    /// [`SeccompError::Json`] for malformed JSON or wrongly typed fields;
    /// [`SeccompError::ProfileField`] naming the field for bad values, e.g.
    /// `seccomp profile: syscalls[3].action: unknown action "SCMP_ACT_FOO"`.
    pub fn from_docker_json(text: &str) -> Result<Profile, SeccompError> {
        Profile::from_docker_json_with_caps(text, &[] as &[&str])
    }

    /// Like [`Profile::from_docker_json`], evaluating `includes.caps` /
    /// `excludes.caps` for a box holding `caps` (names like `CAP_SYS_ADMIN`; the
    /// `CAP_` prefix is optional and case does not matter).
    pub fn from_docker_json_with_caps<S: AsRef<str>>(
        text: &str,
        caps: &[S],
    ) -> Result<Profile, SeccompError> {
        let file: FileProfile = serde_json::from_str(text).map_err(SeccompError::Json)?;
        let caps: BTreeSet<String> = caps.iter().map(|c| normalize_cap(c.as_ref())).collect();

        let default = file
            .default_action
            .as_deref()
            .ok_or_else(|| SeccompError::field("defaultAction", "missing"))?;
        let default_action = parse_action(
            default,
            file.default_errno_ret,
            "defaultAction",
            "defaultErrnoRet",
        )?;
        let mut profile = Profile::new(default_action);

        for (i, entry) in file.syscalls.iter().flatten().enumerate() {
            let at = |field: &str| format!("syscalls[{i}].{field}");
            let action = entry
                .action
                .as_deref()
                .ok_or_else(|| SeccompError::field(at("action"), "missing"))?;
            let action = parse_action(action, entry.errno_ret, &at("action"), &at("errnoRet"))?;
            let conditions = entry
                .args
                .iter()
                .flatten()
                .enumerate()
                .map(|(j, arg)| parse_arg(arg, &at(&format!("args[{j}]"))))
                .collect::<Result<Vec<_>, _>>()?;
            let names = match (&entry.names, &entry.name) {
                (Some(names), _) => names.clone(),
                (None, Some(name)) => vec![name.clone()],
                (None, None) => return Err(SeccompError::field(at("names"), "missing")),
            };
            if !applies(entry, &caps) {
                continue;
            }
            // runc: a repeated argument index turns the ANDed conditions into
            // separate (ORed) rules.
            let mut seen = [false; 6];
            let repeated = conditions
                .iter()
                .any(|c| std::mem::replace(&mut seen[usize::from(c.arg)], true));
            let rule_sets: Vec<Vec<ArgCondition>> = if repeated {
                conditions.iter().map(|c| vec![*c]).collect()
            } else {
                vec![conditions]
            };
            for nr in names.iter().filter_map(|n| syscall_number(n)) {
                for set in &rule_sets {
                    profile.push(Rule {
                        syscall: nr,
                        action,
                        conditions: set.clone(),
                    });
                }
            }
        }
        Ok(profile)
    }
}

/// `cap_sys_admin` / `SYS_ADMIN` -> `CAP_SYS_ADMIN`.
fn normalize_cap(name: &str) -> String {
    let upper = name.trim().to_ascii_uppercase();
    if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    }
}

/// Docker's include/exclude evaluation for `caps` on amd64 (`minKernel` assumed met).
fn applies(entry: &FileSyscall, caps: &BTreeSet<String>) -> bool {
    let native = |arches: &Option<Vec<String>>| {
        arches
            .iter()
            .flatten()
            .any(|a| NATIVE_ARCHES.contains(&a.to_ascii_lowercase().as_str()))
    };
    let list = |v: &Option<Vec<String>>| v.as_ref().is_some_and(|v| !v.is_empty());
    if let Some(ex) = &entry.excludes {
        if native(&ex.arches)
            || ex
                .caps
                .iter()
                .flatten()
                .any(|c| caps.contains(&normalize_cap(c)))
        {
            return false;
        }
    }
    if let Some(inc) = &entry.includes {
        if list(&inc.arches) && !native(&inc.arches) {
            return false;
        }
        if !inc
            .caps
            .iter()
            .flatten()
            .all(|c| caps.contains(&normalize_cap(c)))
        {
            return false;
        }
    }
    true
}

/// Parse an `SCMP_ACT_*` name with its optional errno.
fn parse_action(
    name: &str,
    errno: Option<u64>,
    path: &str,
    errno_path: &str,
) -> Result<Action, SeccompError> {
    let action = match name {
        "SCMP_ACT_ALLOW" => Action::Allow,
        "SCMP_ACT_ERRNO" => {
            let errno = match errno {
                None => EPERM,
                Some(e) => u16::try_from(e)
                    .ok()
                    .filter(|e| *e <= MAX_ERRNO)
                    .ok_or_else(|| {
                        SeccompError::field(
                            errno_path,
                            format!("errno {e} is out of range 0..={MAX_ERRNO}"),
                        )
                    })?,
            };
            return Ok(Action::Errno(errno));
        }
        "SCMP_ACT_KILL" | "SCMP_ACT_KILL_THREAD" => Action::KillThread,
        "SCMP_ACT_KILL_PROCESS" => Action::KillProcess,
        "SCMP_ACT_TRAP" => Action::Trap,
        "SCMP_ACT_LOG" => Action::Log,
        "SCMP_ACT_TRACE" | "SCMP_ACT_NOTIFY" => {
            return Err(SeccompError::field(
                path,
                format!("action {name:?} is not supported by nestbox"),
            ));
        }
        other => {
            return Err(SeccompError::field(
                path,
                format!("unknown action {other:?}"),
            ))
        }
    };
    if let Some(e) = errno {
        return Err(SeccompError::field(
            errno_path,
            format!("errnoRet {e} given for {name}, which takes none"),
        ));
    }
    Ok(action)
}

/// Parse one `args[]` condition at `path`.
fn parse_arg(arg: &FileArg, path: &str) -> Result<ArgCondition, SeccompError> {
    let index = arg
        .index
        .ok_or_else(|| SeccompError::field(format!("{path}.index"), "missing"))?;
    let index = u8::try_from(index)
        .ok()
        .filter(|i| *i <= 5)
        .ok_or_else(|| {
            SeccompError::field(
                format!("{path}.index"),
                format!("{index} is out of range 0..=5"),
            )
        })?;
    let value = arg.value.unwrap_or(0);
    let op_name = arg
        .op
        .as_deref()
        .ok_or_else(|| SeccompError::field(format!("{path}.op"), "missing"))?;
    let (op, value) = match op_name {
        "SCMP_CMP_EQ" => (CmpOp::Eq, value),
        "SCMP_CMP_NE" => (CmpOp::Ne, value),
        "SCMP_CMP_LT" => (CmpOp::Lt, value),
        "SCMP_CMP_LE" => (CmpOp::Le, value),
        "SCMP_CMP_GT" => (CmpOp::Gt, value),
        "SCMP_CMP_GE" => (CmpOp::Ge, value),
        "SCMP_CMP_MASKED_EQ" => (CmpOp::MaskedEq(value), arg.value_two.unwrap_or(0)),
        other => {
            return Err(SeccompError::field(
                format!("{path}.op"),
                format!("unknown operator {other:?}"),
            ))
        }
    };
    Ok(ArgCondition::new(index, op, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interp::{run, Data};
    use crate::profile::ENOSYS;

    fn nr(name: &str) -> u32 {
        syscall_number(name).unwrap()
    }

    fn err(text: &str) -> String {
        Profile::from_docker_json(text).unwrap_err().to_string()
    }

    /// An allow-list profile in the shape of Docker's default (written for this test).
    const ALLOWLIST: &str = r#"{
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 1,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": ["read", "write", "exit_group", "not_a_syscall", "mmap2"], "action": "SCMP_ACT_ALLOW"},
            {"names": ["socket"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 38, "op": "SCMP_CMP_LT"}]},
            {"names": ["mount", "umount2"], "action": "SCMP_ACT_ALLOW",
             "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": 0, "value": 2114060288, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
             "excludes": {"caps": ["CAP_SYS_ADMIN"], "arches": ["s390x"]}},
            {"names": ["clone"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38,
             "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["amd64", "x32"]}},
            {"names": ["getcpu"], "action": "SCMP_ACT_ALLOW", "includes": {"arches": ["arm64"]}},
            {"names": ["getppid"], "action": "SCMP_ACT_ALLOW", "excludes": {"arches": ["amd64"]}},
            {"names": ["ptrace"], "action": "SCMP_ACT_ALLOW", "includes": {"minKernel": "4.8"}},
            {"name": "getpid", "action": "SCMP_ACT_LOG"},
            {"names": ["kill"], "action": "SCMP_ACT_KILL"},
            {"names": ["tkill"], "action": "SCMP_ACT_KILL_PROCESS"},
            {"names": ["tgkill"], "action": "SCMP_ACT_TRAP", "comment": "ignored", "args": null}
        ]
    }"#;

    #[test]
    fn allowlist_profile() {
        let p = Profile::from_docker_json(ALLOWLIST).unwrap();
        assert_eq!(p.default_action, Action::Errno(EPERM));
        assert_eq!(p.x32_action, Action::Errno(EPERM));
        let prog = p.compile().unwrap();
        let call = |name: &str, a0: u64| run(&prog, &Data::x86_64(nr(name), [a0, 0, 0, 0, 0, 0]));
        assert_eq!(call("read", 0), Action::Allow);
        assert_eq!(call("exit_group", 0), Action::Allow);
        assert_eq!(call("openat", 0), Action::Errno(EPERM));
        assert_eq!(call("socket", 2), Action::Allow);
        assert_eq!(call("socket", 38), Action::Errno(EPERM));
        assert_eq!(call("mount", 0), Action::Errno(EPERM));
        assert_eq!(call("clone", 17), Action::Allow);
        assert_eq!(call("clone", 0x1000_0011), Action::Errno(EPERM));
        assert_eq!(call("clone3", 0), Action::Errno(ENOSYS));
        assert_eq!(call("arch_prctl", 0), Action::Allow);
        assert_eq!(call("ptrace", 0), Action::Allow);
        assert_eq!(call("getpid", 0), Action::Log);
        assert_eq!(call("kill", 0), Action::KillThread);
        assert_eq!(call("tkill", 0), Action::KillProcess);
        assert_eq!(call("tgkill", 0), Action::Trap);
        // Entries for other architectures do not apply.
        assert_eq!(call("getcpu", 0), Action::Errno(EPERM));
        assert_eq!(call("getppid", 0), Action::Errno(EPERM));
        // mmap2 and not_a_syscall do not exist on x86_64 and are skipped.
        assert_eq!(
            p.rules
                .iter()
                .filter(|r| r.action == Action::Allow && r.conditions.is_empty())
                .count(),
            5
        );
    }

    #[test]
    fn capabilities_select_entries() {
        let p = Profile::from_docker_json_with_caps(ALLOWLIST, &["sys_admin"]).unwrap();
        let prog = p.compile().unwrap();
        let call = |name: &str, a0: u64| run(&prog, &Data::x86_64(nr(name), [a0, 0, 0, 0, 0, 0]));
        assert_eq!(call("mount", 0), Action::Allow);
        assert_eq!(call("clone", 0x1000_0011), Action::Allow);
        assert_eq!(call("clone3", 0), Action::Errno(EPERM));
    }

    #[test]
    fn repeated_index_means_or() {
        let text = r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
            {"names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": 22,
             "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"},
                      {"index": 0, "value": 2, "op": "SCMP_CMP_EQ"}]},
            {"names": ["write"], "action": "SCMP_ACT_ERRNO",
             "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"},
                      {"index": 2, "value": 10, "op": "SCMP_CMP_GE"}]}
        ]}"#;
        let p = Profile::from_docker_json(text).unwrap();
        let prog = p.compile().unwrap();
        let call = |name: &str, args: [u64; 6]| run(&prog, &Data::x86_64(nr(name), args));
        assert_eq!(call("personality", [1, 0, 0, 0, 0, 0]), Action::Errno(22));
        assert_eq!(call("personality", [2, 0, 0, 0, 0, 0]), Action::Errno(22));
        assert_eq!(call("personality", [3, 0, 0, 0, 0, 0]), Action::Allow);
        assert_eq!(call("write", [1, 0, 10, 0, 0, 0]), Action::Errno(EPERM));
        assert_eq!(call("write", [1, 0, 9, 0, 0, 0]), Action::Allow);
        assert_eq!(call("write", [2, 0, 10, 0, 0, 0]), Action::Allow);
    }

    #[test]
    fn all_ops_parse() {
        let text = r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"],
            "action": "SCMP_ACT_ERRNO", "args": [
            {"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}, {"index": 1, "value": 2, "op": "SCMP_CMP_NE"},
            {"index": 2, "value": 3, "op": "SCMP_CMP_LT"}, {"index": 3, "value": 4, "op": "SCMP_CMP_LE"},
            {"index": 4, "value": 5, "op": "SCMP_CMP_GT"},
            {"index": 5, "value": 255, "valueTwo": 6, "op": "SCMP_CMP_MASKED_EQ"}]}]}"#;
        let p = Profile::from_docker_json(text).unwrap();
        let ops: Vec<(u8, CmpOp, u64)> = p.rules[0]
            .conditions
            .iter()
            .map(|c| (c.arg, c.op, c.value))
            .collect();
        assert_eq!(
            ops,
            [
                (0, CmpOp::Eq, 1),
                (1, CmpOp::Ne, 2),
                (2, CmpOp::Lt, 3),
                (3, CmpOp::Le, 4),
                (4, CmpOp::Gt, 5),
                (5, CmpOp::MaskedEq(255), 6)
            ]
        );
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(
            err(r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
                {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["read"], "action": "SCMP_ACT_ALLOW"},
                {"names": ["read"], "action": "SCMP_ACT_FOO"}]}"#),
            r#"seccomp profile: syscalls[3].action: unknown action "SCMP_ACT_FOO""#
        );
        assert_eq!(
            err(
                r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO",
                "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_ABOUT"}]}]}"#
            ),
            r#"seccomp profile: syscalls[0].args[0].op: unknown operator "SCMP_CMP_ABOUT""#
        );
        assert_eq!(
            err(
                r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO",
                "args": [{"index": 6, "value": 1, "op": "SCMP_CMP_EQ"}]}]}"#
            ),
            "seccomp profile: syscalls[0].args[0].index: 6 is out of range 0..=5"
        );
        assert_eq!(
            err(r#"{"syscalls": []}"#),
            "seccomp profile: defaultAction: missing"
        );
        assert_eq!(
            err(r#"{"defaultAction": "ALLOW"}"#),
            r#"seccomp profile: defaultAction: unknown action "ALLOW""#
        );
        assert_eq!(
            err(r#"{"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 70000}"#),
            "seccomp profile: defaultErrnoRet: errno 70000 is out of range 0..=4095"
        );
        assert_eq!(
            err(
                r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_NOTIFY"}]}"#
            ),
            r#"seccomp profile: syscalls[0].action: action "SCMP_ACT_NOTIFY" is not supported by nestbox"#
        );
        assert_eq!(
            err(r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_LOG", "errnoRet": 1}]}"#),
            "seccomp profile: syscalls[0].errnoRet: errnoRet 1 given for SCMP_ACT_LOG, which takes none"
        );
        assert_eq!(
            err(r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"action": "SCMP_ACT_LOG"}]}"#),
            "seccomp profile: syscalls[0].names: missing"
        );
        let e = err(
            r#"{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": "read", "action": "SCMP_ACT_LOG"}]}"#,
        );
        assert!(
            e.starts_with("seccomp profile: invalid JSON: invalid type: string"),
            "{e}"
        );
        assert!(e.contains("line 1"), "{e}");
        assert!(!e.contains('\n'));
        let e = err("{");
        assert!(e.starts_with("seccomp profile: invalid JSON: EOF"), "{e}");
    }
}
