//! How a column-major BLAS (cuBLAS) reads Burn's row-major matrices: the
//! operation and leading dimension of each operand of `C = A · B`, from
//! the operands' strides. Plain arithmetic, tested on every build; the
//! call itself is `cube::cublas` (CUDA builds).
//!
//! A row-major `rows × cols` matrix whose rows are `ld` apart is, to a
//! column-major library, its transpose (`cols × rows`, columns `ld`
//! apart); a transposed view (Burn's `transpose` swaps the strides) is a
//! column-major `rows × cols`. So `C = A · B` (`m × k` times `k × n`, `C`
//! row-major and contiguous) is the column-major `Cᵀ = Bᵀ · Aᵀ`: B first,
//! A second, `n × m` out with `ldc = n`.

/// One operand as the library reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operand {
    /// `CUBLAS_OP_T` where true (the operand is a column-major view),
    /// `CUBLAS_OP_N` where false (row-major, rows possibly padded).
    pub(crate) transposed: bool,
    /// The leading dimension: the row stride of a row-major operand, the
    /// column stride of a column-major one.
    pub(crate) ld: usize,
}

/// How the library reads a `rows × cols` operand with element `strides`
/// (`[row stride, column stride]`), or `None` where it cannot without a
/// copy (a broadcast, or a stride in both dimensions): the caller makes
/// it contiguous first. A dimension of one element has no stride to
/// speak of, and its leading dimension is the smallest the library takes.
pub(crate) fn operand(rows: usize, cols: usize, strides: [usize; 2]) -> Option<Operand> {
    let [row_stride, col_stride] = strides;
    if rows == 0 || cols == 0 {
        return None;
    }
    // Row-major: columns next to each other, rows at least a row apart
    // (CUDA pads rows: its pitched layout).
    if (col_stride == 1 || cols == 1) && (rows == 1 || row_stride >= cols) {
        let ld = if rows == 1 { cols } else { row_stride };
        return Some(Operand {
            transposed: false,
            ld,
        });
    }
    // Column-major: a transposed view.
    if (row_stride == 1 || rows == 1) && (cols == 1 || col_stride >= rows) {
        let ld = if cols == 1 { rows } else { col_stride };
        return Some(Operand {
            transposed: true,
            ld,
        });
    }
    None
}

/// The arguments of the column-major call for `C = A · B` (`A`: `m × k`,
/// `B`: `k × n`, `C`: `m × n` row-major contiguous): B's operand first,
/// A's second, then `(n, m, k)` and `ldc`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gemm {
    /// The call's first operand (B).
    pub(crate) first: Operand,
    /// The call's second operand (A).
    pub(crate) second: Operand,
    /// The call's `m`, `n`, `k`: C's columns, C's rows, the inner size.
    pub(crate) mnk: [usize; 3],
    /// C's row stride: its columns.
    pub(crate) ldc: usize,
}

/// [`Gemm`] for `A` (`[m, k]`, `a_strides`) times `B` (`[k, n]`,
/// `b_strides`), or `None` where an operand needs a copy first, the
/// shapes do not chain, or a size exceeds what the library's 32-bit
/// arguments hold.
pub(crate) fn gemm(
    a: [usize; 2],
    a_strides: [usize; 2],
    b: [usize; 2],
    b_strides: [usize; 2],
) -> Option<Gemm> {
    let ([m, k], [k2, n]) = (a, b);
    if k != k2 {
        return None;
    }
    let second = operand(m, k, a_strides)?;
    let first = operand(k, n, b_strides)?;
    let fits = |v: usize| i32::try_from(v).is_ok();
    if ![m, n, k, first.ld, second.ld].into_iter().all(fits) {
        return None;
    }
    Some(Gemm {
        first,
        second,
        mnk: [n, m, k],
        ldc: n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `C = A · B` by the column-major rules the library follows, reading
    /// the operands' memory as the [`Gemm`] says: what cuBLAS would
    /// compute, on the host.
    fn column_major_product(g: Gemm, a_mem: &[f32], b_mem: &[f32]) -> Vec<f32> {
        let [cm, cn, ck] = g.mnk;
        // op(X)[i][j] of a stored column-major matrix with leading
        // dimension ld: X[i + j·ld] untransposed, X[j + i·ld] transposed.
        let read = |op: Operand, mem: &[f32], i: usize, j: usize| {
            if op.transposed {
                mem[j + i * op.ld]
            } else {
                mem[i + j * op.ld]
            }
        };
        let mut c = vec![0.0; cm * cn];
        for i in 0..cm {
            for j in 0..cn {
                let mut sum = 0.0;
                for p in 0..ck {
                    sum += read(g.first, b_mem, i, p) * read(g.second, a_mem, p, j);
                }
                // Column-major C (cm × cn), leading dimension ldc.
                c[i + j * g.ldc] = sum;
            }
        }
        c
    }

    /// A `rows × cols` matrix laid out in memory with `strides` (the
    /// unused slots NaN, so that reading one shows).
    fn lay_out(values: &[Vec<f32>], strides: [usize; 2]) -> Vec<f32> {
        let (rows, cols) = (values.len(), values[0].len());
        let len = (rows - 1) * strides[0] + (cols - 1) * strides[1] + 1;
        let mut mem = vec![f32::NAN; len];
        for (i, row) in values.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                mem[i * strides[0] + j * strides[1]] = v;
            }
        }
        mem
    }

    fn matrix(rows: usize, cols: usize, seed: f32) -> Vec<Vec<f32>> {
        (0..rows)
            .map(|i| {
                (0..cols)
                    .map(|j| ((i * 7 + j * 3) as f32 * 0.37 + seed).sin())
                    .collect()
            })
            .collect()
    }

    #[test]
    fn every_layout_burn_hands_over_gives_the_row_major_product() {
        for (m, k, n) in [(5, 3, 4), (1, 4, 3), (4, 1, 2), (3, 2, 1), (1, 1, 1)] {
            let (a, b) = (matrix(m, k, 0.1), matrix(k, n, 0.7));
            let expected: Vec<f32> = (0..m)
                .flat_map(|i| {
                    let (a, b) = (&a, &b);
                    (0..n).map(move |j| (0..k).map(|p| a[i][p] * b[p][j]).sum::<f32>())
                })
                .collect();
            // Row-major contiguous, row-major pitched (rows padded),
            // a transposed view of a contiguous matrix, and of a padded one.
            let layouts =
                |rows: usize, cols: usize| [[cols, 1], [cols + 5, 1], [1, rows], [1, rows + 3]];
            for sa in layouts(m, k) {
                for sb in layouts(k, n) {
                    let g = gemm([m, k], sa, [k, n], sb)
                        .unwrap_or_else(|| panic!("{m}×{k}·{k}×{n} {sa:?} {sb:?}"));
                    let c = column_major_product(g, &lay_out(&a, sa), &lay_out(&b, sb));
                    for (x, y) in c.iter().zip(&expected) {
                        assert!((x - y).abs() < 1e-5, "{m}×{k}·{k}×{n} {sa:?} {sb:?}: {c:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn broadcasts_mismatched_shapes_and_strided_views_are_refused() {
        // A broadcast row (stride 0) and a view strided both ways need a copy.
        assert_eq!(operand(4, 3, [0, 1]), None);
        assert_eq!(operand(4, 3, [6, 2]), None);
        // Rows closer than a row apart overlap.
        assert_eq!(operand(4, 3, [2, 1]), None);
        assert!(gemm([2, 3], [3, 1], [4, 2], [2, 1]).is_none());
        assert!(gemm([1 << 31, 1], [1, 1], [1, 1], [1, 1]).is_none());
        assert_eq!(
            operand(4, 3, [3, 1]),
            Some(Operand {
                transposed: false,
                ld: 3
            })
        );
        assert_eq!(
            operand(4, 3, [1, 4]),
            Some(Operand {
                transposed: true,
                ld: 4
            })
        );
    }
}
