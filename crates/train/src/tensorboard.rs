//! TensorBoard event files, written as a run goes: each record of
//! `metrics.jsonl` also as scalars in `RUN/tensorboard/events.out.tfevents.*`
//! (flushed at every log line), the resolved config as text, and for a
//! cross-validation the folds' results; `tensorboard --logdir runs` shows
//! every run side by side, during the run too.
//!
//! The format is TensorBoard's own: records framed as TFRecord (length,
//! masked CRC-32C of the length, data, masked CRC-32C of the data; the
//! `crc32c` crate), each an `Event` protobuf (`prost`'s derive, the fields
//! of tensorflow/core/util/event.proto and summary.proto that kiln writes).
//!
//! A resumed run (or a fold started again) opens a new file that begins
//! with `SessionLog.START` at the first step it will write: TensorBoard
//! then drops what the earlier files hold from that step on, as the resume
//! cuts `metrics.jsonl` there, so no curve has a step twice.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::TrainError;
use crate::records::{CvSummary, EvalMetrics, Record};

/// `tensorflow.Event`: a wall time, a step and one of what it carries.
#[derive(Clone, PartialEq, prost::Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(oneof = "What", tags = "3, 5, 7")]
    what: Option<What>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum What {
    /// The first event of a file: "brain.Event:2".
    #[prost(string, tag = "3")]
    FileVersion(String),
    #[prost(message, tag = "5")]
    Summary(Summary),
    /// (Tag 6 is the deprecated `log_message`.)
    #[prost(message, tag = "7")]
    SessionLog(SessionLog),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`: a tag and a scalar or a tensor.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
    #[prost(oneof = "Kind", tags = "2, 8")]
    kind: Option<Kind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum Kind {
    #[prost(float, tag = "2")]
    SimpleValue(f32),
    #[prost(message, tag = "8")]
    Tensor(TensorProto),
}

/// `tensorflow.SummaryMetadata`: which plugin shows the value.
#[derive(Clone, PartialEq, prost::Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
    #[prost(bytes = "vec", tag = "2")]
    content: Vec<u8>,
}

/// `tensorflow.TensorProto`, a scalar string (the text plugin's).
#[derive(Clone, PartialEq, prost::Message)]
struct TensorProto {
    /// `DT_STRING`.
    #[prost(int32, tag = "1")]
    dtype: i32,
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` with no dimensions: a scalar.
#[derive(Clone, PartialEq, prost::Message)]
struct TensorShape {}

/// `tensorflow.SessionLog`: `status` 1 is `START`.
#[derive(Clone, PartialEq, prost::Message)]
struct SessionLog {
    #[prost(int32, tag = "1")]
    status: i32,
}

/// `tensorboard.hparams.HParamsPluginData` carrying a `SessionStartInfo`:
/// what TensorBoard's HParams dashboard reads a run's hyperparameters from
/// (plugin_data.proto; without an experiment summary it gathers the
/// hyperparameters from the runs' sessions and the metrics from their
/// scalars).
#[derive(Clone, PartialEq, prost::Message)]
struct HParamsPluginData {
    #[prost(int32, tag = "1")]
    version: i32,
    #[prost(message, optional, tag = "3")]
    session_start_info: Option<SessionStartInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct SessionStartInfo {
    #[prost(btree_map = "string, message", tag = "1")]
    hparams: std::collections::BTreeMap<String, ProtoValue>,
    #[prost(double, tag = "5")]
    start_time_secs: f64,
}

/// `google.protobuf.Value`: the kinds a hyperparameter takes.
#[derive(Clone, PartialEq, prost::Message)]
struct ProtoValue {
    #[prost(oneof = "ValueKind", tags = "2, 3, 4")]
    kind: Option<ValueKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum ValueKind {
    #[prost(double, tag = "2")]
    Number(f64),
    #[prost(string, tag = "3")]
    Text(String),
    #[prost(bool, tag = "4")]
    Flag(bool),
}

/// A hyperparameter's value, for [`write_hparams`].
#[derive(Clone, Debug, PartialEq)]
pub enum HParam {
    /// A number.
    Number(f64),
    /// Text.
    Text(String),
    /// A flag.
    Bool(bool),
}

impl HParam {
    /// A value as the override syntax writes it: a number, `true` or
    /// `false`, else text (its TOML quotes taken off).
    pub fn parse(value: &str) -> Self {
        let v = value.trim();
        if let Ok(n) = v.parse::<f64>() {
            return Self::Number(n);
        }
        match v {
            "true" => Self::Bool(true),
            "false" => Self::Bool(false),
            _ => Self::Text(v.trim_matches(['"', '\'']).to_string()),
        }
    }
}

/// The name of the event file [`write_hparams`] writes in a run's
/// `tensorboard/` folder ends so.
pub const HPARAMS_SUFFIX: &str = ".hparams";

/// Writes `hparams` as the session of the run whose TensorBoard folder is
/// `dir` (`RUN/tensorboard`), in an event file of its own, so that
/// TensorBoard's HParams dashboard lists the run with them and its scalars'
/// last values (as PyTorch's `SummaryWriter.add_hparams`). A folder that
/// has one already is left as it is; returns whether it wrote.
pub fn write_hparams(dir: &Path, hparams: &[(String, HParam)]) -> Result<bool, TrainError> {
    let written = std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .filter_map(Result::ok)
            .any(|e| e.file_name().to_string_lossy().ends_with(HPARAMS_SUFFIX))
    });
    if written {
        return Ok(false);
    }
    let info = SessionStartInfo {
        hparams: hparams
            .iter()
            .map(|(k, v)| {
                let kind = match v {
                    HParam::Number(n) => ValueKind::Number(*n),
                    HParam::Text(t) => ValueKind::Text(t.clone()),
                    HParam::Bool(b) => ValueKind::Flag(*b),
                };
                (k.clone(), ProtoValue { kind: Some(kind) })
            })
            .collect(),
        start_time_secs: now(),
    };
    let content = HParamsPluginData {
        version: 0,
        session_start_info: Some(info),
    }
    .encode_to_vec();
    let mut events = Events::create_named(dir, None, HPARAMS_SUFFIX)?;
    let value = SummaryValue {
        tag: "_hparams_/session_start_info".into(),
        metadata: Some(SummaryMetadata {
            plugin_data: Some(PluginData {
                plugin_name: "hparams".into(),
                content,
            }),
        }),
        kind: None,
    };
    events.write(0, What::Summary(Summary { value: vec![value] }))?;
    events.flush()?;
    Ok(true)
}

const DT_STRING: i32 = 7;
const SESSION_START: i32 = 1;

/// TFRecord's masked CRC-32C (Castagnoli), as TensorFlow's
/// `crc32c::Mask`: rotated right by 15 bits, plus a constant.
pub(crate) fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One TFRecord: the length (u64, little-endian), its masked CRC, the
/// data, the data's masked CRC.
pub(crate) fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// Seconds since the epoch, as TensorBoard's wall time.
fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One event file of a run, open for appending.
#[derive(Debug)]
pub(crate) struct Events {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
}

impl Events {
    /// A new event file in `dir` (created if missing), named as
    /// TensorBoard's writers name theirs (`events.out.tfevents.<seconds>.
    /// <host>.<pid>.<n>`: later files sort after earlier ones), begun with
    /// the file version and, where `first_step` is given, a
    /// `SessionLog.START` at it.
    pub(crate) fn create(dir: &Path, first_step: Option<u64>) -> Result<Self, TrainError> {
        Self::create_named(dir, first_step, "")
    }

    /// [`Events::create`] with `suffix` after the file's name.
    fn create_named(dir: &Path, first_step: Option<u64>, suffix: &str) -> Result<Self, TrainError> {
        std::fs::create_dir_all(dir).map_err(|source| TrainError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let seconds = now() as u64;
        let host = sysinfo::System::host_name().unwrap_or_else(|_| "kiln".into());
        let pid = std::process::id();
        // Another file of this second (a fold after a fold): the next number.
        let mut n = 0;
        let path = loop {
            let name = format!("events.out.tfevents.{seconds:010}.{host}.{pid}.{n}{suffix}");
            let path = dir.join(name);
            if !path.exists() {
                break path;
            }
            n += 1;
        };
        let file = std::fs::File::create(&path).map_err(|source| TrainError::Write {
            path: path.clone(),
            source,
        })?;
        let mut events = Self {
            path,
            file: std::io::BufWriter::new(file),
        };
        events.write(0, What::FileVersion("brain.Event:2".into()))?;
        if let Some(step) = first_step {
            events.write(
                step,
                What::SessionLog(SessionLog {
                    status: SESSION_START,
                }),
            )?;
        }
        events.flush()?;
        Ok(events)
    }

    fn write(&mut self, step: u64, what: What) -> Result<(), TrainError> {
        let event = Event {
            wall_time: now(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            what: Some(what),
        };
        self.file
            .write_all(&frame(&event.encode_to_vec()))
            .map_err(|source| TrainError::Write {
                path: self.path.clone(),
                source,
            })
    }

    /// Scalars `(tag, value)` at `step`, as one event.
    pub(crate) fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<(), TrainError> {
        if values.is_empty() {
            return Ok(());
        }
        let value = values
            .iter()
            .map(|(tag, v)| SummaryValue {
                tag: (*tag).to_string(),
                metadata: None,
                kind: Some(Kind::SimpleValue(*v as f32)),
            })
            .collect();
        self.write(step, What::Summary(Summary { value }))
    }

    /// `text` under `tag` for TensorBoard's text plugin (shown as
    /// Markdown), at `step`.
    pub(crate) fn text(&mut self, step: u64, tag: &str, text: &str) -> Result<(), TrainError> {
        let value = SummaryValue {
            tag: tag.to_string(),
            metadata: Some(SummaryMetadata {
                plugin_data: Some(PluginData {
                    plugin_name: "text".into(),
                    content: Vec::new(),
                }),
            }),
            kind: Some(Kind::Tensor(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            })),
        };
        self.write(step, What::Summary(Summary { value: vec![value] }))
    }

    /// Everything written so far, on disk for a TensorBoard that is
    /// watching.
    pub(crate) fn flush(&mut self) -> Result<(), TrainError> {
        self.file.flush().map_err(|source| TrainError::Write {
            path: self.path.clone(),
            source,
        })
    }

    /// A record of `metrics.jsonl` as scalars, then flushed.
    pub(crate) fn record(&mut self, record: &Record) -> Result<(), TrainError> {
        self.scalars(record.step(), &scalars_of(record))?;
        self.flush()
    }

    /// A cross-validation's results: each fold's accuracy, macro-F1 and
    /// validation loss at its fold number as the step, and the means.
    pub(crate) fn cv_summary(&mut self, summary: &CvSummary) -> Result<(), TrainError> {
        for f in &summary.folds {
            self.scalars(
                f.fold as u64,
                &[
                    ("cv/fold_accuracy", f.scores.accuracy),
                    ("cv/fold_macro_f1", f.scores.macro_f1),
                    ("cv/fold_val_loss", f.val_loss),
                    ("cv/fold_majority_baseline", f.majority_baseline),
                ],
            )?;
        }
        let last = summary.folds.len() as u64;
        self.scalars(
            last,
            &[
                ("cv/accuracy_mean", summary.accuracy_mean),
                ("cv/accuracy_std", summary.accuracy_std),
                ("cv/macro_f1_mean", summary.macro_f1_mean),
                ("cv/macro_f1_std", summary.macro_f1_std),
            ],
        )?;
        self.flush()
    }
}

/// The scalars TensorBoard gets for a record: tag and value, in the
/// groups TensorBoard's sidebar shows (`train/`, `eval/`, `perf/`,
/// `memory/`, `precision/`).
pub(crate) fn scalars_of(record: &Record) -> Vec<(&'static str, f64)> {
    match record {
        Record::Step(s) => {
            let mut v = vec![
                ("train/loss", s.loss),
                ("train/learning_rate", s.lr),
                ("train/grad_norm", s.grad_norm),
                ("perf/tokens_per_s", s.tokens_per_s),
                ("perf/samples_per_s", s.samples_per_s),
                ("perf/ms_per_step", s.ms_per_step),
                ("perf/data_wait_pct", s.data_wait_pct),
                ("train/tokens_seen", s.tokens_seen as f64),
            ];
            if let Some(mfu) = s.mfu {
                v.push(("perf/mfu", mfu));
            }
            if let Some(comm) = s.comm_pct {
                v.push(("perf/comm_pct", comm));
            }
            let (now, peak) = if s.device_memory {
                ("memory/gpu_bytes", "memory/gpu_peak_bytes")
            } else {
                ("memory/bytes", "memory/peak_bytes")
            };
            v.push((now, s.memory_bytes as f64));
            v.push((peak, s.peak_memory_bytes as f64));
            v
        }
        Record::Eval(e) => {
            let mut v = match &e.metrics {
                EvalMetrics::Lm {
                    train_loss,
                    val_loss,
                } => vec![
                    ("eval/train_loss", *train_loss),
                    ("eval/val_loss", *val_loss),
                ],
                EvalMetrics::Nli { val_loss, scores } => vec![
                    ("eval/val_loss", *val_loss),
                    ("eval/accuracy", scores.accuracy),
                    ("eval/macro_f1", scores.macro_f1),
                ],
            };
            if let Some(score) = e.score {
                v.push(("eval/score", score));
            }
            v
        }
        Record::Skipped(s) => {
            let mut v = vec![("precision/skipped_step", 1.0)];
            if let Some(scale) = s.loss_scale {
                v.push(("precision/loss_scale", scale));
            }
            v
        }
        Record::LossScale { scale, .. } => vec![("precision/loss_scale", *scale)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's framing against values TensorFlow's own writer gives:
    /// the masked CRC-32C of the empty string and of an 8-byte length, and
    /// a frame's layout (length, its CRC, data, the data's CRC).
    #[test]
    fn records_are_framed_as_tensorflow_frames_them() {
        // crc32c("") = 0; masked: rotate 0, plus the constant.
        assert_eq!(masked_crc32c(b""), 0xa282_ead8);
        // crc32c("123456789") = 0xE3069283 (the CRC's check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc32c(b"123456789"),
            0xe306_9283_u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
        let framed = frame(b"abc");
        assert_eq!(framed.len(), 8 + 4 + 3 + 4);
        assert_eq!(&framed[..8], &3u64.to_le_bytes());
        assert_eq!(
            &framed[8..12],
            &masked_crc32c(&3u64.to_le_bytes()).to_le_bytes()
        );
        assert_eq!(&framed[12..15], b"abc");
        assert_eq!(&framed[15..], &masked_crc32c(b"abc").to_le_bytes());
    }

    /// What a file holds reads back: each record's frame checks, and the
    /// events decode to the version, the session start and the scalars.
    #[test]
    fn an_event_file_reads_back_frame_by_frame() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut events = Events::create(dir.path(), Some(5)).expect("create");
        events
            .scalars(7, &[("train/loss", 2.5), ("train/learning_rate", 1e-3)])
            .expect("scalars");
        events.text(0, "config", "[training]").expect("text");
        events.flush().expect("flush");
        let bytes = std::fs::read(&events.path).expect("read");
        let mut rest = &bytes[..];
        let mut decoded = Vec::new();
        while !rest.is_empty() {
            let len_bytes: [u8; 8] = rest[..8].try_into().expect("length");
            let len = u64::from_le_bytes(len_bytes) as usize;
            let crc = u32::from_le_bytes(rest[8..12].try_into().expect("crc"));
            assert_eq!(crc, masked_crc32c(&len_bytes));
            let data = &rest[12..12 + len];
            let crc = u32::from_le_bytes(rest[12 + len..16 + len].try_into().expect("crc"));
            assert_eq!(crc, masked_crc32c(data));
            decoded.push(Event::decode(data).expect("event"));
            rest = &rest[16 + len..];
        }
        assert_eq!(decoded.len(), 4);
        assert_eq!(
            decoded[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        assert_eq!(decoded[1].step, 5);
        assert_eq!(
            decoded[1].what,
            Some(What::SessionLog(SessionLog {
                status: SESSION_START
            }))
        );
        assert_eq!(decoded[2].step, 7);
        let Some(What::Summary(s)) = &decoded[2].what else {
            panic!("{:?}", decoded[2]);
        };
        assert_eq!(s.value[0].tag, "train/loss");
        assert_eq!(s.value[0].kind, Some(Kind::SimpleValue(2.5)));
        assert_eq!(s.value[1].kind, Some(Kind::SimpleValue(1e-3)));
        let name = events.path.file_name().expect("name").to_string_lossy();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
    }
}
