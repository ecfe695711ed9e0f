//! The fused kernels on Burn's `flex` CPU backend: each one pass over
//! contiguous f32 memory, split over rayon's threads (the same pool flex's
//! matmul uses), its inner loop compiled for the CPU's widest SIMD.

use std::mem::MaybeUninit;

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Shape, TensorData};
use multiversion::multiversion;
use multiversion::target::target_cfg_f;
use rayon::prelude::*;

use super::dropout_keeps;
use super::optim::{Factors, update};

mod math;
pub(crate) mod peak;

/// Elements per rayon task: big enough that scheduling is noise, small
/// enough that both cores get work on a 128 × 512 activation.
const CHUNK: usize = 1 << 13;

/// Compiles the slice loop it wraps once per instruction-set level, the
/// `math` helpers inlined into each, and picks the level at run time from
/// what the CPU has (`#[multiversion]`). With kiln-model's `avx512` feature
/// the levels are multiversion's `simd` set (on x86-64: AVX-512 with Ice
/// Lake's extensions, AVX2 + FMA, SSE4.2, baseline) and one more, x86-64-v4
/// proper (AVX-512 F/BW/CD/DQ/VL), for the AVX-512 CPUs without those
/// extensions (Skylake-SP, Cascade Lake), which multiversion's set would
/// send to AVX2 (`isa::loops_level` picks it); without the feature the
/// same less AVX-512, so that an AVX-512 CPU runs what an AVX2 one does
/// (the `gemm` crate's kernels follow the same feature, through Burn's
/// `x86-v4`).
macro_rules! simd_levels {
    ($(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$attr])*
        $vis fn $name($($arg: $ty),*) {
            #[cfg(all(feature = "avx512", target_arch = "x86_64"))]
            {
                $(#[$attr])*
                #[target_feature(enable = "avx,avx2,avx512bw,avx512cd,avx512dq,avx512f,avx512vl,bmi1,bmi2,cmpxchg16b,f16c,fma,lzcnt,movbe,popcnt,sse3,sse4.1,sse4.2,ssse3,xsave")]
                fn v4_without_extensions($($arg: $ty),*) {
                    // This level has FMA (every AVX-512 CPU does).
                    #[allow(unused_macros)]
                    macro_rules! has_fma {
                        () => {
                            true
                        };
                    }
                    $body
                }
                if super::isa::loops_level() == super::isa::LoopsLevel::V4WithoutExtensions {
                    // SAFETY: loops_level found every feature enabled above
                    // on this CPU.
                    return unsafe { v4_without_extensions($($arg),*) };
                }
            }
            #[cfg_attr(feature = "avx512", multiversion(targets = "simd"))]
            #[cfg_attr(not(feature = "avx512"), multiversion(targets(
                "x86_64+avx+avx2+bmi1+bmi2+cmpxchg16b+f16c+fma+lzcnt+movbe+popcnt+sse3+sse4.1+sse4.2+ssse3+xsave",
                "x86_64+cmpxchg16b+popcnt+sse3+sse4.1+sse4.2+ssse3",
                "aarch64+fp16+sve+sve2",
                "aarch64+fp16+sve",
            )))]
            $(#[$attr])*
            fn levels($($arg: $ty),*) $body
            levels($($arg),*)
        }
    };
}

/// Inside a [`simd_levels!`] function: whether the level it is compiled for
/// has fused multiply-add (x86-64's FMA, which AVX2 CPUs have; every AArch64
/// level), the `FMA` of the [`math`] functions.
macro_rules! has_fma {
    () => {
        target_cfg_f!(any(target_feature = "fma", target_arch = "aarch64"))
    };
}

/// `t` as contiguous f32, copied only when it is a strided view.
fn contiguous(t: FlexTensor) -> FlexTensor {
    assert_eq!(t.dtype(), DType::F32, "kiln kernels take f32 tensors");
    if t.as_slice::<f32>().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

fn slice(t: &FlexTensor) -> &[f32] {
    t.as_slice::<f32>()
        .expect("contiguous f32 tensor (checked by `contiguous`)")
}

fn shape(t: &FlexTensor) -> Shape {
    t.layout().shape().clone()
}

fn from_vec(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// A new buffer of `n` f32s, written by `fill` through its uninitialised
/// room: chunks made writable with [`zeroed`] inside their own rayon task,
/// or a gemm that does not read its destination. Never zeroed as a whole:
/// `vec![0.0; n]` of reused memory is a `memset` on the calling thread while
/// the other cores wait (3 % of the CPU samples of a GPT step).
///
/// # Safety
/// `fill` must write all `n` elements.
unsafe fn buffer(n: usize, fill: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    fill(&mut v.spare_capacity_mut()[..n]);
    // SAFETY: `fill` wrote all `n` elements (the caller's promise).
    unsafe { v.set_len(n) };
    v
}

/// `room` zeroed, as f32s: called by the task that then writes the chunk,
/// so the zeroing is spread over the threads and leaves the chunk in cache.
fn zeroed(room: &mut [MaybeUninit<f32>]) -> &mut [f32] {
    room.fill(MaybeUninit::new(0.0));
    // SAFETY: every element was just written, and `MaybeUninit<f32>` has the
    // layout of `f32`.
    unsafe { &mut *(room as *mut [MaybeUninit<f32>] as *mut [f32]) }
}

/// `t`'s own buffer when nothing else holds it and it is exactly the
/// tensor's elements, so a kernel can write its result in place.
fn writable(t: &mut FlexTensor) -> Option<&mut [f32]> {
    let n = t.layout().num_elements();
    let dense = t.layout().contiguous_offsets() == Some((0, n));
    if !dense {
        return None;
    }
    t.try_storage_mut::<f32>().filter(|s| s.len() == n)
}

/// `t` as a dense f32 tensor that nothing else holds (copied when shared
/// or strided), so a kernel can write over it.
fn owned(t: FlexTensor) -> FlexTensor {
    let mut t = contiguous(t);
    if writable(&mut t).is_some() {
        return t;
    }
    from_vec(slice(&t).to_vec(), shape(&t))
}

simd_levels! {
    fn gelu_slice(x: &[f32], out: &mut [MaybeUninit<f32>]) {
        const FMA: bool = has_fma!();
        for (o, &x) in out.iter_mut().zip(x) {
            o.write(math::gelu::<FMA>(x));
        }
    }
}

simd_levels! {
    fn gelu_grad_slice(x: &[f32], grad: &mut [f32]) {
        const FMA: bool = has_fma!();
        for (g, &x) in grad.iter_mut().zip(x) {
            *g = math::gelu_grad::<FMA>(x, *g);
        }
    }
}

/// A dropout mask and its scale: elements kept where [`dropout_keeps`]
/// says so under `seed`, times `1 / keep`; the others 0.
#[derive(Clone, Copy, Debug)]
struct Mask {
    seed: u64,
    threshold: u32,
    scale: f32,
}

impl Mask {
    fn new(seed: u64, keep: f64) -> Self {
        let drop = super::ProbsDropout { seed, keep };
        Self {
            seed,
            threshold: drop.threshold(),
            scale: drop.scale(),
        }
    }

    /// The mask over `values`, elements `first ..` of it.
    #[inline(always)]
    fn apply(self, values: &mut [f32], first: u64) {
        for (j, v) in values.iter_mut().enumerate() {
            let keep = dropout_keeps(self.seed, first + j as u64, self.threshold);
            *v = if keep { *v * self.scale } else { 0.0 };
        }
    }
}

simd_levels! {
    fn dropout_slice(values: &mut [f32], first: u64, mask: Mask) {
        mask.apply(values, first);
    }
}

/// Dropout with its mask drawn from `seed` ([`dropout_keeps`]): each kept
/// element times `1 / keep`, the others 0, written over `x` when nothing
/// else holds it. Its own backward: the same call on the output's gradient
/// applies the same mask and scale.
pub(crate) fn dropout(x: FlexTensor, seed: u64, keep: f64) -> FlexTensor {
    let mut x = owned(x);
    let mask = Mask::new(seed, keep);
    let values = writable(&mut x).expect("`owned` returns a writable tensor");
    values
        .par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(c, v)| dropout_slice(v, (c * CHUNK) as u64, mask));
    x
}

simd_levels! {
    /// The mask over one head's `t × keys` buffer (`p`, [`Span`]), that
    /// head's first element of the mask at `first`: each row's visible
    /// keys, row `i` at `first + i·t`.
    fn drop_head(p: &mut [f32], span: Span, first: u64, mask: Mask) {
        for (i, row) in p.chunks_exact_mut(span.keys).enumerate() {
            mask.apply(&mut row[..span.visible(i)], first + (i * span.t) as u64);
        }
    }
}

impl super::ProbsDropout {
    /// Applies the mask to head `bh`'s buffer `p` ([`drop_head`]).
    fn apply(self, p: &mut [f32], span: Span, bh: usize) {
        let first = (bh * span.t * span.t) as u64;
        drop_head(p, span, first, Mask::new(self.seed, self.keep));
    }
}

/// Exact GELU, forward.
pub(crate) fn gelu(x: FlexTensor) -> FlexTensor {
    let x = contiguous(x);
    let input = slice(&x);
    // SAFETY: the chunks cover the buffer, and each is written in full.
    let out = unsafe {
        buffer(input.len(), |room| {
            room.par_chunks_mut(CHUNK)
                .zip(input.par_chunks(CHUNK))
                .for_each(|(o, i)| gelu_slice(i, o))
        })
    };
    from_vec(out, shape(&x))
}

/// Exact GELU, backward: `grad · gelu'(x)`, written over `grad` when it is
/// not shared.
pub(crate) fn gelu_backward(x: FlexTensor, grad: FlexTensor) -> FlexTensor {
    let x = contiguous(x);
    let mut grad = owned(grad);
    let xs = slice(&x);
    let g = writable(&mut grad).expect("`owned` returns a writable tensor");
    g.par_chunks_mut(CHUNK)
        .zip(xs.par_chunks(CHUNK))
        .for_each(|(g, x)| gelu_grad_slice(x, g));
    grad
}

/// A `[batch, heads, time, head_dim]` f32 tensor's storage and strides, for
/// passing strided heads straight to gemm (no copy of the q/k/v views).
struct Heads<'a> {
    data: &'a [f32],
    offset: usize,
    /// Strides of batch, head, time, head_dim, in elements.
    strides: [usize; 4],
    dims: [usize; 4],
}

impl<'a> Heads<'a> {
    /// The heads of columns `part·d .. (part+1)·d` of `t` (`[batch, time,
    /// width]`, non-negative strides, see [`positive`]): `heads` heads of
    /// `d / heads` columns each, as a `[batch, heads, time, head_dim]` view.
    fn split(t: &'a FlexTensor, part: usize, d: usize, heads: usize) -> Self {
        let layout = t.layout();
        let [b, time, width]: [usize; 3] = layout
            .shape()
            .as_slice()
            .try_into()
            .expect("attention takes [batch, time, width] activations");
        assert!(
            (part + 1) * d <= width && d.is_multiple_of(heads),
            "attention: {heads} heads of width {d} (part {part}) do not fit width {width}"
        );
        let [s0, s1, s2] = std::array::from_fn(|i| layout.strides()[i] as usize);
        Self {
            data: t.storage::<f32>(),
            offset: layout.start_offset() + part * d * s2,
            strides: [s0, (d / heads) * s2, s1, s2],
            dims: [b, heads, time, d / heads],
        }
    }

    /// Pointer to head `(b, h)`'s first element.
    fn head(&self, b: usize, h: usize) -> *const f32 {
        let at = self.offset + b * self.strides[0] + h * self.strides[1];
        debug_assert!(at < self.data.len());
        self.data[at..].as_ptr()
    }

    fn at(&self, b: usize, h: usize, t: usize, d: usize) -> f32 {
        self.data[self.offset
            + b * self.strides[0]
            + h * self.strides[1]
            + t * self.strides[2]
            + d * self.strides[3]]
    }

    /// Row `t` of head `(b, h)` as a slice, where its columns are adjacent.
    fn row(&self, b: usize, h: usize, t: usize) -> Option<&[f32]> {
        let at = self.offset + b * self.strides[0] + h * self.strides[1] + t * self.strides[2];
        (self.strides[3] == 1).then(|| &self.data[at..at + self.dims[3]])
    }

    fn row_stride(&self) -> isize {
        self.strides[2] as isize
    }

    fn col_stride(&self) -> isize {
        self.strides[3] as isize
    }
}

/// The key-padding mask's values, `None` when no key is padding.
fn padding(key_pad: &FlexTensor, len: usize) -> Option<&[f32]> {
    let pad = slice(key_pad);
    assert_eq!(pad.len(), len, "attention: key_pad must be [batch, time]");
    pad.iter().any(|&p| p > 0.5).then_some(pad)
}

/// `t` with non-negative strides (a flipped view is copied).
fn positive(t: FlexTensor) -> FlexTensor {
    assert_eq!(t.dtype(), DType::F32, "kiln kernels take f32 tensors");
    if t.layout().strides().iter().all(|&s| s >= 0) {
        t
    } else {
        t.to_contiguous()
    }
}

/// A raw pointer shared by rayon tasks that write disjoint parts of one
/// buffer.
#[derive(Clone, Copy)]
struct SharedMut(*mut f32);
// SAFETY: every task writes a region no other task touches (one head each).
unsafe impl Send for SharedMut {}
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// A strided matrix operand of [`matmul`]: pointer, row stride, column stride.
#[derive(Clone, Copy)]
struct Mat(*const f32, isize, isize);

impl Mat {
    /// The transpose: the same memory, strides swapped.
    fn t(self) -> Self {
        Mat(self.0, self.2, self.1)
    }

    /// The sub-matrix from row `r`, column `c` on.
    ///
    /// # Safety
    /// `(r, c)` must lie inside the matrix.
    unsafe fn at(self, r: usize, c: usize) -> Self {
        // SAFETY: forwarded from the caller.
        let p = unsafe { self.0.offset(r as isize * self.1 + c as isize * self.2) };
        Mat(p, self.1, self.2)
    }
}

/// `dst (m × n) = alpha · lhs (m × k) · rhs (k × n)`, single-threaded (the
/// caller runs one head per rayon task), any strides.
///
/// # Safety
/// The operands must address `m × k`, `k × n` and `m × n` valid f32s with
/// the strides given, and `dst` must not overlap the others.
unsafe fn matmul(m: usize, n: usize, k: usize, dst: Mat, lhs: Mat, rhs: Mat, alpha: f32) {
    // SAFETY: forwarded from the caller.
    unsafe {
        gemm_call(
            m,
            n,
            k,
            dst,
            lhs,
            rhs,
            alpha,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Query rows per block of the causal attention: block `r` sees keys
/// `0 .. (r+1)·CAUSAL_BLOCK` only, so the products skip most of the masked
/// upper triangle (at t = 128, 62.5 % of the full products are computed).
const CAUSAL_BLOCK: usize = 32;

/// The part of one batch entry's `t × t` scores that a head computes: every
/// query, and the first `keys` keys — up to its last key that is not
/// padding. Trailing padding keys (a padded batch's shorter sequences) are
/// seen by no query, so their scores are never computed, as the causal
/// mask's upper triangle is not; padding keys before the last real one are
/// masked (−∞). A head's scores are `t × keys`, row stride `keys`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    t: usize,
    keys: usize,
    causal: bool,
}

impl Span {
    /// The span of a batch entry whose key-padding mask is `pad` (`None`: no
    /// padding).
    fn new(t: usize, pad: Option<&[f32]>, causal: bool) -> Self {
        let keys = pad.map_or(t, |pad| {
            pad.iter()
                .rposition(|&p| p <= 0.5)
                .map_or(0, |last| last + 1)
        });
        Self { t, keys, causal }
    }

    /// How many leading keys query `i` may attend to (`j ≤ i` when causal;
    /// padding among them is masked by [`mask_row`]).
    #[inline(always)]
    fn visible(self, i: usize) -> usize {
        if self.causal {
            (i + 1).min(self.keys)
        } else {
            self.keys
        }
    }

    /// The keys [`square`] computed for query `i` (the end of its row
    /// block); from there on the row is already 0.
    #[inline(always)]
    fn computed(self, i: usize) -> usize {
        if self.causal {
            ((i / CAUSAL_BLOCK + 1) * CAUSAL_BLOCK).min(self.keys)
        } else {
            self.keys
        }
    }

    /// `0..len` in blocks `[start, end)`: of [`CAUSAL_BLOCK`] with the
    /// causal mask, else one block.
    fn blocks(self, len: usize) -> impl Iterator<Item = (usize, usize)> {
        let step = if self.causal {
            CAUSAL_BLOCK
        } else {
            len.max(1)
        };
        (0..len)
            .step_by(step)
            .map(move |start| (start, (start + step).min(len)))
    }

    /// The query row blocks `[r0, r1)` and the keys `0..n` each may see:
    /// one block of all queries without the causal mask.
    fn row_blocks(self) -> impl Iterator<Item = (usize, usize, usize)> {
        self.blocks(self.t)
            .map(move |(r0, r1)| (r0, r1, self.computed(r0)))
    }

    /// The key blocks `[c0, c1)` of the keys computed and the first query
    /// that sees each: with the causal mask the query of its first key,
    /// else query 0 (one block of all keys).
    fn key_blocks(self) -> impl Iterator<Item = (usize, usize, usize)> {
        self.blocks(self.keys)
            .map(move |(c0, c1)| (c0, c1, if self.causal { c0 } else { 0 }))
    }
}

/// `alpha · lhs (t × k) · rhs (k × keys)` in a new `t × keys` buffer (one
/// head's scores or their gradient, [`Span`]). With `causal`, only the
/// entries of [`Span::row_blocks`] are computed; the keys beyond a block's
/// are 0.
///
/// # Safety
/// The operands as in [`matmul`]; `span.keys` > 0.
unsafe fn square(span: Span, k: usize, lhs: Mat, rhs: Mat, alpha: f32) -> Vec<f32> {
    let width = span.keys;
    // SAFETY: forwarded from the caller; each gemm writes its block without
    // reading it, and the rest of each block's rows is zeroed here.
    unsafe {
        buffer(span.t * width, |room| {
            for (r0, r1, n) in span.row_blocks() {
                let dst = Mat(room.as_mut_ptr().cast(), width as isize, 1);
                matmul(r1 - r0, n, k, dst.at(r0, 0), lhs.at(r0, 0), rhs, alpha);
                for row in room[r0 * width..r1 * width].chunks_exact_mut(width) {
                    row[n..].fill(MaybeUninit::new(0.0));
                }
            }
        })
    }
}

/// Zeros into `rows` rows of `cols` f32s from `at`, `stride` apart: a
/// head's columns of a result that no key reaches.
///
/// # Safety
/// The rows must be valid for writes and belong to the caller's task.
unsafe fn zero_rows(at: *mut f32, rows: usize, cols: usize, stride: usize) {
    for r in 0..rows {
        // SAFETY: forwarded from the caller.
        unsafe { std::ptr::write_bytes(at.add(r * stride), 0, cols) };
    }
}

/// gemm splitting one product over rayon's threads itself.
const ALL_THREADS: gemm::Parallelism = gemm::Parallelism::Rayon(0);

/// `c = a · b` for contiguous row-major `a` (`m × k`), `b` (`k × n`) and
/// `c` (`m × n`), split over rayon's threads by gemm as the kernels' large
/// products are: the call the measured peak (`peak`) times.
pub(super) fn row_major_product(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    assert!(a.len() == m * k && b.len() == k * n && c.len() == m * n);
    let row = |p: *const f32, cols: usize| Mat(p, cols as isize, 1);
    // SAFETY: the lengths are checked above and the strides are those of
    // contiguous row-major matrices; `c` is borrowed mutably, so it
    // overlaps neither operand.
    unsafe {
        gemm_call(
            m,
            n,
            k,
            row(c.as_mut_ptr().cast_const(), n),
            row(a.as_ptr(), k),
            row(b.as_ptr(), n),
            1.0,
            false,
            ALL_THREADS,
        )
    }
}

/// `dst = alpha · lhs · rhs`, plus what `dst` holds when `accumulate`.
///
/// # Safety
/// As [`matmul`].
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_call(
    m: usize,
    n: usize,
    k: usize,
    dst: Mat,
    lhs: Mat,
    rhs: Mat,
    alpha: f32,
    accumulate: bool,
    parallelism: gemm::Parallelism,
) {
    // SAFETY: forwarded from the caller; gemm takes column stride first.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0.cast_mut(),
            dst.2,
            dst.1,
            accumulate,
            lhs.0,
            lhs.2,
            lhs.1,
            rhs.0,
            rhs.2,
            rhs.1,
            1.0,
            alpha,
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// Multi-head scaled dot-product attention of a packed projection `qkv`
/// (`[batch, time, 3·d]`: queries, keys, values side by side, each `heads`
/// heads of `d / heads`), one head per rayon task, the scores of one head
/// at a time in a task-local buffer (`time × keys`, [`Span`]; never the
/// whole `[b, h, t, t]` tensor). `key_pad` (`[batch, time]`, 1.0 where a key is
/// padding; all zeros for none) and `spec.causal` mask keys; `spec.heads`
/// heads. Returns the output
/// with the heads merged (`[batch, time, d]`) and the log-sum-exp of each
/// query's scores (`[batch, heads, time]`), which the backward pass uses to
/// rebuild the probabilities. A query that sees no key gets zeros. With
/// `spec.dropout`, the probabilities are dropped out before they weigh the
/// values (the log-sum-exp is of the scores before it).
pub(crate) fn attention(
    qkv: FlexTensor,
    key_pad: FlexTensor,
    spec: super::AttentionSpec,
) -> (FlexTensor, FlexTensor) {
    let (heads, causal, dropout) = (spec.heads, spec.causal, spec.dropout);
    let qkv = positive(qkv);
    let key_pad = contiguous(key_pad);
    let d = qkv.layout().shape()[2] / 3;
    let [qh, kh, vh] = [0, 1, 2].map(|part| Heads::split(&qkv, part, d, heads));
    let [b, h, t, hd] = qh.dims;
    let pad = padding(&key_pad, b * t);
    let scale = 1.0 / (hd as f32).sqrt();

    let mut lse = vec![0.0f32; b * h * t];
    // SAFETY: q/k/v heads are `t × hd` with their own strides inside their
    // storage; `p` is `t × span.keys`; the gemms write their destinations
    // in full without reading them (a head with no key writes zeros); this
    // task's output columns `hi·hd .. (hi+1)·hd` of batch `bi` belong to no
    // other task, and the tasks together cover the output.
    let out = unsafe {
        buffer(b * t * d, |room| {
            let out_ptr = SharedMut(room.as_mut_ptr().cast());
            lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
                let (bi, hi) = (bh / h, bh % h);
                let pad = pad.map(|p| &p[bi * t..(bi + 1) * t]);
                let span = Span::new(t, pad, causal);
                let out_at = out_ptr.get().add(bi * t * d + hi * hd);
                if span.keys == 0 {
                    // Every key is padding: no query sees one (lse stays 0).
                    zero_rows(out_at, t, hd, d);
                    return;
                }
                let qm = Mat(qh.head(bi, hi), qh.row_stride(), qh.col_stride());
                let km = Mat(kh.head(bi, hi), kh.row_stride(), kh.col_stride());
                let vm = Mat(vh.head(bi, hi), vh.row_stride(), vh.col_stride());
                let mut p = square(span, hd, qm, km.t(), scale);
                softmax_rows(&mut p, lse, span, pad);
                if let Some(drop) = dropout {
                    drop.apply(&mut p, span, bh);
                }
                let om = Mat(out_at, d as isize, 1);
                let pm = Mat(p.as_ptr(), span.keys as isize, 1);
                // O = P V, each row block over the keys it sees.
                for (r0, r1, n) in span.row_blocks() {
                    matmul(r1 - r0, hd, n, om.at(r0, 0), pm.at(r0, 0), vm, 1.0);
                }
            })
        })
    };
    (
        from_vec(out, Shape::new([b, t, d])),
        from_vec(lse, Shape::new([b, h, t])),
    )
}

simd_levels! {
    /// Masked softmax of each row of `p` (`t × keys` scores, [`Span`]) in
    /// place, writing each row's log-sum-exp to `lse`. Masked keys get
    /// exactly 0.
    fn softmax_rows(p: &mut [f32], lse: &mut [f32], span: Span, pad: Option<&[f32]>) {
        const FMA: bool = has_fma!();
        for (i, (row, lse)) in p.chunks_exact_mut(span.keys).zip(lse.iter_mut()).enumerate() {
            let n = span.visible(i);
            mask_row(&mut row[..span.computed(i)], n, pad);
            let max = max_of(&row[..n]);
            if max == f32::NEG_INFINITY {
                row.fill(0.0);
                *lse = 0.0;
                continue;
            }
            for x in row[..n].iter_mut() {
                *x = math::exp::<FMA>(*x - max);
            }
            let inv = 1.0 / sum_of(&row[..n]);
            for x in row[..n].iter_mut() {
                *x *= inv;
            }
            *lse = max - inv.ln();
        }
    }
}

simd_levels! {
    /// Rebuilds the probabilities from the scores in `p` and each row's
    /// log-sum-exp, masked keys exactly 0.
    fn probabilities(p: &mut [f32], lse: &[f32], span: Span, pad: Option<&[f32]>) {
        const FMA: bool = has_fma!();
        for (i, row) in p.chunks_exact_mut(span.keys).enumerate() {
            let n = span.visible(i);
            mask_row(&mut row[..span.computed(i)], n, pad);
            for x in row[..n].iter_mut() {
                *x = math::exp::<FMA>(*x - lse[i]);
            }
        }
    }
}

simd_levels! {
    /// `dS = P ⊙ (dP − delta) · scale`, in place over `dp`; with `causal`, the
    /// keys a query does not see are 0 (beyond its row block [`square`] made them so).
    fn score_grads(dp: &mut [f32], p: &[f32], delta: &[f32], span: Span, scale: f32) {
        let rows = dp.chunks_exact_mut(span.keys).zip(p.chunks_exact(span.keys));
        for (i, (ds, p)) in rows.enumerate() {
            let n = span.visible(i);
            for (ds, &p) in ds[..n].iter_mut().zip(&p[..n]) {
                *ds = p * (*ds - delta[i]) * scale;
            }
            ds[n..span.computed(i)].fill(0.0);
        }
    }
}

/// A chunk of the fused LM head's rows ([`super::lm_loss`]), from their
/// logits (`[rows, padded]`, f32) and targets (`[rows, 1]`): each row's
/// cross-entropy over the first `vocab` columns (label smoothing ε: `(1 −
/// ε)` on the target, `ε / vocab` on each column) and, with `grads`,
/// their gradient with respect to the logits, `softmax − target`, written
/// over the logits (0 on the padding).
/// A row is one scan for its maximum, one for the exponentials (kiln's,
/// which vectorise, not libm's) and their sum, and with `grads` one to
/// scale them: where Burn's composition makes seven passes and four
/// buffers the size of the chunk. The rows go over rayon's threads; each
/// row's result does not depend on them.
pub(crate) fn lm_rows(
    logits: FlexTensor,
    targets: FlexTensor,
    vocab: usize,
    smoothing: f64,
    grads: bool,
) -> (Vec<f32>, Option<FlexTensor>) {
    let [rows, padded] = [shape(&logits)[0], shape(&logits)[1]];
    let targets: Vec<i64> = targets
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("integer targets");
    assert_eq!(targets.len(), rows, "lm_rows: a target a row");
    assert!(
        targets.iter().all(|&t| (0..vocab as i64).contains(&t)),
        "lm_rows: a target outside the vocabulary of {vocab}"
    );
    let eps = smoothing as f32;
    let mut losses = vec![0.0f32; rows];
    let grad = if grads {
        let mut g = owned(logits);
        let buf = writable(&mut g).expect("an owned tensor is writable");
        buf.par_chunks_mut(padded)
            .zip(losses.par_iter_mut())
            .zip(targets.par_iter())
            .for_each(|((row, loss), &t)| lm_row_grad(row, vocab, t as usize, eps, loss));
        Some(g)
    } else {
        let logits = contiguous(logits);
        slice(&logits)
            .par_chunks(padded)
            .zip(losses.par_iter_mut())
            .zip(targets.par_iter())
            .for_each(|((row, loss), &t)| lm_row_loss(row, vocab, t as usize, eps, loss));
        None
    };
    (losses, grad)
}

/// [`lm_rows`]'s losses summed in row order, as a `[1]` tensor.
pub(crate) fn lm_total(losses: &[f32]) -> FlexTensor {
    let total: f64 = losses.iter().map(|&l| f64::from(l)).sum();
    from_vec(vec![total as f32], Shape::new([1]))
}

/// [`lm_rows`]'s losses as a `[rows]` tensor.
pub(crate) fn lm_each(losses: Vec<f32>) -> FlexTensor {
    let rows = losses.len();
    from_vec(losses, Shape::new([rows]))
}

simd_levels! {
    /// One row's cross-entropy into `loss` ([`lm_rows`]), the logits left
    /// as they are.
    fn lm_row_loss(row: &[f32], vocab: usize, target: usize, eps: f32, loss: &mut f32) {
        const FMA: bool = has_fma!();
        let z = &row[..vocab];
        let max = max_of(z);
        let mut acc = [0.0f32; LANES];
        let chunks = z.chunks_exact(LANES);
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|&v| math::exp::<FMA>(v - max))
            .sum();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += math::exp::<FMA>(v - max);
            }
        }
        let lse = max + (acc.iter().sum::<f32>() + tail).ln();
        let spread = if eps != 0.0 { eps / vocab as f32 * sum_of(z) } else { 0.0 };
        *loss = lse - (1.0 - eps) * z[target] - spread;
    }
}

simd_levels! {
    /// One row's cross-entropy into `loss` and its gradient over the row
    /// ([`lm_rows`]).
    fn lm_row_grad(row: &mut [f32], vocab: usize, target: usize, eps: f32, loss: &mut f32) {
        const FMA: bool = has_fma!();
        let (z, padding) = row.split_at_mut(vocab);
        let max = max_of(z);
        let picked = z[target];
        let spread = if eps != 0.0 { eps / vocab as f32 * sum_of(z) } else { 0.0 };
        for x in z.iter_mut() {
            *x = math::exp::<FMA>(*x - max);
        }
        let sum = sum_of(z);
        *loss = max + sum.ln() - (1.0 - eps) * picked - spread;
        let (inv, share) = (1.0 / sum, eps / vocab as f32);
        for x in z.iter_mut() {
            *x = *x * inv - share;
        }
        z[target] += eps - 1.0;
        padding.fill(0.0);
    }
}

/// Lanes of the partial sums and maxima below: two AVX-512 registers, so
/// that the reductions vectorise (a single running f32 would not).
const LANES: usize = 32;

#[inline(always)]
fn sum_of(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ a·b`, in `LANES` partial sums.
#[inline(always)]
fn dot2(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (ca, cb) in ca.zip(cb) {
        for ((acc, &a), &b) in acc.iter_mut().zip(ca).zip(cb) {
            *acc += a * b;
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `Σ a·b·c`, in `LANES` partial sums.
#[inline(always)]
fn dot3(a: &[f32], b: &[f32], c: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let tail: f32 = (ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .zip(cc.remainder()))
    .map(|((a, b), c)| a * b * c)
    .sum();
    for ((ca, cb), cc) in ca.zip(cb).zip(cc) {
        for (((acc, &a), &b), &c) in acc.iter_mut().zip(ca).zip(cb).zip(cc) {
            *acc += a * b * c;
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[inline(always)]
fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a = if v > *a { v } else { *a };
        }
    }
    acc.iter().fold(tail, |m, &v| if v > m { v } else { m })
}

/// Masks the keys a query may not see: those from `n` on are set to 0 (the
/// callers exponentiate only `row[..n]`), padding keys among the first `n`
/// to −∞ (which `math::exp` turns into exactly 0).
#[inline(always)]
fn mask_row(row: &mut [f32], n: usize, pad: Option<&[f32]>) {
    row[n..].fill(0.0);
    if let Some(pad) = pad {
        for (x, &p) in row[..n].iter_mut().zip(pad) {
            if p > 0.5 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The gradient of [`attention`] with respect to its packed `qkv`, from the
/// output gradient `grad` (`[batch, time, d]`), the forward's output and
/// log-sum-exp. The probabilities are rebuilt per head from q, k and the
/// log-sum-exp rather than kept from the forward pass; each head writes its
/// query, key and value gradients straight into its columns of one
/// `[batch, time, 3·d]` buffer.
pub(crate) fn attention_backward(
    qkv: FlexTensor,
    key_pad: FlexTensor,
    spec: super::AttentionSpec,
    out: FlexTensor,
    lse: FlexTensor,
    grad: FlexTensor,
) -> FlexTensor {
    let (heads, causal, dropout) = (spec.heads, spec.causal, spec.dropout);
    let (qkv, out, grad) = (positive(qkv), positive(out), positive(grad));
    let (key_pad, lse) = (contiguous(key_pad), contiguous(lse));
    let d = qkv.layout().shape()[2] / 3;
    let [qh, kh, vh] = [0, 1, 2].map(|part| Heads::split(&qkv, part, d, heads));
    let (oh, gh) = (
        Heads::split(&out, 0, d, heads),
        Heads::split(&grad, 0, d, heads),
    );
    let [b, h, t, hd] = qh.dims;
    let pad = padding(&key_pad, b * t);
    let lse = slice(&lse);
    let scale = 1.0 / (hd as f32).sqrt();

    let row = (3 * d) as isize;
    // SAFETY: as in `attention`; each task writes only its own head's
    // columns of dq, dk and dv (zeros for the keys past its span), and the
    // tasks together cover dqkv.
    let dqkv = unsafe {
        buffer(b * t * 3 * d, |room| {
            let dqkv_ptr = SharedMut(room.as_mut_ptr().cast());
            (0..b * h).into_par_iter().for_each(|bh| {
                let (bi, hi) = (bh / h, bh % h);
                let pad = pad.map(|p| &p[bi * t..(bi + 1) * t]);
                let span = Span::new(t, pad, causal);
                // This head's columns of dq, dk and dv in the packed gradient.
                let part = |part: usize| {
                    let at = bi * t * 3 * d + part * d + hi * hd;
                    Mat(dqkv_ptr.get().add(at), row, 1)
                };
                // Keys no query sees (trailing padding; all of them when
                // every key is padding) get no gradient, nor, with no key
                // to see, do the queries.
                if span.keys < t {
                    for which in [1, 2] {
                        let from = part(which).at(span.keys, 0).0.cast_mut();
                        zero_rows(from, t - span.keys, hd, 3 * d);
                    }
                }
                if span.keys == 0 {
                    zero_rows(part(0).0.cast_mut(), t, hd, 3 * d);
                    return;
                }
                let lse = &lse[bh * t..(bh + 1) * t];
                // Row i of `delta`: Σ_c dO[i, c] · O[i, c].
                let delta: Vec<f32> = (0..t)
                    .map(|i| match (gh.row(bi, hi, i), oh.row(bi, hi, i)) {
                        (Some(g), Some(o)) => dot2(g, o),
                        _ => (0..hd)
                            .map(|c| gh.at(bi, hi, i, c) * oh.at(bi, hi, i, c))
                            .sum(),
                    })
                    .collect();
                let qm = Mat(qh.head(bi, hi), qh.row_stride(), qh.col_stride());
                let km = Mat(kh.head(bi, hi), kh.row_stride(), kh.col_stride());
                let vm = Mat(vh.head(bi, hi), vh.row_stride(), vh.col_stride());
                let gm = Mat(gh.head(bi, hi), gh.row_stride(), gh.col_stride());
                let mut p = square(span, hd, qm, km.t(), scale);
                probabilities(&mut p, lse, span, pad);
                let width = span.keys as isize;
                // dP = dO Vᵀ (with dropout, of the dropped-out
                // probabilities: through the mask, the gradient of P), then
                // dS = P ⊙ (dP − delta) · scale, into dp. `delta` is the
                // same with dropout: Σ_j P ⊙ dP = dO · O.
                let mut dp = square(span, hd, gm, vm.t(), 1.0);
                if let Some(drop) = dropout {
                    drop.apply(&mut dp, span, bh);
                }
                score_grads(&mut dp, &p, &delta, span, scale);
                let dsm = Mat(dp.as_ptr(), width, 1);
                // dQ = dS K, each query block over the keys it sees.
                for (r0, r1, n) in span.row_blocks() {
                    matmul(r1 - r0, hd, n, part(0).at(r0, 0), dsm.at(r0, 0), km, 1.0);
                }
                // dK = dSᵀ Q and dV = P′ᵀ dO (P′ the probabilities that
                // weighed the values: dropped out with dropout), each key
                // block over the queries that see it: with the causal mask,
                // queries from its first key on.
                if let Some(drop) = dropout {
                    drop.apply(&mut p, span, bh);
                }
                let pm = Mat(p.as_ptr(), width, 1);
                for (which, weights, by) in [(1, dsm, qm), (2, pm, gm)] {
                    for (c0, c1, from) in span.key_blocks() {
                        let (dst, lhs) = (part(which).at(c0, 0), weights.at(from, c0).t());
                        matmul(c1 - c0, hd, t - from, dst, lhs, by.at(from, 0), 1.0);
                    }
                }
            })
        })
    };
    from_vec(dqkv, Shape::new([b, t, 3 * d]))
}

/// Rows per rayon task in the LayerNorm kernels.
const ROWS: usize = 64;

/// LayerNorm over the last dimension: `(x − mean) / √(var + eps) · gamma +
/// beta`, one pass per row. Returns the output and each row's mean and
/// reciprocal standard deviation (`[rows]`), which the backward pass uses.
pub(crate) fn layer_norm(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    epsilon: f64,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (x, gamma, beta) = (contiguous(x), contiguous(gamma), contiguous(beta));
    let (xs, g, b) = (slice(&x), slice(&gamma), slice(&beta));
    let d = g.len();
    assert_eq!(b.len(), d, "layer_norm: beta's length differs from gamma's");
    assert_eq!(
        xs.len() % d,
        0,
        "layer_norm: last dimension is not gamma's length"
    );
    let rows = xs.len() / d;
    let mut mean = vec![0.0f32; rows];
    let mut rstd = vec![0.0f32; rows];
    // SAFETY: the chunks cover the buffer, and each is written in full.
    let y = unsafe {
        buffer(xs.len(), |room| {
            room.par_chunks_mut(ROWS * d)
                .zip(xs.par_chunks(ROWS * d))
                .zip(mean.par_chunks_mut(ROWS).zip(rstd.par_chunks_mut(ROWS)))
                .for_each(|((y, x), (mean, rstd))| {
                    layer_norm_rows(x, g, b, epsilon as f32, zeroed(y), mean, rstd)
                })
        })
    };
    let stats = |v: Vec<f32>| from_vec(v, Shape::new([rows]));
    (from_vec(y, shape(&x)), stats(mean), stats(rstd))
}

simd_levels! {
    fn layer_norm_rows(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        epsilon: f32,
        y: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        let d = gamma.len();
        let inv_d = 1.0 / d as f32;
        for (((x, y), mean), rstd) in x
            .chunks_exact(d)
            .zip(y.chunks_exact_mut(d))
            .zip(mean.iter_mut())
            .zip(rstd.iter_mut())
        {
            let mu = sum_of(x) * inv_d;
            for (y, &x) in y.iter_mut().zip(x) {
                *y = x - mu;
            }
            let mut sq = [0.0f32; LANES];
            let chunks = y.chunks_exact(LANES);
            let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
            for c in chunks {
                for (a, &v) in sq.iter_mut().zip(c) {
                    *a += v * v;
                }
            }
            let var = (sq.iter().sum::<f32>() + tail) * inv_d;
            let r = 1.0 / (var + epsilon).sqrt();
            for ((y, &g), &b) in y.iter_mut().zip(gamma).zip(beta) {
                *y = *y * r * g + b;
            }
            *mean = mu;
            *rstd = r;
        }
    }
}

/// LayerNorm's backward: the gradients of x, gamma and beta from the
/// output gradient and the forward's row statistics.
pub(crate) fn layer_norm_backward(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    rstd: FlexTensor,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (x, gamma, grad) = (contiguous(x), contiguous(gamma), contiguous(grad));
    let (mean, rstd) = (contiguous(mean), contiguous(rstd));
    let (xs, g, dy) = (slice(&x), slice(&gamma), slice(&grad));
    let (mean, rstd) = (slice(&mean), slice(&rstd));
    let d = g.len();
    // Each task's partial sums of dgamma and dbeta, added up below.
    let mut partials: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
    // SAFETY: the chunks cover the buffer, and each is written in full.
    let dx = unsafe {
        buffer(xs.len(), |room| {
            partials = room
                .par_chunks_mut(ROWS * d)
                .zip(xs.par_chunks(ROWS * d))
                .zip(dy.par_chunks(ROWS * d))
                .zip(mean.par_chunks(ROWS).zip(rstd.par_chunks(ROWS)))
                .map(|(((dx, x), dy), (mean, rstd))| {
                    let mut dgamma = vec![0.0f32; d];
                    let mut dbeta = vec![0.0f32; d];
                    let dx = zeroed(dx);
                    layer_norm_grad_rows(x, dy, g, mean, rstd, dx, &mut dgamma, &mut dbeta);
                    (dgamma, dbeta)
                })
                .collect()
        })
    };
    let mut dgamma = vec![0.0f32; d];
    let mut dbeta = vec![0.0f32; d];
    for (pg, pb) in &partials {
        column_sums(pg, &mut dgamma);
        column_sums(pb, &mut dbeta);
    }
    (
        from_vec(dx, shape(&x)),
        from_vec(dgamma, Shape::new([d])),
        from_vec(dbeta, Shape::new([d])),
    )
}

simd_levels! {
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_grad_rows(
        x: &[f32],
        dy: &[f32],
        gamma: &[f32],
        mean: &[f32],
        rstd: &[f32],
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
    ) {
        let d = gamma.len();
        let inv_d = 1.0 / d as f32;
        for ((((x, dy), dx), &mu), &r) in x
            .chunks_exact(d)
            .zip(dy.chunks_exact(d))
            .zip(dx.chunks_exact_mut(d))
            .zip(mean)
            .zip(rstd)
        {
            // dx holds x̂ first; dx̂ = dy · gamma, c1 = mean(dx̂ · x̂), c2 = mean(dx̂).
            for ((((dx, &x), &dy), dg), db) in dx
                .iter_mut()
                .zip(x)
                .zip(dy)
                .zip(dgamma.iter_mut())
                .zip(dbeta.iter_mut())
            {
                let xhat = (x - mu) * r;
                *dx = xhat;
                *dg += dy * xhat;
                *db += dy;
            }
            let c1 = dot3(dy, gamma, dx) * inv_d;
            let c2 = dot2(dy, gamma) * inv_d;
            for ((dx, &dy), &g) in dx.iter_mut().zip(dy).zip(gamma) {
                *dx = r * (dy * g - c2 - *dx * c1);
            }
        }
    }
}

/// A `[rows, cols]` matrix's storage pointer and strides.
fn matrix(t: &FlexTensor) -> Mat {
    let layout = t.layout();
    let strides = layout.strides();
    let [rs, cs] = [strides[0], strides[1]];
    Mat(t.storage::<f32>()[layout.start_offset()..].as_ptr(), rs, cs)
}

/// A 2-D tensor's `[rows, cols]` (`what` names it where it is not 2-D).
fn dims2(t: &FlexTensor, what: &str) -> [usize; 2] {
    t.layout()
        .shape()
        .as_slice()
        .try_into()
        .unwrap_or_else(|_| panic!("{what} is not 2-D"))
}

/// A linear layer's `[in, out]`.
fn weight_dims(weight: &FlexTensor) -> [usize; 2] {
    dims2(weight, "linear: the weight ([in, out])")
}

/// Output rows each task of [`linear_rows`] computes at most. Measured on
/// a Zen 3 (AVX2, 2 threads) against the bias written into the whole output
/// first and one gemm over all rows split by gemm itself: 1.03–1.20× as
/// fast at the GPT's width of 128, 1.11–1.13× at 384 and 768; 128 or 512
/// rows were no better (docs/PERFORMANCE.md).
const LINEAR_CHUNK_ROWS: usize = 256;

/// The row ranges of [`linear_rows`]' tasks: whole blocks of 16 rows (the
/// product's micro-kernel height), at most [`LINEAR_CHUNK_ROWS`] a task, as
/// many tasks as a multiple of `threads` and their sizes within one block
/// of each other, so that every thread gets the same share. 768 rows (the
/// `cpu` preset's 12 × 64 tokens) on 2 threads are 4 tasks of 192 rows,
/// where a fixed 256 made 3 and left one thread waiting while the other
/// did two. The ranges depend on the row and thread counts only.
fn linear_chunks(rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    let blocks = rows.div_ceil(16);
    let tasks = blocks
        .div_ceil(LINEAR_CHUNK_ROWS / 16)
        .next_multiple_of(threads.max(1))
        .min(blocks);
    (0..tasks)
        .map(|i| (i * blocks / tasks * 16).min(rows)..((i + 1) * blocks / tasks * 16).min(rows))
        .collect()
}

/// `room`'s rows of `n` in [`linear_chunks`], each with its first row's
/// index, for rayon's threads.
fn row_chunks<T: Send>(
    room: &mut [T],
    n: usize,
    threads: usize,
) -> impl ParallelIterator<Item = (usize, &mut [T])> {
    let mut rest = room;
    let mut tasks = Vec::new();
    for range in linear_chunks(rest.len() / n, threads) {
        let (out, tail) = std::mem::take(&mut rest).split_at_mut(range.len() * n);
        tasks.push((range.start, out));
        rest = tail;
    }
    tasks.into_par_iter()
}

/// `room (rows × n) = lhs (rows × k) · weight (k × n) + bias`: the rows in
/// chunks of [`linear_chunks`], each on a rayon task that writes its
/// chunk's bias and then adds one single-threaded gemm's product onto it,
/// while the chunk is still in cache (the bias written into the whole
/// output first, as before, cost up to 10 % of the product at the GPT's
/// width). The chunks depend on the row and thread counts only, so a run
/// is bitwise repeatable with the same thread count.
///
/// # Safety
/// `lhs` must hold `rows × k` values, `bias` `n`, and `weight` must be a
/// `k × n` f32 tensor with non-negative strides; `linear_rows` writes all
/// of `room`.
unsafe fn linear_rows(
    room: &mut [MaybeUninit<f32>],
    lhs: &[f32],
    weight: &FlexTensor,
    bias: &[f32],
) {
    let n = bias.len();
    if n == 0 {
        return;
    }
    let rows = room.len() / n;
    let k = lhs.len() / rows.max(1);
    row_chunks(room, n, rayon::current_num_threads()).for_each(|(r0, out)| {
        for row in out.chunks_exact_mut(n) {
            for (y, &b) in row.iter_mut().zip(bias) {
                y.write(b);
            }
        }
        let lhs = Mat(lhs[r0 * k..].as_ptr(), k as isize, 1);
        let dst = Mat(out.as_mut_ptr().cast(), n as isize, 1);
        // SAFETY: the chunk's rows of lhs and of room (the caller's
        // shapes); every element of the chunk holds its bias.
        unsafe {
            gemm_call(
                out.len() / n,
                n,
                k,
                dst,
                lhs,
                matrix(weight),
                1.0,
                true,
                gemm::Parallelism::None,
            )
        }
    });
}

/// `a · b` for 2-D f32 tensors of any non-negative strides (the fused LM
/// head's products, two of them over transposed views): the rows of `a`
/// in [`linear_chunks`] over the threads, one single-threaded gemm a
/// chunk, where Burn's flex runs a product below 192³ multiply-adds on one
/// thread (a character model's head: 768 × 128 × 65). With fewer than 16
/// rows a thread, gemm splits the product itself.
pub(crate) fn product(a: FlexTensor, b: FlexTensor) -> FlexTensor {
    let (a, b) = (positive(a), positive(b));
    let ([m, k], [k_b, n]) = (dims2(&a, "product: a"), dims2(&b, "product: b"));
    assert_eq!(k, k_b, "product: the inner dimensions differ");
    if m * n * k == 0 {
        // An empty product, or a sum over nothing.
        return from_vec(vec![0.0; m * n], Shape::new([m, n]));
    }
    let threads = rayon::current_num_threads();
    // SAFETY: `a` is `m × k` and `b` `k × n` with the strides `matrix`
    // reads; each task's gemm writes its own rows of the fresh `m × n`
    // destination in full without reading them, and the chunks cover it.
    let c = unsafe {
        buffer(m * n, |room| {
            if m < 16 * threads {
                let dst = Mat(room.as_mut_ptr().cast(), n as isize, 1);
                gemm_call(
                    m,
                    n,
                    k,
                    dst,
                    matrix(&a),
                    matrix(&b),
                    1.0,
                    false,
                    ALL_THREADS,
                );
                return;
            }
            row_chunks(room, n, threads).for_each(|(r0, out)| {
                let dst = Mat(out.as_mut_ptr().cast(), n as isize, 1);
                // Rows `r0 ..` of `a` lie inside it: the chunks are its rows.
                let lhs = matrix(&a).at(r0, 0);
                let rows = out.len() / n;
                let serial = gemm::Parallelism::None;
                gemm_call(rows, n, k, dst, lhs, matrix(&b), 1.0, false, serial);
            });
        })
    };
    from_vec(c, Shape::new([m, n]))
}

/// A linear layer, `x · weight + bias` over the last dimension of `x`
/// (`weight` is `[in, out]`, Burn's layout): all rows at once whatever the
/// batch shape, in chunks of rows over the threads ([`linear_rows`]), each
/// chunk's bias written first and the product added onto it.
pub(crate) fn linear(x: FlexTensor, weight: FlexTensor, bias: FlexTensor) -> FlexTensor {
    let (x, weight, bias) = (contiguous(x), positive(weight), contiguous(bias));
    let [d_in, d_out] = weight_dims(&weight);
    let xs = slice(&x);
    let b = slice(&bias);
    assert_eq!(
        b.len(),
        d_out,
        "linear: bias length differs from the weight's outputs"
    );
    assert!(
        xs.len().is_multiple_of(d_in),
        "linear: input width is not the weight's inputs"
    );
    let rows = xs.len() / d_in;
    // SAFETY: `linear_rows` writes every row of y (the bias, then the
    // product added); x is `rows × d_in` contiguous, the weight
    // `d_in × d_out`, the bias `d_out` (checked above).
    let y = unsafe { buffer(rows * d_out, |room| linear_rows(room, xs, &weight, b)) };
    let mut dims = shape(&x).as_slice().to_vec();
    *dims.last_mut().expect("linear: input has a last dimension") = d_out;
    from_vec(y, Shape::from(dims))
}

/// The linear layer's backward: `dx = grad · weightᵀ` (one gemm over all
/// rows), `dweight = xᵀ · grad` ([`weight_grad`]: the rows split over the
/// threads) and `dbias` = the column sums of `grad`.
pub(crate) fn linear_backward(
    x: FlexTensor,
    weight: FlexTensor,
    grad: FlexTensor,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let (x, weight, grad) = (contiguous(x), positive(weight), contiguous(grad));
    let [d_in, d_out] = weight_dims(&weight);
    let (xs, gs) = (slice(&x), slice(&grad));
    let rows = xs.len() / d_in;
    let w = matrix(&weight);
    let g = Mat(gs.as_ptr(), d_out as isize, 1);
    // SAFETY: the shapes above; the destination is a fresh buffer that the
    // gemm writes in full without reading it. (In chunks of rows, as the
    // forward product, it was no faster in the step: docs/PERFORMANCE.md.)
    let dx = unsafe {
        buffer(rows * d_in, |room| {
            let dx = Mat(room.as_mut_ptr().cast(), d_in as isize, 1);
            gemm_call(rows, d_in, d_out, dx, g, w.t(), 1.0, false, ALL_THREADS)
        })
    };
    let dw = weight_grad(xs, gs, d_in, d_out, dw_parts(rows, d_in, d_out));
    let partials: Vec<Vec<f32>> = gs
        .par_chunks(ROWS * d_out)
        .map(|g| {
            let mut sums = vec![0.0f32; d_out];
            column_sums(g, &mut sums);
            sums
        })
        .collect();
    let mut db = vec![0.0f32; d_out];
    for part in &partials {
        column_sums(part, &mut db);
    }
    (
        from_vec(dx, shape(&x)),
        from_vec(dw, Shape::new([d_in, d_out])),
        from_vec(db, Shape::new([d_out])),
    )
}

/// Rows of the reduction each part of a split weight gradient gets at
/// least: below that a part's gemm is mostly packing.
const DW_PART_ROWS: usize = 256;

/// Floats the partial weight gradients beyond the first may take together
/// (64 MiB): the split holds one `d_in × d_out` buffer per part.
const DW_PARTIAL_FLOATS: usize = 1 << 24;

/// How many parts [`weight_grad`] splits the reduction over `rows` into:
/// one per rayon thread where the rows and the memory allow, else 1.
fn dw_parts(rows: usize, d_in: usize, d_out: usize) -> usize {
    let threads = rayon::current_num_threads();
    let by_memory = 1 + DW_PARTIAL_FLOATS / (d_in * d_out).max(1);
    threads.min(rows / DW_PART_ROWS).min(by_memory).max(1)
}

/// The weight gradient `xᵀ · g` (`d_in × d_out`) of `rows` rows of `x`
/// (`rows × d_in`) and `g` (`rows × d_out`), both contiguous. Its output is
/// small and its reduction long (the batch's every token), which gemm does
/// not split: at the GPT's shapes on two threads the product with the rows
/// split ran 1.03–2.25× as fast as gemm's own split (docs/PERFORMANCE.md,
/// the 65-wide head the most). So with
/// `parts > 1` each part reduces a contiguous share of the rows into its own
/// buffer (one gemm each, on its own threads), and the parts are summed in
/// order: the result depends on `parts`, which [`dw_parts`] takes from the
/// thread count, so a run is still bitwise repeatable on the same machine.
fn weight_grad(xs: &[f32], gs: &[f32], d_in: usize, d_out: usize, parts: usize) -> Vec<f32> {
    let rows = xs.len() / d_in.max(1);
    assert_eq!(gs.len(), rows * d_out, "weight_grad: x and g rows differ");
    // One part's gemm over rows `r0 .. r1`, with `parallelism`.
    let part = |r0: usize, r1: usize, parallelism| {
        // SAFETY: rows `r0 .. r1` of x and g lie inside the slices (checked
        // above); the destination is a fresh `d_in × d_out` buffer that the
        // gemm writes in full without reading it.
        unsafe {
            buffer(d_in * d_out, |room| {
                let xt = Mat(xs.as_ptr().add(r0 * d_in), d_in as isize, 1).t();
                let g = Mat(gs.as_ptr().add(r0 * d_out), d_out as isize, 1);
                let dw = Mat(room.as_mut_ptr().cast(), d_out as isize, 1);
                gemm_call(d_in, d_out, r1 - r0, dw, xt, g, 1.0, false, parallelism)
            })
        }
    };
    if parts <= 1 {
        return part(0, rows, ALL_THREADS);
    }
    // Threads beyond one per part go to each part's gemm.
    let per_part = rayon::current_num_threads() / parts;
    let parallelism = if per_part > 1 {
        gemm::Parallelism::Rayon(per_part)
    } else {
        gemm::Parallelism::None
    };
    let share = rows.div_ceil(parts);
    let mut partials: Vec<Vec<f32>> = (0..parts)
        .into_par_iter()
        .map(|p| {
            part(
                (p * share).min(rows),
                ((p + 1) * share).min(rows),
                parallelism,
            )
        })
        .collect();
    let mut dw = partials.remove(0);
    dw.par_chunks_mut(CHUNK).enumerate().for_each(|(c, sums)| {
        for other in &partials {
            column_sums(&other[c * CHUNK..][..sums.len()], sums);
        }
    });
    dw
}

simd_levels! {
    /// Adds each row of `rows` (rows of `sums.len()`) into `sums`: the
    /// column sums, or with one row an element-wise add (the partial sums
    /// of the kernels' parallel reductions).
    fn column_sums(rows: &[f32], sums: &mut [f32]) {
        for row in rows.chunks_exact(sums.len()) {
            for (s, &v) in sums.iter_mut().zip(row) {
                *s += v;
            }
        }
    }
}

simd_levels! {
    fn adamw_slice(f: &Factors, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
            (*w, *m, *v) = update(f, *w, g, *m, *v);
        }
    }
}

/// AdamW's update, written over the weight and the moments (copies of them
/// where they are shared): the new weight, first and second moment.
pub(crate) fn adamw(
    weight: FlexTensor,
    grad: FlexTensor,
    m: FlexTensor,
    v: FlexTensor,
    f: Factors,
) -> (FlexTensor, FlexTensor, FlexTensor) {
    let grad = contiguous(grad);
    let [mut weight, mut m, mut v] = [weight, m, v].map(owned);
    let g = slice(&grad);
    let (Some(ws), Some(ms), Some(vs)) =
        (writable(&mut weight), writable(&mut m), writable(&mut v))
    else {
        unreachable!("`owned` returns writable tensors")
    };
    assert!(
        ws.len() == g.len() && ms.len() == g.len() && vs.len() == g.len(),
        "AdamW: the weight, gradient and moments differ in size"
    );
    ws.par_chunks_mut(CHUNK)
        .zip(g.par_chunks(CHUNK))
        .zip(ms.par_chunks_mut(CHUNK))
        .zip(vs.par_chunks_mut(CHUNK))
        .for_each(|(((w, g), m), v)| adamw_slice(&f, w, g, m, v));
    (weight, m, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `xᵀ · g` in f64, the plain triple loop.
    fn reference_weight_grad(xs: &[f32], gs: &[f32], d_in: usize, d_out: usize) -> Vec<f64> {
        let mut dw = vec![0.0f64; d_in * d_out];
        for (x, g) in xs.chunks_exact(d_in).zip(gs.chunks_exact(d_out)) {
            for (i, &xi) in x.iter().enumerate() {
                for (j, &gj) in g.iter().enumerate() {
                    dw[i * d_out + j] += f64::from(xi) * f64::from(gj);
                }
            }
        }
        dw
    }

    #[test]
    fn the_weight_gradient_split_over_the_rows_sums_every_row_once() {
        // 215 rows in 1, 2, 3 (shares of 72, 72, 71) and 7 parts, and more
        // parts than rows (empty parts write zeros); 9 → 13 and a product
        // wide enough for gemm's blocking (70 → 130).
        for (d_in, d_out) in [(9, 13), (70, 130)] {
            for rows in [215, 5] {
                let value =
                    |i: usize, scale: f32| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * scale;
                let xs: Vec<f32> = (0..rows * d_in).map(|i| value(i, 2.0)).collect();
                let gs: Vec<f32> = (0..rows * d_out).map(|i| value(i + 17, 0.5)).collect();
                let expected = reference_weight_grad(&xs, &gs, d_in, d_out);
                for parts in [1, 2, 3, 7] {
                    let dw = weight_grad(&xs, &gs, d_in, d_out, parts);
                    assert_eq!(dw.len(), d_in * d_out);
                    let worst = dw
                        .iter()
                        .zip(&expected)
                        .map(|(&a, &b)| (f64::from(a) - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        worst < 1e-4,
                        "{rows} rows, {d_in} → {d_out}, {parts} parts: off by {worst}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_weight_gradient_is_split_only_when_each_part_has_rows_enough() {
        let threads = rayon::current_num_threads();
        assert_eq!(dw_parts(DW_PART_ROWS - 1, 128, 128), 1);
        assert_eq!(dw_parts(4096, 128, 128), threads.min(4096 / DW_PART_ROWS));
        // A weight so large that one partial buffer is the memory allowed.
        assert_eq!(dw_parts(1 << 20, 1 << 12, 1 << 12), threads.min(2));
    }

    #[test]
    fn the_row_chunked_linear_writes_every_row_with_its_bias() {
        // Row counts below one chunk, at a chunk's edge and over several
        // chunks with a ragged last one. The room starts as NaN, so a row
        // no chunk wrote shows.
        let value = |i: usize, scale: f32| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * scale;
        let (k, n) = (37, 70);
        let ws: Vec<f32> = (0..k * n).map(|i| value(i + 11, 1.0)).collect();
        let weight = from_vec(ws.clone(), Shape::new([k, n]));
        let bias: Vec<f32> = (0..n).map(|i| value(i + 5, 4.0)).collect();
        for rows in [1, 15, 16, 17, 256, 300, 600] {
            let lhs: Vec<f32> = (0..rows * k).map(|i| value(i, 2.0)).collect();
            let mut room = vec![MaybeUninit::new(f32::NAN); rows * n];
            // SAFETY: lhs is rows × k, the weight k × n, the bias n, the
            // room rows × n.
            unsafe { linear_rows(&mut room, &lhs, &weight, &bias) };
            for r in 0..rows {
                for j in 0..n {
                    let product: f64 = (0..k)
                        .map(|i| f64::from(lhs[r * k + i]) * f64::from(ws[i * n + j]))
                        .sum();
                    let expected = product + f64::from(bias[j]);
                    // SAFETY: written with a value or left NaN.
                    let got = unsafe { room[r * n + j].assume_init() };
                    assert!(
                        (f64::from(got) - expected).abs() < 1e-4,
                        "{rows} rows: row {r} column {j} is {got}, not {expected}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_row_split_product_matches_the_sum_over_any_strides() {
        // Fewer rows than 16 a thread (gemm's own split), one chunk, and
        // several with a ragged last one; operands contiguous and as
        // transposed views (the LM head's `Gᵀ · X` and `X · Wᵀ`); an
        // empty sum is zeros.
        let value = |i: usize, scale: f32| ((i * 7919 % 1009) as f32 / 1009.0 - 0.5) * scale;
        for (m, k, n) in [
            (3, 37, 65),
            (16, 37, 65),
            (300, 37, 65),
            (601, 130, 7),
            (5, 0, 4),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| value(i, 2.0)).collect();
            let b: Vec<f32> = (0..k * n).map(|i| value(i + 11, 1.0)).collect();
            let expected = |r: usize, j: usize| -> f64 {
                (0..k)
                    .map(|i| f64::from(a[r * k + i]) * f64::from(b[i * n + j]))
                    .sum()
            };
            let transposed = |v: &[f32], rows: usize, cols: usize| {
                let t: Vec<f32> = (0..rows * cols)
                    .map(|i| v[(i % rows) * cols + i / rows])
                    .collect();
                from_vec(t, Shape::new([cols, rows])).transpose(0, 1)
            };
            let ways = [
                (
                    from_vec(a.clone(), Shape::new([m, k])),
                    from_vec(b.clone(), Shape::new([k, n])),
                ),
                (transposed(&a, m, k), transposed(&b, k, n)),
            ];
            for (way, (at, bt)) in ways.into_iter().enumerate() {
                let c = product(at, bt);
                assert_eq!(shape(&c).as_slice(), [m, n]);
                let got = slice(&contiguous(c)).to_vec();
                for r in 0..m {
                    for j in 0..n {
                        let g = f64::from(got[r * n + j]);
                        assert!(
                            (g - expected(r, j)).abs() < 1e-4,
                            "{m} × {k} × {n}, way {way}: ({r}, {j}) is {g}, not {}",
                            expected(r, j)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_thread_gets_the_same_share_of_a_linear_layers_rows() {
        for threads in 1..=32 {
            for rows in (1..=64 * threads).chain([768, 1000, 4352, 1 << 20]) {
                let chunks = linear_chunks(rows, threads);
                let at = format!("{rows} rows on {threads} threads: {chunks:?}");
                // Every row once, in order, in whole 16-row blocks.
                assert_eq!(chunks[0].start, 0, "{at}");
                assert_eq!(chunks.last().map(|c| c.end), Some(rows), "{at}");
                for pair in chunks.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start, "{at}");
                }
                for c in &chunks {
                    assert!(!c.is_empty() && c.start.is_multiple_of(16), "{at}");
                    assert!(c.len() <= LINEAR_CHUNK_ROWS, "{at}");
                }
                // As many tasks as a multiple of the threads (or one
                // block each), within one block of each other.
                let blocks = rows.div_ceil(16);
                assert!(
                    chunks.len().is_multiple_of(threads) || chunks.len() == blocks,
                    "{at}"
                );
                let full = &chunks[..chunks.len() - 1];
                let (lo, hi) = full.iter().fold((usize::MAX, 0), |(lo, hi), c| {
                    (lo.min(c.len()), hi.max(c.len()))
                });
                assert!(full.is_empty() || hi - lo <= 16, "{at}");
            }
        }
        // The `cpu` preset's 12 × 64 tokens on 2 threads: 4 tasks of 192.
        assert_eq!(
            linear_chunks(768, 2),
            [0..192, 192..384, 384..576, 576..768]
        );
    }
}
