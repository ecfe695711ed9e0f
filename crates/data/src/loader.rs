//! The parallel loader: N worker threads, each with a bounded queue, and the
//! consumer's wait for each batch measured.
//!
//! Worker `w` of `N` makes batches `start + w`, `start + w + N`, ... in order
//! into its own queue of `prefetch` slots; the consumer takes batch `k` from
//! queue `(k - start) mod N`. So batches arrive in index order, the sequence is the
//! same for any N (a batch depends on its index alone), and resuming at
//! batch `k` is starting the loader at `k`. Workers live as long as the
//! loader (persistent across epochs) and stop when it is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, bounded};

/// Something that makes batch `index` on demand, from any thread.
pub trait BatchSource: Send + Sync + 'static {
    /// The batch it makes.
    type Batch: Send + 'static;
    /// Batch `index`: the same batch for the same index, whichever thread
    /// asks; an error where its data can no longer be read (a store's shard
    /// removed under the run).
    fn batch(&self, index: u64) -> Result<Self::Batch, crate::DataError>;
}

/// A batch and how long the consumer waited for it.
#[derive(Debug)]
pub struct Loaded<B> {
    /// The batch.
    pub batch: B,
    /// Its index in the sequence of batches.
    pub index: u64,
    /// How long the consumer waited for it (0 when it was ready).
    pub wait: Duration,
}

/// Batches from a source, in index order, made ahead by worker threads.
pub struct Loader<S: BatchSource> {
    source: Arc<S>,
    queues: Vec<Receiver<Result<S::Batch, crate::DataError>>>,
    workers: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    start: u64,
    next: u64,
}

impl<S: BatchSource> std::fmt::Debug for Loader<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("workers", &self.workers.len())
            .field("next", &self.next)
            .finish()
    }
}

impl<S: BatchSource> Loader<S> {
    /// Starts `num_workers` threads (0: batches are made on the calling
    /// thread when asked for), each keeping up to `prefetch` batches ready,
    /// beginning at batch `start`.
    pub fn new(source: Arc<S>, start: u64, num_workers: usize, prefetch: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let n = num_workers as u64;
        let mut queues = Vec::with_capacity(num_workers);
        let mut workers = Vec::with_capacity(num_workers);
        for w in 0..n {
            let (tx, rx) = bounded(prefetch.max(1));
            let source = Arc::clone(&source);
            let stop = Arc::clone(&stop);
            let handle = std::thread::Builder::new()
                .name(format!("kiln-loader-{w}"))
                .spawn(move || {
                    let mut index = start + w;
                    while !stop.load(Ordering::Relaxed) {
                        let batch = source.batch(index);
                        // After an error the consumer stops at that batch.
                        let failed = batch.is_err();
                        if tx.send(batch).is_err() || failed {
                            break;
                        }
                        index += n;
                    }
                });
            match handle {
                Ok(h) => {
                    queues.push(rx);
                    workers.push(h);
                }
                // No thread could be started: make batches inline instead.
                Err(_) => break,
            }
        }
        if workers.len() as u64 != n {
            stop.store(true, Ordering::Relaxed);
            queues.clear();
            for w in workers.drain(..) {
                let _ = w.join();
            }
        }
        Self {
            source,
            queues,
            workers,
            stop,
            start,
            next: start,
        }
    }

    /// The index of the next batch (the position to resume from).
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Worker threads (0: batches are made on the caller's thread).
    pub fn num_workers(&self) -> usize {
        self.workers.len()
    }

    /// The next batch, and how long this call waited for it; the error of
    /// a batch whose data could not be read.
    pub fn next_batch(&mut self) -> Result<Loaded<S::Batch>, crate::DataError> {
        let index = self.next;
        let started = Instant::now();
        let batch = if self.queues.is_empty() {
            self.source.batch(index)
        } else {
            let queue = &self.queues[((index - self.start) % self.queues.len() as u64) as usize];
            // A worker only stops when the loader drops or its thread
            // panicked: then make the batch here rather than hang.
            queue.recv().unwrap_or_else(|_| self.source.batch(index))
        }?;
        self.next += 1;
        Ok(Loaded {
            batch,
            index,
            wait: started.elapsed(),
        })
    }
}

impl<S: BatchSource> Drop for Loader<S> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Dropping the receivers wakes workers blocked on a full queue.
        self.queues.clear();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// What [`benchmark_loader`] measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoaderBenchmark {
    /// Batches taken.
    pub batches: usize,
    /// Mean time the consumer waited per batch.
    pub mean_wait: Duration,
    /// Batches per second when nothing else consumes time.
    pub batches_per_second: f64,
}

/// The guides' `benchmark_dataloader`: pulls `batches` batches as fast as
/// possible and reports the mean wait and the rate.
pub fn benchmark_loader<S: BatchSource>(
    loader: &mut Loader<S>,
    batches: usize,
) -> Result<LoaderBenchmark, crate::DataError> {
    let started = Instant::now();
    let mut waited = Duration::ZERO;
    for _ in 0..batches {
        waited += loader.next_batch()?.wait;
    }
    let total = started.elapsed().as_secs_f64();
    Ok(LoaderBenchmark {
        batches,
        mean_wait: waited / batches.max(1) as u32,
        batches_per_second: if total > 0.0 {
            batches as f64 / total
        } else {
            f64::INFINITY
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LmWindows, Split, TokenBatch};

    fn source() -> Arc<LmWindows> {
        let tokens: Arc<[u32]> = (0..5000u32).map(|i| i % 97).collect();
        Arc::new(LmWindows::new(tokens, 3, 16, 42, Split::Train).expect("long enough"))
    }

    fn first(workers: usize, start: u64, n: usize) -> Vec<TokenBatch> {
        let mut loader = Loader::new(source(), start, workers, 2);
        (0..n)
            .map(|_| loader.next_batch().expect("batch").batch)
            .collect()
    }

    #[test]
    fn the_same_batches_with_0_1_and_4_workers() {
        let zero = first(0, 0, 25);
        assert_eq!(zero, first(1, 0, 25));
        assert_eq!(zero, first(4, 0, 25));
        assert_eq!(
            zero.iter().map(|b| b.index).collect::<Vec<_>>(),
            (0..25).collect::<Vec<_>>()
        );
    }

    #[test]
    fn starting_at_k_continues_the_same_sequence() {
        let all = first(3, 0, 20);
        assert_eq!(all[7..], first(2, 7, 13)[..]);
    }

    #[test]
    fn dropping_a_loader_with_full_queues_stops_its_workers() {
        let mut loader = Loader::new(source(), 0, 4, 1);
        let _ = loader.next_batch().expect("batch");
        std::thread::sleep(Duration::from_millis(20));
        drop(loader); // joins: the test would hang if a worker stayed blocked
    }

    #[test]
    fn benchmark_counts_batches() {
        let mut loader = Loader::new(source(), 0, 2, 2);
        let b = benchmark_loader(&mut loader, 10).expect("bench");
        assert_eq!(b.batches, 10);
        assert!(b.batches_per_second > 0.0);
        assert_eq!(loader.position(), 10);
    }
}
