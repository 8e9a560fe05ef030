//! Measure the cost of one injected syscall and print it.
//!
//! `cargo run --release --example inject_bench` (as root): starts `sleep 60`,
//! stops it with ptrace, injects `getpid` many times, detaches and kills it.

use std::process::Command;
use std::time::{Duration, Instant};

use nestbox_remote::Tracee;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut child = Command::new("sleep").arg("60").spawn()?;
    let pid = child.id() as i32;
    std::thread::sleep(Duration::from_millis(50));
    let mut tracee = Tracee::seize_and_interrupt(pid)?;
    tracee.wait_stopped(Duration::from_secs(2))?;
    let rounds = 2000;
    for _ in 0..100 {
        tracee.inject_syscall(libc::SYS_getpid, &[])?;
    }
    let start = Instant::now();
    for _ in 0..rounds {
        let got = tracee.inject_syscall(libc::SYS_getpid, &[])?;
        assert_eq!(got, i64::from(pid));
    }
    let per_call = start.elapsed() / rounds;
    println!("one injected syscall: {per_call:?} (mean of {rounds})");
    tracee.detach()?;
    child.kill()?;
    child.wait()?;
    Ok(())
}
