//! Sentence-pair classification (NLI) with grouped, stratified k-fold
//! cross-validation, on the shared loop. Each fold has its own folder
//! (`fold-<k>/`: tokenizer trained on that fold's training pairs only,
//! metrics, checkpoints, the best model and `result.json`); the run folder
//! holds the fold assignment, `cv_summary.json` and the plots. A stopped CV
//! run resumes in the fold, at the step, where it stopped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_config::{BadRowsMode, PairsFormat, Pooling, RunConfig};
use kiln_data::{
    BadRows, EncodedPair, PairBatch, PairBatches, PairDataset, PairFormat, PairSchema, Tokenizer,
    encode_dataset, grouped_stratified_folds, pad_batch, read_pairs,
};
use kiln_model::{EncoderClassifier, EncoderConfig, GeluKind, PoolingKind};
use serde::{Deserialize, Serialize};

use crate::checkpoint;
use crate::lm::{device_lines, mfu_peak, schedule_line};
use crate::optim::AdamW;
use crate::report::{Event, Observer, median};
use crate::trainer::{
    BEST_MODEL, Evaluation, LoopEnd, LoopPlan, LoopPlanStart, Task, Work, best_from_metrics,
    init_model, kernels, restore, run_loop, train_device,
};
use crate::{DeviceChoice, Outcome, RunDir, TrainError, TrainOptions, open_device, select_device};

/// Precision, recall and F1 of one class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassMetrics {
    pub label: String,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: usize,
}

/// Classification quality of predictions against labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scores {
    pub accuracy: f64,
    pub macro_f1: f64,
    pub per_class: Vec<ClassMetrics>,
    /// `confusion[true][predicted]`.
    pub confusion: Vec<Vec<usize>>,
}

impl Scores {
    pub fn new(labels: &[String], truth: &[usize], predicted: &[usize]) -> Self {
        let n = labels.len();
        let mut confusion = vec![vec![0usize; n]; n];
        for (&t, &p) in truth.iter().zip(predicted) {
            confusion[t][p] += 1;
        }
        let correct: usize = (0..n).map(|i| confusion[i][i]).sum();
        let per_class: Vec<ClassMetrics> = (0..n)
            .map(|c| {
                let tp = confusion[c][c] as f64;
                let predicted_c: usize = (0..n).map(|t| confusion[t][c]).sum();
                let support: usize = confusion[c].iter().sum();
                let precision = if predicted_c > 0 {
                    tp / predicted_c as f64
                } else {
                    0.0
                };
                let recall = if support > 0 {
                    tp / support as f64
                } else {
                    0.0
                };
                let f1 = if precision + recall > 0.0 {
                    2.0 * precision * recall / (precision + recall)
                } else {
                    0.0
                };
                ClassMetrics {
                    label: labels[c].clone(),
                    precision,
                    recall,
                    f1,
                    support,
                }
            })
            .collect();
        Self {
            accuracy: correct as f64 / truth.len().max(1) as f64,
            macro_f1: per_class.iter().map(|c| c.f1).sum::<f64>() / n.max(1) as f64,
            per_class,
            confusion,
        }
    }
}

/// One fold's outcome: the scores of its best evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FoldResult {
    pub fold: usize,
    pub train_pairs: usize,
    pub held_out_pairs: usize,
    pub best_step: u64,
    pub stopped_early: bool,
    pub val_loss: f64,
    pub scores: Scores,
    /// Accuracy of always predicting the training part's most common label.
    pub majority_baseline: f64,
    pub median_samples_per_s: f64,
}

/// The cross-validation summary (`cv_summary.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CvSummary {
    pub folds: Vec<FoldResult>,
    pub accuracy_mean: f64,
    pub accuracy_std: f64,
    pub macro_f1_mean: f64,
    pub macro_f1_std: f64,
    pub majority_baseline_mean: f64,
    pub labels: Vec<String>,
    pub pairs: usize,
    pub skipped_rows: usize,
    pub median_samples_per_s: f64,
    pub wall_s: f64,
}

fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

/// The pair schema of a configuration.
pub(crate) fn schema(config: &RunConfig, require_label: bool) -> PairSchema {
    let d = &config.data;
    PairSchema {
        premise: d.premise_field.clone(),
        hypothesis: d.hypothesis_field.clone(),
        label: d.label_field.clone(),
        labels: d.labels.clone(),
        bad_rows: match d.bad_rows {
            BadRowsMode::Skip => BadRows::Skip,
            BadRowsMode::Error => BadRows::Error,
        },
        format: match d.format {
            PairsFormat::Auto => PairFormat::Auto,
            PairsFormat::Jsonl => PairFormat::Jsonl,
            PairsFormat::Tsv => PairFormat::Tsv,
            PairsFormat::Csv => PairFormat::Csv,
        },
        require_label,
    }
}

pub(crate) fn encoder_config(config: &RunConfig, vocab_size: usize) -> EncoderConfig {
    let m = &config.model;
    EncoderConfig {
        vocab_size,
        max_positions: m.max_length,
        layers: m.layers,
        heads: m.heads,
        hidden: m.hidden,
        intermediate: m.intermediate,
        dropout: m.dropout,
        classes: config.data.labels.len(),
        pooling: match m.pooling {
            Pooling::Cls => PoolingKind::Cls,
            Pooling::Mean => PoolingKind::Mean,
        },
        gelu: match m.gelu {
            kiln_config::Gelu::Exact => GeluKind::Exact,
            kiln_config::Gelu::Tanh => GeluKind::Tanh,
        },
    }
}

/// Tensors of a pair batch on `device`.
pub(crate) fn pair_tensors(
    b: &PairBatch,
    device: &Device,
) -> (
    Tensor<2, Int>,
    Tensor<2, Int>,
    Tensor<2, Bool>,
    Tensor<1, Int>,
) {
    let shape = [b.batch_size, b.seq_len];
    let int = |v: &[u32]| {
        Tensor::<2, Int>::from_data(
            TensorData::new(v.iter().map(|&x| i64::from(x)).collect::<Vec<_>>(), shape),
            device,
        )
    };
    let mask = Tensor::<2, Bool>::from_data(TensorData::new(b.mask.clone(), shape), device);
    let labels = Tensor::<1, Int>::from_data(
        TensorData::new(
            b.labels.iter().map(|&l| l as i64).collect::<Vec<_>>(),
            [b.batch_size],
        ),
        device,
    );
    (int(&b.ids), int(&b.segments), mask, labels)
}

/// The NLI workload of one fold.
struct NliTask {
    train: Arc<PairBatches>,
    held_out: Vec<PairBatch>,
    labels: Vec<String>,
    encoder: EncoderConfig,
    frozen: bool,
    inner: Device,
}

impl NliTask {
    /// Predicted class of every held-out pair, and the mean loss.
    fn predict(&self, model: &EncoderClassifier) -> (Vec<usize>, Vec<usize>, f64) {
        let model = model.valid();
        let mut truth = Vec::new();
        let mut predicted = Vec::new();
        let mut loss_sum = 0.0;
        for b in &self.held_out {
            let (ids, seg, mask, labels) = pair_tensors(b, &self.inner);
            let logits = model.forward(ids.clone(), seg.clone(), mask.clone());
            let loss: f32 = model.loss(ids, seg, mask, labels).into_scalar();
            loss_sum += f64::from(loss) * b.batch_size as f64;
            let arg: Vec<i64> = logits.argmax(1).into_data().iter::<i64>().collect();
            predicted.extend(arg.iter().map(|&a| a as usize));
            truth.extend(b.labels.iter().copied());
        }
        let n = truth.len().max(1) as f64;
        (truth, predicted, loss_sum / n)
    }
}

impl Task for NliTask {
    type Model = EncoderClassifier;
    type Source = PairBatches;

    fn source(&self) -> Arc<PairBatches> {
        Arc::clone(&self.train)
    }

    fn loss(&self, model: &EncoderClassifier, batch: &PairBatch, device: &Device) -> Tensor<1> {
        let (ids, seg, mask, labels) = pair_tensors(batch, device);
        model.loss(ids, seg, mask, labels)
    }

    fn work(&self, batch: &PairBatch) -> Work {
        Work {
            samples: batch.batch_size,
            tokens: batch.real_tokens,
            flops: batch.batch_size as f64
                * self.encoder.flops_per_sequence(batch.seq_len, self.frozen),
        }
    }

    fn evaluate(&self, model: &EncoderClassifier, _step: u64) -> Evaluation {
        let (truth, predicted, val_loss) = self.predict(model);
        let scores = Scores::new(&self.labels, &truth, &predicted);
        Evaluation {
            line: format!(
                "val loss {val_loss:.4}, accuracy {:.1}%, macro-F1 {:.3}",
                100.0 * scores.accuracy,
                scores.macro_f1
            ),
            score: Some(scores.macro_f1),
            record: serde_json::json!({ "val_loss": val_loss, "scores": scores }),
        }
    }
}

/// Trains the NLI workload of `config` with k-fold cross-validation in a new run directory.
pub fn train_cv(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let device = open_device(config, !options.hardware.gpus().is_empty())?;
    let data = read_pairs(Path::new(&config.data.path), &schema(config, true))?;
    if !config.data.tokenizer_file.is_empty() {
        Tokenizer::load(Path::new(&config.data.tokenizer_file))?;
    }
    let run = RunDir::start(config, options)?;
    run_cv(config, &run, &device, data, options, observer)
}

/// Continues a CV run: finished folds are kept, the stopped one resumes from
/// its newest good checkpoint.
pub(crate) fn resume_cv(
    config: &RunConfig,
    run: &RunDir,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let device = open_device(config, !options.hardware.gpus().is_empty())?;
    let data = read_pairs(Path::new(&config.data.path), &schema(config, true))?;
    run_cv(config, run, &device, data, options, observer)
}

fn run_cv(
    config: &RunConfig,
    run: &RunDir,
    device: &DeviceChoice,
    data: PairDataset,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let k = config.cv.folds;
    let premises: Vec<&str> = data.pairs.iter().map(|p| p.premise.as_str()).collect();
    let labels: Vec<usize> = data.pairs.iter().map(|p| p.label.unwrap_or(0)).collect();
    let folds = grouped_stratified_folds(
        &premises,
        &labels,
        data.labels.len(),
        k,
        config.training.seed,
    );
    let assignment: Vec<serde_json::Value> = data
        .pairs
        .iter()
        .zip(&folds)
        .map(|(p, f)| serde_json::json!({ "line": p.line, "fold": f + 1 }))
        .collect();
    run.write(
        "folds.json",
        &serde_json::to_string(&assignment).unwrap_or_default(),
    )?;
    let mut notes = vec![format!(
        "data: {} — {} pairs, labels {} ({})",
        data.path.display(),
        data.pairs.len(),
        data.labels.join(" / "),
        data.label_counts()
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" / ")
    )];
    if let Some(skipped) = data.skipped_report() {
        notes.push(skipped);
    }
    notes.push(format!(
        "cross-validation: {k} folds, grouped by premise (no premise in two folds), stratified by label"
    ));
    for n in notes {
        observer.event(&Event::Note(n));
    }
    let mut results = Vec::new();
    for fold in 0..k {
        let dir = RunDir {
            path: run.path.join(format!("fold-{}", fold + 1)),
        };
        let result_path = dir.file("result.json");
        if let Ok(text) = std::fs::read_to_string(&result_path)
            && let Ok(result) = serde_json::from_str::<FoldResult>(&text)
        {
            observer.event(&Event::Note(format!(
                "fold {}/{k}: done before, kept",
                fold + 1
            )));
            results.push(result);
            continue;
        }
        std::fs::create_dir_all(dir.checkpoints()).map_err(|source| TrainError::Write {
            path: dir.path.clone(),
            source,
        })?;
        match train_fold(config, &dir, device, &data, &folds, fold, options, observer)? {
            FoldEnd::Done(result) => {
                dir.write(
                    "result.json",
                    &serde_json::to_string_pretty(&result).unwrap_or_default(),
                )?;
                observer.event(&Event::Report(fold_lines(&result)));
                results.push(*result);
            }
            FoldEnd::Interrupted { step, checkpoint } => {
                return Ok(Outcome::Interrupted {
                    run: run.path.clone(),
                    step,
                    checkpoint,
                });
            }
        }
    }
    let accuracies: Vec<f64> = results.iter().map(|r| r.scores.accuracy).collect();
    let f1s: Vec<f64> = results.iter().map(|r| r.scores.macro_f1).collect();
    let (accuracy_mean, accuracy_std) = mean_std(&accuracies);
    let (macro_f1_mean, macro_f1_std) = mean_std(&f1s);
    let mut speeds: Vec<f64> = results.iter().map(|r| r.median_samples_per_s).collect();
    let summary = CvSummary {
        majority_baseline_mean: mean_std(
            &results
                .iter()
                .map(|r| r.majority_baseline)
                .collect::<Vec<_>>(),
        )
        .0,
        folds: results,
        accuracy_mean,
        accuracy_std,
        macro_f1_mean,
        macro_f1_std,
        labels: data.labels.clone(),
        pairs: data.pairs.len(),
        skipped_rows: data.skipped.len(),
        median_samples_per_s: median(&mut speeds),
        wall_s: started.elapsed().as_secs_f64(),
    };
    run.write(
        "cv_summary.json",
        &serde_json::to_string_pretty(&summary).unwrap_or_default(),
    )?;
    let _ = crate::report::write_cv_plots(&run.path, &summary);
    observer.event(&Event::Report(summary_lines(&summary)));
    Ok(Outcome::CvFinished {
        run: run.path.clone(),
        summary,
    })
}

enum FoldEnd {
    Done(Box<FoldResult>),
    Interrupted { step: u64, checkpoint: PathBuf },
}

#[allow(
    clippy::too_many_arguments,
    reason = "one fold's inputs, each distinct"
)]
fn train_fold(
    config: &RunConfig,
    dir: &RunDir,
    device: &DeviceChoice,
    data: &PairDataset,
    folds: &[usize],
    fold: usize,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<FoldEnd, TrainError> {
    let t = &config.training;
    let max_len = config.model.max_length;
    let (train_idx, held_idx): (Vec<usize>, Vec<usize>) =
        (0..data.pairs.len()).partition(|&i| folds[i] != fold);
    // The tokenizer learns from this fold's training pairs only.
    let tok_path = dir.file("tokenizer.json");
    let tokenizer = if tok_path.is_file() {
        let mut t = Tokenizer::load(&tok_path)?;
        t.set_pair_template(max_len)?;
        t
    } else {
        let mut tokenizer = if config.data.tokenizer_file.is_empty() {
            let texts = train_idx.iter().flat_map(|&i| {
                [
                    data.pairs[i].premise.as_str(),
                    data.pairs[i].hypothesis.as_str(),
                ]
            });
            Tokenizer::wordpiece(texts, config.data.vocab_size, max_len)?
        } else {
            Tokenizer::load(Path::new(&config.data.tokenizer_file))?
        };
        tokenizer.set_pair_template(max_len)?;
        tokenizer.save(&tok_path)?;
        tokenizer
    };
    let encoded = encode_dataset(&tokenizer, data)?;
    let train_set: Arc<[EncodedPair]> = train_idx.iter().map(|&i| encoded[i].clone()).collect();
    let held: Vec<&EncodedPair> = held_idx.iter().map(|&i| &encoded[i]).collect();
    let held_out: Vec<PairBatch> = held
        .chunks(config.eval.batch_size)
        .zip(0u64..)
        .map(|(chunk, i)| pad_batch(i, chunk))
        .collect();
    let seed = t.seed.wrapping_add(fold as u64);
    let source = Arc::new(PairBatches::new(
        train_set,
        t.batch_size,
        seed,
        config.loader.bucket_by_length,
    ));
    let batches_per_epoch = source.batches_per_epoch();
    let steps_per_epoch = (batches_per_epoch / t.gradient_accumulation_steps as u64).max(1);
    let total_steps = if t.max_steps > 0 {
        t.max_steps as u64
    } else {
        steps_per_epoch * t.epochs as u64
    };
    let encoder = encoder_config(config, tokenizer.vocab_size());
    let train_device = train_device(config, &device.device, seed);
    let precision = crate::lm::run_precision(config, device, &options.hardware);
    let mut model = init_model(config, &train_device, device.is_gpu, seed, |d| {
        encoder.init(d)
    });
    if config.model.freeze_encoder {
        model = model.freeze_encoder();
    }
    let mut optim = AdamW::for_training(t);
    let mut start = LoopPlanStart {
        first_step: 1,
        ..LoopPlanStart::default()
    };
    match checkpoint::latest_good(&dir.checkpoints()) {
        Ok((info, state, notes)) => {
            for n in notes {
                observer.event(&Event::Note(n));
            }
            observer.event(&Event::Note(format!(
                "fold {}: resuming from step {}",
                fold + 1,
                info.step
            )));
            dir.truncate_metrics_after(info.step)?;
            (model, start) = restore(
                model,
                &mut optim,
                state,
                &info.path,
                &train_device,
                &device.device,
            )?;
        }
        Err(_) => dir.truncate_metrics_after(0)?,
    }
    let model = model
        .with_compute(precision.compute)
        .with_kernels(kernels(config));
    let (best, since_best) = best_from_metrics(&dir.metrics());
    let majority = {
        let mut counts = vec![0usize; data.labels.len()];
        for &i in &train_idx {
            counts[encoded[i].label] += 1;
        }
        let top = (0..counts.len()).max_by_key(|&c| counts[c]).unwrap_or(0);
        held.iter().filter(|p| p.label == top).count() as f64 / held.len().max(1) as f64
    };
    let (peak, peak_name) = mfu_peak(device, &precision, &options.hardware);
    let mut lines = vec![
        format!(
            "fold {}/{}: {} training pairs, {} held out; WordPiece vocabulary {} (trained on this fold's training pairs)",
            fold + 1,
            config.cv.folds,
            train_idx.len(),
            held_idx.len(),
            tokenizer.vocab_size()
        ),
        format!(
            "model: encoder, {} layers × {} heads × {} wide, max length {}, {:.2} M parameters{}",
            encoder.layers,
            encoder.heads,
            encoder.hidden,
            max_len,
            encoder.num_params() as f64 / 1e6,
            if config.model.freeze_encoder {
                ", encoder frozen (only the head trains)"
            } else {
                ""
            }
        ),
    ];
    lines.extend(device_lines(
        config, device, &precision, options, &peak_name,
    ));
    lines.push(format!(
        "batch: {} pairs padded per batch{}, accumulation {} → {} pairs per optimizer step; {steps_per_epoch} steps per epoch",
        t.batch_size,
        if config.loader.bucket_by_length { ", bucketed by length" } else { "" },
        t.gradient_accumulation_steps,
        config.effective_batch()
    ));
    lines.push(schedule_line(config, total_steps));
    observer.event(&Event::Start {
        lines,
        first_step: start.first_step,
        total_steps,
    });
    let task = NliTask {
        train: source,
        held_out,
        labels: data.labels.clone(),
        encoder,
        frozen: config.model.freeze_encoder,
        inner: device.device.clone(),
    };
    let mut plan = LoopPlan {
        first_step: start.first_step,
        total_steps,
        loader_start: start.loader_start,
        tokens_seen: start.tokens_seen,
        wall_before: start.wall_before,
        eval_every_epoch: Some(steps_per_epoch),
        patience: (config.cv.patience > 0).then_some(config.cv.patience),
        best,
        since_best,
        peak_flops: peak,
        scaler: start.scaler(precision.loss_scaling(), config),
    };
    let (_model, end) = run_loop(
        &task,
        model,
        &mut optim,
        &train_device,
        config,
        &mut plan,
        dir,
        options,
        observer,
    )?;
    let stopped_early = match end {
        LoopEnd::Interrupted { step, checkpoint } => {
            return Ok(FoldEnd::Interrupted { step, checkpoint });
        }
        LoopEnd::EarlyStopped => true,
        LoopEnd::Finished => false,
    };
    let metrics = dir.metrics();
    let best_eval = metrics
        .iter()
        .filter(|m| m["kind"] == "eval")
        .fold(None::<&serde_json::Value>, |best, m| match best {
            Some(b) if b["score"].as_f64() >= m["score"].as_f64() => Some(b),
            _ => Some(m),
        })
        .ok_or_else(|| {
            TrainError::Unsupported(
                "a fold without an evaluation",
                "raise training.epochs".into(),
            )
        })?;
    let mut speeds: Vec<f64> = metrics
        .iter()
        .filter(|m| m["kind"] == "step")
        .filter_map(|m| m["samples_per_s"].as_f64())
        .collect();
    let scores: Scores =
        serde_json::from_value(best_eval["scores"].clone()).map_err(|e| TrainError::NotARun {
            path: dir.path.clone(),
            why: format!("unreadable evaluation record: {e}"),
        })?;
    Ok(FoldEnd::Done(Box::new(FoldResult {
        fold: fold + 1,
        train_pairs: train_idx.len(),
        held_out_pairs: held_idx.len(),
        best_step: best_eval["step"].as_u64().unwrap_or(0),
        stopped_early,
        val_loss: best_eval["val_loss"].as_f64().unwrap_or(f64::NAN),
        scores,
        majority_baseline: majority,
        median_samples_per_s: median(&mut speeds),
    })))
}

fn fold_lines(r: &FoldResult) -> Vec<String> {
    let mut lines = vec![format!(
        "fold {} result (best at step {}{}): accuracy {:.1}%, macro-F1 {:.3}, val loss {:.4}; majority baseline {:.1}%",
        r.fold,
        r.best_step,
        if r.stopped_early {
            ", stopped early"
        } else {
            ""
        },
        100.0 * r.scores.accuracy,
        r.scores.macro_f1,
        r.val_loss,
        100.0 * r.majority_baseline
    )];
    for c in &r.scores.per_class {
        lines.push(format!(
            "  {:<14} precision {:.3}  recall {:.3}  F1 {:.3}  ({} pairs)",
            c.label, c.precision, c.recall, c.f1, c.support
        ));
    }
    lines
}

/// The per-fold table and the mean ± std.
pub(crate) fn summary_lines(s: &CvSummary) -> Vec<String> {
    let mut lines = vec![
        format!(
            "cross-validation over {} pairs ({} rows skipped):",
            s.pairs, s.skipped_rows
        ),
        "  fold | accuracy | macro-F1 | majority baseline | best step".to_string(),
    ];
    for f in &s.folds {
        lines.push(format!(
            "  {:>4} | {:>7.1}% | {:>8.3} | {:>16.1}% | {:>9}",
            f.fold,
            100.0 * f.scores.accuracy,
            f.scores.macro_f1,
            100.0 * f.majority_baseline,
            f.best_step
        ));
    }
    lines.push(format!(
        "  mean | {:.1}% ± {:.1} | {:.3} ± {:.3} | {:.1}%",
        100.0 * s.accuracy_mean,
        100.0 * s.accuracy_std,
        s.macro_f1_mean,
        s.macro_f1_std,
        100.0 * s.majority_baseline_mean
    ));
    lines.push(format!(
        "throughput: median {:.1} pairs/s; wall time {:.0} s",
        s.median_samples_per_s, s.wall_s
    ));
    lines
}

/// What `predict` wrote and, where the file has labels, how good it was.
#[derive(Clone, Debug)]
pub struct Prediction {
    pub output: PathBuf,
    pub rows: usize,
    pub fold: usize,
    pub scores: Option<Scores>,
    pub skipped: Option<String>,
}

/// Predicts a pairs file with the best fold's model and tokenizer of a CV
/// run, writing one JSON line per input row to `output`.
pub fn predict(
    run_dir: &Path,
    data_path: &Path,
    output: Option<&Path>,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Prediction, TrainError> {
    let run = RunDir::open(run_dir)?;
    let config = kiln_config::read_run_config(&run.file("config.toml"))?;
    let summary: CvSummary = std::fs::read_to_string(run.file("cv_summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| TrainError::NotARun {
            path: run.path.clone(),
            why: "it has no cv_summary.json: only a finished cross-validation run can predict"
                .into(),
        })?;
    let best = summary
        .folds
        .iter()
        .max_by(|a, b| a.scores.macro_f1.total_cmp(&b.scores.macro_f1))
        .ok_or_else(|| TrainError::NotARun {
            path: run.path.clone(),
            why: "cv_summary.json lists no fold".into(),
        })?;
    let fold_dir = run.path.join(format!("fold-{}", best.fold));
    let mut tokenizer = Tokenizer::load(&fold_dir.join("tokenizer.json"))?;
    tokenizer.set_pair_template(config.model.max_length)?;
    let data = read_pairs(data_path, &schema(&config, false))?;
    let device = select_device(&config.device, !hardware.gpus().is_empty())?;
    let encoder = encoder_config(&config, tokenizer.vocab_size());
    let model_path = fold_dir.join(BEST_MODEL);
    let state = checkpoint::load(&model_path).map_err(|why| TrainError::CheckpointMismatch {
        path: model_path.clone(),
        why,
    })?;
    let values = state
        .params
        .into_iter()
        .map(|(p, s, v)| (p, (s, v)))
        .collect();
    let model = crate::params::load_values(encoder.init(&device.device), values, &device.device)
        .map_err(|why| TrainError::CheckpointMismatch {
            path: model_path.clone(),
            why,
        })?;
    let encoded = encode_dataset(&tokenizer, &data)?;
    let refs: Vec<&EncodedPair> = encoded.iter().collect();
    let mut lines = String::new();
    let mut predicted = Vec::new();
    for (chunk, i) in refs.chunks(config.eval.batch_size).zip(0u64..) {
        let b = pad_batch(i, chunk);
        let (ids, seg, mask, _) = pair_tensors(&b, &device.device);
        let probs = burn::tensor::activation::softmax(model.forward(ids, seg, mask), 1);
        let probs: Vec<f32> = probs.into_data().iter::<f32>().collect();
        for row in probs.chunks(config.data.labels.len()) {
            let best = (0..row.len())
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0);
            predicted.push(best);
        }
        let start = predicted.len() - b.batch_size;
        for (k, row) in probs.chunks(config.data.labels.len()).enumerate() {
            let pair = &data.pairs[start + k];
            let probabilities: serde_json::Map<String, serde_json::Value> = config
                .data
                .labels
                .iter()
                .zip(row)
                .map(|(l, p)| (l.clone(), serde_json::Value::from(f64::from(*p))))
                .collect();
            lines.push_str(
                &serde_json::json!({
                    "line": pair.line,
                    "prediction": config.data.labels[predicted[start + k]],
                    "probabilities": probabilities,
                })
                .to_string(),
            );
            lines.push('\n');
        }
    }
    let output = output.map_or_else(
        || {
            let stem = data_path
                .file_stem()
                .map_or("data".into(), |s| s.to_string_lossy().into_owned());
            run.file(&format!("predictions-{stem}.jsonl"))
        },
        Path::to_path_buf,
    );
    std::fs::write(&output, lines).map_err(|source| TrainError::Write {
        path: output.clone(),
        source,
    })?;
    let labelled: Vec<(usize, usize)> = data
        .pairs
        .iter()
        .zip(&predicted)
        .filter_map(|(p, &pred)| p.label.map(|l| (l, pred)))
        .collect();
    let scores = (!labelled.is_empty()).then(|| {
        let (truth, pred): (Vec<usize>, Vec<usize>) = labelled.into_iter().unzip();
        Scores::new(&config.data.labels, &truth, &pred)
    });
    Ok(Prediction {
        output,
        rows: data.pairs.len(),
        fold: best.fold,
        scores,
        skipped: data.skipped_report(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_by_hand() {
        let labels: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        // truth: a a b b c c; predicted: a b b b c a
        let s = Scores::new(&labels, &[0, 0, 1, 1, 2, 2], &[0, 1, 1, 1, 2, 0]);
        assert!((s.accuracy - 4.0 / 6.0).abs() < 1e-12);
        assert_eq!(
            s.confusion,
            vec![vec![1, 1, 0], vec![0, 2, 0], vec![1, 0, 1]]
        );
        // a: P 1/2, R 1/2, F1 1/2; b: P 2/3, R 1, F1 0.8; c: P 1, R 1/2, F1 2/3.
        assert!((s.per_class[1].f1 - 0.8).abs() < 1e-12);
        assert!((s.macro_f1 - (0.5 + 0.8 + 2.0 / 3.0) / 3.0).abs() < 1e-12);
    }

    #[test]
    fn mean_and_sample_std() {
        let (m, s) = mean_std(&[1.0, 2.0, 3.0]);
        assert!((m - 2.0).abs() < 1e-12 && (s - 1.0).abs() < 1e-12);
    }
}
