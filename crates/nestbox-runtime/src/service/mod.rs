//! Services (μDenali's continuous rejuvenation): K clones of a template
//! behind one published host port, replaced on a schedule and when they die.
//!
//! `service create` records the service under `$ROOT/run/services/NAME/`
//! (`service.json`: the spec; `state.json`: what its supervisor reports;
//! `log`: the supervisor's warnings) and starts its supervisor, a detached
//! `nestbox service supervise NAME` process ([`supervisor`]), which holds the
//! host port and relays each connection to an active replica ([`proxy`]).
//! `scale` rewrites the spec's replica count, which the supervisor follows;
//! `rm` stops the supervisor (SIGTERM: it stops accepting, removes its
//! replicas and exits) and removes whatever a dead supervisor left.
//! A supervisor holds the service's `lock` file (`flock`) for its life, so at
//! most one runs per service; `gc` finds a service whose supervisor died
//! without recording a failure (SIGKILL, a crash), removes the replicas it
//! left and starts a new supervisor ([`orphaned`]).
//!
//! Replicas are boxes named `NAME.rN` (N counts up), clones of the template
//! on its network; the proxy connects to `ADDRESS:BOXPORT` of each.

pub mod proxy;
pub mod supervisor;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::liveness::ProcRef;
use crate::paths::Roots;
use crate::registry::Registry;
use crate::state::{read_json, write_json};
use crate::{Result, RuntimeError};

/// The most replicas a service may have.
pub const MAX_REPLICAS: usize = 64;
/// The shortest rejuvenation period.
pub const MIN_REJUVENATE: Duration = Duration::from_secs(1);
/// How long a retired replica may keep open connections before it is removed.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long `create` and `scale` wait for the replicas to be ready.
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// What the user asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceSpec {
    /// Service name.
    pub name: String,
    /// The template its replicas are cloned from.
    pub template: String,
    /// How many replicas take connections.
    pub replicas: usize,
    /// Replace each replica after this many milliseconds (staggered: one
    /// replica every `rejuvenate_ms / replicas`).
    #[serde(default)]
    pub rejuvenate_ms: Option<u64>,
    /// The host port the service is reached on (TCP, all addresses).
    pub host_port: u16,
    /// The port its replicas listen on.
    pub box_port: u16,
}

/// One replica as its supervisor reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaState {
    /// Its box name.
    pub name: String,
    /// `ADDRESS:PORT` the proxy connects to.
    pub address: String,
    /// `active` (takes connections) or `draining` (retired, waiting for its
    /// open connections to end).
    pub role: String,
    /// Open connections relayed to it.
    pub connections: usize,
    /// Seconds since it was made.
    pub age_s: f64,
}

/// What the supervisor reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServiceState {
    /// The supervisor process.
    pub supervisor: Option<ProcRef>,
    /// All replicas asked for were made once.
    pub ready: bool,
    /// Why the supervisor failed, if it did.
    pub error: Option<String>,
    /// Replicas, active first.
    pub replicas: Vec<ReplicaState>,
    /// Replicas replaced on schedule so far.
    pub rejuvenated: u64,
    /// Replicas replaced because they ended.
    pub replaced_dead: u64,
    /// Connections accepted so far.
    pub accepted: u64,
    /// Connections no replica took.
    pub failed: u64,
}

impl ServiceState {
    /// How many replicas take connections.
    pub fn active(&self) -> usize {
        self.replicas.iter().filter(|r| r.role == "active").count()
    }
}

/// Checks a replica count.
fn check_replicas(replicas: usize) -> Result<()> {
    if (1..=MAX_REPLICAS).contains(&replicas) {
        Ok(())
    } else {
        Err(invalid(format!(
            "--replicas {replicas} is out of range: a service has 1 to {MAX_REPLICAS} replicas"
        )))
    }
}

/// A service as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct Service {
    /// Its spec.
    pub spec: ServiceSpec,
    /// Its supervisor's report.
    pub state: ServiceState,
    /// Whether its supervisor runs.
    pub running: bool,
}

/// The directory of all services.
pub fn services_dir(roots: &Roots) -> PathBuf {
    roots.run.join("services")
}

pub(crate) fn dir(roots: &Roots, name: &str) -> PathBuf {
    services_dir(roots).join(name)
}

fn spec_path(roots: &Roots, name: &str) -> PathBuf {
    dir(roots, name).join("service.json")
}

fn state_path(roots: &Roots, name: &str) -> PathBuf {
    dir(roots, name).join("state.json")
}

/// The lock a live supervisor holds.
pub(crate) fn lock_path(roots: &Roots, name: &str) -> PathBuf {
    dir(roots, name).join("lock")
}

/// The supervisor's log.
pub fn log_path(roots: &Roots, name: &str) -> PathBuf {
    dir(roots, name).join("log")
}

/// The name of replica number `n` of service `name`.
pub fn replica_name(name: &str, n: u64) -> String {
    format!("{name}.r{n}")
}

fn invalid(msg: String) -> RuntimeError {
    RuntimeError::InvalidInput(msg)
}

/// Parse a duration such as `30s`, `500ms`, `2m` or `1h`.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| {
        invalid(format!(
            "invalid duration {text:?} (expected e.g. 30s, 500ms, 2m)"
        ))
    })?;
    let ms = match unit {
        "ms" => n,
        "s" | "" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        _ => {
            return Err(invalid(format!(
                "invalid duration {text:?} (expected e.g. 30s, 500ms, 2m)"
            )))
        }
    };
    Ok(Duration::from_millis(ms))
}

impl ServiceSpec {
    /// Check what can be checked before anything is made: the name, the
    /// counts, the period, and that the template exists, is frozen and has a
    /// network to be reached on.
    pub fn validate(&self, reg: &Registry) -> Result<()> {
        crate::spec::validate_user_name(&self.name)
            .map_err(|_| invalid(format!("invalid service name {:?}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit", self.name)))?;
        check_replicas(self.replicas)?;
        if let Some(ms) = self.rejuvenate_ms {
            if Duration::from_millis(ms) < MIN_REJUVENATE {
                return Err(invalid(format!(
                    "--rejuvenate {ms}ms is too short: at least 1s"
                )));
            }
        }
        let t = crate::templates::template::load_frozen(reg, &self.template)?;
        if t.spec.network.mode != crate::spec::NetworkMode::Bridge {
            return Err(invalid(format!(
                "template {:?} has no network address to reach replicas on: run it with --network bridge or a network's name",
                self.template
            )));
        }
        Ok(())
    }
}

/// Load service `name`.
pub fn load(roots: &Roots, name: &str) -> Result<Service> {
    let path = spec_path(roots, name);
    if !path.exists() {
        return Err(invalid(format!("no service named {name:?}")));
    }
    let spec: ServiceSpec = read_json(&path)?;
    let state: ServiceState = match read_json(&state_path(roots, name)) {
        Ok(s) => s,
        Err(RuntimeError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            ServiceState::default()
        }
        Err(e) => return Err(e),
    };
    let running = state.supervisor.is_some_and(|p| p.alive());
    Ok(Service {
        spec,
        state,
        running,
    })
}

/// Every service, by name.
pub fn list(roots: &Roots) -> Result<Vec<Service>> {
    let mut names: Vec<String> = match fs::read_dir(services_dir(roots)) {
        Ok(entries) => entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.'))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(RuntimeError::io("readdir", services_dir(roots))(e)),
    };
    names.sort();
    Ok(names.iter().filter_map(|n| load(roots, n).ok()).collect())
}

/// Record service `spec` (its directory must not exist). The caller then
/// starts its supervisor and waits with [`wait_ready`].
pub fn record(reg: &Registry, spec: &ServiceSpec) -> Result<()> {
    spec.validate(reg)?;
    nestbox_net::PortMapping {
        host_port: spec.host_port,
        box_port: spec.box_port,
        proto: nestbox_net::Proto::Tcp,
    }
    .check_host_port_free()?;
    let parent = services_dir(reg.roots());
    fs::create_dir_all(&parent).map_err(RuntimeError::io("mkdir", &parent))?;
    let d = dir(reg.roots(), &spec.name);
    match fs::create_dir(&d) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            return Err(invalid(format!(
                "a service named {:?} already exists",
                spec.name
            )))
        }
        Err(e) => return Err(RuntimeError::io("mkdir", &d)(e)),
    }
    write_json(&spec_path(reg.roots(), &spec.name), spec)
}

/// Wait until service `name` has `want` active replicas (all of them made
/// once, for `want == None`), its supervisor fails, or [`READY_TIMEOUT`].
pub fn wait_ready(roots: &Roots, name: &str, want: Option<usize>) -> Result<()> {
    let end = Instant::now() + READY_TIMEOUT;
    loop {
        let s = load(roots, name)?;
        if let Some(e) = &s.state.error {
            return Err(RuntimeError::Failed(format!("service {name:?}: {e}")));
        }
        let active = s.state.active();
        let done = match want {
            None => s.state.ready,
            Some(k) => s.state.ready && active == k,
        };
        if done {
            return Ok(());
        }
        if s.state.supervisor.is_some() && !s.running {
            return Err(RuntimeError::Failed(format!(
                "service {name:?}: its supervisor ended (see {})",
                log_path(roots, name).display()
            )));
        }
        if Instant::now() >= end {
            return Err(RuntimeError::Failed(format!(
                "service {name:?}: its replicas were not ready within {}s (see {})",
                READY_TIMEOUT.as_secs(),
                log_path(roots, name).display()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Set the replica count of service `name` (its supervisor follows).
pub fn scale(roots: &Roots, name: &str, replicas: usize) -> Result<()> {
    let s = load(roots, name)?;
    check_replicas(replicas)?;
    if !s.running {
        return Err(invalid(format!(
            "service {name:?} is not running (its supervisor ended): remove it and create it again"
        )));
    }
    let spec = ServiceSpec { replicas, ..s.spec };
    write_json(&spec_path(roots, name), &spec)?;
    wait_ready(roots, name, Some(replicas))
}

/// Remove service `name`: stop its supervisor (which removes its replicas),
/// then remove any replica a dead supervisor left, and the record.
pub fn remove(reg: &Registry, name: &str) -> Result<()> {
    let s = load(reg.roots(), name)?;
    if let Some(p) = s.state.supervisor.filter(|p| p.alive()) {
        let pid = nix::unistd::Pid::from_raw(p.pid);
        // ESRCH: it ended meanwhile, as wanted.
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        if !p.ends_within(DRAIN_TIMEOUT + Duration::from_secs(30)) {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            p.ends_within(Duration::from_secs(5));
        }
    }
    remove_leftovers(reg, name)?;
    let d = dir(reg.roots(), name);
    crate::registry::remove_tree(&d)
}

/// Remove the replicas of service `name` that still exist: those its state
/// lists and any box named as its replicas are.
pub fn remove_leftovers(reg: &Registry, name: &str) -> Result<()> {
    let prefix = format!("{name}.r");
    for record in reg.list()? {
        let n = record.name();
        if n.strip_prefix(&prefix)
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
        {
            match crate::ops::remove(reg, n, true) {
                Ok(()) | Err(RuntimeError::NoSuchBox(_)) => {}
                Err(RuntimeError::InBox { source, .. })
                    if matches!(*source, RuntimeError::NoSuchBox(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Services whose supervisor died without recording a failure (killed, or
/// crashed): for each, under its lock (so that no new supervisor is starting),
/// the replicas it left are removed (nothing relays to them any more) and its
/// state is cleared. The caller then starts a supervisor for each name
/// returned, which makes the replicas anew, and waits with [`wait_ready`].
/// A service whose supervisor recorded a failure is left for `rm`.
pub fn orphaned(reg: &Registry) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for s in list(reg.roots())? {
        if s.running || s.state.supervisor.is_none() || s.state.error.is_some() {
            continue;
        }
        let name = s.spec.name;
        // Held: a supervisor runs after all (it started after the listing).
        let Some(lock) = crate::state::lock_file(&lock_path(reg.roots(), &name), false)? else {
            continue;
        };
        let s = load(reg.roots(), &name)?;
        if s.running || s.state.supervisor.is_none() {
            continue;
        }
        tracing::warn!(
            "service {name}: its supervisor (pid {}) died; removing its replicas and starting another",
            s.state.supervisor.map_or(0, |p| p.pid)
        );
        remove_leftovers(reg, &name)?;
        write_json(&state_path(reg.roots(), &name), &ServiceState::default())?;
        drop(lock);
        names.push(name);
    }
    Ok(names)
}

/// Whether `dir` holds a service record.
pub fn is_service_dir(dir: &Path) -> bool {
    dir.join("service.json").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        for bad in ["", "s", "1x", "-1s", "1.5s"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replica_names() {
        assert_eq!(replica_name("web", 3), "web.r3");
    }
}
