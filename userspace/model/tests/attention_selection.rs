//! The reference's top-k sentinel semantics on `selection_demo.safetensors`: a Reindex
//! indexer over a crafted sparse candidate state, where many rows have fewer than k
//! candidates and the reference's `-1` slots fall between valid indices.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use kvstack_firmware_interface::EntryFormat;
use kvstack_kernels::csa2::gemm::linear;
use kvstack_kernels::csa2::indexer::{IndexQuery, scale_head_weights};
use kvstack_kernels::csa2::quant::RowCodec;
use kvstack_kernels::csa2::topk::{topk, topk_ref};
use kvstack_model::attention::AttentionDims;
use kvstack_model::weights::TensorFile;
use kvstack_spec::{LayerPlan, ModelConfig};

fn dir() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/vectors/csa2"
    ))
}

#[test]
fn reindex_selection_demo_reproduces_the_reference_sets() {
    let cfg = ModelConfig::from_file(dir().join("config.json")).unwrap();
    let plan = LayerPlan::from_config(&cfg).unwrap();
    let dims = AttentionDims::from_config(&cfg, &plan).unwrap();
    let f = TensorFile::open(dir().join("selection_demo.safetensors")).unwrap();
    let t = f.shape("hidden_states").unwrap()[1];
    let (ih, id, k) = (dims.index_heads, dims.index_head_dim, dims.index_topk);
    // A ratio-1 Reindex layer: rotation of a compressed layer, positions = token positions.
    let spec = plan.layers.iter().find(|l| l.uses_candidates).unwrap();
    let rope = dims.rope(spec).unwrap();
    let angles = f.f32("angles", &[1, t, rope.rope_dim() / 2]).unwrap();
    let mut a = vec![0f32; rope.rope_dim() / 2];
    for p in 0..t {
        rope.angles(p as u64, &mut a).unwrap();
        assert_eq!(
            a,
            angles[p * a.len()..(p + 1) * a.len()],
            "angles of position {p}"
        );
    }
    let hidden = f.f32("hidden_states", &[1, t, dims.hidden]).unwrap();
    let ql = f.f32("query_latent", &[1, t, dims.q_lora_rank]).unwrap();
    let wq_b = f
        .f32("indexer.wq_b.weight", &[ih * id, dims.q_lora_rank])
        .unwrap();
    let wp = f
        .f32("indexer.weights_proj.weight", &[ih, dims.hidden])
        .unwrap();
    let keys = f.f32("index_keys", &[1, t, id]).unwrap();
    let cand = f.u8("candidates", &[1, t, t]).unwrap();
    let raw = f.i64("topk_indices", &[1, t, k]).unwrap();
    let canonical = f.i64("topk_indices_canonical", &[1, t, k]).unwrap();

    let codec = RowCodec::new(EntryFormat::IndexMxfp4, id).unwrap();
    let mut q = vec![0f32; t * ih * id];
    linear(&ql, &wq_b, t, dims.q_lora_rank, ih * id, &mut q).unwrap();
    let positions: Vec<u64> = (0..t as u64).collect();
    rope.rotate_rows(&mut q, ih * id, id, &positions, false)
        .unwrap();
    let mut qrows = vec![0u8; t * ih * codec.bytes()];
    codec.quantize(&q, &mut qrows).unwrap();
    let mut w = vec![0f32; t * ih];
    linear(&hidden, &wp, t, dims.hidden, ih, &mut w).unwrap();
    scale_head_weights(&mut w, id, ih);
    let mut krows = vec![0u8; t * codec.bytes()];
    codec.quantize(&keys, &mut krows).unwrap();

    let qb = ih * codec.bytes();
    let mut between = 0;
    for i in 0..t {
        let iq = IndexQuery::new(
            codec.layout(),
            &qrows[i * qb..(i + 1) * qb],
            &w[i * ih..(i + 1) * ih],
        )
        .unwrap();
        // Ratio 1: query i sees entries 0..=i; outside the candidate pool -inf.
        let scores: Vec<f32> = (0..t)
            .map(|j| {
                if j <= i && cand[i * t + j] != 0 {
                    iq.score(&krows[j * codec.bytes()..(j + 1) * codec.bytes()])
                        .unwrap()
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mut fast = vec![0; k];
        let mut slow = vec![0; k];
        topk(&scores, k, &mut fast).unwrap();
        topk_ref(&scores, k, &mut slow).unwrap();
        let set = |r: &[i32]| {
            r.iter()
                .filter(|&&j| j >= 0)
                .map(|&j| i64::from(j))
                .collect::<BTreeSet<_>>()
        };
        let want: BTreeSet<i64> = raw[i * k..(i + 1) * k]
            .iter()
            .copied()
            .filter(|&j| j >= 0)
            .collect();
        assert_eq!(set(&fast), want, "row {i}");
        assert_eq!(set(&slow), want, "row {i}");
        // The canonical layout is exactly ours: valid ascending, then -1.
        let ours: Vec<i64> = fast.iter().map(|&j| i64::from(j)).collect();
        assert_eq!(ours, canonical[i * k..(i + 1) * k], "row {i}");
        // Count reference rows whose -1 sits before a valid index.
        let r = &raw[i * k..(i + 1) * k];
        if r.iter()
            .enumerate()
            .any(|(p, &j)| j < 0 && r[p..].iter().any(|&x| x >= 0))
        {
            between += 1;
        }
    }
    assert!(between > 0, "the demo shows -1 between valid indices");
}
