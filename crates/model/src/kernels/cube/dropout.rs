//! Dropout on attention's probabilities inside the CubeCL attention
//! kernels (the scalar ones in `attention.rs`, FlashAttention-2's on the
//! matrix unit in `flash_attention.rs`): the mask of
//! [`kernels::dropout_keeps`](super::super::dropout_keeps), computed in
//! 32-bit arithmetic (WGSL has no 64-bit integers), so that a probability
//! is kept on a GPU exactly where flex's kernel, and the reference check's
//! host-built mask, keep it. Nothing is kept between the passes: the
//! backward kernels hash each pair again.
//!
//! The seed stays on the device: it is two f32 of the device's generator
//! (`kernels::MaskSeed`), whose bits are its high and low halves, appended
//! to the key-padding flags the kernels already read
//! (`attention::self_attention`), so that drawing it costs the host no
//! wait for the device (reading it back did, once a layer and step); the
//! kernels derive the seed's keys from those two words ([`seed_keys`]), as
//! PyTorch's flash attention reads its Philox seed from a device tensor.
//!
//! Query `i`'s probability of key `j` in head `bh` (of the `batch × heads`
//! heads, `t` positions) is element `(bh·t + i)·t + j` of the mask. The
//! kernels know `row = bh·t + i` (below 2³²: it indexes the log-sum-exp)
//! and `j`; the product `row · t` can pass 2³² (a batch of 128 × 12 heads
//! × 2048² does), so
//! it is taken in 16-bit halves, and the 64-bit index folded into 32 bits
//! as the host's hash folds it.

use cubecl::prelude::*;

use super::super::{INDEX_HIGH, MIX_1, MIX_2, ProbsDropout};

/// A mask's probability as the kernels take it: the threshold a kept
/// element's hash is below, and the factor kept probabilities are
/// multiplied by (`1 / keep`). The seed is not here: the kernels read it on
/// the device ([`seed_keys`]). Without dropout the kernels are compiled
/// without reading it (their `dropout` is a compile-time flag): threshold
/// 0, scale 1.
#[derive(CubeLaunch, CubeType)]
pub(crate) struct Mask {
    pub(crate) threshold: u32,
    pub(crate) scale: f32,
}

/// `drop`'s mask as a launch argument (the kernels' compile-time
/// `dropout` is whether there is one: `drop.is_some()`).
pub(crate) fn launch_mask(drop: Option<ProbsDropout>) -> MaskLaunch {
    match drop {
        Some(drop) => MaskLaunch::new(drop.threshold(), drop.scale()),
        None => MaskLaunch::new(0, 1.0),
    }
}

/// The mask's compile-time argument, for `kiln check-kernels`'s kernels
/// built without a device.
#[cfg(feature = "cuda")]
pub(crate) fn compilation() -> MaskCompilationArg {
    MaskCompilationArg {
        threshold: (),
        scale: (),
    }
}

/// The keys [`kernels::MaskKeys`](super::super::MaskKeys) derives from a
/// seed: the index's odd multiplier, the key the product is xored with,
/// and the key between the two rounds.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Keys {
    multiply: u32,
    xor: u32,
    last: u32,
}

/// The keys of the seed in `words`' last two elements (its high and low
/// halves, as f32 bit patterns: the key-padding flags followed by the
/// seed, `attention::self_attention`), as `MaskKeys::of` derives them on
/// the host; without `dropout` nothing is read (zeros).
#[cube]
// (Rotations are not CubeCL operations: `last` rotates by hand.)
#[allow(clippy::manual_rotate)]
pub(crate) fn seed_keys(words: &[f32], #[comptime] dropout: bool) -> Keys {
    let mut hi = 0u32;
    let mut lo = 0u32;
    if dropout {
        let n = words.len();
        hi = u32::reinterpret(words[n - 2]);
        lo = u32::reinterpret(words[n - 1]);
    }
    Keys {
        multiply: hi | 1u32,
        xor: lo,
        last: (hi << 16u32) | (hi >> 16u32),
    }
}

/// murmur3's 32-bit finalizer (the host's `fmix32`).
#[cube]
fn fmix(h: u32) -> u32 {
    let a = h ^ (h >> 16u32);
    let b = a * MIX_1;
    let c = b ^ (b >> 13u32);
    let d = c * MIX_2;
    d ^ (d >> 16u32)
}

/// What the mask of the seed's `keys` makes of query row `row`'s (`bh·t +
/// i`) probability of key `j` over `seq` keys a row: `mask.scale` where it
/// is kept, else 0.
#[cube]
pub(crate) fn kept(keys: &Keys, mask: &Mask, row: u32, seq: u32, j: u32) -> f32 {
    // row · seq as two 32-bit halves, from 16-bit ones.
    let (a0, a1) = (row & 0xFFFFu32, row >> 16u32);
    let (b0, b1) = (seq & 0xFFFFu32, seq >> 16u32);
    let low = a0 * b0;
    let cross_a = a0 * b1;
    let cross_b = a1 * b0;
    let middle = (low >> 16u32) + (cross_a & 0xFFFFu32) + (cross_b & 0xFFFFu32);
    let product_lo = (middle << 16u32) | (low & 0xFFFFu32);
    let product_hi = a1 * b1 + (cross_a >> 16u32) + (cross_b >> 16u32) + (middle >> 16u32);
    // + j, with its carry.
    let index_lo = product_lo + j;
    let mut index_hi = product_hi;
    if index_lo < product_lo {
        index_hi += 1u32;
    }
    let folded = index_lo ^ (index_hi * INDEX_HIGH);
    let h = fmix(fmix((folded * keys.multiply) ^ keys.xor) ^ keys.last);
    let mut factor = f32::new(0.0);
    if h < mask.threshold {
        factor = mask.scale;
    }
    factor
}

/// The mask's factor for `rows` query rows from `row0`, `seq` keys a row,
/// under the seed in `seed` (its two words, as the attention kernels find
/// them after the padding flags): what [`kept`] gives each `(row, j)`, row
/// by row.
#[cube(launch)]
fn mask_kernel(out: &mut [f32], seed: &[f32], row0: u32, seq: u32, mask: Mask) {
    let unit = ABSOLUTE_POS;
    if unit < out.len() {
        let mask_keys = seed_keys(seed, true);
        let (row, j) = (unit as u32 / seq, unit as u32 % seq);
        out[unit] = kept(&mask_keys, &mask, row0 + row, seq, j);
    }
}

/// What the kernels' mask under `drop` makes of each probability of `rows`
/// query rows from `row0`, `seq` keys a row, on `device` (a CubeCL GPU),
/// row by row: for the check that it is [`dropout_keeps`]'s where the
/// index `row · seq + j` passes 2³² (`kernels::check`).
///
/// [`dropout_keeps`]: super::super::dropout_keeps
#[cfg(not(feature = "fusion"))]
pub(crate) fn factors(
    device: &burn::tensor::Device,
    drop: ProbsDropout,
    row0: u32,
    rows: u32,
    seq: u32,
) -> Vec<f32> {
    use burn::tensor::Tensor;
    let n = (rows * seq) as usize;
    let out = super::into_cube(Tensor::<1>::zeros([n], &device.clone().without_autodiff()));
    let cube_dim = CubeDim::new_1d(256);
    let cube_count = cubecl::calculate_cube_count_elemwise(&out.client, n, cube_dim);
    let mask = launch_mask(Some(drop));
    let seed = super::into_cube(super::super::MaskSeed::Host(drop.seed).on_device(device));
    mask_kernel::launch(
        &out.client.clone(),
        cube_count,
        cube_dim,
        out.clone().into_buffer_arg(),
        seed.into_buffer_arg(),
        row0,
        seq,
        mask,
    );
    super::from_cube(out)
        .into_data()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}
