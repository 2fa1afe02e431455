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

/// Multiply-adds below which one more thread does not pay for waking it (about 10-20 us of
/// work on one core, a few times what handing a task to the pool costs).
pub const MIN_MACS_PER_THREAD: usize = 1 << 17;

/// [`linear`] over up to `threads` threads (the calling one and rayon's pool, see
/// [`crate::par::run_tasks`]), as many as the work pays for ([`MIN_MACS_PER_THREAD`]). Many
/// rows (prefill) are split by rows; a few (decode) by weight rows, each thread computing its
/// own output columns. `matrixmultiply` sums each element along `k` in an order that depends
/// on neither the number of rows nor of columns computed together, so the result is
/// bit-identical to [`linear`]'s for every thread count. Inside a task of
/// [`crate::par::run_tasks`] it runs on the calling thread (the pool is already shared out).
///
/// # Errors
/// [`linear`]'s errors; [`Error::Internal`] if a worker panicked.
pub fn linear_threads(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<(), Error> {
    check_len("linear input x [m, k]", m * k, x.len())?;
    check_len("linear weight w [n, k]", n * k, w.len())?;
    check_len("output matrix [rows, cols]", m * n, out.len())?;
    let macs = m.saturating_mul(n).saturating_mul(k);
    let t = threads
        .min(macs / crate::par::min_split_work(MIN_MACS_PER_THREAD))
        .min(m.max(n))
        .max(1);
    if t == 1 || crate::par::in_task() {
        return linear(x, w, m, k, n, out);
    }
    let mut results: Vec<Result<(), Error>> = Vec::with_capacity(t);
    if m >= 2 * t {
        // By rows: every part is whole output rows.
        let per = m.div_ceil(t);
        let parts: Vec<(usize, &mut [f32])> = out
            .chunks_mut(per * n)
            .enumerate()
            .map(|(c, o)| (c * per, o))
            .collect();
        results.resize_with(parts.len(), || Ok(()));
        crate::par::run_tasks(results.iter_mut().zip(parts).map(|(r, (i0, o))| {
            move || {
                let rows = o.len() / n.max(1);
                *r = guarded(|| linear(&x[i0 * k..(i0 + rows) * k], w, rows, k, n, o));
            }
        }));
    } else {
        // By weight rows: every part computes its columns for all rows into its own buffer.
        let per = n.div_ceil(t);
        let mut bufs: Vec<(usize, Vec<f32>)> = (0..n)
            .step_by(per)
            .map(|j0| (j0, vec![0f32; m * per.min(n - j0)]))
            .collect();
        results.resize_with(bufs.len(), || Ok(()));
        crate::par::run_tasks(results.iter_mut().zip(bufs.iter_mut()).map(|(r, (j0, b))| {
            let j0 = *j0;
            move || {
                let cols = b.len() / m.max(1);
                *r = guarded(|| linear(x, &w[j0 * k..(j0 + cols) * k], m, k, cols, b));
            }
        }));
        results.into_iter().collect::<Result<(), Error>>()?;
        for (j0, b) in &bufs {
            let cols = b.len() / m.max(1);
            for (i, row) in b.chunks_exact(cols.max(1)).enumerate() {
                out[i * n + j0..i * n + j0 + cols].copy_from_slice(row);
            }
        }
        return Ok(());
    }
    results.into_iter().collect()
}

/// Runs `f`, turning a panic into an error (a worker's panic must not cross the pool).
pub(crate) fn guarded(f: impl FnOnce() -> Result<(), Error>) -> Result<(), Error> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(Err(Error::Internal {
        what: "a linear worker thread panicked",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Every thread count gives the bits of one thread, split by rows or by columns: what
    /// makes a model step independent of `--threads`.
    #[test]
    fn linear_threads_is_bit_identical_to_linear_for_every_thread_count() {
        for (m, k, n) in [
            (1, 300, 700),
            (3, 256, 513),
            (4, 128, 2048),
            (37, 200, 150),
            (256, 64, 96),
        ] {
            let x = data(m * k, 1);
            let w = data(n * k, 2);
            let mut want = vec![0f32; m * n];
            linear(&x, &w, m, k, n, &mut want).unwrap();
            for t in [1, 2, 3, 8] {
                let mut got = vec![f32::NAN; m * n];
                linear_threads(&x, &w, m, k, n, &mut got, t).unwrap();
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{m}x{k}x{n} on {t} threads"
                );
            }
        }
    }

    #[test]
    fn linear_threads_checks_its_buffers() {
        let mut out = vec![0f32; 5];
        let e = linear_threads(&[0.0; 6], &[0.0; 6], 2, 3, 2, &mut out, 4).unwrap_err();
        assert!(e.to_string().contains("output"), "{e}");
    }
}
