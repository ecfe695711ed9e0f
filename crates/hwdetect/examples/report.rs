//! `cargo run -p kiln-hwdetect --example report [-- --json]`: this machine's
//! report, in words or as JSON, and the dtype each GPU should train in.

#![allow(clippy::print_stdout, reason = "an example prints")]

fn main() -> Result<(), serde_json::Error> {
    let report = kiln_hwdetect::detect();
    if std::env::args().any(|a| a == "--json") {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print!("{report}");
    println!("machine id: {}", report.machine_id());
    for gpu in report.gpus() {
        let c = gpu.capabilities;
        let advice = match (c.bf16, c.fp16, c.tf32) {
            (true, _, true) => "bf16 autocast, TF32 for the f32 matmuls",
            (true, _, false) => "bf16 autocast",
            (false, true, _) => "fp16 autocast with loss scaling",
            _ => "f32",
        };
        println!("GPU {}: {advice}", gpu.index);
    }
    if report.gpus().is_empty() {
        println!("no NVIDIA GPU: train on the CPU in f32");
    }
    Ok(())
}
