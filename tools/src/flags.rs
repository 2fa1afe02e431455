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
    fn reals_are_finite_and_in_range() {
        assert_eq!(top_p("1"), Ok(1.0));
        assert!(top_p("0").is_err());
        assert!(top_p("NaN").is_err());
        assert!(temperature("inf").is_err());
        assert!(rel_tol("-1e-4").is_err());
    }
}
