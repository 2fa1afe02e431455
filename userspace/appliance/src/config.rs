//! `kvstackd.toml`: every key, its default, and the checks run at start (and on `SIGHUP` for
//! what can be reloaded). `docs/appliance.md` lists the same keys; a test keeps the two in step.
//!
//! Unknown keys are refused (a misspelt key silently ignored is a limit silently not applied),
//! and every value is checked before anything is opened, with the key and the reason.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Where the daemon listens by default.
pub const DEFAULT_SOCKET: &str = "/run/kvstack/kvstackd.sock";
/// The data directory by default (systemd's `StateDirectory=kvstack`).
pub const DEFAULT_DATA_DIR: &str = "/var/lib/kvstack";
/// The config file by default.
pub const DEFAULT_CONFIG: &str = "/etc/kvstack/kvstackd.toml";
/// Largest config file read (a config is a few KiB; a bigger "file" is a mistake like
/// `--config /dev/zero`).
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// A listening address: `unix:PATH` or `tcp:ADDR:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A Unix stream socket at this path.
    Unix(PathBuf),
    /// A TCP socket.
    Tcp(SocketAddr),
}

impl Listen {
    /// Parses `unix:PATH` or `tcp:ADDR:PORT`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `key` and what is wrong.
    pub fn parse(key: &str, s: &str) -> Result<Listen> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err(bad(key, format!("`{s}`: empty socket path")));
            }
            return Ok(Listen::Unix(PathBuf::from(p)));
        }
        if let Some(a) = s.strip_prefix("tcp:") {
            let addr: SocketAddr = a
                .parse()
                .map_err(|e| bad(key, format!("`{s}`: not an IP address and port ({e})")))?;
            return Ok(Listen::Tcp(addr));
        }
        Err(bad(
            key,
            format!("`{s}`: expected unix:PATH or tcp:ADDR:PORT"),
        ))
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// The whole file as written (every section optional).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    data_dir: Option<PathBuf>,
    listen: Option<Vec<String>>,
    allow_remote: Option<bool>,
    #[serde(default)]
    model: ModelFile,
    #[serde(default)]
    engine: EngineFile,
    #[serde(default)]
    limits: LimitsFile,
    #[serde(default)]
    window_pool: PoolFile,
    #[serde(default)]
    ssd: SsdFile,
    #[serde(default)]
    drain: DrainFile,
    #[serde(default)]
    tenant: Vec<TenantFile>,
    cluster: Option<ClusterFile>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    peer_secret: Option<String>,
    #[serde(default)]
    peer: Vec<PeerFile>,
    fetch_timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerFile {
    node_id: Option<String>,
    address: Option<String>,
}

/// `[cluster]`: fetching units' global KV from the node the shared prefix index names
/// (`docs/cluster.md`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterConfig {
    /// The shared secret nodes authenticate to each other with (`X-Kvstack-Peer`).
    pub peer_secret: String,
    /// The other nodes: node id and where their API listens.
    pub peers: Vec<(String, Listen)>,
    /// Longest wait for one peer fetch.
    pub fetch_timeout_ms: u64,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    builtin_seed: Option<u64>,
    config: Option<PathBuf>,
    weights: Option<PathBuf>,
    name: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineFile {
    threads: Option<u64>,
    chunk: Option<u64>,
    max_decode_batch: Option<u64>,
    max_sequences: Option<u64>,
    context_limit: Option<u64>,
    queue_depth: Option<u64>,
    session_idle_ms: Option<u64>,
    max_sessions: Option<u64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitsFile {
    max_body_bytes: Option<u64>,
    max_kv_body_bytes: Option<u64>,
    max_header_bytes: Option<u64>,
    max_prompt_tokens: Option<u64>,
    max_tokens: Option<u64>,
    request_timeout_ms: Option<u64>,
    max_connections: Option<u64>,
    max_pin_ttl_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFile {
    capacity_bytes: Option<u64>,
    ttl_ms: Option<u64>,
    backend: Option<String>,
    local_level: Option<bool>,
    redis_nodes: Option<Vec<String>>,
    redis_key_prefix: Option<String>,
    redis_connect_timeout_ms: Option<u64>,
    redis_io_timeout_ms: Option<u64>,
    redis_retry_ms: Option<u64>,
    redis_node_id: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SsdFile {
    capacity_bytes: Option<u64>,
    retention_hours: Option<u64>,
    io_engine: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct DrainFile {
    timeout_ms: Option<u64>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    name: Option<String>,
    api_key_sha256: Option<String>,
    max_concurrent: Option<u64>,
    max_prompt_tokens: Option<u64>,
    dram_pool_bytes: Option<u64>,
    ssd_bytes: Option<u64>,
}

/// Which model the daemon serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelChoice {
    /// The built-in tiny V4.1 model, weights from this seed.
    Builtin {
        /// Seed of the generated weights.
        seed: u64,
    },
    /// A checkpoint.
    Checkpoint {
        /// Its `config.json`.
        config: PathBuf,
        /// Its safetensors weights.
        weights: PathBuf,
    },
}

/// Engine keys (`[engine]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Threads of the forward pass; 0 in the file means all cores.
    pub threads: usize,
    /// Most tokens of one prefill step.
    pub chunk: usize,
    /// Most decoding requests per batched step.
    pub max_decode_batch: usize,
    /// Live sequences the paged cache holds at most.
    pub max_sequences: usize,
    /// Longest sequence, in tokens.
    pub context_limit: u64,
    /// Requests waiting for the engine at most; beyond it new requests get 429.
    pub queue_depth: usize,
    /// Named sessions idle this long are closed (their units stay in the tiers).
    pub session_idle_ms: u64,
    /// Named sessions open at most (per daemon).
    pub max_sessions: usize,
}

/// Request limits (`[limits]`): reloadable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest JSON request body.
    pub max_body_bytes: usize,
    /// Largest KV-cache API body (`/v1/kv/put`).
    pub max_kv_body_bytes: usize,
    /// Largest request head (request line and headers).
    pub max_header_bytes: usize,
    /// Longest prompt (new tokens of one request).
    pub max_prompt_tokens: usize,
    /// Largest `max_tokens`.
    pub max_tokens: usize,
    /// A request running longer is cancelled (408 or a final error event).
    pub request_timeout_ms: u64,
    /// Open connections at most (more wait in the listen backlog).
    pub max_connections: usize,
    /// Longest pin a client may ask for.
    pub max_pin_ttl_ms: u64,
}

/// A tenant (`[[tenant]]`): reloadable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tenant {
    /// Its name: the cache salt (units of different tenants never match).
    pub name: String,
    /// SHA-256 of its API key; `None` only for the default tenant of a config with no
    /// tenants.
    pub api_key_sha256: Option<[u8; 32]>,
    /// Requests of this tenant running or queued at once.
    pub max_concurrent: usize,
    /// Longest prompt of this tenant (at most the global limit).
    pub max_prompt_tokens: usize,
    /// DRAM window pool bytes this tenant's snapshots may take (whole slots; a new snapshot
    /// past it replaces the tenant's own least recently used); `None`: the pool's cap alone.
    pub dram_pool_bytes: Option<u64>,
    /// SSD bytes this tenant's KV blocks may take (its own least recently used unpinned units
    /// make way, of any age; a put that cannot fit is refused with 507); `None`: the store's
    /// capacity alone.
    pub ssd_bytes: Option<u64>,
}

/// The daemon's whole configuration, checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The data directory (SSD store segments, its lock).
    pub data_dir: PathBuf,
    /// Where to listen (when no sockets are passed by systemd).
    pub listen: Vec<Listen>,
    /// Accept TCP addresses that are not loopback.
    pub allow_remote: bool,
    /// The model.
    pub model: ModelChoice,
    /// Name in `/v1/models` and responses.
    pub model_name: String,
    /// Engine keys.
    pub engine: EngineConfig,
    /// Request limits.
    pub limits: Limits,
    /// DRAM window pool bytes; `None`: 10% of RAM.
    pub pool_capacity_bytes: Option<u64>,
    /// Window snapshot time to live.
    pub pool_ttl_ms: u64,
    /// `window_pool.backend = "redis-cluster"`: the pool's Redis Cluster level
    /// (`docs/cluster.md`); `None` for `"dram"`.
    pub pool_remote: Option<kvstack_tiers::RedisOptions>,
    /// SSD store capacity; `None`: the store's default.
    pub ssd_capacity_bytes: Option<u64>,
    /// `ssd.io_engine`: the store's I/O engine (`auto`, `io_uring`, `sync`, `sync-direct`, or
    /// `vfio:<pci-address>`, which puts the store on that NVMe namespace instead of
    /// `data_dir`); checked, applied by [`kvstack_tiers::StoreOptions::set_io_engine`].
    pub ssd_io_engine: Option<String>,
    /// Units retained at least this long after last use.
    pub ssd_retention_hours: u64,
    /// SIGTERM: running requests get this long to finish.
    pub drain_timeout_ms: u64,
    /// Tenants; one default tenant without a key when the file has none.
    pub tenants: Vec<Tenant>,
    /// Peer fetch between nodes; `None` without a `[cluster]` section.
    pub cluster: Option<ClusterConfig>,
}

/// Name of the tenant of a config without `[[tenant]]` sections.
pub const DEFAULT_TENANT: &str = "default";

fn bad(key: &str, reason: String) -> Error {
    Error::Config {
        key: key.to_string(),
        reason,
    }
}

/// `v` within `[lo, hi]`, as `T`.
fn range<T: TryFrom<u64>>(key: &str, v: Option<u64>, default: u64, lo: u64, hi: u64) -> Result<T> {
    let v = v.unwrap_or(default);
    if v < lo || v > hi {
        return Err(bad(key, format!("{v} is outside [{lo}, {hi}]")));
    }
    T::try_from(v).map_err(|_| bad(key, format!("{v} does not fit this machine")))
}

impl Config {
    /// The defaults: what an empty file gives.
    ///
    /// # Errors
    /// None in practice (the unit tests check an empty file); kept as a `Result` so that the
    /// defaults have one source, the checks of [`Config::from_toml_str`].
    pub fn defaults() -> Result<Config> {
        Config::from_toml_str("", "defaults")
    }

    /// Reads and checks `path`.
    ///
    /// # Errors
    /// [`Error::ConfigFile`] when it cannot be read or is not TOML (with the line), and
    /// [`Error::Config`] for a bad value.
    pub fn from_file(path: &Path) -> Result<Config> {
        use std::io::Read;
        let f = std::fs::File::open(path).map_err(|e| Error::ConfigFile {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let mut text = String::new();
        let n = f
            .take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| Error::ConfigFile {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        if n as u64 > MAX_CONFIG_BYTES {
            return Err(Error::ConfigFile {
                path: path.to_path_buf(),
                reason: format!("larger than {MAX_CONFIG_BYTES} bytes"),
            });
        }
        Config::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses and checks TOML text; `origin` names it in errors.
    ///
    /// # Errors
    /// As [`Config::from_file`].
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Config> {
        let f: File = toml::from_str(text).map_err(|e| Error::ConfigFile {
            path: PathBuf::from(origin),
            reason: e.to_string().trim_end().to_string(),
        })?;
        Config::check(f)
    }

    fn check(f: File) -> Result<Config> {
        let model = match (&f.model.builtin_seed, &f.model.config, &f.model.weights) {
            (None, None, None) => ModelChoice::Builtin { seed: 0 },
            (Some(seed), None, None) => ModelChoice::Builtin { seed: *seed },
            (None, Some(c), Some(w)) => ModelChoice::Checkpoint {
                config: c.clone(),
                weights: w.clone(),
            },
            (Some(_), _, _) => {
                return Err(bad(
                    "model.builtin_seed",
                    "give either builtin_seed or config and weights, not both".into(),
                ));
            }
            (None, Some(_), None) => {
                return Err(bad("model.weights", "missing (config is given)".into()));
            }
            (None, None, Some(_)) => {
                return Err(bad("model.config", "missing (weights is given)".into()));
            }
        };
        let model_name = match (&f.model.name, &model) {
            (Some(n), _) if n.is_empty() || n.len() > 256 => {
                return Err(bad("model.name", "must be 1 to 256 bytes".into()));
            }
            (Some(n), _) => n.clone(),
            (None, ModelChoice::Builtin { .. }) => {
                kvstack_spec::builtin::TINY_CONFIG_NAME.to_string()
            }
            (None, ModelChoice::Checkpoint { weights, .. }) => weights
                .file_stem()
                .map_or_else(|| "checkpoint".into(), |s| s.to_string_lossy().into_owned()),
        };
        let listen = match &f.listen {
            None => vec![Listen::Unix(PathBuf::from(DEFAULT_SOCKET))],
            Some(v) if v.is_empty() => {
                return Err(bad("listen", "empty: nothing to listen on".into()));
            }
            Some(v) => v
                .iter()
                .enumerate()
                .map(|(i, s)| Listen::parse(&format!("listen[{i}]"), s))
                .collect::<Result<_>>()?,
        };
        let allow_remote = f.allow_remote.unwrap_or(false);
        check_remote(&listen, allow_remote)?;
        let e = &f.engine;
        let max_sequences: usize = range("engine.max_sequences", e.max_sequences, 64, 1, 4096)?;
        let engine = EngineConfig {
            threads: range("engine.threads", e.threads, 0, 0, 1024)?,
            chunk: range("engine.chunk", e.chunk, 256, 1, 1 << 20)?,
            max_decode_batch: range("engine.max_decode_batch", e.max_decode_batch, 32, 1, 4096)?,
            max_sequences,
            context_limit: range(
                "engine.context_limit",
                e.context_limit,
                1 << 16,
                64,
                1 << 24,
            )?,
            queue_depth: range("engine.queue_depth", e.queue_depth, 256, 1, 1 << 20)?,
            session_idle_ms: range(
                "engine.session_idle_ms",
                e.session_idle_ms,
                600_000,
                1,
                7 * 86_400_000,
            )?,
            max_sessions: range("engine.max_sessions", e.max_sessions, 1024, 1, 1 << 20)?,
        };
        let l = &f.limits;
        let limits = Limits {
            max_body_bytes: range(
                "limits.max_body_bytes",
                l.max_body_bytes,
                4 << 20,
                1024,
                1 << 30,
            )?,
            max_kv_body_bytes: range(
                "limits.max_kv_body_bytes",
                l.max_kv_body_bytes,
                256 << 20,
                4096,
                4 << 30,
            )?,
            max_header_bytes: range(
                "limits.max_header_bytes",
                l.max_header_bytes,
                16 << 10,
                8192,
                1 << 20,
            )?,
            max_prompt_tokens: range(
                "limits.max_prompt_tokens",
                l.max_prompt_tokens,
                engine.context_limit.min(1 << 16),
                1,
                engine.context_limit,
            )?,
            max_tokens: range(
                "limits.max_tokens",
                l.max_tokens,
                4096,
                1,
                engine.context_limit,
            )?,
            request_timeout_ms: range(
                "limits.request_timeout_ms",
                l.request_timeout_ms,
                600_000,
                100,
                86_400_000,
            )?,
            max_connections: range(
                "limits.max_connections",
                l.max_connections,
                1024,
                1,
                1 << 20,
            )?,
            max_pin_ttl_ms: range(
                "limits.max_pin_ttl_ms",
                l.max_pin_ttl_ms,
                3_600_000,
                1,
                72 * 3_600_000,
            )?,
        };
        let pool_capacity_bytes = match f.window_pool.capacity_bytes {
            None | Some(0) => None,
            Some(b) if b < 1 << 20 => {
                return Err(bad(
                    "window_pool.capacity_bytes",
                    format!("{b} is below 1 MiB (0: 10% of RAM)"),
                ));
            }
            Some(b) => Some(b),
        };
        let pool_ttl_ms = range(
            "window_pool.ttl_ms",
            f.window_pool.ttl_ms,
            kvstack_tiers::window_pool::DEFAULT_TTL_MS,
            1,
            86_400_000,
        )?;
        let pool_remote = pool_remote(&f.window_pool)?;
        let ssd_capacity_bytes = match f.ssd.capacity_bytes {
            None => None,
            Some(b) if b < 256 << 20 => {
                return Err(bad("ssd.capacity_bytes", format!("{b} is below 256 MiB")));
            }
            Some(b) => Some(b),
        };
        let ssd_io_engine = match &f.ssd.io_engine {
            None => None,
            Some(v) => {
                let mut probe = kvstack_tiers::StoreOptions::new(
                    kvstack_tiers::StoreLocation::Directory(PathBuf::new()),
                );
                probe
                    .set_io_engine(v)
                    .map_err(|e| bad("ssd.io_engine", e.to_string()))?;
                Some(v.clone())
            }
        };
        let ssd_retention_hours = range(
            "ssd.retention_hours",
            f.ssd.retention_hours,
            72,
            1,
            24 * 365,
        )?;
        let drain_timeout_ms = range("drain.timeout_ms", f.drain.timeout_ms, 30_000, 0, 3_600_000)?;
        let tenants = tenants(&f.tenant, &engine, &limits)?;
        let cluster = match &f.cluster {
            None => None,
            Some(c) => Some(cluster(c, pool_remote.as_ref())?),
        };
        Ok(Config {
            data_dir: f
                .data_dir
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            listen,
            allow_remote,
            model,
            model_name,
            engine,
            limits,
            pool_capacity_bytes,
            pool_ttl_ms,
            pool_remote,
            ssd_capacity_bytes,
            ssd_io_engine,
            ssd_retention_hours,
            drain_timeout_ms,
            tenants,
            cluster,
        })
    }

    /// Replaces the listening addresses (`--listen`), checked as the file's are.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad address or a remote one without `allow_remote`.
    pub fn set_listen(&mut self, listen: &[String]) -> Result<()> {
        let l = listen
            .iter()
            .map(|s| Listen::parse("--listen", s))
            .collect::<Result<Vec<_>>>()?;
        check_remote(&l, self.allow_remote)?;
        self.listen = l;
        Ok(())
    }

    /// The tenant called `name` when `secret` is this node's `[cluster] peer_secret` (a peer
    /// node fetching a unit on that tenant's behalf); compared in constant time.
    pub fn tenant_for_peer(&self, secret: &str, name: &str) -> Option<&Tenant> {
        let c = self.cluster.as_ref()?;
        let want: [u8; 32] = Sha256::digest(c.peer_secret.as_bytes()).into();
        let got: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        if !ct_eq(&want, &got) {
            return None;
        }
        self.tenants.iter().find(|t| t.name == name)
    }

    /// The tenant whose key hashes to `digest`; with no keys configured, the default tenant.
    pub fn tenant_for_key(&self, key: Option<&str>) -> Option<&Tenant> {
        if self.tenants.len() == 1 && self.tenants[0].api_key_sha256.is_none() {
            return self.tenants.first();
        }
        let key = key?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // Every tenant is compared (no early exit on a match position), in constant time per
        // comparison, so timing does not tell how close a guess came.
        let mut found = None;
        for t in &self.tenants {
            if let Some(d) = &t.api_key_sha256
                && ct_eq(d, &digest)
            {
                found = Some(t);
            }
        }
        found
    }
}

fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check_remote(listen: &[Listen], allow_remote: bool) -> Result<()> {
    for l in listen {
        if let Listen::Tcp(a) = l
            && !a.ip().is_loopback()
            && !allow_remote
        {
            return Err(bad(
                "listen",
                format!(
                    "{l} is not a loopback address; set allow_remote = true to serve the network"
                ),
            ));
        }
    }
    Ok(())
}

/// `[cluster]`, checked: it needs the shared prefix index (`window_pool.redis_node_id`).
fn cluster(c: &ClusterFile, remote: Option<&kvstack_tiers::RedisOptions>) -> Result<ClusterConfig> {
    let Some(own) = remote.and_then(|r| r.node_id.as_deref()) else {
        return Err(bad(
            "cluster",
            "needs window_pool.backend = \"redis-cluster\" and window_pool.redis_node_id (the \
             shared prefix index names the peers)"
                .into(),
        ));
    };
    let secret = c
        .peer_secret
        .clone()
        .ok_or_else(|| bad("cluster.peer_secret", "missing".into()))?;
    if secret.len() < 16 || secret.len() > 256 || !secret.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(bad(
            "cluster.peer_secret",
            "16 to 256 printable ASCII characters".into(),
        ));
    }
    let mut peers: Vec<(String, Listen)> = Vec::new();
    for (i, p) in c.peer.iter().enumerate() {
        let key = |k: &str| format!("cluster.peer[{i}].{k}");
        let id = p
            .node_id
            .clone()
            .ok_or_else(|| bad(&key("node_id"), "missing".into()))?;
        if id.is_empty() || id.len() > 128 || !id.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(
                &key("node_id"),
                format!("`{id}`: 1 to 128 printable ASCII characters"),
            ));
        }
        if id == own || peers.iter().any(|(o, _)| *o == id) {
            return Err(bad(
                &key("node_id"),
                format!("`{id}` is this node or given twice"),
            ));
        }
        let addr = p
            .address
            .as_deref()
            .ok_or_else(|| bad(&key("address"), "missing".into()))?;
        peers.push((id, Listen::parse(&key("address"), addr)?));
    }
    Ok(ClusterConfig {
        peer_secret: secret,
        peers,
        fetch_timeout_ms: range(
            "cluster.fetch_timeout_ms",
            c.fetch_timeout_ms,
            10_000,
            10,
            600_000,
        )?,
    })
}

/// The Redis Cluster level of `[window_pool]`, checked (`docs/appliance.md`).
fn pool_remote(p: &PoolFile) -> Result<Option<kvstack_tiers::RedisOptions>> {
    let redis_keys = p.redis_nodes.is_some()
        || p.redis_key_prefix.is_some()
        || p.redis_connect_timeout_ms.is_some()
        || p.redis_io_timeout_ms.is_some()
        || p.redis_retry_ms.is_some()
        || p.redis_node_id.is_some()
        || p.local_level.is_some();
    match p.backend.as_deref().unwrap_or("dram") {
        "dram" if redis_keys => {
            return Err(bad(
                "window_pool.backend",
                "redis_* and local_level keys need backend = \"redis-cluster\"".into(),
            ));
        }
        "dram" => return Ok(None),
        "redis-cluster" => {}
        other => {
            return Err(bad(
                "window_pool.backend",
                format!("`{other}`: expected \"dram\" or \"redis-cluster\""),
            ));
        }
    }
    let nodes = p.redis_nodes.clone().unwrap_or_default();
    if nodes.is_empty() || nodes.len() > 64 {
        return Err(bad(
            "window_pool.redis_nodes",
            "1 to 64 seed node URLs needed with backend = \"redis-cluster\"".into(),
        ));
    }
    for (i, n) in nodes.iter().enumerate() {
        let ok = n
            .strip_prefix("redis://")
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_graphic()));
        if !ok || n.len() > 256 {
            return Err(bad(
                &format!("window_pool.redis_nodes[{i}]"),
                format!("`{n}`: expected redis://HOST:PORT"),
            ));
        }
    }
    let prefix = p
        .redis_key_prefix
        .clone()
        .unwrap_or_else(|| kvstack_tiers::redis_pool::DEFAULT_KEY_PREFIX.into());
    if prefix.is_empty()
        || prefix.len() > 64
        || !prefix.bytes().all(|b| b.is_ascii_graphic())
        || prefix.contains(['{', '}'])
    {
        return Err(bad(
            "window_pool.redis_key_prefix",
            format!("`{prefix}`: 1 to 64 printable ASCII characters, no braces"),
        ));
    }
    let mut o = kvstack_tiers::RedisOptions::new(nodes);
    o.key_prefix = prefix;
    o.connect_timeout_ms = range(
        "window_pool.redis_connect_timeout_ms",
        p.redis_connect_timeout_ms,
        o.connect_timeout_ms,
        1,
        60_000,
    )?;
    o.io_timeout_ms = range(
        "window_pool.redis_io_timeout_ms",
        p.redis_io_timeout_ms,
        o.io_timeout_ms,
        1,
        60_000,
    )?;
    o.retry_ms = range(
        "window_pool.redis_retry_ms",
        p.redis_retry_ms,
        o.retry_ms,
        10,
        600_000,
    )?;
    o.local_level = p.local_level.unwrap_or(true);
    if let Some(n) = &p.redis_node_id {
        if n.is_empty() || n.len() > 128 || !n.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(
                "window_pool.redis_node_id",
                format!("`{n}`: 1 to 128 printable ASCII characters"),
            ));
        }
        o.node_id = Some(n.clone());
    }
    // The client parses the URLs the same way at start; refuse here, with the key.
    kvstack_tiers::RedisPool::new(o.clone(), 1).map_err(|e| {
        bad(
            "window_pool.redis_nodes",
            format!(
                "{e}{}",
                std::error::Error::source(&e)
                    .map(|s| format!(": {s}"))
                    .unwrap_or_default()
            ),
        )
    })?;
    Ok(Some(o))
}

fn tenants(list: &[TenantFile], e: &EngineConfig, l: &Limits) -> Result<Vec<Tenant>> {
    if list.is_empty() {
        return Ok(vec![Tenant {
            name: DEFAULT_TENANT.into(),
            api_key_sha256: None,
            max_concurrent: e.queue_depth,
            max_prompt_tokens: l.max_prompt_tokens,
            dram_pool_bytes: None,
            ssd_bytes: None,
        }]);
    }
    let mut out: Vec<Tenant> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let key = |k: &str| format!("tenant[{i}].{k}");
        let name = t
            .name
            .clone()
            .ok_or_else(|| bad(&key("name"), "missing".into()))?;
        if name.is_empty() || name.len() > 128 || !name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(
                &key("name"),
                format!("`{name}`: 1 to 128 printable ASCII characters"),
            ));
        }
        if out.iter().any(|o| o.name == name) {
            return Err(bad(&key("name"), format!("`{name}` is given twice")));
        }
        let hex = t.api_key_sha256.as_deref().ok_or_else(|| {
            bad(
                &key("api_key_sha256"),
                "missing (every configured tenant needs a key)".into(),
            )
        })?;
        let digest = parse_sha256(hex).ok_or_else(|| {
            bad(
                &key("api_key_sha256"),
                "expected 64 hex digits (sha256sum of the key)".into(),
            )
        })?;
        if out.iter().any(|o| o.api_key_sha256 == Some(digest)) {
            return Err(bad(
                &key("api_key_sha256"),
                "the same key as another tenant".into(),
            ));
        }
        out.push(Tenant {
            name,
            api_key_sha256: Some(digest),
            max_concurrent: range(
                &key("max_concurrent"),
                t.max_concurrent,
                e.queue_depth as u64,
                1,
                e.queue_depth as u64,
            )?,
            max_prompt_tokens: range(
                &key("max_prompt_tokens"),
                t.max_prompt_tokens,
                l.max_prompt_tokens as u64,
                1,
                l.max_prompt_tokens as u64,
            )?,
            dram_pool_bytes: match t.dram_pool_bytes {
                None => None,
                Some(b) => Some(range(&key("dram_pool_bytes"), Some(b), 0, 0, 1 << 50)?),
            },
            ssd_bytes: match t.ssd_bytes {
                None => None,
                Some(b) => Some(range(&key("ssd_bytes"), Some(b), 0, 0, 1 << 60)?),
            },
        });
    }
    Ok(out)
}

/// 64 hex digits as bytes.
fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let b = hex.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in b.chunks_exact(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// SHA-256 of `key` in hex, as `api_key_sha256` wants it (`printf %s KEY | sha256sum`).
pub fn key_digest_hex(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_the_documented_defaults() {
        let c = Config::from_toml_str("", "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.engine.queue_depth, 256);
        assert_eq!(c.engine.chunk, 256);
        assert_eq!(c.limits.max_tokens, 4096);
        assert_eq!(c.ssd_retention_hours, 72);
        assert_eq!(c.ssd_io_engine, None);
        assert_eq!(c.pool_capacity_bytes, None);
        assert_eq!(c.model, ModelChoice::Builtin { seed: 0 });
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(c.listen, vec![Listen::Unix(PathBuf::from(DEFAULT_SOCKET))]);
        assert_eq!(c.tenants.len(), 1);
        assert!(c.tenant_for_key(None).is_some());
        assert_eq!(c.pool_remote, None);
        let c = Config::from_toml_str(
            "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://127.0.0.1:7000\"]",
            "t",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let r = c.pool_remote.unwrap_or_else(|| panic!("no redis options"));
        assert_eq!(
            (r.key_prefix.as_str(), r.connect_timeout_ms, r.io_timeout_ms),
            ("kvstack:", 500, 1000)
        );
        assert_eq!((r.retry_ms, r.local_level), (1000, true));
    }

    #[test]
    fn ssd_io_engine_puts_the_store_on_a_vfio_namespace() {
        let c = Config::from_toml_str("[ssd]\nio_engine = \"vfio:0000:00:04.0\"", "t")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.ssd_io_engine.as_deref(), Some("vfio:0000:00:04.0"));
        let opts = service_options_store(&c);
        assert_eq!(
            opts.location.path(),
            std::path::Path::new("vfio:0000:00:04.0")
        );
        let c = Config::from_toml_str("[ssd]\nio_engine = \"sync\"", "t")
            .unwrap_or_else(|e| panic!("{e}"));
        let opts = service_options_store(&c);
        assert_eq!(format!("{:?}", opts.engine), "SyncBuffered");
    }

    /// The store options the daemon opens with `c`.
    fn service_options_store(c: &Config) -> kvstack_tiers::StoreOptions {
        crate::service_options(c)
            .tiers
            .unwrap_or_else(|| panic!("no tiers"))
            .store
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let cases = [
            ("bogus = 1", "bogus"),
            ("[engine]\nchunk = 0", "engine.chunk"),
            ("[engine]\nthreadz = 2", "threadz"),
            ("listen = [\"udp:1\"]", "listen[0]"),
            ("listen = [\"tcp:0.0.0.0:80\"]", "allow_remote"),
            ("[limits]\nmax_tokens = \"many\"", "max_tokens"),
            ("[[tenant]]\nname = \"a\"", "tenant[0].api_key_sha256"),
            (
                "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"xyz\"",
                "tenant[0].api_key_sha256",
            ),
            ("[model]\nconfig = \"c.json\"", "model.weights"),
            (
                "[window_pool]\ncapacity_bytes = 5",
                "window_pool.capacity_bytes",
            ),
            (
                "[window_pool]\nbackend = \"memcached\"",
                "window_pool.backend",
            ),
            ("[window_pool]\nredis_retry_ms = 100", "window_pool.backend"),
            (
                "[window_pool]\nbackend = \"redis-cluster\"",
                "window_pool.redis_nodes",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"http://x:1\"]",
                "window_pool.redis_nodes[0]",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_key_prefix = \"{x}\"",
                "window_pool.redis_key_prefix",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_io_timeout_ms = 0",
                "window_pool.redis_io_timeout_ms",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_node_id = \"a b\"",
                "window_pool.redis_node_id",
            ),
            ("[cluster]\npeer_secret = \"0123456789abcdef\"", "cluster"),
            ("[ssd]\nio_engine = \"spdk\"", "ssd.io_engine"),
            ("[ssd]\nio_engine = \"vfio:00:04.0\"", "ssd.io_engine"),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_node_id = \"a\"\n[cluster]\npeer_secret = \"short\"",
                "cluster.peer_secret",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_node_id = \"a\"\n[cluster]\npeer_secret = \"0123456789abcdef\"\n[[cluster.peer]]\nnode_id = \"a\"\naddress = \"unix:/x\"",
                "cluster.peer[0].node_id",
            ),
            (
                "[window_pool]\nbackend = \"redis-cluster\"\nredis_nodes = [\"redis://a:1\"]\nredis_node_id = \"a\"\n[cluster]\npeer_secret = \"0123456789abcdef\"\n[[cluster.peer]]\nnode_id = \"b\"\naddress = \"udp:1\"",
                "cluster.peer[0].address",
            ),
        ];
        for (text, want) in cases {
            let e = Config::from_toml_str(text, "t")
                .err()
                .map(|e| e.to_string());
            let e = e.unwrap_or_else(|| panic!("accepted: {text}"));
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn tenants_are_found_by_key_only() {
        let text = format!(
            "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\n[[tenant]]\nname = \"b\"\napi_key_sha256 = \"{}\"\n",
            key_digest_hex("key-a"),
            key_digest_hex("key-b")
        );
        let c = Config::from_toml_str(&text, "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            c.tenant_for_key(Some("key-a")).map(|t| t.name.as_str()),
            Some("a")
        );
        assert_eq!(
            c.tenant_for_key(Some("key-b")).map(|t| t.name.as_str()),
            Some("b")
        );
        assert!(c.tenant_for_key(Some("key-c")).is_none());
        assert!(c.tenant_for_key(None).is_none());
    }
}
