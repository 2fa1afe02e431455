//! Token sampling from logits: greedy, and temperature with nucleus (top-p) truncation.
//!
//! The random draw is an argument (`u` uniform in `[0, 1)`), so the caller owns the generator
//! and a seeded run is reproducible.

/// How to pick the next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The highest logit (the lowest id on ties).
    Greedy,
    /// Softmax of `logits / temperature`, restricted to the smallest set of most likely tokens
    /// whose probability reaches `top_p`.
    TopP {
        /// Temperature (> 0).
        temperature: f32,
        /// Nucleus mass in `(0, 1]`.
        top_p: f32,
    },
}

/// The greedy choice; `None` for empty or all-NaN logits.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

/// Picks a token. `u` is a uniform draw in `[0, 1)` (ignored by [`Sampling::Greedy`]).
/// Returns `None` for empty or all-NaN logits.
pub fn sample(logits: &[f32], how: Sampling, u: f32) -> Option<usize> {
    let (temperature, top_p) = match how {
        Sampling::Greedy => return argmax(logits),
        Sampling::TopP { temperature, top_p } if temperature > 0.0 => {
            (temperature, top_p.clamp(0.0, 1.0))
        }
        Sampling::TopP { .. } => return argmax(logits),
    };
    let max = logits
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return argmax(logits);
    }
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_nan())
        .map(|(i, &v)| (i, f64::from((v - max) / temperature).exp()))
        .collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut kept = 0.0;
    let mut n = 0;
    for p in &probs {
        kept += p.1;
        n += 1;
        if kept / total >= f64::from(top_p) {
            break;
        }
    }
    let target = f64::from(u.clamp(0.0, 1.0)) * kept;
    let mut acc = 0.0;
    for p in &probs[..n] {
        acc += p.1;
        if target < acc {
            return Some(p.0);
        }
    }
    probs[..n].last().map(|p| p.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_and_degenerate_inputs() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[f32::NAN, 0.5]), Some(1));
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        // Probabilities about 0.665, 0.245, 0.090: top_p 0.6 keeps only the first token.
        let logits = [2.0, 1.0, 0.0];
        let how = Sampling::TopP {
            temperature: 1.0,
            top_p: 0.6,
        };
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample(&logits, how, u), Some(0));
        }
        // top_p 1: the draw walks the full distribution.
        let how = Sampling::TopP {
            temperature: 1.0,
            top_p: 1.0,
        };
        assert_eq!(sample(&logits, how, 0.1), Some(0));
        assert_eq!(sample(&logits, how, 0.8), Some(1));
        assert_eq!(sample(&logits, how, 0.99), Some(2));
    }
}
