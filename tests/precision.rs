//! The mixed-precision policy end to end on flex: bf16 and fp16 runs end
//! where the f32 run ends, parameters and optimizer state stay f32, and
//! fp16's loss scaler backs off, skips and grows as specified.

use std::path::Path;

use crate::support::{kill_when, kiln};
use crate::train::{checkpoint_digest, ckpt, final_val_loss, tiny, train_tiny as train};

fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

/// The header of a run's newest checkpoint and the dtypes of its tensors.
fn last_checkpoint(run: &Path) -> (serde_json::Value, Vec<(String, String)>) {
    let mut files: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
        .expect("checkpoints")
        .map(|e| e.expect("entry").path())
        .collect();
    files.sort();
    let bytes = std::fs::read(files.last().expect("a checkpoint")).expect("read");
    let len = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len]).expect("header");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let dtypes = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, format!("{:?}", view.dtype())))
        .collect();
    (header, dtypes)
}

/// 100 steps of the tiny LM in f32, bf16 and fp16 compute from the same
/// seed. Tolerance 0.02 on the validation loss (measured: equal to 4
/// decimals, 3.2445 each); every saved tensor (weights, Adam moments) f32.
#[test]
fn bf16_and_fp16_runs_end_near_the_f32_run_with_f32_state() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let common = ["checkpoint.every_steps=100"];
    train(tmp.path(), "f32", 100, &common)
        .expect_code(0)
        .stdout_has(&["precision: f32 — precision.amp is off"]);
    let reference = final_val_loss(&tmp.path().join("f32"));
    for (dtype, label) in [
        ("bf16", "precision: bf16 compute, f32 master weights"),
        (
            "fp16",
            "precision: fp16 compute with dynamic loss scaling, f32 master weights",
        ),
    ] {
        let amp = format!("precision.amp_dtype={dtype}");
        let mut args = common.to_vec();
        args.extend(["precision.amp=true", amp.as_str()]);
        let run = train(tmp.path(), dtype, 100, &args).expect_code(0);
        run.stdout_has(&[label]);
        let dir = tmp.path().join(dtype);
        let loss = final_val_loss(&dir);
        assert!(
            (loss - reference).abs() < 0.02,
            "{dtype}: val loss {loss} vs f32 {reference}"
        );
        let (header, dtypes) = last_checkpoint(&dir);
        assert!(
            dtypes.iter().any(|(n, _)| n.starts_with("adam_m/")),
            "{dtypes:?}"
        );
        for (name, d) in &dtypes {
            assert_eq!(d, "F32", "{dtype} run saved {name} as {d}");
        }
        let scale = &header["__metadata__"]["loss_scale"];
        assert_eq!(scale.is_string(), dtype == "fp16", "{header}");
    }
}

/// An overflow injected by a loss scale far too large (2^40): each step
/// overflows, is skipped and halves the scale until the gradients fit; then
/// 5 clean steps (the configured growth interval) double it. The overflows
/// do not stop the run (they are the scale's doing, not the model's).
#[test]
fn the_fp16_loss_scaler_backs_off_skips_and_grows() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = train(
        tmp.path(),
        "run",
        60,
        &[
            "precision.amp=true",
            "precision.amp_dtype=fp16",
            "precision.loss_scale_init=1099511627776",
            "precision.loss_scale_growth_interval=5",
            "precision.max_bad_steps=2",
            "checkpoint.every_steps=60",
        ],
    )
    .expect_code(0);
    run.stdout_has(&[
        "step 1: fp16 gradients overflowed at loss scale 1099511627776: step skipped, scale halved to 549755813888",
    ]);
    let m = metrics(&tmp.path().join("run"));
    let skipped: Vec<&serde_json::Value> = m.iter().filter(|v| v["kind"] == "skipped").collect();
    // Backs off: the first steps each halve the scale, from 2^39 down.
    for (i, s) in skipped.iter().take(10).enumerate() {
        assert_eq!(s["step"], i + 1, "{s}");
        assert_eq!(s["loss_scale"], 2f64.powi(39 - i as i32), "{s}");
    }
    // Grows: doublings after clean steps, each from the scale before it.
    let mut scale = 2f64.powi(40);
    let mut grown = 0;
    let steps: Vec<&serde_json::Value> = m.iter().filter(|v| v["kind"] == "step").collect();
    assert!(!steps.is_empty());
    for v in &m {
        match v["kind"].as_str() {
            Some("skipped") => {
                scale /= 2.0;
                assert_eq!(v["loss_scale"].as_f64(), Some(scale), "{v}");
            }
            Some("loss_scale") => {
                scale *= 2.0;
                grown += 1;
                assert_eq!(v["scale"].as_f64(), Some(scale), "{v}");
            }
            _ => {}
        }
    }
    assert!(grown >= 1, "no growth in 60 steps");
    // The run finished, finite, and its checkpoint carries the scale.
    let val = final_val_loss(&tmp.path().join("run"));
    assert!(val.is_finite(), "{val}");
    let (header, _) = last_checkpoint(&tmp.path().join("run"));
    assert_eq!(
        header["__metadata__"]["loss_scale"].as_str(),
        Some(scale.to_string().as_str()),
        "{header}"
    );
}

/// fp16 with a scale that changes early (an overflowing start, growth every
/// 5 clean steps), killed after its first checkpoint and resumed: the
/// resumed run continues from the checkpoint's loss scale, not from
/// `loss_scale_init`, and ends bitwise where the uninterrupted run ends.
#[test]
fn a_killed_fp16_run_resumes_with_its_loss_scale() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let steps = 300;
    let args = |run: &str| {
        let mut a = tiny(tmp.path(), run, steps);
        a.extend(
            [
                "precision.amp=true",
                "precision.amp_dtype=fp16",
                "precision.loss_scale_init=1099511627776",
                "precision.loss_scale_growth_interval=5",
            ]
            .map(String::from),
        );
        a
    };
    let whole_args = args("whole");
    let whole: Vec<&str> = whole_args.iter().map(String::as_str).collect();
    kiln(&whole).run().expect_code(0);
    let killed = tmp.path().join("killed");
    kill_when(&args("killed"), &ckpt(&killed, 100), &ckpt(&killed, steps));
    kiln(&["resume", killed.to_str().expect("utf-8")])
        .run()
        .expect_code(0)
        .stdout_has(&["resuming", "from step 100"]);
    assert_eq!(
        checkpoint_digest(&ckpt(&killed, steps)),
        checkpoint_digest(&ckpt(&tmp.path().join("whole"), steps))
    );
}
