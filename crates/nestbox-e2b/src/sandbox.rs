//! A sandbox as the API sees it: an id that stays while the box behind it
//! changes (pause freezes the box into a template, resume clones it anew),
//! its template, metadata, environment, end of life and access token, its
//! processes, and its users as its own `/etc/passwd` names them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use nestbox_runtime::liveness::ProcRef;
use nestbox_runtime::registry::Registry;
use nestbox_runtime::state::Status;

use crate::envd::process::Table;
use crate::error::{E2bError, Result};

/// The user a sandbox's commands and files belong to by default.
pub const DEFAULT_USER: &str = "user";

/// A user of the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Name.
    pub name: String,
    /// Uid inside the box.
    pub uid: u32,
    /// Gid inside the box.
    pub gid: u32,
    /// Home directory inside the box.
    pub home: String,
}

impl User {
    /// Root, for boxes whose image has no such user.
    pub fn root() -> Self {
        User {
            name: "root".into(),
            uid: 0,
            gid: 0,
            home: "/root".into(),
        }
    }

    /// Resolve `path` against the home directory (a relative path is
    /// relative to it, as the SDK assumes).
    pub fn resolve(&self, path: &str) -> String {
        if path.starts_with('/') {
            path.to_string()
        } else if path.is_empty() || path == "." {
            self.home.clone()
        } else {
            format!("{}/{}", self.home.trim_end_matches('/'), path)
        }
    }
}

/// Whether the sandbox runs or is paused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Its box runs.
    Running,
    /// Its box is frozen (a template); connect resumes it as a clone.
    Paused,
}

impl Phase {
    /// The SDK's name.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Running => "running",
            Phase::Paused => "paused",
        }
    }
}

/// What changes over a sandbox's life.
#[derive(Debug, Clone)]
pub struct Live {
    /// The box now behind it.
    pub box_name: String,
    /// Running or paused.
    pub phase: Phase,
    /// When it is removed (seconds since the epoch) unless extended.
    pub end_at: f64,
    /// How many boxes it has had (names the next one).
    pub generation: u32,
    /// The boxes it had before (frozen, removed once their clones are).
    pub previous: Vec<String>,
}

/// One sandbox.
#[derive(Debug)]
pub struct Sandbox {
    /// Its id.
    pub id: String,
    /// The template (or image) it was made from.
    pub template: String,
    /// When it was made.
    pub started_at: f64,
    /// The caller's metadata.
    pub metadata: BTreeMap<String, String>,
    /// Environment of every command.
    pub env: Vec<(String, String)>,
    /// The token envd requests must carry (`X-Access-Token`).
    pub token: String,
    /// Paused, not removed, when its time is up (`autoPause`).
    pub auto_pause: bool,
    /// What changes.
    pub live: Mutex<Live>,
    /// Processes started through envd.
    pub procs: Arc<Table>,
    /// Directories watched through envd.
    pub watchers: crate::envd::fs::Watchers,
    /// The init of the box last looked up (its name and identity), so that a
    /// command or file call need not read the box's record again while that
    /// process lives.
    pub init: Mutex<Option<(String, ProcRef)>>,
}

impl Sandbox {
    /// A copy of what changes.
    pub fn live(&self) -> Live {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The box, if the sandbox runs.
    pub fn running_box(&self) -> Result<String> {
        let live = self.live();
        match live.phase {
            Phase::Running => Ok(live.box_name),
            Phase::Paused => Err(E2bError::Paused(self.id.clone())),
        }
    }

    /// A process of the running box (its init), whose `/proc/PID/root` is
    /// the box's root.
    pub fn root_pid(&self, reg: &Registry) -> Result<i32> {
        let name = self.running_box()?;
        let mut cached = self.init.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((box_name, init)) = &*cached {
            // The same process (pid and start time) as when the record said
            // the box ran: a box that ends takes its init with it.
            if *box_name == name && init.alive() {
                return Ok(init.pid);
            }
        }
        let record = reg.load(&name)?;
        match (record.state.effective_status(), record.state.init) {
            (Status::Running, Some(init)) if init.alive() => {
                *cached = Some((name, init));
                Ok(init.pid)
            }
            _ => Err(E2bError::NoSuchSandbox(self.id.clone())),
        }
    }

    /// The user `name` (default: [`DEFAULT_USER`], or root where the image
    /// has no such user) as the box's `/etc/passwd` has it.
    pub fn user(&self, reg: &Registry, name: Option<&str>) -> Result<User> {
        let pid = self.root_pid(reg)?;
        let passwd = format!("/proc/{pid}/root/etc/passwd");
        let text = std::fs::read_to_string(&passwd).unwrap_or_default();
        let wanted = name.unwrap_or(DEFAULT_USER);
        if let Some(u) = find_user(&text, wanted) {
            return Ok(u);
        }
        match name {
            None => Ok(find_user(&text, "root").unwrap_or_else(User::root)),
            Some("root") => Ok(User::root()),
            Some(other) => Err(E2bError::Invalid(format!(
                "no user {other:?} in sandbox {:?}",
                self.id
            ))),
        }
    }
}

/// The entry of `name` in a passwd file's text.
pub fn find_user(passwd: &str, name: &str) -> Option<User> {
    passwd.lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 || f[0] != name {
            return None;
        }
        Some(User {
            name: name.to_string(),
            uid: f[2].parse().ok()?,
            gid: f[3].parse().ok()?,
            home: if f[5].is_empty() {
                "/".into()
            } else {
                f[5].to_string()
            },
        })
    })
}

/// The user named in an envd request's `Authorization: Basic base64(user:)`.
pub fn user_of_authorization(header: Option<&str>) -> Option<String> {
    let encoded = header?.strip_prefix("Basic ")?;
    let decoded = crate::util::base64_decode(encoded.trim())?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split(':').next()?.to_string();
    (!user.is_empty()).then_some(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_read_from_passwd() {
        let text = "root:x:0:0:root:/root:/bin/bash\nuser:x:1001:1002::/home/user:/bin/bash\n";
        let u = find_user(text, "user").unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1001, 1002, "/home/user"));
        assert!(find_user(text, "nobody").is_none());
        assert_eq!(u.resolve("a/b"), "/home/user/a/b");
        assert_eq!(u.resolve("/etc"), "/etc");
        assert_eq!(u.resolve(""), "/home/user");
    }

    #[test]
    fn the_user_comes_from_basic_authorization() {
        // base64("user:")
        assert_eq!(
            user_of_authorization(Some("Basic dXNlcjo=")).as_deref(),
            Some("user")
        );
        assert_eq!(user_of_authorization(Some("Bearer x")), None);
        assert_eq!(user_of_authorization(None), None);
    }
}
