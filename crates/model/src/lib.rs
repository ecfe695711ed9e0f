//! kiln-model: the Burn models (a GPT decoder and a sentence-pair encoder
//! classifier) and their FLOP counts. No I/O.
//!
//! Not built yet: this crate is a placeholder in the workspace layout, and
//! exports nothing.
