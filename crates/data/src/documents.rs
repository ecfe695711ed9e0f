//! Documents as users have them: plain text (a document a file), JSON lines
//! (a document a line, one field), parquet (a document a row, one column, a
//! row group at a time), each also gzip- or zstd-compressed; found from a
//! file, a folder (every supported file under it, in sorted path order) or a
//! glob. Documents stream: memory holds a row group or a few MiB of text,
//! never a whole corpus.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use crate::{BadRows, DataError};

/// What a file holds, from its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DocFormat {
    /// Plain text (`.txt`, `.text`, `.md`, `.rst`): the file is one document.
    Text,
    /// JSON lines (`.jsonl`, `.json`): a document a line.
    Jsonl,
    /// Parquet: a document a row.
    Parquet,
}

/// How a file is compressed, from its last extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    /// Not compressed.
    None,
    /// `.gz`.
    Gzip,
    /// `.zst`.
    Zstd,
}

/// One input file and how to read it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InputFile {
    /// The file.
    pub path: PathBuf,
    /// Its size on disk.
    pub bytes: u64,
    /// What it holds.
    pub format: DocFormat,
    /// How it is compressed.
    pub compression: Compression,
}

impl InputFile {
    /// The file at `path`, its format and compression from its name; `None`
    /// when the name is not of a supported kind.
    pub fn classify(path: &Path) -> Option<(DocFormat, Compression)> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let (stem, compression) = if let Some(s) = name.strip_suffix(".gz") {
            (s, Compression::Gzip)
        } else if let Some(s) = name.strip_suffix(".zst") {
            (s, Compression::Zstd)
        } else {
            (name.as_str(), Compression::None)
        };
        let ext = stem.rsplit_once('.')?.1;
        let format = match ext {
            "txt" | "text" | "md" | "markdown" | "rst" => DocFormat::Text,
            "jsonl" | "json" | "ndjson" => DocFormat::Jsonl,
            // Parquet compresses inside the file, by column.
            "parquet" if compression == Compression::None => DocFormat::Parquet,
            _ => return None,
        };
        Some((format, compression))
    }
}

/// The input files that `spec` names: a file, a folder (every supported
/// file under it, recursively, hidden ones left out) or a glob (`*`, `?`,
/// `[`), in sorted path order. Errors when nothing usable is found, naming
/// what was there.
pub fn find_inputs(spec: &str) -> Result<Vec<InputFile>, DataError> {
    find_inputs_and_others(spec).map(|(inputs, _)| inputs)
}

/// [`find_inputs`], and the files of a folder or a glob it leaves out, not
/// being of a kind it reads (`.png`, `.html`, …), to tell the user of.
pub fn find_inputs_and_others(spec: &str) -> Result<(Vec<InputFile>, Vec<PathBuf>), DataError> {
    let path = Path::new(spec);
    let mut candidates = Vec::new();
    let mut skipped = Vec::new();
    if path.is_dir() {
        walk(path, &mut candidates).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    } else if path.exists() {
        candidates.push(path.to_path_buf());
    } else if spec.contains(['*', '?', '[']) {
        let paths = glob::glob(spec).map_err(|e| DataError::InvalidArgument {
            what: "data.path glob",
            why: format!("`{spec}`: {e}"),
        })?;
        for p in paths.flatten() {
            if p.is_file() {
                candidates.push(p);
            }
        }
    } else {
        return Err(DataError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        });
    }
    candidates.sort();
    let mut inputs = Vec::new();
    for p in candidates {
        match InputFile::classify(&p) {
            Some((format, compression)) => {
                let bytes = std::fs::metadata(&p)
                    .map_err(|source| DataError::Io {
                        path: p.clone(),
                        source,
                    })?
                    .len();
                inputs.push(InputFile {
                    path: p,
                    bytes,
                    format,
                    compression,
                });
            }
            None => skipped.push(p),
        }
    }
    if inputs.is_empty() {
        let seen = if skipped.is_empty() {
            "nothing".to_string()
        } else {
            let names: Vec<String> = skipped
                .iter()
                .take(3)
                .map(|p| format!("`{}`", p.display()))
                .collect();
            format!("only {} ({} files)", names.join(", "), skipped.len())
        };
        return Err(DataError::InvalidArgument {
            what: "data.path",
            why: format!(
                "`{spec}` holds no document file of a supported kind ({DOCUMENT_KINDS}) — found {seen}"
            ),
        });
    }
    Ok((inputs, skipped))
}

/// The files [`find_inputs`] reads, in words.
pub const DOCUMENT_KINDS: &str = ".txt/.text/.md/.markdown/.rst, .jsonl/.json/.ndjson, .parquet; the text and JSON also .gz or .zst";

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            walk(&path, out)?;
        } else if path.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// How documents are read from the inputs.
#[derive(Clone, Debug)]
pub struct ReadOptions {
    /// The JSON field or parquet column holding the text.
    pub text_field: String,
    /// A row without the field (or a null): skip and count it, or fail.
    pub bad_rows: BadRows,
}

/// A piece of a document, as the reader hands it on.
#[derive(Debug)]
pub(crate) struct Piece {
    /// The text.
    pub(crate) text: String,
    /// Whether the piece begins a document (an end-of-text token goes before it).
    pub(crate) doc_start: bool,
}

/// Rows skipped under `BadRows::Skip`: how many, and the first few named.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SkippedRows {
    /// Rows skipped.
    pub count: u64,
    /// The first few, as `file line N: why`.
    pub first: Vec<String>,
}

impl SkippedRows {
    pub(crate) fn add_row(&mut self, what: String) {
        self.count += 1;
        if self.first.len() < 5 {
            self.first.push(what);
        }
    }
}

/// What a reader hands each piece to, with the input bytes read so far;
/// `Break` stops the reading of the file there.
pub(crate) type Emit<'a> = dyn FnMut(Piece, u64) -> Result<ControlFlow<()>, DataError> + 'a;

/// Reads the documents of one file in order, calling `emit` with each
/// document's text (whole: jsonl and parquet documents are rows), or, for
/// plain text, with blocks of about `block` bytes of the file as they are
/// read (`doc_start` on the first). `bytes_read` is told the compressed
/// bytes consumed so far, for progress.
pub(crate) fn read_file(
    input: &InputFile,
    options: &ReadOptions,
    skipped: &mut SkippedRows,
    emit: &mut Emit<'_>,
) -> Result<(), DataError> {
    let path = &input.path;
    let io = |source| DataError::Io {
        path: path.clone(),
        source,
    };
    let text = match input.format {
        DocFormat::Parquet => return crate::parquet_text::read(input, options, skipped, emit),
        DocFormat::Text => true,
        DocFormat::Jsonl => false,
    };
    let file = File::open(path).map_err(io)?;
    let counted = Counted::new(file);
    let consumed = counted.count.clone();
    let reader: Box<dyn Read> = match input.compression {
        Compression::None => Box::new(counted),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(counted)),
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(counted).map_err(io)?),
    };
    let mut reader = BufReader::with_capacity(1 << 20, reader);
    let progress = || consumed.load(std::sync::atomic::Ordering::Relaxed);
    if text {
        read_text(path, &mut reader, &progress, emit)
    } else {
        read_jsonl(path, &mut reader, options, skipped, &progress, emit)
    }
}

/// A text file as one document, handed on in blocks of whole UTF-8
/// characters; invalid UTF-8 is an error naming the byte offset.
fn read_text(
    path: &Path,
    reader: &mut dyn BufRead,
    progress: &dyn Fn() -> u64,
    emit: &mut Emit<'_>,
) -> Result<(), DataError> {
    const BLOCK: usize = 1 << 20;
    let mut carry: Vec<u8> = Vec::new();
    let mut offset = 0u64;
    let mut lines = 0usize;
    let mut first = true;
    let mut buf = vec![0u8; BLOCK];
    loop {
        let n = read_full(reader, &mut buf).map_err(|source| DataError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        carry.extend_from_slice(&buf[..n]);
        let end = n == 0;
        let valid = match std::str::from_utf8(&carry) {
            Ok(_) => carry.len(),
            Err(e) if e.error_len().is_none() && !end => e.valid_up_to(),
            Err(e) => {
                let at = e.valid_up_to();
                return Err(DataError::NotUtf8 {
                    path: path.to_path_buf(),
                    offset: (offset + at as u64) as usize,
                    line: lines + carry[..at].iter().filter(|b| **b == b'\n').count() + 1,
                    byte: carry[at],
                });
            }
        };
        if valid > 0 || (first && end) {
            let rest = carry.split_off(valid);
            let text = String::from_utf8(std::mem::replace(&mut carry, rest))
                .map_err(|e| DataError::Tokenizer(e.to_string()))?;
            offset += text.len() as u64;
            lines += text.bytes().filter(|b| *b == b'\n').count();
            if !text.is_empty() || first {
                let piece = Piece {
                    text,
                    doc_start: first,
                };
                if emit(piece, progress())?.is_break() {
                    return Ok(());
                }
                first = false;
            }
        }
        if end {
            return Ok(());
        }
    }
}

fn read_full(reader: &mut dyn BufRead, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match reader.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

fn read_jsonl(
    path: &Path,
    reader: &mut dyn BufRead,
    options: &ReadOptions,
    skipped: &mut SkippedRows,
    progress: &dyn Fn() -> u64,
    emit: &mut Emit<'_>,
) -> Result<(), DataError> {
    let mut line = Vec::new();
    let mut number = 0usize;
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|source| DataError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        if n == 0 {
            return Ok(());
        }
        number += 1;
        let bytes = line.trim_ascii();
        if bytes.is_empty() {
            continue;
        }
        match jsonl_text(bytes, &options.text_field) {
            Ok(text) => {
                let piece = Piece {
                    text,
                    doc_start: true,
                };
                if emit(piece, progress())?.is_break() {
                    return Ok(());
                }
            }
            Err(why) => match options.bad_rows {
                BadRows::Error => {
                    return Err(DataError::BadRow {
                        path: path.to_path_buf(),
                        line: number,
                        why: format!("{why} (data.bad_rows = \"skip\" skips such rows)"),
                    });
                }
                BadRows::Skip => {
                    skipped.add_row(format!("`{}` line {number}: {why}", path.display()))
                }
            },
        }
    }
}

fn jsonl_text(bytes: &[u8], field: &str) -> Result<String, String> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        if std::str::from_utf8(bytes).is_err() {
            "not UTF-8".to_string()
        } else {
            format!("not a JSON object: {e}")
        }
    })?;
    match value.get(field) {
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(serde_json::Value::Null) => Err(format!("the field `{field}` is null")),
        Some(other) => Err(format!(
            "the field `{field}` is not a string but {}",
            kind(other)
        )),
        None => match value.as_object() {
            Some(row) => Err(missing_field(field, row)),
            None => Err(format!("not a JSON object but {}", kind(&value))),
        },
    }
}

/// A row without the text field: the fields it has, for `data.text_field`
/// (and where they are a sentence pair's, the workload that reads them).
fn missing_field(field: &str, row: &serde_json::Map<String, serde_json::Value>) -> String {
    let names: Vec<String> = row.keys().take(8).map(|k| format!("`{k}`")).collect();
    let more = if row.len() > names.len() { ", …" } else { "" };
    let pairs = if row.contains_key("premise") && row.contains_key("hypothesis") {
        "; a sentence pair's: the nli workload reads these (`kiln cv`, or experiment=nli_snli)"
    } else {
        ""
    };
    format!(
        "no field `{field}` (data.text_field names the field with the text; the row has {}{more}{pairs})",
        if names.is_empty() {
            "none".to_string()
        } else {
            names.join(", ")
        }
    )
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// A reader that counts the bytes read through it (the compressed bytes,
/// for progress).
struct Counted<R> {
    inner: R,
    count: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<R> Counted<R> {
    fn new(inner: R) -> Self {
        Self {
            inner,
            count: Default::default(),
        }
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn collect(
        input: &InputFile,
        options: &ReadOptions,
    ) -> Result<(Vec<(String, bool)>, SkippedRows), DataError> {
        let mut docs = Vec::new();
        let mut skipped = SkippedRows::default();
        read_file(input, options, &mut skipped, &mut |p, _| {
            docs.push((p.text, p.doc_start));
            Ok(ControlFlow::Continue(()))
        })?;
        Ok((docs, skipped))
    }

    fn input(path: &Path) -> InputFile {
        let (format, compression) = InputFile::classify(path).expect("supported");
        InputFile {
            path: path.to_path_buf(),
            bytes: 0,
            format,
            compression,
        }
    }

    fn options(bad_rows: BadRows) -> ReadOptions {
        ReadOptions {
            text_field: "text".into(),
            bad_rows,
        }
    }

    const JSONL: &str = "{\"text\": \"first doc\"}\n\n{\"text\": \"second\", \"id\": 2}\n{\"id\": 3}\n{\"text\": null}\n{\"text\": \"ünïcode\"}\n";

    /// A row without the text field names the fields it has, and a
    /// sentence pair's the workload that reads it.
    #[test]
    fn a_row_without_the_text_field_names_the_fields_it_has() {
        let err = jsonl_text(br#"{"content": "a doc", "id": 1}"#, "text").expect_err("no text");
        assert!(
            err.contains("no field `text`") && err.contains("the row has `content`, `id`"),
            "{err}"
        );
        assert!(!err.contains("nli"), "{err}");
        let pair = br#"{"premise": "a", "hypothesis": "b", "label": "neutral"}"#;
        let err = jsonl_text(pair, "text").expect_err("a pair");
        assert!(
            err.contains("`hypothesis`, `label`, `premise`")
                && err.contains("the nli workload reads these (`kiln cv`, or experiment=nli_snli)"),
            "{err}"
        );
    }

    #[test]
    fn jsonl_gz_and_zst_read_the_same_documents_and_count_bad_rows() {
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("a.jsonl");
        std::fs::write(&plain, JSONL).expect("write");
        let gz = dir.path().join("a.jsonl.gz");
        let mut enc = flate2::write::GzEncoder::new(
            File::create(&gz).expect("create"),
            flate2::Compression::default(),
        );
        enc.write_all(JSONL.as_bytes()).expect("gz");
        enc.finish().expect("gz");
        let zst = dir.path().join("a.jsonl.zst");
        std::fs::write(&zst, zstd::encode_all(JSONL.as_bytes(), 3).expect("zstd")).expect("write");
        for path in [&plain, &gz, &zst] {
            let (docs, skipped) = collect(&input(path), &options(BadRows::Skip)).expect("reads");
            let texts: Vec<&str> = docs.iter().map(|(t, _)| t.as_str()).collect();
            assert_eq!(
                texts,
                ["first doc", "second", "ünïcode"],
                "{}",
                path.display()
            );
            assert!(docs.iter().all(|(_, start)| *start));
            assert_eq!(skipped.count, 2);
            assert!(
                skipped.first[0].contains("line 4: no field `text`"),
                "{:?}",
                skipped.first
            );
            assert!(skipped.first[1].contains("line 5: the field `text` is null"));
        }
        let err = collect(&input(&gz), &options(BadRows::Error)).expect_err("bad row");
        assert!(err.to_string().contains("a.jsonl.gz` line 4"), "{err}");
    }

    #[test]
    fn text_is_one_document_and_bad_utf8_names_the_byte_offset() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.txt");
        let text = "é".repeat(700_000); // 1.4 MB: more than one block, a character cut at the edge
        std::fs::write(&path, &text).expect("write");
        let (docs, _) = collect(&input(&path), &options(BadRows::Skip)).expect("reads");
        assert!(docs.len() >= 2);
        assert!(docs[0].1 && docs[1..].iter().all(|(_, s)| !s));
        assert_eq!(
            docs.iter().map(|(t, _)| t.as_str()).collect::<String>(),
            text
        );
        let bad = dir.path().join("bad.txt");
        std::fs::write(&bad, b"caf\xe9 au lait").expect("write");
        let err = collect(&input(&bad), &options(BadRows::Skip)).expect_err("latin-1");
        assert!(err.to_string().contains("at byte 3"), "{err}");
    }

    #[test]
    fn folders_and_globs_find_supported_files_in_sorted_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
        for name in [
            "b.jsonl",
            "a.txt",
            "sub/c.parquet",
            "sub/d.jsonl.zst",
            "notes.csv",
            ".hidden.txt",
        ] {
            std::fs::write(dir.path().join(name), "x").expect("write");
        }
        let root = dir.path().to_str().expect("utf-8");
        let names = |files: Vec<InputFile>| -> Vec<String> {
            files
                .iter()
                .map(|f| {
                    f.path
                        .strip_prefix(dir.path())
                        .expect("under")
                        .display()
                        .to_string()
                })
                .collect()
        };
        assert_eq!(
            names(find_inputs(root).expect("folder")),
            ["a.txt", "b.jsonl", "sub/c.parquet", "sub/d.jsonl.zst"]
        );
        assert_eq!(
            names(find_inputs(&format!("{root}/*.jsonl")).expect("glob")),
            ["b.jsonl"]
        );
        let err = find_inputs(&format!("{root}/*.csv"))
            .expect_err("csv only")
            .to_string();
        assert!(err.contains("notes.csv"), "{err}");
    }
}
