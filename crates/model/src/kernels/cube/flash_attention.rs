//! The attention forward pass on matrix instructions (tensor cores, Vulkan
//! cooperative matrices): FlashAttention-2's tiling with CubeCL's `cmma`.
//!
//! One cube is one plane (a warp on CUDA, a subgroup on Vulkan) and owns a
//! tile of `tile` queries of one head; it walks the key tiles the queries
//! see (with `causal`, none past the tile's last query) and for each:
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
//! a query that sees no key) and each query's log-sum-exp, from which the
//! backward kernels (scalar, in `attention.rs`) rebuild the probabilities.
//! So the two forward kernels are interchangeable, and `kiln check-kernels`
//! compares this one with Burn's composition in f16/bf16 where it runs.
//!
//! It runs where the device has a square matrix instruction for the dtype
//! with an f32 accumulator (`tile × tile × tile`: 16 on NVIDIA's tensor
//! cores for bf16 and f16, 8 for f16 on Mesa's lavapipe), the head width
//! is a multiple of it, and the plane has one fixed size; everywhere else
//! (f32, WGSL, widths such as 136 against 16) the scalar kernel does.
//!
//! The tile is the instruction's size: one plane per cube, the scores'
//! tile a single instruction tall and wide. Larger tiles (several planes
//! sharing each key tile, as FlashAttention-2 does with four warps) and
//! the accumulator kept in registers rather than shared memory are the
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
    let stride = 3 * width;
    let q_start = q_tile * tile;
    let tile_elems = tile * head_dim;
    let steps = head_dim / tile;

    let mut sq = Shared::<[E]>::new_slice(tile_elems);
    let mut sk = Shared::<[E]>::new_slice(tile_elems);
    let mut sv = Shared::<[E]>::new_slice(tile_elems);
    let mut so = Shared::<[f32]>::new_slice(tile_elems);
    let mut ss = Shared::<[f32]>::new_slice(tile * tile);
    let mut sp = Shared::<[E]>::new_slice(tile * tile);
    let mut row_max = Shared::<[f32]>::new_slice(tile);
    let mut row_sum = Shared::<[f32]>::new_slice(tile);
    let mut row_factor = Shared::<[f32]>::new_slice(tile);

    // The query tile (zeros past the end) and the accumulator.
    let mut e = unit;
    while e < tile_elems {
        let i = q_start + e / head_dim;
        let mut x = E::from_int(0);
        if i < seq {
            x = qkv[(b * seq + i) * stride + h * head_dim + e % head_dim];
        }
        sq[e] = x;
        so[e] = f32::new(0.0);
        e += units;
    }
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
        let mut e = unit;
        while e < tile_elems {
            let j = k_start + e / head_dim;
            let mut k = E::from_int(0);
            let mut v = E::from_int(0);
            if j < seq {
                let k0 = (b * seq + j) * stride + width + h * head_dim + e % head_dim;
                k = qkv[k0];
                v = qkv[k0 + width];
            }
            sk[e] = k;
            sv[e] = v;
            e += units;
        }
        sync_cube();

        // S = Q·Kᵀ: Kᵀ's tile is the key rows read column-major.
        let scores = Matrix::<f32>::from_value(
            MatrixIdent::Accumulator,
            tile,
            tile,
            tile,
            MatrixLayout::Undefined,
            f32::new(0.0),
        );
        #[unroll]
        for step in 0..steps {
            let a = Matrix::<E>::from_slice(
                MatrixIdent::A,
                tile,
                tile,
                tile,
                MatrixLayout::RowMajor,
                &sq[step * tile..tile_elems],
                head_dim as u32,
            );
            let kt = Matrix::<E>::from_slice(
                MatrixIdent::B,
                tile,
                tile,
                tile,
                MatrixLayout::ColMajor,
                &sk[step * tile..tile_elems],
                head_dim as u32,
            );
            cmma::execute(&a, &kt, &scores, &scores);
        }
        cmma::store(&mut ss, &scores, tile as u32, MatrixLayout::RowMajor);
        sync_cube();

        // The online softmax, one unit per query row.
        let mut r = unit;
        while r < tile {
            let i = q_start + r;
            let old_max = row_max[r];
            let mut new_max = old_max;
            for c in 0..tile {
                let j = k_start + c;
                let mut seen = j < seq;
                if seen {
                    seen = pad[b * seq + j] == f32::new(0.0) && (!causal || j <= i);
                }
                if seen {
                    new_max = max(new_max, ss[r * tile + c] * scale);
                }
            }
            let factor = (old_max - new_max).exp();
            let mut sum = row_sum[r] * factor;
            for c in 0..tile {
                let j = k_start + c;
                let mut seen = j < seq;
                if seen {
                    seen = pad[b * seq + j] == f32::new(0.0) && (!causal || j <= i);
                }
                let mut p = f32::new(0.0);
                if seen {
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
        let p = Matrix::<E>::from_slice(
            MatrixIdent::A,
            tile,
            tile,
            tile,
            MatrixLayout::RowMajor,
            &sp,
            tile as u32,
        );
        #[unroll]
        for step in 0..steps {
            let v = Matrix::<E>::from_slice(
                MatrixIdent::B,
                tile,
                tile,
                tile,
                MatrixLayout::RowMajor,
                &sv[step * tile..tile_elems],
                head_dim as u32,
            );
            let o = Matrix::<f32>::from_slice(
                MatrixIdent::Accumulator,
                tile,
                tile,
                tile,
                MatrixLayout::RowMajor,
                &so[step * tile..tile_elems],
                head_dim as u32,
            );
            cmma::execute(&p, &v, &o, &o);
            cmma::store(
                &mut so[step * tile..tile_elems],
                &o,
                head_dim as u32,
                MatrixLayout::RowMajor,
            );
        }
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
