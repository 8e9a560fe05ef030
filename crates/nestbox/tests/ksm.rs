//! Same-page merging, seen from outside: ten `--ksm` boxes that fill 50 MiB
//! each with the same data come to share it once the host's scanner runs
//! (`nestbox ksm --on`), as their `stats` and the host's figures show; a box
//! without `--ksm` holding the same data takes no part; a clone of a `--ksm`
//! box is mergeable too. `serial_`: it runs the host-wide scanner fast for a
//! while (its settings are put back at the end).

mod common;

use std::time::Duration;

use common::*;

const KSM: &str = "/sys/kernel/mm/ksm";
const MIB: u64 = 50;
const PAGES: u64 = MIB * 256;

/// 50 MiB of private anonymous memory, each page holding its own index (so
/// pages are alike across boxes, not within one), then idle.
const FILL: &str = r#"
import mmap, struct, sys, time
n = int(sys.argv[1]) * 256
m = mmap.mmap(-1, n * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(n):
    m[i * 4096:(i + 1) * 4096] = struct.pack('Q', i + 1) * 512
print('ready', flush=True)
while True:
    time.sleep(3600)
"#;

/// The scanner's settings, put back when dropped (also when the test fails).
struct Scanner(Vec<(&'static str, String)>);

impl Scanner {
    fn save() -> Scanner {
        Scanner(
            ["run", "pages_to_scan", "sleep_millisecs"]
                .into_iter()
                .map(|f| (f, std::fs::read_to_string(format!("{KSM}/{f}")).unwrap()))
                .collect(),
        )
    }
}

impl Drop for Scanner {
    fn drop(&mut self) {
        for (f, v) in &self.0 {
            let _ = std::fs::write(format!("{KSM}/{f}"), v.trim());
        }
    }
}

fn merging_pages(root: &TestRoot, name: &str) -> u64 {
    root.stats(name)["ksm"]["merging_pages"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn serial_ten_ksm_boxes_with_the_same_data_share_it() {
    let Some(root) = TestRoot::new("serial_ten_ksm_boxes_with_the_same_data_share_it") else {
        return;
    };
    let _scanner = Scanner::save();
    root.ok(&["ksm", "--off"]);
    let mib = MIB.to_string();
    let names: Vec<String> = (1..=10).map(|i| format!("k{i}")).collect();
    for n in &names {
        root.ok(&[
            "run",
            "-d",
            "--ksm",
            "--network",
            "none",
            "--name",
            n,
            "--",
            "python3",
            "-c",
            FILL,
            &mib,
        ]);
    }
    root.ok(&[
        "run",
        "-d",
        "--network",
        "none",
        "--name",
        "plain",
        "--",
        "python3",
        "-c",
        FILL,
        &mib,
    ]);
    for n in names.iter().map(String::as_str).chain(["plain"]) {
        root.wait_logged(n, "ready", Duration::from_secs(60));
    }
    // Marked, but nothing merged while the scanner is stopped.
    let s = root.stats("k1");
    assert_eq!(s["ksm"]["mergeable_processes"], 1, "{s}");
    assert_eq!(s["ksm"]["merging_pages"], 0, "{s}");
    root.ok(&["ksm", "--on", "--pages-to-scan", "20000", "--sleep-ms", "5"]);
    wait_for(
        "every --ksm box to have its 50 MiB merged",
        Duration::from_secs(120),
        || {
            names
                .iter()
                .all(|n| merging_pages(&root, n) >= PAGES * 95 / 100)
        },
    );
    // The box without --ksm takes no part.
    let s = root.stats("plain");
    assert_eq!(s["ksm"]["mergeable_processes"], 0, "{s}");
    assert_eq!(s["ksm"]["merging_pages"], 0, "{s}");
    // Host-wide: one copy of each page stands for ten (the host's figure also
    // counts any other mergeable memory, so it is at least ours).
    let host: serde_json::Value = serde_json::from_str(&root.ok(&["ksm", "--json"])).unwrap();
    assert_eq!(host["running"], true, "{host}");
    let sharing = host["pages_sharing"].as_u64().unwrap();
    assert!(sharing >= 9 * PAGES * 95 / 100, "{host}");
    let text = root.ok(&["stats", "k1"]);
    assert!(
        text.contains("ksm:") && text.contains("pages merged"),
        "{text}"
    );

    // A clone of a --ksm box is mergeable as its template is.
    root.ok(&["freeze", "k1"]);
    root.ok(&["clone", "k1", "-d", "--name", "k1c"]);
    let pid = root.inspect("k1c")["state"]["clone"]["process"]["pid"]
        .as_i64()
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/ksm_stat")).unwrap();
    assert!(stat.contains("ksm_merge_any: yes"), "{stat}");
    root.rm_all(
        ["k1c", "plain"]
            .into_iter()
            .chain(names.iter().map(String::as_str)),
    );
}

#[test]
fn ksm_settings_out_of_range_are_refused() {
    let Some(root) = TestRoot::new("ksm_settings_out_of_range_are_refused") else {
        return;
    };
    let out = root.run(&["ksm", "--pages-to-scan", "0"]);
    assert_ne!(out.code, 0, "{out}");
    assert!(out.stderr.contains("invalid --pages-to-scan 0"), "{out}");
    let out = root.run(&["ksm", "--sleep-ms", "20000"]);
    assert_ne!(out.code, 0, "{out}");
    assert!(out.stderr.contains("invalid --sleep-ms 20000"), "{out}");
}
