//! The GPU code path, on whatever Vulkan device wgpu finds (in CI: Mesa's
//! software device, llvmpipe — correctness, never speed). Built only with
//! this crate's `wgpu` feature: `cargo test -p kiln-tests --features wgpu gpu::`.
//!
//! A GPU run draws its initial weights on the CPU with the same seed, so a
//! wgpu run and a flex run start from the same model and see the same
//! batches; their losses differ only by floating-point summation order.

use std::path::Path;

use crate::support::kiln;
use crate::train::tiny;

/// The loss `kiln bench <workload>` reaches after `steps` steps on a backend.
fn final_loss(dir: &Path, workload: &str, backend: &str, steps: usize, extra: &[&str]) -> f64 {
    let mut args: Vec<String> = vec![
        "bench".into(),
        workload.into(),
        "--json".into(),
        "--warmup=0".into(),
        format!("--steps={steps}"),
    ];
    args.extend(
        tiny(dir, "unused", 10)
            .into_iter()
            .skip(1)
            .filter(|a| !a.starts_with("run.dir")),
    );
    args.push(format!("device.backend={backend}"));
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = kiln(&refs).run().expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    let want = if backend == "wgpu" { "wgpu" } else { "flex" };
    assert!(
        v["bench"]["backend"]
            .as_str()
            .is_some_and(|b| b.starts_with(want)),
        "{}",
        v["bench"]["backend"]
    );
    v["bench"]["final_loss"].as_f64().expect("final_loss")
}

/// Tolerances: the first step's loss (same weights, same batch) within
/// 1e-4; after 20 steps of AdamW within 1e-3 (f32 sums in another order,
/// amplified by the updates). Measured on llvmpipe: 2e-6 and 7e-7.
fn agree(workload: &str, extra: &[&str]) {
    let tmp = tempfile::tempdir().expect("tempdir");
    for (steps, tol) in [(1, 1e-4), (20, 1e-3)] {
        let flex = final_loss(tmp.path(), workload, "flex", steps, extra);
        let wgpu = final_loss(tmp.path(), workload, "wgpu", steps, extra);
        assert!(
            (flex - wgpu).abs() < tol,
            "{workload} after {steps} step(s): flex {flex} vs wgpu {wgpu} (tolerance {tol})"
        );
    }
}

#[test]
fn lm_steps_on_wgpu_agree_with_flex() {
    agree("lm", &[]);
}

#[test]
fn nli_steps_on_wgpu_agree_with_flex() {
    agree(
        "nli",
        &[
            "experiment=nli_snli",
            "data.path=data/snli_sample.jsonl",
            "model.dropout=0.0",
            "model.max_length=48",
        ],
    );
}

#[test]
fn a_short_training_run_on_wgpu_ends_with_its_run_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "run", 30);
    args.push("device.backend=wgpu".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = kiln(&refs).run().expect_code(0);
    run.stdout_has(&["backend: wgpu (GPU)"]);
    let summary = std::fs::read_to_string(tmp.path().join("run/summary.json")).expect("summary");
    let v: serde_json::Value = serde_json::from_str(&summary).expect("json");
    assert!(
        v["final_val_loss"].as_f64().is_some_and(f64::is_finite),
        "{v}"
    );
}
