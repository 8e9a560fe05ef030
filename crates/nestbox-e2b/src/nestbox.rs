//! How the HTTP server acts on boxes. It is multi-threaded, so it never forks
//! to run nestbox code itself: clones are asked of the single-threaded clone
//! server on the Unix socket (`nestbox serve`'s own, the fast path with its
//! pools and prepared claims), everything else runs the `nestbox` binary
//! (`run -d`, `exec`, `freeze`, `rm -f`), which fork+exec does safely.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{CommandKind, E2bError, Result};

/// The `nestbox` binary, the root it works on and the clone server's socket.
#[derive(Debug, Clone)]
pub struct Nestbox {
    /// The binary.
    pub exe: PathBuf,
    /// `--root`, when one was given.
    pub root: Option<PathBuf>,
    /// The clone server's socket.
    pub socket: PathBuf,
}

impl Nestbox {
    /// A command of the binary, on the right root.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.exe);
        if let Some(root) = &self.root {
            cmd.arg("--root").arg(root);
        }
        cmd.args(args);
        cmd
    }

    /// Run `nestbox ARGS` to its end; its stdout, or its error line as an
    /// error about `what`.
    pub fn run(&self, what: &str, args: &[&str]) -> Result<String> {
        let out = self
            .command(args)
            .stdin(Stdio::null())
            .output()
            .map_err(E2bError::io("run", &self.exe))?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        let message = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("failed without a message")
            .trim_start_matches("nestbox: error: ")
            .to_string();
        Err(command_error(what, message))
    }

    /// Clone `template` as box `name` through the clone server.
    pub fn clone_box(&self, template: &str, name: &str) -> Result<()> {
        let answer = self.ask(&json!({"op": "clone", "template": template, "name": name}))?;
        if answer["ok"] == true {
            return Ok(());
        }
        let message = answer["error"].as_str().unwrap_or("failed").to_string();
        let kind = match answer["kind"].as_str() {
            Some("not_found") => CommandKind::NotFound,
            Some("conflict") => CommandKind::Conflict,
            _ => CommandKind::Other,
        };
        Err(E2bError::Command {
            what: format!("clone {template:?}"),
            message,
            kind,
        })
    }

    /// Wait until the clone server answers (it starts with this server).
    pub fn wait_for_clone_server(&self, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        loop {
            match self.ask(&json!({"op": "ping"})) {
                Ok(_) => return Ok(()),
                Err(e) if Instant::now() >= end => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }

    fn ask(&self, request: &Value) -> Result<Value> {
        let fail = |message: String| E2bError::CloneServer {
            socket: self.socket.clone(),
            message,
        };
        let mut stream = UnixStream::connect(&self.socket).map_err(|e| fail(e.to_string()))?;
        let mut line = request.to_string();
        line.push('\n');
        stream
            .write_all(line.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
        let mut answer = String::new();
        BufReader::new(&stream)
            .read_line(&mut answer)
            .map_err(|e| fail(e.to_string()))?;
        serde_json::from_str(&answer).map_err(|e| fail(format!("answer is not JSON: {e}")))
    }

    /// The root directory's runtime part.
    pub fn socket_dir(&self) -> Option<&Path> {
        self.socket.parent()
    }
}

/// The error of a `nestbox` command about `what` that printed `message`.
pub fn command_error(what: &str, message: String) -> E2bError {
    let kind = if message.contains("no box named")
        || message.contains("no template named")
        || message.contains("has been removed")
        || message.contains("no image named")
        || message.contains("unknown image")
        || (message.starts_with("image ") && message.contains("not found"))
    {
        CommandKind::NotFound
    } else if message.contains("already exists") || message.contains("not running") {
        CommandKind::Conflict
    } else {
        CommandKind::Other
    };
    E2bError::Command {
        what: what.to_string(),
        message,
        kind,
    }
}
