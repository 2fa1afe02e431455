//! f32 matrix products: every projection of the attention layer (`y = x Wᵀ`, spec §4).
//!
//! The fast path wraps `matrixmultiply::sgemm`. Why that crate: it is pure Rust (no BLAS to
//! find or link on a build host), small (a few seconds of build on the 2-core CI, where `gemm`
//! and `faer` take minutes), picks AVX2/FMA or AVX-512 kernels at run time like the rest of
//! this crate (no `-C target-cpu`), accepts arbitrary row and column strides (so `x Wᵀ` needs
//! no transposed copy of `W`, and the grouped output projection reads each group's columns in
//! place), and is maintained by the author of `ndarray`, which builds on it. Its summation
//! order along `k` does not depend on `m`, so one token (decode) and many tokens (prefill)
//! give bit-identical rows. The benchmark is `benches/csa2_gemm.rs` (`cargo bench -p
//! kvstack-kernels --bench csa2_gemm`).
//!
//! [`gemm_ref`] is the plain triple loop every result is tested against: the difference is
//! bounded by `k · 2^-24 · Σ_l |a_il b_lj|` (any summation order, FMA or not).

use super::{Error, check_len};

/// A read-only matrix view: element `(i, j)` is `data[i * row_stride + j * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `rows x cols` matrix; `data.len()` must be `rows * cols`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Result<Self, Error> {
        check_len("matrix [rows, cols]", rows * cols, data.len())?;
        Ok(MatRef {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        })
    }

    /// A strided view; every addressed element must lie inside `data`.
    pub fn strided(
        data: &'a [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, Error> {
        if rows > 0 && cols > 0 {
            let last = (rows - 1).checked_mul(row_stride).and_then(|r| {
                (cols - 1)
                    .checked_mul(col_stride)
                    .and_then(|c| r.checked_add(c))
            });
            match last {
                Some(l) if l < data.len() => {}
                _ => {
                    return Err(Error::Param {
                        what: "strided matrix view",
                        reason: format!(
                            "{rows} x {cols} with strides ({row_stride}, {col_stride}) exceeds {} elements",
                            data.len()
                        ),
                    });
                }
            }
        }
        Ok(MatRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    #[inline]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.row_stride + j * self.col_stride]
    }
}

/// A writable matrix view with unit column stride and `row_stride >= cols` (rows never overlap).
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
}

impl<'a> MatMut<'a> {
    /// A contiguous row-major `rows x cols` matrix.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Result<Self, Error> {
        check_len("output matrix [rows, cols]", rows * cols, data.len())?;
        Ok(MatMut {
            data,
            rows,
            cols,
            row_stride: cols,
        })
    }

    /// Rows of `cols` elements, `row_stride` apart (for writing a block of columns of a wider
    /// matrix, e.g. one group's slice of the grouped output projection).
    pub fn strided(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
    ) -> Result<Self, Error> {
        if row_stride < cols {
            return Err(Error::Param {
                what: "output matrix view",
                reason: format!("row stride {row_stride} is below the width {cols}"),
            });
        }
        if rows > 0 && cols > 0 && (rows - 1) * row_stride + cols > data.len() {
            return Err(Error::Param {
                what: "output matrix view",
                reason: format!(
                    "{rows} x {cols} with row stride {row_stride} exceeds {} elements",
                    data.len()
                ),
            });
        }
        Ok(MatMut {
            data,
            rows,
            cols,
            row_stride,
        })
    }
}

fn check_shapes(a: &MatRef<'_>, b: &MatRef<'_>, c: &MatMut<'_>) -> Result<(), Error> {
    if a.cols != b.rows || a.rows != c.rows || b.cols != c.cols {
        return Err(Error::Param {
            what: "matrix product shapes",
            reason: format!(
                "[{} x {}] · [{} x {}] -> [{} x {}] do not chain",
                a.rows, a.cols, b.rows, b.cols, c.rows, c.cols
            ),
        });
    }
    Ok(())
}

/// `c = a · b` with `matrixmultiply` (see the module documentation).
pub fn gemm(a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>) -> Result<(), Error> {
    check_shapes(&a, &b, &c)?;
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        for row in c.data.chunks_mut(c.row_stride).take(m) {
            row[..n].fill(0.0);
        }
        return Ok(());
    }
    // Strides fit in isize: each is at most a slice length (checked by the views' extents,
    // and slices never exceed isize::MAX bytes).
    let s = |x: usize| x as isize;
    // SAFETY: `MatRef::new`/`strided` checked that every element (i, l) of `a` and (l, j) of
    // `b` with the given strides lies inside its slice, and `MatMut` that every (i, j) of `c`
    // does, with distinct elements (unit column stride, row stride >= n). `c` is a unique
    // borrow, so it aliases neither input. With beta = 0, `c` need not be initialized
    // (it is anyway). matrixmultiply reads/writes only those elements.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            s(a.row_stride),
            s(a.col_stride),
            b.data.as_ptr(),
            s(b.row_stride),
            s(b.col_stride),
            0.0,
            c.data.as_mut_ptr(),
            s(c.row_stride),
            1,
        );
    }
    Ok(())
}

/// `c = a · b` as a plain triple loop, summing along `k` in order in f32 (the reference).
pub fn gemm_ref(a: MatRef<'_>, b: MatRef<'_>, c: MatMut<'_>) -> Result<(), Error> {
    check_shapes(&a, &b, &c)?;
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut acc = 0f32;
            for l in 0..a.cols {
                acc += a.at(i, l) * b.at(l, j);
            }
            c.data[i * c.row_stride + j] = acc;
        }
    }
    Ok(())
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ`: an `nn.Linear` without bias (weights in `[out, in]`
/// layout, as the checkpoints store them).
pub fn linear(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), Error> {
    check_len("linear input x [m, k]", m * k, x.len())?;
    check_len("linear weight w [n, k]", n * k, w.len())?;
    gemm(
        MatRef::new(x, m, k)?,
        MatRef::new(w, n, k)?.t(),
        MatMut::new(out, m, n)?,
    )
}

/// [`linear`] through [`gemm_ref`].
pub fn linear_ref(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
) -> Result<(), Error> {
    check_len("linear input x [m, k]", m * k, x.len())?;
    check_len("linear weight w [n, k]", n * k, w.len())?;
    gemm_ref(
        MatRef::new(x, m, k)?,
        MatRef::new(w, n, k)?.t(),
        MatMut::new(out, m, n)?,
    )
}
