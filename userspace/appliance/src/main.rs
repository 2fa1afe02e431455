//! `kvstackd`: the kvstack appliance daemon (`docs/appliance.md`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use kvstack_appliance::Config;
use kvstack_appliance::config::DEFAULT_CONFIG;

/// kvstackd: serves completions and the KV-cache API of one model over HTTP on a Unix socket
/// (and optionally loopback TCP), under systemd or by hand.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The config file (TOML). Without it, and when /etc/kvstack/kvstackd.toml is absent,
    /// the defaults.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The data directory (overrides `data_dir`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where to listen: unix:PATH or tcp:ADDR:PORT, repeatable (overrides `listen`; ignored
    /// when systemd passes sockets).
    #[arg(long)]
    listen: Vec<String>,
    /// Check the config and exit (0 when it is valid).
    #[arg(long)]
    check_config: bool,
}

/// Logs to stderr: with journald's priority prefixes and no timestamps under systemd
/// (`JOURNAL_STREAM` set), plain lines otherwise.
fn init_logging() {
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        b.format(|f, r| {
            let p = match r.level() {
                log::Level::Error => 3,
                log::Level::Warn => 4,
                log::Level::Info => 6,
                log::Level::Debug | log::Level::Trace => 7,
            };
            writeln!(f, "<{p}>{}: {}", r.target(), r.args())
        });
    }
    b.init();
}

fn load(a: &Args) -> Result<(Config, Option<PathBuf>), kvstack_appliance::Error> {
    let path = match &a.config {
        Some(p) => Some(p.clone()),
        None => Some(PathBuf::from(DEFAULT_CONFIG)).filter(|p| p.exists()),
    };
    let mut cfg = match &path {
        Some(p) => Config::from_file(p)?,
        None => Config::defaults()?,
    };
    if let Some(d) = &a.data_dir {
        cfg.data_dir = d.clone();
    }
    if !a.listen.is_empty() {
        cfg.set_listen(&a.listen)?;
    }
    Ok((cfg, path))
}

fn main() -> ExitCode {
    let a = Args::parse();
    init_logging();
    let r = load(&a).and_then(|(cfg, path)| {
        if a.check_config {
            println!(
                "config OK: {} tenant(s), listen {}",
                cfg.tenants.len(),
                cfg.listen
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            return Ok(());
        }
        kvstack_appliance::serve(cfg, path)
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut msg = format!("kvstackd: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            log::error!("{msg}");
            eprintln!("{msg}");
            ExitCode::FAILURE
        }
    }
}
