//! Checkpoints as Hugging Face ships them (spec §9): one safetensors file, or a directory with
//! `model.safetensors.index.json` mapping every tensor to one of several shards.
//!
//! The index is read and checked when the checkpoint opens: shard names are plain file names
//! in the index's directory (no paths: an index must not reach outside its checkpoint), and
//! every shard it names exists as a regular file. Shards are memory-mapped lazily, each on the
//! first load of one of its tensors, so opening a checkpoint costs one small JSON read however
//! large it is. A tensor and its block scales (`<name>.scale`, see [`crate::load_f32`]) must
//! sit in the same shard: the decoder reads them together, and an index that splits them is
//! refused by name.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Deserialize;

use crate::Error;
use crate::checkpoint::TensorSource;
use crate::storage::{StoredMatrix, load_f32, load_stored};
use crate::weights::TensorFile;

/// The index's file name in a sharded checkpoint's directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The largest index read (the released V4.1-Flash index is a few hundred KiB).
const MAX_INDEX_BYTES: u64 = 64 << 20;

/// The JSON of `model.safetensors.index.json`.
#[derive(Deserialize)]
struct IndexFile {
    /// Free-form (`total_size` in the release); kept for [`Sharded::metadata`].
    #[serde(default)]
    metadata: serde_json::Map<String, serde_json::Value>,
    /// Tensor name to shard file name.
    weight_map: BTreeMap<String, String>,
}

/// One shard: its path, and its map once a tensor of it was loaded.
struct Shard {
    path: PathBuf,
    file: Mutex<Option<Arc<TensorFile>>>,
}

/// A sharded checkpoint: the index read, the shards opened on first use.
pub struct Sharded {
    index: PathBuf,
    index_bytes: Vec<u8>,
    metadata: serde_json::Map<String, serde_json::Value>,
    /// Tensor name to index into `shards`.
    tensors: HashMap<String, usize>,
    shards: Vec<Shard>,
}

impl std::fmt::Debug for Sharded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sharded")
            .field("index", &self.index)
            .field("tensors", &self.tensors.len())
            .field("shards", &self.shards.len())
            .finish()
    }
}

fn format_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

impl Sharded {
    /// Opens the checkpoint whose index is `index` (its shards lie beside it).
    ///
    /// # Errors
    /// [`Error::Open`] when the index cannot be read; [`Error::Format`] when it is not an
    /// index (bad JSON, no `weight_map`, a shard name with a path in it, an empty map) or a
    /// shard it names is missing or not a regular file.
    pub fn open(index: impl AsRef<Path>) -> Result<Sharded, Error> {
        let index = index.as_ref().to_path_buf();
        let bytes =
            kvstack_spec::files::read_regular(&index, MAX_INDEX_BYTES).map_err(|e| match e {
                kvstack_spec::files::FileError::Io(source) => Error::Open {
                    path: index.clone(),
                    source,
                },
                other => format_err(&index, other.to_string()),
            })?;
        let parsed: IndexFile = serde_json::from_slice(&bytes)
            .map_err(|e| format_err(&index, format!("not a safetensors index: {e}")))?;
        if parsed.weight_map.is_empty() {
            return Err(format_err(&index, "weight_map lists no tensors"));
        }
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<Shard> = Vec::new();
        let mut by_name: HashMap<String, usize> = HashMap::new();
        let mut tensors = HashMap::with_capacity(parsed.weight_map.len());
        for (tensor, shard) in parsed.weight_map {
            let i = match by_name.get(&shard) {
                Some(&i) => i,
                None => {
                    let plain = Path::new(&shard)
                        .file_name()
                        .is_some_and(|f| f == std::ffi::OsStr::new(&shard));
                    if !plain || shard == "." || shard == ".." {
                        return Err(format_err(
                            &index,
                            format!(
                                "tensor `{tensor}`: shard `{shard}` is not a plain file name in \
                                 the checkpoint's directory"
                            ),
                        ));
                    }
                    let path = dir.join(&shard);
                    let meta = std::fs::metadata(&path).map_err(|e| {
                        format_err(
                            &index,
                            format!("shard `{}` (holding `{tensor}`): {e}", path.display()),
                        )
                    })?;
                    if !meta.is_file() {
                        return Err(format_err(
                            &index,
                            format!("shard `{}` is not a regular file", path.display()),
                        ));
                    }
                    shards.push(Shard {
                        path,
                        file: Mutex::new(None),
                    });
                    by_name.insert(shard, shards.len() - 1);
                    shards.len() - 1
                }
            };
            tensors.insert(tensor, i);
        }
        Ok(Sharded {
            index,
            index_bytes: bytes,
            metadata: parsed.metadata,
            tensors,
            shards,
        })
    }

    /// The index file.
    pub fn index_path(&self) -> &Path {
        &self.index
    }

    /// The shard files, in the order the index first names them.
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// The index's `metadata` object.
    pub fn metadata(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.metadata
    }

    /// Every tensor name the index lists.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort();
        v
    }

    /// How many shards have been mapped so far (they open on first use).
    pub fn shards_open(&self) -> usize {
        self.shards
            .iter()
            .filter(|s| s.file.lock().is_ok_and(|f| f.is_some()))
            .count()
    }

    /// The shard holding `name`, mapped now if it was not yet.
    fn shard_of(&self, name: &str) -> Result<Option<(usize, Arc<TensorFile>)>, Error> {
        let Some(&i) = self.tensors.get(name) else {
            return Ok(None);
        };
        let shard = &self.shards[i];
        let mut slot = shard.file.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = slot.as_ref() {
            return Ok(Some((i, Arc::clone(f))));
        }
        let f = Arc::new(TensorFile::open(&shard.path)?);
        *slot = Some(Arc::clone(&f));
        Ok(Some((i, f)))
    }

    /// A content hash: BLAKE3 over the index and every shard's own content hash, in order
    /// (reads every byte of every shard once).
    pub fn content_id(&self) -> Result<Vec<u8>, Error> {
        let mut h = blake3::Hasher::new();
        h.update(&self.index_bytes);
        for i in 0..self.shards.len() {
            let shard = &self.shards[i];
            let f = {
                let mut slot = shard.file.lock().unwrap_or_else(|e| e.into_inner());
                match slot.as_ref() {
                    Some(f) => Arc::clone(f),
                    None => {
                        let f = Arc::new(TensorFile::open(&shard.path)?);
                        *slot = Some(Arc::clone(&f));
                        f
                    }
                }
            };
            h.update(&f.content_id());
        }
        Ok(h.finalize().as_bytes().to_vec())
    }
}

impl TensorSource for Sharded {
    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
        let file = self.file_of(name)?;
        load_f32(&file, name, shape)
    }

    fn load_stored(&self, name: &str, shape: &[usize]) -> Result<StoredMatrix, Error> {
        let file = self.file_of(name)?;
        load_stored(&file, name, shape)
    }

    fn describe(&self) -> PathBuf {
        self.index.clone()
    }
}

impl Sharded {
    /// The shard holding `name` (and its scales), checked against the index.
    fn file_of(&self, name: &str) -> Result<Arc<TensorFile>, Error> {
        let Some((i, file)) = self.shard_of(name)? else {
            return Err(Error::Storage {
                path: self.index.clone(),
                name: name.to_owned(),
                reason: "missing: the index maps no shard to it".into(),
            });
        };
        if !file.contains(name) {
            return Err(Error::Storage {
                path: file.path().to_path_buf(),
                name: name.to_owned(),
                reason: format!(
                    "the index ({}) maps it to this shard, which does not hold it",
                    self.index.display()
                ),
            });
        }
        // The scales are read from the tensor's own shard; say so if the index put them
        // elsewhere rather than report them missing.
        let stem = name.strip_suffix(".weight").unwrap_or(name);
        for scale in [format!("{stem}.scale"), format!("{name}.scale")] {
            if let Some(&j) = self.tensors.get(&scale)
                && j != i
            {
                return Err(Error::Storage {
                    path: file.path().to_path_buf(),
                    name: name.to_owned(),
                    reason: format!(
                        "its scales `{scale}` are in another shard ({}); a tensor and its scales \
                         must share a shard",
                        self.shards[j].path.display()
                    ),
                });
            }
        }
        Ok(file)
    }
}

/// A checkpoint's weights: one safetensors file or a sharded directory.
#[derive(Debug)]
pub enum Checkpoint {
    /// One `.safetensors` file.
    Single(TensorFile),
    /// `model.safetensors.index.json` and its shards.
    Sharded(Sharded),
}

impl Checkpoint {
    /// Opens `path`: a directory holding [`INDEX_FILE`], an index file (`*.index.json`), or a
    /// single safetensors file.
    ///
    /// # Errors
    /// As [`TensorFile::open`] or [`Sharded::open`]; a directory without an index is
    /// [`Error::Format`].
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint, Error> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join(INDEX_FILE);
            if !index.is_file() {
                return Err(format_err(
                    path,
                    format!("a directory without {INDEX_FILE}: not a sharded checkpoint"),
                ));
            }
            return Ok(Checkpoint::Sharded(Sharded::open(index)?));
        }
        if path
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| f.ends_with(".index.json"))
        {
            return Ok(Checkpoint::Sharded(Sharded::open(path)?));
        }
        Ok(Checkpoint::Single(TensorFile::open(path)?))
    }

    /// The identity of the weights (a BLAKE3 hash over every byte): see
    /// [`TensorFile::content_id`] and [`Sharded::content_id`].
    pub fn content_id(&self) -> Result<Vec<u8>, Error> {
        match self {
            Checkpoint::Single(f) => Ok(f.content_id()),
            Checkpoint::Sharded(s) => s.content_id(),
        }
    }

    /// The checkpoint as a [`TensorSource`].
    pub fn source(&self) -> &dyn TensorSource {
        match self {
            Checkpoint::Single(f) => f,
            Checkpoint::Sharded(s) => s,
        }
    }
}
