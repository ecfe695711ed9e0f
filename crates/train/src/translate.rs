//! The one translation from the run configuration to the library types:
//! kiln-config's enums and sections become kiln-model's and kiln-data's.
//! (Which GPU a run uses is `kiln_plan::run_gpu`; `hardware=auto` writes
//! it into `device.index`.)

use kiln_config::{BadRowsMode, Gelu, PairsFormat, Pooling, RunConfig};
use kiln_data::{BadRows, PairFormat, PairSchema};
use kiln_model::{EncoderConfig, GeluKind, GptConfig, PoolingKind};

fn gelu(g: Gelu) -> GeluKind {
    match g {
        Gelu::Exact => GeluKind::Exact,
        Gelu::Tanh => GeluKind::Tanh,
    }
}

/// The model shape of a configuration, for a vocabulary.
pub(crate) fn gpt_config(config: &RunConfig, vocab_size: usize) -> GptConfig {
    let m = &config.model;
    GptConfig::new(vocab_size, m.max_length, m.layers, m.heads, m.hidden)
        .with_intermediate(m.intermediate)
        .with_dropout(m.dropout)
        .with_attention_dropout(m.attention_dropout)
        .with_gelu(gelu(m.gelu))
        .with_vocab_multiple(m.vocab_multiple)
}

/// The pair schema of a configuration.
pub(crate) fn schema(config: &RunConfig, require_label: bool) -> PairSchema {
    let d = &config.data;
    PairSchema {
        premise: d.premise_field.clone(),
        hypothesis: d.hypothesis_field.clone(),
        label: d.label_field.clone(),
        labels: d.labels.clone(),
        bad_rows: match d.bad_rows {
            BadRowsMode::Skip => BadRows::Skip,
            BadRowsMode::Error => BadRows::Error,
        },
        format: match d.format {
            PairsFormat::Auto => PairFormat::Auto,
            PairsFormat::Jsonl => PairFormat::Jsonl,
            PairsFormat::Tsv => PairFormat::Tsv,
            PairsFormat::Csv => PairFormat::Csv,
        },
        require_label,
    }
}

/// The encoder shape of a configuration, for a vocabulary.
pub(crate) fn encoder_config(config: &RunConfig, vocab_size: usize) -> EncoderConfig {
    let m = &config.model;
    EncoderConfig::new(
        vocab_size,
        m.max_length,
        m.layers,
        m.heads,
        m.hidden,
        config.data.labels.len(),
    )
    .with_intermediate(m.intermediate)
    .with_dropout(m.dropout)
    .with_attention_dropout(m.attention_dropout)
    .with_pooling(match m.pooling {
        Pooling::Cls => PoolingKind::Cls,
        Pooling::Pooler => PoolingKind::Pooler,
        Pooling::Mean => PoolingKind::Mean,
    })
    .with_pooler_activation(match m.pooler_activation {
        kiln_config::PoolerActivation::Tanh => kiln_model::PoolerActivation::Tanh,
        kiln_config::PoolerActivation::Gelu => kiln_model::PoolerActivation::Gelu,
        kiln_config::PoolerActivation::Relu => kiln_model::PoolerActivation::Relu,
    })
    .with_segments(m.segments)
    .with_embedding(Some(m.embedding_width()).filter(|&width| width != m.hidden))
    .with_gelu(gelu(m.gelu))
    .with_layer_norm_eps(m.layer_norm_eps)
}

/// The kernels `optimization.kernels` asks the models to run.
pub(crate) fn kernels(config: &RunConfig) -> kiln_model::Kernels {
    match config.optimization.kernels {
        kiln_config::KernelChoice::Fused => kiln_model::Kernels::Fused,
        kiln_config::KernelChoice::Reference => kiln_model::Kernels::Reference,
    }
}

/// The self-attention `optimization.attention` asks the models to run.
pub(crate) fn attention(config: &RunConfig) -> kiln_model::AttentionKernel {
    use kiln_config::AttentionChoice;
    use kiln_model::AttentionKernel;
    match config.optimization.attention {
        AttentionChoice::Auto => AttentionKernel::Auto,
        AttentionChoice::Flash => AttentionKernel::Flash,
        AttentionChoice::MemoryEfficient => AttentionKernel::MemoryEfficient,
        AttentionChoice::Math => AttentionKernel::Math,
    }
}

/// kiln-data's error about a pairs file, with the configuration keys that
/// change what it complains about: `data.bad_rows` for a bad row read with
/// `bad_rows = "error"`, `data.premise_field` / `data.hypothesis_field` for
/// a missing field.
pub(crate) fn with_config_keys(
    e: kiln_data::DataError,
    config: &RunConfig,
) -> kiln_data::DataError {
    match e {
        kiln_data::DataError::BadRow { path, line, why } => {
            let hint = if why.starts_with("no field") {
                "; set data.premise_field / data.hypothesis_field to the file's names"
            } else if config.data.bad_rows == kiln_config::BadRowsMode::Error {
                "; set data.bad_rows = \"skip\" to skip such rows"
            } else {
                ""
            };
            kiln_data::DataError::BadRow {
                path,
                line,
                why: format!("{why}{hint}"),
            }
        }
        other => other,
    }
}
