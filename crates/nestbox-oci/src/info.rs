//! What the runtime can do (`features`, the runtime-spec's features
//! document) and the default bundle config (`spec`).

use std::path::Path;

use crate::{OciError, Result};

/// The `features` document.
pub fn features() -> serde_json::Value {
    let caps: Vec<String> = {
        let mut v: Vec<caps::Capability> = caps::all().into_iter().collect();
        v.sort_by_key(|c| c.index());
        v.iter().map(|c| c.to_string()).collect()
    };
    serde_json::json!({
        "ociVersionMin": "1.0.0",
        "ociVersionMax": crate::state::OCI_VERSION,
        "hooks": ["prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"],
        "mountOptions": [
            "async", "atime", "bind", "dev", "diratime", "dirsync", "exec", "lazytime", "loud",
            "mand", "noatime", "nodev", "nodiratime", "noexec", "nolazytime", "nomand",
            "norelatime", "nostrictatime", "nosuid", "private", "rbind", "relatime", "remount",
            "ro", "rprivate", "rshared", "rslave", "runbindable", "rw", "shared", "silent",
            "slave", "strictatime", "suid", "sync", "unbindable"
        ],
        "linux": {
            "namespaces": ["cgroup", "ipc", "mount", "network", "pid", "user", "uts"],
            "capabilities": caps,
            "cgroup": { "v1": true, "v2": true, "systemd": false, "systemdUser": false, "rdma": false },
            "seccomp": {
                "enabled": true,
                "actions": [
                    "SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS",
                    "SCMP_ACT_KILL_THREAD", "SCMP_ACT_LOG", "SCMP_ACT_TRAP"
                ],
                "operators": [
                    "SCMP_CMP_EQ", "SCMP_CMP_GE", "SCMP_CMP_GT", "SCMP_CMP_LE", "SCMP_CMP_LT",
                    "SCMP_CMP_MASKED_EQ", "SCMP_CMP_NE"
                ],
                "archs": ["SCMP_ARCH_X86_64"],
                "supportedFlags": []
            },
            "apparmor": { "enabled": false },
            "selinux": { "enabled": false },
            "intelRdt": { "enabled": false },
            "mountExtensions": { "idmap": { "enabled": false } }
        },
        "annotations": {
            "org.nestbox.runtime": "nestbox-runc",
            "org.nestbox.version": env!("CARGO_PKG_VERSION")
        }
    })
}

/// Write a default `config.json` into `bundle` (refusing to overwrite one):
/// the `oci-spec` crate's default (a shell on a terminal, the usual mounts,
/// masked paths and namespaces), with hostname `nestbox`.
pub fn write_default_spec(bundle: &Path) -> Result<()> {
    let path = bundle.join("config.json");
    if path.exists() {
        return Err(OciError::Usage(format!(
            "{} exists already: remove it first",
            path.display()
        )));
    }
    let mut spec = oci_spec::runtime::Spec::default();
    spec.set_hostname(Some("nestbox".into()));
    spec.save(&path).map_err(|e| OciError::Config {
        path,
        message: e.to_string(),
    })
}
