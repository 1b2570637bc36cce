//! Fuzz targets (proptest): mutated inputs for every parser that reads what a file or a client
//! hands picchio: the safetensors header and tensor table, config.json, a converted store's
//! index, the Harmony parser and the stdio line protocol. Each must end in Ok or an error,
//! never a panic or an abort (a hang shows as a run that does not finish).
//!
//! Cases per target: `PICCHIO_FUZZ_CASES` (default 48; `.ci/run` runs 4,000). proptest keeps a
//! failing input's seed in `tests/fuzz.regressions` and replays it first on every run: commit
//! that file with the fix.

mod common;

use std::path::Path;
use std::sync::OnceLock;

use picchio::chat::tokenizer::{CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, Tokenizer};
use picchio::model::Model;
use proptest::prelude::*;
use serde_json::Value;

fn config() -> ProptestConfig {
    let cases = std::env::var("PICCHIO_FUZZ_CASES").map_or(48, |n| n.parse().unwrap());
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("regressions"),
        )),
        ..ProptestConfig::default()
    }
}

/// One change to a byte string; positions are taken modulo the region changed.
#[derive(Debug, Clone)]
enum Edit {
    Set(usize, u8),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Replaces the n-th run of digits with this text.
    Number(usize, String),
    Truncate(usize),
}

/// Numbers that break parsers: zero, negative, at and past the integer limits, floats.
fn hostile_number() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("18446744073709551615".to_string()),
        Just("18446744073709551616".to_string()),
        Just("4294967296".to_string()),
        Just("9223372036854775807".to_string()),
        Just("1e308".to_string()),
        Just("0.5".to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        (0u32..100_000).prop_map(|n| n.to_string()),
    ]
}

fn edit() -> impl Strategy<Value = Edit> {
    // Numbers first: a changed offset, shape or size reaches deeper than broken syntax.
    prop_oneof![
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Set(at, byte)),
        1 => (any::<usize>(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Edit::Insert(at, bytes)),
        1 => (any::<usize>(), 1usize..16).prop_map(|(at, n)| Edit::Remove(at, n)),
        6 => (any::<usize>(), hostile_number()).prop_map(|(n, text)| Edit::Number(n, text)),
        1 => any::<usize>().prop_map(Edit::Truncate),
    ]
}

/// Applies `edits` to `bytes[region]`, in place; returns the region's new length.
fn apply(bytes: &mut Vec<u8>, region: std::ops::Range<usize>, edits: &[Edit]) -> usize {
    let mut part: Vec<u8> = bytes[region.clone()].to_vec();
    for edit in edits {
        let len = part.len().max(1);
        match edit {
            Edit::Set(at, byte) if !part.is_empty() => part[at % len] = *byte,
            Edit::Insert(at, new) => {
                let at = at % (part.len() + 1);
                part.splice(at..at, new.iter().copied());
            }
            Edit::Remove(at, n) if !part.is_empty() => {
                let at = at % len;
                part.drain(at..(at + n).min(part.len()));
            }
            Edit::Number(n, text) => {
                let runs = digit_runs(&part);
                if !runs.is_empty() {
                    let run = runs[n % runs.len()].clone();
                    part.splice(run, text.bytes());
                }
            }
            Edit::Truncate(at) => part.truncate(at % len),
            _ => {}
        }
    }
    let new_len = part.len();
    bytes.splice(region, part);
    new_len
}

fn digit_runs(bytes: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut runs = Vec::new();
    let mut start = None;
    for (i, b) in bytes.iter().enumerate() {
        match (b.is_ascii_digit(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                runs.push(s..i);
                start = None;
            }
            _ => {}
        }
    }
    runs.extend(start.map(|s| s..bytes.len()));
    runs
}

/// A JSON value that breaks a reader's expectations of one field.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        hostile_number().prop_map(|n| serde_json::from_str(&n).unwrap_or(Value::Null)),
        Just(Value::Null),
        Just(Value::Bool(true)),
        Just(Value::String("yarn".into())),
        Just(Value::String(String::new())),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        Just(serde_json::json!([1, -1, 0])),
        any::<f64>().prop_map(|x| serde_json::json!(x)),
        any::<i64>().prop_map(|x| serde_json::json!(x)),
    ]
}

/// Replaces or removes fields of a JSON object, nested objects included; `picks` chooses the
/// field (modulo the fields there), `None` removes it.
fn mutate_json(value: &mut Value, picks: &[(usize, Option<Value>)]) {
    for (pick, replacement) in picks {
        let mut target = &mut *value;
        let mut pick = *pick;
        // Walk into nested objects while the pick says so (its low bit).
        while let Value::Object(map) = target {
            if map.is_empty() {
                break;
            }
            let key = map.keys().nth((pick >> 1) % map.len()).unwrap().clone();
            let descend = pick & 1 == 1 && matches!(map[&key], Value::Object(_));
            if descend {
                pick >>= 4;
                target = map.get_mut(&key).unwrap();
                continue;
            }
            match replacement {
                Some(new) => map[&key] = new.clone(),
                None => {
                    map.shift_remove(&key);
                }
            }
            break;
        }
    }
}

fn json_picks() -> impl Strategy<Value = Vec<(usize, Option<Value>)>> {
    prop::collection::vec(
        (
            any::<usize>(),
            prop::option::weighted(0.85, hostile_value()),
        ),
        1..4,
    )
}

/// A private copy of tiny-single, rewritten per case.
fn scratch_of(fixture: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

fn tiny_single() -> std::path::PathBuf {
    common::fixtures_dir().join("tiny-single")
}

/// Loads the model in `dir` and, when that works, generates two tokens: the load's checks are
/// what must hold, and a model that loads must run.
fn load_and_run(dir: &Path) {
    if let Ok(model) = Model::load(dir) {
        let _ = picchio::model::generate::generate(&model, &[1, 2], &common::greedy_options(2));
    }
}

/// tiny-single converted into an expert store, once per test process.
fn converted() -> &'static Path {
    static STORE: OnceLock<tempfile::TempDir> = OnceLock::new();
    let dir = STORE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("store");
        let source = tiny_single();
        common::picchio_stdout(&[
            "convert",
            "--model",
            source.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        dir
    });
    Box::leak(dir.path().join("store").into_boxed_path())
}

proptest! {
    #![proptest_config(config())]

    /// The safetensors header (its length prefix, JSON and tensor table) mutated: the load is
    /// an error or a model that runs.
    #[test]
    fn safetensors_header(edits in prop::collection::vec(edit(), 1..4), fix_length in any::<bool>()) {
        let scratch = scratch_of(&tiny_single());
        let file = scratch.path().join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let region = if fix_length { 8..8 + header } else { 0..8 + header };
        let new_len = apply(&mut bytes, region, &edits);
        if fix_length {
            bytes[..8].copy_from_slice(&(new_len as u64).to_le_bytes());
        }
        std::fs::write(&file, &bytes).unwrap();
        load_and_run(scratch.path());
    }

    /// config.json with fields replaced by hostile values or removed, and its text mutated.
    #[test]
    fn config_json(picks in json_picks(), edits in prop::option::weighted(0.3, prop::collection::vec(edit(), 1..3))) {
        let scratch = scratch_of(&tiny_single());
        let file = scratch.path().join("config.json");
        let mut config: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        mutate_json(&mut config, &picks);
        let mut text = serde_json::to_vec(&config).unwrap();
        let len = text.len();
        apply(&mut text, 0..len, &edits.unwrap_or_default());
        std::fs::write(&file, &text).unwrap();
        load_and_run(scratch.path());
    }

    /// A converted store's experts.json with fields replaced or removed.
    #[test]
    fn store_index(picks in json_picks(), number_edits in prop::collection::vec(
        (any::<usize>(), hostile_number()).prop_map(|(n, text)| Edit::Number(n, text)), 0..3),
        keep_fields in any::<bool>()) {
        let scratch = scratch_of(converted());
        let file = scratch.path().join("experts.json");
        let mut index: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        if !keep_fields {
            mutate_json(&mut index, &picks);
        }
        let mut text = serde_json::to_vec(&index).unwrap();
        let len = text.len();
        apply(&mut text, 0..len, &number_edits);
        std::fs::write(&file, &text).unwrap();
        load_and_run(scratch.path());
    }

    /// Any token sequence, Harmony's structural tokens mixed with text and ids past the vocabulary.
    #[test]
    fn harmony_parser(tokens in prop::collection::vec(prop_oneof![
        3 => prop::sample::select(vec![START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL]),
        3 => 0u32..200_000,
        1 => any::<u32>(),
    ], 0..64)) {
        let tokenizer = Tokenizer::o200k_harmony();
        let _ = picchio::chat::parser::StreamParser::parse(tokenizer, &tokens);
        let mut parser = picchio::chat::parser::StreamParser::new(tokenizer);
        for token in tokens {
            let _ = parser.push(token);
        }
        let _ = (parser.messages(), parser.unfinished(), parser.stop());
    }

    /// Lines of the stdio protocol: commands with hostile fields, stray bytes, broken UTF-8.
    /// Every answer is a protocol line and the session survives to the end of input.
    #[test]
    fn stdio_lines(lines in prop::collection::vec(prop_oneof![
        (prop::collection::vec(hostile_number(), 0..9), prop::collection::vec(0u32..300, 0..4))
            .prop_map(|(fields, ids)| {
                let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
                format!("TURN {} {}", fields.join(" "), ids.join(" ")).into_bytes()
            }),
        (0usize..3, 0usize..40, 0u32..256).prop_map(|(max_new, keep, id)| {
            format!("TURN {max_new} {keep} 0 1 0 1 {id}").into_bytes()
        }),
        prop::sample::select(vec![&b"RESET"[..], b"RESET now", b"SHUTDOWN x", b"", b"turn", b"\xff\xfe", b"TURN\t1"])
            .prop_map(<[u8]>::to_vec),
        prop::collection::vec(any::<u8>(), 0..40),
    ], 0..12)) {
        let model = tiny_model();
        let mut input = Vec::new();
        for line in &lines {
            input.extend(line.iter().filter(|&&b| b != b'\n'));
            input.push(b'\n');
        }
        let mut output = Vec::new();
        let tier = picchio::model::generate::SessionTier::cpu();
        let served = picchio::chat::stdio::serve(model, 32, &tier, 0, &input[..], &mut output);
        prop_assert!(served.is_ok(), "{served:?}");
        let text = String::from_utf8(output).unwrap();
        for line in text.lines() {
            let word = line.split(' ').next().unwrap();
            prop_assert!(["READY", "TOKEN", "DONE", "ERROR"].contains(&word), "{line:?}");
            prop_assert!(!line.starts_with("ERROR 500"), "{line:?}");
        }
    }
}

/// tiny-single, loaded once per test process.
fn tiny_model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| Model::load(&tiny_single()).unwrap())
}
