//! Command-line syntax (Docker-like) and dispatch to the runtime.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use nestbox_cgroup::Limits;
use nestbox_runtime::exec::ExecOptions;
use nestbox_runtime::paths::Roots;
use nestbox_runtime::registry::{generated_name, Registry};
use nestbox_runtime::size::parse_size;
use nestbox_runtime::spec::{
    parse_user, parse_volume, BoxSpec, NetSpec, NetworkMode, SeccompChoice,
};
use nestbox_runtime::{ops, RuntimeError};

use crate::output;

/// Lightweight, strongly isolated Linux sandboxes.
#[derive(Debug, Parser)]
#[command(name = "nestbox", version, about, long_about = None)]
pub struct Cli {
    /// Keep all state under DIR (DIR/run and DIR/lib) instead of /run/nestbox and
    /// /var/lib/nestbox. Also set by NESTBOX_ROOT.
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

impl Cli {
    /// Parse the command line. A `run` is parsed by a parser that knows only
    /// `run` (and the global `--root`): building the whole command tree takes
    /// about 0.4 ms, a tenth of a pooled start. It accepts nothing the full
    /// parser would not parse the same way (its `run` is the same `RunArgs`);
    /// anything it refuses (help, a mistake, another command) goes to the
    /// full parser, which says what the full parser says.
    pub fn parse_args() -> std::result::Result<Cli, clap::Error> {
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        if args.iter().skip(1).any(|a| a == "run") {
            if let Ok(r) = RunOnly::try_parse_from(&args) {
                let RunOnlyCommand::Run(run) = r.command;
                return Ok(Cli {
                    root: r.root,
                    command: Command::Run(run),
                });
            }
        }
        Cli::try_parse_from(args)
    }
}

/// The part of [`Cli`] that parses `run` (see [`Cli::parse_args`]).
#[derive(Debug, Parser)]
#[command(name = "nestbox", version)]
struct RunOnly {
    #[arg(long, global = true, value_name = "DIR")]
    root: Option<PathBuf>,
    #[command(subcommand)]
    command: RunOnlyCommand,
}

#[derive(Debug, Subcommand)]
enum RunOnlyCommand {
    Run(Box<RunArgs>),
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a command in a new box.
    Run(Box<RunArgs>),
    /// List boxes (running ones; -a for all).
    Ps {
        /// Show all boxes, not just running ones.
        #[arg(short, long)]
        all: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Show the boxes inside running nest boxes too (`run --nest`), as
        /// `parent/child`, to any depth.
        #[arg(long)]
        tree: bool,
    },
    /// Show everything known about a box, as JSON.
    Inspect {
        /// Box name.
        name: String,
    },
    /// Print a box's output.
    Logs {
        /// Keep printing new output until the box exits.
        #[arg(short, long)]
        follow: bool,
        /// Print the warnings and errors of the box's detached monitor instead
        /// (`$ROOT/lib/boxes/<id>/monitor.log`).
        #[arg(long, conflicts_with = "follow")]
        monitor: bool,
        /// Box name.
        name: String,
    },
    /// Run another command in a running box.
    Exec(ExecArgs),
    /// Stop a box: SIGTERM, then SIGKILL after the timeout.
    Stop {
        /// Seconds to wait before SIGKILL.
        #[arg(short = 't', long = "time", default_value_t = 10)]
        time: u64,
        /// Box name.
        name: String,
    },
    /// Send a signal to a box's command.
    Kill {
        /// Signal name or number.
        #[arg(short, long, default_value = "KILL")]
        signal: String,
        /// Box name.
        name: String,
    },
    /// Remove a box (a running one only with -f).
    Rm {
        /// Kill the box first if it is running.
        #[arg(short, long)]
        force: bool,
        /// Box names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Resource use of a box: CPU time, memory, pids.
    Stats {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Box name.
        name: String,
    },
    /// Attach a stack of monitors to a running box, detach it, or show it
    /// (docs/monitors.md, "Attaching to a running box").
    Monitor {
        #[command(subcommand)]
        cmd: MonitorCommand,
    },
    /// Attach gdb from outside to a process of a running box (its command by
    /// default): the box gets no capability and keeps its filter; gdb runs on
    /// the host as root and reads the program and its libraries from the
    /// box's root. Arguments after `--` go to gdb (e.g. `-batch -ex bt`).
    Debug {
        /// The process, by its pid in the box (default: the box's command, 2).
        #[arg(long, value_name = "PID")]
        pid: Option<i32>,
        /// Box name.
        name: String,
        /// gdb's own arguments.
        #[arg(last = true)]
        gdb_args: Vec<String>,
    },
    /// Remove dead boxes and every leftover no live box owns.
    Gc,
    /// The pool of box shells `run` starts boxes from (made ahead: namespaces,
    /// cgroup, root, network; only the command is left to start): show it
    /// (default), set its size, or drain it.
    Pool {
        #[command(subcommand)]
        cmd: Option<PoolCommand>,
    },
    /// Same-page merging (KSM) on this host: what it saves, what its scanner
    /// costs, and its settings (boxes take part with `run --ksm`).
    Ksm(KsmArgs),
    /// The overload watchdog: while the host's available memory is below a
    /// threshold, stop the running box furthest above its --memory-reserve.
    Watchdog(WatchdogArgs),
    /// Freeze a running box into a template that clones are forked from.
    Freeze {
        /// Name the template (default: the box name).
        #[arg(long = "as", value_name = "TEMPLATE")]
        as_name: Option<String>,
        /// Keep N clones forked ahead of time, so `clone` only has to claim one
        /// (the pool is refilled in the background after each claim).
        #[arg(long, value_name = "N", default_value_t = 0)]
        pool: usize,
        /// Also save the template on disk (as `template save` does): `clone`
        /// starts it again from there when it is gone (after a reboot).
        #[arg(long)]
        persist: bool,
        /// Box name.
        name: String,
    },
    /// List or remove templates.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Fork boxes from a template: each continues from its frozen state.
    Clone(CloneArgs),
    /// Save a running box (its process, threads, memory, fds, root layer and
    /// spec) as a checkpoint it can be restored from; `checkpoint ls|rm|inspect`
    /// manage checkpoints.
    Checkpoint(CheckpointArgs),
    /// Start a box from a checkpoint: it continues where the checkpointed box
    /// was (always in the background, like `run -d`).
    Restore {
        /// Name of the restored box (default: the checkpointed box's).
        #[arg(long)]
        name: Option<String>,
        /// In the background (as `run -d`): what restore always does; accepted
        /// for the habit of `run -d`.
        #[arg(short = 'd', long = "detach")]
        _detach: bool,
        /// Print JSON (name, pid, milliseconds).
        #[arg(long)]
        json: bool,
        /// Share memory with the other boxes restored so: the checkpoint is
        /// restored once as its template (ckpt-NAME) and the box is a clone of
        /// it (its hostname is then its name).
        #[arg(long)]
        shared: bool,
        /// With --shared, when the checkpoint's template is made: keep N
        /// clones of it forked ahead (as freeze --pool).
        #[arg(long, value_name = "N", default_value_t = 0, requires = "shared")]
        pool: usize,
        /// Run before the memory is filled: a box of one process gets its
        /// private memory from a page server of its own, each page when first
        /// touched and the rest in the background (see docs/checkpoint.md).
        #[arg(long, conflicts_with = "shared")]
        lazy: bool,
        /// Checkpoint name, a checkpoint directory (a path with a '/'), or `-`:
        /// a checkpoint stream on standard input (from `checkpoint -o -`),
        /// kept as the checkpoint of its name.
        checkpoint: String,
    },
    /// Move a running box to another nestbox host while it runs: its memory
    /// is copied ahead in rounds, then the box stops briefly, the last pages
    /// and its state follow, and it goes on there (see docs/checkpoint.md).
    Migrate {
        /// The box.
        #[arg(value_name = "BOX")]
        name: String,
        /// tcp:HOST:PORT (a `nestbox receive --listen` there) or exec:COMMAND
        /// (a command whose standard input and output reach `nestbox receive
        /// --stdio`, e.g. exec:ssh HOST nestbox receive --stdio).
        #[arg(long, value_name = "TARGET")]
        to: String,
        /// The box's name there (default: its name).
        #[arg(long = "name")]
        new_name: Option<String>,
        /// Pre-copy rounds at most after the first.
        #[arg(long, value_name = "N", default_value_t = 8)]
        rounds: usize,
        /// Print the migration's figures as JSON.
        #[arg(long)]
        json: bool,
        /// The target restores the box lazily (see `restore --lazy`): its
        /// memory is filled after it runs, so the stop does not grow with it.
        #[arg(long)]
        lazy: bool,
    },
    /// Take one box that `nestbox migrate` sends and run it here.
    Receive {
        /// Listen on ADDR:PORT for one migration.
        #[arg(
            long,
            value_name = "ADDR:PORT",
            conflicts_with = "stdio",
            required_unless_present = "stdio"
        )]
        listen: Option<String>,
        /// Take the migration on standard input, answer on standard output.
        #[arg(long)]
        stdio: bool,
    },
    /// Answer clone requests on a Unix socket (one JSON object per line; see
    /// docs/clones.md) until SIGTERM or SIGINT; with --http, also the E2B SDK's
    /// API over HTTP (see docs/e2b.md).
    Serve {
        /// Socket path (default: nestbox.sock in the root's runtime directory).
        #[arg(long)]
        socket: Option<PathBuf>,
        /// Also answer the E2B API (control plane and envd) on ADDR:PORT.
        #[arg(long, value_name = "ADDR:PORT")]
        http: Option<String>,
        /// An API key E2B clients must send (repeatable; none: any key).
        #[arg(long = "api-key", value_name = "KEY", requires = "http")]
        api_keys: Vec<String>,
    },
    /// The in-box agent of `serve --http` (run by it as a box's command).
    #[command(name = "e2b-agent", hide = true)]
    E2bAgent,
    /// Inside a nest box, run there by the nestbox outside it around the nest
    /// box's checkpoint, freeze or migration: suspend its running boxes
    /// (each saved with its processes and stopped) or resume them
    /// (docs/nesting.md).
    #[command(hide = true)]
    Subtree {
        #[command(subcommand)]
        cmd: SubtreeCommand,
    },
    /// Manage images in the content-addressed store.
    #[command(subcommand)]
    Image(crate::store_cmd::ImageCommand),
    /// Turn a box's current root filesystem into a new image.
    Commit(crate::store_cmd::CommitArgs),
    /// Inspect and maintain the object store.
    #[command(subcommand)]
    Store(crate::store_cmd::StoreCommand),
    /// Merge identical files across images and box layers into shared objects.
    Dedup(crate::store_cmd::DedupArgs),
    /// Record a box's writable layer as a snapshot (only files changed since
    /// the last one are read), with `--checkpoint` its processes too;
    /// `snapshot ls|rm` manage snapshots.
    Snapshot(crate::snapshot_cmd::SnapshotArgs),
    /// Put a box's files back as a snapshot had them (a running box is
    /// stopped and started again), and its processes when the snapshot has
    /// them (`snapshot --checkpoint`).
    Rollback(crate::snapshot_cmd::RollbackArgs),
    /// List the paths a box changed (A added, C changed, D deleted) against
    /// its image, or against a snapshot.
    Diff(crate::snapshot_cmd::DiffArgs),
    /// Inspect or remove box networks.
    #[command(subcommand)]
    Network(crate::network_cmd::NetworkCommand),
    /// Services: clones of a template behind one published port, replaced on
    /// a schedule (rejuvenation) and when they die.
    #[command(subcommand)]
    Service(crate::service_cmd::ServiceCommand),
}

#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct CheckpointArgs {
    #[command(subcommand)]
    cmd: Option<CheckpointCommand>,
    /// Name the checkpoint (default: the box name).
    #[arg(long = "as", value_name = "NAME")]
    as_name: Option<String>,
    /// Leave the box running (default: it is stopped once saved).
    #[arg(long)]
    leave_running: bool,
    /// Write a self-contained checkpoint into directory DIR (its pages and
    /// layers with it), to restore with `restore DIR` here or on another
    /// host; it is not listed by `checkpoint ls`. `-o -` writes it to
    /// standard output as a stream for `restore -`.
    #[arg(
        short = 'o',
        long = "output",
        value_name = "DIR",
        conflicts_with = "as_name"
    )]
    output: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Box name.
    #[arg(required = true)]
    name: Option<String>,
}

#[derive(Debug, Subcommand)]
enum CheckpointCommand {
    /// List checkpoints.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove checkpoints (their pages go at the next `gc` when no other
    /// checkpoint has them).
    Rm {
        /// Checkpoint names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Show a checkpoint (without its processes' registers), as JSON.
    Inspect {
        /// Checkpoint name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum TemplateCommand {
    /// List templates.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Save templates on disk (each as the checkpoint of its name): `clone`
    /// starts a template again from there when it is gone (after a reboot,
    /// on another host with the checkpoint directory).
    Save {
        /// Template names.
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Remove templates (with live clones, only the template's process goes; its
    /// init stays until the last clone is gone).
    Rm {
        /// Template names.
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Args)]
struct CloneArgs {
    /// Name of the clone (repeat with -n for several; default: generated).
    #[arg(long)]
    name: Vec<String>,
    /// Number of clones.
    #[arg(short = 'n', long = "count", default_value_t = 1)]
    count: usize,
    /// Print the clone names and return (otherwise a single clone is followed
    /// like `run` in the foreground: its output, then its exit code).
    #[arg(short, long)]
    detach: bool,
    /// Signal delivered to each clone's process right after the fork (so it can
    /// reseed random state), e.g. USR1.
    #[arg(long, value_name = "SIG")]
    on_clone_signal: Option<String>,
    /// `none`: the clone gets loopback only (no address, veth or bandwidth
    /// class) instead of its template's network; its servers answer on its
    /// loopback (e.g. through `exec`). `bridge` or a network's name (`nestbox
    /// network create`): the clone is put on that network instead.
    #[arg(long, value_name = "none|bridge|NAME")]
    network: Option<String>,
    #[command(flatten)]
    resources: ResourceArgs,
    /// Size of each clone's writable layer (default: its template's --disk).
    #[arg(long, value_name = "SIZE")]
    disk: Option<String>,
    /// Template name.
    template: String,
}

/// Bandwidth options (bridge networking).
#[derive(Debug, Args)]
struct BandwidthArgs {
    /// Hard cap of the box's egress (e.g. 10mbit).
    #[arg(long, value_name = "RATE")]
    net_rate: Option<String>,
    /// Egress bandwidth reserved for the box (e.g. 5mbit).
    #[arg(long, value_name = "RATE")]
    net_reserve: Option<String>,
    /// Weight of the box in sharing what is left of the link (1-1000, default 100).
    #[arg(long, value_name = "WEIGHT")]
    net_share: Option<u32>,
    /// Hard cap of the box's ingress (e.g. 10mbit).
    #[arg(long, value_name = "RATE")]
    net_ingress_rate: Option<String>,
}

impl BandwidthArgs {
    /// Put the parsed options into `net`.
    fn apply(&self, net: &mut NetSpec) -> Result<()> {
        let rate = |opt: &str, v: &Option<String>| -> Result<Option<nestbox_net::Rate>> {
            v.as_deref()
                .map(|t| nestbox_net::parse_rate(t).with_context(|| format!("--{opt}")))
                .transpose()
        };
        if let Some(r) = rate("net-rate", &self.net_rate)? {
            net.rate = Some(r);
        }
        if let Some(r) = rate("net-reserve", &self.net_reserve)? {
            net.reserve = Some(r);
        }
        if let Some(r) = rate("net-ingress-rate", &self.net_ingress_rate)? {
            net.ingress_rate = Some(r);
        }
        if self.net_share.is_some() {
            net.share = self.net_share;
        }
        Ok(())
    }
}

/// Resource options shared by `run` and `clone`.
#[derive(Debug, Args)]
struct ResourceArgs {
    /// Memory limit (e.g. 64m); the OOM killer acts inside the box only.
    #[arg(long, value_name = "SIZE")]
    memory: Option<String>,
    /// Memory reserved for the box (SIZE): reclaimed from it last, and the
    /// overload watchdog stops boxes by their use above it.
    #[arg(long, value_name = "SIZE")]
    memory_reserve: Option<String>,
    /// Memory plus swap limit (SIZE, or -1 for unlimited swap).
    #[arg(long, value_name = "SIZE", allow_hyphen_values = true)]
    memory_swap: Option<String>,
    /// Maximum number of processes and threads.
    #[arg(long, value_name = "N")]
    pids: Option<u64>,
    /// CPU hard cap in CPUs (e.g. 0.5).
    #[arg(long, value_name = "X")]
    cpus: Option<f64>,
    /// CPU fair-share weight (2..262144, default 1024).
    #[arg(long, value_name = "N")]
    cpu_shares: Option<u64>,
    /// CPUs guaranteed to the box under any competition (e.g. 0.5); all
    /// reservations together may take 90% of the CPUs.
    #[arg(long, value_name = "X")]
    cpu_reserve: Option<f64>,
    /// CPUs the box may run on (e.g. 0-1,3).
    #[arg(long, value_name = "LIST")]
    cpuset_cpus: Option<String>,
    /// Block-IO weight (10..1000).
    #[arg(long, value_name = "N")]
    io_weight: Option<u16>,
}

impl ResourceArgs {
    fn limits(&self) -> Result<Limits> {
        let a = self;
        Ok(Limits {
            memory: a
                .memory
                .as_deref()
                .map(parse_size)
                .transpose()
                .context("--memory")?,
            memory_reserve: a
                .memory_reserve
                .as_deref()
                .map(parse_size)
                .transpose()
                .context("--memory-reserve")?,
            memory_swap: match a.memory_swap.as_deref() {
                None => None,
                Some("-1") => Some(-1),
                Some(s) => Some(parse_size(s).context("--memory-swap")? as i64),
            },
            pids: a.pids,
            cpus: a.cpus,
            cpu_period_us: None,
            cpu_shares: a.cpu_shares,
            cpu_reserve: a.cpu_reserve,
            cpuset_cpus: a.cpuset_cpus.clone(),
            io_weight: a.io_weight,
            // Not options of nestbox's own command line (the OCI runtime's
            // linux.resources.memory sets them).
            memory_swappiness: None,
            oom_kill_disable: false,
            io_devices: Vec::new(),
            net_class_id: None,
            net_priorities: Vec::new(),
            hugepage_limits: Vec::new(),
        })
    }

    fn any(&self) -> bool {
        self.memory.is_some()
            || self.memory_reserve.is_some()
            || self.memory_swap.is_some()
            || self.pids.is_some()
            || self.cpus.is_some()
            || self.cpu_shares.is_some()
            || self.cpu_reserve.is_some()
            || self.cpuset_cpus.is_some()
            || self.io_weight.is_some()
    }
}

#[derive(Debug, Subcommand)]
enum MonitorCommand {
    /// Attach a stack of monitors (`--monitor` as `run` takes them) to every
    /// process of a running box but its init; processes it forks later are
    /// monitored too. `packets:…` inspects a bridged box's packets.
    Attach {
        /// A monitor, as `run --monitor` takes it; repeat for a stack.
        #[arg(long = "monitor", value_name = "SPEC", required = true)]
        monitors: Vec<String>,
        /// Box name.
        name: String,
    },
    /// Switch the attached stack off: every call is let through unasked
    /// (the filter stays until the box ends: a filter cannot be removed);
    /// the packet inspector's rules are taken out.
    Detach {
        /// Box name.
        name: String,
    },
    /// Show the stack attached to a box.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// Box name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum SubtreeCommand {
    /// Save every running box with its processes and stop it.
    Suspend,
    /// Start every suspended box again with its processes as saved.
    Resume,
}

#[derive(Debug, Subcommand)]
enum PoolCommand {
    /// Show the pool's size and, per shape of box, the shells ready.
    Ls {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Set how many shells of each shape of box are kept ready (0-16; the
    /// machine-wide root keeps 2 unless told, other roots 0). Fills the pool
    /// at once with shells of the default shape (a plain `run`) and of the
    /// shapes already asked for; other shapes are learned when a `run` of
    /// them finds none. 0 drains the pool.
    Size {
        /// Shells per shape.
        size: usize,
    },
    /// Remove every shell and forget the shapes (the size stays).
    Drain,
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Run in the background and print the box name.
    #[arg(short, long)]
    detach: bool,
    /// Box name (default: generated).
    #[arg(long)]
    name: Option<String>,
    /// Remove the box when it exits.
    #[arg(long)]
    rm: bool,
    /// Keep stdin open and pass it to the command.
    #[arg(short, long)]
    interactive: bool,
    /// Image to build the root from.
    #[arg(long, default_value = nestbox_image::HOST_IMAGE)]
    image: String,
    #[command(flatten)]
    resources: ResourceArgs,
    /// Network: bridge (own namespace on a host bridge, with an address; the
    /// default as root), none (loopback only; the default without root), host,
    /// or the name of a network made by `nestbox network create`.
    #[arg(long, value_name = "MODE|NAME")]
    network: Option<String>,
    /// Publish a port: HOSTPORT:BOXPORT[/tcp|udp] (repeatable; bridge only).
    #[arg(short = 'p', long = "publish", value_name = "HOST:BOX[/PROTO]")]
    publish: Vec<String>,
    /// Let the box open connections to this port of the host, on the network's
    /// gateway address: PORT[/tcp|udp] (repeatable; bridge only). The host is
    /// otherwise no destination for a box.
    #[arg(long = "allow-host-port", value_name = "PORT[/PROTO]")]
    allow_host_port: Vec<String>,
    /// Where beyond its network the box may open connections: allow-all (the
    /// default), deny-all, or ADDRESS[/PREFIX][:PORT],... (bridge only);
    /// decisions are logged to the kernel log.
    #[arg(long, value_name = "POLICY")]
    egress: Option<String>,
    #[command(flatten)]
    bandwidth: BandwidthArgs,
    /// Hostname (default: the box name).
    #[arg(long)]
    hostname: Option<String>,
    /// Environment variable KEY=VALUE (repeatable).
    #[arg(short, long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Working directory in the box.
    #[arg(short, long, value_name = "DIR", default_value = "/")]
    workdir: PathBuf,
    /// User to run as: UID[:GID].
    #[arg(short, long, value_name = "UID[:GID]")]
    user: Option<String>,
    /// Make the root filesystem read-only.
    #[arg(long)]
    read_only: bool,
    /// Let the kernel merge identical pages of the box's memory with other
    /// mergeable memory (KSM; inherited by its clones; see `nestbox ksm`).
    #[arg(long)]
    ksm: bool,
    /// Size of the box's writable layer (e.g. 1g): writing past it fails
    /// with ENOSPC in the box (a filesystem image of its own; root only).
    #[arg(long, value_name = "SIZE")]
    disk: Option<String>,
    /// Run the box under a monitor (repeatable: a stack, in order), which
    /// answers the system calls it subscribes to: trace:CALL,.. |
    /// files:deny=PATH,redirect=PATH=>OTHER | net:allow=CIDR[:PORT],.. |
    /// null:CALL,.. | socket:PATH:CALL,.. (docs/monitors.md).
    #[arg(long = "monitor", value_name = "NAME[:ARGS]")]
    monitors: Vec<String>,
    /// Mount a host path: HOST:BOX[:ro] (repeatable).
    #[arg(short, long = "volume", value_name = "HOST:BOX[:ro]")]
    volume: Vec<String>,
    /// Mount a fresh tmpfs at PATH (repeatable).
    #[arg(long, value_name = "PATH")]
    tmpfs: Vec<PathBuf>,
    /// Add a capability (repeatable, or ALL).
    #[arg(long, value_name = "CAP")]
    cap_add: Vec<String>,
    /// Drop a capability (repeatable, or ALL).
    #[arg(long, value_name = "CAP")]
    cap_drop: Vec<String>,
    /// Security options: seccomp=unconfined or seccomp=PROFILE.json.
    #[arg(long, value_name = "OPT")]
    security_opt: Vec<String>,
    /// Give the box a user namespace (always on without root, and inside a
    /// box).
    #[arg(long)]
    userns: bool,
    /// Let the box run boxes of its own (nestbox inside, without host root):
    /// a user namespace, its cgroups delegated, a state directory, the
    /// nestbox binary on its PATH (docs/nesting.md).
    #[arg(long)]
    nest: bool,
    /// The command and its arguments (after --).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<String>,
}

#[derive(Debug, Args)]
struct ExecArgs {
    /// Environment variable KEY=VALUE (repeatable).
    #[arg(short, long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Working directory.
    #[arg(short, long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// User: UID[:GID].
    #[arg(short, long, value_name = "UID[:GID]")]
    user: Option<String>,
    /// Accepted for Docker compatibility: stdin is always passed through.
    #[arg(short, long)]
    interactive: bool,
    /// Box name.
    name: String,
    /// The command and its arguments (after --).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<String>,
}

/// Run the parsed command; returns the process exit code.
pub fn dispatch(cli: Cli) -> Result<i32> {
    let reg = Registry::new(Roots::resolve(cli.root.as_deref()));
    let root = cli.root;
    match cli.command {
        Command::Run(args) => run(&reg, *args),
        Command::Ps { all, json, tree } => output::ps(&reg, all, json, tree).map(|_| 0),
        Command::Inspect { name } => {
            println!(
                "{}",
                serde_json::to_string_pretty(&ops::inspect(&reg, &name)?)?
            );
            Ok(0)
        }
        Command::Logs {
            monitor: true,
            name,
            ..
        } => output::monitor_log(&reg, &name).map(|_| 0),
        Command::Logs { follow, name, .. } => output::logs(&reg, &name, follow).map(|_| 0),
        Command::Exec(args) => {
            let opts = ExecOptions {
                command: args.command,
                env: args.env,
                workdir: args.workdir,
                user: args.user.as_deref().map(parse_user).transpose()?,
            };
            Ok(nestbox_runtime::exec::exec(&reg, &args.name, &opts)?)
        }
        Command::Stop { time, name } => {
            ops::stop(&reg, &name, Duration::from_secs(time))?;
            Ok(0)
        }
        Command::Kill { signal, name } => {
            ops::kill_box(&reg, &name, parse_signal(&signal)?)?;
            Ok(0)
        }
        Command::Rm { force, names } => {
            let mut failed = None;
            for e in ops::remove_many(&reg, &names, force)
                .into_iter()
                .filter_map(|r| r.err())
            {
                eprintln!("nestbox: error: {e}");
                failed = Some(e.exit_code());
            }
            Ok(failed.unwrap_or(0))
        }
        Command::Stats { json, name } => output::stats(&reg, &name, json).map(|_| 0),
        Command::Gc => output::gc(&reg, &root).map(|_| 0),
        Command::Pool { cmd } => pool(&reg, cmd.unwrap_or(PoolCommand::Ls { json: false })),
        Command::Subtree { cmd } => {
            let names = match cmd {
                SubtreeCommand::Suspend => nestbox_runtime::subtree::suspend_all(&reg)?,
                SubtreeCommand::Resume => nestbox_runtime::subtree::resume_all(&reg)?,
            };
            for n in names {
                println!("{n}");
            }
            Ok(0)
        }
        Command::Monitor { cmd } => monitor_cmd(&reg, cmd),
        Command::Debug {
            pid,
            name,
            gdb_args,
        } => {
            use std::os::unix::process::CommandExt;
            let host = ops::host_pid_of(&reg, &name, pid)?;
            // gdb is the debugger users know; nestbox only finds the process
            // and points gdb at the box's files (an exception to "a call, not
            // a program": this command is a launcher of gdb).
            let err = std::process::Command::new("gdb")
                .args(["-q", "-p", &host.to_string()])
                .args(["-ex", &format!("set sysroot /proc/{host}/root")])
                .args(&gdb_args)
                .exec();
            Err(anyhow::anyhow!(
                "cannot run gdb: {err} (apt-get install gdb)"
            ))
        }
        Command::Watchdog(a) => {
            use nestbox_runtime::watchdog;
            let min_available = match a.min_available.as_deref() {
                Some(s) => parse_size(s).context("--min-available")?,
                None => watchdog::default_min_available(watchdog::host_memory()?.0),
            };
            let cfg = watchdog::WatchdogConfig {
                min_available,
                interval: std::time::Duration::from_millis(a.interval_ms.max(10)),
            };
            let report = |name: &str, v: &nestbox_runtime::state::WatchdogStop| {
                println!(
                    "stopped {name}: available {} < {}, it used {} (reserve {})",
                    nestbox_runtime::size::format_size(v.available_bytes),
                    nestbox_runtime::size::format_size(v.min_available_bytes),
                    nestbox_runtime::size::format_size(v.memory_bytes),
                    nestbox_runtime::size::format_size(v.reserve_bytes)
                )
            };
            if a.once {
                if let Some((name, v)) = watchdog::check_once(&reg, &cfg)? {
                    report(&name, &v);
                }
                return Ok(0);
            }
            watchdog::run(&reg, &cfg, report)?;
            Ok(0)
        }
        Command::Ksm(a) => {
            let dir = std::path::Path::new(nestbox_runtime::ksm::SYSFS);
            let run = match (a.on, a.off) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            };
            nestbox_runtime::ksm::tune(
                dir,
                nestbox_runtime::ksm::Tuning {
                    run,
                    pages_to_scan: a.pages_to_scan,
                    sleep_millisecs: a.sleep_ms,
                },
            )?;
            output::ksm(&nestbox_runtime::ksm::host(dir)?, a.json).map(|_| 0)
        }
        Command::Freeze {
            as_name,
            pool,
            persist,
            name,
        } => {
            let t = nestbox_runtime::template::freeze(&reg, &name, as_name.as_deref(), pool)?;
            if persist {
                nestbox_runtime::checkpoint::save_template(&reg, &t.name)?;
            }
            if pool > 0 {
                nestbox_runtime::clone::fill_pool(&reg, &t.name)?;
            }
            println!("{}", t.name);
            Ok(0)
        }
        Command::Template(cmd) => template(&reg, cmd),
        Command::Clone(args) => clone(&reg, args),
        Command::Checkpoint(args) => checkpoint(&reg, args),
        Command::Migrate {
            name,
            to,
            new_name,
            rounds,
            json,
            lazy,
        } => {
            let req = nestbox_runtime::migrate::MigrateRequest {
                target: to.parse()?,
                name: new_name,
                max_rounds: rounds,
                lazy,
            };
            // As a checkpoint: in a worker of its own process group, which a
            // signal to this command does not cut while it injects calls.
            if std::env::var_os(CHECKPOINT_WORKER).is_none() {
                return run_as_worker();
            }
            let stats = nestbox_runtime::migrate::migrate(&reg, &name, &req)?;
            if json {
                println!("{}", serde_json::to_string(&stats)?);
            } else {
                println!(
                    "{} -> {} (stopped {:.1} ms, {} rounds, {} MiB sent)",
                    name,
                    stats.arrived.name,
                    stats.downtime_ms,
                    stats.rounds.len(),
                    stats.bytes >> 20
                );
            }
            Ok(0)
        }
        Command::Receive { listen, stdio } => {
            let restored = if stdio {
                match nestbox_runtime::migrate::receive(
                    &reg,
                    Box::new(std::io::stdin()),
                    Box::new(std::io::stdout()),
                ) {
                    Ok(r) => r,
                    // Said to the source, which says it on its side.
                    Err(e) => return Ok(e.exit_code()),
                }
            } else {
                let addr = listen.context("missing --listen")?;
                let listener = std::net::TcpListener::bind(&addr)
                    .with_context(|| format!("receive --listen {addr}"))?;
                println!("listening on {}", listener.local_addr()?);
                use std::io::Write as _;
                std::io::stdout().flush()?;
                let (conn, _) = listener.accept().context("receive: accept")?;
                conn.set_nodelay(true)?;
                let reader = conn.try_clone()?;
                nestbox_runtime::migrate::receive(&reg, Box::new(reader), Box::new(conn))?
            };
            if !stdio {
                println!("{} {}", restored.name, restored.pid);
            } else {
                eprintln!("nestbox: received {} (pid {})", restored.name, restored.pid);
            }
            Ok(0)
        }
        Command::Restore {
            name,
            _detach,
            json,
            shared,
            pool,
            lazy,
            checkpoint,
        } => {
            let r = if checkpoint == "-" {
                nestbox_runtime::checkpoint::restore_from_stdin(&reg, name.as_deref())?
            } else if shared {
                nestbox_runtime::checkpoint::restore_shared(
                    &reg,
                    &checkpoint,
                    name.as_deref(),
                    pool,
                )?
            } else {
                nestbox_runtime::checkpoint::restore_with(&reg, &checkpoint, name.as_deref(), lazy)?
            };
            nestbox_runtime::phases::mark("cli: restored");
            nestbox_runtime::phases::report();
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!("{}", r.name);
            }
            Ok(0)
        }
        Command::Serve {
            socket,
            http,
            api_keys,
        } => {
            let socket = socket.unwrap_or_else(|| nestbox_runtime::api::default_socket(&reg));
            match http {
                Some(addr) => nestbox_e2b::serve(
                    &reg,
                    &socket,
                    nestbox_e2b::Config {
                        addr,
                        api_keys,
                        root: root.clone(),
                        base_pool: nestbox_e2b::DEFAULT_BASE_POOL,
                    },
                )?,
                None => nestbox_runtime::api::serve(&reg, &socket)?,
            }
            Ok(0)
        }
        Command::E2bAgent => {
            nestbox_e2b::envd::agentd::run().context("the e2b agent's socket")?;
            Ok(0)
        }
        Command::Image(cmd) => crate::store_cmd::image(&reg, cmd),
        Command::Commit(args) => crate::store_cmd::commit(&reg, args),
        Command::Store(cmd) => crate::store_cmd::store(&reg, cmd),
        Command::Dedup(args) => crate::store_cmd::dedup(&reg, args),
        Command::Snapshot(a) => crate::snapshot_cmd::snapshot(&reg, a),
        Command::Rollback(a) => crate::snapshot_cmd::rollback(&reg, a),
        Command::Diff(a) => crate::snapshot_cmd::diff(&reg, a),
        Command::Network(cmd) => crate::network_cmd::network(&reg, cmd),
        Command::Service(cmd) => crate::service_cmd::service(&reg, &root, cmd),
    }
}

fn run(reg: &Registry, args: RunArgs) -> Result<i32> {
    let detach = args.detach;
    let spec = build_spec(args)?;
    if spec.ksm
        && nestbox_runtime::ksm::host(std::path::Path::new(nestbox_runtime::ksm::SYSFS))
            .is_ok_and(|h| !h.running)
    {
        // The box runs all the same: its memory is mergeable once the scanner runs.
        eprintln!("nestbox: warning: the host's KSM scanner is stopped: nothing is merged until `nestbox ksm --on`");
    }
    if detach {
        ops::run_detached(reg, &spec)?;
        println!("{}", spec.name);
        return Ok(0);
    }
    nestbox_runtime::phases::mark("cli: spec built");
    let outcome = ops::run_foreground(reg, &spec)?;
    nestbox_runtime::phases::mark("cli: run returned");
    nestbox_runtime::phases::report();
    if outcome.oom_killed {
        eprintln!("nestbox: {}", nestbox_runtime::monitor::oom_message(&spec));
    }
    Ok(outcome.exit_code)
}

fn pool(reg: &Registry, cmd: PoolCommand) -> Result<i32> {
    use nestbox_runtime::shell;
    let json = match cmd {
        PoolCommand::Ls { json } => json,
        PoolCommand::Size { size } => {
            // The shape of a plain `nestbox run -- CMD` by this user.
            let default = match Cli::try_parse_from(["nestbox", "run", "--", "true"])?.command {
                Command::Run(a) => build_spec(*a).ok().and_then(|s| shell::Shape::of(&s)),
                _ => None,
            };
            shell::set_size(reg, size, default.as_ref())?;
            false
        }
        PoolCommand::Drain => {
            let n = shell::drain(reg, &|_| true)?;
            println!("drained {n} shell(s)");
            return Ok(0);
        }
    };
    let view = shell::view(reg)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(0);
    }
    println!("size {} (shells per shape)", view.size);
    for s in &view.shapes {
        let net = match (&s.shape.network, &s.shape.network_name) {
            (_, Some(n)) => n.clone(),
            (m, None) => format!("{m:?}").to_lowercase(),
        };
        println!(
            "{}  image {}  network {}  limits {}{}{}  ready {}  making {}",
            s.key,
            s.shape.image,
            net,
            serde_json::to_string(&s.shape.limits)?,
            if s.shape.read_only { "  read-only" } else { "" },
            if s.shape.tmpfs.is_empty() {
                String::new()
            } else {
                format!("  tmpfs {:?}", s.shape.tmpfs)
            },
            s.ready,
            s.making
        );
    }
    Ok(0)
}

fn build_spec(a: RunArgs) -> Result<BoxSpec> {
    if a.command.is_empty() {
        bail!(RuntimeError::InvalidInput(
            "missing command: usage is nestbox run [OPTIONS] -- CMD [ARGS...]".into()
        ));
    }
    let root = nix::unistd::geteuid().is_root();
    if !root {
        check_userns_available()?;
    }
    // Inside a box (a user namespace), every box gets a user namespace of
    // its own, and the network defaults to none (docs/nesting.md).
    let nested = nestbox_runtime::nest::in_user_namespace();
    let name = a.name.unwrap_or_else(generated_name);
    let limits = a.resources.limits()?;
    let mut seccomp = SeccompChoice::Default;
    for opt in &a.security_opt {
        match opt.split_once(['=', ':']) {
            Some(("seccomp", "unconfined")) => seccomp = SeccompChoice::Unconfined,
            Some(("seccomp", path)) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| RuntimeError::InvalidInput(format!("--security-opt seccomp={path}: {e}")))?;
                seccomp = SeccompChoice::Profile { path: path.into(), text };
            }
            _ if opt == "no-new-privileges" || opt == "no-new-privileges=true" => {}
            _ => bail!(RuntimeError::InvalidInput(format!(
                "unsupported --security-opt {opt:?} (supported: seccomp=unconfined, seccomp=FILE, no-new-privileges)"
            ))),
        }
    }
    // A box for boxes needs CAP_SYS_PTRACE in its user namespace to reach
    // its boxes' first processes, which are not dumpable and whose memory
    // belongs to its namespace (`exec`, `freeze`, `clone` inside), and
    // CAP_NET_ADMIN there for its boxes' bridge, veths, shaping and
    // nftables in its own network namespace (which its user namespace owns;
    // the capability reaches no other).
    let mut cap_add = a.cap_add.clone();
    if a.nest && !a.cap_drop.iter().any(|c| c.eq_ignore_ascii_case("ALL")) {
        cap_add.push("SYS_PTRACE".into());
        cap_add.push("NET_ADMIN".into());
    }
    let capabilities = nestbox_runtime::spec::resolve_capabilities(&cap_add, &a.cap_drop)?;
    let (mode, network_name) = match a.network.as_deref() {
        Some(m) => NetworkMode::parse_with_name(m)?,
        None if root && !nested => (NetworkMode::Bridge, None),
        None => (NetworkMode::None, None),
    };
    let mut network = NetSpec {
        mode,
        name: network_name,
        publish: a
            .publish
            .iter()
            .map(|p| nestbox_net::PortMapping::parse(p).with_context(|| format!("-p {p}")))
            .collect::<Result<_>>()?,
        allow_host: a
            .allow_host_port
            .iter()
            .map(|p| {
                nestbox_net::HostPort::parse(p).with_context(|| format!("--allow-host-port {p}"))
            })
            .collect::<Result<_>>()?,
        egress: a
            .egress
            .as_deref()
            .map(|e| {
                nestbox_net::Egress::parse(e)
                    .and_then(|p| p.check_resolvable().map(|()| p))
                    .with_context(|| format!("--egress {e}"))
            })
            .transpose()?
            .unwrap_or_default(),
        ..NetSpec::default()
    };
    a.bandwidth.apply(&mut network)?;
    let spec = BoxSpec {
        hostname: a.hostname.unwrap_or_else(|| name.clone()),
        name,
        image: a.image,
        command: a.command,
        env: a.env,
        workdir: a.workdir,
        user: a
            .user
            .as_deref()
            .map(parse_user)
            .transpose()?
            .unwrap_or_default(),
        read_only: a.read_only,
        volumes: a
            .volume
            .iter()
            .map(|v| parse_volume(v))
            .collect::<Result<_, _>>()?,
        tmpfs: a.tmpfs,
        capabilities,
        seccomp,
        userns: a.userns || !root || a.nest || nested,
        limits,
        interactive: a.interactive,
        remove_on_exit: a.rm,
        ksm: a.ksm,
        disk: disk_size(&a.disk)?,
        clone_of: None,
        restore_of: None,
        network,
        monitors: a.monitors,
        nest: a.nest,
    };
    // Validated by the runtime (ops::run_*) before anything is created.
    Ok(spec)
}

/// `--disk SIZE` of `run` and `clone`.
fn disk_size(text: &Option<String>) -> Result<Option<u64>> {
    text.as_deref()
        .map(parse_size)
        .transpose()
        .context("--disk")
}

/// `nestbox watchdog`.
#[derive(clap::Args, Debug)]
struct WatchdogArgs {
    /// Act when MemAvailable is below SIZE (default: 5% of the host's memory,
    /// at least 128m).
    #[arg(long, value_name = "SIZE")]
    min_available: Option<String>,
    /// Milliseconds between checks.
    #[arg(long, value_name = "MS", default_value_t = 1000)]
    interval_ms: u64,
    /// Check once and exit.
    #[arg(long)]
    once: bool,
}

/// `nestbox ksm`: settings to change, then the report.
#[derive(clap::Args, Debug)]
struct KsmArgs {
    /// Start the scanner (host-wide).
    #[arg(long, conflicts_with = "off")]
    on: bool,
    /// Stop the scanner (merged pages stay merged).
    #[arg(long)]
    off: bool,
    /// Pages the scanner looks at per wake-up (1-100000).
    #[arg(long, value_name = "N")]
    pages_to_scan: Option<u64>,
    /// Milliseconds the scanner sleeps between wake-ups (0-10000).
    #[arg(long, value_name = "MS")]
    sleep_ms: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn checkpoint(reg: &Registry, a: CheckpointArgs) -> Result<i32> {
    use nestbox_runtime::checkpoint as ckpt;
    match a.cmd {
        Some(CheckpointCommand::Ls { json }) => {
            output::checkpoints(&ckpt::list(reg)?, json).map(|_| 0)
        }
        Some(CheckpointCommand::Rm { names }) => {
            let mut failed = None;
            for name in names {
                if let Err(e) = ckpt::remove(reg, &name) {
                    eprintln!("nestbox: error: {e}");
                    failed = Some(e.exit_code());
                }
            }
            Ok(failed.unwrap_or(0))
        }
        Some(CheckpointCommand::Inspect { name }) => {
            let (meta, dir) = ckpt::load(reg, &name)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&output::checkpoint_summary(&meta, Some(&dir)))?
            );
            Ok(0)
        }
        None => {
            let name = a.name.context("missing box name")?;
            // The checkpoint itself runs in a process of its own group, which
            // goes on when this one is killed (a SIGKILL or Ctrl-C of the
            // command): a checkpoint cut during the calls it injects in the
            // box's threads would leave a thread with injected registers.
            if std::env::var_os(CHECKPOINT_WORKER).is_none() {
                return run_as_worker();
            }
            let req = ckpt::CheckpointRequest {
                name: a.as_name,
                leave_running: a.leave_running,
                output: a.output,
            };
            let to_stdout = req.output.as_deref() == Some(std::path::Path::new("-"));
            let meta = if to_stdout {
                ckpt::checkpoint_to_stdout(reg, &name, &req)?
            } else {
                ckpt::checkpoint(reg, &name, &req)?
            };
            if to_stdout {
                // Standard output carries the stream.
                return Ok(0);
            }
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string(&output::checkpoint_summary(&meta, None))?
                );
            } else {
                println!("{}", meta.name);
            }
            Ok(0)
        }
    }
}

/// Set in the environment of the process that does a checkpoint for the
/// command (see [`run_as_worker`]).
const CHECKPOINT_WORKER: &str = "NESTBOX_CHECKPOINT_WORKER";

/// Run this same command again in a child process of its own process group
/// (so a signal to this process or its group does not reach it), with our
/// standard streams, and exit with its status.
fn run_as_worker() -> Result<i32> {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let exe = std::env::current_exe().context("finding the nestbox binary")?;
    let status = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(CHECKPOINT_WORKER, "1")
        .process_group(0)
        .status()
        .context("starting the checkpoint's worker process")?;
    Ok(status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
}

fn template(reg: &Registry, cmd: TemplateCommand) -> Result<i32> {
    match cmd {
        TemplateCommand::Ls { json } => output::templates(reg, json).map(|_| 0),
        TemplateCommand::Save { names } => {
            for name in names {
                let c = nestbox_runtime::checkpoint::save_template(reg, &name)?;
                println!("{}", c.name);
            }
            Ok(0)
        }
        TemplateCommand::Rm { names } => {
            let mut failed = None;
            for name in names {
                if let Err(e) = nestbox_runtime::template::remove(reg, &name) {
                    eprintln!("nestbox: error: {e}");
                    failed = Some(e.exit_code());
                }
            }
            Ok(failed.unwrap_or(0))
        }
    }
}

fn clone(reg: &Registry, a: CloneArgs) -> Result<i32> {
    let req = nestbox_runtime::clone::CloneRequest {
        names: if a.name.is_empty() || a.name.len() == a.count {
            a.name.clone()
        } else if a.name.len() == 1 && a.count > 1 {
            (1..=a.count)
                .map(|i| format!("{}-{i}", a.name[0]))
                .collect()
        } else {
            a.name.clone()
        },
        count: a.count,
        limits: if a.resources.any() {
            Some(a.resources.limits()?)
        } else {
            None
        },
        on_clone_signal: a.on_clone_signal.as_deref().map(parse_signal).transpose()?,
        pooled: false,
        fork_now: false,
        stdio: None,
        disk: disk_size(&a.disk)?,
        without_network: a.network.as_deref() == Some("none"),
        network: match a.network.as_deref() {
            None | Some("none") => None,
            Some(n) => match NetworkMode::parse_with_name(n) {
                Ok((NetworkMode::Bridge, _)) => Some(n.to_string()),
                _ => anyhow::bail!(
                    "unknown clone --network {n:?} (a clone has its template's network, none, bridge or a network's name)"
                ),
            },
        },
    };
    let made = nestbox_runtime::clone::clone_template(reg, &a.template, &req)?;
    nestbox_runtime::phases::mark("cli: clone made");
    nestbox_runtime::phases::report();
    if a.detach || made.len() != 1 {
        for c in &made {
            println!("{}", c.name);
        }
        return Ok(0);
    }
    output::follow_to_end(reg, &made[0].name)
}

/// Without root a box needs an unprivileged user namespace.
fn check_userns_available() -> Result<()> {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let max = read("/proc/sys/user/max_user_namespaces");
    let clone = read("/proc/sys/kernel/unprivileged_userns_clone");
    if max.as_deref() == Some("0") || clone.as_deref() == Some("0") {
        bail!(RuntimeError::InvalidInput(
            "running without root needs unprivileged user namespaces, which this kernel has disabled \
             (user.max_user_namespaces / kernel.unprivileged_userns_clone)"
                .into()
        ));
    }
    Ok(())
}

fn parse_signal(s: &str) -> Result<nix::sys::signal::Signal> {
    Ok(nestbox_runtime::spec::parse_signal(s)?)
}

/// `nestbox monitor attach|detach|ls`.
fn monitor_cmd(reg: &Registry, cmd: MonitorCommand) -> Result<i32> {
    use nestbox_runtime::attach;
    let show = |a: &attach::Attached| {
        println!(
            "{}\t{}\tprocesses {:?}\tserver {}",
            a.state,
            a.monitors.join(" "),
            a.processes,
            a.server_pid
        )
    };
    match cmd {
        MonitorCommand::Attach { monitors, name } => {
            show(&attach::attach(reg, &name, &monitors)?);
        }
        MonitorCommand::Detach { name } => show(&attach::detach(reg, &name)?),
        MonitorCommand::Ls { json, name } => {
            let a = attach::list(reg, &name)?;
            if json {
                println!("{}", serde_json::to_string(&a)?);
            } else if let Some(a) = a {
                show(&a);
            }
        }
    }
    Ok(0)
}
