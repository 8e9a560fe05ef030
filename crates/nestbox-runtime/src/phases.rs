//! Where the time of a box start goes: timestamps of the start path's phases,
//! taken only when `NESTBOX_PHASES` is set (measurement, not a feature).
//!
//! `NESTBOX_PHASES=1 nestbox run --rm -- /bin/true` (or `nestbox clone`) prints, once the run is
//! over, one line per phase on stderr: the process that reached it (the CLI
//! or monitor, the box's first process, the command before its `execve`), its
//! name, the time since the first mark and since the previous one, in ms.
//! With `NESTBOX_PHASES=NS`, NS being the `CLOCK_MONOTONIC` time in
//! nanoseconds at which the caller started nestbox (`bench/phases.py` sets
//! it), times count from there, so the process's own exec and loading show
//! up too.
//!
//! The marks are written to one shared anonymous page mapped when the CLI
//! starts, so the box's first process and the command (forks of the monitor)
//! record into the same table; a mark is one atomic increment and two stores,
//! and costs nothing when the variable is unset (one relaxed load).

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

/// The environment variable that turns the marks on.
pub const ENV: &str = "NESTBOX_PHASES";

const SLOTS: usize = 120;

#[repr(C)]
struct Slot {
    name: *const u8,
    len: usize,
    pid: i32,
    ns: u64,
}

#[repr(C)]
struct Table {
    next: AtomicU32,
    base_ns: u64,
    slots: [Slot; SLOTS],
}

static TABLE: AtomicPtr<Table> = AtomicPtr::new(std::ptr::null_mut());

/// Where a process without the table writes its marks instead: a pooled
/// shell's init and command, whose claimer asked for marks (one line a
/// mark, `PID NS NAME`, each written at once).
static SINK: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Write this process's marks (and its forks') to `fd` from now on.
pub fn to_fd(fd: std::os::fd::RawFd) {
    SINK.store(fd, Ordering::Relaxed);
}

/// `CLOCK_MONOTONIC` now, in nanoseconds.
pub fn now_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Map the table if `NESTBOX_PHASES` is set. Call once, early, in the CLI's
/// process (before any fork whose marks should be seen).
pub fn init() {
    let Some(value) = std::env::var_os(ENV) else {
        return;
    };
    let size = std::mem::size_of::<Table>();
    // SAFETY: a fresh anonymous shared mapping of the table's size; nothing
    // else refers to it. It is never unmapped: the process keeps it to the end.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return;
    }
    let table = ptr.cast::<Table>();
    let base = value
        .to_str()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&n| n > 1)
        .unwrap_or_else(now_ns);
    // SAFETY: the mapping is zero-filled, writable and of the table's size.
    unsafe { (*table).base_ns = base };
    TABLE.store(table, Ordering::Release);
    // The rebuild engine's steps (a restore's) are marked too.
    nestbox_remote::set_phase_hook(mark);
    mark("cli: main");
}

/// Whether the marks are on (in this process's table).
pub fn enabled() -> bool {
    !TABLE.load(Ordering::Relaxed).is_null()
}

/// Record that this process reached phase `name`.
pub fn mark(name: &'static str) {
    record(name, std::process::id() as i32, now_ns());
}

/// Record that process `pid` reached phase `name` at `ns` (marks another
/// process sent: a pooled shell's monitor).
pub fn record(name: &'static str, pid: i32, ns: u64) {
    let table = TABLE.load(Ordering::Relaxed);
    if table.is_null() {
        let sink = SINK.load(Ordering::Relaxed);
        if sink >= 0 {
            let line = format!("{pid} {ns} {name}\n");
            // SAFETY: a write of a buffer we own to a descriptor this process
            // was given for its marks; a failure loses a mark only.
            unsafe { libc::write(sink, line.as_ptr().cast(), line.len()) };
        }
        return;
    }
    // SAFETY: a non-null TABLE points at the shared mapping made by `init`,
    // which lives as long as the process (and is inherited by its forks);
    // each index is handed out once by the atomic increment.
    unsafe {
        let i = (*table).next.fetch_add(1, Ordering::Relaxed) as usize;
        if i >= SLOTS {
            return;
        }
        let slot = std::ptr::addr_of_mut!((*table).slots[i]);
        (*slot).name = name.as_ptr();
        (*slot).len = name.len();
        (*slot).pid = pid;
        (*slot).ns = ns;
    }
}

/// Print the marks (sorted by time) on stderr. In the process that called
/// [`init`], once the phases of interest have passed.
pub fn report() {
    let table = TABLE.load(Ordering::Acquire);
    if table.is_null() {
        return;
    }
    mark("cli: report");
    // SAFETY: as in `mark`; the names point into this binary's read-only data,
    // mapped at the same address in every fork that wrote them (none of them
    // executed another program before marking).
    let mut rows: Vec<(u64, i32, String)> = unsafe {
        let n = ((*table).next.load(Ordering::Acquire) as usize).min(SLOTS);
        (0..n)
            .map(|i| {
                let s = &(*table).slots[i];
                let name = std::str::from_utf8(std::slice::from_raw_parts(s.name, s.len))
                    .unwrap_or("?")
                    .to_string();
                (s.ns, s.pid, name)
            })
            .collect()
    };
    rows.sort();
    // SAFETY: as above.
    let base = unsafe { (*table).base_ns };
    let mut prev = base;
    for (ns, pid, name) in rows {
        eprintln!(
            "phase {pid:>7} {:<44} {:>8.3} {:>+8.3}",
            name,
            ns.saturating_sub(base) as f64 / 1e6,
            ns.saturating_sub(prev) as f64 / 1e6
        );
        prev = ns;
    }
}
