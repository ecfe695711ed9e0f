//! Self-attention on matrix instructions (tensor cores, Vulkan cooperative
//! matrices): FlashAttention-2's tiling with CubeCL's `cmma`, forward and
//! backward.
//!
//! A plane (a warp on CUDA, a subgroup on Vulkan) owns a tile of `tile`
//! rows of one head, and a cube is up to four planes that share what they
//! read (FlashAttention-2's four warps a block): each tile of the other
//! side is loaded into shared memory once for all of them. The forward
//! kernel's rows are queries; it walks the key tiles they see (with
//! `causal`, none past the cube's last query) and for each:
//!
//! 1. copies the key and value tile into shared memory (zeros past the
//!    sequence's end), the one step where the cube's planes meet, from
//!    the units' registers, into which the step before read it (the next
//!    tile's loads are in flight while a step is computed), in vectors
//!    as wide as the device loads (16 bytes on CUDA);
//! 2. each plane on its own (meeting only its own units: a warp's barrier
//!    on CUDA), and only where some of its queries see the tile: `S = Q·Kᵀ`
//!    on the matrix unit (inputs in the tensor's dtype, the sum in f32;
//!    the plane's queries kept as the unit's operands in its registers),
//!    spilled to shared memory;
//! 3. the plane's units spread over its query rows (two a row on a 32-unit
//!    warp): masking (padding, causal, past the end; each key's flag read
//!    once into shared memory), the online softmax in f32 against each
//!    row's reference maximum, which moves only when a score passes it by
//!    more than ln 256 (FlashAttention-4's lazy rescaling: [`RESCALE_MARGIN`]),
//!    `P` rounded to the input dtype;
//! 4. `O = O·factor + P·V`, O the matrix unit's f32 accumulators in the
//!    plane's registers for the whole walk; where some row's reference
//!    moved (on the first tiles mostly), O passes through shared memory
//!    to be rescaled row by row (the unit's fragments cannot be).
//!
//! It ends as the scalar kernel does: the merged heads (`O / sum`, zeros for
//! a query that sees no key) and each query's log-sum-exp. The backward
//! pass rebuilds the probabilities from it, after the scalar `delta`
//! kernel (`Σ dO·O` per query, in `attention.rs`):
//!
//! - dQ, a plane per query tile, over the key tiles they see: `S = Q·Kᵀ`
//!   and `dP = dO·Vᵀ` on the matrix unit, `P = exp(scale·S − lse)` and
//!   `dS = P·(dP − delta)` per element in f32, then `dQ += dS·K`;
//! - dK and dV, a plane per key tile, over the query tiles that see them:
//!   the same `S`, `dP`, `P` and `dS`, then `dV += Pᵀ·dO` and
//!   `dK += dSᵀ·Q` (the transposes read column-major), summed in the
//!   plane's registers and written once at the end.
//!
//! With dropout on the probabilities (`dropout.rs`'s mask, compiled in
//! only then), `P` is multiplied by the mask where it is rounded for
//! `P·V` and for dV's `Pᵀ·dO`, and `dP` where `dS` is formed, as in the
//! scalar kernels.
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
//! The tile is the instruction's size. Each step of a walk takes one tile
//! of the inner rows (keys, or with dK/dV queries), or several with
//! `FLASH_KEYS` (fewer cube-wide syncs); each plane's scores are a tile
//! tall and that wide. A cube takes four planes where its shared memory
//! (48 KiB, or `FLASH_SHARED_KIB`: CubeCL's CUDA kernels take it
//! dynamically, up to the device's 227 KiB on an H100) and the sequence
//! allow, else two or one (GPT-2's 64-wide heads in bf16 by default: four
//! in each kernel). All three kernels keep their sums (O, dQ, or dK and
//! dV) in the planes' registers, as the matrix unit's accumulators, and
//! meet cube-wide only around the shared loads (two barriers a step), the
//! rest of a step synchronised within each plane. The forward kernel keeps
//! its plane's queries in registers as the unit's operands too; with
//! `FLASH_HOLD=1` the backward kernels keep theirs (Q and dO, or K and V).
//! The three variables are experiments the GPU check times
//! (`bench/gpu_check.py`'s `FLASH_VARIANTS`); `kiln check-kernels
//! --cuda-arch 90` gives each variant's registers and occupancy. On CUDA,
//! `FLASH_MMA=1` replaces these kernels by `flash_mma.rs`'s, whose
//! softmax is in the warps' registers (CUDA's manual MMA).

use burn::tensor::DType;
use burn_backend::cubecl::{dtype_to_elem_type, dtype_to_storage_type};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::{self, Matrix, MatrixIdent, MatrixLayout};
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::super::AttentionSpec;
use super::super::cube_empty as empty;
use super::dropout::{Mask, kept, launch_mask, seed_keys};

/// Below any score: the running maximum before the first key (as the
/// scalar kernel's, a finite stand-in for −∞).
pub(super) const LOWEST: f32 = -3.0e38;

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
                && backward_shared_bytes(t as usize, head_dim, dtype.size(), (1, 1), true)
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

/// A backward kernel's shared memory with `planes` planes a cube (each a
/// `tile` of the cube's rows: keys with `keys_outer`, else queries) and
/// `subs` inner tiles a step: the queries with their output gradient,
/// log-sum-exp and `delta`, the keys and values with their flags (the
/// cube's rows', or the step's inner tiles shared by the planes), each
/// plane's scores and their gradient in f32 and rounded (the rounded
/// probabilities only with `keys_outer`: the dQ kernel has no product of
/// them). (The sums, dK and dV or dQ, are in the planes' registers.)
fn backward_shared_bytes(
    tile: usize,
    head_dim: usize,
    elem: usize,
    (planes, subs): (usize, usize),
    keys_outer: bool,
) -> usize {
    let rows = tile * planes;
    let inner = tile * subs;
    let (q_rows, k_rows) = if keys_outer {
        (inner, rows)
    } else {
        (rows, inner)
    };
    let rounded = if keys_outer { 2 } else { 1 };
    // (The dK/dV kernel's key flags are in its units' registers where the
    // plane is a whole number of tiles wide: counted here anyway.)
    2 * (q_rows + k_rows) * head_dim * elem
        + 4 * (2 * q_rows + k_rows)
        + rows * inner * (8 + rounded * elem)
}

/// Whether the launch grid (query or key tiles, heads, batch entries) fits
/// the device's.
pub(super) fn grid_fits(
    client: &cubecl::client::Client,
    tiles: usize,
    heads: usize,
    batch: usize,
) -> bool {
    let (x, y, z) = client.properties().hardware.max_cube_count;
    tiles <= x as usize && heads <= y as usize && batch <= z as usize
}

/// Reads a unit's share of `tile` rows of one head (row-major, `head_dim`
/// wide, in vectors of `N` elements, the cube's `units` taking every
/// `units`-th vector) into `values`: rows `first..first + tile` of batch
/// entry `b`, each `row_stride` elements apart in `src`, from column
/// `col0` (both multiples of `N`); zeros for rows past `seq`. Into
/// registers, the loop unrolled, for [`write_rows`] to store once every
/// read a caller needs is issued: the loads are then all in flight at
/// once, where a load followed by its store waits out the memory's latency
/// once an element.
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn read_rows<E: Float, N: Size>(
    src: &[Vector<E, N>],
    values: &mut Array<Vector<E, N>>,
    b: usize,
    first: usize,
    seq: usize,
    row_stride: usize,
    col0: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    let n = src.vector_size().comptime();
    let per_row = comptime!(head_dim / n);
    let len = comptime!(tile * per_row);
    #[unroll]
    for k in 0..comptime!((len + units - 1) / units) {
        let v = unit + k * units;
        let row = first + v / per_row;
        let mut x = Vector::<E, N>::new(E::from_int(0));
        if v < len && row < seq {
            x = src[((b * seq + row) * row_stride + col0) / n + v % per_row];
        }
        values[k] = x;
    }
}

/// Stores what [`read_rows`] read (the same `head_dim`, `tile` and
/// `units`) into `dst`, row-major, rows `stride` elements apart
/// (`head_dim`, or more for rows padded against bank conflicts).
#[cube]
#[allow(clippy::manual_div_ceil)]
pub(super) fn write_rows<E: Float, N: Size>(
    values: &Array<Vector<E, N>>,
    dst: &mut Shared<[E]>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    let n = values[0].vector_size().comptime();
    let per_row = comptime!(head_dim / n);
    let len = comptime!(tile * per_row);
    #[unroll]
    for k in 0..comptime!((len + units - 1) / units) {
        let v = unit + k * units;
        if v < len {
            let x = values[k];
            let at = (v / per_row) * stride + (v % per_row) * n;
            #[unroll]
            for i in 0..n {
                dst[at + i] = x.extract(i);
            }
        }
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

/// The `step`-th `tile × tile` block of columns of a row-major `tile ×
/// head_dim` tile at `off` in `s`, as the matrix unit's left operand, or
/// (`right`) read column-major as the right operand of a product with the
/// tile's transpose (`A·Bᵀ`).
#[cube]
fn block<E: Float>(
    s: &Shared<[E]>,
    off: usize,
    step: usize,
    #[comptime] right: bool,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
) -> Matrix<E> {
    let ident = comptime!(if right {
        MatrixIdent::B
    } else {
        MatrixIdent::A
    });
    let layout = comptime!(if right {
        MatrixLayout::ColMajor
    } else {
        MatrixLayout::RowMajor
    });
    fragment::<E>(
        ident,
        layout,
        &s[off + step * tile..off + tile * head_dim],
        head_dim as u32,
        tile,
    )
}

/// `out = A·Bᵀ` (`tile × tile`, f32) of two row-major `tile × head_dim`
/// tiles on the matrix unit: the scores `Q·Kᵀ`, or `dO·Vᵀ`. `Bᵀ` is `B`
/// read column-major. `A` starts at `a_off` in `a`, `B` at `b_off` in
/// `b`, the result at `out_off` in `out` (a plane's part of a cube's
/// tiles), its rows `out_stride` apart. With `a_held` (`b_held`), `A`'s
/// (`B`'s) fragments are `held_a` (`held_b`), in the plane's registers
/// ([`held_operands`]), instead of loaded from shared memory.
#[cube]
#[allow(clippy::too_many_arguments)]
fn product_abt<E: Float>(
    a: &Shared<[E]>,
    a_off: usize,
    held_a: &Sequence<Matrix<E>>,
    b: &Shared<[E]>,
    b_off: usize,
    held_b: &Sequence<Matrix<E>>,
    out: &mut Shared<[f32]>,
    out_off: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] out_stride: usize,
    #[comptime] a_held: bool,
    #[comptime] b_held: bool,
) {
    let acc = Matrix::<f32>::from_value(
        MatrixIdent::Accumulator,
        tile,
        tile,
        tile,
        MatrixLayout::Undefined,
        f32::new(0.0),
    );
    #[unroll]
    for step in 0..head_dim / tile {
        if comptime!(a_held) {
            let rhs = block(b, b_off, step, true, head_dim, tile);
            cmma::execute(held_a.index(step), &rhs, &acc, &acc);
        } else if comptime!(b_held) {
            let lhs = block(a, a_off, step, false, head_dim, tile);
            cmma::execute(&lhs, held_b.index(step), &acc, &acc);
        } else {
            let lhs = block(a, a_off, step, false, head_dim, tile);
            let rhs = block(b, b_off, step, true, head_dim, tile);
            cmma::execute(&lhs, &rhs, &acc, &acc);
        }
    }
    cmma::store(
        &mut out[out_off..out_off + (tile - 1) * out_stride + tile],
        &acc,
        out_stride as u32,
        MatrixLayout::RowMajor,
    );
}

/// The `count` fragments of a row-major `tile × head_dim` tile at `off` in
/// `s` as the matrix unit's operands, to keep in the plane's registers:
/// as left operands (`A`), or (`right`) as the right operands of a product
/// with the tile's transpose (`B`, read column-major). `count` is
/// `head_dim / tile`, or 0 for none.
#[cube]
fn held_operands<E: Float>(
    s: &Shared<[E]>,
    off: usize,
    #[comptime] right: bool,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] count: usize,
) -> Sequence<Matrix<E>> {
    let mut out = Sequence::new();
    #[unroll]
    for step in 0..count {
        out.push(block(s, off, step, right, head_dim, tile));
    }
    out
}

/// The `tile × tile` left operand at `a_off` in `a`, row-major with rows
/// `stride` apart (with `transposed`, read column-major: its transpose):
/// `P`, `dS`, `Pᵀ`, `dSᵀ`.
#[cube]
fn square_operand<E: Float>(
    a: &Shared<[E]>,
    a_off: usize,
    #[comptime] transposed: bool,
    #[comptime] tile: usize,
    #[comptime] stride: usize,
) -> Matrix<E> {
    let layout = comptime!(if transposed {
        MatrixLayout::ColMajor
    } else {
        MatrixLayout::RowMajor
    });
    fragment::<E>(
        MatrixIdent::A,
        layout,
        &a[a_off..a_off + (tile - 1) * stride + tile],
        stride as u32,
        tile,
    )
}

/// The `step`-th `tile × tile` block of columns of a row-major `tile ×
/// head_dim` right operand at `base` in `b`: `V`, `K`, `dO`, `Q`.
#[cube]
fn column_block<E: Float>(
    b: &Shared<[E]>,
    #[comptime] base: usize,
    #[comptime] step: usize,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
) -> Matrix<E> {
    fragment::<E>(
        MatrixIdent::B,
        MatrixLayout::RowMajor,
        &b[base + step * tile..base + tile * head_dim],
        head_dim as u32,
        tile,
    )
}

/// `head_dim / tile` accumulators of the matrix unit (f32, zeros): a
/// `tile × head_dim` tile of sums kept in the plane's registers.
#[cube]
fn accumulators(#[comptime] head_dim: usize, #[comptime] tile: usize) -> Sequence<Matrix<f32>> {
    let mut sums = Sequence::new();
    #[unroll]
    for _ in 0..head_dim / tile {
        sums.push(Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            tile,
            tile,
            tile,
            MatrixLayout::Undefined,
            f32::new(0.0),
        ));
    }
    sums
}

/// `sums += Σ A_s·B_s` over `subs` pairs on the matrix unit, the sums in
/// registers ([`accumulators`]): `A_s` the [`square_operand`] at `a_off +
/// s·sub_off` (rows `stride` apart; with `transposed` its transpose),
/// `B_s` the `s`-th row-major `tile × head_dim` tile of `b`. The forward
/// pass's `P·V`, the backward pass's `Pᵀ·dO`, `dSᵀ·Q`, `dS·K`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate_in<E: Float>(
    a: &Shared<[E]>,
    a_off: usize,
    b: &Shared<[E]>,
    sums: &Sequence<Matrix<f32>>,
    #[comptime] transposed: bool,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] subs: usize,
    #[comptime] sub_off: usize,
    #[comptime] stride: usize,
) {
    #[unroll]
    for sub in 0..subs {
        let lhs = square_operand(a, a_off + sub * sub_off, transposed, tile, stride);
        #[unroll]
        for step in 0..head_dim / tile {
            let rhs = column_block(b, comptime!(sub * tile * head_dim), step, head_dim, tile);
            let sum = sums.index(step);
            cmma::execute(&lhs, &rhs, sum, sum);
        }
    }
}

/// Writes a plane's register sums ([`accumulators`]) times `factor` (and
/// with `rowwise`, each row times its `row_scale[scale_off + row]`) to rows
/// `first..` (those before `seq`) of batch entry `b` in `dst`, each
/// `row_stride` apart, from column `col0`, through `stage` (`tile × tile`
/// f32 at `stage_off`, the plane's own) a fragment at a time.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_sums<E: Float>(
    sums: &Sequence<Matrix<f32>>,
    factor: f32,
    row_scale: &Shared<[f32]>,
    scale_off: usize,
    stage: &mut Shared<[f32]>,
    stage_off: usize,
    dst: &mut [E],
    b: usize,
    first: usize,
    seq: usize,
    row_stride: usize,
    col0: usize,
    #[comptime] rowwise: bool,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] plane: usize,
) {
    let lane = UNIT_POS_X as usize;
    #[unroll]
    for step in 0..head_dim / tile {
        cmma::store(
            &mut stage[stage_off..stage_off + tile * tile],
            sums.index(step),
            tile as u32,
            MatrixLayout::RowMajor,
        );
        sync_plane();
        let mut e = lane;
        while e < tile * tile {
            let r = e / tile;
            let row = first + r;
            if row < seq {
                let mut x = stage[stage_off + e] * factor;
                if rowwise {
                    x *= row_scale[scale_off + r];
                }
                dst[(b * seq + row) * row_stride + col0 + step * tile + e % tile] = E::cast_from(x);
            }
            e += plane;
        }
        sync_plane();
    }
}

/// Whether key `c` of the tile (key `j`), seen at all (`seen[c]`: in the
/// sequence and not padding), is seen by query `i` (in the sequence, and
/// with `causal` not before the key).
#[cube]
fn query_sees(
    seen: &Shared<[f32]>,
    c: usize,
    i: usize,
    j: usize,
    seq: usize,
    #[comptime] causal: bool,
) -> bool {
    let mut sees = i < seq && seen[c] != f32::new(0.0);
    if causal {
        sees = sees && j <= i;
    }
    sees
}

/// Whether key `j`, seen at all (`key_seen`: in the sequence and not
/// padding), is seen by query `i` (in the sequence, and with `causal` not
/// before the key): [`query_sees`] with the flag in a register. (Written
/// out there rather than through this: with the shared flag read first,
/// ptxas gave the forward kernel at 32 keys a step 134 registers instead
/// of 125, one cube a multiprocessor fewer.)
#[cube]
fn sees(key_seen: bool, i: usize, j: usize, seq: usize, #[comptime] causal: bool) -> bool {
    let mut sees = i < seq && key_seen;
    if causal {
        sees = sees && j <= i;
    }
    sees
}

/// How far above a row's reference maximum a score may be before the
/// forward kernel moves the reference (ln 256): FlashAttention-4's lazy
/// rescaling. The probabilities are `exp(score − reference)`, so they stay
/// below 256 (well inside f16's and bf16's range, summed in f32), and the
/// sums in the plane's registers are rescaled only when some row's
/// reference moves — on the first key tiles mostly, rarely after. The
/// result is the same up to rounding: the output divides by a sum taken
/// against the same reference, and the log-sum-exp adds it back.
const RESCALE_MARGIN: f32 = 5.545_177;

#[cube(launch)]
// (`div_ceil` is not a CubeCL operation: the key tiles are counted by hand.)
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn flash_attention_kernel<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    out: &mut [E],
    lse: &mut [f32],
    seq: usize,
    heads: usize,
    scale: f32,
    mask: Mask,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] plane: usize,
    #[comptime] planes: usize,
    #[comptime] parts: usize,
    #[comptime] subs: usize,
    #[comptime] causal: bool,
    #[comptime] rotate: bool,
    #[comptime] dropout: bool,
    #[define(E)] _dtype: ElemType,
) {
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    // The mask seed's keys, after the padding flags (with dropout).
    let mask_keys = seed_keys(pad, dropout);
    let unit = UNIT_POS as usize;
    // The cube's units, its rows (a `tile` of queries a plane), and this
    // plane's.
    let units = comptime!(plane * planes);
    // The elements a vector of `qkv` (and `grad`) holds.
    let vec = qkv.vector_size().comptime();
    let rows = comptime!(tile * planes);
    // The keys a step: `subs` tiles of them.
    let step_keys = comptime!(tile * subs);
    let cols = comptime!(step_keys / parts);
    // (A plane is a row of the cube, as CubeCL's own matrix kernels
    // arrange theirs.)
    let warp = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let width = heads * head_dim;
    let block = CUBE_POS_X as usize * rows;
    let q_start = block + warp * tile;
    let tile_elems = tile * head_dim;
    let mine = warp * tile_elems;
    let my_rows = warp * tile;
    // Each plane's part of `ss`: its scores (`tile × step_keys`, rows
    // `step_keys` apart), and once they are read the stage its sums pass
    // through to be rescaled (`tile × head_dim`).
    let region = comptime!(
        tile * if step_keys > head_dim {
            step_keys
        } else {
            head_dim
        }
    );
    let my_scores = warp * region;
    let region_end = my_scores + region;

    let mut sq = tile_memory::<E>(comptime!(rows * head_dim));
    let mut sk = tile_memory::<E>(comptime!(step_keys * head_dim));
    let mut sv = tile_memory::<E>(comptime!(step_keys * head_dim));
    let mut seen = Shared::<[f32]>::new_slice(step_keys);
    let mut ss = tile_memory::<f32>(comptime!(planes * region));
    let mut sp = tile_memory::<E>(comptime!(rows * step_keys));
    let mut row_max = Shared::<[f32]>::new_slice(rows);
    let mut row_sum = Shared::<[f32]>::new_slice(rows);
    let mut row_factor = Shared::<[f32]>::new_slice(rows);
    let mut part_max = Shared::<[f32]>::new_slice(comptime!(rows * parts));
    let mut part_sum = Shared::<[f32]>::new_slice(comptime!(rows * parts));
    // Whether some row of a plane moved its reference at this key tile.
    let mut rescale = Shared::<[u32]>::new_slice(planes);

    // The cube's queries (zeros past the end) and the rows' statistics.
    let mut read =
        Array::<Vector<E, N>>::new(comptime!((rows * head_dim / vec + units - 1) / units));
    read_rows(
        qkv,
        &mut read,
        b,
        block,
        seq,
        3 * width,
        h * head_dim,
        head_dim,
        rows,
        units,
    );
    write_rows(&read, &mut sq, head_dim, head_dim, rows, units);
    let mut r = unit;
    while r < rows {
        row_max[r] = f32::new(LOWEST);
        row_sum[r] = f32::new(0.0);
        r += units;
    }
    sync_cube();
    // This plane's queries as the matrix unit's left operands and its sums
    // O, both in the plane's registers for the whole walk.
    let queries = held_operands(&sq, mine, false, head_dim, tile, comptime!(head_dim / tile));
    let mut o = accumulators(head_dim, tile);

    // With `causal`, no key after the cube's last query.
    let mut keys = seq;
    if causal && block + rows < seq {
        keys = block + rows;
    }
    let key_steps = (keys + step_keys - 1) / step_keys;
    let mut next = staged::<E, N>(head_dim, step_keys, units, vec);
    read_keys(
        qkv, pad, &mut next, b, h, heads, 0, seq, head_dim, step_keys, units,
    );
    for k_step in 0..key_steps {
        let k_start = k_step * step_keys;
        // (Every plane is done with the previous keys and values.)
        sync_cube();
        write_keys(
            &next, &mut sk, &mut sv, &mut seen, head_dim, head_dim, step_keys, units,
        );
        if lane == 0 {
            rescale[warp] = 0;
        }
        sync_cube();
        // The next step's keys and values, in flight while this one is
        // computed.
        if k_step + 1 < key_steps {
            read_keys(
                qkv,
                pad,
                &mut next,
                b,
                h,
                heads,
                k_start + step_keys,
                seq,
                head_dim,
                step_keys,
                units,
            );
        }
        // From here on each plane works on its own rows, meeting only its
        // own units (a plane's barrier: a warp's on CUDA; every plane
        // reaches every one of them, as lavapipe's Vulkan wants). With
        // `causal`, a plane whose queries all come before the step's keys
        // has no product to take (the cube's other planes may): its rows
        // see none of the keys, so the softmax leaves them as they are.
        let mut visible = true;
        if causal {
            visible = k_start < q_start + tile;
        }
        if visible {
            // The plane's scores, a key tile at a time.
            #[unroll]
            for sub in 0..subs {
                product_abt(
                    &sq,
                    mine,
                    &queries,
                    &sk,
                    sub * tile_elems,
                    &queries,
                    &mut ss,
                    my_scores + sub * tile,
                    head_dim,
                    tile,
                    step_keys,
                    true,
                    false,
                );
            }
        }
        sync_plane();

        // The online softmax, `parts` units a query row, `cols` keys each:
        // the parts' maxima; then, each part from the row's, the row's
        // reference (moved only past `RESCALE_MARGIN`), the probabilities
        // and the parts' sums; then the row's reference, sum and factor.
        let mut idx = lane;
        while idx < tile * parts {
            let r = idx / parts;
            let first = (idx % parts) * cols;
            let i = q_start + r;
            let mut m = f32::new(LOWEST);
            for cc in 0..cols {
                let c = first + softmax_column(cc, r, step_keys, cols, rotate);
                if query_sees(&seen, c, i, k_start + c, seq, causal) {
                    m = max(m, ss[my_scores + r * step_keys + c] * scale);
                }
            }
            part_max[(my_rows + r) * parts + idx % parts] = m;
            idx += plane;
        }
        sync_plane();
        let mut idx = lane;
        while idx < tile * parts {
            let r = idx / parts;
            let row = my_rows + r;
            let first = (idx % parts) * cols;
            let i = q_start + r;
            let reference = moved_reference(&part_max, &row_max, row, parts);
            let mut sum = f32::new(0.0);
            for cc in 0..cols {
                let c = first + softmax_column(cc, r, step_keys, cols, rotate);
                let mut p = f32::new(0.0);
                // What weighs the values: the probability dropped out
                // (the sum is of all of them).
                let mut weight = f32::new(0.0);
                if query_sees(&seen, c, i, k_start + c, seq, causal) {
                    p = (ss[my_scores + r * step_keys + c] * scale - reference).exp();
                    weight = p;
                    if dropout {
                        let query_row = ((b * heads + h) * seq + i) as u32;
                        weight = p * kept(
                            &mask_keys,
                            &mask,
                            query_row,
                            seq as u32,
                            (k_start + c) as u32,
                        );
                    }
                }
                sum += p;
                sp[row * step_keys + c] = E::cast_from(weight);
            }
            part_sum[row * parts + idx % parts] = sum;
            idx += plane;
        }
        sync_plane();
        let mut r = lane;
        while r < tile {
            let row = my_rows + r;
            let old = row_max[row];
            let reference = moved_reference(&part_max, &row_max, row, parts);
            let mut sum = part_sum[row * parts];
            for q in 1..parts {
                sum += part_sum[row * parts + q];
            }
            let factor = (old - reference).exp();
            row_max[row] = reference;
            row_sum[row] = row_sum[row] * factor + sum;
            row_factor[row] = factor;
            // (Before its first seen key a row's sums are zeros.)
            if old != reference && old != f32::new(LOWEST) {
                rescale[warp] = 1;
            }
            r += plane;
        }
        sync_plane();

        // O = O·factor + P·V: where some row's reference moved, O through
        // the plane's stage (its scores are read: P is in `sp`), rescaled
        // row by row.
        let rescaling = rescale[warp] != 0;
        if rescaling {
            #[unroll]
            for step in 0..head_dim / tile {
                cmma::store(
                    &mut ss[my_scores + step * tile..region_end],
                    o.index(step),
                    head_dim as u32,
                    MatrixLayout::RowMajor,
                );
            }
        }
        sync_plane();
        if rescaling {
            let mut e = lane;
            while e < tile * head_dim {
                ss[my_scores + e] *= row_factor[my_rows + e / head_dim];
                e += plane;
            }
        }
        sync_plane();
        if rescaling {
            #[unroll]
            for step in 0..head_dim / tile {
                cmma::load_with_layout(
                    o.index_mut(step),
                    &ss[my_scores + step * tile..region_end],
                    head_dim as u32,
                    MatrixLayout::RowMajor,
                );
            }
        }
        if visible {
            accumulate_in(
                &sp,
                my_rows * step_keys,
                &sv,
                &o,
                false,
                head_dim,
                tile,
                subs,
                tile,
                step_keys,
            );
        }
    }

    // The merged heads (`O / sum`, zeros for a query that sees no key) and
    // the log-sum-exp, as the scalar kernel writes them.
    let mut r = lane;
    while r < tile {
        let i = q_start + r;
        let sum = row_sum[my_rows + r];
        let mut inverse = f32::new(0.0);
        let mut l = f32::new(0.0);
        if sum > f32::new(0.0) {
            inverse = f32::new(1.0) / sum;
            l = row_max[my_rows + r] + sum.ln();
        }
        row_factor[my_rows + r] = inverse;
        if i < seq {
            lse[(b * heads + h) * seq + i] = l;
        }
        r += plane;
    }
    sync_plane();
    write_sums(
        &o,
        f32::new(1.0),
        &row_factor,
        my_rows,
        &mut ss,
        my_scores,
        out,
        b,
        q_start,
        seq,
        width,
        h * head_dim,
        true,
        head_dim,
        tile,
        plane,
    );
}

/// The `cc`-th of a unit's `cols` keys in its part of row `r`'s scores
/// (`step_keys` a row, f32). In order, the 32 units of a warp reading
/// their `cc`-th key together are `cols` floats apart (two a row of 16
/// keys on CUDA: 8-way conflicts in shared memory's 32 banks); with
/// `rotate`, each row starts its walk `r · step_keys / 32` keys on
/// (mod `cols`), which puts the units of a read in distinct banks on
/// CUDA's 16-row tiles and 32-unit warps (the probabilities' bf16 writes
/// too). The same keys either way: the maximum is the same, the sum adds
/// them in another order. `FLASH_ROTATE=0` keeps the order (an
/// experiment for the GPU check to time).
#[cube]
fn softmax_column(
    cc: usize,
    r: usize,
    #[comptime] step_keys: usize,
    #[comptime] cols: usize,
    #[comptime] rotate: bool,
) -> usize {
    let mut c = cc;
    if comptime!(rotate) {
        c = (cc + r * step_keys / 32) % cols;
    }
    c
}

/// A row's reference maximum after a key tile: the old one, or the tile's
/// maximum (the parts' in `part_max`) where that is more than
/// [`RESCALE_MARGIN`] above it.
#[cube]
fn moved_reference(
    part_max: &Shared<[f32]>,
    row_max: &Shared<[f32]>,
    row: usize,
    #[comptime] parts: usize,
) -> f32 {
    let old = row_max[row];
    let mut m = part_max[row * parts];
    for q in 1..parts {
        m = max(m, part_max[row * parts + q]);
    }
    let mut reference = old;
    if m > old + f32::new(RESCALE_MARGIN) {
        reference = m;
    }
    reference
}

/// One step's tile of `n` rows of one head in a unit's registers, read
/// ahead of the step that uses it so that its loads are in flight while
/// the cube computes the step before ([`read_keys`] and [`write_keys`],
/// [`read_queries`] and [`write_queries`]): a pair of row tiles (keys
/// and values, or queries and their output gradient) and each row's
/// figures (a key's flag, or a query's log-sum-exp and `delta`).
#[derive(CubeType)]
pub(super) struct Staged<E: Float, N: Size> {
    first: Array<Vector<E, N>>,
    second: Array<Vector<E, N>>,
    stats: Array<f32>,
}

/// Registers for a [`Staged`] tile of `n` rows `head_dim` wide over
/// `units` units, in vectors of `vec` elements.
#[cube]
#[allow(clippy::manual_div_ceil)]
pub(super) fn staged<E: Float, N: Size>(
    #[comptime] head_dim: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
    #[comptime] vec: usize,
) -> Staged<E, N> {
    Staged::<E, N> {
        first: Array::<Vector<E, N>>::new(comptime!((n * head_dim / vec + units - 1) / units)),
        second: Array::<Vector<E, N>>::new(comptime!((n * head_dim / vec + units - 1) / units)),
        stats: Array::<f32>::new(comptime!(2 * ((n + units - 1) / units))),
    }
}

/// Reads `n` query rows from `q_start` of head `h` into `tile` (zeros past
/// the end): the queries, their output gradient, log-sum-exp and `delta`.
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn read_queries<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    tile: &mut Staged<E, N>,
    b: usize,
    h: usize,
    heads: usize,
    q_start: usize,
    seq: usize,
    #[comptime] head_dim: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
) {
    let width = heads * head_dim;
    let q0 = h * head_dim;
    let (queries, gradients) = (&mut tile.first, &mut tile.second);
    read_rows(
        qkv,
        queries,
        b,
        q_start,
        seq,
        3 * width,
        q0,
        head_dim,
        n,
        units,
    );
    read_rows(
        grad, gradients, b, q_start, seq, width, q0, head_dim, n, units,
    );
    let row0 = (b * heads + h) * seq + q_start;
    #[unroll]
    for k in 0..comptime!((n + units - 1) / units) {
        let r = UNIT_POS as usize + k * units;
        let mut l = f32::new(0.0);
        let mut d = f32::new(0.0);
        if r < n && q_start + r < seq {
            l = lse[row0 + r];
            d = delta[row0 + r];
        }
        tile.stats[2 * k] = l;
        tile.stats[2 * k + 1] = d;
    }
}

/// Stores a tile [`read_queries`] read, rows `stride` elements apart.
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn write_queries<E: Float, N: Size>(
    tile: &Staged<E, N>,
    sq: &mut Shared<[E]>,
    sdo: &mut Shared<[E]>,
    slse: &mut Shared<[f32]>,
    sdelta: &mut Shared<[f32]>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
) {
    write_rows(&tile.first, sq, head_dim, stride, n, units);
    write_rows(&tile.second, sdo, head_dim, stride, n, units);
    #[unroll]
    for k in 0..comptime!((n + units - 1) / units) {
        let r = UNIT_POS as usize + k * units;
        if r < n {
            slse[r] = tile.stats[2 * k];
            sdelta[r] = tile.stats[2 * k + 1];
        }
    }
}

/// Reads `n` key rows from `k_start` of head `h` into `tile` (zeros past
/// the end): the keys, the values, and each key's flag (1 where it is in
/// the sequence and not padding).
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub(super) fn read_keys<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    tile: &mut Staged<E, N>,
    b: usize,
    h: usize,
    heads: usize,
    k_start: usize,
    seq: usize,
    #[comptime] head_dim: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
) {
    let width = heads * head_dim;
    let k0 = width + h * head_dim;
    let (keys, values) = (&mut tile.first, &mut tile.second);
    read_rows(
        qkv,
        keys,
        b,
        k_start,
        seq,
        3 * width,
        k0,
        head_dim,
        n,
        units,
    );
    read_rows(
        qkv,
        values,
        b,
        k_start,
        seq,
        3 * width,
        k0 + width,
        head_dim,
        n,
        units,
    );
    #[unroll]
    for k in 0..comptime!((n + units - 1) / units) {
        let c = UNIT_POS as usize + k * units;
        let j = k_start + c;
        let mut flag = f32::new(0.0);
        if c < n && j < seq && pad[b * seq + j] == f32::new(0.0) {
            flag = f32::new(1.0);
        }
        tile.stats[2 * k] = flag;
    }
}

/// Stores a tile [`read_keys`] read, rows `stride` elements apart.
#[cube]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub(super) fn write_keys<E: Float, N: Size>(
    tile: &Staged<E, N>,
    sk: &mut Shared<[E]>,
    sv: &mut Shared<[E]>,
    seen: &mut Shared<[f32]>,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
) {
    write_rows(&tile.first, sk, head_dim, stride, n, units);
    write_rows(&tile.second, sv, head_dim, stride, n, units);
    #[unroll]
    for k in 0..comptime!((n + units - 1) / units) {
        let c = UNIT_POS as usize + k * units;
        if c < n {
            seen[c] = tile.stats[2 * k];
        }
    }
}

/// The backward kernels' inner tile from row `start`: queries (with
/// `keys_outer`, [`read_queries`]) or keys ([`read_keys`]).
#[cube]
#[allow(clippy::too_many_arguments)]
fn read_inner<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    tile: &mut Staged<E, N>,
    b: usize,
    h: usize,
    heads: usize,
    start: usize,
    seq: usize,
    #[comptime] head_dim: usize,
    #[comptime] n: usize,
    #[comptime] units: usize,
    #[comptime] keys_outer: bool,
) {
    if keys_outer {
        read_queries(
            qkv, grad, lse, delta, tile, b, h, heads, start, seq, head_dim, n, units,
        );
    } else {
        read_keys(qkv, pad, tile, b, h, heads, start, seq, head_dim, n, units);
    }
}

/// The backward pass's products, one cube per `planes` tiles of rows of
/// one head (a tile each plane). With `keys_outer`, the rows are keys:
/// over the query tiles that see them (loaded once for all the planes),
/// `dV += Pᵀ·dO` and `dK += dSᵀ·Q`. Without, queries: over the key tiles
/// they see (loaded once for all the planes), `dQ += dS·K`. Each plane's
/// pair of tiles: `S = Q·Kᵀ` and `dP = dO·Vᵀ` on the matrix unit, then per
/// element `P = exp(scale·S − lse)` (0 where the query does not see the
/// key) and `dS = P·(dP − delta)`. Each writes its part of `dqkv`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn flash_backward_kernel<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    dqkv: &mut [E],
    seq: usize,
    heads: usize,
    scale: f32,
    mask: Mask,
    #[comptime] head_dim: usize,
    #[comptime] tile: usize,
    #[comptime] plane: usize,
    #[comptime] planes: usize,
    #[comptime] subs: usize,
    #[comptime] causal: bool,
    #[comptime] keys_outer: bool,
    #[comptime] hold: bool,
    #[comptime] dropout: bool,
    #[define(E)] _dtype: ElemType,
) {
    let h = CUBE_POS_Y as usize;
    let b = CUBE_POS_Z as usize;
    // The mask seed's keys, after the padding flags (with dropout).
    let mask_keys = seed_keys(pad, dropout);
    let warp = UNIT_POS_Y as usize;
    let lane = UNIT_POS_X as usize;
    let units = comptime!(plane * planes);
    // The elements a vector of `qkv` (and `grad`) holds.
    let vec = qkv.vector_size().comptime();
    let rows = comptime!(tile * planes);
    // The inner rows a step: `subs` tiles of them.
    let inner_rows = comptime!(tile * subs);
    let q_rows = comptime!(if keys_outer { inner_rows } else { rows });
    let k_rows = comptime!(if keys_outer { rows } else { inner_rows });
    // A plane's scores (queries × keys): with `keys_outer` the inner
    // tiles' blocks one under another (`inner_rows × tile`), else side by
    // side (`tile × inner_rows`); where each block starts and the rows'
    // stride.
    let sub_off = comptime!(if keys_outer { tile * tile } else { tile });
    let stride = comptime!(if keys_outer { tile } else { inner_rows });
    // Where an inner tile's rows start among the queries or keys loaded.
    let q_step = comptime!(if keys_outer { tile * head_dim } else { 0 });
    let k_step = comptime!(if keys_outer { 0 } else { tile * head_dim });
    let width = heads * head_dim;
    let start = CUBE_POS_X as usize * rows;
    let mine = warp * tile * head_dim;
    let my_scores = warp * tile * inner_rows;
    let my_start = start + warp * tile;

    let mut sq = tile_memory::<E>(comptime!(q_rows * head_dim));
    let mut sdo = tile_memory::<E>(comptime!(q_rows * head_dim));
    let mut slse = Shared::<[f32]>::new_slice(q_rows);
    let mut sdelta = Shared::<[f32]>::new_slice(q_rows);
    let mut sk = tile_memory::<E>(comptime!(k_rows * head_dim));
    let mut sv = tile_memory::<E>(comptime!(k_rows * head_dim));
    // In the dK/dV kernel each unit of a plane meets the same one of the
    // plane's keys at every step where the plane is a whole number of
    // tiles wide (NVIDIA's 32-unit warps and 16-row tiles; lavapipe's 8 and
    // 8): the unit keeps whether its key is seen in a register, and the
    // cube no flags in shared memory (256 bytes less: three cubes a
    // multiprocessor instead of two on an RTX 4090's 100 KiB).
    let unit_flags = comptime!(keys_outer && plane.is_multiple_of(tile));
    let mut seen = Shared::<[f32]>::new_slice(comptime!(if unit_flags { 1 } else { k_rows }));
    let mut key_seen = false;
    if comptime!(unit_flags) {
        let key = my_start + lane % tile;
        if key < seq {
            key_seen = pad[b * seq + key] == f32::new(0.0);
        }
    }
    let mut ss = tile_memory::<f32>(comptime!(rows * inner_rows));
    let mut sdp = tile_memory::<f32>(comptime!(rows * inner_rows));
    // (`P` rounded is the left operand of dK/dV's `Pᵀ·dO` only: the dQ
    // kernel takes none of it, and its shared memory is what bounds its
    // cubes a multiprocessor.)
    let mut sp = tile_memory::<E>(comptime!(if keys_outer { rows * inner_rows } else { 1 }));
    let mut sds = tile_memory::<E>(comptime!(rows * inner_rows));
    // dK (or dQ), and dV (dK/dV only): each plane's rows, in its
    // registers (nothing rescales them, unlike the forward pass's O).
    let acc = accumulators(head_dim, tile);
    let acc_v = accumulators(comptime!(if keys_outer { head_dim } else { 0 }), tile);

    // Where this plane's queries and keys are in the tiles, and the first
    // of the pair's each time (the outer rows' are this plane's).
    let mut q_off = 0;
    let mut k_off = 0;
    let mut q_row0 = 0;
    let mut k_row0 = 0;
    // Where the rows' gradient goes in `dqkv`: the keys' block (the values'
    // one `width` further) or the queries'.
    let mut col0 = h * head_dim;
    let mut inner_steps = (seq + inner_rows - 1) / inner_rows;
    let mut first = 0;
    if keys_outer {
        k_off = mine;
        k_row0 = warp * tile;
        col0 += width;
        // With `causal`, no query step before the one holding the cube's
        // first key.
        if causal {
            first = start / inner_rows;
        }
        let mut outer = staged::<E, N>(head_dim, rows, units, vec);
        read_keys(
            qkv, pad, &mut outer, b, h, heads, start, seq, head_dim, rows, units,
        );
        if comptime!(unit_flags) {
            write_rows(&outer.first, &mut sk, head_dim, head_dim, rows, units);
            write_rows(&outer.second, &mut sv, head_dim, head_dim, rows, units);
        } else {
            write_keys(
                &outer, &mut sk, &mut sv, &mut seen, head_dim, head_dim, rows, units,
            );
        }
    } else {
        q_off = mine;
        q_row0 = warp * tile;
        // With `causal`, no key after the cube's last query.
        if causal && start + rows < seq {
            inner_steps = (start + rows + inner_rows - 1) / inner_rows;
        }
        let mut outer = staged::<E, N>(head_dim, rows, units, vec);
        read_queries(
            qkv, grad, lse, delta, &mut outer, b, h, heads, start, seq, head_dim, rows, units,
        );
        write_queries(
            &outer,
            &mut sq,
            &mut sdo,
            &mut slse,
            &mut sdelta,
            head_dim,
            head_dim,
            rows,
            units,
        );
    }
    // With `hold`, the plane's own rows' operands of the two score
    // products (Q and dO as left operands in the dQ kernel, K and V as
    // right ones in dK/dV's) in its registers for the whole walk instead
    // of loaded from shared memory at every step.
    let held = comptime!(if hold { head_dim / tile } else { 0 });
    if comptime!(hold) {
        sync_cube();
    }
    let held_left = comptime!(if keys_outer { 0 } else { held });
    let held_right = comptime!(if keys_outer { held } else { 0 });
    let held_q = held_operands(&sq, q_off, false, head_dim, tile, held_left);
    let held_do = held_operands(&sdo, q_off, false, head_dim, tile, held_left);
    let held_k = held_operands(&sk, k_off, true, head_dim, tile, held_right);
    let held_v = held_operands(&sv, k_off, true, head_dim, tile, held_right);
    // The inner side's tiles, each read a step ahead: in flight while the
    // step before is computed.
    let mut next = staged::<E, N>(head_dim, inner_rows, units, vec);
    read_inner(
        qkv,
        pad,
        grad,
        lse,
        delta,
        &mut next,
        b,
        h,
        heads,
        first * inner_rows,
        seq,
        head_dim,
        inner_rows,
        units,
        keys_outer,
    );
    for inner in first..inner_steps {
        let inner_start = inner * inner_rows;
        // (The previous tile's products are done with these buffers.)
        sync_cube();
        let mut q_first = my_start;
        let mut k_first = inner_start;
        if keys_outer {
            q_first = inner_start;
            k_first = my_start;
            write_queries(
                &next,
                &mut sq,
                &mut sdo,
                &mut slse,
                &mut sdelta,
                head_dim,
                head_dim,
                inner_rows,
                units,
            );
        } else {
            write_keys(
                &next, &mut sk, &mut sv, &mut seen, head_dim, head_dim, inner_rows, units,
            );
        }
        sync_cube();
        if inner + 1 < inner_steps {
            read_inner(
                qkv,
                pad,
                grad,
                lse,
                delta,
                &mut next,
                b,
                h,
                heads,
                inner_start + inner_rows,
                seq,
                head_dim,
                inner_rows,
                units,
                keys_outer,
            );
        }
        // From here on each plane works on its own scores, meeting only
        // its own units (a plane's barrier: a warp's on CUDA; every plane
        // reaches every one, as lavapipe's Vulkan wants). With `causal`, a
        // plane none of whose queries sees a key of the pair has nothing to
        // add (the cube's other planes may).
        let mut visible = true;
        if causal {
            if keys_outer {
                visible = inner_start + inner_rows > my_start;
            } else {
                visible = inner_start < my_start + tile;
            }
        }
        if visible {
            #[unroll]
            for sub in 0..subs {
                let q_at = q_off + sub * q_step;
                let k_at = k_off + sub * k_step;
                let at = my_scores + sub * sub_off;
                product_abt(
                    &sq,
                    q_at,
                    &held_q,
                    &sk,
                    k_at,
                    &held_k,
                    &mut ss,
                    at,
                    head_dim,
                    tile,
                    stride,
                    comptime!(held_left > 0),
                    comptime!(held_right > 0),
                );
                product_abt(
                    &sdo,
                    q_at,
                    &held_do,
                    &sv,
                    k_at,
                    &held_v,
                    &mut sdp,
                    at,
                    head_dim,
                    tile,
                    stride,
                    comptime!(held_left > 0),
                    comptime!(held_right > 0),
                );
            }
        }
        sync_plane();
        if visible {
            let mut e = lane;
            while e < tile * inner_rows {
                let r = e / stride;
                let c = e % stride;
                let at = my_scores + e;
                let mut p = f32::new(0.0);
                let visible_pair = if comptime!(unit_flags) {
                    sees(key_seen, q_first + r, k_first + c, seq, causal)
                } else {
                    query_sees(&seen, k_row0 + c, q_first + r, k_first + c, seq, causal)
                };
                // With dropout, dV's `Pᵀ·dO` takes the probabilities that
                // weighed the values (dropped out), and dS the gradient
                // of those before the dropout (the mask's factor on dP).
                let mut factor = f32::new(1.0);
                if visible_pair {
                    p = (ss[at] * scale - slse[q_row0 + r]).exp();
                    if dropout {
                        let query_row = ((b * heads + h) * seq + q_first + r) as u32;
                        factor = kept(
                            &mask_keys,
                            &mask,
                            query_row,
                            seq as u32,
                            (k_first + c) as u32,
                        );
                    }
                }
                if comptime!(keys_outer) {
                    sp[at] = E::cast_from(p * factor);
                }
                sds[at] = E::cast_from(p * (sdp[at] * factor - sdelta[q_row0 + r]));
                e += plane;
            }
        }
        sync_plane();
        if visible {
            if keys_outer {
                accumulate_in(
                    &sp, my_scores, &sdo, &acc_v, true, head_dim, tile, subs, sub_off, stride,
                );
                accumulate_in(
                    &sds, my_scores, &sq, &acc, true, head_dim, tile, subs, sub_off, stride,
                );
            } else {
                accumulate_in(
                    &sds, my_scores, &sk, &acc, false, head_dim, tile, subs, sub_off, stride,
                );
            }
        }
    }
    sync_plane();

    // dK (scaled) and dV, or dQ (scaled), through each plane's scores'
    // buffer (`slse` unread: no row's own scale).
    write_sums(
        &acc,
        scale,
        &slse,
        0,
        &mut ss,
        my_scores,
        dqkv,
        b,
        my_start,
        seq,
        3 * width,
        col0,
        false,
        head_dim,
        tile,
        plane,
    );
    if keys_outer {
        write_sums(
            &acc_v,
            f32::new(1.0),
            &slse,
            0,
            &mut ss,
            my_scores,
            dqkv,
            b,
            my_start,
            seq,
            3 * width,
            col0 + width,
            false,
            head_dim,
            tile,
            plane,
        );
    }
}

/// Parts a query row takes in the forward kernel's softmax, each a unit's
/// share of the tile's keys: the plane's units spread over the tile's
/// rows (2 on NVIDIA's 32-unit warps and 16-row tiles), and at least two
/// wherever the tile allows, so that every device (lavapipe's 8-unit
/// subgroups in CI among them) runs the path that combines the parts;
/// at most one a key.
fn softmax_parts(tile: usize, plane: usize) -> usize {
    (plane / tile).max(2).min(tile)
}

/// The forward kernel's shared memory with `planes` planes a cube and
/// `subs` key tiles a step: their queries, the shared keys and values with
/// their flags, each plane's scores in f32 (also the stage its sums pass
/// through) and rounded, the rows' statistics and the planes' flags. (The
/// sums, O, are in the planes' registers.)
fn forward_shared_bytes(
    tile: usize,
    head_dim: usize,
    elem: usize,
    (planes, subs): (usize, usize),
    parts: usize,
) -> usize {
    let rows = tile * planes;
    let keys = tile * subs;
    rows * head_dim * elem
        + 2 * keys * head_dim * elem
        + 4 * keys
        + rows * keys.max(head_dim) * 4
        + rows * keys * elem
        + 4 * rows * (3 + 2 * parts)
        + 4 * planes
}

/// Inner rows the kernels take a step, as tiles: the keys of the forward
/// and dQ kernels, the queries of the dK/dV kernel. `FLASH_KEYS`
/// (rows, a multiple of the tile up to 8 tiles; an experiment for the GPU
/// check to time), else one tile.
fn inner_tiles(tile: usize) -> usize {
    static KEYS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| setting("FLASH_KEYS"))
        .filter(|&keys| keys.is_multiple_of(tile) && (tile..=8 * tile).contains(&keys))
        .map_or(1, |keys| keys / tile)
}

/// Whether the backward kernels keep their own rows' operands of the
/// score products in registers: `FLASH_HOLD=1` (an experiment for the GPU
/// check to time: fewer shared-memory loads a step, 32 more registers a
/// unit, so fewer cubes a multiprocessor; `kiln check-kernels --cuda-arch`
/// counts them). Off by default.
fn hold_operands() -> bool {
    static HOLD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HOLD.get_or_init(|| setting("FLASH_HOLD") == Some(1))
}

/// Whether the forward kernel's softmax walks each row's keys from a
/// rotated start ([`softmax_column`]): yes, unless `FLASH_ROTATE=0` (an
/// experiment for the GPU check to time against).
fn rotate_softmax() -> bool {
    static ROTATE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ROTATE.get_or_init(|| setting("FLASH_ROTATE") != Some(0))
}

/// The environment variable `name` as a number, or None: read once a
/// process by its caller (these are consulted at every launch).
fn setting(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.trim().parse().ok()
}

/// Shared memory a cube of these kernels may take: 48 KiB, or
/// `FLASH_SHARED_KIB` (an experiment for the GPU check to time: on
/// CUDA, CubeCL's kernels take their shared memory dynamically and opt in
/// to the device's maximum, 227 KiB on an H100, at the cost of fewer
/// cubes a multiprocessor); never more than the device's.
fn shared_budget(hardware: &cubecl::ir::HardwareProperties) -> usize {
    static KIB: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let kib = KIB
        .get_or_init(|| setting("FLASH_SHARED_KIB"))
        .filter(|&kib| kib > 0)
        .unwrap_or(48);
    (kib * 1024).min(hardware.max_shared_memory_size)
}

/// Planes a cube and inner tiles a step, for a kernel whose shared memory
/// is `bytes(planes, subs)`: each plane a `tile` of the cube's rows, all
/// sharing the inner rows the cube loads (FlashAttention-2's four warps a
/// block: a quarter of the loads a row). Four planes where the
/// [`shared_budget`] and the cube size allow and the sequence fills them,
/// else fewer; the inner tiles [`inner_tiles`] asks for, fewer where one
/// plane's memory would not fit them.
fn planes_and_steps(
    hardware: &cubecl::ir::HardwareProperties,
    (tile, plane): (usize, usize),
    seq: usize,
    bytes: impl Fn(usize, usize) -> usize,
) -> (usize, usize) {
    let budget = shared_budget(hardware);
    let fits = |planes: usize, subs: usize| bytes(planes, subs) <= budget;
    let mut subs = inner_tiles(tile);
    while subs > 1 && !fits(1, subs) {
        subs /= 2;
    }
    let units = hardware.max_units_per_cube as usize;
    let planes = [4, 2]
        .into_iter()
        .find(|&planes| {
            seq.div_ceil(tile) >= planes && planes * plane <= units && fits(planes, subs)
        })
        .unwrap_or(1);
    (planes, subs)
}

/// The elements a load of `qkv` (and of the output's gradient, its dtype)
/// takes at once: the widest vector the device loads (16 bytes on CUDA)
/// that divides the heads' width, so that a vector never straddles two
/// heads.
pub(super) fn vector_size(qkv: &CubeTensor, head_dim: usize) -> usize {
    qkv.client
        .io_optimized_vector_sizes(qkv.dtype.size())
        .filter(|&n| n > 0 && head_dim.is_multiple_of(n))
        .max()
        .unwrap_or(1)
}

/// The forward pass on the matrix unit where [`tile_for`] finds one: the
/// merged heads and the log-sum-exp (`[b, heads, t]`, f32), as the scalar
/// kernel's; `None` where it does not run. `qkv` and `pad` are contiguous.
pub(super) fn forward(
    qkv: &CubeTensor,
    pad: &CubeTensor,
    spec: AttentionSpec,
) -> Option<(CubeTensor, CubeTensor)> {
    let (heads, causal) = (spec.heads, spec.causal);
    let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
    let head_dim = three_width / 3 / heads;
    let dtype = qkv.dtype;
    let (tile, plane) = tile_for(&qkv.client, dtype, head_dim)?;
    let parts = softmax_parts(tile, plane);
    let hardware = &qkv.client.properties().hardware;
    let (planes, subs) = planes_and_steps(hardware, (tile, plane), seq, |planes, subs| {
        forward_shared_bytes(tile, head_dim, dtype.size(), (planes, subs), parts)
    });
    let rows = tile * planes;
    if !grid_fits(&qkv.client, seq.div_ceil(rows), heads, batch) {
        return None;
    }
    let out = empty(qkv, vec![batch, seq, heads * head_dim], dtype);
    let lse = empty(qkv, vec![batch, heads, seq], DType::F32);
    let cube_count = CubeCount::Static(seq.div_ceil(rows) as u32, heads as u32, batch as u32);
    flash_attention_kernel::launch(
        &qkv.client,
        cube_count,
        CubeDim::new_2d(plane as u32, planes as u32),
        vector_size(qkv, head_dim),
        qkv.clone().into_buffer_arg(),
        pad.clone().into_buffer_arg(),
        out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        seq,
        heads,
        (1.0 / (head_dim as f64).sqrt()) as f32,
        launch_mask(spec.dropout),
        head_dim,
        tile,
        plane,
        planes,
        parts,
        subs,
        causal,
        rotate_softmax(),
        spec.dropout.is_some(),
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
    spec: AttentionSpec,
) -> Option<CubeTensor> {
    let (heads, causal) = (spec.heads, spec.causal);
    let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
    let head_dim = three_width / 3 / heads;
    let dtype = qkv.dtype;
    let (tile, plane) = tile_for(&qkv.client, dtype, head_dim)?;
    // (The grid is widest with one plane a cube.)
    if !grid_fits(&qkv.client, seq.div_ceil(tile), heads, batch) {
        return None;
    }
    let dqkv = empty(qkv, qkv.meta.shape().to_vec(), dtype);
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    // dQ per query tile, then dK and dV per key tile.
    for keys_outer in [false, true] {
        let hardware = &qkv.client.properties().hardware;
        let (planes, subs) = planes_and_steps(hardware, (tile, plane), seq, |planes, subs| {
            backward_shared_bytes(tile, head_dim, dtype.size(), (planes, subs), keys_outer)
        });
        let rows = tile * planes;
        flash_backward_kernel::launch(
            &qkv.client,
            CubeCount::Static(seq.div_ceil(rows) as u32, heads as u32, batch as u32),
            CubeDim::new_2d(plane as u32, planes as u32),
            vector_size(qkv, head_dim),
            qkv.clone().into_buffer_arg(),
            pad.clone().into_buffer_arg(),
            grad.clone().into_buffer_arg(),
            lse.clone().into_buffer_arg(),
            delta.clone().into_buffer_arg(),
            dqkv.clone().into_buffer_arg(),
            seq,
            heads,
            scale,
            launch_mask(spec.dropout),
            head_dim,
            tile,
            plane,
            planes,
            subs,
            causal,
            keys_outer,
            hold_operands(),
            spec.dropout.is_some(),
            dtype_to_storage_type(dtype),
        );
    }
    Some(dqkv)
}

/// The three kernels as GPT-2 small runs them on an NVIDIA GPU in `dtype`
/// (heads 64 wide, causal, 16-row tiles, 32-unit warps, four planes a cube,
/// one tile a step), for `kiln check-kernels --cuda-arch`.
#[cfg(feature = "cuda")]
pub(super) fn offline_kernels(
    o: &super::offline::Offline,
    dtype: DType,
) -> super::offline::Kernels {
    use super::dropout::compilation;
    use super::offline::buffer;
    // GPT-2 small's heads and block, and CUDA's tile and warps.
    let (head_dim, seq, tile, plane, causal) = (64, 1024, 16, 32, true);
    let hardware = &o.props.hardware;
    // 16-byte loads of qkv, as on CUDA.
    let vec = 16 / dtype.size();
    let elem = dtype_to_storage_type(dtype);
    let parts = softmax_parts(tile, plane);
    // Planes a cube and inner tiles a step as a launch picks them
    // (`FLASH_KEYS`, `FLASH_SHARED_KIB` included), so that the variants
    // the GPU check times are compiled here too.
    let (planes, subs) = planes_and_steps(hardware, (tile, plane), seq, |planes, subs| {
        forward_shared_bytes(tile, head_dim, dtype.size(), (planes, subs), parts)
    });
    let mut kernels: super::offline::Kernels = Vec::new();
    // Without dropout, then with it on the probabilities (BERT's and
    // GPT-2's 0.1 in training: the mask hashed in the softmax's loop).
    for dropout in [false, true] {
        let with = if dropout { ", dropout" } else { "" };
        let forward = flash_attention_kernel::FlashAttentionKernel::new(
            o.settings(plane as u32, planes as u32),
            o.props.clone(),
            o.target.clone(),
            buffer(),
            buffer(),
            buffer(),
            buffer(),
            (),
            (),
            (),
            compilation(),
            // (The vector size, `N`, comes first among the compile-time
            // arguments.)
            vec,
            head_dim,
            tile,
            plane,
            planes,
            parts,
            subs,
            causal,
            rotate_softmax(),
            dropout,
            elem,
        );
        kernels.push((
            format!(
                "flash attention forward ({dtype:?}, heads {head_dim} wide, causal{with}, {} keys a step, {planes} warps)",
                tile * subs
            ),
            Box::new(forward),
        ));
        for (keys_outer, name, rows) in [(false, "dQ", "keys"), (true, "dK and dV", "queries")] {
            let (planes, subs) = planes_and_steps(hardware, (tile, plane), seq, |planes, subs| {
                backward_shared_bytes(tile, head_dim, dtype.size(), (planes, subs), keys_outer)
            });
            let backward = flash_backward_kernel::FlashBackwardKernel::new(
                o.settings(plane as u32, planes as u32),
                o.props.clone(),
                o.target.clone(),
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                buffer(),
                (),
                (),
                (),
                compilation(),
                vec,
                head_dim,
                tile,
                plane,
                planes,
                subs,
                causal,
                keys_outer,
                hold_operands(),
                dropout,
                elem,
            );
            kernels.push((
                format!(
                    "flash attention {name} ({dtype:?}, heads {head_dim} wide, causal{with}, {} {rows} a step, {planes} warps{})",
                    tile * subs,
                    if hold_operands() { ", operands held" } else { "" }
                ),
                Box::new(backward),
            ));
        }
    }
    kernels
}
