//! Cache options and the page geometry derived from a model's layer plan.

use kvstack_driver::PinnedOptions;
use kvstack_firmware_interface::{GlobalFp4Entry, IndexMxfp4Entry, WindowFp8Entry};
use serde::Serialize;

use super::{PoolKind, PoolName};
use crate::{Error, Result};
use kvstack_spec::calc::F32_BYTES;
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::{LayerPlan, PlanKind};

/// Default tokens per page (see `docs/paged-cache.md`, "Page geometry").
pub const DEFAULT_PAGE_TOKENS: u32 = 256;

/// Default context limit: the V4.1-Flash context of 1,048,576 tokens (spec §2).
pub const DEFAULT_CONTEXT_LIMIT: u64 = 1 << 20;

/// Options of [`super::KvCache::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheOptions {
    /// The longest a sequence may grow, in tokens.
    pub context_limit: u64,
    /// Tokens covered by one page: a page of a ratio-`m` source holds `page_tokens / m`
    /// entries, and a prefix-index block is `page_tokens` tokens. Must be a multiple of every
    /// compress ratio of the model (2 for V4.1).
    pub page_tokens: u32,
    /// Live sequences at most; also sizes the window pool.
    pub max_sequences: usize,
    /// Tokens every global / index pool can hold (pages = `ceil(pool_tokens / ratio /
    /// page_entries)`); `None`: enough for `max_sequences` sequences at the context limit, plus
    /// one page per sequence for copy-on-write. Cached prefix blocks that no sequence uses are
    /// evicted (least recently used first) when a pool runs out.
    pub pool_tokens: Option<u64>,
    /// Keep a prefix index of completed token blocks (see [`super::KvCache::lookup_prefix`]).
    pub prefix_index: bool,
    /// Huge page and locking policy of the pools' memory.
    pub memory: PinnedOptions,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            context_limit: DEFAULT_CONTEXT_LIMIT,
            page_tokens: DEFAULT_PAGE_TOKENS,
            max_sequences: 8,
            pool_tokens: None,
            prefix_index: true,
            memory: PinnedOptions::default(),
        }
    }
}

/// One KV source layer: it owns a global-entry pool and an index-key pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SourceGeometry {
    /// The source layer.
    pub layer: usize,
    /// Tokens per compressed entry.
    pub ratio: u32,
    /// Entries per page (`page_tokens / ratio`), the same for global entries and index keys.
    pub page_entries: usize,
    /// Bytes of a global-entry page.
    pub global_page_bytes: usize,
    /// Bytes of an index-key page.
    pub index_page_bytes: usize,
    /// Pending compressor tokens this source can hold (`ratio - 1`).
    pub max_pending_tokens: usize,
}

/// The shape of a cache: which layers own pools, page sizes, window and pending-state sizes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CacheGeometry {
    /// Layers of the model (speculative layers excluded).
    pub num_layers: usize,
    /// Window rows per layer (`sliding_window`, 128).
    pub window_tokens: usize,
    /// Tokens per page and per prefix block.
    pub page_tokens: usize,
    /// The KV sources, in layer order. Pool `2 * i` holds source `i`'s global entries, pool
    /// `2 * i + 1` its index keys.
    pub sources: Vec<SourceGeometry>,
    /// For every layer, the position in `sources` of the KV source it reads (its plan
    /// `kv_source`); `None` for window-only layers.
    pub layer_source: Vec<Option<usize>>,
    /// f32 values of one pending compressor token: the `wkv` and `wgate` projections
    /// (`2 * head_dim`).
    pub pending_token_floats: usize,
    /// Bytes of one global entry (288).
    pub global_entry_bytes: usize,
    /// Bytes of one index key (68).
    pub index_entry_bytes: usize,
    /// Bytes of one window row (528).
    pub window_entry_bytes: usize,
}

impl CacheGeometry {
    /// The geometry of a CSA2 model (spec §4) with the V4.1 formats (spec §5).
    pub fn new(cfg: &ModelConfig, plan: &LayerPlan, page_tokens: u32) -> Result<CacheGeometry> {
        let unsupported = |reason: String| Error::UnsupportedModel { reason };
        let config = Error::Config;
        if plan.kind != PlanKind::Csa2 {
            return Err(unsupported(format!(
                "the plan is {:?}; the paged cache stores CSA2 (V4.1) caches",
                plan.kind
            )));
        }
        let head_dim = cfg.head_dim().map_err(config)?;
        if head_dim != GlobalFp4Entry::DIM as u64 {
            return Err(unsupported(format!(
                "head_dim {head_dim} differs from the {}-wide FP4 entry",
                GlobalFp4Entry::DIM
            )));
        }
        let index_dim = cfg.index_head_dim().map_err(config)?;
        if index_dim != IndexMxfp4Entry::DIM as u64 {
            return Err(unsupported(format!(
                "index_head_dim {index_dim} differs from the {}-wide MXFP4 key",
                IndexMxfp4Entry::DIM
            )));
        }
        let window = cfg.sliding_window().map_err(config)?;
        let window_tokens = usize::try_from(window)
            .ok()
            .filter(|&w| w > 0 && w <= 1 << 20)
            .ok_or_else(|| unsupported(format!("sliding_window {window} is not usable")))?;
        if page_tokens == 0 {
            return Err(Error::InvalidOption {
                field: "page_tokens",
                reason: "is 0".into(),
            });
        }
        let page_tokens = page_tokens as usize;

        let mut sources = Vec::new();
        let mut layer_source = Vec::with_capacity(plan.layers.len());
        for l in &plan.layers {
            if l.owns_kv() {
                if !l.owns_index_keys() {
                    return Err(unsupported(format!(
                        "KV source layer {} owns no indexer keys",
                        l.index
                    )));
                }
                let ratio = l.compress_ratio as usize;
                let check = |kind, entry: usize| {
                    let page_bytes = page_tokens * entry / ratio;
                    if !page_tokens.is_multiple_of(ratio) || !page_bytes.is_multiple_of(entry) {
                        return Err(Error::PageSize {
                            pool: PoolName {
                                kind,
                                layer: Some(l.index),
                            },
                            page_tokens: page_tokens as u64,
                            page_bytes: page_bytes as u64,
                            entry_bytes: entry as u64,
                        });
                    }
                    Ok(page_bytes)
                };
                let global_page_bytes = check(PoolKind::Global, GlobalFp4Entry::BYTES)?;
                let index_page_bytes = check(PoolKind::Index, IndexMxfp4Entry::BYTES)?;
                sources.push(SourceGeometry {
                    layer: l.index,
                    ratio: l.compress_ratio,
                    page_entries: page_tokens / ratio,
                    global_page_bytes,
                    index_page_bytes,
                    max_pending_tokens: ratio - 1,
                });
            }
            let src = match l.kv_source {
                None => None,
                Some(k) => Some(sources.iter().position(|s| s.layer == k).ok_or_else(|| {
                    unsupported(format!(
                        "layer {} reads KV source {k}, which owns no KV",
                        l.index
                    ))
                })?),
            };
            layer_source.push(src);
        }
        if sources.is_empty() {
            return Err(unsupported("the plan has no KV source".into()));
        }
        Ok(CacheGeometry {
            num_layers: plan.layers.len(),
            window_tokens,
            page_tokens,
            sources,
            layer_source,
            pending_token_floats: 2 * head_dim as usize,
            global_entry_bytes: GlobalFp4Entry::BYTES,
            index_entry_bytes: IndexMxfp4Entry::BYTES,
            window_entry_bytes: WindowFp8Entry::BYTES,
        })
    }

    /// Bytes of one sequence's window slab: `num_layers * window_tokens * 528`.
    pub fn window_slab_bytes(&self) -> usize {
        self.num_layers * self.window_tokens * self.window_entry_bytes
    }

    /// Bytes of one pending compressor token (`pending_token_floats * 4`).
    pub fn pending_token_bytes(&self) -> usize {
        self.pending_token_floats * F32_BYTES as usize
    }

    /// Number of page pools for global entries and index keys (two per source).
    pub fn entry_pools(&self) -> usize {
        2 * self.sources.len()
    }

    /// Compressed entries a ratio-`ratio` source holds for `tokens` tokens: one per complete
    /// group (spec §4).
    pub fn entries(tokens: u64, ratio: u32) -> u64 {
        tokens / u64::from(ratio.max(1))
    }
}
