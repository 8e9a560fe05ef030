//! The page pool: memory pages of checkpoints, each distinct page stored once
//! by its BLAKE3 digest, whatever checkpoint or box it came from.
//!
//! Layout of the pool's directory:
//!
//! ```text
//! index        records of 40 bytes: digest (32), pack number (u32 LE), slot (u32 LE)
//! pack-N       pages, slot k at offset k * 4096
//! lock         flock: one writer at a time
//! ```
//!
//! A writer ([`PageWriter`]) takes the lock, appends the pages the pool lacks
//! to a new pack, syncs it, then appends their index records and syncs the
//! index: a crash leaves at worst a pack no record names (removed by
//! [`PagePool::gc`]) or a torn last record (ignored when the index is read).
//! A page read back ([`PagePool::read`]) is checked against its digest, so a
//! corrupt or truncated pack is found before its contents are used. The
//! directory is made mode 0700: pages are memory of boxes.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

use crate::error::{Result, StoreError};
use crate::hash::Digest;

/// Bytes of a page.
pub const PAGE_SIZE: usize = 4096;
/// Bytes of an index record.
const RECORD: usize = 40;

/// Where a page is: pack number and slot.
type Place = (u32, u32);

/// The page pool in one directory.
#[derive(Debug)]
pub struct PagePool {
    dir: PathBuf,
    index: HashMap<Digest, Place>,
    packs: Mutex<HashMap<u32, File>>,
}

/// What the pool holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolUsage {
    /// Distinct pages indexed.
    pub pages: u64,
    /// Bytes of the pack files (indexed pages and any not yet collected).
    pub bytes: u64,
    /// Pack files.
    pub packs: u64,
}

impl PagePool {
    /// Open (creating if needed) the pool in `dir` and read its index.
    pub fn open(dir: &Path) -> Result<PagePool> {
        // Pages are boxes' memory (keys, tokens): for root only. The
        // directories made above it are only traversable by others: a box
        // in a user namespace reaches its layers through them (the pool is
        // often the first thing made in a new root: `nestbox receive`).
        if let Some(parent) = dir.parent() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(parent)
                .map_err(StoreError::io("create", parent))?;
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(StoreError::io("create", dir))?;
        let path = dir.join("index");
        let data = match fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StoreError::io("read", &path)(e)),
        };
        let mut index = HashMap::with_capacity(data.len() / RECORD);
        // A torn last record (a crash while appending) is ignored.
        for rec in data.chunks_exact(RECORD) {
            let mut digest = [0u8; 32];
            digest.copy_from_slice(&rec[..32]);
            let pack = u32::from_le_bytes(rec[32..36].try_into().unwrap_or_default());
            let slot = u32::from_le_bytes(rec[36..40].try_into().unwrap_or_default());
            index.entry(Digest(digest)).or_insert((pack, slot));
        }
        Ok(PagePool {
            dir: dir.to_path_buf(),
            index,
            packs: Mutex::new(HashMap::new()),
        })
    }

    /// The pool's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the pool holds the page with digest `digest`.
    pub fn contains(&self, digest: &Digest) -> bool {
        self.index.contains_key(digest)
    }

    fn pack_path(&self, pack: u32) -> PathBuf {
        self.dir.join(format!("pack-{pack}"))
    }

    /// Read the page `digest` into `buf` (one page), checked against the digest.
    pub fn read(&self, digest: &Digest, buf: &mut [u8]) -> std::io::Result<()> {
        let (pack, slot) = *self.index.get(digest).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("page {} is not in the page pool", digest.short()),
            )
        })?;
        let mut packs = self.packs.lock().unwrap_or_else(|p| p.into_inner());
        let file = match packs.get(&pack) {
            Some(f) => f,
            None => {
                let f = File::open(self.pack_path(pack))?;
                packs.entry(pack).or_insert(f)
            }
        };
        file.read_exact_at(&mut buf[..PAGE_SIZE], u64::from(slot) * PAGE_SIZE as u64)
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("pack-{pack} slot {slot} (truncated page file?): {e}"),
                )
            })?;
        if Digest::of(&buf[..PAGE_SIZE]) != *digest {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "pack-{pack} slot {slot} does not hash to {}: the page file is corrupt",
                    digest.short()
                ),
            ));
        }
        Ok(())
    }

    /// Start adding pages (one writer at a time: waits for the pool's lock).
    pub fn writer(&mut self) -> Result<PageWriter<'_>> {
        let lock = self.lock()?;
        // Another writer may have added pages since this pool was opened.
        let fresh = PagePool::open(&self.dir)?;
        self.index = fresh.index;
        let pack = self.next_pack()?;
        let path = self.pack_path(pack);
        let file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(StoreError::io("create", &path))?;
        Ok(PageWriter {
            pool: self,
            _lock: lock,
            pack,
            file,
            path,
            slots: 0,
            added: Vec::new(),
            seen: HashSet::new(),
        })
    }

    /// The pool's writer lock (one writer or collector at a time).
    fn lock(&self) -> Result<Flock<File>> {
        let path = self.dir.join("lock");
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(StoreError::io("open", &path))?;
        Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| StoreError::io("flock", &path)(e.into()))
    }

    fn next_pack(&self) -> Result<u32> {
        let mut highest = 0;
        for entry in fs::read_dir(&self.dir).map_err(StoreError::io("read", &self.dir))? {
            let entry = entry.map_err(StoreError::io("read", &self.dir))?;
            if let Some(n) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("pack-"))
                .and_then(|n| n.parse::<u32>().ok())
            {
                highest = highest.max(n);
            }
        }
        Ok(highest + 1)
    }

    /// What the pool holds.
    pub fn usage(&self) -> Result<PoolUsage> {
        let mut usage = PoolUsage {
            pages: self.index.len() as u64,
            ..PoolUsage::default()
        };
        for entry in fs::read_dir(&self.dir).map_err(StoreError::io("read", &self.dir))? {
            let entry = entry.map_err(StoreError::io("read", &self.dir))?;
            if entry.file_name().to_string_lossy().starts_with("pack-") {
                usage.packs += 1;
                usage.bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        Ok(usage)
    }

    /// Forget every page not in `referenced`: a pack none of whose pages is
    /// referenced is removed, a pack holding fewer referenced pages than half
    /// its size has them copied (and checked) into a new pack and is removed,
    /// and the index is rewritten (new pack, then index, then removals: a
    /// crash between leaves only files the next `gc` removes). Pack files no
    /// index record names go too. Returns (packs removed, bytes freed).
    pub fn gc(&mut self, referenced: &HashSet<Digest>) -> Result<(u64, u64)> {
        let _lock = self.lock()?;
        let fresh = PagePool::open(&self.dir)?;
        self.index = fresh.index;
        self.index.retain(|d, _| referenced.contains(d));
        let mut live: HashMap<u32, u64> = HashMap::new();
        for (pack, _) in self.index.values() {
            *live.entry(*pack).or_default() += 1;
        }
        // Packs mostly of garbage: their live pages move to a new pack.
        let sparse: HashSet<u32> = live
            .iter()
            .filter(|(pack, n)| {
                let size = fs::metadata(self.pack_path(**pack))
                    .map(|m| m.len())
                    .unwrap_or(0);
                size / PAGE_SIZE as u64 > 2 * **n
            })
            .map(|(pack, _)| *pack)
            .collect();
        if !sparse.is_empty() {
            let new = self.next_pack()?;
            let path = self.pack_path(new);
            let mut out = OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&path)
                .map_err(StoreError::io("create", &path))?;
            let mut moved: Vec<(Digest, Place)> = self
                .index
                .iter()
                .filter(|(_, (pack, _))| sparse.contains(pack))
                .map(|(d, p)| (*d, *p))
                .collect();
            moved.sort_by_key(|(_, place)| *place);
            let mut buf = vec![0u8; PAGE_SIZE];
            let mut slot = 0u32;
            for (digest, _) in moved {
                if self.read(&digest, &mut buf).is_err() {
                    // Corrupt or cut: forgotten (a restore that needs it
                    // says the page is missing).
                    self.index.remove(&digest);
                    continue;
                }
                out.write_all(&buf)
                    .map_err(StoreError::io("write", &path))?;
                self.index.insert(digest, (new, slot));
                slot += 1;
            }
            out.sync_all().map_err(StoreError::io("fsync", &path))?;
            live.retain(|pack, _| !sparse.contains(pack));
            live.insert(new, u64::from(slot));
        }
        let mut records = Vec::with_capacity(self.index.len() * RECORD);
        let mut entries: Vec<(&Digest, &Place)> = self.index.iter().collect();
        entries.sort_by_key(|(_, place)| **place);
        for (digest, (pack, slot)) in entries {
            records.extend_from_slice(&digest.0);
            records.extend_from_slice(&pack.to_le_bytes());
            records.extend_from_slice(&slot.to_le_bytes());
        }
        let tmp = self.dir.join("index.tmp");
        fs::write(&tmp, &records).map_err(StoreError::io("write", &tmp))?;
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(StoreError::io("fsync", &tmp))?;
        let index = self.dir.join("index");
        fs::rename(&tmp, &index).map_err(StoreError::io("rename", &index))?;
        self.packs.lock().unwrap_or_else(|p| p.into_inner()).clear();
        let (mut removed, mut freed) = (0, 0);
        for entry in fs::read_dir(&self.dir).map_err(StoreError::io("read", &self.dir))? {
            let entry = entry.map_err(StoreError::io("read", &self.dir))?;
            let Some(n) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("pack-"))
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if !live.contains_key(&n) {
                freed += entry.metadata().map(|m| m.len()).unwrap_or(0);
                fs::remove_file(entry.path()).map_err(StoreError::io("remove", entry.path()))?;
                removed += 1;
            }
        }
        Ok((removed, freed))
    }
}

/// Adds pages to the pool (see the module documentation); dropped without
/// [`PageWriter::finish`], what it wrote is left for `gc`.
#[derive(Debug)]
pub struct PageWriter<'a> {
    pool: &'a mut PagePool,
    _lock: Flock<File>,
    pack: u32,
    file: File,
    path: PathBuf,
    slots: u32,
    added: Vec<(Digest, u32)>,
    seen: HashSet<Digest>,
}

impl PageWriter<'_> {
    /// Add one page (unless the pool has it); returns its digest and whether
    /// it was new.
    pub fn put(&mut self, page: &[u8]) -> Result<(Digest, bool)> {
        let digest = Digest::of(page);
        Ok((digest, self.put_hashed(digest, page)?))
    }

    /// [`PageWriter::put`] of a page whose digest the caller has just
    /// computed from these very bytes (it is not computed again).
    pub fn put_hashed(&mut self, digest: Digest, page: &[u8]) -> Result<bool> {
        if self.pool.contains(&digest) || !self.seen.insert(digest) {
            return Ok(false);
        }
        self.file
            .write_all(page)
            .map_err(StoreError::io("write", &self.path))?;
        self.added.push((digest, self.slots));
        self.slots += 1;
        Ok(true)
    }

    /// Pages added so far.
    pub fn added(&self) -> usize {
        self.added.len()
    }

    /// Sync the pack and record its pages in the index.
    pub fn finish(self) -> Result<()> {
        if self.added.is_empty() {
            fs::remove_file(&self.path).map_err(StoreError::io("remove", &self.path))?;
            return Ok(());
        }
        self.file
            .sync_all()
            .map_err(StoreError::io("fsync", &self.path))?;
        let mut records = Vec::with_capacity(self.added.len() * RECORD);
        for (digest, slot) in &self.added {
            records.extend_from_slice(&digest.0);
            records.extend_from_slice(&self.pack.to_le_bytes());
            records.extend_from_slice(&slot.to_le_bytes());
        }
        let index = self.pool.dir.join("index");
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&index)
            .map_err(StoreError::io("open", &index))?;
        // A record torn by an earlier crash would shift every later one.
        let len = f.metadata().map_err(StoreError::io("stat", &index))?.len();
        if len % RECORD as u64 != 0 {
            f.set_len(len - len % RECORD as u64)
                .map_err(StoreError::io("truncate", &index))?;
        }
        f.write_all(&records)
            .and_then(|()| f.sync_all())
            .map_err(StoreError::io("write", &index))?;
        for (digest, slot) in self.added {
            self.pool.index.insert(digest, (self.pack, slot));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(byte: u8) -> Vec<u8> {
        vec![byte; PAGE_SIZE]
    }

    #[test]
    fn a_new_pool_is_private_and_the_directories_made_above_it_traversable() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("root/lib/pages");
        PagePool::open(&dir).expect("open");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&tmp.path().join("root/lib")), 0o711);
        assert_eq!(mode(&tmp.path().join("root")), 0o711);
    }

    #[test]
    fn pages_are_stored_once_and_read_back_checked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut pool = PagePool::open(dir.path()).expect("open");
        let mut w = pool.writer().expect("writer");
        let (a, new_a) = w.put(&page(1)).expect("put");
        let (a2, new_a2) = w.put(&page(1)).expect("put");
        let (b, _) = w.put(&page(2)).expect("put");
        assert!(new_a && !new_a2 && a == a2);
        w.finish().expect("finish");
        // A second writer (another checkpoint) stores only what is new.
        let mut pool = PagePool::open(dir.path()).expect("reopen");
        let mut w = pool.writer().expect("writer");
        assert!(!w.put(&page(2)).expect("put").1);
        assert!(w.put(&page(3)).expect("put").1);
        w.finish().expect("finish");
        let pool = PagePool::open(dir.path()).expect("reopen");
        let mut buf = vec![0u8; PAGE_SIZE];
        pool.read(&b, &mut buf).expect("read");
        assert_eq!(buf, page(2));
        assert_eq!(pool.usage().expect("usage").pages, 3);
        // Corrupt the first pack: the read says so.
        std::fs::write(dir.path().join("pack-1"), vec![9u8; 2 * PAGE_SIZE]).expect("write");
        let err = pool.read(&a, &mut buf).expect_err("corrupt");
        assert!(err.to_string().contains("corrupt"), "{err}");
        // Truncated: also said.
        std::fs::write(dir.path().join("pack-1"), vec![1u8; 100]).expect("write");
        let pool = PagePool::open(dir.path()).expect("reopen");
        let err = pool.read(&b, &mut buf).expect_err("truncated");
        assert!(err.to_string().contains("truncated"), "{err}");
    }

    #[test]
    fn gc_removes_packs_nothing_refers_to() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut pool = PagePool::open(dir.path()).expect("open");
        let mut w = pool.writer().expect("writer");
        let (a, _) = w.put(&page(1)).expect("put");
        w.finish().expect("finish");
        let mut w = pool.writer().expect("writer");
        let (b, _) = w.put(&page(2)).expect("put");
        w.finish().expect("finish");
        // A pack a crashed writer left: no record names it.
        std::fs::write(dir.path().join("pack-9"), page(7)).expect("write");
        let (removed, _) = pool.gc(&HashSet::from([b])).expect("gc");
        assert_eq!(removed, 2);
        let pool = PagePool::open(dir.path()).expect("reopen");
        assert!(!pool.contains(&a) && pool.contains(&b));
        let mut buf = vec![0u8; PAGE_SIZE];
        pool.read(&b, &mut buf).expect("read");
    }

    #[test]
    fn gc_moves_the_live_pages_of_a_mostly_dead_pack() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut pool = PagePool::open(dir.path()).expect("open");
        let mut w = pool.writer().expect("writer");
        let digests: Vec<Digest> = (1..=5u8).map(|b| w.put(&page(b)).expect("put").0).collect();
        w.finish().expect("finish");
        let size = |p: &str| std::fs::metadata(dir.path().join(p)).map(|m| m.len()).ok();
        assert_eq!(size("pack-1"), Some(5 * PAGE_SIZE as u64));
        // One of five pages still referenced: moved to a pack of its own.
        let (removed, freed) = pool.gc(&HashSet::from([digests[3]])).expect("gc");
        assert_eq!((removed, freed), (1, 5 * PAGE_SIZE as u64));
        assert_eq!(size("pack-1"), None);
        assert_eq!(size("pack-2"), Some(PAGE_SIZE as u64));
        let pool = PagePool::open(dir.path()).expect("reopen");
        let mut buf = vec![0u8; PAGE_SIZE];
        pool.read(&digests[3], &mut buf).expect("read");
        assert_eq!(buf, page(4));
        assert!(!pool.contains(&digests[0]));
        assert_eq!(pool.usage().expect("usage").pages, 1);
    }
}
