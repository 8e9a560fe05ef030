//! Fuzzing the runtime's parsers of user input: sizes (`--memory`, `--samples`),
//! the spec's option parsers (`-v`, `-u`, `-p`, signals, names, `--network`,
//! capabilities) and `BoxSpec::validate` over specs with random fields (`-e`,
//! `--tmpfs`, `--workdir`, `--hostname`, `--cpus`, `--cpuset-cpus`, memory,
//! swap, pids...), stored specs read back from damaged JSON, and the request
//! parser of `nestbox serve` (JSON lines on its socket). No input may panic;
//! what is accepted must satisfy the rule that accepted it; every error is one
//! line; the server answers each request line with one JSON line and keeps
//! serving.
//!
//! Budget: see `bench/fuzz/budget.rs` (`NESTBOX_FUZZ_SECS`).

#[path = "../../../bench/fuzz/budget.rs"]
mod budget;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::thread::JoinHandleExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nestbox_runtime::paths::Roots;
use nestbox_runtime::registry::Registry;
use nestbox_runtime::size::{format_size, parse_size};
use nestbox_runtime::spec::{
    parse_signal, parse_user, parse_volume, resolve_capabilities, validate_name,
    validate_user_name, BoxSpec, NetSpec, NetworkMode, SeccompChoice, User,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn one_line(e: &dyn std::fmt::Display) -> Result<(), TestCaseError> {
    let text = e.to_string();
    prop_assert!(
        !text.is_empty() && !text.contains('\n'),
        "error not one line: {text:?}"
    );
    Ok(())
}

// ------------------------------------------------------------------- sizes

fn size_text() -> impl Strategy<Value = String> {
    let unit = prop_oneof![
        Just(""),
        Just("b"),
        Just("k"),
        Just("KiB"),
        Just("m"),
        Just("MB"),
        Just("g"),
        Just("GiB"),
        Just("t"),
        Just("tb"),
        Just("x"),
        Just("ib"),
    ];
    let number = prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..100_000).prop_map(|n| n.to_string()),
        any::<f64>().prop_map(|f| f.to_string()),
        "[0-9]{0,30}\\.?[0-9]{0,30}",
        "[0-9.eE+-]{0,12}",
    ];
    prop_oneof![
        3 => (" ?", number, unit, " ?").prop_map(|(a, n, u, b)| format!("{a}{n}{u}{b}")),
        1 => any::<String>(),
        1 => "\\PC{0,12}",
    ]
}

#[test]
fn size_parser() {
    budget::fuzz("size_parser", 3000, size_text(), |text| {
        match parse_size(&text) {
            Ok(n) => {
                // What is printed for a size reads back as a size.
                let shown = format_size(n);
                prop_assert!(parse_size(&shown.replace(' ', "")).is_ok(), "{shown:?}");
                // Plain byte counts are exact.
                if let Ok(plain) = text.trim().parse::<u64>() {
                    prop_assert_eq!(n, plain);
                }
            }
            Err(e) => one_line(&e)?,
        }
        Ok(())
    });
}

// ----------------------------------------------------- the spec's options

fn option_text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => any::<String>(),
        2 => "[a-zA-Z0-9:/._,=+-]{0,24}",
        1 => "(/[a-z.]{0,4}){0,3}:(/[a-z.]{0,4}){0,3}(:ro|:rw|:x)?",
        1 => "[0-9]{0,12}(:[0-9]{0,12})?",
        1 => "(SIG)?[A-Za-z]{0,6}|-?[0-9]{1,12}",
        1 => "[0-9]{0,6}:[0-9]{0,6}(/tcp|/udp|/sctp)?",
    ]
}

#[test]
fn spec_option_parsers() {
    budget::fuzz("spec_option_parsers", 3000, option_text(), |text| {
        match parse_volume(&text) {
            Ok(v) => {
                prop_assert!(v.source.is_absolute());
                prop_assert!(!v.target.as_os_str().is_empty());
            }
            Err(e) => one_line(&e)?,
        }
        match parse_user(&text) {
            Ok(u) => {
                let (uid, gid) = text.split_once(':').unwrap_or((&text, &text));
                prop_assert_eq!(u.uid, uid.parse::<u32>().unwrap());
                prop_assert_eq!(u.gid, gid.parse::<u32>().unwrap());
            }
            Err(e) => one_line(&e)?,
        }
        if let Err(e) = parse_signal(&text) {
            one_line(&e)?;
        }
        match validate_name(&text) {
            Ok(()) => prop_assert!(text.len() <= 64 && text.is_ascii() && !text.contains('/')),
            Err(e) => one_line(&e)?,
        }
        if validate_user_name(&text).is_ok() {
            prop_assert!(!text.starts_with("pool."));
        }
        if let Err(e) = NetworkMode::parse(&text) {
            one_line(&e)?;
        }
        match nestbox_net::PortMapping::parse(&text) {
            Ok(p) => prop_assert!(p.host_port > 0 && p.box_port > 0),
            Err(e) => one_line(&e)?,
        }
        let caps: Vec<String> = text.split(',').map(str::to_string).collect();
        if let Err(e) = resolve_capabilities(&caps, &[]) {
            one_line(&e)?;
        }
        if let Err(e) = resolve_capabilities(&[], &caps) {
            one_line(&e)?;
        }
        Ok(())
    });
}

fn path_text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => "(/[a-z.]{0,5}){0,4}",
        1 => "[a-z./]{0,10}",
        1 => Just("/".to_string()),
        1 => any::<String>(),
    ]
}

fn limits() -> impl Strategy<Value = nestbox_cgroup::Limits> {
    (
        (
            proptest::option::of(prop_oneof![any::<u64>(), 0u64..(64 << 20)]),
            proptest::option::of(prop_oneof![any::<i64>(), -2i64..2]),
            proptest::option::of(any::<u64>()),
            proptest::option::of(prop_oneof![any::<u64>(), 0u64..(128 << 20)]),
        ),
        (
            proptest::option::of(prop_oneof![
                any::<f64>(),
                0.0f64..8.0,
                Just(f64::NAN),
                Just(f64::INFINITY),
                Just(-0.0)
            ]),
            proptest::option::of(any::<u64>()),
            proptest::option::of(prop_oneof![
                "[0-9,-]{0,12}",
                "[0-9]{1,4}-[0-9]{1,4}",
                any::<String>()
            ]),
            proptest::option::of(any::<u16>()),
        ),
    )
        .prop_map(
            |(
                (memory, memory_swap, pids, memory_reserve),
                (cpus, cpu_shares, cpuset_cpus, io_weight),
            )| {
                nestbox_cgroup::Limits {
                    memory,
                    memory_reserve,
                    memory_swap,
                    pids,
                    cpus,
                    cpu_period_us: None,
                    cpu_shares,
                    // Half the cap, when there is one: in range and out of it alike.
                    cpu_reserve: cpus.map(|c| c / 2.0),
                    cpuset_cpus,
                    io_weight,
                    // From the weight: in range (0..=100) and out of it alike.
                    memory_swappiness: io_weight.map(|w| u64::from(w % 128)),
                    oom_kill_disable: pids.is_some_and(|p| p % 2 == 0),
                    io_devices: Vec::new(),
                    net_class_id: None,
                    net_priorities: Vec::new(),
                    hugepage_limits: Vec::new(),
                }
            },
        )
}

fn spec() -> impl Strategy<Value = BoxSpec> {
    (
        ("[a-z0-9._-]{0,10}|\\PC{0,8}", "[a-z0-9.-]{0,12}|\\PC{0,8}"),
        proptest::collection::vec("\\PC{0,6}", 0..3),
        proptest::collection::vec("[A-Z=_]{0,4}=?\\PC{0,6}", 0..4),
        path_text(),
        proptest::collection::vec((path_text(), path_text(), any::<bool>()), 0..3),
        proptest::collection::vec(path_text(), 0..3),
        limits(),
        (
            prop_oneof![
                Just(NetworkMode::None),
                Just(NetworkMode::Bridge),
                Just(NetworkMode::Host)
            ],
            proptest::option::of(8u64..u64::MAX),
            proptest::option::of(any::<u32>()),
            any::<bool>(),
        ),
    )
        .prop_map(
            |((name, hostname), command, env, workdir, volumes, tmpfs, limits, net)| {
                let (mode, rate, share, userns) = net;
                BoxSpec {
                    name,
                    image: "host".into(),
                    command,
                    env,
                    workdir: workdir.into(),
                    user: User::default(),
                    hostname,
                    read_only: false,
                    volumes: volumes
                        .into_iter()
                        .map(|(s, t, ro)| nestbox_isolation::rootfs::Volume {
                            source: s.into(),
                            target: t.into(),
                            read_only: ro,
                        })
                        .collect(),
                    tmpfs: tmpfs.into_iter().map(PathBuf::from).collect(),
                    capabilities: resolve_capabilities(&[], &[]).unwrap(),
                    seccomp: SeccompChoice::Default,
                    userns,
                    limits,
                    interactive: false,
                    remove_on_exit: false,
                    ksm: false,
                    disk: None,
                    monitors: Vec::new(),
                    nest: false,
                    clone_of: None,
                    restore_of: None,
                    network: NetSpec {
                        mode,
                        rate: rate.and_then(nestbox_net::Rate::from_bits),
                        share,
                        ..NetSpec::default()
                    },
                }
            },
        )
}

#[test]
fn spec_validation() {
    budget::fuzz("spec_validation", 2000, spec(), |s| {
        match s.validate() {
            Ok(()) => {
                validate_user_name(&s.name).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!(!s.command.is_empty() && !s.command[0].is_empty());
                prop_assert!(s.workdir.is_absolute());
                for kv in &s.env {
                    prop_assert!(kv.contains('=') && !kv.starts_with('='), "{kv:?}");
                }
                for t in &s.tmpfs {
                    prop_assert!(t.is_absolute() && t != Path::new("/"), "{t:?}");
                }
                for v in &s.volumes {
                    prop_assert!(v.target.is_absolute() && v.target != Path::new("/"));
                }
                if let Some(c) = s.limits.cpus {
                    prop_assert!(c.is_finite() && c > 0.0);
                }
                // Its environment has one entry per key.
                let env = s.environment();
                let mut keys: Vec<&str> =
                    env.iter().map(|e| e.split('=').next().unwrap()).collect();
                keys.sort();
                let n = keys.len();
                keys.dedup();
                prop_assert_eq!(keys.len(), n);
            }
            Err(e) => one_line(&e)?,
        }
        Ok(())
    });
}

/// A stored spec damaged on disk reads back as an error or a spec, never a
/// panic, and a spec read back validates or not without panicking either.
#[test]
fn stored_spec_json() {
    let base = serde_json::to_string(&BoxSpec {
        name: "b".into(),
        image: "host".into(),
        command: vec!["/bin/true".into()],
        env: vec!["A=1".into()],
        workdir: "/".into(),
        user: User::default(),
        hostname: "b".into(),
        read_only: false,
        volumes: vec![],
        tmpfs: vec!["/tmp".into()],
        capabilities: resolve_capabilities(&[], &[]).unwrap(),
        seccomp: SeccompChoice::Default,
        userns: false,
        limits: Default::default(),
        interactive: false,
        remove_on_exit: false,
        ksm: false,
        disk: None,
        monitors: Vec::new(),
        nest: false,
        clone_of: None,
        restore_of: None,
        network: NetSpec::default(),
    })
    .unwrap();
    let edits = proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 0..4);
    budget::fuzz("stored_spec_json", 2000, edits, |edits| {
        let mut bytes = base.clone().into_bytes();
        for (i, b) in edits {
            let k = i.index(bytes.len());
            bytes[k] = b;
        }
        if let Ok(s) = serde_json::from_slice::<BoxSpec>(&bytes) {
            if let Err(e) = s.validate() {
                one_line(&e)?;
            }
        }
        Ok(())
    });
}

// --------------------------------------------------- the API's requests

/// `nestbox serve` on a scratch root, in a thread, stopped on drop.
struct Server {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    thread: Option<std::thread::JoinHandle<nestbox_runtime::Result<()>>>,
}

impl Server {
    fn start() -> Server {
        let dir = tempfile::Builder::new()
            .prefix("nestbox-test-fuzz-api-")
            .tempdir()
            .unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        let socket = dir.path().join("api.sock");
        let s = socket.clone();
        let thread = std::thread::spawn(move || nestbox_runtime::api::serve(&reg, &s));
        let server = Server {
            _dir: dir,
            socket,
            thread: Some(thread),
        };
        // Once it answers, it has blocked SIGTERM in its thread (see Drop).
        for _ in 0..500 {
            if server.ask(b"{\"op\":\"ping\"}\n").is_ok() {
                return server;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("nestbox serve did not answer");
    }

    /// Send `bytes`, close the sending side, read every answer line.
    fn ask(&self, bytes: &[u8]) -> std::io::Result<Vec<String>> {
        let mut c = UnixStream::connect(&self.socket)?;
        c.set_read_timeout(Some(Duration::from_secs(20)))?;
        c.write_all(bytes)?;
        c.shutdown(std::net::Shutdown::Write)?;
        BufReader::new(c).lines().collect()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            // The server ends on SIGTERM, which it reads from a signalfd with
            // the signal blocked in its thread: sent to that thread alone, it
            // ends the server, not this process.
            // SAFETY: `t` is not joined yet, so its pthread_t names a live
            // (or not yet reaped) thread; pthread_kill only queues a signal.
            let rc = unsafe { libc::pthread_kill(t.as_pthread_t(), libc::SIGTERM) };
            assert_eq!(rc, 0, "pthread_kill");
            let r = t.join().expect("server thread panicked");
            if !std::thread::panicking() {
                r.expect("server ended with an error");
            }
        }
    }
}

fn request_line() -> impl Strategy<Value = Vec<u8>> {
    let string = prop_oneof![
        "[a-z0-9._-]{0,12}",
        Just("ping".to_string()),
        Just("clone".to_string()),
        Just("USR1".to_string()),
        Just("pool.x".to_string()),
        "\\PC{0,8}",
    ];
    let value = prop_oneof![
        string.clone().prop_map(Value::String),
        Just(Value::Null),
        any::<i64>().prop_map(|n| json!(n)),
        any::<bool>().prop_map(Value::Bool),
        Just(json!([])),
        Just(json!({})),
    ];
    let key = prop_oneof![
        Just("op".to_string()),
        Just("template".to_string()),
        Just("name".to_string()),
        Just("on_clone_signal".to_string()),
        "[a-z_]{1,8}",
    ];
    let object = proptest::collection::btree_map(key, value, 0..5)
        .prop_map(|m| serde_json::to_vec(&Value::Object(m.into_iter().collect())).unwrap());
    prop_oneof![
        6 => object,
        1 => Just(br#"{"op":"ping"}"#.to_vec()),
        1 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => "\\PC{0,32}".prop_map(String::into_bytes),
        1 => Just(b"   \t\r".to_vec()),
    ]
}

/// The lines the server answers: complete lines that are not blank.
fn answered(bytes: &[u8]) -> usize {
    let mut n = 0;
    let mut rest = bytes;
    while let Some(end) = rest.iter().position(|&b| b == b'\n') {
        if !String::from_utf8_lossy(&rest[..=end]).trim().is_empty() {
            n += 1;
        }
        rest = &rest[end + 1..];
    }
    n
}

#[test]
fn api_request_parser() {
    let server = Server::start();
    let lines = proptest::collection::vec(request_line(), 1..6);
    budget::fuzz(
        "api_request_parser",
        1000,
        (lines, any::<bool>()),
        |(lines, last_newline)| {
            let mut bytes = Vec::new();
            for (i, l) in lines.iter().enumerate() {
                bytes.extend_from_slice(l);
                if i + 1 < lines.len() || last_newline {
                    bytes.push(b'\n');
                }
            }
            let answers = server
                .ask(&bytes)
                .map_err(|e| TestCaseError::fail(format!("server gone: {e}")))?;
            prop_assert_eq!(answers.len(), answered(&bytes), "{:?}", answers);
            for a in &answers {
                let v: Value = serde_json::from_str(a)
                    .map_err(|e| TestCaseError::fail(format!("answer not JSON: {a:?}: {e}")))?;
                match v["ok"] {
                    Value::Bool(true) => {}
                    Value::Bool(false) => {
                        let e = v["error"].as_str().unwrap_or_default();
                        prop_assert!(!e.is_empty() && !e.contains('\n'), "{a}");
                    }
                    _ => prop_assert!(false, "answer without ok: {a}"),
                }
            }
            Ok(())
        },
    );
    // Still serving.
    assert_eq!(
        server.ask(b"{\"op\":\"ping\"}\n").unwrap(),
        ["{\"ok\":true}"]
    );
}
