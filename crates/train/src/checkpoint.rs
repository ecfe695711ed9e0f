//! Checkpoints: model, optimizer moments, counters and loader position in one
//! safetensors file, written atomically (temporary file, fsync, rename) with a
//! SHA-256 of its tensor data in the header. The last `keep` are kept; a
//! damaged one is found by its checksum and the previous one is used.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};

use crate::TrainError;
use crate::rundir::RunDir;

const FORMAT: &str = "kiln-checkpoint-1";

/// Where a checkpoint is and which step it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The checkpoint file.
    pub path: PathBuf,
    /// The optimizer steps taken when it was written.
    pub step: u64,
}

/// The model file kept for the best evaluation score (beside the
/// `checkpoints/` folder).
pub(crate) const BEST_MODEL: &str = "best.safetensors";

/// Everything a run needs to continue exactly.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CheckpointState {
    pub(crate) step: u64,
    pub(crate) loader_position: u64,
    pub(crate) adam_steps: u64,
    pub(crate) tokens_seen: u64,
    /// Seconds of training before this checkpoint, over all sessions.
    pub(crate) wall_s: f64,
    /// fp16's loss scale and its clean steps (runs that scale their loss).
    pub(crate) loss_scale: Option<(f64, u64)>,
    /// Data-parallel ranks that trained up to this checkpoint (1 alone;
    /// written to the header only above 1). `loader_position` counts
    /// global micro-batches of `batch_size × world_size` rows.
    pub(crate) world_size: u64,
    /// The evaluation after `step` was cut short by a stop: a resume runs
    /// it before the next step (written to the header only when true).
    pub(crate) eval_pending: bool,
    /// Model parameters by path: shape and values.
    pub(crate) params: Vec<(String, Vec<usize>, Vec<f32>)>,
    /// Adam moments by parameter path: (m, v), flattened.
    pub(crate) moments: Vec<(String, Vec<f32>, Vec<f32>)>,
}

/// f32 values as little-endian bytes (a checkpoint's tensors, a ZeRO
/// rank's moments on their way to rank 0).
pub(crate) fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// [`f32_bytes`] read back.
pub(crate) fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The checkpoint file of a step.
pub(crate) fn path_for(dir: &Path, step: u64) -> PathBuf {
    dir.join(format!("ckpt-{step:08}.safetensors"))
}

/// Writes the checkpoint of `state` into `dir` and deletes all but the
/// newest `keep`. Where the disk is full, the checkpoints that the write
/// would delete after it are deleted first and the write tried again, if
/// that makes room for it (never the newest, so that a failed write still
/// leaves one): a run resumed with a lower `checkpoint.keep` to make room
/// gets it.
pub(crate) fn save(
    dir: &Path,
    state: &CheckpointState,
    keep: usize,
) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    // The run's lock is ours: a temporary file here is a killed write's.
    crate::rundir::remove_debris(dir);
    let path = path_for(dir, state.step);
    let keep = keep.max(1);
    if let Err(mut e) = save_file(&path, state) {
        let TrainError::CheckpointWrite {
            bytes,
            source,
            hint,
            ..
        } = &mut e
        else {
            return Err(e);
        };
        if source.kind() != std::io::ErrorKind::StorageFull {
            return Err(e);
        }
        let existing = list(dir);
        let doomed = deleted_by_the_next(&existing, keep);
        let freed: u64 = doomed
            .iter()
            .filter_map(|c| std::fs::metadata(&c.path).ok())
            .map(|m| m.len())
            .sum();
        let room = free_bytes(dir).is_some_and(|free| free + freed > *bytes);
        if doomed.is_empty() || !room {
            *hint = format!(
                "; the disk is full: free space there, or keep fewer checkpoints (checkpoint.keep = {keep}, {} on disk now; `kiln resume <run> checkpoint.keep=N` changes it)",
                crate::counted(existing.len(), "checkpoint")
            );
            return Err(e);
        }
        for old in doomed {
            let _ = std::fs::remove_file(&old.path);
        }
        save_file(&path, state)?;
    }
    for old in list(dir).into_iter().rev().skip(keep) {
        let _ = std::fs::remove_file(old.path);
    }
    Ok(path)
}

/// Of `existing` (oldest first), those that the rotation after the next
/// checkpoint's write deletes (all but the newest `keep - 1`), less the
/// newest of them all: what a full disk may lose before that write.
fn deleted_by_the_next(existing: &[CheckpointInfo], keep: usize) -> &[CheckpointInfo] {
    let kept = keep.saturating_sub(1).max(1).min(existing.len());
    &existing[..existing.len() - kept]
}

/// The bytes free to this process on the file system of `dir`.
#[allow(
    clippy::useless_conversion,
    reason = "u64 on Linux, u32 block counts on macOS"
)]
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs reads the NUL-terminated path and writes only the
    // struct it is given.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    (unsafe { libc::statvfs(c.as_ptr(), &mut s) } == 0)
        .then(|| u64::from(s.f_bavail).saturating_mul(u64::from(s.f_frsize)))
}

/// Writes a model's parameters alone (no optimizer state) as the model
/// after optimizer step `step`: the best model's file.
pub(crate) fn save_params(
    path: &Path,
    step: u64,
    params: Vec<crate::params::NamedValues>,
) -> Result<(), TrainError> {
    let state = CheckpointState {
        step,
        loader_position: 0,
        adam_steps: 0,
        tokens_seen: 0,
        wall_s: 0.0,
        loss_scale: None,
        world_size: 1,
        eval_pending: false,
        params,
        moments: Vec::new(),
    };
    save_file(path, &state)
}

/// Writes `state` to `path` atomically: a temporary file beside it, synced,
/// then renamed into place.
pub(crate) fn save_file(path: &Path, state: &CheckpointState) -> Result<(), TrainError> {
    let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (p, shape, values) in &state.params {
        named.push((format!("model/{p}"), shape.clone(), f32_bytes(values)));
    }
    for (p, m, v) in &state.moments {
        named.push((format!("adam_m/{p}"), vec![m.len()], f32_bytes(m)));
        named.push((format!("adam_v/{p}"), vec![v.len()], f32_bytes(v)));
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut hasher = Sha256::new();
    for (_, _, bytes) in &named {
        hasher.update(bytes);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut metadata: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("step", state.step.to_string()),
        ("loader_position", state.loader_position.to_string()),
        ("adam_steps", state.adam_steps.to_string()),
        ("tokens_seen", state.tokens_seen.to_string()),
        ("wall_s", state.wall_s.to_string()),
        ("sha256", digest),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    if state.world_size > 1 {
        metadata.insert("world_size".into(), state.world_size.to_string());
    }
    if state.eval_pending {
        metadata.insert("eval_pending".into(), "true".into());
    }
    if let Some((scale, clean)) = state.loss_scale {
        metadata.insert("loss_scale".into(), scale.to_string());
        metadata.insert("loss_scale_clean".into(), clean.to_string());
    }
    let other = |e: safetensors::SafeTensorError| TrainError::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    };
    let views: Vec<(String, TensorView<'_>)> = named
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(Dtype::F32, shape.clone(), bytes).map(|view| (name.clone(), view))
        })
        .collect::<Result<_, _>>()
        .map_err(other)?;
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(other)?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut file| {
        file.write_all(&bytes)?;
        file.sync_all()
    });
    if let Err(source) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        // A full disk must not stay full with the debris of this write.
        let _ = std::fs::remove_file(&tmp);
        return Err(TrainError::CheckpointWrite {
            path: path.to_path_buf(),
            bytes: bytes.len() as u64,
            hint: String::new(),
            source,
        });
    }
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The checkpoints in `dir`, oldest first.
pub(crate) fn list(dir: &Path) -> Vec<CheckpointInfo> {
    let mut found: Vec<CheckpointInfo> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let step = name
                        .strip_prefix("ckpt-")?
                        .strip_suffix(".safetensors")?
                        .parse()
                        .ok()?;
                    Some(CheckpointInfo {
                        path: e.path(),
                        step,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|c| c.step);
    found
}

/// After a resume `--from` `step` set the best model aside (it was kept
/// after `step`): the best evaluation up to `step`, at `best_step`,
/// becomes `best.safetensors` again from its checkpoint, where that was
/// kept. Returns a note on what was done; `None` where the best model was
/// not set aside or there was no evaluation.
pub(crate) fn restore_best(
    run: &RunDir,
    step: u64,
    best_step: Option<u64>,
) -> Result<Option<String>, TrainError> {
    let path = run.file(BEST_MODEL);
    let Some(best_step) = best_step.filter(|_| !path.exists()) else {
        return Ok(None);
    };
    let Some(ckpt) = list(&run.checkpoints())
        .into_iter()
        .find(|c| c.step == best_step)
    else {
        return Ok(Some(format!(
            "the best model up to step {step} (step {best_step}) has no checkpoint: \
             best.safetensors is written again at the next better evaluation"
        )));
    };
    let params = load_params(&ckpt.path).map_err(|why| TrainError::CheckpointMismatch {
        path: ckpt.path.clone(),
        why,
    })?;
    save_params(&path, best_step, params)?;
    Ok(Some(format!(
        "the best model up to step {step} is step {best_step}'s again (best.safetensors, from its checkpoint)"
    )))
}

/// The step a checkpoint or model file at `path` was written after (its
/// header's `step`), reading the header alone; `None` where it is missing
/// or unreadable.
pub(crate) fn file_step(path: &Path) -> Option<u64> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let len = usize::try_from(u64::from_le_bytes(len)).ok()?;
    if len > 100 << 20 {
        return None;
    }
    let mut header = vec![0u8; len];
    file.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    header["__metadata__"]["step"].as_str()?.parse().ok()
}

/// Reads and verifies one checkpoint.
pub(crate) fn load(path: &Path) -> Result<CheckpointState, String> {
    read_checked(path, true)
}

/// The parameters of the checkpoint at `path`, checked whole as [`load`]
/// checks it; the optimizer's moments are hashed, not read out (two thirds
/// of an AdamW checkpoint): what sampling, prediction and export need.
pub(crate) fn load_params(path: &Path) -> Result<Vec<crate::params::NamedValues>, String> {
    read_checked(path, false).map(|state| state.params)
}

/// [`load`], the moments read out or (`moments` false) only hashed: then
/// the state's `moments` are empty.
fn read_checked(path: &Path, moments: bool) -> Result<CheckpointState, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let (_, meta) =
        SafeTensors::read_metadata(&bytes).map_err(|e| format!("unreadable header ({e})"))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err("not a kiln checkpoint".into());
    }
    let tensors =
        SafeTensors::deserialize(&bytes).map_err(|e| format!("truncated or damaged ({e})"))?;
    let mut names: Vec<String> = tensors.names().into_iter().map(String::from).collect();
    names.sort();
    let mut hasher = Sha256::new();
    let mut params = Vec::new();
    let mut m: HashMap<String, Vec<f32>> = HashMap::new();
    let mut v: HashMap<String, Vec<f32>> = HashMap::new();
    for name in &names {
        let view = tensors.tensor(name).map_err(|e| e.to_string())?;
        if view.dtype() != Dtype::F32 {
            return Err(format!("`{name}` is not f32"));
        }
        hasher.update(view.data());
        if let Some(p) = name.strip_prefix("model/") {
            params.push((
                p.to_string(),
                view.shape().to_vec(),
                f32_values(view.data()),
            ));
        } else if !moments {
            continue;
        } else if let Some(p) = name.strip_prefix("adam_m/") {
            m.insert(p.to_string(), f32_values(view.data()));
        } else if let Some(p) = name.strip_prefix("adam_v/") {
            v.insert(p.to_string(), f32_values(view.data()));
        }
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if meta.get("sha256") != Some(&digest) {
        return Err("checksum mismatch: the file is damaged".into());
    }
    let mut moments = Vec::new();
    for (path, mv) in m {
        let vv = v
            .remove(&path)
            .ok_or_else(|| format!("`adam_v/{path}` is missing"))?;
        moments.push((path, mv, vv));
    }
    moments.sort_by(|a, b| a.0.cmp(&b.0));
    let num = |key: &str| -> Result<u64, String> {
        meta.get(key)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("header lacks `{key}`"))
    };
    Ok(CheckpointState {
        step: num("step")?,
        loader_position: num("loader_position")?,
        adam_steps: num("adam_steps")?,
        tokens_seen: num("tokens_seen")?,
        wall_s: meta
            .get("wall_s")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0.0),
        loss_scale: meta
            .get("loss_scale")
            .and_then(|s| s.parse().ok())
            .map(|scale| (scale, num("loss_scale_clean").unwrap_or(0))),
        world_size: num("world_size").unwrap_or(1),
        eval_pending: meta.get("eval_pending").is_some_and(|v| v == "true"),
        params,
        moments,
    })
}

/// The checkpoint of optimizer step `step` in `dir`, verified (`kiln resume
/// --from`); an error lists the steps the run keeps.
pub(crate) fn at_step(
    dir: &Path,
    step: u64,
) -> Result<(CheckpointInfo, CheckpointState), TrainError> {
    let all = list(dir);
    let Some(info) = all.iter().find(|c| c.step == step).cloned() else {
        let kept: Vec<String> = all.iter().map(|c| c.step.to_string()).collect();
        return Err(TrainError::NoCheckpoint {
            dir: dir.to_path_buf(),
            why: if kept.is_empty() {
                format!("none at step {step}: the run wrote none yet")
            } else {
                format!(
                    "none at step {step}; the run keeps the checkpoints of steps {} (checkpoint.keep)",
                    kept.join(", ")
                )
            },
        });
    };
    let state = load(&info.path).map_err(|why| TrainError::NoCheckpoint {
        dir: dir.to_path_buf(),
        why: format!("checkpoint `{}` is unusable ({why})", info.path.display()),
    })?;
    Ok((info, state))
}

/// Moves what the run wrote after `step` aside, for a resume from that
/// step's checkpoint: the newer checkpoints, the metric lines after it
/// and a finished run's `summary.json` and `samples.txt` go to
/// `checkpoints/after-<step>/` (`after-<step>-2/`, … where that exists),
/// where no resume or export looks. Returns the folder, or `None` where
/// nothing came after `step`.
pub(crate) fn set_aside_after(run: &RunDir, step: u64) -> Result<Option<PathBuf>, TrainError> {
    let newer: Vec<_> = list(&run.checkpoints())
        .into_iter()
        .filter(|c| c.step > step)
        .collect();
    let (_, later) = run.metrics_split_at(step);
    if newer.is_empty() && later.is_empty() {
        return Ok(None);
    }
    let base = run.checkpoints().join(format!("after-{step}"));
    let aside = std::iter::once(base.clone())
        .chain((2..).map(|n| PathBuf::from(format!("{}-{n}", base.display()))))
        .find(|p| !p.exists())
        .unwrap_or(base);
    std::fs::create_dir_all(&aside).map_err(|source| TrainError::Write {
        path: aside.clone(),
        source,
    })?;
    if !later.is_empty() {
        crate::rundir::write_atomic(
            &aside.join("metrics.jsonl"),
            (later.join("\n") + "\n").as_bytes(),
        )?;
    }
    // A finished run's ending describes steps after `step` too, and so
    // does a best model kept after it.
    let ending = ["summary.json", "samples.txt"].map(|name| run.file(name));
    let best = run.file(BEST_MODEL);
    let best_after = file_step(&best).is_some_and(|s| s > step);
    let moves = newer
        .into_iter()
        .map(|c| c.path)
        .chain(ending.into_iter().filter(|p| p.is_file()))
        .chain(best_after.then_some(best));
    for from in moves {
        let to = aside.join(from.file_name().unwrap_or_default());
        std::fs::rename(&from, &to).map_err(|source| TrainError::Write {
            path: to.clone(),
            source,
        })?;
    }
    Ok(Some(aside))
}

/// The newest checkpoint in `dir` that verifies, and a note for each newer
/// one that did not.
pub fn latest_good_checkpoint(dir: &Path) -> Result<(CheckpointInfo, Vec<String>), TrainError> {
    let (info, _, notes) = latest_good_params(dir)?;
    Ok((info, notes))
}

pub(crate) fn latest_good(
    dir: &Path,
) -> Result<(CheckpointInfo, CheckpointState, Vec<String>), TrainError> {
    latest_good_by(dir, load)
}

/// [`latest_good`]'s parameters alone ([`load_params`]).
pub(crate) fn latest_good_params(
    dir: &Path,
) -> Result<(CheckpointInfo, Vec<crate::params::NamedValues>, Vec<String>), TrainError> {
    latest_good_by(dir, load_params)
}

/// A language-model run's weights to read out: its newest good
/// checkpoint, or (`best`) the best model it kept (`best.safetensors`, the
/// lowest validation loss), with the step and notes on damaged checkpoints
/// skipped.
pub(crate) fn run_params(
    run: &RunDir,
    best: bool,
) -> Result<(CheckpointInfo, Vec<crate::params::NamedValues>, Vec<String>), TrainError> {
    if !best {
        return latest_good_params(&run.checkpoints());
    }
    let path = run.file(BEST_MODEL);
    if !path.is_file() {
        return Err(TrainError::NoCheckpoint {
            dir: run.path.clone(),
            why: "it kept no best model yet (best.safetensors is written at its first evaluation, after eval.eval_steps steps): leave out --best for its newest checkpoint".into(),
        });
    }
    let params = load_params(&path).map_err(|why| TrainError::CheckpointMismatch {
        path: path.clone(),
        why,
    })?;
    let step = file_step(&path).unwrap_or(0);
    Ok((CheckpointInfo { path, step }, params, Vec::new()))
}

fn latest_good_by<T>(
    dir: &Path,
    load: impl Fn(&Path) -> Result<T, String>,
) -> Result<(CheckpointInfo, T, Vec<String>), TrainError> {
    let mut notes = Vec::new();
    let all = list(dir);
    if all.is_empty() {
        return Err(TrainError::NoCheckpoint {
            dir: dir.to_path_buf(),
            why: "the run wrote none yet".into(),
        });
    }
    for info in all.into_iter().rev() {
        match load(&info.path) {
            Ok(state) => return Ok((info, state, notes)),
            Err(why) => notes.push(format!(
                "checkpoint `{}` is unusable ({why}); trying the one before it",
                info.path.display()
            )),
        }
    }
    Err(TrainError::NoCheckpoint {
        dir: dir.to_path_buf(),
        why: notes.join("; "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64) -> CheckpointState {
        CheckpointState {
            step,
            loader_position: step * 2,
            adam_steps: step,
            tokens_seen: step * 100,
            wall_s: 1.5,
            loss_scale: Some((32768.0, step)),
            world_size: 1 + step % 3,
            eval_pending: step % 20 == 10,
            params: vec![
                (
                    "wte.weight".into(),
                    vec![2, 3],
                    vec![0.1, 0.2, 0.3, 0.4, 0.5, f32::MIN_POSITIVE],
                ),
                ("ln.bias".into(), vec![3], vec![1.0, -2.0, 3.5]),
            ],
            moments: vec![(
                "ln.bias".into(),
                vec![0.1, 0.2, 0.3],
                vec![0.01, 0.02, 0.03],
            )],
        }
    }

    #[test]
    fn round_trip_is_exact_and_keep_prunes() {
        let dir = tempfile::tempdir().expect("tempdir");
        for step in [10, 20, 30] {
            save(dir.path(), &state(step), 2).expect("saves");
        }
        let steps: Vec<u64> = list(dir.path()).iter().map(|c| c.step).collect();
        assert_eq!(steps, vec![20, 30]);
        let (info, back, notes) = latest_good(dir.path()).expect("loads");
        assert_eq!(info.step, 30);
        assert!(notes.is_empty());
        let mut want = state(30);
        want.params.sort_by(|a, b| a.0.cmp(&b.0));
        let mut got = back;
        got.params.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(got, want);
        // The parameters alone, as sampling and export read them.
        let (info, mut params, _) = latest_good_params(dir.path()).expect("loads");
        params.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!((info.step, params), (30, want.params));
    }

    #[test]
    fn a_damaged_checkpoint_falls_back_to_the_previous_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        save(dir.path(), &state(10), 3).expect("saves");
        let newest = save(dir.path(), &state(20), 3).expect("saves");
        // Flip one byte of tensor data: the checksum catches it.
        let mut bytes = std::fs::read(&newest).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&newest, &bytes).expect("write");
        let (info, _, notes) = latest_good(dir.path()).expect("falls back");
        assert_eq!(info.step, 10);
        assert!(notes[0].contains("checksum mismatch"), "{notes:?}");
        // A byte of an optimizer moment: the parameters alone are not
        // trusted either.
        let mut bytes = std::fs::read(&newest).expect("read");
        bytes[last] ^= 0xff;
        let (header, _) = SafeTensors::read_metadata(&bytes).expect("header");
        let start = 8 + header;
        let at = {
            let file = SafeTensors::deserialize(&bytes).expect("reads");
            let (_, moment) = file
                .tensors()
                .into_iter()
                .find(|(n, _)| n.starts_with("adam_v/"))
                .expect("a moment");
            moment.data().as_ptr() as usize - bytes.as_ptr() as usize
        };
        assert!(at >= start);
        bytes[at] ^= 0x01;
        std::fs::write(&newest, &bytes).expect("write");
        let (info, _, notes) = latest_good_params(dir.path()).expect("falls back");
        assert_eq!(info.step, 10);
        assert!(notes[0].contains("checksum mismatch"), "{notes:?}");
        // A truncated file is caught too.
        std::fs::write(&newest, &bytes[..bytes.len() / 2]).expect("truncate");
        let (info, _, notes) = latest_good(dir.path()).expect("falls back");
        assert_eq!(info.step, 10);
        assert!(notes[0].contains("unusable"), "{notes:?}");
    }

    #[test]
    fn no_checkpoint_is_a_named_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = latest_good(dir.path()).expect_err("none").to_string();
        assert!(err.contains("no usable checkpoint"), "{err}");
    }

    #[test]
    fn a_full_disk_loses_only_what_the_rotation_would_and_never_the_newest() {
        let infos: Vec<CheckpointInfo> = [50, 100, 150]
            .into_iter()
            .map(|step| CheckpointInfo {
                path: path_for(Path::new("c"), step),
                step,
            })
            .collect();
        let steps = |keep: usize| -> Vec<u64> {
            deleted_by_the_next(&infos, keep)
                .iter()
                .map(|c| c.step)
                .collect()
        };
        // After the write of step 200 with keep 2: 150 and 200 stay.
        assert_eq!(steps(2), [50, 100]);
        assert_eq!(steps(3), [50]);
        assert_eq!(steps(4), Vec::<u64>::new());
        // keep 1 would leave 200 alone: 150 stays until it is written.
        assert_eq!(steps(1), [50, 100]);
        assert_eq!(deleted_by_the_next(&infos[2..], 1).len(), 0);
        assert_eq!(deleted_by_the_next(&[], 1).len(), 0);
    }

    #[test]
    fn free_bytes_reads_the_file_system() {
        let dir = tempfile::tempdir().expect("tempdir");
        let free = free_bytes(dir.path()).expect("statvfs");
        assert!(free > 0, "{free}");
        assert_eq!(free_bytes(&dir.path().join("absent")), None);
    }
}
