//! Finding box cgroups left behind by boxes that no longer exist, for
//! garbage collection.

use std::collections::BTreeMap;
use std::fs;

use crate::boxcg::{validate_id, BoxCgroup, CgroupDir, DIR_PREFIX};
use crate::detect::{Hierarchies, Version};
use crate::v2;

/// v1 controllers a box uses (the hierarchies worth scanning).
const V1_USED: &[&str] = &[
    "cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
];

/// Lists the `nestbox-<id>` directories directly under the invoking
/// process's cgroup, in every hierarchy, whose id `live_ids` says is not
/// live. Directories of one id across hierarchies are grouped into one
/// [`BoxCgroup`]; the result is sorted by id. Unreadable directories are
/// skipped. Call [`BoxCgroup::kill_all`] and [`BoxCgroup::remove`] on them.
pub fn find_stale(h: &Hierarchies, live_ids: &dyn Fn(&str) -> bool) -> Vec<BoxCgroup> {
    let mut found: BTreeMap<String, Vec<CgroupDir>> = BTreeMap::new();
    for hier in h.hierarchies() {
        let controllers: Vec<String> = match hier.version() {
            Version::V1 => hier
                .controllers()
                .iter()
                .filter(|c| V1_USED.contains(&c.as_str()))
                .cloned()
                .collect(),
            Version::V2 => {
                let enabled =
                    fs::read_to_string(hier.invoking_dir().join("cgroup.subtree_control"))
                        .unwrap_or_default();
                enabled
                    .split_whitespace()
                    .map(|c| c.trim_start_matches('+'))
                    .filter(|c| v2::CONTROLLERS.contains(c))
                    .map(str::to_string)
                    .collect()
            }
        };
        if hier.version() == Version::V1 && controllers.is_empty() {
            continue;
        }
        let Ok(entries) = fs::read_dir(hier.invoking_dir()) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_prefix(DIR_PREFIX)) else {
                continue;
            };
            if validate_id(id).is_err() || live_ids(id) {
                continue;
            }
            found.entry(id.to_string()).or_default().push(CgroupDir {
                version: hier.version(),
                controllers: controllers.clone(),
                path: entry.path(),
            });
        }
    }
    found
        .into_iter()
        .filter_map(|(id, dirs)| BoxCgroup::from_dirs(&id, dirs).ok())
        .collect()
}
