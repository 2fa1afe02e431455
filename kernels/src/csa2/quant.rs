//! Quantized rows at any width (spec §5) and the exact MXFP4·MXFP4 dot of the indexer.
//!
//! [`RowCodec`] quantizes and dequantizes rows of one format at one width. At the deployed
//! widths (512 for KV, 128 for index keys) it runs this crate's SIMD codecs; at other widths
//! (small test models) the scalar reference of
//! [`RowLayout`]. Both are byte-identical to the
//! reference codecs, so the choice never changes a result.
//!
//! [`Mxfp4Query`] computes indexer dots `q · k` between an MXFP4 query and MXFP4 keys exactly:
//! per 32-element block the sum of `(2 q_i)(2 k_i)` is an exact integer, scaled by
//! `2^(e_q + e_k - 256)` (an exact f64), the block terms summed in f64 and rounded once to f32.
//! That is the correctly rounded f32 of the exact dot whenever the block exponents of a pair
//! span at most about 38 binades (always, for activations). The reference computes the same
//! dot in f32 on the dequantized values; with one block per row (the 32-wide test model) every
//! partial sum is exact, so the two agree bit for bit (the verify test checks it against the
//! recorded `index_scores`). At 128 wide the dots go through
//! [`crate::dot_mxfp4_mxfp4`], which computes the same exact value with SIMD.

use kvstack_firmware_interface::element::E2M1_TIMES_TWO_I8;
use kvstack_firmware_interface::rows::RowLayout;
use kvstack_firmware_interface::{EntryFormat, IndexMxfp4Entry};
use zerocopy::FromBytes;

use super::{Error, check_len};

/// One entry format at one row width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCodec {
    layout: RowLayout,
}

impl RowCodec {
    /// The codec of `format` rows `dim` wide (a positive whole number of the format's tiles).
    pub fn new(format: EntryFormat, dim: usize) -> Result<RowCodec, Error> {
        Ok(RowCodec {
            layout: RowLayout::new(format, dim)?,
        })
    }

    /// The byte layout of one row.
    pub fn layout(&self) -> RowLayout {
        self.layout
    }

    /// The format.
    pub fn format(&self) -> EntryFormat {
        self.layout.format
    }

    /// Values per row.
    pub fn dim(&self) -> usize {
        self.layout.dim
    }

    /// Bytes per row.
    pub fn bytes(&self) -> usize {
        self.layout.bytes()
    }

    fn full_width(&self) -> bool {
        self.layout.dim == self.layout.format.dim()
    }

    fn rows(&self, values: usize, bytes: usize) -> Result<(), Error> {
        let d = self.layout.dim;
        if !values.is_multiple_of(d) {
            return Err(Error::Param {
                what: "quantized rows",
                reason: format!(
                    "{values} values are not whole {} rows of {d}",
                    self.format()
                ),
            });
        }
        check_len("quantized row bytes", values / d * self.bytes(), bytes)
    }

    /// Quantizes whole rows of `x` into `out` (SIMD at the deployed width).
    pub fn quantize(&self, x: &[f32], out: &mut [u8]) -> Result<(), Error> {
        self.rows(x.len(), out.len())?;
        if self.full_width() {
            return crate::quantize_unchecked(self.format(), x, out).map_err(|e| Error::Param {
                what: "quantize",
                reason: e.to_string(),
            });
        }
        self.quantize_ref(x, out)
    }

    /// Quantizes row by row with the scalar reference codec.
    pub fn quantize_ref(&self, x: &[f32], out: &mut [u8]) -> Result<(), Error> {
        self.rows(x.len(), out.len())?;
        for (row, o) in x
            .chunks_exact(self.dim())
            .zip(out.chunks_exact_mut(self.bytes()))
        {
            self.layout.quantize(row, o)?;
        }
        Ok(())
    }

    /// Dequantizes whole rows (SIMD at the deployed width).
    pub fn dequantize(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), Error> {
        self.rows(out.len(), bytes.len())?;
        if self.full_width() {
            return crate::dequantize(self.format(), bytes, out).map_err(|e| Error::Param {
                what: "dequantize",
                reason: e.to_string(),
            });
        }
        self.dequantize_ref(bytes, out)
    }

    /// Dequantizes row by row with the scalar reference codec.
    pub fn dequantize_ref(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), Error> {
        self.rows(out.len(), bytes.len())?;
        for (b, o) in bytes
            .chunks_exact(self.bytes())
            .zip(out.chunks_exact_mut(self.dim()))
        {
            self.layout.dequantize(b, o)?;
        }
        Ok(())
    }
}

/// `2^e` as an f64 for `e` in `-1022..=1023`.
#[inline]
fn pow2(e: i32) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

const BLOCK: usize = IndexMxfp4Entry::TILE;

/// Reference exact dot of two MXFP4 rows of `layout`: both dequantized to f32 (exact), products
/// and sum in f64 (exact for realistic exponent spans), rounded once to f32.
pub fn dot_mxfp4_exact_ref(layout: RowLayout, q: &[u8], k: &[u8]) -> Result<f32, Error> {
    if layout.format != EntryFormat::IndexMxfp4 {
        return Err(Error::Param {
            what: "dot_mxfp4_exact_ref",
            reason: format!("needs mxfp4-index rows, not {}", layout.format),
        });
    }
    let mut a = vec![0f32; layout.dim];
    let mut b = vec![0f32; layout.dim];
    layout.dequantize(q, &mut a)?;
    layout.dequantize(k, &mut b)?;
    Ok(a.iter()
        .zip(&b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum::<f64>() as f32)
}

/// An MXFP4 query row prepared for exact dots with many keys of the same width.
#[derive(Clone, Debug)]
pub struct Mxfp4Query {
    layout: RowLayout,
    /// `2 · e2m1` of every element.
    twice: Vec<i8>,
    /// Block scale bytes.
    scales: Vec<u8>,
    /// The row itself at the deployed width (for the SIMD kernel).
    entry: Option<IndexMxfp4Entry>,
}

impl Mxfp4Query {
    /// Prepares the query row `q` (`layout.bytes()` bytes of an MXFP4 row).
    pub fn new(layout: RowLayout, q: &[u8]) -> Result<Mxfp4Query, Error> {
        if layout.format != EntryFormat::IndexMxfp4 {
            return Err(Error::Param {
                what: "Mxfp4Query",
                reason: format!("needs mxfp4-index rows, not {}", layout.format),
            });
        }
        check_len("mxfp4 query row bytes", layout.bytes(), q.len())?;
        let (values, scales) = q.split_at(layout.value_bytes);
        let twice = values
            .iter()
            .flat_map(|&b| {
                [
                    E2M1_TIMES_TWO_I8[usize::from(b & 0x0F)],
                    E2M1_TIMES_TWO_I8[usize::from(b >> 4)],
                ]
            })
            .collect();
        let entry = if layout.dim == IndexMxfp4Entry::DIM {
            IndexMxfp4Entry::read_from_bytes(q).ok()
        } else {
            None
        };
        Ok(Mxfp4Query {
            layout,
            twice,
            scales: scales.to_vec(),
            entry,
        })
    }

    /// The exact dot with key row `k` (see the module documentation).
    pub fn dot(&self, k: &[u8]) -> Result<f32, Error> {
        check_len("mxfp4 key row bytes", self.layout.bytes(), k.len())?;
        if let Some(q) = &self.entry
            && let Ok(key) = IndexMxfp4Entry::ref_from_bytes(k)
        {
            return Ok(crate::dot_mxfp4_mxfp4(q, key));
        }
        let (values, scales) = k.split_at(self.layout.value_bytes);
        let mut total = 0f64;
        for (((qb, kb), &sq), &sk) in self
            .twice
            .chunks_exact(BLOCK)
            .zip(values.chunks_exact(BLOCK / 2))
            .zip(&self.scales)
            .zip(scales)
        {
            if sq == 255 || sk == 255 {
                return Ok(f32::NAN);
            }
            let mut acc = 0i32;
            for (q2, &b) in qb.chunks_exact(2).zip(kb) {
                acc += i32::from(q2[0]) * i32::from(E2M1_TIMES_TWO_I8[usize::from(b & 0x0F)]);
                acc += i32::from(q2[1]) * i32::from(E2M1_TIMES_TWO_I8[usize::from(b >> 4)]);
            }
            // (2q)(2k) = 4 q k, and the scales are 2^(s - 127) each: divide by 2^(2 + 254).
            total += f64::from(acc) * pow2(i32::from(sq) + i32::from(sk) - 256);
        }
        Ok(total as f32)
    }
}
