//! Sharded checkpoints (`model.safetensors.index.json` and its shards, spec §9): `model init
//! --shards` writes the released layout, it loads lazily to the same model as the single file
//! of the same seed, and a broken index or shard is refused naming the shard and the tensor.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use kvstack_kernels::model::argmax;
use kvstack_model::init::{shard_name, write_checkpoint, write_sharded_checkpoint};
use kvstack_model::shards::INDEX_FILE;
use kvstack_model::weights::TensorFile;
use kvstack_model::{Checkpoint, Logits, Model, WeightPrecision};
use kvstack_spec::config::ModelConfig;

const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../testdata/vectors/csa2/model_config.json"
);

fn config() -> ModelConfig {
    ModelConfig::from_file(CONFIG).unwrap()
}

/// Greedy tokens of `model` after `prompt`.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut store = model.new_store(None);
    let mut logits = model.step(&mut store, prompt, Logits::Last, None).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits).unwrap() as u32;
        out.push(t);
        logits = model.decode(&mut store, t).unwrap();
    }
    out
}

fn index_of(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join(INDEX_FILE)).unwrap()).unwrap()
}

fn write_index(dir: &Path, v: &serde_json::Value) {
    std::fs::write(dir.join(INDEX_FILE), serde_json::to_vec(v).unwrap()).unwrap();
}

fn load_err(cfg: &ModelConfig, dir: &Path) -> String {
    let e = Checkpoint::open(dir).and_then(|ck| Model::load_from(cfg, ck.source()));
    match e {
        Ok(_) => panic!("loaded a broken checkpoint"),
        Err(e) => format!("{e}"),
    }
}

#[test]
fn a_sharded_checkpoint_loads_lazily_and_equals_the_single_file() {
    let cfg = config();
    let tmp = tempfile::tempdir().unwrap();
    let single = tmp.path().join("model.safetensors");
    let dir = tmp.path().join("sharded");
    let a = write_checkpoint(&cfg, 7, &single).unwrap();
    let b = write_sharded_checkpoint(&cfg, 7, &dir, 3).unwrap();
    assert_eq!(a, b, "the same tensors, bytes and parameters");

    // The released layout: three shards named as the release names them, every tensor of the
    // single file mapped to exactly one, a tensor's scales beside it.
    let index = index_of(&dir);
    assert_eq!(index["metadata"]["total_size"], b.bytes);
    let map = index["weight_map"].as_object().unwrap();
    let whole = TensorFile::open(&single).unwrap();
    let mut names: Vec<&String> = map.keys().collect();
    names.sort();
    let mut expected = whole.names();
    expected.sort();
    assert_eq!(names, expected.iter().collect::<Vec<_>>());
    for i in 0..3 {
        let shard = TensorFile::open(dir.join(shard_name(i, 3))).unwrap();
        assert!(!shard.names().is_empty(), "shard {i} is empty");
        for n in shard.names() {
            assert_eq!(map[&n], shard_name(i, 3), "{n}");
        }
    }
    assert_eq!(
        map["layers.0.attn.wq_a.weight"],
        map["layers.0.attn.wq_a.scale"]
    );

    // Opening reads the index only; loading maps every shard.
    let ck = Checkpoint::open(&dir).unwrap();
    let Checkpoint::Sharded(s) = &ck else {
        panic!("a directory opened as {ck:?}")
    };
    assert_eq!(s.shard_paths().len(), 3);
    assert_eq!(s.shards_open(), 0);
    let sharded = Model::load_from(&cfg, ck.source()).unwrap();
    let Checkpoint::Sharded(s) = &ck else {
        unreachable!()
    };
    assert_eq!(s.shards_open(), 3);
    let from_file = Model::load(&cfg, &whole).unwrap();

    // Bit for bit the same model: the same logits and the same greedy tokens.
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 31 + 5) % 256).collect();
    let mut s1 = sharded.new_store(None);
    let mut s2 = from_file.new_store(None);
    assert_eq!(
        sharded.step(&mut s1, &prompt, Logits::All, None).unwrap(),
        from_file.step(&mut s2, &prompt, Logits::All, None).unwrap()
    );
    assert_eq!(greedy(&sharded, &prompt, 8), greedy(&from_file, &prompt, 8));

    // The index path itself opens the same checkpoint; its identity is stable and differs
    // from another seed's.
    let by_index = Checkpoint::open(dir.join(INDEX_FILE)).unwrap();
    assert_eq!(by_index.content_id().unwrap(), ck.content_id().unwrap());
    let other = tmp.path().join("other");
    write_sharded_checkpoint(&cfg, 8, &other, 3).unwrap();
    assert_ne!(
        Checkpoint::open(&other).unwrap().content_id().unwrap(),
        ck.content_id().unwrap()
    );
    // More shards than tensors is refused up front.
    let e = write_sharded_checkpoint(&cfg, 7, &tmp.path().join("x"), 1 << 20).unwrap_err();
    assert!(format!("{e}").contains("--shards"), "{e}");
}

#[test]
fn a_broken_sharded_checkpoint_is_refused_naming_the_shard_and_the_tensor() {
    let cfg = config();
    let tmp = tempfile::tempdir().unwrap();
    let fresh = |name: &str| -> PathBuf {
        let dir = tmp.path().join(name);
        write_sharded_checkpoint(&cfg, 7, &dir, 2).unwrap();
        dir
    };
    let (first, second) = (shard_name(0, 2), shard_name(1, 2));

    // A shard the index names is gone: refused at open, naming it.
    let dir = fresh("missing");
    std::fs::remove_file(dir.join(&second)).unwrap();
    let e = format!("{}", Checkpoint::open(&dir).unwrap_err());
    assert!(e.contains(&second), "{e}");

    // The index sends a tensor to a shard that does not hold it.
    let dir = fresh("moved");
    let mut index = index_of(&dir);
    let owner = index["weight_map"]["embed.weight"]
        .as_str()
        .unwrap()
        .to_owned();
    let wrong = if owner == first { &second } else { &first };
    index["weight_map"]["embed.weight"] = wrong.clone().into();
    write_index(&dir, &index);
    let e = load_err(&cfg, &dir);
    assert!(
        e.contains("embed.weight") && e.contains(wrong.as_str()),
        "{e}"
    );
    assert!(e.contains("does not hold it"), "{e}");

    // A tensor's scales mapped to another shard than the tensor.
    let dir = fresh("split");
    let mut index = index_of(&dir);
    let w = "layers.0.attn.wq_a.weight";
    let owner = index["weight_map"][w].as_str().unwrap().to_owned();
    let other = if owner == first { &second } else { &first };
    index["weight_map"]["layers.0.attn.wq_a.scale"] = other.clone().into();
    write_index(&dir, &index);
    let e = load_err(&cfg, &dir);
    assert!(e.contains(w) && e.contains("must share a shard"), "{e}");

    // A shard name with a path in it never leaves the checkpoint's directory.
    let dir = fresh("escape");
    let mut index = index_of(&dir);
    index["weight_map"]["embed.weight"] = format!("../escape/{first}").into();
    write_index(&dir, &index);
    let e = format!("{}", Checkpoint::open(&dir).unwrap_err());
    assert!(e.contains("not a plain file name"), "{e}");

    // Not JSON, or no weight_map.
    let dir = fresh("garbage");
    std::fs::write(dir.join(INDEX_FILE), b"{\"metadata\": {}}").unwrap();
    let e = format!("{}", Checkpoint::open(&dir).unwrap_err());
    assert!(e.contains("weight_map") && e.contains(INDEX_FILE), "{e}");

    // A directory that is no checkpoint.
    let e = format!("{}", Checkpoint::open(tmp.path()).unwrap_err());
    assert!(e.contains(INDEX_FILE), "{e}");

    // Another config's shapes: the error names the shard, the tensor and both shapes.
    let text = std::fs::read_to_string(CONFIG)
        .unwrap()
        .replace("\"vocab_size\": 256", "\"vocab_size\": 300");
    let wider = ModelConfig::from_json_str(&text).unwrap();
    let dir = fresh("shapes");
    let e = load_err(&wider, &dir);
    assert!(e.contains("embed.weight") && e.contains("300"), "{e}");
    assert!(e.contains("-of-00002.safetensors"), "{e}");
}

/// The sharded checkpoint computes with its weights as stored (FP8 linears, packed FP4
/// experts, BF16 head and index weights), holding far fewer bytes than as f32, and gives the
/// f32 verification path's logits bit for bit (the same weight values, summed in the same
/// order: `kvstack_kernels::linear`), so the same greedy tokens.
#[test]
fn stored_formats_compute_what_the_f32_path_computes_in_fewer_bytes() {
    let cfg = config();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    write_sharded_checkpoint(&cfg, 11, &dir, 2).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let stored = Model::load_from(&cfg, ck.source()).unwrap();
    let f32s = Model::load_with(&cfg, ck.source(), WeightPrecision::F32).unwrap();

    let (a, b) = (stored.weight_bytes(), f32s.weight_bytes());
    for f in ["fp8-e4m3", "fp4-e2m1", "bf16"] {
        assert!(a.formats.get(f).copied().unwrap_or(0) > 0, "{f}: {a:?}");
        assert!(!b.formats.contains_key(f), "{f} in the f32 model: {b:?}");
    }
    assert_eq!(a.f32, b.f32, "the same parameters");
    assert!(
        b.resident >= b.f32,
        "f32 weights hold at least 4 bytes each: {b:?}"
    );
    assert!(
        a.resident * 2 < b.resident,
        "stored formats should hold well under half the f32 bytes: {} vs {}",
        a.resident,
        b.resident
    );

    let prompt: Vec<u32> = (0..41u32).map(|i| (i * 17 + 3) % 256).collect();
    let (mut s1, mut s2) = (stored.new_store(None), f32s.new_store(None));
    let l1 = stored.step(&mut s1, &prompt, Logits::All, None).unwrap();
    let l2 = f32s.step(&mut s2, &prompt, Logits::All, None).unwrap();
    assert!(
        l1.iter().zip(&l2).all(|(x, y)| x.to_bits() == y.to_bits()),
        "stored-format logits differ from the f32 path's"
    );
    assert_eq!(greedy(&stored, &prompt, 8), greedy(&f32s, &prompt, 8));
}
