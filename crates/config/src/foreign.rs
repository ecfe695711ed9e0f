//! The names other training tools give kiln's settings (nanoGPT's
//! `train.py` and `GPTConfig`, transformers' `TrainingArguments` and model
//! configs, Lightning's `Trainer`, torchtitan's, Accelerate's), so that an
//! unknown key in one of them is answered with the kiln key, or the kiln
//! overrides, it means.

/// Names other training tools give kiln's keys, each with the kiln key it
/// means: an unknown key with one of these names is answered with the kiln
/// key.
pub const FOREIGN_NAMES: &[(&str, &str)] = &[
    ("n_layer", "model.layers"),
    ("n_layers", "model.layers"),
    ("num_layers", "model.layers"),
    ("num_hidden_layers", "model.layers"),
    ("n_head", "model.heads"),
    ("n_heads", "model.heads"),
    ("num_heads", "model.heads"),
    ("num_attention_heads", "model.heads"),
    ("n_embd", "model.hidden"),
    ("n_embed", "model.hidden"),
    ("d_model", "model.hidden"),
    ("dim", "model.hidden"),
    ("hidden_size", "model.hidden"),
    ("n_inner", "model.intermediate"),
    ("d_ff", "model.intermediate"),
    ("ffn_dim", "model.intermediate"),
    ("intermediate_size", "model.intermediate"),
    ("block_size", "model.max_length"),
    ("n_ctx", "model.max_length"),
    ("n_positions", "model.max_length"),
    ("max_position_embeddings", "model.max_length"),
    ("seq_len", "model.max_length"),
    ("max_seq_len", "model.max_length"),
    ("max_seq_length", "model.max_length"),
    ("context_length", "model.max_length"),
    ("resid_pdrop", "model.dropout"),
    ("hidden_dropout_prob", "model.dropout"),
    ("attn_pdrop", "model.attention_dropout"),
    ("attn_dropout", "model.attention_dropout"),
    ("attention_probs_dropout_prob", "model.attention_dropout"),
    ("lr", "training.learning_rate"),
    ("max_lr", "training.learning_rate"),
    ("max_iters", "training.max_steps"),
    ("num_steps", "training.max_steps"),
    ("train_steps", "training.max_steps"),
    ("total_steps", "training.max_steps"),
    ("max_train_steps", "training.max_steps"),
    ("warmup_iters", "training.warmup_steps"),
    ("num_warmup_steps", "training.warmup_steps"),
    ("lr_scheduler_type", "training.lr_schedule"),
    ("per_device_train_batch_size", "training.batch_size"),
    ("train_batch_size", "training.batch_size"),
    ("micro_batch_size", "training.batch_size"),
    (
        "accumulate_grad_batches",
        "training.gradient_accumulation_steps",
    ),
    ("grad_accum_steps", "training.gradient_accumulation_steps"),
    ("num_train_epochs", "training.epochs"),
    ("max_epochs", "training.epochs"),
    ("max_grad_norm", "training.grad_clip"),
    ("gradient_clip_val", "training.grad_clip"),
    ("adam_beta1", "training.beta1"),
    ("adam_beta2", "training.beta2"),
    ("adam_epsilon", "training.eps"),
    ("label_smoothing_factor", "training.label_smoothing"),
    ("eval_interval", "eval.eval_steps"),
    ("val_check_interval", "eval.eval_steps"),
    ("per_device_eval_batch_size", "eval.batch_size"),
    ("early_stopping_patience", "eval.patience"),
    ("log_interval", "logging.logging_steps"),
    ("log_every_n_steps", "logging.logging_steps"),
    ("save_steps", "checkpoint.every_steps"),
    ("save_total_limit", "checkpoint.keep"),
    ("dataloader_num_workers", "loader.num_workers"),
    ("torch_compile", "optimization.compile"),
    ("dataset", "data.path"),
    ("dataset_name", "data.path"),
    ("train_file", "data.path"),
    ("model_name_or_path", "model.init_from"),
    ("decay_lr", "training.lr_schedule"),
    ("out_dir", "run.dir"),
    ("output_dir", "run.dir"),
];

/// The kiln key another tool's name `field` means ([`FOREIGN_NAMES`]).
pub(crate) fn foreign_name(field: &str) -> Option<&'static str> {
    FOREIGN_NAMES
        .iter()
        .find(|(name, _)| *name == field)
        .map(|(_, key)| *key)
}

/// The kiln overrides another tool's setting `name` = `value` means, where
/// what it means depends on the value: transformers' `bf16=true` and
/// `fp16=true`, nanoGPT's `dtype=bfloat16`, Accelerate's
/// `mixed_precision=fp16`, Lightning's `precision=bf16-mixed`, nanoGPT's
/// `device=cuda`, Lightning's `accelerator=gpu` and `devices=4` (a job of
/// ranks: `kiln launch`), Hydra's `defaults` list (the preset keys).
/// `value` is as written, without quotes. `None` where the value means
/// nothing kiln has.
pub fn foreign_setting(name: &str, value: &str) -> Option<String> {
    let value = value.trim().to_ascii_lowercase();
    let v = value.as_str();
    match name {
        "bf16" | "fp16" => match v {
            "true" | "1" => Some(mixed(name)),
            "false" | "0" => Some(no_mixed()),
            _ => None,
        },
        "dtype" | "torch_dtype" | "mixed_precision" | "precision" => {
            // Lightning's "bf16-mixed", "16-mixed", "32-true"; torch's
            // "torch.bfloat16".
            let v = v.strip_prefix("torch.").unwrap_or(v);
            let v = v
                .strip_suffix("-mixed")
                .or_else(|| v.strip_suffix("-true"))
                .unwrap_or(v);
            match v {
                "bfloat16" | "bf16" => Some(mixed("bf16")),
                "float16" | "fp16" | "half" | "16" => Some(mixed("fp16")),
                "float32" | "fp32" | "float" | "32" | "no" => Some(no_mixed()),
                _ => None,
            }
        }
        "device" | "accelerator" => {
            let (kind, index) = v.split_once(':').unwrap_or((v, ""));
            let backend = match kind {
                "cuda" | "gpu" => "cuda",
                "cpu" => "flex",
                "rocm" | "hip" => "rocm",
                "mps" | "metal" | "vulkan" => "wgpu",
                "auto" => "auto",
                _ => return None,
            };
            match index.parse::<usize>() {
                Ok(i) => Some(format!("device.backend={backend} device.index={i}")),
                Err(_) if index.is_empty() => Some(format!("device.backend={backend}")),
                Err(_) => None,
            }
        }
        // Hydra's defaults list: kiln's presets are two keys.
        "defaults" => Some("hardware=<name> experiment=<name>".into()),
        "devices" | "nproc_per_node" | "num_gpus" | "n_gpu" => match v.parse::<usize>() {
            Ok(n) if n > 1 => Some(format!("kiln launch --nproc-per-node {n} train …")),
            _ => None,
        },
        _ => None,
    }
}

fn mixed(dtype: &str) -> String {
    format!("precision.amp=true precision.amp_dtype={dtype}")
}

fn no_mixed() -> String {
    "precision.amp=false".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_that_depend_on_their_value_are_answered_with_the_overrides_they_mean() {
        let amp_bf16 = "precision.amp=true precision.amp_dtype=bf16";
        let amp_fp16 = "precision.amp=true precision.amp_dtype=fp16";
        for (name, value, means) in [
            ("bf16", "true", amp_bf16),
            ("fp16", "True", amp_fp16),
            ("fp16", "false", "precision.amp=false"),
            ("dtype", "bfloat16", amp_bf16),
            ("dtype", "float16", amp_fp16),
            ("dtype", "float32", "precision.amp=false"),
            ("torch_dtype", "torch.bfloat16", amp_bf16),
            ("mixed_precision", "no", "precision.amp=false"),
            ("precision", "bf16-mixed", amp_bf16),
            ("precision", "16-mixed", amp_fp16),
            ("precision", "32-true", "precision.amp=false"),
            ("device", "cuda", "device.backend=cuda"),
            ("device", "cuda:1", "device.backend=cuda device.index=1"),
            ("device", "cpu", "device.backend=flex"),
            ("accelerator", "gpu", "device.backend=cuda"),
            ("devices", "4", "kiln launch --nproc-per-node 4 train …"),
            (
                "defaults",
                "[{hardware = \"t4\"}]",
                "hardware=<name> experiment=<name>",
            ),
        ] {
            assert_eq!(
                foreign_setting(name, value).as_deref(),
                Some(means),
                "{name}={value}"
            );
        }
        for (name, value) in [
            ("bf16", "maybe"),
            ("dtype", "int8"),
            ("device", "tpu"),
            ("device", "cuda:x"),
            ("devices", "auto"),
            ("devices", "1"),
            ("learning_rate", "1"),
        ] {
            assert_eq!(foreign_setting(name, value), None, "{name}={value}");
        }
    }
}
