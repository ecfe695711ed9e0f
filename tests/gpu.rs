//! The GPU code path, on whatever Vulkan device wgpu finds (in CI: Mesa's
//! software device, llvmpipe — correctness, never speed). Built only with
//! this crate's `wgpu` feature: `cargo test -p kiln-tests --features wgpu gpu::`;
//! with `--features fusion` the same suite runs on a `kiln` built with Burn's
//! operation fusion, so fused and unfused steps are each held to flex.
//!
//! A GPU run draws its initial weights on the CPU with the same seed, so a
//! wgpu run and a flex run start from the same model and see the same
//! batches; their losses differ only by floating-point summation order.

use std::path::Path;

use crate::support::kiln;
use crate::train::{final_val_loss, tiny, train_tiny};

/// `kiln bench <workload> --json` on the tiny model for `steps` steps on a
/// backend, `extra` (overrides, flags) last.
fn bench_on(
    dir: &Path,
    workload: &str,
    backend: &str,
    steps: usize,
    extra: &[&str],
) -> crate::support::Run {
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
    kiln(&refs).run().expect_code(0)
}

/// The loss `kiln bench <workload>` reaches after `steps` steps on a backend.
fn final_loss(dir: &Path, workload: &str, backend: &str, steps: usize, extra: &[&str]) -> f64 {
    let run = bench_on(dir, workload, backend, steps, extra);
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

/// `kiln bench --kernel-profile=1` on wgpu: one more step after the timed
/// ones with each kernel timed, its table in the JSON (launches, device
/// time, the kernels most first, shares adding up to 100 %, the matrix
/// products among them, no reduction of Burn's per layer), and the timed
/// steps untouched by it.
#[test]
fn a_kernel_profile_lists_where_the_device_time_goes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let plain = final_loss(tmp.path(), "lm", "wgpu", 2, &[]);
    let run = bench_on(tmp.path(), "lm", "wgpu", 2, &["--kernel-profile=1"]);
    crate::measure::check_schema("bench-schema", &run.stdout);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    let b = &v["bench"];
    // The allocator's own high-water mark: at least the model's f32
    // weights, gradients and AdamW's moments (16 bytes a parameter).
    let parameters = b["parameters"].as_u64().expect("parameters");
    assert!(
        b["device_memory_peak_bytes"]
            .as_u64()
            .is_some_and(|peak| peak >= 16 * parameters),
        "{}",
        b["device_memory_peak_bytes"]
    );
    assert!(
        b["final_loss"]
            .as_f64()
            .is_some_and(|l| (l - plain).abs() < 1e-5),
        "the profiled step comes after the timed ones: {} against {plain}",
        b["final_loss"]
    );
    let p = &b["kernel_profile"];
    assert_eq!(p["profiled_steps"], 1, "{p}");
    assert!(
        p["launches_per_step"].as_f64().is_some_and(|n| n >= 10.0),
        "{p}"
    );
    assert!(
        p["device_ms_per_step"].as_f64().is_some_and(|t| t > 0.0),
        "{p}"
    );
    assert!(
        p["device_busy_pct"].as_f64().is_some_and(|t| t > 0.0),
        "{p}"
    );
    assert!(
        ["device", "system", "mixed"].contains(&p["timing"].as_str().unwrap_or("")),
        "{p}"
    );
    let kernels = p["kernels"].as_array().expect("kernels");
    let ms: Vec<f64> = kernels
        .iter()
        .map(|k| k["ms_per_step"].as_f64().expect("ms"))
        .collect();
    let listed = if kernels.len() > 15 {
        &ms[..15]
    } else {
        &ms[..]
    };
    assert!(
        listed.windows(2).all(|w| w[0] >= w[1]),
        "most time first: {p}"
    );
    let shares: f64 = kernels
        .iter()
        .map(|k| k["share_pct"].as_f64().expect("share"))
        .sum();
    assert!((shares - 100.0).abs() < 1e-6, "{p}");
    let launches: f64 = kernels
        .iter()
        .map(|k| k["launches_per_step"].as_f64().expect("launches"))
        .sum();
    assert_eq!(Some(launches), p["launches_per_step"].as_f64(), "{p}");
    assert!(
        kernels.iter().any(|k| k["name"]
            .as_str()
            .is_some_and(|n| n.to_lowercase().contains("matmul"))),
        "the linear layers' products are kernels: {p}"
    );
    // No reduction of Burn's runs per layer (the tiny model has 2): a
    // linear layer's bias gradient and LayerNorm's gamma and beta ones are
    // kiln's column sums, and a weight's gradient is one product over all
    // rows, not a product per batch entry summed by a reduction (13 of
    // Burn's reductions a layer and micro-batch on the H200 before).
    // Two a step remain (the loss's); one a layer would make four.
    if !cfg!(feature = "fusion") {
        let layers = 2.0;
        assert!(
            kernels.iter().any(|k| k["name"] == "ColumnSumKernel"),
            "{p}"
        );
        for k in kernels {
            let name = k["name"].as_str().unwrap_or("");
            assert!(
                !name.starts_with("Reduce")
                    || k["launches_per_step"]
                        .as_f64()
                        .is_some_and(|n| n < 2.0 * layers),
                "Burn's reductions per layer: {p}"
            );
        }
    }
    // kiln's kernels launch fewer: one per LayerNorm, GELU and parameter
    // (the gradient norm) and direction, where Burn's compositions launch
    // some 34, 20 and 3 (without `fusion`; under it both sides are fused).
    let reference = bench_on(
        tmp.path(),
        "lm",
        "wgpu",
        1,
        &["--kernel-profile=1", "optimization.kernels=reference"],
    );
    let r: serde_json::Value = serde_json::from_str(&reference.stdout).expect("json");
    let launches = |v: &serde_json::Value| {
        v["kernel_profile"]["launches_per_step"]
            .as_f64()
            .expect("launches")
    };
    let (fused, composed) = (launches(b), launches(&r["bench"]));
    let most = if cfg!(feature = "fusion") { 1.0 } else { 0.6 };
    assert!(
        fused <= most * composed,
        "{fused} launches a step with kiln's kernels, {composed} with Burn's compositions"
    );
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

/// The loss a run logged at `step` (`step     1/30 | loss 4.0557 | …`).
fn logged_loss(stdout: &str, step: u32) -> f64 {
    let prefix = format!("{step}/");
    stdout
        .lines()
        .filter_map(|l| {
            let mut parts = l.split('|');
            let mut head = parts.next()?.split_whitespace();
            (head.next()? == "step" && head.next()?.starts_with(&prefix)).then_some(())?;
            parts
                .next()?
                .trim()
                .strip_prefix("loss ")?
                .trim()
                .parse()
                .ok()
        })
        .next()
        .unwrap_or_else(|| panic!("no loss logged for step {step}: {stdout}"))
}

/// `kiln train` on wgpu ends with its run directory, and follows the flex
/// run of the same seed: the first step's loss within 1e-4, the final
/// validation loss within 1e-3 (the tolerances of the bench comparison).
#[test]
fn a_short_training_run_on_wgpu_follows_the_flex_run() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = |backend: &str| {
        let device = format!("device.backend={backend}");
        let out = train_tiny(
            tmp.path(),
            backend,
            30,
            &[device.as_str(), "logging.logging_steps=10"],
        )
        .expect_code(0);
        (out, final_val_loss(&tmp.path().join(backend)))
    };
    let (wgpu, wgpu_val) = run("wgpu");
    wgpu.stdout_has(&[
        // "wgpu (GPU, WGSL)", or "wgpu (GPU, SPIR-V)" from a build with
        // `vulkan` on a Vulkan device (CI's; TEST_WGPU_LANGUAGE below).
        "backend: wgpu (GPU, ",
        if cfg!(feature = "fusion") {
            "fusion built in (always on in this build)"
        } else {
            "fusion not in this build"
        },
    ]);
    // The kernel language the binary's wgpu device must have compiled to
    // (CI: SPIR-V, its build having `vulkan`), so that a silent fall back
    // to WGSL fails the suite.
    if let Ok(language) = std::env::var("TEST_WGPU_LANGUAGE") {
        wgpu.stdout_has(&[&format!("backend: wgpu (GPU, {language})")]);
    }
    let (flex, flex_val) = run("flex");
    // The step lines' memory is the GPU allocator's on wgpu, the process's
    // RAM on flex.
    assert!(
        wgpu.stdout
            .lines()
            .filter(|l| l.contains("| mem "))
            .all(|l| l.ends_with(" on the GPU")),
        "{}",
        wgpu.stdout
    );
    assert!(!flex.stdout.contains(" on the GPU"), "{}", flex.stdout);
    let (a, b) = (logged_loss(&flex.stdout, 1), logged_loss(&wgpu.stdout, 1));
    assert!((a - b).abs() < 1e-4, "step 1: flex {a} vs wgpu {b}");
    assert!(
        (flex_val - wgpu_val).abs() < 1e-3,
        "val loss after 30 steps: flex {flex_val} vs wgpu {wgpu_val}"
    );
}

/// The final validation loss of a `kiln train` run and its start lines.
fn train_on_wgpu(dir: &Path, run: &str, steps: u32, extra: &[&str]) -> (f64, String) {
    let mut extra = extra.to_vec();
    extra.push("device.backend=wgpu");
    let out = train_tiny(dir, run, steps, &extra).expect_code(0);
    (final_val_loss(&dir.join(run)), out.stdout)
}

/// bf16 and fp16 asked for on the wgpu device: where it computes in them,
/// 100 steps end within 0.02 of the f32 run's validation loss (as on flex);
/// where it lacks them, the fallback is taken and the start line says why.
/// The compile line reports CubeCL's autotune level for the mode, and MFU
/// counts against the peak Burn measures on the device.
#[test]
fn reduced_precision_on_wgpu_ends_near_f32_or_says_why_not() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (reference, out) = train_on_wgpu(
        tmp.path(),
        "f32",
        100,
        &[
            "optimization.compile=true",
            "optimization.compile_mode=max-autotune",
        ],
    );
    assert!(out.contains("precision: f32"), "{out}");
    assert!(
        out.contains("compile: on (max-autotune) — CubeCL autotune level full"),
        "{out}"
    );
    // MFU's denominator: the device's own f32 peak, measured by Burn.
    assert!(
        out.contains("MFU is measured against")
            && out.contains("f32 of wgpu (GPU")
            && out.contains("), measured by Burn's performance_stats"),
        "{out}"
    );
    for dtype in ["bf16", "fp16"] {
        let amp = format!("precision.amp_dtype={dtype}");
        let (loss, out) = train_on_wgpu(tmp.path(), dtype, 100, &["precision.amp=true", &amp]);
        let line = out
            .lines()
            .find(|l| l.contains("precision: "))
            .unwrap_or_else(|| panic!("no precision line: {out}"));
        if line.contains("precision: f32") {
            assert!(line.contains("→ f32"), "a fallback says why: {line}");
        } else {
            assert!(
                line.contains("bf16 compute") || line.contains("fp16 compute"),
                "{line}"
            );
            if dtype == "bf16" && line.contains("fp16 compute") {
                assert!(line.contains("no bf16 → fp16"), "{line}");
            }
            assert!(
                (loss - reference).abs() < 0.02,
                "{dtype} ({line}): val loss {loss} vs f32 {reference}"
            );
        }
    }
}

/// With CubeCL's cache turned off from the environment
/// (`CUBECL_AUTOTUNE_CACHE=false`), kiln still applies the mode's autotune
/// level, and the compile line says the tuned kernels are not kept.
#[test]
fn autotune_level_applies_with_the_cache_disabled() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = tiny(tmp.path(), "nocache", 1);
    args.extend([
        "device.backend=wgpu".to_string(),
        "optimization.compile=true".into(),
        "optimization.compile_mode=max-autotune".into(),
    ]);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs)
        .env("CUBECL_AUTOTUNE_CACHE", "false")
        .run()
        .expect_code(0)
        .stdout_has(&[
            "compile: on (max-autotune) — CubeCL autotune level full, tuned kernels not kept across runs (the cache disabled by cubecl.toml or CUBECL_AUTOTUNE_CACHE)",
        ]);
}

/// The prepared GPU check (`bench/gpu_check.py`, what a lent GPU machine
/// runs on the CUDA build) end to end with tiny shapes on this wgpu build:
/// every step it has runs and passes (the PyTorch steps are skipped where
/// no torch with CUDA is installed), and its JSON carries each benchmark's
/// figures and the GPU-vs-flex reference verdicts. The same binary stands in
/// for the NVRTC build (`--kiln-cuda-cpp`): on wgpu nothing is compiled by
/// NVRTC, so what this covers is the check's handling of that build (its
/// steps, their names and environment), not NVRTC. Once per CI run: not
/// repeated in the fused suite.
#[cfg(not(feature = "fusion"))]
#[test]
fn the_gpu_check_runs_end_to_end_with_tiny_shapes() {
    let (stdout, steps) = crate::support::gpu_check(
        &["--tiny", "--backend=wgpu", "--budget=1200"],
        &["--kiln-cuda-cpp"],
    );
    let step = |name: &str| {
        steps
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no step `{name}` in {stdout}"))
    };
    // (The `… composed` and `… scalar attention` benches, comparisons of
    // speeds, run on a real GPU only.)
    for name in [
        "check-hardware",
        "check-kernels",
        "bench lm tiny f32",
        "bench lm tiny bf16",
        "bench lm gpt2-small bf16",
        "bench lm gpt2-small f32",
        "bench nli bert-base bf16",
        "bench lm h100 preset",
        "bench lm gpt2-small bf16, 2 ranks",
        // 20 steps on a GPU, 5 with --tiny.
        "reference lm: wgpu vs flex after 5 step(s)",
        "reference nli: wgpu vs flex after 5 step(s)",
        "train-auto 300 steps",
    ] {
        assert_eq!(step(name)["status"], "ok", "{name}: {stdout}");
    }
    // Steps skipped off CUDA, saying why: the NVRTC build's
    // (`--kiln-cuda-cpp`: it would run the plain build's kernels again)
    // and cuBLAS's benches (`optimization.matmul=cublas`).
    for (name, why) in [
        ("check-kernels (NVRTC)", "CUDA's kernels only"),
        ("bench lm gpt2-small bf16 (NVRTC)", "CUDA's kernels only"),
        ("bench lm tiny f32 (NVRTC)", "CUDA's kernels only"),
        ("bench lm gpt2-small bf16 cuBLAS", "CUDA only"),
        ("bench nli bert-base bf16 cuBLAS", "CUDA only"),
        ("bench lm h100 preset cuBLAS", "CUDA only"),
        ("bench lm gpt2-small f32 cuBLAS", "CUDA only"),
    ] {
        assert_eq!(step(name)["status"], "skipped", "{name}: {stdout}");
        assert!(
            step(name)["why"]
                .as_str()
                .is_some_and(|reason| reason.contains(why)),
            "{name}: {stdout}"
        );
    }
    // The jobs of ranks against one process: each job reduced (a job that
    // trained alone has no communication in its summary, and fails this).
    let ddp = step("ddp: the jobs of ranks against one process");
    assert_eq!(ddp["status"], "ok", "{ddp}");
    assert_eq!(ddp["trained_alone"], serde_json::json!([]), "{ddp}");
    // The job's bench: two ranks, their gradients all-reduced (over the
    // sockets on wgpu; NCCL on CUDA).
    let job = &step("bench lm gpt2-small bf16, 2 ranks")["result"]["bench"];
    assert_eq!(job["world_size"], 2, "{job}");
    assert!(job["comm_pct"].as_f64().is_some_and(|c| c > 0.0), "{job}");
    let gpt2 = &step("bench lm gpt2-small bf16")["result"]["bench"];
    assert!(
        gpt2["backend"]
            .as_str()
            .is_some_and(|b| b.starts_with("wgpu")),
        "{gpt2}"
    );
    assert!(
        gpt2["tokens_per_s_median"]
            .as_f64()
            .is_some_and(|t| t > 0.0),
        "{gpt2}"
    );
    // The BPE stops where the tiny shapes' 300-token vocabulary ends.
    assert!(
        gpt2["vocab_size"]
            .as_u64()
            .is_some_and(|v| (257..=300).contains(&v)),
        "{gpt2}"
    );
    // The kernel profile of its steps (`--kernel-profile`).
    assert!(
        gpt2["kernel_profile"]["launches_per_step"]
            .as_f64()
            .is_some_and(|n| n > 0.0),
        "{gpt2}"
    );
    assert!(stdout.contains("device busy"), "{stdout}");
    let reference = step("reference lm: wgpu vs flex after 1 step(s)");
    assert!(
        reference["difference"].as_f64().is_some_and(|d| d < 1e-4),
        "{reference}"
    );
    assert!(stdout.contains("passed, 0 failed"), "{stdout}");
}

/// `kiln check-kernels` on wgpu: kiln's CubeCL kernels against Burn's
/// composition of the same operations — the AdamW update (100 steps) and
/// the memory-efficient attention, forward and backward, causal and padded,
/// with heads narrow enough for the kernels' unrolled loops and wider,
/// and queries that see no key (zeros, not NaN); the LM head fused
/// with its loss, in chunks of tokens, against the logits' composition;
/// a bias's column-sum gradient against Burn's sums (f32; the half
/// dtypes where llvmpipe has them), and the token embedding's gradient
/// against Burn's `select_assign`.
/// Under Burn's `fusion` AdamW's composition runs (fusion fuses it) and
/// the check says so; the attention kernels run there too, as custom
/// operations of the fusion stream.
#[test]
fn kiln_kernels_on_wgpu_agree_with_the_composition() {
    let run = kiln(&["check-kernels", "--json", "device.backend=wgpu"])
        .run()
        .expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    assert_eq!(v["schema"], "kiln.check-kernels/1");
    assert!(
        v["device"].as_str().is_some_and(|d| d.starts_with("wgpu")),
        "{}",
        run.stdout
    );
    // Named as a run names it: with the kernel language (CI: SPIR-V).
    if let Ok(language) = std::env::var("TEST_WGPU_LANGUAGE") {
        assert_eq!(
            v["device"],
            format!("wgpu (GPU, {language})"),
            "{}",
            run.stdout
        );
    }
    let checks = v["kernels"].as_array().expect("kernels");
    // (name, tolerance, whether kiln's kernel runs)
    let expected = [
        ("adamw", 1e-5, !cfg!(feature = "fusion")),
        ("sum of squares", 1e-5, !cfg!(feature = "fusion")),
        ("gelu", 1e-5, !cfg!(feature = "fusion")),
        ("layer norm", 1e-4, !cfg!(feature = "fusion")),
        ("bias, f32 (6003 × 200)", 5e-3, !cfg!(feature = "fusion")),
        ("bias, f32 (150 × 96)", 5e-3, !cfg!(feature = "fusion")),
        // The token embedding's gradient: the same sums in the same order.
        ("embedding gradient (225", 1e-5, !cfg!(feature = "fusion")),
        ("embedding gradient (100", 1e-5, !cfg!(feature = "fusion")),
        ("attention, causal", 1e-4, true),
        ("attention, padded", 1e-4, true),
        // Wider than the kernels unroll for: their loop path.
        ("attention, causal, heads 136 wide", 1e-4, true),
        ("attention, queries that see no key", 1e-4, true),
        // Dropout on the probabilities in the scalar kernels, against the
        // composition with the host's mask.
        ("attention, causal, dropout 0.1", 1e-4, true),
        ("attention, padded, dropout 0.1", 1e-4, true),
        // The kernels' mask where an index passes 2³², against the host's:
        // exactly (not under `fusion`, where it is not checked).
        (
            "attention's dropout mask, indices past 2³²",
            0.0,
            !cfg!(feature = "fusion"),
        ),
        // Burn's primitive operations in chunks, on CubeCL and under fusion.
        ("lm head and loss", 1e-4, true),
    ];
    for (name, tolerance, fused) in expected {
        let check = checks
            .iter()
            .find(|k| k["kernel"].as_str().is_some_and(|n| n.starts_with(name)))
            .unwrap_or_else(|| panic!("no `{name}` check: {}", run.stdout));
        assert_eq!(check["fused"], fused, "{}", run.stdout);
        assert_eq!(check["passed"], true, "{}", run.stdout);
        assert!(
            check["max_abs_difference"]
                .as_f64()
                .is_some_and(|d| d <= tolerance),
            "{}",
            run.stdout
        );
    }
    // cuBLAS's products run on CUDA only: here each says it did not run.
    for check in checks.iter().filter(|k| {
        k["kernel"]
            .as_str()
            .is_some_and(|n| n.starts_with("matmul by cuBLAS"))
    }) {
        assert_eq!(check["fused"], false, "{}", run.stdout);
        assert_eq!(check["passed"], true, "{}", run.stdout);
    }
}

/// Out of device memory is an error with its fix, not a backtrace: Burn's
/// attention at block 2048 (score buffers of 8 × 16 × 2048 × 2048 f32,
/// 2 GiB, over llvmpipe's largest buffer) fails to allocate; kiln says so on
/// one line, names the keys to lower, and exits with 2. (The same shape
/// with kiln's memory-efficient attention trains its step: a minute on
/// llvmpipe, measured by hand in docs/PERFORMANCE.md.)
#[test]
fn out_of_device_memory_says_what_to_lower() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let run = kiln(&[
        "bench",
        "lm",
        "--steps=1",
        "--warmup=0",
        "device.backend=wgpu",
        "model.layers=1",
        "model.heads=16",
        "model.hidden=64",
        "model.intermediate=64",
        "model.max_length=2048",
        "training.batch_size=8",
        "optimization.kernels=reference",
        &format!("data.cache_dir={}", tmp.path().join("cache").display()),
    ])
    .cwd(tmp.path())
    .run()
    .expect_code(2);
    let last = run.stderr.lines().rev().find(|l| !l.trim().is_empty());
    let last = last.unwrap_or_default();
    assert!(
        last.starts_with("error: out of device memory (can't allocate buffer"),
        "{}",
        run.stderr
    );
    assert!(
        last.contains("training.batch_size") && last.contains("model.max_length"),
        "{last}"
    );
    assert!(!run.stderr.contains("stack backtrace"), "{}", run.stderr);
}

/// Dropout on the attention probabilities on a GPU runs in kiln's CubeCL
/// kernels, as on flex: asked for by name (`memory-efficient`), in f32 and
/// in fp16 (where the device computes in it), the run trains (it was
/// refused while the kernels had none) and ends elsewhere than the same
/// run without dropout, so the mask took effect; `auto` trains too and
/// says nothing of Burn's composition; and `kiln diagnose` counts no
/// `T × T` scores for it. Whether the kernels' mask is the one asked for
/// is `kiln check-kernels`' to say ("attention, …, dropout 0.1").
#[test]
fn attention_dropout_on_wgpu_trains_in_the_kernels() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let named = "optimization.attention=memory-efficient";
    let fp16 = ["precision.amp=true", "precision.amp_dtype=fp16"];
    for (dtype, extra) in [("f32", &[][..]), ("fp16", &fp16[..])] {
        let run = |name: &str, dropout: &str| {
            let mut args = vec![named, dropout];
            args.extend(extra);
            train_on_wgpu(tmp.path(), &format!("{dtype}-{name}"), 5, &args)
        };
        let (plain, _) = run("plain", "model.attention_dropout=0.0");
        let (dropped, out) = run("dropped", "model.attention_dropout=0.5");
        assert!(dropped.is_finite(), "{dtype}: {out}");
        assert!(
            (dropped - plain).abs() > 1e-6,
            "{dtype}: dropout 0.5 left the loss at {dropped} (without: {plain})"
        );
    }
    let (auto, out) = train_on_wgpu(tmp.path(), "auto", 5, &["model.attention_dropout=0.1"]);
    assert!(auto.is_finite(), "{out}");
    assert!(!out.contains("Burn's composition"), "{out}");
    let diagnose = kiln(&[
        "diagnose",
        "--burst=0",
        "device.backend=wgpu",
        "model.attention_dropout=0.1",
    ])
    .run();
    assert!(
        diagnose
            .stdout
            .contains("attention keeps no T² scores, its log-sum-exp"),
        "{}\n{}",
        diagnose.stdout,
        diagnose.stderr
    );
}

/// Asking for CUDA where there is no NVIDIA driver is a clear error with
/// exit code 2, not a panic in the driver's loader: CI's GPU build has the
/// CUDA backend (with `cuda-cpp`) and its machine has no driver. A `kiln`
/// without the backend says which feature it lacks. On a machine with an
/// NVIDIA driver there is nothing to refuse, and the test returns.
#[test]
fn cuda_without_an_nvidia_driver_is_a_clear_error() {
    if Path::new("/proc/driver/nvidia").exists() {
        // An NVIDIA driver is loaded here: nothing to refuse.
        return;
    }
    let hardware = kiln(&["check-hardware"]).run().expect_code(0);
    let built_in = hardware
        .stdout
        .lines()
        .find(|l| l.contains("backends built in"))
        .unwrap_or_else(|| panic!("no `backends built in` line:\n{}", hardware.stdout))
        .to_string();
    let tmp = tempfile::tempdir().expect("tempdir");
    let run_dir = tmp.path().join("run");
    let run = kiln(&[
        "train",
        "device.backend=cuda",
        "training.max_steps=1",
        &format!("run.dir={}", run_dir.display()),
    ])
    .run()
    .expect_code(2);
    let why = if built_in.contains("cuda") {
        "the NVIDIA driver's libcuda could not be loaded"
    } else {
        "kiln was built without the `cuda` feature"
    };
    run.stderr_has(&["backend `cuda` is not available", why]);
    assert!(!run_dir.exists(), "a refused run leaves no run folder");
}

/// ZeRO-2 on wgpu (each gradient's sum of squares by the fused kernel, the
/// reduce-scattered share put back on the device, the weights gathered
/// into device tensors): two ranks follow DDP's two ranks to rounding
/// (the per-tensor sums add in another order than one launch's), and each
/// keeps less on the device.
#[test]
fn zero_2_on_wgpu_follows_ddp_with_less_on_the_device() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let job = |name: &str, stage: &str| {
        let args = crate::dist::launch_args(
            dir,
            name,
            20,
            2,
            &[
                "device.backend=wgpu",
                "training.batch_size=4",
                "logging.logging_steps=10",
                stage,
            ],
        );
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        kiln(&refs).run().expect_code(0)
    };
    job("ddp", "optimization.zero_stage=0");
    job("zero2", "optimization.zero_stage=2").stdout_has(&[
        "ZeRO-2: each rank keeps AdamW's moments for its share",
        "(GPU",
    ]);
    let steps = |name: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join(name).join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["kind"] == "step")
            .collect()
    };
    let (ddp, zero) = (steps("ddp"), steps("zero2"));
    assert_eq!(ddp.len(), zero.len());
    assert!(!ddp.is_empty());
    for (d, z) in ddp.iter().zip(&zero) {
        let (dn, zn) = (
            d["grad_norm"].as_f64().expect("norm"),
            z["grad_norm"].as_f64().expect("norm"),
        );
        assert!(
            (dn - zn).abs() <= 1e-5 * dn,
            "step {}: {dn} vs {zn}",
            d["step"]
        );
    }
    let (a, b) = (
        final_val_loss(&dir.join("ddp")),
        final_val_loss(&dir.join("zero2")),
    );
    assert!((a - b).abs() < 1e-4, "DDP {a}, ZeRO-2 {b}");
    // Half the moments and half the gradients leave the device.
    let memory = |v: &[serde_json::Value]| v.last().and_then(|s| s["memory_bytes"].as_u64());
    let (dm, zm) = (memory(&ddp), memory(&zero));
    assert!(
        dm.zip(zm).is_some_and(|(d, z)| z < d),
        "device memory: DDP {dm:?}, ZeRO-2 {zm:?}"
    );
}
