//! The spec of a box: everything needed to (re)create it, as plain data
//! (exportability). The CLI builds it from options; `validate` turns every bad
//! input into one clear line before anything is created.

use std::path::{Path, PathBuf};

use nestbox_cgroup::Limits;
pub use nestbox_isolation::caps::CapNames;
use nestbox_isolation::rootfs::Volume;
use serde::{Deserialize, Serialize};

use crate::{Result, RuntimeError};

/// The seccomp policy of a box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SeccompChoice {
    /// nestbox's default filter (blocks at least what Docker's default blocks).
    #[default]
    Default,
    /// No filter at all.
    Unconfined,
    /// A Docker/OCI-format profile loaded from this file (its text is kept in the spec).
    Profile {
        /// Where it was loaded from.
        path: PathBuf,
        /// The profile text.
        text: String,
    },
}

/// User and group the command runs as, inside the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct User {
    /// Uid inside the box.
    pub uid: u32,
    /// Gid inside the box.
    pub gid: u32,
}

/// Everything that defines a box.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoxSpec {
    /// Name, unique among the boxes of one root.
    pub name: String,
    /// The image the root is built from.
    pub image: String,
    /// Command and arguments.
    pub command: Vec<String>,
    /// Extra environment, `KEY=VALUE`.
    pub env: Vec<String>,
    /// Working directory in the box.
    pub workdir: PathBuf,
    /// User of the command.
    pub user: User,
    /// Hostname (defaults to the box name).
    pub hostname: String,
    /// Root filesystem read-only.
    pub read_only: bool,
    /// Host paths mounted in.
    pub volumes: Vec<Volume>,
    /// Paths with a fresh tmpfs.
    pub tmpfs: Vec<PathBuf>,
    /// Capabilities of the box (bounding set), resolved from the defaults and add/drop.
    pub capabilities: CapNames,
    /// Seccomp policy.
    pub seccomp: SeccompChoice,
    /// Run in a user namespace.
    pub userns: bool,
    /// Resource limits.
    pub limits: Limits,
    /// Pass the caller's stdin to the command.
    pub interactive: bool,
    /// Remove the box as soon as it exits (`--rm`).
    #[serde(default)]
    pub remove_on_exit: bool,
    /// Set for a clone: the box is a shell its process is forked into from a template.
    #[serde(default)]
    pub clone_of: Option<CloneSource>,
    /// Set for a box restored from a checkpoint (its name): the box's init
    /// waits for the process nestbox restores into it.
    #[serde(default)]
    pub restore_of: Option<String>,
    /// Networking.
    #[serde(default)]
    pub network: NetSpec,
    /// Mark the box's anonymous memory mergeable by the kernel's same-page
    /// merging (`--ksm`: `PR_SET_MEMORY_MERGE` on its command, inherited by
    /// every process it starts, by `exec`'d commands and by clones).
    #[serde(default)]
    pub ksm: bool,
    /// Size in bytes of the box's writable layer (`--disk`): its overlay's
    /// upper and work directories live on a filesystem of that size (see
    /// [`crate::disk`]), so writing past it fails with ENOSPC in the box.
    /// Clones inherit it, each with a disk of its own.
    #[serde(default)]
    pub disk: Option<u64>,
    /// The box's monitor stack (`--monitor`, in order; see
    /// `nestbox_interpose::MonitorSpec` for the forms): the calls they
    /// subscribe to stop and are answered by them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub monitors: Vec<String>,
    /// The box may run boxes of its own (`--nest`, see `docs/nesting.md`):
    /// it gets a user namespace, its cgroups delegated and mounted at
    /// `/sys/fs/cgroup`, a state directory of its own at `/var/lib/nestbox`,
    /// the nestbox binary at [`NESTED_BINARY`], and a seccomp filter that lets
    /// it make namespaces and mount in them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub nest: bool,
}

/// Where a box that may run boxes of its own (`--nest`) finds the nestbox
/// binary (bound read-only; its directory is on the box's PATH).
pub const NESTED_BINARY: &str = "/opt/nestbox/bin/nestbox";
/// The directory of [`NESTED_BINARY`].
pub const NESTED_BIN_DIR: &str = "/opt/nestbox/bin";

/// How a box is connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Its own network namespace on a host bridge, with an address (the default as root).
    Bridge,
    /// Its own network namespace with loopback only.
    #[default]
    None,
    /// The host's network namespace.
    Host,
}

impl NetworkMode {
    /// Parse `bridge`, `none` or `host`.
    pub fn parse(text: &str) -> Result<Self> {
        match text {
            "bridge" => Ok(NetworkMode::Bridge),
            "none" => Ok(NetworkMode::None),
            "host" => Ok(NetworkMode::Host),
            other => Err(RuntimeError::InvalidInput(format!(
                "unknown --network {other:?} (use bridge, none or host)"
            ))),
        }
    }

    /// Parse `--network`: `bridge`, `none`, `host`, or the name of a
    /// user-defined network (bridge mode on that network).
    pub fn parse_with_name(text: &str) -> Result<(Self, Option<String>)> {
        match NetworkMode::parse(text) {
            Ok(mode) => Ok((mode, None)),
            Err(_) if text == "default" => Ok((NetworkMode::Bridge, None)),
            Err(_)
                if !text.is_empty()
                    && !text.starts_with('.')
                    && text.bytes().all(|c| {
                        c.is_ascii_alphanumeric() || c == b'-' || c == b'_' || c == b'.'
                    }) =>
            {
                Ok((NetworkMode::Bridge, Some(text.to_string())))
            }
            Err(_) => Err(RuntimeError::InvalidInput(format!(
                "unknown --network {text:?} (use bridge, none, host or a network's name)"
            ))),
        }
    }
}

/// The box's network: mode, published ports and bandwidth (bridge mode only).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NetSpec {
    /// Mode.
    pub mode: NetworkMode,
    /// The user-defined network of a bridged box (`--network NAME`); the
    /// root's default network when `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Host ports forwarded to the box (`-p`).
    pub publish: Vec<nestbox_net::PortMapping>,
    /// Egress cap (`--net-rate`).
    pub rate: Option<nestbox_net::Rate>,
    /// Egress reservation (`--net-reserve`).
    pub reserve: Option<nestbox_net::Rate>,
    /// Share of what is left (`--net-share`).
    pub share: Option<u32>,
    /// Ingress cap (`--net-ingress-rate`).
    pub ingress_rate: Option<nestbox_net::Rate>,
    /// Host ports the box may open connections to on the gateway
    /// (`--allow-host-port`); the host is no destination otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_host: Vec<nestbox_net::HostPort>,
    /// Where beyond its network the box may send (`--egress`).
    #[serde(default, skip_serializing_if = "nestbox_net::Egress::is_allow_all")]
    pub egress: nestbox_net::Egress,
}

impl NetSpec {
    /// Whether any bridge-only option is set.
    pub fn has_bridge_options(&self) -> bool {
        !self.publish.is_empty()
            || self.rate.is_some()
            || self.reserve.is_some()
            || self.share.is_some()
            || self.ingress_rate.is_some()
            || !self.allow_host.is_empty()
            || !self.egress.is_allow_all()
    }
}

/// The template a clone is forked from (the clone's root is a copy-on-write view of
/// the template's files; its pid and user namespaces are nested in the template's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloneSource {
    /// Box name of the template.
    pub template_box: String,
    /// Template name.
    pub template: String,
}

/// The PATH a box gets unless its spec sets one.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The smallest memory limit a box can start and run a shell with.
pub const MIN_MEMORY: u64 = 6 << 20;

impl BoxSpec {
    /// The names the box goes by on its network: its name, and its hostname
    /// when that differs.
    pub fn host_names(&self) -> Vec<&str> {
        let mut names = vec![self.name.as_str()];
        if self.hostname != self.name {
            names.push(self.hostname.as_str());
        }
        names
    }

    /// Check everything that can be checked before creating anything.
    pub fn validate(&self) -> Result<()> {
        validate_name(&self.name)?;
        if self.clone_of.is_none() {
            validate_user_name(&self.name)?;
        }
        if self.command.is_empty() || self.command[0].is_empty() {
            return Err(invalid(
                "missing command: usage is nestbox run [OPTIONS] -- CMD [ARGS...]",
            ));
        }
        if let Some(m) = self.limits.memory {
            if m < MIN_MEMORY {
                return Err(invalid(format!(
                    "--memory {} is below the minimum of {} a box needs",
                    crate::size::format_size(m),
                    crate::size::format_size(MIN_MEMORY)
                )));
            }
        }
        self.limits.validate()?;
        if let Some(size) = self.disk {
            crate::disk::validate(size)?;
        }
        for m in &self.monitors {
            let parsed =
                nestbox_interpose::MonitorSpec::parse(m).map_err(|e| invalid(e.to_string()))?;
            if parsed.is_packets() && self.network.mode != NetworkMode::Bridge {
                return Err(invalid(format!(
                    "--monitor {m}: the packet inspector needs --network bridge (a box with --network {} has no network namespace of its own with a bridge to inspect)",
                    match self.network.mode {
                        NetworkMode::Host => "host",
                        _ => "none",
                    }
                )));
            }
        }
        for kv in &self.env {
            if !kv.contains('=') || kv.starts_with('=') {
                return Err(invalid(format!("invalid --env {kv:?}: expected KEY=VALUE")));
            }
        }
        if !self.workdir.is_absolute() {
            return Err(invalid(format!(
                "--workdir {:?} must be an absolute path",
                self.workdir
            )));
        }
        validate_hostname(&self.hostname)?;
        if self.network.mode != NetworkMode::Bridge && self.network.has_bridge_options() {
            return Err(invalid(
                "-p, --allow-host-port, --egress, --net-rate, --net-reserve, --net-share and --net-ingress-rate need --network bridge",
            ));
        }
        if self.network.mode == NetworkMode::Bridge
            && nestbox_isolation::idmap::in_user_namespace()
            && !nestbox_sys::ns::own_netns_is_owned_by_own_userns().unwrap_or(false)
        {
            return Err(invalid(
                "--network bridge inside a box needs the box's own network namespace, owned by its user namespace (a nest box started with --network bridge or none, not host): use --network none or host",
            ));
        }
        if self.nest {
            if !self.userns {
                return Err(invalid("--nest needs a user namespace (--userns)"));
            }
            if self.read_only {
                return Err(invalid(
                    "--nest and --read-only do not go together: the boxes inside keep their state in the box's /run",
                ));
            }
            if self.clone_of.is_none() && self.disk.is_some() {
                return Err(invalid(
                    "--nest and --disk do not go together yet: the box's boxes keep their layers in its state directory, outside its disk",
                ));
            }
        }
        if self.network.mode == NetworkMode::Bridge
            && self.userns
            && !nix::unistd::geteuid().is_root()
        {
            return Err(invalid(
                "--network bridge needs root (without root a box gets --network none)",
            ));
        }
        for v in &self.volumes {
            if !v.target.is_absolute() {
                return Err(invalid(format!(
                    "volume target {:?} must be an absolute path",
                    v.target
                )));
            }
            if v.target == Path::new("/") {
                return Err(invalid("a volume cannot be mounted on / of the box"));
            }
            if std::fs::symlink_metadata(&v.source).is_err() {
                return Err(invalid(format!(
                    "volume source {:?} does not exist",
                    v.source
                )));
            }
        }
        for t in &self.tmpfs {
            if !t.is_absolute() || t == Path::new("/") {
                return Err(invalid(format!(
                    "--tmpfs {t:?} must be an absolute path other than /"
                )));
            }
        }
        Ok(())
    }

    /// The environment the command gets: defaults, then the spec's `env` on top.
    pub fn environment(&self) -> Vec<String> {
        let home = if self.user.uid == 0 { "/root" } else { "/" };
        let path = if self.nest {
            format!("{DEFAULT_PATH}:{NESTED_BIN_DIR}")
        } else {
            DEFAULT_PATH.to_string()
        };
        let mut env = vec![
            format!("PATH={path}"),
            format!("HOSTNAME={}", self.hostname),
            format!("HOME={home}"),
        ];
        for kv in &self.env {
            let key = kv.split('=').next().unwrap_or_default();
            env.retain(|e| e.split('=').next() != Some(key));
            env.push(kv.clone());
        }
        env
    }
}

/// Docker's default capabilities plus `add` minus `drop` (names like NET_ADMIN or ALL).
pub fn resolve_capabilities(add: &[String], drop: &[String]) -> Result<CapNames> {
    nestbox_isolation::caps::resolve(add, drop).map_err(|e| invalid(e.to_string()))
}

fn invalid(msg: impl Into<String>) -> RuntimeError {
    RuntimeError::InvalidInput(msg.into())
}

/// Box names: 1–64 of letters, digits, `_`, `.`, `-`, starting with a letter or digit.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "invalid box name {name:?}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )))
    }
}

/// Names of pooled clones start with this; no other box may take such a name.
pub const POOL_NAME_PREFIX: &str = "pool.";

/// Check a name a user gives a box: a valid name outside the reserved pool
/// prefix.
pub fn validate_user_name(name: &str) -> Result<()> {
    validate_name(name)?;
    if name.starts_with(POOL_NAME_PREFIX) {
        return Err(invalid(format!(
            "invalid box name {name:?}: names starting with {POOL_NAME_PREFIX:?} are reserved for template pools"
        )));
    }
    Ok(())
}

fn validate_hostname(h: &str) -> Result<()> {
    let ok = !h.is_empty()
        && h.len() <= 64
        && h.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        });
    if ok {
        Ok(())
    } else {
        Err(invalid(format!("invalid --hostname {h:?}")))
    }
}

/// Parse `-v HOST:BOX[:ro|:rw]`. The host path is made absolute.
pub fn parse_volume(text: &str) -> Result<Volume> {
    let parts: Vec<&str> = text.split(':').collect();
    let (src, dst, ro) = match parts.as_slice() {
        [s, d] => (*s, *d, false),
        [s, d, "ro"] => (*s, *d, true),
        [s, d, "rw"] => (*s, *d, false),
        _ => {
            return Err(invalid(format!(
                "invalid --volume {text:?}: expected HOST:BOX[:ro]"
            )))
        }
    };
    if src.is_empty() || dst.is_empty() {
        return Err(invalid(format!(
            "invalid --volume {text:?}: expected HOST:BOX[:ro]"
        )));
    }
    let source =
        std::path::absolute(src).map_err(RuntimeError::io("resolve volume source", src))?;
    Ok(Volume {
        source,
        target: PathBuf::from(dst),
        read_only: ro,
    })
}

/// Parse `-u UID[:GID]` (numeric; the gid defaults to the uid).
pub fn parse_user(text: &str) -> Result<User> {
    let bad = || {
        invalid(format!(
            "invalid --user {text:?}: expected UID[:GID] (numbers)"
        ))
    };
    let mut it = text.splitn(2, ':');
    let uid: u32 = it.next().unwrap_or_default().parse().map_err(|_| bad())?;
    let gid: u32 = match it.next() {
        Some(g) => g.parse().map_err(|_| bad())?,
        None => uid,
    };
    Ok(User { uid, gid })
}

/// Specs for unit tests of this crate.
#[cfg(test)]
pub(crate) mod tests_support {
    use super::*;

    /// A valid spec named `name` running /bin/true.
    pub(crate) fn sample(name: &str) -> BoxSpec {
        BoxSpec {
            name: name.into(),
            image: "host".into(),
            command: vec!["/bin/true".into()],
            env: vec![],
            workdir: "/".into(),
            user: User::default(),
            hostname: name.into(),
            read_only: false,
            volumes: vec![],
            tmpfs: vec![],
            capabilities: nestbox_isolation::caps::resolve(&[], &[]).unwrap(),
            seccomp: SeccompChoice::Default,
            userns: false,
            limits: Limits::default(),
            interactive: false,
            remove_on_exit: false,
            ksm: false,
            disk: None,
            monitors: Vec::new(),
            nest: false,
            clone_of: None,
            restore_of: None,
            network: NetSpec::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::sample as named;
    use super::*;

    fn sample() -> BoxSpec {
        named("web-1")
    }

    #[test]
    fn valid_spec_passes_and_round_trips() {
        let s = sample();
        s.validate().unwrap();
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<BoxSpec>(&json).unwrap(), s);
    }

    #[test]
    fn bad_inputs_name_the_problem() {
        let mut s = sample();
        s.command.clear();
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("missing command"));
        let mut s = sample();
        s.limits.memory = Some(1024);
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--memory 1 KiB is below the minimum of 6 MiB"));
        let mut s = sample();
        s.name = "../x".into();
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("invalid box name"));
        let mut s = sample();
        s.volumes.push(Volume {
            source: "/nonexistent/zz".into(),
            target: "/data".into(),
            read_only: false,
        });
        assert!(s
            .validate()
            .unwrap_err()
            .to_string()
            .contains("does not exist"));
        let mut s = sample();
        s.env.push("NOEQUALS".into());
        assert!(s.validate().unwrap_err().to_string().contains("KEY=VALUE"));
        let mut s = sample();
        s.hostname = "bad_host!".into();
        assert!(s.validate().is_err());
    }

    #[test]
    fn environment_overrides_defaults() {
        let mut s = sample();
        s.env = vec!["PATH=/x".into(), "A=1".into()];
        let env = s.environment();
        assert!(env.contains(&"PATH=/x".to_string()));
        assert!(env.contains(&"A=1".to_string()));
        assert_eq!(env.iter().filter(|e| e.starts_with("PATH=")).count(), 1);
    }

    #[test]
    fn volumes_and_users_parse() {
        let v = parse_volume("/tmp:/data:ro").unwrap();
        assert_eq!(
            (v.source, v.target, v.read_only),
            ("/tmp".into(), "/data".into(), true)
        );
        assert!(parse_volume("/tmp").is_err());
        assert!(parse_volume("/tmp:/d:xx").is_err());
        assert_eq!(
            parse_user("1000").unwrap(),
            User {
                uid: 1000,
                gid: 1000
            }
        );
        assert_eq!(parse_user("1000:5").unwrap(), User { uid: 1000, gid: 5 });
        assert!(parse_user("bob").is_err());
    }
}

/// A signal by number, name or name without `SIG` (`9`, `SIGKILL`, `kill`).
pub fn parse_signal(s: &str) -> Result<nix::sys::signal::Signal> {
    use std::str::FromStr;
    let unknown = || RuntimeError::InvalidInput(format!("unknown signal {s:?}"));
    if let Ok(n) = s.parse::<i32>() {
        return nix::sys::signal::Signal::try_from(n).map_err(|_| unknown());
    }
    let up = s.to_ascii_uppercase();
    let full = if up.starts_with("SIG") {
        up
    } else {
        format!("SIG{up}")
    };
    nix::sys::signal::Signal::from_str(&full).map_err(|_| unknown())
}
