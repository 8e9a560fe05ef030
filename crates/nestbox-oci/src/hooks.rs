//! OCI hooks: programs run by the runtime at fixed points of a container's
//! life, each given the container's state JSON on its standard input, killed
//! when it outlives its `timeout`.
//!
//! Hooks are external programs by definition, so they are run with
//! `std::process::Command`.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{OciError, Result};

/// One hook.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hook {
    /// Absolute path of the program.
    pub path: PathBuf,
    /// argv, argv\[0\] included.
    pub args: Vec<String>,
    /// Environment.
    pub env: Vec<String>,
    /// Seconds it may run.
    pub timeout: Option<u64>,
}

/// The hooks of a container, by stage.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hooks {
    /// `prestart` (deprecated; run with `createRuntime`).
    pub prestart: Vec<Hook>,
    /// After the namespaces are made, in the runtime's namespaces.
    pub create_runtime: Vec<Hook>,
    /// After the namespaces are made, in the container's (run by the
    /// container's process before its pivot; by the runtime for a clone).
    pub create_container: Vec<Hook>,
    /// Before the program is executed, in the container (run by the
    /// container's process after `start`; by the runtime for a clone).
    pub start_container: Vec<Hook>,
    /// After the process was started.
    pub poststart: Vec<Hook>,
    /// After the container was deleted.
    pub poststop: Vec<Hook>,
}

impl Hooks {
    /// From the `hooks` section.
    #[allow(deprecated)]
    pub fn from_spec(h: Option<&oci_spec::runtime::Hooks>) -> Result<Hooks> {
        let Some(h) = h else {
            return Ok(Hooks::default());
        };
        let conv =
            |stage: &str, list: &Option<Vec<oci_spec::runtime::Hook>>| -> Result<Vec<Hook>> {
                list.iter()
                    .flatten()
                    .map(|k| {
                        if !k.path().is_absolute() {
                            return Err(OciError::Unsupported(format!(
                                "hooks.{stage}: path {} is not absolute",
                                k.path().display()
                            )));
                        }
                        if let Some(t) = k.timeout() {
                            if t <= 0 {
                                return Err(OciError::Unsupported(format!(
                                    "hooks.{stage}: timeout {t} must be positive"
                                )));
                            }
                        }
                        Ok(Hook {
                            path: k.path().clone(),
                            args: k.args().clone().unwrap_or_default(),
                            env: k.env().clone().unwrap_or_default(),
                            timeout: k.timeout().map(|t| t as u64),
                        })
                    })
                    .collect()
            };
        Ok(Hooks {
            prestart: conv("prestart", h.prestart())?,
            create_runtime: conv("createRuntime", h.create_runtime())?,
            create_container: conv("createContainer", h.create_container())?,
            start_container: conv("startContainer", h.start_container())?,
            poststart: conv("poststart", h.poststart())?,
            poststop: conv("poststop", h.poststop())?,
        })
    }
}

/// Run `hooks` of `stage` in order with `state` (JSON) on stdin; the first
/// failure is returned.
pub fn run(stage: &'static str, hooks: &[Hook], state: &str) -> Result<()> {
    for hook in hooks {
        run_one(stage, hook, state)?;
    }
    Ok(())
}

/// Run every hook of `stage` whatever happens to the others (poststart,
/// poststop: the spec asks for a warning and the rest to run); each failure
/// is a warning on stderr.
pub fn run_warning(stage: &'static str, hooks: &[Hook], state: &str) {
    for hook in hooks {
        if let Err(e) = run_one(stage, hook, state) {
            tracing::warn!("{e}");
            eprintln!("nestbox-runc: warning: {e}");
        }
    }
}

fn run_one(stage: &'static str, hook: &Hook, state: &str) -> Result<()> {
    let fail = |message: String| OciError::Hook {
        stage,
        path: hook.path.clone(),
        message,
    };
    let mut cmd = Command::new(&hook.path);
    if let Some((first, rest)) = hook.args.split_first() {
        use std::os::unix::process::CommandExt;
        cmd.arg0(first).args(rest);
    }
    cmd.env_clear();
    for kv in &hook.env {
        if let Some((k, v)) = kv.split_once('=') {
            cmd.env(k, v);
        }
    }
    cmd.stdin(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| fail(format!("cannot run: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A hook that does not read its input may close it early.
        let _ = stdin.write_all(state.as_bytes());
    }
    let deadline = hook
        .timeout
        .map(|t| Instant::now() + Duration::from_secs(t));
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => return Err(fail(format!("exited with {status}"))),
            Ok(None) => {}
            Err(e) => return Err(fail(format!("wait: {e}"))),
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            // Kill and reap it; it failed by its timeout whatever happens here.
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "timed out after {} s",
                hook.timeout.unwrap_or(0)
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
