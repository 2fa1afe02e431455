//! A throwaway Redis Cluster for tests: 6 `redis-server` processes (3 masters, 3 replicas) on
//! 127.0.0.1, free ports, a temporary directory; every process is killed and the directory
//! removed on drop, so also when a test fails. Shared by the tiers' and kvstackd's tests
//! (`#[path]`-included; scripts/install-test-deps installs Debian's `redis-server`).
//!
//! Without `redis-server`, [`RedisCluster::start`] returns `None` after printing why, so the
//! test can skip; under CI (`CI` set) a missing `redis-server` fails the test instead.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Masters and replicas of the test cluster.
pub const NODES: usize = 6;

/// A running test cluster; see the module docs.
pub struct RedisCluster {
    dir: tempfile::TempDir,
    ports: Vec<u16>,
    children: Vec<Option<Child>>,
}

/// Whether `prog` runs (`prog --version`).
fn runs(prog: &str) -> bool {
    Command::new(prog)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Ports handed out in this process: clusters of tests running in parallel never get the
/// same port between its check and the server's bind.
static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// A port P on 127.0.0.1 that is free now, with P + 10000 (the cluster bus) free too.
fn free_port(taken: &[u16]) -> u16 {
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..200 {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p >= 55_000
            || taken.contains(&p)
            || handed
                .iter()
                .any(|&h| h == p || h + 10_000 == p || p + 10_000 == h)
        {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", p + 10_000)).is_ok() {
            handed.push(p);
            return p;
        }
    }
    panic!("no free port pair (P, P + 10000) on 127.0.0.1 after 200 tries");
}

impl RedisCluster {
    /// Starts a cluster and waits until every node reports `cluster_state:ok` (a few
    /// seconds). `None` (printed) when `redis-server` is not installed and `CI` is not set.
    pub fn start() -> Option<RedisCluster> {
        if !runs("redis-server") || !runs("redis-cli") {
            let why =
                "redis-server/redis-cli not installed (scripts/install-test-deps installs them)";
            if std::env::var_os("CI").is_some() {
                panic!("{why}; CI is set, so this is a failure, not a skip");
            }
            // Straight to the process's stderr: libtest hides eprintln! output of passing tests.
            let _ = writeln!(std::io::stderr(), "SKIPPED (Redis Cluster test): {why}");
            return None;
        }
        let dir = tempfile::Builder::new()
            .prefix("kvstack-redis-")
            .tempdir()
            .unwrap();
        let mut ports = Vec::new();
        while ports.len() < NODES {
            let p = free_port(&ports);
            ports.push(p);
        }
        let mut c = RedisCluster {
            dir,
            ports,
            children: (0..NODES).map(|_| None).collect(),
        };
        for i in 0..NODES {
            c.spawn(i);
        }
        c.wait_pings();
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for p in &c.ports {
            create.arg(format!("127.0.0.1:{p}"));
        }
        let out = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        c.wait_ok(Duration::from_secs(20));
        c.wait_roles(Duration::from_secs(20));
        c.wait_replicas(Duration::from_secs(20));
        Some(c)
    }

    /// Starts node `i` (again) on its port, from its own nodes file when it has one.
    fn spawn(&mut self, i: usize) {
        let p = self.ports[i];
        let log = std::fs::File::create(self.dir.path().join(format!("redis-{p}.log"))).unwrap();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &p.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-config-file", &format!("nodes-{p}.conf")])
            // Fast failure detection: a stopped master is failed over within seconds.
            .args(["--cluster-node-timeout", "1500"])
            .args(["--appendonly", "no", "--save", ""])
            // A master otherwise waits 5 s for more replicas before the first sync.
            .args(["--repl-diskless-sync-delay", "0"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // SAFETY: prctl(PR_SET_PDEATHSIG) between fork and exec only sets a flag of the child
        // (async-signal-safe); it makes the kernel kill the server if the test process dies
        // without running its destructors (killed by a timeout).
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self.children[i] = Some(cmd.spawn().unwrap());
    }

    /// `redis-cli -p P ARGS...`'s output, or `None` when it failed.
    fn cli(&self, p: u16, args: &[&str]) -> Option<String> {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &p.to_string()])
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn wait_pings(&self) {
        let end = Instant::now() + Duration::from_secs(10);
        for &p in &self.ports {
            while self.cli(p, &["ping"]).is_none_or(|o| !o.contains("PONG")) {
                assert!(
                    Instant::now() < end,
                    "redis-server on port {p} does not answer"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Waits until every running node says `cluster_state:ok`.
    pub fn wait_ok(&self, limit: Duration) {
        let end = Instant::now() + limit;
        for (i, &p) in self.ports.iter().enumerate() {
            if self.children[i].is_none() {
                continue;
            }
            while self
                .cli(p, &["cluster", "info"])
                .is_none_or(|o| !o.contains("cluster_state:ok"))
            {
                assert!(
                    Instant::now() < end,
                    "the cluster is not ok after {limit:?} (node {p}); logs in {}",
                    self.dir.path().display()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Waits until every node sees 3 masters and 3 replicas, none failing (the roles that
    /// `--cluster create` set have spread by gossip).
    fn wait_roles(&self, limit: Duration) {
        let end = Instant::now() + limit;
        for &p in &self.ports {
            loop {
                let text = self.cli(p, &["cluster", "nodes"]).unwrap_or_default();
                let count = |role: &str| {
                    text.lines()
                        .filter(|l| l.contains(role) && !l.contains("fail"))
                        .count()
                };
                if count("master") == NODES / 2 && count("slave") == NODES / 2 {
                    break;
                }
                assert!(
                    Instant::now() < end,
                    "node {p} does not see 3 masters and 3 replicas: {text}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Waits until every running replica's link to its master is up (its first sync done),
    /// so a master killed later has a replica that holds what was written before.
    pub fn wait_replicas(&self, limit: Duration) {
        let end = Instant::now() + limit;
        for (i, &p) in self.ports.iter().enumerate() {
            if self.children[i].is_none() {
                continue;
            }
            loop {
                let info = self.cli(p, &["info", "replication"]).unwrap_or_default();
                if info.contains("role:master") || info.contains("master_link_status:up") {
                    break;
                }
                assert!(
                    Instant::now() < end,
                    "replica on port {p} not in sync after {limit:?}"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Seed node URLs, `redis://127.0.0.1:P`, one per node.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The nodes' ports.
    pub fn ports(&self) -> &[u16] {
        &self.ports
    }

    /// The directory of the nodes' files and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The ports of the current masters (`cluster nodes` of a running node).
    pub fn masters(&self) -> Vec<u16> {
        let Some(i) = self.children.iter().position(Option::is_some) else {
            return Vec::new();
        };
        let text = self
            .cli(self.ports[i], &["cluster", "nodes"])
            .unwrap_or_default();
        text.lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter_map(|a| a.split('@').next()?.rsplit(':').next()?.parse().ok())
            .collect()
    }

    /// The port of the master that holds `key` now (`KEYS` on each master: the literal key,
    /// so it must contain no glob characters), if any does.
    pub fn holder_of(&self, key: &str) -> Option<u16> {
        self.masters().into_iter().find(|&p| {
            self.cli(p, &["keys", key])
                .is_some_and(|o| o.lines().any(|l| l.trim() == key))
        })
    }

    /// Kills the node listening on `port` (SIGKILL) and waits for it.
    pub fn kill_port(&mut self, port: u16) {
        if let Some(i) = self.ports.iter().position(|&p| p == port) {
            self.kill(i);
        }
    }

    /// Kills node `i` (SIGKILL) and waits for it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.children[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every node: the cluster is unreachable until [`RedisCluster::restart`].
    pub fn stop(&mut self) {
        for i in 0..NODES {
            self.kill(i);
        }
    }

    /// Starts the stopped nodes again on their ports (they rejoin from their nodes files; the
    /// data is gone: no persistence) and waits until the cluster is ok.
    pub fn restart(&mut self) {
        for i in 0..NODES {
            if self.children[i].is_none() {
                self.spawn(i);
            }
        }
        self.wait_pings();
        self.wait_ok(Duration::from_secs(30));
    }

    /// Where the node files live (for a failing test's message).
    pub fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Every child is killed and reaped; the TempDir field then removes the directory.
        self.stop();
    }
}
