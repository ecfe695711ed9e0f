//! Resolving real and fabricated preset folders: precedence, provenance and
//! errors, each checked through one helper.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use kiln_config::{
    ConfigError, FOREIGN_NAMES, LayerKind, LoadOptions, NOT_CONFIGURATION, Presets, ResolvedConfig,
    resolve,
};
use kiln_hwdetect::{DriverInfo, FixedProbe, GpuInfo, GpuStatus, HardwareReport, detect_with};

fn no_gpu() -> HardwareReport {
    detect_with(&FixedProbe(
        GpuStatus::None {
            why: "no NVIDIA driver".into(),
        },
        DriverInfo::default(),
    ))
}

fn one_gpu(name: &str, gib: u64, cc: (u32, u32)) -> HardwareReport {
    let gpu = GpuInfo::new(0, name, gib << 30, gib << 30, cc);
    detect_with(&FixedProbe(
        GpuStatus::Found { gpus: vec![gpu] },
        DriverInfo::default(),
    ))
}

struct Case<'a> {
    /// A directory over the built-in presets.
    presets: Option<&'a Path>,
    file: Option<&'a Path>,
    env: &'a [(&'a str, &'a str)],
    args: &'a [&'a str],
    report: HardwareReport,
}

impl<'a> Case<'a> {
    fn new(args: &'a [&'a str]) -> Self {
        Self {
            presets: None,
            file: None,
            env: &[],
            args,
            report: no_gpu(),
        }
    }

    fn run(&self) -> Result<ResolvedConfig, ConfigError> {
        let overrides: Vec<String> = self.args.iter().map(|s| s.to_string()).collect();
        let env: Vec<(OsString, OsString)> =
            self.env.iter().map(|(k, v)| (k.into(), v.into())).collect();
        let presets = match self.presets {
            Some(dir) => Presets::with_dir(dir)?,
            None => Presets::built_in(),
        };
        let files: Vec<PathBuf> = self.file.iter().map(|p| p.to_path_buf()).collect();
        resolve(&LoadOptions {
            presets: &presets,
            config_files: &files,
            overrides: &overrides,
            env: &env,
            hardware: &self.report,
        })
    }

    fn ok(&self) -> ResolvedConfig {
        self.run()
            .unwrap_or_else(|e| panic!("{:?}: {e}", self.args))
    }

    fn err(&self) -> String {
        match self.run() {
            Ok(_) => panic!("{:?} resolved, expected an error", self.args),
            Err(e) => e.to_string(),
        }
    }
}

/// Asserts a key's value (as TOML text) and the text of its source.
fn check(r: &ResolvedConfig, key: &str, value: &str, source: &str) {
    let row = r.explain().into_iter().find(|row| row.key == key);
    let row = row.unwrap_or_else(|| panic!("no key {key}"));
    assert_eq!(row.value, value, "{key}");
    let shown = row.source.to_string();
    assert!(
        shown.contains(source),
        "{key}: source `{shown}` lacks `{source}`"
    );
}

#[test]
fn every_hardware_preset_resolves_with_every_experiment() {
    let presets = Presets::built_in();
    let hardware = presets.names("hardware");
    let experiments = presets.names("experiment");
    assert!(hardware.len() >= 13, "{hardware:?}");
    for hw in &hardware {
        for exp in &experiments {
            let h = format!("hardware={hw}");
            let e = format!("experiment={exp}");
            let r = Case::new(&[&h, &e]).ok();
            assert_eq!(&r.config.hardware, hw);
            assert_eq!(&r.config.experiment, exp);
        }
    }
}

#[test]
fn the_t4_example_of_the_issue() {
    let r = Case::new(&[
        "hardware=t4",
        "experiment=nli_snli",
        "training.batch_size=10",
    ])
    .ok();
    check(
        &r,
        "training.batch_size",
        "10",
        "command line (training.batch_size=10)",
    );
    check(
        &r,
        "precision.amp_dtype",
        "\"fp16\"",
        "built-in hardware/t4.toml:18",
    );
    check(&r, "workload", "\"nli\"", "experiment `nli_snli`");
}

#[test]
fn layers_win_in_order() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let file = tmp.path().join("run.toml");
    std::fs::write(&file, "[training]\nbatch_size = 5\nseed = 9\n").expect("write");
    // defaults < hardware
    check(
        &Case::new(&["hardware=gpu_4090"]).ok(),
        "training.batch_size",
        "16",
        "gpu_4090.toml:6",
    );
    // hardware < experiment
    check(
        &Case::new(&["hardware=t4"]).ok(),
        "eval.eval_steps",
        "250",
        "shakespeare_char.toml",
    );
    // experiment < file
    let mut case = Case::new(&["hardware=t4"]);
    case.file = Some(&file);
    check(&case.ok(), "training.batch_size", "5", "config file (");
    check(&case.ok(), "training.seed", "9", "run.toml:3");
    // file < environment
    case.env = &[("KILN_TRAINING__BATCH_SIZE", "7"), ("PATH", "/bin")];
    check(
        &case.ok(),
        "training.batch_size",
        "7",
        "environment (KILN_TRAINING__BATCH_SIZE)",
    );
    // environment < command line
    case.args = &["hardware=t4", "training.batch_size=20"];
    check(&case.ok(), "training.batch_size", "20", "command line");
    check(&case.ok(), "training.seed", "9", "config file");
}

/// A configuration file in YAML (Hydra's) or JSON, by its name, resolves
/// as the same keys in TOML do, each value's source its file and line; so
/// do presets in YAML, and a preset in two files is refused.
#[test]
fn yaml_and_json_files_resolve_as_toml_does() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let toml = tmp.path().join("run.toml");
    std::fs::write(
        &toml,
        "[training]\nbatch_size = 5\nlearning_rate = 3e-4\n[model]\nlayers = 2\n",
    )
    .expect("write");
    let yaml = tmp.path().join("run.yaml");
    std::fs::write(
        &yaml,
        "training:\n  batch_size: 5\n  learning_rate: 3e-4\nmodel:\n  layers: 2\n",
    )
    .expect("write");
    let json = tmp.path().join("run.json");
    std::fs::write(
        &json,
        r#"{"training": {"batch_size": 5, "learning_rate": 3e-4}, "model": {"layers": 2}}"#,
    )
    .expect("write");
    let resolved = |file: &Path| {
        let mut case = Case::new(&[]);
        case.file = Some(file);
        case.ok()
    };
    let from_toml = resolved(&toml);
    for file in [&yaml, &json] {
        let r = resolved(file);
        assert_eq!(r.config, from_toml.config, "{}", file.display());
        check(&r, "training.batch_size", "5", "config file (");
    }
    check(&resolved(&yaml), "model.layers", "2", "run.yaml:5");

    // Presets in YAML: an experiment, and defaults over the built-in ones.
    let presets = presets_copy();
    std::fs::create_dir_all(presets.path().join("experiment")).expect("mkdir");
    let mine = presets.path().join("experiment/mine.yaml");
    std::fs::write(&mine, "workload: lm\ntraining:\n  batch_size: 7\n").expect("write");
    std::fs::write(
        presets.path().join("defaults.yml"),
        "training:\n  seed: 9\n",
    )
    .expect("write");
    let mut case = Case::new(&["experiment=mine"]);
    case.presets = Some(presets.path());
    check(&case.ok(), "training.batch_size", "7", "mine.yaml:3");
    check(&case.ok(), "training.seed", "9", "defaults.yml:2");
    std::fs::write(presets.path().join("experiment/mine.toml"), "").expect("write");
    let err = case.run().expect_err("two files").to_string();
    assert!(
        err.contains("mine.toml` and `")
            && err.ends_with("mine.yaml` are the same preset in two files: keep one"),
        "{err}"
    );
}

/// `cargo xtask` runs kiln with its own `KILN_FEATURES` still set (`KILN_FEATURES=wgpu,fusion
/// cargo xtask train-auto`), and the GPU check sets kiln's process switches (`KILN_FAST_EXP`,
/// `KILN_CUBLAS_WAIT`): none is a key, and the environment's keys still apply beside them.
#[test]
fn kiln_s_own_process_variables_are_not_configuration() {
    let mut env: Vec<(&str, &str)> = NOT_CONFIGURATION.iter().map(|name| (*name, "1")).collect();
    assert!(env.iter().any(|(name, _)| *name == "KILN_FEATURES"));
    env.push(("KILN_TRAINING__BATCH_SIZE", "7"));
    let mut case = Case::new(&["hardware=t4"]);
    case.env = &env;
    check(
        &case.ok(),
        "training.batch_size",
        "7",
        "environment (KILN_TRAINING__BATCH_SIZE)",
    );
    // A name near one of them is still an unknown key.
    case.env = &[("KILN_FAST_EXPS", "1")];
    assert!(case.err().contains("unknown key `fast_exps`"));
}

#[test]
fn workload_sections_of_hardware_presets_apply_to_their_workload_only() {
    let lm = Case::new(&["hardware=cpu"]).ok();
    check(&lm, "training.batch_size", "12", "cpu.toml");
    let nli = Case::new(&["hardware=cpu", "experiment=nli_snli"]).ok();
    check(&nli, "training.batch_size", "8", "[nli] section");
    check(
        &nli,
        "training.gradient_accumulation_steps",
        "2",
        "[nli] section",
    );
    assert_eq!(nli.config.effective_batch(), 16);
}

#[test]
fn auto_asks_the_hardware_report() {
    let r = Case::new(&[]).ok();
    assert_eq!(r.config.hardware, "cpu");
    check(
        &r,
        "hardware",
        "\"cpu\"",
        "hardware detection (auto: no GPU to train on",
    );
    let mut t4 = Case::new(&["hardware=auto"]);
    t4.report = one_gpu("Tesla T4", 15, (7, 5));
    let r = t4.ok();
    check(
        &r,
        "hardware",
        "\"t4\"",
        "T4: compute capability 7.5, no bf16 → fp16; 15 GiB",
    );
    check(
        &r,
        "precision.amp_dtype",
        "\"fp16\"",
        "hardware preset `t4`",
    );
    // An explicit choice is not second-guessed.
    let mut forced = Case::new(&["hardware=gpu_4090"]);
    forced.report = one_gpu("Tesla T4", 15, (7, 5));
    assert!(forced.ok().hardware_choice.is_none());
}

#[test]
fn every_value_has_a_source() {
    let r = Case::new(&["hardware=t4"]).ok();
    let rows = r.explain();
    assert!(rows.len() > 40, "{}", rows.len());
    for row in rows {
        assert_ne!(row.source.location, "not set", "{}", row.key);
    }
    assert_eq!(
        r.source("model.layers").map(|s| &s.layer),
        Some(&LayerKind::Experiment("shakespeare_char".into()))
    );
}

/// `--explain` marks what a run would not read, with the key that makes it
/// so, and nothing it reads.
#[test]
fn explain_marks_the_keys_a_run_does_not_read() {
    let unused = |args: &[&str]| -> Vec<(String, String)> {
        let r = Case::new(args).ok();
        let rows = r.explain();
        rows.into_iter()
            .filter_map(|row| Some((row.key, row.unused?)))
            .collect()
    };
    let keys = |rows: &[(String, String)]| -> Vec<String> {
        let mut keys: Vec<String> = rows.iter().map(|(k, _)| k.clone()).collect();
        keys.sort();
        keys
    };
    // The default run: a character-level LM by steps on the cosine, in f32.
    let plain = unused(&[]);
    assert_eq!(
        keys(&plain),
        [
            "cv.folds",
            "cv.patience",
            "data.vocab_size",
            "precision.amp_dtype",
            "precision.loss_scale_growth_interval",
            "precision.loss_scale_init",
            "training.decay_fraction",
            "training.epochs",
        ]
    );
    let why = |rows: &[(String, String)], key: &str| {
        rows.iter()
            .find(|(k, _)| k == key)
            .map(|(_, why)| why.clone())
            .unwrap_or_default()
    };
    assert!(why(&plain, "training.epochs").contains("training.max_steps "));
    assert!(why(&plain, "data.vocab_size").contains("\"char\""));
    // Each setting that reads a key takes it off the list.
    let wsd = unused(&[
        "training.lr_schedule=wsd",
        "training.max_steps=0",
        "data.tokenizer=bpe",
        "precision.amp=true",
    ]);
    assert_eq!(keys(&wsd), ["cv.folds", "cv.patience"]);
    // BERT fine-tuned by epochs with a warm-up ratio: its fixed warm-up,
    // the tokenizer keys and the sampling are not read.
    let bert = unused(&["experiment=bert_finetune"]);
    assert!(
        why(&bert, "training.warmup_steps").contains("training.warmup_ratio 0.1"),
        "{bert:?}"
    );
    assert!(why(&bert, "data.vocab_size").contains("model.init_from"));
    for key in ["data.tokenizer", "sample.top_k", "training.decay_fraction"] {
        assert!(!why(&bert, key).is_empty(), "{key}: {bert:?}");
    }
    for key in ["training.epochs", "cv.folds", "training.min_lr"] {
        assert!(why(&bert, key).is_empty(), "{key}: {bert:?}");
    }
}

#[test]
fn bad_values_name_key_value_and_layer() {
    /// (overrides, environment, what the error must say)
    type BadCase<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a [&'a str]);
    let cases: &[BadCase<'_>] = &[
        (
            &["training.batch_sise=3"],
            &[],
            &[
                "unknown key `training.batch_sise`",
                "did you mean `training.batch_size`?",
                "command line",
            ],
        ),
        (
            &["training.max_length=3"],
            &[],
            &["did you mean `model.max_length`?"],
        ),
        (
            &["training.batch_size=-1"],
            &[],
            &[
                "invalid value -1 for `training.batch_size`",
                "command line (training.batch_size=-1)",
            ],
        ),
        (
            &["training.batch_size=abc"],
            &[],
            &[
                "invalid value \"abc\" for `training.batch_size`",
                "expected a whole number",
            ],
        ),
        (
            &["training.batch_size=0"],
            &[],
            &["invalid value 0", "must be at least 1"],
        ),
        (
            &["data.tokenizer=bpe", "data.vocab_size=1000000000"],
            &[],
            &[
                "`data.vocab_size`",
                "must be at most 4194304 for a trained tokenizer",
            ],
        ),
        (
            &["loader.num_workers=100000"],
            &[],
            &[
                "invalid value 100000 for `loader.num_workers`",
                "at most 1024",
            ],
        ),
        (
            &["sample.count=100000000000000"],
            &[],
            &[
                "invalid value 100000000000000 for `sample.count`",
                "at most 10000",
            ],
        ),
        (
            &["sample.tokens=100000000000000"],
            &[],
            &["`sample.tokens`", "at most 1000000"],
        ),
        (
            &["loader.prefetch_factor=5000"],
            &[],
            &["`loader.prefetch_factor`", "between 1 and 1024"],
        ),
        (
            &["training.batch_size=99999999999999999999"],
            &[],
            &[
                "invalid value 99999999999999999999 for `training.batch_size`",
                "expected a whole number up to 18446744073709551615",
            ],
        ),
        (
            &["training.batch_size=-99999999999999999999"],
            &[],
            &[
                "invalid value -99999999999999999999 for",
                "expected a whole number, 0 or more",
            ],
        ),
        (
            &["precision.amp_dtype=bf61"],
            &[],
            &["expected one of `bf16`, `fp16`", "did you mean `bf16`?"],
        ),
        (
            &["data.max_chars=-3"],
            &[],
            &[
                "invalid value -3 for `data.max_chars`",
                "expected a positive whole number, or \"none\"",
            ],
        ),
        (
            &["data.max_chars=all"],
            &[],
            &["invalid value \"all\" for `data.max_chars`", "or \"none\""],
        ),
        (
            &["model.dropout=1.5"],
            &[],
            &["model.dropout", "must be in [0, 1)"],
        ),
        // No label at all read every pair as unknown ("expected one of ,").
        (
            &["experiment=nli_snli", "data.labels=[]"],
            &[],
            &["data.labels", "must name 2 labels or more, each once"],
        ),
        (
            &["experiment=nli_snli", r#"data.labels=["yes", "no", "yes"]"#],
            &[],
            &["data.labels", "must name 2 labels or more, each once"],
        ),
        // Byte-level BPE made 256 ids, silently, of the 100 asked.
        (
            &["data.tokenizer=bpe", "data.vocab_size=100"],
            &[],
            &["invalid value 100 for `data.vocab_size`", "at least 256"],
        ),
        // 0 is a multiple of any head count, and panicked in the kernels.
        (
            &["model.hidden=0"],
            &[],
            &["invalid value 0 for `model.hidden`", "at least 1"],
        ),
        (
            &["run.dir=runs/{date}-{experiment}"],
            &[],
            &[
                "run.dir",
                "`{date}` is not a placeholder kiln fills in: use {time}, {experiment}, {data}",
            ],
        ),
        (
            &["model.attention_dropout=1"],
            &[],
            &["model.attention_dropout", "must be in [0, 1)"],
        ),
        (
            &[r#"model.init_labels=["entailment", "neutral", "contradiction"]"#],
            &[],
            &["model.init_labels", "set model.init_from, or leave it []"],
        ),
        (
            &[
                "experiment=nli_snli",
                "model.init_from=bert",
                r#"model.init_labels=["Entailment", "neutral", "neutral"]"#,
            ],
            &[],
            &[
                "model.init_labels",
                "must name each of data.labels ([entailment, neutral, contradiction]) once",
            ],
        ),
        (
            &["training.lr_schedule=wsd", "training.decay_fraction=0"],
            &[],
            &["training.decay_fraction", "must be in (0, 1]"],
        ),
        (
            &["training.warmup_ratio=1"],
            &[],
            &["training.warmup_ratio", "must be in [0, 1)"],
        ),
        (
            &["experiment=nli_snli", "eval.patience=2"],
            &[],
            &[
                "eval.patience",
                "a cross-validation fold stops early by cv.patience",
            ],
        ),
        (
            &["training.layer_lr_decay=0.8"],
            &[],
            &["training.layer_lr_decay", "is the sentence-pair encoder's"],
        ),
        (
            &["experiment=nli_snli", "training.layer_lr_decay=1.2"],
            &[],
            &["training.layer_lr_decay", "must be in (0, 1]"],
        ),
        (
            &["training.label_smoothing=1"],
            &[],
            &["training.label_smoothing", "must be in [0, 1)"],
        ),
        (
            &["hardware=t5"],
            &[],
            &[
                "unknown hardware preset `t5`",
                "available (built in)",
                "auto, tuned, a100",
                "t4",
                "did you mean `t4`?",
            ],
        ),
        (
            &["experiment=../../etc/passwd"],
            &[],
            &["unknown experiment preset"],
        ),
        (
            &["batch_size"],
            &[],
            &["bad override `batch_size`", "KEY=VALUE"],
        ),
        (&["+training.foo=1"], &[], &["not supported"]),
        (
            &[],
            &[("KILN_TRAINING__BATCH_SIZE", "x")],
            &["\"x\"", "environment (KILN_TRAINING__BATCH_SIZE)"],
        ),
        (
            &[],
            &[("KILN_TRAINNG__BATCH_SIZE", "3")],
            &["unknown key `trainng`", "did you mean `training`?"],
        ),
        // An unknown table is named where it was set (it read "(?)").
        (
            &["nonsense.key=1"],
            &[],
            &["unknown key `nonsense` set by command line (nonsense.key=1)"],
        ),
    ];
    for (args, env, wants) in cases {
        let mut case = Case::new(args);
        case.env = env;
        let err = case.err();
        for want in *wants {
            assert!(
                err.contains(want),
                "{args:?} {env:?}: `{err}` lacks `{want}`"
            );
        }
    }
}

/// Another tool's name for a key (nanoGPT's `n_embd`, transformers'
/// `per_device_train_batch_size`), in any section, is answered with the
/// kiln key it means, and each such key is one kiln has.
#[test]
fn other_tools_names_for_keys_are_answered_with_kilns() {
    let keys: Vec<String> = Case::new(&[])
        .run()
        .expect("defaults")
        .explain()
        .into_iter()
        .map(|row| row.key)
        .collect();
    for (name, key) in FOREIGN_NAMES {
        assert!(keys.iter().any(|k| k == key), "{name} → {key}: no such key");
        for arg in [format!("{name}=1"), format!("model.{name}=1")] {
            let args = [arg.as_str()];
            let err = Case::new(&args).err();
            assert!(
                err.contains("unknown key `") && err.ends_with(&format!("; did you mean `{key}`?")),
                "{arg}: {err}"
            );
        }
    }
    // A kiln key's own name in another section still points there first.
    let err = Case::new(&["training.max_length=5"]).err();
    assert!(err.contains("did you mean `model.max_length`?"), "{err}");
    // A name several sections have is answered with each, training's first.
    let err = Case::new(&["batch_size=8"]).err();
    assert!(
        err.ends_with("; did you mean `training.batch_size` or `eval.batch_size`?"),
        "{err}"
    );
}

/// Another tool's setting whose meaning depends on its value
/// (transformers' `bf16=true`, nanoGPT's `dtype` and `device`, Lightning's
/// `precision`) is answered with the kiln overrides that value means, and
/// those overrides resolve to it; a section set as one value says it is a
/// section.
#[test]
fn other_tools_settings_are_answered_with_the_overrides_they_mean() {
    for (arg, means, amp, dtype) in [
        (
            "bf16=true",
            "precision.amp=true precision.amp_dtype=bf16",
            true,
            "bf16",
        ),
        (
            "fp16=true",
            "precision.amp=true precision.amp_dtype=fp16",
            true,
            "fp16",
        ),
        (
            "dtype=float16",
            "precision.amp=true precision.amp_dtype=fp16",
            true,
            "fp16",
        ),
        ("model.dtype=float32", "precision.amp=false", false, "bf16"),
        (
            "precision=bf16-mixed",
            "precision.amp=true precision.amp_dtype=bf16",
            true,
            "bf16",
        ),
    ] {
        let args = [arg];
        let err = Case::new(&args).err();
        assert!(
            err.ends_with(&format!("; did you mean `{means}`?")),
            "{arg}: {err}"
        );
        let suggested: Vec<&str> = means.split(' ').collect();
        let config = Case::new(&suggested).ok().config;
        assert_eq!(config.precision.amp, amp, "{means}");
        assert_eq!(
            format!("{:?}", config.precision.amp_dtype).to_lowercase(),
            dtype,
            "{means}"
        );
    }
    let err = Case::new(&["precision=bf16-mixed"]).err();
    assert!(
        err.contains("for `precision` set by command line (precision=bf16-mixed): `precision` is a section of keys (precision.amp, "),
        "{err}"
    );
    let err = Case::new(&["device=cuda:1"]).err();
    assert!(
        err.ends_with("`device` is a section of keys (device.backend, device.index), not a value; did you mean `device.backend=cuda device.index=1`?"),
        "{err}"
    );
    let config = Case::new(&["device.backend=cuda", "device.index=1"])
        .ok()
        .config;
    assert_eq!(config.device.index, 1);
    // A value that means nothing kiln has: the section alone.
    let err = Case::new(&["device=tpu"]).err();
    assert!(err.ends_with("not a value"), "{err}");
}

/// A presets directory over the built-in ones, to add broken presets to.
fn presets_copy() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(tmp.path().join("hardware")).expect("mkdir");
    tmp
}

#[test]
fn broken_presets_name_file_and_line() {
    let tmp = presets_copy();
    let t4 = tmp.path().join("hardware/t4.toml");
    std::fs::write(&t4, "[training]\nbatch_size = 16\nbad line\n").expect("write");
    let mut case = Case::new(&["hardware=t4"]);
    case.presets = Some(tmp.path());
    let err = case.run().expect_err("broken").to_string();
    assert!(
        err.contains("t4.toml` line 3") && err.contains("invalid TOML"),
        "{err}"
    );

    std::fs::write(&t4, "[training]\n\nbatch_sise = 16\n").expect("write");
    let err = case.run().expect_err("unknown key").to_string();
    assert!(
        err.contains("t4.toml:3") && err.contains("batch_size"),
        "{err}"
    );

    std::fs::write(&t4, "hardware = \"a100\"\n").expect("write");
    let err = case.run().expect_err("reserved").to_string();
    assert!(
        err.contains("sets `hardware`") && err.contains("t4.toml:1"),
        "{err}"
    );
}

#[test]
fn hardware_tuned_layers_this_machines_measured_values_over_its_preset() {
    let tmp = presets_copy();
    let mut case = Case::new(&["hardware=tuned"]);
    case.presets = Some(tmp.path());
    let machine = case.report.machine_id();

    // Not tuned yet: the error says what to run.
    let err = case.run().expect_err("untuned").to_string();
    assert!(
        err.contains(&machine) && err.contains("kiln tune experiment=shakespeare_char"),
        "{err}"
    );

    let path = tmp.path().join(format!("tuned/{machine}.toml"));
    std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
    std::fs::write(
        &path,
        "[shakespeare_char.training]\n# measured\nbatch_size = 6\ngradient_accumulation_steps = 2\n\
         [shakespeare_char.loader]\nnum_workers = 2\n",
    )
    .expect("write");
    let r = case.run().expect("tuned");
    assert_eq!(r.config.hardware, "tuned");
    assert_eq!(r.config.training.batch_size, 6);
    assert_eq!(r.config.training.gradient_accumulation_steps, 2);
    assert_eq!(r.config.loader.num_workers, 2);
    // The rest comes from the preset the machine would get (cpu).
    assert_eq!(r.config.device.backend, kiln_config::Backend::Flex);
    let source = &r.sources["training.batch_size"];
    assert_eq!(source.layer, LayerKind::Tuned(machine.clone()));
    assert!(source.location.contains(":3"), "{source}");
    assert!(
        r.hardware_choice
            .expect("choice")
            .why
            .contains("over `cpu`")
    );
    // The command line still wins.
    let mut over = Case::new(&["hardware=tuned", "training.batch_size=4"]);
    over.presets = Some(tmp.path());
    assert_eq!(over.run().expect("ok").config.training.batch_size, 4);

    // Another experiment was not tuned; a misspelt key is named with its line.
    let mut nli = Case::new(&["hardware=tuned", "experiment=nli_snli"]);
    nli.presets = Some(tmp.path());
    let err = nli.run().expect_err("nli untuned").to_string();
    assert!(err.contains("experiment `nli_snli`"), "{err}");
    std::fs::write(&path, "[shakespeare_char.training]\nbatch_sise = 6\n").expect("write");
    let err = case.run().expect_err("typo").to_string();
    assert!(
        err.contains("batch_sise") && err.contains("did you mean") && err.contains(":2"),
        "{err}"
    );
}

#[test]
fn a_presets_directory_overrides_single_defaults_and_adds_presets() {
    let tmp = presets_copy();
    // A partial defaults.toml changes only what it names; the rest stays.
    std::fs::write(tmp.path().join("defaults.toml"), "[training]\nseed = 7\n").expect("write");
    std::fs::write(
        tmp.path().join("hardware/my_box.toml"),
        "[training]\nbatch_size = 3\n",
    )
    .expect("write");
    let mut case = Case::new(&["hardware=my_box"]);
    case.presets = Some(tmp.path());
    let r = case.run().expect("resolves");
    assert_eq!(r.config.training.seed, 7);
    assert_eq!(r.config.training.batch_size, 3);
    check(&r, "training.seed", "7", "defaults.toml:2");
    check(
        &r,
        "data.premise_field",
        "\"premise\"",
        "built-in defaults.toml:",
    );
    check(&r, "training.batch_size", "3", "my_box.toml:2");

    // An unknown key in the directory's defaults is named with its line.
    std::fs::write(tmp.path().join("defaults.toml"), "[training]\nsed = 7\n").expect("write");
    let err = case.run().expect_err("typo").to_string();
    assert!(
        err.contains("training.sed") && err.contains("defaults.toml:2") && err.contains("seed"),
        "{err}"
    );

    // An unknown preset lists both sources.
    let err = Case {
        presets: Some(tmp.path()),
        ..Case::new(&["hardware=my_bx"])
    }
    .run()
    .expect_err("unknown")
    .to_string();
    assert!(
        err.contains("built in and in") && err.contains("did you mean `my_box`"),
        "{err}"
    );
}

#[test]
fn the_built_in_defaults_are_a_run_config() {
    let config = kiln_config::RunConfig::default();
    assert_eq!(config.experiment, "shakespeare_char");
    assert!(config.validate().is_empty());
}

#[test]
fn none_is_spelt_none_and_old_runs_spellings_still_read() {
    let defaults = Case::new(&[]).ok();
    assert_eq!(defaults.config.data.max_chars, None);
    assert_eq!(defaults.config.data.tokenizer_file, None);
    check(&defaults, "data.max_chars", "\"none\"", "defaults");
    check(&defaults, "data.tokenizer_file", "\"none\"", "defaults");

    let set = Case::new(&["data.max_chars=5000", "data.tokenizer_file=tok.json"]).ok();
    assert_eq!(set.config.data.max_chars, Some(5000));
    assert_eq!(set.config.data.tokenizer_file.as_deref(), Some("tok.json"));
    check(&set, "data.max_chars", "5000", "command line");

    // kiln 0.1 wrote none as 0 and "": a saved run's configuration resumes.
    let old = Case::new(&["data.max_chars=0", "data.tokenizer_file="]).ok();
    assert_eq!(old.config.data.max_chars, None);
    assert_eq!(old.config.data.tokenizer_file, None);

    // A run's saved configuration round-trips through its TOML.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.toml");
    std::fs::write(&path, set.to_toml()).expect("write");
    let back = kiln_config::read_run_config(&path).expect("read back");
    assert_eq!(back, set.config);
    std::fs::write(&path, defaults.to_toml()).expect("write");
    let back = kiln_config::read_run_config(&path).expect("read back");
    assert_eq!(back, defaults.config);
}

#[test]
fn a_resume_changes_what_leaves_model_and_data_and_names_what_it_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.toml");
    let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    std::fs::write(&path, Case::new(&[]).ok().to_toml()).expect("write");

    // No overrides: the saved configuration, nothing changed.
    let same = kiln_config::resume_run_config(&path, &[]).expect("reads");
    assert_eq!(same.config, same.saved);
    assert!(same.changes.is_empty());

    // A language model may train longer, slower, in smaller micro-batches;
    // setting a key to its saved value is no change.
    let r = kiln_config::resume_run_config(
        &path,
        &args(&[
            "training.max_steps=6000",
            "training.learning_rate=5e-4",
            "training.batch_size=6",
            "model.gradient_checkpointing=true",
            "model.layers=4",
        ]),
    )
    .expect("allowed");
    assert_eq!(r.config.training.max_steps, 6000);
    assert_eq!(r.saved.training.max_steps, 3000);
    let changed: Vec<(&str, &str, &str)> = r
        .changes
        .iter()
        .map(|c| (c.key.as_str(), c.from.as_str(), c.to.as_str()))
        .collect();
    assert_eq!(
        changed,
        [
            ("model.gradient_checkpointing", "false", "true"),
            ("training.batch_size", "12", "6"),
            ("training.max_steps", "3000", "6000"),
            ("training.learning_rate", "0.001", "0.0005"),
        ]
    );
    assert_eq!(r.changes[1].source.layer, LayerKind::CommandLine);
    assert_eq!(r.changes[1].source.location, "training.batch_size=6");

    // The model, the data, the seed and the presets stay, each refused by name.
    let err = kiln_config::resume_run_config(
        &path,
        &args(&[
            "model.hidden=64",
            "data.vocab_size=500",
            "training.seed=1",
            "hardware=t4",
        ]),
    )
    .expect_err("refused")
    .to_string();
    for part in [
        "`model.hidden` set by command line (model.hidden=64): the run has 128",
        "`data.vocab_size`",
        "`training.seed`",
        "`hardware`",
    ] {
        assert!(err.contains(part), "{part} not in {err}");
    }
    // The usual errors still apply.
    let err = kiln_config::resume_run_config(&path, &args(&["training.max_step=1"]))
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("did you mean `training.max_steps`"), "{err}");
    let err = kiln_config::resume_run_config(&path, &args(&["training.learning_rate=0"]))
        .expect_err("range")
        .to_string();
    assert!(err.contains("must be a positive number"), "{err}");

    // Cross-validation: the folds train alike, so only what runs them and
    // what they write may change.
    std::fs::write(&path, Case::new(&["experiment=nli_snli"]).ok().to_toml()).expect("write");
    let cv = kiln_config::resume_run_config(
        &path,
        &args(&["loader.num_workers=2", "logging.logging_steps=5"]),
    )
    .expect("allowed");
    assert_eq!(cv.changes.len(), 2);
    let err = kiln_config::resume_run_config(
        &path,
        &args(&[
            "training.learning_rate=1e-4",
            "eval.eval_steps=10",
            "cv.folds=3",
        ]),
    )
    .expect_err("refused")
    .to_string();
    for key in ["training.learning_rate", "eval.eval_steps", "cv.folds"] {
        assert!(err.contains(&format!("`{key}`")), "{key} not in {err}");
    }
}
