//! One integration binary: end-to-end tests of the `kiln` binary, and hygiene
//! checks that keep docs, presets and code in step.

mod cli;
mod dist;
#[cfg(feature = "wgpu")]
mod gpu;
mod hygiene;
mod measure;
mod nli;
mod precision;
mod store;
mod support;
mod sweep;
mod tensorboard;
mod train;
#[cfg(unix)]
mod tui;
mod xtask;
