//! Deterministic synthetic data for the harnesses, without dependencies.

/// xorshift64 (a nonzero state stays nonzero).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[-0.5, 0.5)`.
    pub(crate) fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    /// Roughly normal with standard deviation about `0.58 * scale`.
    pub(crate) fn normal(&mut self, scale: f32) -> f32 {
        (self.uniform() + self.uniform() + self.uniform() + self.uniform()) * scale
    }

    /// Uniform in `0..n` (`0` for `n == 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
