//! Value parsers of numeric flags: every count, size and rate is checked against its allowed
//! range while the command line is parsed, so a zero or absurd value is refused (exit 2, the
//! message naming the flag and the range) before any work starts.
//!
//! The ranges are what the commands can serve on one machine, not what the formats allow:
//! wide enough for real use, narrow enough that a typo (`--chunk 0`, `--sessions 1000000`)
//! cannot hang the process or exhaust its memory.

use clap::builder::RangedU64ValueParser;

/// An integer flag in `lo..=hi`.
pub fn count<T>(lo: u64, hi: u64) -> RangedU64ValueParser<T>
where
    T: TryFrom<u64> + Clone + Send + Sync + 'static,
    <T as TryFrom<u64>>::Error: std::error::Error + Send + Sync + 'static,
{
    RangedU64ValueParser::<T>::new().range(lo..=hi)
}

/// Parses a token count with an optional K / M suffix (x1024, x1024^2).
pub fn parse_tokens(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1u64 << 20),
        _ => (t, 1),
    };
    let n: u64 = digits
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{s:?} is not a token count (examples: 131072, 128K, 1M)"))?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Most tokens of a context `kvstack calc` computes (a billion: far beyond any model).
pub const MAX_CALC_CONTEXT: u64 = 1 << 30;

/// Most tokens of the footprint bench's one sequence (its memory grows with them).
pub const MAX_FOOTPRINT_TOKENS: u64 = 16 << 20;

/// `--context` of `kvstack calc`: 1 to [`MAX_CALC_CONTEXT`] tokens.
pub fn calc_context(s: &str) -> Result<u64, String> {
    tokens_in(s, 1, MAX_CALC_CONTEXT)
}

/// `--tokens` of `kvstack bench footprint`: 1 to [`MAX_FOOTPRINT_TOKENS`].
pub fn footprint_tokens(s: &str) -> Result<u64, String> {
    tokens_in(s, 1, MAX_FOOTPRINT_TOKENS)
}

fn tokens_in(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let n = parse_tokens(s)?;
    if (lo..=hi).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} tokens is not in {lo}..={hi}"))
    }
}

/// A finite number in `(lo, hi]`.
fn real_in(s: &str, lo: f64, hi: f64) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))?;
    if v.is_finite() && v > lo && v <= hi {
        Ok(v)
    } else {
        Err(format!("{v} is not in ({lo}, {hi}]"))
    }
}

/// `--temperature`: in (0, 100] (greedy decoding is the flag's absence).
pub fn temperature(s: &str) -> Result<f32, String> {
    real_in(s, 0.0, 100.0).map(|v| v as f32)
}

/// `--top-p`: a probability mass in (0, 1].
pub fn top_p(s: &str) -> Result<f32, String> {
    real_in(s, 0.0, 1.0).map(|v| v as f32)
}

/// `--rel-tol`: a relative tolerance in (0, 1].
pub fn rel_tol(s: &str) -> Result<f64, String> {
    real_in(s, 0.0, 1.0)
}

/// Parses a byte size: digits with an optional K, M, G, T (powers of 1000) or Ki, Mi, Gi, Ti
/// (powers of 1024) suffix, and an optional trailing `B`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim().trim_end_matches(['b', 'B']);
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '_' && c != '.')
        .unwrap_or(t.len());
    let (digits, suffix) = t.split_at(split);
    let mult: f64 = match suffix.to_ascii_lowercase().as_str() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "{s:?} is not a size (examples: 512M, 20G, 4GiB, 1T)"
            ));
        }
    };
    let v: f64 = digits
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{s:?} is not a size (examples: 512M, 20G, 4GiB, 1T)"))?;
    let b = v * mult;
    if b.is_finite() && (0.0..1.8e19).contains(&b) {
        Ok(b as u64)
    } else {
        Err(format!("{s:?} is too large"))
    }
}

fn bytes_in(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let n = parse_bytes(s)?;
    if (lo..=hi).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n} bytes is not in {lo}..={hi}"))
    }
}

/// `--ssd-capacity` of `kvstack profile`: 16 MB to 1 PB.
pub fn ssd_capacity(s: &str) -> Result<u64, String> {
    bytes_in(s, 16_000_000, 1_000_000_000_000_000)
}

/// `--dram-pool` of `kvstack profile`: 0 (no pool) to 16 TB.
pub fn dram_pool(s: &str) -> Result<u64, String> {
    bytes_in(s, 0, 16_000_000_000_000)
}

/// `--cache` of `kvstack profile`: 16 MB to 16 TB.
pub fn cache_bytes(s: &str) -> Result<u64, String> {
    bytes_in(s, 16_000_000, 16_000_000_000_000)
}

/// Parses a duration into milliseconds: digits with `ms`, `s`, `m`, `h` or `d` (a bare number
/// is seconds).
pub fn parse_duration_ms(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let mult = match unit {
        "ms" => 1.0,
        "" | "s" => 1e3,
        "m" | "min" => 6e4,
        "h" => 3.6e6,
        "d" => 8.64e7,
        _ => {
            return Err(format!(
                "{s:?} is not a duration (examples: 500ms, 300s, 5m, 72h, 3d)"
            ));
        }
    };
    let v: f64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (examples: 500ms, 300s, 5m, 72h, 3d)"))?;
    let ms = v * mult;
    if ms.is_finite() && (0.0..1e15).contains(&ms) {
        Ok(ms.round() as u64)
    } else {
        Err(format!("{s:?} is too long"))
    }
}

fn duration_in(s: &str, lo: u64, hi: u64) -> Result<u64, String> {
    let ms = parse_duration_ms(s)?;
    if (lo..=hi).contains(&ms) {
        Ok(ms)
    } else {
        Err(format!("{ms} ms is not in {lo}..={hi} ms"))
    }
}

/// A TTL or retention of `kvstack profile`: 1 ms to 365 days.
pub fn profile_duration(s: &str) -> Result<u64, String> {
    duration_in(s, 1, 365 * 86_400_000)
}

/// `--bucket` of `kvstack profile replay`: 1 s to 1 day.
pub fn bucket(s: &str) -> Result<u64, String> {
    duration_in(s, 1000, 86_400_000)
}

/// A token rate: in (0, 10^9] tokens per second.
pub fn token_rate(s: &str) -> Result<f64, String> {
    real_in(s, 0.0, 1e9)
}

/// `--speed`: trace seconds per wall second, in (0, 10^6].
pub fn speed(s: &str) -> Result<f64, String> {
    real_in(s, 0.0, 1e6)
}

/// `--turns-per-hour` of `kvstack profile plan`: in (0, 3600].
pub fn turns_per_hour(s: &str) -> Result<f64, String> {
    real_in(s, 0.0, 3600.0)
}

/// `--context` of `kvstack profile plan`: 1 to [`MAX_CALC_CONTEXT`] tokens.
pub fn plan_context(s: &str) -> Result<u64, String> {
    tokens_in(s, 1, MAX_CALC_CONTEXT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_take_suffixes_and_ranges() {
        assert_eq!(parse_tokens("1M"), Ok(1_048_576));
        assert_eq!(parse_tokens("128K"), Ok(131_072));
        assert_eq!(parse_tokens("1_000"), Ok(1000));
        assert!(parse_tokens("lots").unwrap_err().contains("\"lots\""));
        assert!(parse_tokens("99999999999999999999M").is_err());
        assert_eq!(calc_context("1M"), Ok(1 << 20));
        assert!(calc_context("0").is_err());
        assert!(footprint_tokens("17M").is_err());
    }

    #[test]
    fn sizes_and_durations_take_units_and_ranges() {
        assert_eq!(parse_bytes("20G"), Ok(20_000_000_000));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("1.5T"), Ok(1_500_000_000_000));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_bytes("5X").unwrap_err().contains("\"5X\""));
        assert!(ssd_capacity("1M").is_err());
        assert!(cache_bytes("17T").is_err());
        assert_eq!(parse_duration_ms("5m"), Ok(300_000));
        assert_eq!(parse_duration_ms("72h"), Ok(259_200_000));
        assert_eq!(parse_duration_ms("250ms"), Ok(250));
        assert_eq!(parse_duration_ms("2"), Ok(2000));
        assert!(parse_duration_ms("5 weeks").is_err());
        assert!(profile_duration("0s").is_err());
        assert!(profile_duration("400d").is_err());
        assert!(token_rate("0").is_err() && token_rate("1e10").is_err());
        assert_eq!(speed("60"), Ok(60.0));
    }

    #[test]
    fn reals_are_finite_and_in_range() {
        assert_eq!(top_p("1"), Ok(1.0));
        assert!(top_p("0").is_err());
        assert!(top_p("NaN").is_err());
        assert!(temperature("inf").is_err());
        assert!(rel_tol("-1e-4").is_err());
    }
}
