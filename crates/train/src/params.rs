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
    t.to_data().iter::<f32>().collect()
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
/// rank gets the same bytes back, so every rank takes the same update. A
/// gradient leaves its device for the host and comes back in its dtype:
/// the socket reduction's path (the CPU's); NCCL's would stay on the GPU.
/// With `reduce_dtype` bf16 the gradients travel as bf16 (half the
/// bytes) and `extra` in a second, f32 all-reduce of its own (a loss
/// rounded to bf16 would be logged so).
pub(crate) fn all_reduce_grads<M: Module>(
    module: &M,
    grads: GradientsParams,
    extra: &mut [f32],
    group: &kiln_dist::Group,
    reduce_dtype: kiln_config::ReduceDtype,
) -> Result<GradientsParams, kiln_dist::DistError> {
    /// A gradient taken out of `grads` onto the host, as the module's
    /// visiting order meets it (`global_grad_norm`'s walk).
    struct Taken {
        id: ParamId,
        dims: Vec<usize>,
        device: Device,
        dtype: burn::tensor::DType,
    }
    struct Gather {
        grads: GradientsParams,
        flat: Vec<f32>,
        taken: Vec<Taken>,
    }
    impl ModuleVisitor for Gather {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.remove::<D>(param.id) {
                self.taken.push(Taken {
                    id: param.id,
                    dims: g.dims().to_vec(),
                    device: g.device(),
                    dtype: g.dtype(),
                });
                self.flat.extend(g.into_data().iter::<f32>());
            }
        }
    }
    /// Puts the reduced values back, in the same order.
    struct Scatter<'a> {
        grads: GradientsParams,
        taken: std::slice::Iter<'a, Taken>,
        values: &'a [f32],
    }
    impl ModuleVisitor for Scatter<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(t) = self.taken.as_slice().first().filter(|t| t.id == param.id) else {
                return;
            };
            self.taken.next();
            let (mine, rest) = self.values.split_at(t.dims.iter().product());
            self.values = rest;
            let g: Tensor<D> = tensor_from(mine.to_vec(), &t.dims, &t.device).cast(t.dtype);
            self.grads.register::<D>(t.id, g);
        }
    }
    let mut gather = Gather {
        grads,
        flat: Vec::new(),
        taken: Vec::new(),
    };
    module.visit(&mut gather);
    let Gather {
        grads,
        mut flat,
        taken,
    } = gather;
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
    let mut scatter = Scatter {
        grads,
        taken: taken.iter(),
        values: &flat[..n],
    };
    module.visit(&mut scatter);
    Ok(scatter.grads)
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
