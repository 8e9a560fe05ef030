//! The packet inspector of a box (`--monitor packets:…`, docs/monitors.md):
//! the queue rules go into the box's network namespace
//! ([`nestbox_net::queue::install_rules`]), and a thread of the box's
//! monitor process, moved into that namespace, binds the queue and judges
//! every packet with [`nestbox_interpose::packets::Inspector`].
//!
//! Fail closed: the rules have no bypass, so while no reader is bound (the
//! thread ended, the monitor died) the box's packets are dropped; a monitor
//! that dies ends its box anyway. An inspector attached to a running box
//! (`monitor attach`, [`Reader`]) is read by a thread of the attach server,
//! and its rules are taken out again on `detach`.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{mpsc, Arc, Mutex};

use nestbox_interpose::packets::{Inspector, PacketVerdict};
use nestbox_interpose::MonitorSpec;
use nestbox_net::queue::{PacketQueue, QUEUE};
use nix::unistd::Pid;

use crate::{Result, RuntimeError};

/// Put the queue rules into `child`'s network namespace and start the thread
/// that reads the queue; returns once the queue is bound (so the box's first
/// packet already has its reader).
pub fn start(child: Pid, spec: &MonitorSpec, inspector: Inspector) -> Result<()> {
    let reader = Reader::bind(child.as_raw())?;
    reader.inspect(spec, inspector)
}

/// The thread reading a box's packet queue, bound in the box's network
/// namespace, and the inspector it asks: the rules can be put in and taken
/// out again while it reads (`monitor attach`/`detach`).
pub struct Reader {
    /// A process of the box (its network namespace).
    pid: i32,
    /// What judges each packet; `None` lets it through (a packet queued
    /// before the rules were taken out).
    inspector: Arc<Mutex<Option<Inspector>>>,
    /// The directions the rules in place queue (outbound, inbound).
    rules: Mutex<Option<(bool, bool)>>,
}

impl Reader {
    /// Start the thread that binds the queue in the network namespace of
    /// process `pid`; returns once it is bound. No rule is put in yet.
    pub fn bind(pid: i32) -> Result<Reader> {
        let path = format!("/proc/{pid}/ns/net");
        let ns: OwnedFd = std::fs::File::open(&path)
            .map_err(RuntimeError::io("open", &path))?
            .into();
        let inspector = Arc::new(Mutex::new(None));
        let (tx, rx) = mpsc::channel();
        let judge = Arc::clone(&inspector);
        std::thread::Builder::new()
            .name("packets".into())
            .spawn(move || serve(ns, judge, tx))
            .map_err(|e| {
                RuntimeError::Failed(format!("no thread for the packet inspector: {e}"))
            })?;
        match rx.recv() {
            Ok(Ok(())) => Ok(Reader {
                pid,
                inspector,
                rules: Mutex::new(None),
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(RuntimeError::Failed(
                "the packet inspector's thread ended before binding its queue".into(),
            )),
        }
    }

    /// Judge the box's packets with `inspector` from now on, and put in the
    /// rules `spec` asks for (after taking out any in place). The reader is
    /// bound first: with the rules in and no reader, the box's packets
    /// would be dropped.
    pub fn inspect(&self, spec: &MonitorSpec, inspector: Inspector) -> Result<()> {
        let MonitorSpec::Packets {
            outbound, inbound, ..
        } = spec
        else {
            return Ok(());
        };
        self.stop()?;
        *lock(&self.inspector) = Some(inspector);
        if let Err(e) = nestbox_net::queue::install_rules(self.pid, *outbound, *inbound) {
            // The rules go in one at a time, in the order they are taken
            // out: those put in before the failure go, the first missing
            // one ends the removal (and its error is not the one to tell).
            let _ = nestbox_net::queue::remove_rules(self.pid, *outbound, *inbound);
            *lock(&self.inspector) = None;
            return Err(e.into());
        }
        *lock(&self.rules) = Some((*outbound, *inbound));
        Ok(())
    }

    /// Take the rules out: the box's packets go straight through again.
    /// Packets still queued are let through.
    pub fn stop(&self) -> Result<()> {
        let mut rules = lock(&self.rules);
        if let Some((outbound, inbound)) = *rules {
            nestbox_net::queue::remove_rules(self.pid, outbound, inbound)?;
            *rules = None;
        }
        *lock(&self.inspector) = None;
        Ok(())
    }
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("pid", &self.pid)
            .field("rules", &*lock(&self.rules))
            .finish_non_exhaustive()
    }
}

/// A lock that a panicked holder did not spoil (the data is replaced whole).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The thread: join the box's network namespace, bind the queue, tell
/// `ready`, then judge packets until the queue fails.
fn serve(ns: OwnedFd, inspector: Arc<Mutex<Option<Inspector>>>, ready: mpsc::Sender<Result<()>>) {
    let opened = nestbox_sys::ns::enter(ns.as_fd(), nestbox_sys::ns::Namespace::Net)
        .map_err(RuntimeError::sys("setns into the box's network namespace"))
        .and_then(|()| PacketQueue::open(QUEUE).map_err(RuntimeError::from));
    drop(ns);
    let mut queue = match opened {
        Ok(q) => {
            // The starter waits for this message; it cannot have left.
            let _ = ready.send(Ok(()));
            q
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    loop {
        let packet = match queue.receive() {
            Ok(p) => p,
            Err(e) => {
                if matches!(&e, nestbox_net::NetError::Sys { source, .. } if source.raw_os_error() == Some(libc::ENOBUFS))
                {
                    // The kernel dropped packets it could not queue (fail closed).
                    tracing::warn!("packet inspector: queue overflowed, packets were dropped");
                    continue;
                }
                tracing::error!("packet inspector: {e}; the box's packets are dropped from now on");
                return;
            }
        };
        let accept = lock(&inspector)
            .as_mut()
            .is_none_or(|i| i.judge(packet.inbound, &packet.payload) != PacketVerdict::Drop);
        if let Err(e) = queue.verdict(packet.id, accept) {
            tracing::error!("packet inspector: {e}; the box's packets are dropped from now on");
            return;
        }
    }
}
