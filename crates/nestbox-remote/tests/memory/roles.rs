//! The memory template of `remote_memory.rs`, run by re-executing the test binary
//! as the scenario's `template` role with `NBR_MODE=memory`: one single-threaded
//! process that holds one counter in each kind of shared object, each reachable a
//! second way (a second mapping, a second attachment, an fd), and answers line
//! commands on 127.0.0.1:7777 with a blocking `accept`.
//!
//! * `inc`: add one to every counter (through the first mapping; the fd-only memfd
//!   through `pwrite`), then answer like `get`;
//! * `get`: every counter, read through each of its ways;
//! * `shmid`: `shmget(key, 0, 0)` of the System V segment in the caller's IPC namespace.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::PathBuf;

const PAGE: usize = 4096;

fn die(what: &str) -> ! {
    eprintln!(
        "memory role failed: {what}: {}",
        std::io::Error::last_os_error()
    );
    std::process::exit(101)
}

fn ok<T: PartialOrd + Default>(v: T, what: &str) -> T {
    if v < T::default() {
        die(what)
    }
    v
}

fn map(len: usize, prot: i32, flags: i32, fd: i32, offset: i64, what: &str) -> *mut u8 {
    // SAFETY: a new mapping at an address the kernel chooses; nothing is aliased.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, offset) };
    if p == libc::MAP_FAILED {
        die(what)
    }
    p.cast()
}

struct Mem {
    anon: *mut u64,
    anon2: *mut u64,
    memfd: i32,
    m1: *mut u64,
    m2: *mut u64,
    deep: *mut u8,
    only: i32,
    shm: *mut u64,
    file: *mut u64,
    v1: *mut u64,
    v2: *const u64,
    dest: *mut u64,
    deleted: i32,
    key: i32,
}

fn read_u64_at(fd: i32, offset: i64) -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: pread into an 8-byte buffer.
    ok(
        unsafe { libc::pread(fd, b.as_mut_ptr().cast(), 8, offset) },
        "pread",
    );
    u64::from_ne_bytes(b)
}

impl Mem {
    fn get(&self) -> String {
        let mut only = [0u8; 8];
        // SAFETY: pread into an 8-byte buffer; every pointer is one of our live
        // mappings (reads of shared memory only this process writes now).
        unsafe {
            ok(
                libc::pread(self.only, only.as_mut_ptr().cast(), 8, 0),
                "pread only",
            );
            let pos = libc::lseek(self.only, 0, libc::SEEK_CUR);
            format!(
                "anon={}/{} memfd={}/{}/{} deep={} only={} pos={} shm={} file={} sysv={}/{} dest={} deleted={}",
                self.anon.read_volatile(),
                self.anon2.read_volatile(),
                self.m1.read_volatile(),
                self.m2.read_volatile(),
                read_u64_at(self.memfd, 0),
                self.deep.read_volatile(),
                u64::from_ne_bytes(only),
                pos,
                self.shm.read_volatile(),
                self.file.read_volatile(),
                self.v1.read_volatile(),
                self.v2.read_volatile(),
                self.dest.read_volatile(),
                read_u64_at(self.deleted, 0),
            )
        }
    }

    fn inc(&self) -> String {
        // SAFETY: as in get; this process is the only writer of its mappings.
        unsafe {
            for p in [self.anon, self.m1, self.shm, self.file, self.v1, self.dest] {
                p.write_volatile(p.read_volatile() + 1);
            }
            self.deep
                .write_volatile(self.deep.read_volatile().wrapping_add(1));
            for fd in [self.only, self.deleted] {
                let n = read_u64_at(fd, 0) + 1;
                ok(
                    libc::pwrite(fd, n.to_ne_bytes().as_ptr().cast(), 8, 0),
                    "pwrite",
                );
            }
        }
        self.get()
    }
}

/// The memory template (see the module documentation).
pub fn memory_template() -> ! {
    // SAFETY: close_range with plain integers (fds inherited from cargo).
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    let dir = PathBuf::from(std::env::var("NBR_DIR").unwrap_or_else(|_| die("NBR_DIR")));
    let tag = std::env::var("NBR_ABSTRACT").unwrap_or_else(|_| die("NBR_ABSTRACT"));
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let shared = libc::MAP_SHARED;
    let anon = map(
        4 * PAGE,
        rw,
        shared | libc::MAP_ANONYMOUS,
        -1,
        0,
        "mmap anon",
    );
    // SAFETY: mremap with old size 0 makes a second mapping of the same shared object.
    let anon2 = unsafe { libc::mremap(anon.cast(), 0, 4 * PAGE, libc::MREMAP_MAYMOVE) };
    if anon2 == libc::MAP_FAILED {
        die("mremap")
    }
    let name = CString::new("nbmem").unwrap_or_else(|_| die("name"));
    // SAFETY: memfd_create with a NUL-terminated name.
    let memfd = ok(
        unsafe { libc::memfd_create(name.as_ptr(), 0) },
        "memfd_create",
    );
    // SAFETY: ftruncate on our fd.
    ok(
        unsafe { libc::ftruncate(memfd, (256 * PAGE) as i64) },
        "ftruncate",
    );
    let m1 = map(256 * PAGE, rw, shared, memfd, 0, "mmap memfd");
    let m2 = map(PAGE, rw, shared, memfd, 0, "mmap memfd again");
    let only_name = CString::new("nbonly").unwrap_or_else(|_| die("name"));
    // SAFETY: memfd_create with a NUL-terminated name.
    let only = ok(
        unsafe { libc::memfd_create(only_name.as_ptr(), libc::MFD_CLOEXEC) },
        "memfd_create only",
    );
    // SAFETY: pwrite/lseek on our fd from a live buffer.
    unsafe {
        ok(
            libc::pwrite(only, [0u8; 16].as_ptr().cast(), 16, 0),
            "pwrite",
        );
        libc::lseek(only, 5, libc::SEEK_SET);
    }
    let shm_path = format!("/dev/shm/{tag}");
    let file_path = dir.join("data/shared.bin");
    let mut ptrs = Vec::new();
    for (path, len) in [(PathBuf::from(&shm_path), PAGE), (file_path, 2 * PAGE)] {
        let c = CString::new(path.to_str().unwrap_or_else(|| die("path")))
            .unwrap_or_else(|_| die("nul"));
        // SAFETY: open with a NUL-terminated path; ftruncate/close on the fd it gives.
        let fd = ok(
            unsafe {
                libc::open(
                    c.as_ptr(),
                    libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
                    0o640,
                )
            },
            "open shared file",
        );
        // SAFETY: as above.
        ok(unsafe { libc::ftruncate(fd, len as i64) }, "ftruncate file");
        ptrs.push(map(len, rw, shared, fd, 0, "mmap file"));
        // SAFETY: our fd; the mapping keeps the file.
        unsafe { libc::close(fd) };
    }
    let pid: i32 = std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| die("/proc/self"));
    let key = 0x4e42_0000 | (pid & 0xffff);
    // SAFETY: shmget/shmat with plain arguments; the attachments are new mappings.
    let (shmid, v1, v2) = unsafe {
        let id = ok(
            libc::shmget(key, 2 * PAGE + 100, libc::IPC_CREAT | 0o640),
            "shmget",
        );
        let v1 = libc::shmat(id, std::ptr::null(), 0);
        let v2 = libc::shmat(id, std::ptr::null(), libc::SHM_RDONLY);
        if v1 as isize == -1 || v2 as isize == -1 {
            die("shmat")
        }
        (id, v1, v2)
    };
    // A private segment removed while attached (SHM_DEST), and, in mode
    // `memory-partial`, the first attachment of the keyed one cut short.
    // SAFETY: shmget/shmat/shmctl/munmap with plain arguments on our segments.
    let dest = unsafe {
        let id = ok(
            libc::shmget(libc::IPC_PRIVATE, PAGE, 0o600),
            "shmget private",
        );
        let p = libc::shmat(id, std::ptr::null(), 0);
        if p as isize == -1 {
            die("shmat private")
        }
        ok(
            libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
            "IPC_RMID",
        );
        if std::env::var("NBR_MODE").is_ok_and(|m| m == "memory-partial") {
            ok(
                libc::munmap(v1.cast::<u8>().add(2 * PAGE).cast(), PAGE),
                "munmap part",
            );
        }
        p
    };
    // A file open for writing, then unlinked.
    let deleted_path = dir.join("data/deleted.bin");
    let deleted = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&deleted_path)
        .unwrap_or_else(|_| die("open deleted.bin"));
    std::io::Write::write_all(&mut &deleted, &[0u8; 64]).unwrap_or_else(|_| die("write"));
    std::fs::remove_file(&deleted_path).unwrap_or_else(|_| die("unlink"));
    let deleted = std::os::fd::IntoRawFd::into_raw_fd(deleted);
    let mem = Mem {
        anon: anon.cast(),
        anon2: anon2.cast(),
        memfd,
        m1: m1.cast(),
        m2: m2.cast(),
        // SAFETY: page 100 of the 256-page memfd mapping.
        deep: unsafe { m1.add(100 * PAGE + 17) },
        only,
        shm: ptrs[0].cast(),
        file: ptrs[1].cast(),
        v1: v1.cast(),
        v2: v2.cast(),
        dest: dest.cast(),
        deleted,
        key,
    };
    let listener = TcpListener::bind(("127.0.0.1", 7777)).unwrap_or_else(|_| die("bind"));
    println!(
        "ready {pid} memfd={memfd} only={only} deleted={deleted} key={key} shmid={shmid} shm={shm_path}"
    );
    loop {
        let Ok((conn, _)) = listener.accept() else {
            continue;
        };
        let mut line = String::new();
        let mut reader = BufReader::new(&conn);
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        let reply = match line.trim() {
            "inc" => mem.inc(),
            "get" => mem.get(),
            // SAFETY: shmget with plain arguments.
            "shmid" => unsafe { libc::shmget(mem.key, 0, 0) }.to_string(),
            other => format!("unknown {other}"),
        };
        let _ = (&conn).write_all(format!("{reply}\n").as_bytes());
    }
}

fn host_pid() -> i32 {
    std::fs::read_link("/proc/self")
        .ok()
        .and_then(|p| p.to_str().and_then(|s| s.parse().ok()))
        .unwrap_or_else(|| die("/proc/self"))
}

fn fill(p: *mut u8, len: usize, seed: u8) {
    for i in (0..len).step_by(64) {
        // SAFETY: i < len, inside the mapping of `len` bytes at `p`.
        unsafe { p.add(i).write_volatile(seed.wrapping_add((i / 4096) as u8)) };
    }
}

fn checksum(p: *const u8, len: usize) -> u64 {
    (0..len)
        .step_by(64)
        // SAFETY: i < len, inside the mapping of `len` bytes at `p`.
        .map(|i| u64::from(unsafe { p.add(i).read_volatile() }) * (i as u64 + 1))
        .sum()
}

/// The rebuild scenario's template A: memory of every kind (brk heap, large
/// allocations, private anonymous mappings, a private file mapping), then a
/// child B. Without `exec`, B writes some pages, unmaps one region, maps
/// another, grows the heap, and answers `get` on A's listener with a counter and
/// a checksum of its memory; with `exec`, B runs Python, counting on stdout. A
/// then waits in `pause` (no memory written), as the clone of A does.
pub fn rebuild_template(exec: bool) -> ! {
    // SAFETY: close_range with plain integers (fds inherited from cargo).
    unsafe { libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) };
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
    let small: Vec<Vec<u8>> = (0..2000).map(|i| vec![(i % 251) as u8; 500]).collect();
    let mut big = vec![0u8; 2 << 20];
    fill(big.as_mut_ptr(), big.len(), 1);
    let r1 = map(64 * PAGE, rw, private, -1, 0, "mmap r1");
    fill(r1, 64 * PAGE, 2);
    let r2 = map(8 * PAGE, rw, private, -1, 0, "mmap r2");
    fill(r2, 8 * PAGE, 3);
    let dir = PathBuf::from(std::env::var("NBR_DIR").unwrap_or_else(|_| die("NBR_DIR")));
    let ro = std::fs::File::open(dir.join("data/ro")).unwrap_or_else(|_| die("open ro"));
    let fmap = map(
        PAGE,
        rw,
        libc::MAP_PRIVATE,
        std::os::fd::AsRawFd::as_raw_fd(&ro),
        0,
        "mmap ro",
    );
    // SAFETY: a private (copy-on-write) mapping of our own.
    unsafe { fmap.write_volatile(b'R') };
    drop(ro);
    // Shared anonymous memory A and B share (B writes it before the clone).
    let both = map(
        2 * PAGE,
        rw,
        libc::MAP_SHARED | libc::MAP_ANONYMOUS,
        -1,
        0,
        "mmap both",
    );
    fill(both, 2 * PAGE, 6);
    let listener = TcpListener::bind(("127.0.0.1", 7777)).unwrap_or_else(|_| die("bind"));
    // Before the fork, so that it comes before B's line.
    println!("ready {}", host_pid());
    // SAFETY: the process is single-threaded.
    let child = unsafe { libc::fork() };
    if child < 0 {
        die("fork")
    }
    if child > 0 {
        loop {
            // SAFETY: pause takes no arguments.
            unsafe { libc::pause() };
        }
    }
    if exec {
        let err = std::os::unix::process::CommandExt::exec(
            std::process::Command::new("/usr/bin/python3").args([
                "-u",
                "-c",
                "import os,time\nprint('b-ready', open('/proc/self/stat').read().split()[0], flush=True)\ni=0\nwhile True:\n    i+=1\n    print('count', i, flush=True)\n    time.sleep(0.01)\n",
            ]),
        );
        eprintln!("exec python3: {err}");
        std::process::exit(101)
    }
    // B: write a few pages, unmap, map, grow the heap.
    for i in [0usize, 100, 300] {
        big[i * PAGE + 7] = 0xee;
    }
    // SAFETY: r2 is our mapping of 8 pages; r1's pages 5 to 13 are inside r1.
    unsafe {
        libc::munmap(r2.cast(), 8 * PAGE);
        r1.add(5 * PAGE).write_volatile(0x55);
        // Four pages B no longer has (they read as zeros again).
        libc::madvise(r1.add(10 * PAGE).cast(), 4 * PAGE, libc::MADV_DONTNEED);
    }
    let r3 = map(5 * PAGE, rw, private, -1, 0, "mmap r3");
    fill(r3, 5 * PAGE, 4);
    // Shared memory B made after the fork (A has none there), and a write into
    // the memory it shares with A.
    let own = map(
        3 * PAGE,
        rw,
        libc::MAP_SHARED | libc::MAP_ANONYMOUS,
        -1,
        0,
        "mmap own",
    );
    fill(own, 3 * PAGE, 7);
    // SAFETY: inside the two-page shared mapping.
    unsafe { both.add(PAGE + 8).write_volatile(0x77) };
    let more: Vec<Vec<u8>> = (0..3000).map(|i| vec![(i % 13) as u8; 700]).collect();
    let sum = || {
        checksum(big.as_ptr(), big.len())
            + checksum(r1, 64 * PAGE)
            + checksum(r3, 5 * PAGE)
            + checksum(own, 3 * PAGE)
            + checksum(both, 2 * PAGE)
            + small.iter().chain(&more).map(|v| checksum(v.as_ptr(), v.len())).sum::<u64>()
            // SAFETY: fmap is a live one-page mapping.
            + u64::from(unsafe { fmap.read_volatile() })
    };
    println!("b-ready {}", host_pid());
    let mut count = 0u64;
    loop {
        let Ok((conn, _)) = listener.accept() else {
            continue;
        };
        let mut line = String::new();
        if BufReader::new(&conn).read_line(&mut line).is_err() {
            continue;
        }
        let reply = format!("count={count} sum={}", sum());
        count += 1;
        let _ = (&conn).write_all(format!("{reply}\n").as_bytes());
    }
}
