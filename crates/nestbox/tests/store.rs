//! The content-addressed image store through the CLI: import of every supported
//! format (root filesystems built here from Debian's busybox-static, the host's
//! /usr, OCI layouts and docker-save archives written by the test), boxes of store
//! images sharing inodes, commit, export, df/verify/gc, dedup, bad input and
//! crash safety.

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{assert_error, TestRoot};
use serde_json::Value;

/// Where Debian's busybox-static puts its binary.
const BUSYBOX: &str = "/bin/busybox";
/// Applets the test root filesystem links to busybox.
const APPLETS: &[&str] = &[
    "sh",
    "cat",
    "ls",
    "stat",
    "echo",
    "touch",
    "sleep",
    "mkdir",
    "rm",
    "grep",
    "head",
    "chmod",
    "cp",
    "mv",
    "true",
    "sha256sum",
    "wc",
];
const HELLO: &str = "hello from the image\n";

fn busybox_present(test: &str) -> bool {
    nestbox_testkit::require(
        Path::new(BUSYBOX).is_file(),
        test,
        &format!("{BUSYBOX} missing (scripts/setup.sh installs busybox-static)"),
    )
}

/// A minimal root filesystem: busybox, its applets, /etc/hello, /tmp.
fn busybox_rootfs(dir: &Path) {
    fs::create_dir_all(dir.join("bin")).unwrap();
    fs::create_dir_all(dir.join("etc")).unwrap();
    fs::create_dir_all(dir.join("tmp")).unwrap();
    fs::set_permissions(dir.join("tmp"), fs::Permissions::from_mode(0o1777)).unwrap();
    fs::copy(BUSYBOX, dir.join("bin/busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    fs::write(dir.join("etc/hello"), HELLO).unwrap();
}

fn store_dir(root: &TestRoot) -> PathBuf {
    root.path().join("lib/images/store")
}

/// Every path under the store (but its lock file), to prove it unchanged.
fn snapshot(root: &TestRoot) -> BTreeSet<String> {
    let base = store_dir(root);
    let mut out = BTreeSet::new();
    let mut stack = vec![base.clone()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let rel = p.strip_prefix(&base).unwrap().to_string_lossy().to_string();
            if rel == "lock" {
                continue;
            }
            if e.file_type().unwrap().is_dir() {
                stack.push(p.clone());
            }
            out.insert(rel);
        }
    }
    out
}

fn json(out: &str) -> Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON: {e}: {out}"))
}

fn inspect_image(root: &TestRoot, name: &str) -> Value {
    json(&root.ok(&["image", "inspect", name]))
}

fn image_names(root: &TestRoot) -> Vec<String> {
    json(&root.ok(&["image", "ls", "--json"]))
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect()
}

#[track_caller]
fn assert_verify_clean(root: &TestRoot) {
    let out = root.run(&["store", "verify", "--json"]);
    assert_eq!(out.code, 0, "store verify found problems\n{out}");
    let v = json(&out.stdout);
    assert_eq!(v["problems"].as_array().unwrap().len(), 0, "{out}");
}

/// A tar archive builder for the test's archives.
struct TarFile {
    b: tar::Builder<Vec<u8>>,
}

impl TarFile {
    fn new() -> Self {
        TarFile {
            b: tar::Builder::new(Vec::new()),
        }
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(size);
        h
    }

    fn dir(mut self, path: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Directory, 0o755, 0);
        self.b.append_data(&mut h, path, std::io::empty()).unwrap();
        self
    }

    fn file(mut self, path: &str, data: &[u8]) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, 0o644, data.len() as u64);
        self.b.append_data(&mut h, path, data).unwrap();
        self
    }

    fn exe(mut self, path: &str, data: &[u8]) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, 0o755, data.len() as u64);
        self.b.append_data(&mut h, path, data).unwrap();
        self
    }

    fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    fn hardlink(mut self, path: &str, target: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Link, 0o644, 0);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    /// An entry whose name is written raw into the header (the tar crate refuses
    /// to write `..` or absolute names through its safe API).
    fn raw(mut self, kind: tar::EntryType, name: &str, link: &str, data: &[u8]) -> Self {
        let mut h = Self::header(kind, 0o644, data.len() as u64);
        {
            let gnu = h.as_gnu_mut().unwrap();
            gnu.name[..name.len()].copy_from_slice(name.as_bytes());
            gnu.linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }

    fn device(mut self, path: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Char, 0o666, 0);
        h.set_device_major(1).unwrap();
        h.set_device_minor(3).unwrap();
        self.b.append_data(&mut h, path, std::io::empty()).unwrap();
        self
    }

    /// The busybox binary with applet links, /etc/hello and /tmp.
    fn busybox(mut self) -> Self {
        let bb = fs::read(BUSYBOX).unwrap();
        self = self
            .dir("bin")
            .exe("bin/busybox", &bb)
            .dir("etc")
            .dir("tmp");
        for a in APPLETS {
            self = self.symlink(&format!("bin/{a}"), "busybox");
        }
        self.file("etc/hello", HELLO.as_bytes())
    }

    fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(data, 1).unwrap()
}

fn sha256_hex(data: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The two layers of the layered-image tests: busybox and files, then a layer that
/// deletes /etc/a (whiteout), makes /opt opaque, and adds /opt/z and /etc/c.
fn layers() -> (Vec<u8>, Vec<u8>) {
    let l1 = TarFile::new()
        .busybox()
        .file("etc/a", b"a\n")
        .file("etc/b", b"b\n")
        .dir("opt")
        .file("opt/x", b"x\n")
        .dir("opt/sub")
        .file("opt/sub/y", b"y\n")
        .finish();
    let l2 = TarFile::new()
        .dir("etc")
        .file("etc/.wh.a", b"")
        .file("etc/c", b"c\n")
        .dir("opt")
        .file("opt/.wh..wh..opq", b"")
        .file("opt/z", b"z\n")
        .finish();
    (l1, l2)
}

/// Write an OCI image layout for `layers` (already encoded) into `dir`.
fn write_oci_layout(dir: &Path, layers: &[(Vec<u8>, &str)]) {
    let blobs = dir.join("blobs/sha256");
    fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> String {
        let h = sha256_hex(data);
        fs::write(blobs.join(&h), data).unwrap();
        h
    };
    let config =
        put(br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#);
    let descs: Vec<Value> = layers
        .iter()
        .map(|(data, media)| {
            serde_json::json!({"mediaType": media, "digest": format!("sha256:{}", put(data)), "size": data.len()})
        })
        .collect();
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{config}"), "size": 10},
        "layers": descs,
    }))
    .unwrap();
    let mh = put(&manifest);
    fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": format!("sha256:{mh}"), "size": manifest.len(),
                           "platform": {"architecture": "amd64", "os": "linux"}}],
        }))
        .unwrap(),
    )
    .unwrap();
}

/// A tar of the directory tree `dir` (plain files and directories).
fn tar_of_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.append_dir_all(".", dir).unwrap();
    b.into_inner().unwrap()
}

/// What the layered image must look like inside a box.
/// (Only the image's own names are listed: the runtime may add mount points such
/// as /etc/hosts.)
const LAYERED_CHECK: &str = "cat /etc/hello; for f in a b c; do test -e /etc/$f && echo $f; done; \
     echo --; ls /opt; test -e /opt/sub && echo LEAK; true";
const LAYERED_EXPECT: &str = "hello from the image\nb\nc\n--\nz\n";

#[test]
fn busybox_rootfs_imports_from_dir_and_archives_and_runs() {
    let test = "busybox_rootfs_imports_from_dir_and_archives_and_runs";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if !busybox_present(test) {
        return;
    }
    let src = tempfile::tempdir().unwrap();
    let rootfs = src.path().join("rootfs");
    busybox_rootfs(&rootfs);
    let out = root.ok(&["image", "import", rootfs.to_str().unwrap(), "--name", "bb"]);
    assert!(out.starts_with("bb "), "{out}");
    let out = root.sh(&["--rm", "--image", "bb"], "cat /etc/hello; echo $0");
    assert_eq!(out.clone().ok().stdout, format!("{HELLO}sh\n"), "{out}");

    // The same tree as tar, tar.gz and tar.zst archives.
    let plain = TarFile::new().busybox().finish();
    for (name, data) in [
        ("bb-tar", plain.clone()),
        ("bb-gz", gzip(&plain)),
        ("bb-zst", zstd(&plain)),
    ] {
        let f = src.path().join(format!("{name}.archive"));
        fs::write(&f, &data).unwrap();
        root.ok(&["image", "import", "-q", f.to_str().unwrap(), "--name", name]);
        let out = root.sh(&["--rm", "--image", name], "cat /etc/hello");
        assert_eq!(out.clone().ok().stdout, HELLO, "{name}: {out}");
    }
    // Three archive imports of one tree: one image id, and busybox stored once.
    let ids: BTreeSet<String> = ["bb-tar", "bb-gz", "bb-zst"]
        .iter()
        .map(|n| inspect_image(&root, n)["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ids.len(),
        1,
        "same content and metadata give the same image id"
    );
    let names = image_names(&root);
    assert_eq!(names, vec!["bb", "bb-gz", "bb-tar", "bb-zst"]);
    let text = root.ok(&["image", "ls"]);
    assert!(text.contains("bb-zst"), "{text}");
    assert_verify_clean(&root);
}

#[test]
fn boxes_of_one_image_share_inodes_and_writes_stay_private() {
    let test = "boxes_of_one_image_share_inodes_and_writes_stay_private";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if !busybox_present(test) {
        return;
    }
    let src = tempfile::tempdir().unwrap();
    busybox_rootfs(src.path());
    root.ok(&[
        "image",
        "import",
        src.path().to_str().unwrap(),
        "--name",
        "bb",
    ]);
    let tree = PathBuf::from(inspect_image(&root, "bb")["tree"].as_str().unwrap());
    let host = fs::metadata(tree.join("bin/busybox")).unwrap();
    assert!(
        host.nlink() >= 2,
        "the tree file is a hardlink of the store object"
    );

    // stat() in an overlay reports the overlay's own st_dev, but (all layers on one
    // filesystem) the real st_ino; /proc/self/maps shows the inode of the file the
    // process maps. Both must be the store object's inode, in every box.
    let script = "stat -c '%i %d' /bin/busybox; grep -m1 /bin/busybox /proc/self/maps";
    for _ in 0..2 {
        let out = root.sh(&["--rm", "--image", "bb"], script).ok();
        let lines = out.lines();
        let mut stat = lines[0].split_whitespace();
        let ino: u64 = stat.next().unwrap().parse().unwrap();
        let maps: Vec<&str> = lines[1].split_whitespace().collect();
        let map_ino: u64 = maps[4].parse().unwrap();
        assert_eq!(ino, host.ino(), "st_ino in the box is the object's\n{out}");
        assert_eq!(map_ino, host.ino(), "the mapped file is the object\n{out}");
    }

    // A write in one box is private to it.
    let out = root.sh(
        &["--name", "writer", "--image", "bb"],
        "echo changed > /etc/hello; echo new > /etc/new; cat /etc/hello",
    );
    assert_eq!(out.ok().stdout, "changed\n");
    let out = root.sh(
        &["--rm", "--image", "bb"],
        "cat /etc/hello; test -e /etc/new && echo LEAK; true",
    );
    assert_eq!(out.ok().stdout, HELLO);
    assert_eq!(fs::read_to_string(tree.join("etc/hello")).unwrap(), HELLO);
    assert_verify_clean(&root);

    // Before they write, boxes add nothing but their (empty) layer directories.
    let df = json(&root.ok(&["store", "df", "--json"]));
    assert_eq!(df["images"], 1);
    assert!(df["layer_files"].as_u64().unwrap() >= 2, "{df}");
    assert!(df["sharing_ratio"].as_f64().unwrap() > 0.0, "{df}");

    // The image is in use: it cannot be removed while the box exists.
    let out = root.run(&["image", "rm", "bb"]);
    assert_error(&out, 125, "used by box \"writer\"");
    assert_eq!(image_names(&root), vec!["bb"]);
    root.ok(&["rm", "writer"]);
    root.ok(&["image", "rm", "bb"]);
    assert!(image_names(&root).is_empty());
    let gc = json(&root.ok(&["store", "gc", "--json"]));
    assert!(gc["objects_removed"].as_u64().unwrap() >= 2, "{gc}");
    assert!(!tree.exists(), "the tree goes with the image");
    let left: Vec<String> = snapshot(&root)
        .into_iter()
        .filter(|p| p.starts_with("objects/") && p.contains('.'))
        .collect();
    assert!(left.is_empty(), "gc left objects: {left:?}");
}

#[test]
fn commit_round_trip_and_export() {
    let test = "commit_round_trip_and_export";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if !busybox_present(test) {
        return;
    }
    let src = tempfile::tempdir().unwrap();
    busybox_rootfs(src.path());
    root.ok(&[
        "image",
        "import",
        src.path().to_str().unwrap(),
        "--name",
        "base",
    ]);
    let base = inspect_image(&root, "base");
    let out = root.sh(
        &["--name", "work", "--image", "base"],
        "rm /etc/hello && mkdir -p /srv/data && echo payload > /srv/data/file && chmod 600 /srv/data/file && echo ok",
    );
    assert_eq!(out.ok().stdout, "ok\n");
    let out = root.ok(&["commit", "work", "snap"]);
    // Only the changed file's content is new (besides it, only empty mount-point
    // files the runtime may create in the layer, such as /etc/hosts).
    assert!(out.contains(", 8 B stored)"), "{out}");
    let snap = inspect_image(&root, "snap");
    assert_ne!(snap["id"], base["id"]);
    assert!(
        snap["files"].as_u64().unwrap() >= 2,
        "busybox and /srv/data/file: {snap}"
    );
    let out = root.sh(
        &["--rm", "--image", "snap"],
        "test -e /etc/hello && echo LEAK; cat /srv/data/file; stat -c %a /srv/data/file",
    );
    assert_eq!(out.ok().stdout, "payload\n600\n");

    // export → import gives back exactly the same image (same manifest id).
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("snap.tar");
    root.ok(&["image", "export", "snap", archive.to_str().unwrap()]);
    root.ok(&[
        "image",
        "import",
        archive.to_str().unwrap(),
        "--name",
        "again",
    ]);
    assert_eq!(inspect_image(&root, "again")["id"], snap["id"]);

    // Commit of a box of the host image is refused with a clear error.
    root.sh(&["--name", "hostbox"], "true").ok();
    let out = root.run(&["commit", "hostbox", "x"]);
    assert_error(&out, 125, "host image");
    let out = root.run(&["commit", "nosuchbox", "x"]);
    assert_eq!(out.code, 125, "{out}");
    assert_verify_clean(&root);
}

#[test]
fn oci_layouts_and_docker_save_archives_honour_whiteouts() {
    let test = "oci_layouts_and_docker_save_archives_honour_whiteouts";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if !busybox_present(test) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (l1, l2) = layers();

    // OCI layout directory: first layer zstd, second gzip.
    let oci = dir.path().join("oci");
    write_oci_layout(
        &oci,
        &[
            (zstd(&l1), "application/vnd.oci.image.layer.v1.tar+zstd"),
            (gzip(&l2), "application/vnd.oci.image.layer.v1.tar+gzip"),
        ],
    );
    // The same layout as an archive.
    let oci_tar = dir.path().join("oci.tar");
    fs::write(&oci_tar, tar_of_dir(&oci)).unwrap();
    // docker save: manifest.json + one directory per layer (plain tars).
    let docker = dir.path().join("docker");
    fs::create_dir_all(docker.join("l1")).unwrap();
    fs::create_dir_all(docker.join("l2")).unwrap();
    fs::write(docker.join("l1/layer.tar"), &l1).unwrap();
    fs::write(docker.join("l2/layer.tar"), &l2).unwrap();
    fs::write(docker.join("cfg.json"), b"{}").unwrap();
    fs::write(
        docker.join("manifest.json"),
        br#"[{"Config":"cfg.json","RepoTags":["t:latest"],"Layers":["l1/layer.tar","l2/layer.tar"]}]"#,
    )
    .unwrap();
    let docker_tar = dir.path().join("docker.tar");
    fs::write(&docker_tar, tar_of_dir(&docker)).unwrap();
    let docker_tgz = dir.path().join("docker.tar.gz");
    fs::write(&docker_tgz, gzip(&tar_of_dir(&docker))).unwrap();

    for (name, path, format) in [
        ("oci-dir", &oci, "OCI image layout"),
        ("oci-tar", &oci_tar, "OCI image archive"),
        ("docker-tar", &docker_tar, "docker save archive"),
        ("docker-tgz", &docker_tgz, "docker save archive"),
        ("docker-dir", &docker, "docker save directory"),
    ] {
        let out = root.ok(&["image", "import", path.to_str().unwrap(), "--name", name]);
        assert!(out.contains(format), "{name}: {out}");
        let out = root.sh(&["--rm", "--image", name], LAYERED_CHECK);
        assert_eq!(out.clone().ok().stdout, LAYERED_EXPECT, "{name}: {out}");
    }
    // All five are the same image.
    let ids: BTreeSet<String> = [
        "oci-dir",
        "oci-tar",
        "docker-tar",
        "docker-tgz",
        "docker-dir",
    ]
    .iter()
    .map(|n| inspect_image(&root, n)["id"].as_str().unwrap().to_string())
    .collect();
    assert_eq!(ids.len(), 1);

    // A layer blob that does not match its digest is corrupt input.
    let blobs = oci.join("blobs/sha256");
    let victim = fs::read_dir(&blobs)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .max_by_key(|p| fs::metadata(p).unwrap().len())
        .unwrap();
    let mut data = fs::read(&victim).unwrap();
    let mid = data.len() / 2;
    data[mid] ^= 0xff;
    fs::write(&victim, &data).unwrap();
    let before = snapshot(&root);
    let out = root.run(&["image", "import", oci.to_str().unwrap(), "--name", "broken"]);
    assert_error(&out, 125, "corrupt");
    assert_eq!(
        snapshot(&root),
        before,
        "a failed import leaves the store unchanged"
    );
    assert_verify_clean(&root);
}

#[test]
fn dedup_merges_identical_files_of_exited_boxes_only() {
    let test = "dedup_merges_identical_files_of_exited_boxes_only";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    if !busybox_present(test) {
        return;
    }
    let src = tempfile::tempdir().unwrap();
    busybox_rootfs(src.path());
    root.ok(&[
        "image",
        "import",
        src.path().to_str().unwrap(),
        "--name",
        "bb",
    ]);
    // Same content and same mtime (as a package manager leaves them) in two
    // boxes; a same-content file with its own mtime; a file unique to each; a
    // copy of busybox (already an object with the same metadata? no: other mtime).
    let script = |tag: &str| {
        format!(
            "i=0; while [ $i -lt 2000 ]; do echo shared-line-$i; i=$((i+1)); done > /tmp/shared; \
             touch -d '2024-01-02 03:04:05' /tmp/shared; \
             cp /tmp/shared /tmp/othertime; \
             i=0; while [ $i -lt 2000 ]; do echo {tag}-line-$i; i=$((i+1)); done > /tmp/unique; \
             sha256sum /tmp/shared"
        )
    };
    let a = root
        .sh(&["--name", "a", "--image", "bb"], &script("a"))
        .ok()
        .stdout;
    let b = root
        .sh(&["--name", "b", "--image", "bb"], &script("b"))
        .ok()
        .stdout;
    assert_eq!(a, b);
    // A running box with the same file: it must be left alone.
    root.detached_sh(
        "live",
        &["--image", "bb"],
        &format!("{}; echo ready; sleep 600", script("live")),
    );
    root.wait_log("live", "ready", Duration::from_secs(30));

    let upper = |name: &str| -> PathBuf {
        let v = root.inspect(name);
        let id = v["id"].as_str().unwrap().to_string();
        root.path().join("lib/boxes").join(id).join("upper-0/tmp")
    };
    let (ua, ub, ul) = (upper("a"), upper("b"), upper("live"));
    let ino = |p: &Path| fs::metadata(p).unwrap().ino();
    let before: Vec<Vec<u8>> = [&ua, &ub]
        .iter()
        .flat_map(|u| ["shared", "othertime", "unique"].map(|f| fs::read(u.join(f)).unwrap()))
        .collect();

    let dry = json(&root.ok(&["dedup", "--dry-run", "--json"]));
    assert_eq!(dry["dry_run"], true);
    assert!(dry["merged_files"].as_u64().unwrap() >= 1, "{dry}");
    assert_ne!(
        ino(&ua.join("shared")),
        ino(&ub.join("shared")),
        "dry run changes nothing"
    );

    let out = root.ok(&["dedup", "--samples", "1k,8k"]);
    assert!(out.contains("skipped 1 boxes"), "{out}");
    assert!(out.contains("live: running"), "{out}");
    assert!(
        out.contains("sample 1024") && out.contains("sample 8192"),
        "{out}"
    );
    // Identical content and metadata: one inode, which is a store object.
    assert_eq!(ino(&ua.join("shared")), ino(&ub.join("shared")));
    assert!(fs::metadata(ua.join("shared")).unwrap().nlink() >= 3);
    // Same content, other mtime: what the boxes see must not change, so kept apart.
    assert_ne!(ino(&ua.join("othertime")), ino(&ub.join("othertime")));
    assert_ne!(ino(&ua.join("unique")), ino(&ub.join("unique")));
    // The running box's layer was not touched.
    assert_eq!(fs::metadata(ul.join("shared")).unwrap().nlink(), 1);
    let after: Vec<Vec<u8>> = [&ua, &ub]
        .iter()
        .flat_map(|u| ["shared", "othertime", "unique"].map(|f| fs::read(u.join(f)).unwrap()))
        .collect();
    assert_eq!(before, after, "contents stay byte-identical");

    // A second run finds nothing new; the JSON report has the per-level figures.
    let again = json(&root.ok(&["dedup", "--json"]));
    assert_eq!(again["merged_files"], 0, "{again}");
    let levels = again["levels"].as_array().unwrap();
    let names: Vec<&str> = levels
        .iter()
        .map(|l| l["level"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        vec!["size", "sample 4096", "sample 65536", "full", "compare"]
    );
    assert_eq!(again["skipped_boxes"][0]["name"], "live");
    assert!(again["metadata_differs"].as_u64().unwrap() >= 2, "{again}");

    // Commit after dedup still sees the right content; the store stays sound.
    root.ok(&["commit", "a", "a-snap"]);
    let out = root.sh(&["--rm", "--image", "a-snap"], "sha256sum /tmp/shared");
    assert_eq!(out.ok().stdout, a);
    assert_verify_clean(&root);
    // Objects a box layer still links survive gc.
    root.ok(&["store", "gc"]);
    assert_eq!(fs::read(ub.join("shared")).unwrap(), before[0]);
    assert_verify_clean(&root);
    root.ok(&["rm", "-f", "live"]);
}

#[test]
fn bad_input_is_refused_with_one_line_and_store_unchanged() {
    let test = "bad_input_is_refused_with_one_line_and_store_unchanged";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let good = TarFile::new().dir("etc").file("etc/x", b"x").finish();
    let good_path = dir.path().join("good.tar");
    fs::write(&good_path, &good).unwrap();
    root.ok(&[
        "image",
        "import",
        good_path.to_str().unwrap(),
        "--name",
        "good",
    ]);
    use tar::EntryType as T;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "dotdot",
            TarFile::new()
                .file("ok", b"1")
                .raw(T::Regular, "a/../../evil", "", b"x")
                .finish(),
            "\"..\"",
        ),
        (
            "absolute",
            TarFile::new()
                .raw(T::Regular, "/etc/passwd", "", b"x")
                .finish(),
            "absolute path",
        ),
        (
            "symlink-escape",
            TarFile::new()
                .dir("a")
                .symlink("a/up", "../../../etc/shadow")
                .finish(),
            "climbs above the image root",
        ),
        (
            "hardlink-escape",
            TarFile::new()
                .raw(T::Link, "h", "../../etc/passwd", b"")
                .finish(),
            "hardlink target",
        ),
        (
            "hardlink-missing",
            TarFile::new().hardlink("h", "nowhere").finish(),
            "does not exist",
        ),
        (
            "through-symlink",
            TarFile::new()
                .symlink("etc", "/tmp")
                .file("etc/evil", b"x")
                .finish(),
            "not a directory",
        ),
        (
            "device",
            TarFile::new().dir("dev").device("dev/null").finish(),
            "--allow-devices",
        ),
        ("truncated", good[..good.len() - 1024].to_vec(), "truncated"),
        (
            "truncated-data",
            {
                let t = TarFile::new().file("big", &[7u8; 5000]).finish();
                t[..1500].to_vec()
            },
            "corrupt",
        ),
        (
            "bad-gzip",
            {
                let mut g = gzip(&good);
                let n = g.len();
                g.truncate(n / 2);
                g
            },
            "corrupt",
        ),
        (
            "unknown",
            b"this is not an archive at all".repeat(40),
            "unknown format",
        ),
    ];
    let before = snapshot(&root);
    for (name, data, fragment) in &cases {
        let f = dir.path().join(format!("{name}.tar"));
        fs::write(&f, data).unwrap();
        let out = root.run(&["image", "import", f.to_str().unwrap(), "--name", name]);
        assert_error(&out, 125, fragment);
        assert_eq!(
            snapshot(&root),
            before,
            "{name}: the store must be unchanged"
        );
    }
    // Device nodes are accepted with --allow-devices (as root).
    let f = dir.path().join("device.tar");
    root.ok(&[
        "image",
        "import",
        f.to_str().unwrap(),
        "--name",
        "dev",
        "--allow-devices",
    ]);
    let before = snapshot(&root);
    for (args, fragment) in [
        (
            vec![
                "image",
                "import",
                good_path.to_str().unwrap(),
                "--name",
                "good",
            ],
            "already in use",
        ),
        (
            vec![
                "image",
                "import",
                good_path.to_str().unwrap(),
                "--name",
                "host",
            ],
            "built-in host image",
        ),
        (
            vec![
                "image",
                "import",
                good_path.to_str().unwrap(),
                "--name",
                "a/b",
            ],
            "invalid image name",
        ),
        (
            vec!["image", "import", "/nonexistent/x.tar", "--name", "n"],
            "/nonexistent/x.tar",
        ),
        (vec!["image", "inspect", "nope"], "\"nope\" not found"),
        (
            vec!["image", "export", "nope", "/tmp/x.tar"],
            "\"nope\" not found",
        ),
        (
            vec!["run", "--rm", "--image", "nope", "--", "true"],
            "\"nope\" not found",
        ),
    ] {
        let out = root.run(&args);
        assert_error(&out, 125, fragment);
        assert_eq!(
            snapshot(&root),
            before,
            "{args:?}: the store must be unchanged"
        );
    }
    assert_verify_clean(&root);

    // A corrupted object is reported by verify, with a non-zero exit.
    let objects: Vec<PathBuf> = snapshot(&root)
        .into_iter()
        .filter(|p| p.starts_with("objects/") && p.len() > 20)
        .map(|p| store_dir(&root).join(p))
        .collect();
    let victim = objects
        .iter()
        .find(|p| fs::read(p).map(|d| d == b"x").unwrap_or(false))
        .expect("the object of etc/x");
    let mut f = fs::OpenOptions::new().write(true).open(victim).unwrap();
    f.write_all(b"y").unwrap();
    drop(f);
    let out = root.run(&["store", "verify"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(out.stdout.contains("corrupt"), "{out}");
}

#[test]
fn kill_during_import_leaves_no_partial_image() {
    let test = "kill_during_import_leaves_no_partial_image";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    // A tree of a few hundred MB: the host's libraries.
    let src = Path::new("/usr/lib/x86_64-linux-gnu");
    if !nestbox_testkit::require(src.is_dir(), test, &format!("no {}", src.display())) {
        return;
    }
    for delay_ms in [30u64, 300, 900, 1800] {
        let child = root
            .command(&[
                "image",
                "import",
                "-q",
                src.to_str().unwrap(),
                "--name",
                "libs",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        // SAFETY: kill(2) on the pid of our own child, which has not been waited for.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        let out = common::finish(child, None, Duration::from_secs(60), "import".into());
        let names = image_names(&root);
        if names.is_empty() {
            assert_ne!(out.code, 0, "an import that succeeded left no image");
        } else {
            // Finished (name created) before the kill landed: a whole image.
            assert_eq!(names, vec!["libs"], "killed after {delay_ms} ms");
            assert_verify_clean(&root);
            root.ok(&["image", "rm", "libs"]);
        }
        assert_verify_clean(&root);
    }
    // gc reclaims what the killed imports left (staging areas, objects, trees).
    root.ok(&["store", "gc"]);
    let left: Vec<String> = snapshot(&root)
        .into_iter()
        .filter(|p| p.starts_with("tmp/") || p.starts_with("trees/") || p.contains('.'))
        .collect();
    assert!(left.is_empty(), "after gc: {left:?}");
    root.ok(&[
        "image",
        "import",
        "-q",
        src.to_str().unwrap(),
        "--name",
        "libs",
    ]);
    assert_verify_clean(&root);
}

#[test]
fn host_usr_imports_as_a_large_image_and_boxes_share_libc() {
    let test = "host_usr_imports_as_a_large_image_and_boxes_share_libc";
    let Some(root) = TestRoot::new(test) else {
        return;
    };
    let out = root.run_timeout(
        &["image", "import", "-q", "/usr", "--name", "usr"],
        Duration::from_secs(600),
    );
    assert_eq!(out.code, 0, "{out}");
    let img = inspect_image(&root, "usr");
    assert!(img["files"].as_u64().unwrap() > 10_000, "{img}");
    let tree = PathBuf::from(img["tree"].as_str().unwrap());
    // The image root is /usr: its bin, lib and lib64 are the box's /bin, /lib, /lib64.
    let mut inos = BTreeSet::new();
    let mut libc_path = String::new();
    for _ in 0..2 {
        let out = root
            .run(&[
                "run",
                "--rm",
                "--image",
                "usr",
                "--",
                "/bin/cat",
                "/proc/self/maps",
            ])
            .ok();
        let line = out
            .lines()
            .into_iter()
            .find(|l| l.contains("libc.so"))
            .unwrap_or_else(|| panic!("libc is not mapped\n{out}"))
            .to_string();
        let f: Vec<&str> = line.split_whitespace().collect();
        inos.insert(f[4].parse::<u64>().unwrap());
        libc_path = f[5].to_string();
    }
    assert_eq!(inos.len(), 1, "both boxes map one libc inode");
    let host_ino = fs::metadata(tree.join(libc_path.trim_start_matches('/')))
        .unwrap()
        .ino();
    assert_eq!(
        inos.into_iter().next().unwrap(),
        host_ino,
        "the store object"
    );
    let df = json(&root.ok(&["store", "df", "--json"]));
    assert!(
        df["image_logical_bytes"].as_u64().unwrap() > 100 << 20,
        "{df}"
    );
    root.run_timeout(&["image", "rm", "usr"], Duration::from_secs(600))
        .ok();
    root.run_timeout(&["store", "gc"], Duration::from_secs(600))
        .ok();
}
