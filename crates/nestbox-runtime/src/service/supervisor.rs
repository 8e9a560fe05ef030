//! The supervisor of one service: a detached process (`nestbox service
//! supervise NAME`) that holds the service's host port, runs the [`proxy`]
//! and keeps the replicas: as many as the spec asks, a dead one replaced, each
//! replaced on schedule with `--rejuvenate` (a new replica made and ready
//! first, then the old one retired from the proxy, then removed once its open
//! connections have ended or after [`DRAIN_TIMEOUT`]). SIGTERM or SIGINT
//! stop it, and so does its record's disappearance (its root removed): it
//! stops accepting, removes its replicas and exits.
//!
//! It makes and removes replicas by running nestbox's own `clone -d` and
//! `rm -f` as child processes (an exception to "a call, not a shell-out"): the
//! supervisor is multi-threaded (one relay thread per connection), and
//! nestbox's clone machinery forks helpers that must be forked from a
//! single-threaded process; `fork` + `exec` of a new nestbox is safe from any.
//! A replica is ready when a TCP connect to its port succeeds.

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use super::proxy::{self, Backend, Balancer};
use super::{
    load, log_path, replica_name, state_path, ReplicaState, ServiceSpec, ServiceState,
    DRAIN_TIMEOUT,
};
use crate::liveness::ProcRef;
use crate::registry::Registry;
use crate::state::{write_json, Status};
use crate::{Result, RuntimeError};

/// How often the supervisor looks at its replicas.
const TICK: Duration = Duration::from_millis(100);
/// How long a new replica may take to accept a connection.
const REPLICA_READY: Duration = Duration::from_secs(10);

/// How the supervisor runs nestbox: the executable and the arguments that
/// select the root (`--root DIR`, or none).
#[derive(Debug, Clone)]
pub struct Nestbox {
    /// The nestbox executable.
    pub exe: PathBuf,
    /// Arguments before the subcommand.
    pub root_args: Vec<OsString>,
}

impl Nestbox {
    fn run(&self, args: &[&str]) -> std::result::Result<String, String> {
        let out = Command::new(&self.exe)
            .args(&self.root_args)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run {}: {e}", self.exe.display()))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            let line = err.lines().last().unwrap_or("").trim();
            Err(line
                .strip_prefix("nestbox: error: ")
                .unwrap_or(line)
                .to_string())
        }
    }
}

/// A replica the supervisor keeps.
#[derive(Debug)]
struct Replica {
    backend: Arc<Backend>,
    made: Instant,
    retired: Option<Instant>,
}

struct Supervisor<'a> {
    reg: &'a Registry,
    nestbox: Nestbox,
    spec: ServiceSpec,
    balancer: Arc<Balancer>,
    replicas: Vec<Replica>,
    next_number: u64,
    state: ServiceState,
    next_rejuvenation: Option<Instant>,
}

/// Run the supervisor of service `name` until SIGTERM/SIGINT.
pub fn run(reg: &Registry, name: &str, nestbox: Nestbox) -> Result<()> {
    crate::diag::to_file(log_path(reg.roots(), name), false);
    // Blocked before any thread exists, so every thread inherits the mask and
    // the signals wait in the descriptor.
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT] {
        set.add(s);
    }
    nix::sys::signal::sigprocmask(SigmaskHow::SIG_BLOCK, Some(&set), None)
        .map_err(RuntimeError::sys("sigprocmask"))?;
    let signals = SignalFd::with_flags(&set, SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK)
        .map_err(RuntimeError::sys("signalfd"))?;
    // One supervisor per service, for its whole life (a dead one's lock is
    // free: `gc` starts another, see [`super::orphaned`]).
    let Some(_lock) = crate::state::lock_file(&super::lock_path(reg.roots(), name), false)? else {
        tracing::warn!("service {name}: another supervisor runs it; this one stops");
        return Ok(());
    };
    let spec = load(reg.roots(), name)?.spec;
    let mut sup = Supervisor {
        reg,
        nestbox,
        balancer: Arc::new(Balancer::default()),
        replicas: Vec::new(),
        next_number: 1,
        state: ServiceState {
            supervisor: Some(ProcRef::current()),
            ..Default::default()
        },
        next_rejuvenation: None,
        spec,
    };
    let listener = match TcpListener::bind(("0.0.0.0", sup.spec.host_port)) {
        Ok(l) => l,
        Err(e) => {
            let msg = format!("cannot listen on host port {}: {e}", sup.spec.host_port);
            sup.fail(&msg);
            return Err(RuntimeError::Failed(msg));
        }
    };
    let listen_fd = listener.as_raw_fd();
    let stop = Arc::new(AtomicBool::new(false));
    let (b, s) = (sup.balancer.clone(), stop.clone());
    let accept = std::thread::Builder::new()
        .name("accept".into())
        .spawn(move || proxy::serve(listener, b, s))
        .map_err(|e| RuntimeError::Failed(format!("no thread for the proxy: {e}")))?;
    sup.publish();
    let result = sup.keep(&signals);
    // Stop accepting: wake the accept thread (a shut-down listening socket
    // fails its accept), then remove every replica.
    stop.store(true, Ordering::SeqCst);
    let _ = nix::sys::socket::shutdown(listen_fd, nix::sys::socket::Shutdown::Both);
    let _ = accept.join();
    let names: Vec<String> = sup
        .replicas
        .drain(..)
        .map(|r| r.backend.name.clone())
        .collect();
    for n in names {
        sup.remove_box(&n);
    }
    sup.publish();
    result
}

impl Supervisor<'_> {
    /// The supervision loop; returns on a stop signal or a failure to start.
    fn keep(&mut self, signals: &SignalFd) -> Result<()> {
        loop {
            match load(self.reg.roots(), &self.spec.name) {
                Ok(s) => self.spec = s.spec,
                // The record is gone (its root removed): nothing to serve.
                Err(_)
                    if !super::is_service_dir(&super::dir(self.reg.roots(), &self.spec.name)) =>
                {
                    tracing::warn!("service {}: its record is gone; stopping", self.spec.name);
                    return Ok(());
                }
                Err(_) => {}
            }
            if let Err(e) = self.step() {
                if !self.state.ready {
                    let msg = e.to_string();
                    self.fail(&msg);
                    return Err(e);
                }
                tracing::warn!("service {}: {e}", self.spec.name);
            }
            self.publish();
            let mut fds = [nix::poll::PollFd::new(
                std::os::fd::AsFd::as_fd(signals),
                nix::poll::PollFlags::POLLIN,
            )];
            let _ = nix::poll::poll(
                &mut fds,
                nix::poll::PollTimeout::from(TICK.as_millis() as u16),
            );
            if let Ok(Some(sig)) = signals.read_signal() {
                tracing::info!(
                    "service {}: stopping on signal {}",
                    self.spec.name,
                    sig.ssi_signo
                );
                return Ok(());
            }
        }
    }

    /// One round: replace dead replicas, reach the replica count, rejuvenate
    /// one replica when due, remove drained ones.
    fn step(&mut self) -> Result<()> {
        // Dead replicas: out of the proxy at once, then replaced below.
        let dead: Vec<(String, String)> = self
            .replicas
            .iter()
            .filter(|r| r.retired.is_none())
            .filter_map(|r| Some((r.backend.name.clone(), self.ended(&r.backend.name)?)))
            .collect();
        for (n, why) in dead {
            tracing::warn!(
                "service {}: replica {n} ended ({why}); replacing it",
                self.spec.name
            );
            self.balancer.retire(&n);
            self.replicas.retain(|r| r.backend.name != n);
            self.remove_box(&n);
            self.state.replaced_dead += 1;
        }
        while self.active() < self.spec.replicas {
            self.add_replica()?;
        }
        if !self.state.ready {
            self.state.ready = true;
            self.schedule_rejuvenation();
        }
        while self.active() > self.spec.replicas {
            self.retire_oldest();
        }
        if self.next_rejuvenation.is_some_and(|t| Instant::now() >= t) {
            // The new replica is ready before the oldest stops taking connections.
            self.add_replica()?;
            self.retire_oldest();
            self.state.rejuvenated += 1;
            self.schedule_rejuvenation();
        }
        let drained: Vec<String> = self
            .replicas
            .iter()
            .filter(|r| {
                r.retired.is_some_and(|t| {
                    r.backend.open.load(Ordering::SeqCst) == 0 || t.elapsed() >= DRAIN_TIMEOUT
                })
            })
            .map(|r| r.backend.name.clone())
            .collect();
        for n in drained {
            self.replicas.retain(|r| r.backend.name != n);
            self.remove_box(&n);
        }
        Ok(())
    }

    fn active(&self) -> usize {
        self.replicas.iter().filter(|r| r.retired.is_none()).count()
    }

    fn schedule_rejuvenation(&mut self) {
        self.next_rejuvenation = self.spec.rejuvenate_ms.map(|ms| {
            Instant::now() + Duration::from_millis(ms / self.spec.replicas.max(1) as u64)
        });
    }

    /// Why replica `name` is no longer running, if it is not.
    fn ended(&self, name: &str) -> Option<String> {
        match self.reg.load(name) {
            Ok(r) => match r.state.effective_status() {
                Status::Running | Status::Creating => None,
                s => Some(format!(
                    "it is {}, exit code {:?}, {}; its last output: {:?}",
                    s.as_str(),
                    r.state.exit_code,
                    r.state.error.as_deref().unwrap_or("no error recorded"),
                    last_output(&r)
                )),
            },
            Err(RuntimeError::NoSuchBox(_)) => Some("its box is gone".into()),
            // Unreadable for a moment: looked at again next time.
            Err(_) => None,
        }
    }

    /// Take the oldest active replica out of the proxy; it is removed once drained.
    fn retire_oldest(&mut self) {
        let Some(r) = self
            .replicas
            .iter_mut()
            .filter(|r| r.retired.is_none())
            .min_by_key(|r| r.made)
        else {
            return;
        };
        self.balancer.retire(&r.backend.name);
        r.retired = Some(Instant::now());
    }

    /// Clone a new replica, wait until it accepts connections, add it to the proxy.
    fn add_replica(&mut self) -> Result<()> {
        let mut last = String::new();
        for _ in 0..3 {
            let name = replica_name(&self.spec.name, self.next_number);
            self.next_number += 1;
            match self
                .nestbox
                .run(&["clone", "-d", "--name", &name, &self.spec.template])
            {
                Ok(_) => return self.admit(name),
                // A box of that name exists: the next number.
                Err(e) if e.contains("already exists") => last = e,
                Err(e) => {
                    return Err(RuntimeError::Failed(format!(
                        "cloning template {:?} as {name:?}: {e}",
                        self.spec.template
                    )))
                }
            }
        }
        Err(RuntimeError::Failed(last))
    }

    fn admit(&mut self, name: String) -> Result<()> {
        let addr = match self.address(&name) {
            Ok(a) => a,
            Err(e) => {
                self.remove_box(&name);
                return Err(e);
            }
        };
        let end = Instant::now() + REPLICA_READY;
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                break;
            }
            if Instant::now() >= end {
                self.remove_box(&name);
                return Err(RuntimeError::Failed(format!(
                    "replica {name:?} does not accept connections on {addr} within {}s",
                    REPLICA_READY.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let backend = Arc::new(Backend {
            name,
            addr,
            open: AtomicUsize::new(0),
        });
        self.balancer.add(backend.clone());
        self.replicas.push(Replica {
            backend,
            made: Instant::now(),
            retired: None,
        });
        Ok(())
    }

    /// The address and port the proxy connects to for replica `name`.
    fn address(&self, name: &str) -> Result<SocketAddr> {
        let record = self.reg.load(name)?;
        let ip = record
            .state
            .network
            .as_ref()
            .and_then(|n| n.get("address"))
            .and_then(|a| a.as_str())
            .and_then(|a| a.split('/').next())
            .and_then(|a| a.parse::<IpAddr>().ok())
            .ok_or_else(|| {
                RuntimeError::Failed(format!("replica {name:?} has no network address"))
            })?;
        Ok(SocketAddr::new(ip, self.spec.box_port))
    }

    fn remove_box(&self, name: &str) {
        if let Err(e) = self.nestbox.run(&["rm", "-f", name]) {
            if !e.contains("no box named") {
                tracing::warn!("service {}: removing replica {name}: {e}", self.spec.name);
            }
        }
    }

    fn fail(&mut self, msg: &str) {
        self.state.error = Some(msg.to_string());
        self.publish();
    }

    /// Write the state for `ls`, `inspect` and the waiting commands.
    fn publish(&mut self) {
        self.state.replicas = self
            .replicas
            .iter()
            .map(|r| ReplicaState {
                name: r.backend.name.clone(),
                address: r.backend.addr.to_string(),
                role: if r.retired.is_some() {
                    "draining"
                } else {
                    "active"
                }
                .into(),
                connections: r.backend.open.load(Ordering::SeqCst),
                age_s: (r.made.elapsed().as_secs_f64() * 10.0).round() / 10.0,
            })
            .collect();
        self.state.replicas.sort_by_key(|r| r.role != "active");
        self.state.accepted = self.balancer.accepted.load(Ordering::Relaxed);
        self.state.failed = self.balancer.failed.load(Ordering::Relaxed);
        let path = state_path(self.reg.roots(), &self.spec.name);
        if let Err(e) = write_json(&path, &self.state) {
            tracing::warn!("service {}: {e}", self.spec.name);
        }
    }
}

/// The last lines a replica wrote (for the log of its end).
fn last_output(r: &crate::registry::BoxRecord) -> String {
    let mut text = Vec::new();
    if let Ok(Some(mut reader)) = crate::logs::LogReader::open(&r.log_path()) {
        while let Ok(Some((_, data))) = reader.next_record() {
            text.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}
