//! Walking a module's float parameters by path: reading them to the host and
//! replacing them from host data (checkpoints), in one deterministic order.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};

/// A float parameter: its dotted path (`blocks.0.qkv.weight`), id and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParamEntry {
    pub(crate) path: String,
    pub(crate) id: ParamId,
    pub(crate) shape: Vec<usize>,
}

/// Visits float parameters with their dotted path (Burn's derive calls
/// `enter_module` / `exit_module` around every field, parameters included),
/// reading their values to the host when asked.
struct PathVisitor {
    stack: Vec<String>,
    read_values: bool,
    out: Vec<(ParamEntry, Vec<f32>)>,
}

impl ModuleVisitor for PathVisitor {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.stack.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.stack.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let tensor = param.val();
        let values = if self.read_values {
            host(&tensor)
        } else {
            Vec::new()
        };
        let entry = ParamEntry {
            path: self.stack.join("."),
            id: param.id,
            shape: tensor.dims().to_vec(),
        };
        self.out.push((entry, values));
    }
}

fn visit_paths<M: Module>(module: &M, read_values: bool) -> Vec<(ParamEntry, Vec<f32>)> {
    let mut v = PathVisitor {
        stack: Vec::new(),
        read_values,
        out: Vec::new(),
    };
    module.visit(&mut v);
    v.out
}

/// Every float parameter of `module`, in visiting order.
pub(crate) fn param_entries<M: Module>(module: &M) -> Vec<ParamEntry> {
    visit_paths(module, false)
        .into_iter()
        .map(|(e, _)| e)
        .collect()
}

/// A parameter's path (or a file's tensor name), its shape and values.
pub(crate) type NamedValues = (String, Vec<usize>, Vec<f32>);

/// Every float parameter's values on the host, by path.
pub(crate) fn param_values<M: Module>(module: &M) -> Vec<NamedValues> {
    visit_paths(module, true)
        .into_iter()
        .map(|(e, v)| (e.path, e.shape, v))
        .collect()
}

/// Host values of a tensor.
pub(crate) fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    f32_values(t.to_data())
}

/// `data`'s values as f32: converted (bf16, f16) or taken as they are, in
/// one pass; `TensorData::iter` goes through a boxed iterator value by
/// value, which cost the gradients' trip through the host a few ms a step
/// (a job of one rank on the CPU, 0.8 M parameters).
pub(crate) fn f32_values(data: TensorData) -> Vec<f32> {
    data.try_into_vec_as::<f32>()
        .unwrap_or_else(|e| panic!("a float tensor's values as f32: {e}"))
}

/// Appends `data`'s values, as f32, to `out`: [`f32_values`] without the
/// vector of its own.
pub(crate) fn extend_f32(out: &mut Vec<f32>, data: TensorData) {
    out.extend_from_slice(f32_slice(&data.convert::<f32>()));
}

/// The values of `data`, converted to f32 already, as a slice.
pub(crate) fn f32_slice(data: &TensorData) -> &[f32] {
    data.as_slice::<f32>()
        .unwrap_or_else(|e| panic!("a float tensor's values as f32: {e}"))
}

/// A tensor of `shape` from host values.
pub(crate) fn tensor_from<const D: usize>(
    values: Vec<f32>,
    shape: &[usize],
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape.to_vec()), device)
}

/// `w` (flat, without autodiff's wrapper) in `tensor`'s place: its shape,
/// `require_grad` and gradient-checkpointing strategy (a property of the
/// tensor) kept.
pub(crate) fn replaced<const D: usize>(tensor: &Tensor<D>, w: Tensor<1>) -> Tensor<D> {
    let mut updated = Tensor::from_inner(w.reshape(tensor.dims()));
    if let Some(strategy) = tensor.gradient_checkpointing_strategy() {
        updated = updated.with_gradient_checkpointing_strategy(strategy);
    }
    if tensor.is_require_grad() {
        updated = updated.require_grad();
    }
    updated
}

/// Replaces every float parameter of `module` by the values under its path.
/// Fails, naming the path, if one is missing or has another shape.
pub(crate) fn load_values<M: Module>(
    module: M,
    mut values: HashMap<String, (Vec<usize>, Vec<f32>)>,
    device: &Device,
) -> Result<M, String> {
    let entries = param_entries(&module);
    struct Load<'a> {
        entries: &'a [ParamEntry],
        next: usize,
        values: &'a mut HashMap<String, (Vec<usize>, Vec<f32>)>,
        device: &'a Device,
        error: Option<String>,
    }
    impl ModuleMapper for Load<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let Some(entry) = self.entries.get(self.next) else {
                self.error
                    .get_or_insert("more parameters than expected".to_string());
                return param;
            };
            self.next += 1;
            let (id, tensor, mapper) = param.consume();
            let replaced = match self.values.remove(&entry.path) {
                Some((shape, data)) if shape == entry.shape && id == entry.id => {
                    let mut t = tensor_from::<D>(data, &shape, self.device);
                    if tensor.is_require_grad() {
                        t = t.require_grad();
                    }
                    t
                }
                Some((shape, _)) => {
                    self.error.get_or_insert(format!(
                        "`{}` has shape {shape:?}, the model {:?}",
                        entry.path, entry.shape
                    ));
                    tensor
                }
                None => {
                    self.error
                        .get_or_insert(format!("`{}` is missing", entry.path));
                    tensor
                }
            };
            Param::from_mapped_value(id, replaced, mapper)
        }
    }
    let mut loader = Load {
        entries: &entries,
        next: 0,
        values: &mut values,
        device,
        error: None,
    };
    let module = module.map(&mut loader);
    if let Some(e) = loader.error {
        return Err(e);
    }
    if let Some(extra) = values.keys().next() {
        return Err(format!("`{extra}` is not a parameter of this model"));
    }
    Ok(module)
}

/// Averages `grads` across a data-parallel job's ranks as one flat buffer,
/// with `extra` values (the loss, the stop flag) at its end: one all-reduce
/// per optimizer step, as DDP's buckets once accumulation is done. Every
/// rank gets the same bytes back, so every rank takes the same update.
///
/// Where the job reduces through NCCL and the gradients are on a CUDA GPU,
/// they stay there ([`reduce_flat`]): concatenated into buffers of 25 MiB
/// (DDP's buckets), each reduced in place by NCCL on the device, sliced
/// back; only `extra` reaches the host. Elsewhere (the sockets; NCCL with
/// `KILN_NCCL_VIA_HOST=1`, the path kiln had before, kept for comparison)
/// each gradient leaves its device for the host and comes back in its
/// dtype. With `reduce_dtype` bf16 the gradients travel as bf16 (half the
/// bytes) and `extra` in a second, f32 all-reduce of its own (a loss
/// rounded to bf16 would be logged so).
pub(crate) fn all_reduce_grads<M: Module>(
    module: &M,
    grads: GradientsParams,
    extra: &mut [f32],
    group: &kiln_dist::Group,
    reduce_dtype: kiln_config::ReduceDtype,
) -> Result<GradientsParams, kiln_dist::DistError> {
    let taken = take_flat(module, grads);
    #[cfg(feature = "cuda")]
    if let Some(device) = taken.pieces.first().map(|(t, _)| t.device.clone())
        && group.uses_nccl()
        && nccl_through_host(&device).is_none()
    {
        return nccl_on_device(module, taken, &device, extra, group, reduce_dtype);
    }
    let Taken { grads, pieces } = taken;
    let total: usize = pieces
        .iter()
        .map(|(m, _)| m.dims.iter().product::<usize>())
        .sum();
    let mut flat = Vec::with_capacity(total + extra.len());
    let mut metas = Vec::with_capacity(pieces.len());
    for (meta, piece) in pieces {
        extend_f32(&mut flat, piece.into_data());
        metas.push(meta);
    }
    let n = flat.len();
    match reduce_dtype {
        kiln_config::ReduceDtype::F32 => {
            flat.extend_from_slice(extra);
            group.all_reduce(&mut flat, kiln_dist::Reduce::Mean)?;
            extra.copy_from_slice(&flat[n..]);
        }
        kiln_config::ReduceDtype::Bf16 => {
            group.all_reduce_bf16(&mut flat, kiln_dist::Reduce::Mean)?;
            group.all_reduce(extra, kiln_dist::Reduce::Mean)?;
        }
    }
    let mut rest = &flat[..n];
    let pieces = metas.iter().map(|t| {
        let (mine, after) = rest.split_at(t.dims.iter().product());
        rest = after;
        tensor_from::<1>(mine.to_vec(), &[mine.len()], &t.device).cast(t.dtype)
    });
    let grads = put_back(module, grads, &metas, pieces);
    Ok(grads)
}

/// Why a job that reduces through NCCL hands it the gradients on `device`
/// through host memory, or `None` where they stay on the GPU: the one rule
/// [`all_reduce_grads`] follows and the run's note tells. Through the host
/// where `KILN_NCCL_VIA_HOST=1` asks (as kiln ran it before, the GPU
/// check's comparison; read once a process) or where kiln-model lends no
/// CUDA buffer (a `fusion` build).
#[cfg(feature = "cuda")]
pub(crate) fn nccl_through_host(device: &Device) -> Option<&'static str> {
    static VIA_HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let asked = *VIA_HOST.get_or_init(|| {
        std::env::var("KILN_NCCL_VIA_HOST").is_ok_and(|v| matches!(v.trim(), "1" | "true"))
    });
    if asked {
        Some("KILN_NCCL_VIA_HOST=1")
    } else if !kiln_model::kernels::lends_cuda_buffers(device) {
        Some("a `fusion` build")
    } else {
        None
    }
}

/// [`all_reduce_grads`] on the device: the gradients in buffers of the
/// wire's dtype (DDP's buckets of 25 MiB, [`BUCKET_BYTES`]), each reduced in
/// place by NCCL on the thread's CubeCL stream
/// ([`kiln_dist::Group::all_reduce_device`]), nothing waited for until
/// `extra` is read back.
#[cfg(feature = "cuda")]
fn nccl_on_device<M: Module>(
    module: &M,
    taken: Taken,
    device: &Device,
    extra: &mut [f32],
    group: &kiln_dist::Group,
    reduce_dtype: kiln_config::ReduceDtype,
) -> Result<GradientsParams, kiln_dist::DistError> {
    use burn::tensor::DType;
    use kiln_dist::{DistError, Reduce};
    let reduce = |flat: Tensor<1>| -> Result<Tensor<1>, DistError> {
        let lent = kiln_model::kernels::with_cuda_buffer(flat, |buffer| {
            let buffer = nccl_buffer(buffer)?;
            // SAFETY: the buffer is the flat tensor's, which
            // `with_cuda_buffer` keeps and hands back: its memory outlives
            // the call, and its readers (the slices, `extra`'s read) are
            // queued after it on the same stream.
            unsafe { group.all_reduce_device(&buffer, Reduce::Mean) }
        });
        match lent {
            (flat, Some(done)) => done.map(|()| flat),
            (_, None) => Err(not_on_cuda("the gradients")),
        }
    };
    match reduce_dtype {
        kiln_config::ReduceDtype::F32 => reduce_flat(
            module,
            taken,
            device,
            extra,
            DType::F32,
            BUCKET_BYTES,
            reduce,
        ),
        kiln_config::ReduceDtype::Bf16 => {
            let grads = reduce_flat(
                module,
                taken,
                device,
                &mut [],
                DType::BF16,
                BUCKET_BYTES,
                reduce,
            )?;
            group.all_reduce(extra, Reduce::Mean)?;
            Ok(grads)
        }
    }
}

/// A CubeCL tensor's CUDA buffer as NCCL takes it: f32 or bf16.
#[cfg(feature = "cuda")]
pub(crate) fn nccl_buffer(
    buffer: &kiln_model::kernels::CudaBuffer,
) -> Result<kiln_dist::DeviceBuffer, kiln_dist::DistError> {
    use burn::tensor::DType;
    use kiln_dist::DeviceDtype;
    let dtype = match buffer.dtype {
        DType::F32 => DeviceDtype::F32,
        DType::BF16 => DeviceDtype::Bf16,
        other => {
            return Err(kiln_dist::DistError::Nccl(format!(
                "values in {other:?}: NCCL's collectives here take f32 or bf16"
            )));
        }
    };
    Ok(kiln_dist::DeviceBuffer {
        ptr: buffer.ptr,
        len: buffer.len,
        dtype,
        stream: buffer.stream,
    })
}

/// The error of a buffer [`kiln_model::kernels::with_cuda_buffer`] did
/// not lend: `what` is not on a CUDA device.
#[cfg(feature = "cuda")]
pub(crate) fn not_on_cuda(what: &str) -> kiln_dist::DistError {
    kiln_dist::DistError::Nccl(format!("{what}' buffer is not on a CUDA device"))
}

/// A gradient taken out of its [`GradientsParams`], as the module's
/// visiting order meets it.
#[derive(Clone, Debug)]
struct TakenMeta {
    id: ParamId,
    dims: Vec<usize>,
    device: Device,
    dtype: burn::tensor::DType,
}

/// [`take_flat`]'s result: what is left of the gradients, and each one
/// taken, flat (1-D, on its device, in its dtype), in visiting order.
struct Taken {
    grads: GradientsParams,
    pieces: Vec<(TakenMeta, Tensor<1>)>,
}

/// Takes every gradient of `module`'s parameters out of `grads`, flat.
fn take_flat<M: Module>(module: &M, grads: GradientsParams) -> Taken {
    struct Gather {
        grads: GradientsParams,
        pieces: Vec<(TakenMeta, Tensor<1>)>,
    }
    impl ModuleVisitor for Gather {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                let dims = g.dims().to_vec();
                let meta = TakenMeta {
                    id: param.id,
                    device: g.device(),
                    dtype: g.dtype(),
                    dims: dims.clone(),
                };
                self.pieces
                    .push((meta, g.reshape([dims.iter().product::<usize>()])));
            }
        }
    }
    let mut gather = Gather {
        grads,
        pieces: Vec::new(),
    };
    module.visit(&mut gather);
    Taken {
        grads: gather.grads,
        pieces: gather.pieces,
    }
}

/// Registers `pieces` (flat, in `metas`' order and dtypes) in `grads` in
/// their parameters' shapes. `module` is walked again only to meet each
/// parameter at its rank.
fn put_back<M: Module>(
    module: &M,
    grads: GradientsParams,
    metas: &[TakenMeta],
    pieces: impl Iterator<Item = Tensor<1>>,
) -> GradientsParams {
    struct Scatter<'a, I> {
        grads: GradientsParams,
        metas: std::slice::Iter<'a, TakenMeta>,
        pieces: I,
    }
    impl<I: Iterator<Item = Tensor<1>>> ModuleVisitor for Scatter<'_, I> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(t) = self.metas.as_slice().first().filter(|t| t.id == param.id) else {
                return;
            };
            self.metas.next();
            let piece = self
                .pieces
                .next()
                .expect("a piece for every gradient taken");
            let dims: [usize; D] = t.dims.clone().try_into().expect("the parameter's rank");
            self.grads.register::<D>(t.id, piece.reshape(dims));
        }
    }
    let mut scatter = Scatter {
        grads,
        metas: metas.iter(),
        pieces,
    };
    module.visit(&mut scatter);
    scatter.grads
}

/// The largest bucket [`reduce_flat`] concatenates the gradients into
/// before one collective: PyTorch DDP's `bucket_cap_mb = 25`. One buffer
/// of every gradient would hold them twice at the concatenation (the
/// gradients and their copy); a bucket at a time holds one bucket more.
#[cfg(feature = "cuda")]
pub(crate) const BUCKET_BYTES: usize = 25 << 20;

/// Consecutive runs of `sizes` (values, each `bytes` wide) whose bytes
/// reach `cap` (the last run may hold less; a value larger than `cap`
/// alone), as ranges of indices: DDP's buckets, in the gradients' order.
/// At least one run, empty where `sizes` is.
#[cfg(any(feature = "cuda", test))]
fn buckets(sizes: &[usize], bytes: usize, cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let (mut start, mut filled) = (0, 0usize);
    for (i, &n) in sizes.iter().enumerate() {
        filled = filled.saturating_add(n.saturating_mul(bytes));
        if filled >= cap {
            runs.push(start..i + 1);
            (start, filled) = (i + 1, 0);
        }
    }
    if start < sizes.len() || runs.is_empty() {
        runs.push(start..sizes.len());
    }
    runs
}

/// The device side of [`all_reduce_grads`], for any `reduce` of one flat
/// tensor: the gradients taken (each cast to `wire`) concatenated, in
/// buckets of `bucket_bytes` ([`buckets`]; `extra`, f32 only, at the end
/// of the last), into tensors on `device`, their device, each `reduce`d
/// and sliced back into its gradients' shapes and dtypes; `extra` read
/// back from the last one's end, the one read to the host. A reduce that
/// changes nothing gives back the gradients' own values (f32), or each
/// rounded to bf16 once.
#[cfg(any(feature = "cuda", test))]
fn reduce_flat<M: Module, E>(
    module: &M,
    taken: Taken,
    device: &Device,
    extra: &mut [f32],
    wire: burn::tensor::DType,
    bucket_bytes: usize,
    mut reduce: impl FnMut(Tensor<1>) -> Result<Tensor<1>, E>,
) -> Result<GradientsParams, E> {
    assert!(
        extra.is_empty() || wire == burn::tensor::DType::F32,
        "extra values travel in f32 only"
    );
    let Taken { grads, pieces } = taken;
    let len = |t: &TakenMeta| t.dims.iter().product::<usize>();
    let sizes: Vec<usize> = pieces.iter().map(|(t, _)| len(t)).collect();
    let runs = buckets(&sizes, wire.size(), bucket_bytes);
    let last = runs.len() - 1;
    let mut pieces = pieces.into_iter();
    let mut metas = Vec::with_capacity(sizes.len());
    let mut back = Vec::with_capacity(sizes.len());
    for (b, run) in runs.into_iter().enumerate() {
        let mut parts = Vec::with_capacity(run.len() + 1);
        for (meta, piece) in pieces.by_ref().take(run.len()) {
            parts.push(piece.cast(wire));
            metas.push(meta);
        }
        let with_extra = b == last && !extra.is_empty();
        if with_extra {
            parts.push(tensor_from::<1>(extra.to_vec(), &[extra.len()], device));
        }
        if parts.is_empty() {
            continue;
        }
        let flat = reduce(Tensor::cat(parts, 0))?;
        let mut at = 0;
        for t in &metas[run] {
            back.push(flat.clone().narrow(0, at, len(t)).cast(t.dtype));
            at += len(t);
        }
        if with_extra {
            let read = flat.narrow(0, at, extra.len()).into_data();
            for (e, v) in extra.iter_mut().zip(read.iter::<f32>()) {
                *e = v;
            }
        }
    }
    Ok(put_back(module, grads, &metas, back.into_iter()))
}

/// A checksum of every parameter's bits (FNV-1a), the same on every rank
/// that holds the same weights.
pub(crate) fn weights_checksum<M: Module>(module: &M) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (_, _, values) in param_values(module) {
        for v in values {
            for b in v.to_bits().to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_model::GptConfig;

    fn model(device: &Device) -> kiln_model::Gpt {
        GptConfig::new(10, 4, 2, 2, 8)
            .with_intermediate(16)
            .init(device)
    }

    #[test]
    fn every_parameter_has_a_unique_path() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex();
        let m = model(&device);
        let entries = param_entries(&m);
        let paths: Vec<&str> = entries.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(entries.len(), 2 + 2 * 12 + 2, "{paths:?}");
        assert!(paths.contains(&"wte.weight"), "{paths:?}");
        assert!(paths.contains(&"blocks.1.qkv.bias"), "{paths:?}");
        let mut unique = paths.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), paths.len());
    }

    /// A gradient for every parameter of `m`: its weights times `factor`.
    fn grads_of(m: &kiln_model::Gpt, factor: f32) -> GradientsParams {
        struct Register {
            grads: GradientsParams,
            factor: f32,
        }
        impl ModuleVisitor for Register {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let g = param.val().mul_scalar(self.factor);
                self.grads.register::<D>(param.id, g);
            }
        }
        let mut register = Register {
            grads: GradientsParams::new(),
            factor,
        };
        m.visit(&mut register);
        register.grads
    }

    /// Each parameter's gradient in `grads`, by path: its shape and values.
    fn grad_values(
        m: &kiln_model::Gpt,
        grads: &GradientsParams,
    ) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        param_entries(m)
            .into_iter()
            .map(|e| {
                let values = match e.shape.len() {
                    1 => grads.get::<1>(e.id).map(|g| (g.dims().to_vec(), host(&g))),
                    2 => grads.get::<2>(e.id).map(|g| (g.dims().to_vec(), host(&g))),
                    d => panic!("a parameter of rank {d}"),
                };
                let (dims, values) = values.unwrap_or_else(|| panic!("no gradient for {}", e.path));
                (e.path, dims, values)
            })
            .collect()
    }

    /// The device path of the gradients' all-reduce (NCCL's on a GPU,
    /// here any reduce of the flat tensor on flex): one flat tensor in the
    /// wire's dtype with `extra` at its end (or buckets of them), and every
    /// gradient back in its place, shape and dtype, with exactly what the
    /// reduce made of it.
    #[test]
    fn gradients_reduce_as_one_flat_tensor_and_come_back_in_place() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex();
        device.seed(3);
        let m = model(&device);
        let want = grad_values(&m, &grads_of(&m, 0.5));
        let total: usize = want.iter().map(|(_, _, v)| v.len()).sum();

        // Reduced as a sum of two ranks holding the same values would be
        // (each bucket doubled), in buckets of `cap` bytes; what each
        // reduce was given: its dims, dtype and values.
        type Seen = Vec<([usize; 1], burn::tensor::DType, Vec<f32>)>;
        let doubled = |cap: usize, extra: &mut [f32]| -> (GradientsParams, Seen) {
            let mut seen = Vec::new();
            let grads = reduce_flat(
                &m,
                take_flat(&m, grads_of(&m, 0.5)),
                &device,
                extra,
                burn::tensor::DType::F32,
                cap,
                |flat| -> Result<Tensor<1>, ()> {
                    seen.push((flat.dims(), flat.dtype(), host(&flat)));
                    Ok(flat.mul_scalar(2.0))
                },
            )
            .expect("reduces");
            (grads, seen)
        };

        // f32 in one bucket: the gradients and then `extra`.
        let mut extra = [1.25f32, 1.0];
        let (grads, seen) = doubled(usize::MAX, &mut extra);
        let [(dims, dtype, flat)] = &seen[..] else {
            panic!("reduced once, not {} times", seen.len());
        };
        assert_eq!((*dims, *dtype), ([total + 2], burn::tensor::DType::F32));
        let in_order: Vec<f32> = want
            .iter()
            .flat_map(|(_, _, v)| v.iter().copied())
            .collect();
        assert_eq!(
            flat[..total],
            in_order[..],
            "the gradients in visiting order"
        );
        assert_eq!(flat[total..], [1.25, 1.0], "then `extra`");
        assert_eq!(extra, [2.5, 2.0], "`extra` read back");
        assert_doubled(&want, &grad_values(&m, &grads));

        // Buckets (DDP's, 25 MiB on a GPU; here 256 bytes, 64 values):
        // the gradients in visiting order across several reduces, each
        // bucket reaching the cap but the last, `extra` at the last one's
        // end, and every gradient back in its place.
        let cap = 256;
        let mut extra = [3.0f32];
        let (grads, seen) = doubled(cap, &mut extra);
        let seen: Vec<Vec<f32>> = seen.into_iter().map(|(_, _, v)| v).collect();
        assert!(seen.len() > 2, "several buckets: {}", seen.len());
        let (last, full) = seen.split_last().expect("one bucket at least");
        for b in full {
            assert!(4 * b.len() >= cap, "a bucket of {} values", b.len());
        }
        assert_eq!(last.last(), Some(&3.0), "`extra` ends the last bucket");
        let mut sent_in_order = in_order.clone();
        sent_in_order.push(3.0);
        assert_eq!(
            seen.concat(),
            sent_in_order,
            "every gradient once, in order"
        );
        assert_eq!(extra, [6.0]);
        assert_doubled(&want, &grad_values(&m, &grads));

        // bf16 on the wire: each value rounded to bf16 once, back in f32.
        let grads = reduce_flat(
            &m,
            take_flat(&m, grads_of(&m, 0.5)),
            &device,
            &mut [],
            burn::tensor::DType::BF16,
            usize::MAX,
            |flat| -> Result<Tensor<1>, ()> {
                assert_eq!(
                    (flat.dims(), flat.dtype()),
                    ([total], burn::tensor::DType::BF16)
                );
                Ok(flat)
            },
        )
        .expect("reduces");
        for ((path, _, values), (_, _, v)) in want.iter().zip(&grad_values(&m, &grads)) {
            let rounded: Vec<f32> = values
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            assert_eq!(&rounded, v, "{path}");
        }
        assert_eq!(
            grads_dtype(&m, &grads),
            burn::tensor::DType::F32,
            "back in f32"
        );

        // A failed reduce is the caller's error.
        let failed = reduce_flat(
            &m,
            take_flat(&m, grads_of(&m, 0.5)),
            &device,
            &mut [0.0],
            burn::tensor::DType::F32,
            usize::MAX,
            |_| Err("the collective failed"),
        );
        assert_eq!(failed.err(), Some("the collective failed"));
    }

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one bucket is a result
    fn buckets_fill_to_the_cap_in_order() {
        // 4-byte values, a cap of 40 bytes (10 values).
        assert_eq!(buckets(&[4, 4, 4, 30, 1], 4, 40), [0..3, 3..4, 4..5]);
        assert_eq!(buckets(&[10, 10], 4, 40), [0..1, 1..2]);
        assert_eq!(buckets(&[3, 3], 4, 40), [0..2]);
        assert_eq!(buckets(&[], 4, 40), [0..0]);
        assert_eq!(buckets(&[5, 5], 4, usize::MAX), [0..2]);
        // bf16: twice the values a bucket.
        assert_eq!(buckets(&[10, 10, 1], 2, 40), [0..2, 2..3]);
    }

    /// Each gradient of `got` is `want`'s doubled, in its place and shape.
    fn assert_doubled(
        want: &[(String, Vec<usize>, Vec<f32>)],
        got: &[(String, Vec<usize>, Vec<f32>)],
    ) {
        assert_eq!(want.len(), got.len());
        for ((path, dims, values), (p, d, v)) in want.iter().zip(got) {
            assert_eq!((path, dims), (p, d));
            let doubled: Vec<f32> = values.iter().map(|x| x * 2.0).collect();
            assert_eq!(&doubled, v, "{path}");
        }
    }

    fn grads_dtype(m: &kiln_model::Gpt, grads: &GradientsParams) -> burn::tensor::DType {
        let wte = param_entries(m)
            .into_iter()
            .find(|e| e.path == "wte.weight")
            .expect("wte");
        grads.get::<2>(wte.id).expect("a gradient").dtype()
    }

    #[test]
    fn values_load_back_exactly() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex();
        device.seed(1);
        let a = model(&device);
        device.seed(2);
        let b = model(&device);
        let values: HashMap<_, _> = param_values(&a)
            .into_iter()
            .map(|(p, shape, v)| (p, (shape, v)))
            .collect();
        let b = load_values(b, values, &device).expect("loads");
        assert_eq!(param_values(&a), param_values(&b));
        let mut short: HashMap<_, _> = param_values(&a)
            .into_iter()
            .map(|(p, shape, v)| (p, (shape, v)))
            .collect();
        short.remove("wte.weight");
        let err = load_values(b, short, &device).expect_err("missing");
        assert!(err.contains("wte.weight"), "{err}");
    }
}
