//! The bundle's `config.json`, read with the `oci-spec` crate and turned into a
//! plain [`Plan`]: everything the container's process needs, checked and
//! translated (mount options into flags, capability and rlimit names into
//! numbers, the seccomp section into a nestbox-seccomp program) before any
//! process is forked, so bad input fails while nothing has been made yet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use nestbox_cgroup::Limits;
use nestbox_seccomp::{Profile, Program};
use nestbox_sys::mount::MsFlags;
use nestbox_sys::ns::Namespace;
use oci_spec::runtime::{LinuxNamespaceType, Process, Spec};

use crate::hooks::Hooks;
use crate::mounts::MountEntry;
use crate::{OciError, Result};

/// One namespace of the container: a new one, or an existing one joined by path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NsEntry {
    /// The kind.
    pub kind: Namespace,
    /// The namespace file to join; `None` for a new namespace.
    pub path: Option<PathBuf>,
}

/// One line of a uid or gid map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdMapping {
    /// First id in the container.
    pub inside: u32,
    /// First id on the host.
    pub outside: u32,
    /// Number of ids.
    pub size: u32,
}

/// A device node the container gets in its `/dev`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    /// Absolute path in the container.
    pub path: PathBuf,
    /// Character, block or FIFO.
    pub kind: nestbox_sys::node::NodeKind,
    /// Device number.
    pub major: u64,
    /// Device number.
    pub minor: u64,
    /// Permission bits.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
}

/// The capability sets of the process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapSets {
    /// Bounding set.
    pub bounding: Vec<caps::Capability>,
    /// Effective set.
    pub effective: Vec<caps::Capability>,
    /// Inheritable set.
    pub inheritable: Vec<caps::Capability>,
    /// Permitted set.
    pub permitted: Vec<caps::Capability>,
    /// Ambient set.
    pub ambient: Vec<caps::Capability>,
}

/// The container's process (`process` of config.json, or `exec --process`).
#[derive(Debug, Clone)]
pub struct ProcessPlan {
    /// Program and arguments.
    pub args: Vec<String>,
    /// Environment.
    pub env: Vec<String>,
    /// Working directory (absolute, in the container).
    pub cwd: PathBuf,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
    /// Supplementary groups.
    pub additional_gids: Vec<u32>,
    /// File mode creation mask.
    pub umask: Option<u32>,
    /// Capabilities.
    pub caps: CapSets,
    /// `(RLIMIT_*, soft, hard)`.
    pub rlimits: Vec<(i32, u64, u64)>,
    /// Set `no_new_privs`.
    pub no_new_privileges: bool,
    /// Give the process a terminal (sent over the console socket).
    pub terminal: bool,
    /// `/proc/self/oom_score_adj`.
    pub oom_score_adj: Option<i32>,
}

impl ProcessPlan {
    /// The process of a config without one (empty `args`): nothing to run.
    pub fn none() -> ProcessPlan {
        ProcessPlan {
            args: Vec::new(),
            env: Vec::new(),
            cwd: PathBuf::from("/"),
            uid: 0,
            gid: 0,
            additional_gids: Vec::new(),
            umask: None,
            caps: CapSets::default(),
            rlimits: Vec::new(),
            no_new_privileges: false,
            terminal: false,
            oom_score_adj: None,
        }
    }

    /// Whether there is a program to run.
    pub fn is_none(&self) -> bool {
        self.args.is_empty()
    }
}

/// Everything needed to create the container, checked.
#[derive(Debug)]
pub struct Plan {
    /// The bundle directory (absolute).
    pub bundle: PathBuf,
    /// The root filesystem (absolute).
    pub rootfs: PathBuf,
    /// Make the root read-only.
    pub root_readonly: bool,
    /// Hostname (needs a new UTS namespace).
    pub hostname: Option<String>,
    /// NIS domain name (needs a new UTS namespace).
    pub domainname: Option<String>,
    /// Namespaces, in config order.
    pub namespaces: Vec<NsEntry>,
    /// Uid map of a new user namespace.
    pub uid_map: Vec<IdMapping>,
    /// Gid map of a new user namespace.
    pub gid_map: Vec<IdMapping>,
    /// Mounts, in config order.
    pub mounts: Vec<MountEntry>,
    /// Propagation of the root mount (`linux.rootfsPropagation`).
    pub rootfs_propagation: MsFlags,
    /// Paths hidden from the container.
    pub masked_paths: Vec<PathBuf>,
    /// Paths made read-only.
    pub readonly_paths: Vec<PathBuf>,
    /// Extra device nodes.
    pub devices: Vec<Device>,
    /// Kernel parameters to set in the container's namespaces.
    pub sysctl: Vec<(String, String)>,
    /// The process.
    pub process: ProcessPlan,
    /// Cgroup limits (from `linux.resources`).
    pub limits: Limits,
    /// `linux.resources.devices`: the device cgroup's rules (`None`:
    /// nestbox's default rules).
    pub device_rules: Option<Vec<nestbox_cgroup::DeviceRule>>,
    /// `linux.cgroupsPath`: where the cgroup goes (absolute: from each
    /// hierarchy's root; relative: under the runtime's own cgroup).
    pub cgroups_path: Option<PathBuf>,
    /// The seccomp filter, compiled.
    pub seccomp: Option<Program>,
    /// Hooks.
    pub hooks: Hooks,
    /// Annotations.
    pub annotations: BTreeMap<String, String>,
}

impl Plan {
    /// Whether the container gets a namespace of `kind` (new or joined).
    pub fn has_namespace(&self, kind: Namespace) -> bool {
        self.namespaces.iter().any(|n| n.kind == kind)
    }

    /// Whether the container gets a *new* namespace of `kind`.
    pub fn new_namespace(&self, kind: Namespace) -> bool {
        self.namespaces
            .iter()
            .any(|n| n.kind == kind && n.path.is_none())
    }
}

/// Read `bundle/config.json` and check and translate it.
pub fn load(bundle: &Path) -> Result<Plan> {
    let bundle =
        std::path::absolute(bundle).map_err(|e| OciError::io("resolve bundle", bundle, e))?;
    let path = bundle.join("config.json");
    if !path.is_file() {
        return Err(OciError::Config {
            path,
            message: "not found (is --bundle the bundle directory?)".into(),
        });
    }
    // serde_json directly rather than Spec::load: its errors name the field,
    // the value and the line ("unknown variant `CAP_FLY`, expected one of …").
    let text = std::fs::read_to_string(&path).map_err(|e| OciError::io("read", &path, e))?;
    let spec: Spec = serde_json::from_str(&text).map_err(|e| OciError::Config {
        path: path.clone(),
        message: e.to_string(),
    })?;
    translate(&bundle, &spec).map_err(|e| match e {
        OciError::Unsupported(message) => OciError::Config { path, message },
        other => other,
    })
}

fn unsupported(msg: impl Into<String>) -> OciError {
    OciError::Unsupported(msg.into())
}

fn translate(bundle: &Path, spec: &Spec) -> Result<Plan> {
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| unsupported("root: missing"))?;
    let rootfs = if root.path().is_absolute() {
        root.path().clone()
    } else {
        bundle.join(root.path())
    };
    if !rootfs.is_dir() {
        return Err(unsupported(format!(
            "root.path: {} is not a directory",
            rootfs.display()
        )));
    }
    // No process: the container can be created, and `start` refuses it.
    let process = match spec.process() {
        Some(p) => process_plan(p)?,
        None => ProcessPlan::none(),
    };
    let linux = spec.linux().clone().unwrap_or_default();
    let namespaces = namespaces(linux.namespaces().as_deref().unwrap_or_default())?;
    let has = |k: Namespace| namespaces.iter().any(|n| n.kind == k);
    let new_userns = namespaces
        .iter()
        .any(|n| n.kind == Namespace::User && n.path.is_none());
    let map = |m: &Option<Vec<oci_spec::runtime::LinuxIdMapping>>| -> Vec<IdMapping> {
        m.iter()
            .flatten()
            .map(|m| IdMapping {
                inside: m.container_id(),
                outside: m.host_id(),
                size: m.size(),
            })
            .collect()
    };
    let (uid_map, gid_map) = (map(linux.uid_mappings()), map(linux.gid_mappings()));
    if new_userns && (uid_map.is_empty() || gid_map.is_empty()) {
        return Err(unsupported(
            "linux.uidMappings and linux.gidMappings are needed with a new user namespace",
        ));
    }
    if !new_userns && (!uid_map.is_empty() || !gid_map.is_empty()) {
        return Err(unsupported(
            "linux.uidMappings/gidMappings given without a new user namespace",
        ));
    }
    if !has(Namespace::Mnt)
        && (root.readonly().unwrap_or(false)
            || linux.devices().as_ref().is_some_and(|d| !d.is_empty()))
    {
        // Without a mount namespace nestbox makes no mount at all (it would
        // be the host's): the root is a chroot and config mounts, masks and
        // read-only paths are not applied (docs/oci.md).
        return Err(unsupported(
            "root.readonly and linux.devices need a mount namespace (nestbox never mounts on the host)",
        ));
    }
    if (spec.hostname().is_some() || spec.domainname().is_some()) && !has(Namespace::Uts) {
        return Err(unsupported(
            "hostname/domainname set without a UTS namespace",
        ));
    }
    let mounts = spec
        .mounts()
        .iter()
        .flatten()
        .map(crate::mounts::MountEntry::from_spec)
        .collect::<Result<Vec<_>>>()?;
    let rootfs_propagation = match linux.rootfs_propagation().as_deref() {
        None | Some("") => MsFlags::MS_PRIVATE | MsFlags::MS_REC,
        Some(p) => crate::mounts::propagation_flag(p)
            .ok_or_else(|| unsupported(format!("linux.rootfsPropagation: unknown {p:?}")))?,
    };
    let abs = |field: &str, list: &Option<Vec<String>>| -> Result<Vec<PathBuf>> {
        list.iter()
            .flatten()
            .map(|p| {
                let p = PathBuf::from(p);
                if p.is_absolute() {
                    Ok(p)
                } else {
                    Err(unsupported(format!(
                        "{field}: {} is not absolute",
                        p.display()
                    )))
                }
            })
            .collect()
    };
    let masked_paths = abs("linux.maskedPaths", linux.masked_paths())?;
    let readonly_paths = abs("linux.readonlyPaths", linux.readonly_paths())?;
    let devices = linux
        .devices()
        .iter()
        .flatten()
        .map(device)
        .collect::<Result<Vec<_>>>()?;
    let mut sysctl: Vec<(String, String)> = linux
        .sysctl()
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    sysctl.sort();
    for (key, _) in &sysctl {
        check_sysctl(key, &has)?;
    }
    let limits = crate::resources::limits(linux.resources().as_ref())?;
    let device_rules = crate::resources::device_rules(linux.resources().as_ref())?;
    let seccomp = match linux.seccomp() {
        Some(s) => Some(seccomp_program(s)?),
        None => None,
    };
    let cgroups_path = linux
        .cgroups_path()
        .clone()
        .filter(|p| !p.as_os_str().is_empty());
    if let Some(p) = &cgroups_path {
        if p.to_string_lossy().contains(':') {
            return Err(unsupported(format!(
                "linux.cgroupsPath {}: systemd slice paths need --systemd-cgroup, which nestbox does not support",
                p.display()
            )));
        }
    }
    let hooks = Hooks::from_spec(spec.hooks().as_ref())?;
    let annotations = spec
        .annotations()
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok(Plan {
        bundle: bundle.to_path_buf(),
        rootfs,
        root_readonly: root.readonly().unwrap_or(false),
        hostname: spec.hostname().clone(),
        domainname: spec.domainname().clone(),
        namespaces,
        uid_map,
        gid_map,
        mounts,
        rootfs_propagation,
        masked_paths,
        readonly_paths,
        devices,
        sysctl,
        process,
        limits,
        device_rules,
        cgroups_path,
        seccomp,
        hooks,
        annotations,
    })
}

fn namespaces(list: &[oci_spec::runtime::LinuxNamespace]) -> Result<Vec<NsEntry>> {
    let mut out: Vec<NsEntry> = Vec::new();
    for ns in list {
        let kind = match ns.typ() {
            LinuxNamespaceType::Mount => Namespace::Mnt,
            LinuxNamespaceType::Cgroup => Namespace::Cgroup,
            LinuxNamespaceType::Uts => Namespace::Uts,
            LinuxNamespaceType::Ipc => Namespace::Ipc,
            LinuxNamespaceType::User => Namespace::User,
            LinuxNamespaceType::Pid => Namespace::Pid,
            LinuxNamespaceType::Network => Namespace::Net,
            other => {
                return Err(unsupported(format!(
                    "linux.namespaces: {other} namespaces are not supported"
                )))
            }
        };
        if out.iter().any(|n| n.kind == kind) {
            return Err(unsupported(format!(
                "linux.namespaces: {} is listed twice",
                kind.name()
            )));
        }
        let path = ns.path().clone().filter(|p| !p.as_os_str().is_empty());
        if let Some(p) = &path {
            if !p.exists() {
                return Err(unsupported(format!(
                    "linux.namespaces: {} namespace path {} does not exist",
                    kind.name(),
                    p.display()
                )));
            }
        }
        out.push(NsEntry { kind, path });
    }
    Ok(out)
}

fn device(d: &oci_spec::runtime::LinuxDevice) -> Result<Device> {
    use nestbox_sys::node::NodeKind;
    use oci_spec::runtime::LinuxDeviceType;
    let kind = match d.typ() {
        LinuxDeviceType::C | LinuxDeviceType::U => NodeKind::Char,
        LinuxDeviceType::B => NodeKind::Block,
        LinuxDeviceType::P => NodeKind::Fifo,
        LinuxDeviceType::A => {
            return Err(unsupported(format!(
                "linux.devices: {}: type \"a\" is for the device cgroup only",
                d.path().display()
            )))
        }
    };
    if !d.path().is_absolute() || !d.path().starts_with("/dev") {
        return Err(unsupported(format!(
            "linux.devices: {} must be an absolute path under /dev",
            d.path().display()
        )));
    }
    let num = |v: i64, what: &str| {
        u64::try_from(v).map_err(|_| {
            unsupported(format!(
                "linux.devices: {}: negative {what}",
                d.path().display()
            ))
        })
    };
    Ok(Device {
        path: d.path().clone(),
        kind,
        major: num(d.major(), "major")?,
        minor: num(d.minor(), "minor")?,
        mode: d.file_mode().unwrap_or(0o666) & 0o7777,
        uid: d.uid().unwrap_or(0),
        gid: d.gid().unwrap_or(0),
    })
}

/// A sysctl is only allowed when it is namespaced by a namespace the
/// container has of its own (as runc checks): otherwise it would change the host.
fn check_sysctl(key: &str, has: &dyn Fn(Namespace) -> bool) -> Result<()> {
    const IPC: &[&str] = &[
        "kernel.msgmax",
        "kernel.msgmnb",
        "kernel.msgmni",
        "kernel.sem",
        "kernel.shmall",
        "kernel.shmmax",
        "kernel.shmmni",
        "kernel.shm_rmid_forced",
    ];
    let ok = if IPC.contains(&key) || key.starts_with("fs.mqueue.") {
        has(Namespace::Ipc)
    } else if key.starts_with("net.") {
        has(Namespace::Net)
    } else if key == "kernel.hostname" || key == "kernel.domainname" {
        has(Namespace::Uts)
    } else {
        false
    };
    if ok {
        Ok(())
    } else {
        Err(unsupported(format!(
            "linux.sysctl: {key:?} is not namespaced by a namespace of the container"
        )))
    }
}

/// The process of config.json or of `exec --process`.
pub fn process_plan(p: &Process) -> Result<ProcessPlan> {
    let args = p.args().clone().unwrap_or_default();
    if args.is_empty() {
        return Err(unsupported("process.args: must name a program"));
    }
    if !p.cwd().is_absolute() {
        return Err(unsupported(format!(
            "process.cwd: {} is not absolute",
            p.cwd().display()
        )));
    }
    let caps = match p.capabilities() {
        None => CapSets::default(),
        Some(c) => {
            let conv =
                |set: &Option<oci_spec::runtime::Capabilities>| -> Result<Vec<caps::Capability>> {
                    let mut v: Vec<caps::Capability> = set
                        .iter()
                        .flatten()
                        .map(|c| {
                            let name = serde_json::to_value(c)
                                .ok()
                                .and_then(|v| v.as_str().map(String::from))
                                .unwrap_or_default();
                            caps::Capability::from_str(&name).map_err(|_| {
                                unsupported(format!(
                                "process.capabilities: {name} is not known to this kernel interface"
                            ))
                            })
                        })
                        .collect::<Result<_>>()?;
                    v.sort_by_key(|c| c.index());
                    Ok(v)
                };
            CapSets {
                bounding: conv(c.bounding())?,
                effective: conv(c.effective())?,
                inheritable: conv(c.inheritable())?,
                permitted: conv(c.permitted())?,
                ambient: conv(c.ambient())?,
            }
        }
    };
    let mut rlimits = Vec::new();
    for r in p.rlimits().iter().flatten() {
        let name = serde_json::to_value(r.typ())
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        let res = rlimit_number(&name)
            .ok_or_else(|| unsupported(format!("process.rlimits: unknown {name}")))?;
        if r.soft() > r.hard() {
            return Err(unsupported(format!(
                "process.rlimits: {name}: soft limit {} above hard limit {}",
                r.soft(),
                r.hard()
            )));
        }
        rlimits.push((res, r.soft(), r.hard()));
    }
    if let Some(adj) = p.oom_score_adj() {
        if !(-1000..=1000).contains(&adj) {
            return Err(unsupported(format!(
                "process.oomScoreAdj: {adj} is outside -1000..1000"
            )));
        }
    }
    if p.apparmor_profile()
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return Err(unsupported(
            "process.apparmorProfile: AppArmor is not supported",
        ));
    }
    if p.selinux_label().as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported(
            "process.selinuxLabel: SELinux is not supported",
        ));
    }
    let user = p.user();
    Ok(ProcessPlan {
        args,
        env: p.env().clone().unwrap_or_default(),
        cwd: p.cwd().clone(),
        uid: user.uid(),
        gid: user.gid(),
        additional_gids: user.additional_gids().clone().unwrap_or_default(),
        umask: user.umask(),
        caps,
        rlimits,
        no_new_privileges: p.no_new_privileges().unwrap_or(false),
        terminal: p.terminal().unwrap_or(false),
        oom_score_adj: p.oom_score_adj(),
    })
}

/// `RLIMIT_*` name to its number.
pub fn rlimit_number(name: &str) -> Option<i32> {
    let n = match name {
        "RLIMIT_CPU" => libc::RLIMIT_CPU,
        "RLIMIT_FSIZE" => libc::RLIMIT_FSIZE,
        "RLIMIT_DATA" => libc::RLIMIT_DATA,
        "RLIMIT_STACK" => libc::RLIMIT_STACK,
        "RLIMIT_CORE" => libc::RLIMIT_CORE,
        "RLIMIT_RSS" => libc::RLIMIT_RSS,
        "RLIMIT_NPROC" => libc::RLIMIT_NPROC,
        "RLIMIT_NOFILE" => libc::RLIMIT_NOFILE,
        "RLIMIT_MEMLOCK" => libc::RLIMIT_MEMLOCK,
        "RLIMIT_AS" => libc::RLIMIT_AS,
        "RLIMIT_LOCKS" => libc::RLIMIT_LOCKS,
        "RLIMIT_SIGPENDING" => libc::RLIMIT_SIGPENDING,
        "RLIMIT_MSGQUEUE" => libc::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => libc::RLIMIT_NICE,
        "RLIMIT_RTPRIO" => libc::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => libc::RLIMIT_RTTIME,
        _ => return None,
    };
    Some(n as i32)
}

/// The seccomp section, translated onto nestbox-seccomp: its JSON form is the
/// Docker profile format nestbox-seccomp reads.
fn seccomp_program(s: &oci_spec::runtime::LinuxSeccomp) -> Result<Program> {
    if s.listener_path().is_some() {
        return Err(unsupported(
            "linux.seccomp.listenerPath: seccomp notification agents are not supported",
        ));
    }
    let text = serde_json::to_string(s).map_err(|e| unsupported(format!("linux.seccomp: {e}")))?;
    let profile = Profile::from_docker_json(&text)?;
    Ok(profile.compile()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysctl_needs_its_namespace() {
        let only_net = |k: Namespace| k == Namespace::Net;
        assert!(check_sysctl("net.ipv4.ip_forward", &only_net).is_ok());
        assert!(check_sysctl("kernel.shmmax", &only_net).is_err());
        assert!(check_sysctl("vm.swappiness", &|_| true).is_err());
    }

    #[test]
    fn rlimit_names_map_to_numbers() {
        assert_eq!(
            rlimit_number("RLIMIT_NOFILE"),
            Some(libc::RLIMIT_NOFILE as i32)
        );
        assert_eq!(rlimit_number("RLIMIT_FOO"), None);
    }
}
