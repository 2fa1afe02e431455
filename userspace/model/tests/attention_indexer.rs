//! The indexer at the deployed shape (32 heads x 128, the built-in model) goes through the
//! integer scan of `kvstack_kernels::attn`; its scores must be bit-identical to the exact
//! per-key path (`kvstack_kernels::csa2::indexer`), with one query and with a prefill step's
//! many queries split over threads.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::EntryFormat;
use kvstack_kernels::csa2::indexer::IndexQuery;
use kvstack_model::init::random_model;
use kvstack_spec::builtin::tiny_config;
use kvstack_spec::plan::LayerMode;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

#[test]
fn fast_indexer_scan_equals_the_exact_path() {
    let cfg = tiny_config().unwrap();
    let mut model = random_model(&cfg, 3).unwrap();
    let layer = model
        .attention()
        .plan()
        .layers
        .iter()
        .find(|s| s.mode == LayerMode::Full && s.compress_ratio == 2)
        .unwrap()
        .index;
    let codec = model.attention().key_codec().unwrap();
    assert_eq!(codec.dim(), 128);
    let heads = 32;
    let width = 700usize;
    let mut rng = Rng(0x9e37_79b9);
    let mut quant = |rows: usize, scale: f32| {
        let v: Vec<f32> = (0..rows * 128).map(|_| rng.next() * scale).collect();
        let mut out = vec![0u8; rows * codec.bytes()];
        kvstack_kernels::quantize(EntryFormat::IndexMxfp4, &v, &mut out).unwrap();
        out
    };
    let keys = quant(width, 3.0);
    let positions: Vec<u64> = (1300..1340).collect();
    let n = positions.len();
    let q_rows = quant(n * heads, 2.0);
    let mut rng = Rng(77);
    let weights: Vec<f32> = (0..n * heads).map(|_| rng.next() * 0.1).collect();
    let kb = codec.bytes();
    let key = |j: u64| keys.get(j as usize * kb..(j as usize + 1) * kb);
    for threads in [1, 2] {
        model.set_threads(threads);
        let many = model
            .attention()
            .index_scores(layer, &q_rows, &weights, &positions, width, &key)
            .unwrap();
        let qb = heads * kb;
        for (i, &t) in positions.iter().enumerate() {
            let one = model
                .attention()
                .index_scores(
                    layer,
                    &q_rows[i * qb..(i + 1) * qb],
                    &weights[i * heads..(i + 1) * heads],
                    &[t],
                    width,
                    &key,
                )
                .unwrap();
            let exact = IndexQuery::new(
                codec.layout(),
                &q_rows[i * qb..(i + 1) * qb],
                &weights[i * heads..(i + 1) * heads],
            )
            .unwrap();
            let visible = t.div_ceil(2) as usize;
            for j in 0..width {
                let want = if j < visible.min(width) {
                    exact.score(key(j as u64).unwrap()).unwrap()
                } else {
                    f32::NEG_INFINITY
                };
                assert_eq!(
                    many[i * width + j].to_bits(),
                    want.to_bits(),
                    "threads {threads}, query {i}, key {j}"
                );
                assert_eq!(
                    one[j].to_bits(),
                    want.to_bits(),
                    "single query {i}, key {j}"
                );
            }
        }
    }
}
