//! The records of `metrics.jsonl`, one JSON object a line tagged by
//! `kind`, written and read back through the same types; and the results of
//! a cross-validation run (`fold-<k>/result.json`, `cv_summary.json`).

use serde::{Deserialize, Serialize};

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// A logged optimizer step.
    Step(StepMetrics),
    /// An evaluation.
    Eval(EvalRecord),
    /// A step whose update was skipped.
    Skipped(Skipped),
    /// fp16's loss scale grew.
    LossScale {
        /// The step after which it grew.
        step: u64,
        /// The new scale.
        scale: f64,
        /// Why ("2000 clean steps in a row").
        why: String,
    },
}

impl Record {
    /// The optimizer step the record belongs to.
    pub fn step(&self) -> u64 {
        match self {
            Self::Step(s) => s.step,
            Self::Eval(e) => e.step,
            Self::Skipped(s) => s.step,
            Self::LossScale { step, .. } => *step,
        }
    }
}

/// A loss or norm that JSON holds as `null` where it was NaN or infinite
/// (serde_json writes those so): read back as NaN, so that a diverged
/// step's or evaluation's record is kept where it was dropped (a run's
/// summary then counted the steps up to the last finite one).
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One logged optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The optimizer step, from 1.
    pub step: u64,
    /// The training loss, averaged over the step's micro-batches.
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// The learning rate the update used.
    pub lr: f64,
    /// The global gradient norm, before clipping.
    #[serde(deserialize_with = "nan_if_null")]
    pub grad_norm: f64,
    /// Wall time of the step, loader wait included.
    pub ms_per_step: f64,
    /// Tokens that carry data (padding not counted) per second.
    pub tokens_per_s: f64,
    /// Samples (windows or pairs) per second.
    pub samples_per_s: f64,
    /// Model FLOPs/s over the device peak (`None`: peak unknown).
    pub mfu: Option<f64>,
    /// Share of the step spent waiting for the loader, in percent.
    pub data_wait_pct: f64,
    /// In a data-parallel job: the share of the step spent in the
    /// gradients' all-reduce (the wait for the slowest rank included), in
    /// percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_pct: Option<f64>,
    /// Memory in use: on a GPU (`device_memory`) the bytes CubeCL's
    /// allocator has live, else the process's resident set.
    pub memory_bytes: u64,
    /// The highest memory so far: on a GPU the most the allocator's pools
    /// have held, else the process's high-water mark.
    pub peak_memory_bytes: u64,
    /// Whether the two figures above are the GPU's (a run on wgpu or CUDA).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub device_memory: bool,
    /// Tokens trained on since the run began (padding not counted).
    pub tokens_seen: u64,
}

/// An evaluation: the workload's metrics and, where the workload ranks its
/// evaluations (NLI: macro-F1), the score that keeps the best model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// The optimizer step evaluated after.
    pub step: u64,
    /// What was measured.
    #[serde(flatten)]
    pub metrics: EvalMetrics,
    /// The ranking score (higher is better), where the workload has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score: Option<f64>,
}

/// What an evaluation measured, per workload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EvalMetrics {
    /// The language model: mean loss over `eval_iters` batches of each split.
    Lm {
        /// Mean loss on training batches.
        #[serde(deserialize_with = "nan_if_null")]
        train_loss: f64,
        /// Mean loss on validation batches.
        #[serde(deserialize_with = "nan_if_null")]
        val_loss: f64,
    },
    /// The pair classifier: loss and scores on the held-out fold.
    Nli {
        /// Mean loss on the held-out fold.
        #[serde(deserialize_with = "nan_if_null")]
        val_loss: f64,
        /// Accuracy, macro-F1 and per-class scores on it.
        scores: Scores,
    },
}

impl EvalMetrics {
    /// The validation loss, whichever the workload.
    pub fn val_loss(&self) -> f64 {
        match self {
            Self::Lm { val_loss, .. } | Self::Nli { val_loss, .. } => *val_loss,
        }
    }
}

/// Why a step made no update.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    /// The step whose update was skipped.
    pub step: u64,
    /// What was not finite.
    pub why: String,
    /// fp16 overflow: the loss scale after halving, and overflows so far.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// fp16 overflow: overflowed steps so far in this session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflows: Option<u64>,
    /// Non-finite: how many such steps in a row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_a_row: Option<usize>,
}

/// Precision, recall and F1 of one class.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassMetrics {
    /// The class's name.
    pub label: String,
    /// Of the rows predicted as this class, the share that are.
    pub precision: f64,
    /// Of the rows of this class, the share predicted as it.
    pub recall: f64,
    /// The harmonic mean of precision and recall.
    pub f1: f64,
    /// Rows of this class.
    pub support: usize,
}

/// Classification quality of predictions against labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Scores {
    /// The share of rows predicted right.
    pub accuracy: f64,
    /// The unweighted mean of the classes' F1.
    pub macro_f1: f64,
    /// Each class's scores, in label order.
    pub per_class: Vec<ClassMetrics>,
    /// `confusion[true][predicted]`.
    pub confusion: Vec<Vec<usize>>,
}

impl Scores {
    /// The scores of `predicted` against `truth` (label indices into `labels`).
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
    /// The fold, from 0.
    pub fold: usize,
    /// Pairs trained on.
    pub train_pairs: usize,
    /// Pairs held out (evaluated on).
    pub held_out_pairs: usize,
    /// The step of the best evaluation (by macro-F1).
    pub best_step: u64,
    /// Whether early stopping ended the fold.
    pub stopped_early: bool,
    /// The held-out loss at the best step.
    pub val_loss: f64,
    /// The held-out scores at the best step.
    pub scores: Scores,
    /// Accuracy of always predicting the training part's most common label.
    pub majority_baseline: f64,
    /// Median training throughput of the fold.
    pub median_samples_per_s: f64,
    /// The ranks of the data-parallel job that trained it (1: one
    /// process); a run written before kiln recorded it trained in one.
    #[serde(default = "one_rank")]
    pub world_size: u64,
}

fn one_rank() -> u64 {
    1
}

/// The cross-validation summary (`cv_summary.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CvSummary {
    /// Each fold's result, in fold order.
    pub folds: Vec<FoldResult>,
    /// Mean held-out accuracy over the folds.
    pub accuracy_mean: f64,
    /// Its sample standard deviation.
    pub accuracy_std: f64,
    /// Mean held-out macro-F1 over the folds.
    pub macro_f1_mean: f64,
    /// Its sample standard deviation.
    pub macro_f1_std: f64,
    /// Mean accuracy of always predicting the majority label.
    pub majority_baseline_mean: f64,
    /// The label names, in class order.
    pub labels: Vec<String>,
    /// Pairs read.
    pub pairs: usize,
    /// Rows skipped as bad (see `data.bad_rows`).
    pub skipped_rows: usize,
    /// Median training throughput over the folds.
    pub median_samples_per_s: f64,
    /// Wall time of the whole run, in seconds.
    pub wall_s: f64,
}

pub(crate) fn mean_std(values: &[f64]) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (mean, var.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_the_metrics_jsonl_format() {
        let eval = Record::Eval(EvalRecord {
            step: 4,
            metrics: EvalMetrics::Lm {
                train_loss: 2.5,
                val_loss: 2.75,
            },
            score: None,
        });
        let v = serde_json::to_value(&eval).expect("serialises");
        assert_eq!(
            v,
            serde_json::json!({"kind": "eval", "step": 4, "train_loss": 2.5, "val_loss": 2.75})
        );
        // Lines written before the typed records read back the same.
        let line = r#"{"kind":"skipped","step":7,"why":"fp16 gradients overflowed","loss_scale":32768.0,"overflows":1}"#;
        let r: Record = serde_json::from_str(line).expect("parses");
        assert_eq!(r.step(), 7);
        assert!(matches!(
            r,
            Record::Skipped(Skipped {
                overflows: Some(1),
                ..
            })
        ));
        let nli = r#"{"val_loss":0.9,"scores":{"accuracy":0.5,"macro_f1":0.4,"per_class":[],"confusion":[]},"kind":"eval","step":3,"score":0.4}"#;
        match serde_json::from_str::<Record>(nli).expect("parses") {
            Record::Eval(e) => {
                assert_eq!(e.score, Some(0.4));
                assert!(matches!(e.metrics, EvalMetrics::Nli { .. }));
            }
            other => panic!("{other:?}"),
        }
    }

    /// A diverged step's NaN loss is written as `null`; it reads back as
    /// NaN, not as a line that fails to parse (and is dropped).
    #[test]
    fn records_of_a_diverged_step_read_back() {
        let step = Record::Step(StepMetrics {
            step: 3,
            loss: f64::NAN,
            lr: 1e-3,
            grad_norm: f64::INFINITY,
            ms_per_step: 30.0,
            tokens_per_s: 1000.0,
            samples_per_s: 10.0,
            mfu: None,
            data_wait_pct: 0.0,
            comm_pct: None,
            memory_bytes: 1,
            peak_memory_bytes: 1,
            device_memory: false,
            tokens_seen: 768,
        });
        let eval = Record::Eval(EvalRecord {
            step: 3,
            metrics: EvalMetrics::Lm {
                train_loss: f64::NAN,
                val_loss: f64::NAN,
            },
            score: Some(f64::NAN),
        });
        for record in [step, eval] {
            let line = serde_json::to_string(&record).expect("serialises");
            assert!(line.contains("null"), "{line}");
            let back: Record = serde_json::from_str(&line).expect("a NaN's line parses");
            assert_eq!(back.step(), 3);
            match back {
                Record::Step(s) => assert!(s.loss.is_nan() && s.grad_norm.is_nan() && s.lr == 1e-3),
                Record::Eval(e) => {
                    assert!(e.metrics.val_loss().is_nan());
                    assert_eq!(e.score, None, "no score: never the best");
                }
                other => panic!("{other:?}"),
            }
        }
        let nli = r#"{"val_loss":null,"scores":{"accuracy":0.5,"macro_f1":0.4,"per_class":[],"confusion":[]},"kind":"eval","step":3}"#;
        match serde_json::from_str::<Record>(nli).expect("parses") {
            Record::Eval(e) => {
                assert!(matches!(e.metrics, EvalMetrics::Nli { val_loss, .. } if val_loss.is_nan()))
            }
            other => panic!("{other:?}"),
        }
    }
}
