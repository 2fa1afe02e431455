//! Fetching a unit's global KV from the node that holds it (`docs/cluster.md`): before a
//! completion is queued, a node whose own tiers hold less of the prompt than the shared prefix
//! index says another node holds asks that node's `/v1/kv/get` (authenticated with the
//! `[cluster] peer_secret`, acting for the request's tenant), checks the frame (every block's
//! and the window's CRC-32C, sizes, the model fingerprint) and stores the unit in its own tiers,
//! durably, before the engine looks the prompt up. Every failure (peer down, not listed, slow,
//! damaged frame, another model) is a miss: the request is served from what this node has.
//!
//! Policy: the fetched unit is kept like any unit this node persisted (SSD retention, the
//! tenant's SSD quota), so the next turns here need no fetch; it is indexed under this node's
//! id, so later askers come here.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use crate::config::{ClusterConfig, Config, Listen, Tenant};
use crate::http::{AppState, PEER_HEADER, PEER_TENANT_HEADER, fingerprint_hex};

/// What a fetch brought (reported in `usage.kvstack.peer_fetch`).
#[derive(Clone, Debug)]
pub struct Fetched {
    /// The node it came from.
    pub node: String,
    /// Tokens of the unit stored here.
    pub tokens: u64,
    /// Bytes of the frame.
    pub bytes: u64,
    /// Time of the fetch and the durable store.
    pub ms: f64,
}

impl Fetched {
    /// As `usage.kvstack.peer_fetch`.
    pub fn to_json(&self) -> Value {
        json!({"node": self.node, "tokens": self.tokens, "bytes": self.bytes, "ms": self.ms})
    }
}

/// POSTs `tokens` to `addr`'s `/v1/kv/get` as a peer acting for `tenant`; the frame, or why
/// not.
async fn get_frame(
    addr: &Listen,
    secret: &str,
    tenant: &str,
    tokens: &[u32],
    max_bytes: usize,
) -> Result<Bytes, String> {
    let body = json!({ "tokens": tokens }).to_string();
    let req = hyper::Request::post("/v1/kv/get")
        .header(hyper::header::HOST, "kvstackd")
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(PEER_HEADER, secret)
        .header(PEER_TENANT_HEADER, tenant)
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = match addr {
        Listen::Unix(p) => {
            let io = tokio::net::UnixStream::connect(p)
                .await
                .map_err(|e| format!("connect {}: {e}", p.display()))?;
            send(TokioIo::new(io), req).await?
        }
        Listen::Tcp(a) => {
            let io = tokio::net::TcpStream::connect(a)
                .await
                .map_err(|e| format!("connect {a}: {e}"))?;
            send(TokioIo::new(io), req).await?
        }
    };
    let status = resp.status();
    let bytes = Limited::new(resp.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    if status != hyper::StatusCode::OK {
        return Err(format!(
            "{status}: {}",
            String::from_utf8_lossy(bytes.get(..200.min(bytes.len())).unwrap_or_default())
        ));
    }
    Ok(bytes)
}

async fn send<T>(
    io: TokioIo<T>,
    req: hyper::Request<Full<Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, String>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            log::debug!("peer connection: {e}");
        }
    });
    sender
        .send_request(req)
        .await
        .map_err(|e| format!("request: {e}"))
}

/// Fetches the unit of `tokens` from the node the shared prefix index names, when it holds
/// more of them than this node does (module docs). `None`: nothing fetched (not needed, or a
/// miss; failures are logged at warning and counted).
pub async fn maybe_fetch(
    s: &AppState,
    cfg: &Config,
    tenant: &Tenant,
    tokens: &[u32],
) -> Option<Fetched> {
    let cluster: &ClusterConfig = cfg.cluster.as_ref()?;
    let tiers = s.shared.tiers.read().ok()?.clone()?;
    let t0 = Instant::now();
    let cache_tenant = kvstack_tiers::Tenant::new(&tenant.name);
    let (tiers2, ct, toks) = (tiers.clone(), cache_tenant.clone(), tokens.to_vec());
    // Local and index lookups touch the SSD index and Redis: off the async threads.
    let (local, ix) = tokio::task::spawn_blocking(move || {
        let local = tiers2.lookup(&toks, &ct).tokens;
        (local, tiers2.cluster_lookup(&toks, &ct))
    })
    .await
    .ok()?;
    let ix = ix?;
    let own = tiers.remote()?.options().node_id.clone()?;
    let page = tiers.geometry().page_tokens as u64;
    let covered = (ix.blocks as u64 * page)
        .min(ix.entry.unit_tokens)
        .min(tokens.len() as u64);
    if ix.entry.node == own || covered <= local {
        return None;
    }
    let node = ix.entry.node;
    let Some((_, addr)) = cluster.peers.iter().find(|(id, _)| *id == node) else {
        log::warn!("the shared prefix index names node `{node}`, which [cluster] does not list");
        s.metrics.peer_fetch_failures.inc();
        return None;
    };
    let timeout = Duration::from_millis(cluster.fetch_timeout_ms);
    let got = tokio::time::timeout(
        timeout,
        get_frame(
            addr,
            &cluster.peer_secret,
            &tenant.name,
            tokens,
            cfg.limits.max_kv_body_bytes,
        ),
    )
    .await
    .unwrap_or_else(|_| Err(format!("no answer in {timeout:?}")));
    let frame = match got {
        Ok(f) => f,
        Err(e) => {
            log::warn!("fetching {covered} tokens from node `{node}` ({addr}) failed: {e}");
            s.metrics.peer_fetch_failures.inc();
            return None;
        }
    };
    let bytes = frame.len() as u64;
    let (toks, n_tokens) = (tokens.to_vec(), tokens.len() as u64);
    let stored = tokio::task::spawn_blocking(move || -> Result<u64, String> {
        // Every CRC and size is checked by the decoder; the model must be this one.
        let f = crate::frame::decode(&frame).map_err(|e| e.to_string())?;
        if f.header.model.as_deref() != Some(fingerprint_hex(&tiers).as_str()) {
            return Err("the peer serves another model".into());
        }
        if f.header.page_tokens as usize != tiers.geometry().page_tokens {
            return Err("the peer uses another page size".into());
        }
        let n = f.header.tokens;
        if n == 0 || n > n_tokens {
            return Err(format!("{n} tokens for a request of {n_tokens}"));
        }
        let data = kvstack_tiers::UnitData {
            tokens: n,
            blocks: f.blocks,
            window: f.window,
        };
        tiers
            .write_unit(&cache_tenant, &toks[..n as usize], &data)
            .and_then(|t| t.wait())
            .map_err(|e| e.to_string())?;
        Ok(n)
    })
    .await
    .map_err(|e| e.to_string())
    .and_then(|r| r);
    match stored {
        Ok(n) => {
            s.metrics.peer_fetches.inc();
            s.metrics.peer_fetched_bytes.inc_by(bytes);
            Some(Fetched {
                node,
                tokens: n,
                bytes,
                ms: t0.elapsed().as_secs_f64() * 1e3,
            })
        }
        Err(e) => {
            log::warn!("the unit fetched from node `{node}` was not stored: {e}");
            s.metrics.peer_fetch_failures.inc();
            None
        }
    }
}
