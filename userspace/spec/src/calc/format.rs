//! Storage formats of cache entries and their sizes, derived from the entry dimensions.
//!
//! Sizes are computed, never tabled: value bytes from the element width, plus scale bytes from
//! the tile size. The tile sizes of the three kvstack formats come from
//! `kvstack-firmware-interface`, so the spec's 528 / 288 / 68 bytes fall out of the same
//! constants the codecs use (checked in the tests below).

use std::fmt;
use std::str::FromStr;

use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;

use crate::error::Error;

/// Bytes of one BF16 element.
pub const BF16_BYTES: u64 = 2;
/// Bytes of one f32 (scales, compressor state).
pub const F32_BYTES: u64 = 4;
/// FP8 E4M3 elements per UE8M0 scale in the spec §5.1 layout (32).
pub const FP8_TILE: u64 = WindowFp8Entry::TILE as u64;
/// FP4 E2M1 elements per E4M3 scale in the spec §5.2 layout (16).
pub const FP4_TILE: u64 = GlobalFp4Entry::TILE as u64;
/// MXFP4 elements per UE8M0 scale in the spec §5.3 layout (32).
pub const MXFP4_TILE: u64 = IndexMxfp4Entry::TILE as u64;
/// V3.2 FP8 MLA entry: non-RoPE FP8 elements per f32 scale (128).
pub const FP8_MLA_TILE: u64 = 128;
/// V4 FP8 entry: non-RoPE FP8 elements per UE8M0 scale (64).
pub const V4_FP8_TILE: u64 = 64;
/// V4 FP8 entry: the scale bytes are padded to a multiple of this (8).
pub const V4_SCALE_ALIGN: u64 = 8;
/// V3.2 FP8 indexer key: FP8 elements per f32 scale (128).
pub const INDEX_FP8_TILE: u64 = 128;

/// Storage format of one persistent (global) KV vector; also used for the window entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GlobalFormat {
    /// BF16, every dimension: `2 * dim` bytes.
    Bf16,
    /// FP8 E4M3 over every dimension (RoPE dims included) with one UE8M0 scale per 32 values
    /// (spec §5.1): `dim + ceil(dim / 32)`; 528 for 512.
    Fp8,
    /// FP4 E2M1, two per byte, with one E4M3 scale per 16 values (spec §5.2):
    /// `ceil(dim / 2) + ceil(dim / 16)`; 288 for 512.
    Fp4,
    /// V3.2's FP8 MLA entry: the non-RoPE dims FP8 with one f32 scale per 128, the RoPE dims
    /// BF16: `nope + 4 * ceil(nope / 128) + 2 * rope`; 656 for 512 + 64.
    Fp8Mla,
    /// V4's entry: the non-RoPE dims FP8, the RoPE dims BF16, one UE8M0 scale per 64 FP8 values
    /// padded to 8 bytes: `nope + 2 * rope + round_up(ceil(nope / 64), 8)`; 584 for 448 + 64.
    Fp8NopeBf16Rope,
}

impl GlobalFormat {
    /// Every format.
    pub const ALL: [GlobalFormat; 5] = [
        GlobalFormat::Bf16,
        GlobalFormat::Fp8,
        GlobalFormat::Fp4,
        GlobalFormat::Fp8Mla,
        GlobalFormat::Fp8NopeBf16Rope,
    ];

    /// The command-line name (`bf16`, `fp8`, `fp4`, `fp8-mla`, `fp8-nope-bf16-rope`).
    pub const fn name(self) -> &'static str {
        match self {
            GlobalFormat::Bf16 => "bf16",
            GlobalFormat::Fp8 => "fp8",
            GlobalFormat::Fp4 => "fp4",
            GlobalFormat::Fp8Mla => "fp8-mla",
            GlobalFormat::Fp8NopeBf16Rope => "fp8-nope-bf16-rope",
        }
    }

    /// Whether the format stores the RoPE dims differently from the rest (and so needs a
    /// decoupled RoPE part, which GQA keys do not have).
    pub const fn splits_rope(self) -> bool {
        matches!(self, GlobalFormat::Fp8Mla | GlobalFormat::Fp8NopeBf16Rope)
    }

    /// Bytes of one stored vector of `dim` values whose last `rope_dims` are RoPE dims.
    /// `None` when the format splits RoPE dims and `rope_dims` is `None` or exceeds `dim`.
    pub fn vector_bytes(self, dim: u64, rope_dims: Option<u64>) -> Option<u64> {
        match self {
            GlobalFormat::Bf16 => dim.checked_mul(BF16_BYTES),
            GlobalFormat::Fp8 => dim.checked_add(dim.div_ceil(FP8_TILE)),
            GlobalFormat::Fp4 => dim.div_ceil(2).checked_add(dim.div_ceil(FP4_TILE)),
            GlobalFormat::Fp8Mla => {
                let rope = rope_dims?;
                let nope = dim.checked_sub(rope)?;
                nope.checked_add(nope.div_ceil(FP8_MLA_TILE).checked_mul(F32_BYTES)?)?
                    .checked_add(rope.checked_mul(BF16_BYTES)?)
            }
            GlobalFormat::Fp8NopeBf16Rope => {
                let rope = rope_dims?;
                let nope = dim.checked_sub(rope)?;
                let scales = nope
                    .div_ceil(V4_FP8_TILE)
                    .checked_next_multiple_of(V4_SCALE_ALIGN)?;
                nope.checked_add(rope.checked_mul(BF16_BYTES)?)?
                    .checked_add(scales)
            }
        }
    }
}

impl fmt::Display for GlobalFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for GlobalFormat {
    type Err = Error;

    /// Parses a [`GlobalFormat::name`] (case-insensitive).
    fn from_str(s: &str) -> Result<GlobalFormat, Error> {
        GlobalFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownFormat {
                kind: "global",
                name: s.to_owned(),
                expected: names(GlobalFormat::ALL.map(GlobalFormat::name)),
            })
    }
}

/// Storage format of one indexer key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum IndexFormat {
    /// BF16: `2 * dim` bytes (the uncompressed reference of the levers).
    Bf16,
    /// FP8 E4M3 with one f32 scale per 128 values (V3.2): `dim + 4 * ceil(dim / 128)`; 132 for
    /// 128.
    Fp8,
    /// MXFP4 (spec §5.3): E2M1 two per byte, one UE8M0 scale per 32 values:
    /// `ceil(dim / 2) + ceil(dim / 32)`; 68 for 128.
    Mxfp4,
}

impl IndexFormat {
    /// Every format.
    pub const ALL: [IndexFormat; 3] = [IndexFormat::Bf16, IndexFormat::Fp8, IndexFormat::Mxfp4];

    /// The command-line name (`bf16`, `fp8`, `mxfp4`).
    pub const fn name(self) -> &'static str {
        match self {
            IndexFormat::Bf16 => "bf16",
            IndexFormat::Fp8 => "fp8",
            IndexFormat::Mxfp4 => "mxfp4",
        }
    }

    /// Bytes of one key of `dim` values (`None` on overflow).
    pub fn key_bytes(self, dim: u64) -> Option<u64> {
        match self {
            IndexFormat::Bf16 => dim.checked_mul(BF16_BYTES),
            IndexFormat::Fp8 => {
                dim.checked_add(dim.div_ceil(INDEX_FP8_TILE).checked_mul(F32_BYTES)?)
            }
            IndexFormat::Mxfp4 => dim.div_ceil(2).checked_add(dim.div_ceil(MXFP4_TILE)),
        }
    }
}

impl fmt::Display for IndexFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IndexFormat {
    type Err = Error;

    /// Parses an [`IndexFormat::name`] (case-insensitive).
    fn from_str(s: &str) -> Result<IndexFormat, Error> {
        IndexFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::UnknownFormat {
                kind: "index",
                name: s.to_owned(),
                expected: names(IndexFormat::ALL.map(IndexFormat::name)),
            })
    }
}

fn names<const N: usize>(names: [&str; N]) -> String {
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstack_firmware_interface::EntryFormat;

    #[test]
    fn kvstack_entry_sizes_come_out_of_the_formulas() {
        let d = |f: EntryFormat| f.dim() as u64;
        let b = |f: EntryFormat| f.entry_bytes() as u64;
        assert_eq!(
            GlobalFormat::Fp8.vector_bytes(d(EntryFormat::WindowFp8), Some(64)),
            Some(b(EntryFormat::WindowFp8))
        );
        assert_eq!(
            GlobalFormat::Fp4.vector_bytes(d(EntryFormat::GlobalFp4), Some(64)),
            Some(b(EntryFormat::GlobalFp4))
        );
        assert_eq!(
            IndexFormat::Mxfp4.key_bytes(d(EntryFormat::IndexMxfp4)),
            Some(b(EntryFormat::IndexMxfp4))
        );
        assert_eq!(GlobalFormat::Fp8.vector_bytes(512, None), Some(528));
        assert_eq!(GlobalFormat::Fp4.vector_bytes(512, None), Some(288));
        assert_eq!(IndexFormat::Mxfp4.key_bytes(128), Some(68));
    }

    #[test]
    fn deployed_entry_sizes_of_older_generations() {
        // V3.2: 512 FP8 + 4 f32 scales + 64 BF16 RoPE dims.
        assert_eq!(GlobalFormat::Fp8Mla.vector_bytes(576, Some(64)), Some(656));
        // V4: 448 FP8 + 64 BF16 RoPE dims + 7 UE8M0 scales padded to 8.
        assert_eq!(
            GlobalFormat::Fp8NopeBf16Rope.vector_bytes(512, Some(64)),
            Some(584)
        );
        assert_eq!(IndexFormat::Fp8.key_bytes(128), Some(132));
        assert_eq!(GlobalFormat::Bf16.vector_bytes(576, Some(64)), Some(1152));
        assert_eq!(IndexFormat::Bf16.key_bytes(128), Some(256));
        // Split formats need a RoPE part no wider than the vector.
        assert_eq!(GlobalFormat::Fp8Mla.vector_bytes(576, None), None);
        assert_eq!(
            GlobalFormat::Fp8NopeBf16Rope.vector_bytes(32, Some(64)),
            None
        );
        // The tiny CSA2 model of shared/vectors/csa2: head_dim 64, index_head_dim 32.
        assert_eq!(GlobalFormat::Fp4.vector_bytes(64, Some(16)), Some(36));
        assert_eq!(GlobalFormat::Fp8.vector_bytes(64, Some(16)), Some(66));
        assert_eq!(IndexFormat::Mxfp4.key_bytes(32), Some(17));
    }

    #[test]
    fn names_parse() {
        for f in GlobalFormat::ALL {
            assert_eq!(f.name().parse::<GlobalFormat>().unwrap(), f);
        }
        for f in IndexFormat::ALL {
            assert_eq!(f.name().parse::<IndexFormat>().unwrap(), f);
        }
        assert_eq!("FP4".parse::<GlobalFormat>().unwrap(), GlobalFormat::Fp4);
        let err = "mxfp4".parse::<GlobalFormat>().unwrap_err();
        assert!(err.to_string().contains("bf16, fp8, fp4"), "{err}");
        assert!("fp4".parse::<IndexFormat>().is_err());
    }
}
