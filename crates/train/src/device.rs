//! Choosing the device: `device.backend = auto | cuda | wgpu | flex`.

use burn::tensor::Device;
use kiln_config::Backend;

use crate::TrainError;

/// The device a run uses, and why.
#[derive(Clone, Debug)]
pub struct DeviceChoice {
    pub device: Device,
    /// "flex (CPU)", ...
    pub name: String,
    pub why: String,
    pub is_gpu: bool,
}

/// The device for `backend`. This build has the `flex` CPU backend only;
/// asking for another names the feature it needs.
pub fn select_device(backend: Backend) -> Result<DeviceChoice, TrainError> {
    let flex = |why: &str| DeviceChoice {
        device: Device::flex(),
        name: "flex (CPU)".to_string(),
        why: why.to_string(),
        is_gpu: false,
    };
    match backend {
        Backend::Flex => Ok(flex("device.backend = flex")),
        Backend::Auto => Ok(flex(
            "auto: this build has no GPU backend (the `wgpu` and `cuda` features are off), so the CPU",
        )),
        Backend::Wgpu | Backend::Cuda => {
            let name = if backend == Backend::Wgpu {
                "wgpu"
            } else {
                "cuda"
            };
            Err(TrainError::Backend {
                backend: name.to_string(),
                why: format!(
                    "kiln was built without the `{name}` feature; rebuild with `--features {name}` or set device.backend=auto"
                ),
            })
        }
    }
}
