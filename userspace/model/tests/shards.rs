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
use kvstack_model::{Checkpoint, Logits, Model};
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
