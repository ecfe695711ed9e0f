//! The GPT language model: its preparation (corpus, tokenizer, token
//! windows, model shape, schedule), its task for the shared step and loop,
//! and its run (samples and summary at the end).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use kiln_config::{ConfigError, ResumedConfig, RunConfig, TokenizerKind as ConfigTokenizer};
use kiln_data::{
    BatchSource, LmWindows, MemoryTokens, Split, TokenBatch, TokenSpan, Tokenizer, TokenizerKind,
    encode_cached, read_corpus,
};
use kiln_dist::Group;
use kiln_hwdetect::HardwareReport;
use kiln_model::{Gpt, GptConfig};
use kiln_plan::{DataSize, ModelSize, Schedule};

use crate::checkpoint::{self, CheckpointState};
use crate::optim::AdamW;
use crate::records::{EvalMetrics, EvalRecord, Record, StepMetrics};
use crate::report::{Event, LmEval, Observer, Summary, held_back_by, median, write_plots};
use crate::setup::{
    device_lines, init_model, mfu_peak, run_precision, schedule_line, schedule_warnings,
    train_device,
};
use crate::task::{Evaluation, StopAsked, Task, Work, evaluate_shared};
use crate::trainer::{EarlyStopping, LoopEnd, LoopPlan, LoopPlanStart, restore, run_loop};
use crate::translate::{gpt_config, kernels};
use crate::{DeviceChoice, Outcome, RunDir, TrainError, TrainOptions, open_device, tokens};

/// Where a run's tokenizer comes from.
#[derive(Debug)]
pub(crate) enum TokenizerFrom<'a> {
    /// Made as the config says: trained, character-level, or `data.tokenizer_file`.
    Config,
    /// The one a run saved (resume).
    File(&'a Path),
}

/// The language model's workload, prepared from a config: what the run,
/// `kiln bench` and `kiln diagnose` all start from.
pub(crate) struct Prepared {
    /// What `data.path` named (a text file, a store, documents).
    pub(crate) source: PathBuf,
    /// Where the tokens are read from, for the start line.
    pub(crate) origin: String,
    /// The token store, when the tokens are read from one.
    pub(crate) store: Option<kiln_data::TokenStore>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) train_tokens: Arc<dyn TokenSpan>,
    pub(crate) val_tokens: Arc<dyn TokenSpan>,
    pub(crate) gpt: GptConfig,
    pub(crate) schedule: Schedule,
}

/// Reads the corpus, makes the tokenizer, encodes (through the cache) and
/// splits the tokens, and counts the schedule; or opens the token store
/// (preparing documents into one first). The splits are not checked
/// against the block here (`kiln diagnose` reports a short one as a
/// finding); [`Prepared::task`] checks them.
pub(crate) fn prepare(config: &RunConfig, from: TokenizerFrom<'_>) -> Result<Prepared, TrainError> {
    prepare_observed(config, from, &mut crate::report::Silent)
}

/// [`prepare`], telling `observer` about a store being prepared.
pub(crate) fn prepare_observed(
    config: &RunConfig,
    from: TokenizerFrom<'_>,
    observer: &mut dyn Observer,
) -> Result<Prepared, TrainError> {
    let path = match tokens::route(config)? {
        tokens::Route::Memory => return prepare_in_memory(config, from),
        tokens::Route::Store(path) => path,
        tokens::Route::Documents(inputs, others) => {
            tokens::note_left_out(config, &others, observer);
            tokens::prepare_cached(config, inputs, observer)?
        }
    };
    let saved = match from {
        TokenizerFrom::File(p) => Some(p),
        TokenizerFrom::Config => None,
    };
    let opened = Instant::now();
    let (store, tokenizer) = tokens::open_store(config, &path, saved)?;
    let opened = opened.elapsed();
    let t = &config.training;
    let batches_per_epoch =
        (store.train.len() / (t.batch_size * config.model.max_length).max(1)).max(1) as u64;
    Ok(Prepared {
        source: PathBuf::from(&config.data.path),
        origin: format!(
            "token store `{}`, {} shards opened in {:.0} ms",
            path.display(),
            store.train.shards().len() + store.val.shards().len(),
            opened.as_secs_f64() * 1e3
        ),
        gpt: gpt_config(config, tokenizer.vocab_size()),
        schedule: Schedule::new(t, batches_per_epoch),
        train_tokens: store.train.clone(),
        val_tokens: store.val.clone(),
        store: Some(store),
        tokenizer,
    })
}

/// What lengthens a split too short for one window of `source` (what
/// `data.path` named): the split's share (`data.val_fraction`) where kiln
/// splits the text as it reads it, a new store where `data.path` is a token
/// folder, whose splits were fixed when it was prepared.
fn short_split_remedy(source: &Path, split: Split) -> String {
    let share = match split {
        Split::Train => "a smaller",
        Split::Val => "a larger",
    };
    match kiln_data::TokenStore::detect(source) {
        Some(kiln_data::store::StoreKind::Kiln) => format!(
            "its splits were fixed when it was prepared: prepare its documents again into a new folder with {share} data.val_fraction (`kiln prepare … data.val_fraction=…`), or use a smaller model.max_length"
        ),
        Some(_) => {
            let name = kiln_data::store::split_name(split);
            format!(
                "its {name} files are all the tokens it has: add to them (llm.c's `*_{name}_*.bin`, nanoGPT's `{name}.bin`), or use a smaller model.max_length"
            )
        }
        None => {
            format!("use a longer corpus, a smaller model.max_length or {share} data.val_fraction")
        }
    }
}

/// A text file read, encoded (through the token cache) and split in memory.
fn prepare_in_memory(config: &RunConfig, from: TokenizerFrom<'_>) -> Result<Prepared, TrainError> {
    let corpus = read_corpus(Path::new(&config.data.path), config.data.max_chars)?;
    let tokenizer = match from {
        TokenizerFrom::Config => make_tokenizer(config, &corpus.text)?,
        TokenizerFrom::File(path) => Tokenizer::load(path)?,
    };
    let (ids, cached) = encode_cached(&tokenizer, &corpus, Path::new(&config.data.cache_dir))?;
    let n_train = ((ids.len() as f64) * (1.0 - config.data.val_fraction)) as usize;
    let (train, val) = ids.split_at(n_train);
    let t = &config.training;
    let batches_per_epoch =
        (train.len() / (t.batch_size * config.model.max_length).max(1)).max(1) as u64;
    let memory = |ids: &[u32]| -> Arc<dyn TokenSpan> { Arc::new(MemoryTokens(ids.into())) };
    Ok(Prepared {
        gpt: gpt_config(config, tokenizer.vocab_size()),
        schedule: Schedule::new(t, batches_per_epoch),
        train_tokens: memory(train),
        val_tokens: memory(val),
        origin: if cached.hit {
            "from the token cache".into()
        } else {
            "encoded and cached".into()
        },
        store: None,
        tokenizer,
        source: corpus.path,
    })
}

/// The fingerprint of the tokens a run trained on, from its `data.json`
/// (`None` for a run written before 2026-12-07, or a damaged file).
fn read_fingerprint(run: &RunDir) -> Option<tokens::DataFingerprint> {
    let text = std::fs::read_to_string(run.file(tokens::DataFingerprint::FILE)).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_fingerprint(
    run: &RunDir,
    fingerprint: &tokens::DataFingerprint,
) -> Result<(), TrainError> {
    let json = serde_json::to_string_pretty(fingerprint).unwrap_or_default() + "\n";
    run.write(tokens::DataFingerprint::FILE, &json)
}

impl Prepared {
    /// The fingerprint of its splits, for the run's `data.json`.
    pub(crate) fn fingerprint(&self) -> Result<tokens::DataFingerprint, TrainError> {
        Ok(tokens::DataFingerprint::of(
            self.train_tokens.as_ref(),
            self.val_tokens.as_ref(),
        )?)
    }

    /// The data measured against the config, for `kiln diagnose`.
    pub(crate) fn data_size(&self, config: &RunConfig) -> DataSize {
        DataSize {
            unit: "tokens".into(),
            train: self.train_tokens.len(),
            validation: self.val_tokens.len(),
            samples_per_epoch: self.train_tokens.len() / config.model.max_length.max(1),
            splits_fixed: kiln_data::TokenStore::detect(&self.source).is_some(),
            ..DataSize::default()
        }
    }

    /// A CPU run whose step needs more than the available RAM, refused
    /// ([`crate::setup::refuse_over_memory`]).
    fn refuse_over_memory(
        &self,
        config: &RunConfig,
        device: &DeviceChoice,
        options: &TrainOptions,
    ) -> Result<(), TrainError> {
        let model = (self.tokenizer.vocab_size(), self.model_size());
        crate::setup::refuse_over_memory(config, device, &options.hardware, model, options.force)
    }

    pub(crate) fn model_size(&self) -> ModelSize {
        let parameters = self.gpt.num_params();
        ModelSize {
            parameters,
            trainable: parameters,
        }
    }

    /// The task the step and the loop run: training windows and the fixed
    /// evaluation batches of each split, on `inner` (the device without
    /// autodiff). Errors where a split is shorter than one window.
    pub(crate) fn task(&self, config: &RunConfig, inner: &Device) -> Result<LmTask, TrainError> {
        self.shared_task(config, inner, 0, 1)
    }

    /// The task of rank `rank` in a data-parallel job of `world` ranks:
    /// `training.batch_size` rows per rank of the global micro-batch of
    /// `batch_size × world` rows that one process would draw.
    pub(crate) fn shared_task(
        &self,
        config: &RunConfig,
        inner: &Device,
        rank: usize,
        world: usize,
    ) -> Result<LmTask, TrainError> {
        let block = config.model.max_length;
        let t = &config.training;
        let eval_seed = t.seed ^ 0xE7A1_0000_0000_0000;
        let windows = |tokens: &Arc<dyn TokenSpan>, batch, seed, split| {
            LmWindows::over(Arc::clone(tokens), batch, block, seed, split).map_err(|e| {
                TrainError::CorpusTooShort {
                    path: self.source.clone(),
                    why: e.to_string(),
                    remedy: short_split_remedy(&self.source, split),
                }
            })
        };
        let eval_batch = config.eval.batch_size;
        Ok(LmTask {
            train: Arc::new(
                windows(
                    &self.train_tokens,
                    t.batch_size * world,
                    t.seed,
                    Split::Train,
                )?
                .share(rank, world)?,
            ),
            eval_train: windows(&self.train_tokens, eval_batch, eval_seed, Split::Train)?,
            eval_val: windows(&self.val_tokens, eval_batch, eval_seed, Split::Val)?,
            eval_iters: config.eval.eval_iters as u64,
            inner: inner.clone(),
            flops_per_token: self.gpt.flops_per_token(),
            label_smoothing: t.label_smoothing,
        })
    }
}

/// Trains the language model of `config` in a new run directory.
pub(crate) fn train(
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    // Everything that can fail on bad input fails before the run directory exists.
    let rank_config = on_rank_device(config, options.group.as_deref(), &options.hardware);
    let device = open_device(&rank_config, options.hardware.gpu_vendor())?;
    note_collectives(&device, &rank_config, options, observer)?;
    let prepared = prepare_in_turn(options.group.as_deref(), || {
        prepare_observed(config, TokenizerFrom::Config, observer)
    })?;
    let (session, model) = Session::new(config, device, prepared, None, options)?;
    let run = if options.writes() {
        RunDir::start(config, options)?
    } else {
        RunDir::elsewhere()
    };
    let _lock = run.lock()?;
    run.write("tokenizer.json", &session.prepared.tokenizer.to_json()?)?;
    write_fingerprint(&run, &session.prepared.fingerprint()?)?;
    run.start_tensorboard(config)?;
    session.run(model, &run, options, observer)
}

/// Continues the language-model run in `run` from its newest good
/// checkpoint; a run killed before its first checkpoint (or whose every
/// checkpoint is damaged) starts again from step 0 in the same directory.
pub(crate) fn resume(
    resumed: &ResumedConfig,
    from_step: Option<u64>,
    run: &RunDir,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<Outcome, TrainError> {
    let config = &resumed.config;
    let found = match from_step {
        Some(step) => {
            checkpoint::at_step(&run.checkpoints(), step).map(|(i, s)| (i, s, Vec::new()))
        }
        None => checkpoint::latest_good(&run.checkpoints()),
    };
    let from = match found {
        Ok((info, mut state, notes)) => {
            check_resume_length(resumed, info.step)?;
            check_resume_world(resumed, state.world_size, options.world_size())?;
            // The loader counts global micro-batches: every rank's rows.
            state.loader_position = loader_position_for(
                state.loader_position,
                resumed.saved.training.batch_size * state.world_size as usize,
                config.training.batch_size * options.world_size(),
            );
            for note in notes {
                observer.event(&Event::Note(note));
            }
            observer.event(&Event::Note(format!(
                "resuming `{}` from step {} ({})",
                run.path.display(),
                info.step,
                info.path.display()
            )));
            let max_steps = config.training.max_steps as u64;
            if max_steps > 0 && info.step >= max_steps {
                observer.event(&Event::Note(format!(
                    "the run has taken its {max_steps} steps; to train it further: kiln resume {} training.max_steps={}",
                    run.path.display(),
                    max_steps * 2
                )));
            }
            Some((info, state))
        }
        Err(TrainError::NoCheckpoint { why, .. }) if from_step.is_none() => {
            observer.event(&Event::Note(format!(
                "no usable checkpoint in `{}` ({why}): starting the run again from step 0 in the same directory",
                run.path.display()
            )));
            None
        }
        Err(e) => return Err(e),
    };
    let rank_config = on_rank_device(config, options.group.as_deref(), &options.hardware);
    let device = open_device(&rank_config, options.hardware.gpu_vendor())?;
    note_collectives(&device, &rank_config, options, observer)?;
    let tokenizer = run.file("tokenizer.json");
    // Killed before it saved its tokenizer, a run makes it again (the same
    // config makes the same tokenizer).
    let saved = tokenizer.is_file();
    let from_tokenizer = if saved {
        TokenizerFrom::File(&tokenizer)
    } else {
        TokenizerFrom::Config
    };
    let prepared = prepare_in_turn(options.group.as_deref(), || {
        prepare_observed(config, from_tokenizer, observer)
    })?;
    if !saved {
        run.write("tokenizer.json", &prepared.tokenizer.to_json()?)?;
    }
    let now = prepared.fingerprint()?;
    if from.is_some()
        && let Some(then) = read_fingerprint(run)
        && let Some(how) = then.differs(&now)
    {
        observer.event(&Event::Note(format!(
            "warning: the data is not what the run trained on: `{}` now holds {how}; the batches from here are not those the run would have drawn (an exact resume needs the same tokens)",
            config.data.path
        )));
    }
    write_fingerprint(run, &now)?;
    let step = from.as_ref().map_or(0, |(info, _)| info.step);
    let resume_from = from.map(|(info, state)| (info.path, state));
    let (session, model) = Session::new(config, device, prepared, resume_from, options)?;
    // Everything that can refuse the resume has run: the run takes the changes.
    run.record_resume(resumed, Some(step), observer)?;
    if from_step.is_some()
        && run.writes()
        && let Some(aside) = checkpoint::set_aside_after(run, step)?
    {
        observer.event(&Event::Note(format!(
            "what the run wrote after step {step} (newer checkpoints, metrics, a summary, a best model) is kept in `{}`",
            aside.display()
        )));
        let evals = run.records().into_iter().filter_map(|r| match r {
            Record::Eval(e) if e.step <= step => lm_val_loss(&e).map(|v| (e.step, v)),
            _ => None,
        });
        let best_step = first_lowest(evals).map(|(s, _)| s);
        if let Some(note) = checkpoint::restore_best(run, step, best_step)? {
            observer.event(&Event::Note(note));
        }
    }
    run.records_go_on_after(config, step)?;
    session.run(model, run, options, observer)
}

/// A data-parallel rank trains on GPU `LOCAL_RANK` of its machine, as
/// torchrun's ranks take `cuda:LOCAL_RANK` (modulo the GPUs there are).
pub(crate) fn on_rank_device(
    config: &RunConfig,
    group: Option<&Group>,
    hardware: &HardwareReport,
) -> RunConfig {
    let mut config = config.clone();
    if let Some(group) = group {
        // More ranks than GPUs (NCCL 2.30's ranks sharing a GPU) wrap round.
        let gpus = kiln_plan::rank_gpu_count(hardware);
        config.device.index = group.local_rank() % gpus;
    }
    config
}

/// How long a job's other ranks wait for rank 0 to prepare the corpus
/// (a rank 0 that dies ends the wait at once).
const PREPARE_WAIT: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// `prepare` (the corpus prepared, or read where it was) in a data-parallel
/// job: rank 0 first, the others once it is done, so that a corpus
/// prepared into a token store (or a token cache) is written once, by
/// rank 0, and read by the rest.
pub(crate) fn prepare_in_turn<T>(
    group: Option<&Group>,
    prepare: impl FnOnce() -> Result<T, TrainError>,
) -> Result<T, TrainError> {
    match group {
        None => prepare(),
        Some(group) if group.is_root() => {
            let prepared = prepare()?;
            group.barrier(PREPARE_WAIT)?;
            Ok(prepared)
        }
        Some(group) => {
            group.barrier(PREPARE_WAIT)?;
            prepare()
        }
    }
}

/// A job on CUDA devices reduces its gradients through NCCL, the engine of
/// PyTorch DDP, on the GPU (in place; reduce-scattered under ZeRO-2, whose
/// weights NCCL all-gathers on the GPU too; `COLLECTIVES=sockets` keeps
/// the rendezvous's sockets; `KILN_NCCL_VIA_HOST=1` takes them through
/// host memory to NCCL); elsewhere (flex, wgpu) over the sockets, through
/// host memory.
///
/// Returns what reduces the gradients, for the run's notes. `config` is
/// the rank's ([`on_rank_device`]).
pub(crate) fn collectives(
    device: &DeviceChoice,
    group: &Group,
    config: &RunConfig,
) -> Result<String, TrainError> {
    let reduce_dtype = match config.precision.reduce_dtype {
        kiln_config::ReduceDtype::F32 => "",
        kiln_config::ReduceDtype::Bf16 => ", in bf16 (precision.reduce_dtype)",
    };
    let zero = match config.optimization.zero_stage {
        0 => "",
        1 => {
            "; ZeRO-1 (optimization.zero_stage): each rank updates its share of the parameters, and the weights are all-gathered"
        }
        _ => {
            "; ZeRO-2 (optimization.zero_stage): reduce-scattered, each rank receiving its share's average, which it updates, and the weights are all-gathered"
        }
    };
    let dtype = format!("{reduce_dtype}{zero}");
    let world = group.world_size();
    let one = if world == 1 { " (a job of one)" } else { "" };
    let ranks = format!("{}{one}", kiln_plan::counted(world, "rank"));
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        // The rank's GPU (`on_rank_device`: LOCAL_RANK modulo the GPUs, so
        // that ranks sharing a GPU share its NCCL device too).
        return Ok(match group.use_nccl(config.device.index)? {
            Some(v) => format!(
                "NCCL {}.{}.{} reduces the gradients of the {ranks} {}{dtype}",
                v / 10000,
                (v / 100) % 100,
                v % 100,
                match crate::params::nccl_through_host(&device.device) {
                    Some(why) => format!("through host memory ({why})"),
                    None if config.optimization.zero_stage >= 2 => {
                        "on the GPU (ncclReduceScatter)".to_string()
                    }
                    None => "in place on the GPU".to_string(),
                }
            ),
            None => format!(
                "COLLECTIVES=sockets: the gradients are reduced over the rendezvous's sockets, through host memory{dtype}"
            ),
        });
    }
    Ok(format!(
        "the gradients of the {ranks} are reduced over the rendezvous's sockets through rank 0 ({}){dtype}",
        device.name
    ))
}

/// [`collectives`] of a job's rank, told to `observer`; nothing alone.
pub(crate) fn note_collectives(
    device: &DeviceChoice,
    config: &RunConfig,
    options: &TrainOptions,
    observer: &mut dyn Observer,
) -> Result<(), TrainError> {
    if let Some(group) = &options.group {
        observer.event(&Event::Note(collectives(device, group, config)?));
    }
    Ok(())
}

/// A resume keeps the global batch (micro-batch × accumulation × ranks)
/// the run trained with: another world size is allowed where the
/// micro-batch or the accumulation makes up for it, and refused otherwise,
/// with the settings that would.
fn check_resume_world(
    resumed: &ResumedConfig,
    saved_world: u64,
    world: usize,
) -> Result<(), TrainError> {
    let saved = &resumed.saved.training;
    let now = &resumed.config.training;
    let saved_world = saved_world.max(1) as usize;
    let before = saved.batch_size * saved.gradient_accumulation_steps * saved_world;
    let after = now.batch_size * now.gradient_accumulation_steps * world;
    if before == after {
        return Ok(());
    }
    let per_rank = before / world;
    let ranks = |n: usize| kiln_plan::counted(n, "rank");
    let hint = if before.is_multiple_of(world) && per_rank.is_multiple_of(now.batch_size) {
        format!(
            "; with {}, resume with training.gradient_accumulation_steps={}",
            ranks(world),
            per_rank / now.batch_size
        )
    } else {
        format!(
            "; launch {}, or choose ranks, micro-batch and accumulation whose product is {before}",
            ranks(saved_world)
        )
    };
    Err(TrainError::WorldSize {
        world,
        why: format!(
            "the run trained with a global batch of {before} sequences (micro-batch {} × accumulation {} × {}), and {} × {} × {} make {after}, which would change the training{hint}",
            saved.batch_size,
            saved.gradient_accumulation_steps,
            ranks(saved_world),
            ranks(world),
            now.batch_size,
            now.gradient_accumulation_steps,
        ),
    })
}

/// A new `training.max_steps` must leave steps to take after the checkpoint.
fn check_resume_length(resumed: &ResumedConfig, step: u64) -> Result<(), TrainError> {
    let max_steps = resumed.config.training.max_steps as u64;
    match resumed
        .changes
        .iter()
        .find(|c| c.key == "training.max_steps")
    {
        Some(change) if max_steps > 0 && max_steps <= step => {
            Err(TrainError::Config(ConfigError::InvalidValue {
                key: change.key.clone(),
                value: change.to.clone(),
                problem: format!(
                    "the run resumes from its checkpoint of step {step}, so training.max_steps must be larger to leave steps to train"
                ),
                set_by: Box::new(change.source.clone()),
            }))
        }
        _ => Ok(()),
    }
}

/// The loader's position (micro-batches drawn) after a resume that changes
/// the micro-batch from `saved` to `batch` rows: the windows drawn so far,
/// in the new micro-batches. A language model's batches are random windows
/// drawn by index, so the run goes on with new ones; with the effective
/// batch kept (the batch lowered and the accumulation raised by the same
/// factor) it is at the same optimizer step of the stream. With the
/// micro-batch unchanged it is the saved position, so a plain resume stays
/// bitwise. (The config's checks keep `batch` at 1 or more.)
fn loader_position_for(position: u64, saved: usize, batch: usize) -> u64 {
    position * saved as u64 / batch as u64
}

pub(crate) fn make_tokenizer(config: &RunConfig, text: &str) -> Result<Tokenizer, TrainError> {
    if let Some(file) = &config.data.tokenizer_file {
        return Ok(Tokenizer::load(Path::new(file))?);
    }
    let kind = match config.data.tokenizer {
        // Characters come from the whole corpus, as nanoGPT does: a character
        // seen only in validation text would otherwise be unencodable.
        ConfigTokenizer::Char => return Ok(Tokenizer::char_level(text)?),
        ConfigTokenizer::Gpt2 => return Ok(Tokenizer::gpt2()?),
        ConfigTokenizer::Bpe => TokenizerKind::Bpe {
            vocab_size: config.data.vocab_size,
        },
        ConfigTokenizer::Wordpiece => {
            return Err(TrainError::Unsupported(
                "data.tokenizer = wordpiece",
                "WordPiece comes with the nli workload; use char or bpe for a language model"
                    .into(),
            ));
        }
    };
    // Learned tokenizers see the training part of the text only.
    let cut = text
        .char_indices()
        .nth(((text.chars().count() as f64) * (1.0 - config.data.val_fraction)) as usize)
        .map_or(text.len(), |(i, _)| i);
    Ok(Tokenizer::train(kind, &text[..cut])?)
}

/// The language-model workload for the shared step and loop.
pub(crate) struct LmTask {
    train: Arc<LmWindows>,
    eval_train: LmWindows,
    eval_val: LmWindows,
    eval_iters: u64,
    /// The device evaluation runs on (no autodiff).
    inner: Device,
    flops_per_token: f64,
    /// `training.label_smoothing`: the training loss's ε (evaluation's
    /// loss is the plain cross-entropy).
    label_smoothing: f64,
}

impl Task for LmTask {
    type Model = Gpt;
    type Source = LmWindows;
    type Inputs = (Tensor<2, Int>, Tensor<2, Int>);

    fn source(&self) -> Arc<LmWindows> {
        Arc::clone(&self.train)
    }

    fn upload(&self, batch: &TokenBatch, device: &Device) -> Self::Inputs {
        batch_tensors(batch, device)
    }

    fn loss(&self, model: &Gpt, (x, y): Self::Inputs) -> Tensor<1> {
        model.smoothed_loss(x, y, self.label_smoothing)
    }

    fn work(&self, batch: &TokenBatch) -> Work {
        let tokens = batch.batch_size * batch.block;
        Work {
            samples: batch.batch_size,
            tokens,
            padded_tokens: tokens,
            flops: self.flops_per_token * tokens as f64,
        }
    }

    /// Mean loss over `eval_iters` fixed batches of each split, without
    /// autodiff; cut short where `stop` is asked between two batches.
    fn evaluate(
        &self,
        model: &Gpt,
        _step: u64,
        stop: StopAsked<'_>,
    ) -> Result<Option<Evaluation>, TrainError> {
        let model = model.valid();
        // The training split's batches, then the validation split's.
        let iters = self.eval_iters as usize;
        let losses = evaluate_shared(2 * iters, stop, |i| {
            let (windows, j) = match i < iters {
                true => (&self.eval_train, i),
                false => (&self.eval_val, i - iters),
            };
            let (x, y) = batch_tensors(&windows.batch(j as u64)?, &self.inner);
            Ok(vec![model.loss(x, y).into_scalar::<f32>()])
        })?;
        let Some(losses) = losses else {
            return Ok(None);
        };
        let mean =
            |split: &[Vec<f32>]| split.iter().map(|l| f64::from(l[0])).sum::<f64>() / iters as f64;
        let (train_loss, val_loss) = (mean(&losses[..iters]), mean(&losses[iters..]));
        Ok(Some(Evaluation {
            metrics: EvalMetrics::Lm {
                train_loss,
                val_loss,
            },
            // The lower the validation loss the better: the best model is
            // kept (best.safetensors) and `eval.patience` counts from it.
            score: Some(-val_loss),
        }))
    }
}

/// The first of `evals` (step, validation loss) with the lowest loss: the
/// model the loop kept as the best (a tie is no better, and a loss that is
/// not finite never the best, as [`crate::trainer::EarlyStopping`] keeps).
fn first_lowest(evals: impl IntoIterator<Item = (u64, f64)>) -> Option<(u64, f64)> {
    let finite = evals.into_iter().filter(|e| e.1.is_finite());
    finite.fold(None, |best, e| match best {
        Some(b) if b.1 <= e.1 => Some(b),
        _ => Some(e),
    })
}

/// A language model's evaluation's validation loss.
fn lm_val_loss(e: &EvalRecord) -> Option<f64> {
    match e.metrics {
        EvalMetrics::Lm { val_loss, .. } => Some(val_loss),
        EvalMetrics::Nli { .. } => None,
    }
}

/// `records` with each evaluation's score, where a run written before
/// language models had one left it out: its validation loss negated, as
/// [`LmTask::evaluate`] scores.
fn scored(records: Vec<Record>) -> Vec<Record> {
    records
        .into_iter()
        .map(|r| match r {
            Record::Eval(mut e) => {
                e.score = e.score.or(lm_val_loss(&e).map(|v| -v));
                Record::Eval(e)
            }
            other => other,
        })
        .collect()
}

/// A prepared run: the task, the model shape, and where it starts.
struct Session {
    config: RunConfig,
    device: DeviceChoice,
    train_device: Device,
    prepared: Prepared,
    optim: AdamW,
    task: LmTask,
    start: LoopPlanStart,
    precision: crate::precision::PrecisionChoice,
    /// Where the weights came from (`model.init_from`), for the start lines.
    init_note: Option<String>,
}

impl Session {
    /// Refuses a CPU run whose step would not fit in memory
    /// ([`Prepared::refuse_over_memory`]) before anything is built.
    fn new(
        config: &RunConfig,
        device: DeviceChoice,
        prepared: Prepared,
        resume_from: Option<(PathBuf, CheckpointState)>,
        options: &TrainOptions,
    ) -> Result<(Self, Gpt), TrainError> {
        prepared.refuse_over_memory(config, &device, options)?;
        let hardware = &options.hardware;
        let rank = options.group.as_ref().map_or(0, |g| g.rank());
        let task = prepared.shared_task(config, &device.device, rank, options.world_size())?;
        let seed = config.training.seed;
        let gpt = &prepared.gpt;
        let train_device = train_device(config, &device.device, seed);
        let precision = run_precision(config, &device, hardware);
        crate::setup::check_attention_choice(config, &device, &precision)?;
        // A fresh start from `model.init_from`'s weights, a resume from its
        // checkpoint's: either holds every weight, so none is drawn first
        // (the loop reseeds the generator every step: dropout draws the same).
        let pretrained = match resume_from {
            None => crate::pretrained::open(config, &prepared.tokenizer)?,
            Some(_) => None,
        };
        let init_note = pretrained
            .as_ref()
            .map(|p| p.describe(config, gpt.padded_vocab()));
        let mut model = match &pretrained {
            Some(pretrained) => {
                pretrained.load_into(gpt.init_unset(&train_device), &train_device)?
            }
            None if resume_from.is_some() => gpt.init_unset(&train_device),
            None => init_model(config, &train_device, seed, |d| gpt.init(d)),
        };
        let mut optim = AdamW::for_run(config, &model, options.group.as_deref());
        let mut start = LoopPlanStart {
            first_step: 1,
            ..LoopPlanStart::default()
        };
        if let Some((path, state)) = resume_from {
            (model, start) = restore(
                model,
                &mut optim,
                state,
                &path,
                &train_device,
                &device.device,
            )?;
        }
        let model = model
            .with_compute(precision.compute)
            .with_kernels(kernels(config))
            .with_attention(crate::translate::attention(config));
        let session = Self {
            config: config.clone(),
            device,
            precision,
            train_device,
            prepared,
            optim,
            task,
            start,
            init_note,
        };
        Ok((session, model))
    }

    fn start_lines(&self, options: &TrainOptions, peak_name: &str) -> Vec<String> {
        let c = &self.config;
        let t = &c.training;
        let p = &self.prepared;
        let gpt = &p.gpt;
        let vocab = p.tokenizer.vocab_size();
        let mut lines = vec![
            format!(
                "data: {} — {} tokens ({}), vocabulary {vocab}",
                p.source.display(),
                p.train_tokens.len() + p.val_tokens.len(),
                p.origin,
            ),
            format!(
                "model: GPT, {} × {} × {} wide, block {}, {:.2} M parameters, {:.2} M FLOPs per token",
                crate::counted(gpt.layers, "layer"),
                crate::counted(gpt.heads, "head"),
                gpt.hidden,
                gpt.block_size,
                gpt.num_params() as f64 / 1e6,
                gpt.flops_per_token() / 1e6
            ),
        ];
        // A store's tokenizer said so as it was trained (kiln prepare).
        if p.store.is_none() {
            lines.extend(tokens::vocabulary_short(c, vocab));
        }
        lines.extend(self.init_note.clone());
        lines.extend(device_lines(
            c,
            &self.device,
            &self.precision,
            options,
            peak_name,
        ));
        let world = options.world_size();
        let ranks = if world > 1 {
            format!(" × {world} ranks")
        } else {
            String::new()
        };
        lines.push(format!(
            "batch: {} × {} tokens, accumulation {}{ranks} → {} sequences ({} tokens) per optimizer step",
            t.batch_size,
            c.model.max_length,
            t.gradient_accumulation_steps,
            c.effective_batch() * world,
            c.effective_batch() * world * c.model.max_length
        ));
        lines.push(schedule_line(c, &p.schedule));
        lines.extend(schedule_warnings(c, &p.schedule));
        if let Some(shard) = &self.optim.shard {
            lines.push(format!("optimizer: {}", shard.describe()));
        }
        lines
    }

    fn run(
        mut self,
        model: Gpt,
        run: &RunDir,
        options: &TrainOptions,
        observer: &mut dyn Observer,
    ) -> Result<Outcome, TrainError> {
        let started = Instant::now();
        let (peak, peak_name) = mfu_peak(
            &self.config,
            &self.device,
            &self.precision,
            &options.hardware,
        );
        let schedule = self.prepared.schedule;
        observer.event(&Event::Start {
            lines: self.start_lines(options, &peak_name),
            first_step: self.start.first_step,
            total_steps: schedule.total_steps,
            fold: None,
        });
        let mut plan = LoopPlan {
            first_step: self.start.first_step,
            schedule,
            loader_start: self.start.loader_start,
            tokens_seen: self.start.tokens_seen,
            wall_before: self.start.wall_before,
            eval_at_epoch_ends: false,
            stopping: EarlyStopping::from_records(
                (self.config.eval.patience > 0).then_some(self.config.eval.patience),
                &scored(run.records()),
            ),
            peak_flops: peak,
            scaler: self
                .start
                .scaler(self.precision.loss_scaling(), &self.config),
            eval_pending: self.start.eval_pending,
        };
        let (model, end) = run_loop(
            &self.task,
            model,
            &mut self.optim,
            &self.train_device,
            &self.config,
            &mut plan,
            run,
            options,
            observer,
        )?;
        if let LoopEnd::Interrupted { step, checkpoint } = end {
            return Ok(Outcome::Interrupted {
                run: run.path.clone(),
                step,
                checkpoint,
            });
        }
        if run.writes() {
            // A stop asked now ends the samples, not the run: it has its
            // steps, and its summary follows (rank 0 alone samples: no
            // rank waits on another here).
            self.write_samples(&model, run, observer, Some(&options.interrupt))?;
        }
        let summary = self.summarise(
            run,
            &peak_name,
            &options.hardware,
            plan.tokens_seen,
            self.start.wall_before + started.elapsed().as_secs_f64(),
        );
        run.write(
            "summary.json",
            &serde_json::to_string_pretty(&summary).unwrap_or_default(),
        )?;
        observer.event(&Event::Done(summary.clone()));
        Ok(Outcome::Finished {
            run: run.path.clone(),
            summary,
        })
    }

    /// The final model's samples in `samples.txt`; where its logits are
    /// not finite (training diverged, in fewer bad steps in a row than
    /// precision.max_bad_steps stops at), the reason there instead, and in
    /// a note: the run still ends with its summary. Cut short where `stop`
    /// is asked (the run has its steps; the summary follows).
    fn write_samples(
        &self,
        model: &Gpt,
        run: &RunDir,
        observer: &mut dyn Observer,
        stop: Option<&AtomicBool>,
    ) -> Result<(), TrainError> {
        let s = &self.config.sample;
        let generated = match crate::generate::generate_texts(
            model,
            "the run's final model",
            &self.prepared.tokenizer,
            "\n",
            s,
            self.config.training.seed,
            &self.device.device,
            stop,
        ) {
            Ok(generated) => generated,
            Err(e @ TrainError::Diverged { .. }) => {
                let why = format!("no samples: {e}");
                observer.event(&Event::Note(why.clone()));
                return run.write("samples.txt", &format!("{why}\n"));
            }
            Err(e) => return Err(e),
        };
        let mut text = String::new();
        for (i, sample) in generated.texts.iter().enumerate() {
            text.push_str(&format!(
                "--- sample {} (temperature {}, top-k {})\n{sample}\n",
                i + 1,
                s.temperature,
                s.top_k
            ));
        }
        if generated.cut_short {
            let why = format!(
                "samples cut short by the stop ({} of {} begun); `kiln sample {}` draws them",
                generated.texts.len(),
                s.count,
                run.path.display()
            );
            text.push_str(&format!("--- {why}\n"));
            observer.event(&Event::Note(why));
        }
        run.write("samples.txt", &text)
    }

    fn summarise(
        &self,
        run: &RunDir,
        peak_name: &str,
        hardware: &HardwareReport,
        tokens_seen: u64,
        wall_s: f64,
    ) -> Summary {
        let mut steps: Vec<StepMetrics> = Vec::new();
        let mut evals: Vec<LmEval> = Vec::new();
        for record in run.records() {
            match record {
                Record::Step(s) => steps.push(s),
                Record::Eval(e) => {
                    if let EvalMetrics::Lm {
                        train_loss,
                        val_loss,
                    } = e.metrics
                    {
                        evals.push(LmEval {
                            step: e.step,
                            train_loss,
                            val_loss,
                        });
                    }
                }
                _ => {}
            }
        }
        if run.writes() {
            let _ = write_plots(&run.path, &steps, &evals);
        }
        let best = first_lowest(evals.iter().map(|e| (e.step, e.val_loss)));
        // The first logged steps include start-up costs: leave them out of the medians.
        let steady: Vec<&StepMetrics> = steps.iter().filter(|s| s.step > 3).collect();
        let steady = if steady.is_empty() {
            steps.iter().collect()
        } else {
            steady
        };
        let mut tps: Vec<f64> = steady.iter().map(|s| s.tokens_per_s).collect();
        let mut ms: Vec<f64> = steady.iter().map(|s| s.ms_per_step).collect();
        let mut mfu: Vec<f64> = steady.iter().filter_map(|s| s.mfu).collect();
        let mut wait: Vec<f64> = steady.iter().map(|s| s.data_wait_pct).collect();
        let median_mfu = (!mfu.is_empty()).then(|| median(&mut mfu));
        let data_wait_pct = median(&mut wait);
        let mut comm: Vec<f64> = steady.iter().filter_map(|s| s.comm_pct).collect();
        let comm_pct = (!comm.is_empty()).then(|| median(&mut comm));
        let peak_memory = steps.iter().map(|s| s.peak_memory_bytes).max().unwrap_or(0);
        // A GPU run's memory is its allocator's, against the GPU's memory
        // (the first GPU's: kiln trains on one kind at a time).
        let on_gpu = steps.iter().any(|s| s.device_memory);
        let memory_total = match hardware.gpus().first() {
            Some(gpu) if on_gpu => gpu.memory_total_bytes,
            _ => hardware.memory.total_bytes,
        };
        Summary {
            steps: steps.last().map_or(0, |s| s.step),
            tokens_seen,
            final_train_loss: evals.last().map(|e| e.train_loss),
            final_val_loss: evals.last().map(|e| e.val_loss),
            best_val_loss: best.map(|(_, loss)| loss),
            best_step: best.map(|(step, _)| step),
            median_tokens_per_s: median(&mut tps),
            median_ms_per_step: median(&mut ms),
            median_mfu,
            mfu_peak: peak_name.to_string(),
            data_wait_pct,
            comm_pct,
            peak_memory_bytes: peak_memory,
            peak_memory_on_gpu: on_gpu,
            wall_s,
            held_back_by: held_back_by(
                data_wait_pct,
                (peak_memory, memory_total, on_gpu),
                median_mfu,
                comm_pct,
            ),
        }
    }
}

/// Input and target tensors of a batch on `device` (the host-to-device copy).
pub(crate) fn batch_tensors(
    batch: &TokenBatch,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let shape = [batch.batch_size, batch.block];
    let to = |ids: &[u32]| {
        let data: Vec<i64> = ids.iter().map(|&i| i64::from(i)).collect();
        Tensor::<2, Int>::from_data(TensorData::new(data, shape), device)
    };
    (to(&batch.inputs), to(&batch.targets))
}

#[cfg(test)]
mod tests {
    use super::{EarlyStopping, Record, first_lowest, loader_position_for, scored};

    /// The summary's and `resume --from`'s best: the first lowest finite
    /// loss, as the loop keeps it.
    #[test]
    fn the_best_evaluation_is_the_first_lowest_finite_loss() {
        let best = first_lowest([(1, f64::NAN), (2, 3.0), (3, 2.0), (4, f64::NAN), (5, 2.0)]);
        assert_eq!(best, Some((3, 2.0)));
        assert_eq!(first_lowest([(1, f64::NAN), (2, f64::INFINITY)]), None);
    }

    /// An evaluation line of a run written before language models had a
    /// score (`{"kind":"eval","step":..,"train_loss":..,"val_loss":..}`)
    /// counts for the best model as a new one does: the lower loss wins.
    #[test]
    fn evaluations_without_a_score_are_scored_by_their_validation_loss() {
        let line = |step: u64, val: f64| -> Record {
            serde_json::from_str(&format!(
                r#"{{"kind":"eval","step":{step},"train_loss":3.0,"val_loss":{val}}}"#
            ))
            .expect("an old eval line")
        };
        let records = scored(vec![line(25, 2.5), line(50, 2.25), line(75, 2.4)]);
        let stopping = EarlyStopping::from_records(Some(3), &records);
        assert_eq!(stopping.best, Some(-2.25));
        assert_eq!(stopping.since_best, 1);
    }

    #[test]
    fn a_smaller_micro_batch_continues_after_the_windows_drawn() {
        // 100 steps of 8 windows: 800 windows, 200 micro-batches of 4.
        assert_eq!(loader_position_for(100, 8, 4), 200);
        assert_eq!(loader_position_for(200, 4, 8), 100);
        // Unchanged: the position as saved (a plain resume is bitwise).
        assert_eq!(loader_position_for(123, 12, 12), 123);
        // Not a whole number of new micro-batches: rounded down.
        assert_eq!(loader_position_for(10, 12, 8), 15);
        assert_eq!(loader_position_for(11, 12, 8), 16);
    }
}
