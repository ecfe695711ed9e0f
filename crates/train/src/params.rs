//! Walking a module's float parameters by path: reading them to the host and
//! replacing them from host data (checkpoints), in one deterministic order.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, Tensor, TensorData};

/// A float parameter: its dotted path (`blocks.0.qkv.weight`), id and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ParamEntry {
    pub(crate) path: String,
    pub(crate) id: ParamId,
    pub(crate) shape: Vec<usize>,
}

/// Every float parameter of `module`, in visiting order.
pub(crate) fn param_entries<M: Module>(module: &M) -> Vec<ParamEntry> {
    struct Collect(Vec<ParamEntry>);
    impl ModuleVisitor for Collect {
        fn visit_float_with_path<const D: usize>(
            &mut self,
            path: &[String],
            id: ParamId,
            tensor: &Tensor<D>,
        ) {
            self.0.push(ParamEntry {
                path: path.join("."),
                id,
                shape: tensor.dims().to_vec(),
            });
        }
    }
    let mut c = Collect(Vec::new());
    module.visit(&mut c);
    c.0
}

/// Every float parameter's values on the host, by path.
pub(crate) fn param_values<M: Module>(module: &M) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    struct Read(Vec<(String, Vec<usize>, Vec<f32>)>);
    impl ModuleVisitor for Read {
        fn visit_float_with_path<const D: usize>(
            &mut self,
            path: &[String],
            _id: ParamId,
            tensor: &Tensor<D>,
        ) {
            let values = tensor.to_data().iter::<f32>().collect();
            self.0.push((path.join("."), tensor.dims().to_vec(), values));
        }
    }
    let mut r = Read(Vec::new());
    module.visit(&mut r);
    r.0
}

/// Host values of a tensor.
pub(crate) fn host<const D: usize>(t: &Tensor<D>) -> Vec<f32> {
    t.to_data().iter::<f32>().collect()
}

/// A tensor of `shape` from host values.
pub(crate) fn tensor_from<const D: usize>(values: Vec<f32>, shape: &[usize], device: &Device) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values, shape.to_vec()), device)
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
                self.error.get_or_insert("more parameters than expected".to_string());
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
