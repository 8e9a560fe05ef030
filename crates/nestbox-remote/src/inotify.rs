//! inotify instances: their watches as fdinfo shows them (`inotify wd:N
//! ino:… sdev:… mask:… f_handle:…`), and the path of each watched file, which
//! the clone watches again.
//!
//! A watch holds an inode, not a path. Its file handle is decoded with
//! `open_by_handle_at` on each mount of the template that shows the watched
//! file's device; the path the kernel shows for the opened file (relative to
//! the template's mount namespace) is kept only if it leads, through
//! `/proc/PID/root`, to that very inode. Where no handle can be decoded
//! (overlayfs, a box's root, decodes none without `nfs_export`), the inode is
//! searched for, breadth first from the mount point, up to 200,000 entries.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::fdinfo::InotifyWatch;
use crate::procfs::proc_path;

/// Parse the `inotify` lines of an inotify fd's fdinfo (of process `pid`) and
/// find the path of each watched file. The watches are sorted by wd.
pub(crate) fn parse_watches(pid: i32, info: &str) -> Result<Vec<InotifyWatch>, String> {
    let mut out = Vec::new();
    let mut mounts = None;
    for line in info.lines().filter(|l| l.starts_with("inotify ")) {
        let value = |key: &str| -> Option<&str> {
            line.split_whitespace()
                .find_map(|t| t.strip_prefix(key)?.strip_prefix(':'))
        };
        let hex = |key: &str| value(key).and_then(|v| u64::from_str_radix(v, 16).ok());
        let bad = || format!("bad inotify line {line:?}");
        let wd = value("wd").and_then(|v| v.parse().ok()).ok_or_else(bad)?;
        let ino = hex("ino").ok_or_else(bad)?;
        let sdev = hex("sdev").ok_or_else(bad)?;
        let mask = hex("mask").ok_or_else(bad)? as u32;
        let handle = match (
            value("fhandle-type").and_then(|v| i32::from_str_radix(v, 16).ok()),
            value("f_handle").and_then(parse_hex_bytes),
        ) {
            (Some(kind), Some(bytes)) => Some((kind, bytes)),
            _ => None,
        };
        let path = handle.and_then(|(kind, bytes)| {
            let mounts = mounts.get_or_insert_with(|| mount_points(pid));
            find_path(pid, mounts, sdev, ino, kind, &bytes)
        });
        out.push(InotifyWatch {
            wd,
            mask,
            ino,
            sdev,
            path,
        });
    }
    out.sort_by_key(|w| w.wd);
    Ok(out)
}

fn parse_hex_bytes(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).ok())
        .collect()
}

/// (device as `major << 20 | minor`, mount point) of every mount of `pid`.
fn mount_points(pid: i32) -> Vec<(u64, String)> {
    let text = std::fs::read_to_string(proc_path(pid, "mountinfo")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let dev = fields.nth(2)?;
            let point = fields.nth(1)?;
            let (major, minor) = dev.split_once(':')?;
            let dev = (major.parse::<u64>().ok()? << 20) | minor.parse::<u64>().ok()?;
            Some((dev, nestbox_sys::mount::unescape_mountinfo(point)))
        })
        .collect()
}

fn find_path(
    pid: i32,
    mounts: &[(u64, String)],
    sdev: u64,
    ino: u64,
    kind: i32,
    handle: &[u8],
) -> Option<String> {
    let root = proc_path(pid, "root");
    for (_, point) in mounts.iter().filter(|(dev, _)| *dev == sdev) {
        let Ok(mount) = std::fs::File::open(root.join(point.trim_start_matches('/'))) else {
            continue;
        };
        let Ok(file) = open_by_handle(&mount, kind, handle) else {
            continue;
        };
        let Ok(path) = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd())) else {
            continue;
        };
        let Some(path) = path.to_str().map(str::to_string) else {
            continue;
        };
        if !path.starts_with('/') {
            continue;
        }
        let seen = Path::new(&root).join(path.trim_start_matches('/'));
        let same = std::fs::symlink_metadata(&seen).is_ok_and(|m| {
            let dev = m.dev();
            let (major, minor) = (libc::major(dev) as u64, libc::minor(dev) as u64);
            m.ino() == ino && (major << 20 | minor) == sdev
        });
        if same {
            return Some(path);
        }
    }
    // No usable handle (overlayfs decodes none without its `nfs_export`
    // option): look for the inode itself, breadth first from each mount of
    // its device (watches are mostly directories near the top).
    mounts
        .iter()
        .filter(|(dev, _)| *dev == sdev)
        .find_map(|(_, point)| search(&root, point, sdev, ino))
}

/// Most directory entries [`search`] looks at per mount.
const SEARCH_LIMIT: usize = 200_000;

/// The path (in the template's mount namespace) of inode `ino` of device
/// `sdev` under mount point `point`, searched breadth first through
/// `/proc/PID/root` without leaving the device.
fn search(root: &Path, point: &str, sdev: u64, ino: u64) -> Option<String> {
    let kernel_dev = |dev: u64| (libc::major(dev) as u64) << 20 | libc::minor(dev) as u64;
    let start = root.join(point.trim_start_matches('/'));
    let meta = std::fs::symlink_metadata(&start).ok()?;
    if meta.ino() == ino && kernel_dev(meta.dev()) == sdev {
        return Some(point.to_string());
    }
    let mut queue = std::collections::VecDeque::from([point.trim_end_matches('/').to_string()]);
    let mut seen = 0usize;
    while let Some(dir) = queue.pop_front() {
        let Ok(entries) = std::fs::read_dir(root.join(dir.trim_start_matches('/'))) else {
            continue;
        };
        for entry in entries.flatten() {
            seen += 1;
            if seen > SEARCH_LIMIT {
                return None;
            }
            let Ok(meta) = entry.metadata() else { continue };
            let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let path = format!("{dir}/{name}");
            // A directory of an overlay reports the overlay's device; its
            // other files report their layer's, with the same inode number.
            let same_dev = kernel_dev(meta.dev()) == sdev;
            if meta.ino() == ino && (same_dev || !meta.is_dir()) {
                return Some(path);
            }
            if meta.is_dir() && same_dev {
                queue.push_back(path);
            }
        }
    }
    None
}

/// `open_by_handle_at(mount, handle, O_PATH)` (needs `CAP_DAC_READ_SEARCH`).
fn open_by_handle(mount: &std::fs::File, kind: i32, handle: &[u8]) -> io::Result<OwnedFd> {
    // struct file_handle { u32 handle_bytes; i32 handle_type; u8 f_handle[]; },
    // built in a u32 buffer so that it is aligned.
    let mut bytes = Vec::with_capacity(8 + handle.len().next_multiple_of(4));
    bytes.extend_from_slice(&(handle.len() as u32).to_ne_bytes());
    bytes.extend_from_slice(&kind.to_ne_bytes());
    bytes.extend_from_slice(handle);
    bytes.resize(bytes.capacity(), 0);
    let words: Vec<u32> = bytes
        .chunks(4)
        .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    // SAFETY: `words` holds a complete struct file_handle of the declared
    // length; the kernel only reads it and returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_by_handle_at,
            mount.as_raw_fd(),
            words.as_ptr(),
            libc::O_PATH | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_lines_are_parsed_and_sorted() {
        let info = "pos:\t0\nflags:\t00\nmnt_id:\t17\nino:\t1038\n\
inotify wd:3 ino:13 sdev:fe00000 mask:2 ignored_mask:0 fhandle-bytes:8 fhandle-type:1 f_handle:1300000000000000\n\
inotify wd:1 ino:98e0bd sdev:fe00000 mask:100 ignored_mask:0\n";
        let watches = parse_watches(-1, info).unwrap();
        assert_eq!(watches.len(), 2);
        assert_eq!(
            (watches[0].wd, watches[0].mask, watches[0].ino),
            (1, 0x100, 0x98e0bd)
        );
        assert_eq!((watches[1].wd, watches[1].sdev), (3, 0xfe00000));
        assert_eq!(watches[0].path, None, "no handle, no path");
        assert_eq!(parse_hex_bytes("13ff"), Some(vec![0x13, 0xff]));
        assert!(parse_watches(-1, "inotify wd:x").is_err());
    }
}
