//! `nestbox service create|ls|inspect|scale|rm`: services, K clones of a
//! template behind one published host port, replaced on a schedule
//! (`--rejuvenate`) and when they die; `service supervise` is the detached
//! supervisor those commands start and stop (see
//! `nestbox_runtime::service`).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use nestbox_runtime::registry::Registry;
use nestbox_runtime::service::{self, supervisor, ServiceSpec};

/// `nestbox service ...`
#[derive(Debug, Subcommand)]
pub enum ServiceCommand {
    /// Make a service: REPLICAS clones of TEMPLATE behind one host port, each
    /// connection relayed to one of them in turn.
    Create {
        /// The service's name (its replicas are boxes named NAME.rN).
        name: String,
        /// The frozen template its replicas are cloned from (on a network).
        #[arg(long)]
        template: String,
        /// How many replicas take connections.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
        /// Replace each replica by a fresh clone after this long (e.g. 30s),
        /// one replica at a time: the new one is ready before the old one
        /// stops taking connections, and the old one drains first.
        #[arg(long, value_name = "DURATION")]
        rejuvenate: Option<String>,
        /// The published address: HOSTPORT:BOXPORT (TCP).
        #[arg(short = 'p', long = "publish", value_name = "HOST:BOX")]
        publish: String,
    },
    /// List services.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a service (spec, replicas, counters) as JSON.
    Inspect {
        /// The service.
        name: String,
    },
    /// Change a service's number of replicas.
    Scale {
        /// The service.
        name: String,
        /// The new number of replicas.
        replicas: usize,
    },
    /// Remove a service and its replicas.
    Rm {
        /// The services.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// The supervisor of a service (started by `service create`).
    #[command(hide = true)]
    Supervise {
        /// The service.
        name: String,
    },
}

/// The arguments that make a nestbox child use this root.
fn root_args(root: &Option<PathBuf>) -> Vec<OsString> {
    match root {
        Some(r) => vec!["--root".into(), r.clone().into_os_string()],
        None => Vec::new(),
    }
}

/// Run `nestbox service ...`.
pub fn service(reg: &Registry, root: &Option<PathBuf>, cmd: ServiceCommand) -> Result<i32> {
    match cmd {
        ServiceCommand::Create {
            name,
            template,
            replicas,
            rejuvenate,
            publish,
        } => {
            let mapping = nestbox_net::PortMapping::parse(&publish)
                .with_context(|| format!("-p {publish}"))?;
            if mapping.proto != nestbox_net::Proto::Tcp {
                bail!("-p {publish}: a service publishes a TCP port");
            }
            let rejuvenate_ms = rejuvenate
                .as_deref()
                .map(|r| service::parse_duration(r).map(|d| d.as_millis() as u64))
                .transpose()
                .context("--rejuvenate")?;
            let spec = ServiceSpec {
                name: name.clone(),
                template,
                replicas,
                rejuvenate_ms,
                host_port: mapping.host_port,
                box_port: mapping.box_port,
            };
            service::record(reg, &spec)?;
            let started = start_supervisor(root, &name)
                .and_then(|()| Ok(service::wait_ready(reg.roots(), &name, None)?));
            if let Err(e) = started {
                // Nothing half-made stays: the supervisor, its replicas, the record.
                let _ = service::remove(reg, &name);
                return Err(e);
            }
            println!("{name}");
            Ok(0)
        }
        ServiceCommand::Ls { json } => {
            let all = service::list(reg.roots())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&all)?);
                return Ok(0);
            }
            println!(
                "{:<20} {:<20} {:>9} {:>11} {:>10} {:>8}",
                "NAME", "TEMPLATE", "REPLICAS", "PORT", "REJUVENATE", "STATUS"
            );
            for s in all {
                let active = s.state.active();
                println!(
                    "{:<20} {:<20} {:>9} {:>11} {:>10} {:>8}",
                    s.spec.name,
                    s.spec.template,
                    format!("{active}/{}", s.spec.replicas),
                    format!("{}:{}", s.spec.host_port, s.spec.box_port),
                    s.spec
                        .rejuvenate_ms
                        .map_or("-".to_string(), |ms| format!("{}s", ms as f64 / 1000.0)),
                    if s.running { "running" } else { "stopped" }
                );
            }
            Ok(0)
        }
        ServiceCommand::Inspect { name } => {
            let s = service::load(reg.roots(), &name)?;
            println!("{}", serde_json::to_string_pretty(&s)?);
            Ok(0)
        }
        ServiceCommand::Scale { name, replicas } => {
            service::scale(reg.roots(), &name, replicas)?;
            Ok(0)
        }
        ServiceCommand::Rm { names } => {
            for name in names {
                service::remove(reg, &name)?;
            }
            Ok(0)
        }
        ServiceCommand::Supervise { name } => {
            let nestbox = supervisor::Nestbox {
                exe: std::env::current_exe().context("the nestbox executable")?,
                root_args: root_args(root),
            };
            supervisor::run(reg, &name, nestbox)?;
            Ok(0)
        }
    }
}

/// Start `nestbox service supervise NAME` detached: its own session, stdio on
/// /dev/null (its warnings go to the service's log).
pub(crate) fn start_supervisor(root: &Option<PathBuf>, name: &str) -> Result<()> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("the nestbox executable")?;
    let mut cmd = Command::new(exe);
    cmd.args(root_args(root))
        .args(["service", "supervise", name])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    let child = cmd.spawn().context("start the service's supervisor")?;
    // Not waited for: it outlives this command; its exit is noticed by the
    // state's liveness check, and the init process reaps it.
    drop(child);
    Ok(())
}
