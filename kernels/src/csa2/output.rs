//! The grouped low-rank output projection (spec §4): the heads' outputs (after the inverse
//! RoPE) split into `groups` groups of `heads / groups` consecutive heads; group `g`'s
//! `[heads / groups · head_dim]` slice goes through its own `wo_a` block (rows
//! `g · rank .. (g + 1) · rank` of the `[groups · rank, heads / groups · head_dim]` matrix),
//! the `groups · rank` results are concatenated and `wo_b` (`[hidden, groups · rank]`) maps them
//! to the hidden size.

use super::gemm::{MatMut, MatRef, gemm, gemm_ref};
use super::{Error, check_len};

/// Shapes of the output projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputShape {
    /// Query heads.
    pub heads: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// `o_groups`.
    pub groups: usize,
    /// `o_lora_rank`: outputs of one group's `wo_a`.
    pub rank: usize,
    /// `hidden_size`.
    pub hidden: usize,
}

impl OutputShape {
    /// Inputs of one group's `wo_a`: `heads / groups · head_dim`.
    pub fn group_width(&self) -> usize {
        self.heads / self.groups * self.head_dim
    }

    fn check(
        &self,
        n: usize,
        x: &[f32],
        wo_a: &[f32],
        wo_b: &[f32],
        out: &[f32],
    ) -> Result<(), Error> {
        if self.groups == 0 || !self.heads.is_multiple_of(self.groups) {
            return Err(Error::Param {
                what: "o_groups",
                reason: format!("{} does not divide the {} heads", self.groups, self.heads),
            });
        }
        check_len(
            "output input [tokens, heads * head_dim]",
            n * self.heads * self.head_dim,
            x.len(),
        )?;
        check_len(
            "wo_a [groups * rank, group width]",
            self.groups * self.rank * self.group_width(),
            wo_a.len(),
        )?;
        check_len(
            "wo_b [hidden, groups * rank]",
            self.hidden * self.groups * self.rank,
            wo_b.len(),
        )?;
        check_len("output [tokens, hidden]", n * self.hidden, out.len())
    }
}

fn project(
    shape: &OutputShape,
    n: usize,
    x: &[f32],
    wo_a: &[f32],
    wo_b: &[f32],
    out: &mut [f32],
    mm: fn(MatRef<'_>, MatRef<'_>, MatMut<'_>) -> Result<(), Error>,
) -> Result<(), Error> {
    shape.check(n, x, wo_a, wo_b, out)?;
    if n == 0 {
        return Ok(());
    }
    let gw = shape.group_width();
    let width = shape.heads * shape.head_dim;
    let gr = shape.groups * shape.rank;
    let mut low = vec![0f32; n * gr];
    for g in 0..shape.groups {
        let xg = MatRef::strided(&x[g * gw..], n, gw, width, 1)?;
        let wa = MatRef::new(
            &wo_a[g * shape.rank * gw..(g + 1) * shape.rank * gw],
            shape.rank,
            gw,
        )?
        .t();
        let yg = MatMut::strided(&mut low[g * shape.rank..], n, shape.rank, gr)?;
        mm(xg, wa, yg)?;
    }
    mm(
        MatRef::new(&low, n, gr)?,
        MatRef::new(wo_b, shape.hidden, gr)?.t(),
        MatMut::new(out, n, shape.hidden)?,
    )
}

/// Reference: the projection with [`gemm_ref`] (plain loops).
pub fn grouped_output_ref(
    shape: &OutputShape,
    n: usize,
    x: &[f32],
    wo_a: &[f32],
    wo_b: &[f32],
    out: &mut [f32],
) -> Result<(), Error> {
    project(shape, n, x, wo_a, wo_b, out, gemm_ref)
}

/// Fast: the projection with [`gemm`] on strided views (no copies of the groups).
pub fn grouped_output(
    shape: &OutputShape,
    n: usize,
    x: &[f32],
    wo_a: &[f32],
    wo_b: &[f32],
    out: &mut [f32],
) -> Result<(), Error> {
    project(shape, n, x, wo_a, wo_b, out, gemm)
}
