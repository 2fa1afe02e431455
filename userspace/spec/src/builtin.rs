//! Built-in model configurations: the embedded defaults the CLI, the daemon and the C ABI use
//! when no config file is given.
//!
//! `deepseek-v4.1-flash.json` is the DeepSeek-V4.1-Flash text config of spec §2 (the same
//! values as `shared/spec/configs/deepseek-v4.1-flash.json`; a test keeps the two identical).

use crate::config::ModelConfig;
use crate::error::Result;

/// The name under which the embedded default appears in reports.
pub const DEFAULT_CONFIG_NAME: &str = "built-in deepseek-v4.1-flash";

/// The embedded DeepSeek-V4.1-Flash `config.json` text.
pub const DEEPSEEK_V41_FLASH_JSON: &str = include_str!("builtin/deepseek-v4.1-flash.json");

/// The name under which the embedded tiny model appears in reports.
pub const TINY_CONFIG_NAME: &str = "built-in kvstack-tiny-v4.1";

/// The embedded tiny V4.1 model config: the real V4.1-Flash cache geometry (40 layers, the
/// released CSA2 plan, head dim 512, window 128, index 32 x 128 with top-k 512, candidate pool
/// 2048 x 8, so the persistent cache is exactly 890 B/token) with a small hidden size (256),
/// 4 heads, 8 experts (top 2, width 128) and a 1024-token vocabulary, so it runs on a laptop.
/// Its weights are generated from a seed (`kvstack_model::init`); `kvstack run` uses it.
pub const TINY_V41_JSON: &str = include_str!("builtin/kvstack-tiny-v4.1.json");

/// The embedded tiny model config ([`TINY_V41_JSON`]).
pub fn tiny_config() -> Result<ModelConfig> {
    ModelConfig::from_json_str(TINY_V41_JSON)
}

/// The embedded default model config (DeepSeek-V4.1-Flash).
pub fn default_config() -> Result<ModelConfig> {
    ModelConfig::from_json_str(DEEPSEEK_V41_FLASH_JSON)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_default_equals_the_spec_config() {
        let spec = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/configs/deepseek-v4.1-flash.json"
        );
        let from_spec: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(spec).unwrap()).unwrap();
        let embedded: serde_json::Value = serde_json::from_str(DEEPSEEK_V41_FLASH_JSON).unwrap();
        assert_eq!(embedded, from_spec);
        assert_eq!(
            default_config().unwrap(),
            ModelConfig::from_file(spec).unwrap()
        );
    }
}
