//! kiln-data: tokenizers, datasets and the parallel loader, with no ML
//! framework: it yields host batches (token ids, masks, labels) and measures
//! how long the consumer waited for each.
//!
//! Not built yet: this crate is a placeholder in the workspace layout, and
//! exports nothing.
