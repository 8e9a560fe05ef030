//! The built-in `base` template, like E2B's: a user `user` (home
//! `/home/user`, shell bash) in a box of the default (`host`) image, which
//! has bash and python3, frozen with a pool of clones.
//!
//! The host image shows the host's `/etc` read-only, so the user is added by
//! two files of the root's data directory, `LIB/e2b/passwd` and
//! `LIB/e2b/group` (the host's files plus `user`, with the first uid and gid
//! from 1000 up that the host does not use), mounted read-only over
//! `/etc/passwd` and `/etc/group` (and `LIB/e2b/profile` over `/etc/profile`,
//! see [`user_box_args`]). Then: `nestbox run -d --name base -v
//! …passwd:/etc/passwd:ro -v …group:/etc/group:ro -v NESTBOX:/run/e2b-agent:ro
//! -- /run/e2b-agent e2b-agent` (the in-box agent, [`crate::envd::agentd`]: this
//! server's own binary), the home made in its writable layer
//! (`mkdir -p /home/user; chown`), and once the agent listens, `nestbox
//! freeze base --pool N`. A cold create of the `host` image makes the same
//! box without freezing it.

use std::path::PathBuf;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use nestbox_runtime::state::Status;

use crate::error::{E2bError, Result};
use crate::Server;

/// The template's name.
pub const BASE: &str = "base";

/// Where the base template stands.
#[derive(Debug, Clone)]
enum State {
    Making,
    Ready,
    Failed(String),
}

/// The base template's readiness, waited on by creates of it.
#[derive(Debug)]
pub struct Base {
    state: Mutex<State>,
    changed: Condvar,
}

impl Default for Base {
    fn default() -> Self {
        Base {
            state: Mutex::new(State::Making),
            changed: Condvar::new(),
        }
    }
}

impl Base {
    fn set(&self, s: State) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = s;
        self.changed.notify_all();
    }

    /// Wait until the template is ready (at most `limit`).
    pub fn wait(&self, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match &*state {
                State::Ready => return Ok(()),
                State::Failed(why) => {
                    return Err(E2bError::Invalid(format!(
                        "the base template could not be made: {why}"
                    )))
                }
                State::Making => {}
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(E2bError::Invalid(
                    "the base template is still being made: try again".into(),
                ));
            }
            state = self
                .changed
                .wait_timeout(state, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Whether `name` is a template clones can be made of.
pub fn is_template(server: &Server, name: &str) -> bool {
    server.reg.load(name).is_ok_and(|r| {
        r.state.effective_status() == Status::Frozen
            && r.state.template.as_ref().is_some_and(|t| !t.removed)
    })
}

/// Make the base template unless it exists; record the outcome.
pub fn ensure(server: &Server, pool: u32) {
    let outcome = if is_template(server, BASE) {
        Ok(())
    } else {
        make(server, pool)
    };
    match outcome {
        Ok(()) => server.base.set(State::Ready),
        Err(e) => {
            tracing::error!("e2b: making the base template: {e}");
            server.base.set(State::Failed(e.to_string()));
        }
    }
}

fn make(server: &Server, pool: u32) -> Result<()> {
    let args = user_box_args(server)?;
    let mut run = vec!["run", "-d", "--name", BASE];
    run.extend(args.iter().map(String::as_str));
    let agent = agent_args(server);
    run.extend(agent.iter().map(String::as_str));
    // A box named base that is no template (someone else's) makes this
    // fail, and is left alone.
    server.nestbox.run("start the base box", &run)?;
    let pool = pool.to_string();
    let rest = make_home(server, BASE)
        .and_then(|()| wait_for_agent(server, BASE))
        .and_then(|()| {
            server
                .nestbox
                .run("freeze the base box", &["freeze", BASE, "--pool", &pool])
                .map(drop)
        });
    if rest.is_err() {
        // The half-made box this started is not left behind.
        let _ = server
            .nestbox
            .run("remove the base box", &["rm", "-f", BASE]);
    }
    rest
}

/// Wait until the agent of box `name` listens (read from its network
/// namespace's `/proc/net/unix`, without connecting: a template is frozen
/// idle).
pub fn wait_for_agent(server: &Server, name: &str) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    let wanted = format!("@{}", crate::envd::agent::SOCKET);
    loop {
        let record = server.reg.load(name)?;
        if let Some(init) = record.state.init {
            let table =
                std::fs::read_to_string(format!("/proc/{}/net/unix", init.pid)).unwrap_or_default();
            if table
                .lines()
                .any(|l| l.split_whitespace().last() == Some(wanted.as_str()))
            {
                return Ok(());
            }
        }
        if Instant::now() >= end {
            return Err(E2bError::Invalid(format!(
                "the agent of box {name:?} did not start listening within 20 s"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Make the home directory of `user` in box `name`.
pub fn make_home(server: &Server, name: &str) -> Result<()> {
    let (uid, gid) = user_ids(server)?;
    let script =
        format!("mkdir -p /home/user && chown {uid}:{gid} /home/user && chmod 0750 /home/user");
    server.nestbox.run(
        "make /home/user",
        &["exec", name, "--", "sh", "-c", &script],
    )?;
    Ok(())
}

/// The end of the `run` command line that makes the in-box agent the box's
/// command: this server's binary mounted read-only at
/// [`crate::envd::agentd::AGENT_PATH`] and run as `e2b-agent`.
pub fn agent_args(server: &Server) -> Vec<String> {
    use crate::envd::agentd::{AGENT_PATH, SUBCOMMAND};
    vec![
        "-v".into(),
        format!("{}:{AGENT_PATH}:ro", server.nestbox.exe.display()),
        "--".into(),
        AGENT_PATH.into(),
        SUBCOMMAND.into(),
    ]
}

/// The `run` options that give a box of the host image the user `user`.
pub fn user_box_args(server: &Server) -> Result<Vec<String>> {
    let (passwd, group) = etc_files(server)?;
    let mut args = vec![
        "-v".into(),
        format!("{}:/etc/passwd:ro", passwd.display()),
        "-v".into(),
        format!("{}:/etc/group:ro", group.display()),
    ];
    if let Some(profile) = profile_file(server)? {
        args.push("-v".into());
        args.push(format!("{}:/etc/profile:ro", profile.display()));
    }
    Ok(args)
}

/// The host's `/etc/profile` with its `"$(id -u)"` tests read from bash's
/// `$EUID` when there is one: the SDK runs every command as `bash -l -c`, and
/// Debian's profile otherwise forks and execs `id` for each (1 ms of the 2 a
/// login shell takes). The same test for other shells. `None` if the host's
/// profile has no such test (it is then left as it is).
fn profile_file(server: &Server) -> Result<Option<PathBuf>> {
    let host = std::fs::read_to_string("/etc/profile").unwrap_or_default();
    if !host.contains("\"$(id -u)\"") {
        return Ok(None);
    }
    let d = dir(server);
    let path = d.join("profile");
    if !path.exists() {
        std::fs::create_dir_all(&d).map_err(E2bError::io("mkdir", &d))?;
        let text = host.replace("\"$(id -u)\"", "\"${EUID:-$(id -u)}\"");
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(E2bError::io("write", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(E2bError::io("rename", &path))?;
    }
    Ok(Some(path))
}

fn dir(server: &Server) -> PathBuf {
    server.reg.roots().lib.join("e2b")
}

/// The uid and gid of `user`: the first from 1000 up the host does not use.
fn user_ids(server: &Server) -> Result<(u32, u32)> {
    let passwd = std::fs::read_to_string(dir(server).join("passwd"));
    if let Some(u) = passwd
        .ok()
        .and_then(|t| crate::sandbox::find_user(&t, crate::sandbox::DEFAULT_USER))
    {
        return Ok((u.uid, u.gid));
    }
    let host_passwd =
        std::fs::read_to_string("/etc/passwd").map_err(E2bError::io("read", "/etc/passwd"))?;
    let host_group =
        std::fs::read_to_string("/etc/group").map_err(E2bError::io("read", "/etc/group"))?;
    let used = |table: &str, id: u32| {
        table
            .lines()
            .any(|l| l.split(':').nth(2).and_then(|x| x.parse::<u32>().ok()) == Some(id))
    };
    let uid = (1000..60000)
        .find(|i| !used(&host_passwd, *i))
        .unwrap_or(60000);
    let gid = (1000..60000)
        .find(|i| !used(&host_group, *i))
        .unwrap_or(60000);
    Ok((uid, gid))
}

/// Write (once) the passwd and group files with `user` added.
fn etc_files(server: &Server) -> Result<(PathBuf, PathBuf)> {
    let d = dir(server);
    let (passwd, group) = (d.join("passwd"), d.join("group"));
    if passwd.exists() && group.exists() {
        return Ok((passwd, group));
    }
    std::fs::create_dir_all(&d).map_err(E2bError::io("mkdir", &d))?;
    let (uid, gid) = user_ids(server)?;
    let mut p =
        std::fs::read_to_string("/etc/passwd").map_err(E2bError::io("read", "/etc/passwd"))?;
    let mut g =
        std::fs::read_to_string("/etc/group").map_err(E2bError::io("read", "/etc/group"))?;
    if !p.ends_with('\n') {
        p.push('\n');
    }
    if !g.ends_with('\n') {
        g.push('\n');
    }
    p.push_str(&format!("user:x:{uid}:{gid}::/home/user:/bin/bash\n"));
    g.push_str(&format!("user:x:{gid}:\n"));
    for (path, text) in [(&group, g), (&passwd, p)] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).map_err(E2bError::io("write", &tmp))?;
        std::fs::rename(&tmp, path).map_err(E2bError::io("rename", path))?;
    }
    Ok((passwd, group))
}
