//! A nestbox template for the tests of containers forked from one
//! (`nestbox.template`): a private nestbox root (removed with every box in
//! it) holding a frozen box whose process (Python, from the host image) counts in a variable and
//! writes each value to `/count`. It is made with the `nestbox` binary built
//! next to `nestbox-runc` (`cargo build -p nestbox`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Out;

/// The `nestbox` binary next to the `nestbox-runc` under test.
pub fn nestbox_bin() -> PathBuf {
    Path::new(super::RUNC).with_file_name("nestbox")
}

/// A private nestbox root holding one template, removed on drop.
pub struct Template {
    dir: tempfile::TempDir,
}

impl Template {
    /// The nestbox root.
    pub fn root(&self) -> &str {
        self.dir.path().to_str().unwrap()
    }

    /// Run `nestbox --root ROOT args...`.
    pub fn nestbox(&self, args: &[&str]) -> Out {
        let mut full = vec!["--root", self.root()];
        full.extend_from_slice(args);
        super::run(nestbox_bin().to_str().unwrap(), &full, None)
    }

    /// Box names of the root.
    pub fn boxes(&self) -> Vec<String> {
        let out = self.nestbox(&["ps", "--all", "--json"]).ok();
        let v: serde_json::Value =
            serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("ls: {e}: {}", out.stdout));
        v.as_array()
            .unwrap()
            .iter()
            .map(|b| b["name"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for Template {
    fn drop(&mut self) {
        if let Ok(boxes) = std::panic::catch_unwind(|| self.boxes()) {
            for b in boxes {
                let _ = self.nestbox(&["rm", "-f", &b]);
            }
        }
        let _ = self.nestbox(&["gc"]);
    }
}

/// The template's program: it counts in a variable and writes each value to
/// `/count` (renamed into place, so a reader never sees a partial number),
/// 100 times a second, and prints `count N` on its standard output every
/// tenth step. It forks nothing: a template's process tree is then one
/// process, whatever the moment it is frozen.
const COUNTER: &str = "import os, sys, time
i = 0
while True:
    i += 1
    with open('/count.tmp', 'w') as f:
        f.write(str(i))
    os.rename('/count.tmp', '/count')
    if i % 10 == 0:
        try:
            print('count', i, flush=True)
        except OSError:
            pass
    time.sleep(0.01)
";

/// A frozen template named `tpl` whose process counts in variable `i` and
/// writes each value to `/count`; its last value before the freeze.
pub fn counting_template() -> (Template, u64) {
    let t = Template {
        dir: tempfile::Builder::new()
            .prefix("nestbox-test-oci-clone-")
            .tempdir()
            .unwrap(),
    };
    t.nestbox(&[
        "run",
        "-d",
        "--name",
        "tpl",
        "--network",
        "none",
        "--",
        "python3",
        "-c",
        COUNTER,
    ])
    .ok();
    let pid = template_pid(&t);
    let count = |pid: i64| read_count(pid);
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(pid).unwrap_or(0) < 20 {
        assert!(
            Instant::now() < deadline,
            "the template never counted to 20"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    t.nestbox(&["freeze", "tpl"]).ok();
    let frozen = count(pid).expect("the template's count");
    assert!(frozen >= 20);
    (t, frozen)
}

/// Host pid of the template box's process.
pub fn template_pid(t: &Template) -> i64 {
    let v: serde_json::Value =
        serde_json::from_str(&t.nestbox(&["ps", "--all", "--json"]).ok().stdout).unwrap();
    let init = v
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "tpl")
        .and_then(|b| b["pid"].as_i64())
        .unwrap_or_else(|| panic!("no init pid of tpl in {v}"));
    // The command's pid: init's only child.
    let children =
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap_or_default();
    children
        .split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("init {init} has no child"))
        .parse()
        .unwrap()
}

/// The number in `/count` of the root of process `pid`.
pub fn read_count(pid: i64) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/root/count"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether the `nestbox` binary is there; under CI its absence is a failure.
pub fn nestbox_present(test: &str) -> bool {
    nestbox_testkit::require(
        nestbox_bin().is_file(),
        test,
        "needs the nestbox binary next to nestbox-runc (cargo build -p nestbox)",
    )
}
