//! `kiln check-hardware`, `kiln config` and `kiln train` as a user runs them.

use crate::support::{FakeGpu, fake_report, kiln, other_gpus_report};

/// A variable that is not UTF-8 (a shell's leftover, a file name in
/// Latin-1) is nothing kiln reads: every command still runs, where reading
/// the environment with `std::env::vars` panics on it.
#[test]
fn a_variable_that_is_not_utf8_is_passed_over() {
    use std::os::unix::ffi::OsStrExt;
    let latin1 = std::ffi::OsStr::from_bytes(b"caf\xe9");
    for ranks in [None, Some("2")] {
        let mut cmd = std::process::Command::new(crate::support::kiln_bin());
        cmd.arg("config").env("LEGACY_LATIN1_VALUE", latin1);
        if let Some(world) = ranks {
            // A rank's environment: read for the job and its threads.
            cmd.env("WORLD_SIZE", world)
                .env("RANK", "0")
                .env("LOCAL_WORLD_SIZE", world);
        }
        let out = cmd.output().expect("kiln runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn check_hardware_reports_this_machine_and_its_preset() {
    let run = kiln(&["check-hardware"]).run().expect_code(0);
    run.stdout_has(&[
        "CPU ",
        "logical cores",
        "ISA: ",
        "fp32 peak",
        "Memory ",
        "Preset ",
        "Recommended",
        "batch size",
        "precision",
        "loader",
        "compile",
        "checkpointing",
        "CPU products ",
        "GFLOP/s fp32, measured",
    ]);
    let report = kiln_hwdetect::detect();
    if report.gpus().is_empty() {
        run.stdout_has(&["GPU      none: ", "Preset   cpu — no GPU to train on"]);
    }
    if report.cpu.features.avx2 {
        run.stdout_has(&["avx2", "fma"]);
    }
}

#[test]
fn check_hardware_json_carries_the_fields() {
    let run = kiln(&["check-hardware", "--json"]).run().expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("valid JSON");
    assert!(
        v["hardware"]["cpu"]["logical_cores"]
            .as_u64()
            .is_some_and(|n| n >= 1)
    );
    assert!(
        v["hardware"]["memory"]["total_bytes"]
            .as_u64()
            .is_some_and(|n| n > 0)
    );
    assert!(v["hardware"]["cpu"]["features"]["avx2"].is_boolean());
    assert!(v["hardware"]["gpu"]["status"].is_string());
    assert!(v["preset"]["name"].is_string());
    assert!(
        v["recommended"]["batch_size"]
            .as_u64()
            .is_some_and(|n| n >= 1)
    );
    assert!(v["recommended"]["precision"].is_string());
    // The JSON is also a report `--hardware-report` reads back.
    let tmp = tempfile::tempdir().expect("tempdir");
    let saved = tmp.path().join("saved.json");
    std::fs::write(&saved, &run.stdout).expect("write");
    let again = kiln(&[
        "--hardware-report",
        saved.to_str().expect("utf-8"),
        "check-hardware",
        "--json",
    ])
    .run()
    .expect_code(0);
    let w: serde_json::Value = serde_json::from_str(&again.stdout).expect("valid JSON");
    assert_eq!(w["hardware"], v["hardware"]);
    // This machine's products are measured; a report from a file is not
    // this machine, so its products are not.
    let measured = &v["cpu_products_measured"];
    assert!(
        measured["flops"].as_f64().is_some_and(|f| f > 1e8),
        "{measured}"
    );
    assert!(measured["n"].as_u64().is_some_and(|n| n >= 128));
    assert!(w["cpu_products_measured"].is_null(), "{w}");
}

#[test]
fn check_hardware_on_fake_gpus() {
    let tmp = tempfile::tempdir().expect("tempdir");
    /// (GPUs as name, GiB, compute capability; what the report must say)
    type GpuCase<'a> = (&'a [FakeGpu<'a>], &'a [&'a str]);
    let cases: &[GpuCase<'_>] = &[
        (
            &[("Tesla T4", 15, (7, 5))],
            &[
                "GPU 0    Tesla T4",
                "bf16 no",
                "Preset   t4 — T4: compute capability 7.5, no bf16 → fp16; 15 GiB",
                "fp16 compute with dynamic loss scaling",
                "no bf16 → fp16",
            ],
        ),
        (
            &[("NVIDIA A30", 24, (8, 0)), ("NVIDIA A30", 24, (8, 0))],
            &[
                "GPU 1 ",
                "Preset   a30",
                "2 × NVIDIA A30",
                "bf16 compute, f32 master weights, TF32",
            ],
        ),
        (
            &[("NVIDIA H200", 141, (9, 0))],
            &[
                "fp8 yes",
                "fp8 1978.9",
                "H200 Tensor Core GPU data sheet",
                "Preset   h100",
            ],
        ),
    ];
    for (gpus, wants) in cases {
        let report = fake_report(tmp.path(), gpus);
        kiln(&[
            "--hardware-report",
            report.to_str().expect("utf-8"),
            "check-hardware",
        ])
        .run()
        .expect_code(0)
        .stdout_has(wants);
    }
}

#[test]
fn amd_intel_and_apple_gpus_get_a_preset_a_backend_and_what_to_build() {
    use kiln_hwdetect::{OtherGpu, apple_gpu_from};
    const GIB: u64 = 1 << 30;
    let tmp = tempfile::tempdir().expect("tempdir");
    let amd = |id, gib, product: &str| {
        OtherGpu::from_pci(0x1002, id, Some(gib * GIB), Some(product.into())).expect("AMD")
    };
    let mi300x = || amd(0x74a1, 192, "AMD Instinct MI300X");
    let cases: Vec<(&str, Vec<OtherGpu>, Vec<&str>)> = vec![
        (
            "mi300x-node",
            (0..8).map(|_| mi300x()).collect(),
            vec![
                "GPU      AMD Instinct MI300X, 192.0 GiB, seen through sysfs",
                "dense peak: fp32 163.4, tf32 653.7, bf16 1307.4",
                "Preset   mi300x",
                "AMD Instinct MI300X: bf16; 192 GiB",
                "bf16 compute, f32 master weights",
                "GPU backends   AMD Instinct MI300X: none in this build (backends built in: flex); build with `--features rocm` (ROCm/HIP;",
                "auto: an AMD GPU is present, but this build has no backend for it, so the CPU",
            ],
        ),
        (
            "radeon-desktop",
            vec![
                amd(0x744c, 24, "AMD Radeon RX 7900 XTX"),
                // The Ryzen's own graphics: a 512 MiB carve-out.
                OtherGpu::from_pci(0x1002, 0x164e, Some(512 << 20), None).expect("AMD"),
            ],
            vec![
                "Preset   rx_7900_xtx",
                "AMD Radeon RX 7900 XTX: none in this build",
                "AMD GPU 0x164e: none (an integrated GPU, slower than the CPU's kernels: auto trains on the CPU)",
            ],
        ),
        (
            "arc",
            vec![OtherGpu::from_pci(0x8086, 0x56a0, None, None).expect("Intel")],
            vec![
                "Preset   arc_a770",
                "fp16 compute with dynamic loss scaling",
                "Intel Arc A770: none in this build (backends built in: flex); build with `--features vulkan` (Vulkan)",
            ],
        ),
        (
            "m2-max",
            vec![
                apple_gpu_from("Apple M2 Max", 96 * GIB, "Total Number of Cores: 38")
                    .expect("Apple"),
            ],
            vec![
                "GPU      Apple M2 Max (38-core GPU), 96.0 GiB unified memory, seen through sysctl",
                "Preset   apple_m",
                "96 GiB unified memory, about 75 % of it for the GPU",
                "build with `--features wgpu` (Metal)",
            ],
        ),
    ];
    for (name, others, wants) in cases {
        let report = other_gpus_report(tmp.path(), name, others);
        let report = report.to_str().expect("utf-8");
        kiln(&["--hardware-report", report, "check-hardware"])
            .run()
            .expect_code(0)
            .stdout_has(&wants);
        // The JSON says the same per GPU, and the preset named fits.
        let out = kiln(&["--hardware-report", report, "check-hardware", "--json"])
            .run()
            .expect_code(0);
        let json: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
        let first = &json["gpu_backends"][0];
        assert_eq!(first["backend"], serde_json::Value::Null, "{name}: {first}");
        assert!(
            first["build"]
                .as_str()
                .is_some_and(|b| b.starts_with("build with")),
            "{name}: {first}"
        );
        let preset = json["preset"]["name"].as_str().expect("a preset");
        kiln(&[
            "--hardware-report",
            report,
            "config",
            &format!("hardware={preset}"),
        ])
        .run()
        .expect_code(0);
    }
}

#[test]
fn check_gpu_exits_1_without_a_gpu() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let none = fake_report(tmp.path(), &[]);
    kiln(&[
        "--hardware-report",
        none.to_str().expect("utf-8"),
        "check-gpu",
    ])
    .run()
    .expect_code(1)
    .stdout_has(&["none: no NVIDIA driver"]);
    let t4 = fake_report(tmp.path(), &[("Tesla T4", 15, (7, 5))]);
    kiln(&[
        "--hardware-report",
        t4.to_str().expect("utf-8"),
        "check-gpu",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["Tesla T4"]);
}

#[test]
fn config_explain_shows_each_source() {
    // From the checkout's root, whose `presets/` is the folder the built-in
    // presets are compiled from: they are named as built in, not read again
    // as a presets directory over themselves.
    kiln(&[
        "config",
        "hardware=t4",
        "experiment=nli_snli",
        "training.batch_size=10",
        "--explain",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "training.batch_size = 10",
        "# command line (training.batch_size=10)",
        "precision.amp_dtype = \"fp16\"",
        "# hardware preset `t4` (built-in hardware/t4.toml:18)",
    ]);
    // Named with --presets, the same folder is a directory like any other.
    kiln(&["config", "hardware=t4", "--presets", "presets", "--explain"])
        .run()
        .expect_code(0)
        .stdout_has(&["# hardware preset `t4` (presets/hardware/t4.toml:18)"]);
    kiln(&["config", "--explain"])
        .env("KILN_TRAINING__BATCH_SIZE", "7")
        .run()
        .expect_code(0)
        .stdout_has(&[
            "training.batch_size = 7",
            "# environment (KILN_TRAINING__BATCH_SIZE)",
        ]);
}

#[test]
fn config_explain_shows_bf16_on_a_t4_resolving_to_fp16() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t4 = fake_report(tmp.path(), &[("Tesla T4", 15, (7, 5))]);
    let report = t4.to_str().expect("utf-8");
    kiln(&[
        "--hardware-report",
        report,
        "config",
        "hardware=t4",
        "precision.amp_dtype=bf16",
        "--explain",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "precision.amp_dtype = \"bf16\"",
        "# command line (precision.amp_dtype=bf16)",
        "#   precision → fp16 compute with dynamic loss scaling, f32 master weights — bf16 asked for, but compute capability 7.5 has no bf16 → fp16",
        "#   backend → auto → flex (CPU) in this build",
        "#   compile → CubeCL autotune level minimal",
    ]);
    // On an A100 the same request stays bf16.
    let a100 = fake_report(tmp.path(), &[("NVIDIA A100-SXM4-40GB", 40, (8, 0))]);
    kiln(&[
        "--hardware-report",
        a100.to_str().expect("utf-8"),
        "config",
        "hardware=a100",
        "--explain",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "#   precision → bf16 compute, f32 master weights",
        "#   compile → CubeCL autotune level balanced",
    ]);
}

#[test]
fn config_prints_toml_that_reads_back_as_a_config_file() {
    let run = kiln(&["config", "hardware=cpu", "training.seed=7"])
        .run()
        .expect_code(0);
    let parsed: toml::Table = toml::from_str(&run.stdout).expect("TOML");
    assert_eq!(parsed["training"]["seed"].as_integer(), Some(7));
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("resolved.toml");
    std::fs::write(&file, &run.stdout).expect("write");
    kiln(&[
        "config",
        "--explain",
        "--config",
        file.to_str().expect("utf-8"),
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["training.seed = 7", "# config file ("]);
}

/// `kiln config --format yaml` and `--format json` print files that read
/// back as the same configuration (`--config x.yaml`, `--config x.json`).
#[test]
fn config_prints_yaml_and_json_that_read_back_as_the_same_configuration() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let args = [
        "experiment=nli_snli",
        "hardware=t4",
        "data.labels=[\"a\", \"b \\\"quoted\\\"\"]",
        "model.init_from=none",
    ];
    let with = |extra: &[&str]| {
        let mut all: Vec<&str> = vec!["config"];
        all.extend(extra);
        all.extend(args);
        kiln(&all).run().expect_code(0).stdout
    };
    let toml = with(&[]);
    for format in ["yaml", "json"] {
        let printed = with(&["--format", format]);
        let file = tmp.path().join(format!("resolved.{format}"));
        std::fs::write(&file, &printed).expect("write");
        let path = file.to_str().expect("utf-8");
        let read_back = kiln(&["config", "--config", path, "hardware=t4"])
            .run()
            .expect_code(0)
            .stdout;
        assert_eq!(read_back, toml, "{format}:\n{printed}");
    }
}

/// `--config` reads a Hydra-style YAML file, each value's source its line,
/// a second `--config` goes over it, and a broken one exits 2 naming file,
/// line and column.
#[test]
fn config_reads_yaml_files_and_names_the_line_of_a_broken_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("exp.yaml");
    std::fs::write(
        &file,
        "# Hydra's style\ntraining:\n  seed: 7\nprecision: {amp: true, amp_dtype: fp16}\n",
    )
    .expect("write");
    let path = file.to_str().expect("utf-8");
    kiln(&["config", "--explain", "--config", path, "hardware=cpu"])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "training.seed = 7",
            "exp.yaml:3)",
            "precision.amp_dtype = \"fp16\"",
            "exp.yaml:4)",
        ]);
    // A second file goes over the first.
    let over = tmp.path().join("over.toml");
    std::fs::write(&over, "[training]\nseed = 8\n").expect("write");
    let over_path = over.to_str().expect("utf-8");
    kiln(&[
        "config",
        "--explain",
        "--config",
        path,
        "--config",
        over_path,
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "training.seed = 8",
        "over.toml:2)",
        "precision.amp_dtype = \"fp16\"",
        "exp.yaml:4)",
    ]);
    std::fs::write(&file, "training:\n  seed: 7\n bad: [\n").expect("write");
    kiln(&["config", "--config", path])
        .run()
        .expect_code(2)
        .stderr_has(&["exp.yaml` line 3, column 2: invalid YAML: "]);
}

/// `bench --kernel-profile` times CubeCL's kernel launches: on the CPU it
/// is refused before any step, with the flag, the device and what to do
/// named.
#[test]
fn a_kernel_profile_on_the_cpu_is_refused_with_what_to_do() {
    kiln(&[
        "bench",
        "lm",
        "--kernel-profile",
        "device.backend=flex",
        "--steps",
        "1",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&["--kernel-profile", "flex (CPU)", "GPU backend"]);
}

#[test]
fn bad_input_exits_2_with_key_value_and_layer() {
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["config", "training.batch_sise=3"],
            &[
                "unknown key `training.batch_sise`",
                "did you mean `training.batch_size`?",
            ],
        ),
        (
            &["config", "training.batch_size=-1"],
            &[
                "invalid value -1 for `training.batch_size`",
                "command line (training.batch_size=-1)",
            ],
        ),
        (
            &["config", "training.batch_size=abc"],
            &[
                "invalid value \"abc\" for `training.batch_size`",
                "command line",
            ],
        ),
        (
            &["config", "precision.loss_scale_init=0.5"],
            &[
                "invalid value 0.5 for `precision.loss_scale_init`",
                "must be a finite number of at least 1",
            ],
        ),
        (
            &["config", "precision.loss_scale_growth_interval=0"],
            &[
                "invalid value 0 for `precision.loss_scale_growth_interval`",
                "must be at least 1",
            ],
        ),
        (
            &["config", "optimization.zero_stage=3"],
            &[
                "invalid value 3 for `optimization.zero_stage`",
                "stage 3 (the weights sharded too, FSDP) is not built",
            ],
        ),
        (
            &["config", "model.layer_norm_eps=0"],
            &[
                "invalid value 0 for `model.layer_norm_eps`",
                "must be in (0, 1)",
            ],
        ),
        (
            &["config", "optimization.kernels=fast"],
            &[
                "invalid value \"fast\" for `optimization.kernels`",
                "expected one of `fused`, `reference`",
            ],
        ),
        (
            &["config", "hardware=nope"],
            &["unknown hardware preset `nope`", "a100, a100_80gb", "t4"],
        ),
        (
            &["config", "--config", "missing.toml"],
            &["failed to read `missing.toml`"],
        ),
        (
            &["--hardware-report", "missing.json", "check-hardware"],
            &["missing.json"],
        ),
        (
            &["--presets", "/nonexistent", "config"],
            &["presets directory `/nonexistent` does not exist"],
        ),
        (
            &["--presets", "/etc/passwd", "config"],
            &["presets directory `/etc/passwd` is not a directory"],
        ),
    ];
    for (args, wants) in cases {
        let run = kiln(args).run();
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        run.stderr_has(wants);
    }
    // A run folder under a regular file: the key and the file, and the file
    // is left as it was.
    let tmp = tempfile::tempdir().expect("tempdir");
    let notes = tmp.path().join("notes.txt");
    std::fs::write(&notes, "mine").expect("write");
    let run_dir = format!("run.dir={}", notes.join("run").display());
    let run = kiln(&["train", "training.max_steps=1", &run_dir]).run();
    assert_eq!(run.code, 2, "{}", run.stderr);
    run.stderr_has(&[
        &format!("invalid run.dir `{}`", notes.join("run").display()),
        &format!("`{}` is a file, not a folder", notes.display()),
    ]);
    assert_eq!(std::fs::read_to_string(&notes).expect("read"), "mine");
    // clap's own usage errors are bad input too.
    assert_eq!(kiln(&["config", "--no-such-flag"]).run().code, 2);
}

#[test]
fn a_broken_preset_names_file_and_line() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let presets = tmp.path().join("presets");
    for group in ["hardware", "experiment"] {
        std::fs::create_dir_all(presets.join(group)).expect("mkdir");
    }
    let src = crate::support::root().join("presets");
    std::fs::copy(src.join("defaults.toml"), presets.join("defaults.toml")).expect("copy");
    std::fs::copy(
        src.join("experiment/shakespeare_char.toml"),
        presets.join("experiment/shakespeare_char.toml"),
    )
    .expect("copy");
    std::fs::write(
        presets.join("hardware/cpu.toml"),
        "[training]\nbatch_size = 4\nbatch_size = 5\n",
    )
    .expect("write");
    let run = kiln(&["config", "hardware=cpu"]).cwd(tmp.path()).run();
    assert_eq!(run.code, 2, "{}", run.stderr);
    run.stderr_has(&["presets/hardware/cpu.toml` line 3", "invalid TOML"]);
}

#[test]
fn a_gpu_preset_on_the_wrong_machine_needs_force() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let none = fake_report(tmp.path(), &[]);
    let report = none.to_str().expect("utf-8");
    let run = kiln(&["--hardware-report", report, "train", "hardware=gpu_4090"]).run();
    assert_eq!(run.code, 2, "{}", run.stderr);
    run.stderr_has(&[
        "hardware preset `gpu_4090` is for RTX 4090",
        "no GPU",
        "--force",
    ]);
    // Forced, it goes on and says so (here it stops at once on a missing corpus).
    let missing = format!("data.path={}", tmp.path().join("none.txt").display());
    let forced = kiln(&[
        "--hardware-report",
        report,
        "train",
        "hardware=gpu_4090",
        "--force",
        &missing,
    ])
    .run();
    forced.stderr_has(&["running anyway (--force)", "none.txt"]);
    assert_eq!(forced.code, 2);
}

#[test]
fn a_report_read_on_a_real_h200_replays() {
    // Recorded with `kiln check-hardware --json` on a lent H200 machine.
    let report = crate::support::root().join("tests/data/h200-check-hardware.json");
    kiln(&[
        "--hardware-report",
        report.to_str().expect("utf-8"),
        "check-hardware",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&[
        "GPU 0    NVIDIA H200, 140.4 GiB",
        "compute capability 9.0",
        "Driver   580.159.04, CUDA 13.0",
        "Preset   h100 — H200: compute capability 9.0, bf16; 140 GiB",
    ]);
}

#[test]
fn cv_and_bench_nli_respect_an_experiment_chosen_by_any_layer() {
    // The environment's experiment wins over cv's default (nli_snli): an LM
    // experiment is refused rather than silently replaced.
    kiln(&["cv"])
        .env("KILN_EXPERIMENT", "shakespeare_char")
        .run()
        .expect_code(2)
        .stderr_has(&[
            "`kiln cv` cross-validates the nli workload",
            "shakespeare_char",
        ]);
    // A bench of no steps (or a loader bench of no batches) is refused: it
    // printed zeros as its rates; so is sampling no text.
    for args in [
        ["bench", "nli", "--steps=0"],
        ["bench", "loader", "--batches=0"],
    ] {
        kiln(&args)
            .run()
            .expect_code(2)
            .stderr_has(&["`0` is not a whole number of 1 or more"]);
    }
    // Texts and their tokens bounded: a hundred trillion texts aborted on
    // their allocation.
    for (flag, n, range) in [
        ("--count", "0", "1 to 10000"),
        ("--count", "100000000000000", "1 to 10000"),
        ("--tokens", "100000000000000", "0 to 1000000"),
    ] {
        kiln(&["sample", "runs/any", flag, n])
            .run()
            .expect_code(2)
            .stderr_has(&[&format!("`{n}` is not a whole number from {range}")]);
    }
    // Threads from 1 to 1024: a hundred thousand aborted the process after
    // minutes of starting them.
    for n in ["0", "100000"] {
        kiln(&["prepare", "--threads", n])
            .run()
            .expect_code(2)
            .stderr_has(&[&format!("`{n}` is not a whole number from 1 to 1024")]);
    }
    // Where no layer chooses one, `bench nli` takes the NLI experiment.
    let run = kiln(&[
        "bench",
        "nli",
        "--json",
        "--warmup=0",
        "--steps=1",
        "model.layers=1",
        "model.hidden=32",
        "model.heads=2",
        "model.intermediate=64",
        "training.batch_size=4",
    ])
    .run()
    .expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    assert_eq!(v["bench"]["workload"], "nli");
    assert_eq!(v["config"]["experiment"], "nli_snli");
}

#[test]
fn a_machine_with_two_different_gpus_trains_on_the_one_its_preset_was_chosen_for() {
    let tmp = tempfile::tempdir().expect("tempdir");
    // GPU 0 a T4 (no bf16), GPU 1 an A100 80GB: the preset is the A100's.
    let report = fake_report(
        tmp.path(),
        &[
            ("Tesla T4", 15, (7, 5)),
            ("NVIDIA A100-SXM4-80GB", 80, (8, 0)),
        ],
    );
    let report = report.to_str().expect("utf-8");
    kiln(&["--hardware-report", report, "config", "--explain"])
        .run()
        .expect_code(0)
        .stdout_has(&[
            "hardware = \"a100_80gb\"",
            "device.index = 1",
            "# hardware detection (auto: GPU 1, the GPU the preset was chosen for)",
        ]);
    // The run then plans for that GPU: no T4 fallback to fp16, and the GPU
    // it names is the A100.
    let out = kiln(&[
        "--hardware-report",
        report,
        "diagnose",
        "--burst=0",
        "--json",
        "precision.amp_dtype=bf16",
    ])
    .run();
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    let findings = v["diagnosis"]["findings"].to_string();
    assert!(findings.contains("A100"), "{findings}");
    assert!(!findings.contains("T4"), "{findings}");
    // An index set by the user stays.
    kiln(&[
        "--hardware-report",
        report,
        "config",
        "--explain",
        "device.index=0",
    ])
    .run()
    .expect_code(0)
    .stdout_has(&["device.index = 0", "# command line (device.index=0)"]);
}

/// A machine whose available memory could not be read (kiln-hwdetect
/// reports 0): diagnose says it is not known, and no memory problem (it
/// printed "of 0 MiB available RAM").
#[test]
fn diagnose_says_when_available_memory_is_not_known() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut machine = crate::support::this_machine();
    machine["hardware"]["memory"]["available_bytes"] = 0.into();
    let report = tmp.path().join("unread.json");
    std::fs::write(&report, machine.to_string()).expect("write");
    let report = report.to_str().expect("utf-8");
    let out = kiln(&["--hardware-report", report, "diagnose", "--burst=0"])
        .run()
        .expect_code(0);
    out.stdout_has(&["of available RAM (not known here)"]);
    assert!(!out.stdout.contains("0 MiB available"), "{}", out.stdout);
}

/// kiln as `cargo install` leaves it: a binary run from an empty directory,
/// with no presets and no data beside it. The presets are built in, the
/// default corpus is written on first use with its attribution, and the run
/// goes under the working directory.
#[test]
fn kiln_runs_from_an_empty_directory() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let here = tmp.path();
    let hw = kiln(&["check-hardware"]).cwd(here).run().expect_code(0);
    hw.stdout_has(&["Recommended (hardware="]);
    let explain = kiln(&["config", "--explain", "hardware=cpu"])
        .cwd(here)
        .run()
        .expect_code(0);
    explain.stdout_has(&[
        "(built-in defaults.toml:",
        "(built-in hardware/cpu.toml:",
        "(built-in experiment/shakespeare_char.toml:",
    ]);
    let train = kiln(&[
        "train",
        "hardware=cpu",
        "model.layers=1",
        "model.heads=2",
        "model.hidden=32",
        "model.intermediate=64",
        "model.max_length=32",
        "training.batch_size=4",
        "training.max_steps=20",
        "training.warmup_steps=5",
        "eval.eval_iters=1",
        "sample.count=1",
        "sample.tokens=10",
    ])
    .cwd(here)
    .run()
    .expect_code(0);
    train.stderr_has(&["wrote kiln's built-in `data/tinyshakespeare.txt`"]);
    let corpus = std::fs::metadata(here.join("data/tinyshakespeare.txt")).expect("corpus");
    assert_eq!(corpus.len(), 1_115_394);
    assert!(here.join("data/README.md").is_file());
    assert!(!here.join("presets").exists());
    let runs: Vec<_> = std::fs::read_dir(here.join("runs"))
        .expect("runs/ under the working directory")
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .ends_with("-shakespeare_char")
        })
        .collect();
    assert_eq!(runs.len(), 1, "one run directory");
    assert!(runs[0].path().join("summary.json").is_file());
}

/// `optimization.matmul = "cublas"` where cuBLAS cannot run (here: no
/// CUDA) is refused before the run starts, saying why and what to set.
#[test]
fn cublas_products_where_they_cannot_run_are_refused_at_the_start() {
    kiln(&[
        "bench",
        "lm",
        "--steps=1",
        "--warmup=0",
        "optimization.matmul=cublas",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&[
        "optimization.matmul = \"cublas\" cannot run here",
        "set optimization.matmul = \"burn\"",
    ]);
}

/// `kiln check-kernels` on the CPU: every kernel flex has runs and agrees
/// with its composition (the GPU-only ones say they do not run there);
/// `--only` picks checks by name, and an unknown name is bad input.
#[test]
fn check_kernels_on_flex_agree_and_only_picks_by_name() {
    let run = kiln(&["check-kernels", "--json"]).run().expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    assert_eq!(v["passed"], true, "{}", run.stdout);
    let kernels = v["kernels"].as_array().expect("kernels");
    let ran = |name: &str| {
        kernels
            .iter()
            .find(|k| k["kernel"].as_str().is_some_and(|n| n.starts_with(name)))
            .unwrap_or_else(|| panic!("no `{name}` check: {}", run.stdout))["fused"]
            == true
    };
    // flex has its own GELU, LayerNorm, attention, AdamW and the chunked
    // LM head; the sum of squares and the bias's column sums are CubeCL
    // kernels only.
    for name in [
        "adamw",
        "gelu",
        "layer norm",
        "attention, causal",
        "lm head",
    ] {
        assert!(ran(name), "{name} did not run on flex: {}", run.stdout);
    }
    assert!(!ran("sum of squares"), "{}", run.stdout);
    assert!(!ran("bias, f32"), "{}", run.stdout);
    assert!(!ran("embedding gradient"), "{}", run.stdout);
    // cuBLAS's products: CUDA only, said so, one shape each dtype (bf16,
    // f16, f32 and f32 as TF32).
    assert!(!ran("matmul by cuBLAS, bf16"), "{}", run.stdout);
    assert!(!ran("matmul by cuBLAS, f32 as TF32"), "{}", run.stdout);
    assert_eq!(
        kernels
            .iter()
            .filter(|k| k["kernel"]
                .as_str()
                .is_some_and(|n| n.starts_with("matmul by cuBLAS")))
            .count(),
        4,
        "{}",
        run.stdout
    );

    let run = kiln(&["check-kernels", "--json", "--only", "gelu,lm-head"])
        .run()
        .expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("json");
    let names: Vec<&str> = v["kernels"]
        .as_array()
        .expect("kernels")
        .iter()
        .filter_map(|k| k["kernel"].as_str())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    assert!(
        names[0].starts_with("gelu") && names[1].starts_with("lm head"),
        "{names:?}"
    );

    kiln(&["check-kernels", "--only", "softmax"])
        .run()
        .expect_code(2)
        .stderr_has(&[
            "unknown kernel `softmax` in --only",
            "adamw, sum-of-squares",
        ]);

    // Compiling the CUDA kernels without a GPU needs CubeCL's CUDA
    // compilers, which this (CPU) build does not have; CI runs it on the
    // CUDA build.
    kiln(&["check-kernels", "--cuda-arch", "90"])
        .run()
        .expect_code(2)
        .stderr_has(&["--cuda-arch needs a CUDA build", "cargo xtask build-cuda"]);
    kiln(&["check-kernels", "--emit", "ptx"])
        .run()
        .expect_code(2)
        .stderr_has(&["--cuda-arch"]);
    kiln(&["check-kernels", "--ptxas", "ptxas"])
        .run()
        .expect_code(2)
        .stderr_has(&["--cuda-arch"]);
    // A ptxas that is not there is named (before anything is compiled).
    kiln(&[
        "check-kernels",
        "--cuda-arch",
        "90",
        "--ptxas",
        "/nonexistent/ptxas",
    ])
    .run()
    .expect_code(2)
    .stderr_has(&["--ptxas /nonexistent/ptxas: no such file"]);
}

#[test]
fn flash_attention_is_refused_where_it_cannot_run_and_the_other_choices_run() {
    let tiny = [
        "bench",
        "lm",
        "--warmup=0",
        "--steps=1",
        "model.layers=1",
        "model.hidden=32",
        "model.heads=2",
        "model.intermediate=64",
        "model.max_length=16",
        "training.batch_size=2",
    ];
    let with = |setting: &str| {
        let mut args = tiny.to_vec();
        args.push(setting);
        kiln(&args).run()
    };
    // The CPU computes in f32 here, and has no matrix unit kiln's kernels use.
    with("optimization.attention=flash")
        .expect_code(2)
        .stderr_has(&[
            "optimization.attention = \"flash\" cannot run here",
            "computes in f32",
            "optimization.attention = \"auto\"",
        ]);
    with("optimization.attention=fast")
        .expect_code(2)
        .stderr_has(&["optimization.attention", "fast"]);
    for runs in ["memory-efficient", "math"] {
        with(&format!("optimization.attention={runs}")).expect_code(0);
    }
}
