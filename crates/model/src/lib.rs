//! kiln-model: Burn models and their FLOP counts. No I/O.
//!
//! - [`Gpt`]: a GPT decoder (token and position embeddings, pre-LayerNorm
//!   blocks, causal self-attention, GELU MLP, weight tying, dropout), its
//!   parameter count, FLOPs per token as nanoGPT counts them, and
//!   [`Gpt::generate`].

mod gpt;

pub use gpt::{GeluKind, Gpt, GptConfig, cross_entropy};
