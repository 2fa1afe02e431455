//! The attention layer over the paged KV cache at the deployed widths (512-wide FP8 window
//! rows and FP4 entries, 128-wide MXFP4 keys, 64 rotary dims) gives the same bits as over the
//! in-memory store, through prefill chunks and decode steps that wrap the window ring; with 2
//! index heads (the exact per-key scorer) and with the deployed 32 (the integer scan over the
//! cache's pages in place, and a Reindex layer scoring only its candidate pool unless traced).

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_cache::{CacheOptions, KvCache};
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_kernels::linear::PackedLinear;
use kvstack_model::attention::{
    AttentionDims, AttentionWeights, CompressorWeights, Csa2Attention, IndexKeyWeights,
    IndexerWeights, KvStore, LayerTrace, LayerWeights, PagedStore, StepState,
};
use kvstack_spec::plan::LayerMode;
use kvstack_spec::{LayerPlan, ModelConfig};

const CONFIG: &str = r#"{
  "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
  "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
  "sliding_window": 24, "rms_norm_eps": 1e-20, "rope_theta": 10000.0,
  "compress_rope_theta": 160000.0,
  "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                   "beta_fast": 32, "beta_slow": 1},
  "num_hidden_layers": 6, "compress_ratios": [0, 2, 2, 1, 1, 1],
  "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5],
  "candidate_source_layer_id": 3, "candidate_topk_blocks": 2, "candidate_block_size": 8,
  "index_n_heads": 2, "index_head_dim": 128, "index_topk": 8
}"#;

/// A small deterministic generator (no extra dependency).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Sum of uniforms: roughly normal, mean 0, variance 1.
        let u = |x: u64| ((x >> 40) as f32) / (1u64 << 24) as f32;
        let (a, b, c) = (u(self.0), u(self.0 << 12), u(self.0 << 24));
        (a + b + c - 1.5) * 2.0
    }

    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }

    fn linear(&mut self, out: usize, inp: usize) -> PackedLinear {
        PackedLinear::from_f32(&self.vec(out * inp, (inp as f32).powf(-0.5)), out, inp).unwrap()
    }

    fn norm(&mut self, n: usize) -> Vec<f32> {
        self.vec(n, 0.1).iter().map(|v| 1.0 + v).collect()
    }
}

fn model(index_heads: usize) -> (ModelConfig, Csa2Attention) {
    let config = CONFIG.replace(
        r#""index_n_heads": 2"#,
        &format!(r#""index_n_heads": {index_heads}"#),
    );
    let cfg = ModelConfig::from_json_str(&config).unwrap();
    let plan = LayerPlan::from_config(&cfg).unwrap();
    let d = AttentionDims::from_config(&cfg, &plan).unwrap();
    let mut r = Lcg(41);
    let layers = plan
        .layers
        .iter()
        .map(|s| LayerWeights {
            wq_a: r.linear(d.q_lora_rank, d.hidden),
            q_norm: r.norm(d.q_lora_rank),
            wq_b: r.linear(d.q_width(), d.q_lora_rank),
            wkv: r.linear(d.head_dim, d.hidden),
            kv_norm: r.norm(d.head_dim),
            wo_a: (0..d.o_groups)
                .map(|_| r.linear(d.o_lora_rank, d.group_width()))
                .collect(),
            wo_b: r.linear(d.hidden, d.o_groups * d.o_lora_rank),
            sinks: r.vec(d.heads, 1.0),
            compressor: (s.mode == LayerMode::Full).then(|| CompressorWeights {
                wkv: r.linear(d.head_dim, d.hidden),
                wgate: (s.compress_ratio > 1).then(|| r.linear(d.head_dim, d.hidden)),
                norm: r.norm(d.head_dim),
            }),
            indexer: (s.index_source == Some(s.index)).then(|| IndexerWeights {
                wq_b: r.linear(d.index_q_width(), d.q_lora_rank),
                weights_proj: r.linear(d.index_heads, d.hidden),
                keys: s.owns_index_keys().then(|| IndexKeyWeights {
                    wk: r.linear(d.index_head_dim, d.head_dim),
                    k_norm: r.norm(d.index_head_dim),
                }),
            }),
        })
        .collect();
    let attn = Csa2Attention::new(d, plan, AttentionWeights { layers }).unwrap();
    (cfg, attn)
}

/// Runs `steps` (token counts) through `store`, tracing every layer when `traced`; returns
/// every output and top-k row.
fn run(
    attn: &Csa2Attention,
    store: &mut dyn KvStore,
    inputs: &[Vec<f32>],
    steps: &[usize],
    traced: bool,
) -> (Vec<Vec<f32>>, Vec<Vec<i32>>) {
    let d = attn.dims();
    let layers = attn.plan().layers.len();
    let mut outs = vec![Vec::new(); layers];
    let mut topk = vec![Vec::new(); layers];
    let mut start = 0;
    for &n in steps {
        let mut step = StepState::new(n);
        for (l, input) in inputs.iter().enumerate() {
            let x = &input[start * d.hidden..(start + n) * d.hidden];
            let mut trace = LayerTrace::default();
            let tr = traced.then_some(&mut trace);
            outs[l].extend(attn.forward(l, store, &mut step, x, tr).unwrap());
            if let Some(tk) = step.topk() {
                topk[l].extend_from_slice(&tk.rows);
            }
        }
        store.commit(n as u64).unwrap();
        start += n;
    }
    (outs, topk)
}

#[test]
fn paged_cache_store_equals_the_contiguous_store() {
    for index_heads in [2, 32] {
        paged_equals_contiguous(index_heads);
    }
}

fn paged_equals_contiguous(index_heads: usize) {
    let (cfg, attn) = model(index_heads);
    let d = attn.dims().clone();
    let layers = attn.plan().layers.len();
    let mut r = Lcg(7);
    // 31 prefill tokens (one pending compressor token), a chunk of 9, then 25 decode steps:
    // 65 tokens, past the 24-token window ring and several candidate blocks.
    let mut steps = vec![31, 9];
    steps.extend(std::iter::repeat_n(1, 25));
    let total: usize = steps.iter().sum();
    let inputs: Vec<Vec<f32>> = (0..layers).map(|_| r.vec(total * d.hidden, 1.0)).collect();

    let mut contiguous = attn.new_store(None);
    let (want, want_topk) = run(&attn, &mut contiguous, &inputs, &steps, false);
    // Traced, the Reindex layer scores every key instead of its pool: same selections, bits.
    let (traced, traced_topk) = run(&attn, &mut attn.new_store(None), &inputs, &steps, true);
    assert_eq!(
        traced_topk, want_topk,
        "{index_heads} index heads: traced top-k"
    );
    assert!(
        traced == want,
        "{index_heads} index heads: traced outputs differ"
    );

    let options = CacheOptions {
        context_limit: 1024,
        page_tokens: 16,
        max_sequences: 2,
        prefix_index: false,
        memory: PinnedOptions {
            huge_pages: HugePages::Never,
            locking: Locking::Never,
        },
        ..CacheOptions::default()
    };
    let mut cache = KvCache::for_config(&cfg, options).unwrap();
    let seq = cache.create_sequence().unwrap();
    let tokens: Vec<u32> = (0..total as u32).collect();
    {
        let mut paged = PagedStore::new(&mut cache, seq).unwrap();
        // As `run`, with the token ids the cache needs before each step.
        let mut start = 0;
        let mut outs = vec![Vec::new(); layers];
        let mut topk = vec![Vec::new(); layers];
        for &n in &steps {
            paged.begin_step(&tokens[start..start + n]);
            let mut step = StepState::new(n);
            for (l, input) in inputs.iter().enumerate() {
                let x = &input[start * d.hidden..(start + n) * d.hidden];
                outs[l].extend(attn.forward(l, &mut paged, &mut step, x, None).unwrap());
                if let Some(tk) = step.topk() {
                    topk[l].extend_from_slice(&tk.rows);
                }
            }
            paged.commit(n as u64).unwrap();
            start += n;
        }
        assert_eq!(topk, want_topk, "{index_heads} index heads");
        for l in 0..layers {
            assert!(
                outs[l] == want[l],
                "{index_heads} index heads, layer {l}: paged store output differs"
            );
        }
        assert_eq!(paged.len(), total as u64);
    }
    // The cache holds exactly the contiguous store's entries.
    for src in [1usize, 3] {
        let view = cache.global_entries(seq, src).unwrap();
        let bytes: Vec<u8> = view
            .iter()
            .flat_map(|e| zerocopy::IntoBytes::as_bytes(e).to_vec())
            .collect();
        assert_eq!(
            bytes,
            contiguous.compressed_rows(src),
            "entries of layer {src}"
        );
    }
    // Committing with the wrong number of token ids is refused, naming the cause.
    let mut paged = PagedStore::new(&mut cache, seq).unwrap();
    let err = paged.commit(1).unwrap_err();
    assert!(err.to_string().contains("token ids"), "{err}");
}
