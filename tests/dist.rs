//! `kiln launch`: data-parallel jobs of two and three local processes on
//! the CPU, against one process with the whole batch; a rank killed; a
//! resume that would change the global batch; bad launches.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::support::{exit_within, interrupted_stdout, kiln, root, signal, start_until, weights};
use crate::train::{checkpoint_digest, ckpt, eval_steps, final_val_loss, metadata, tiny};

/// A port nobody listens on now.
fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port().to_string())
        .expect("a free port")
}

/// `kiln launch --nproc-per-node n` at a free port, every rank running
/// `command`.
fn launch_of(n: usize, command: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut args = vec![
        "launch".to_string(),
        "--nproc-per-node".into(),
        n.to_string(),
        "--master-port".into(),
        free_port(),
    ];
    args.extend(command);
    args
}

/// `kiln launch --nproc-per-node n` of the tiny run with `extra` overrides.
pub(crate) fn launch_args(
    dir: &Path,
    run: &str,
    steps: u32,
    n: usize,
    extra: &[&str],
) -> Vec<String> {
    let mut args = launch_of(n, tiny(dir, run, steps));
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run(args: &[String]) -> crate::support::Run {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    kiln(&refs).run()
}

/// `kiln launch` of 2 ranks resuming `job` with `change`.
fn resume_job(job: &Path, change: &str) -> crate::support::Run {
    run(&launch_of(
        2,
        ["resume".into(), job.display().to_string(), change.into()],
    ))
}

/// The largest difference between two checkpoints' weights, but for the
/// keys' biases (the middle third of each `qkv.bias`): attention's softmax
/// does not change when every key of a query moves by the same amount, so
/// their gradient is 0 in exact arithmetic and rounding noise in floats,
/// which AdamW scales up to learning-rate-sized steps. They drift apart
/// with the order of the sums (1.3e-4 after 200 steps of the tiny GPT)
/// and change no output.
fn max_abs_diff(a: &Path, b: &Path) -> f32 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .flat_map(|((na, va), (nb, vb))| {
            assert_eq!(na, nb);
            let n = va.len();
            let keys = if na.ends_with("qkv.bias") {
                n / 3..2 * n / 3
            } else {
                0..0
            };
            va.iter()
                .zip(vb)
                .enumerate()
                .filter(move |(i, _)| !keys.contains(i))
                .map(|(_, (x, y))| (x - y).abs())
        })
        .fold(0.0, f32::max)
}

/// The steps `metrics.jsonl` logs, in order.
fn logged(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .expect("metrics.jsonl")
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "step")
        .filter_map(|v| v["step"].as_u64())
        .collect()
}

#[test]
fn two_and_three_ranks_train_as_one_process_with_the_whole_batch() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    let mut one = tiny(dir, "one", steps);
    one.push("training.batch_size=6".into());
    run(&one).expect_code(0);
    for (n, micro) in [(2, 3), (3, 2)] {
        let name = format!("ranks{n}");
        let job = run(&launch_args(
            dir,
            &name,
            steps,
            n,
            &[&format!("training.batch_size={micro}")],
        ))
        .expect_code(0);
        job.stdout_has(&[&format!("accumulation 1 × {n} ranks → 6 sequences")]);
        // The ranks split the machine's cores (RAYON_NUM_THREADS, as
        // torchrun sets OMP_NUM_THREADS), and each says so.
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if cores >= n {
            job.stdout_has(&[&format!("threads: {} of the ", cores / n)]);
        }
        let ranked = dir.join(&name);
        // The same batches, summed in another order: within float rounding
        // after 200 AdamW steps (measured 4.7e-6 for 2 ranks; docs/DISTRIBUTED.md).
        let diff = max_abs_diff(&ckpt(&dir.join("one"), steps), &ckpt(&ranked, steps));
        assert!(diff < 1e-4, "{n} ranks: weights differ by {diff}");
        let (a, b) = (final_val_loss(&dir.join("one")), final_val_loss(&ranked));
        assert!((a - b).abs() < 1e-4, "{n} ranks: val loss {b} against {a}");
        // Each step logged once, by rank 0 alone.
        let steps_logged = logged(&ranked);
        let mut unique = steps_logged.clone();
        unique.dedup();
        assert_eq!(unique, steps_logged, "a step logged twice");
        assert!(!steps_logged.is_empty());
    }
    // The gradients averaged in bf16 (precision.reduce_dtype): rounded, so
    // further from one process than the f32 jobs, but the same training.
    let job = run(&launch_args(
        dir,
        "bf16",
        steps,
        2,
        &["training.batch_size=3", "precision.reduce_dtype=bf16"],
    ))
    .expect_code(0);
    job.stdout_has(&[
        "reduced over the rendezvous's sockets",
        "in bf16 (precision.reduce_dtype)",
    ]);
    let bf16 = dir.join("bf16");
    let diff = max_abs_diff(&ckpt(&dir.join("one"), steps), &ckpt(&bf16, steps));
    let (a, b) = (final_val_loss(&dir.join("one")), final_val_loss(&bf16));
    assert!(
        diff > 1e-4,
        "bf16 gradients rounded: weights differ by {diff}"
    );
    assert!((a - b).abs() < 2e-2, "bf16: val loss {b} against {a}");
    // Only rank 0 wrote: no run directory besides the named ones.
    let mut entries: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        ["bf16", "cache", "corpus.txt", "one", "ranks2", "ranks3"]
    );
}

/// The pid of rank `rank` among the children of `launcher`.
fn rank_pid(launcher: u32, rank: usize) -> Option<u32> {
    // (The launcher may spawn from any of its threads.)
    let mut children = String::new();
    for task in std::fs::read_dir(format!("/proc/{launcher}/task"))
        .ok()?
        .flatten()
    {
        children += &std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        children.push(' ');
    }
    children.split_whitespace().find_map(|pid| {
        let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let wanted = format!("RANK={rank}");
        env.split(|&b| b == 0)
            .any(|v| v == wanted.as_bytes())
            .then(|| pid.parse().ok())
            .flatten()
    })
}

#[test]
fn a_rank_killed_ends_the_job_and_the_resumed_job_matches_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 1000;
    let batch = ["training.batch_size=4"];
    run(&launch_args(dir, "whole", steps, 2, &batch)).expect_code(0);
    let killed = dir.join("killed");
    let launcher = start_until(
        &launch_args(dir, "killed", steps, 2, &batch),
        &ckpt(&killed, 100),
    );
    let pid = rank_pid(launcher.id(), 1).expect("rank 1 runs");
    signal(pid, "-KILL");
    let killed_at = Instant::now();
    let out = launcher.wait_with_output().expect("launcher ends");
    assert!(
        killed_at.elapsed() < Duration::from_secs(60),
        "the job took {:?} to end",
        killed_at.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 1") && stderr.contains("SIGKILL"),
        "the launcher names the rank:\n{stderr}"
    );
    assert!(
        !ckpt(&killed, steps).exists(),
        "killed after the last step: make it longer"
    );
    // Resumed as torchrun's --max-restarts starts it: the same `kiln
    // train` again, its attempt counted (what `kiln launch … resume RUN`
    // does by hand, and --max-restarts below by itself).
    let again = launch_args(dir, "killed", steps, 2, &batch);
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    let resumed = kiln(&again)
        .env("TORCHELASTIC_MAX_RESTARTS", "3")
        .env("TORCHELASTIC_RESTART_COUNT", "1")
        .run();
    resumed
        .expect_code(0)
        .stdout_has(&["resuming", "from step"])
        .stderr_has(&["torchrun's restart 1 of 3: resuming"]);
    assert_eq!(
        checkpoint_digest(&ckpt(&killed, steps)),
        checkpoint_digest(&ckpt(&dir.join("whole"), steps)),
        "the resumed job's last checkpoint is the uninterrupted job's, bit for bit"
    );
    // With --max-restarts the launcher does that itself: it fixes the
    // folder the run.dir template names ({time} included; {data}, the
    // corpus's name, too) before the ranks start, and when a rank dies
    // every rank resumes it from its last checkpoint.
    let parent = dir.join("restarts");
    let mut args = launch_args(dir, "unused", steps, 2, &batch);
    args.splice(1..1, ["--max-restarts".to_string(), "2".into()]);
    args.push(format!(
        "run.dir={}/{{time}}-{{data}}-job",
        parent.display()
    ));
    let launcher = start_until(&args, &parent);
    // Rank 0 makes the parent, then the run folder in it.
    let run_dir = crate::support::poll("the run folder", || {
        std::fs::read_dir(&parent)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with("-corpus-job"))
    });
    crate::support::wait_for(&ckpt(&run_dir, 100));
    signal(rank_pid(launcher.id(), 1).expect("rank 1 runs"), "-KILL");
    let out = launcher.wait_with_output().expect("launcher ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("rank 1")
            && stderr.contains("SIGKILL")
            && stderr.contains("restart 1 of 2: every rank resumes")
            && stderr.contains("from its checkpoint of step"),
        "{stderr}"
    );
    assert_eq!(
        checkpoint_digest(&ckpt(&run_dir, steps)),
        checkpoint_digest(&ckpt(&dir.join("whole"), steps)),
        "the restarted job's last checkpoint is the uninterrupted job's, bit for bit"
    );
}

#[test]
fn zero_1_and_2_keep_a_share_on_each_rank_and_take_ddps_steps_bit_for_bit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 200;
    // Clipping at every step: the norm ZeRO-2 adds up from the ranks'
    // shares must be DDP's to the bit, or the updates differ.
    let common = ["training.batch_size=4", "training.grad_clip=0.05"];
    let job = |name: &str, stage: &str| {
        let mut extra = common.to_vec();
        extra.push(stage);
        run(&launch_args(dir, name, steps, 2, &extra)).expect_code(0)
    };
    job("ddp", "optimization.zero_stage=0");
    job("zero1", "optimization.zero_stage=1").stdout_has(&[
        "ZeRO-1: each rank keeps AdamW's moments for its share",
        "rank 0:",
        "the weights are all-gathered",
    ]);
    job("zero2", "optimization.zero_stage=2").stdout_has(&[
        "ZeRO-2: each rank keeps AdamW's moments for its share",
        "the gradients are reduce-scattered",
        "reduce-scattered, each rank receiving its share's average",
    ]);
    let norms = |name: &str| -> Vec<f64> {
        std::fs::read_to_string(dir.join(name).join("metrics.jsonl"))
            .expect("metrics")
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["grad_norm"].as_f64())
            .collect()
    };
    let ddp_norms = norms("ddp");
    assert!(
        !ddp_norms.is_empty() && ddp_norms.iter().all(|&n| n > 0.05),
        "clipping at every logged step: {ddp_norms:?}"
    );
    // Each parameter updated by one rank with the same arithmetic, the
    // norm the same bits, the weights gathered bit for bit, every moment
    // gathered into rank 0's checkpoint: the checkpoints are DDP's,
    // weights and moments alike.
    for zero in ["zero1", "zero2"] {
        assert_eq!(norms(zero), ddp_norms, "{zero}'s logged norms");
        for step in [100, steps] {
            assert_eq!(
                checkpoint_digest(&ckpt(&dir.join(zero), step)),
                checkpoint_digest(&ckpt(&dir.join("ddp"), step)),
                "{zero} at step {step}"
            );
        }
    }
    // With the gradients in bf16 (each rank's rounded, the average
    // rounded), the reduce-scatter's part is the all-reduce's, bit for bit.
    for (name, stage) in [("ddp-bf16", "0"), ("zero2-bf16", "2")] {
        let mut extra = common.to_vec();
        let stage = format!("optimization.zero_stage={stage}");
        extra.extend(["precision.reduce_dtype=bf16", &stage]);
        run(&launch_args(dir, name, 100, 2, &extra)).expect_code(0);
    }
    assert_eq!(
        checkpoint_digest(&ckpt(&dir.join("zero2-bf16"), 100)),
        checkpoint_digest(&ckpt(&dir.join("ddp-bf16"), 100)),
    );
    assert_ne!(
        checkpoint_digest(&ckpt(&dir.join("ddp-bf16"), 100)),
        checkpoint_digest(&ckpt(&dir.join("ddp"), 100)),
        "bf16 gradients round"
    );
    // `--nproc-per-node 1` asked for is a job of one rank (torchrun's),
    // not one process: ZeRO-2 runs over a world of one (every parameter
    // its own: what a GPU check on one GPU runs NCCL's reduce-scatter and
    // all-gather through) and takes the steps of DDP's job of one.
    for (name, stage) in [("ddp-one", "0"), ("zero2-one", "2")] {
        let mut extra = common.to_vec();
        let stage = format!("optimization.zero_stage={stage}");
        extra.push(&stage);
        let ran = run(&launch_args(dir, name, 100, 1, &extra)).expect_code(0);
        ran.stdout_has(&["the gradients of the 1 rank (a job of one) are reduced"]);
        if name == "zero2-one" {
            // "(rank 0: 26 of 26 tensors, …": every tensor its own.
            let (mine, all) = ran
                .stdout
                .split_once("(rank 0: ")
                .and_then(|(_, rest)| rest.split_once(" tensors"))
                .and_then(|(counts, _)| counts.split_once(" of "))
                .unwrap_or_else(|| panic!("no ZeRO line:\n{}", ran.stdout));
            assert_eq!(mine, all, "{}", ran.stdout);
        }
    }
    assert_eq!(
        checkpoint_digest(&ckpt(&dir.join("zero2-one"), 100)),
        checkpoint_digest(&ckpt(&dir.join("ddp-one"), 100)),
        "a job of one rank, ZeRO-2 against DDP"
    );
    // Resumed: each rank takes its share of the checkpoint's moments and
    // goes on as the DDP job does.
    let more = |run_dir: &str| {
        let args: Vec<String> = [
            "launch",
            "--nproc-per-node",
            "2",
            "--master-port",
            &free_port(),
            "resume",
            &dir.join(run_dir).display().to_string(),
            "training.max_steps=300",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        run(&args).expect_code(0);
    };
    for name in ["zero1", "zero2", "ddp"] {
        more(name);
    }
    for zero in ["zero1", "zero2"] {
        assert_eq!(
            checkpoint_digest(&ckpt(&dir.join(zero), 300)),
            checkpoint_digest(&ckpt(&dir.join("ddp"), 300)),
            "{zero} resumed"
        );
    }
}

#[test]
fn a_resume_that_changes_the_global_batch_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    run(&launch_args(dir, "job", 100, 2, &["training.batch_size=4"])).expect_code(0);
    let job = dir.join("job");
    let job = job.to_str().expect("utf-8");
    // Alone with the same micro-batch: half the global batch.
    kiln(&["resume", job, "training.max_steps=120"])
        .run()
        .expect_code(2)
        .stderr_has(&[
            "cannot resume with 1 rank:",
            "global batch of 8",
            "× 2 ranks), and 1 rank × 4 × 1 make 4,",
            "training.gradient_accumulation_steps=2",
        ]);
    // Alone with the accumulation that keeps it: allowed.
    kiln(&[
        "resume",
        job,
        "training.max_steps=120",
        "training.gradient_accumulation_steps=2",
    ])
    .run()
    .expect_code(0);
    assert!(ckpt(Path::new(job), 120).exists());
}

/// `torchrun --no-python kiln train …` (a stand-in for torchrun in
/// tests/data/pytorch-stub, CI having no PyTorch: its agent's TCPStore at
/// `MASTER_PORT`, as torchrun's): the ranks meet through that store and
/// take `kiln launch`'s steps, each with its share of the cores.
#[test]
fn torchrun_starts_the_job_kiln_launch_starts() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    run(&launch_args(dir, "launched", 100, 2, &[])).expect_code(0);
    let out = Command::new("python3")
        .args(["-m", "torch.distributed.run", "--nproc-per-node", "2"])
        .args(["--master-port", &free_port(), "--no-python"])
        .arg(crate::support::kiln_bin())
        .args(tiny(dir, "torchrun", 100))
        .env("PYTHONPATH", root().join("tests/data/pytorch-stub"))
        .output()
        .expect("python3 runs the torchrun stand-in");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        checkpoint_digest(&ckpt(&dir.join("torchrun"), 100)),
        checkpoint_digest(&ckpt(&dir.join("launched"), 100)),
        "torchrun's job takes kiln launch's steps"
    );
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    if cores >= 2 {
        let threads = format!("threads: {} of the {cores} cores", cores / 2);
        assert!(stdout.contains(&threads), "{threads}:\n{stdout}");
    }
}

#[test]
fn a_job_benchmarks_the_language_model_step_over_every_rank() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut args: Vec<String> = [
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &free_port(),
        "bench",
        "lm",
        "--json",
        "--warmup=1",
        "--steps=3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // The tiny run's layers (batch 8 of 32 tokens per rank), no run directory.
    args.extend(
        tiny(dir, "unused", 10)
            .into_iter()
            .skip(1)
            .filter(|a| !a.starts_with("run.dir")),
    );
    let out = run(&args).expect_code(0);
    // Rank 0 alone reports: one JSON document, by the documented schema.
    crate::measure::check_schema("bench-schema", &out.stdout);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("one JSON document");
    let b = &v["bench"];
    assert_eq!(b["world_size"], 2);
    assert_eq!(b["timed_steps"], 3);
    let how = b["collectives"].as_str().expect("collectives");
    assert!(how.contains("sockets") && how.contains("2 ranks"), "{how}");
    let comm = b["comm_pct"].as_f64().expect("comm_pct");
    assert!(comm > 0.0 && comm < 100.0, "all-reduce {comm}% of the step");
    assert!(
        b["phases"]["all_reduce_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0)
    );
    // The rates are the job's: both ranks' micro-batches in each step.
    let per_step = b["tokens_per_s_median"].as_f64().expect("tokens/s")
        * b["ms_per_step_median"].as_f64().expect("ms")
        / 1e3;
    assert!(
        (per_step - (2 * 8 * 32) as f64).abs() < 1.0,
        "{per_step} tokens per step"
    );
    let peak = b["mfu_peak"].as_str().expect("mfu_peak");
    assert!(peak.starts_with("2 × "), "{peak}");
    assert_eq!(b["phases"]["all_gather_ms"], 0.0, "DDP gathers no weights");
    // ZeRO-1 and ZeRO-2: the weights' all-gather timed, and counted as
    // communication; ZeRO-2's reduce-scatter where the all-reduce was.
    for stage in [1, 2] {
        let mut zero = args.clone();
        zero.push(format!("optimization.zero_stage={stage}"));
        let v: serde_json::Value =
            serde_json::from_str(&run(&zero).expect_code(0).stdout).expect("json");
        let z = &v["bench"];
        let how = z["collectives"].as_str().expect("collectives");
        assert!(how.contains(&format!("ZeRO-{stage}")), "{how}");
        let gather = z["phases"]["all_gather_ms"]
            .as_f64()
            .expect("all_gather_ms");
        let reduce = z["phases"]["all_reduce_ms"]
            .as_f64()
            .expect("all_reduce_ms");
        let step = z["ms_per_step_median"].as_f64().expect("ms");
        let comm = z["comm_pct"].as_f64().expect("comm_pct");
        assert!(gather > 0.0 && reduce > 0.0, "{gather} ms, {reduce} ms");
        // comm_pct is the median of each step's share (bench.rs's
        // `comm_share` adds the gather, unit-tested there); the medians of
        // the phases and of the step, taken apart, need not give it back
        // on a loaded machine (37.7 % against 7.3 of 14.6 ms, 2026-12-03).
        assert!(
            comm > 0.0 && comm < 100.0,
            "comm_pct {comm} (gather {gather} ms, reduction {reduce} ms of {step})"
        );
    }
    // Alone, the same bench has no job.
    let alone: Vec<String> = args[5..].to_vec();
    let v: serde_json::Value =
        serde_json::from_str(&run(&alone).expect_code(0).stdout).expect("json");
    assert_eq!(v["bench"]["world_size"], 1);
    assert!(v["bench"]["comm_pct"].is_null() && v["bench"]["collectives"].is_null());
    assert_eq!(v["bench"]["phases"]["all_reduce_ms"], 0.0);
    // A job of one rank (`--nproc-per-node 1`), in text: its line counts
    // one rank.
    let mut one = args.clone();
    one[2] = "1".into();
    one.retain(|a| a != "--json");
    run(&one)
        .expect_code(0)
        .stdout_has(&["job: 1 rank, the rates and MFU"]);
}

#[test]
fn bad_launches_exit_2_with_the_reason() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let train = tiny(dir, "x", 10);
    let with = |pre: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = pre.iter().map(|s| s.to_string()).collect();
        a.extend(train.iter().cloned());
        a
    };
    run(&with(&["launch", "--nproc-per-node", "0"]))
        .expect_code(2)
        .stderr_has(&["--nproc-per-node 0"]);
    // A typo's hundred thousand processes are refused, not started.
    run(&with(&["launch", "--nproc-per-node", "100000"]))
        .expect_code(2)
        .stderr_has(&["--nproc-per-node 100000", "at most 1024 processes"]);
    run(&with(&["launch", "--nnodes", "2", "--node-rank", "2"]))
        .expect_code(2)
        .stderr_has(&["--node-rank 2", "out of range"]);
    let held = std::net::TcpListener::bind("0.0.0.0:0").expect("binds");
    let port = held.local_addr().expect("addr").port().to_string();
    run(&with(&[
        "launch",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
    ]))
    .expect_code(2)
    .stderr_has(&[&format!("port {port} is in use")]);
    // A sweep of jobs, before any rank starts.
    let sweep = run(&launch_of(
        2,
        [
            "cv".into(),
            "-m".into(),
            "training.learning_rate=1e-3,3e-4".into(),
        ],
    ))
    .expect_code(2);
    sweep.stderr_has(&["`kiln launch … cv -m`: a sweep starts its jobs as processes of its own"]);
    assert!(!sweep.stderr.contains("rank 0"), "{}", sweep.stderr);
    run(&["launch".into(), "predict".into()])
        .expect_code(2)
        .stderr_has(&[
            "runs `train`, `cv`, `resume` or `bench lm|nli` on every rank, not `predict`",
        ]);
    // Under torchrun's --max-restarts a run.dir with {time} would name a
    // new folder each attempt: refused before anything trains.
    let mut timed = train.clone();
    timed.push("run.dir=runs/{time}".into());
    let timed: Vec<&str> = timed.iter().map(String::as_str).collect();
    let error_file = dir.join("error.json");
    kiln(&timed)
        .env("TORCHELASTIC_MAX_RESTARTS", "2")
        .env("TORCHELASTIC_RESTART_COUNT", "0")
        .env(
            "TORCHELASTIC_ERROR_FILE",
            error_file.to_str().expect("utf-8"),
        )
        .run()
        .expect_code(2)
        .stderr_has(&["under torchrun --max-restarts 2, run.dir must name one folder"]);
    // The reason, where torchrun's summary of the failed job reads it.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&error_file).expect("error file"))
            .expect("json");
    let message = record["message"].as_str().expect("message");
    assert!(message.contains("run.dir must name one folder"), "{record}");
    assert!(
        record["timestamp"].as_u64().is_some_and(|t| t > 0),
        "{record}"
    );
    // Bad input on a rank (a job of one's cross-validation of pairs that
    // are not there): its error, and the launcher's word that the input
    // was bad, not a crash to resume from.
    let missing = dir.join("no-such-pairs.jsonl");
    run(&launch_of(
        1,
        [
            "cv".into(),
            "hardware=cpu".into(),
            format!("data.path={}", missing.display()),
        ],
    ))
    .expect_code(2)
    .stderr_has(&[
        "no-such-pairs.jsonl",
        "bad input (exit 2); fix what it names first",
    ]);
    // Restarts resume a run: not a bench, and on several nodes only a
    // folder every node names alike.
    run(&["launch", "--max-restarts", "1", "bench", "lm"].map(String::from))
        .expect_code(2)
        .stderr_has(&["restarts `train`, `cv` and `resume`, not `bench`"]);
    let mut timed = with(&["launch", "--max-restarts", "1", "--nnodes", "2"]);
    timed.push("run.dir=runs/{time}".into());
    run(&timed)
        .expect_code(2)
        .stderr_has(&["needs a run directory every node names alike", "run.dir="]);
    // Only the training step's benches run as a job, at the launcher or on
    // a rank torchrun started.
    run(&["launch", "--nproc-per-node", "2", "bench", "loader"].map(String::from))
        .expect_code(2)
        .stderr_has(&["bench loader", "`bench lm` or `bench nli`"]);
    kiln(&["bench", "loader"])
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", &free_port())
        .run()
        .expect_code(2)
        .stderr_has(&["rank 1 of 2", "`bench loader` runs in one process"]);
    // A rank outside its world, as torchrun's variables give it.
    let refs: Vec<&str> = train.iter().map(String::as_str).collect();
    kiln(&refs)
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .run()
        .expect_code(2)
        .stderr_has(&["RANK=2", "out of range"]);
    // A rendezvous nobody else joins times out naming who is missing.
    kiln(&refs)
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .env("MASTER_PORT", &free_port())
        .env("RENDEZVOUS_TIMEOUT", "1")
        .run()
        .expect_code(1)
        .stderr_has(&["rank 1, 2 did not join"]);
    assert!(
        !dir.join("x").exists(),
        "no run directory for a failed launch"
    );
}

#[test]
fn one_rank_trains_in_place_and_planning_knows_the_world() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // No GPU here: `kiln launch` without --nproc-per-node trains in this
    // process, as `cargo xtask train-auto` does on a CPU.
    let mut args = vec!["launch".to_string()];
    args.extend(tiny(dir, "alone", 20));
    run(&args)
        .expect_code(0)
        .stderr_has(&["1 rank on this machine — no GPU"]);
    assert!(ckpt(&dir.join("alone"), 20).exists());
    // check-hardware says how many ranks train-auto starts: four GPUs of
    // one kind, but this test build has no GPU backend.
    let report = crate::support::fake_report(dir, &[("NVIDIA H100 80GB HBM3", 80, (9, 0)); 4]);
    let report = format!("--hardware-report={}", report.display());
    kiln(&[&report, "check-hardware"])
        .run()
        .expect_code(0)
        .stdout_has(&["ranks          1 — 4 GPU(s), but this build has no GPU backend"]);
    // diagnose estimates the reduction for the ranks asked for.
    let mut diag: Vec<String> = vec![
        "diagnose".into(),
        "--json".into(),
        "--burst".into(),
        "0".into(),
    ];
    diag.extend(["--ranks".into(), "4".into()]);
    diag.extend(tiny(dir, "unused", 20).into_iter().skip(1));
    let out = run(&diag).expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("json");
    let r = &v["diagnosis"]["reduction"];
    assert_eq!(r["ranks"], 4);
    let params = v["diagnosis"]["memory"]["parameters"]
        .as_u64()
        .expect("parameters");
    assert_eq!(r["gradient_bytes"].as_u64(), Some(params * 4));
    assert_eq!(r["gather_bytes"], 0);
    assert_eq!(r["per_link_ms"].as_array().map(Vec::len), Some(5));
    let ddp = &v["diagnosis"]["memory"];
    let (total, moments) = (
        ddp["total"].as_u64().expect("total"),
        ddp["optimizer"].as_u64().expect("optimizer"),
    );
    // Under ZeRO-1 a rank keeps a quarter of the moments, and the weights'
    // all-gather joins the reduction.
    diag.push("optimization.zero_stage=1".into());
    let z: serde_json::Value =
        serde_json::from_str(&run(&diag).expect_code(0).stdout).expect("json");
    let zm = &z["diagnosis"]["memory"];
    assert_eq!(zm["optimizer"].as_u64(), Some(moments.div_ceil(4)));
    assert_eq!(zm["optimizer_ranks"], 4);
    let sharded = zm["total"].as_u64().expect("total");
    assert_eq!(total - sharded, moments - moments.div_ceil(4));
    assert_eq!(
        z["diagnosis"]["reduction"]["gather_bytes"].as_u64(),
        Some(params * 4)
    );
    // ZeRO-2 reduce-scatters the gradients: with the all-gather, the
    // per-link estimate is DDP's; the memory estimate is ZeRO-1's (Burn
    // builds every gradient before the reduction).
    let mut diag2 = diag.clone();
    diag2.push("optimization.zero_stage=2".into());
    let z2: serde_json::Value =
        serde_json::from_str(&run(&diag2).expect_code(0).stdout).expect("json");
    let r2 = &z2["diagnosis"]["reduction"];
    assert_eq!(r2["zero_stage"], 2);
    let ms = |r: &serde_json::Value| -> Vec<f64> {
        r["per_link_ms"]
            .as_array()
            .expect("links")
            .iter()
            .map(|l| l[1].as_f64().expect("ms"))
            .collect()
    };
    for (ddp_ms, zero_ms) in ms(r).iter().zip(ms(r2)) {
        assert!(
            (zero_ms / ddp_ms - 1.0).abs() < 1e-9,
            "{zero_ms} vs {ddp_ms}"
        );
    }
    assert_eq!(z2["diagnosis"]["memory"]["total"].as_u64(), Some(sharded));
    // A machine where all the moments do not fit on each rank, but a
    // quarter does: diagnose says so, and how.
    let mut machine = crate::support::this_machine();
    machine["hardware"]["memory"]["available_bytes"] =
        (((total + sharded) as f64 / 2.0 / 0.9).round() as u64).into();
    let tight = dir.join("tight.json");
    std::fs::write(&tight, machine.to_string()).expect("write");
    let mut on_tight = vec![format!("--hardware-report={}", tight.display())];
    on_tight.extend(diag[..diag.len() - 1].iter().cloned());
    on_tight.retain(|a| a != "--json");
    // (The step does not fit as configured: an error, exit 2.)
    run(&on_tight).expect_code(2).stdout_has(&[
        "warning optimization.zero_stage: each of the 4 ranks would keep all of AdamW's moments",
        "fix: optimization.zero_stage=2",
    ]);
}

#[test]
fn sigterm_to_the_launcher_checkpoints_once_and_stops_every_rank() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let steps = 100_000;
    let job = dir.join("job");
    let launcher = start_until(
        &launch_args(dir, "job", steps, 2, &["training.batch_size=2"]),
        &ckpt(&job, 100),
    );
    signal(launcher.id(), "-TERM");
    let stdout = interrupted_stdout(launcher.wait_with_output().expect("launcher ends"));
    // Rank 0 alone says it, once, and the checkpoint it names exists.
    assert_eq!(
        stdout.matches("interrupted after step").count(),
        1,
        "{stdout}"
    );
    let step: u32 = stdout
        .split("interrupted after step ")
        .nth(1)
        .and_then(|s| s.split(';').next())
        .and_then(|s| s.trim().parse().ok())
        .expect("the step");
    assert!(ckpt(&job, step).exists());
    // The job continues from it.
    resume_job(&job, &format!("training.max_steps={}", step + 10)).expect_code(0);
    assert!(ckpt(&job, step + 10).exists());
}

/// A stop during a job's evaluation cuts it short on every rank at the same
/// batch (the ranks agree on it before each one): the step's checkpoint
/// owes the evaluation, and the job's resume runs it first.
#[test]
fn a_stop_during_a_jobs_evaluation_cuts_it_short_on_every_rank() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let job = dir.join("job");
    // An evaluation after every step, of more batches than a test waits
    // for: the first step's record is written just before it starts.
    let launcher = start_until(
        &launch_args(
            dir,
            "job",
            3,
            2,
            &[
                "training.batch_size=2",
                "eval.eval_steps=1",
                "eval.eval_iters=1000000000",
            ],
        ),
        &job.join("metrics.jsonl"),
    );
    signal(launcher.id(), "-TERM");
    let out = exit_within(launcher, 120, "the job's evaluation of 1e9 batches to end");
    let stdout = interrupted_stdout(out);
    assert_eq!(
        stdout
            .matches(
                "the evaluation after step 1 was cut short by the stop; a resume runs it first"
            )
            .count(),
        1,
        "{stdout}"
    );
    assert_eq!(metadata(&ckpt(&job, 1), "eval_pending"), "true");
    assert_eq!(eval_steps(&job), Vec::<u64>::new());
    resume_job(&job, "eval.eval_iters=2")
        .expect_code(0)
        .stdout_has(&[
            "the evaluation after step 1 was cut short by the stop: it runs now",
            "eval      1:",
        ]);
    assert_eq!(eval_steps(&job), vec![1, 2, 3]);
}

#[test]
fn a_job_on_documents_has_rank_0_prepare_them_and_the_others_read_them() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let docs = crate::store::documents(dir).join("speeches.jsonl");
    let args = launch_of(
        2,
        crate::store::tiny_on(
            dir,
            "job",
            20,
            &docs,
            &[
                "data.tokenizer=gpt2",
                "model.max_length=16",
                "training.batch_size=4",
            ],
        ),
    );
    run(&args)
        .expect_code(0)
        .stdout_has(&["preparing them into the token store", "vocabulary 50257"]);
    let stores = std::fs::read_dir(dir.join("cache"))
        .expect("cache")
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("store-"))
        })
        .count();
    assert_eq!(stores, 1, "one store, written once");
    assert!(ckpt(&dir.join("job"), 20).exists());
}

/// `kiln launch … cv`: the ranks share each fold's batches. Two ranks of 4
/// pairs train every fold as one process of 8 does (to rounding), and rank
/// 0 alone writes; a job stopped in its second fold (a SIGTERM, a rank
/// killed under --max-restarts) resumes there on its two ranks and ends
/// with the uninterrupted job's summary; a resume on another number of
/// ranks is refused.
#[test]
fn a_cross_validation_job_shares_each_folds_batches_and_resumes_on_its_ranks() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // 120 training pairs a fold: 15 whole batches of 8 an epoch.
    let cv = |run: &str, epochs: u32, batch: usize| {
        let mut args = crate::nli::tiny(dir, run, epochs);
        args.extend([
            "model.dropout=0".to_string(),
            "model.attention_dropout=0".into(),
            format!("training.batch_size={batch}"),
        ]);
        args
    };
    let job = |run: &str, epochs: u32| launch_of(2, cv(run, epochs, 4));
    // The same batches, summed in another order: within rounding after 180
    // steps (1.2e-7, measured; these tiny folds drift apart later, 6e-3
    // after 900 steps).
    let epochs = 12;
    run(&cv("one", epochs, 8)).expect_code(0);
    run(&job("two", epochs)).expect_code(0).stdout_has(&[
        "the gradients of the 2 ranks are reduced",
        "accumulation 1 × 2 ranks → 8 pairs per optimizer step; 15 steps per epoch",
        "fold 3 result",
    ]);
    let (one, two) = (dir.join("one"), dir.join("two"));
    let last = epochs * 15;
    // The job's step timed (`kiln launch … bench nli`): both ranks' pairs
    // in each step.
    let mut bench = vec!["bench", "nli", "--json", "--warmup=1", "--steps=3"]
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    bench.extend(
        cv("unused", epochs, 4)
            .into_iter()
            .skip(1)
            .filter(|a| !a.starts_with("run.dir")),
    );
    let out = run(&launch_of(2, bench)).expect_code(0);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("one JSON document");
    let b = &v["bench"];
    assert_eq!(b["world_size"], 2);
    assert!(
        b["collectives"]
            .as_str()
            .is_some_and(|c| c.contains("2 ranks")),
        "{b}"
    );
    let per_step = b["samples_per_s_median"].as_f64().expect("samples/s")
        * b["ms_per_step_median"].as_f64().expect("ms")
        / 1e3;
    assert!((per_step - 8.0).abs() < 0.01, "{per_step} pairs per step");
    // `kiln diagnose --ranks 2` plans the job's steps (the global batch's).
    let planned = crate::train::predicted_steps_with(
        &cv("planned", epochs, 4),
        &["--ranks", "2", "experiment=nli_snli"],
    );
    assert_eq!(planned, u64::from(last));
    assert_eq!(
        crate::train::last_step(&two.join("fold-1/metrics.jsonl")),
        u64::from(last)
    );
    for fold in 1..=3 {
        let at = |run: &Path| ckpt(&run.join(format!("fold-{fold}")), last);
        let diff = max_abs_diff(&at(&one), &at(&two));
        assert!(diff < 1e-5, "fold {fold}: weights differ by {diff}");
    }
    let (a, b) = (crate::nli::summary(&one), crate::nli::summary(&two));
    for (x, y) in a["folds"]
        .as_array()
        .into_iter()
        .flatten()
        .zip(b["folds"].as_array().into_iter().flatten())
    {
        let loss = |f: &serde_json::Value| f["val_loss"].as_f64().expect("val_loss");
        assert!((loss(x) - loss(y)).abs() < 1e-5, "{x} against {y}");
        assert_eq!(x["world_size"], 1);
        assert_eq!(y["world_size"], 2);
    }
    // Rank 0 alone wrote: nothing besides the named runs.
    let mut entries: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(entries, ["one", "pairs.jsonl", "two"]);

    // Stopped in its second fold, as a scheduler's SIGTERM stops it, and
    // resumed: the job it would have been, bit for bit. The folds are
    // longer, so that the stop comes before the fold ends.
    let epochs = 60;
    run(&job("whole", epochs)).expect_code(0);
    let stopped = dir.join("stopped");
    let launcher = start_until(&job("stopped", epochs), &ckpt(&stopped.join("fold-2"), 20));
    signal(launcher.id(), "-TERM");
    let stdout = interrupted_stdout(launcher.wait_with_output().expect("launcher ends"));
    assert_eq!(
        stdout.matches("interrupted after step").count(),
        1,
        "{stdout}"
    );
    assert!(
        !stopped.join("fold-2/result.json").exists(),
        "fold 2 finished before the stop: make it longer"
    );
    let stopped_arg = stopped.to_str().expect("utf-8");
    kiln(&["resume", stopped_arg])
        .run()
        .expect_code(2)
        .stderr_has(&[
            "fold 1 of the cross-validation trained on 2 ranks",
            &format!("kiln launch --nproc-per-node 2 resume {stopped_arg}"),
        ]);
    // Nor on three: the launcher's last line does not offer that resume.
    let three = run(&launch_of(3, ["resume".into(), stopped_arg.into()])).expect_code(2);
    three.stderr_has(&["fold 1 of the cross-validation trained on 2 ranks"]);
    assert!(
        !three.stderr.contains("--nproc-per-node 3 resume"),
        "{}",
        three.stderr
    );
    // Resumed as torchrun's --max-restarts starts it again: the same
    // `kiln cv`, its attempt counted (`kiln launch … resume RUN` by hand).
    let again = job("stopped", epochs);
    let again: Vec<&str> = again.iter().map(String::as_str).collect();
    kiln(&again)
        .env("TORCHELASTIC_MAX_RESTARTS", "3")
        .env("TORCHELASTIC_RESTART_COUNT", "1")
        .run()
        .expect_code(0)
        .stdout_has(&["fold 1/3: done before, kept", "fold 2: resuming from step"])
        .stderr_has(&["torchrun's restart 1 of 3: resuming"]);
    let whole = crate::nli::summary(&dir.join("whole"));
    assert_eq!(crate::nli::summary(&stopped), whole);
    // A rank killed in fold 2 under --max-restarts: every rank resumes
    // there, the finished fold kept.
    let restarted = dir.join("restarted");
    let mut args = job("restarted", epochs);
    args.splice(1..1, ["--max-restarts".to_string(), "1".into()]);
    let launcher = start_until(&args, &ckpt(&restarted.join("fold-2"), 20));
    signal(rank_pid(launcher.id(), 1).expect("rank 1 runs"), "-KILL");
    let out = launcher.wait_with_output().expect("launcher ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("restart 1 of 1: every rank resumes")
            && stderr.contains("from fold 2's checkpoint of step"),
        "{stderr}"
    );
    assert_eq!(crate::nli::summary(&restarted), whole);
}
