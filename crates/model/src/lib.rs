#![doc = include_str!("../README.md")]
//!
//! ## In this crate
//!
//! kiln-model: Burn models and their FLOP counts. No I/O.
//!
//! - [`Gpt`]: a GPT decoder (token and position embeddings, pre-LayerNorm
//!   blocks, causal self-attention, GELU MLP, weight tying, dropout), its
//!   parameter count, FLOPs per token as nanoGPT counts them, and
//!   [`Gpt::generate`].
//! - [`EncoderClassifier`]: a BERT-style encoder for sentence pairs (token,
//!   position and segment embeddings, padding-masked attention, [CLS] or
//!   mean pooling, a classification head), with FLOPs per sequence counting
//!   real or padded tokens and a frozen-encoder mode.
//! - [`precision`]: the mixed-precision policy both models follow: f32
//!   parameters, products in a [`ComputeDtype`], everything else f32.
//! - [`kernels`]: fused CPU kernels (Burn backend extensions with their own
//!   backward) for the element-wise hot spots, chosen by [`Kernels`].
//! - [`device_memory`]: what CubeCL's allocator holds on a GPU.
#![warn(missing_docs)]

/// Burn, whose tensors and devices the models take (`burn::tensor::Device`).
pub use burn;

/// `with_<field>` setters of a config struct, each with its doc.
macro_rules! with_setters {
    ($($(#[$doc:meta])* $name:ident: $field:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $field: $ty) -> Self {
                self.$field = $field;
                self
            }
        )*
    };
}

mod device_memory;
mod encoder;
mod gpt;
pub mod kernels;
pub mod precision;

pub use device_memory::{DeviceMemory, device_memory, gpu_runtime};
pub use encoder::{EncoderClassifier, EncoderConfig, PoolerActivation, PoolingKind};
pub use gpt::{
    GeluKind, Gpt, GptConfig, NonFiniteLogits, Sampling, cross_entropy, smoothed_cross_entropy,
};
pub use kernels::{AttentionKernel, Kernels};
pub use precision::ComputeDtype;
