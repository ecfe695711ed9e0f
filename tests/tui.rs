//! `kiln train --tui` in a real terminal: tmux runs kiln in a detached
//! session, `capture-pane` reads the screen, `send-keys C-c` presses Ctrl-C
//! (CI installs tmux).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::support::kiln_bin;

/// `tmux` with `args`; its standard output.
fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux")
        .args(args)
        .output()
        .expect("run tmux: this test needs it (Debian: apt install tmux)");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `what` every 200 ms (a tmux command each) until it returns
/// `Some`, for up to `limit`.
fn wait_for<T>(limit: Duration, what: impl FnMut() -> Option<T>) -> Option<T> {
    crate::support::poll_for(limit, Duration::from_millis(200), what)
}

/// Ends the tmux session when the test ends, passed or not.
struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .output();
    }
}

fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The dashboard shows the metrics and the step count as the run goes;
/// Ctrl-C in it writes a checkpoint and exits 130, as in a plain run;
/// metrics.jsonl is written as always; the lines of the end come after the
/// dashboard closes.
#[test]
fn tui_shows_the_run_and_ctrl_c_in_it_checkpoints_and_exits_130() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = crate::train::tiny(tmp.path(), "run", 100_000);
    args.extend([
        "logging.logging_steps=5".into(),
        "eval.eval_steps=20".into(),
        "checkpoint.every_steps=100000".into(),
        "--tui".into(),
    ]);
    let rc = tmp.path().join("rc");
    // kiln on the terminal itself; then its code, and time to read what it
    // printed after the dashboard.
    let command = format!(
        "{} {} ; echo $? > {} ; sleep 120",
        quote(&kiln_bin().display().to_string()),
        args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "),
        quote(&rc.display().to_string()),
    );
    let name = format!("kiln-tui-{}", std::process::id());
    tmux(&[
        "new-session",
        "-d",
        "-s",
        &name,
        "-x",
        "160",
        "-y",
        "48",
        "-c",
        &tmp.path().display().to_string(),
        "bash",
        "-c",
        &command,
    ]);
    let _session = Session(name.clone());
    let screen = wait_for(Duration::from_secs(240), || {
        let s = tmux(&["capture-pane", "-p", "-t", &name]);
        (s.contains("val loss") && s.contains("tokens/s") && s.contains("grad norm")).then_some(s)
    });
    let screen = screen.unwrap_or_else(|| {
        panic!(
            "the dashboard never showed the metrics; the screen:\n{}",
            tmux(&["capture-pane", "-p", "-t", &name])
        )
    });
    for part in ["loss", "learning rate", "MFU", "data-wait", "/100000"] {
        assert!(
            screen.contains(part),
            "no `{part}` on the screen:\n{screen}"
        );
    }
    tmux(&["send-keys", "-t", &name, "C-c"]);
    let code = wait_for(Duration::from_secs(60), || {
        std::fs::read_to_string(&rc).ok().filter(|s| !s.is_empty())
    })
    .unwrap_or_else(|| {
        panic!(
            "kiln did not end after Ctrl-C; the screen:\n{}",
            tmux(&["capture-pane", "-p", "-t", &name])
        )
    });
    let after = tmux(&["capture-pane", "-p", "-t", &name]);
    assert_eq!(code.trim(), "130", "after the dashboard:\n{after}");
    assert!(
        after.contains("interrupted after step") && after.contains("resume with: kiln resume"),
        "{after}"
    );
    let run = tmp.path().join("run");
    let checkpoints: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
        .expect("RUN/checkpoints")
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".safetensors"))
        .collect();
    assert_eq!(checkpoints.len(), 1, "the checkpoint Ctrl-C wrote");
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).expect("metrics.jsonl");
    assert!(metrics.lines().count() >= 2, "{metrics}");
    assert!(Path::new(&run.join("tensorboard")).is_dir());
}

/// Where standard output is not a terminal, `--tui` prints lines, says so,
/// and the run goes on as a plain one.
#[test]
fn tui_without_a_terminal_prints_lines() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let mut args = crate::train::tiny(tmp.path(), "run", 10);
    args.push("--tui".into());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = crate::support::kiln(&refs).run().expect_code(0);
    run.stderr_has(&["--tui needs a terminal on standard output; printing lines"]);
    run.stdout_has(&["step    10/10 | loss", "done: 10 steps"]);
}
