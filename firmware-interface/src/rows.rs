//! Width-generic rows of the three entry formats.
//!
//! The deployed model stores 512-wide KV entries and 128-wide index keys ([`crate::entry`]); the
//! same formats apply unchanged to any width that is a whole number of scale tiles, which is what
//! small test models use (e.g. `shared/vectors/csa2`: 64-wide KV, 32-wide index keys). A row is
//! laid out like an entry: value bytes, then scale bytes.

use crate::element::{e4m3_to_f32, ue8m0_to_f32};
use crate::entry::{
    GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry, e2m1_dequantize_tiles, fp4_quantize_tiles,
    fp8_dequantize_tiles, fp8_quantize_tiles, mxfp4_quantize_tiles,
};
use crate::{EntryFormat, Error};

/// The byte layout of one row of `format` at width `dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    /// The format.
    pub format: EntryFormat,
    /// Elements per row.
    pub dim: usize,
    /// Bytes of values (`dim` for FP8, `dim / 2` for the packed FP4 formats).
    pub value_bytes: usize,
    /// Bytes of scales (one per tile).
    pub scale_bytes: usize,
}

impl RowLayout {
    /// The layout of a `dim`-wide row; an error unless `dim` is a positive whole number of the
    /// format's tiles.
    pub fn new(format: EntryFormat, dim: usize) -> Result<RowLayout, Error> {
        let tile = format.tile();
        if dim == 0 || !dim.is_multiple_of(tile) {
            return Err(Error::RowWidth { format, dim, tile });
        }
        let value_bytes = match format {
            EntryFormat::WindowFp8 => dim,
            EntryFormat::GlobalFp4 | EntryFormat::IndexMxfp4 => dim / 2,
        };
        Ok(RowLayout {
            format,
            dim,
            value_bytes,
            scale_bytes: dim / tile,
        })
    }

    /// Bytes per row: values then scales.
    pub fn bytes(&self) -> usize {
        self.value_bytes + self.scale_bytes
    }

    fn check(&self, what: &'static str, expected: usize, actual: usize) -> Result<(), Error> {
        if expected == actual {
            Ok(())
        } else {
            Err(Error::RowLength {
                format: self.format,
                what,
                expected,
                actual,
            })
        }
    }

    /// Quantizes one row (scalar reference, spec §5): `x.len()` must be `dim` and `out.len()`
    /// must be [`RowLayout::bytes`]. Non-finite values are not rejected here (see
    /// [`crate::element`] for what they encode to); callers that must reject them check first.
    pub fn quantize(&self, x: &[f32], out: &mut [u8]) -> Result<(), Error> {
        self.check("values", self.dim, x.len())?;
        self.check("bytes", self.bytes(), out.len())?;
        let (values, scales) = out.split_at_mut(self.value_bytes);
        match self.format {
            EntryFormat::WindowFp8 => fp8_quantize_tiles(x, values, scales),
            EntryFormat::GlobalFp4 => fp4_quantize_tiles(x, values, scales),
            EntryFormat::IndexMxfp4 => mxfp4_quantize_tiles(x, values, scales),
        }
        Ok(())
    }

    /// Dequantizes one row: `bytes.len()` must be [`RowLayout::bytes`], `out.len()` `dim`.
    pub fn dequantize(&self, bytes: &[u8], out: &mut [f32]) -> Result<(), Error> {
        self.check("bytes", self.bytes(), bytes.len())?;
        self.check("values", self.dim, out.len())?;
        let (values, scales) = bytes.split_at(self.value_bytes);
        match self.format {
            EntryFormat::WindowFp8 => fp8_dequantize_tiles(values, scales, out),
            EntryFormat::GlobalFp4 => {
                e2m1_dequantize_tiles(values, scales, GlobalFp4Entry::TILE, e4m3_to_f32, out)
            }
            EntryFormat::IndexMxfp4 => {
                e2m1_dequantize_tiles(values, scales, IndexMxfp4Entry::TILE, ue8m0_to_f32, out)
            }
        }
        Ok(())
    }
}

const _: () = assert!(WindowFp8Entry::TILE == 32 && GlobalFp4Entry::TILE == 16);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::{quantize_global_fp4, quantize_index_mxfp4, quantize_window_fp8};
    use zerocopy::IntoBytes;

    fn row(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.731).sin() * (1.0 + i as f32 * 0.01))
            .collect()
    }

    #[test]
    fn full_width_rows_equal_the_entry_functions() {
        let x = row(512);
        let mut out = vec![0u8; 528];
        RowLayout::new(EntryFormat::WindowFp8, 512)
            .unwrap()
            .quantize(&x, &mut out)
            .unwrap();
        assert_eq!(
            out,
            quantize_window_fp8(x.as_slice().try_into().unwrap()).as_bytes()
        );
        let mut out = vec![0u8; 288];
        RowLayout::new(EntryFormat::GlobalFp4, 512)
            .unwrap()
            .quantize(&x, &mut out)
            .unwrap();
        assert_eq!(
            out,
            quantize_global_fp4(x.as_slice().try_into().unwrap()).as_bytes()
        );
        let x = row(128);
        let mut out = vec![0u8; 68];
        RowLayout::new(EntryFormat::IndexMxfp4, 128)
            .unwrap()
            .quantize(&x, &mut out)
            .unwrap();
        assert_eq!(
            out,
            quantize_index_mxfp4(x.as_slice().try_into().unwrap()).as_bytes()
        );
    }

    #[test]
    fn narrow_rows_are_prefixes_of_tiles() {
        // A 64-wide FP4 row is the first 4 tiles of a 512-wide one with the same leading values.
        let wide = row(512);
        let l = RowLayout::new(EntryFormat::GlobalFp4, 64).unwrap();
        assert_eq!(l.bytes(), 36);
        let mut narrow = vec![0u8; 36];
        l.quantize(&wide[..64], &mut narrow).unwrap();
        let full = quantize_global_fp4(wide.as_slice().try_into().unwrap());
        assert_eq!(&narrow[..32], &full.values[..32]);
        assert_eq!(&narrow[32..], &full.scales[..4]);
        let mut back = vec![0f32; 64];
        l.dequantize(&narrow, &mut back).unwrap();
        assert!(
            back.iter()
                .zip(&wide[..64])
                .all(|(a, b)| (a - b).abs() <= b.abs() * 0.25 + 0.1)
        );
    }

    #[test]
    fn bad_widths_and_lengths_are_errors() {
        assert!(matches!(
            RowLayout::new(EntryFormat::IndexMxfp4, 48),
            Err(Error::RowWidth {
                dim: 48,
                tile: 32,
                ..
            })
        ));
        let l = RowLayout::new(EntryFormat::WindowFp8, 64).unwrap();
        let err = l.quantize(&[0.0; 63], &mut [0; 66]).unwrap_err();
        assert!(err.to_string().contains("63"), "{err}");
    }
}
