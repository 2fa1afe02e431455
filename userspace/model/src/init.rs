//! Seeded random checkpoints of any valid V4.1 config (`kvstack model init`) and the
//! in-memory default model of `kvstack run`.
//!
//! Every tensor is drawn from its own generator (SplitMix64 seeded by the seed and a BLAKE3 hash
//! of the tensor's released name), so values do not depend on the order tensors are requested
//! in, and a model generated in memory ([`Generator`] as a [`TensorSource`]) equals the same
//! seed's checkpoint file loaded back, bit for bit.
//!
//! Initialization (the reference's recipe for its tiny model, `shared/vectors/csa2/README.md`):
//! embeddings N(0, 1); linears N(0, 1/fan_in), except routed-expert gate/up 4/sqrt(fan_in) (so
//! the SwiGLU clamp is exercised) and expert/shared down 1/(32 sqrt(fan_in)); RMSNorm scales
//! 1 + 0.1 N; sinks N(0, 1); HC `fn` N(0, 1/fan_in), `base` 0.5 N, `scale` U(0.5, 0.75);
//! correction bias 0.1 N; antipodal index heads (indexer `wq_b` rows of head 2m+1 are minus
//! head 2m's, so index scores are never exactly 0).
//!
//! Storage follows the release (spec §9): `attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `attn.indexer.wq_b`
//! and `ffn.shared_experts.w{1,2,3}` FP8 E4M3 with `<name>.scale` UE8M0 over 128 x 128 blocks;
//! routed experts packed FP4 E2M1 (`I8` `[out, in / 2]`) with UE8M0 scales per row and 32
//! columns; embedding, head, `indexer.wk` and `indexer.weights_proj` BF16; the rest F32. The
//! generator applies the same rounding, so a file and the in-memory model agree.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

use kvstack_firmware_interface::element::ue8m0_to_f32;
use safetensors::tensor::TensorView;

use crate::attention::AttentionDims;
use crate::weights::{Dtype, RawTensor};
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::LayerPlan;

use crate::Error;
use crate::checkpoint::{ModelWeights, TensorSource};
use crate::dims::ModelDims;
use crate::forward::Model;
use crate::storage::{
    StoredMatrix, WeightPrecision, dequantize_fp4, dequantize_fp8, encode_fp4, encode_fp8,
    f32_from_bf16, stored_matrix,
};

/// FP8 block shape of the release.
const FP8_BLOCK: usize = 128;
/// FP4 scale group (columns) of the release.
const FP4_BLOCK: usize = 32;

/// How a tensor is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Storage {
    F32,
    Bf16,
    Fp8,
    Fp4,
}

fn storage_of(name: &str) -> Storage {
    const FP8: [&str; 9] = [
        "attn.wq_a.weight",
        "attn.wq_b.weight",
        "attn.wkv.weight",
        "attn.wo_a.weight",
        "attn.wo_b.weight",
        "attn.indexer.wq_b.weight",
        "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w2.weight",
        "ffn.shared_experts.w3.weight",
    ];
    if FP8.iter().any(|s| name.ends_with(s)) {
        Storage::Fp8
    } else if name.contains(".ffn.experts.") {
        Storage::Fp4
    } else if name == "embed.weight"
        || name == "head.weight"
        || name.ends_with("indexer.wk.weight")
        || name.ends_with("indexer.weights_proj.weight")
    {
        Storage::Bf16
    } else {
        Storage::F32
    }
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    f32_from_bf16(r as u16)
}

/// A seeded tensor generator in the released naming; as a [`TensorSource`] it yields each
/// tensor as stored and dequantized.
#[derive(Debug)]
pub struct Generator {
    seed: u64,
    index_head_dim: usize,
    /// Tensors requested so far (name, logical shape), in order.
    requested: RefCell<Vec<(String, Vec<usize>)>>,
}

impl Generator {
    /// A generator for `seed`; `index_head_dim` makes the indexer heads antipodal.
    pub fn new(seed: u64, index_head_dim: usize) -> Generator {
        Generator {
            seed,
            index_head_dim,
            requested: RefCell::new(Vec::new()),
        }
    }

    /// The raw (unrounded) f32 values of `name`.
    fn raw(&self, name: &str, shape: &[usize]) -> Vec<f32> {
        let h = blake3::hash(name.as_bytes());
        let mut k = [0u8; 8];
        k.copy_from_slice(&h.as_bytes()[..8]);
        let mut rng = Rng(self.seed ^ u64::from_le_bytes(k));
        let n: usize = shape.iter().product();
        let fan_in = shape.last().copied().unwrap_or(1).max(1) as f32;
        let std = 1.0 / fan_in.sqrt();
        let is = |s: &str| name.ends_with(s);
        let mut v: Vec<f32> = if name == "embed.weight" || is("attn_sink") {
            (0..n).map(|_| rng.normal()).collect()
        } else if is("norm.weight") {
            (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect()
        } else if is("_base") {
            (0..n).map(|_| 0.5 * rng.normal()).collect()
        } else if is("_scale") && name.contains(".hc_") {
            (0..n).map(|_| 0.5 + 0.25 * rng.uniform() as f32).collect()
        } else if is("ffn.gate.bias") {
            (0..n).map(|_| 0.1 * rng.normal()).collect()
        } else if name.contains(".ffn.experts.") && (is("w1.weight") || is("w3.weight")) {
            (0..n).map(|_| 4.0 * std * rng.normal()).collect()
        } else if name.contains("experts.") && is("w2.weight") {
            (0..n).map(|_| std / 32.0 * rng.normal()).collect()
        } else {
            (0..n).map(|_| std * rng.normal()).collect()
        };
        if is("indexer.wq_b.weight") && self.index_head_dim > 0 {
            let cols = shape.get(1).copied().unwrap_or(1);
            let head = self.index_head_dim * cols;
            for pair in v.chunks_exact_mut(2 * head) {
                let (a, b) = pair.split_at_mut(head);
                b.iter_mut().zip(a.iter()).for_each(|(b, &a)| *b = -a);
            }
        }
        v
    }

    /// The stored form of `name`: (tensors to write: name, dtype, shape, bytes) and the values
    /// it loads back as.
    #[allow(clippy::type_complexity)]
    fn stored(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(Vec<(String, Dtype, Vec<usize>, Vec<u8>)>, Vec<f32>), Error> {
        let x = self.raw(name, shape);
        let bad = |reason: String| Error::Storage {
            path: "<generator>".into(),
            name: name.to_owned(),
            reason,
        };
        let matrix = || match shape {
            [r, c] => Ok((*r, *c)),
            _ => Err(bad(format!(
                "quantized storage needs a matrix, not {shape:?}"
            ))),
        };
        let scale_name = format!("{}.scale", name.strip_suffix(".weight").unwrap_or(name));
        Ok(match storage_of(name) {
            Storage::F32 => (
                vec![(
                    name.to_owned(),
                    Dtype::F32,
                    shape.to_vec(),
                    x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )],
                x,
            ),
            Storage::Bf16 => {
                let y: Vec<f32> = x.iter().map(|&v| bf16_round(v)).collect();
                let bytes = y
                    .iter()
                    .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                    .collect();
                (
                    vec![(name.to_owned(), Dtype::BF16, shape.to_vec(), bytes)],
                    y,
                )
            }
            Storage::Fp8 => {
                let (r, c) = matrix()?;
                let (codes, s) = encode_fp8(&x, r, c, FP8_BLOCK, FP8_BLOCK);
                let (sr, sc) = (r.div_ceil(FP8_BLOCK), c.div_ceil(FP8_BLOCK));
                let sv: Vec<f32> = s.iter().map(|&e| ue8m0_to_f32(e)).collect();
                let y = dequantize_fp8(&codes, r, c, &sv, sr, sc).map_err(bad)?;
                (
                    vec![
                        (name.to_owned(), Dtype::F8_E4M3, shape.to_vec(), codes),
                        (scale_name, Dtype::F8_E8M0, vec![sr, sc], s),
                    ],
                    y,
                )
            }
            Storage::Fp4 => {
                let (r, c) = matrix()?;
                if !c.is_multiple_of(2) {
                    return Err(bad(format!("FP4 packing needs an even width, not {c}")));
                }
                let (packed, s) = encode_fp4(&x, r, c, FP4_BLOCK);
                let sc = c.div_ceil(FP4_BLOCK);
                let sv: Vec<f32> = s.iter().map(|&e| ue8m0_to_f32(e)).collect();
                let y = dequantize_fp4(&packed, r, c, &sv, r, sc).map_err(bad)?;
                (
                    vec![
                        (name.to_owned(), Dtype::I8, vec![r, c / 2], packed),
                        (scale_name, Dtype::F8_E8M0, vec![r, sc], s),
                    ],
                    y,
                )
            }
        })
    }
}

impl TensorSource for Generator {
    fn contains(&self, name: &str) -> bool {
        name == "embed.weight"
    }

    fn load(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, Error> {
        self.requested
            .borrow_mut()
            .push((name.to_owned(), shape.to_vec()));
        Ok(self.stored(name, shape)?.1)
    }

    fn load_stored(&self, name: &str, shape: &[usize]) -> Result<StoredMatrix, Error> {
        self.requested
            .borrow_mut()
            .push((name.to_owned(), shape.to_vec()));
        let (tensors, _) = self.stored(name, shape)?;
        fn raw(t: &(String, Dtype, Vec<usize>, Vec<u8>)) -> RawTensor<'_> {
            RawTensor {
                dtype: t.1,
                shape: &t.2,
                data: &t.3,
            }
        }
        stored_matrix(
            &self.describe(),
            name,
            tensors.first().map(raw),
            tensors.get(1).map(|t| (t.0.clone(), raw(t))),
            shape,
        )
    }

    fn describe(&self) -> std::path::PathBuf {
        format!("<generated, seed {}>", self.seed).into()
    }
}

fn parts(cfg: &ModelConfig) -> Result<(ModelDims, AttentionDims, LayerPlan), Error> {
    let plan = LayerPlan::from_config(cfg).map_err(Error::AttentionConfig)?;
    let ad = AttentionDims::from_config(cfg, &plan)?;
    let md = ModelDims::from_config(cfg)?;
    Ok((md, ad, plan))
}

/// The model of `cfg` with weights generated from `seed`, in memory (linear weights in their
/// stored formats).
pub fn random_model(cfg: &ModelConfig, seed: u64) -> Result<Model, Error> {
    random_model_with(cfg, seed, WeightPrecision::Stored)
}

/// [`random_model`] with linear weights at `precision`.
pub fn random_model_with(
    cfg: &ModelConfig,
    seed: u64,
    precision: WeightPrecision,
) -> Result<Model, Error> {
    let (md, ad, plan) = parts(cfg)?;
    let g = Generator::new(seed, ad.index_head_dim);
    let w = ModelWeights::load_with(&g, &md, &ad, &plan, precision)?;
    Model::new(cfg, w)
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSummary {
    /// Tensors written (scales included).
    pub tensors: usize,
    /// Bytes of tensor data.
    pub bytes: u64,
    /// Parameters (logical elements, scales excluded).
    pub parameters: u64,
}

/// One tensor as stored: its name, dtype, shape and bytes.
type Stored = (String, Dtype, Vec<usize>, Vec<u8>);

/// Every stored tensor of `cfg`'s seeded checkpoint, one group per logical tensor (the tensor,
/// then its scales), in the order the loader requests them; and the parameter count.
fn stored_groups(cfg: &ModelConfig, seed: u64) -> Result<(Vec<Vec<Stored>>, u64), Error> {
    let (md, ad, plan) = parts(cfg)?;
    let g = Generator::new(seed, ad.index_head_dim);
    // Loading through the generator both checks the config and lists every tensor needed.
    ModelWeights::load_from(&g, &md, &ad, &plan)?;
    let mut groups = Vec::new();
    let mut parameters = 0u64;
    for (name, shape) in g.requested.borrow().iter() {
        parameters += shape.iter().product::<usize>() as u64;
        groups.push(g.stored(name, shape)?.0);
    }
    Ok((groups, parameters))
}

/// Writes `tensors` as one safetensors file at `path`, with the generator's metadata.
fn write_file(tensors: &[&Stored], seed: u64, path: &Path) -> Result<(), Error> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| Error::Storage {
                    path: path.to_path_buf(),
                    name: n.clone(),
                    reason: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta: HashMap<String, String> = [
        ("generator".to_owned(), "kvstack model init".to_owned()),
        ("seed".to_owned(), seed.to_string()),
    ]
    .into();
    safetensors::serialize_to_file(views, Some(meta), path).map_err(|e| Error::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })
}

/// Writes the seeded random checkpoint of `cfg` to `path` (released naming and storage).
pub fn write_checkpoint(
    cfg: &ModelConfig,
    seed: u64,
    path: &Path,
) -> Result<CheckpointSummary, Error> {
    let (groups, parameters) = stored_groups(cfg, seed)?;
    let all: Vec<&Stored> = groups.iter().flatten().collect();
    write_file(&all, seed, path)?;
    Ok(CheckpointSummary {
        tensors: all.len(),
        bytes: all.iter().map(|t| t.3.len() as u64).sum(),
        parameters,
    })
}

/// The released shard file name of shard `i` (from 0) of `n`.
pub fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
}

/// Writes the seeded random checkpoint of `cfg` into directory `dir` as `shards` shards in
/// the released layout: `model-0000i-of-0000N.safetensors` and
/// [`crate::shards::INDEX_FILE`] (`metadata.total_size` and `weight_map`). Tensors keep the
/// loader's order and are cut into shards of about equal bytes; a tensor's scales stay in its
/// shard. The weights equal [`write_checkpoint`]'s for the same seed, bit for bit.
///
/// # Errors
/// [`Error::ModelInput`] when `shards` is 0 or exceeds the number of tensors;
/// [`Error::Write`] when a file cannot be written.
pub fn write_sharded_checkpoint(
    cfg: &ModelConfig,
    seed: u64,
    dir: &Path,
    shards: usize,
) -> Result<CheckpointSummary, Error> {
    let (groups, parameters) = stored_groups(cfg, seed)?;
    if shards == 0 || shards > groups.len() {
        return Err(Error::ModelInput(format!(
            "--shards {shards}: must be 1..={} (the checkpoint has that many tensors)",
            groups.len()
        )));
    }
    let bytes_of = |g: &Vec<Stored>| g.iter().map(|t| t.3.len() as u64).sum::<u64>();
    let total: u64 = groups.iter().map(bytes_of).sum();
    // Shard k takes groups until the running total passes (k + 1) / n of all bytes, leaving
    // at least one group for each shard after it.
    let mut assignment = Vec::with_capacity(groups.len());
    let (mut k, mut acc) = (0usize, 0u64);
    for (i, g) in groups.iter().enumerate() {
        let left_after = groups.len() - i;
        let need_after = shards - k - 1;
        let boundary = total / shards as u64 * (k as u64 + 1);
        let started = assignment.last() == Some(&k);
        if k + 1 < shards && started && (acc >= boundary || left_after == need_after) {
            k += 1;
        }
        assignment.push(k);
        acc += bytes_of(g);
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut weight_map = serde_json::Map::new();
    for shard in 0..shards {
        let name = shard_name(shard, shards);
        let part: Vec<&Stored> = groups
            .iter()
            .zip(&assignment)
            .filter(|(_, a)| **a == shard)
            .flat_map(|(g, _)| g.iter())
            .collect();
        for t in &part {
            weight_map.insert(t.0.clone(), serde_json::Value::String(name.clone()));
        }
        write_file(&part, seed, &dir.join(&name))?;
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total, "generator": "kvstack model init", "seed": seed},
        "weight_map": weight_map,
    });
    let path = dir.join(crate::shards::INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).map_err(|e| Error::Write {
        path: path.clone(),
        source: std::io::Error::other(e.to_string()),
    })?;
    std::fs::write(&path, text + "\n").map_err(|source| Error::Write { path, source })?;
    Ok(CheckpointSummary {
        tensors: groups.iter().map(Vec::len).sum(),
        bytes: total,
        parameters,
    })
}
