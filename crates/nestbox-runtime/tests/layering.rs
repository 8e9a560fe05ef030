//! The runtime's layers import one way (see `docs/architecture.md`): api (and store_ops) →
//! templates → lifecycle → network → records. This test reads every source file
//! and fails when a module names one of a higher layer, by its path or by the
//! old path re-exported at the crate root.

use std::path::{Path, PathBuf};

/// The layers from the bottom up, each with the module paths (after `crate::`)
/// that name it.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "records",
        &[
            "error",
            "copy",
            "diag",
            "disk",
            "paths",
            "phases",
            "size",
            "snapshots",
            "spec",
            "state",
            "registry",
            "liveness",
            "process",
        ],
    ),
    ("network", &["network", "network_pool"]),
    (
        "lifecycle",
        &[
            "lifecycle",
            "exec",
            "init",
            "launch",
            "logs",
            "monitor",
            "residency",
            "shell",
            "ops",
        ],
    ),
    (
        "templates",
        &[
            "templates",
            "attach",
            "checkpoint",
            "clone",
            "kept_state",
            "migrate",
            "nscheckpoint",
            "prepared_claim",
            "template",
            "time_travel",
            "working_set",
        ],
    ),
    ("api", &["api", "service", "store_ops", "watchdog"]),
];

/// The layer a source file (relative to `src/`) belongs to.
fn layer_of(rel: &Path) -> Option<usize> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.trim_end_matches(".rs");
    if name == "lib" {
        return None; // the crate root re-exports every layer
    }
    LAYERS.iter().position(|(_, mods)| mods.contains(&name))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module names a file refers to as `crate::NAME`.
fn crate_paths(text: &str) -> Vec<String> {
    text.match_indices("crate::")
        .map(|(i, m)| {
            text[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect::<String>()
        })
        .filter(|n| !n.is_empty())
        .collect()
}

#[test]
fn imports_run_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut wrong = Vec::new();
    let mut placed = 0;
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let Some(own) = layer_of(rel) else {
            continue;
        };
        placed += 1;
        let text = std::fs::read_to_string(file).unwrap();
        for name in crate_paths(&text) {
            let target = LAYERS
                .iter()
                .position(|(_, mods)| mods.contains(&name.as_str()));
            if let Some(t) = target.filter(|t| *t > own) {
                wrong.push(format!(
                    "{} ({}) names crate::{name} ({})",
                    rel.display(),
                    LAYERS[own].0,
                    LAYERS[t].0
                ));
            }
        }
    }
    assert!(
        placed + 1 == files.len(),
        "a source file belongs to no layer"
    );
    assert!(
        wrong.is_empty(),
        "imports against the layering:\n{}",
        wrong.join("\n")
    );
}
