//! Persistent state of a network (`state.json`: address leases and what each
//! box's attachment created), read and written under an exclusive `flock` on
//! `lock`, so concurrent `nestbox run`s never hand out one address twice.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::error::{NetError, Result};
use crate::port::PortMapping;
use crate::rate::Rate;

/// What the network knows about one box.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoxEntry {
    pub names: Vec<String>,
    pub address: Ipv4Addr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<AttachRecord>,
}

/// What attaching a box created (recorded before it is created, so that a
/// crash in between still leaves an owner that `detach`/`gc` can clean up).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct AttachRecord {
    pub host_veth: String,
    pub class: u32,
    #[serde(default)]
    pub publish: Vec<PortMapping>,
    pub rate: Option<Rate>,
    pub reserve: Option<Rate>,
    pub share: u32,
    pub ingress_rate: Option<Rate>,
}

/// The state file's content.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct State {
    /// Offset at which the next address search starts (addresses are handed
    /// out round-robin, so a freed address is not reused at once while other
    /// boxes may still have it in their ARP caches).
    #[serde(default)]
    pub next: u32,
    #[serde(default)]
    pub boxes: BTreeMap<String, BoxEntry>,
}

/// The state, held under the network's lock until dropped.
#[derive(Debug)]
pub(crate) struct Locked {
    _lock: Flock<File>,
    path: PathBuf,
    pub state: State,
}

/// Lock the state of the network in `dir` and read it.
pub(crate) fn lock(dir: &Path) -> Result<Locked> {
    fs::create_dir_all(dir).map_err(|e| NetError::io("create", dir, e))?;
    let lock_path = dir.join("lock");
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_CLOEXEC)
        .open(&lock_path)
        .map_err(|e| NetError::io("open", &lock_path, e))?;
    let lock = Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| NetError::Io {
        what: "lock",
        path: lock_path.clone(),
        source: std::io::Error::from_raw_os_error(e as i32),
    })?;
    let path = dir.join("state.json");
    let state = read(&path)?;
    Ok(Locked {
        _lock: lock,
        path,
        state,
    })
}

/// Read a state file without locking (for `inspect`); missing is empty.
pub(crate) fn read(path: &Path) -> Result<State> {
    match fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map_err(|e| NetError::State {
            path: path.to_path_buf(),
            message: e.to_string(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(State::default()),
        Err(e) => Err(NetError::io("read", path, e)),
    }
}

impl Locked {
    /// Write the state back (atomically; the lock is kept).
    pub fn save(&self) -> Result<()> {
        let json = serde_json::to_vec_pretty(&self.state).map_err(|e| NetError::State {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        write_atomic(&self.path, &json)
    }
}

/// Write `data` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    let mut f = File::create(&tmp).map_err(|e| NetError::io("create", &tmp, e))?;
    f.write_all(data)
        .map_err(|e| NetError::io("write", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| NetError::io("rename into place", path, e))
}
