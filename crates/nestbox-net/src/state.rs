//! Persistent state of a network (`state.json`: address leases and what each
//! box's attachment created), read and written under an exclusive `flock` on
//! `lock`, so concurrent `nestbox run`s never hand out one address twice.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use crate::egress::Egress;
use crate::error::{NetError, Result};
use crate::port::{HostPort, PortMapping};
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
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub publish: Vec<PortMapping>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<Rate>,
    pub share: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_rate: Option<Rate>,
    /// Host ports the box may open connections to (on the gateway).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_host: Vec<HostPort>,
    /// Where beyond the network the box may send.
    #[serde(default, skip_serializing_if = "Egress::is_allow_all")]
    pub egress: Egress,
    /// The box's MAC address (`aa:bb:…`) when its guard is nftables rules
    /// (a nestbox in a user namespace, which cannot load BPF: see
    /// [`crate::nft`]) rather than the BPF program on its veth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nft_guard: Option<String>,
}

impl AttachRecord {
    /// Whether the box has rules of its own in the network's nftables tables
    /// (published ports, allowed host ports, an egress policy, a guard).
    pub fn has_rules(&self) -> bool {
        !self.publish.is_empty()
            || !self.allow_host.is_empty()
            || !self.egress.is_allow_all()
            || self.nft_guard.is_some()
    }
}

/// The state file's content.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct State {
    /// Offset at which the next address search starts (addresses are handed
    /// out round-robin, so a freed address is not reused at once while other
    /// boxes may still have it in their ARP caches).
    #[serde(default)]
    pub next: u32,
    /// Layout version of the network's nftables tables on the host
    /// ([`crate::nft::RULES_VERSION`]; 0: made before versions were kept).
    #[serde(default)]
    pub rules: u32,
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

/// The lock of a network's state, held, the state not read: for a caller
/// that reads it only in some cases (with a thousand boxes, reading the state
/// is most of what a lease costs).
#[derive(Debug)]
pub(crate) struct Held {
    lock: Flock<File>,
    path: PathBuf,
}

impl Held {
    /// The state as it is now (the lock is kept).
    pub fn state(&self) -> Result<State> {
        read(&self.path)
    }

    /// Read the state, to change it.
    fn read(self) -> Result<Locked> {
        let state = read(&self.path)?;
        Ok(Locked {
            _lock: self.lock,
            path: self.path,
            state,
        })
    }
}

/// Lock the state of the network in `dir` and read it, making the directory
/// if it is missing (for the calls that make a network: open and allocate).
pub(crate) fn lock(dir: &Path) -> Result<Locked> {
    hold(dir)?.read()
}

/// [`lock`] without reading the state.
pub(crate) fn hold(dir: &Path) -> Result<Held> {
    loop {
        fs::create_dir_all(dir).map_err(|e| NetError::io("create", dir, e))?;
        // `None`: the network was removed while we waited; make it anew.
        if let Some(held) = hold_at(dir, true)? {
            return Ok(held);
        }
    }
}

/// Lock the state of the network in `dir` and read it; `None` if the network
/// does not exist (never made, or removed, also while this waited for the
/// lock). Nothing is created.
pub(crate) fn lock_existing(dir: &Path) -> Result<Option<Locked>> {
    hold_at(dir, false)?.map(Held::read).transpose()
}

fn hold_at(dir: &Path, create: bool) -> Result<Option<Held>> {
    let lock_path = dir.join("lock");
    let f = match OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .custom_flags(libc::O_CLOEXEC)
        .open(&lock_path)
    {
        Ok(f) => f,
        Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(NetError::io("open", &lock_path, e)),
    };
    let lock = Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| NetError::Io {
        what: "lock",
        path: lock_path.clone(),
        source: std::io::Error::from_raw_os_error(e as i32),
    })?;
    // [`Locked::remove`] deletes the lock file last, still holding the lock:
    // whoever waited on that file finds it unlinked once it gets the lock,
    // and must not act on a network that is gone (it would make the bridge
    // and NAT table again with no state left to own them).
    if !is_current(&lock, &lock_path)? {
        return Ok(None);
    }
    Ok(Some(Held {
        lock,
        path: dir.join("state.json"),
    }))
}

/// Whether the open file `f` is still the one at `path`.
fn is_current(f: &File, path: &Path) -> Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let open = f.metadata().map_err(|e| NetError::io("stat", path, e))?;
    match fs::metadata(path) {
        Ok(m) => Ok(m.dev() == open.dev() && m.ino() == open.ino()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(NetError::io("stat", path, e)),
    }
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
    /// Write the state back (atomically; the lock is kept). Compact JSON
    /// with empty fields left out: every lease and attachment reads and
    /// writes the whole file under the lock, so with a thousand boxes its
    /// size is what a clone waits for (318 KB pretty-printed, 131 KB so).
    pub fn save(&self) -> Result<()> {
        let json = serde_json::to_vec(&self.state).map_err(|e| NetError::State {
            path: self.path.clone(),
            message: e.to_string(),
        })?;
        write_atomic(&self.path, &json)
    }

    /// Remove the network's state directory, the lock file last, while the
    /// lock is still held: every call waiting for the lock then finds the
    /// network gone ([`lock_existing`]) or makes a new one ([`lock`]).
    pub fn remove(self) -> Result<()> {
        let dir = match self.path.parent() {
            Some(d) => d.to_path_buf(),
            None => return Ok(()),
        };
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(NetError::io("read directory", &dir, e)),
        };
        for e in entries {
            let e = e.map_err(|e| NetError::io("read directory", &dir, e))?;
            if e.file_name() == "lock" {
                continue;
            }
            let p = e.path();
            let r = if e.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(NetError::io("remove", &p, e)),
            }
        }
        let lock_path = dir.join("lock");
        match fs::remove_file(&lock_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(NetError::io("remove", &lock_path, e)),
        }
        match fs::remove_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(NetError::io("remove", &dir, e)),
        }
    }
}

/// Write `data` to `path` through a temporary file and a rename.
pub(crate) fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    nestbox_sys::replace::replace_file(path, &tmp, data).map_err(|e| {
        let what = if e.what == "rename" {
            "rename into place"
        } else {
            e.what
        };
        NetError::io(what, &e.path, e.source)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> BoxEntry {
        BoxEntry {
            names: vec!["a".into()],
            address: Ipv4Addr::new(10, 0, 0, 2),
            attachment: None,
        }
    }

    fn attached(rate: Option<Rate>) -> BoxEntry {
        BoxEntry {
            attachment: Some(AttachRecord {
                host_veth: "nbv0123".into(),
                class: 0x1_0005,
                publish: Vec::new(),
                rate,
                reserve: None,
                share: 100,
                ingress_rate: None,
                allow_host: Vec::new(),
                egress: Egress::default(),
                nft_guard: None,
            }),
            ..entry()
        }
    }

    /// The state is written compact, without the empty fields of an
    /// attachment, and reads back the same; a field that is set is kept.
    #[test]
    fn saved_state_is_compact_and_reads_back() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("net");
        let mut held = lock(&dir).unwrap();
        let capped = attached(Rate::from_bits(10_000_000));
        held.state.boxes.insert("box-a".into(), attached(None));
        held.state.boxes.insert("box-b".into(), capped.clone());
        held.save().unwrap();
        let text = fs::read_to_string(dir.join("state.json")).unwrap();
        assert!(!text.contains('\n'), "not compact: {text}");
        for empty in ["null", "\"publish\"", "\"reserve\"", "\"ingress_rate\""] {
            assert!(!text.contains(empty), "{empty} written: {text}");
        }
        assert_eq!(text.matches("\"rate\"").count(), 1, "{text}");
        let back = read(&dir.join("state.json")).unwrap();
        assert_eq!(back.boxes["box-a"], attached(None));
        assert_eq!(back.boxes["box-b"], capped);
    }

    /// A state written before (pretty-printed, every field present, empty
    /// ones as `null` and `[]`) still reads.
    #[test]
    fn state_of_the_earlier_layout_reads() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("state.json");
        fs::write(
            &path,
            r#"{
  "next": 7,
  "rules": 3,
  "boxes": {
    "box-a": {
      "names": ["a"],
      "address": "10.0.0.2",
      "attachment": {
        "host_veth": "nbv0123",
        "class": 65541,
        "publish": [],
        "rate": null,
        "reserve": null,
        "share": 100,
        "ingress_rate": null
      }
    }
  }
}"#,
        )
        .unwrap();
        let s = read(&path).unwrap();
        assert_eq!((s.next, s.rules), (7, 3));
        assert_eq!(s.boxes["box-a"], attached(None));
    }

    /// A call that waited for the lock while the network was removed finds it
    /// gone: it neither sees the old state nor makes the directory again.
    #[test]
    fn waiter_finds_a_removed_network_gone() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("net");
        let mut held = lock(&dir).unwrap();
        held.state.boxes.insert("box-a".into(), entry());
        held.save().unwrap();
        let waiter = {
            let dir = dir.clone();
            std::thread::spawn(move || lock_existing(&dir).map(|l| l.map(|l| l.state.boxes.len())))
        };
        // Let the waiter open the lock file and block on it.
        std::thread::sleep(std::time::Duration::from_millis(200));
        held.remove().unwrap();
        assert_eq!(waiter.join().unwrap().unwrap(), None);
        assert!(
            !dir.exists(),
            "the waiter made the removed network's directory again"
        );
    }

    /// A maker that waited while the network was removed makes it anew, on a
    /// lock file others can find.
    #[test]
    fn maker_after_removal_starts_afresh() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("net");
        let mut held = lock(&dir).unwrap();
        held.state.boxes.insert("box-a".into(), entry());
        held.save().unwrap();
        let maker = {
            let dir = dir.clone();
            std::thread::spawn(move || lock(&dir).map(|l| l.state.boxes.len()))
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        held.remove().unwrap();
        assert_eq!(maker.join().unwrap().unwrap(), 0);
        assert!(dir.join("lock").exists());
        assert!(lock_existing(&dir).unwrap().is_some());
    }
}
