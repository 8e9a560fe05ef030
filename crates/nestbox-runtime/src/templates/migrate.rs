//! `nestbox migrate` and `nestbox receive`: a running box moved to another
//! nestbox host with a short stop, by iterative pre-copy of its memory.
//!
//! The source tracks the writes of every process of the box
//! ([`nestbox_remote::DirtyTracker`]: userfaultfd write-protection in
//! asynchronous mode, read with `PAGEMAP_SCAN`) and sends, while the box runs,
//! first every page of its private memory, then in each round the pages
//! written since the last, until a round writes few pages or the rounds run
//! out. Then the box is frozen and checkpointed as `checkpoint` does, except
//! that a page not written since it was sent is not read again (its digest
//! is known); the last pages, the checkpoint's files and its root layers
//! follow, and the target restores it (`restore`). Once the target answers
//! that the box runs there, the source removes its box; if the target
//! refuses or the stream breaks, the source's box is thawed and goes on.
//!
//! The stream is one connection both ways (a TCP connection to `nestbox
//! receive --listen`, or the standard input and output of a command such
//! as `ssh HOST nestbox receive --stdio`), of frames: a tag byte, a length
//! (u32 little-endian), the payload. Tags: `H` hello (JSON: the box, the
//! image version, the kernel and CPU features, answered `R` ready or `E` and
//! the reason), `P` pages (digest of 32 bytes then the 4096 bytes, repeated;
//! each checked against its digest as it is stored in the target's page
//! pool), `F` the end of a pre-copy round (answered `A` once the target has
//! read it: the stop does not begin while the target still reads a round),
//! `C` the checkpoint's directory as a tar archive, answered `D`
//! (JSON: the restored box) or `E`. The target keeps the checkpoint as
//! `BOX-migrated-SECONDS` (its layers are the restored box's lower layers).

use std::collections::{HashMap, HashSet};
use std::fs;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Instant;

use nestbox_remote::{DirtyTracker, PageData};
use nestbox_store::{Digest, PagePool};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{
    check_compatible, checkpoints_dir, copy_layers, copy_nest_state, cpu_flags, kernel_release,
    now, pool_dir, private_dir, remove_staging, restore_incoming, run_tar, running_cgroup,
    save_processes, write_page_records, write_private, Checkpoint, CheckpointStats, PageRecords,
    Preloaded, Restored, SaveError, FREEZER_TIMEOUT,
};
use crate::registry::Registry;
use crate::{Result, RuntimeError};

/// Bytes of a page.
const PAGE: usize = 4096;
/// Bytes of one page in a `P` frame: digest and contents.
const PAGE_ENTRY: usize = 32 + PAGE;
/// Pages per `P` frame.
const FRAME_PAGES: usize = 256;
/// The largest frame a receiver takes (the checkpoint's tar archive with
/// the box's root layers is the large one).
const MAX_FRAME: usize = 1 << 31;
/// Stop pre-copying once a round wrote at most this many pages.
const SMALL_ROUND: usize = 256;

/// Where `migrate` sends a box.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `tcp:HOST:PORT`: a `nestbox receive --listen` there.
    Tcp(String),
    /// `exec:COMMAND`: a command run with `sh -c` whose standard input and
    /// output are the stream (`exec:ssh host nestbox receive --stdio`).
    Exec(String),
}

impl std::str::FromStr for Target {
    type Err = RuntimeError;

    fn from_str(s: &str) -> Result<Target> {
        let bad = || {
            RuntimeError::InvalidInput(format!(
                "migrate --to {s:?}: expected tcp:HOST:PORT or exec:COMMAND"
            ))
        };
        if let Some(addr) = s.strip_prefix("tcp:") {
            let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
            if host.is_empty() || port.parse::<u16>().is_err() {
                return Err(bad());
            }
            Ok(Target::Tcp(addr.to_string()))
        } else if let Some(cmd) = s.strip_prefix("exec:").filter(|c| !c.trim().is_empty()) {
            Ok(Target::Exec(cmd.to_string()))
        } else {
            Err(bad())
        }
    }
}

/// What `nestbox migrate` was asked.
#[derive(Debug, Clone)]
pub struct MigrateRequest {
    /// Where to.
    pub target: Target,
    /// The box's name on the target (default: its name here).
    pub name: Option<String>,
    /// Pre-copy rounds at most (after the first, which sends everything).
    pub max_rounds: usize,
    /// The target restores the box lazily (see `checkpoint::restore_with`):
    /// its memory is filled after it runs, so the stop does not grow with it.
    pub lazy: bool,
}

/// The first frame: who comes.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    version: u32,
    box_name: String,
    name: String,
    checkpoint: String,
    kernel: String,
    cpu_flags: Vec<String>,
    /// Restore lazily on the target (`migrate --lazy`).
    #[serde(default)]
    lazy: bool,
}

/// The target's last answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Arrived {
    /// The box's name there.
    pub name: String,
    /// Its main process's pid on the target host.
    pub pid: i32,
    /// Milliseconds the target's restore took.
    pub restore_ms: f64,
    /// Of those, milliseconds to start the box there.
    #[serde(default)]
    pub shell_ms: f64,
    /// The page server of a lazy restore there (`migrate --lazy`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_server: Option<nestbox_remote::LazyServer>,
    /// Milliseconds from the checkpoint's arrival to the restored box
    /// running (the last pages made durable, the files unpacked, the
    /// restore).
    #[serde(default)]
    pub target_ms: f64,
    /// Of those, milliseconds to unpack the checkpoint's files.
    #[serde(default)]
    pub unpack_ms: f64,
    /// When the checkpoint's files arrived (seconds since the epoch).
    #[serde(default)]
    pub arrived_at: f64,
    /// When the answer was sent (seconds since the epoch).
    #[serde(default)]
    pub answered_at: f64,
}

/// One pre-copy round.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// Pages written since the last round (the first: every tracked page).
    pub written: usize,
    /// Pages whose contents were sent (new contents only).
    pub sent: usize,
    /// Milliseconds it took.
    pub ms: f64,
}

/// Figures of a migration.
#[derive(Debug, Clone, Serialize)]
pub struct MigrateStats {
    /// The pre-copy rounds.
    pub rounds: Vec<Round>,
    /// Pages of the last stop read again (written since they were sent,
    /// or untracked).
    pub last_read: u64,
    /// Pages of the last stop sent.
    pub last_sent: u64,
    /// Bytes of the whole stream.
    pub bytes: u64,
    /// Milliseconds the box was stopped: from its freeze here to the
    /// target's answer that it runs there.
    pub downtime_ms: f64,
    /// Of those, milliseconds to save its processes (last pages sent).
    pub save_ms: f64,
    /// Of those, milliseconds to copy its root layers and send the
    /// checkpoint's files.
    pub files_ms: f64,
    /// Of those, milliseconds from the files sent to their arrival at the
    /// target (by both hosts' clocks: meaningful on one machine or with
    /// synchronised clocks).
    pub handover_ms: f64,
    /// Of those, milliseconds from the target's answer sent to its arrival.
    pub answer_ms: f64,
    /// Milliseconds of the whole migration.
    pub total_ms: f64,
    /// The box on the target.
    pub arrived: Arrived,
}

/// A two-way stream of frames.
struct Stream {
    reader: BufReader<Box<dyn Read>>,
    writer: BufWriter<Box<dyn Write>>,
    child: Option<Child>,
    sent: u64,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("sent", &self.sent).finish()
    }
}

impl Stream {
    fn new(reader: Box<dyn Read>, writer: Box<dyn Write>, child: Option<Child>) -> Stream {
        Stream {
            reader: BufReader::with_capacity(1 << 20, reader),
            writer: BufWriter::with_capacity(1 << 20, writer),
            child,
            sent: 0,
        }
    }

    /// Connect to `target`.
    fn connect(target: &Target) -> std::io::Result<Stream> {
        match target {
            Target::Tcp(addr) => {
                let tcp = std::net::TcpStream::connect(addr)?;
                tcp.set_nodelay(true)?;
                let r = tcp.try_clone()?;
                Ok(Stream::new(Box::new(r), Box::new(tcp), None))
            }
            Target::Exec(cmd) => {
                // The one transport nestbox does not make itself: the
                // user's command (ssh and the like).
                let mut child = std::process::Command::new("sh")
                    .args(["-c", cmd])
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .spawn()?;
                let w = child
                    .stdin
                    .take()
                    .ok_or_else(|| std::io::Error::other("no stdin"))?;
                let r = child
                    .stdout
                    .take()
                    .ok_or_else(|| std::io::Error::other("no stdout"))?;
                Ok(Stream::new(Box::new(r), Box::new(w), Some(child)))
            }
        }
    }

    fn send(&mut self, tag: u8, payload: &[u8]) -> std::io::Result<()> {
        self.writer.write_all(&[tag])?;
        self.writer
            .write_all(&(payload.len() as u32).to_le_bytes())?;
        self.writer.write_all(payload)?;
        self.sent += 5 + payload.len() as u64;
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.writer.flush()
    }

    fn recv(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        self.reader.read_exact(&mut head)?;
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_FRAME {
            return Err(std::io::Error::other(format!("a frame of {len} bytes")));
        }
        let mut payload = vec![0u8; len];
        self.reader.read_exact(&mut payload)?;
        Ok((head[0], payload))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = self.writer.flush();
            // Closing its input ends a well-behaved transport.
            drop(std::mem::replace(
                &mut self.writer,
                BufWriter::new(Box::new(std::io::sink())),
            ));
            let _ = child.wait();
        }
    }
}

/// Pages waiting to go out in a `P` frame, and every digest sent so far.
#[derive(Debug, Default)]
struct Outgoing {
    frame: Vec<u8>,
    sent: HashSet<Digest>,
    pages_sent: usize,
}

impl Outgoing {
    /// Queue `page` (of digest `digest`) unless the target has it already.
    fn page(&mut self, stream: &mut Stream, digest: Digest, page: &[u8]) -> std::io::Result<()> {
        if !self.sent.insert(digest) {
            return Ok(());
        }
        self.frame.extend_from_slice(&digest.0);
        self.frame.extend_from_slice(page);
        self.pages_sent += 1;
        if self.frame.len() >= FRAME_PAGES * PAGE_ENTRY {
            self.flush(stream)?;
        }
        Ok(())
    }

    fn flush(&mut self, stream: &mut Stream) -> std::io::Result<()> {
        if !self.frame.is_empty() {
            stream.send(b'P', &self.frame)?;
            self.frame.clear();
        }
        stream.flush()
    }
}

/// Move running box `box_name` to `req.target` (see the module
/// documentation). On success the box is gone here and runs there.
///
/// # Errors
/// A box that is not running or is a template, a target that refuses it
/// (name in use, incompatible kernel or CPU, a port taken, a failed
/// restore) or a broken stream: one line, and the box runs on here.
pub fn migrate(reg: &Registry, box_name: &str, req: &MigrateRequest) -> Result<MigrateStats> {
    let start = Instant::now();
    let record = reg.load(box_name)?;
    // One at a time with freezes and checkpoints of the box (see
    // `checkpoint`), the box read again under the lock.
    let _lock = crate::clone::box_lock(&record)?;
    let record = reg.load(box_name)?;
    crate::template::refuse_monitored(&record, "migrated")?;
    if record.state.template.is_some() {
        return Err(RuntimeError::Unsupported {
            name: box_name.to_string(),
            problem: "is a template: save it (template save) and restore it there".into(),
        });
    }
    let cgroup = running_cgroup(&record)?;
    // The boxes inside a nest box are saved first, each with its processes,
    // and stopped (`subtree`): their monitors are processes of the nest box,
    // which cannot be moved while they serve a box. They go in its state
    // directory with the checkpoint's files and run again on the target (or
    // here again, should the migration fail); the nest box's own processes
    // run on until the last stop.
    let suspended = crate::subtree::suspend_inside(reg, &record)?;
    let moved = migrate_running(reg, &record, &cgroup, req, start);
    if moved.is_err() && suspended {
        crate::subtree::resume_inside_or_warn(reg, box_name);
    }
    moved
}

/// [`migrate`] of running box `record` (in `cgroup`), locked and checked,
/// with no box inside it running.
fn migrate_running(
    reg: &Registry,
    record: &crate::registry::BoxRecord,
    cgroup: &nestbox_cgroup::BoxCgroup,
    req: &MigrateRequest,
    start: Instant,
) -> Result<MigrateStats> {
    let box_name = record.name();
    let fail = |problem: String| RuntimeError::Migrate {
        name: box_name.to_string(),
        problem,
    };
    let name = req.name.clone().unwrap_or_else(|| box_name.to_string());
    let checkpoint = format!("{box_name}-migrated-{}", now() as u64);
    nestbox_store::validate_name(&checkpoint)
        .map_err(|e| RuntimeError::InvalidInput(format!("box name: {e}")))?;
    let io = |what: &'static str| move |e: std::io::Error| fail(format!("{what}: {e}"));
    let mut stream = Stream::connect(&req.target).map_err(io("connecting to the target"))?;
    let hello = Hello {
        version: nestbox_remote::IMAGE_VERSION,
        box_name: box_name.to_string(),
        name: name.clone(),
        checkpoint: checkpoint.clone(),
        kernel: kernel_release(),
        cpu_flags: cpu_flags(),
        lazy: req.lazy,
    };
    let json = serde_json::to_vec(&hello).map_err(|e| fail(format!("encoding: {e}")))?;
    stream
        .send(b'H', &json)
        .and_then(|()| stream.flush())
        .map_err(io("sending to the target"))?;
    answer(&mut stream, b'R').map_err(&fail)?;

    // Pre-copy, the box running.
    let steps = crate::template::template_tree(record)?;
    let remote = |e: nestbox_remote::RemoteError| RuntimeError::Remote {
        what: "tracking the memory of box",
        name: box_name.to_string(),
        source: e,
    };
    let mut trackers = Vec::new();
    for step in &steps {
        trackers.push(DirtyTracker::start(step.process.host_pid).map_err(remote)?);
    }
    let mut known: HashMap<(i32, u64), Digest> = HashMap::new();
    let mut out = Outgoing::default();
    let mut rounds = Vec::new();
    for round in 0..=req.max_rounds {
        let at = Instant::now();
        let before = out.pages_sent;
        let mut written = 0;
        for tracker in &mut trackers {
            let pid = tracker.pid();
            let done = tracker.round(&mut |addr, page| {
                match page {
                    None => {
                        known.remove(&(pid, addr));
                    }
                    Some(page) => {
                        let digest = Digest::of(page);
                        known.insert((pid, addr), digest);
                        out.page(&mut stream, digest, page)?;
                    }
                }
                Ok(())
            });
            match done {
                Ok(n) => written += n,
                Err(e) => {
                    // A process that ended or changed under the read: what
                    // was sent of it is not trusted at the last stop.
                    tracing::debug!(box_name, pid, "pre-copy round: {e}");
                    known.retain(|(p, _), _| *p != pid);
                }
            }
        }
        out.flush(&mut stream)
            .and_then(|()| stream.send(b'F', &[]))
            .and_then(|()| stream.flush())
            .map_err(io("sending pages"))?;
        // The target has taken the round in (what it has still to read
        // would otherwise be read during the stop).
        answer(&mut stream, b'A').map_err(&fail)?;
        rounds.push(Round {
            written,
            sent: out.pages_sent - before,
            ms: at.elapsed().as_secs_f64() * 1e3,
        });
        if round > 0 && written <= SMALL_ROUND {
            break;
        }
    }

    // The last stop.
    let tmp = checkpoints_dir(reg).join(format!(".tmp-migrate-{}", std::process::id()));
    private_dir(&checkpoints_dir(reg))?;
    {
        use std::os::unix::fs::DirBuilderExt;
        fs::DirBuilder::new()
            .mode(0o711)
            .create(&tmp)
            .map_err(RuntimeError::io("create", &tmp))?;
    }
    let dir = tmp.join("checkpoint");
    let frozen_at = Instant::now();
    let mut last = (0u64, 0u64);
    let mut phases = (0f64, 0f64);
    let (mut sent_at, mut got_at) = (0f64, 0f64);
    let result = fs::create_dir(&dir)
        .map_err(RuntimeError::io("create", &dir))
        // Which box this unfinished migration froze: `gc` thaws it if we die.
        .and_then(|()| {
            fs::write(tmp.join("box"), box_name).map_err(RuntimeError::io("write", &tmp))
        })
        .and_then(|()| {
            cgroup
                .set_frozen(true, FREEZER_TIMEOUT)
                .map_err(RuntimeError::from)
        })
        .and_then(|()| crate::template::refuse_boxes_inside(record, cgroup, false))
        .and_then(|()| {
            let sent_before = out.pages_sent;
            let saved = save_processes(record, cgroup, &mut |tracees, steps| {
                last_stop(
                    box_name,
                    tracees,
                    steps,
                    &known,
                    &mut out,
                    &mut stream,
                    &dir,
                )
            });
            last.1 = (out.pages_sent - sent_before) as u64;
            phases.0 = frozen_at.elapsed().as_secs_f64() * 1e3;
            saved
        })
        .and_then(|(processes, stats)| {
            last.0 = stats.pages_written;
            let layers = copy_layers(reg, record, &dir, true)?;
            copy_nest_state(record, &dir)?;
            let meta = Checkpoint {
                version: nestbox_remote::IMAGE_VERSION,
                name: checkpoint.clone(),
                box_name: box_name.to_string(),
                created_at: now(),
                spec: record.spec.clone(),
                layers,
                template: None,
                kernel: kernel_release(),
                cpu_flags: cpu_flags(),
                processes,
                stats,
            };
            let json = serde_json::to_vec(&meta)
                .map_err(|e| fail(format!("encoding checkpoint.json: {e}")))?;
            write_private(&dir.join("checkpoint.json"), &json)?;
            let archive = tmp.join("checkpoint.tar");
            run_tar(
                &[
                    "-C",
                    &dir.display().to_string(),
                    "-cf",
                    &archive.display().to_string(),
                    ".",
                ],
                Stdio::null(),
            )?;
            let tar = fs::read(&archive).map_err(RuntimeError::io("read", &archive))?;
            stream
                .send(b'C', &tar)
                .and_then(|()| stream.flush())
                .map_err(io("sending the checkpoint"))?;
            phases.1 = frozen_at.elapsed().as_secs_f64() * 1e3 - phases.0;
            sent_at = now();
            let arrived = answer(&mut stream, b'D').map_err(&fail)?;
            got_at = now();
            serde_json::from_slice::<Arrived>(&arrived)
                .map_err(|e| fail(format!("the target's answer: {e}")))
        });
    let downtime_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
    drop(trackers);
    let outcome = match result {
        Ok(arrived) => {
            // It runs there: its processes here are killed while frozen (a
            // killed process thawed dies before it runs again: nothing it
            // does here after the last stop can be seen outside). Should we
            // die first, `gc` finds it said so and removes the box.
            crate::diag::warn_on_err(
                Some(box_name),
                "removing a box migrated away",
                fs::write(tmp.join("moved"), &arrived.name)
                    .map_err(RuntimeError::io("write", &tmp))
                    .and_then(|()| cgroup.kill_all().map_err(RuntimeError::from))
                    .and_then(|()| crate::templates::ops::remove(reg, box_name, true)),
            );
            Ok(MigrateStats {
                rounds,
                last_read: last.0,
                last_sent: last.1,
                bytes: stream.sent,
                downtime_ms,
                save_ms: phases.0,
                files_ms: phases.1,
                handover_ms: (arrived.arrived_at - sent_at) * 1e3,
                answer_ms: (got_at - arrived.answered_at) * 1e3,
                total_ms: start.elapsed().as_secs_f64() * 1e3,
                arrived,
            })
        }
        Err(e) => {
            crate::diag::warn_on_err(
                Some(box_name),
                "thawing a box whose migration failed",
                cgroup
                    .set_frozen(false, FREEZER_TIMEOUT)
                    .map_err(RuntimeError::from),
            );
            Err(e)
        }
    };
    remove_staging(box_name, "removing a migration's staging directory", &tmp);
    outcome
}

/// Read the next frame: its payload if its tag is `want`, the target's
/// reason if it is `E`.
fn answer(stream: &mut Stream, want: u8) -> std::result::Result<Vec<u8>, String> {
    match stream.recv() {
        Ok((tag, payload)) if tag == want => Ok(payload),
        Ok((b'E', reason)) => Err(format!(
            "the target refused it: {}",
            String::from_utf8_lossy(&reason)
        )),
        Ok((tag, _)) => Err(format!(
            "unexpected frame {:?} from the target",
            tag as char
        )),
        Err(e) => Err(format!("the target closed the stream ({e})")),
    }
}

/// Save the stopped processes: pages not written since they were sent are
/// taken from `known`, the others read and sent.
fn last_stop(
    box_name: &str,
    tracees: &mut [nestbox_remote::Tracee],
    steps: &[nestbox_remote::tree::Step],
    known: &HashMap<(i32, u64), Digest>,
    out: &mut Outgoing,
    stream: &mut Stream,
    dir: &Path,
) -> std::result::Result<(Vec<nestbox_remote::ProcessImage>, CheckpointStats), SaveError> {
    let mut unwritten = HashMap::new();
    for t in tracees.iter() {
        let ranges = nestbox_remote::unwritten_ranges(t.pid()).map_err(SaveError::Remote)?;
        unwritten.insert(t.pid(), ranges);
    }
    let host_of: HashMap<i32, i32> = steps
        .iter()
        .map(|s| (s.process.pid, s.process.host_pid))
        .collect();
    let unchanged = |host: i32, addr: u64| {
        known.contains_key(&(host, addr))
            && unwritten
                .get(&host)
                .is_some_and(|r| nestbox_remote::in_ranges(r, addr))
    };
    let mut records = PageRecords::default();
    let (mut pages, mut read) = (0u64, 0u64);
    let images = nestbox_remote::capture_box_incremental(
        tracees,
        steps,
        &unchanged,
        &mut |pid, addr, page| {
            let digest = match page {
                PageData::Bytes(page) => {
                    let digest = Digest::of(page);
                    out.page(stream, digest, page)?;
                    read += 1;
                    digest
                }
                PageData::Unchanged => *host_of
                    .get(&pid)
                    .and_then(|h| known.get(&(*h, addr)))
                    .ok_or_else(|| std::io::Error::other("an unchanged page never sent"))?,
            };
            records.add(pid, addr, &digest);
            pages += 1;
            Ok(())
        },
    )
    .map_err(SaveError::Remote)?;
    out.flush(stream).map_err(|e| {
        SaveError::Runtime(RuntimeError::Migrate {
            name: box_name.to_string(),
            problem: format!("sending pages: {e}"),
        })
    })?;
    write_page_records(dir, &images, records).map_err(SaveError::Runtime)?;
    Ok((
        images,
        CheckpointStats {
            pages,
            pages_written: read,
            ..CheckpointStats::default()
        },
    ))
}

/// Take one migrating box from `reader`/`writer` (see the module
/// documentation) and run it here.
///
/// # Errors
/// What the source is told as well: an incompatible image, kernel or CPU, a
/// name in use, a damaged page, a failed restore. Nothing of the box is left.
pub fn receive(reg: &Registry, reader: Box<dyn Read>, writer: Box<dyn Write>) -> Result<Restored> {
    let mut stream = Stream::new(reader, writer, None);
    let result =
        receive_on(reg, &mut stream).and_then(|(r, target_ms, unpack_ms, at, pages, received)| {
            if !crate::subtree::holds_suspended_boxes(reg, &r.name) {
                return Ok((r, target_ms, unpack_ms, at, Some(pages), received));
            }
            // A nest box saved with its boxes: they run again before the source
            // is told (it keeps its copy until then). The nestbox inside is run
            // from a process forked from this one, which then has no other
            // thread: the pages are made durable first.
            store_pages_done(&r.name, pages);
            let checkpoint = reg
                .load(&r.name)
                .ok()
                .and_then(|b| b.spec.restore_of)
                .and_then(|d| {
                    Path::new(&d)
                        .file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                });
            match crate::checkpoint::with_boxes_inside(reg, r) {
                Ok(r) => Ok((r, target_ms, unpack_ms, at, None, received)),
                Err(e) => {
                    if let Some(c) = checkpoint {
                        crate::checkpoint::remove_received(reg, &c);
                    }
                    Err(e)
                }
            }
        });
    let reply = match &result {
        Ok((r, target_ms, unpack_ms, arrived_at, _, _)) => serde_json::to_vec(&Arrived {
            name: r.name.clone(),
            pid: r.pid,
            restore_ms: r.restore_ms,
            shell_ms: r.shell_ms,
            page_server: r.page_server,
            target_ms: *target_ms,
            unpack_ms: *unpack_ms,
            arrived_at: *arrived_at,
            answered_at: now(),
        })
        .map(|j| (b'D', j))
        .unwrap_or((b'E', b"encoding the answer".to_vec())),
        Err(e) => (b'E', e.to_string().into_bytes()),
    };
    if let Err(e) = stream.send(reply.0, &reply.1).and_then(|()| stream.flush()) {
        tracing::warn!("receive: answering the source: {e}");
    }
    // The pages kept for the restore are freed only now (25 600 of them for
    // 100 MiB: tens of milliseconds the source would wait for).
    let (restored, _, _, _, pages, received) = result?;
    drop(received);
    // The box runs here; what is left is to make its checkpoint's pages
    // durable (needed only to restore that checkpoint again).
    if let Some(pages) = pages {
        store_pages_done(&restored.name, pages);
    }
    Ok(restored)
}

/// Wait for the pool thread `pages` of migrated box `name` to have stored
/// its pages; a failure is logged (the box runs: only its checkpoint cannot
/// be restored again).
fn store_pages_done(name: &str, pages: PoolThread) {
    let stored = pages.join().unwrap_or_else(|_| {
        Err(RuntimeError::InvalidInput(
            "page pool: its writer thread panicked".into(),
        ))
    });
    crate::diag::warn_on_err(
        Some(name),
        "storing the pages of a migrated box's checkpoint (it cannot be restored again)",
        stored,
    );
}

/// The receiver's pool thread (see [`store_pages`]).
type PoolThread = std::thread::JoinHandle<Result<()>>;

/// [`receive`]'s work: the restored box, the milliseconds from the
/// checkpoint's arrival to it running, and of those to unpack the files,
/// when it arrived, the thread still storing the pages in the pool, and the
/// pages kept in memory for the restore.
#[allow(clippy::type_complexity)]
fn receive_on(
    reg: &Registry,
    stream: &mut Stream,
) -> Result<(Restored, f64, f64, f64, PoolThread, Preloaded)> {
    let broken = |e: std::io::Error| RuntimeError::Migrate {
        name: "(incoming)".into(),
        problem: format!("the stream broke: {e}"),
    };
    let (tag, payload) = stream.recv().map_err(broken)?;
    if tag != b'H' {
        return Err(RuntimeError::InvalidInput(format!(
            "receive: not a nestbox migration stream (first frame {:?})",
            tag as char
        )));
    }
    let hello: Hello = serde_json::from_slice(&payload)
        .map_err(|e| RuntimeError::InvalidInput(format!("receive: a bad hello: {e}")))?;
    let checked = check_compatible(
        &hello.checkpoint,
        hello.version,
        &hello.kernel,
        &hello.cpu_flags,
    )
    .and_then(|()| crate::clone::check_new_name(reg, &hello.name))
    .and_then(|()| {
        nestbox_store::validate_name(&hello.checkpoint)
            .map_err(|e| RuntimeError::InvalidInput(format!("checkpoint name: {e}")))?;
        if checkpoints_dir(reg).join(&hello.checkpoint).exists() {
            return Err(RuntimeError::CheckpointExists(hello.checkpoint.clone()));
        }
        Ok(())
    });
    checked?;
    stream
        .send(b'R', &[])
        .and_then(|()| stream.flush())
        .map_err(broken)?;
    // The pages go to the pool in a thread of their own (written, and made
    // durable at the end of each round), so that reading the stream never
    // waits for the disk; the restore takes them from memory.
    let pool_path = pool_dir(reg);
    let (to_pool, pool_inbox) = std::sync::mpsc::channel::<ToPool>();
    let pool_thread = std::thread::spawn(move || store_pages(&pool_path, pool_inbox));
    // The pages sent, kept in memory for the restore (checked as they came).
    let mut received = Preloaded::new();
    let damaged = || RuntimeError::Migrate {
        name: hello.box_name.clone(),
        problem: "a page arrived damaged (its contents do not match its digest)".into(),
    };
    let streamed = (|| loop {
        let (tag, payload) = stream.recv().map_err(broken)?;
        match tag {
            b'P' if payload.len() % PAGE_ENTRY == 0 => {
                let mut pages = Vec::with_capacity(payload.len() / PAGE_ENTRY);
                for entry in payload.chunks(PAGE_ENTRY) {
                    let digest = Digest::of(&entry[32..]);
                    if digest.0 != entry[..32] {
                        return Err(damaged());
                    }
                    received.insert(digest, entry[32..].into());
                    pages.push(digest);
                }
                let _ = to_pool.send(ToPool::Pages(pages, payload));
            }
            // The end of a pre-copy round: its pages are made durable while
            // the next round runs.
            b'F' => {
                let _ = to_pool.send(ToPool::Round);
                stream
                    .send(b'A', &[])
                    .and_then(|()| stream.flush())
                    .map_err(broken)?;
            }
            b'C' => return Ok((payload, Instant::now(), now())),
            tag => {
                return Err(RuntimeError::InvalidInput(format!(
                    "receive: unexpected frame {:?} of {} bytes",
                    tag as char,
                    payload.len()
                )))
            }
        }
    })();
    drop(to_pool);
    let (tar, arrived, arrived_at) = match streamed {
        Ok(s) => s,
        Err(e) => {
            let _ = pool_thread.join();
            return Err(e);
        }
    };
    let mut unpack_ms = 0.0;
    let restored = restore_incoming(
        reg,
        Some(&hello.name),
        Some(&received),
        hello.lazy,
        false,
        &mut |staging| {
            let at = Instant::now();
            let archive = staging.with_extension("tar");
            fs::write(&archive, &tar).map_err(RuntimeError::io("write", &archive))?;
            let file = fs::File::open(&archive).map_err(RuntimeError::io("open", &archive));
            let unpacked = file.and_then(|f| crate::checkpoint::untar(staging, Stdio::from(f)));
            let _ = fs::remove_file(&archive);
            unpack_ms = at.elapsed().as_secs_f64() * 1e3;
            unpacked
        },
    );
    let restored = match restored {
        Ok(r) => r,
        Err(e) => {
            let _ = pool_thread.join();
            return Err(e);
        }
    };
    Ok((
        restored,
        arrived.elapsed().as_secs_f64() * 1e3,
        unpack_ms,
        arrived_at,
        pool_thread,
        received,
    ))
}

/// What the receiver's pool thread is given.
enum ToPool {
    /// Pages (digests checked) and the frame holding them.
    Pages(Vec<Digest>, Vec<u8>),
    /// A pre-copy round ended: make its pages durable.
    Round,
}

/// The receiver's pool thread: store the pages it is given in the pool at
/// `path`, each round made durable (synced and indexed) as it ends, the rest
/// when the stream ends.
fn store_pages(path: &Path, inbox: std::sync::mpsc::Receiver<ToPool>) -> Result<()> {
    let pool_err =
        |e: nestbox_store::StoreError| RuntimeError::InvalidInput(format!("page pool: {e}"));
    let mut pool = PagePool::open(path).map_err(pool_err)?;
    loop {
        let mut writer = pool.writer().map_err(pool_err)?;
        let mut ended = true;
        for message in inbox.iter() {
            match message {
                ToPool::Pages(digests, frame) => {
                    for (digest, entry) in digests.into_iter().zip(frame.chunks(PAGE_ENTRY)) {
                        writer.put_hashed(digest, &entry[32..]).map_err(pool_err)?;
                    }
                }
                ToPool::Round => {
                    ended = false;
                    break;
                }
            }
        }
        writer.finish().map_err(pool_err)?;
        if ended {
            return Ok(());
        }
    }
}
