//! `kvstack_store`: the KV store of one model in a data directory (the SSD tier and the DRAM
//! window pool, `kvstack_tiers::Tiers`), for engines that compute KV themselves: look up the
//! longest stored prefix of a tenant's tokens, read a unit's bytes into the caller's buffer,
//! store the bytes of a unit.
//!
//! Unit bytes are the stored formats (`docs/formats.md`, `docs/ssd-format.md`): the blocks'
//! KV payloads, one block per `page_tokens` tokens (the last may be shorter), concatenated;
//! and, apart, the window snapshot at the unit's end (`docs/tiers.md`).

use std::ffi::c_char;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_spec::ModelConfig;
use kvstack_tiers::unit::{block_payload_bytes, snapshot_bytes};
use kvstack_tiers::window_pool::DEFAULT_TTL_MS;
use kvstack_tiers::{
    PoolOptions, StoreLocation, StoreOptions, SystemClock, Tenant, TierOptions, Tiers, UnitData,
};

use crate::KVSTACK_MAX_TOKENS;
use crate::error::{Error, Result, kvstack_result};
use crate::ffi::{self, Out, OutBuf, OutSized, SizedStruct, boundary};

/// Most bytes of a weights id.
const MAX_WEIGHTS_ID_BYTES: usize = 4096;

/// An open store. Created by `kvstack_store_open`, freed by `kvstack_store_free`.
pub struct kvstack_store {
    /// `None` once closed.
    tiers: RwLock<Option<Tiers>>,
    /// Set when a call panicked while using the tiers: their state is not trusted after it.
    poisoned: AtomicBool,
}

/// Marks the store poisoned if it is dropped while its thread unwinds.
struct PoisonOnPanic<'a>(&'a AtomicBool);

impl Drop for PoisonOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.store(true, Ordering::Release);
        }
    }
}

impl kvstack_store {
    /// Runs `f` on the open tiers. Calls run concurrently (shared lock); close waits for
    /// them.
    fn with<T>(&self, f: impl FnOnce(&Tiers) -> Result<T>) -> Result<T> {
        if self.poisoned.load(Ordering::Acquire) {
            return Err(Error::Poisoned { what: "store" });
        }
        let guard = self
            .tiers
            .read()
            .map_err(|_| Error::Poisoned { what: "store" })?;
        let tiers = guard.as_ref().ok_or(Error::Closed { what: "store" })?;
        let _flag = PoisonOnPanic(&self.poisoned);
        f(tiers)
    }
}

/// The store behind a handle.
///
/// # Safety
/// `p` is NULL or a store from `kvstack_store_open` that is not freed before the call ends.
unsafe fn store_ref<'a>(p: *const kvstack_store) -> Result<&'a kvstack_store> {
    if p.is_null() {
        return Err(Error::Null { name: "store" });
    }
    // SAFETY: the caller's contract: a live store made by `kvstack_store_open` (a `Box` that
    // `kvstack_store_free` alone releases), so the pointer is valid for the call. Only shared
    // references are ever made of it.
    Ok(unsafe { &*p })
}

/// A tenant name argument: non-empty UTF-8 of at most 4096 bytes.
///
/// # Safety
/// As [`ffi::c_str`].
unsafe fn tenant_arg(p: *const c_char) -> Result<Tenant> {
    // SAFETY: the caller's contract is `c_str`'s.
    let name = unsafe { ffi::c_str(p, "tenant") }?;
    if name.is_empty() {
        return Err(Error::invalid("tenant", "must not be empty"));
    }
    Ok(Tenant::new(name))
}

/// How to open a store. Set `size` to `sizeof(kvstack_store_options)`, fill it with
/// `kvstack_store_options_default`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstack_store_options {
    /// `sizeof(kvstack_store_options)`, set by the caller.
    pub size: usize,
    /// The model's Hugging Face `config.json`, or NULL for the built-in DeepSeek-V4.1-Flash
    /// config. Units are keyed by the model (config, page size, formats, weights id): a store
    /// never serves KV of another model.
    pub config_path: *const c_char,
    /// Identity of the model's weights (a checkpoint hash), mixed into every key so that KV
    /// of other weights of the same config never matches; NULL with length 0 for none.
    pub weights_id: *const u8,
    /// Bytes of `weights_id` (at most 4096).
    pub weights_id_len: usize,
    /// Most bytes of segment files in the directory (default 64 GiB).
    pub capacity_bytes: u64,
    /// Bytes per segment file, a multiple of 4096 (default 64 MiB).
    pub segment_bytes: u64,
    /// A unit is kept at least this long after its last use, in ms (default 72 hours).
    pub retention_ms: u64,
    /// Bytes of the DRAM window pool; 0 for 10% of the machine's memory (the default).
    pub pool_capacity_bytes: u64,
    /// Time to live of a window snapshot in the pool, in ms (default 5 minutes).
    pub pool_ttl_ms: u64,
    /// Tokens per block (default 256; a multiple of the model's compress ratios).
    pub page_tokens: u32,
    /// Non-zero: open read-only (lookups and reads; no writes, a shared lock on the
    /// directory). Default 0.
    pub read_only: u8,
    /// Non-zero: try to lock the store's buffers and the pool in memory (default 1).
    pub lock_memory: u8,
    /// Non-zero: use huge pages when the system has them (default 1).
    pub huge_pages: u8,
}

// SAFETY: `#[repr(C)]`, `size: usize` first; the other fields are integers and raw pointers,
// valid for any bits.
unsafe impl SizedStruct for kvstack_store_options {
    const NAME: &'static str = "kvstack_store_options";
    const MIN_SIZE: usize = size_of::<kvstack_store_options>();
}

impl Default for kvstack_store_options {
    fn default() -> Self {
        let s = StoreOptions::new(StoreLocation::Directory(PathBuf::new()));
        kvstack_store_options {
            size: size_of::<kvstack_store_options>(),
            config_path: std::ptr::null(),
            weights_id: std::ptr::null(),
            weights_id_len: 0,
            capacity_bytes: s.capacity_bytes,
            segment_bytes: s.segment_bytes,
            retention_ms: s.retention_ms,
            pool_capacity_bytes: 0,
            pool_ttl_ms: DEFAULT_TTL_MS,
            page_tokens: kvstack_cache::DEFAULT_PAGE_TOKENS,
            read_only: 0,
            lock_memory: 1,
            huge_pages: 1,
        }
    }
}

/// The memory policy of two option flags.
pub(crate) fn memory_policy(lock_memory: u8, huge_pages: u8) -> PinnedOptions {
    PinnedOptions {
        huge_pages: if huge_pages != 0 {
            HugePages::Auto
        } else {
            HugePages::Never
        },
        locking: if lock_memory != 0 {
            Locking::BestEffort
        } else {
            Locking::Never
        },
    }
}

/// What `kvstack_store_lookup` found. Set `size` to `sizeof(kvstack_hit)` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstack_hit {
    /// `sizeof(kvstack_hit)`, set by the caller.
    pub size: usize,
    /// Tokens of the longest stored prefix (0: a miss). A prefix ends at a block end: whole
    /// blocks, then possibly one shorter block that ends a stored unit.
    pub tokens: u64,
    /// Of them, tokens whose global KV the SSD tier serves (all of them).
    pub ssd_tokens: u64,
    /// Tokens at the end of the prefix whose window KV the DRAM tier serves (the last
    /// `min(tokens, window)` when a window snapshot exists exactly at its end, else 0).
    pub dram_window_tokens: u64,
    /// Blocks of the prefix.
    pub blocks: u64,
    /// Bytes `kvstack_store_get_unit` writes for its payload.
    pub payload_bytes: u64,
    /// Bytes its window buffer must hold (0 when there is no window snapshot).
    pub window_bytes: u64,
}

// SAFETY: `#[repr(C)]`, `size: usize` first, then integers.
unsafe impl SizedStruct for kvstack_hit {
    const NAME: &'static str = "kvstack_hit";
    const MIN_SIZE: usize = size_of::<kvstack_hit>();
}

/// What `kvstack_store_get_unit` read. Set `size` to `sizeof(kvstack_unit)` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstack_unit {
    /// `sizeof(kvstack_unit)`, set by the caller.
    pub size: usize,
    /// Tokens of the unit read (0: a miss, nothing written).
    pub tokens: u64,
    /// Its blocks.
    pub blocks: u64,
    /// Bytes written to the payload buffer; with `KVSTACK_BUFFER_TOO_SMALL`, bytes needed.
    pub payload_bytes: u64,
    /// Bytes written to the window buffer (0: no snapshot, or no window buffer given); with
    /// `KVSTACK_BUFFER_TOO_SMALL`, bytes needed.
    pub window_bytes: u64,
}

// SAFETY: `#[repr(C)]`, `size: usize` first, then integers.
unsafe impl SizedStruct for kvstack_unit {
    const NAME: &'static str = "kvstack_unit";
    const MIN_SIZE: usize = size_of::<kvstack_unit>();
}

/// The byte layout of a unit of some length in a store. Set `size` to
/// `sizeof(kvstack_unit_layout)` before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstack_unit_layout {
    /// `sizeof(kvstack_unit_layout)`, set by the caller.
    pub size: usize,
    /// Tokens of the unit.
    pub tokens: u64,
    /// Tokens per block.
    pub page_tokens: u64,
    /// Unit lengths are a multiple of this (the model's largest compress ratio).
    pub align: u64,
    /// Blocks of the unit (`ceil(tokens / page_tokens)`).
    pub blocks: u64,
    /// Payload bytes of a full block; the last block holds the rest of `payload_bytes`.
    pub block_bytes: u64,
    /// Payload bytes of the unit: its blocks, concatenated.
    pub payload_bytes: u64,
    /// Bytes of the unit's window snapshot (`docs/tiers.md`, "DRAM window pool"): a 32-byte
    /// header, `layers x window_rows` FP8 rows of 528 bytes, and per KV source a `u32` count
    /// of pending floats and the floats (none at a length that is a multiple of `align`).
    pub window_bytes: u64,
    /// Layers of the model (the snapshot's header).
    pub layers: u64,
    /// Window rows per layer of this unit's snapshot: `min(tokens, sliding window)`.
    pub window_rows: u64,
    /// KV sources of the model (the snapshot's pending-state sections).
    pub kv_sources: u64,
}

// SAFETY: `#[repr(C)]`, `size: usize` first, then integers.
unsafe impl SizedStruct for kvstack_unit_layout {
    const NAME: &'static str = "kvstack_unit_layout";
    const MIN_SIZE: usize = size_of::<kvstack_unit_layout>();
}

/// Counters and sizes of a store, per tier. Set `size` to `sizeof(kvstack_tier_stats)`
/// before the call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvstack_tier_stats {
    /// `sizeof(kvstack_tier_stats)`, set by the caller.
    pub size: usize,
    /// SSD: bytes per segment.
    pub segment_bytes: u64,
    /// SSD: segments at most.
    pub segment_slots: u64,
    /// SSD: segments in use.
    pub segments: u64,
    /// SSD: visible units.
    pub units: u64,
    /// SSD: visible blocks.
    pub blocks: u64,
    /// SSD: bytes of live records.
    pub live_bytes: u64,
    /// SSD: bytes written into segments in use (live or dead).
    pub written_bytes: u64,
    /// SSD: payload bytes waiting in the write-behind queue.
    pub queued_bytes: u64,
    /// SSD: units made durable since open.
    pub units_written: u64,
    /// SSD: blocks written since open.
    pub blocks_written: u64,
    /// SSD: blocks shared with stored ones instead of written.
    pub blocks_shared: u64,
    /// SSD: record bytes written since open.
    pub bytes_written: u64,
    /// SSD: units refused because the store is full.
    pub refused_full: u64,
    /// SSD: units refused because the write-behind queue is full.
    pub refused_queue: u64,
    /// SSD: unit writes that failed.
    pub failed_writes: u64,
    /// SSD: units evicted past retention.
    pub units_evicted: u64,
    /// SSD: block reads that found damage (served as misses).
    pub damaged_reads: u64,
    /// SSD: lookups.
    pub lookups: u64,
    /// SSD: lookups that found at least one block.
    pub hits: u64,
    /// SSD: units recovered at open.
    pub recovered_units: u64,
    /// SSD: damaged ranges found at open.
    pub recovered_damage: u64,
    /// DRAM pool: bytes it may hold.
    pub pool_capacity_bytes: u64,
    /// DRAM pool: bytes committed.
    pub pool_committed_bytes: u64,
    /// DRAM pool: window snapshots held.
    pub pool_entries: u64,
    /// DRAM pool: reads that found a snapshot.
    pub pool_hits: u64,
    /// DRAM pool: reads that found none.
    pub pool_misses: u64,
    /// DRAM pool: snapshots evicted to make room.
    pub pool_evicted: u64,
    /// Non-zero when the store stopped writing after an I/O failure.
    pub poisoned: u8,
}

// SAFETY: `#[repr(C)]`, `size: usize` first, then integers.
unsafe impl SizedStruct for kvstack_tier_stats {
    const NAME: &'static str = "kvstack_tier_stats";
    const MIN_SIZE: usize = size_of::<kvstack_tier_stats>();
}

/// Fills `*options` with the defaults (the fields its `size` covers).
///
/// Thread safety: callable from any thread.
///
/// # Safety
/// `options` points to a writable `kvstack_store_options` whose `size` the caller set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_options_default(
    options: *mut kvstack_store_options,
) -> kvstack_result {
    boundary::call("kvstack_store_options_default", || {
        // SAFETY: the caller's contract above is `OutSized::new`'s.
        let out = unsafe { OutSized::new(options) }?;
        out.write(&kvstack_store_options::default());
        Ok(())
    })
}

/// Opens (creating if needed) the store in the directory `dir` for the model of
/// `options->config_path`, and writes its handle to `*out` (NULL on failure). `options` may
/// be NULL for the defaults. Recovery of the directory's segments runs here.
///
/// One writer per directory: a directory another store holds (in this or another process)
/// gives `KVSTACK_STORE_IN_USE`, naming the holder in the last error.
///
/// Thread safety: callable from any thread. The handle may be shared by any number of
/// threads: every store function except `kvstack_store_free` may be called concurrently.
///
/// # Safety
/// `dir` is a NUL-terminated string; `options` is NULL or a readable
/// `kvstack_store_options` with its `size` set, whose pointers follow its field docs; `out`
/// points to a writable `kvstack_store *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_open(
    dir: *const c_char,
    options: *const kvstack_store_options,
    out: *mut *mut kvstack_store,
) -> kvstack_result {
    boundary::call("kvstack_store_open", || {
        // SAFETY: the caller's contract for `out`.
        let out = unsafe { Out::new(out, "out") }?;
        out.write(std::ptr::null_mut());
        // SAFETY: the caller's contract for `dir`.
        let dir = unsafe { ffi::c_str(dir, "dir") }?;
        if dir.is_empty() {
            return Err(Error::invalid("dir", "must not be empty"));
        }
        // SAFETY: the caller's contract for `options`.
        let o = unsafe { ffi::read_sized(options, kvstack_store_options::default()) }?;
        // SAFETY: the caller's contract for the options' pointer fields.
        let config_path = unsafe { ffi::opt_c_str(o.config_path, "options.config_path") }?;
        // SAFETY: as above.
        let weights_id = unsafe {
            ffi::slice(
                o.weights_id,
                o.weights_id_len,
                MAX_WEIGHTS_ID_BYTES,
                "options.weights_id",
            )
        }?;
        if o.page_tokens == 0 {
            return Err(Error::option(
                "kvstack_store_options.page_tokens",
                "must be at least 1",
            ));
        }
        let config = match config_path {
            Some(p) => ModelConfig::from_file(std::path::Path::new(p))?,
            None => kvstack_spec::builtin::default_config()?,
        };
        let memory = memory_policy(o.lock_memory, o.huge_pages);
        let mut store = StoreOptions::new(StoreLocation::Directory(PathBuf::from(dir)));
        store.capacity_bytes = o.capacity_bytes;
        store.segment_bytes = o.segment_bytes;
        store.retention_ms = o.retention_ms;
        store.read_only = o.read_only != 0;
        store.memory = memory;
        let mut pool = PoolOptions::new(1);
        pool.capacity_bytes = (o.pool_capacity_bytes > 0).then_some(o.pool_capacity_bytes);
        pool.ttl_ms = o.pool_ttl_ms;
        pool.memory = memory;
        let opts = TierOptions {
            pool,
            weights_id: weights_id.to_vec(),
            ..TierOptions::new(store)
        };
        let tiers = Tiers::open(&config, o.page_tokens, opts, Arc::new(SystemClock))?;
        let handle = Box::new(kvstack_store {
            tiers: RwLock::new(Some(tiers)),
            poisoned: AtomicBool::new(false),
        });
        out.write(Box::into_raw(handle));
        Ok(())
    })
}

/// Closes the store: waits for queued writes, records last uses, releases the directory.
/// The handle stays valid and every later call on it but `kvstack_store_close` (a no-op,
/// `KVSTACK_OK`) and `kvstack_store_free` gives `KVSTACK_CLOSED`. Waits for calls in flight
/// on other threads.
///
/// Thread safety: callable from any thread, concurrently with other calls on the handle.
///
/// # Safety
/// `store` is a handle from `kvstack_store_open`, not freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_close(store: *mut kvstack_store) -> kvstack_result {
    boundary::call("kvstack_store_close", || {
        // SAFETY: the caller's contract above.
        let store = unsafe { store_ref(store) }?;
        let mut guard = store
            .tiers
            .write()
            .map_err(|_| Error::Poisoned { what: "store" })?;
        match guard.take() {
            Some(t) => Ok(t.close()?),
            None => Ok(()),
        }
    })
}

/// Frees the store, closing it first if it is open (close errors are then not reported: call
/// `kvstack_store_close` first to see them). NULL is a no-op.
///
/// Thread safety: no other call on this handle may run or follow.
///
/// # Safety
/// `store` is NULL or a handle from `kvstack_store_open` not yet freed; no other thread uses
/// it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_free(store: *mut kvstack_store) {
    boundary::value("kvstack_store_free", (), || {
        if store.is_null() {
            return;
        }
        // SAFETY: the caller's contract: the pointer came from `Box::into_raw` in
        // `kvstack_store_open` and is freed once, with no other user.
        drop(unsafe { Box::from_raw(store) });
    })
}

/// Looks up the longest stored prefix of `tokens[0..n_tokens]` for `tenant` and describes
/// it in `*hit` (`hit->tokens == 0` on a miss). A lookup does not count as a use of the
/// prefix; reading it does. Another tenant's units are never found.
///
/// `tokens` may be NULL when `n_tokens` is 0; `n_tokens` is at most `KVSTACK_MAX_TOKENS`.
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `tenant` a NUL-terminated string; `tokens` points to
/// `n_tokens` readable `uint32_t`; `hit` to a writable `kvstack_hit` with its `size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_lookup(
    store: *const kvstack_store,
    tenant: *const c_char,
    tokens: *const u32,
    n_tokens: usize,
    hit: *mut kvstack_hit,
) -> kvstack_result {
    boundary::call("kvstack_store_lookup", || {
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, tenant, tokens, out) = unsafe {
            (
                store_ref(store)?,
                tenant_arg(tenant)?,
                ffi::slice(tokens, n_tokens, KVSTACK_MAX_TOKENS, "tokens")?,
                OutSized::new(hit)?,
            )
        };
        store.with(|tiers| {
            let h = tiers.lookup(tokens, &tenant);
            let g = tiers.geometry();
            let payload: u64 = h
                .store
                .block_tokens
                .iter()
                .map(|&t| block_payload_bytes(g, u64::from(t)))
                .sum();
            out.write(&kvstack_hit {
                size: 0,
                tokens: h.tokens,
                ssd_tokens: h.tokens,
                dram_window_tokens: if h.window {
                    h.tokens.min(g.window_tokens as u64)
                } else {
                    0
                },
                blocks: h.store.keys.len() as u64,
                payload_bytes: payload,
                window_bytes: if h.window {
                    snapshot_bytes(g) as u64
                } else {
                    0
                },
            });
            Ok(())
        })
    })
}

/// Reads the longest stored prefix of `tokens[0..n_tokens]` for `tenant` into the caller's
/// buffers: its blocks' payload, concatenated, into `payload` (`payload_cap` bytes), and its
/// window snapshot, when there is one, into `window` (`window_cap` bytes; NULL with 0 to skip
/// the window). `*unit` says what was written (`unit->tokens == 0`: a miss, nothing written).
/// Reading counts as a use of the prefix.
///
/// Size query first: with `payload = NULL, payload_cap = 0` (or any buffer too small), the
/// call writes nothing, returns `KVSTACK_BUFFER_TOO_SMALL` and puts the sizes needed in
/// `*unit` (`payload_bytes`, `window_bytes`); `kvstack_store_lookup` gives them too. A unit
/// may change between two calls (evicted, or a longer one stored): call again on
/// `KVSTACK_BUFFER_TOO_SMALL`.
///
/// Every block is checked (header, key, CRC) before its bytes are copied; a damaged or
/// vanished block makes the whole read a miss, and bytes already copied are zeroed: the
/// caller never gets partial or damaged KV.
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `tenant` a NUL-terminated string; `tokens` points to
/// `n_tokens` readable `uint32_t`; `payload` is NULL with 0 or has `payload_cap` writable
/// bytes, `window` likewise, neither overlapping another argument; `unit` points to a
/// writable `kvstack_unit` with its `size` set.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstack_store_get_unit(
    store: *const kvstack_store,
    tenant: *const c_char,
    tokens: *const u32,
    n_tokens: usize,
    payload: *mut u8,
    payload_cap: usize,
    window: *mut u8,
    window_cap: usize,
    unit: *mut kvstack_unit,
) -> kvstack_result {
    boundary::call("kvstack_store_get_unit", || {
        let want_window = !window.is_null();
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, tenant, tokens, mut payload, mut window, out) = unsafe {
            (
                store_ref(store)?,
                tenant_arg(tenant)?,
                ffi::slice(tokens, n_tokens, KVSTACK_MAX_TOKENS, "tokens")?,
                OutBuf::new(payload, payload_cap, "payload")?,
                OutBuf::new(window, window_cap, "window")?,
                OutSized::new(unit)?,
            )
        };
        store.with(|tiers| {
            get_unit(
                tiers,
                &tenant,
                tokens,
                &mut payload,
                want_window.then_some(&mut window),
                &out,
            )
        })
    })
}

fn get_unit(
    tiers: &Tiers,
    tenant: &Tenant,
    tokens: &[u32],
    payload: &mut OutBuf,
    window: Option<&mut OutBuf>,
    out: &OutSized<kvstack_unit>,
) -> Result<()> {
    let mut info = kvstack_unit::default();
    let hit = tiers.lookup(tokens, tenant);
    if hit.tokens == 0 {
        out.write(&info);
        return Ok(());
    }
    let g = tiers.geometry();
    let need: u64 = hit
        .store
        .block_tokens
        .iter()
        .map(|&t| block_payload_bytes(g, u64::from(t)))
        .sum();
    let window_need = if hit.window {
        snapshot_bytes(g) as u64
    } else {
        0
    };
    info.tokens = hit.tokens;
    info.blocks = hit.store.keys.len() as u64;
    info.payload_bytes = need;
    info.window_bytes = window_need;
    if (payload.capacity() as u64) < need {
        out.write(&info);
        return Err(Error::BufferTooSmall {
            name: "payload",
            needed: need,
            given: payload.capacity() as u64,
        });
    }
    if let Some(w) = &window
        && (w.capacity() as u64) < window_need
    {
        out.write(&info);
        return Err(Error::BufferTooSmall {
            name: "window",
            needed: window_need,
            given: w.capacity() as u64,
        });
    }
    let read = tiers.read_unit_with(tokens, &hit, |i, kv| {
        // The lookup sized the buffer from the same blocks; a block that does not fit is a
        // store that changed under the read, refused as a payload mismatch.
        payload
            .push(kv, "payload")
            .map_err(|e| kvstack_tiers::Error::Payload {
                block: i,
                tokens: hit.tokens,
                reason: e.to_string(),
            })
    });
    let read = match read {
        Ok(Some(r)) => r,
        Ok(None) => {
            payload.clear();
            out.write(&kvstack_unit::default());
            return Ok(());
        }
        Err(e) => {
            payload.clear();
            return Err(e.into());
        }
    };
    info.payload_bytes = payload.len() as u64;
    info.window_bytes = 0;
    if let (Some(w), Some(snap)) = (window, &read.window) {
        if let Err(e) = w.push(snap, "window") {
            payload.clear();
            return Err(e);
        }
        info.window_bytes = w.len() as u64;
    }
    out.write(&info);
    Ok(())
}

/// Stores `payload` (the unit's blocks' payloads, concatenated; `kvstack_store_unit_layout`
/// gives the sizes) as the unit `tokens[0..n_tokens]` of `tenant`, with its window snapshot
/// `window` when not NULL. Every size is checked before anything is stored. Blocks the
/// store already holds are shared. Written behind: with `durable` the call returns once the
/// unit is on stable storage (and visible to lookups); without, it returns at once and the
/// unit becomes visible when the write-behind thread has made it durable
/// (`kvstack_store_flush` waits for that).
///
/// `n_tokens` must be a multiple of the model's largest compress ratio (`layout.align`).
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `tenant` a NUL-terminated string; `tokens` points to
/// `n_tokens` readable `uint32_t`; `payload` to `payload_len` readable bytes; `window` is NULL
/// or points to `window_len` readable bytes.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kvstack_store_put_unit(
    store: *const kvstack_store,
    tenant: *const c_char,
    tokens: *const u32,
    n_tokens: usize,
    payload: *const u8,
    payload_len: usize,
    window: *const u8,
    window_len: usize,
    durable: bool,
) -> kvstack_result {
    boundary::call("kvstack_store_put_unit", || {
        if n_tokens == 0 {
            return Err(Error::invalid("n_tokens", "a unit needs tokens"));
        }
        if payload_len == 0 {
            return Err(Error::invalid("payload_len", "a unit needs payload bytes"));
        }
        if !window.is_null() && window_len == 0 {
            return Err(Error::invalid(
                "window_len",
                "0 with a window buffer (pass NULL for no window)",
            ));
        }
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, tenant, tokens, payload, window) = unsafe {
            (
                store_ref(store)?,
                tenant_arg(tenant)?,
                ffi::slice(tokens, n_tokens, KVSTACK_MAX_TOKENS, "tokens")?,
                ffi::slice(payload, payload_len, isize::MAX as usize, "payload")?,
                ffi::slice(window, window_len, isize::MAX as usize, "window")?,
            )
        };
        store.with(|tiers| {
            let data = unit_data(tiers, tokens, payload, window)?;
            let ticket = tiers.write_unit(&tenant, tokens, &data)?;
            if durable {
                ticket.wait()?;
            }
            Ok(())
        })
    })
}

/// Cuts a unit's concatenated payload into its blocks, checking the total first.
fn unit_data(tiers: &Tiers, tokens: &[u32], payload: &[u8], window: &[u8]) -> Result<UnitData> {
    let n = tokens.len() as u64;
    if !n.is_multiple_of(tiers.align()) {
        return Err(kvstack_tiers::Error::Unaligned {
            tokens: n,
            align: tiers.align(),
        }
        .into());
    }
    let g = tiers.geometry();
    let p = g.page_tokens as u64;
    let sizes: Vec<u64> = (0..n.div_ceil(p))
        .map(|i| block_payload_bytes(g, (n - i * p).min(p)))
        .collect();
    let total: u64 = sizes.iter().sum();
    if payload.len() as u64 != total {
        return Err(kvstack_tiers::Error::Payload {
            block: 0,
            tokens: n,
            reason: format!(
                "{} payload bytes given, a unit of {n} tokens has {total} in {} blocks",
                payload.len(),
                sizes.len()
            ),
        }
        .into());
    }
    let mut blocks = Vec::with_capacity(sizes.len());
    let mut rest = payload;
    for s in sizes {
        let (b, r) = rest.split_at(s as usize);
        blocks.push(b.to_vec());
        rest = r;
    }
    Ok(UnitData {
        tokens: n,
        blocks,
        window: (!window.is_empty()).then(|| window.to_vec()),
    })
}

/// Deletes the unit `tokens[0..n_tokens]` of `tenant` (its blocks stay while longer units
/// share them).
///
/// Returns once the delete is durable: the unit is gone from the SSD store (before and after
/// a restart) and its window snapshot from the DRAM pool. `KVSTACK_STORE_NOT_FOUND` when no
/// unit of exactly these tokens is stored for this tenant.
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `tenant` a NUL-terminated string; `tokens` points to
/// `n_tokens` readable `uint32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_delete(
    store: *const kvstack_store,
    tenant: *const c_char,
    tokens: *const u32,
    n_tokens: usize,
) -> kvstack_result {
    boundary::call("kvstack_store_delete", || {
        if n_tokens == 0 {
            return Err(Error::invalid("n_tokens", "a unit needs tokens"));
        }
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, tenant, tokens) = unsafe {
            (
                store_ref(store)?,
                tenant_arg(tenant)?,
                ffi::slice(tokens, n_tokens, KVSTACK_MAX_TOKENS, "tokens")?,
            )
        };
        store.with(|tiers| delete_unit(tiers, &tenant, tokens))
    })
}

/// Deletes one unit and waits until the delete is durable.
fn delete_unit(tiers: &Tiers, tenant: &Tenant, tokens: &[u32]) -> Result<()> {
    match tiers.delete_unit(tenant, tokens)?.wait()? {
        kvstack_tiers::DeleteOutcome::Deleted => Ok(()),
        kvstack_tiers::DeleteOutcome::NotStored => Err(Error::NotFound {
            what: "no unit of these tokens is stored for this tenant",
        }),
    }
}

/// Waits until every unit written before this call is durable (or failed).
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_flush(store: *const kvstack_store) -> kvstack_result {
    boundary::call("kvstack_store_flush", || {
        // SAFETY: the caller's contract above.
        let store = unsafe { store_ref(store) }?;
        store.with(|tiers| Ok(tiers.flush()?))
    })
}

/// The layout of a unit of `n_tokens` tokens in this store (block size, payload bytes, most
/// window bytes), for callers that produce unit bytes. `n_tokens` must be a positive
/// multiple of the model's largest compress ratio.
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `layout` points to a writable `kvstack_unit_layout` with its
/// `size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_unit_layout(
    store: *const kvstack_store,
    n_tokens: usize,
    layout: *mut kvstack_unit_layout,
) -> kvstack_result {
    boundary::call("kvstack_store_unit_layout", || {
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, out) = unsafe { (store_ref(store)?, OutSized::new(layout)?) };
        if n_tokens == 0 || n_tokens > KVSTACK_MAX_TOKENS {
            return Err(Error::invalid(
                "n_tokens",
                format!("{n_tokens} is not in 1..={KVSTACK_MAX_TOKENS}"),
            ));
        }
        store.with(|tiers| {
            let n = n_tokens as u64;
            if !n.is_multiple_of(tiers.align()) {
                return Err(kvstack_tiers::Error::Unaligned {
                    tokens: n,
                    align: tiers.align(),
                }
                .into());
            }
            let g = tiers.geometry();
            let p = g.page_tokens as u64;
            let blocks = n.div_ceil(p);
            let full = block_payload_bytes(g, p);
            let last = block_payload_bytes(g, n - (blocks - 1) * p);
            let rows = (n as usize).min(g.window_tokens);
            out.write(&kvstack_unit_layout {
                size: 0,
                tokens: n,
                page_tokens: p,
                align: tiers.align(),
                blocks,
                block_bytes: full,
                payload_bytes: (blocks - 1) * full + last,
                window_bytes: (32
                    + g.num_layers * rows * g.window_entry_bytes
                    + 4 * g.sources.len()) as u64,
                layers: g.num_layers as u64,
                window_rows: rows as u64,
                kv_sources: g.sources.len() as u64,
            });
            Ok(())
        })
    })
}

/// Counters and sizes of the store's tiers into `*stats`.
///
/// Thread safety: the store handle may be shared; calls run concurrently.
///
/// # Safety
/// `store` is a live handle; `stats` points to a writable `kvstack_tier_stats` with its
/// `size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_store_stats(
    store: *const kvstack_store,
    stats: *mut kvstack_tier_stats,
) -> kvstack_result {
    boundary::call("kvstack_store_stats", || {
        // SAFETY: the caller's contract for each argument, as documented above.
        let (store, out) = unsafe { (store_ref(store)?, OutSized::new(stats)?) };
        store.with(|tiers| {
            let s = tiers.store().stats();
            let p = tiers.pool().stats();
            out.write(&kvstack_tier_stats {
                size: 0,
                segment_bytes: s.segment_bytes,
                segment_slots: s.segment_slots,
                segments: s.segments,
                units: s.units,
                blocks: s.blocks,
                live_bytes: s.live_bytes,
                written_bytes: s.written_bytes,
                queued_bytes: s.queued_bytes,
                units_written: s.units_written,
                blocks_written: s.blocks_written,
                blocks_shared: s.blocks_shared,
                bytes_written: s.bytes_written,
                refused_full: s.refused_full,
                refused_queue: s.refused_queue,
                failed_writes: s.failed_writes,
                units_evicted: s.units_evicted,
                damaged_reads: s.damaged_reads,
                lookups: s.lookups,
                hits: s.hits,
                recovered_units: s.recovery.units,
                recovered_damage: s.recovery.damaged.len() as u64,
                pool_capacity_bytes: p.capacity_bytes,
                pool_committed_bytes: p.committed_bytes,
                pool_entries: p.entries,
                pool_hits: p.hits,
                pool_misses: p.misses,
                pool_evicted: p.evicted,
                poisoned: u8::from(s.poisoned.is_some()),
            });
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use super::*;

    #[test]
    fn a_panic_while_using_the_store_poisons_the_handle() {
        let dir = tempfile::tempdir().unwrap();
        let mut o = kvstack_store_options {
            pool_capacity_bytes: 64 << 20,
            segment_bytes: 8 << 20,
            capacity_bytes: 64 << 20,
            lock_memory: 0,
            huge_pages: 0,
            ..kvstack_store_options::default()
        };
        o.size = size_of::<kvstack_store_options>();
        let path = std::ffi::CString::new(dir.path().to_str().unwrap()).unwrap();
        let mut s: *mut kvstack_store = std::ptr::null_mut();
        // SAFETY: a NUL-terminated path, local options, a local out-pointer.
        let rc = unsafe { kvstack_store_open(path.as_ptr(), &o, &mut s) };
        assert_eq!(rc, kvstack_result::KVSTACK_OK);
        // SAFETY: `s` is the live store just opened; no other thread uses it.
        let store = unsafe { &*s };
        let rc = boundary::call("kvstack_test", || {
            store.with(|_| -> Result<()> { panic!("inside the store") })
        });
        assert_eq!(rc, kvstack_result::KVSTACK_PANIC);
        let mut flushed = boundary::call("kvstack_test", || store.with(|_| Ok(())));
        assert_eq!(flushed, kvstack_result::KVSTACK_POISONED);
        // SAFETY: the live store; freed once.
        unsafe {
            flushed = kvstack_store_flush(s);
            kvstack_store_free(s);
        }
        assert_eq!(flushed, kvstack_result::KVSTACK_POISONED);
    }
}
