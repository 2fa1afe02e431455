//! Hyper-connections, the MoE and the final head against the tiny reference model of
//! `shared/vectors/csa2` (`model_weights.safetensors`, `model_vectors.safetensors`), block by
//! block: each stage is fed the reference's own recorded inputs (the attention output included),
//! so these check the non-attention math of spec §9 in isolation.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_kernels::csa2::gemm::linear;
use kvstack_kernels::csa2::norm::rms_norm;
use kvstack_kernels::linear::PackedLinear;
use kvstack_kernels::model::{Expert, HcMix, HcShape, HcSite, MoeShape};
use safetensors::SafeTensors;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/vectors/csa2");
const T: usize = 64;
const H: usize = 128;
const N: usize = 4;

struct Files {
    weights: Vec<u8>,
    vectors: Vec<u8>,
}

fn f32s(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i64s(st: &SafeTensors<'_>, name: &str) -> Vec<i64> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Worst elementwise relative error, with the denominator floored at 1% of the tensor's largest
/// magnitude: sums of cancelling terms (stream collapses) leave near-zero elements whose own
/// relative error only measures f32 cancellation.
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / (b.abs().max(scale * 1e-2)))
        .fold(0f32, f32::max);
    assert!(
        worst <= rel,
        "{what}: worst relative error {worst:e} > {rel:e}"
    );
}

fn flatten(m: &[HcMix], f: impl Fn(&HcMix) -> &[f32]) -> Vec<f32> {
    m.iter().flat_map(|x| f(x).to_vec()).collect()
}

#[test]
fn hyper_connections_moe_and_head_match_the_reference_model() {
    let files = Files {
        weights: std::fs::read(format!("{DIR}/model_weights.safetensors")).unwrap(),
        vectors: std::fs::read(format!("{DIR}/model_vectors.safetensors")).unwrap(),
    };
    let w = SafeTensors::deserialize(&files.weights).unwrap();
    let v = SafeTensors::deserialize(&files.vectors).unwrap();
    let hc = HcShape {
        streams: N,
        hidden: H,
        sinkhorn_iters: 20,
        eps: 1e-6,
        norm_eps: 1e-20,
    };
    let moe = MoeShape {
        hidden: H,
        inter: 32,
        experts: 8,
        top_k: 2,
        routed_scale: 1.5,
        swiglu_limit: 10.0,
    };
    // The first block reads stream 0 (spec §9).
    let mut prev_pre: Vec<HcMix> = (0..T)
        .map(|_| HcMix {
            pre: vec![1.0, 0.0, 0.0, 0.0],
            ..Default::default()
        })
        .collect();
    let mut streams = f32s(&v, "layers.0.streams_in");
    for l in 0..8 {
        let p = format!("model.layers.{l}.");
        let r = format!("layers.{l}.");
        // The previous block's output streams against the recorded input of this block; then
        // continue from the recorded streams so every block is checked on the reference's
        // inputs (errors do not compound across blocks).
        let recorded = f32s(&v, &format!("{r}streams_in"));
        assert_close(&format!("{r}streams_in"), &streams, &recorded, 1e-4);
        streams = recorded;
        let site = |name: &str| {
            let f = f32s(&w, &format!("{p}{name}.fn"));
            let c = f.len() / (N * H);
            (
                PackedLinear::from_f32(&f, c, N * H).unwrap(),
                f32s(&w, &format!("{p}{name}.base")),
                f32s(&w, &format!("{p}{name}.scale")),
            )
        };

        let (f, b, s) = site("attn_hc");
        let attn_mix = hc
            .mixes(
                &HcSite {
                    proj: &f,
                    base: &b,
                    scale: &s,
                },
                &streams,
                T,
            )
            .unwrap();
        for (key, got) in [
            ("pre", flatten(&attn_mix, |m| &m.pre)),
            ("post", flatten(&attn_mix, |m| &m.post)),
            ("comb", flatten(&attn_mix, |m| &m.comb)),
        ] {
            assert_close(
                &format!("{r}attn_hc.{key}"),
                &got,
                &f32s(&v, &format!("{r}attn_hc.{key}")),
                1e-4,
            );
        }
        let mut x = vec![0f32; T * H];
        hc.collapse(&prev_pre, &streams, &mut x).unwrap();
        let mut normed = vec![0f32; T * H];
        rms_norm(
            &x,
            &f32s(&w, &format!("{p}attn_norm.weight")),
            1e-20,
            &mut normed,
        )
        .unwrap();
        assert_close(
            &format!("{r}attn_input"),
            &normed,
            &f32s(&v, &format!("{r}attn_input")),
            1e-4,
        );

        // Attention itself is checked elsewhere: continue from the reference's output.
        hc.expand(
            &attn_mix,
            &f32s(&v, &format!("{r}attn_output")),
            &mut streams,
        )
        .unwrap();
        let (f, b, s) = site("ffn_hc");
        let ffn_mix = hc
            .mixes(
                &HcSite {
                    proj: &f,
                    base: &b,
                    scale: &s,
                },
                &streams,
                T,
            )
            .unwrap();
        for (key, got) in [
            ("pre", flatten(&ffn_mix, |m| &m.pre)),
            ("post", flatten(&ffn_mix, |m| &m.post)),
            ("comb", flatten(&ffn_mix, |m| &m.comb)),
        ] {
            assert_close(
                &format!("{r}ffn_hc.{key}"),
                &got,
                &f32s(&v, &format!("{r}ffn_hc.{key}")),
                1e-4,
            );
        }
        hc.collapse(&attn_mix, &streams, &mut x).unwrap();
        rms_norm(
            &x,
            &f32s(&w, &format!("{p}ffn_norm.weight")),
            1e-20,
            &mut normed,
        )
        .unwrap();
        let ffn_input = f32s(&v, &format!("{r}ffn_input"));
        assert_close(&format!("{r}ffn_input"), &normed, &ffn_input, 1e-4);

        let gate = PackedLinear::from_f32(&f32s(&w, &format!("{p}ffn.gate.weight")), 8, H).unwrap();
        let routes = moe
            .route(
                &ffn_input,
                &gate,
                &f32s(&w, &format!("{p}ffn.gate.e_score_correction_bias")),
                T,
            )
            .unwrap();
        let want_idx = i64s(&v, &format!("{r}router.indices"));
        let want_w = f32s(&v, &format!("{r}router.weights"));
        for (t, route) in routes.iter().enumerate() {
            let mut got: Vec<(i64, f32)> = route
                .experts
                .iter()
                .map(|&e| e as i64)
                .zip(route.weights.iter().copied())
                .collect();
            let mut want: Vec<(i64, f32)> = want_idx[t * 2..t * 2 + 2]
                .iter()
                .copied()
                .zip(want_w[t * 2..t * 2 + 2].iter().copied())
                .collect();
            got.sort_by_key(|x| x.0);
            want.sort_by_key(|x| x.0);
            for (g, wv) in got.iter().zip(&want) {
                assert_eq!(g.0, wv.0, "{r} token {t}: experts {got:?} vs {want:?}");
                assert!(
                    (g.1 - wv.1).abs() <= 1e-5 * wv.1.abs().max(1.0),
                    "{r} token {t}: weights {got:?} vs {want:?}"
                );
            }
        }
        // Routed experts: [E, hidden, 2*inter] applied as x @ G (gate | up), down [E, inter, hidden].
        let gu = f32s(&w, &format!("{p}ffn.experts.gate_and_up_projs"));
        let down = f32s(&w, &format!("{p}ffn.experts.down_projs"));
        let (i, e_n) = (32, 8);
        let mut w1 = vec![vec![0f32; i * H]; e_n];
        let mut w3 = vec![vec![0f32; i * H]; e_n];
        let mut w2 = vec![vec![0f32; H * i]; e_n];
        for e in 0..e_n {
            for k in 0..H {
                for j in 0..i {
                    w1[e][j * H + k] = gu[e * H * 2 * i + k * 2 * i + j];
                    w3[e][j * H + k] = gu[e * H * 2 * i + k * 2 * i + i + j];
                }
            }
            for j in 0..i {
                for k in 0..H {
                    w2[e][k * i + j] = down[e * i * H + j * H + k];
                }
            }
        }
        let pack = |v: &[f32], n: usize, k: usize| PackedLinear::from_f32(v, n, k).unwrap();
        let packed: Vec<[PackedLinear; 3]> = (0..e_n)
            .map(|e| [pack(&w1[e], i, H), pack(&w2[e], H, i), pack(&w3[e], i, H)])
            .collect();
        let experts: Vec<Expert<'_>> = packed
            .iter()
            .map(|[w1, w2, w3]| Expert { w1, w2, w3 })
            .collect();
        let si = f32s(&w, &format!("{p}ffn.shared_experts.gate_proj.weight")).len() / H;
        let sw1 = pack(
            &f32s(&w, &format!("{p}ffn.shared_experts.gate_proj.weight")),
            si,
            H,
        );
        let sw2 = pack(
            &f32s(&w, &format!("{p}ffn.shared_experts.down_proj.weight")),
            H,
            si,
        );
        let sw3 = pack(
            &f32s(&w, &format!("{p}ffn.shared_experts.up_proj.weight")),
            si,
            H,
        );
        let shared = Expert {
            w1: &sw1,
            w2: &sw2,
            w3: &sw3,
        };
        let mut y = vec![0f32; T * H];
        moe.forward(&ffn_input, T, &routes, &experts, &shared, &mut y)
            .unwrap();
        let ffn_output = f32s(&v, &format!("{r}ffn_output"));
        assert_close(&format!("{r}ffn_output"), &y, &ffn_output, 1e-4);

        hc.expand(&ffn_mix, &ffn_output, &mut streams).unwrap();
        prev_pre = ffn_mix;
    }
    // Final: collapse with the last ffn pre, norm, LM head.
    let mut x = vec![0f32; T * H];
    hc.collapse(&prev_pre, &streams, &mut x).unwrap();
    let mut hidden = vec![0f32; T * H];
    rms_norm(&x, &f32s(&w, "model.norm.weight"), 1e-20, &mut hidden).unwrap();
    assert_close("final_hidden", &hidden, &f32s(&v, "final_hidden"), 1e-4);
    let mut logits = vec![0f32; T * 256];
    linear(&hidden, &f32s(&w, "lm_head.weight"), T, H, 256, &mut logits).unwrap();
    assert_close("logits", &logits, &f32s(&v, "logits"), 1e-4);
}
