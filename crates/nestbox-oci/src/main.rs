//! `nestbox-runc`: the runc-compatible command line of nestbox. Give its path
//! to podman (`--runtime`), containerd (`BinaryName` of the runc shim) or a
//! Kubernetes RuntimeClass handler; see `docs/oci.md`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use nestbox_oci::create::{self, CreateOpts};
use nestbox_oci::ops::{self, ExecOpts};
use nestbox_oci::state::{Root, DEFAULT_ROOT};

#[derive(Parser, Debug)]
#[command(
    name = "nestbox-runc",
    version,
    about = "nestbox as an OCI runtime (runc-compatible)",
    // A flag given twice is taken once, as runc takes it (podman passes
    // `checkpoint --leave-running --leave-running`).
    args_override_self = true
)]
struct Cli {
    /// Directory of the runtime's container records.
    #[arg(long, global = true, default_value = DEFAULT_ROOT)]
    root: PathBuf,
    /// Also write errors to this file.
    #[arg(long, global = true)]
    log: Option<PathBuf>,
    /// Format of --log: text or json.
    #[arg(long = "log-format", global = true, default_value = "text")]
    log_format: String,
    /// Use systemd for cgroups (not supported: refused).
    #[arg(long = "systemd-cgroup", global = true)]
    systemd_cgroup: bool,
    /// Accepted for compatibility; no effect.
    #[arg(long, global = true)]
    debug: bool,
    /// Accepted for compatibility; no effect (nestbox has its own checkpoint engine).
    #[arg(long, global = true)]
    criu: Option<String>,
    /// Accepted for compatibility (true, false or auto); no effect.
    #[arg(long, global = true)]
    rootless: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The options `create` and `run` share.
#[derive(clap::Args, Debug)]
struct CreateArgs {
    id: String,
    #[arg(short, long, default_value = ".")]
    bundle: PathBuf,
    #[arg(long = "pid-file")]
    pid_file: Option<PathBuf>,
    #[arg(long = "console-socket")]
    console_socket: Option<PathBuf>,
    /// Accepted for compatibility: nestbox always pivots.
    #[arg(long = "no-pivot")]
    no_pivot: bool,
    /// Accepted for compatibility: no session keyring is made.
    #[arg(long = "no-new-keyring")]
    no_new_keyring: bool,
    #[arg(long = "preserve-fds", default_value_t = 0)]
    preserve_fds: u32,
}

impl CreateArgs {
    fn opts(self) -> anyhow::Result<CreateOpts> {
        check_preserved_fds(self.preserve_fds)?;
        Ok(CreateOpts {
            id: self.id,
            bundle: self.bundle,
            pid_file: self.pid_file,
            console_socket: self.console_socket,
            preserve_fds: self.preserve_fds,
        })
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Create a container from a bundle; it waits for `start`.
    Create {
        #[command(flatten)]
        c: CreateArgs,
    },
    /// Start a created container.
    Start { id: String },
    /// Print a container's state JSON.
    State { id: String },
    /// Send a signal to a container's process (SIGTERM by default).
    Kill {
        id: String,
        #[arg(default_value = "SIGTERM")]
        signal: String,
        #[arg(short, long)]
        all: bool,
    },
    /// Delete a stopped container (a running one with --force).
    Delete {
        id: String,
        #[arg(short, long)]
        force: bool,
    },
    /// Create and start a container; without --detach, wait for it and delete it.
    Run {
        #[command(flatten)]
        c: CreateArgs,
        #[arg(short, long)]
        detach: bool,
        #[arg(long)]
        keep: bool,
    },
    /// Run a new process in a container.
    Exec {
        id: String,
        #[arg(short, long)]
        process: Option<PathBuf>,
        #[arg(short, long)]
        tty: bool,
        #[arg(long = "console-socket")]
        console_socket: Option<PathBuf>,
        #[arg(long = "pid-file")]
        pid_file: Option<PathBuf>,
        #[arg(short, long)]
        detach: bool,
        #[arg(long)]
        cwd: Option<PathBuf>,
        #[arg(short, long)]
        env: Vec<String>,
        #[arg(short, long)]
        user: Option<String>,
        #[arg(long = "no-new-privs")]
        no_new_privs: bool,
        #[arg(long = "preserve-fds", default_value_t = 0)]
        preserve_fds: u32,
        #[arg(long = "process-label")]
        process_label: Option<String>,
        #[arg(long)]
        apparmor: Option<String>,
        #[arg(long)]
        cap: Vec<String>,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// List the processes of a container.
    Ps {
        id: String,
        #[arg(short, long, default_value = "table")]
        format: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        ps_args: Vec<String>,
    },
    /// Freeze a container.
    Pause { id: String },
    /// Thaw a paused container.
    Resume { id: String },
    /// Print a container's resource usage (only --stats is supported).
    Events {
        id: String,
        #[arg(long)]
        stats: bool,
        #[arg(long)]
        interval: Option<String>,
    },
    /// List containers.
    List {
        #[arg(short, long)]
        quiet: bool,
        #[arg(short, long, default_value = "table")]
        format: String,
    },
    /// Print what this runtime supports (runtime-spec features document).
    Features,
    /// Write a default config.json.
    Spec {
        #[arg(short, long, default_value = ".")]
        bundle: PathBuf,
    },
    /// Change a container's resources (a linux.resources JSON file, `-` for
    /// stdin, and/or the options below, which win).
    Update {
        id: String,
        #[arg(short, long)]
        resources: Option<PathBuf>,
        /// Memory limit in bytes (k, m, g suffixes accepted).
        #[arg(long)]
        memory: Option<String>,
        /// Memory plus swap in bytes (-1: unlimited).
        #[arg(long = "memory-swap")]
        memory_swap: Option<String>,
        #[arg(long = "memory-reservation")]
        memory_reservation: Option<String>,
        #[arg(long = "pids-limit")]
        pids_limit: Option<i64>,
        #[arg(long = "cpu-period")]
        cpu_period: Option<u64>,
        #[arg(long = "cpu-quota")]
        cpu_quota: Option<i64>,
        #[arg(long = "cpu-share")]
        cpu_share: Option<u64>,
        #[arg(long = "cpuset-cpus")]
        cpuset_cpus: Option<String>,
        #[arg(long = "blkio-weight")]
        blkio_weight: Option<u16>,
    },
    /// Save a running container with nestbox's checkpoint engine (then stop
    /// and delete it, unless --leave-running).
    Checkpoint {
        id: String,
        /// Where the image goes (made; an empty directory is accepted).
        #[arg(long = "image-path", default_value = "checkpoint")]
        image_path: PathBuf,
        /// Accepted: nestbox writes no CRIU work files.
        #[arg(long = "work-path")]
        work_path: Option<PathBuf>,
        /// Leave the container running (default: stopped and deleted once saved).
        #[arg(long = "leave-running")]
        leave_running: bool,
        #[command(flatten)]
        criu: CriuFlags,
        #[arg(long = "pre-dump")]
        pre_dump: bool,
        #[arg(long = "page-server")]
        page_server: Option<String>,
        #[arg(long = "status-fd")]
        status_fd: Option<String>,
    },
    /// Make a container from a checkpoint image, running.
    Restore {
        id: String,
        #[arg(long = "image-path", default_value = "checkpoint")]
        image_path: PathBuf,
        /// Accepted: nestbox writes no CRIU work files.
        #[arg(long = "work-path")]
        work_path: Option<PathBuf>,
        #[arg(short, long, default_value = ".")]
        bundle: PathBuf,
        #[arg(short, long)]
        detach: bool,
        #[arg(long = "pid-file")]
        pid_file: Option<PathBuf>,
        #[arg(long = "console-socket")]
        console_socket: Option<PathBuf>,
        /// Accepted: the restored box's monitor is this process's child.
        #[arg(long = "no-subreaper")]
        no_subreaper: bool,
        /// Accepted for compatibility: nestbox always pivots.
        #[arg(long = "no-pivot")]
        no_pivot: bool,
        #[command(flatten)]
        criu: CriuFlags,
    },
}

/// runc's CRIU options of `checkpoint` and `restore`, which nestbox's own
/// checkpoint engine has no use for: each is refused by name.
#[derive(clap::Args, Debug)]
struct CriuFlags {
    #[arg(long = "tcp-established")]
    tcp_established: bool,
    #[arg(long = "ext-unix-sk")]
    ext_unix_sk: bool,
    #[arg(long = "shell-job")]
    shell_job: bool,
    #[arg(long = "lazy-pages")]
    lazy_pages: bool,
    #[arg(long = "file-locks")]
    file_locks: bool,
    #[arg(long = "auto-dedup")]
    auto_dedup: bool,
    #[arg(long = "parent-path")]
    parent_path: Option<String>,
    #[arg(long = "manage-cgroups-mode")]
    manage_cgroups_mode: Option<String>,
    #[arg(long = "empty-ns")]
    empty_ns: Vec<String>,
}

impl CriuFlags {
    /// Refuse the first CRIU option given.
    fn refuse(&self, cmd: &str, more: &[(&str, bool)]) -> anyhow::Result<()> {
        let given = [
            ("--tcp-established", self.tcp_established),
            ("--ext-unix-sk", self.ext_unix_sk),
            ("--shell-job", self.shell_job),
            ("--lazy-pages", self.lazy_pages),
            ("--file-locks", self.file_locks),
            ("--auto-dedup", self.auto_dedup),
            ("--parent-path", self.parent_path.is_some()),
            ("--manage-cgroups-mode", self.manage_cgroups_mode.is_some()),
            ("--empty-ns", !self.empty_ns.is_empty()),
        ];
        if let Some((flag, _)) = given.iter().chain(more).find(|(_, on)| *on) {
            bail!("{cmd} {flag} is a CRIU option: nestbox-runc checkpoints with nestbox's own engine, which does not support it");
        }
        Ok(())
    }
}

fn main() {
    let cli = Cli::parse();
    let (log, format) = (cli.log.clone(), cli.log_format.clone());
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            let msg = format!("{e:#}");
            eprintln!("nestbox-runc: {msg}");
            if let Some(path) = log {
                write_log(&path, &format, &msg);
            }
            std::process::exit(1)
        }
    }
}

/// Append the error to the --log file in runc's formats (containerd's shim
/// and podman read the last error from there).
fn write_log(path: &std::path::Path, format: &str, msg: &str) {
    let time = nestbox_oci::state::now_rfc3339();
    let line = if format == "json" {
        serde_json::json!({"level": "error", "msg": msg, "time": time}).to_string()
    } else {
        format!("time={time:?} level=error msg={msg:?}")
    };
    // Nowhere else to report a log that cannot be written: stderr has the error.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

fn print_json(v: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// A byte count with an optional k/m/g suffix (powers of 1024), or -1.
fn parse_bytes(text: &str) -> anyhow::Result<i64> {
    let t = text.trim().to_ascii_lowercase();
    let (num, mult) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1i64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t.as_str(), 1),
    };
    let n: i64 = num.parse().with_context(|| {
        format!("invalid size {text:?} (expected bytes, or a number with k, m or g)")
    })?;
    if n == -1 && mult == 1 {
        return Ok(-1);
    }
    n.checked_mul(mult)
        .filter(|v| *v >= 0)
        .with_context(|| format!("invalid size {text:?}"))
}

/// `--preserve-fds N`: descriptors 3 to 3 + N - 1 must be open when the
/// runtime starts (it has opened nothing yet), so that none of the runtime's
/// own descriptors can take one of their numbers and reach the program.
fn check_preserved_fds(n: u32) -> anyhow::Result<()> {
    for fd in 3..3u32.saturating_add(n) {
        if nix::fcntl::fcntl(fd as i32, nix::fcntl::FcntlArg::F_GETFD).is_err() {
            bail!("--preserve-fds {n}: descriptor {fd} is not open");
        }
    }
    Ok(())
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    if cli.systemd_cgroup {
        bail!("--systemd-cgroup is not supported: nestbox manages cgroups through cgroupfs (use podman --cgroup-manager=cgroupfs, or SystemdCgroup = false in containerd)");
    }
    if !matches!(cli.log_format.as_str(), "text" | "json") {
        bail!("--log-format {:?}: expected text or json", cli.log_format);
    }
    let root = Root::new(&cli.root);
    match cli.cmd {
        Cmd::Create { c } => {
            create::create(&root, &c.opts()?)?;
            Ok(0)
        }
        Cmd::Start { id } => {
            create::start(&root, &id)?;
            Ok(0)
        }
        Cmd::State { id } => {
            print_json(&ops::state(&root, &id)?)?;
            Ok(0)
        }
        Cmd::Kill { id, signal, all } => {
            ops::kill(&root, &id, ops::parse_signal(&signal)?, all)?;
            Ok(0)
        }
        Cmd::Delete { id, force } => {
            ops::delete(&root, &id, force)?;
            Ok(0)
        }
        Cmd::Run { c, detach, keep } => {
            let opts = c.opts()?;
            let id = opts.id.clone();
            let rec = create::create(&root, &opts)?;
            if let Err(e) = create::start(&root, &id) {
                // Started or not, nothing of it may stay behind.
                let _ = ops::delete(&root, &id, true);
                let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(rec.pid), None);
                return Err(e.into());
            }
            if detach {
                return Ok(0);
            }
            let code = ops::wait_exit_code(nix::unistd::Pid::from_raw(rec.pid));
            if !keep {
                ops::delete(&root, &id, true).context("delete after run")?;
            }
            Ok(code)
        }
        Cmd::Exec {
            id,
            process,
            tty,
            console_socket,
            pid_file,
            detach,
            cwd,
            env,
            user,
            no_new_privs,
            preserve_fds,
            process_label,
            apparmor,
            cap,
            args,
        } => {
            check_preserved_fds(preserve_fds)?;
            if process_label.is_some_and(|l| !l.is_empty()) {
                bail!("exec --process-label: SELinux is not supported");
            }
            if apparmor.is_some_and(|l| !l.is_empty()) {
                bail!("exec --apparmor: AppArmor is not supported");
            }
            let opts = ExecOpts {
                process,
                args,
                env,
                cwd,
                user,
                tty,
                console_socket,
                pid_file,
                detach,
                no_new_privs,
                preserve_fds,
                caps: cap,
            };
            Ok(ops::exec(&root, &id, &opts)?)
        }
        Cmd::Ps { id, format, .. } => {
            let pids = ops::ps(&root, &id)?;
            match format.as_str() {
                "json" => println!("{}", serde_json::to_string(&pids)?),
                "table" => {
                    println!("PID   CMD");
                    for pid in pids {
                        let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
                            .map(|b| {
                                String::from_utf8_lossy(&b)
                                    .split('\0')
                                    .filter(|s| !s.is_empty())
                                    .collect::<Vec<_>>()
                                    .join(" ")
                            })
                            .unwrap_or_default();
                        println!("{pid:<5} {cmd}");
                    }
                }
                other => bail!("ps --format {other:?}: expected table or json"),
            }
            Ok(0)
        }
        Cmd::Pause { id } => {
            ops::set_paused(&root, &id, true)?;
            Ok(0)
        }
        Cmd::Resume { id } => {
            ops::set_paused(&root, &id, false)?;
            Ok(0)
        }
        Cmd::Events { id, stats, .. } => {
            if !stats {
                bail!("events: only --stats is supported");
            }
            println!("{}", serde_json::to_string(&ops::stats(&root, &id)?)?);
            Ok(0)
        }
        Cmd::List { quiet, format } => {
            let ids = root.list()?;
            let states: Vec<serde_json::Value> = ids
                .iter()
                .filter_map(|id| ops::state(&root, id).ok())
                .collect();
            if quiet {
                for id in &ids {
                    println!("{id}");
                }
            } else if format == "json" {
                println!("{}", serde_json::to_string(&states)?);
            } else {
                println!("ID    PID    STATUS    BUNDLE    CREATED");
                for s in &states {
                    println!(
                        "{}    {}    {}    {}    {}",
                        s["id"].as_str().unwrap_or(""),
                        s["pid"],
                        s["status"].as_str().unwrap_or(""),
                        s["bundle"].as_str().unwrap_or(""),
                        s["created"].as_str().unwrap_or("")
                    );
                }
            }
            Ok(0)
        }
        Cmd::Features => {
            print_json(&nestbox_oci::info::features())?;
            Ok(0)
        }
        Cmd::Spec { bundle } => {
            nestbox_oci::info::write_default_spec(&bundle)?;
            Ok(0)
        }
        Cmd::Update {
            id,
            resources,
            memory,
            memory_swap,
            memory_reservation,
            pids_limit,
            cpu_period,
            cpu_quota,
            cpu_share,
            cpuset_cpus,
            blkio_weight,
        } => {
            let mut r: serde_json::Value = match resources {
                None => serde_json::json!({}),
                Some(path) => {
                    let text = if path.as_os_str() == "-" {
                        std::io::read_to_string(std::io::stdin()).context("update: read stdin")?
                    } else {
                        std::fs::read_to_string(&path)
                            .with_context(|| format!("update: read {}", path.display()))?
                    };
                    serde_json::from_str(&text).context("update: resources")?
                }
            };
            let mut set = |section: &str, key: &str, v: serde_json::Value| {
                if !r[section].is_object() {
                    r[section] = serde_json::json!({});
                }
                r[section][key] = v;
            };
            for (key, value) in [
                ("limit", memory),
                ("swap", memory_swap),
                ("reservation", memory_reservation),
            ] {
                if let Some(v) = value {
                    set("memory", key, serde_json::json!(parse_bytes(&v)?));
                }
            }
            if let Some(v) = pids_limit {
                set("pids", "limit", serde_json::json!(v));
            }
            if let Some(v) = cpu_period {
                set("cpu", "period", serde_json::json!(v));
            }
            if let Some(v) = cpu_quota {
                set("cpu", "quota", serde_json::json!(v));
            }
            if let Some(v) = cpu_share {
                set("cpu", "shares", serde_json::json!(v));
            }
            if let Some(v) = cpuset_cpus {
                set("cpu", "cpus", serde_json::json!(v));
            }
            if let Some(v) = blkio_weight {
                set("blockIO", "weight", serde_json::json!(v));
            }
            ops::update(&root, &id, &r)?;
            Ok(0)
        }
        Cmd::Checkpoint {
            id,
            image_path,
            work_path: _,
            leave_running,
            criu,
            pre_dump,
            page_server,
            status_fd,
        } => {
            criu.refuse(
                "checkpoint",
                &[
                    ("--pre-dump", pre_dump),
                    ("--page-server", page_server.is_some()),
                    ("--status-fd", status_fd.is_some()),
                ],
            )?;
            nestbox_oci::checkpoint::checkpoint(&root, &id, &image_path, leave_running)?;
            Ok(0)
        }
        Cmd::Restore {
            id,
            image_path,
            work_path: _,
            bundle,
            detach,
            pid_file,
            console_socket,
            no_subreaper: _,
            no_pivot: _,
            criu,
        } => {
            criu.refuse("restore", &[])?;
            let opts = CreateOpts {
                id: id.clone(),
                bundle,
                pid_file,
                console_socket,
                preserve_fds: 0,
            };
            let rec = nestbox_oci::checkpoint::restore(&root, &opts, &image_path)?;
            if detach {
                return Ok(0);
            }
            // In the foreground, as `run`: wait for it (its monitor is our
            // child), then delete it.
            let code = ops::wait_exit_code(nix::unistd::Pid::from_raw(rec.pid));
            ops::delete(&root, &id, true).context("delete after restore")?;
            Ok(code)
        }
    }
}
