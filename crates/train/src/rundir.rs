//! The run directory: the resolved config (with sources), the hardware
//! report, the tokenizer, metrics, summary, samples, plots and checkpoints.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::TrainError;
use crate::tensorboard::Events;

/// A run directory's lock, held while it lives (see [`RunDir::lock`]).
#[derive(Debug)]
pub struct RunLock {
    _file: Option<std::fs::File>,
}

/// A run's folder and the files in it.
#[derive(Clone, Debug)]
pub struct RunDir {
    /// The folder.
    pub path: PathBuf,
    /// `false` on a data-parallel job's ranks other than 0: they read the
    /// run (a resume's config and checkpoint) but write nothing to it.
    writes: bool,
    /// The TensorBoard event file this process writes the records into as
    /// well (`logging.tensorboard`), once [`RunDir::start_tensorboard`]
    /// opened it; shared by the clones of this `RunDir`, not by its
    /// [`RunDir::sub`] folders.
    tensorboard: Arc<Mutex<Option<Events>>>,
}

impl RunDir {
    /// Creates a fresh run folder from the `run.dir` template (`{time}`,
    /// `{experiment}`; `RunConfig::run_dir_template` fills `{data}`). An
    /// existing folder that already holds a run is refused, so nothing
    /// saved is overwritten.
    pub fn create(template: &str, experiment: &str) -> Result<Self, TrainError> {
        let path = Self::path_of(template, experiment, std::time::SystemTime::now());
        refuse_under_file("run.dir", &path, &path)?;
        if path.join("config.toml").exists() {
            return Err(TrainError::RunExists { path });
        }
        std::fs::create_dir_all(path.join("checkpoints")).map_err(|source| TrainError::Write {
            path: path.clone(),
            source,
        })?;
        Ok(Self::at(path, true))
    }

    /// The folder the `run.dir` template names at time `now` (`{time}`,
    /// `{experiment}` filled in). `kiln launch --max-restarts` fixes it
    /// before the ranks start, so that it knows what to resume.
    pub fn path_of(template: &str, experiment: &str, now: std::time::SystemTime) -> PathBuf {
        PathBuf::from(
            template
                .replace("{time}", &utc_stamp(now))
                .replace("{experiment}", experiment),
        )
    }

    /// Creates the run folder of `config` and records what the run is made
    /// of: `config.toml` (reads back with `--config`), `config-sources.txt`
    /// and `hardware.json`.
    pub(crate) fn start(
        config: &kiln_config::RunConfig,
        options: &crate::TrainOptions,
    ) -> Result<Self, TrainError> {
        let run = Self::create(&config.run_dir_template(), &config.experiment)?;
        run.write_config(config)?;
        run.write("config-sources.txt", &(options.sources.join("\n") + "\n"))?;
        run.write(
            "hardware.json",
            &serde_json::to_string_pretty(&options.hardware).unwrap_or_default(),
        )?;
        Ok(run)
    }

    /// Opens an existing run for resuming.
    pub fn open(path: &Path) -> Result<Self, TrainError> {
        if !path.is_dir() {
            return Err(TrainError::NotARun {
                path: path.to_path_buf(),
                why: "no such directory".into(),
            });
        }
        if !path.join("config.toml").is_file() {
            return Err(TrainError::NotARun {
                path: path.to_path_buf(),
                why: "it has no config.toml".into(),
            });
        }
        Ok(Self::at(path.to_path_buf(), true))
    }

    /// The same run as a rank other than 0 sees it: read, never written
    /// (every write below does nothing).
    pub(crate) fn reader(mut self) -> Self {
        self.writes = false;
        self
    }

    /// What a rank other than 0 of a new run holds: rank 0 names and writes
    /// the folder.
    pub(crate) fn elsewhere() -> Self {
        Self::at(PathBuf::from("(rank 0's run directory)"), false)
    }

    /// A folder inside the run (a fold's), written as the run is.
    pub(crate) fn sub(&self, name: &str) -> Self {
        Self::at(self.path.join(name), self.writes)
    }

    fn at(path: PathBuf, writes: bool) -> Self {
        Self {
            path,
            writes,
            tensorboard: Arc::new(Mutex::new(None)),
        }
    }

    /// Opens a TensorBoard event file in `tensorboard/` for a new run's
    /// records (`logging.tensorboard`; nothing on a rank that does not
    /// write), with `config` as text.
    pub(crate) fn start_tensorboard(
        &self,
        config: &kiln_config::RunConfig,
    ) -> Result<(), TrainError> {
        *lock(&self.tensorboard) = self.new_events(config, None)?;
        Ok(())
    }

    /// The records go on after `step` (a resume, a fold started again):
    /// `metrics.jsonl` is cut after it, and a new TensorBoard event file
    /// begins with a `SessionLog.START` at the next step, so that
    /// TensorBoard drops what the earlier files hold from there on.
    pub(crate) fn records_go_on_after(
        &self,
        config: &kiln_config::RunConfig,
        step: u64,
    ) -> Result<(), TrainError> {
        self.truncate_metrics_after(step)?;
        *lock(&self.tensorboard) = self.new_events(config, Some(step))?;
        Ok(())
    }

    /// A cross-validation's results in a new event file of this (the
    /// top) folder, which supersedes what earlier ones hold (a resumed
    /// CV writes them once more): the config as text, each fold's scores.
    pub(crate) fn tensorboard_cv(
        &self,
        config: &kiln_config::RunConfig,
        summary: &crate::records::CvSummary,
    ) -> Result<(), TrainError> {
        if !self.tensorboard_on(config) {
            return Ok(());
        }
        let mut events = Events::create(&self.file("tensorboard"), Some(0))?;
        events.text(0, "config", &config_text(config, None))?;
        events.cv_summary(summary)
    }

    /// Whether this process writes TensorBoard's files for the run.
    fn tensorboard_on(&self, config: &kiln_config::RunConfig) -> bool {
        self.writes && config.logging.tensorboard
    }

    /// A new event file with `config` as text (see
    /// [`RunDir::records_go_on_after`] for `resumed_at`), or none where
    /// this process writes none.
    fn new_events(
        &self,
        config: &kiln_config::RunConfig,
        resumed_at: Option<u64>,
    ) -> Result<Option<Events>, TrainError> {
        if !self.tensorboard_on(config) {
            return Ok(None);
        }
        let mut events = Events::create(&self.file("tensorboard"), resumed_at.map(|s| s + 1))?;
        events.text(
            resumed_at.unwrap_or(0),
            "config",
            &config_text(config, resumed_at),
        )?;
        events.flush()?;
        Ok(Some(events))
    }

    /// Whether this process writes the run (rank 0, or a single process).
    pub(crate) fn writes(&self) -> bool {
        self.writes
    }

    /// Takes the run's lock (`run.lock`, an OS file lock that the kernel
    /// releases when the process ends, however it ends): one process writes
    /// a run at a time. A second gets [`TrainError::RunInUse`] with the
    /// holder's pid. The lock lasts as long as the returned guard.
    pub fn lock(&self) -> Result<RunLock, TrainError> {
        if !self.writes {
            return Ok(RunLock { _file: None });
        }
        let path = self.file("run.lock");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| TrainError::Write {
                path: path.clone(),
                source,
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let pid = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.trim().parse().ok());
                return Err(TrainError::RunInUse {
                    path: self.path.clone(),
                    pid,
                });
            }
            Err(std::fs::TryLockError::Error(source)) => {
                return Err(TrainError::Write { path, source });
            }
        }
        // What a killed writer left behind is this process's to clear.
        remove_debris(&self.path);
        // Who holds it, for the message the next one gets.
        let pid = std::process::id().to_string();
        let _ = file
            .set_len(0)
            .and_then(|()| file.write_all(pid.as_bytes()))
            .and_then(|()| file.flush());
        Ok(RunLock { _file: Some(file) })
    }

    /// `name` inside the run's folder.
    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The folder of the checkpoints (`ckpt-<step>.safetensors`).
    pub fn checkpoints(&self) -> PathBuf {
        self.path.join("checkpoints")
    }

    /// Writes a whole file, atomically (see [`write_atomic`]).
    pub fn write(&self, name: &str, contents: &str) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        write_atomic(&self.file(name), contents.as_bytes())
    }

    /// Takes the changes of a resume with overrides: says them, writes the
    /// new values into `config.toml` (a later `kiln resume` keeps them) and
    /// appends them to `config-sources.txt` with the step they start after.
    /// Nothing is written where nothing changed.
    pub(crate) fn record_resume(
        &self,
        resumed: &kiln_config::ResumedConfig,
        step: Option<u64>,
        observer: &mut dyn crate::report::Observer,
    ) -> Result<(), TrainError> {
        if resumed.changes.is_empty() {
            return Ok(());
        }
        let listed: Vec<String> = resumed
            .changes
            .iter()
            .map(|c| format!("{} {} → {}", c.key, c.from, c.to))
            .collect();
        observer.event(&crate::report::Event::Note(format!(
            "resuming with changes: {}",
            listed.join(", ")
        )));
        let mut sources =
            std::fs::read_to_string(self.file("config-sources.txt")).unwrap_or_default();
        if !sources.is_empty() && !sources.ends_with('\n') {
            sources.push('\n');
        }
        let when = step.map_or(String::new(), |s| format!(" after step {s}"));
        for c in &resumed.changes {
            let lhs = format!("{} = {}", c.key, c.to);
            sources.push_str(&format!(
                "{lhs:<56}  # {}, on `kiln resume`{when} (was {})\n",
                c.source, c.from
            ));
        }
        self.write_config(&resumed.config)?;
        self.write("config-sources.txt", &sources)
    }

    /// `config.toml`: the configuration the run trains with (reads back
    /// with `--config`, and with [`kiln_config::read_run_config`]).
    fn write_config(&self, config: &kiln_config::RunConfig) -> Result<(), TrainError> {
        self.write(
            "config.toml",
            &toml::to_string_pretty(config).unwrap_or_default(),
        )
    }

    /// Appends one JSON line to `metrics.jsonl`.
    pub(crate) fn append_metric(&self, value: &serde_json::Value) -> Result<(), TrainError> {
        if !self.writes {
            return Ok(());
        }
        let path = self.file("metrics.jsonl");
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|source| TrainError::Write {
                path: path.clone(),
                source,
            })?;
        writeln!(file, "{value}").map_err(|source| TrainError::Write { path, source })
    }

    /// Appends one record to `metrics.jsonl`, and to the TensorBoard
    /// event file where one is open (flushed: a TensorBoard watching the
    /// run shows it at once).
    pub(crate) fn append(&self, record: &crate::records::Record) -> Result<(), TrainError> {
        self.append_metric(&serde_json::to_value(record).unwrap_or_default())?;
        match lock(&self.tensorboard).as_mut() {
            Some(events) => events.record(record),
            None => Ok(()),
        }
    }

    /// The metric lines, parsed (a torn last line from a killed run is skipped).
    pub(crate) fn metrics(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(self.file("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The records of `metrics.jsonl` (a torn last line from a killed run is skipped).
    pub(crate) fn records(&self) -> Vec<crate::records::Record> {
        std::fs::read_to_string(self.file("metrics.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    /// The metric lines up to `step`, and those after it.
    pub(crate) fn metrics_split_at(&self, step: u64) -> (Vec<String>, Vec<String>) {
        let (mut upto, mut after) = (Vec::new(), Vec::new());
        for m in self.metrics() {
            match m["step"].as_u64() {
                Some(s) if s <= step => upto.push(m.to_string()),
                Some(_) => after.push(m.to_string()),
                None => {}
            }
        }
        (upto, after)
    }

    /// Drops metric lines after `step` (a resumed run writes them again).
    fn truncate_metrics_after(&self, step: u64) -> Result<(), TrainError> {
        let (kept, _) = self.metrics_split_at(step);
        let mut text = kept.join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        self.write("metrics.jsonl", &text)
    }
}

/// The lock of a run's event file; a panic elsewhere does not stop the
/// records from being written.
fn lock(m: &Mutex<Option<Events>>) -> std::sync::MutexGuard<'_, Option<Events>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The resolved config as the text TensorBoard shows (Markdown: a TOML
/// block), with the step a resume went on from.
fn config_text(config: &kiln_config::RunConfig, resumed_at: Option<u64>) -> String {
    let when = resumed_at.map_or(String::new(), |s| format!("resumed after step {s}\n\n"));
    format!(
        "{when}```toml\n{}```",
        toml::to_string_pretty(config).unwrap_or_default()
    )
}

/// A file where `folder` or a folder above it should be, on the way to
/// `path` (which `what` named): the user's input (exit 2), not a failure
/// to write.
fn refuse_under_file(what: &'static str, path: &Path, folder: &Path) -> Result<(), TrainError> {
    match kiln_data::file_in_the_way(folder) {
        Some(file) => Err(TrainError::PathUnderFile {
            what,
            path: path.to_path_buf(),
            file: file.to_path_buf(),
        }),
        None => Ok(()),
    }
}

/// Makes the folder `path` (which `what` named) is to be written in, where
/// it does not exist (an output file the user named in a folder not yet
/// made); returns it.
pub(crate) fn create_parent<'a>(
    what: &'static str,
    path: &'a Path,
) -> Result<&'a Path, TrainError> {
    let parent = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    refuse_under_file(what, path, parent)?;
    std::fs::create_dir_all(parent).map_err(|source| TrainError::Write {
        path: parent.to_path_buf(),
        source,
    })?;
    Ok(parent)
}

/// Writes `contents` to `path` atomically: a temporary file beside it,
/// then renamed into place, so that a process killed mid-write leaves the
/// old file whole (or none); the temporary file is removed when the write
/// fails (a full disk stays no fuller).
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), TrainError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let written = std::fs::write(&tmp, contents).and_then(|()| std::fs::rename(&tmp, path));
    written.map_err(|source| {
        let _ = std::fs::remove_file(&tmp);
        TrainError::Write {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// Removes what writes killed midway left behind in `dir` (`.<name>.tmp<pid>`
/// files): called by the one process that holds the run's lock.
pub(crate) fn remove_debris(dir: &Path) {
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name.contains(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// `YYYYMMDD-HHMMSS` in UTC.
pub fn utc_stamp(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_are_utc_calendar_times() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_651_200 + 3_723);
        assert_eq!(utc_stamp(t), "20261126-010203");
        assert_eq!(utc_stamp(std::time::UNIX_EPOCH), "19700101-000000");
    }

    /// An output in folders not yet made gets them; one under a file is
    /// the user's input (exit 2), naming the option, the path and the file.
    #[test]
    fn an_output_file_gets_its_folders_unless_a_file_is_in_the_way() {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("a").join("b").join("p.jsonl");
        assert_eq!(
            create_parent("--out", &out).expect("made"),
            out.parent().expect("parent")
        );
        assert!(dir.path().join("a/b").is_dir());
        assert_eq!(
            create_parent("--out", Path::new("p.jsonl")).expect("here"),
            Path::new(".")
        );
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "x").expect("write");
        let err = create_parent("--plot", &file.join("sub").join("lr.svg")).expect_err("a file");
        assert!(err.is_bad_input());
        let text = err.to_string();
        assert!(
            text.starts_with("invalid --plot `")
                && text.contains(&format!("`{}` is a file, not a folder", file.display())),
            "{text}"
        );
    }

    #[test]
    fn an_existing_run_is_not_overwritten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let template = dir
            .path()
            .join("{experiment}")
            .to_string_lossy()
            .into_owned();
        let run = RunDir::create(&template, "x").expect("creates");
        run.write("config.toml", "x = 1\n").expect("writes");
        let err = RunDir::create(&template, "x")
            .expect_err("exists")
            .to_string();
        assert!(err.contains("kiln resume"), "{err}");
        assert_eq!(
            std::fs::read_to_string(run.file("config.toml")).expect("kept"),
            "x = 1\n"
        );
    }

    #[test]
    fn metrics_after_a_step_are_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let run = RunDir::at(dir.path().to_path_buf(), true);
        for step in 1..=5u64 {
            run.append_metric(&serde_json::json!({ "step": step }))
                .expect("appends");
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(run.file("metrics.jsonl"))
            .and_then(|mut f| f.write_all(b"{\"step\": 6, \"tor"))
            .expect("torn line");
        run.truncate_metrics_after(3).expect("truncates");
        let steps: Vec<u64> = run
            .metrics()
            .iter()
            .filter_map(|m| m["step"].as_u64())
            .collect();
        assert_eq!(steps, vec![1, 2, 3]);
    }
}
