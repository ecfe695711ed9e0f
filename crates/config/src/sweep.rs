//! Hydra's multirun over command-line overrides: `key=a,b,c` (or
//! `key=choice(a,b,c)`) and `key=range(start,stop[,step])` each sweep a key,
//! and the jobs are every combination, the last swept key varying fastest,
//! as Hydra's basic sweeper orders them ([`expand`]). Everything else is
//! one value for every job: a list (`data.labels=[a,b]`), a quoted string
//! (`"a,b"`), a plain value. [`draw`] is random search instead, as Hydra's
//! Optuna sweeper writes its distributions: each of N trials draws every
//! swept key, `interval(a,b)` uniformly, `tag(log, interval(a,b))`
//! log-uniformly, `int(...)` of either as a whole number (both ends in),
//! and a list, `choice` or `range` as one of its values. What runs the jobs
//! is the caller's (`kiln train -m`).

use rand::rngs::StdRng;
use rand::{RngExt as _, SeedableRng as _};
use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// The most jobs one sweep may have: a typo in a `range` should not start
/// a million runs.
pub const MAX_JOBS: usize = 10_000;

/// A swept key and its values, in the order given.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Axis {
    /// The key, dotted, as written (`training.learning_rate`).
    pub key: String,
    /// Its values, as the override syntax reads them (TOML, else a string);
    /// in random search, each trial's draw.
    pub values: Vec<String>,
    /// In random search, what the values were drawn from, as written
    /// (`tag(log, interval(1e-4, 1e-2))`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drawn_from: Option<String>,
}

/// One job of a sweep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SweepJob {
    /// Every override of the job, in the order given: the swept ones as
    /// `key=value` with this job's value.
    pub overrides: Vec<String>,
    /// The swept keys and this job's value of each, in the axes' order.
    pub swept: Vec<(String, String)>,
}

/// The axes `overrides` sweep and the jobs they make, in order. An override
/// that sweeps nothing is in every job as given (one that is not
/// `key=value` too: the resolver names what is wrong with it). A sweep of
/// nothing is one job.
pub fn expand(overrides: &[String]) -> Result<(Vec<Axis>, Vec<SweepJob>), ConfigError> {
    // For each override: `Some(axis index)` if it sweeps.
    let mut axes: Vec<Axis> = Vec::new();
    let mut slots: Vec<Option<usize>> = Vec::new();
    for arg in overrides {
        let Some((key, value)) = arg.split_once('=') else {
            slots.push(None);
            continue;
        };
        if distribution(value).is_some() {
            return Err(ConfigError::BadOverride {
                arg: arg.clone(),
                reason: "interval() is a distribution, not a list of values: add --trials N to draw N jobs from it (random search)".into(),
            });
        }
        let values = sweep_values(value).map_err(|reason| ConfigError::BadOverride {
            arg: arg.clone(),
            reason,
        })?;
        if values.len() < 2 && !is_call(value) {
            slots.push(None);
            continue;
        }
        let key = key.trim().to_string();
        if axes.iter().any(|a| a.key == key) {
            return Err(ConfigError::BadOverride {
                arg: arg.clone(),
                reason: format!("`{key}` is swept twice; give all its values in one override"),
            });
        }
        slots.push(Some(axes.len()));
        axes.push(Axis {
            key,
            values,
            drawn_from: None,
        });
    }
    let count = axes
        .iter()
        .try_fold(1usize, |n, a| n.checked_mul(a.values.len()))
        .filter(|&n| n <= MAX_JOBS)
        .ok_or_else(|| ConfigError::BadOverride {
            arg: axes
                .iter()
                .map(|a| format!("{}={} values", a.key, a.values.len()))
                .collect::<Vec<_>>()
                .join(" "),
            reason: format!("a sweep of more than {MAX_JOBS} jobs"),
        })?;
    let jobs = (0..count)
        .map(|n| {
            // The job's index of each axis, the last varying fastest.
            let mut rest = n;
            let mut picks = vec![0; axes.len()];
            for (i, axis) in axes.iter().enumerate().rev() {
                picks[i] = rest % axis.values.len();
                rest /= axis.values.len();
            }
            let overrides = overrides
                .iter()
                .zip(&slots)
                .map(|(arg, slot)| match slot {
                    Some(i) => format!("{}={}", axes[*i].key, axes[*i].values[picks[*i]]),
                    None => arg.clone(),
                })
                .collect();
            let swept = axes
                .iter()
                .zip(&picks)
                .map(|(a, &p)| (a.key.clone(), a.values[p].clone()))
                .collect();
            SweepJob { overrides, swept }
        })
        .collect();
    Ok((axes, jobs))
}

/// A distribution of random search: Optuna's, as Hydra's Optuna sweeper
/// writes them.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Distribution {
    low: f64,
    high: f64,
    log: bool,
    int: bool,
}

impl Distribution {
    /// One draw, as the override syntax writes it: a whole number, or a
    /// decimal of 4 significant digits.
    fn draw(&self, rng: &mut StdRng) -> String {
        let (low, high) = if self.log {
            (self.low.ln(), self.high.ln())
        } else {
            (self.low, self.high)
        };
        if self.int {
            // Both ends in, each whole number as likely (on the log scale:
            // as its share of the log range, as Optuna's).
            let (lo, hi) = (self.low.round(), self.high.round());
            let v = if self.log {
                let x = rng.random_range((lo - 0.5).max(0.5).ln()..(hi + 0.5).ln());
                x.exp().round()
            } else {
                rng.random_range(lo..hi + 1.0).floor()
            };
            return format!("{}", v.clamp(lo, hi) as i64);
        }
        let x = rng.random_range(low..high);
        decimal(if self.log { x.exp() } else { x }, 4)
    }
}

/// `value` as a distribution (`interval(a,b)`, `tag(log, interval(a,b))`,
/// `int(...)` of either), `None` if it is none; `Some(Err)` if it is one,
/// malformed.
fn distribution(value: &str) -> Option<Result<Distribution, String>> {
    let mut v = value.trim();
    let mut int = false;
    let mut log = false;
    if let Some(inner) = v.strip_prefix("int(").and_then(|r| r.strip_suffix(')')) {
        int = true;
        v = inner.trim();
    }
    if let Some(inner) = v.strip_prefix("tag(").and_then(|r| r.strip_suffix(')')) {
        let (tag, rest) = inner.split_once(',')?;
        if tag.trim() != "log" {
            return Some(Err(format!(
                "tag({}, ...): the tag random search reads is `log`",
                tag.trim()
            )));
        }
        log = true;
        v = rest.trim();
    }
    let inner = v.strip_prefix("interval(")?.strip_suffix(')')?;
    let bounds: Vec<&str> = inner.split(',').map(str::trim).collect();
    let parse = |t: &str| {
        t.parse::<f64>()
            .ok()
            .filter(|x| x.is_finite())
            .ok_or_else(|| format!("`{t}` in interval() is not a number"))
    };
    Some((|| {
        let [low, high] = bounds.as_slice() else {
            return Err("interval takes low,high".to_string());
        };
        let (low, high) = (parse(low)?, parse(high)?);
        if low >= high {
            return Err(format!(
                "interval({low}, {high}) is empty: low must be below high"
            ));
        }
        if log && low <= 0.0 {
            return Err(format!(
                "tag(log, interval({low}, {high})): a log scale needs a low above 0"
            ));
        }
        Ok(Distribution {
            low,
            high,
            log,
            int,
        })
    })())
}

/// Random search: `trials` jobs, each drawing every swept key of
/// `overrides` from a random stream seeded with `seed` (a distribution as
/// [`Distribution`] reads it; a list, `choice` or `range` as one of its
/// values, each as likely). The draws are recorded in the jobs: the same
/// overrides and seed draw the same jobs with this build.
pub fn draw(
    overrides: &[String],
    trials: usize,
    seed: u64,
) -> Result<(Vec<Axis>, Vec<SweepJob>), ConfigError> {
    if trials == 0 || trials > MAX_JOBS {
        return Err(ConfigError::BadOverride {
            arg: format!("--trials {trials}"),
            reason: format!("random search runs 1 to {MAX_JOBS} trials"),
        });
    }
    // Each override: its distribution, its values, or nothing to draw.
    enum Slot {
        Fixed,
        Drawn(Distribution, usize),
        Picked(Vec<String>, usize),
    }
    let mut axes: Vec<Axis> = Vec::new();
    let mut slots = Vec::new();
    for arg in overrides {
        let Some((key, value)) = arg.split_once('=') else {
            slots.push(Slot::Fixed);
            continue;
        };
        let key = key.trim().to_string();
        let bad = |reason: String| ConfigError::BadOverride {
            arg: arg.clone(),
            reason,
        };
        let slot = match distribution(value) {
            Some(d) => Slot::Drawn(d.map_err(bad)?, axes.len()),
            None => {
                let values = sweep_values(value).map_err(bad)?;
                if values.len() < 2 && !is_call(value) {
                    slots.push(Slot::Fixed);
                    continue;
                }
                Slot::Picked(values, axes.len())
            }
        };
        if axes.iter().any(|a| a.key == key) {
            return Err(bad(format!(
                "`{key}` is swept twice; give all its values in one override"
            )));
        }
        axes.push(Axis {
            key,
            values: Vec::new(),
            drawn_from: Some(value.trim().to_string()),
        });
        slots.push(slot);
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let mut jobs = Vec::with_capacity(trials);
    for _ in 0..trials {
        let mut swept = vec![(String::new(), String::new()); axes.len()];
        let overrides = overrides
            .iter()
            .zip(&slots)
            .map(|(arg, slot)| {
                let (value, i) = match slot {
                    Slot::Fixed => return arg.clone(),
                    Slot::Drawn(d, i) => (d.draw(&mut rng), *i),
                    Slot::Picked(values, i) => {
                        (values[rng.random_range(0..values.len())].clone(), *i)
                    }
                };
                axes[i].values.push(value.clone());
                swept[i] = (axes[i].key.clone(), value.clone());
                format!("{}={value}", axes[i].key)
            })
            .collect();
        jobs.push(SweepJob { overrides, swept });
    }
    Ok((axes, jobs))
}

/// `v` to `digits` significant digits, in the shortest text that reads back
/// as that; a whole number stays a float for TOML (`1.0`, not `1`).
fn decimal(v: f64, digits: usize) -> String {
    let rounded: f64 = format!("{v:.*e}", digits.saturating_sub(1))
        .parse()
        .unwrap_or(v);
    let text = rounded.to_string();
    if text.contains(['.', 'e', 'E']) {
        text
    } else {
        format!("{text}.0")
    }
}

/// Whether `value` is a sweep function (`range(...)`, `choice(...)`), which
/// sweeps even with one value.
fn is_call(value: &str) -> bool {
    let v = value.trim();
    (v.starts_with("range(") || v.starts_with("choice(")) && v.ends_with(')')
}

/// The values one override's value stands for: several for a sweep, one
/// otherwise.
fn sweep_values(value: &str) -> Result<Vec<String>, String> {
    let v = value.trim();
    if let Some(inner) = v.strip_prefix("range(").and_then(|r| r.strip_suffix(')')) {
        return range(inner);
    }
    if let Some(inner) = v.strip_prefix("choice(").and_then(|r| r.strip_suffix(')')) {
        let values = split_top_level(inner)?;
        if values.iter().all(String::is_empty) {
            return Err("choice() of nothing".into());
        }
        return Ok(values);
    }
    let values = split_top_level(value)?;
    Ok(if values.len() < 2 {
        vec![value.to_string()]
    } else {
        values
    })
}

/// `s` split at the commas outside brackets and quotes, each part trimmed;
/// an empty part is an error (`a,,b`, `a,`).
fn split_top_level(s: &str) -> Result<Vec<String>, String> {
    let mut parts = Vec::new();
    let mut depth: Vec<char> = Vec::new();
    let mut quote: Option<char> = None;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '(' | '{') => depth.push(c),
            (None, ']' | ')' | '}') => {
                let open = match c {
                    ']' => '[',
                    ')' => '(',
                    _ => '{',
                };
                if depth.pop() != Some(open) {
                    return Err(format!("`{c}` without its opening bracket"));
                }
            }
            (None, ',') if depth.is_empty() => {
                parts.push(s[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    if let Some(q) = quote {
        return Err(format!("a {q} quote is not closed"));
    }
    if let Some(open) = depth.last() {
        return Err(format!("`{open}` is not closed"));
    }
    parts.push(s[start..].trim().to_string());
    if parts.len() > 1 && parts.iter().any(String::is_empty) {
        return Err("an empty value in a comma-separated sweep".into());
    }
    Ok(parts)
}

/// Hydra's (and Python's) `range`: `stop`, `start,stop` or
/// `start,stop,step`, `stop` excluded; integers, or decimals when any bound
/// is one (`range(0.1,0.5,0.1)` is 0.1, 0.2, 0.3, 0.4).
fn range(inner: &str) -> Result<Vec<String>, String> {
    let args = split_top_level(inner)?;
    let (start, stop, step) = match args.as_slice() {
        [stop] => ("0", stop.as_str(), "1"),
        [start, stop] => (start.as_str(), stop.as_str(), "1"),
        [start, stop, step] => (start.as_str(), stop.as_str(), step.as_str()),
        _ => return Err("range takes stop, start,stop or start,stop,step".into()),
    };
    if let (Ok(a), Ok(b), Ok(s)) = (
        start.parse::<i64>().map(i128::from),
        stop.parse::<i64>().map(i128::from),
        step.parse::<i64>().map(i128::from),
    ) {
        if s == 0 {
            return Err("range with a step of 0".into());
        }
        let count = (b - a + s - s.signum()) / s;
        if count <= 0 {
            return Err(format!("range({inner}) is empty"));
        }
        if count > MAX_JOBS as i128 {
            return Err(format!("range({inner}) has more than {MAX_JOBS} values"));
        }
        return Ok((0..count).map(|i| (a + i * s).to_string()).collect());
    }
    let number = |t: &str| {
        t.parse::<f64>()
            .ok()
            .filter(|v| v.is_finite())
            .ok_or_else(|| format!("`{t}` in range() is not a number"))
    };
    let (a, b, s) = (number(start)?, number(stop)?, number(step)?);
    if s == 0.0 {
        return Err("range with a step of 0".into());
    }
    // The values short of `stop` by more than rounding.
    let count = ((b - a) / s - 1e-9).ceil();
    if count < 1.0 {
        return Err(format!("range({inner}) is empty"));
    }
    if count > MAX_JOBS as f64 {
        return Err(format!("range({inner}) has more than {MAX_JOBS} values"));
    }
    Ok((0..count as usize)
        .map(|i| {
            // Twelve significant digits: 0.1 + 2 × 0.1 is written 0.3.
            decimal(a + i as f64 * s, 12)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    fn values(v: &str) -> Vec<String> {
        sweep_values(v).expect("sweep values")
    }

    #[test]
    fn the_last_swept_key_varies_fastest_and_fixed_overrides_stay_in_place() {
        let (axes, jobs) = expand(&args(&[
            "training.learning_rate=1e-3,3e-4",
            "hardware=cpu",
            "model.layers=range(2,5)",
        ]))
        .expect("expand");
        assert_eq!(axes.len(), 2);
        assert_eq!(axes[1].values, ["2", "3", "4"]);
        assert_eq!(jobs.len(), 6);
        assert_eq!(
            jobs[1].overrides,
            [
                "training.learning_rate=1e-3",
                "hardware=cpu",
                "model.layers=3"
            ]
        );
        assert_eq!(
            jobs[3].swept,
            [
                ("training.learning_rate".to_string(), "3e-4".to_string()),
                ("model.layers".to_string(), "2".to_string())
            ]
        );
    }

    #[test]
    fn lists_quotes_and_plain_values_are_one_value() {
        assert_eq!(values("[1, 2]"), ["[1, 2]"]);
        assert_eq!(values("\"a,b\""), ["\"a,b\""]);
        assert_eq!(values("'a,b'"), ["'a,b'"]);
        assert_eq!(values("data/x.txt"), ["data/x.txt"]);
        assert_eq!(values("[1,2],[3, 4]"), ["[1,2]", "[3, 4]"]);
        assert_eq!(values("a, b"), ["a", "b"]);
        let (axes, jobs) = expand(&args(&["data.labels=[a,b]", "x"])).expect("expand");
        assert!(axes.is_empty());
        assert_eq!(jobs.len(), 1);
        assert_eq!(jobs[0].overrides, ["data.labels=[a,b]", "x"]);
    }

    #[test]
    fn ranges_and_choices_as_hydra_writes_them() {
        assert_eq!(values("range(3)"), ["0", "1", "2"]);
        assert_eq!(values("range(10,0,-4)"), ["10", "6", "2"]);
        assert_eq!(values("range(0.1,0.5,0.1)"), ["0.1", "0.2", "0.3", "0.4"]);
        assert_eq!(values("range(1,3,0.5)"), ["1.0", "1.5", "2.0", "2.5"]);
        assert_eq!(
            values("range(1e-4,4e-4,1e-4)"),
            ["0.0001", "0.0002", "0.0003"]
        );
        assert_eq!(values("choice(gelu, relu)"), ["gelu", "relu"]);
        // One value, swept: the job list names it.
        let (axes, _) = expand(&args(&["model.layers=choice(4)"])).expect("expand");
        assert_eq!(axes[0].values, ["4"]);
    }

    #[test]
    fn random_search_draws_each_key_from_its_distribution_the_same_each_time() {
        let overrides = args(&[
            "training.learning_rate=tag(log, interval(1e-4, 1e-2))",
            "hardware=cpu",
            "training.warmup_steps=int(interval(10, 20))",
            "model.layers=2,4",
            "model.dropout=interval(0, 0.2)",
            "training.batch_size=int(tag(log, interval(2, 64)))",
        ]);
        let (axes, jobs) = draw(&overrides, 200, 7).expect("draw");
        assert_eq!(jobs.len(), 200);
        assert_eq!(axes.len(), 5);
        assert_eq!(
            axes[0].drawn_from.as_deref(),
            Some("tag(log, interval(1e-4, 1e-2))")
        );
        let column = |i: usize| -> Vec<f64> {
            axes[i]
                .values
                .iter()
                .map(|v| v.parse().expect("number"))
                .collect()
        };
        let lr = column(0);
        assert!(lr.iter().all(|v| (1e-4..1e-2).contains(v)));
        // Log-uniform: about half below the geometric middle, 1e-3.
        let below = lr.iter().filter(|&&v| v < 1e-3).count();
        assert!((70..130).contains(&below), "{below} of 200 below 1e-3");
        let warmup = column(1);
        assert!(
            warmup
                .iter()
                .all(|v| v.fract() == 0.0 && (10.0..=20.0).contains(v))
        );
        for end in [10.0, 20.0] {
            assert!(warmup.contains(&end), "{end} is drawn too");
        }
        assert!(axes[2].values.iter().all(|v| v == "2" || v == "4"));
        assert!(axes[2].values.iter().any(|v| v == "2") && axes[2].values.iter().any(|v| v == "4"));
        assert!(column(3).iter().all(|v| (0.0..0.2).contains(v)));
        let batch = column(4);
        assert!(
            batch
                .iter()
                .all(|v| v.fract() == 0.0 && (2.0..=64.0).contains(v))
        );
        let small = batch.iter().filter(|&&v| v <= 11.0).count();
        assert!(
            (70..130).contains(&small),
            "{small} of 200 at most 11 (log-uniform)"
        );
        // A job's overrides hold its draws in place; the fixed one stays.
        assert_eq!(jobs[3].overrides[1], "hardware=cpu");
        assert_eq!(
            jobs[3].overrides[0],
            format!("training.learning_rate={}", axes[0].values[3])
        );
        assert_eq!(
            jobs[3].swept[2],
            ("model.layers".into(), axes[2].values[3].clone())
        );
        // The same seed draws the same jobs; another seed others.
        assert_eq!(draw(&overrides, 200, 7).expect("again").1, jobs);
        assert_ne!(draw(&overrides, 200, 8).expect("other").1, jobs);
    }

    #[test]
    fn distributions_need_trials_and_say_what_is_wrong() {
        let err = expand(&args(&["a=interval(0,1)"])).expect_err("grid");
        assert!(err.to_string().contains("add --trials N"), "{err}");
        for (arg, part) in [
            ("a=interval(1,1)", "is empty"),
            ("a=interval(x,1)", "`x` in interval() is not a number"),
            ("a=interval(1)", "interval takes low,high"),
            (
                "a=tag(log, interval(0, 1))",
                "a log scale needs a low above 0",
            ),
            (
                "a=tag(lin, interval(0, 1))",
                "the tag random search reads is `log`",
            ),
        ] {
            let err = draw(&args(&[arg]), 2, 0).expect_err(arg).to_string();
            assert!(err.contains(arg) && err.contains(part), "{arg}: {err}");
        }
        assert!(draw(&args(&["a=1,2"]), 0, 0).is_err());
    }

    #[test]
    fn malformed_sweeps_are_named() {
        for (arg, part) in [
            ("a=1,,2", "empty value"),
            ("a=1,", "empty value"),
            ("a=[1,2", "not closed"),
            ("a=1]", "without its opening"),
            ("a='x", "quote is not closed"),
            ("a=range(0)", "is empty"),
            ("a=range(1,2,0)", "step of 0"),
            ("a=range(x,3)", "`x` in range() is not a number"),
            ("a=range(1,2,3,4)", "range takes"),
            ("a=range(100000)", "more than"),
            ("a=choice()", "choice() of nothing"),
        ] {
            let err = expand(&args(&[arg])).expect_err(arg).to_string();
            assert!(err.contains(arg) && err.contains(part), "{arg}: {err}");
        }
        let err = expand(&args(&["a=1,2", "a=3,4"])).expect_err("twice");
        assert!(err.to_string().contains("swept twice"), "{err}");
        let err = expand(&args(&["a=range(200)", "b=range(200)"])).expect_err("too many");
        assert!(err.to_string().contains("more than 10000 jobs"), "{err}");
    }
}
