//! Grouped, stratified k-fold assignment: no group (premise) is in two
//! folds, and each fold's label mix stays as close to the whole's as the
//! groups allow.
//!
//! Groups are shuffled with the seed, then placed largest first, each into
//! the fold where it most reduces the squared distance of the fold's label
//! counts from their share of the whole (ties: the smaller fold). A repair
//! pass then moves single groups between folds while that lowers the largest
//! deviation. On SNLI-shaped data (mostly one hypothesis per label per
//! premise) every fold ends within one example of the whole's proportions.

use std::collections::HashMap;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// The fold (0..k) of each item, given each item's group key and label.
pub fn grouped_stratified_folds(
    groups: &[&str],
    labels: &[usize],
    n_labels: usize,
    k: usize,
    seed: u64,
) -> Vec<usize> {
    let k = k.max(1);
    let mut index: HashMap<&str, usize> = HashMap::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        let id = *index.entry(g).or_insert_with(|| {
            members.push(Vec::new());
            members.len() - 1
        });
        members[id].push(i);
    }
    let counts: Vec<Vec<i64>> = members
        .iter()
        .map(|m| {
            let mut c = vec![0i64; n_labels];
            for &i in m {
                c[labels[i]] += 1;
            }
            c
        })
        .collect();
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.shuffle(&mut StdRng::seed_from_u64(seed));
    order.sort_by_key(|&g| std::cmp::Reverse(members[g].len()));

    let total: Vec<f64> = (0..n_labels)
        .map(|l| counts.iter().map(|c| c[l] as f64).sum())
        .collect();
    let target: Vec<f64> = total.iter().map(|t| t / k as f64).collect();
    let mut fold_counts = vec![vec![0i64; n_labels]; k];
    let mut fold_of_group = vec![0usize; members.len()];
    for &g in &order {
        let best = (0..k)
            .min_by(|&a, &b| {
                let cost = |f: usize| -> f64 {
                    (0..n_labels)
                        .map(|l| counts[g][l] as f64 * (fold_counts[f][l] as f64 - target[l]))
                        .sum()
                };
                let size = |f: usize| fold_counts[f].iter().sum::<i64>();
                cost(a).total_cmp(&cost(b)).then(size(a).cmp(&size(b)))
            })
            .unwrap_or(0);
        fold_of_group[g] = best;
        for l in 0..n_labels {
            fold_counts[best][l] += counts[g][l];
        }
    }
    repair(&counts, &mut fold_of_group, &mut fold_counts, &total);
    let mut fold = vec![0; groups.len()];
    for (g, m) in members.iter().enumerate() {
        for &i in m {
            fold[i] = fold_of_group[g];
        }
    }
    fold
}

/// The largest |count − size·share| over folds and labels.
fn worst(fold_counts: &[Vec<i64>], total: &[f64]) -> f64 {
    let n: f64 = total.iter().sum();
    fold_counts
        .iter()
        .flat_map(|c| {
            let size: f64 = c.iter().sum::<i64>() as f64;
            c.iter()
                .zip(total)
                .map(move |(&x, &t)| (x as f64 - size * t / n).abs())
        })
        .fold(0.0, f64::max)
}

/// Moves single groups between folds while that lowers the worst deviation
/// (bounded, so it always ends).
fn repair(
    counts: &[Vec<i64>],
    fold_of_group: &mut [usize],
    fold_counts: &mut [Vec<i64>],
    total: &[f64],
) {
    let k = fold_counts.len();
    let n_labels = total.len();
    for _ in 0..counts.len().min(10_000) {
        let current = worst(fold_counts, total);
        if current <= 1.0 {
            return;
        }
        let mut best: Option<(f64, usize, usize)> = None;
        for (g, c) in counts.iter().enumerate() {
            // Small groups only: moving a big one shifts sizes too much.
            if c.iter().sum::<i64>() > 3 {
                continue;
            }
            let from = fold_of_group[g];
            for to in (0..k).filter(|&t| t != from) {
                for l in 0..n_labels {
                    fold_counts[from][l] -= c[l];
                    fold_counts[to][l] += c[l];
                }
                let w = worst(fold_counts, total);
                for l in 0..n_labels {
                    fold_counts[from][l] += c[l];
                    fold_counts[to][l] -= c[l];
                }
                if w < current - 1e-9 && best.is_none_or(|b| w < b.0) {
                    best = Some((w, g, to));
                }
            }
        }
        let Some((_, g, to)) = best else {
            return;
        };
        let from = fold_of_group[g];
        for l in 0..n_labels {
            fold_counts[from][l] -= counts[g][l];
            fold_counts[to][l] += counts[g][l];
        }
        fold_of_group[g] = to;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_stay_together_and_folds_are_balanced() {
        // 300 premises with one pair per label, 20 with two, 10 with one.
        let mut groups = Vec::new();
        let mut labels = Vec::new();
        for p in 0..330 {
            let n = if p < 300 {
                3
            } else if p < 320 {
                2
            } else {
                1
            };
            for j in 0..n {
                groups.push(format!("premise {p}"));
                labels.push((p + j) % 3);
            }
        }
        let refs: Vec<&str> = groups.iter().map(String::as_str).collect();
        let folds = grouped_stratified_folds(&refs, &labels, 3, 5, 7);
        let mut fold_of: HashMap<&str, usize> = HashMap::new();
        for (g, f) in refs.iter().zip(&folds) {
            assert_eq!(*fold_of.entry(g).or_insert(*f), *f, "{g} in two folds");
        }
        let n = labels.len() as f64;
        for f in 0..5 {
            let size = folds.iter().filter(|&&x| x == f).count() as f64;
            assert!((size - n / 5.0).abs() <= 3.0, "fold {f} has {size}");
            for l in 0..3 {
                let c = folds
                    .iter()
                    .zip(&labels)
                    .filter(|(x, y)| **x == f && **y == l)
                    .count() as f64;
                let share = labels.iter().filter(|&&y| y == l).count() as f64 / n;
                assert!(
                    (c - size * share).abs() <= 1.0,
                    "fold {f} label {l}: {c} vs {}",
                    size * share
                );
            }
        }
        assert_eq!(
            folds,
            grouped_stratified_folds(&refs, &labels, 3, 5, 7),
            "deterministic"
        );
    }
}
