//! The packet inspector of a box (`--monitor packets:…`, docs/monitors.md):
//! the queue rules go into the box's network namespace
//! ([`nestbox_net::queue::install_rules`]), and a thread of the box's
//! monitor process, moved into that namespace, binds the queue and judges
//! every packet with [`nestbox_interpose::packets::Inspector`].
//!
//! Fail closed: the rules have no bypass, so while no reader is bound (the
//! thread ended, the monitor died) the box's packets are dropped; a monitor
//! that dies ends its box anyway.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;

use nestbox_interpose::packets::{Inspector, PacketVerdict};
use nestbox_interpose::MonitorSpec;
use nestbox_net::queue::{PacketQueue, QUEUE};
use nix::unistd::Pid;

use crate::{Result, RuntimeError};

/// Put the queue rules into `child`'s network namespace and start the thread
/// that reads the queue; returns once the queue is bound (so the box's first
/// packet already has its reader).
pub fn start(child: Pid, spec: &MonitorSpec, inspector: Inspector) -> Result<()> {
    let MonitorSpec::Packets {
        outbound, inbound, ..
    } = spec
    else {
        return Ok(());
    };
    let path = format!("/proc/{child}/ns/net");
    let ns: OwnedFd = std::fs::File::open(&path)
        .map_err(RuntimeError::io("open", &path))?
        .into();
    // The reader first: with the rules in and no reader, the box's packets
    // would be dropped.
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("packets".into())
        .spawn(move || serve(ns, inspector, tx))
        .map_err(|e| RuntimeError::Failed(format!("no thread for the packet inspector: {e}")))?;
    match rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => {
            return Err(RuntimeError::Failed(
                "the packet inspector's thread ended before binding its queue".into(),
            ))
        }
    }
    nestbox_net::queue::install_rules(child.as_raw(), *outbound, *inbound)?;
    Ok(())
}

/// The thread: join the box's network namespace, bind the queue, tell
/// `ready`, then judge packets until the queue fails.
fn serve(ns: OwnedFd, mut inspector: Inspector, ready: mpsc::Sender<Result<()>>) {
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
        let accept = inspector.judge(packet.inbound, &packet.payload) != PacketVerdict::Drop;
        if let Err(e) = queue.verdict(packet.id, accept) {
            tracing::error!("packet inspector: {e}; the box's packets are dropped from now on");
            return;
        }
    }
}
