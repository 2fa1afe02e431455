//! Storage types of the released checkpoint (spec §9), decoded to f32 on load, and their
//! encoders (used by `model init` to write checkpoints in the released storage).
//!
//! | stored dtype | shape | companion | decoded as |
//! |---|---|---|---|
//! | `F32` | the expected shape | | as is |
//! | `BF16` | the expected shape | | `f32::from_bits(b << 16)` |
//! | `F8_E4M3` | `[out, in]` | `<name minus .weight>.scale` (or `<name>.scale`), `[ceil(out / br), ceil(in / bc)]` UE8M0 (`F8_E8M0`/`U8`/`I8`) or `F32`/`BF16` | `e4m3(w[r, c]) · scale[r / br, c / bc]` |
//! | `F4` `[out, in]`, or `I8`/`U8` `[out, in / 2]` | packed E2M1, the even element in the low nibble | `.scale` `[out, ceil(in / bc)]` as above | `e2m1(w[r, c]) · scale[r, c / bc]` |
//!
//! The block shape `(br, bc)` is derived from the two shapes: `br = ceil(out / scale_rows)`,
//! `bc = ceil(in / scale_cols)`, and the scale shape must be exactly `[ceil(out / br),
//! ceil(in / bc)]` (the release uses 128 x 128 blocks for FP8 and 1 x 32 for FP4).

use kvstack_firmware_interface::element::{
    e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32, pow2ceil_exponent, ue8m0_to_f32,
};

use crate::weights::{
    Dtype, DtypeMismatch, MissingTensor, RawTensor, Shape, ShapeMismatch, TensorFile,
};

use std::path::Path;

use kvstack_kernels::linear::PackedLinear;

use crate::Error;

/// `f32` from a BF16 bit pattern.
pub fn f32_from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

fn storage(file: &TensorFile, name: &str, reason: impl Into<String>) -> Error {
    Error::Storage {
        path: file.path().to_path_buf(),
        name: name.to_owned(),
        reason: reason.into(),
    }
}

fn scale_values(t: &RawTensor<'_>) -> Option<Vec<f32>> {
    Some(match t.dtype {
        Dtype::F8_E8M0 | Dtype::U8 | Dtype::I8 => t.data.iter().map(|&e| ue8m0_to_f32(e)).collect(),
        Dtype::F32 => t
            .data
            .as_chunks::<4>()
            .0
            .iter()
            .map(|b| f32::from_le_bytes(*b))
            .collect(),
        Dtype::BF16 => t
            .data
            .as_chunks::<2>()
            .0
            .iter()
            .map(|b| f32_from_bf16(u16::from_le_bytes(*b)))
            .collect(),
        _ => return None,
    })
}

/// Block shape `(br, bc)` of a `[rows, cols]` matrix with a `[srows, scols]` scale grid.
fn blocks(rows: usize, cols: usize, srows: usize, scols: usize) -> Option<(usize, usize)> {
    if srows == 0 || scols == 0 {
        return None;
    }
    let (br, bc) = (rows.div_ceil(srows), cols.div_ceil(scols));
    (br > 0 && bc > 0 && rows.div_ceil(br) == srows && cols.div_ceil(bc) == scols)
        .then_some((br, bc))
}

/// Dequantizes FP8 E4M3 `codes` (`[rows, cols]`) with block scales `[srows, scols]`.
pub fn dequantize_fp8(
    codes: &[u8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    srows: usize,
    scols: usize,
) -> Result<Vec<f32>, String> {
    let (br, bc) = blocks(rows, cols, srows, scols).ok_or_else(|| {
        format!("scale grid [{srows}, {scols}] does not tile a [{rows}, {cols}] matrix")
    })?;
    if codes.len() != rows * cols || scales.len() != srows * scols {
        return Err(format!(
            "{} codes and {} scales for [{rows}, {cols}] with a [{srows}, {scols}] grid",
            codes.len(),
            scales.len()
        ));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (r, row) in codes.chunks_exact(cols.max(1)).enumerate() {
        let srow = &scales[(r / br) * scols..(r / br + 1) * scols];
        out.extend(
            row.iter()
                .enumerate()
                .map(|(c, &b)| e4m3_to_f32(b) * srow[c / bc]),
        );
    }
    Ok(out)
}

/// Dequantizes packed FP4 E2M1 (`[rows, cols / 2]` bytes, even element in the low nibble) with
/// scales `[rows, scols]` (one per row and `ceil(cols / scols)` columns).
pub fn dequantize_fp4(
    packed: &[u8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    srows: usize,
    scols: usize,
) -> Result<Vec<f32>, String> {
    let (br, bc) = blocks(rows, cols, srows, scols).ok_or_else(|| {
        format!("scale grid [{srows}, {scols}] does not tile a [{rows}, {cols}] matrix")
    })?;
    if !cols.is_multiple_of(2) || packed.len() != rows * cols / 2 || scales.len() != srows * scols {
        return Err(format!(
            "{} packed bytes and {} scales for [{rows}, {cols}] with a [{srows}, {scols}] grid",
            packed.len(),
            scales.len()
        ));
    }
    let mut out = Vec::with_capacity(rows * cols);
    for (r, row) in packed.chunks_exact((cols / 2).max(1)).enumerate() {
        let srow = &scales[(r / br) * scols..(r / br + 1) * scols];
        for (i, &b) in row.iter().enumerate() {
            let c = 2 * i;
            out.push(e2m1_to_f32(b & 0xF) * srow[c / bc]);
            out.push(e2m1_to_f32(b >> 4) * srow[(c + 1) / bc]);
        }
    }
    Ok(out)
}

/// Encodes `[rows, cols]` f32 as FP8 E4M3 with UE8M0 scales over `br x bc` blocks:
/// `s = pow2ceil(max(amax, 1e-4) / 448)`, codes `E4M3(x / s)`. Returns (codes, scale bytes
/// `[ceil(rows / br), ceil(cols / bc)]`).
pub fn encode_fp8(x: &[f32], rows: usize, cols: usize, br: usize, bc: usize) -> (Vec<u8>, Vec<u8>) {
    let (sr, sc) = (rows.div_ceil(br.max(1)), cols.div_ceil(bc.max(1)));
    let mut amax = vec![0f32; sr * sc];
    for (r, row) in x.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, v) in row.iter().enumerate() {
            let a = &mut amax[(r / br) * sc + c / bc];
            *a = a.max(v.abs());
        }
    }
    let sbytes: Vec<u8> = amax
        .iter()
        .map(|&a| pow2ceil_exponent(a.max(1e-4) / 448.0))
        .collect();
    let mut codes = Vec::with_capacity(rows * cols);
    for (r, row) in x.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &v) in row.iter().enumerate() {
            let s = ue8m0_to_f32(sbytes[(r / br) * sc + c / bc]);
            codes.push(e4m3_from_f32((v / s).clamp(-448.0, 448.0)));
        }
    }
    (codes, sbytes)
}

/// Encodes `[rows, cols]` f32 (cols even) as packed FP4 E2M1 with one UE8M0 scale per row and
/// `bc` columns: `s = pow2ceil(max(amax, 6·2^-126) / 6)`. Returns (packed `[rows, cols / 2]`,
/// scale bytes `[rows, ceil(cols / bc)]`).
pub fn encode_fp4(x: &[f32], rows: usize, cols: usize, bc: usize) -> (Vec<u8>, Vec<u8>) {
    let sc = cols.div_ceil(bc.max(1));
    let mut sbytes = vec![0u8; rows * sc];
    let mut packed = Vec::with_capacity(rows * cols / 2);
    for (r, row) in x.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (b, blk) in row.chunks(bc.max(1)).enumerate() {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            sbytes[r * sc + b] = pow2ceil_exponent(amax.max(6.0 * f32::MIN_POSITIVE) / 6.0);
        }
        for (i, pair) in row.chunks_exact(2).enumerate() {
            let s0 = ue8m0_to_f32(sbytes[r * sc + (2 * i) / bc]);
            let s1 = ue8m0_to_f32(sbytes[r * sc + (2 * i + 1) / bc]);
            let lo = e2m1_from_f32((pair[0] / s0).clamp(-6.0, 6.0));
            let hi = e2m1_from_f32((pair[1] / s1).clamp(-6.0, 6.0));
            packed.push(lo | (hi << 4));
        }
    }
    (packed, sbytes)
}

fn scale_tensor<'f>(file: &'f TensorFile, name: &str) -> Option<(String, RawTensor<'f>)> {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    [format!("{base}.scale"), format!("{name}.scale")]
        .into_iter()
        .find_map(|n| file.raw_tensor(&n).map(|t| (n, t)))
}

/// A tensor as the checkpoint stores it, validated against its logical shape: what the loader
/// packs for the kernels ([`StoredMatrix::pack`]) or dequantizes ([`StoredMatrix::to_f32`]).
#[derive(Clone, Debug, PartialEq)]
pub enum StoredMatrix {
    /// f32 values (any shape; `rows` x `cols` for matrices, `1` x len otherwise).
    F32 {
        /// The values, row-major.
        values: Vec<f32>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// BF16 bit patterns.
    Bf16 {
        /// The bit patterns, row-major.
        bits: Vec<u16>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
    /// FP8 E4M3 codes with block scales.
    Fp8 {
        /// Codes `[rows, cols]`.
        codes: Vec<u8>,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
        /// Scales `[srows, scols]` as f32.
        scales: Vec<f32>,
        /// Scale grid rows.
        srows: usize,
        /// Scale grid columns.
        scols: usize,
    },
    /// Packed FP4 E2M1 (`[rows, cols / 2]` bytes, the even element in the low nibble) with
    /// scales.
    Fp4 {
        /// Packed codes.
        packed: Vec<u8>,
        /// Rows.
        rows: usize,
        /// Columns (logical).
        cols: usize,
        /// Scales `[srows, scols]` as f32.
        scales: Vec<f32>,
        /// Scale grid rows.
        srows: usize,
        /// Scale grid columns.
        scols: usize,
    },
}

/// How a loaded model holds its linear weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightPrecision {
    /// As the checkpoint stores them (FP8, FP4, BF16 or f32), packed once for the kernels.
    #[default]
    Stored,
    /// Dequantized to f32 (4 bytes per weight): the verification path. Each weight has the
    /// same value as stored, and the kernels sum in the same order, so the two give the same
    /// bits.
    F32,
}

impl StoredMatrix {
    /// `[rows, cols]`.
    pub fn shape(&self) -> (usize, usize) {
        match *self {
            StoredMatrix::F32 { rows, cols, .. }
            | StoredMatrix::Bf16 { rows, cols, .. }
            | StoredMatrix::Fp8 { rows, cols, .. }
            | StoredMatrix::Fp4 { rows, cols, .. } => (rows, cols),
        }
    }

    /// The values as f32, row-major (the dequantizer of the storage type).
    pub fn to_f32(&self) -> Result<Vec<f32>, String> {
        match self {
            StoredMatrix::F32 { values, .. } => Ok(values.clone()),
            StoredMatrix::Bf16 { bits, .. } => Ok(bits.iter().map(|&b| f32_from_bf16(b)).collect()),
            StoredMatrix::Fp8 {
                codes,
                rows,
                cols,
                scales,
                srows,
                scols,
            } => dequantize_fp8(codes, *rows, *cols, scales, *srows, *scols),
            StoredMatrix::Fp4 {
                packed,
                rows,
                cols,
                scales,
                srows,
                scols,
            } => dequantize_fp4(packed, *rows, *cols, scales, *srows, *scols),
        }
    }

    /// Rows `r` of the matrix, scales included (a block grid that `r` cuts through becomes
    /// one scale row per row, with the same values).
    pub fn rows(&self, r: std::ops::Range<usize>) -> Result<StoredMatrix, String> {
        let (rows, cols) = self.shape();
        if r.start > r.end || r.end > rows {
            return Err(format!("rows {r:?} of a {rows}-row matrix"));
        }
        let n = r.len();
        let regrid = |scales: &[f32], srows: usize, scols: usize| -> Result<Vec<f32>, String> {
            let (br, _) = blocks(rows, cols, srows, scols).ok_or_else(|| {
                format!("scale grid [{srows}, {scols}] does not tile [{rows}, {cols}]")
            })?;
            Ok(r.clone()
                .flat_map(|j| {
                    scales[(j / br) * scols..(j / br + 1) * scols]
                        .iter()
                        .copied()
                })
                .collect())
        };
        Ok(match self {
            StoredMatrix::F32 { values, .. } => StoredMatrix::F32 {
                values: values[r.start * cols..r.end * cols].to_vec(),
                rows: n,
                cols,
            },
            StoredMatrix::Bf16 { bits, .. } => StoredMatrix::Bf16 {
                bits: bits[r.start * cols..r.end * cols].to_vec(),
                rows: n,
                cols,
            },
            StoredMatrix::Fp8 {
                codes,
                scales,
                srows,
                scols,
                ..
            } => StoredMatrix::Fp8 {
                codes: codes[r.start * cols..r.end * cols].to_vec(),
                rows: n,
                cols,
                scales: regrid(scales, *srows, *scols)?,
                srows: n,
                scols: *scols,
            },
            StoredMatrix::Fp4 {
                packed,
                scales,
                srows,
                scols,
                ..
            } => StoredMatrix::Fp4 {
                packed: packed[r.start * cols / 2..r.end * cols / 2].to_vec(),
                rows: n,
                cols,
                scales: regrid(scales, *srows, *scols)?,
                srows: n,
                scols: *scols,
            },
        })
    }

    /// Packs the matrix for the kernels, as stored or as f32.
    pub fn pack(&self, precision: WeightPrecision) -> Result<PackedLinear, String> {
        let (rows, cols) = self.shape();
        let r = match (self, precision) {
            (StoredMatrix::F32 { values, .. }, _) => PackedLinear::from_f32(values, rows, cols),
            (_, WeightPrecision::F32) => PackedLinear::from_f32(&self.to_f32()?, rows, cols),
            (StoredMatrix::Bf16 { bits, .. }, _) => PackedLinear::from_bf16(bits, rows, cols),
            (
                StoredMatrix::Fp8 {
                    codes,
                    scales,
                    srows,
                    scols,
                    ..
                },
                _,
            ) => PackedLinear::from_fp8(codes, rows, cols, scales, *srows, *scols),
            (
                StoredMatrix::Fp4 {
                    packed,
                    scales,
                    srows,
                    scols,
                    ..
                },
                _,
            ) => PackedLinear::from_fp4(packed, rows, cols, scales, *srows, *scols),
        };
        r.map_err(|e| e.to_string())
    }
}

/// Reads tensor `name` (with its `.scale` companion where the storage has one) as stored,
/// checked against the expected logical `shape`. Errors name the tensor (missing, shape,
/// dtype, scale grid) and `path`.
pub fn stored_matrix(
    path: &Path,
    name: &str,
    t: Option<RawTensor<'_>>,
    scale: Option<(String, RawTensor<'_>)>,
    shape: &[usize],
) -> Result<StoredMatrix, Error> {
    let storage = |name: &str, reason: String| Error::Storage {
        path: path.to_path_buf(),
        name: name.to_owned(),
        reason,
    };
    let Some(t) = t else {
        return Err(Error::Missing(Box::new(MissingTensor {
            path: path.to_path_buf(),
            name: name.to_owned(),
            dtype: "F32, BF16, F8_E4M3 (+ .scale) or packed F4 (+ .scale)",
            expected: shape.to_vec(),
        })));
    };
    let shape_err = || -> Error {
        Error::WeightsShape(Box::new(ShapeMismatch {
            path: path.to_path_buf(),
            name: name.to_owned(),
            expected: shape.to_vec(),
            actual: t.shape.to_vec(),
        }))
    };
    let matrix = |what: &str| -> Result<(usize, usize), Error> {
        match shape {
            [r, c] => Ok((*r, *c)),
            _ => Err(storage(
                name,
                format!("{what} storage for a tensor of shape {}", Shape(shape)),
            )),
        }
    };
    let flat = || match shape {
        [r, c] => (*r, *c),
        _ => (1, shape.iter().product()),
    };
    let scales = |rows: usize, cols: usize| -> Result<(Vec<f32>, usize, usize), Error> {
        let (sname, st) = scale.clone().ok_or_else(|| {
            storage(
                name,
                format!("{:?} storage needs a `.scale` tensor (none found)", t.dtype),
            )
        })?;
        let (sr, sc) = match st.shape {
            [a, b] => (*a, *b),
            s => {
                return Err(storage(
                    &sname,
                    format!("scale of shape {} is not 2-D", Shape(s)),
                ));
            }
        };
        let v = scale_values(&st).ok_or_else(|| {
            storage(
                &sname,
                format!(
                    "scale dtype {:?} (expected F8_E8M0, U8, F32 or BF16)",
                    st.dtype
                ),
            )
        })?;
        if v.len() != sr * sc {
            return Err(storage(&sname, "scale bytes do not match its shape".into()));
        }
        if blocks(rows, cols, sr, sc).is_none() {
            return Err(storage(
                &sname,
                format!("scale grid [{sr}, {sc}] does not tile the [{rows}, {cols}] weight"),
            ));
        }
        Ok((v, sr, sc))
    };
    match t.dtype {
        Dtype::F32 | Dtype::BF16 => {
            if t.shape != shape {
                return Err(shape_err());
            }
            let (rows, cols) = flat();
            Ok(if t.dtype == Dtype::F32 {
                StoredMatrix::F32 {
                    values: t
                        .data
                        .as_chunks::<4>()
                        .0
                        .iter()
                        .map(|b| f32::from_le_bytes(*b))
                        .collect(),
                    rows,
                    cols,
                }
            } else {
                StoredMatrix::Bf16 {
                    bits: t
                        .data
                        .as_chunks::<2>()
                        .0
                        .iter()
                        .map(|b| u16::from_le_bytes(*b))
                        .collect(),
                    rows,
                    cols,
                }
            })
        }
        Dtype::F8_E4M3 => {
            let (r, c) = matrix("FP8")?;
            if t.shape != shape {
                return Err(shape_err());
            }
            let (s, sr, sc) = scales(r, c)?;
            if t.data.len() != r * c {
                return Err(storage(name, "FP8 bytes do not match its shape".into()));
            }
            Ok(StoredMatrix::Fp8 {
                codes: t.data.to_vec(),
                rows: r,
                cols: c,
                scales: s,
                srows: sr,
                scols: sc,
            })
        }
        Dtype::F4 | Dtype::I8 | Dtype::U8 => {
            let (r, c) = matrix("packed FP4")?;
            let packed_shape = [r, c / 2];
            let ok = if t.dtype == Dtype::F4 {
                t.shape == shape
            } else {
                c.is_multiple_of(2) && t.shape == packed_shape
            };
            if !ok {
                return Err(shape_err());
            }
            let (s, sr, sc) = scales(r, c)?;
            if !c.is_multiple_of(2) || t.data.len() != r * c / 2 {
                return Err(storage(
                    name,
                    "packed FP4 bytes do not match its shape".into(),
                ));
            }
            Ok(StoredMatrix::Fp4 {
                packed: t.data.to_vec(),
                rows: r,
                cols: c,
                scales: s,
                srows: sr,
                scols: sc,
            })
        }
        other => Err(Error::Dtype(Box::new(DtypeMismatch {
            path: path.to_path_buf(),
            name: name.to_owned(),
            expected: "F32, BF16, F8_E4M3 or packed F4",
            actual: format!("{other:?}"),
            shape: shape.to_vec(),
        }))),
    }
}

/// Tensor `name` of `file` as stored (see [`stored_matrix`]).
pub fn load_stored(file: &TensorFile, name: &str, shape: &[usize]) -> Result<StoredMatrix, Error> {
    stored_matrix(
        file.path(),
        name,
        file.raw_tensor(name),
        scale_tensor(file, name),
        shape,
    )
}

/// Loads tensor `name` of the expected (logical) `shape` as f32 from any storage type of the
/// module table. Errors name the tensor (missing, shape, dtype, scale grid).
pub fn load_f32(file: &TensorFile, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
    load_stored(file, name, shape)?
        .to_f32()
        .map_err(|e| storage(file, name, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trip_is_within_e4m3_precision() {
        let (rows, cols) = (5, 70);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let (codes, s) = encode_fp8(&x, rows, cols, 4, 32);
        let sv: Vec<f32> = s.iter().map(|&e| ue8m0_to_f32(e)).collect();
        let y = dequantize_fp8(&codes, rows, cols, &sv, 2, 3).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() / 16.0 + 1e-3, "{a} vs {b}");
        }
    }

    #[test]
    fn fp4_round_trip_is_within_e2m1_precision() {
        let (rows, cols) = (3, 64);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 29 % 61) as f32 - 30.0) * 0.01)
            .collect();
        let (p, s) = encode_fp4(&x, rows, cols, 32);
        let sv: Vec<f32> = s.iter().map(|&e| ue8m0_to_f32(e)).collect();
        let y = dequantize_fp4(&p, rows, cols, &sv, 3, 2).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= a.abs() / 4.0 + 0.02, "{a} vs {b}");
        }
        assert!(dequantize_fp4(&p, rows, cols, &sv, 3, 3).is_err());
    }
}
