//! Tensors from safetensors files, memory-mapped: model weights and reference dumps.
//!
//! [`TensorFile`] maps the file read-only, validates the header once (offsets contiguous and
//! inside the file, sizes consistent with dtype and shape: the `safetensors` crate's checks),
//! and hands out tensors by name with their dtype and shape checked against what the caller
//! expects. Every error names the file, the tensor and the expected shape or dtype, so a
//! malformed checkpoint or dump is diagnosed without a debugger.
//!
//! Values are copied out into `Vec`s (little-endian decode): the attention weights of a layer
//! are small next to the cache, and a copy frees the caller from the file's alignment.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
pub use safetensors::tensor::Dtype;
use safetensors::tensor::{Metadata, SafeTensors};

use crate::Error;

/// [`Error::Missing`]: a tensor the caller needs is absent.
#[derive(Debug)]
pub struct MissingTensor {
    /// The file.
    pub path: PathBuf,
    /// The tensor's name.
    pub name: String,
    /// The dtype the caller expects.
    pub dtype: &'static str,
    /// The shape the caller expects.
    pub expected: Vec<usize>,
}

/// [`Error::WeightsShape`]: a tensor has another shape than the caller expects.
#[derive(Debug)]
pub struct ShapeMismatch {
    /// The file.
    pub path: PathBuf,
    /// The tensor's name.
    pub name: String,
    /// The shape the caller expects.
    pub expected: Vec<usize>,
    /// The shape in the file.
    pub actual: Vec<usize>,
}

/// [`Error::Dtype`]: a tensor has another dtype than the caller expects.
#[derive(Debug)]
pub struct DtypeMismatch {
    /// The file.
    pub path: PathBuf,
    /// The tensor's name.
    pub name: String,
    /// The dtype the caller expects.
    pub expected: &'static str,
    /// The dtype in the file.
    pub actual: String,
    /// The tensor's shape (as expected by the caller).
    pub shape: Vec<usize>,
}

/// A shape printed as `[a, b, c]`.
pub struct Shape<'a>(pub &'a [usize]);

impl fmt::Display for Shape<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The element types this module decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    /// IEEE f32.
    F32,
    /// i64.
    I64,
    /// u8 (boolean masks are stored as 0/1 bytes).
    U8,
}

impl ElementType {
    fn dtype(self) -> Dtype {
        match self {
            ElementType::F32 => Dtype::F32,
            ElementType::I64 => Dtype::I64,
            ElementType::U8 => Dtype::U8,
        }
    }

    /// The safetensors name (`F32`, `I64`, `U8`).
    pub fn name(self) -> &'static str {
        match self {
            ElementType::F32 => "F32",
            ElementType::I64 => "I64",
            ElementType::U8 => "U8",
        }
    }
}

/// One tensor of a [`TensorFile`] as stored: dtype, shape and the little-endian bytes (borrowed
/// from the map).
#[derive(Clone, Copy, Debug)]
pub struct RawTensor<'a> {
    /// The stored dtype.
    pub dtype: Dtype,
    /// The stored shape (for `F4`, the logical element shape: two elements per byte).
    pub shape: &'a [usize],
    /// The bytes.
    pub data: &'a [u8],
}

/// Most bytes of a safetensors header (its JSON table of tensors): the format's own limit.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// A memory-mapped safetensors file.
pub struct TensorFile {
    path: PathBuf,
    map: Mmap,
    data_start: usize,
    meta: Metadata,
}

impl fmt::Debug for TensorFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TensorFile")
            .field("path", &self.path)
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl TensorFile {
    /// Opens, maps and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<TensorFile, Error> {
        let path = path.as_ref().to_path_buf();
        let open_err = |source| Error::Open {
            path: path.clone(),
            source,
        };
        let file = match kvstack_spec::files::open_regular(&path, u64::MAX) {
            Ok((f, _)) => f,
            Err(kvstack_spec::files::FileError::Io(e)) => return Err(open_err(e)),
            Err(e) => {
                return Err(Error::Format {
                    path,
                    reason: e.to_string(),
                });
            }
        };
        // SAFETY: the map is read-only and private to this process; kvstack never writes
        // tensor files. A concurrent writer outside the process could change the bytes under
        // the map, which is the documented contract of every mmap-based loader: callers must
        // not modify weight or vector files while they are open. Every read below goes through
        // bounds-checked slices of the map.
        let map = unsafe { Mmap::map(&file) }.map_err(open_err)?;
        // The header's length is checked before anything is parsed: its JSON is read into
        // memory, and a corrupt length must not make that unbounded.
        let declared = map
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes);
        match declared {
            None => {
                return Err(Error::Format {
                    path,
                    reason: format!("{} bytes: too short for the header length", map.len()),
                });
            }
            Some(n) if n > MAX_HEADER_BYTES || n > map.len() as u64 - 8 => {
                return Err(Error::Format {
                    path,
                    reason: format!(
                        "header length {n} exceeds the {} bytes after it or the {MAX_HEADER_BYTES}-byte limit",
                        map.len() - 8
                    ),
                });
            }
            Some(_) => {}
        }
        let (n, meta) = SafeTensors::read_metadata(&map).map_err(|e| Error::Format {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Ok(TensorFile {
            path,
            map,
            // `read_metadata` checked that the 8-byte length, the header and the data fill
            // the file exactly.
            data_start: 8 + n,
            meta,
        })
    }

    /// A content hash of the whole file (BLAKE3, 32 bytes): the identity of a checkpoint's
    /// weights, which the tiers mix into every stored key so that KV computed with other
    /// weights of the same shapes never matches. Reads every byte once.
    pub fn content_id(&self) -> Vec<u8> {
        blake3::hash(&self.map).as_bytes().to_vec()
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a tensor named `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.meta.info(name).is_some()
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.meta.tensors().into_keys().collect();
        v.sort();
        v
    }

    /// The header's free-form `__metadata__`.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.meta.metadata().as_ref()
    }

    /// The shape of `name`, if present.
    pub fn shape(&self, name: &str) -> Option<&[usize]> {
        self.meta.info(name).map(|i| i.shape.as_slice())
    }

    /// The dtype of `name` as its safetensors name, if present.
    pub fn dtype_name(&self, name: &str) -> Option<String> {
        self.meta.info(name).map(|i| format!("{:?}", i.dtype))
    }

    /// The tensor `name` as stored (any dtype, any shape), if present: for loaders that
    /// decode storage types themselves (BF16, FP8, packed FP4; `crate::model`).
    pub fn raw_tensor(&self, name: &str) -> Option<RawTensor<'_>> {
        let info = self.meta.info(name)?;
        let (s, e) = info.data_offsets;
        let data = self.map.get(self.data_start + s..self.data_start + e)?;
        Some(RawTensor {
            dtype: info.dtype,
            shape: &info.shape,
            data,
        })
    }

    fn raw(&self, name: &str, ty: ElementType, expected: &[usize]) -> Result<&[u8], Error> {
        let Some(info) = self.meta.info(name) else {
            return Err(Error::Missing(Box::new(MissingTensor {
                path: self.path.clone(),
                name: name.to_owned(),
                dtype: ty.name(),
                expected: expected.to_vec(),
            })));
        };
        if info.dtype != ty.dtype() {
            return Err(Error::Dtype(Box::new(DtypeMismatch {
                path: self.path.clone(),
                name: name.to_owned(),
                expected: ty.name(),
                actual: format!("{:?}", info.dtype),
                shape: expected.to_vec(),
            })));
        }
        if info.shape != expected {
            return Err(Error::WeightsShape(Box::new(ShapeMismatch {
                path: self.path.clone(),
                name: name.to_owned(),
                expected: expected.to_vec(),
                actual: info.shape.clone(),
            })));
        }
        let (s, e) = info.data_offsets;
        self.map
            .get(self.data_start + s..self.data_start + e)
            .ok_or_else(|| Error::Format {
                path: self.path.clone(),
                reason: format!("tensor `{name}` lies outside the file"),
            })
    }

    /// The f32 tensor `name` of exactly `shape`, row-major.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
        let raw = self.raw(name, ElementType::F32, shape)?;
        Ok(raw
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| f32::from_le_bytes(*b))
            .collect())
    }

    /// The i64 tensor `name` of exactly `shape`.
    pub fn i64(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, Error> {
        let raw = self.raw(name, ElementType::I64, shape)?;
        Ok(raw
            .as_chunks::<8>()
            .0
            .iter()
            .map(|b| i64::from_le_bytes(*b))
            .collect())
    }

    /// The u8 tensor `name` of exactly `shape`.
    pub fn u8(&self, name: &str, shape: &[usize]) -> Result<Vec<u8>, Error> {
        Ok(self.raw(name, ElementType::U8, shape)?.to_vec())
    }
}
