//! `picchio serve`: real HTTP requests over loopback against a tiny model with the
//! o200k_harmony vocabulary (`picchio synth --shape tiny-harmony`, made here, not committed).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::http::{picchio, request, request_with, server, server_on, tiny_harmony};

use serde_json::{Value, json};

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = request(port, "POST", path, Some(&body.to_string()));
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The `data:` payloads of an SSE body.
fn events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"model": "tiny-harmony", "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens})
}

#[test]
fn health_models_and_chat_completions() {
    let replies: Vec<Value> = common::backends()
        .into_iter()
        .map(health_models_and_chat_completions_on)
        .collect();
    // Greedy on every tier: the same reply.
    assert!(replies.windows(2).all(|w| w[0] == w[1]), "{replies:?}");
}

/// Returns the first chat reply's choices.
fn health_models_and_chat_completions_on(backend: &str) -> Value {
    let s = server(&["--backend", backend]);
    let (status, body) = request(s.port, "GET", "/health", None);
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));
    let (status, body) = request(s.port, "GET", "/v1/models", None);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "tiny-harmony");

    // Non-streaming: an OpenAI chat.completion object.
    let (status, reply) = post(s.port, "/v1/chat/completions", &chat("Say hi.", 5));
    assert_eq!(status, 200, "{reply}");
    let first = reply["choices"].clone();
    assert_eq!(reply["object"], "chat.completion");
    assert_eq!(reply["choices"][0]["message"]["role"], "assistant");
    assert_eq!(reply["choices"][0]["finish_reason"], "length");
    let usage = &reply["usage"];
    assert_eq!(usage["completion_tokens"], 5);
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 20);
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap() + 5
    );
    // Greedy and deterministic: the same request gives the same reply, reusing the cache.
    let (_, again) = post(s.port, "/v1/chat/completions", &chat("Say hi.", 5));
    assert_eq!(again["choices"], reply["choices"]);
    assert!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0
    );

    // Streaming: chunks, then [DONE].
    let mut streamed = chat("Say hi.", 5);
    streamed["stream"] = json!(true);
    let (status, body) = request(
        s.port,
        "POST",
        "/v1/chat/completions",
        Some(&streamed.to_string()),
    );
    assert_eq!(status, 200);
    let data = events(&body);
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 5);
    // The streamed text is the non-streamed reply's.
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text,
        reply["choices"][0]["message"]["content"].as_str().unwrap()
    );

    // Tools render into the prompt (a longer prompt), and the reply is still valid.
    let mut tools = chat("Weather in Tokyo?", 3);
    tools["tools"] = json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Gets the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    tools["tool_choice"] = json!("auto");
    let (status, with_tools) = post(s.port, "/v1/chat/completions", &tools);
    assert_eq!(status, 200, "{with_tools}");
    let (_, without) = post(
        s.port,
        "/v1/chat/completions",
        &chat("Weather in Tokyo?", 3),
    );
    assert!(
        with_tools["usage"]["prompt_tokens"].as_u64() > without["usage"]["prompt_tokens"].as_u64()
    );
    // A conversation with a tool call and its result renders too.
    let history = json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":\"Tokyo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 20}"}],
        "tools": tools["tools"], "max_tokens": 2});
    let (status, reply) = post(s.port, "/v1/chat/completions", &history);
    assert_eq!(status, 200, "{reply}");

    // Raw completions.
    let (status, reply) = post(
        s.port,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["object"], "text_completion");
    assert_eq!(reply["usage"]["completion_tokens"], 4);
    first
}

#[test]
fn bad_requests_get_openai_errors_and_leave_the_server_working() {
    for backend in common::backends() {
        bad_requests_on(backend);
    }
}

/// A chat request offering one tool, with `tool_choice`.
fn with_tool_choice(choice: Value) -> String {
    json!({"messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
        "tool_choice": choice})
    .to_string()
}

fn bad_requests_on(backend: &str) {
    let s = server(&["--backend", backend, "--context", "128"]);
    let (_, before) = post(s.port, "/v1/chat/completions", &chat("Hello", 4));
    let cases: Vec<(Option<String>, u16, &str)> = vec![
        (Some("{\"messages\": [".into()), 400, "invalid_json"),
        (Some(r#"{"messages": "hi"}"#.into()), 400, "invalid_json"),
        (
            Some(chat("x", 2).to_string().replace("tiny-harmony", "gpt-4")),
            404,
            "model_not_found",
        ),
        (
            Some(
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1})
                    .to_string(),
            ),
            400,
            "invalid_sampling",
        ),
        (
            Some(json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}).to_string()),
            400,
            "invalid_sampling",
        ),
        (
            Some(json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string()),
            400,
            "invalid_messages",
        ),
        (
            Some(json!({"messages": []}).to_string()),
            400,
            "invalid_messages",
        ),
        (
            Some(json!({"messages": [{"role": "user", "content": "x"}], "n": 2}).to_string()),
            400,
            "invalid_sampling",
        ),
        (
            Some(
                json!({"messages": [{"role": "user", "content": "x"}],
                       "stop": ["a", "b", "c", "d", "e"]})
                .to_string(),
            ),
            400,
            "invalid_stop",
        ),
        (
            Some(json!({"messages": [{"role": "user", "content": "x"}], "stop": [""]}).to_string()),
            400,
            "invalid_stop",
        ),
        // Not served yet, so refused rather than ignored.
        (
            Some(
                json!({"messages": [{"role": "user", "content": "x"}],
                       "response_format": {"type": "json_object"}})
                .to_string(),
            ),
            400,
            "unsupported_parameter",
        ),
        (
            Some(
                json!({"messages": [{"role": "user", "content": "x"}], "logprobs": true})
                    .to_string(),
            ),
            400,
            "invalid_sampling",
        ),
        (
            Some(chat(&"word ".repeat(200), 2).to_string()),
            400,
            "context_length_exceeded",
        ),
        // A forced tool call is not served, and a choice naming a missing tool is an error.
        (
            Some(with_tool_choice(json!("required"))),
            400,
            "invalid_messages",
        ),
        (
            Some(with_tool_choice(
                json!({"type": "function", "function": {"name": "no_such_tool"}}),
            )),
            400,
            "invalid_messages",
        ),
        (
            Some(with_tool_choice(
                json!({"type": "function", "function": {"name": "get_weather"}}),
            )),
            400,
            "invalid_messages",
        ),
    ];
    for (body, want_status, want_code) in cases {
        let (status, text) = request(s.port, "POST", "/v1/chat/completions", body.as_deref());
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            (status, error["error"]["code"].as_str()),
            (want_status, Some(want_code)),
            "{text}"
        );
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    let (status, _) = request(s.port, "GET", "/v1/nothing", None);
    assert_eq!(status, 404);
    // An empty stop list, n = 1, logprobs false and a text response_format are what clients
    // often send: accepted.
    let mut plain = chat("Hello", 1);
    plain["stop"] = json!([]);
    plain["n"] = json!(1);
    plain["logprobs"] = json!(false);
    plain["response_format"] = json!({"type": "text"});
    assert_eq!(post(s.port, "/v1/chat/completions", &plain).0, 200);
    // The session was never touched: the same request gives the same reply.
    let (status, after) = post(s.port, "/v1/chat/completions", &chat("Hello", 4));
    assert_eq!(status, 200);
    assert_eq!(after["choices"], before["choices"]);
}

#[test]
fn concurrent_clients_are_queued_and_all_answered() {
    for backend in common::backends() {
        concurrent_clients_on(backend);
    }
}

fn concurrent_clients_on(backend: &str) {
    let s = server(&["--backend", backend]);
    let port = s.port;
    let clients: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                post(
                    port,
                    "/v1/chat/completions",
                    &chat(&format!("Client {i} says hi."), 6),
                )
            })
        })
        .collect();
    for client in clients {
        let (status, reply) = client.join().unwrap();
        assert_eq!(status, 200, "{reply}");
        assert_eq!(reply["usage"]["completion_tokens"], 6);
    }
    // A client that hangs up mid-stream does not stall the server: its generation stops.
    let timed = std::time::Instant::now();
    let (status, _) = post(port, "/v1/chat/completions", &chat("Count.", 100));
    assert_eq!(status, 200);
    let hundred_tokens = timed.elapsed();
    let mut streamed = chat("Tell me a long story.", 2000);
    streamed["stream"] = json!(true);
    let body = streamed.to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let _ = stream.read(&mut first).unwrap();
    drop(stream);
    let started = std::time::Instant::now();
    let (status, _) = post(port, "/v1/chat/completions", &chat("Next.", 2));
    assert_eq!(status, 200);
    // Finishing the abandoned 2000 tokens first would take 20 times as long as 100.
    assert!(
        started.elapsed() < hundred_tokens * 8,
        "{:?} after a hang-up; 100 tokens take {hundred_tokens:?}",
        started.elapsed()
    );
}

/// `picchio chat` on the model in `dir` with `env` set, its standard streams piped and `input`
/// written to its stdin (then closed).
/// A terminal chat's stderr, after checking it exited 0, and its status lines (one per answer).
fn status_lines(out: &std::process::Output) -> (String, Vec<String>) {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    let status = (stderr.lines())
        .filter(|l| l.starts_with('[') && l.contains("tokens/s"))
        .map(str::to_string)
        .collect();
    (stderr, status)
}

fn terminal_chat(
    dir: &std::path::Path,
    backend: &str,
    max_new_tokens: usize,
    env: &[(&str, &str)],
    input: &[u8],
) -> Child {
    let mut child = picchio()
        .args([
            "chat",
            "--backend",
            backend,
            "--model",
            dir.to_str().unwrap(),
        ])
        .arg("--max-new-tokens")
        .arg(max_new_tokens.to_string())
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    child
}

#[test]
fn terminal_chat_answers_reuses_the_conversation_and_resets() {
    let (_model, dir) = tiny_harmony();
    let answers: Vec<String> = common::backends()
        .into_iter()
        .map(|backend| terminal_chat_on(&dir, backend))
        .collect();
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}

/// Returns the answers printed.
fn terminal_chat_on(dir: &std::path::Path, backend: &str) -> String {
    let child = terminal_chat(
        dir,
        backend,
        5,
        &[],
        // A line that is not UTF-8 is reported and skipped: the conversation goes on.
        b"Hello there\n\xff\xfe\nAnd again\n/reset\nFresh start\n/exit\nnever read\n",
    );
    let out = child.wait_with_output().unwrap();
    let (stderr, status) = status_lines(&out);
    let status: Vec<&str> = status.iter().map(String::as_str).collect();
    assert_eq!(status.len(), 3, "{stderr}");
    let reused = |line: &str| -> usize {
        line.split(", ")
            .find_map(|p| p.strip_suffix(" reused")?.parse().ok())
            .unwrap()
    };
    assert_eq!(reused(status[0]), 0);
    assert!(
        reused(status[1]) > 50,
        "the second turn reuses the first: {}",
        status[1]
    );
    assert_eq!(reused(status[2]), 0, "after /reset nothing is reused");
    assert!(stderr.contains("(conversation reset)"));
    assert!(
        stderr.contains("(that line is not UTF-8: not sent)"),
        "{stderr}"
    );
    assert!(
        status.iter().all(|l| l.starts_with("[5 tokens")),
        "{stderr}"
    );
    // One answer line per turn.
    let answers = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(answers.lines().count(), 3);
    answers
}

/// `PICCHIO_CPU_AMX=on` makes a CPU worker log, at the first matrix product, whether it uses AMX
/// tiles (or why not). While the chat held the standard streams' locks for the whole session,
/// that line waited on stderr for ever.
#[test]
fn terminal_chat_with_amx_asked_for_logs_the_choice_and_answers() {
    let (_model, dir) = tiny_harmony();
    let env = [("PICCHIO_CPU_AMX", "on"), ("RUST_LOG", "info")];
    let mut child = terminal_chat(&dir, "cpu", 3, &env, b"Hello there\n/exit\n");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("picchio chat with PICCHIO_CPU_AMX=on did not finish in 120 s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("AMX") && stderr.contains("[3 tokens"),
        "the choice logged and one answer: {stderr}"
    );
}

#[test]
fn chat_on_a_model_without_the_harmony_vocabulary_is_a_clear_error() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-single");
    let out = picchio()
        .args(["chat", "--model", dir.to_str().unwrap()])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("o200k_harmony vocabulary"),
        "{stderr}"
    );
}

/// With --api-key every route but /health needs the key; --max-tokens-limit cuts a request's
/// max_tokens; /metrics counts what was served.
#[test]
fn api_key_and_token_limit_are_enforced() {
    let s = server(&["--api-key", "s3cret", "--max-tokens-limit", "3"]);
    assert_eq!(request(s.port, "GET", "/health", None).0, 200);
    let body = chat("Hello", 10).to_string();
    for headers in [
        "",
        "Authorization: Bearer wrong\r\n",
        "Authorization: s3cret\r\n",
    ] {
        let (status, text) =
            request_with(s.port, "POST", "/v1/chat/completions", headers, Some(&body));
        assert_eq!(status, 401, "{headers:?}: {text}");
        let error: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error["error"]["code"], "invalid_api_key");
    }
    assert_eq!(request(s.port, "GET", "/v1/models", None).0, 401);
    let key = "Authorization: Bearer s3cret\r\n";
    let (status, text) = request_with(s.port, "POST", "/v1/chat/completions", key, Some(&body));
    assert_eq!(status, 200, "{text}");
    let reply: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(reply["usage"]["completion_tokens"], 3, "{reply}");
    assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
    // /metrics counts what was served (behind the key too).
    assert_eq!(request(s.port, "GET", "/metrics", None).0, 401);
    let (status, text) = request_with(s.port, "GET", "/metrics", key, None);
    assert_eq!(status, 200, "{text}");
    let sample = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(name)).expect(name);
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(sample("picchio_completion_tokens_total "), 3.0, "{text}");
    assert!(sample("picchio_prompt_tokens_total ") > 0.0, "{text}");
    // /health and the chat completion.
    assert_eq!(
        sample("picchio_http_responses_total{status=\"200\"}"),
        2.0,
        "{text}"
    );
    assert!(
        sample("picchio_http_responses_total{status=\"401\"}") >= 4.0,
        "{text}"
    );
    assert_eq!(sample("picchio_queue_depth "), 0.0, "{text}");
    assert!(sample("picchio_expert_requests_total ") > 0.0, "{text}");
    assert!(sample("picchio_tokens_per_second ") > 0.0, "{text}");
}

/// SIGTERM stops a server cleanly: a stream in flight still ends with [DONE], and the process
/// exits 0.
#[cfg(unix)]
#[test]
fn a_stop_signal_lets_streams_finish_and_exits_cleanly() {
    let mut s = server(&["--backend", "cpu"]);
    let port = s.port;
    let client = std::thread::spawn(move || {
        let mut body = chat("Hello", 20);
        body["stream"] = json!(true);
        request(
            port,
            "POST",
            "/v1/chat/completions",
            Some(&body.to_string()),
        )
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    common::send_signal(&s.child, "TERM");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no exit after SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    let (code, body) = client.join().unwrap();
    assert_eq!(code, 200);
    assert!(body.contains("data: [DONE]"), "{body}");
}

/// Sends `head_and_body` raw on a new connection and reads until the server closes it or
/// `wait` passes; returns what came back and how long it took.
fn raw_exchange(port: u16, head_and_body: &[u8], wait: Duration) -> (String, Duration) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(wait)).unwrap();
    let started = Instant::now();
    stream.write_all(head_and_body).unwrap();
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    (
        String::from_utf8_lossy(&reply).into_owned(),
        started.elapsed(),
    )
}

/// Stalled, oversized and foreign requests are answered or closed within the server's limits,
/// and the server then serves the next client (slowloris, a lying Content-Length, DNS
/// rebinding, a missing Host).
#[test]
fn stalled_oversized_and_foreign_requests_meet_the_limits() {
    let limits = [
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
        "--max-body-bytes",
        "2000",
        "--allowed-host",
        "box.lan",
    ];
    let s = server(&limits);
    let wait = Duration::from_secs(10);
    // An idle connection and one whose head never ends are closed after the header timeout.
    for sent in [&b""[..], b"GET /health HTTP/1.1\r\nHost: local"] {
        let (reply, took) = raw_exchange(s.port, sent, wait);
        assert!(
            reply.is_empty() && took < Duration::from_secs(5),
            "{reply:?} after {took:?}"
        );
    }
    let head = |length: usize, host: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
        )
    };
    let status = |reply: &str| {
        reply
            .split_whitespace()
            .nth(1)
            .unwrap_or("none")
            .to_string()
    };
    // A body declared far beyond the limit: 413 at once, nothing read.
    let (reply, took) = raw_exchange(s.port, head(100_000_000_000, "localhost").as_bytes(), wait);
    assert_eq!(status(&reply), "413", "{reply}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    // A body over the limit sent whole (within 4x the limit: read and dropped): the client
    // reads the 413 rather than a reset.
    let mut whole = head(7_000, "localhost").into_bytes();
    whole.extend(std::iter::repeat_n(b'a', 7_000));
    let (reply, _) = raw_exchange(s.port, &whole, wait);
    assert!(reply.contains("request_too_large"), "{reply}");
    // A body that stops arriving: 408 after the body timeout.
    let (reply, took) = raw_exchange(
        s.port,
        format!("{}{{\"pro", head(50, "localhost")).as_bytes(),
        wait,
    );
    assert_eq!(status(&reply), "408", "{reply}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // Bound to loopback: a foreign Host is refused, a listed one served.
    let body = r#"{"prompt":"Hi","max_tokens":2}"#;
    for (host, expected) in [
        ("evil.example", "403"),
        ("box.lan:80", "200"),
        ("127.0.0.1", "200"),
    ] {
        let sent = format!("{}{body}", head(body.len(), host))
            .replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n");
        let (reply, _) = raw_exchange(s.port, sent.as_bytes(), wait);
        assert_eq!(status(&reply), expected, "{host}: {reply}");
    }
    // A missing Host is refused where names are checked.
    let (reply, _) = raw_exchange(s.port, b"GET /health HTTP/1.0\r\n\r\n", wait);
    assert_eq!(status(&reply), "400", "{reply}");
}

/// One connection over --max-connections gets 503 with Retry-After and is closed; once one of
/// the open ones closes, the next is served.
#[test]
fn connections_over_the_cap_are_refused_with_retry_after() {
    let s = server(&["--max-connections", "4", "--header-timeout", "60"]);
    let health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n";
    // Each held connection has been answered once, so it holds its place under the cap.
    let held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut stream = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            stream.write_all(health).unwrap();
            let mut reply = [0u8; 512];
            let n = stream.read(&mut reply).unwrap();
            assert!(String::from_utf8_lossy(&reply[..n]).starts_with("HTTP/1.1 200"));
            stream
        })
        .collect();
    let closing = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let (reply, _) = raw_exchange(s.port, closing, Duration::from_secs(10));
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
    assert!(
        reply.to_ascii_lowercase().contains("retry-after: 1"),
        "{reply}"
    );
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (reply, _) = raw_exchange(s.port, closing, Duration::from_secs(10));
        if reply.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {reply}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Qwen3-MoE fixture that chats, and what transformers renders for its conversations.
fn qwen3_chat_fixture() -> (std::path::PathBuf, Value) {
    let dir = common::qwen3_fixture_dirs()
        .into_iter()
        .find(|d| d.join("chat_reference.json").is_file())
        .unwrap();
    let text = std::fs::read_to_string(dir.join("chat_reference.json")).unwrap();
    (dir, serde_json::from_str(&text).unwrap())
}

/// A Qwen3-MoE model chats through its own template and tokenizer: the prompt of a conversation
/// with tools, tool calls and results is the one transformers renders (its token count), the
/// reply streams, GPT-OSS's reasoning_effort is refused for it, and chat_template_kwargs are
/// refused for a Harmony model.
#[test]
fn a_qwen3_model_chats_through_its_template() {
    let (dir, reference) = qwen3_chat_fixture();
    let qwen = server_on(&dir, &["--backend", "cpu"]);
    for case in reference["cases"].as_array().unwrap() {
        if case["add_generation_prompt"] != json!(true) {
            continue;
        }
        let mut body = json!({"messages": case["messages"], "max_tokens": 4, "temperature": 0,
                              "chat_template_kwargs": case["template_arguments"]});
        if !case["tools"].is_null() {
            body["tools"] = case["tools"].clone();
        }
        let (status, reply) = post(qwen.port, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{}: {reply}", case["name"]);
        let want = case["ids"].as_array().unwrap().len();
        assert_eq!(
            reply["usage"]["prompt_tokens"],
            json!(want),
            "{}",
            case["name"]
        );
        assert_eq!(reply["usage"]["completion_tokens"], json!(4));
    }
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                      "stream": true});
    let (status, text) = request(
        qwen.port,
        "POST",
        "/v1/chat/completions",
        Some(&body.to_string()),
    );
    assert_eq!(status, 200);
    let data = events(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{text}");
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "low"});
    let (status, reply) = post(qwen.port, "/v1/chat/completions", &body);
    assert_eq!(status, 400);
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat_template_kwargs")
    );

    let harmony = server(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}],
                      "chat_template_kwargs": {"enable_thinking": false}});
    let (status, reply) = post(harmony.port, "/v1/chat/completions", &body);
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("Harmony")
    );
}

/// The terminal chat with a Qwen3-MoE model renders its turns with the checkpoint's template:
/// the first prompt is transformers' (the reference's token count), the second reuses it.
#[test]
fn terminal_chat_renders_a_template_model_s_turns() {
    let (dir, reference) = qwen3_chat_fixture();
    let first = &reference["cases"][0];
    assert_eq!(first["messages"][0]["content"], json!("Hi there!"));
    let child = terminal_chat(&dir, "cpu", 4, &[], b"Hi there!\nAnd again\n/exit\n");
    let out = child.wait_with_output().unwrap();
    let (stderr, status) = status_lines(&out);
    let status: Vec<&str> = status.iter().map(String::as_str).collect();
    assert_eq!(status.len(), 2, "{stderr}");
    let field = |line: &str, suffix: &str| -> usize {
        line.split([',', ';'])
            .find_map(|p| p.trim().strip_suffix(suffix)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{suffix} in {line}"))
    };
    let want = first["ids"].as_array().unwrap().len();
    assert!(
        status[0].contains(&format!("prompt {want} tokens")),
        "{}",
        status[0]
    );
    assert!(field(status[1], "reused") >= want, "{}", status[1]);
}

/// The text of a stream's chunks (`field` of each choice's delta, or `text`), and the last
/// finish_reason.
fn streamed(body: &str, field: &str) -> (String, Value) {
    let mut text = String::new();
    let mut finish = Value::Null;
    for data in events(body) {
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            continue;
        };
        let choice = &chunk["choices"][0];
        let piece = choice["delta"][field].as_str().or(choice[field].as_str());
        text.push_str(piece.unwrap_or_default());
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    (text, finish)
}

/// A stop string taken from the middle of `text` (whole characters), where it first occurs.
fn stop_inside(text: &str) -> (String, usize) {
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    assert!(chars.len() >= 8, "too short a reply to cut: {text:?}");
    let from = chars.len() / 2;
    let stop: String = chars[from..from + 3].iter().map(|(_, c)| c).collect();
    let at = text.find(&stop).unwrap();
    (stop, at)
}

/// Asks `path` for `body` whole, then with a stop string cut from the middle of its text
/// (`text_of` a reply, `field` of a streamed chunk; the stop given as `stop_as` writes it),
/// plainly and streamed with `stream_options.include_usage`: both give the text up to the stop
/// with finish reason "stop", in fewer tokens than `max_tokens`. Returns the stopped reply and
/// the stream's body.
fn stopped_replies(
    port: u16,
    path: &str,
    body: &Value,
    text_of: fn(&Value) -> &Value,
    field: &str,
    stop_as: fn(String) -> Value,
) -> (Value, String) {
    let (status, whole) = post(port, path, body);
    assert_eq!(status, 200, "{whole}");
    let text = text_of(&whole).as_str().unwrap().to_string();
    let (stop, at) = stop_inside(&text);
    let mut stopped = body.clone();
    stopped["stop"] = stop_as(stop.clone());
    let (status, reply) = post(port, path, &stopped);
    assert_eq!(status, 200, "{reply}");
    assert_eq!(text_of(&reply), &json!(text[..at]), "stop {stop:?}");
    assert_eq!(reply["choices"][0]["finish_reason"], "stop");
    let max_tokens = body["max_tokens"].as_u64().unwrap();
    assert!(reply["usage"]["completion_tokens"].as_u64().unwrap() < max_tokens);
    stopped["stream"] = json!(true);
    stopped["stream_options"] = json!({"include_usage": true});
    let (status, stream) = request(port, "POST", path, Some(&stopped.to_string()));
    assert_eq!(status, 200);
    assert_eq!(
        streamed(&stream, field),
        (text[..at].to_string(), json!("stop"))
    );
    (reply, stream)
}

fn completion_text(reply: &Value) -> &Value {
    &reply["choices"][0]["text"]
}

fn chat_content(reply: &Value) -> &Value {
    &reply["choices"][0]["message"]["content"]
}

/// `stop` ends the reply before the first sequence, as a whole request and streamed, on both
/// endpoints: the text is the unstopped reply's up to it, the finish reason "stop", and the
/// generation ends there rather than at max_tokens. `stream_options.include_usage` adds a last
/// chunk with the usage and no choices.
#[test]
fn stop_sequences_end_the_reply_before_them() {
    let (dir, _) = qwen3_chat_fixture();
    let s = server_on(&dir, &["--backend", "cpu"]);
    const MAX: usize = 40;
    let completion = json!({"prompt": "Once upon a time", "max_tokens": MAX, "temperature": 0});
    stopped_replies(
        s.port,
        "/v1/completions",
        &completion,
        completion_text,
        "text",
        |stop| json!([stop]),
    );

    let chat = json!({"messages": [{"role": "user", "content": "Tell me a story"}],
                      "max_tokens": MAX, "temperature": 0,
                      "chat_template_kwargs": {"enable_thinking": false}});
    let (reply, stream) = stopped_replies(
        s.port,
        "/v1/chat/completions",
        &chat,
        chat_content,
        "content",
        |stop| json!(stop),
    );
    let data = events(&stream);
    let usage: Value = serde_json::from_str(&data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]), "{usage}");
    assert_eq!(usage["usage"], reply["usage"]);
}
