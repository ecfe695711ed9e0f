//! FlashAttention-2 as its authors wrote it for NVIDIA's tensor cores,
//! forward and backward: the scores, the softmax and the sums in each
//! warp's registers, through `mma.sync` with its register layout known
//! (CubeCL's manual MMA, `MmaDefinition`), where `flash_attention.rs`'s
//! kernels go through the opaque `cmma` fragments and so pass every
//! score through shared memory and their softmax through loops of units
//! over it. `FLASH_MMA=1` runs them (an experiment the GPU check
//! verifies with `kiln check-kernels` and times with `kiln bench
//! attention`); CUDA only (bf16 or f16, heads a multiple of 16 wide, 32-unit
//! warps): the manual MMA is CUDA's, and its layout HIP's differs.
//!
//! A warp owns 16 queries of one head, a cube four warps (64 queries,
//! their keys and values shared through shared memory: two cube-wide
//! barriers a step, as in the other kernel). For each step of
//! [`STEP_KEYS`] keys, a warp:
//!
//! 1. takes `S = Q·Kᵀ` (`m16n8k16`: the warp's 16 queries against 8 keys
//!    a product, over the head's width 16 at a time): each unit holds
//!    four scores of each 8-key block, two of row `g = lane / 4` and two
//!    of row `g + 8`, at keys `2·(lane % 4)` and the next;
//! 2. masks (only where the step needs it: a padded or missing key, or
//!    the causal diagonal), takes each row's maximum over its own eight
//!    blocks and then over the four units that share the row (two
//!    shuffles), moves the row's running maximum and rescales its sums O
//!    and its partial sum of probabilities by `exp(old − new)`;
//! 3. `P = exp(scale·S − max)`, in registers, rounded to the input dtype:
//!    two 8-key blocks of the accumulator's layout are exactly one
//!    16-key left operand of the next product, so P never leaves the
//!    registers;
//! 4. `O += P·V` (the values read transposed from shared memory by
//!    `ldmatrix.trans`).
//!
//! The queries' fragments are loaded once; the keys' and values' by
//! `ldmatrix` from rows padded by 16 bytes (no bank conflicts). It ends as
//! the other kernels do: `O / sum` (zeros for a query that sees no key)
//! and each query's log-sum-exp for the backward pass.
//!
//! The backward pass is two kernels, as `flash_attention.rs`'s (no
//! atomics), 64 rows of the other side a step and 16 at a time within
//! it, so that only 16 columns of scores are live at once (the
//! log-sum-exp is known: no row maximum to keep):
//!
//! - dQ, a warp per 16 queries: `S = Q·Kᵀ` and `dP = dO·Vᵀ`,
//!   `dS = P·(dP − delta)` with `P = exp(scale·S − lse)` in registers,
//!   `dQ += dS·K` with dS the left operand as it lies;
//! - dK and dV, a warp per 16 keys (its K and V held as left operands):
//!   the products transposed, `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, so that `Pᵀ`
//!   and `dSᵀ` come out as the left operands of `dV += Pᵀ·dO` and
//!   `dK += dSᵀ·Q`, each query's log-sum-exp and `delta` read by column.

use burn::tensor::DType;
use burn_backend::cubecl::{dtype_to_elem_type, dtype_to_storage_type};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::features::MmaConfig;
use cubecl::prelude::*;
use cubecl::{CubeCount, CubeDim};

use super::super::cube_empty as empty;
use super::flash_attention::{
    LOWEST, Staged, grid_fits, read_keys, read_queries, read_rows, staged, vector_size, write_keys,
    write_queries, write_rows,
};

/// Keys a step (a multiple of 16).
const STEP_KEYS: usize = 64;
/// Warps a cube.
const PLANES: usize = 4;
/// Queries a warp: the instruction's `m`.
const ROWS: usize = 16;
/// The units of a warp.
const WARP: usize = 32;
/// Elements each shared row is padded by (16 bytes of bf16 or f16), so
/// that the eight rows an `ldmatrix` reads start in distinct banks.
const PAD: usize = 8;

/// Which of these kernels `FLASH_MMA` asks for (none by default, until
/// the GPU check has verified and timed them): `1` all three, `forward`
/// or `backward` only those (for the GPU check to tell which disagrees,
/// where `1` does).
fn asked_for() -> (bool, bool) {
    static ASKED: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| sides(&std::env::var("FLASH_MMA").unwrap_or_default()))
}

/// The sides (forward, backward) a value of `FLASH_MMA` asks for.
fn sides(value: &str) -> (bool, bool) {
    match value.trim() {
        "1" => (true, true),
        "forward" => (true, false),
        "backward" => (false, true),
        _ => (false, false),
    }
}

/// Whether `FLASH_MMA` asks for the forward kernel ([`asked_for`]).
pub(crate) fn forward_asked() -> bool {
    asked_for().0
}

/// Whether `FLASH_MMA` asks for the backward kernels ([`asked_for`]).
pub(crate) fn backward_asked() -> bool {
    asked_for().1
}

/// Whether the kernel runs on `qkv`'s device for its dtype and heads
/// `head_dim` wide: CUDA (whose register layout the kernel is written
/// for; HIP's manual MMA lays its registers out otherwise), its
/// `mma.m16n8k16` with f32 sums for the dtype, `ldmatrix`, and 32-unit
/// warps.
fn runs(qkv: &CubeTensor, head_dim: usize) -> bool {
    runs_on(&qkv.device, &qkv.client, qkv.dtype, head_dim)
}

/// [`runs`] for `device` (its `client`), `dtype` and `head_dim`.
pub(crate) fn runs_on(
    device: &cubecl::Device,
    client: &cubecl::client::Client,
    dtype: DType,
    head_dim: usize,
) -> bool {
    #[cfg(feature = "cuda")]
    let cuda = matches!(device, cubecl::Device::Cuda(_));
    #[cfg(not(feature = "cuda"))]
    let cuda = {
        let _ = device;
        false
    };
    if !cuda || !matches!(dtype, DType::BF16 | DType::F16) || !head_dim.is_multiple_of(16) {
        return false;
    }
    let props = client.properties();
    let (elem, acc) = (dtype_to_elem_type(dtype), dtype_to_elem_type(DType::F32));
    props.hardware.plane_size_min == WARP as u32
        && props.hardware.plane_size_max == WARP as u32
        && props.features.matmul.ldmatrix.contains(&elem)
        && props.features.matmul.mma.contains(&MmaConfig {
            a_type: elem,
            b_type: elem,
            cd_type: acc,
            m: 16,
            n: 8,
            k: 16,
        })
        && shared_bytes(head_dim, dtype.size()) <= props.hardware.max_shared_memory_size
}

/// The kernel's shared memory: the cube's queries, one step's keys and
/// values (rows padded by [`PAD`]) and the keys' flags.
fn shared_bytes(head_dim: usize, elem: usize) -> usize {
    (PLANES * ROWS + 2 * STEP_KEYS) * (head_dim + PAD) * elem + 4 * STEP_KEYS
}

/// One 32-bit register of a fragment: two elements.
type Pair<T> = Vector<T, Const<2>>;

/// The forward pass (the module's doc): the merged heads into `out`, each
/// query's log-sum-exp into `lse`.
#[cube(launch)]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn flash_mma_forward_kernel<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    out: &mut [E],
    lse: &mut [f32],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[define(E)] _dtype: ElemType,
) {
    let units = comptime!(WARP * PLANES);
    let rows = comptime!(ROWS * PLANES);
    let stride = comptime!(head_dim + PAD);
    let vec = qkv.vector_size().comptime();
    let (h, b, block, warp, lane, g, t) = place();
    let width = heads * head_dim;
    let q_start = block + warp * ROWS;
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);

    let mut sq = Shared::<[E]>::new_aligned_slice(comptime!(rows * stride), 16usize);
    let mut sk = Shared::<[E]>::new_aligned_slice(comptime!(STEP_KEYS * stride), 16usize);
    let mut sv = Shared::<[E]>::new_aligned_slice(comptime!(STEP_KEYS * stride), 16usize);
    let mut seen = Shared::<[f32]>::new_slice(STEP_KEYS);

    // The cube's queries, then this warp's as left operands
    // ([`left_operands`]).
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
    write_rows(&read, &mut sq, head_dim, stride, rows, units);
    sync_cube();
    let queries = left_operands(&def, &sq, warp * ROWS, head_dim, stride);
    // O, 8 columns an accumulator (two registers: row g, row g + 8).
    let mut o = Sequence::<Array<Pair<f32>>>::new();
    #[unroll]
    for _ in 0..head_dim / 8 {
        o.push(zeros());
    }
    // Each of the unit's two rows: its running maximum (of scaled
    // scores; LOWEST before its first seen key) and the unit's share of
    // its sum of probabilities.
    let mut max_lo = f32::new(LOWEST);
    let mut max_hi = f32::new(LOWEST);
    let mut sum_lo = f32::new(0.0);
    let mut sum_hi = f32::new(0.0);
    let i_lo = q_start + g;
    let i_hi = i_lo + 8;

    // With `causal`, no key after the cube's last query.
    let mut keys = seq;
    if causal && block + rows < seq {
        keys = block + rows;
    }
    let key_steps = (keys + STEP_KEYS - 1) / STEP_KEYS;
    let mut next: Staged<E, N> = staged::<E, N>(head_dim, STEP_KEYS, units, vec);
    read_keys(
        qkv, pad, &mut next, b, h, heads, 0, seq, head_dim, STEP_KEYS, units,
    );
    for k_step in 0..key_steps {
        let k_start = k_step * STEP_KEYS;
        sync_cube();
        write_keys(
            &next, &mut sk, &mut sv, &mut seen, head_dim, stride, STEP_KEYS, units,
        );
        sync_cube();
        if k_step + 1 < key_steps {
            read_keys(
                qkv,
                pad,
                &mut next,
                b,
                h,
                heads,
                k_start + STEP_KEYS,
                seq,
                head_dim,
                STEP_KEYS,
                units,
            );
        }
        // Whether some key of the step is padding or past the end (each
        // unit looks at two flags, the warp answers together).
        let mut unseen = false;
        #[unroll]
        for k in 0..STEP_KEYS / WARP {
            unseen = unseen || seen[lane + k * WARP] == f32::new(0.0);
        }
        let unseen = plane_any(unseen);
        // With `causal`, a warp whose queries all come before the step's
        // keys has nothing to do; one whose first query comes before the
        // step's last key masks.
        let mut visible = true;
        let mut diagonal = false;
        if causal {
            visible = k_start < q_start + ROWS;
            diagonal = k_start + STEP_KEYS > q_start + 1;
        }
        if visible {
            // S = Q·Kᵀ, 8 keys an accumulator ([`transposed_product`]).
            let mut s = Sequence::<Array<Pair<f32>>>::new();
            #[unroll]
            for nt in 0..STEP_KEYS / 8 {
                s.push(transposed_product(
                    &def,
                    &queries,
                    &sk,
                    nt * 8,
                    head_dim,
                    stride,
                ));
            }
            // The masks, where the step has some: a key a query does not
            // see scores LOWEST.
            if unseen || diagonal {
                #[unroll]
                for nt in 0..STEP_KEYS / 8 {
                    let acc = s.index_mut(nt);
                    #[unroll]
                    for half in 0..2 {
                        let i = q_start + g + half * 8;
                        let mut pair = acc[half];
                        #[unroll]
                        for e in 0..2 {
                            let c = nt * 8 + 2 * t + e;
                            let mut sees = seen[c] != f32::new(0.0);
                            if causal {
                                sees = sees && k_start + c <= i;
                            }
                            if !sees {
                                pair.insert(e, f32::new(LOWEST));
                            }
                        }
                        acc[half] = pair;
                    }
                }
            }
            // Each row's maximum: the unit's eight blocks, then the four
            // units of the row.
            let mut top_lo = f32::new(LOWEST);
            let mut top_hi = f32::new(LOWEST);
            #[unroll]
            for nt in 0..STEP_KEYS / 8 {
                let acc = s.index(nt);
                top_lo = max(top_lo, max(acc[0].extract(0usize), acc[0].extract(1usize)));
                top_hi = max(top_hi, max(acc[1].extract(0usize), acc[1].extract(1usize)));
            }
            top_lo = max(top_lo, plane_shuffle_xor(top_lo, 1));
            top_lo = max(top_lo, plane_shuffle_xor(top_lo, 2));
            top_hi = max(top_hi, plane_shuffle_xor(top_hi, 1));
            top_hi = max(top_hi, plane_shuffle_xor(top_hi, 2));
            let (new_lo, factor_lo) = moved(max_lo, top_lo, scale);
            let (new_hi, factor_hi) = moved(max_hi, top_hi, scale);
            max_lo = new_lo;
            max_hi = new_hi;
            sum_lo *= factor_lo;
            sum_hi *= factor_hi;
            #[unroll]
            for dt in 0..head_dim / 8 {
                let acc = o.index_mut(dt);
                acc[0] *= Pair::<f32>::new(factor_lo);
                acc[1] *= Pair::<f32>::new(factor_hi);
            }
            // (Before a row's first seen key its reference is 0: its
            // masked scores' exponentials are then 0, not 1.)
            let ref_lo = select(max_lo == f32::new(LOWEST), f32::new(0.0), max_lo);
            let ref_hi = select(max_hi == f32::new(LOWEST), f32::new(0.0), max_hi);
            // P in place of the scores, and O += P·V 16 keys at a time:
            // accumulators 2·kb and 2·kb + 1 are the left operand
            // ([`left_of`]).
            #[unroll]
            for nt in 0..STEP_KEYS / 8 {
                let acc = s.index_mut(nt);
                let lo = probabilities(acc[0], scale, ref_lo);
                let hi = probabilities(acc[1], scale, ref_hi);
                sum_lo += lo.extract(0usize) + lo.extract(1usize);
                sum_hi += hi.extract(0usize) + hi.extract(1usize);
                acc[0] = lo;
                acc[1] = hi;
            }
            #[unroll]
            for kb in 0..STEP_KEYS / 16 {
                let p = left_of::<E>(s.index(2 * kb), s.index(2 * kb + 1));
                #[unroll]
                for dt in 0..head_dim / 8 {
                    // The values as the right operand, transposed on
                    // their way (`ldmatrix.x2.trans`: units 0–15 address
                    // the 16 keys' rows at the 8 columns).
                    let key = kb * 16 + lane % 16;
                    let v_frag = def.load_matrix::<E, Const<2>>(
                        &sv[key * stride + dt * 8..key * stride + dt * 8 + 8],
                        MatrixIdent::B,
                        2usize,
                        true,
                    );
                    def.execute_inplace(&p, &v_frag, o.index_mut(dt));
                }
            }
        }
    }

    // The rows' sums over their four units; O / sum (zeros for a query
    // that sees no key) and the log-sum-exp, as the other kernels write
    // them.
    sum_lo += plane_shuffle_xor(sum_lo, 1);
    sum_lo += plane_shuffle_xor(sum_lo, 2);
    sum_hi += plane_shuffle_xor(sum_hi, 1);
    sum_hi += plane_shuffle_xor(sum_hi, 2);
    let (inv_lo, lse_lo) = finish(sum_lo, max_lo);
    let (inv_hi, lse_hi) = finish(sum_hi, max_hi);
    let row0 = (b * heads + h) * seq;
    if t == 0 {
        if i_lo < seq {
            lse[row0 + i_lo] = lse_lo;
        }
        if i_hi < seq {
            lse[row0 + i_hi] = lse_hi;
        }
    }
    #[unroll]
    for dt in 0..head_dim / 8 {
        let acc = o.index(dt);
        let col = h * head_dim + dt * 8 + 2 * t;
        if i_lo < seq {
            let at = (b * seq + i_lo) * width + col;
            out[at] = E::cast_from(acc[0].extract(0usize) * inv_lo);
            out[at + 1] = E::cast_from(acc[0].extract(1usize) * inv_lo);
        }
        if i_hi < seq {
            let at = (b * seq + i_hi) * width + col;
            out[at] = E::cast_from(acc[1].extract(0usize) * inv_hi);
            out[at + 1] = E::cast_from(acc[1].extract(1usize) * inv_hi);
        }
    }
}

/// Rows a step of the backward kernels' walk (keys in dQ's, queries in
/// dK/dV's; a multiple of 16).
const STEP_ROWS: usize = 64;

/// The backward pass with the scores in each warp's registers: with
/// `keys_outer` dK and dV ([`dkdv_walk`]), else dQ ([`dq_walk`]), as
/// `flash_attention.rs`'s two launches of its backward kernel.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn flash_mma_backward_kernel<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    dqkv: &mut [E],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] keys_outer: bool,
    #[define(E)] _dtype: ElemType,
) {
    if comptime!(keys_outer) {
        dkdv_walk(
            qkv, pad, grad, lse, delta, dqkv, seq, heads, scale, head_dim, causal,
        );
    } else {
        dq_walk(
            qkv, pad, grad, lse, delta, dqkv, seq, heads, scale, head_dim, causal,
        );
    }
}

/// dQ with the scores in each warp's registers (`FLASH_MMA=1`): a warp
/// owns 16 queries, a cube four warps; over the key steps they see, 16
/// keys at a time, `S = Q·Kᵀ` and `dP = dO·Vᵀ` (two 8-key accumulators
/// each), `P = exp(scale·S − lse)` and `dS = P·(dP − delta)` in registers,
/// and `dQ += dS·K` with dS the left operand as it lies (the forward
/// kernel's P). Writes `scale · dQ`, as `flash_attention.rs`'s dQ.
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn dq_walk<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    dqkv: &mut [E],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
    let units = comptime!(WARP * PLANES);
    let rows = comptime!(ROWS * PLANES);
    let stride = comptime!(head_dim + PAD);
    let vec = qkv.vector_size().comptime();
    let (h, b, block, warp, lane, g, t) = place();
    let width = heads * head_dim;
    let q_start = block + warp * ROWS;
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);

    let mut sq = Shared::<[E]>::new_aligned_slice(comptime!(rows * stride), 16usize);
    let mut sdo = Shared::<[E]>::new_aligned_slice(comptime!(rows * stride), 16usize);
    let mut sk = Shared::<[E]>::new_aligned_slice(comptime!(STEP_ROWS * stride), 16usize);
    let mut sv = Shared::<[E]>::new_aligned_slice(comptime!(STEP_ROWS * stride), 16usize);
    let mut seen = Shared::<[f32]>::new_slice(STEP_ROWS);

    // The cube's queries and their output gradient, then this warp's as
    // left operands.
    let per_unit = comptime!((rows * head_dim / vec + units - 1) / units);
    let mut read_q = Array::<Vector<E, N>>::new(per_unit);
    let mut read_do = Array::<Vector<E, N>>::new(per_unit);
    read_rows(
        qkv,
        &mut read_q,
        b,
        block,
        seq,
        3 * width,
        h * head_dim,
        head_dim,
        rows,
        units,
    );
    read_rows(
        grad,
        &mut read_do,
        b,
        block,
        seq,
        width,
        h * head_dim,
        head_dim,
        rows,
        units,
    );
    write_rows(&read_q, &mut sq, head_dim, stride, rows, units);
    write_rows(&read_do, &mut sdo, head_dim, stride, rows, units);
    sync_cube();
    let queries = left_operands(&def, &sq, warp * ROWS, head_dim, stride);
    let gradients = left_operands(&def, &sdo, warp * ROWS, head_dim, stride);
    let i_lo = q_start + g;
    let i_hi = i_lo + 8;
    let row0 = (b * heads + h) * seq;
    let (lse_lo, delta_lo) = row_figures(lse, delta, row0, i_lo, seq);
    let (lse_hi, delta_hi) = row_figures(lse, delta, row0, i_hi, seq);
    let mut dq = Sequence::<Array<Pair<f32>>>::new();
    #[unroll]
    for _ in 0..head_dim / 8 {
        dq.push(zeros());
    }

    let mut keys = seq;
    if causal && block + rows < seq {
        keys = block + rows;
    }
    let key_steps = (keys + STEP_ROWS - 1) / STEP_ROWS;
    let mut next: Staged<E, N> = staged::<E, N>(head_dim, STEP_ROWS, units, vec);
    read_keys(
        qkv, pad, &mut next, b, h, heads, 0, seq, head_dim, STEP_ROWS, units,
    );
    for k_step in 0..key_steps {
        let k_start = k_step * STEP_ROWS;
        sync_cube();
        write_keys(
            &next, &mut sk, &mut sv, &mut seen, head_dim, stride, STEP_ROWS, units,
        );
        sync_cube();
        if k_step + 1 < key_steps {
            read_keys(
                qkv,
                pad,
                &mut next,
                b,
                h,
                heads,
                k_start + STEP_ROWS,
                seq,
                head_dim,
                STEP_ROWS,
                units,
            );
        }
        let mut unseen = false;
        #[unroll]
        for k in 0..STEP_ROWS / WARP {
            unseen = unseen || seen[lane + k * WARP] == f32::new(0.0);
        }
        let unseen = plane_any(unseen);
        let mut visible = true;
        let mut diagonal = false;
        if causal {
            visible = k_start < q_start + ROWS;
            diagonal = k_start + STEP_ROWS > q_start + 1;
        }
        let masked = unseen || diagonal;
        if visible {
            #[unroll]
            for kb in 0..STEP_ROWS / 16 {
                // dS for keys 16·kb…: two 8-key blocks.
                let mut ds = Sequence::<Array<Pair<f32>>>::new();
                #[unroll]
                for half in 0..2 {
                    let nt = 2 * kb + half;
                    let s = transposed_product(&def, &queries, &sk, nt * 8, head_dim, stride);
                    let dp = transposed_product(&def, &gradients, &sv, nt * 8, head_dim, stride);
                    let mut out = zeros();
                    #[unroll]
                    for r in 0..2 {
                        let i = i_lo + r * 8;
                        let (l, d) = if r == 0 {
                            (lse_lo, delta_lo)
                        } else {
                            (lse_hi, delta_hi)
                        };
                        let mut pair = out[r];
                        #[unroll]
                        for e in 0..2 {
                            let c = nt * 8 + 2 * t + e;
                            let mut sees = true;
                            if masked {
                                sees = seen[c] != f32::new(0.0);
                                if causal {
                                    sees = sees && k_start + c <= i;
                                }
                            }
                            let mut value = f32::new(0.0);
                            if sees {
                                let p = (s[r].extract(e) * scale - l).exp();
                                value = p * (dp[r].extract(e) - d);
                            }
                            pair.insert(e, value);
                        }
                        out[r] = pair;
                    }
                    ds.push(out);
                }
                let left = left_of(ds.index(0), ds.index(1));
                // dQ += dS·K: the keys as the right operand, transposed on
                // their way (`ldmatrix.x2.trans`).
                #[unroll]
                for dt in 0..head_dim / 8 {
                    let key = kb * 16 + lane % 16;
                    let k_frag = def.load_matrix::<E, Const<2>>(
                        &sk[key * stride + dt * 8..key * stride + dt * 8 + 8],
                        MatrixIdent::B,
                        2usize,
                        true,
                    );
                    def.execute_inplace(&left, &k_frag, dq.index_mut(dt));
                }
            }
        }
    }

    // scale · dQ into the queries' block of `dqkv`.
    #[unroll]
    for dt in 0..head_dim / 8 {
        let acc = dq.index(dt);
        let col = h * head_dim + dt * 8 + 2 * t;
        write_pair(
            dqkv,
            acc[0],
            scale,
            (b * seq + i_lo) * 3 * width + col,
            i_lo < seq,
        );
        write_pair(
            dqkv,
            acc[1],
            scale,
            (b * seq + i_hi) * 3 * width + col,
            i_hi < seq,
        );
    }
}

/// dK and dV with the scores in each warp's registers (`FLASH_MMA=1`): a
/// warp owns 16 keys (its K and V the left operands, in its registers),
/// a cube four warps; over the query steps that see them, 16 queries at a
/// time, the scores transposed, `Sᵀ = K·Qᵀ` and `dPᵀ = V·dOᵀ`, so that
/// `Pᵀ` and `dSᵀ` come out of the products as the left operands of
/// `dV += Pᵀ·dO` and `dK += dSᵀ·Q` (each query's log-sum-exp and `delta`
/// from shared memory, by column). Writes `scale · dK` and dV, as
/// `flash_attention.rs`'s dK/dV.
#[cube]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
fn dkdv_walk<E: Float, N: Size>(
    qkv: &[Vector<E, N>],
    pad: &[f32],
    grad: &[Vector<E, N>],
    lse: &[f32],
    delta: &[f32],
    dqkv: &mut [E],
    seq: usize,
    heads: usize,
    scale: f32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
) {
    let units = comptime!(WARP * PLANES);
    let rows = comptime!(ROWS * PLANES);
    let stride = comptime!(head_dim + PAD);
    let vec = qkv.vector_size().comptime();
    let (h, b, block, warp, lane, g, t) = place();
    let width = heads * head_dim;
    let k_first = block + warp * ROWS;
    let def = MmaDefinition::<E, E, f32>::new(16usize, 8usize, 16usize);

    let mut sk = Shared::<[E]>::new_aligned_slice(comptime!(rows * stride), 16usize);
    let mut sv = Shared::<[E]>::new_aligned_slice(comptime!(rows * stride), 16usize);
    let mut sq = Shared::<[E]>::new_aligned_slice(comptime!(STEP_ROWS * stride), 16usize);
    let mut sdo = Shared::<[E]>::new_aligned_slice(comptime!(STEP_ROWS * stride), 16usize);
    let mut slse = Shared::<[f32]>::new_slice(STEP_ROWS);
    let mut sdelta = Shared::<[f32]>::new_slice(STEP_ROWS);
    let mut flags = Shared::<[f32]>::new_slice(rows);

    // The cube's keys and values, then this warp's as left operands; each
    // of the unit's two keys: whether it is seen at all.
    let mut outer = staged::<E, N>(head_dim, rows, units, vec);
    read_keys(
        qkv, pad, &mut outer, b, h, heads, block, seq, head_dim, rows, units,
    );
    write_keys(
        &outer, &mut sk, &mut sv, &mut flags, head_dim, stride, rows, units,
    );
    sync_cube();
    let keys = left_operands(&def, &sk, warp * ROWS, head_dim, stride);
    let values = left_operands(&def, &sv, warp * ROWS, head_dim, stride);
    let j_lo = k_first + g;
    let j_hi = j_lo + 8;
    let seen_lo = flags[warp * ROWS + g] != f32::new(0.0);
    let seen_hi = flags[warp * ROWS + g + 8] != f32::new(0.0);
    let unseen = plane_any(!seen_lo || !seen_hi);
    let mut dk = Sequence::<Array<Pair<f32>>>::new();
    let mut dv = Sequence::<Array<Pair<f32>>>::new();
    #[unroll]
    for _ in 0..head_dim / 8 {
        dk.push(zeros());
        dv.push(zeros());
    }

    // With `causal`, no query step before the one holding the cube's first
    // key.
    let mut first = 0;
    if causal {
        first = block / STEP_ROWS;
    }
    let q_steps = (seq + STEP_ROWS - 1) / STEP_ROWS;
    let mut next: Staged<E, N> = staged::<E, N>(head_dim, STEP_ROWS, units, vec);
    read_queries(
        qkv,
        grad,
        lse,
        delta,
        &mut next,
        b,
        h,
        heads,
        first * STEP_ROWS,
        seq,
        head_dim,
        STEP_ROWS,
        units,
    );
    for q_step in first..q_steps {
        let q_start = q_step * STEP_ROWS;
        sync_cube();
        write_queries(
            &next,
            &mut sq,
            &mut sdo,
            &mut slse,
            &mut sdelta,
            head_dim,
            stride,
            STEP_ROWS,
            units,
        );
        sync_cube();
        if q_step + 1 < q_steps {
            read_queries(
                qkv,
                grad,
                lse,
                delta,
                &mut next,
                b,
                h,
                heads,
                q_start + STEP_ROWS,
                seq,
                head_dim,
                STEP_ROWS,
                units,
            );
        }
        // With `causal`, a warp sees the step where some query comes at or
        // after its first key, and masks where some query comes before
        // its last; it masks too where one of its keys is not seen, or
        // the step runs past the sequence's end.
        let mut visible = true;
        let mut diagonal = false;
        if causal {
            visible = q_start + STEP_ROWS > k_first;
            diagonal = q_start + 1 < k_first + ROWS;
        }
        let masked = unseen || diagonal || q_start + STEP_ROWS > seq;
        if visible {
            #[unroll]
            for qb in 0..STEP_ROWS / 16 {
                // Pᵀ and dSᵀ for queries 16·qb…: two 8-query blocks.
                let mut pt = Sequence::<Array<Pair<f32>>>::new();
                let mut dst = Sequence::<Array<Pair<f32>>>::new();
                #[unroll]
                for half in 0..2 {
                    let nt = 2 * qb + half;
                    let s = transposed_product(&def, &keys, &sq, nt * 8, head_dim, stride);
                    let dp = transposed_product(&def, &values, &sdo, nt * 8, head_dim, stride);
                    let mut p_out = zeros();
                    let mut ds_out = zeros();
                    #[unroll]
                    for r in 0..2 {
                        let j = j_lo + r * 8;
                        let key_seen = if r == 0 { seen_lo } else { seen_hi };
                        let mut p_pair = p_out[r];
                        let mut ds_pair = ds_out[r];
                        #[unroll]
                        for e in 0..2 {
                            let c = nt * 8 + 2 * t + e;
                            let i = q_start + c;
                            let mut sees = true;
                            if masked {
                                sees = key_seen && i < seq;
                                if causal {
                                    sees = sees && j <= i;
                                }
                            }
                            let mut p = f32::new(0.0);
                            let mut value = f32::new(0.0);
                            if sees {
                                p = (s[r].extract(e) * scale - slse[c]).exp();
                                value = p * (dp[r].extract(e) - sdelta[c]);
                            }
                            p_pair.insert(e, p);
                            ds_pair.insert(e, value);
                        }
                        p_out[r] = p_pair;
                        ds_out[r] = ds_pair;
                    }
                    pt.push(p_out);
                    dst.push(ds_out);
                }
                let p_left = left_of(pt.index(0), pt.index(1));
                let ds_left = left_of(dst.index(0), dst.index(1));
                // dV += Pᵀ·dO and dK += dSᵀ·Q: the queries' rows as the
                // right operands, transposed on their way.
                #[unroll]
                for dt in 0..head_dim / 8 {
                    let query = qb * 16 + lane % 16;
                    let at = query * stride + dt * 8;
                    let do_frag = def.load_matrix::<E, Const<2>>(
                        &sdo[at..at + 8],
                        MatrixIdent::B,
                        2usize,
                        true,
                    );
                    def.execute_inplace(&p_left, &do_frag, dv.index_mut(dt));
                    let q_frag = def.load_matrix::<E, Const<2>>(
                        &sq[at..at + 8],
                        MatrixIdent::B,
                        2usize,
                        true,
                    );
                    def.execute_inplace(&ds_left, &q_frag, dk.index_mut(dt));
                }
            }
        }
    }

    // scale · dK and dV into the keys' and values' blocks of `dqkv`.
    #[unroll]
    for dt in 0..head_dim / 8 {
        let col = width + h * head_dim + dt * 8 + 2 * t;
        let (at_lo, at_hi) = (
            (b * seq + j_lo) * 3 * width + col,
            (b * seq + j_hi) * 3 * width + col,
        );
        let k_acc = dk.index(dt);
        write_pair(dqkv, k_acc[0], scale, at_lo, j_lo < seq);
        write_pair(dqkv, k_acc[1], scale, at_hi, j_hi < seq);
        let v_acc = dv.index(dt);
        write_pair(dqkv, v_acc[0], f32::new(1.0), at_lo + width, j_lo < seq);
        write_pair(dqkv, v_acc[1], f32::new(1.0), at_hi + width, j_hi < seq);
    }
}

/// A warp's 16 rows (from `first`) of a `PAD`-padded tile as the left
/// operands of products over the head's width, 16 columns a fragment
/// (`ldmatrix.x4`: units 0–15 address rows 0–15 of columns 0–7, units
/// 16–31 of columns 8–15).
#[cube]
fn left_operands<E: Float>(
    def: &MmaDefinition<E, E, f32>,
    s: &Shared<[E]>,
    first: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) -> Sequence<Array<Pair<E>>> {
    let lane = UNIT_POS_X as usize;
    let mut out = Sequence::<Array<Pair<E>>>::new();
    #[unroll]
    for kb in 0..head_dim / 16 {
        let at = (first + lane % 16) * stride + kb * 16 + (lane / 16) * 8;
        out.push(def.load_matrix::<E, Const<2>>(&s[at..at + 8], MatrixIdent::A, 4usize, false));
    }
    out
}

/// `left · Bᵀ` for the 8 rows of `s` (a `PAD`-padded tile) from `first`:
/// an 8-column accumulator, the rows read as they lie as the right
/// operand (`ldmatrix.x2`: units 0–7 address the 8 rows at columns 0–7,
/// units 8–15 at 8–15), over the head's width.
#[cube]
fn transposed_product<E: Float>(
    def: &MmaDefinition<E, E, f32>,
    left: &Sequence<Array<Pair<E>>>,
    s: &Shared<[E]>,
    first: usize,
    #[comptime] head_dim: usize,
    #[comptime] stride: usize,
) -> Array<Pair<f32>> {
    let lane = UNIT_POS_X as usize;
    let mut acc = zeros();
    #[unroll]
    for kb in 0..head_dim / 16 {
        let at = (first + lane % 8) * stride + kb * 16 + ((lane / 8) % 2) * 8;
        let right = def.load_matrix::<E, Const<2>>(&s[at..at + 8], MatrixIdent::B, 2usize, false);
        def.execute_inplace(left.index(kb), &right, &mut acc);
    }
    acc
}

/// Two 8-column accumulators (columns 0–7 and 8–15 of 16 rows) rounded
/// to the input dtype as one 16-deep left operand: the accumulator's
/// layout is the left operand's, register for register.
#[cube]
fn left_of<E: Float>(first: &Array<Pair<f32>>, second: &Array<Pair<f32>>) -> Array<Pair<E>> {
    let mut left = Array::<Pair<E>>::new(4usize);
    left[0] = Pair::<E>::cast_from(first[0]);
    left[1] = Pair::<E>::cast_from(first[1]);
    left[2] = Pair::<E>::cast_from(second[0]);
    left[3] = Pair::<E>::cast_from(second[1]);
    left
}

/// Query `i`'s log-sum-exp and `delta` (zeros past the end).
#[cube]
fn row_figures(lse: &[f32], delta: &[f32], row0: usize, i: usize, seq: usize) -> (f32, f32) {
    let mut l = f32::new(0.0);
    let mut d = f32::new(0.0);
    if i < seq {
        l = lse[row0 + i];
        d = delta[row0 + i];
    }
    (l, d)
}

/// A register's two sums times `factor` into `dst` at `at` and the next,
/// where `inside`.
#[cube]
fn write_pair<E: Float>(dst: &mut [E], sums: Pair<f32>, factor: f32, at: usize, inside: bool) {
    if inside {
        dst[at] = E::cast_from(sums.extract(0usize) * factor);
        dst[at + 1] = E::cast_from(sums.extract(1usize) * factor);
    }
}

/// Where a unit works: its cube's head and batch entry and first row
/// (of queries, or of keys in dK/dV's), its warp and lane, and its rows
/// and columns in the accumulators' layout (`g`: rows `g` and `g + 8`;
/// `t`: columns `2t` and `2t + 1` of each 8-column block).
#[cube]
fn place() -> (usize, usize, usize, usize, usize, usize, usize) {
    let lane = UNIT_POS_X as usize;
    (
        CUBE_POS_Y as usize,
        CUBE_POS_Z as usize,
        CUBE_POS_X as usize * comptime!(ROWS * PLANES),
        UNIT_POS_Y as usize,
        lane,
        lane / 4,
        lane % 4,
    )
}

/// An accumulator of zeros: an 8-column block, two registers.
#[cube]
fn zeros() -> Array<Pair<f32>> {
    let mut acc = Array::<Pair<f32>>::new(2usize);
    acc[0] = Pair::<f32>::new(f32::new(0.0));
    acc[1] = Pair::<f32>::new(f32::new(0.0));
    acc
}

/// A row's running maximum after a step whose largest raw score is `top`
/// (LOWEST where the row sees none of its keys), and the factor its sums
/// so far are rescaled by (0 before its first seen key, when they are
/// zeros anyway).
#[cube]
fn moved(old: f32, top: f32, scale: f32) -> (f32, f32) {
    let mut new = old;
    if top > f32::new(LOWEST) {
        new = max(old, top * scale);
    }
    let mut factor = f32::new(0.0);
    if old != f32::new(LOWEST) {
        factor = (old - new).exp();
    }
    (new, factor)
}

/// `exp(scale·s − reference)` of a register's two scores.
#[cube]
fn probabilities(s: Pair<f32>, scale: f32, reference: f32) -> Pair<f32> {
    let mut p = s;
    p.insert(0usize, (s.extract(0usize) * scale - reference).exp());
    p.insert(1usize, (s.extract(1usize) * scale - reference).exp());
    p
}

/// A row's `1 / sum` and log-sum-exp (0 and 0 for a row that saw no key).
#[cube]
fn finish(sum: f32, top: f32) -> (f32, f32) {
    let mut inverse = f32::new(0.0);
    let mut l = f32::new(0.0);
    if sum > f32::new(0.0) {
        inverse = f32::new(1.0) / sum;
        l = top + sum.ln();
    }
    (inverse, l)
}

/// The forward pass by this kernel where [`runs`] says it does (`None`
/// elsewhere): the merged heads and the log-sum-exp, as
/// `flash_attention::forward`'s. `qkv` and `pad` are contiguous.
pub(super) fn forward(
    qkv: &CubeTensor,
    pad: &CubeTensor,
    heads: usize,
    causal: bool,
) -> Option<(CubeTensor, CubeTensor)> {
    let [batch, seq, three_width] = qkv.meta.shape().dims::<3>();
    let head_dim = three_width / 3 / heads;
    let dtype = qkv.dtype;
    let rows = ROWS * PLANES;
    if !runs(qkv, head_dim) || !grid_fits(&qkv.client, seq.div_ceil(rows), heads, batch) {
        return None;
    }
    let out = empty(qkv, vec![batch, seq, heads * head_dim], dtype);
    let lse = empty(qkv, vec![batch, heads, seq], DType::F32);
    flash_mma_forward_kernel::launch(
        &qkv.client,
        CubeCount::Static(seq.div_ceil(rows) as u32, heads as u32, batch as u32),
        CubeDim::new_2d(WARP as u32, PLANES as u32),
        vector_size(qkv, head_dim),
        qkv.clone().into_buffer_arg(),
        pad.clone().into_buffer_arg(),
        out.clone().into_buffer_arg(),
        lse.clone().into_buffer_arg(),
        seq,
        heads,
        (1.0 / (head_dim as f64).sqrt()) as f32,
        head_dim,
        causal,
        dtype_to_storage_type(dtype),
    );
    Some((out, lse))
}

/// The gradient of the packed qkv by this file's dQ and dK/dV kernels
/// where [`runs`] says they do (`None` elsewhere), from the forward pass's
/// log-sum-exp and `delta` (`Σ dO·O` per query), as
/// `flash_attention::backward`'s. All inputs contiguous, `grad` in qkv's
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
    let rows = ROWS * PLANES;
    if !runs(qkv, head_dim)
        || backward_shared_bytes(head_dim, dtype.size())
            > qkv.client.properties().hardware.max_shared_memory_size
        || !grid_fits(&qkv.client, seq.div_ceil(rows), heads, batch)
    {
        return None;
    }
    let dqkv = empty(qkv, qkv.meta.shape().to_vec(), dtype);
    let scale = (1.0 / (head_dim as f64).sqrt()) as f32;
    // dQ per query tile, then dK and dV per key tile.
    for keys_outer in [false, true] {
        flash_mma_backward_kernel::launch(
            &qkv.client,
            CubeCount::Static(seq.div_ceil(rows) as u32, heads as u32, batch as u32),
            CubeDim::new_2d(WARP as u32, PLANES as u32),
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
            head_dim,
            causal,
            keys_outer,
            dtype_to_storage_type(dtype),
        );
    }
    Some(dqkv)
}

/// The backward kernels' shared memory (the larger, dK/dV's): one side's
/// 64 rows twice and the other's step twice (rows padded by [`PAD`]),
/// with the keys' flags or the queries' figures.
fn backward_shared_bytes(head_dim: usize, elem: usize) -> usize {
    2 * (PLANES * ROWS + STEP_ROWS) * (head_dim + PAD) * elem + 4 * (PLANES * ROWS + 2 * STEP_ROWS)
}

/// The kernel as GPT-2 small runs it on an NVIDIA GPU in `dtype` (heads
/// 64 wide, causal), for `kiln check-kernels --cuda-arch`.
#[cfg(feature = "cuda")]
pub(super) fn offline_kernels(
    o: &super::offline::Offline,
    dtype: DType,
) -> super::offline::Kernels {
    use super::offline::buffer;
    let head_dim = 64;
    let kernel = flash_mma_forward_kernel::FlashMmaForwardKernel::new(
        o.settings(WARP as u32, PLANES as u32),
        o.props.clone(),
        o.target.clone(),
        buffer(),
        buffer(),
        buffer(),
        buffer(),
        (),
        (),
        (),
        16 / dtype.size(),
        head_dim,
        true,
        dtype_to_storage_type(dtype),
    );
    let backward = |name: &str, keys_outer: bool| -> (String, Box<dyn cubecl::CubeKernel>) {
        let kernel = flash_mma_backward_kernel::FlashMmaBackwardKernel::new(
            o.settings(WARP as u32, PLANES as u32),
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
            16 / dtype.size(),
            head_dim,
            true,
            keys_outer,
            dtype_to_storage_type(dtype),
        );
        let rows = if keys_outer { "queries" } else { "keys" };
        (
            format!(
                "flash attention {name}, registers (FLASH_MMA=1; {dtype:?}, heads {head_dim} wide, causal, {STEP_ROWS} {rows} a step, {PLANES} warps)"
            ),
            Box::new(kernel),
        )
    };
    vec![
        (
            format!(
                "flash attention forward, registers (FLASH_MMA=1; {dtype:?}, heads {head_dim} wide, causal, {STEP_KEYS} keys a step, {PLANES} warps)"
            ),
            Box::new(kernel),
        ),
        backward("dQ", false),
        backward("dK and dV", true),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `FLASH_MMA`: `1` both sides, `forward` or `backward` one, anything
    /// else (unset, `0`, a typo) neither: the default kernels.
    #[test]
    fn flash_mma_asks_for_its_sides() {
        assert_eq!(sides("1"), (true, true));
        assert_eq!(sides(" forward\n"), (true, false));
        assert_eq!(sides("backward"), (false, true));
        for value in ["", "0", "yes", "Forward"] {
            assert_eq!(sides(value), (false, false), "{value:?}");
        }
    }

    /// The shared memory the kernels take at GPT-2's heads in bf16 (what
    /// `kiln check-kernels --cuda-arch` reports from the compiled kernels):
    /// under every CUDA GPU's 48 KiB a cube without opting in.
    #[test]
    fn shared_memory_fits_48_kib_at_gpt2s_heads() {
        assert_eq!(shared_bytes(64, 2), 27_904);
        assert_eq!(backward_shared_bytes(64, 2), 37_632);
        assert!(backward_shared_bytes(64, 2) <= 48 * 1024);
    }
}
