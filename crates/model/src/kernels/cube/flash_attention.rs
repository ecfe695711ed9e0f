//! Self-attention on matrix instructions (tensor cores, Vulkan cooperative
//! matrices): FlashAttention-2's tiling with CubeCL's `cmma`, forward and
//! backward.
//!
//! One cube is one plane (a warp on CUDA, a subgroup on Vulkan) and owns a
//! tile of `tile` rows of one head. The forward kernel's rows are queries;
//! it walks the key tiles they see (with `causal`, none past the tile's
//! last query) and for each:
//!
//! 1. copies the key and value tile into shared memory (zeros past the
//!    sequence's end);
//! 2. `S = Q·Kᵀ` on the matrix unit (inputs in the tensor's dtype, the sum
//!    in f32), spilled to shared memory;
//! 3. one unit per query row: masking (padding, causal, past the end), the
//!    online softmax in f32 (running maximum and sum, the factor that
//!    rescales what was summed so far), `P` rounded to the input dtype;
//! 4. `O = O·factor + P·V`, O kept in f32 in shared memory, the product on
//!    the matrix unit.
//!
//! It ends as the scalar kernel does: the merged heads (`O / sum`, zeros for
//! a query that sees no key) and each query's log-sum-exp. The backward
//! pass rebuilds the probabilities from it, after the scalar `delta`
//! kernel (`Σ dO·O` per query, in `attention.rs`):
//!
//! - dQ, one cube per query tile, over the key tiles it sees: `S = Q·Kᵀ`
//!   and `dP = dO·Vᵀ` on the matrix unit, `P = exp(scale·S − lse)` and
//!   `dS = P·(dP − delta)` per element in f32, then `dQ += dS·K`;
//! - dK and dV, one cube per key tile, over the query tiles that see it:
//!   the same `S`, `dP`, `P` and `dS`, then `dV += Pᵀ·dO` and
//!   `dK += dSᵀ·Q` (the transposes read column-major).
//!
//! No atomics and nothing `time × time` in memory, as in the scalar
//! kernels, and the same results up to rounding: `kiln check-kernels`
//! compares these with Burn's composition in f16/bf16 where they run.
//!
//! They run where the device has a square matrix instruction for the dtype
//! with an f32 accumulator (`tile × tile × tile`: 16 on NVIDIA's tensor
//! cores for bf16 and f16, 8 for f16 on Mesa's lavapipe), the head width
//! is a multiple of it, the plane has one fixed size and the dK/dV
//! kernel's shared memory fits; everywhere else (f32, WGSL, widths such as
//! 136 against 16) the scalar kernels do.
//!
//! The tile is the instruction's size: one plane per cube, the scores'
//! tile a single instruction tall and wide. Larger tiles (several planes
//! sharing each key tile, as FlashAttention-2 does with four warps) and
//! the accumulators kept in registers rather than shared memory are the
//! next steps, for the GPU check's profile to decide between.

use burn::tensor::DType;
use burn_backend::cubecl::{dtype_to_elem_type, dtype_to_storage_type};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::super::cube_empty as empty;

/// Below any score: the running maximum before the first key (as the
/// scalar kernel's, a finite stand-in for −∞).
const LOWEST: f32 = -3.0e38;

/// The matrix instruction's size this kernel uses for `dtype` and
/// `head_dim` on `client`'s device, and the plane's size; `None` where the
/// scalar kernel runs instead (see the module's doc).
pub(crate) fn tile_for(
    client: &cubecl::client::Client,
    dtype: DType,
    head_dim: usize,
) -> Option<(usize, usize)> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return None;
    }
    let props = client.properties();
    let plane = props.hardware.plane_size_max;
    if plane == 0 || plane != props.hardware.plane_size_min {
        return None;
    }
    let (elem, acc) = (dtype_to_elem_type(dtype), dtype_to_elem_type(DType::F32));
    [16u32, 8]
        .into_iter()
        .find(|&t| {
            head_dim.is_multiple_of(t as usize)
                && shared_bytes(t as usize, head_dim, dtype.size())
                    <= props.hardware.max_shared_memory_size
                && props.features.matmul.cmma.contains(&MmaConfig {
                    a_type: elem,
                    b_type: elem,
                    cd_type: acc,
                    m: t,
                    n: t,
                    k: t,
                })
        })
        .map(|t| (t as usize, plane as usize))
}

/// The shared memory of the largest of the kernels (dK/dV's): four
/// `tile × head_dim` tiles of the inputs, two in f32 (dK, dV), the scores
/// and their gradient in f32 and rounded, and two floats per row.
fn shared_bytes(tile: usize, head_dim: usize, elem: usize) -> usize {
    4 * tile * head_dim * elem + 2 * tile * head_dim * 4 + 2 * tile * tile * (4 + elem) + 8 * tile
}

/// Whether the launch grid (query or key tiles, heads, batch entries) fits
/// the device's.
fn grid_fits(client: &cubecl::client::Client, tiles: usize, heads: usize, batch: usize) -> bool {
    let (x, y, z) = client.properties().hardware.max_cube_count;
    tiles <= x as usize && heads <= y as usize && batch <= z as usize
}

/// Copies `tile` rows of one head into `dst` (row-major, `head_dim` wide):
/// rows `first..first + tile` of batch entry `b`, each `row_stride` apart in
/// `src`, from column `col0`; zeros for rows past `seq`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_rows<E: Float>(
    src: &[E],
    dst: &mut Shared<[E]>,
    b: usize,
    first: usize,
    seq: usize,
    row_stride: usize,
    col0: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
) {
    let mut e = UNIT_POS as usize;
    while e < tile * head_dim {
        let row = first + e / head_dim;
        let mut x = E::from_int(0);
        if row < seq {
            x = src[(b * seq + row) * row_stride + col0 + e % head_dim];
        }
        dst[e] = x;
        e += units;
    }
}

/// Shared memory for `len` elements that the matrix unit loads from or
/// stores to: 32-byte aligned, as CUDA's `wmma` loads and stores require
/// (every offset the kernels use into it is a multiple of 32 bytes too: a
/// whole tile row of 16 or 8 elements).
#[cube]
fn tile_memory<T: CubePrimitive>(#[comptime] len: usize) -> Shared<[T]> {
    Shared::<[T]>::new_aligned_slice(len, 32usize)
}

/// A `tile × tile` fragment of the matrix unit (`ident`: which operand)
/// loaded from `slice`, rows (or with `ColMajor`, columns) `stride` apart.
#[cube]
fn fragment<T: CubePrimitive>(
    #[comptime] ident: MatrixIdent,
    layout: MatrixLayout,
    slice: &[T],
    stride: u32,
    #[comptime] tile: usize,
) -> Matrix<T> {
    Matrix::<T>::from_slice(ident, tile, tile, tile, layout, slice, stride)
}

/// `out = A·Bᵀ` (`tile × tile`, f32) of two row-major `tile × head_dim`
/// tiles on the matrix unit: the scores `Q·Kᵀ`, or `dO·Vᵀ`. `Bᵀ` is `B`
/// read column-major.
#[cube]
fn product_abt<E: Float>(
    a: &Shared<[E]>,
    b: &Shared<[E]>,
    out: &mut Shared<[f32]>,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
) {
    let acc = Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        tile,
        tile,
        tile,
        MatrixLayout::Undefined,
        f32::new(0.0),
    );
    let end = tile * head_dim;
    #[unroll]
    for step in 0..head_dim / tile {
        let lhs = fragment::<E>(
            MatrixIdent::A,
            MatrixLayout::RowMajor,
            &a[step * tile..end],
            head_dim as u32,
            tile,
        );
        let rhs = fragment::<E>(
            MatrixIdent::B,
            MatrixLayout::ColMajor,
            &b[step * tile..end],
            head_dim as u32,
            tile,
        );
        cmma::execute(&lhs, &rhs, &acc, &acc);
    }
    cmma::store(out, &acc, tile as u32, MatrixLayout::RowMajor);
}

/// `acc += A·B` on the matrix unit: `A` a row-major `tile × tile` tile
/// (with `transposed`, `Aᵀ`: read column-major), `B` and `acc` row-major
/// `tile × head_dim` (`acc` in f32). `P·V`, `dS·K`, `Pᵀ·dO`, `dSᵀ·Q`.
#[cube]
fn accumulate_ab<E: Float>(
    a: &Shared<[E]>,
    b: &Shared<[E]>,
    acc: &mut Shared<[f32]>,
    #[comptime] transposed: bool,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
) {
    let layout = comptime!(if transposed {
        MatrixLayout::ColMajor
    } else {
        MatrixLayout::RowMajor
    });
    let lhs = fragment::<E>(MatrixIdent::A, layout, a, tile as u32, tile);
    let end = tile * head_dim;
    #[unroll]
    for step in 0..head_dim / tile {
        let rhs = fragment::<E>(
            MatrixIdent::B,
            MatrixLayout::RowMajor,
            &b[step * tile..end],
            head_dim as u32,
            tile,
        );
        let sum = fragment::<f32>(
            MatrixIdent::Accumulator,
            MatrixLayout::RowMajor,
            &acc[step * tile..end],
            head_dim as u32,
            tile,
        );
        cmma::execute(&lhs, &rhs, &sum, &sum);
        cmma::store(
            &mut acc[step * tile..end],
            &sum,
            head_dim as u32,
            MatrixLayout::RowMajor,
        );
    }
}

/// Whether query `i` sees key `j` (both in the sequence, the key not
/// padding, and with `causal` not after the query).
#[cube]
fn sees(pad: &[f32], b: usize, i: usize, j: usize, seq: usize, #[comptime] causal: bool) -> bool {
    let mut seen = i < seq && j < seq;
    if seen {
        seen = pad[b * seq + j] == f32::new(0.0) && (!causal || j <= i);
    }
    seen
}

/// Zeros `len` floats of `dst`.
#[cube]
fn zero(dst: &mut Shared<[f32]>, #[comptime] len: usize, #[comptime] units: usize) {
    let mut e = UNIT_POS as usize;
    while e < len {
        dst[e] = f32::new(0.0);
        e += units;
    }
}

#[cube(launch)]
// (`div_ceil` is not a CubeCL operation: the key tiles are counted by hand.)
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn flash_attention_kernel<E: Float>(
    qkv: &[E],
    pad: &[f32],
    out: &mut [E],
    lse: &mut [f32],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] causal: bool,
    #[define(E)] _dtype: ElemType,
) {
    let q_tile = CUBE_POS_X as usize;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let unit = UNIT_POS as usize;
    let width = heads * head_dim;
    let q_start = q_tile * tile;
    let tile_elems = tile * head_dim;

    let mut sq = tile_memory::<E>(tile_elems);
    let mut sk = tile_memory::<E>(tile_elems);
    let mut sv = tile_memory::<E>(tile_elems);
    let mut so = tile_memory::<f32>(tile_elems);
    let mut ss = tile_memory::<f32>(tile * tile);
    let mut sp = tile_memory::<E>(tile * tile);
    let mut row_max = Shared::<[f32]>::new_slice(tile);
    let mut row_sum = Shared::<[f32]>::new_slice(tile);
    let mut row_factor = Shared::<[f32]>::new_slice(tile);

    // The query tile (zeros past the end) and the accumulator.
    load_rows(
        qkv,
        &mut sq,
        b,
        q_start,
        seq,
        3 * width,
        h * head_dim,
        head_dim,
        tile,
        units,
    );
    zero(&mut so, tile_elems, units);
    let mut r = unit;
    while r < tile {
        row_max[r] = f32::new(LOWEST);
        row_sum[r] = f32::new(0.0);
        r += units;
    }
    sync_cube();

    // With `causal`, no key after the tile's last query.
    let mut keys = seq;
    if causal && q_start + tile < seq {
        keys = q_start + tile;
    }
    let key_tiles = (keys + tile - 1) / tile;
    for k_tile in 0..key_tiles {
        let k_start = k_tile * tile;
        let k0 = width + h * head_dim;
        load_rows(
            qkv,
            &mut sk,
            b,
            k_start,
            seq,
            3 * width,
            k0,
            head_dim,
            tile,
            units,
        );
        load_rows(
            qkv,
            &mut sv,
            b,
            k_start,
            seq,
            3 * width,
            k0 + width,
            head_dim,
            tile,
            units,
        );
        sync_cube();
        product_abt(&sq, &sk, &mut ss, head_dim, tile);
        sync_cube();

        // The online softmax, one unit per query row.
        let mut r = unit;
        while r < tile {
            let i = q_start + r;
            let old_max = row_max[r];
            let mut new_max = old_max;
            for c in 0..tile {
                if sees(pad, b, i, k_start + c, seq, causal) {
                    new_max = max(new_max, ss[r * tile + c] * scale);
                }
            }
            let factor = (old_max - new_max).exp();
            let mut sum = row_sum[r] * factor;
            for c in 0..tile {
                let mut p = f32::new(0.0);
                if sees(pad, b, i, k_start + c, seq, causal) {
                    p = (ss[r * tile + c] * scale - new_max).exp();
                }
                sum += p;
                sp[r * tile + c] = E::cast_from(p);
            }
            row_max[r] = new_max;
            row_sum[r] = sum;
            row_factor[r] = factor;
            r += units;
        }
        sync_cube();

        // O = O·factor + P·V.
        let mut e = unit;
        while e < tile_elems {
            so[e] *= row_factor[e / head_dim];
            e += units;
        }
        sync_cube();
        accumulate_ab(&sp, &sv, &mut so, false, head_dim, tile);
        sync_cube();
    }

    // The merged heads and the log-sum-exp, as the scalar kernel writes
    // them (zeros and 0 for a query that sees no key).
    let mut e = unit;
    while e < tile_elems {
        let r = e / head_dim;
        let i = q_start + r;
        if i < seq {
            let sum = row_sum[r];
            let mut o = f32::new(0.0);
            if sum > f32::new(0.0) {
                o = so[e] / sum;
            }
            out[(b * seq + i) * width + h * head_dim + e % head_dim] = E::cast_from(o);
        }
        e += units;
    }
    let mut r = unit;
    while r < tile {
        let i = q_start + r;
        if i < seq {
            let sum = row_sum[r];
            let mut l = f32::new(0.0);
            if sum > f32::new(0.0) {
                l = row_max[r] + sum.ln();
            }
            lse[(b * heads + h) * seq + i] = l;
        }
        r += units;
    }
}

/// What a backward kernel keeps in shared memory for one pair of a query
/// tile and a key tile: the queries, their output gradient, log-sum-exp and
/// `delta`; the keys and values; the scores `S = Q·Kᵀ` and `dP = dO·Vᵀ` in
/// f32, and from them `P` and `dS` rounded to the inputs' dtype.
#[derive(CubeType)]
struct BackwardTiles<E: Float> {
    q: Shared<[E]>,
    dout: Shared<[E]>,
    lse: Shared<[f32]>,
    delta: Shared<[f32]>,
    k: Shared<[E]>,
    v: Shared<[E]>,
    s: Shared<[f32]>,
    dp: Shared<[f32]>,
    p: Shared<[E]>,
    ds: Shared<[E]>,
}

#[cube]
impl<E: Float> BackwardTiles<E> {
    fn new(#[comptime] head_dim: usize, #[comptime] tile: usize) -> BackwardTiles<E> {
        BackwardTiles::<E> {
            q: tile_memory::<E>(tile * head_dim),
            dout: tile_memory::<E>(tile * head_dim),
            lse: Shared::<[f32]>::new_slice(tile),
            delta: Shared::<[f32]>::new_slice(tile),
            k: tile_memory::<E>(tile * head_dim),
            v: tile_memory::<E>(tile * head_dim),
            s: tile_memory::<f32>(tile * tile),
            dp: tile_memory::<f32>(tile * tile),
            p: tile_memory::<E>(tile * tile),
            ds: tile_memory::<E>(tile * tile),
        }
    }

    /// The query tile from `q_start` of head `h` (zeros past the end).
    #[allow(clippy::too_many_arguments)]
    fn load_queries(
        &mut self,
        qkv: &[E],
        grad: &[E],
        lse: &[f32],
        delta: &[f32],
        b: usize,
        h: usize,
        heads: usize,
        q_start: usize,
        seq: usize,
        #[comptime] head_dim: usize,
        #[comptime] tile: usize,
        #[comptime] units: usize,
    ) {
        let width = heads * head_dim;
        let q0 = h * head_dim;
        load_rows(
            qkv,
            &mut self.q,
            b,
            q_start,
            seq,
            3 * width,
            q0,
            head_dim,
            tile,
            units,
        );
        load_rows(
            grad,
            &mut self.dout,
            b,
            q_start,
            seq,
            width,
            q0,
            head_dim,
            tile,
            units,
        );
        let row0 = (b * heads + h) * seq + q_start;
        let mut r = UNIT_POS as usize;
        while r < tile {
            let mut l = f32::new(0.0);
            let mut d = f32::new(0.0);
            if q_start + r < seq {
                l = lse[row0 + r];
                d = delta[row0 + r];
            }
            self.lse[r] = l;
            self.delta[r] = d;
            r += units;
        }
    }

    /// The key and value tile from `k_start` of head `h` (zeros past the
    /// end).
    #[allow(clippy::too_many_arguments)]
    fn load_keys(
        &mut self,
        qkv: &[E],
        b: usize,
        h: usize,
        heads: usize,
        k_start: usize,
        seq: usize,
        #[comptime] head_dim: usize,
        #[comptime] tile: usize,
        #[comptime] units: usize,
    ) {
        let width = heads * head_dim;
        let k0 = width + h * head_dim;
        load_rows(
            qkv,
            &mut self.k,
            b,
            k_start,
            seq,
            3 * width,
            k0,
            head_dim,
            tile,
            units,
        );
        load_rows(
            qkv,
            &mut self.v,
            b,
            k_start,
            seq,
            3 * width,
            k0 + width,
            head_dim,
            tile,
            units,
        );
    }

    /// `S` and `dP` on the matrix unit, then per element
    /// `P = exp(scale·S − lse)` (0 where the query does not see the key) and
    /// `dS = P·(dP − delta)`. The loaded tiles must be visible to the whole
    /// plane (`sync_cube`) before; `P` and `dS` are when this returns.
    #[allow(clippy::too_many_arguments)]
    fn probabilities(
        &mut self,
        pad: &[f32],
        b: usize,
        q_start: usize,
        k_start: usize,
        seq: usize,
        scale: f32,
        #[comptime] head_dim: usize,
        #[comptime] tile: usize,
        #[comptime] units: usize,
        #[comptime] causal: bool,
    ) {
        product_abt(&self.q, &self.k, &mut self.s, head_dim, tile);
        product_abt(&self.dout, &self.v, &mut self.dp, head_dim, tile);
        sync_cube();
        let mut e = UNIT_POS as usize;
        while e < tile * tile {
            let r = e / tile;
            let mut p = f32::new(0.0);
            if sees(pad, b, q_start + r, k_start + e % tile, seq, causal) {
                p = (self.s[e] * scale - self.lse[r]).exp();
            }
            self.p[e] = E::cast_from(p);
            self.ds[e] = E::cast_from(p * (self.dp[e] - self.delta[r]));
            e += units;
        }
        sync_cube();
    }
}

/// The backward pass's products, one cube per tile of rows of one head.
/// With `keys_outer`, the rows are keys: over the query tiles that see
/// them, `dV += Pᵀ·dO` and `dK += dSᵀ·Q`. Without, queries: over the key
/// tiles they see, `dQ += dS·K`. Each writes its part of `dqkv`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn flash_backward_kernel<E: Float>(
    qkv: &[E],
    pad: &[f32],
    grad: &[E],
    lse: &[f32],
    delta: &[f32],
    dqkv: &mut [E],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] causal: bool,
    #[comptime] keys_outer: bool,
    #[define(E)] _dtype: ElemType,
) {
    let start = CUBE_POS_X as usize * tile;
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    let width = heads * head_dim;
    let tile_elems = tile * head_dim;
    let mut t = BackwardTiles::<E>::new(head_dim, tile);
    // dK (or dQ), and dV (dK/dV only).
    let mut acc = tile_memory::<f32>(tile_elems);
    let mut acc_v = tile_memory::<f32>(comptime!(if keys_outer { tile_elems } else { 1 }));
    zero(&mut acc, tile_elems, units);
    // Where the rows' gradient goes in `dqkv`: the keys' block (the values'
    // one `width` further) or the queries'.
    let mut col0 = h * head_dim;
    if keys_outer {
        col0 += width;
        zero(&mut acc_v, tile_elems, units);
        // With `causal`, no query tile before the one holding the first key.
        let mut first = 0;
        if causal {
            first = start / tile;
        }
        t.load_keys(qkv, b, h, heads, start, seq, head_dim, tile, units);
        for q_tile in first..(seq + tile - 1) / tile {
            let q_start = q_tile * tile;
            // (The previous tile's products are done with these buffers.)
            sync_cube();
            t.load_queries(
                qkv, grad, lse, delta, b, h, heads, q_start, seq, head_dim, tile, units,
            );
            sync_cube();
            t.probabilities(
                pad, b, q_start, start, seq, scale, head_dim, tile, units, causal,
            );
            accumulate_ab(&t.p, &t.dout, &mut acc_v, true, head_dim, tile);
            accumulate_ab(&t.ds, &t.q, &mut acc, true, head_dim, tile);
        }
    } else {
        // With `causal`, no key after the tile's last query.
        let mut keys = seq;
        if causal && start + tile < seq {
            keys = start + tile;
        }
        t.load_queries(
            qkv, grad, lse, delta, b, h, heads, start, seq, head_dim, tile, units,
        );
        for k_tile in 0..(keys + tile - 1) / tile {
            let k_start = k_tile * tile;
            sync_cube();
            t.load_keys(qkv, b, h, heads, k_start, seq, head_dim, tile, units);
            sync_cube();
            t.probabilities(
                pad, b, start, k_start, seq, scale, head_dim, tile, units, causal,
            );
            accumulate_ab(&t.ds, &t.k, &mut acc, false, head_dim, tile);
        }
    }
    sync_cube();

    let mut e = UNIT_POS as usize;
    while e < tile_elems {
        let row = start + e / head_dim;
        if row < seq {
            let at = (b * seq + row) * 3 * width + col0 + e % head_dim;
            dqkv[at] = E::cast_from(acc[e] * scale);
            if keys_outer {
                dqkv[at + width] = E::cast_from(acc_v[e]);
            }
        }
        e += units;
    }
}

/// The forward pass on the matrix unit where [`tile_for`] finds one: the
/// merged heads and the log-sum-exp (`[b, heads, t]`, f32), as the scalar
/// kernel's; `None` where it does not run. `qkv` and `pad` are contiguous.
pub(super) fn forward(
    qkv: &CubeTensor,
    pad: &CubeTensor,
    heads: usize,
    causal: bool,
) -> Option<(CubeTensor, CubeTensor)> {
    let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
    let head_dim = three_width / 3 / heads;
    let dtype = qkv.dtype;
    let (tile, units) = tile_for(&qkv.client, dtype, head_dim)?;
    if !grid_fits(&qkv.client, seq.div_ceil(tile), heads, batch) {
        return None;
    }
    let out = empty(qkv, vec![batch, seq, heads * head_dim], dtype);
    let lse = empty(qkv, vec![batch, heads, seq], DType::F32);
    let cube_count = CubeCount::Static(seq.div_ceil(tile) as u32, heads as u32, batch as u32);
    flash_attention_kernel::launch(
        &qkv.client,
        cube_count,
        CubeDim::new_1d(units as u32),
        qkv.clone().into_buffer_arg(),
        pad.clone().into_buffer_arg(),
        out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        seq,
        heads,
        (1.0 / (head_dim as f64).sqrt()) as f32,
        head_dim,
        tile,
        units,
        causal,
        dtype_to_storage_type(dtype),
    );
    Some((out, lse))
}

/// The gradient of the packed qkv on the matrix unit where [`tile_for`]
/// finds one (`None` elsewhere): dQ per query tile, dK and dV per key
/// tile, from the forward pass's log-sum-exp and `delta` (`Σ dO·O` per
/// query, `[b, heads, t]`, f32). All inputs contiguous, `grad` in qkv's
/// dtype.
pub(super) fn backward(
    qkv: &CubeTensor,
    pad: &CubeTensor,
    grad: &CubeTensor,
    lse: &CubeTensor,
    delta: &CubeTensor,
    heads: usize,
    causal: bool,
) -> Option<CubeTensor> {
    let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
    let head_dim = three_width / 3 / heads;
    let dtype = qkv.dtype;
    let (tile, units) = tile_for(&qkv.client, dtype, head_dim)?;
    if !grid_fits(&qkv.client, seq.div_ceil(tile), heads, batch) {
        return None;
    }
    let dqkv = empty(qkv, qkv.meta.shape().to_vec(), dtype);
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    // dQ per query tile, then dK and dV per key tile.
    for keys_outer in [false, true] {
        flash_backward_kernel::launch(
            &qkv.client,
            CubeCount::Static(seq.div_ceil(tile) as u32, heads as u32, batch as u32),
            CubeDim::new_1d(units as u32),
            qkv.clone().into_buffer_arg(),
            pad.clone().into_buffer_arg(),
            grad.clone().into_buffer_arg(),
            lse.clone().into_buffer_arg(),
            delta.clone().into_buffer_arg(),
            dqkv.clone().into_buffer_arg(),
            seq,
            heads,
            scale,
            head_dim,
            tile,
            units,
            causal,
            keys_outer,
            dtype_to_storage_type(dtype),
        );
    }
    Some(dqkv)
}
