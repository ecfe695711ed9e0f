//! kiln-train: the only crate that owns a training loop, a device and a
//! checkpoint (precision policy, k-fold cross-validation, tuning).
//!
//! Not built yet: this crate is a placeholder in the workspace layout, and
//! exports nothing.
