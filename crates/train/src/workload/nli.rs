//! Sentence-pair classification (NLI) with grouped, stratified k-fold
//! cross-validation, on the shared step and loop. Each fold has its own
//! folder (`fold-<k>/`: tokenizer trained on that fold's training pairs
//! only, metrics, checkpoints, the best model and `result.json`); the run
//! folder holds the fold assignment, `cv_summary.json` and the plots. A
//! stopped CV run resumes in the fold, at the step, where it stopped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_config::{ResumedConfig, RunConfig};
use kiln_data::{
    EncodedPair, PairBatch, PairBatches, PairDataset, Tokenizer, encode_dataset,
    grouped_stratified_folds, pad_batch, read_pairs,
};
use kiln_model::{EncoderClassifier, EncoderConfig};
use kiln_plan::{ModelSize, Schedule};

use crate::checkpoint;
use crate::optim::AdamW;
use crate::records::{CvSummary, EvalMetrics, FoldResult, Record, Scores, mean_std};
use crate::report::{Event, Observer, median};
use crate::setup::{
    device_lines, init_model, mfu_peak, run_precision, schedule_line, schedule_warnings,
    train_device,
};
use crate::task::{Evaluation, StopAsked, Task, Work, evaluate_shared};
use crate::trainer::{EarlyStopping, LoopEnd, LoopPlan, LoopPlanStart, restore, run_loop};
use crate::translate::{encoder_config, kernels, schema};
use crate::workload::lm;
use crate::{DeviceChoice, Outcome, RunDir, TrainError, TrainOptions, open_device, select_device};

/// The pairs of an NLI run and their fold assignment, read once per run.
pub(crate) struct Pairs {
    pub(crate) data: PairDataset,
    /// The fold (0-based) of each pair.
    pub(crate) folds: Vec<usize>,
}

/// Reads `data.path` as the config says and assigns the folds: grouped by
/// premise (no premise in two folds), stratified by label.
pub(crate) fn read(config: &RunConfig) -> Result<Pairs, TrainError> {
    let data = read_pairs(Path::new(&config.data.path), &schema(config, true))
        .map_err(|e| crate::translate::with_config_keys(e, config))?;
    if let Some(file) = &config.data.tokenizer_file {
        Tokenizer::load(Path::new(file))?;
    }
    let premises: Vec<&str> = data.pairs.iter().map(|p| p.premise.as_str()).collect();
    let labels: Vec<usize> = data.pairs.iter().map(|p| p.label.unwrap_or(0)).collect();
    let folds = grouped_stratified_folds(
        &premises,
        &labels,
        data.labels.len(),
        config.cv.folds,
        config.training.seed,
    );
    check_folds(&data.path, &premises, &folds, config.cv.folds)?;
    Ok(Pairs { data, folds })
}

/// Every fold holds a pair (and so every fold's training part does): a
/// fold of none trained on an empty batch and panicked. Folds are grouped
/// by premise, so `k` folds need `k` premises at least.
fn check_folds(
    path: &Path,
    premises: &[&str],
    folds: &[usize],
    k: usize,
) -> Result<(), TrainError> {
    let mut sizes = vec![0usize; k];
    for &f in folds {
        sizes[f] += 1;
    }
    let Some(empty) = sizes.iter().position(|&n| n == 0) else {
        return Ok(());
    };
    let distinct = premises
        .iter()
        .collect::<std::collections::HashSet<_>>()
        .len();
    Err(TrainError::CorpusTooShort {
        path: path.to_path_buf(),
        why: format!(
            "{} under {}, but {k} folds grouped by premise need {k} premises at least (fold {} would hold no pair)",
            kiln_plan::counted(premises.len(), "usable pair"),
            kiln_plan::counted(distinct, "premise"),
            empty + 1
        ),
        remedy: if distinct >= 2 {
            format!("use more pairs, or cv.folds={}", distinct.min(k - 1))
        } else {
            "use more pairs: cross-validation needs 2 premises at least".into()
        },
    })
}

/// One fold's workload, prepared: what the fold's training, `kiln bench
/// nli` and `kiln diagnose` (both on the first fold) start from.
pub(crate) struct Prepared {
    pub(crate) tokenizer: Tokenizer,
    pub(crate) train_pairs: usize,
    pub(crate) held_out_pairs: usize,
    pub(crate) train: Arc<PairBatches>,
    pub(crate) held_out: Vec<PairBatch>,
    pub(crate) encoder: EncoderConfig,
    pub(crate) schedule: Schedule,
    /// The fold's seed: the run's, plus the fold.
    pub(crate) seed: u64,
    /// Accuracy of always predicting the training part's most common label.
    pub(crate) majority_baseline: f64,
    /// Mean pair length in tokens over the training pairs.
    pub(crate) mean_length: f64,
}

/// Prepares fold `fold` (0-based) of `pairs`: the tokenizer learns from the
/// fold's training pairs only (or is `data.tokenizer_file`, or the BERT
/// folder's of `model.init_from`); with `tokenizer_at`, a tokenizer saved
/// there is used, and a new one saved. `share` is (rank, world) of a
/// data-parallel job, (0, 1) alone: its training batches are the rank's
/// share of `training.batch_size × world` pairs.
pub(crate) fn prepare(
    config: &RunConfig,
    pairs: &Pairs,
    fold: usize,
    tokenizer_at: Option<&Path>,
    (rank, world): (usize, usize),
) -> Result<Prepared, TrainError> {
    let data = &pairs.data;
    let t = &config.training;
    let max_len = config.model.max_length;
    let (train_idx, held_idx): (Vec<usize>, Vec<usize>) =
        (0..data.pairs.len()).partition(|&i| pairs.folds[i] != fold);
    let tokenizer = match tokenizer_at.filter(|p| p.is_file()) {
        Some(path) => {
            let mut t = Tokenizer::load(path)?;
            t.set_pair_template(max_len)?;
            t
        }
        None => {
            let mut tokenizer = if let Some(bert) = crate::pretrained::bert::open(config)? {
                bert.tokenizer
            } else if let Some(file) = &config.data.tokenizer_file {
                Tokenizer::load(Path::new(file))?
            } else {
                let texts = train_idx.iter().flat_map(|&i| {
                    [
                        data.pairs[i].premise.as_str(),
                        data.pairs[i].hypothesis.as_str(),
                    ]
                });
                Tokenizer::wordpiece(texts, config.data.vocab_size, max_len)?
            };
            tokenizer.set_pair_template(max_len)?;
            if let Some(path) = tokenizer_at {
                crate::rundir::write_atomic(path, tokenizer.to_json()?.as_bytes())?;
            }
            tokenizer
        }
    };
    let encoded = encode_dataset(&tokenizer, data)?;
    let train_set: Arc<[EncodedPair]> = train_idx.iter().map(|&i| encoded[i].clone()).collect();
    let mut held: Vec<&EncodedPair> = held_idx.iter().map(|&i| &encoded[i]).collect();
    // Batches of pairs of similar length pad least (the scores do not
    // depend on the order).
    held.sort_by_key(|p| p.ids.len());
    let held_out: Vec<PairBatch> = held
        .chunks(config.eval.batch_size)
        .zip(0u64..)
        .map(|(chunk, i)| pad_batch(i, chunk))
        .collect();
    let majority_baseline = {
        let mut counts = vec![0usize; data.labels.len()];
        for &i in &train_idx {
            counts[encoded[i].label] += 1;
        }
        let top = (0..counts.len()).max_by_key(|&c| counts[c]).unwrap_or(0);
        held.iter().filter(|p| p.label == top).count() as f64 / held.len().max(1) as f64
    };
    let mean_length =
        train_set.iter().map(|p| p.ids.len()).sum::<usize>() as f64 / train_set.len().max(1) as f64;
    let seed = t.seed.wrapping_add(fold as u64);
    let train = Arc::new(
        PairBatches::new(
            train_set,
            t.batch_size * world,
            seed,
            config.loader.bucket_by_length,
        )?
        .share(rank, world)?,
    );
    Ok(Prepared {
        schedule: Schedule::new(t, train.batches_per_epoch()),
        encoder: encoder_config(config, tokenizer.vocab_size()),
        tokenizer,
        train_pairs: train_idx.len(),
        held_out_pairs: held_idx.len(),
        train,
        held_out,
        seed,
        majority_baseline,
        mean_length,
    })
}

impl Prepared {
    pub(crate) fn model_size(&self, config: &RunConfig) -> ModelSize {
        let parameters = self.encoder.num_params();
        ModelSize {
            parameters,
            trainable: if config.model.freeze_encoder {
                self.encoder.head_params()
            } else {
                parameters
            },
        }
    }

    /// The task the step and the loop run; `pad_to` pads every training
    /// batch out to that many tokens (`kiln bench --pad-to-max-length`).
    pub(crate) fn task(
        &self,
        config: &RunConfig,
        labels: &[String],
        inner: &Device,
        pad_to: Option<usize>,
    ) -> NliTask {
        NliTask {
            train: Arc::clone(&self.train),
            held_out: self.held_out.clone(),
            labels: labels.to_vec(),
            encoder: self.encoder.clone(),
            frozen: config.model.freeze_encoder,
            label_smoothing: config.training.label_smoothing,
            inner: inner.clone(),
            pad_to,
        }
    }
}

/// Tensors of a pair batch on `device`.
pub(crate) fn pair_tensors(b: &PairBatch, device: &Device) -> PairTensors {
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
pub(crate) struct NliTask {
    train: Arc<PairBatches>,
    held_out: Vec<PairBatch>,
    labels: Vec<String>,
    encoder: EncoderConfig,
    frozen: bool,
    /// `training.label_smoothing`: the training loss's ε.
    label_smoothing: f64,
    inner: Device,
    pad_to: Option<usize>,
}

/// A pair batch as tensors: ids, segments, mask, labels.
type PairTensors = (
    Tensor<2, Int>,
    Tensor<2, Int>,
    Tensor<2, Bool>,
    Tensor<1, Int>,
);

/// The held-out pairs' labels, the classes predicted for them and their
/// mean loss.
struct Predicted {
    truth: Vec<usize>,
    predicted: Vec<usize>,
    val_loss: f64,
}

impl NliTask {
    /// The held-out pairs, predicted; `None` where `stop` is asked between
    /// two batches.
    fn predict(
        &self,
        model: &EncoderClassifier,
        stop: StopAsked<'_>,
    ) -> Result<Option<Predicted>, TrainError> {
        let model = model.valid();
        // Each batch's loss, then its predicted classes (exact as f32s).
        let results = evaluate_shared(self.held_out.len(), stop, |i| {
            let b = &self.held_out[i];
            let (ids, seg, mask, labels) = pair_tensors(b, &self.inner);
            let logits = model.forward(ids, seg, mask);
            let loss: f32 = EncoderClassifier::cross_entropy(logits.clone(), labels).into_scalar();
            let classes = logits.argmax(1).into_data();
            Ok(std::iter::once(loss)
                .chain(classes.iter::<i64>().map(|c| c as f32))
                .collect())
        })?;
        let Some(results) = results else {
            return Ok(None);
        };
        let mut truth = Vec::new();
        let mut predicted = Vec::new();
        let mut loss_sum = 0.0;
        for (b, result) in self.held_out.iter().zip(&results) {
            let (loss, classes) = result.split_first().unwrap_or((&f32::NAN, &[]));
            loss_sum += f64::from(*loss) * b.batch_size as f64;
            predicted.extend(classes.iter().map(|&c| c as usize));
            truth.extend(b.labels.iter().copied());
        }
        let n = truth.len().max(1) as f64;
        Ok(Some(Predicted {
            truth,
            predicted,
            val_loss: loss_sum / n,
        }))
    }
}

impl Task for NliTask {
    type Model = EncoderClassifier;
    type Source = PairBatches;
    type Inputs = PairTensors;

    fn source(&self) -> Arc<PairBatches> {
        Arc::clone(&self.train)
    }

    fn upload(&self, batch: &PairBatch, device: &Device) -> PairTensors {
        match self.pad_to {
            Some(len) => pair_tensors(&repad(batch, len), device),
            None => pair_tensors(batch, device),
        }
    }

    fn loss(&self, model: &EncoderClassifier, (ids, seg, mask, labels): PairTensors) -> Tensor<1> {
        model.smoothed_loss(ids, seg, mask, labels, self.label_smoothing)
    }

    fn work(&self, batch: &PairBatch) -> Work {
        let len = self.pad_to.map_or(batch.seq_len, |l| l.max(batch.seq_len));
        Work {
            samples: batch.batch_size,
            tokens: batch.real_tokens,
            padded_tokens: batch.batch_size * len,
            flops: batch.batch_size as f64 * self.encoder.flops_per_sequence(len, self.frozen),
        }
    }

    fn evaluate(
        &self,
        model: &EncoderClassifier,
        _step: u64,
        stop: StopAsked<'_>,
    ) -> Result<Option<Evaluation>, TrainError> {
        let Some(Predicted {
            truth,
            predicted,
            val_loss,
        }) = self.predict(model, stop)?
        else {
            return Ok(None);
        };
        let scores = Scores::new(&self.labels, &truth, &predicted);
        Ok(Some(Evaluation {
            score: Some(scores.macro_f1),
            metrics: EvalMetrics::Nli { val_loss, scores },
        }))
    }
}

/// Pads a batch out to `len` tokens.
pub(crate) fn repad(b: &PairBatch, len: usize) -> PairBatch {
    if b.seq_len >= len {
        return b.clone();
    }
    let rows: Vec<EncodedPair> = (0..b.batch_size)
        .map(|r| {
            let row = r * b.seq_len..(r + 1) * b.seq_len;
            let n = b.mask[row.clone()].iter().filter(|m| **m).count();
            EncodedPair {
                ids: b.ids[row.start..row.start + n].to_vec(),
                segments: b.segments[row.start..row.start + n].to_vec(),
                label: b.labels[r],
            }
        })
        .collect();
    let refs: Vec<&EncodedPair> = rows.iter().collect();
    let mut out = pad_batch(b.index, &refs);
    let extra = len - out.seq_len;
    let widen = |v: &[u32]| -> Vec<u32> {
        v.chunks(out.seq_len)
            .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(0, extra)))
            .collect()
    };
    let mask: Vec<bool> = out
        .mask
        .chunks(out.seq_len)
        .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(false, extra)))
        .collect();
    out.ids = widen(&out.ids);
    out.segments = widen(&out.segments);
    out.mask = mask;
    out.seq_len = len;
    out
}

/// Trains the NLI workload of `config` with k-fold cross-validation in a new run directory.
pub(crate) fn train_cv(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let device = open_rank_device(config, options, observer)?;
    let pairs = read(config)?;
    // The weights `model.init_from` names and the attention asked for are
    // checked before anything is written.
    crate::pretrained::bert::open(config)?;
    check_attention(config, &device, options)?;
    let run = if options.writes() {
        RunDir::start(config, options)?
    } else {
        RunDir::elsewhere()
    };
    let _lock = run.lock()?;
    run_cv(config, &run, &device, &pairs, options, observer)
}

/// The device of this process: in a data-parallel job (`kiln launch … cv`)
/// the rank's GPU, with the collectives that reduce the ranks' gradients
/// told to `observer`, as the language model's ranks do.
fn open_rank_device(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<DeviceChoice, TrainError> {
    let rank_config = lm::on_rank_device(config, options.group.as_deref(), &options.hardware);
    let device = open_device(&rank_config, options.hardware.gpu_vendor())?;
    lm::note_collectives(&device, &rank_config, options, observer)?;
    Ok(device)
}

/// (rank, world) of this process: (0, 1) alone.
fn share_of(options: &TrainOptions) -> (usize, usize) {
    options
        .group
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.world_size()))
}

/// A cross-validation's folds train as its first did, their results
/// compared: on as many ranks (each fold's batches are shared by them). A
/// resume on another number is refused before anything changes, naming
/// the fold that trained on the run's.
fn check_cv_world(run: &RunDir, k: usize, world: usize) -> Result<(), TrainError> {
    let ranks = |n: u64| kiln_plan::counted(n as usize, "rank");
    let refuse = |fold: usize, trained: u64| TrainError::WorldSize {
        world,
        why: format!(
            "fold {fold} of the cross-validation trained on {} ({}), and its other folds train as it did (their scores are compared); launch {} (`kiln launch --nproc-per-node {trained} resume {}`{})",
            ranks(trained),
            if trained > 1 {
                "each batch shared among them"
            } else {
                "one process"
            },
            ranks(trained),
            run.path.display(),
            if trained == 1 {
                ", or `kiln resume` without a launcher"
            } else {
                ""
            }
        ),
    };
    for fold in 1..=k {
        let dir = run.sub(&format!("fold-{fold}"));
        if let Some(result) = std::fs::read_to_string(dir.file("result.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<FoldResult>(&t).ok())
        {
            if result.world_size != world as u64 {
                return Err(refuse(fold, result.world_size));
            }
            continue;
        }
        // The fold it stopped in: its checkpoint's world, if it has one.
        if let Ok((_, state, _)) = checkpoint::latest_good(&dir.checkpoints())
            && state.world_size.max(1) != world as u64
        {
            return Err(refuse(fold, state.world_size.max(1)));
        }
        break;
    }
    Ok(())
}

/// Continues a CV run: finished folds are kept, the stopped one resumes from
/// its newest good checkpoint.
pub(crate) fn resume_cv(
    resumed: &ResumedConfig,
    run: &RunDir,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let config = &resumed.config;
    check_cv_world(run, config.cv.folds, options.world_size())?;
    observer.event(&Event::Note(format!(
        "resuming cross-validation run `{}`",
        run.path.display()
    )));
    let device = open_rank_device(config, options, observer)?;
    let pairs = read(config)?;
    check_attention(config, &device, options)?;
    // Everything that can refuse the resume has run: the run takes the
    // changes.
    run.record_resume(resumed, None, observer)?;
    run_cv(config, run, &device, &pairs, options, observer)
}

/// `optimization.attention` against the device and precision the folds
/// train with (`setup::check_attention_choice`): before a run directory is
/// made or a resume's changes are recorded.
fn check_attention(
    config: &RunConfig,
    device: &DeviceChoice,
    options: &TrainOptions,
) -> Result<(), TrainError> {
    let precision = run_precision(config, device, &options.hardware);
    crate::setup::check_attention_choice(config, device, &precision)
}

fn run_cv(
    config: &RunConfig,
    run: &RunDir,
    device: &DeviceChoice,
    pairs: &Pairs,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let started = Instant::now();
    let k = config.cv.folds;
    let (data, folds) = (&pairs.data, &pairs.folds);
    let assignment: Vec<serde_json::Value> = data
        .pairs
        .iter()
        .zip(folds)
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
        let dir = run.sub(&format!("fold-{}", fold + 1));
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
        if dir.writes() {
            std::fs::create_dir_all(dir.checkpoints()).map_err(|source| TrainError::Write {
                path: dir.path.clone(),
                source,
            })?;
        }
        match train_fold(config, &dir, device, pairs, fold, options, observer)? {
            // A job's other ranks: rank 0 reads the fold's records.
            FoldEnd::Done(None) => {}
            FoldEnd::Done(Some(result)) => {
                dir.write(
                    "result.json",
                    &serde_json::to_string_pretty(&result).unwrap_or_default(),
                )?;
                observer.event(&Event::FoldDone((*result).clone()));
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
    if let Some(group) = options.group.as_deref().filter(|_| !run.writes()) {
        // A job's other ranks: rank 0's summary, which it alone can read.
        return cv_summary_from_root(run, group);
    }
    run.write(
        "cv_summary.json",
        &serde_json::to_string_pretty(&summary).unwrap_or_default(),
    )?;
    if let Some(group) = &options.group {
        group.all_gather(
            serde_json::to_string(&summary)
                .unwrap_or_default()
                .as_bytes(),
        )?;
    }
    let curves: Vec<Vec<(u64, f64)>> = summary
        .folds
        .iter()
        .map(|f| {
            let fold = run.sub(&format!("fold-{}", f.fold));
            fold.records()
                .into_iter()
                .filter_map(|r| match r {
                    Record::Eval(e) => Some((e.step, e.score?)),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let _ = crate::report::write_cv_plots(&run.path, &summary, &curves);
    run.tensorboard_cv(config, &summary)?;
    observer.event(&Event::CvDone(summary.clone()));
    Ok(Outcome::CvFinished {
        run: run.path.clone(),
        summary,
    })
}

/// What a job's rank other than 0 returns: the summary rank 0 made from
/// the folds' records (which it alone writes), sent to every rank.
fn cv_summary_from_root(run: &RunDir, group: &kiln_dist::Group) -> Result<Outcome, TrainError> {
    let all = group.all_gather(&[])?;
    let summary = serde_json::from_slice(&all[0]).map_err(|e| TrainError::NotARun {
        path: run.path.clone(),
        why: format!("rank 0's cross-validation summary does not read back: {e}"),
    })?;
    Ok(Outcome::CvFinished {
        run: run.path.clone(),
        summary,
    })
}

enum FoldEnd {
    /// The fold's result: `None` on a job's ranks other than 0.
    Done(Option<Box<FoldResult>>),
    Interrupted {
        step: u64,
        checkpoint: PathBuf,
    },
}

fn train_fold(
    config: &RunConfig,
    dir: &RunDir,
    device: &DeviceChoice,
    pairs: &Pairs,
    fold: usize,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<FoldEnd, TrainError> {
    let t = &config.training;
    // A job's other ranks read the fold's tokenizer where rank 0 saved it
    // (a resume), and otherwise learn the same one, saving nothing.
    let saved_tokenizer = dir.file("tokenizer.json");
    let tokenizer_at = (dir.writes() || saved_tokenizer.is_file()).then_some(&*saved_tokenizer);
    let p = prepare(config, pairs, fold, tokenizer_at, share_of(options))?;
    let encoder = &p.encoder;
    let train_device = train_device(config, &device.device, p.seed);
    let precision = run_precision(config, device, &options.hardware);
    let latest = checkpoint::latest_good(&dir.checkpoints());
    // A resumed fold's checkpoint holds every weight: none is drawn first.
    let mut model = match latest {
        Ok(_) => encoder.init_unset(&train_device),
        Err(_) => init_model(config, &train_device, p.seed, |d| encoder.init(d)),
    };
    let mut weights_note = None;
    let mut optim = AdamW::for_run(config, &model, options.group.as_deref());
    let mut start = LoopPlanStart {
        first_step: 1,
        ..LoopPlanStart::default()
    };
    match latest {
        Ok((info, state, notes)) => {
            for n in notes {
                observer.event(&Event::Note(n));
            }
            observer.event(&Event::Note(format!(
                "fold {}: resuming from step {}",
                fold + 1,
                info.step
            )));
            dir.records_go_on_after(config, info.step)?;
            (model, start) = restore(
                model,
                &mut optim,
                state,
                &info.path,
                &train_device,
                &device.device,
            )?;
        }
        Err(_) => {
            dir.records_go_on_after(config, 0)?;
            // A fresh fold starts from `model.init_from`'s weights (a
            // resumed one from its checkpoint).
            if let Some(bert) = crate::pretrained::bert::open(config)? {
                model = bert.load_into(model, &train_device)?;
                weights_note = Some(bert.describe(config));
            }
        }
    }
    if config.model.freeze_encoder {
        model = model.freeze_encoder();
    }
    let model = model
        .with_compute(precision.compute)
        .with_kernels(kernels(config))
        .with_attention(crate::translate::attention(config));
    let patience = (config.cv.patience > 0).then_some(config.cv.patience);
    // Only the records up to the step it starts from: on a job's other
    // ranks, rank 0 may not yet have cut those after it.
    let records: Vec<Record> = dir
        .records()
        .into_iter()
        .filter(|r| r.step() < start.first_step)
        .collect();
    let stopping = EarlyStopping::from_records(patience, &records);
    let (peak, peak_name) = mfu_peak(config, device, &precision, &options.hardware);
    let mut lines = vec![
        format!(
            "fold {}/{}: {} training pairs, {} held out; {} {} ({})",
            fold + 1,
            config.cv.folds,
            p.train_pairs,
            p.held_out_pairs,
            if config.model.init_from.is_some() || config.data.tokenizer_file.is_some() {
                "vocabulary"
            } else {
                "WordPiece vocabulary"
            },
            p.tokenizer.vocab_size(),
            if config.model.init_from.is_some() {
                "the weights' tokenizer"
            } else if config.data.tokenizer_file.is_some() {
                "data.tokenizer_file"
            } else {
                "trained on this fold's training pairs"
            }
        ),
        format!(
            "model: encoder, {} × {} × {} wide, max length {}, {:.2} M parameters{}",
            crate::counted(encoder.layers, "layer"),
            crate::counted(encoder.heads, "head"),
            encoder.hidden,
            config.model.max_length,
            encoder.num_params() as f64 / 1e6,
            if config.model.freeze_encoder {
                ", encoder frozen (only the head trains)"
            } else {
                ""
            }
        ),
    ];
    lines.extend(weights_note);
    lines.extend(device_lines(
        config, device, &precision, options, &peak_name,
    ));
    let world = options.world_size();
    lines.push(format!(
        "batch: {} pairs padded per batch{}, accumulation {}{} → {} pairs per optimizer step; {} steps per epoch",
        t.batch_size,
        if config.loader.bucket_by_length { ", bucketed by length" } else { "" },
        t.gradient_accumulation_steps,
        if world > 1 { format!(" × {world} ranks") } else { String::new() },
        config.effective_batch() * world,
        steps_text(p.schedule.steps_per_epoch())
    ));
    lines.push(schedule_line(config, &p.schedule));
    lines.extend(schedule_warnings(config, &p.schedule));
    observer.event(&Event::Start {
        lines,
        first_step: start.first_step,
        total_steps: p.schedule.total_steps,
        fold: Some((fold + 1, config.cv.folds)),
    });
    let task = p.task(config, &pairs.data.labels, &device.device, None);
    let mut plan = LoopPlan {
        first_step: start.first_step,
        schedule: p.schedule,
        loader_start: start.loader_start,
        tokens_seen: start.tokens_seen,
        wall_before: start.wall_before,
        eval_at_epoch_ends: true,
        stopping,
        peak_flops: peak,
        scaler: start.scaler(precision.loss_scaling(), config),
        eval_pending: start.eval_pending,
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
    if !dir.writes() {
        return Ok(FoldEnd::Done(None));
    }
    let records = dir.records();
    // The best evaluation: the highest score, the earliest of equals.
    let best_eval = records
        .iter()
        .filter_map(|r| match r {
            Record::Eval(e) => Some(e),
            _ => None,
        })
        .fold(None::<&crate::records::EvalRecord>, |best, e| match best {
            Some(b) if b.score >= e.score => Some(b),
            _ => Some(e),
        })
        .ok_or_else(|| {
            TrainError::Unsupported(
                "a fold without an evaluation",
                "raise training.epochs".into(),
            )
        })?;
    let EvalMetrics::Nli { val_loss, scores } = &best_eval.metrics else {
        return Err(TrainError::NotARun {
            path: dir.path.clone(),
            why: "its evaluation records are not a classifier's".into(),
        });
    };
    let mut speeds: Vec<f64> = records
        .iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s.samples_per_s),
            _ => None,
        })
        .collect();
    Ok(FoldEnd::Done(Some(Box::new(FoldResult {
        fold: fold + 1,
        train_pairs: p.train_pairs,
        held_out_pairs: p.held_out_pairs,
        best_step: best_eval.step,
        stopped_early,
        val_loss: *val_loss,
        scores: scores.clone(),
        majority_baseline: p.majority_baseline,
        median_samples_per_s: median(&mut speeds),
        world_size: options.world_size() as u64,
    }))))
}

/// Steps per epoch: whole, or with one decimal.
fn steps_text(steps: f64) -> String {
    if steps.fract() == 0.0 {
        format!("{steps:.0}")
    } else {
        format!("{steps:.1}")
    }
}

/// What `predict` wrote and, where the file has labels, how good it was.
#[derive(Clone, Debug)]
pub struct Prediction {
    /// The predictions file written.
    pub output: PathBuf,
    /// Rows predicted.
    pub rows: usize,
    /// The fold whose model predicted (the best by validation); `None`
    /// for a `transformers` folder's model.
    pub fold: Option<usize>,
    /// Accuracy and per-class scores, where the file has labels.
    pub scores: Option<Scores>,
    /// The rows skipped and why, if any.
    pub skipped: Option<String>,
}

/// The fold of a finished CV run whose macro-F1 was best: what `kiln
/// predict` predicts with and `kiln export` writes.
pub(crate) struct BestFold {
    pub(crate) run: RunDir,
    pub(crate) config: RunConfig,
    /// 1-based.
    pub(crate) fold: usize,
    /// The optimizer step its best model is from.
    pub(crate) step: u64,
    /// Its tokenizer, with the pair template at the run's length.
    pub(crate) tokenizer: Tokenizer,
    /// Its best model's file and parameters.
    pub(crate) model_path: PathBuf,
    pub(crate) params: Vec<crate::params::NamedValues>,
}

/// The best fold of the CV run `run_dir`; `to` names what needs it in
/// the error for a run that has not finished.
pub(crate) fn best_fold(run_dir: &Path, to: &str) -> Result<BestFold, TrainError> {
    let run = RunDir::open(run_dir)?;
    let config = kiln_config::read_run_config(&run.file("config.toml"))?;
    let summary: CvSummary = std::fs::read_to_string(run.file("cv_summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| TrainError::NotARun {
            path: run.path.clone(),
            why: format!(
                "it has no cv_summary.json: only a finished cross-validation run can {to}"
            ),
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
    let model_path = fold_dir.join(checkpoint::BEST_MODEL);
    let params =
        checkpoint::load_params(&model_path).map_err(|why| TrainError::CheckpointMismatch {
            path: model_path.clone(),
            why,
        })?;
    let (fold, step) = (best.fold, best.best_step);
    Ok(BestFold {
        run,
        config,
        fold,
        step,
        tokenizer,
        model_path,
        params,
    })
}

/// Predicts a pairs file with the best fold's model and tokenizer of a CV
/// run, writing one JSON line per input row to `output` (default:
/// `RUN/predictions-<name>.jsonl`).
pub fn predict(
    run_dir: &Path,
    data_path: &Path,
    output: Option<&Path>,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Prediction, TrainError> {
    let best = best_fold(run_dir, "predict")?;
    let config = best.config;
    let device = select_device(&config.device, hardware.gpu_vendor())?;
    let encoder = encoder_config(&config, best.tokenizer.vocab_size());
    let model_path = best.model_path;
    let values = best
        .params
        .into_iter()
        .map(|(p, s, v)| (p, (s, v)))
        .collect();
    let model =
        crate::params::load_values(encoder.init_unset(&device.device), values, &device.device)
            .map_err(|why| TrainError::CheckpointMismatch {
                path: model_path.clone(),
                why,
            })?;
    let output = predictions_path(output, &best.run.path, data_path);
    let mut prediction = label_pairs(
        &model,
        &best.tokenizer,
        &config,
        data_path,
        output,
        &device.device,
    )?;
    prediction.fold = Some(best.fold);
    Ok(prediction)
}

/// Predicts a pairs file with the classifier of a `transformers` BERT,
/// RoBERTa, ELECTRA or DistilBERT folder (`config`'s `model.init_from`: a model fine-tuned for
/// `data.labels`, such as one on MultiNLI) and its tokenizer, writing one
/// JSON line per input row to `output` (default:
/// `predictions-<name>.jsonl` in the working directory). `config` takes
/// the folder's shape from [`bert_folder_overrides`]. Fails where the
/// folder's classifier is not one for `data.labels`.
pub fn predict_folder(
    config: &RunConfig,
    data_path: &Path,
    output: Option<&Path>,
    hardware: &kiln_hwdetect::HardwareReport,
) -> Result<Prediction, TrainError> {
    let folder = config.model.init_from.clone().unwrap_or_default();
    let bert = crate::pretrained::bert::open(config)?.ok_or_else(|| TrainError::Pretrained {
        path: PathBuf::from(&folder),
        why: "is not a sentence-pair run's model.init_from (workload nli, a transformers folder)"
            .into(),
    })?;
    if let Err(why) = bert.classifier() {
        let base = match bert.has_classifier() {
            true => String::new(),
            false => {
                format!(" (a base model is fine-tuned first: `kiln cv model.init_from={folder}`)")
            }
        };
        return Err(TrainError::Pretrained {
            path: PathBuf::from(&folder),
            why: format!(
                "has no classifier for the run's labels ({why}): predicting needs one trained for data.labels{base}"
            ),
        });
    }
    let device = select_device(&config.device, hardware.gpu_vendor())?;
    let mut tokenizer = bert.tokenizer.clone();
    tokenizer.set_pair_template(config.model.max_length)?;
    let encoder = encoder_config(config, tokenizer.vocab_size());
    let model = bert.load_into(encoder.init_unset(&device.device), &device.device)?;
    let output = predictions_path(output, Path::new(""), data_path);
    label_pairs(
        &model,
        &tokenizer,
        config,
        data_path,
        output,
        &device.device,
    )
}

/// The overrides that make an NLI run's model the one a `transformers`
/// BERT, RoBERTa, ELECTRA or DistilBERT `folder` holds: `model.init_from`
/// and the folder's shape, GELU, LayerNorm ε, segments, embedding width,
/// pooler and its activation, and every position it has
/// (`kiln predict FOLDER` resolves them under the user's own).
pub fn bert_folder_overrides(folder: &Path) -> Result<Vec<String>, TrainError> {
    crate::pretrained::bert::folder_overrides(folder)
}

/// Where predictions of `data_path` go: `output`, or
/// `predictions-<the data file's stem>.jsonl` in the folder `output` names
/// (as `cp` puts a file in a folder), or else in `folder`.
fn predictions_path(output: Option<&Path>, folder: &Path, data_path: &Path) -> PathBuf {
    let stem = data_path
        .file_stem()
        .map_or("data".into(), |s| s.to_string_lossy().into_owned());
    let name = format!("predictions-{stem}.jsonl");
    match output {
        Some(dir) if dir.is_dir() => dir.join(name),
        Some(file) => file.to_path_buf(),
        None => folder.join(name),
    }
}

/// Labels the pairs of `data_path` (read as `config` says) with `model`,
/// writing one JSON line per row to `output`; scored where the file has
/// labels.
fn label_pairs(
    model: &EncoderClassifier,
    tokenizer: &Tokenizer,
    config: &RunConfig,
    data_path: &Path,
    output: PathBuf,
    device: &Device,
) -> Result<Prediction, TrainError> {
    // The folder first: a path that cannot be written fails before the work.
    crate::rundir::create_parent("--out", &output)?;
    let data = read_pairs(data_path, &schema(config, false))
        .map_err(|e| crate::translate::with_config_keys(e, config))?;
    let encoded = encode_dataset(tokenizer, &data)?;
    // Batches of pairs of similar length pad least: predicted shortest
    // first, written in the file's order.
    let mut order: Vec<usize> = (0..encoded.len()).collect();
    order.sort_by_key(|&i| encoded[i].ids.len());
    let classes = config.data.labels.len();
    let mut probabilities = vec![0.0f32; encoded.len() * classes];
    for (chunk, i) in order.chunks(config.eval.batch_size.max(1)).zip(0u64..) {
        let refs: Vec<&EncodedPair> = chunk.iter().map(|&k| &encoded[k]).collect();
        let b = pad_batch(i, &refs);
        let (ids, seg, mask, _) = pair_tensors(&b, device);
        let probs = burn::tensor::activation::softmax(model.forward(ids, seg, mask), 1);
        let probs: Vec<f32> = probs.into_data().iter::<f32>().collect();
        for (&k, row) in chunk.iter().zip(probs.chunks(classes)) {
            probabilities[k * classes..(k + 1) * classes].copy_from_slice(row);
        }
    }
    let mut lines = String::new();
    let mut predicted = Vec::with_capacity(encoded.len());
    for (pair, row) in data.pairs.iter().zip(probabilities.chunks(classes)) {
        let best = (0..row.len())
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap_or(0);
        predicted.push(best);
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
                "prediction": config.data.labels[best],
                "probabilities": probabilities,
            })
            .to_string(),
        );
        lines.push('\n');
    }
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
        fold: None,
        scores,
        skipped: data.skipped_report(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--out` a file is that file; `--out` an existing folder gets the
    /// default name in it (it failed with "Is a directory" after every pair
    /// was predicted); no `--out`, the default name in the run's folder.
    #[test]
    fn predictions_go_to_the_file_or_into_the_folder_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data = Path::new("data/snli_dev.jsonl");
        let file = dir.path().join("mine.jsonl");
        assert_eq!(predictions_path(Some(&file), Path::new("run"), data), file);
        assert_eq!(
            predictions_path(Some(dir.path()), Path::new("run"), data),
            dir.path().join("predictions-snli_dev.jsonl")
        );
        assert_eq!(
            predictions_path(None, Path::new("run"), data),
            Path::new("run/predictions-snli_dev.jsonl")
        );
        assert_eq!(
            predictions_path(None, Path::new(""), data),
            Path::new("predictions-snli_dev.jsonl")
        );
    }

    #[test]
    fn repadding_keeps_the_rows_and_widens_with_padding() {
        let pairs = [
            EncodedPair {
                ids: vec![2, 5, 3],
                segments: vec![0, 0, 0],
                label: 1,
            },
            EncodedPair {
                ids: vec![2, 3],
                segments: vec![0, 0],
                label: 0,
            },
        ];
        let b = pad_batch(0, &pairs.iter().collect::<Vec<_>>());
        let wide = repad(&b, 6);
        assert_eq!(wide.seq_len, 6);
        assert_eq!(wide.ids, vec![2, 5, 3, 0, 0, 0, 2, 3, 0, 0, 0, 0]);
        assert_eq!(wide.mask.iter().filter(|m| **m).count(), 5);
        assert_eq!(wide.labels, vec![1, 0]);
    }

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
