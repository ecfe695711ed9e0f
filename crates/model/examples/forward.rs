//! `cargo run -p kiln-model --example forward`: a small GPT on the flex (CPU)
//! backend learns a repeating sequence in 60 steps of Burn's AdamW, then
//! continues it greedily.

#![allow(clippy::print_stdout, reason = "an example prints")]

use kiln_model::burn::optim::{AdamWConfig, GradientsParams};
use kiln_model::burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_model::{GeluKind, GptConfig};

fn main() -> Result<(), kiln_model::NonFiniteLogits> {
    // 10 tokens, context 16, 2 blocks of 2 heads, 32 wide (MLP 4 × 32).
    let config = GptConfig::new(10, 16, 2, 2, 32).with_gelu(GeluKind::Exact);
    let device = Device::flex().autodiff();
    device.seed(1);
    let mut model = config.init(&device);
    // 0 1 2 … 9 0 1 2 …: each token's successor is its value plus one.
    let sequence: Vec<i64> = (0..4 * 17).map(|i| i % 10).collect();
    let rows = |offset: usize| -> Vec<i64> {
        (0..4)
            .flat_map(|r| sequence[r * 17 + offset..r * 17 + offset + 16].to_vec())
            .collect()
    };
    let tensor =
        |ids: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(ids, [4, 16]), &device);
    let (inputs, targets) = (tensor(rows(0)), tensor(rows(1)));
    let mut optim = AdamWConfig::new().init();
    for step in 1..=60 {
        let loss = model.loss(inputs.clone(), targets.clone());
        let value: f32 = loss.clone().into_scalar();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
        if step % 20 == 0 || step == 1 {
            println!("step {step:>2}: loss {value:.4}");
        }
    }
    let mut rng = rand::rng();
    let continued = model.generate(
        &[3, 4, 5],
        8,
        &kiln_model::Sampling::new(1.0, 1),
        &mut rng,
        &device,
    )?;
    println!("3 4 5 continues as {continued:?}");
    Ok(())
}
