//! `picchio serve --stdio`: the line protocol, end to end through the binary.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs a protocol session on `backend` with `lines` on stdin and returns stdout's lines.
fn session(backend: &str, lines: &[String]) -> Vec<String> {
    session_of(&common::fixtures_dir().join("tiny-routed"), backend, lines)
}

/// `session` with the checkpoint in `dir`.
fn session_of(dir: &Path, backend: &str, lines: &[String]) -> Vec<String> {
    let input: String = lines.iter().map(|line| format!("{line}\n")).collect();
    session_on_bytes(dir, backend, input.as_bytes())
}

/// Runs a protocol session on `backend` with `input` on stdin and returns stdout's lines.
fn session_on_bytes(dir: &Path, backend: &str, input: &[u8]) -> Vec<String> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(["serve", "--stdio", "--backend", backend])
        .args(["--model", dir.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    // Written from another thread: the replies to a long input could fill stdout's pipe first.
    let input = input.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn turn(max_new: usize, keep: usize, ids: &[u32]) -> String {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!(
        "TURN {max_new} {keep} 0 1 0 {} {}",
        ids.len(),
        ids.join(" ")
    )
}

fn tokens(lines: &[String]) -> Vec<u32> {
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("TOKEN ")?.parse().ok())
        .collect()
}

#[test]
fn two_turns_reuse_the_prefix_and_a_bad_keep_changes_nothing() {
    let outputs: Vec<Vec<String>> = common::backends().into_iter().map(two_turns_on).collect();
    // The same lines, tokens included, on every tier.
    assert!(outputs.windows(2).all(|w| w[0] == w[1]), "{outputs:?}");
}

/// Returns the output of the session with the second turn.
fn two_turns_on(backend: &str) -> Vec<String> {
    let session = |lines: &[String]| session(backend, lines);
    let prompt = [3u32, 14, 15, 92, 65];
    // First process: turn 1, a bad turn, then turn 2 keeping everything turn 1 left.
    let first = session(&[turn(4, 0, &prompt)]);
    assert!(first[0].starts_with("READY 4096 256"), "{first:?}");
    let reply = tokens(&first);
    assert_eq!(reply.len(), 4);
    assert_eq!(first.last().unwrap(), "DONE MAX_TOKENS 4 9");

    let position = prompt.len() + reply.len();
    let out = session(&[
        turn(4, 0, &prompt),
        turn(2, position + 1, &[1]),
        "TURN 2 0 0 1 0 3 1 2".to_string(),
        turn(2, 0, &[999]),
        "TURN 2 0 0 7 0 1 1".to_string(),
        turn(3, position, &[7, 8]),
        "SHUTDOWN".to_string(),
        turn(3, 0, &[1]),
    ]);
    let errors: Vec<&String> = out.iter().filter(|l| l.starts_with("ERROR")).collect();
    assert_eq!(errors.len(), 4, "{out:?}");
    assert!(
        errors[0].starts_with("ERROR 400 0 ") && errors[0].contains("keep 10"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1].contains("n_ids is 3 but 2 ids follow"),
        "{}",
        errors[1]
    );
    assert!(errors[2].contains("out of range"), "{}", errors[2]);
    assert!(errors[3].contains("top_p"), "{}", errors[3]);
    // Turn 2 reused all 9 positions: 9 + 2 new ids + 3 generated.
    assert_eq!(out.last().unwrap(), "DONE MAX_TOKENS 3 14", "{out:?}");
    let continued = tokens(&out)[4..].to_vec();

    // The same conversation from scratch gives the same tokens.
    let mut whole = prompt.to_vec();
    whole.extend(&reply);
    whole.extend([7, 8]);
    let fresh = session(&[turn(3, 0, &whole)]);
    assert_eq!(tokens(&fresh), continued);
    assert_eq!(fresh.last().unwrap(), "DONE MAX_TOKENS 3 14");
    out
}

#[test]
fn reset_empties_the_session_and_sampling_is_seeded() {
    let sampled = "TURN 6 0 0.9 0.95 20 3 1 2 3".to_string();
    let mut sampled_tokens = Vec::new();
    for backend in common::backends() {
        let out = session(backend, &[sampled.clone(), "RESET".into(), sampled.clone()]);
        let done: Vec<&String> = out.iter().filter(|l| l.starts_with("DONE")).collect();
        assert_eq!(done, ["DONE MAX_TOKENS 6 9", "DONE MAX_TOKENS 6 9"]);
        // Same seed and turn number in a new process: the same tokens.
        let again = session(backend, std::slice::from_ref(&sampled));
        assert_eq!(tokens(&again), tokens(&out)[..6]);
        sampled_tokens.push(tokens(&again));
    }
    // Seeded sampling chooses the same tokens on every tier.
    assert!(
        sampled_tokens.windows(2).all(|w| w[0] == w[1]),
        "{sampled_tokens:?}"
    );
}

/// Lines a hostile client may send (bytes that are not UTF-8, an empty line, arguments after
/// RESET, a line over the limit, a huge unknown word) each get an ERROR 400 line and leave the
/// session as it was: the turn after them gives a fresh session's tokens.
#[test]
fn broken_lines_get_an_error_and_the_session_goes_on() {
    let good = turn(3, 0, &[1, 2, 3]);
    let mut input: Vec<u8> = Vec::new();
    input.extend_from_slice(b"\xff\xfe TURN\n");
    input.extend_from_slice(b"\n");
    input.extend_from_slice(b"RESET now\n");
    input.extend_from_slice(format!("{}\n", "9".repeat(17 << 20)).as_bytes());
    input.extend_from_slice(format!("{}\n", "X".repeat(100_000)).as_bytes());
    input.extend_from_slice(format!("{good}\nSHUTDOWN\n").as_bytes());
    let out = session_on_bytes(&common::fixtures_dir().join("tiny-routed"), "cpu", &input);
    let errors: Vec<&String> = out
        .iter()
        .filter(|l| l.starts_with("ERROR 400 0 "))
        .collect();
    assert_eq!(errors.len(), 5, "{out:?}");
    assert!(errors[0].contains("not UTF-8"), "{out:?}");
    assert!(errors[1].contains("empty line"), "{out:?}");
    assert!(errors[2].contains("RESET takes no arguments"), "{out:?}");
    assert!(errors[3].contains("longer than 16777216 bytes"), "{out:?}");
    assert!(
        errors[4].len() < 100,
        "the echo is cut short: {}",
        errors[4].len()
    );
    let fresh = session("cpu", &[good]);
    assert_eq!(tokens(&out), tokens(&fresh));
    assert_eq!(out.last(), fresh.last());
}

/// A Qwen3-MoE model speaks the protocol too: the client renders its chat template (here the
/// chat fixture's first conversation as transformers rendered it), READY announces the
/// generation_config's stop ids, the reply is `generate`'s, and a second turn that keeps the
/// first gives a fresh session's tokens, on every tier.
#[test]
fn a_template_model_takes_rendered_ids() {
    let dir = common::fixtures_dir().join("qwen3-moe/tiny-qwen3-chat");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("chat_reference.json")).unwrap())
            .unwrap();
    let prompt: Vec<u32> = serde_json::from_value(reference["cases"][0]["ids"].clone()).unwrap();
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let generated = common::picchio_stdout(&[
        "generate",
        "--backend",
        "cpu",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        &ids.join(","),
        "--max-new-tokens",
        "6",
        "--json",
    ]);
    let generated: serde_json::Value = serde_json::from_str(&generated).unwrap();
    let want: Vec<u32> = serde_json::from_value(generated["generated_ids"].clone()).unwrap();
    assert!(!want.is_empty());

    let mut outputs = Vec::new();
    for backend in common::backends() {
        let out = session_of(&dir, backend, &[turn(6, 0, &prompt)]);
        assert_eq!(out[0], "READY 4096 512 503 505", "{out:?}");
        let reply = tokens(&out);
        assert_eq!(reply, want, "{backend}");

        let position = prompt.len() + reply.len();
        let follow_up = [505u32, 198, 504, 311];
        let kept = session_of(
            &dir,
            backend,
            &[turn(6, 0, &prompt), turn(4, position, &follow_up)],
        );
        let mut whole = [prompt.clone(), reply].concat();
        whole.extend(follow_up);
        let fresh = session_of(&dir, backend, &[turn(4, 0, &whole)]);
        assert_eq!(tokens(&kept)[want.len()..], tokens(&fresh)[..], "{backend}");
        assert_eq!(kept.last(), fresh.last(), "{backend}");
        outputs.push(kept);
    }
    assert!(outputs.windows(2).all(|w| w[0] == w[1]), "{outputs:?}");
}
