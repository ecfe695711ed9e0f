//! `cargo run -p kiln-data --example tokenize -- FILE [VOCAB]`: trains a
//! byte-level BPE tokenizer on a UTF-8 text file, encodes it, and pulls 100
//! batches of 64-token windows from a 2-worker loader.

#![allow(clippy::print_stdout, reason = "an example prints")]

use std::path::PathBuf;
use std::sync::Arc;

use kiln_data::{LmWindows, Loader, Split, Tokenizer, benchmark_loader, read_corpus};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: tokenize FILE [VOCAB]")?);
    let vocab: usize = args.next().map_or(Ok(1000), |v| v.parse())?;
    let corpus = read_corpus(&path, None)?;
    let tokenizer = Tokenizer::bpe(&corpus.text, vocab)?;
    let ids = tokenizer.encode(&corpus.text)?;
    println!(
        "{}: {} characters → {} tokens ({:.2} characters a token, vocabulary {})",
        path.display(),
        corpus.text.chars().count(),
        ids.len(),
        corpus.text.chars().count() as f64 / ids.len() as f64,
        tokenizer.vocab_size()
    );
    let first: Vec<u32> = ids.iter().copied().take(12).collect();
    println!("first tokens {first:?} = {:?}", tokenizer.decode(&first)?);
    let windows = LmWindows::new(ids.into(), 8, 64, 1337, Split::Train)?;
    let mut loader = Loader::new(Arc::new(windows), 0, 2, 4);
    let bench = benchmark_loader(&mut loader, 100)?;
    println!("loader: {bench:?}");
    Ok(())
}
