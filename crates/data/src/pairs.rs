//! Sentence-pair datasets (NLI): JSONL, TSV or CSV, with the column names and
//! label names given by the caller. Rows with a missing or unknown label, or
//! an empty text, are skipped and counted, or rejected, as asked; either way
//! the report names how many and the first line numbers.

use std::path::{Path, PathBuf};

use crate::DataError;

/// One labelled pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The first sentence.
    pub premise: String,
    /// The second sentence.
    pub hypothesis: String,
    /// Index into the label names (`None`: unlabelled, where allowed).
    pub label: Option<usize>,
    /// 1-based line of the file it came from.
    pub line: usize,
}

/// What to do with a row whose label is missing or unknown, or whose text is empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadRows {
    /// Skip it, and record its line and why.
    Skip,
    /// Fail on it, naming its line.
    Error,
}

/// File layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PairFormat {
    /// From the extension: `.jsonl`/`.json` → JSON lines, `.tsv`, `.csv`.
    Auto,
    /// One JSON object a line.
    Jsonl,
    /// Tab-separated columns with a header row.
    Tsv,
    /// Comma-separated columns with a header row (RFC 4180 quoting).
    Csv,
}

/// How to read a pairs file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairSchema {
    /// The field (JSONL) or column (TSV/CSV) of the first sentence.
    pub premise: String,
    /// The field or column of the second sentence.
    pub hypothesis: String,
    /// The field or column of the label: a name, or in JSON an index into `labels`.
    pub label: String,
    /// The label names, in class order.
    pub labels: Vec<String>,
    /// What a bad row does.
    pub bad_rows: BadRows,
    /// The file's layout.
    pub format: PairFormat,
    /// Whether a row without a label is bad (training) or kept unlabelled (prediction).
    pub require_label: bool,
}

impl Default for PairSchema {
    /// SNLI's and MultiNLI's JSONL: `premise`, `hypothesis`, `label` with
    /// entailment / neutral / contradiction; rows without a gold label
    /// skipped; the format from the file's extension.
    fn default() -> Self {
        Self {
            premise: "premise".into(),
            hypothesis: "hypothesis".into(),
            label: "label".into(),
            labels: ["entailment", "neutral", "contradiction"]
                .map(String::from)
                .to_vec(),
            bad_rows: BadRows::Skip,
            format: PairFormat::Auto,
            require_label: true,
        }
    }
}

/// The pairs read, and the rows skipped (line, reason).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairDataset {
    /// The file read.
    pub path: PathBuf,
    /// The pairs kept, in file order.
    pub pairs: Vec<Pair>,
    /// The rows skipped: line (from 1) and why.
    pub skipped: Vec<(usize, String)>,
    /// The label names, in class order.
    pub labels: Vec<String>,
}

impl PairDataset {
    /// Pairs per label, in label order.
    pub fn label_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.labels.len()];
        for p in &self.pairs {
            if let Some(l) = p.label {
                counts[l] += 1;
            }
        }
        counts
    }

    /// One line on what was skipped, if anything.
    pub fn skipped_report(&self) -> Option<String> {
        if self.skipped.is_empty() {
            return None;
        }
        let first: Vec<String> = self
            .skipped
            .iter()
            .take(5)
            .map(|(line, why)| format!("line {line}: {why}"))
            .collect();
        Some(format!(
            "skipped {} row{} of `{}` ({}{})",
            self.skipped.len(),
            if self.skipped.len() == 1 { "" } else { "s" },
            self.path.display(),
            first.join("; "),
            if self.skipped.len() > 5 { "; ..." } else { "" }
        ))
    }
}

/// Reads a pairs file. Structural problems (unreadable file, bad UTF-8,
/// malformed JSON, a missing column) are errors naming file and line; label
/// and empty-text problems follow `schema.bad_rows`.
pub fn read_pairs(path: &Path, schema: &PairSchema) -> Result<PairDataset, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let offset = e.utf8_error().valid_up_to();
            let b = e.as_bytes();
            return Err(DataError::NotUtf8 {
                path: path.to_path_buf(),
                offset,
                line: b[..offset].iter().filter(|c| **c == b'\n').count() + 1,
                byte: b[offset],
            });
        }
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    if text.trim().is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    let format = match schema.format {
        PairFormat::Auto => match path.extension().and_then(|e| e.to_str()) {
            Some("tsv") => PairFormat::Tsv,
            Some("csv") => PairFormat::Csv,
            _ => PairFormat::Jsonl,
        },
        f => f,
    };
    let rows = match format {
        PairFormat::Tsv => delimited(path, text, b'\t', schema)?,
        PairFormat::Csv => delimited(path, text, b',', schema)?,
        PairFormat::Jsonl | PairFormat::Auto => jsonl(path, text, schema)?,
    };
    let mut pairs = Vec::new();
    let mut skipped = Vec::new();
    for row in rows {
        let problem = if row.premise.trim().is_empty() {
            Some(format!("empty `{}`", schema.premise))
        } else if row.hypothesis.trim().is_empty() {
            Some(format!("empty `{}`", schema.hypothesis))
        } else {
            match &row.label {
                None if schema.require_label => Some(format!("no `{}`", schema.label)),
                None => None,
                Some(l) => match label_index(l, &schema.labels) {
                    Some(_) => None,
                    None => Some(format!(
                        "unknown label {l:?} (expected one of {}, or its index from 0)",
                        schema.labels.join(", ")
                    )),
                },
            }
        };
        match problem {
            None => pairs.push(Pair {
                label: row
                    .label
                    .as_ref()
                    .and_then(|l| label_index(l, &schema.labels)),
                premise: row.premise,
                hypothesis: row.hypothesis,
                line: row.line,
            }),
            Some(why) if schema.bad_rows == BadRows::Error => {
                return Err(DataError::BadRow {
                    path: path.to_path_buf(),
                    line: row.line,
                    why: format!("{why} (bad rows are errors: `BadRows::Error`)"),
                });
            }
            Some(why) => skipped.push((row.line, why)),
        }
    }
    if pairs.is_empty() {
        return Err(DataError::BadRow {
            path: path.to_path_buf(),
            line: skipped.first().map_or(1, |s| s.0),
            why: match skipped.first() {
                Some((line, why)) if skipped.len() == 1 => {
                    format!("no usable pair in the file (its one row, line {line}: {why})")
                }
                Some((line, why)) => format!(
                    "no usable pair in the file ({} rows skipped; the first, line {line}: {why})",
                    skipped.len()
                ),
                None => "no usable pair in the file".into(),
            },
        });
    }
    Ok(PairDataset {
        path: path.to_path_buf(),
        pairs,
        skipped,
        labels: schema.labels.clone(),
    })
}

/// The index of the label `l`: its name among `labels`, else a whole
/// number below their count, as Hugging Face's datasets write labels in
/// TSV and CSV (`0` entailment, `1` neutral, `2` contradiction) and as a
/// JSON number is read.
fn label_index(l: &str, labels: &[String]) -> Option<usize> {
    let by_name = labels.iter().position(|n| n == l);
    by_name.or_else(|| l.trim().parse::<usize>().ok().filter(|&i| i < labels.len()))
}

struct Row {
    premise: String,
    hypothesis: String,
    label: Option<String>,
    line: usize,
}

fn jsonl(path: &Path, text: &str, schema: &PairSchema) -> Result<Vec<Row>, DataError> {
    let mut rows = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim_end_matches('\r');
        if raw.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| DataError::BadRow {
                path: path.to_path_buf(),
                line,
                why: format!("malformed JSON: {e}"),
            })?;
        let field = |name: &str| -> Result<String, DataError> {
            match value.get(name) {
                Some(serde_json::Value::String(s)) => Ok(s.clone()),
                Some(other) => Err(DataError::BadRow {
                    path: path.to_path_buf(),
                    line,
                    why: format!("`{name}` is {other}, not a string"),
                }),
                None => Err(DataError::BadRow {
                    path: path.to_path_buf(),
                    line,
                    why: format!("no field `{name}` (the schema's premise or hypothesis field)"),
                }),
            }
        };
        let label = match value.get(&schema.label) {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => n
                .as_u64()
                .and_then(|i| schema.labels.get(i as usize).cloned())
                .or_else(|| Some(n.to_string())),
            _ => None,
        };
        rows.push(Row {
            premise: field(&schema.premise)?,
            hypothesis: field(&schema.hypothesis)?,
            label,
            line,
        });
    }
    Ok(rows)
}

fn delimited(
    path: &Path,
    text: &str,
    delimiter: u8,
    schema: &PairSchema,
) -> Result<Vec<Row>, DataError> {
    let mut reader = csv::ReaderBuilder::new()
        .delimiter(delimiter)
        .flexible(true)
        .quoting(delimiter == b',')
        .from_reader(text.as_bytes());
    let header = reader.headers().map_err(|e| DataError::BadRow {
        path: path.to_path_buf(),
        line: 1,
        why: format!("unreadable header: {e}"),
    })?;
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| DataError::BadRow {
                path: path.to_path_buf(),
                line: 1,
                why: format!(
                    "no column `{name}` in the header (columns: {})",
                    header.iter().collect::<Vec<_>>().join(", ")
                ),
            })
    };
    let (p, h) = (column(&schema.premise)?, column(&schema.hypothesis)?);
    // Pairs to label (`kiln predict`) may come without a label column.
    let l = if schema.require_label {
        Some(column(&schema.label)?)
    } else {
        header.iter().position(|h| h.trim() == schema.label)
    };
    // Lines from byte offsets: csv's own line count differs with CRLF.
    // A record's position may point at the end of the line before it.
    let line_at = |byte: u64| {
        let bytes = text.as_bytes();
        let mut at = (byte as usize).min(bytes.len());
        while at < bytes.len() && matches!(bytes[at], b'\r' | b'\n') {
            at += 1;
        }
        bytes[..at].iter().filter(|b| **b == b'\n').count() + 1
    };
    let mut rows = Vec::new();
    // Where the last record began, if one of its fields spans lines.
    let mut spanning = None;
    for record in reader.records() {
        let record = record.map_err(|e| DataError::BadRow {
            path: path.to_path_buf(),
            line: e.position().map_or(0, |p| line_at(p.byte())),
            why: e.to_string(),
        })?;
        let start = record.position().map_or(0, csv::Position::byte);
        spanning = record.iter().any(|f| f.contains('\n')).then_some(start);
        let line = line_at(start);
        let get = |i: usize| record.get(i).map(|s| s.trim_end_matches('\r').to_string());
        rows.push(Row {
            premise: get(p).unwrap_or_default(),
            hypothesis: get(h).unwrap_or_default(),
            label: l.and_then(get).filter(|s| !s.is_empty()),
            line,
        });
    }
    // A quote left open reads the rest of the file into one field, as csv
    // does (pandas refuses it: "EOF inside string"); a record that spans
    // lines with an odd number of quotes from its start to the end is one.
    if let Some(start) = spanning.filter(|_| delimiter == b',') {
        let rest = &text.as_bytes()[(start as usize).min(text.len())..];
        if rest.iter().filter(|b| **b == b'"').count() % 2 == 1 {
            return Err(DataError::BadRow {
                path: path.to_path_buf(),
                line: line_at(start),
                why: "a quoted field opened in this row is never closed, so the rest of the file was read into it: close it with `\"` (a quote inside quotes is `\"\"`)".into(),
            });
        }
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(bad_rows: BadRows) -> PairSchema {
        PairSchema {
            premise: "premise".into(),
            hypothesis: "hypothesis".into(),
            label: "label".into(),
            labels: vec![
                "entailment".into(),
                "neutral".into(),
                "contradiction".into(),
            ],
            bad_rows,
            format: PairFormat::Auto,
            require_label: true,
        }
    }

    fn file(name: &str, bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(name);
        std::fs::write(&path, bytes).expect("write");
        (dir, path)
    }

    /// Reads `bytes` as `name` and returns (pairs, skipped lines) or the error text.
    fn check(name: &str, bytes: &[u8], bad: BadRows) -> Result<(usize, Vec<usize>), String> {
        let (_d, path) = file(name, bytes);
        read_pairs(&path, &schema(bad))
            .map(|d| (d.pairs.len(), d.skipped.iter().map(|s| s.0).collect()))
            .map_err(|e| e.to_string())
    }

    const JSONL: &str = "{\"premise\": \"A man.\", \"hypothesis\": \"A person.\", \"label\": \"entailment\"}\n\
        {\"premise\": \"A man.\", \"hypothesis\": \"A dog.\", \"label\": \"contradiction\"}\n\
        {\"premise\": \"A man.\", \"hypothesis\": \"A tall man.\", \"label\": \"-\"}\n\
        {\"premise\": \"A man.\", \"hypothesis\": \"\", \"label\": \"neutral\"}\n\
        {\"premise\": \"A cat.\", \"hypothesis\": \"An animal.\"}\n";

    #[test]
    fn jsonl_skips_bad_labels_and_empty_text_and_names_lines() {
        assert_eq!(
            check("d.jsonl", JSONL.as_bytes(), BadRows::Skip),
            Ok((2, vec![3, 4, 5]))
        );
        let err = check("d.jsonl", JSONL.as_bytes(), BadRows::Error).expect_err("rejects");
        assert!(
            err.contains("d.jsonl` line 3") && err.contains("unknown label \"-\""),
            "{err}"
        );
    }

    #[test]
    fn crlf_bom_tsv_and_csv_read_the_same_pairs() {
        let crlf = format!("\u{feff}{}", JSONL.replace('\n', "\r\n"));
        assert_eq!(
            check("d.jsonl", crlf.as_bytes(), BadRows::Skip),
            Ok((2, vec![3, 4, 5]))
        );
        let tsv = "\u{feff}premise\thypothesis\tlabel\r\nA man.\tA person.\tentailment\r\nA man.\tA dog.\tcontradiction\r\nA man.\t\tneutral\r\n";
        assert_eq!(
            check("d.tsv", tsv.as_bytes(), BadRows::Skip),
            Ok((2, vec![4]))
        );
        let csv = "label,premise,hypothesis\nentailment,\"A man, tall.\",A person.\nneutral,A man.,\"He is \"\"tall\"\".\"\n";
        let (_d, path) = file("d.csv", csv.as_bytes());
        let d = read_pairs(&path, &schema(BadRows::Skip)).expect("reads");
        assert_eq!(d.pairs[0].premise, "A man, tall.");
        assert_eq!(d.pairs[1].hypothesis, "He is \"tall\".");
        assert_eq!(d.label_counts(), vec![1, 1, 0]);
        // A quote never closed swallowed the rows after it into one field;
        // a field that spans lines and closes, or a lone inch mark, is fine.
        let open = "premise,hypothesis,label\nA,B,neutral\nC,\"never closed,neutral\nE,F,neutral\n";
        let err = check("d.csv", open.as_bytes(), BadRows::Skip).expect_err("open quote");
        assert!(
            err.contains("d.csv` line 3") && err.contains("never closed"),
            "{err}"
        );
        let fine = "premise,hypothesis,label\nA 5\" man,B,neutral\nC,\"two\nlines\",neutral\n";
        assert_eq!(
            check("d.csv", fine.as_bytes(), BadRows::Skip),
            Ok((2, vec![]))
        );
    }

    #[test]
    fn structural_problems_are_errors_with_file_and_line() {
        let err = check("d.jsonl", b"{\"premise\": \"a\", \"hypothesis\": \"b\", \"label\": \"neutral\"}\n{\"premise\": \n", BadRows::Skip)
            .expect_err("malformed");
        assert!(
            err.contains("line 2") && err.contains("malformed JSON"),
            "{err}"
        );
        let err = check(
            "d.jsonl",
            b"{\"sentence1\": \"a\", \"hypothesis\": \"b\", \"label\": \"neutral\"}\n",
            BadRows::Skip,
        )
        .expect_err("missing field");
        assert!(
            err.contains("line 1") && err.contains("no field `premise`"),
            "{err}"
        );
        let err = check(
            "d.tsv",
            b"sentence1\tsentence2\tlabel\na\tb\tneutral\n",
            BadRows::Skip,
        )
        .expect_err("missing column");
        assert!(
            err.contains("no column `premise`") && err.contains("sentence1"),
            "{err}"
        );
        let err =
            check("d.jsonl", b"{\"premise\": \"caf\xe9\"}\n", BadRows::Skip).expect_err("latin-1");
        assert!(
            err.contains("invalid byte 0xe9") && err.contains("line 1"),
            "{err}"
        );
        let err = check(
            "d.jsonl",
            b"{\"premise\": \"a\", \"hypothesis\": \"b\", \"label\": \"x\"}\n",
            BadRows::Skip,
        )
        .expect_err("nothing usable");
        // The first skipped row's reason, not only a count.
        assert!(
            err.contains("no usable pair in the file (its one row, line 1: unknown label \"x\""),
            "{err}"
        );
    }

    /// Labels as Hugging Face's datasets write them in TSV and CSV: the
    /// index of the name (as a JSON number is read); `-1` (SNLI's "no gold
    /// label") and indices past the names are unknown; a name that is a
    /// number is its name first.
    #[test]
    fn whole_number_labels_are_indices_of_the_names() {
        let tsv =
            "premise\thypothesis\tlabel\na\tb\t0\nc\td\t2\ne\tf\t-1\ng\th\t3\ni\tj\tneutral\n";
        let (_d, path) = file("d.tsv", tsv.as_bytes());
        let d = read_pairs(&path, &schema(BadRows::Skip)).expect("reads");
        let labels: Vec<Option<usize>> = d.pairs.iter().map(|p| p.label).collect();
        assert_eq!(labels, vec![Some(0), Some(2), Some(1)]);
        assert_eq!(
            d.skipped.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![4, 5]
        );
        assert!(
            d.skipped[0].1.contains("unknown label \"-1\""),
            "{:?}",
            d.skipped
        );
        let named = PairSchema {
            labels: vec!["1".into(), "0".into()],
            ..schema(BadRows::Skip)
        };
        let tsv = "premise\thypothesis\tlabel\na\tb\t0\nc\td\t1\n";
        let (_d, path) = file("n.tsv", tsv.as_bytes());
        let d = read_pairs(&path, &named).expect("reads");
        let labels: Vec<Option<usize>> = d.pairs.iter().map(|p| p.label).collect();
        assert_eq!(labels, vec![Some(1), Some(0)], "names before indices");
    }

    #[test]
    fn unlabelled_rows_are_kept_when_labels_are_optional() {
        let optional = PairSchema {
            require_label: false,
            ..schema(BadRows::Error)
        };
        let (_d, path) = file("d.jsonl", b"{\"premise\": \"a\", \"hypothesis\": \"b\"}\n");
        let d = read_pairs(&path, &optional).expect("reads");
        assert_eq!(d.pairs[0].label, None);
        // TSV and CSV without a label column, and with one partly filled.
        for (name, text) in [
            ("d.tsv", &b"premise\thypothesis\na\tb\n"[..]),
            ("d.csv", b"premise,hypothesis\n\"a, c\",b\n"),
            (
                "e.tsv",
                b"premise\thypothesis\tlabel\na\tb\tneutral\nc\td\n",
            ),
        ] {
            let (_d, path) = file(name, text);
            let d = read_pairs(&path, &optional).unwrap_or_else(|e| panic!("{name}: {e}"));
            let labels: Vec<Option<usize>> = d.pairs.iter().map(|p| p.label).collect();
            let want = if name == "e.tsv" {
                vec![Some(1), None]
            } else {
                vec![None]
            };
            assert_eq!(labels, want, "{name}");
        }
        // Required, the label column is still named when it is missing.
        let (_d, path) = file("d.tsv", b"premise\thypothesis\na\tb\n");
        let err = read_pairs(&path, &schema(BadRows::Error))
            .expect_err("required")
            .to_string();
        assert!(err.contains("no column `label`"), "{err}");
    }

    #[test]
    fn numeric_labels_index_the_label_names() {
        let d = check(
            "d.jsonl",
            b"{\"premise\": \"a\", \"hypothesis\": \"b\", \"label\": 2}\n",
            BadRows::Error,
        );
        assert_eq!(d, Ok((1, vec![])));
    }
}
