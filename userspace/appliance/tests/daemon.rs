//! kvstackd end to end: the real binary on a temporary data directory and Unix socket.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[path = "../../tiers/tests/support/redis_cluster.rs"]
mod redis_cluster;

struct Daemon {
    child: Child,
    sock: PathBuf,
}

impl Daemon {
    fn start(dir: &Path, config: &str) -> Daemon {
        Daemon::start_with(dir, config, None, &[], 1 << 30, "")
    }

    /// `activate`: the socket systemd-socket-activate listens on (the config's own address
    /// is then a different path, which must stay unused).
    fn start_with(
        dir: &Path,
        config: &str,
        activate: Option<&Path>,
        env: &[(&str, String)],
        ssd_bytes: u64,
        pool: &str,
    ) -> Daemon {
        Daemon::start_toml(
            dir,
            &format!(
                "[window_pool]\ncapacity_bytes = 67108864\n{pool}\n[ssd]\ncapacity_bytes = {ssd_bytes}\n[engine]\nthreads = 1\nmax_sequences = 8\ncontext_limit = 4096\n{config}"
            ),
            activate,
            env,
        )
    }

    /// Starts kvstackd on `dir` with `body` after its `data_dir` and `listen` lines.
    fn start_toml(
        dir: &Path,
        body: &str,
        activate: Option<&Path>,
        env: &[(&str, String)],
    ) -> Daemon {
        let sock = dir.join("kvstackd.sock");
        let cfg = dir.join("kvstackd.toml");
        std::fs::write(
            &cfg,
            format!(
                "data_dir = \"{}\"\nlisten = [\"unix:{}\"]\n{body}",
                dir.join("data").display(),
                sock.display()
            ),
        )
        .unwrap();
        let mut cmd = match activate {
            Some(a) => {
                let mut c = Command::new("systemd-socket-activate");
                c.arg("-l").arg(a);
                // It hands the program a fresh environment: pass what the test sets.
                for (k, v) in env {
                    c.arg(format!("--setenv={k}={v}"));
                }
                c.arg(env!("CARGO_BIN_EXE_kvstackd"));
                c
            }
            None => Command::new(env!("CARGO_BIN_EXE_kvstackd")),
        };
        // The daemon's log, appended across restarts, for a failing test to show.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("kvstackd.log"))
            .unwrap();
        cmd.arg("--config").arg(&cfg).stderr(log);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        let child = cmd.spawn().unwrap();
        let sock = activate.map_or(sock, Path::to_path_buf);
        let d = Daemon { child, sock };
        let t0 = Instant::now();
        loop {
            if let Ok((200, _)) = d.try_req("GET", "/readyz", None, "") {
                return d;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "kvstackd not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn try_req(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: &str,
    ) -> std::io::Result<(u16, String)> {
        let (st, b) = self.try_req_bytes(method, path, key, "application/json", body.as_bytes())?;
        Ok((st, String::from_utf8_lossy(&b).into_owned()))
    }

    fn try_req_bytes(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        content_type: &str,
        body: &[u8],
    ) -> std::io::Result<(u16, Vec<u8>)> {
        let mut s = UnixStream::connect(&self.sock)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let auth = key
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )?;
        // A server may answer (400, 413) before reading the whole body and close: its
        // answer is still there to read.
        match s.write_all(body) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            r => r?,
        }
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let status = std::str::from_utf8(out.get(9..12).unwrap_or_default())
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let split = out
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .map_or(out.len(), |p| p + 4);
        Ok((status, out[split..].to_vec()))
    }

    fn req_bytes(&self, path: &str, key: Option<&str>, body: &[u8]) -> (u16, Vec<u8>) {
        self.try_req_bytes("POST", path, key, "application/octet-stream", body)
            .unwrap()
    }

    fn req(&self, method: &str, path: &str, key: Option<&str>, body: &str) -> (u16, String) {
        self.try_req(method, path, key, body).unwrap()
    }

    fn json(&self, path: &str, key: Option<&str>, body: &str) -> serde_json::Value {
        let (st, b) = self.req("POST", path, key, body);
        assert_eq!(st, 200, "{path} {body}: {b}");
        serde_json::from_str(&b).unwrap()
    }

    fn stop(mut self) -> i32 {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(pid, 15) };
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code().unwrap_or(-1);
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no exit 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

unsafe extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

impl Daemon {
    /// The daemon's log file.
    fn log(&self) -> PathBuf {
        self.sock.with_file_name("kvstackd.log")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn completes_streams_reuses_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "");
    let (st, body) = d.req("GET", "/v1/models", None, "");
    assert_eq!(st, 200, "{body}");
    assert!(body.contains("kvstack-tiny"), "{body}");

    let prompt: Vec<u32> = (0..300).map(|i| (i * 7 + 3) % 250).collect();
    let req =
        serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "session": "s1"})
            .to_string();
    let a = d.json("/v1/completions", None, &req);
    assert_eq!(
        a["choices"][0]["tokens"].as_array().unwrap().len(),
        4,
        "{a}"
    );
    assert_eq!(a["usage"]["completion_tokens"], 4);
    // The next turn of the same session reuses its context.
    let req2 = serde_json::json!({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "session": "s1"}).to_string();
    let b = d.json("/v1/completions", None, &req2);
    assert!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{b}"
    );

    // Streaming: one event per token, then [DONE].
    let sreq = serde_json::json!({"prompt": "hello, kvstack", "max_tokens": 3, "stream": true})
        .to_string();
    let (st, body) = d.req("POST", "/v1/completions", None, &sreq);
    assert_eq!(st, 200, "{body}");
    assert_eq!(body.matches("\"token\":").count(), 3, "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");

    // The same prompt without a session: its prefix comes through the tiers.
    let fresh =
        serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    let c = d.json("/v1/completions", None, &fresh);
    assert!(
        c["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{c}"
    );
    let (st, m) = d.req("GET", "/metrics", None, "");
    assert_eq!(st, 200);
    assert!(m.contains("kvstack_requests_total"), "{m}");
    assert_eq!(d.stop(), 0, "SIGTERM must drain and exit 0");

    // After a restart, SSD hits survive.
    let d = Daemon::start(dir.path(), "");
    let e = d.json("/v1/completions", None, &fresh);
    assert!(
        e["usage"]["kvstack"]["ssd_tokens"].as_u64().unwrap() > 0,
        "{e}"
    );
    let l = d.json(
        "/v1/kv/lookup",
        None,
        &serde_json::json!({"tokens": prompt}).to_string(),
    );
    assert!(l["tokens"].as_u64().unwrap() > 0, "{l}");
    assert_eq!(d.stop(), 0);
}

#[test]
fn bad_requests_get_4xx_naming_the_field_and_tenants_are_isolated() {
    let dir = tempfile::tempdir().unwrap();
    let ka = "key-of-a";
    let kb = "key-of-b";
    let d = Daemon::start(dir.path(), &two_tenants(ka, kb));
    let ok = r#"{"prompt": [1, 2, 3], "max_tokens": 1}"#;
    assert_eq!(d.req("POST", "/v1/completions", None, ok).0, 401);
    assert_eq!(d.req("POST", "/v1/completions", Some("wrong"), ok).0, 401);
    let cases = [
        ("{", "body"),
        ("[1]", "body"),
        (r#"{"max_tokens": 1}"#, "prompt"),
        (r#"{"prompt": []}"#, "prompt"),
        (r#"{"prompt": [1, 99999]}"#, "prompt[1]"),
        (r#"{"prompt": [1, -1]}"#, "prompt[1]"),
        (r#"{"prompt": [1], "max_tokens": 0}"#, "max_tokens"),
        (r#"{"prompt": [1], "max_tokens": "x"}"#, "max_tokens"),
        (r#"{"prompt": [1], "temperature": 9}"#, "temperature"),
        (r#"{"prompt": [1], "top_p": 0}"#, "top_p"),
        (r#"{"prompt": [1], "stream": 3}"#, "stream"),
        (r#"{"prompt": [1], "n": 2}"#, "n"),
    ];
    for (body, field) in cases {
        let (st, b) = d.req("POST", "/v1/completions", Some(ka), body);
        assert_eq!(st, 400, "{body}: {b}");
        assert!(b.contains(field), "{body}: {b}");
    }
    // Tenant a's prompt is cached for a, never for b.
    let prompt: Vec<u32> = (0..200).map(|i| (i * 11 + 1) % 250).collect();
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    d.json("/v1/completions", Some(ka), &req);
    // Units are written behind: another session finds the prefix once it is durable.
    let lookup = serde_json::json!({"tokens": prompt}).to_string();
    let t0 = Instant::now();
    while d.json("/v1/kv/lookup", Some(ka), &lookup)["tokens"] == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "tenant a's unit never became durable"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // A unit is reused by a longer prompt (an agent's next turn appends to the last).
    let mut longer = prompt.clone();
    longer.extend([1, 2, 3]);
    let req = serde_json::json!({"prompt": longer, "max_tokens": 1, "temperature": 0}).to_string();
    let again = d.json("/v1/completions", Some(ka), &req);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{again}"
    );
    let other = d.json("/v1/completions", Some(kb), &req);
    assert_eq!(
        other["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "{other}"
    );
    let lb = d.json(
        "/v1/kv/lookup",
        Some(kb),
        &serde_json::json!({"tokens": prompt}).to_string(),
    );
    assert_eq!(lb["tokens"], 0, "{lb}");
    assert_eq!(d.stop(), 0);
}

/// Completes `prompt` for `key` and waits until its unit is durable; returns the lookup.
fn complete_and_look_up(d: &Daemon, key: &str, prompt: &[u32]) -> serde_json::Value {
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    d.json("/v1/completions", Some(key), &req);
    wait_durable(d, Some(key), prompt);
    let lookup = serde_json::json!({"tokens": prompt}).to_string();
    d.json("/v1/kv/lookup", Some(key), &lookup)
}

#[test]
fn dram_pool_quotas_bound_each_tenant_and_reload() {
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = ("key-of-a", "key-of-b");
    let tenants = two_tenants(ka, kb).replacen(
        "[[tenant]]\nname = \"b\"",
        "dram_pool_bytes = 0\n[[tenant]]\nname = \"b\"",
        1,
    );
    let d = Daemon::start(dir.path(), &tenants);
    let p = |k: u32| -> Vec<u32> { (0..200).map(|i| (i * 7 + k * 31 + 3) % 250).collect() };
    // a may keep no snapshot; b, without a quota, keeps each one.
    let la = complete_and_look_up(&d, ka, &p(1));
    assert_eq!(la["tiers"]["dram_window"], false, "{la}");
    assert_eq!(la["tenant"]["dram_pool_bytes"], 0, "{la}");
    assert_eq!(la["tenant"]["dram_pool_quota_bytes"], 0, "{la}");
    let lb = complete_and_look_up(&d, kb, &p(1));
    assert_eq!(lb["tiers"]["dram_window"], true, "{lb}");
    assert!(lb["tenant"]["dram_pool_quota_bytes"].is_null(), "{lb}");
    let slot = lb["tenant"]["dram_pool_bytes"].as_u64().unwrap();
    assert!(slot > 0, "{lb}");
    let lb = complete_and_look_up(&d, kb, &p(2));
    assert_eq!(lb["tenant"]["dram_pool_bytes"], 2 * slot, "{lb}");

    // SIGHUP with b's quota at one slot: b's next snapshot replaces its older ones.
    let cfg = dir.path().join("kvstackd.toml");
    let text = std::fs::read_to_string(&cfg).unwrap().replacen(
        "name = \"b\"",
        &format!("name = \"b\"\ndram_pool_bytes = {slot}"),
        1,
    );
    std::fs::write(&cfg, text).unwrap();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc_kill(d.child.id() as i32, 1) };
    let t0 = Instant::now();
    let probe = serde_json::json!({"tokens": p(2)}).to_string();
    while d.json("/v1/kv/lookup", Some(kb), &probe)["tenant"]["dram_pool_quota_bytes"] != slot {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the reload never applied"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let lb = complete_and_look_up(&d, kb, &p(3));
    assert_eq!(lb["tiers"]["dram_window"], true, "{lb}");
    assert_eq!(lb["tenant"]["dram_pool_bytes"], slot, "{lb}");
    for k in [1, 2] {
        let l = d.json(
            "/v1/kv/lookup",
            Some(kb),
            &serde_json::json!({"tokens": p(k)}).to_string(),
        );
        assert_eq!(l["tiers"]["dram_window"], false, "p({k}): {l}");
        assert!(l["tokens"].as_u64() > Some(0), "the SSD keeps p({k}): {l}");
    }
    // a's quota of zero did not change what it reads: its unit is on the SSD.
    assert!(la["tokens"].as_u64() > Some(0), "{la}");
    // /metrics reports each tenant's pool bytes and quota as the lookups do.
    let (st, m) = d.req("GET", "/metrics", None, "");
    assert_eq!(st, 200);
    let gauge = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in {m}"))
    };
    assert_eq!(gauge("kvstack_tenant_dram_pool_bytes{tenant=\"a\"} "), 0);
    assert_eq!(gauge("kvstack_tenant_dram_pool_bytes{tenant=\"b\"} "), slot);
    assert_eq!(
        gauge("kvstack_tenant_dram_pool_quota_bytes{tenant=\"a\"} "),
        0
    );
    assert_eq!(
        gauge("kvstack_tenant_dram_pool_quota_bytes{tenant=\"b\"} "),
        slot
    );
    assert_eq!(d.stop(), 0);
}

#[test]
fn ssd_quotas_bound_each_tenant_refuse_puts_and_reload() {
    use kvstack_appliance::frame;
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = ("key-of-a", "key-of-b");
    let tenants = two_tenants(ka, kb).replacen(
        "[[tenant]]\nname = \"b\"",
        "ssd_bytes = 0\n[[tenant]]\nname = \"b\"",
        1,
    );
    let d = Daemon::start(dir.path(), &tenants);
    let p = |k: u32| -> Vec<u32> { (0..200).map(|i| (i * 11 + k * 37 + 1) % 250).collect() };
    let lookup = |key: &str, tokens: &[u32]| {
        d.json(
            "/v1/kv/lookup",
            Some(key),
            &serde_json::json!({"tokens": tokens}).to_string(),
        )
    };
    // b, without a quota, keeps its unit; its size is what one such unit takes.
    let lb = complete_and_look_up(&d, kb, &p(1));
    assert!(lb["tenant"]["ssd_quota_bytes"].is_null(), "{lb}");
    let unit = lb["tenant"]["ssd_bytes"].as_u64().unwrap();
    assert!(unit > 0, "{lb}");
    // a may keep nothing: its completion is served, its unit is not kept.
    let req = serde_json::json!({"prompt": p(1), "max_tokens": 1, "temperature": 0}).to_string();
    let done = d.json("/v1/completions", Some(ka), &req);
    assert!(done["choices"].is_array(), "{done}");
    let la = lookup(ka, &p(1));
    assert_eq!(la["tokens"], 0, "{la}");
    assert_eq!(la["tenant"]["ssd_bytes"], 0, "{la}");
    assert_eq!(la["tenant"]["ssd_quota_bytes"], 0, "{la}");
    // A KV-cache API put by a is refused with 507 naming the quota; b is untouched.
    let get = serde_json::json!({"tokens": p(1)}).to_string();
    let (st, body) = d.req_bytes("/v1/kv/get", Some(kb), get.as_bytes());
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let f = frame::decode(&body).unwrap();
    let n = f.header.tokens;
    let put = frame::encode(
        n,
        f.header.page_tokens,
        f.header.model.clone(),
        &p(1)[..n as usize],
        &f.blocks,
        f.window.as_deref(),
    );
    let (st, b) = d.req_bytes("/v1/kv/put?durable=true", Some(ka), &put);
    let b = String::from_utf8_lossy(&b);
    assert_eq!(st, 507, "{b}");
    assert!(b.contains("quota"), "{b}");
    assert_eq!(lookup(kb, &p(1))["tenant"]["ssd_bytes"], unit);

    // SIGHUP with room for one unit: a keeps its newest, its older one makes way.
    let quota = unit + unit / 2;
    let cfg = dir.path().join("kvstackd.toml");
    let text = std::fs::read_to_string(&cfg).unwrap().replacen(
        "ssd_bytes = 0",
        &format!("ssd_bytes = {quota}"),
        1,
    );
    std::fs::write(&cfg, text).unwrap();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc_kill(d.child.id() as i32, 1) };
    let t0 = Instant::now();
    while lookup(ka, &p(1))["tenant"]["ssd_quota_bytes"] != quota {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the reload never applied"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let la = complete_and_look_up(&d, ka, &p(2));
    assert!(la["tokens"].as_u64() > Some(0), "{la}");
    assert_eq!(la["tenant"]["ssd_bytes"], unit, "{la}");
    let la = complete_and_look_up(&d, ka, &p(3));
    let used = la["tenant"]["ssd_bytes"].as_u64().unwrap();
    assert!(used > 0 && used <= quota, "{la}");
    assert_eq!(lookup(ka, &p(2))["tokens"], 0, "a's older unit was kept");
    // b's unit was never a's to evict.
    assert!(lookup(kb, &p(1))["tokens"].as_u64() > Some(0));
    let (st, m) = d.req("GET", "/metrics", None, "");
    assert_eq!(st, 200);
    let gauge = |name: &str| -> u64 {
        m.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    assert!(gauge("kvstack_ssd_quota_evicted_units ") >= 1);
    assert!(gauge("kvstack_ssd_quota_refused_puts ") >= 2);
    // The per-tenant gauges say what the lookups say; b has no quota series.
    assert_eq!(gauge("kvstack_tenant_ssd_bytes{tenant=\"a\"} "), used);
    assert_eq!(gauge("kvstack_tenant_ssd_bytes{tenant=\"b\"} "), unit);
    assert_eq!(
        gauge("kvstack_tenant_ssd_quota_bytes{tenant=\"a\"} "),
        quota
    );
    assert!(
        !m.contains("kvstack_tenant_ssd_quota_bytes{tenant=\"b\"}"),
        "{m}"
    );
    assert_eq!(d.stop(), 0);
}

#[test]
fn check_config_refuses_unknown_keys() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("k.toml");
    std::fs::write(&p, "[engine]\nchunkk = 3\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvstackd"))
        .arg("--config")
        .arg(&p)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("chunkk"), "{err}");
    std::fs::write(&p, "[engine]\nchunk = 3\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvstackd"))
        .arg("--config")
        .arg(&p)
        .arg("--check-config")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn socket_activation_and_sd_notify() {
    if !have("systemd-socket-activate") {
        eprintln!("SKIPPED: systemd-socket-activate not installed (Debian package systemd)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let notify = dir.path().join("notify.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let passed = dir.path().join("passed.sock");
    let env = [
        ("NOTIFY_SOCKET", notify.display().to_string()),
        ("WATCHDOG_USEC", "400000".to_string()),
    ];
    let d = Daemon::start_with(dir.path(), "", Some(&passed), &env, 1 << 30, "");
    // It serves on the passed socket and never binds its configured one.
    let (st, _) = d.req(
        "POST",
        "/v1/completions",
        None,
        r#"{"prompt": [1, 2, 3], "max_tokens": 2}"#,
    );
    assert_eq!(st, 200);
    assert!(!dir.path().join("kvstackd.sock").exists());
    let mut msgs = String::new();
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < Duration::from_secs(5)
        && !(msgs.contains("READY=1") && msgs.contains("WATCHDOG=1"))
    {
        if let Ok(n) = rx.recv(&mut buf) {
            msgs.push_str(&String::from_utf8_lossy(&buf[..n]));
            msgs.push('\n');
        }
    }
    assert!(msgs.contains("STATUS=recovering"), "{msgs}");
    assert!(msgs.contains("READY=1"), "{msgs}");
    assert!(msgs.contains("WATCHDOG=1"), "{msgs}");
    assert_eq!(d.stop(), 0);
}

#[test]
fn systemd_units_verify() {
    if !have("systemd-analyze") {
        eprintln!("SKIPPED: systemd-analyze not installed (Debian package systemd)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let units = concat!(env!("CARGO_MANIFEST_DIR"), "/../../packaging/systemd");
    for u in ["kvstackd.service", "kvstackd.socket"] {
        // ExecStart must name an existing binary for verify: point it at the built one.
        let text = std::fs::read_to_string(Path::new(units).join(u)).unwrap();
        let text = text.replace("/usr/local/bin/kvstackd", env!("CARGO_BIN_EXE_kvstackd"));
        std::fs::write(dir.path().join(u), text).unwrap();
    }
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.path().join("kvstackd.service"))
        .arg(dir.path().join("kvstackd.socket"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Lines about the host's own units (not ours) are not this test's business.
    let ours: Vec<&str> = err.lines().filter(|l| l.contains("kvstackd")).collect();
    assert!(out.status.success() && ours.is_empty(), "{err}");
}

/// Tenants a and b with their keys, as config text.
fn two_tenants(ka: &str, kb: &str) -> String {
    format!(
        "[[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\n[[tenant]]\nname = \"b\"\napi_key_sha256 = \"{}\"\n",
        kvstack_appliance::config::key_digest_hex(ka),
        kvstack_appliance::config::key_digest_hex(kb)
    )
}

/// Waits until node `d`'s `/v1/kv/lookup` of `tokens` names `node` as the shared prefix
/// index's holder (entries are written by the holder's index thread once its unit is
/// durable); returns the lookup.
fn wait_indexed(d: &Daemon, key: Option<&str>, tokens: &[u32], node: &str) -> serde_json::Value {
    let lookup = serde_json::json!({"tokens": tokens}).to_string();
    let t0 = Instant::now();
    loop {
        let l = d.json("/v1/kv/lookup", key, &lookup);
        if l["cluster"]["node"] == node {
            return l;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{node} never indexed: {l}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `key`'s tenant has a durable prefix of `tokens`; returns its length.
fn wait_durable(d: &Daemon, key: Option<&str>, tokens: &[u32]) -> u64 {
    let lookup = serde_json::json!({"tokens": tokens}).to_string();
    let t0 = Instant::now();
    loop {
        let n = d.json("/v1/kv/lookup", key, &lookup)["tokens"]
            .as_u64()
            .unwrap();
        if n > 0 {
            return n;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the unit never became durable"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kv_get_and_put_carry_units_in_the_stored_format_and_refuse_damage() {
    use kvstack_appliance::frame;
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = ("key-of-a", "key-of-b");
    let d = Daemon::start(dir.path(), &two_tenants(ka, kb));
    let prompt: Vec<u32> = (0..300).map(|i| (i * 13 + 5) % 250).collect();
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 1, "temperature": 0}).to_string();
    d.json("/v1/completions", Some(ka), &req);
    let n = wait_durable(&d, Some(ka), &prompt);
    let get = serde_json::json!({"tokens": prompt}).to_string();

    // Tenant a's unit, in the stored byte format.
    let (st, body) = d.req_bytes("/v1/kv/get", Some(ka), get.as_bytes());
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let f = frame::decode(&body).unwrap();
    assert_eq!(f.header.tokens, n);
    assert!(f.token_ids.is_empty());
    let page = f.header.page_tokens as u64;
    assert_eq!(f.blocks.len() as u64, n.div_ceil(page));
    let model = f.header.model.clone().unwrap();
    // Nothing of a's reaches b.
    let (st, b) = d.req_bytes("/v1/kv/get", Some(kb), get.as_bytes());
    assert_eq!(st, 404, "{}", String::from_utf8_lossy(&b));

    // Damaged or inconsistent puts (for tokens b has nothing of): each is refused naming
    // what is wrong, and nothing is stored.
    let mut other = prompt[..n as usize].to_vec();
    other[0] = 249 - other[0];
    let enc = |ids: &[u32], blocks: &[Vec<u8>], page: u32, model: &str| {
        frame::encode(
            n,
            page,
            Some(model.to_string()),
            ids,
            blocks,
            f.window.as_deref(),
        )
    };
    let good = enc(&other, &f.blocks, page as u32, &model);
    let mut flipped = good.clone();
    let at = flipped.len() - f.window.as_ref().map_or(0, Vec::len) - 7;
    flipped[at] ^= 0x10;
    let mut short = f.blocks.clone();
    short[0].pop();
    let mut oov = other.clone();
    oov[3] = 99_999;
    let cases: Vec<(Vec<u8>, &str, &str)> = vec![
        (flipped, "", "crc32c["),
        (good[..good.len() - 1].to_vec(), "", "window"),
        (b"KVSX".to_vec(), "", "frame"),
        (enc(&other, &short, page as u32, &model), "", "blocks[0]"),
        (
            enc(&other, &f.blocks, page as u32 + 1, &model),
            "",
            "page_tokens",
        ),
        (
            enc(&oov, &f.blocks, page as u32, &model),
            "",
            "token_ids[3]",
        ),
        (
            enc(&other[1..], &f.blocks, page as u32, &model),
            "",
            "token_ids",
        ),
        (enc(&other, &f.blocks, page as u32, "00ff"), "", "model"),
        (good.clone(), "?durable=maybe", "durable"),
    ];
    for (body, query, field) in &cases {
        let (st, b) = d.req_bytes(&format!("/v1/kv/put{query}"), Some(kb), body);
        let b = String::from_utf8_lossy(&b);
        assert_eq!(st, 400, "{field}: {b}");
        assert!(b.contains(field), "{field}: {b}");
    }
    let lookup_other = serde_json::json!({"tokens": other}).to_string();
    assert_eq!(
        d.json("/v1/kv/lookup", Some(kb), &lookup_other)["tokens"],
        0
    );

    // b stores a's unit under the same tokens, durably: b's get returns the same bytes and
    // b's completions reuse it.
    let put = enc(&prompt[..n as usize], &f.blocks, page as u32, &model);
    let (st, b) = d.req_bytes("/v1/kv/put?durable=true", Some(kb), &put);
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let ack: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(ack["durable"], true);
    assert_eq!(ack["tokens"], n);
    let (st, body_b) = d.req_bytes("/v1/kv/get", Some(kb), get.as_bytes());
    assert_eq!(st, 200);
    let fb = frame::decode(&body_b).unwrap();
    assert_eq!(fb.blocks, f.blocks, "b's copy differs from what it put");
    assert_eq!(fb.window, f.window);
    let c = d.json("/v1/completions", Some(kb), &req);
    assert!(
        c["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{c}"
    );
    let (_, m) = d.req("GET", "/metrics", None, "");
    let written = m
        .lines()
        .find(|l| l.starts_with("kvstack_kv_written_bytes_total"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert_eq!(written as usize, put.len(), "{m}");

    // Pins: bounded by limits.max_pin_ttl_ms (1 h by default), per tenant, and ended once.
    let pin = |key, tokens: &[u32], ttl: serde_json::Value| {
        let body = serde_json::json!({"tokens": tokens, "ttl_ms": ttl}).to_string();
        let (st, b) = d.req_bytes("/v1/kv/pin", Some(key), body.as_bytes());
        (st, String::from_utf8_lossy(&b).into_owned())
    };
    for ttl in [
        serde_json::json!(3_600_001),
        serde_json::json!(0),
        serde_json::json!("1h"),
    ] {
        let (st, b) = pin(ka, &prompt, ttl.clone());
        assert_eq!(st, 400, "{ttl}: {b}");
        assert!(b.contains("ttl_ms"), "{ttl}: {b}");
    }
    let (st, b) = pin(ka, &other, serde_json::json!(60_000));
    assert_eq!(st, 404, "{b}");
    let (st, b) = pin(ka, &prompt, serde_json::json!(60_000));
    assert_eq!(st, 200, "{b}");
    let p: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        (p["pinned"].as_bool(), p["tokens"].as_u64()),
        (Some(true), Some(n))
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let until = p["until_ms"].as_u64().unwrap();
    assert!(until > now && until <= now + 60_000, "{p}");
    // No ttl_ms: the longest pin allowed.
    let (st, b) = pin(kb, &prompt, serde_json::Value::Null);
    assert_eq!(st, 200, "{b}");
    let p: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(p["ttl_ms"], 3_600_000, "{p}");
    let unpin = serde_json::json!({"tokens": prompt}).to_string();
    assert_eq!(d.json("/v1/kv/unpin", Some(ka), &unpin)["unpinned"], true);
    assert_eq!(d.json("/v1/kv/unpin", Some(ka), &unpin)["unpinned"], false);
    assert_eq!(d.json("/v1/kv/unpin", Some(kb), &unpin)["unpinned"], true);
    assert_eq!(d.stop(), 0);
}

#[test]
fn connection_and_header_limits_hold() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(
        dir.path(),
        // (These lines land in the base config's [engine] table, then [limits].)
        "max_sessions = 2\n[limits]\nmax_connections = 2\nmax_header_bytes = 8192\n",
    );
    // At engine.max_sessions, a new named session closes the least recently used idle one:
    // s2 keeps its live context, s1's next turn starts afresh (its prefix then comes from
    // the caches, not from a live session).
    let turn = |name: &str| {
        let req = serde_json::json!({"prompt": [1, 2, 3, 4], "max_tokens": 1, "session": name})
            .to_string();
        d.json("/v1/completions", None, &req)["usage"]["kvstack"]["live_tokens"]
            .as_u64()
            .unwrap()
    };
    for name in ["s1", "s2", "s3"] {
        assert_eq!(turn(name), 0, "{name} is new");
    }
    assert!(turn("s2") > 0, "s2 was closed although s1 was idle longer");
    assert_eq!(turn("s1"), 0, "s1 is still live beyond engine.max_sessions");
    // A request head above the limit: 431, and the daemon serves the next request.
    let mut s = UnixStream::connect(&d.sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let big = "x".repeat(20_000);
    let _ = write!(
        s,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\nConnection: close\r\n\r\n"
    );
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let head = String::from_utf8_lossy(&out);
    assert!(head.starts_with("HTTP/1.1 431"), "{head}");
    assert_eq!(d.req("GET", "/healthz", None, "").0, 200);

    // Two idle connections hold both slots: a third client waits until one closes.
    let a = UnixStream::connect(&d.sock).unwrap();
    let b = UnixStream::connect(&d.sock).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let mut c = UnixStream::connect(&d.sock).unwrap();
    write!(
        c,
        "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    c.set_read_timeout(Some(Duration::from_millis(700)))
        .unwrap();
    let mut buf = [0u8; 64];
    let waited = c.read(&mut buf);
    assert!(
        matches!(&waited, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
        "served beyond max_connections: {waited:?}"
    );
    drop(a);
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut out = Vec::new();
    c.read_to_end(&mut out).unwrap();
    assert!(
        String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&out)
    );
    drop(b);
    assert_eq!(d.stop(), 0);
}

/// The tokens of the `k`-th put of client `c` in cycle `cycle`: unique per put, `n` long.
fn put_tokens(c: u32, cycle: u32, k: u32, n: usize) -> Vec<u32> {
    let mut t = vec![c, cycle, k % 250, k / 250];
    t.extend((4..n as u32).map(|i| (i * 7 + c * 3 + cycle) % 250));
    t.truncate(n);
    t
}

/// (tokens, durable, cycle) of an acknowledged put.
type Ack = (Vec<u32>, bool, u32);

/// `cycles` rounds of: the daemon under 12 clients putting units durably and 4 streaming
/// completions, killed with SIGKILL at an arbitrary moment (the last round: SIGTERM); then
/// fsck finds no damage and, after a restart, every put acknowledged durable is served with
/// its bytes (after the SIGTERM round, every put acknowledged at all).
fn kill9_campaign(cycles: u32) {
    use kvstack_appliance::frame;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let dir = tempfile::tempdir().unwrap();
    // Room for every round's puts (about 1,000 units of ~100 KiB a round here): a full store
    // refuses puts with 507, which is not what this campaign tests. Segments are written as
    // they fill, so the disk holds what was put, not the capacity.
    let ssd = u64::from(cycles) * (256 << 20);
    let start = |dir: &Path| Daemon::start_with(dir, "", None, &[], ssd, "");
    let d = start(dir.path());
    // A template unit: real KV of the built-in model, whose bytes every put reuses under
    // other tokens (the server checks sizes and CRCs, not what the KV means); 100 tokens
    // keep units small.
    let prompt: Vec<u32> = (0..100).map(|i| (i * 5 + 2) % 250).collect();
    let req = serde_json::json!({"prompt": prompt, "max_tokens": 1}).to_string();
    d.json("/v1/completions", None, &req);
    let n = wait_durable(&d, None, &prompt) as usize;
    let (st, body) = d.req_bytes(
        "/v1/kv/get",
        None,
        serde_json::json!({"tokens": prompt}).to_string().as_bytes(),
    );
    assert_eq!(st, 200);
    let template = Arc::new(frame::decode(&body).unwrap());
    drop(d);

    let acked: Arc<Mutex<Vec<Ack>>> = Arc::default();
    // Every put acknowledged durable, and every put acknowledged at all in `drained`, the
    // cycle that ended with SIGTERM.
    let check = |d: &Daemon, acked: &[Ack], drained: Option<u32>| {
        for (tokens, durable, cycle) in acked {
            if !durable && drained != Some(*cycle) {
                continue;
            }
            let body = serde_json::json!({"tokens": tokens}).to_string();
            let (st, b) = d.req_bytes("/v1/kv/get", None, body.as_bytes());
            if st != 200 {
                let lost = acked
                    .iter()
                    .filter(|(t, _, _)| {
                        let body = serde_json::json!({"tokens": t}).to_string();
                        d.req_bytes("/v1/kv/get", None, body.as_bytes()).0 != 200
                    })
                    .count();
                let log = std::fs::read_to_string(d.log()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "an acknowledged put (durable: {durable}, cycle {cycle}, tokens {:?}) is gone ({lost} of {} in all): {}\nlog tail:\n{}",
                    &tokens[..4],
                    acked.len(),
                    String::from_utf8_lossy(&b),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            let f = frame::decode(&b).unwrap();
            assert_eq!(f.header.tokens as usize, n);
            assert_eq!(
                f.blocks, template.blocks,
                "an acknowledged put reads back other bytes"
            );
        }
    };
    let mut puts_total = 0usize;
    let mut checked = 0usize;
    for cycle in 0..cycles {
        let last = cycle + 1 == cycles;
        let d = Arc::new(start(dir.path()));
        // What the previous round acknowledged (earlier rounds were checked already).
        check(&d, &acked.lock().unwrap()[checked..], None);
        checked = acked.lock().unwrap().len();
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = Vec::new();
        for c in 0..16u32 {
            let (d, stop, acked, template) = (
                Arc::clone(&d),
                Arc::clone(&stop),
                Arc::clone(&acked),
                Arc::clone(&template),
            );
            clients.push(std::thread::spawn(move || {
                let mut k = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    if c >= 12 {
                        let req = serde_json::json!({"prompt": [c, k % 250, 9, 9, 9], "max_tokens": 4, "stream": true}).to_string();
                        if d.try_req("POST", "/v1/completions", None, &req).is_err() {
                            return;
                        }
                    } else {
                        let tokens = put_tokens(c, cycle, k, n);
                        let durable = k % 4 != 3;
                        let body = frame::encode(
                            n as u64,
                            template.header.page_tokens,
                            None,
                            &tokens,
                            &template.blocks,
                            None,
                        );
                        let path = format!("/v1/kv/put?durable={durable}");
                        match d.try_req_bytes("POST", &path, None, "application/octet-stream", &body) {
                            Ok((200 | 202, _)) => {
                                acked.lock().unwrap().push((tokens, durable, cycle))
                            }
                            // Draining after SIGTERM: refused, not acknowledged.
                            Ok((503, _)) => return,
                            Ok((st, b)) if st != 0 => {
                                panic!("put answered {st}: {}", String::from_utf8_lossy(&b))
                            }
                            // Killed mid-request: no answer, no acknowledgement.
                            _ => return,
                        }
                    }
                    k += 1;
                    // Paced, so that the store holds every round's puts.
                    std::thread::sleep(Duration::from_millis(10));
                }
            }));
        }
        // An arbitrary moment (a fixed sequence, so a failure reproduces).
        std::thread::sleep(Duration::from_millis(600 + u64::from(cycle * 389 % 900)));
        // The last round drains on SIGTERM (running requests finish, everything queued is
        // flushed); the others die at once.
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc_kill(d.child.id() as i32, if last { 15 } else { 9 }) };
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.join().unwrap();
        }
        let mut d = Arc::into_inner(d).unwrap();
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = d.child.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no exit 30 s after the signal"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        if last {
            assert_eq!(status.code(), Some(0), "SIGTERM under load must exit 0");
        }
        drop(d);
        let mut opts = kvstack_tiers::StoreOptions::new(kvstack_tiers::StoreLocation::Directory(
            dir.path().join("data"),
        ));
        opts.capacity_bytes = 1 << 30;
        let report = kvstack_tiers::fsck::fsck(&opts).unwrap();
        assert!(
            report.clean(),
            "cycle {cycle}: fsck found damage: {report:?}"
        );
        let now = acked.lock().unwrap().len();
        eprintln!(
            "cycle {cycle}: {} puts acknowledged ({} in all), fsck clean ({} complete units)",
            now - puts_total,
            now,
            report.units_complete
        );
        puts_total = now;
    }
    let d = start(dir.path());
    let acked = acked.lock().unwrap();
    assert!(
        acked.len() > cycles as usize,
        "too few puts to mean anything"
    );
    check(&d, &acked, Some(cycles - 1));
    assert_eq!(d.stop(), 0);
}

#[test]
fn kill9_campaign_reduced() {
    kill9_campaign(4);
}

#[test]
#[ignore = "the full campaign (10 cycles); the suite runs 4"]
fn kill9_campaign_full() {
    kill9_campaign(10);
}

/// Two kvstackd nodes sharing one Redis Cluster (docs/cluster.md): a conversation whose first
/// turn node A served continues on node B, which holds the unit's global KV (copied through
/// the KV-cache API without its window) and takes the window from Redis, not replaying it;
/// the same turn on A (window from its DRAM) generates the same tokens. Redis stopped: B
/// still serves (misses), /readyz and /metrics say so.
#[test]
fn two_nodes_share_windows_through_redis_cluster() {
    use kvstack_appliance::frame;
    const SECRET: &str = "a-shared-secret-of-the-nodes";
    let Some(mut cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let pool = format!(
        "backend = \"redis-cluster\"\nredis_nodes = [{}]\nredis_key_prefix = \"daemon-test:\"\nredis_retry_ms = 200",
        nodes.join(", ")
    );
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Both start at once (each builds the model: seconds on 2 cores).
    let (a, b) = std::thread::scope(|s| {
        let pool_a = format!("{pool}\nredis_node_id = \"node-a\"");
        let pool_b = format!("{pool}\nredis_node_id = \"node-b\"");
        let pa = da.path();
        // Each lists the other as its peer, with the shared secret.
        let peer = |id: &str, dir: &Path| {
            format!(
                "[cluster]\npeer_secret = \"{SECRET}\"\n[[cluster.peer]]\nnode_id = \"{id}\"\naddress = \"unix:{}\"\n",
                dir.join("kvstackd.sock").display()
            )
        };
        let (ca, cb) = (peer("node-b", db.path()), peer("node-a", pa));
        let a = s.spawn(move || Daemon::start_with(pa, &ca, None, &[], 1 << 30, &pool_a));
        let b = Daemon::start_with(db.path(), &cb, None, &[], 1 << 30, &pool_b);
        (a.join().unwrap(), b)
    });
    let (_, ready) = b.req("GET", "/readyz", None, "");
    assert!(ready.contains("redis-cluster: up"), "{ready}");

    // Turn 1 on A.
    let prompt: Vec<u32> = (0..300).map(|i| (i * 11 + 7) % 250).collect();
    let t1 = a.json(
        "/v1/completions",
        None,
        &serde_json::json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}).to_string(),
    );
    let mut context = prompt.clone();
    for t in t1["choices"][0]["tokens"].as_array().unwrap() {
        context.push(t.as_u64().unwrap() as u32);
    }
    let n = wait_durable(&a, None, &context);
    let get = serde_json::json!({"tokens": context}).to_string();
    let (st, body) = a.req_bytes("/v1/kv/get", None, get.as_bytes());
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let f = frame::decode(&body).unwrap();
    assert_eq!(f.header.tokens, n);
    assert!(
        f.window.is_some(),
        "A holds no window at its unit's end ({n} tokens)"
    );

    // The shared prefix index tells B that node-a holds it: the whole unit for its own
    // tokens, its whole blocks (256 tokens) for the longer context (whose partial last block
    // differs from the unit's).
    let l = wait_indexed(&b, None, &context[..n as usize], "node-a");
    assert_eq!(l["tokens"], 0, "{l}");
    assert_eq!(l["cluster"]["node"], "node-a", "{l}");
    assert_eq!(l["cluster"]["tokens"], n, "{l}");
    let l = b.json("/v1/kv/lookup", None, &get);
    assert_eq!(l["cluster"]["tokens"], 256, "{l}");

    // B gets the global KV only (the window stays with A and in Redis).
    let put = frame::encode(
        n,
        f.header.page_tokens,
        f.header.model.clone(),
        &context[..n as usize],
        &f.blocks,
        None,
    );
    let (st, body) = b.req_bytes("/v1/kv/put?durable=true", None, &put);
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let l = wait_indexed(&b, None, &context[..n as usize], "node-b");
    assert_eq!(l["tokens"].as_u64(), Some(n), "{l}");
    assert_eq!(l["cluster"]["node"], "node-b", "{l}");

    // Turn 2 lands on B: its window comes from Redis Cluster, nothing is replayed.
    let mut turn2 = context[..n as usize].to_vec();
    turn2.extend([5, 6, 7]);
    let req2 = serde_json::json!({"prompt": turn2, "max_tokens": 3, "temperature": 0}).to_string();
    let on_b = b.json("/v1/completions", None, &req2);
    let u = &on_b["usage"]["kvstack"];
    assert_eq!(u["window_source"], "redis-cluster", "{on_b}");
    assert_eq!(u["replayed_tokens"], 0, "{on_b}");
    assert!(u["ssd_tokens"].as_u64().unwrap() > 0, "{on_b}");
    // The same turn on A, whose window is in its own DRAM: the same tokens.
    let on_a = a.json("/v1/completions", None, &req2);
    assert_eq!(on_a["usage"]["kvstack"]["window_source"], "dram", "{on_a}");
    assert_eq!(on_a["choices"][0]["tokens"], on_b["choices"][0]["tokens"]);
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert!(
        m.contains("kvstack_windows_restored_total{tenant=\"default\",source=\"redis_cluster\"} 1"),
        "{m}"
    );
    assert!(m.contains("kvstack_redis_window_up 1"), "{m}");
    assert!(m.contains("kvstack_redis_window_hits 1"), "{m}");

    // Another conversation served by A only: B, asked for its next turn, finds node-a in the
    // index, fetches the unit from A's KV-cache API as a peer (CRC-checked), stores it, and
    // serves the turn from its own SSD with the window A's frame carried: A's tokens.
    let p3: Vec<u32> = (0..280).map(|i| (i * 17 + 1) % 250).collect();
    let t3 = a.json(
        "/v1/completions",
        None,
        &serde_json::json!({"prompt": p3, "max_tokens": 4, "temperature": 0}).to_string(),
    );
    let mut ctx3 = p3.clone();
    for t in t3["choices"][0]["tokens"].as_array().unwrap() {
        ctx3.push(t.as_u64().unwrap() as u32);
    }
    let n3 = wait_durable(&a, None, &ctx3);
    wait_indexed(&b, None, &ctx3[..n3 as usize], "node-a");
    let mut turn = ctx3[..n3 as usize].to_vec();
    turn.extend([4, 4, 4]);
    let req = serde_json::json!({"prompt": turn, "max_tokens": 3, "temperature": 0}).to_string();
    let on_b = b.json("/v1/completions", None, &req);
    let u = &on_b["usage"]["kvstack"];
    assert_eq!(u["peer_fetch"]["node"], "node-a", "{on_b}");
    assert_eq!(u["peer_fetch"]["tokens"], n3, "{on_b}");
    assert_eq!(u["replayed_tokens"], 0, "{on_b}");
    assert!(
        u["ssd_tokens"].as_u64().unwrap() + u["paged_cache_tokens"].as_u64().unwrap()
            >= n3 - n3 % 2,
        "{on_b}"
    );
    // The same turn on A gives the same tokens (A may fetch B's longer unit, the end of
    // B's prompt, which the index now names: both directions work).
    let on_a = a.json("/v1/completions", None, &req);
    assert_eq!(on_a["choices"][0]["tokens"], on_b["choices"][0]["tokens"]);
    // The next turn on B needs no fetch: B holds it now.
    let again = b.json("/v1/completions", None, &req);
    assert_eq!(
        again["usage"]["kvstack"]["peer_fetch"],
        serde_json::Value::Null,
        "{again}"
    );
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert!(m.contains("kvstack_peer_fetches_total 1"), "{m}");
    // A wrong peer secret gets nothing.
    let get3 = serde_json::json!({"tokens": turn}).to_string();
    let (st, _) = a
        .try_req_bytes(
            "POST",
            "/v1/kv/get",
            None,
            "application/json",
            get3.as_bytes(),
        )
        .map(|(st, b)| (st, b.len()))
        .unwrap();
    assert_eq!(st, 200, "the default tenant needs no key");
    let mut s = UnixStream::connect(&a.sock).unwrap();
    write!(
        s,
        "POST /v1/kv/get HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Kvstack-Peer: wrong-secret-wrong-secret\r\nX-Kvstack-Tenant: default\r\nContent-Length: {}\r\n\r\n",
        get3.len()
    )
    .unwrap();
    // The 401 may come (and the connection close) before the body is read.
    match s.write_all(get3.as_bytes()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.unwrap(),
    }
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 401"), "{out}");

    // Node A killed: a conversation only A held is a miss on B (the fetch fails, counted),
    // and B serves it by computing.
    let p4: Vec<u32> = (0..270).map(|i| (i * 19 + 2) % 250).collect();
    let r4 = serde_json::json!({"prompt": p4, "max_tokens": 2, "temperature": 0}).to_string();
    a.json("/v1/completions", None, &r4);
    wait_durable(&a, None, &p4);
    drop(a);
    let mut t4 = p4.clone();
    t4.extend([8, 8]);
    let r = b.json(
        "/v1/completions",
        None,
        &serde_json::json!({"prompt": t4, "max_tokens": 2, "temperature": 0}).to_string(),
    );
    assert_eq!(
        r["usage"]["kvstack"]["peer_fetch"],
        serde_json::Value::Null,
        "{r}"
    );
    assert_eq!(r["usage"]["kvstack"]["ssd_tokens"], 0, "{r}");
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert!(m.contains("kvstack_peer_fetch_failures_total 1"), "{m}");

    // Redis Cluster stopped: B still serves (its window is replayed: a miss), says so in
    // /readyz (still 200) and /metrics, and logs one warning for the incident.
    cluster.stop();
    let mut turn3 = turn2.clone();
    turn3.extend([9, 9, 9, 9]);
    for _ in 0..3 {
        let r = b.json(
            "/v1/completions",
            None,
            &serde_json::json!({"prompt": turn3, "max_tokens": 2, "temperature": 0}).to_string(),
        );
        assert_ne!(
            r["usage"]["kvstack"]["window_source"], "redis-cluster",
            "{r}"
        );
    }
    let (st, ready) = b.req("GET", "/readyz", None, "");
    assert_eq!(st, 200, "{ready}");
    assert!(ready.contains("redis-cluster: down"), "{ready}");
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert!(m.contains("kvstack_redis_window_up 0"), "{m}");
    assert!(m.contains("kvstack_redis_window_incidents 1"), "{m}");
    let log = std::fs::read_to_string(b.log()).unwrap();
    assert_eq!(log.matches("redis cluster unreachable").count(), 1, "{log}");
    assert_eq!(b.stop(), 0);
}

/// `kvstack_NAME VALUE` of a /metrics text, 0 when absent.
fn metric(m: &str, name: &str) -> u64 {
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A completion's generated tokens.
fn generated(r: &serde_json::Value) -> Vec<u64> {
    r["choices"][0]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

/// A Redis master killed while kvstackd serves a steady load (docs/cluster.md, "Failure
/// behaviour"): the cluster fails over to the replica; meanwhile the windows on the dead
/// master are misses (replayed), every answer is 200 with the tokens the healthy run gave
/// (never a wrong byte: the conversations are shorter than the window, so a replay is
/// exact), /readyz stays 200 and says the window pool is down, /metrics counts
/// the incidents, one warning each; once the replica is promoted the windows come from Redis
/// again.
#[test]
fn a_redis_master_killed_under_load_costs_misses_only() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let Some(mut cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    // No DRAM level: every window is read from Redis, so a dead master shows.
    let pool = format!(
        "backend = \"redis-cluster\"\nredis_nodes = [{}]\nredis_key_prefix = \"failover:\"\nredis_retry_ms = 1000\nlocal_level = false\nredis_node_id = \"node-a\"",
        nodes.join(", ")
    );
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_with(dir.path(), "", None, &[], 1 << 30, &pool);
    // Four conversations, each held as a unit with its window (in Redis only). They are
    // shorter than the window (128 tokens), so every way of serving their next turn is exact:
    // the window from Redis, and the replay a miss costs, which then covers the whole prefix
    // (spec §7). Any answer but the healthy one is a wrong byte.
    let req =
        |p: &[u32]| serde_json::json!({"prompt": p, "max_tokens": 2, "temperature": 0}).to_string();
    let held: Vec<Vec<u32>> = (0..4u32)
        .map(|c| {
            let p: Vec<u32> = (0..60 + 10 * c)
                .map(|i| (i * (13 + 2 * c) + c) % 250)
                .collect();
            let mut ctx = p.clone();
            ctx.extend(
                generated(&d.json("/v1/completions", None, &req(&p)))
                    .iter()
                    .map(|&t| t as u32),
            );
            let n = wait_durable(&d, None, &ctx);
            ctx.truncate(n as usize);
            ctx
        })
        .collect();
    let prompts: Vec<Vec<u32>> = held
        .iter()
        .map(|h| {
            let mut t = h.clone();
            t.extend([3, 1, 4]);
            t
        })
        .collect();
    // The healthy answers, windows from Redis.
    let expected: Vec<Vec<u64>> = prompts
        .iter()
        .map(|p| {
            let r = d.json("/v1/completions", None, &req(p));
            assert_eq!(
                r["usage"]["kvstack"]["window_source"], "redis-cluster",
                "{r}"
            );
            generated(&r)
        })
        .collect();

    // The master holding most of the prompts' windows (at least 2 of the 4).
    let (_, models) = d.req("GET", "/v1/models", None, "");
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    let fp = models["data"][0]["kvstack"]["fingerprint"]
        .as_str()
        .unwrap();
    let mut model = [0u8; 32];
    for (i, b) in model.iter_mut().enumerate() {
        *b = u8::from_str_radix(&fp[2 * i..2 * i + 2], 16).unwrap();
    }
    let model = kvstack_tiers::ModelFingerprint(model);
    let tenant = kvstack_tiers::Tenant::new("default");
    let mut opts = kvstack_tiers::RedisOptions::new(cluster.urls());
    opts.key_prefix = "failover:".into();
    let namer = kvstack_tiers::RedisPool::new(opts, 1000).unwrap();
    let holders: Vec<u16> = held
        .iter()
        .map(|p| {
            let keys = kvstack_tiers::key::chain_keys(p, 256, &model, &tenant);
            let key = namer.value_key(kvstack_tiers::redis_pool::SnapshotId {
                tenant: tenant.id(),
                model: &model,
                key: keys.last().unwrap(),
            });
            cluster
                .holder_of(&key)
                .expect("a prompt's window is in no master")
        })
        .collect();
    let victim = *holders
        .iter()
        .max_by_key(|&&p| holders.iter().filter(|&&h| h == p).count())
        .unwrap();
    let on_victim = holders.iter().filter(|&&h| h == victim).count();
    // Its replica has what was written (replication is asynchronous).
    std::thread::sleep(Duration::from_millis(300));

    let stop = AtomicBool::new(false);
    // Set once the cluster is whole again; then the first window from Redis is the recovery.
    let armed = AtomicBool::new(false);
    let recovered = AtomicBool::new(false);
    let (served, misses, down_seen) = std::thread::scope(|s| {
        // The load: the four conversations in turn, each answer checked.
        let load = s.spawn(|| {
            let (mut served, mut misses) = (0u32, 0u32);
            while !stop.load(Ordering::Acquire) {
                for (p, e) in prompts.iter().zip(&expected) {
                    let r = d.json("/v1/completions", None, &req(p));
                    assert_eq!(&generated(&r), e, "a wrong answer during the failover: {r}");
                    served += 1;
                    if r["usage"]["kvstack"]["window_source"] == "redis-cluster" {
                        if armed.load(Ordering::Acquire) {
                            recovered.store(true, Ordering::Release);
                        }
                    } else {
                        misses += 1;
                    }
                }
            }
            (served, misses)
        });
        std::thread::sleep(Duration::from_millis(200));
        cluster.kill_port(victim);
        // At once, a conversation whose window lived there: a miss (the replica is promoted
        // only after the cluster's node timeout), and the right answer.
        let i = holders.iter().position(|&h| h == victim).unwrap();
        let r = d.json("/v1/completions", None, &req(&prompts[i]));
        assert_eq!(generated(&r), expected[i], "{r}");
        assert_ne!(
            r["usage"]["kvstack"]["window_source"], "redis-cluster",
            "{r}"
        );
        // /readyz: still 200, and it reports the outage while it lasts.
        let t0 = Instant::now();
        let mut down_seen = false;
        while !down_seen && t0.elapsed() < Duration::from_secs(15) && !load.is_finished() {
            let (st, ready) = d.req("GET", "/readyz", None, "");
            assert_eq!(st, 200, "{ready}");
            down_seen = ready.contains("redis-cluster: down");
            std::thread::sleep(Duration::from_millis(25));
        }
        // The replica takes over; then windows come from Redis again.
        cluster.wait_ok(Duration::from_secs(20));
        armed.store(true, Ordering::Release);
        let t0 = Instant::now();
        while !recovered.load(Ordering::Acquire) && !load.is_finished() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "windows never came from Redis again after the failover"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Release);
        let (served, misses) = load.join().unwrap();
        (served, misses, down_seen)
    });
    println!(
        "failover under load: {served} answers, {misses} misses (replayed), {on_victim} of 4 \
         windows on the killed master"
    );
    assert!(down_seen, "/readyz never reported the dead master");
    // The level is back once a call succeeds: the load's last calls, or the index thread's
    // (which shares the client and may still meet the old slot map right after the
    // failover), can leave it down a moment longer than the first window served from Redis.
    let t0 = Instant::now();
    let m = loop {
        let (_, m) = d.req("GET", "/metrics", None, "");
        if metric(&m, "kvstack_redis_window_up") == 1 || t0.elapsed() > Duration::from_secs(15) {
            break m;
        }
        // A request makes the level try Redis again.
        let _ = d.req("POST", "/v1/completions", None, &req(&prompts[0]));
        std::thread::sleep(Duration::from_millis(200));
    };
    let incidents = metric(&m, "kvstack_redis_window_incidents");
    assert!(incidents >= 1, "{m}");
    assert_eq!(metric(&m, "kvstack_redis_window_up"), 1, "{m}");
    assert_eq!(metric(&m, "kvstack_redis_window_damaged"), 0, "{m}");
    let log = std::fs::read_to_string(d.log()).unwrap();
    assert_eq!(
        log.matches("redis cluster unreachable").count() as u64,
        incidents,
        "one warning per incident: {log}"
    );
    assert!(log.contains("redis cluster reachable again"), "{log}");
    assert_eq!(d.stop(), 0);
}

/// Two kvstackd nodes with two tenants (docs/cluster.md): tenant b on node B never gets
/// tenant a's units, neither through the shared prefix index nor by a peer fetch; tenant a
/// does. Node A killed (SIGKILL): B serves A's conversations as misses, computing the tokens
/// A gave; A restarted on its data: B fetches from it again.
#[test]
fn a_killed_node_costs_misses_and_tenants_stay_isolated_across_nodes() {
    const SECRET: &str = "another-shared-secret-of-the-nodes";
    let (ka, kb) = ("key-of-tenant-a", "key-of-tenant-b");
    let Some(cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let pool = format!(
        "backend = \"redis-cluster\"\nredis_nodes = [{}]\nredis_key_prefix = \"kill:\"",
        nodes.join(", ")
    );
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let peer = |id: &str, dir: &Path| {
        format!(
            "{}[cluster]\npeer_secret = \"{SECRET}\"\nfetch_timeout_ms = 3000\n[[cluster.peer]]\nnode_id = \"{id}\"\naddress = \"unix:{}\"\n",
            two_tenants(ka, kb),
            dir.join("kvstackd.sock").display()
        )
    };
    let (ca, cb) = (peer("node-b", db.path()), peer("node-a", da.path()));
    let (pool_a, pool_b) = (
        format!("{pool}\nredis_node_id = \"node-a\""),
        format!("{pool}\nredis_node_id = \"node-b\""),
    );
    let start_a = || Daemon::start_with(da.path(), &ca, None, &[], 1 << 30, &pool_a);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(start_a);
        let b = Daemon::start_with(db.path(), &cb, None, &[], 1 << 30, &pool_b);
        (a.join().unwrap(), b)
    });
    let req =
        |p: &[u32]| serde_json::json!({"prompt": p, "max_tokens": 2, "temperature": 0}).to_string();
    // Three conversations of tenant a served by A (held as units with windows); their next
    // turns.
    let turns: Vec<Vec<u32>> = (0..3u32)
        .map(|c| {
            let p: Vec<u32> = (0..270 + 6 * c)
                .map(|i| (i * (23 + c) + 3 * c) % 250)
                .collect();
            let mut ctx = p.clone();
            ctx.extend(
                generated(&a.json("/v1/completions", Some(ka), &req(&p)))
                    .iter()
                    .map(|&t| t as u32),
            );
            let n = wait_durable(&a, Some(ka), &ctx);
            ctx.truncate(n as usize);
            ctx.extend([7, 7, 7]);
            ctx
        })
        .collect();
    // B learns from the index (written once A's units are durable) that node-a holds them.
    for t in &turns {
        wait_indexed(&b, Some(ka), t, "node-a");
    }
    let lookup0 = serde_json::json!({"tokens": turns[0]}).to_string();

    // Tenant b, same tokens, on B: the index has nothing for it, no fetch; B computes.
    let l = b.json("/v1/kv/lookup", Some(kb), &lookup0);
    assert_eq!(
        (l["tokens"].as_u64(), &l["cluster"]),
        (Some(0), &serde_json::Value::Null),
        "{l}"
    );
    let r = b.json("/v1/completions", Some(kb), &req(&turns[0]));
    let u = &r["usage"]["kvstack"];
    assert_eq!(u["peer_fetch"], serde_json::Value::Null, "{r}");
    assert_eq!(u["ssd_tokens"], 0, "{r}");
    let computed = generated(&r);
    // Nor does A give tenant b's caller tenant a's unit, or a caller without a key.
    let get0 = serde_json::json!({"tokens": turns[0]}).to_string();
    let (st, body) = a.req("POST", "/v1/kv/get", Some(kb), &get0);
    assert_eq!(st, 404, "{body}");
    let (st, _) = a.req("POST", "/v1/kv/get", None, &get0);
    assert_eq!(st, 401);
    // Tenant a on B: fetched from A with its window, nothing replayed: the same answer as
    // computing it.
    let r = b.json("/v1/completions", Some(ka), &req(&turns[0]));
    let u = &r["usage"]["kvstack"];
    assert_eq!(u["peer_fetch"]["node"], "node-a", "{r}");
    assert_eq!(u["replayed_tokens"], 0, "{r}");
    assert_eq!(generated(&r), computed, "{r}");

    // A killed: tenant a's second conversation is a miss on B (the fetch fails, counted), and
    // B computes it; B stays ready.
    drop(a);
    let r = b.json("/v1/completions", Some(ka), &req(&turns[1]));
    let u = &r["usage"]["kvstack"];
    assert_eq!(u["peer_fetch"], serde_json::Value::Null, "{r}");
    assert_eq!(u["ssd_tokens"], 0, "{r}");
    let miss = generated(&r);
    let (st, ready) = b.req("GET", "/readyz", None, "");
    assert_eq!(st, 200, "{ready}");
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert_eq!(metric(&m, "kvstack_peer_fetch_failures_total"), 1, "{m}");
    assert_eq!(metric(&m, "kvstack_peer_fetches_total"), 1, "{m}");

    // A back on its data: B fetches the third conversation from it again; A answers the
    // second as B did, and the third as B did.
    let a = start_a();
    let r = b.json("/v1/completions", Some(ka), &req(&turns[2]));
    assert_eq!(r["usage"]["kvstack"]["peer_fetch"]["node"], "node-a", "{r}");
    assert_eq!(r["usage"]["kvstack"]["replayed_tokens"], 0, "{r}");
    let third = generated(&r);
    let (_, m) = b.req("GET", "/metrics", None, "");
    assert_eq!(metric(&m, "kvstack_peer_fetches_total"), 2, "{m}");
    for (t, want) in [(&turns[1], &miss), (&turns[2], &third)] {
        let r = a.json("/v1/completions", Some(ka), &req(t));
        assert_eq!(r["usage"]["kvstack"]["replayed_tokens"], 0, "{r}");
        assert_eq!(&generated(&r), want, "{r}");
    }
    assert_eq!(a.stop(), 0);
    assert_eq!(b.stop(), 0);
}

/// The median of `v` (sorted here).
fn p50(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measurement of issue 29 item 5 on two kvstackd nodes sharing a Redis Cluster, all on this
/// machine, in one run (`docs/cluster.md`, "Measurement"; not a pass/fail test):
/// - a turn whose window comes from the DRAM level, from Redis Cluster, or is rebuilt by the
///   bounded replay (128 tokens), on node B, which holds the conversation's global KV (put
///   without its window): time to first token and what was read;
/// - a 131,072-token unit (synthetic bytes of the model's block sizes and window, put
///   through the KV-cache API) read from node A's SSD through `/v1/kv/get`, and fetched by
///   node B from A for a turn on it (the daemon's peer fetch, as `usage.peer_fetch` times
///   it: A's `/v1/kv/get` as a peer, every CRC checked, a durable write on B), latency and
///   GB/s.
///
/// `cargo test -p kvstack-appliance --release --test daemon -- --ignored --nocapture measure_cluster`
#[test]
#[ignore = "measurement; run by hand (docs/cluster.md)"]
fn measure_cluster_restores() {
    use kvstack_appliance::frame;
    const SECRET: &str = "measurement-secret-of-the-nodes";
    const UNIT: usize = 131_072;
    let Some(cluster) = redis_cluster::RedisCluster::start() else {
        return;
    };
    let nodes: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let toml = |id: &str, peer: &str, peer_dir: &Path| {
        format!(
            "[window_pool]\ncapacity_bytes = 67108864\nbackend = \"redis-cluster\"\nredis_nodes = [{}]\nredis_key_prefix = \"measure:\"\nredis_node_id = \"{id}\"\n[ssd]\ncapacity_bytes = {}\n[engine]\nthreads = 2\nmax_sequences = 2\ncontext_limit = {}\n[limits]\nmax_prompt_tokens = {}\nmax_kv_body_bytes = {}\n[cluster]\npeer_secret = \"{SECRET}\"\nfetch_timeout_ms = 60000\n[[cluster.peer]]\nnode_id = \"{peer}\"\naddress = \"unix:{}\"\n",
            nodes.join(", "),
            3u64 << 30,
            UNIT + 1024,
            UNIT + 512,
            512u64 << 20,
            peer_dir.join("kvstackd.sock").display()
        )
    };
    let (ta, tb) = (
        toml("node-a", "node-b", db.path()),
        toml("node-b", "node-a", da.path()),
    );
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| Daemon::start_toml(da.path(), &ta, None, &[]));
        let b = Daemon::start_toml(db.path(), &tb, None, &[]);
        (a.join().unwrap(), b)
    });
    let (_, models) = a.req("GET", "/v1/models", None, "");
    let models: serde_json::Value = serde_json::from_str(&models).unwrap();
    let fp = models["data"][0]["kvstack"]["fingerprint"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut model = [0u8; 32];
    for (i, m) in model.iter_mut().enumerate() {
        *m = u8::from_str_radix(&fp[2 * i..2 * i + 2], 16).unwrap();
    }
    let model = kvstack_tiers::ModelFingerprint(model);
    let tenant = kvstack_tiers::Tenant::new("default");
    let mut opts = kvstack_tiers::RedisOptions::new(cluster.urls());
    opts.key_prefix = "measure:".into();
    let namer = kvstack_tiers::RedisPool::new(opts, 1000).unwrap();
    let req = |p: &[u32], n: u32| {
        serde_json::json!({"prompt": p, "max_tokens": n, "temperature": 0}).to_string()
    };

    // Windows: conversations A served; B gets their global KV without the window.
    let (mut dram, mut redis, mut replay) = (Vec::new(), Vec::new(), Vec::new());
    let mut block_bytes = 0usize;
    let mut window: Option<Vec<u8>> = None;
    let mut seen = Vec::new();
    for k in 0..6u32 {
        let p: Vec<u32> = (0..299).map(|i| (i * (29 + k) + k) % 250).collect();
        let mut ctx = p.clone();
        ctx.extend(
            generated(&a.json("/v1/completions", None, &req(&p, 2)))
                .iter()
                .map(|&t| t as u32),
        );
        let n = wait_durable(&a, None, &ctx) as usize;
        ctx.truncate(n);
        let (st, body) = a.req_bytes(
            "/v1/kv/get",
            None,
            serde_json::json!({"tokens": ctx}).to_string().as_bytes(),
        );
        assert_eq!(st, 200);
        let f = frame::decode(&body).unwrap();
        block_bytes = f.blocks[0].len();
        // An even length: no pending compressor token, as at the synthetic unit's end.
        if window.is_none() && n.is_multiple_of(2) {
            window = f.window.clone();
        }
        let put = frame::encode(
            n as u64,
            f.header.page_tokens,
            Some(fp.clone()),
            &ctx,
            &f.blocks,
            None,
        );
        let (st, body) = b.req_bytes("/v1/kv/put?durable=true", None, &put);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
        let mut turn = ctx.clone();
        turn.extend([k + 1, 5, 6]);
        if k % 2 == 1 {
            // No window anywhere for B: drop it from Redis (A keeps its DRAM copy).
            let keys = kvstack_tiers::key::chain_keys(&ctx, 256, &model, &tenant);
            let key = namer.value_key(kvstack_tiers::redis_pool::SnapshotId {
                tenant: tenant.id(),
                model: &model,
                key: keys.last().unwrap(),
            });
            namer.remove(kvstack_tiers::redis_pool::SnapshotId {
                tenant: tenant.id(),
                model: &model,
                key: keys.last().unwrap(),
            });
            assert!(cluster.holder_of(&key).is_none());
        }
        let r = b.json("/v1/completions", None, &req(&turn, 1));
        let u = r["usage"]["kvstack"].clone();
        let ttft = u["ttft_ms"].as_f64().unwrap();
        if k % 2 == 1 {
            assert_eq!(u["replayed_tokens"], 128, "{r}");
            replay.push(ttft);
            if k == 1 {
                println!("  (a replayed turn's usage: {u})");
            }
        } else {
            assert_eq!(u["window_source"], "redis-cluster", "{r}");
            redis.push(ttft);
            // Again: B's DRAM level kept the snapshot read from Redis.
            let r = b.json("/v1/completions", None, &req(&turn, 1));
            let u2 = r["usage"]["kvstack"].clone();
            assert_eq!(u2["window_source"], "dram", "{r}");
            dram.push(u2["ttft_ms"].as_f64().unwrap());
            seen.push((u, u2));
        }
    }
    println!(
        "window restore on node B (built-in model, {n} runs each), time to first token:",
        n = dram.len()
    );
    println!("  DRAM level      p50 {:8.2} ms", p50(&mut dram));
    println!("  Redis Cluster   p50 {:8.2} ms", p50(&mut redis));
    println!("  bounded replay  p50 {:8.2} ms", p50(&mut replay));
    println!(
        "  (first/second turn usage of one conversation: {} / {})",
        seen[0].0, seen[0].1
    );

    // A 131,072-token unit: put into A, read back from A's SSD, fetched by B from A.
    // A 131,072-token unit with a window (a real snapshot's rows, its length set to the
    // unit's: synthetic, as the blocks are), so B's turn on it needs no replay.
    let mut window = window.expect("A's frame carried no window");
    window[8..16].copy_from_slice(&(UNIT as u64).to_le_bytes());
    let (mut local_ms, mut fetch_ms, mut put_ms) = (Vec::new(), Vec::new(), Vec::new());
    let (mut frame_bytes, mut fetched_bytes) = (0u64, 0u64);
    for k in 0..3u32 {
        let tokens: Vec<u32> = (0..UNIT as u32)
            .map(|i| (i * 7 + k * 13 + 1) % 250)
            .collect();
        let blocks: Vec<Vec<u8>> = (0..UNIT / 256)
            .map(|j| {
                (0..block_bytes)
                    .map(|x| ((x as u32).wrapping_mul(31) ^ j as u32 ^ k) as u8)
                    .collect()
            })
            .collect();
        let put = frame::encode(
            UNIT as u64,
            256,
            Some(fp.clone()),
            &tokens,
            &blocks,
            Some(&window),
        );
        drop(blocks);
        let t = Instant::now();
        let (st, body) = a.req_bytes("/v1/kv/put?durable=true", None, &put);
        put_ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
        drop(put);
        let get = serde_json::json!({"tokens": tokens}).to_string();
        for _ in 0..2 {
            let t = Instant::now();
            let (st, body) = a.req_bytes("/v1/kv/get", None, get.as_bytes());
            let f = frame::decode(&body).unwrap();
            local_ms.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!((st, f.header.tokens), (200, UNIT as u64));
            frame_bytes = body.len() as u64;
        }
        // B's turn on the unit plus a token: B fetches it from A first (the daemon's own peer
        // fetch: A's /v1/kv/get as a peer, every CRC checked, a durable write on B), as
        // usage.peer_fetch reports.
        let t0 = Instant::now();
        while b.json("/v1/kv/lookup", None, &get)["cluster"]["node"] != "node-a" {
            assert!(t0.elapsed() < Duration::from_secs(30), "never indexed");
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut prompt = tokens.clone();
        prompt.push(1);
        let body = req(&prompt, 1);
        let mut s = UnixStream::connect(&b.sock).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(600))).unwrap();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let r: serde_json::Value =
            serde_json::from_str(&out[out.find("\r\n\r\n").unwrap() + 4..]).unwrap();
        let u = &r["usage"]["kvstack"];
        assert_eq!(u["peer_fetch"]["tokens"], UNIT, "{out}");
        assert_eq!(u["replayed_tokens"], 0, "{u}");
        fetch_ms.push(u["peer_fetch"]["ms"].as_f64().unwrap());
        fetched_bytes = u["peer_fetch"]["bytes"].as_u64().unwrap();
        if k == 0 {
            println!("  (B's turn on the fetched unit: {u})");
        }
    }
    let gbs = |bytes: u64, ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    let (l, p, w) = (p50(&mut local_ms), p50(&mut fetch_ms), p50(&mut put_ms));
    println!("131,072-token unit with its window ({frame_bytes} frame bytes), p50 of 3 units:");
    println!(
        "  A's SSD via /v1/kv/get (read, CRCs, frame, Unix socket, decode) {l:8.1} ms {:6.2} GB/s",
        gbs(frame_bytes, l)
    );
    println!(
        "  B's peer fetch from A (usage.peer_fetch: GET, decode, durable)   {p:8.1} ms {:6.2} GB/s",
        gbs(fetched_bytes, p)
    );
    println!(
        "  put into A (/v1/kv/put?durable=true)                             {w:8.1} ms {:6.2} GB/s",
        gbs(frame_bytes, w)
    );
    drop(a);
    drop(b);
}
