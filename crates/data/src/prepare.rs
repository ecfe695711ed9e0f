//! `prepare`: documents in, a token store out, with bounded memory.
//!
//! A reader thread streams the documents in input order and cuts each into
//! pieces of about `part_bytes` where the tokenizer's ids do not change
//! ([`Tokenizer::split_point`]); each piece goes to the training or the
//! validation split by a rule on bytes alone (the split's share of the text
//! read so far kept nearest `val_fraction`), so whole documents go to one
//! side (documents longer than a piece are spread over pieces). The main
//! thread encodes a batch of pieces in parallel (rayon), then appends the
//! ids in input order, an end-of-text token before each document, as
//! llm.c's `fineweb.py` does: the bytes do not depend on the thread count.
//!
//! Each split fills `<split>_NNNNNN.bin.partial` (llm.c's header left to
//! write) and renames it to its shard name once full; after every batch the
//! partial files are synced and `progress.json` records how far the input
//! has been written. A prepare killed at any moment and run again truncates
//! the partial files to that record, skips the pieces already written
//! (reading, not encoding, them again) and ends with the bytes of an
//! uninterrupted run.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::Instant;

use crossbeam_channel::bounded;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::documents::{InputFile, Piece, ReadOptions, SkippedRows, read_file};
use crate::store::shard::{HEADER_BYTES, TokenWidth, encode_tokens, header};
use crate::store::{MANIFEST, Manifest, PrepareSettings, ShardInfo, TOKENIZER, TokenizerInfo};
use crate::{DataError, Tokenizer};

/// What `prepare` reads and writes.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// The input files, in order.
    pub inputs: Vec<InputFile>,
    /// The settings (recorded in the manifest).
    pub settings: PrepareSettings,
    /// How to read documents.
    pub read: ReadOptions,
    /// The store's folder.
    pub out: PathBuf,
    /// Encoding threads (`None`: rayon's default, one per core).
    pub threads: Option<usize>,
    /// Text encoded per batch (memory is a few times this).
    pub batch_bytes: usize,
    /// Pieces documents are cut into (at the tokenizer's safe points).
    pub part_bytes: usize,
    /// Tests only: stop with an error after this many batches are written,
    /// leaving the folder as a kill there would.
    #[doc(hidden)]
    pub fail_after_batches: Option<u64>,
}

impl PrepareOptions {
    /// Options with the default batch (16 MiB) and piece (256 KiB) sizes.
    pub fn new(
        inputs: Vec<InputFile>,
        settings: PrepareSettings,
        read: ReadOptions,
        out: PathBuf,
    ) -> Self {
        Self {
            inputs,
            settings,
            read,
            out,
            threads: None,
            batch_bytes: 16 << 20,
            part_bytes: 256 << 10,
            fail_after_batches: None,
        }
    }
}

/// How far a prepare is, for a progress bar.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrepareProgress {
    /// Input bytes read (compressed, as on disk).
    pub read_bytes: u64,
    /// Input bytes in all.
    pub total_bytes: u64,
    /// Tokens written (this run and the one it continues).
    pub tokens: u64,
    /// Documents read.
    pub documents: u64,
    /// Whether this batch was only read again (written by an earlier run).
    pub skipping: bool,
}

/// What `prepare` did.
#[derive(Clone, Debug)]
pub struct PrepareOutcome {
    /// The store's manifest.
    pub manifest: Manifest,
    /// The store was complete already: nothing was done.
    pub already_prepared: bool,
    /// Pieces an interrupted run had written, skipped this time (0: a fresh run).
    pub resumed_after_pieces: u64,
    /// Seconds spent.
    pub seconds: f64,
}

/// The state written after each batch, to continue from.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Progress {
    settings: PrepareSettings,
    inputs: Vec<InputFile>,
    /// Bytes of text the tokenizer learned from (for the manifest).
    trained_on_bytes: u64,
    /// Pieces fully written.
    next_piece: u64,
    shards: Vec<ShardInfo>,
    train: PartialState,
    val: PartialState,
}

impl Progress {
    /// Where the prepare in `out` stands, written atomically.
    fn write(&self, out: &Path) -> Result<(), DataError> {
        write_json(&out.join(PROGRESS), self)
    }

    /// Records the writers' state once `next_piece` pieces are on disk.
    fn record(
        &mut self,
        next_piece: u64,
        shards: &[ShardInfo],
        train: &SplitWriter,
        val: &SplitWriter,
        out: &Path,
    ) -> Result<(), DataError> {
        self.next_piece = next_piece;
        self.shards = shards.to_vec();
        self.train = train.partial;
        self.val = val.partial;
        self.write(out)
    }
}

#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
struct PartialState {
    index: u32,
    tokens: usize,
    documents: u64,
}

const PROGRESS: &str = "progress.json";

/// Prepares the store in `options.out` with `tokenizer` (which must have an
/// end-of-text token: [`Tokenizer::with_end_of_text`]). A complete store of
/// the same settings and inputs is left as it is; an interrupted one is
/// continued (with the tokenizer and `trained_on_bytes` it started with,
/// whatever is passed); a folder holding anything else is refused.
/// `trained_on_bytes`: the text a trained tokenizer learned from, for the
/// manifest (0 for one not trained).
pub fn prepare(
    options: &PrepareOptions,
    tokenizer: &Tokenizer,
    trained_on_bytes: u64,
    on_progress: &mut dyn FnMut(&PrepareProgress),
) -> Result<PrepareOutcome, DataError> {
    let started = Instant::now();
    let out = &options.out;
    let eot = tokenizer
        .end_of_text()
        .ok_or_else(|| DataError::InvalidArgument {
            what: "tokenizer",
            why: "a token store needs an end-of-text token between documents".into(),
        })?;
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Write { path, source }
    };
    if let Some(existing) = existing_state(options)? {
        match existing {
            Existing::Complete(manifest) => {
                return Ok(PrepareOutcome {
                    manifest,
                    already_prepared: true,
                    resumed_after_pieces: 0,
                    seconds: started.elapsed().as_secs_f64(),
                });
            }
            Existing::Partial(progress) => {
                return run(
                    options,
                    tokenizer,
                    eot,
                    trained_on_bytes,
                    Some(progress),
                    on_progress,
                    started,
                );
            }
        }
    }
    std::fs::create_dir_all(out).map_err(write_err(out))?;
    run(
        options,
        tokenizer,
        eot,
        trained_on_bytes,
        None,
        on_progress,
        started,
    )
}

enum Existing {
    Complete(Manifest),
    Partial(Progress),
}

/// What is in `out` already: a store of these settings (complete, or to
/// continue), nothing, or something else (an error).
fn existing_state(options: &PrepareOptions) -> Result<Option<Existing>, DataError> {
    let out = &options.out;
    let refuse = |why: String| DataError::StoreMismatch {
        path: out.clone(),
        why: format!("{why}; remove it or prepare into another folder (--out)"),
    };
    if out.join(MANIFEST).is_file() {
        let manifest = crate::store::read_manifest(out)?;
        if manifest.settings != options.settings || manifest.inputs != options.inputs {
            return Err(refuse(
                "it holds a store prepared from other inputs or settings".into(),
            ));
        }
        return Ok(Some(Existing::Complete(manifest)));
    }
    let progress_path = out.join(PROGRESS);
    if progress_path.is_file() {
        let text = std::fs::read_to_string(&progress_path).map_err(|source| DataError::Io {
            path: progress_path.clone(),
            source,
        })?;
        let progress: Progress = serde_json::from_str(&text)
            .map_err(|e| refuse(format!("its {PROGRESS} does not parse ({e})")))?;
        if progress.settings != options.settings || progress.inputs != options.inputs {
            return Err(refuse(
                "it holds an interrupted prepare of other inputs or settings".into(),
            ));
        }
        return Ok(Some(Existing::Partial(progress)));
    }
    if let Some(file) = crate::file_in_the_way(out).filter(|f| f != out) {
        return Err(refuse(format!(
            "`{}` is a file, not a folder",
            file.display()
        )));
    }
    if out.is_dir() {
        let mut entries = std::fs::read_dir(out).map_err(|source| DataError::Io {
            path: out.clone(),
            source,
        })?;
        if entries.next().is_some() {
            return Err(refuse("it is not empty and holds no kiln store".into()));
        }
    } else if out.exists() {
        return Err(refuse("it is a file".into()));
    }
    Ok(None)
}

/// A piece cut from a document, numbered in input order.
struct Unit {
    text: String,
    doc_start: bool,
    val: bool,
}

/// One batch from the reader: its units (only counted when `skip`), how
/// far the input was read, and the documents it began.
struct Batch {
    units: Vec<Unit>,
    read_bytes: u64,
    documents: u64,
    text_bytes: u64,
}

#[allow(clippy::too_many_arguments)] // one private call site each, all of them needed
fn run(
    options: &PrepareOptions,
    tokenizer: &Tokenizer,
    eot: u32,
    trained_on_bytes: u64,
    resume: Option<Progress>,
    on_progress: &mut dyn FnMut(&PrepareProgress),
    started: Instant,
) -> Result<PrepareOutcome, DataError> {
    let out = &options.out;
    let width = TokenWidth::for_vocab(tokenizer.vocab_size());
    let tokenizer_json = tokenizer.to_json()?;
    let tokenizer_path = out.join(TOKENIZER);
    let resumed = resume.is_some();
    let mut progress = resume.unwrap_or_else(|| Progress {
        settings: options.settings.clone(),
        inputs: options.inputs.clone(),
        trained_on_bytes,
        next_piece: 0,
        shards: Vec::new(),
        train: PartialState::default(),
        val: PartialState::default(),
    });
    if !resumed {
        // From here on the folder is a prepare to continue, even one killed
        // (or out of disk) before its first batch is written.
        progress.write(out)?;
    }
    if !tokenizer_path.is_file() {
        write_atomic(&tokenizer_path, tokenizer_json.as_bytes())?;
    }
    let resumed_after = progress.next_piece;
    let mut shards = std::mem::take(&mut progress.shards);
    let open =
        |split, state| SplitWriter::open(out, split, width, options.settings.shard_tokens, state);
    let mut train = open("train", resumed.then_some(progress.train))?;
    let mut val = open("val", resumed.then_some(progress.val))?;
    let total_bytes: u64 = options.inputs.iter().map(|f| f.bytes).sum();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(options.threads.unwrap_or(0))
        .thread_name(|i| format!("kiln-prepare-{i}"))
        .build()
        .map_err(|e| DataError::InvalidArgument {
            what: "threads",
            why: e.to_string(),
        })?;

    let (tx, rx) = bounded::<Result<Batch, DataError>>(1);
    let mut skipped = SkippedRows::default();
    let mut documents = 0u64;
    let mut text_bytes = 0u64;
    let mut next_piece = 0u64;
    let mut batches_written = 0u64;
    let mut tokens_total = (shards.iter().map(|s| s.tokens).sum::<usize>()
        + train.partial.tokens
        + val.partial.tokens) as u64;
    std::thread::scope(|scope| -> Result<(), DataError> {
        // The receiver lives in this scope and the sender in the reader, so
        // that either side's end (an error, the input's end) ends the other.
        let rx = rx;
        let reader = scope.spawn(move || {
            let mut cutter = Cutter::new(options, tokenizer, &tx);
            let mut skipped = SkippedRows::default();
            let mut base = 0u64;
            for input in &options.inputs {
                let result = read_file(input, &options.read, &mut skipped, &mut |piece, read| {
                    cutter
                        .push(piece, base + read)
                        .map(|()| ControlFlow::Continue(()))
                });
                if let Err(e) = result {
                    let _ = tx.send(Err(e));
                    return skipped;
                }
                base += input.bytes;
            }
            if let Err(e) = cutter.finish(base) {
                let _ = tx.send(Err(e));
            }
            skipped
        });
        let mut buffer = Vec::new();
        let mut write = || -> Result<(), DataError> {
            if options.fail_after_batches == Some(0) {
                return Err(DataError::Tokenizer(
                    "stopped before the first batch (a test's simulated kill)".into(),
                ));
            }
            for batch in rx.iter() {
                let batch = batch?;
                documents += batch.documents;
                text_bytes += batch.text_bytes;
                let first = next_piece;
                next_piece += batch.units.len() as u64;
                let skip_upto = resumed_after.saturating_sub(first) as usize;
                if skip_upto >= batch.units.len() {
                    on_progress(&PrepareProgress {
                        read_bytes: batch.read_bytes,
                        total_bytes,
                        tokens: tokens_total,
                        documents,
                        skipping: true,
                    });
                    continue;
                }
                let units = &batch.units[skip_upto..];
                let encoded: Vec<Result<Vec<u32>, DataError>> = pool.install(|| {
                    units
                        .par_iter()
                        .map(|u| tokenizer.encode_piece(&u.text))
                        .collect()
                });
                for (unit, ids) in units.iter().zip(encoded) {
                    let ids = ids?;
                    let writer = if unit.val { &mut val } else { &mut train };
                    if unit.doc_start {
                        writer.append(&[eot], 1, &mut buffer, &mut shards)?;
                    }
                    writer.append(&ids, 0, &mut buffer, &mut shards)?;
                    tokens_total += (ids.len() + usize::from(unit.doc_start)) as u64;
                }
                train.sync()?;
                val.sync()?;
                progress.record(next_piece, &shards, &train, &val, out)?;
                batches_written += 1;
                on_progress(&PrepareProgress {
                    read_bytes: batch.read_bytes,
                    total_bytes,
                    tokens: tokens_total,
                    documents,
                    skipping: false,
                });
                if options.fail_after_batches == Some(batches_written) {
                    return Err(DataError::Tokenizer(format!(
                        "stopped after {batches_written} batches (a test's simulated kill)"
                    )));
                }
            }
            Ok(())
        };
        let written = write();
        drop(rx);
        match reader.join() {
            Ok(s) => skipped = s,
            Err(_) => {
                return Err(DataError::Tokenizer("the document reader panicked".into()));
            }
        }
        written
    })?;
    // A store of nothing, which no run can train on, is refused here, where
    // the reason is known; the folder this run began goes with it, so that
    // the inputs, mended, prepare into it again.
    let refuse = |e: DataError| {
        if !resumed {
            let _ = std::fs::remove_dir_all(out);
        }
        Err(e)
    };
    // Rows skipped one by one (`data.bad_rows = "skip"`) can add up to
    // every row.
    if documents == 0 && skipped.count > 0 {
        return refuse(DataError::InvalidArgument {
            what: "data.text_field",
            why: format!(
                "no document has text: every one of the {} rows read was skipped, the first {}",
                skipped.count,
                skipped.first.first().map_or("", String::as_str)
            ),
        });
    }
    // Empty files (or compressed nothing) would make a store of end-of-text
    // markers alone.
    if text_bytes == 0 {
        return refuse(match options.inputs.as_slice() {
            [one] => DataError::Empty {
                path: one.path.clone(),
            },
            inputs => DataError::InvalidArgument {
                what: "data.path",
                why: format!("none of its {} files holds any text", inputs.len()),
            },
        });
    }
    train.finish(&mut shards)?;
    val.finish(&mut shards)?;
    // The last shards are whole: a run stopped before the manifest is
    // written (a full disk) continues from here.
    progress.record(next_piece, &shards, &train, &val, out)?;
    let manifest = Manifest {
        format: "kiln-token-store".into(),
        version: 1,
        written_by: format!("kiln-data {}", env!("CARGO_PKG_VERSION")),
        tokenizer: TokenizerInfo {
            kind: options.settings.tokenizer.clone(),
            vocab_size: tokenizer.vocab_size(),
            end_of_text: eot,
            sha256: sha256_hex(tokenizer_json.as_bytes()),
            // A continued prepare reports what the first run learned from.
            trained_on_bytes: progress.trained_on_bytes,
        },
        width,
        settings: options.settings.clone(),
        inputs: options.inputs.clone(),
        shards,
        documents,
        text_bytes,
        skipped,
    };
    write_json(&out.join(MANIFEST), &manifest)?;
    let _ = std::fs::remove_file(out.join(PROGRESS));
    Ok(PrepareOutcome {
        manifest,
        already_prepared: false,
        resumed_after_pieces: resumed_after,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// Cuts documents into pieces at the tokenizer's safe points, assigns each
/// to a split and sends them in batches.
struct Cutter<'a> {
    options: &'a PrepareOptions,
    tokenizer: &'a Tokenizer,
    tx: &'a crossbeam_channel::Sender<Result<Batch, DataError>>,
    /// The size pieces are cut to ([`piece_bytes`]).
    part: usize,
    /// The current document's text not yet cut off.
    pending: String,
    pending_start: bool,
    batch: Vec<Unit>,
    batch_bytes: usize,
    batch_docs: u64,
    batch_text: u64,
    train_bytes: u64,
    val_bytes: u64,
    read_bytes: u64,
}

impl<'a> Cutter<'a> {
    fn new(
        options: &'a PrepareOptions,
        tokenizer: &'a Tokenizer,
        tx: &'a crossbeam_channel::Sender<Result<Batch, DataError>>,
    ) -> Self {
        Self {
            options,
            tokenizer,
            tx,
            part: piece_bytes(options),
            pending: String::new(),
            pending_start: false,
            batch: Vec::new(),
            batch_bytes: 0,
            batch_docs: 0,
            batch_text: 0,
            train_bytes: 0,
            val_bytes: 0,
            read_bytes: 0,
        }
    }

    fn push(&mut self, piece: Piece, read_bytes: u64) -> Result<(), DataError> {
        self.read_bytes = read_bytes;
        if piece.doc_start {
            self.flush_pending()?;
            self.pending_start = true;
            self.batch_docs += 1;
        }
        self.batch_text += piece.text.len() as u64;
        self.pending.push_str(&piece.text);
        let part = self.part;
        while self.pending.len() >= 2 * part {
            let cut = match self.tokenizer.split_point(&self.pending, part) {
                Some(cut) if cut < self.pending.len() => cut,
                // No safe point in sight: a hard cut on a character
                // boundary once the text runs past 8 pieces.
                _ if self.pending.len() >= 8 * part => floor_char(&self.pending, 4 * part),
                _ => break,
            };
            let rest = self.pending.split_off(cut);
            let text = std::mem::replace(&mut self.pending, rest);
            self.unit(text)?;
        }
        Ok(())
    }

    fn flush_pending(&mut self) -> Result<(), DataError> {
        if self.pending.is_empty() && !self.pending_start {
            return Ok(());
        }
        let text = std::mem::take(&mut self.pending);
        self.unit(text)
    }

    /// A piece to encode; its split from the bytes so far alone.
    fn unit(&mut self, text: String) -> Result<(), DataError> {
        let len = text.len() as u64;
        let f = self.options.settings.val_fraction;
        let total = (self.train_bytes + self.val_bytes + len) as f64;
        let val = (self.val_bytes as f64 + len as f64 / 2.0) < f * total;
        if val {
            self.val_bytes += len;
        } else {
            self.train_bytes += len;
        }
        self.batch_bytes += text.len();
        self.batch.push(Unit {
            text,
            doc_start: std::mem::take(&mut self.pending_start),
            val,
        });
        if self.batch_bytes >= self.options.batch_bytes {
            self.send()?;
        }
        Ok(())
    }

    fn send(&mut self) -> Result<(), DataError> {
        let batch = Batch {
            units: std::mem::take(&mut self.batch),
            read_bytes: self.read_bytes,
            documents: std::mem::take(&mut self.batch_docs),
            text_bytes: std::mem::take(&mut self.batch_text),
        };
        self.batch_bytes = 0;
        self.tx
            .send(Ok(batch))
            .map_err(|_| DataError::Tokenizer("the encoder stopped".into()))
    }

    fn finish(&mut self, read_bytes: u64) -> Result<(), DataError> {
        self.read_bytes = read_bytes;
        self.flush_pending()?;
        if !self.batch.is_empty() || self.batch_docs > 0 {
            self.send()?;
        }
        Ok(())
    }
}

/// The smallest piece a small corpus is cut to.
const MIN_PIECE_BYTES: usize = 4 << 10;

/// The size documents are cut to: `part_bytes`, or less for a corpus whose
/// validation share is under 8 such pieces, so that it still gets about
/// its share. A piece goes to one split whole, to the one that keeps the
/// validation share of the text so far nearest `val_fraction`, so a text
/// of fewer pieces than about 1 / `val_fraction` gave validation nothing:
/// Tiny Shakespeare (1.1 MB, one document) in 256 KiB pieces had no
/// validation tokens, and training on it was refused. From the inputs'
/// sizes and the settings alone (a corpus of 20 MiB and more keeps 256
/// KiB), so an interrupted prepare continues with the same cuts.
fn piece_bytes(options: &PrepareOptions) -> usize {
    let total: u64 = options.inputs.iter().map(|f| f.bytes).sum();
    let val_bytes = total as f64 * options.settings.val_fraction;
    let part = options.part_bytes.max(1);
    ((val_bytes / 8.0) as usize).clamp(MIN_PIECE_BYTES.min(part), part)
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// One split's shards: the partial file being filled and its number.
struct SplitWriter {
    dir: PathBuf,
    split: &'static str,
    width: TokenWidth,
    shard_tokens: usize,
    partial: PartialState,
    file: Option<File>,
}

impl SplitWriter {
    fn open(
        dir: &Path,
        split: &'static str,
        width: TokenWidth,
        shard_tokens: usize,
        resume: Option<PartialState>,
    ) -> Result<Self, DataError> {
        let mut w = Self {
            dir: dir.to_path_buf(),
            split,
            width,
            shard_tokens: shard_tokens.max(1),
            partial: resume.unwrap_or_default(),
            file: None,
        };
        if resume.is_some() {
            // Back to what the last batch's record says: a kill may have
            // left more (or, before the first sync, less) behind.
            let path = w.partial_path();
            if w.partial.tokens == 0 {
                // Nothing of it was recorded: it starts again.
                let _ = std::fs::remove_file(&path);
            } else {
                let file = OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                    .map_err(|source| DataError::Write {
                        path: path.clone(),
                        source,
                    })?;
                let len = (HEADER_BYTES + w.partial.tokens * width.bytes()) as u64;
                let have = file.metadata().map(|m| m.len()).unwrap_or(0);
                if have < len {
                    return Err(DataError::StoreMismatch {
                        path: path.clone(),
                        why: format!(
                            "the interrupted prepare recorded {} tokens here but the file has {have} bytes; remove the folder and prepare again",
                            w.partial.tokens
                        ),
                    });
                }
                let mut file = file;
                file.set_len(len)
                    .and_then(|()| file.seek(SeekFrom::Start(len)).map(drop))
                    .map_err(|source| DataError::Write {
                        path: path.clone(),
                        source,
                    })?;
                w.file = Some(file);
            }
        }
        Ok(w)
    }

    fn name(&self) -> String {
        format!("tokens_{}_{:06}.bin", self.split, self.partial.index)
    }

    fn partial_path(&self) -> PathBuf {
        self.dir.join(format!("{}.partial", self.name()))
    }

    fn file(&mut self) -> Result<&mut File, DataError> {
        if self.file.is_none() {
            let path = self.partial_path();
            let mut file = File::create(&path).map_err(|source| DataError::Write {
                path: path.clone(),
                source,
            })?;
            file.write_all(&[0u8; HEADER_BYTES])
                .map_err(|source| DataError::Write { path, source })?;
            self.file = Some(file);
        }
        // Just set when it was not.
        self.file
            .as_mut()
            .ok_or_else(|| DataError::Tokenizer("no shard file".into()))
    }

    fn append(
        &mut self,
        mut ids: &[u32],
        documents: u64,
        buffer: &mut Vec<u8>,
        shards: &mut Vec<ShardInfo>,
    ) -> Result<(), DataError> {
        let mut documents = documents;
        while !ids.is_empty() {
            let room = self.shard_tokens - self.partial.tokens;
            let (now, later) = ids.split_at(room.min(ids.len()));
            buffer.clear();
            encode_tokens(now, self.width, buffer)?;
            let path = self.partial_path();
            self.file()?
                .write_all(buffer)
                .map_err(|source| DataError::Write { path, source })?;
            self.partial.tokens += now.len();
            self.partial.documents += std::mem::take(&mut documents);
            if self.partial.tokens == self.shard_tokens {
                self.close_shard(shards)?;
            }
            ids = later;
        }
        Ok(())
    }

    /// Writes the header, syncs and renames the full partial file.
    fn close_shard(&mut self, shards: &mut Vec<ShardInfo>) -> Result<(), DataError> {
        let path = self.partial_path();
        let head = header(self.width, self.partial.tokens)?;
        let werr = |source| DataError::Write {
            path: path.clone(),
            source,
        };
        let file = self.file()?;
        file.seek(SeekFrom::Start(0)).map_err(werr)?;
        file.write_all(&head).map_err(werr)?;
        file.sync_all().map_err(werr)?;
        self.file = None;
        let name = self.name();
        std::fs::rename(&path, self.dir.join(&name)).map_err(werr)?;
        shards.push(ShardInfo {
            file: name,
            split: self.split.into(),
            tokens: self.partial.tokens,
            documents: self.partial.documents,
        });
        self.partial = PartialState {
            index: self.partial.index + 1,
            tokens: 0,
            documents: 0,
        };
        Ok(())
    }

    fn sync(&mut self) -> Result<(), DataError> {
        if let Some(file) = &self.file {
            file.sync_data().map_err(|source| DataError::Write {
                path: self.partial_path(),
                source,
            })?;
        }
        Ok(())
    }

    /// The last shard, however full; none when the split got no tokens.
    fn finish(&mut self, shards: &mut Vec<ShardInfo>) -> Result<(), DataError> {
        if self.partial.tokens > 0 {
            self.close_shard(shards)?;
        } else {
            let _ = std::fs::remove_file(self.partial_path());
        }
        Ok(())
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let err = |source| DataError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let written = File::create(&tmp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        // A full disk leaves no half-written file behind.
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(err)
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<(), DataError> {
    let json = serde_json::to_vec_pretty(value).map_err(|e| DataError::Tokenizer(e.to_string()))?;
    write_atomic(path, &json)
}

/// The SHA-256 of `bytes` in lowercase hex (a store's tokenizer digest).
pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The first documents of the inputs, up to `max_bytes` of text (whole
/// documents, the last one cut), joined by newlines: what a trained
/// tokenizer learns from on a corpus larger than memory.
pub fn read_sample(
    inputs: &[InputFile],
    read: &ReadOptions,
    max_bytes: u64,
) -> Result<String, DataError> {
    let mut sample = String::new();
    let mut skipped = SkippedRows::default();
    for input in inputs {
        read_file(input, read, &mut skipped, &mut |piece, _| {
            if piece.doc_start && !sample.is_empty() {
                sample.push('\n');
            }
            let room = (max_bytes as usize).saturating_sub(sample.len());
            if piece.text.len() >= room {
                sample.push_str(&piece.text[..floor_char(&piece.text, room)]);
                return Ok(ControlFlow::Break(()));
            }
            sample.push_str(&piece.text);
            Ok(ControlFlow::Continue(()))
        })?;
        if sample.len() as u64 >= max_bytes {
            break;
        }
    }
    Ok(sample)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::shard::{Shard, write_shard};
    use crate::store::{TokenSpan, TokenStore};
    use crate::{BadRows, Split, find_inputs};

    /// A corpus of jsonl documents and a text file, large enough for
    /// several batches and shards at the tests' sizes.
    fn corpus(dir: &Path) -> String {
        let mut jsonl = String::new();
        for i in 0..300 {
            let text = format!(
                "Document {i}: the quick brown fox jumps over the lazy dog {} times.\n\nIt's   done; ünïcode ✓ {}",
                i * 7,
                "and again ".repeat(i % 13)
            );
            jsonl.push_str(&serde_json::json!({ "text": text, "id": i }).to_string());
            jsonl.push('\n');
        }
        std::fs::create_dir_all(dir).expect("mkdir");
        std::fs::write(dir.join("a.jsonl"), &jsonl).expect("write");
        let story = "Once upon a time there was a long story that went on and on.\n".repeat(400);
        std::fs::write(dir.join("b.txt"), story).expect("write");
        dir.to_str().expect("utf-8").to_string()
    }

    fn options(source: &str, out: &Path, threads: usize) -> PrepareOptions {
        let mut o = PrepareOptions::new(
            find_inputs(source).expect("inputs"),
            PrepareSettings {
                source: source.into(),
                text_field: "text".into(),
                val_fraction: 0.1,
                shard_tokens: 3000,
                tokenizer: "gpt2".into(),
                vocab_size: 50257,
                tokenizer_sample_bytes: 0,
            },
            ReadOptions {
                text_field: "text".into(),
                bad_rows: BadRows::Skip,
            },
            out.to_path_buf(),
        );
        o.threads = Some(threads);
        o.batch_bytes = 4096;
        o.part_bytes = 512;
        o
    }

    /// Every file of a store, name and bytes (progress and temporary files excluded).
    fn files(dir: &Path) -> Vec<(String, usize, String)> {
        let mut out: Vec<(String, usize, String)> = std::fs::read_dir(dir)
            .expect("dir")
            .map(|e| e.expect("entry").path())
            .map(|p| {
                let bytes = std::fs::read(&p).expect("read");
                let name = p.file_name().expect("name").to_string_lossy().into_owned();
                (name, bytes.len(), sha256_hex(&bytes))
            })
            .collect();
        out.sort();
        out
    }

    /// Inputs without text are refused, naming the file (one input) or
    /// how many (several), not made into a store of end-of-text markers.
    #[test]
    fn inputs_without_text_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let input = dir.path().join("in");
        std::fs::create_dir_all(&input).expect("mkdir");
        std::fs::write(input.join("a.txt"), "").expect("write");
        let gpt2 = Tokenizer::gpt2().expect("gpt2");
        let one = input.join("a.txt");
        let o = options(one.to_str().expect("utf-8"), &dir.path().join("one"), 1);
        match prepare(&o, &gpt2, 0, &mut |_| {}) {
            Err(DataError::Empty { path }) => assert_eq!(path, one),
            other => panic!("{:?}", other.map(|o| o.manifest.documents)),
        }
        assert!(!o.out.exists(), "the refused store's folder is removed");
        std::fs::write(input.join("b.txt"), "").expect("write");
        let o = options(input.to_str().expect("utf-8"), &dir.path().join("two"), 1);
        let err = prepare(&o, &gpt2, 0, &mut |_| {})
            .map(|o| o.manifest.documents)
            .expect_err("no text");
        assert!(
            err.to_string()
                .contains("none of its 2 files holds any text"),
            "{err}"
        );
        std::fs::write(input.join("b.txt"), "x").expect("write");
        let o = options(input.to_str().expect("utf-8"), &dir.path().join("some"), 1);
        prepare(&o, &gpt2, 0, &mut |_| {}).expect("one file with text is enough");
        // A store's folder under a file is named, not "Not a directory".
        let o = options(input.to_str().expect("utf-8"), &one.join("store"), 1);
        let err = prepare(&o, &gpt2, 0, &mut |_| {})
            .map(|o| o.manifest.documents)
            .expect_err("under a file");
        assert!(
            matches!(err, DataError::StoreMismatch { .. })
                && err.to_string().contains("a.txt` is a file, not a folder"),
            "{err}"
        );
    }

    /// One text file of one document, smaller than two default pieces
    /// (256 KiB): its validation split gets about its share, where it got
    /// no token (the whole text was one piece, and went to training).
    #[test]
    fn a_small_corpus_of_one_document_gets_its_validation_share() {
        let dir = tempfile::tempdir().expect("tempdir");
        let input = dir.path().join("in");
        std::fs::create_dir_all(&input).expect("mkdir");
        let line = |i: usize| format!("Line {i}: a long story goes on and on, word after word.\n");
        let text: String = (0..4000).map(line).collect();
        assert!((200_000..256 << 10).contains(&text.len()), "{}", text.len());
        std::fs::write(input.join("story.txt"), &text).expect("write");
        let source = input.to_str().expect("utf-8");
        let mut o = options(source, &dir.path().join("out"), 2);
        (o.batch_bytes, o.part_bytes) = (16 << 20, 256 << 10);
        assert_eq!(
            piece_bytes(&o),
            4096,
            "a 20 KB validation share in 4 KiB pieces"
        );
        let gpt2 = Tokenizer::gpt2().expect("gpt2");
        prepare(&o, &gpt2, 0, &mut |_| {}).expect("prepares");
        let store = TokenStore::open(&dir.path().join("out")).expect("opens");
        let (train, val) = (store.train.len(), store.val.len());
        let share = val as f64 / (train + val) as f64;
        assert!((0.08..0.12).contains(&share), "validation share {share}");
    }

    #[test]
    fn pieces_shrink_for_a_small_corpus_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("a.txt"), "text").expect("write");
        let source = dir.path().join("a.txt");
        let mut o = options(source.to_str().expect("utf-8"), &dir.path().join("out"), 1);
        o.part_bytes = 256 << 10;
        let sized = |o: &PrepareOptions, bytes: u64| {
            let mut o = o.clone();
            o.inputs = vec![InputFile {
                path: "a.txt".into(),
                bytes,
                format: crate::DocFormat::Text,
                compression: crate::Compression::None,
            }];
            piece_bytes(&o)
        };
        // Tiny Shakespeare at 0.1: 14 KB pieces, about 80 in all.
        assert_eq!(sized(&o, 1_115_394), 13_942);
        // From 20 MiB on, 256 KiB as before; never under 4 KiB.
        assert_eq!(sized(&o, 20 << 20), 256 << 10);
        assert_eq!(sized(&o, 1 << 30), 256 << 10);
        assert_eq!(sized(&o, 1000), 4096);
        // A smaller part_bytes (the tests') bounds it.
        o.part_bytes = 512;
        assert_eq!(sized(&o, 1_115_394), 512);
    }

    #[test]
    fn the_bytes_do_not_depend_on_the_thread_count() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = corpus(&dir.path().join("in"));
        let gpt2 = Tokenizer::gpt2().expect("gpt2");
        let mut stores = Vec::new();
        for threads in [1, 2, 4] {
            let out = dir.path().join(format!("out{threads}"));
            let outcome =
                prepare(&options(&source, &out, threads), &gpt2, 0, &mut |_| {}).expect("prepares");
            assert!(!outcome.already_prepared);
            stores.push(files(&out));
        }
        assert_eq!(stores[0], stores[1]);
        assert_eq!(stores[0], stores[2]);
        let out = dir.path().join("out1");
        let store = TokenStore::open(&out).expect("opens");
        let manifest = store.manifest.as_ref().expect("manifest");
        assert_eq!(manifest.documents, 301);
        assert!(manifest.shards.len() >= 4, "{:?}", manifest.shards);
        let (train, val) = (store.train.len(), store.val.len());
        assert_eq!(train, manifest.tokens(Split::Train));
        let share = val as f64 / (train + val) as f64;
        assert!((0.07..0.13).contains(&share), "validation share {share}");
        // Every document starts with <|endoftext|>, and the store decodes
        // back to the documents (in some order of the two splits).
        let mut all = vec![0u32; train];
        store.train.read(0, &mut all).expect("read");
        assert_eq!(all[0], 50256);
        let text = gpt2.decode(&all).expect("decodes");
        assert!(text.contains("Document 0: the quick brown fox"));
        // A second prepare of the same finds it done.
        let again = prepare(&options(&source, &out, 2), &gpt2, 0, &mut |_| {}).expect("again");
        assert!(again.already_prepared);
        // Other settings in the same folder are refused.
        let mut other = options(&source, &out, 2);
        other.settings.val_fraction = 0.2;
        let err = prepare(&other, &gpt2, 0, &mut |_| {})
            .expect_err("other settings")
            .to_string();
        assert!(err.contains("other inputs or settings"), "{err}");
    }

    #[test]
    fn a_prepare_killed_mid_shard_and_run_again_ends_with_the_same_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = corpus(&dir.path().join("in"));
        let gpt2 = Tokenizer::gpt2().expect("gpt2");
        let whole = dir.path().join("whole");
        prepare(&options(&source, &whole, 2), &gpt2, 0, &mut |_| {}).expect("prepares");
        for kill_after in [0, 1, 3, 7] {
            let out = dir.path().join(format!("killed{kill_after}"));
            let mut o = options(&source, &out, 2);
            o.fail_after_batches = Some(kill_after);
            prepare(&o, &gpt2, 0, &mut |_| {}).expect_err("killed");
            assert!(!out.join(MANIFEST).exists());
            // A kill during the next batch leaves unsynced tokens behind.
            for entry in std::fs::read_dir(&out).expect("dir") {
                let p = entry.expect("entry").path();
                if p.extension().is_some_and(|e| e == "partial") {
                    let mut f = OpenOptions::new().append(true).open(&p).expect("open");
                    f.write_all(&[7u8; 123]).expect("junk");
                }
            }
            o.fail_after_batches = None;
            let outcome = prepare(&o, &gpt2, 0, &mut |_| {}).expect("continues");
            assert_eq!(outcome.resumed_after_pieces > 0, kill_after > 0);
            assert_eq!(
                files(&out),
                files(&whole),
                "killed after {kill_after} batches"
            );
        }
    }

    #[test]
    fn llm_c_s_own_shards_read_and_kiln_writes_them_byte_for_byte() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tokens: Vec<u32> = (0..70_000).step_by(997).collect();
        for (file, width, ids) in [
            (
                "gpt2_shard.bin",
                TokenWidth::U16,
                tokens.iter().map(|t| t % 65536).collect::<Vec<_>>(),
            ),
            ("llama3_shard.bin", TokenWidth::U32, tokens.clone()),
        ] {
            let theirs = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("test_data")
                .join(file);
            let shard = Shard::open(&theirs).expect("opens llm.c's shard");
            let mut out = vec![0u32; shard.tokens()];
            shard.read(0, &mut out).expect("read");
            assert_eq!(out, ids);
            let ours = dir.path().join(file);
            write_shard(&ours, &ids, width).expect("writes");
            assert_eq!(
                std::fs::read(&ours).expect("ours"),
                std::fs::read(&theirs).expect("theirs")
            );
        }
    }

    #[test]
    fn a_trained_tokenizer_learns_from_a_bounded_sample() {
        let dir = tempfile::tempdir().expect("tempdir");
        let source = corpus(&dir.path().join("in"));
        let o = options(&source, &dir.path().join("out"), 1);
        let sample = read_sample(&o.inputs, &o.read, 1000).expect("sample");
        assert_eq!(sample.len(), 1000);
        assert!(sample.starts_with("Document 0:"));
        let t = Tokenizer::char_level(&sample)
            .expect("char")
            .with_end_of_text();
        let eot = t.end_of_text().expect("eot");
        assert_eq!(eot as usize, t.vocab_size() - 1);
    }
}
