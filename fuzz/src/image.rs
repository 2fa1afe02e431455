//! The input of `store_recovery`: a compact, lossless description of a store's files, so the
//! fuzzer mutates the few hundred meaningful bytes of a record rather than pages of zeros.
//!
//! ```text
//! byte 0      flags: bit 0 device layout (else directory); bits 1-2 segment size of the
//!             options, 16 KiB << n (n = 3 is 16 KiB); bit 3 skip the read-write open
//! then chunks, back to back (a cut-off last chunk keeps what is there):
//!   file u8   directory: segment id of the file (0xFF is u64::MAX, 0xFE u64::MAX - 1; at
//!             most 8 files, chunks of further ones are dropped); device: page / 64
//!   page u8   page in the file, modulo 64 (so a file is at most 256 KiB, a device 1 MiB)
//!   fix u8    bit 0: recompute the header CRC of the record or segment header that starts
//!             this page; bit 1: first recompute a record's payload CRC too; bit 2: the file
//!             extends at least to the end of this page
//!   len u16   little-endian, at most 4096 (larger is cut)
//!   bytes     written at the start of the page (the rest of a new page is zero)
//! ```
//!
//! A file is as long as its furthest chunk (or page end, with fix bit 2). CRC fix-ups run
//! after every chunk is written, in chunk order. They let the fuzzer reach the checks behind
//! the CRCs; a real disk never fixes them, so the store must stay correct either way.

use std::collections::BTreeMap;
use std::path::Path;

use crate::{DEVICE_FILE, Layout, PAGE, fix_crcs};

/// Pages per file (and per quarter of a device).
pub const FILE_PAGES: usize = 64;
/// Most segment files of one image.
pub const MAX_FILES: usize = 8;

/// One chunk (module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// File byte.
    pub file: u8,
    /// Page byte.
    pub page: u8,
    /// Fix-up bits.
    pub fix: u8,
    /// Bytes at the start of the page.
    pub data: Vec<u8>,
}

/// A parsed image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Image {
    /// Flag byte.
    pub flags: u8,
    /// Chunks in order.
    pub chunks: Vec<Chunk>,
}

/// Fix bit: recompute the header CRC.
pub const FIX_HEADER: u8 = 1;
/// Fix bit: recompute the payload CRC (then the header CRC).
pub const FIX_PAYLOAD: u8 = 2;
/// Fix bit: the file reaches the end of this page.
pub const EXTEND: u8 = 4;
/// Flag bit: device layout.
pub const DEVICE: u8 = 1;
/// Flag bit: only read-only opens.
pub const NO_WRITE: u8 = 8;

impl Image {
    /// Parses fuzzer bytes (never fails).
    pub fn parse(bytes: &[u8]) -> Image {
        let flags = bytes.first().copied().unwrap_or(0);
        let mut chunks = Vec::new();
        let mut rest = bytes.get(1..).unwrap_or_default();
        while rest.len() >= 3 {
            let (file, page, fix) = (rest[0], rest[1], rest[2]);
            let len = match rest.get(3..5) {
                Some(l) => usize::from(u16::from_le_bytes([l[0], l[1]])).min(PAGE),
                None => 0,
            };
            let body = rest.get(5..).unwrap_or_default();
            let n = len.min(body.len());
            chunks.push(Chunk {
                file,
                page,
                fix,
                data: body[..n].to_vec(),
            });
            rest = &body[n..];
        }
        Image { flags, chunks }
    }

    /// The bytes that parse back to this image.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![self.flags];
        for c in &self.chunks {
            out.extend_from_slice(&[c.file, c.page, c.fix]);
            out.extend_from_slice(&(c.data.len() as u16).to_le_bytes());
            out.extend_from_slice(&c.data);
        }
        out
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        if self.flags & DEVICE != 0 {
            Layout::Device
        } else {
            Layout::Directory
        }
    }

    /// The segment size of the store options.
    pub fn segment_bytes(&self) -> u64 {
        match (self.flags >> 1) & 3 {
            1 => 32 << 10,
            2 => 64 << 10,
            _ => 16 << 10,
        }
    }

    /// Whether to open read-write too.
    pub fn write(&self) -> bool {
        self.flags & NO_WRITE == 0
    }

    /// Where a chunk goes: (file id, page).
    fn place(&self, c: &Chunk) -> (u64, usize) {
        match self.layout() {
            Layout::Directory => {
                let id = match c.file {
                    0xFF => u64::MAX,
                    0xFE => u64::MAX - 1,
                    b => u64::from(b),
                };
                (id, usize::from(c.page) % FILE_PAGES)
            }
            Layout::Device => (
                0,
                (usize::from(c.file) % 4) * FILE_PAGES + usize::from(c.page) % FILE_PAGES,
            ),
        }
    }

    /// The files' bytes, by id (one file, id 0, for a device).
    pub fn files(&self) -> BTreeMap<u64, Vec<u8>> {
        let mut files: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        let mut placed = Vec::new();
        for c in &self.chunks {
            let (id, page) = self.place(c);
            if !files.contains_key(&id) && files.len() >= MAX_FILES {
                continue;
            }
            let f = files.entry(id).or_default();
            let at = page * PAGE;
            let end = if c.fix & EXTEND != 0 {
                at + PAGE
            } else {
                at + c.data.len()
            };
            if f.len() < end {
                f.resize(end, 0);
            }
            f[at..at + c.data.len()].copy_from_slice(&c.data);
            placed.push((id, page, c.fix));
        }
        for (id, page, fix) in placed {
            if fix & (FIX_HEADER | FIX_PAYLOAD) == 0 {
                continue;
            }
            let Some(f) = files.get_mut(&id) else {
                continue;
            };
            let at = page * PAGE;
            if at >= f.len() {
                continue;
            }
            let cut = (at + PAGE).min(f.len());
            let (head, rest) = f.split_at_mut(cut);
            let page_bytes = &mut head[at..];
            fix_crcs(page_bytes, (fix & FIX_PAYLOAD != 0).then_some(&*rest));
        }
        files
    }

    /// Writes the files into the empty directory `dir`.
    pub fn write_to(&self, dir: &Path) -> std::io::Result<()> {
        for (id, bytes) in self.files() {
            let name = match self.layout() {
                Layout::Directory => format!("seg-{id:016x}.kvs"),
                Layout::Device => DEVICE_FILE.to_owned(),
            };
            std::fs::write(dir.join(name), bytes)?;
        }
        Ok(())
    }

    /// The image of the store files in `dir` (for seeds): every non-zero page, trailing zeros
    /// cut, and each file's length. Files must fit the limits of the module docs.
    pub fn from_dir(dir: &Path, layout: Layout, flags: u8) -> std::io::Result<Image> {
        let mut files: Vec<(u64, Vec<u8>)> = Vec::new();
        match layout {
            Layout::Device => files.push((0, std::fs::read(dir.join(DEVICE_FILE))?)),
            Layout::Directory => {
                for e in std::fs::read_dir(dir)? {
                    let e = e?;
                    let name = e.file_name().to_string_lossy().into_owned();
                    let Some(hex) = name
                        .strip_prefix("seg-")
                        .and_then(|n| n.strip_suffix(".kvs"))
                    else {
                        continue;
                    };
                    let id = u64::from_str_radix(hex, 16).map_err(std::io::Error::other)?;
                    files.push((id, std::fs::read(e.path())?));
                }
            }
        }
        files.sort();
        let mut chunks = Vec::new();
        for (id, bytes) in files {
            let pages = bytes.len().div_ceil(PAGE);
            let limit = match layout {
                Layout::Directory => FILE_PAGES,
                Layout::Device => 4 * FILE_PAGES,
            };
            if pages > limit || id >= 0xFE {
                return Err(std::io::Error::other(format!(
                    "file {id} of {} bytes does not fit an image",
                    bytes.len()
                )));
            }
            let at = |page: usize| -> (u8, u8) {
                match layout {
                    Layout::Directory => (id as u8, page as u8),
                    Layout::Device => ((page / FILE_PAGES) as u8, (page % FILE_PAGES) as u8),
                }
            };
            for (page, p) in bytes.chunks(PAGE).enumerate() {
                let used = p.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
                if used > 0 {
                    let (file, page) = at(page);
                    chunks.push(Chunk {
                        file,
                        page,
                        fix: 0,
                        data: p[..used].to_vec(),
                    });
                }
            }
            if pages > 0 {
                let (file, page) = at(pages - 1);
                chunks.push(Chunk {
                    file,
                    page,
                    fix: if bytes.len() % PAGE == 0 { EXTEND } else { 0 },
                    data: Vec::new(),
                });
            }
        }
        let flags = match layout {
            Layout::Device => flags | DEVICE,
            Layout::Directory => flags & !DEVICE,
        };
        Ok(Image { flags, chunks })
    }
}
