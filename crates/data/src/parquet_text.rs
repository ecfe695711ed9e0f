//! A text column of a parquet file, a row group at a time, through
//! parquet's own column readers (no arrow): the Hugging Face Hub's datasets
//! (FineWeb, OpenWebText's conversions) ship as parquet with a `text` column.

use std::fs::File;

use parquet::basic::Type as PhysicalType;
use parquet::column::reader::ColumnReader;
use parquet::data_type::ByteArray;
use parquet::file::reader::{FileReader, SerializedFileReader};

use crate::documents::{Emit, InputFile, Piece, ReadOptions, SkippedRows};
use crate::{BadRows, DataError};

/// Rows decoded per call into the column reader.
const BATCH: usize = 1024;

pub(crate) fn read(
    input: &InputFile,
    options: &ReadOptions,
    skipped: &mut SkippedRows,
    emit: &mut Emit<'_>,
) -> Result<(), DataError> {
    let path = &input.path;
    let bad = |why: String| DataError::BadRow {
        path: path.clone(),
        line: 0,
        why,
    };
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.clone(),
        source,
    })?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| bad(format!("not a readable parquet file: {e}")))?;
    let schema = reader.metadata().file_metadata().schema_descr();
    let field = &options.text_field;
    let column = (0..schema.num_columns())
        .find(|&i| schema.column(i).path().string() == *field)
        .ok_or_else(|| {
            let names: Vec<String> = (0..schema.num_columns())
                .map(|i| schema.column(i).path().string())
                .collect();
            DataError::InvalidArgument {
                what: "data.text_field",
                why: format!(
                    "`{}` has no column `{field}` (its columns: {})",
                    path.display(),
                    names.join(", ")
                ),
            }
        })?;
    let descr = schema.column(column);
    if descr.physical_type() != PhysicalType::BYTE_ARRAY || descr.max_rep_level() > 0 {
        return Err(DataError::InvalidArgument {
            what: "data.text_field",
            why: format!(
                "the column `{field}` of `{}` is not a column of strings",
                path.display()
            ),
        });
    }
    let max_def = descr.max_def_level();
    let groups = reader.metadata().num_row_groups();
    let mut row = 0usize;
    for g in 0..groups {
        let group = reader
            .get_row_group(g)
            .map_err(|e| bad(format!("row group {g}: {e}")))?;
        // Progress: the compressed bytes of the row groups read so far.
        let done: i64 = (0..=g)
            .map(|i| reader.metadata().row_group(i).compressed_size())
            .sum();
        let ColumnReader::ByteArrayColumnReader(mut col) = group
            .get_column_reader(column)
            .map_err(|e| bad(format!("row group {g}: {e}")))?
        else {
            return Err(bad(format!("the column `{field}` is not a byte array")));
        };
        let mut defs: Vec<i16> = Vec::with_capacity(BATCH);
        let mut values: Vec<ByteArray> = Vec::with_capacity(BATCH);
        loop {
            defs.clear();
            values.clear();
            let (records, _, levels) = col
                .read_records(BATCH, Some(&mut defs), None, &mut values)
                .map_err(|e| bad(format!("row group {g}: {e}")))?;
            if records == 0 {
                break;
            }
            let mut next = values.drain(..);
            for i in 0..levels.max(records) {
                row += 1;
                let present = max_def == 0 || defs.get(i).is_some_and(|&d| d == max_def);
                let why = if present {
                    match next.next() {
                        Some(v) => match String::from_utf8(v.data().to_vec()) {
                            Ok(text) => {
                                let piece = Piece {
                                    text,
                                    doc_start: true,
                                };
                                if emit(piece, done.max(0) as u64)?.is_break() {
                                    return Ok(());
                                }
                                continue;
                            }
                            Err(_) => "the text is not UTF-8".to_string(),
                        },
                        None => "a value is missing".to_string(),
                    }
                } else {
                    format!("the column `{field}` is null")
                };
                match options.bad_rows {
                    BadRows::Error => {
                        return Err(DataError::BadRow {
                            path: path.clone(),
                            line: row,
                            why: format!(
                                "row {row}: {why} (data.bad_rows = \"skip\" skips such rows)"
                            ),
                        });
                    }
                    BadRows::Skip => {
                        skipped.add_row(format!("`{}` row {row}: {why}", path.display()))
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::ops::ControlFlow;
    use std::sync::Arc;

    use parquet::data_type::ByteArrayType;
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    use super::*;
    use crate::documents::{Compression, DocFormat};

    /// A parquet file of `id` and an optional `text`, a row group per slice.
    pub(crate) fn write_parquet(path: &std::path::Path, groups: &[&[Option<&str>]]) {
        let schema = Arc::new(
            parse_message_type("message doc { optional binary text (UTF8); }").expect("schema"),
        );
        let props = Arc::new(
            WriterProperties::builder()
                .set_compression(parquet::basic::Compression::SNAPPY)
                .build(),
        );
        let file = File::create(path).expect("create");
        let mut writer = SerializedFileWriter::new(file, schema, props).expect("writer");
        for rows in groups {
            let mut group = writer.next_row_group().expect("group");
            let mut col = group.next_column().expect("column").expect("text");
            let values: Vec<ByteArray> =
                rows.iter().flatten().map(|s| ByteArray::from(*s)).collect();
            let defs: Vec<i16> = rows.iter().map(|r| i16::from(r.is_some())).collect();
            col.typed::<ByteArrayType>()
                .write_batch(&values, Some(&defs), None)
                .expect("write");
            col.close().expect("close column");
            group.close().expect("close group");
        }
        writer.close().expect("close");
    }

    #[test]
    fn rows_come_in_order_across_row_groups_and_nulls_are_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.parquet");
        write_parquet(
            &path,
            &[&[Some("one"), None, Some("twö")], &[Some("three")]],
        );
        let input = InputFile {
            path: path.clone(),
            bytes: 0,
            format: DocFormat::Parquet,
            compression: Compression::None,
        };
        let mut options = ReadOptions {
            text_field: "text".into(),
            bad_rows: BadRows::Skip,
        };
        let mut docs = Vec::new();
        let mut skipped = SkippedRows::default();
        read(&input, &options, &mut skipped, &mut |p, _| {
            docs.push(p.text);
            Ok(ControlFlow::Continue(()))
        })
        .expect("reads");
        assert_eq!(docs, ["one", "twö", "three"]);
        assert_eq!(skipped.count, 1);
        assert!(
            skipped.first[0].contains("row 2: the column `text` is null"),
            "{:?}",
            skipped.first
        );
        let error = |options: &ReadOptions| -> String {
            read(&input, options, &mut SkippedRows::default(), &mut |_, _| {
                Ok(ControlFlow::Continue(()))
            })
            .expect_err("an error")
            .to_string()
        };
        options.bad_rows = BadRows::Error;
        let err = error(&options);
        assert!(err.contains("d.parquet` line 2: row 2"), "{err}");
        options.text_field = "content".into();
        let err = error(&options);
        assert!(
            err.contains("no column `content` (its columns: text)"),
            "{err}"
        );
    }
}
