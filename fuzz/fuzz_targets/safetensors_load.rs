//! The safetensors loader on arbitrary files: `TensorFile::open`, then every tensor it lists
//! read as stored, as f32 through the storage decoders (F32, BF16, FP8 and FP4 with scales), and
//! with the typed readers; then `Model::load` against the built-in tiny config (it fails fast on
//! a missing tensor, so it is cheap). Errors, never panics.
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::OnceLock;

use kvstack_fuzz::ScratchDir;
use kvstack_model::weights::TensorFile;
use kvstack_model::{Model, load_f32};
use kvstack_spec::ModelConfig;
use libfuzzer_sys::fuzz_target;

fn tiny() -> &'static ModelConfig {
    static CFG: OnceLock<ModelConfig> = OnceLock::new();
    CFG.get_or_init(|| kvstack_spec::builtin::tiny_config().unwrap())
}

fn scratch() -> &'static ScratchDir {
    static DIR: OnceLock<ScratchDir> = OnceLock::new();
    DIR.get_or_init(|| ScratchDir::new("safetensors"))
}

/// Decoding more than this many elements of one tensor is skipped: the header may declare a
/// large tensor whose bytes are all there, and reading it is correct but slow.
const MAX_ELEMENTS: usize = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let path = scratch().path().join("input.safetensors");
    std::fs::write(&path, data).unwrap();
    let Ok(file) = TensorFile::open(&path) else {
        return;
    };
    let _ = file.metadata();
    for name in file.names() {
        assert!(file.contains(&name));
        let Some(raw) = file.raw_tensor(&name) else {
            continue;
        };
        assert_eq!(file.shape(&name), Some(raw.shape));
        assert!(file.dtype_name(&name).is_some());
        let shape = raw.shape.to_vec();
        let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        if elements.is_none_or(|n| n > MAX_ELEMENTS) {
            continue;
        }
        let _ = load_f32(&file, &name, &shape);
        let _ = file.f32(&name, &shape);
        let _ = file.i64(&name, &shape);
        let _ = file.u8(&name, &shape);
        // A scale grid of another tensor's shape: the block-scale paths' shape checks.
        let _ = load_f32(&file, &name, &[shape.iter().product::<usize>().max(1)]);
        // Packed FP4 stored as U8/I8 `[rows, cols / 2]`: its logical shape.
        if let [r, c] = shape[..]
            && let Some(c2) = c.checked_mul(2)
        {
            let _ = load_f32(&file, &name, &[r, c2]);
        }
    }
    let _ = file.content_id();
    let _ = Model::load(tiny(), &file);
});
