//! Exact non-negative rationals for the cache arithmetic (bytes per token are sums of
//! `entry_bytes / ratio`). Overflow is reported, never wrapped.

/// `num / den`, always reduced, `den >= 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Frac {
    num: u128,
    den: u128,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Frac {
    pub(crate) const ZERO: Frac = Frac { num: 0, den: 1 };

    /// `num / den`; `None` when `den == 0`.
    pub(crate) fn new(num: u128, den: u128) -> Option<Frac> {
        if den == 0 {
            return None;
        }
        let g = gcd(num, den).max(1);
        Some(Frac {
            num: num / g,
            den: den / g,
        })
    }

    pub(crate) fn int(n: u64) -> Frac {
        Frac {
            num: u128::from(n),
            den: 1,
        }
    }

    pub(crate) fn checked_add(self, o: Frac) -> Option<Frac> {
        let g = gcd(self.den, o.den);
        let den = (self.den / g).checked_mul(o.den)?;
        let num = self
            .num
            .checked_mul(den / self.den)?
            .checked_add(o.num.checked_mul(den / o.den)?)?;
        Frac::new(num, den)
    }

    /// `self / o`; `None` when `o` is zero or on overflow.
    pub(crate) fn checked_div(self, o: Frac) -> Option<Frac> {
        let g1 = gcd(self.num, o.num).max(1);
        let g2 = gcd(self.den, o.den).max(1);
        let num = (self.num / g1).checked_mul(o.den / g2)?;
        let den = (o.num / g1).checked_mul(self.den / g2)?;
        Frac::new(num, den)
    }

    pub(crate) fn is_zero(self) -> bool {
        self.num == 0
    }

    pub(crate) fn to_f64(self) -> f64 {
        self.num as f64 / self.den as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_is_exact() {
        let a = Frac::new(3 * 356, 2).unwrap();
        let b = Frac::int(356);
        assert_eq!(a.checked_add(b).unwrap(), Frac::int(890));
        let c = Frac::new(584, 128)
            .unwrap()
            .checked_add(Frac::new(652, 4).unwrap())
            .unwrap();
        assert_eq!(c, Frac::new(584 + 652 * 32, 128).unwrap());
        assert_eq!(
            Frac::int(10).checked_div(Frac::int(4)).unwrap().to_f64(),
            2.5
        );
        assert!(Frac::int(1).checked_div(Frac::ZERO).is_none());
        assert!(Frac::new(1, 0).is_none());
    }
}
