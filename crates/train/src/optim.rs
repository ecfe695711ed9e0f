//! AdamW as PyTorch computes it, with decoupled weight decay on matrices only
//! (biases, LayerNorm gains and other vectors are not decayed, as in
//! nanoGPT) and global-norm gradient clipping; each step's learning rate
//! comes from `kiln_plan::Schedule`.
//! The state is plain tensors keyed by parameter, so checkpoints hold it all.

use std::collections::HashMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use kiln_model::kernels::{AdamWParam, AdamWStep, Kernels, adamw_many, sum_of_squares_value};

/// AdamW's hyper-parameters, set explicitly (Burn's defaults differ from PyTorch's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// The optimizer and its state.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Learning rate, betas, epsilon and weight decay.
    pub config: AdamWConfig,
    /// Optimizer steps taken (for bias correction).
    pub steps: u64,
    /// First and second moments per parameter, flattened.
    pub(crate) moments: HashMap<ParamId, (Tensor<1>, Tensor<1>)>,
    /// The fused update where the device has it (flex; wgpu and CUDA
    /// without Burn's `fusion`), or the composition of Burn operations.
    pub kernels: Kernels,
    /// ZeRO-1 or ZeRO-2 in a job: the parameters this rank updates and
    /// keeps moments for (`None`: all of them).
    pub(crate) shard: Option<crate::zero::Shard>,
    /// Each parameter's factor on the step's learning rate
    /// (`training.layer_lr_decay`); a parameter not in it takes the rate
    /// as it is.
    pub(crate) lr_scales: HashMap<ParamId, f64>,
}

impl AdamW {
    /// An optimizer with no steps taken and no moments yet.
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            steps: 0,
            moments: HashMap::new(),
            kernels: Kernels::Fused,
            shard: None,
            lr_scales: HashMap::new(),
        }
    }

    /// The optimizer a run of `config` trains `model` with: its
    /// hyper-parameters and kernels, and in a job with
    /// `optimization.zero_stage` 1 or 2, this rank's share (ZeRO; a job of
    /// one rank owns every parameter and runs ZeRO's collectives over a
    /// world of one, as a job of one rank runs DDP's all-reduce).
    pub(crate) fn for_run<M: Module>(
        config: &kiln_config::RunConfig,
        model: &M,
        group: Option<&kiln_dist::Group>,
    ) -> Self {
        let mut optim =
            Self::for_training(&config.training).with_kernels(crate::translate::kernels(config));
        if let Some(g) = group.filter(|_| config.optimization.zero_stage >= 1) {
            optim.shard = Some(crate::zero::Shard::new(
                model,
                g.rank(),
                g.world_size(),
                config.optimization.zero_stage,
            ));
        }
        let decay = config.training.layer_lr_decay;
        if decay != 1.0 {
            optim.lr_scales = layer_lr_scales(model, config.model.layers, decay);
        }
        optim
    }

    /// Whether this optimizer updates `id` and keeps its moments (all
    /// parameters, except under ZeRO).
    pub(crate) fn keeps(&self, id: ParamId) -> bool {
        self.shard.as_ref().is_none_or(|s| s.owns(id))
    }

    /// AdamW with the hyper-parameters of a configuration's `training` section.
    pub fn for_training(t: &kiln_config::TrainingSection) -> Self {
        Self::new(AdamWConfig {
            beta1: t.beta1,
            beta2: t.beta2,
            eps: t.eps,
            weight_decay: t.weight_decay,
        })
    }

    /// The same optimizer with the fused update or the composition
    /// (`optimization.kernels`).
    pub fn with_kernels(mut self, kernels: Kernels) -> Self {
        self.kernels = kernels;
        self
    }

    /// One update of every parameter that has a gradient, with the gradients
    /// multiplied by `grad_scale` first (clipping). All parameters' updates
    /// go to the kernels at once (`kernels::adamw_many`: on a GPU, a few
    /// launches for the whole model), then the module takes its new weights.
    pub fn step<M: Module>(
        &mut self,
        module: M,
        grads: GradientsParams,
        lr: f64,
        grad_scale: f64,
    ) -> M {
        self.steps += 1;
        let mut collect = Collect {
            optim: self,
            grads,
            lr,
            grad_scale,
            ids: Vec::new(),
            params: Vec::new(),
        };
        module.visit(&mut collect);
        let Collect { ids, params, .. } = collect;
        let mut updated = HashMap::with_capacity(ids.len());
        for (id, [w, m, v]) in ids.into_iter().zip(adamw_many(params, self.kernels)) {
            self.moments.insert(id, (m, v));
            updated.insert(id, w);
        }
        module.map(&mut Replace { updated })
    }
}

/// Gathers each parameter that has a gradient, with its moments and
/// hyper-parameters, for one [`adamw_many`].
struct Collect<'a> {
    optim: &'a mut AdamW,
    grads: GradientsParams,
    lr: f64,
    grad_scale: f64,
    ids: Vec<ParamId>,
    params: Vec<AdamWParam>,
}

impl ModuleVisitor for Collect<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(grad) = self.grads.remove::<D>(param.id) else {
            return;
        };
        if !self.optim.keeps(param.id) {
            // ZeRO: another rank updates it; the all-gather brings it.
            return;
        }
        let c = self.optim.config;
        let lr = self.lr * self.optim.lr_scales.get(&param.id).copied().unwrap_or(1.0);
        let tensor = param.val();
        let n: usize = tensor.dims().iter().product();
        let weight: Tensor<1> = tensor.inner().reshape([n]);
        let (m, v) = self.optim.moments.remove(&param.id).unwrap_or_else(|| {
            // Two buffers, so that the update can write over each.
            let zeros = || Tensor::<1>::zeros([n], &weight.device()).cast(weight.dtype());
            (zeros(), zeros())
        });
        self.ids.push(param.id);
        self.params.push(AdamWParam {
            weight,
            grad: grad.reshape([n]),
            m,
            v,
            step: AdamWStep {
                lr,
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                // Decoupled weight decay, on matrices (embeddings and weights) only.
                weight_decay: if D >= 2 { c.weight_decay } else { 0.0 },
                step: self.optim.steps,
                grad_scale: self.grad_scale,
            },
        });
    }
}

/// Layer-wise learning-rate decay: each parameter of the encoder `model`
/// (`layers` blocks) at `decay^(layers + 1 − depth)`, its depth as
/// [`kiln_model::EncoderClassifier::depth_of`] counts it: the classifier at
/// the full rate, the top block at `decay`, the embeddings at
/// `decay^(layers + 1)`.
pub(crate) fn layer_lr_scales<M: Module>(
    model: &M,
    layers: usize,
    decay: f64,
) -> HashMap<ParamId, f64> {
    crate::params::param_entries(model)
        .into_iter()
        .map(|e| {
            let depth = kiln_model::EncoderClassifier::depth_of(&e.path, layers);
            (e.id, decay.powi((layers + 1 - depth) as i32))
        })
        .collect()
}

/// Puts the updated weights (flat, without autodiff's wrapper) into the
/// module, keeping each parameter's `require_grad` and
/// gradient-checkpointing strategy; the others stay as they are.
struct Replace {
    updated: HashMap<ParamId, Tensor<1>>,
}

impl ModuleMapper for Replace {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let (id, tensor, mapper) = param.consume();
        let updated = match self.updated.remove(&id) {
            Some(w) => crate::params::replaced(&tensor, w),
            None => tensor,
        };
        Param::from_mapped_value(id, updated, mapper)
    }
}

/// The global L2 norm of all gradients of `module`, as one number: the
/// sum of their squares in one kernel launch per parameter where `kernels`
/// has it (`kernels::sum_of_squares_value`: its partial sums added on the
/// host in a fixed order, so that the ranks of a job agree), read back once.
pub(crate) fn global_grad_norm<M: Module>(
    module: &M,
    grads: &GradientsParams,
    kernels: Kernels,
) -> f64 {
    struct Flat<'a> {
        grads: &'a GradientsParams,
        flat: Vec<Tensor<1>>,
    }
    impl ModuleVisitor for Flat<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(g) = self.grads.get::<D>(param.id) {
                let n: usize = g.dims().iter().product();
                self.flat.push(g.reshape([n]));
            }
        }
    }
    let mut flat = Flat {
        grads,
        flat: Vec::new(),
    };
    module.visit(&mut flat);
    sum_of_squares_value(flat.flat, kernels).map_or(0.0, f64::sqrt)
}

#[cfg(test)]
mod tests {
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// Two steps of `opt` at rate 0.1 on loss = sum(w·x + b), x = (1, 2).
    fn two_constant_steps(mut lin: Linear, opt: &mut AdamW) -> Linear {
        let device = lin.weight.val().device();
        for _ in 0..2 {
            let x = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 2.0], [1, 2]), &device);
            let grads = lin.forward(x).sum().backward();
            let grads = GradientsParams::from_grads(grads, &lin);
            lin = opt.step(lin, grads, 0.1, 1.0);
        }
        lin
    }

    /// A linear layer's weight and bias values.
    fn values(lin: &Linear) -> (Vec<f32>, Vec<f32>) {
        let w = lin.weight.val().into_data().iter::<f32>().collect();
        let b = lin
            .bias
            .as_ref()
            .map(|b| b.val().into_data().iter::<f32>().collect())
            .unwrap_or_default();
        (w, b)
    }

    /// Two steps with a constant gradient, worked by hand: loss = sum(w·x + b)
    /// with x = (1, 2) gives g_w = (1, 2), g_b = 1 every step. With bias
    /// correction, m̂ = g and v̂ = g² at steps 1 and 2 (m = 0.1g then 0.19g
    /// over 1 − 0.9² = 0.19; v = 0.05g² then 0.0975g² over 1 − 0.95² =
    /// 0.0975), so each update is lr·g/(|g| + ε) = lr·sign(g), and decay
    /// multiplies matrices by (1 − lr·wd) first:
    /// w₂ = (w₀·0.99 − 0.1)·0.99 − 0.1 → 0.29105 and −1.1791; b₂ = 0.25 − 0.2.
    #[test]
    fn two_steps_with_constant_gradient() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex().autodiff();
        let mut lin: Linear = LinearConfig::new(2, 1).init(&device);
        lin.weight = lin.weight.map(|w| {
            Tensor::from_data(TensorData::new(vec![0.5f32, -1.0], [2, 1]), &w.device())
                .require_grad()
        });
        lin.bias = lin.bias.map(|b| {
            b.map(|t| {
                Tensor::from_data(TensorData::new(vec![0.25f32], [1]), &t.device()).require_grad()
            })
        });
        let mut opt = AdamW::new(AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        });
        let lin = two_constant_steps(lin, &mut opt);
        let (w, b) = values(&lin);
        assert!((w[0] - 0.29105).abs() < 1e-5, "{w:?}");
        assert!((w[1] + 1.1791).abs() < 1e-5, "{w:?}");
        assert!((b[0] - 0.05).abs() < 1e-6, "{b:?}");
        assert_eq!(opt.steps, 2);
        assert!(lin.weight.val().is_require_grad());
    }

    #[test]
    fn under_zero_1_a_rank_updates_and_keeps_moments_for_its_share_alone() {
        let _rng = crate::tests::flex_rng();
        use burn::optim::GradientsParams;
        use burn::tensor::{Int, TensorData};

        use crate::params::{param_entries, param_values};
        use crate::zero::Shard;
        use kiln_model::GptConfig;

        let device = Device::flex().autodiff();
        device.seed(3);
        let model = GptConfig::new(10, 4, 2, 2, 8)
            .with_intermediate(16)
            .init(&device);
        let before = param_values(&model);
        let mut optim = AdamW::new(AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        });
        let shard = Shard::new(&model, 1, 2, 1);
        optim.shard = Some(shard.clone());
        let tokens = |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, 4]), &device);
        let loss = model.loss(tokens(vec![1, 2, 3, 4]), tokens(vec![2, 3, 4, 5]));
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(model, grads, 1e-2, 1.0);
        let after = param_values(&model);
        let entries = param_entries(&model);
        for ((e, (_, _, was)), (_, _, now)) in entries.iter().zip(&before).zip(&after) {
            // Its share moved and has moments; the rest is rank 0's to
            // update and send.
            assert_eq!(shard.owns(e.id), was != now, "`{}`", e.path);
            assert_eq!(
                shard.owns(e.id),
                optim.moments.contains_key(&e.id),
                "`{}`",
                e.path
            );
        }
        assert!(entries.iter().any(|e| shard.owns(e.id)));
        assert!(entries.iter().any(|e| !shard.owns(e.id)));
    }

    #[test]
    fn layer_wise_decay_lowers_each_layer_from_the_classifier_down() {
        let _rng = crate::tests::flex_rng();
        use crate::params::param_entries;
        use kiln_model::{EncoderConfig, PoolingKind};

        let device = Device::flex();
        let model = EncoderConfig::new(20, 8, 2, 2, 8, 3)
            .with_embedding(Some(4))
            .with_pooling(PoolingKind::Pooler)
            .init(&device);
        let scales = layer_lr_scales(&model, 2, 0.5);
        let entries = param_entries(&model);
        assert_eq!(scales.len(), entries.len());
        let expected = |path: &str| match path.split('.').next() {
            Some("blocks") if path.starts_with("blocks.0.") => 0.25,
            Some("blocks") => 0.5,
            Some("pooler" | "head") => 1.0,
            // Tokens, positions, segments, their LayerNorm and projection.
            _ => 0.125,
        };
        for e in &entries {
            assert_eq!(scales[&e.id], expected(&e.path), "`{}`", e.path);
        }
        for layer in [
            "tokens",
            "positions",
            "segments",
            "ln_embed",
            "embed_proj",
            "head",
        ] {
            assert!(
                entries.iter().any(|e| e.path.starts_with(layer)),
                "no `{layer}` in {entries:?}"
            );
        }
    }

    /// The constant-gradient steps of `two_steps_with_constant_gradient`
    /// with the bias at half the rate: it moves half as far.
    #[test]
    fn a_parameters_rate_is_scaled_by_its_factor() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex().autodiff();
        let lin: Linear = LinearConfig::new(2, 1).init(&device);
        let bias = lin.bias.as_ref().expect("a bias").id;
        let mut opt = AdamW::new(AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.0,
        });
        opt.lr_scales.insert(bias, 0.5);
        let (before_w, before_b) = values(&lin);
        let lin = two_constant_steps(lin, &mut opt);
        let (w, b) = values(&lin);
        // Each step moves a weight by lr·sign(g) = 0.1, the bias by 0.05.
        for (now, was) in w.iter().zip(&before_w) {
            assert!((was - now - 0.2).abs() < 1e-5, "{was} -> {now}");
        }
        assert!(
            (before_b[0] - b[0] - 0.1).abs() < 1e-5,
            "{before_b:?} -> {b:?}"
        );
    }

    #[test]
    fn grad_norm_is_global() {
        let _rng = crate::tests::flex_rng();
        let device = Device::flex().autodiff();
        let lin: Linear = LinearConfig::new(3, 1).init(&device);
        let x = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 2.0, 2.0], [1, 3]), &device);
        let grads = GradientsParams::from_grads(lin.forward(x).sum().backward(), &lin);
        // d/dw = x = (1, 2, 2), d/db = 1: norm sqrt(1 + 4 + 4 + 1).
        let norm = global_grad_norm(&lin, &grads, Kernels::Fused);
        assert!((norm - 10f64.sqrt()).abs() < 1e-5, "{norm}");
    }
}
