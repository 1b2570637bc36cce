#!/usr/bin/env python3
"""Hostile-user probe of a picchio binary: corrupt files, absurd configs, abusive HTTP and
stdio clients, signals. Each case says whether the binary handled it cleanly (a clear error,
a bounded wait, nothing lost); prints a table by area and writes JSON with --json.

    python3 tools/hostile_probe.py --picchio target/release/picchio [--json out.json]

Needs only the Python standard library, a Unix host and the repository's fixtures; takes
about three minutes. The cases follow issue 40's list; run it against two binaries to
compare them (a flag an older binary lacks counts as not handled).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PICCHIO = None
WORK = None
CASES = []


def case(area):
    def register(f):
        CASES.append((area, f.__name__, f))
        return f
    return register


def run(args, timeout=60, env=None, stdin=None):
    full_env = dict(os.environ, PICCHIO_CACHE_DIR=os.path.join(WORK, "cache"), **(env or {}))
    return subprocess.run([PICCHIO] + args, capture_output=True, timeout=timeout, env=full_env,
                          input=stdin)


def fixture_copy(name="tiny-single"):
    dest = tempfile.mkdtemp(dir=WORK)
    # The checkpoint's files only: not what runs may have left beside it.
    for entry in os.listdir(os.path.join(ROOT, "fixtures", name)):
        if entry.startswith("."):
            continue
        shutil.copy(os.path.join(ROOT, "fixtures", name, entry), dest)
    return dest


def generate(model, extra=(), timeout=60, new_tokens=4):
    return run(["generate", "--model", model, "--ids", "1,2,3", "--max-new-tokens",
                str(new_tokens), "--backend", "cpu"] + list(extra), timeout=timeout)


def failed_naming(result, *words):
    err = result.stderr.decode(errors="replace")
    return result.returncode not in (0, 101) and "panicked" not in err \
        and all(w.lower() in err.lower() for w in words)


# --- silent garbage -------------------------------------------------------------------------

def converted():
    out = os.path.join(tempfile.mkdtemp(dir=WORK), "store")
    result = run(["convert", "--model", os.path.join(ROOT, "fixtures", "tiny-single"),
                  "--out", out])
    assert result.returncode == 0, result.stderr
    return out


@case("silent garbage")
def flipped_byte_in_experts_bin():
    store = converted()
    path = os.path.join(store, "experts.bin")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    return failed_naming(generate(store, new_tokens=16), "experts.bin")


def poison(tensor, value):
    model = fixture_copy()
    path = os.path.join(model, "model.safetensors")
    with open(path, "r+b") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        info = header[tensor]
        begin, end = info["data_offsets"]
        size = {"BF16": 2, "F32": 4}[info["dtype"]]
        bits = {"BF16": {"nan": b"\xc0\x7f", "inf": b"\x80\x7f"},
                "F32": {"nan": b"\x00\x00\xc0\x7f", "inf": b"\x00\x00\x80\x7f"}}[info["dtype"]]
        f.seek(8 + length + begin)
        f.write(bits[value] * ((end - begin) // size))
    return model


for _tensor, _value in [("lm_head.weight", "nan"), ("model.embed_tokens.weight", "nan"),
                        ("model.layers.0.self_attn.q_proj.weight", "nan"),
                        ("model.layers.0.mlp.router.weight", "nan"), ("lm_head.weight", "inf")]:
    def _poisoned(tensor=_tensor, value=_value):
        return failed_naming(generate(poison(tensor, value)), "not finite")
    _poisoned.__name__ = f"{_value}_in_{_tensor}"
    case("silent garbage")(_poisoned)


def with_config(edit):
    model = fixture_copy()
    path = os.path.join(model, "config.json")
    config = json.load(open(path))
    edit(config)
    json.dump(config, open(path, "w"))
    return model


for _name, _field, _edit in [
        ("rope_factor_0", "factor", lambda c: c["rope_scaling"].update(factor=0)),
        ("rope_factor_negative", "factor", lambda c: c["rope_scaling"].update(factor=-5)),
        ("beta_fast_negative", "beta_fast", lambda c: c["rope_scaling"].update(beta_fast=-1)),
        ("eos_beyond_vocab", "eos_token_id", lambda c: c.update(eos_token_id=10**6)),
        ("max_position_0", "max_position_embeddings", lambda c: c.update(max_position_embeddings=0))]:
    def _config(field=_field, edit=_edit):
        return failed_naming(generate(with_config(edit)), field)
    _config.__name__ = _name
    case("silent garbage")(_config)


# --- HTTP server ----------------------------------------------------------------------------

class Server:
    def __init__(self, *extra, env=None):
        self.model = os.path.join(tempfile.mkdtemp(dir=WORK), "tiny-harmony")
        assert run(["synth", "--shape", "tiny-harmony", "--out", self.model]).returncode == 0
        full_env = dict(os.environ, PICCHIO_CACHE_DIR=os.path.join(WORK, "cache"),
                        RUST_LOG="info", **(env or {}))
        self.process = subprocess.Popen(
            [PICCHIO, "serve", "--model", self.model, "--port", "0", "--backend", "cpu"]
            + list(extra), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=full_env)
        self.log = []
        self.port = None
        ready = threading.Event()

        def drain():
            for line in self.process.stderr:
                line = line.decode(errors="replace")
                self.log.append(line)
                if "listening on http://" in line:
                    self.port = int(line.rsplit(":", 1)[1])
                    ready.set()
            ready.set()
        threading.Thread(target=drain, daemon=True).start()
        ready.wait(60)

    def __enter__(self):
        if self.port is None:
            self.__exit__()
            # main() counts a case that raises as not handled.
            raise RuntimeError("the server did not start: " + "".join(self.log[-3:]))
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait()

    def raw(self, data, wait=10.0):
        """Sends `data`, reads until close or `wait`; returns (reply, seconds, closed)."""
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(wait)
        started = time.time()
        out, closed = b"", False
        try:
            s.sendall(data)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    closed = True
                    break
                out += chunk
        except (socket.timeout, ConnectionError):
            pass
        s.close()
        return out, time.time() - started, closed

    def post(self, path, body, headers=""):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n{headers}\r\n").encode()
        return self.raw(head + data, wait=60)[0]


def status(reply):
    try:
        return int(reply.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return None


def chat(content="Hi", max_tokens=4, **more):
    return dict(messages=[{"role": "user", "content": content}], max_tokens=max_tokens, **more)


@case("http")
def slowloris_connections_are_closed():
    with Server() as s:
        socks = []
        for _ in range(50):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
            socks.append(c)
        deadline = time.time() + 25
        closed = 0
        for c in socks:
            c.settimeout(max(0.1, deadline - time.time()))
            try:
                closed += c.recv(1) == b""
            except (socket.timeout, ConnectionError):
                closed += 0
            c.close()
        return closed == len(socks)


@case("http")
def idle_connection_is_closed():
    with Server() as s:
        return s.raw(b"", wait=25)[2]


@case("http")
def lying_content_length_is_answered():
    with Server() as s:
        reply, took, _ = s.raw(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                               b"Content-Length: 100000000000\r\n\r\nab", wait=10)
        return status(reply) == 413 and took < 5


@case("http")
def ten_megabyte_body_gets_413():
    with Server() as s:
        return status(s.post("/v1/completions", b"x" * (10 << 20))) == 413


@case("http")
def max_tokens_capped_by_server_limit():
    with Server("--max-tokens-limit", "3") as s:
        reply = s.post("/v1/chat/completions", chat(max_tokens=2**64 - 1))
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1] or b"{}")
        return status(reply) == 200 and body["usage"]["completion_tokens"] <= 3


@case("http")
def full_queue_answers_503_with_retry_after():
    with Server("--queue-limit", "2") as s:
        replies = []

        def one():
            replies.append(s.post("/v1/chat/completions", chat("Tell a long story", 200)))
        threads = [threading.Thread(target=one) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy = [r for r in replies if status(r) == 503]
        return bool(busy) and all(b"retry-after" in r.lower() for r in busy) \
            and all(status(r) in (200, 503) for r in replies)


@case("http")
def connections_over_the_cap_get_503():
    with Server() as s:
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(140)]
        time.sleep(0.5)
        reply = s.raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
                      wait=5)[0]
        for c in held:
            c.close()
        return status(reply) == 503


@case("http")
def api_key_required():
    with Server("--api-key", "s3cret") as s:
        without = status(s.post("/v1/chat/completions", chat()))
        good = status(s.post("/v1/chat/completions", chat(),
                             "Authorization: Bearer s3cret\r\n"))
        health = status(s.raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\n"
                              b"Connection: close\r\n\r\n")[0])
        return (without, good, health) == (401, 200, 200)


@case("http")
def foreign_host_refused_on_loopback():
    with Server() as s:
        reply = s.raw(b"GET /v1/models HTTP/1.1\r\nHost: evil.example\r\n"
                      b"Connection: close\r\n\r\n")[0]
        return status(reply) == 403


@case("http")
def access_log_has_tokens():
    with Server() as s:
        s.post("/v1/chat/completions", chat())
        time.sleep(0.3)
        return any("POST /v1/chat/completions 200" in l and "completion_tokens=4" in l
                   for l in s.log)


@case("http")
def metrics_in_prometheus_format():
    with Server() as s:
        reply = s.raw(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")[0]
        return status(reply) == 200 and b"# TYPE picchio_" in reply


@case("http")
def sigterm_finishes_streams_and_exits_0():
    with Server() as s:
        replies = []
        t = threading.Thread(target=lambda: replies.append(
            s.post("/v1/chat/completions", chat("Hello", 40, stream=True))))
        t.start()
        time.sleep(0.3)
        s.process.send_signal(signal.SIGTERM)
        t.join(30)
        try:
            code = s.process.wait(30)
        except subprocess.TimeoutExpired:
            return False
        return code == 0 and replies and b"[DONE]" in replies[0]


@case("http")
def tool_choice_naming_a_missing_function_is_400():
    with Server() as s:
        tools = [{"type": "function", "function": {"name": "get_weather"}}]
        body = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
        return status(s.post("/v1/chat/completions", body)) == 400


# --- stdio and chat -------------------------------------------------------------------------

def stdio(lines, extra=()):
    model = fixture_copy()
    data = b"".join(line + b"\n" for line in lines)
    result = run(["serve", "--stdio", "--model", model, "--backend", "cpu"] + list(extra),
                 stdin=data, timeout=60)
    return result, result.stdout.decode(errors="replace").splitlines()


GOOD_TURN = b"TURN 2 0 0 1 0 2 1 2"


def answered_then_served(bad):
    result, out = stdio([bad, GOOD_TURN])
    errors = [l for l in out if l.startswith("ERROR 400 0")]
    return result.returncode == 0 and len(errors) == 1 and any(l.startswith("DONE") for l in out)


@case("stdio")
def non_utf8_line():
    return answered_then_served(b"TURN \xff\xfe 1")


@case("stdio")
def empty_line():
    return answered_then_served(b"")


@case("stdio")
def reset_with_arguments():
    return answered_then_served(b"RESET everything")


@case("stdio")
def line_over_the_limit():
    return answered_then_served(b"TURN " + b"1 " * (10 << 20))


@case("stdio")
def context_clamped_to_max_position():
    _, out = stdio([], ["--context", "1000000000000"])
    return bool(out) and out[0].startswith("READY ") and int(out[0].split()[1]) <= 131072


@case("stdio")
def chat_survives_a_non_utf8_line():
    synth = os.path.join(tempfile.mkdtemp(dir=WORK), "tiny-harmony")
    run(["synth", "--shape", "tiny-harmony", "--out", synth])
    result = run(["chat", "--model", synth, "--backend", "cpu", "--max-new-tokens", "3"],
                 stdin=b"Hi\n\xff\xfe\nHello again\n", timeout=60)
    return result.returncode == 0 and result.stdout.count(b"\n") >= 2


# --- files and CLI --------------------------------------------------------------------------

def crafted_stride():
    store = converted()
    path = os.path.join(store, "experts.json")
    index = json.load(open(path))
    index["record_stride"] = 2**40
    json.dump(index, open(path, "w"))
    return store


@case("files and cli")
def verify_on_a_crafted_record_stride():
    return failed_naming(run(["verify", "--model", crafted_stride()]), "record_stride")


@case("files and cli")
def generate_on_a_crafted_record_stride():
    return failed_naming(generate(crafted_stride()), "record_stride")


@case("files and cli")
def absurd_thread_count_is_capped():
    started = time.time()
    try:
        result = generate(os.path.join(ROOT, "fixtures", "tiny-single"),
                          ["--threads", "100000"], timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and time.time() - started < 30


def interrupted_generate(extra):
    model = fixture_copy("tiny-long")
    env = dict(os.environ, PICCHIO_CACHE_DIR=os.path.join(WORK, "cache"))
    p = subprocess.Popen([PICCHIO, "generate", "--model", model, "--ids", "1,2,3",
                          "--max-new-tokens", "100000", "--context", "100000", "--ignore-eos",
                          "--backend", "cpu"] + extra, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    out, _ = p.communicate(timeout=30)
    return p.returncode, out


@case("files and cli")
def interrupted_generate_prints_its_tokens():
    code, out = interrupted_generate([])
    return code == 130 and len(out.split()) > 0


@case("files and cli")
def interrupted_generate_json_is_valid():
    code, out = interrupted_generate(["--json"])
    try:
        return code == 130 and json.loads(out).get("interrupted") is True
    except ValueError:
        return False


@case("files and cli")
def killed_convert_can_be_retried():
    source = os.path.join(tempfile.mkdtemp(dir=WORK), "tiny-harmony")
    run(["synth", "--shape", "tiny-harmony", "--out", source])
    env = dict(os.environ, PICCHIO_CACHE_DIR=os.path.join(WORK, "cache"))
    # The conversion takes a few tens of milliseconds: kill it once its output appears, and
    # try again when it finished first.
    for _ in range(20):
        parent = tempfile.mkdtemp(dir=WORK)
        out = os.path.join(parent, "store")
        p = subprocess.Popen([PICCHIO, "convert", "--model", source, "--out", out],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        while p.poll() is None and len(os.listdir(parent)) == 0:
            pass
        p.kill()
        if p.wait() == -signal.SIGKILL:
            break
    else:
        return False
    retry = run(["convert", "--model", source, "--out", out])
    return retry.returncode == 0 and generate(out).returncode == 0


@case("files and cli")
def converted_files_have_the_usual_permissions():
    store = converted()
    return all(os.stat(os.path.join(store, f)).st_mode & 0o044 == 0o044
               for f in os.listdir(store))


@case("files and cli")
def fifo_model_file_is_refused():
    model = fixture_copy()
    os.remove(os.path.join(model, "model.safetensors"))
    os.mkfifo(os.path.join(model, "model.safetensors"))
    try:
        return failed_naming(generate(model, timeout=10), "regular file")
    except subprocess.TimeoutExpired:
        return False


@case("files and cli")
def directory_model_file_is_refused():
    model = fixture_copy()
    os.remove(os.path.join(model, "model.safetensors"))
    os.mkdir(os.path.join(model, "model.safetensors"))
    return failed_naming(generate(model), "regular file")


@case("files and cli")
def usage_counters_stay_out_of_the_model_directory():
    model = fixture_copy()
    before = set(os.listdir(model))
    generate(model)
    return set(os.listdir(model)) == before


def main():
    global PICCHIO, WORK
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--picchio", required=True)
    parser.add_argument("--json")
    args = parser.parse_args()
    PICCHIO = os.path.abspath(args.picchio)
    WORK = tempfile.mkdtemp(prefix="picchio-probe-")
    results = []
    try:
        for area, name, f in CASES:
            try:
                ok = bool(f())
            except Exception as e:  # a hang or a crash of the probe is a case not handled
                print(f"  {name}: {type(e).__name__}: {e}")
                ok = False
            print(f"{'ok  ' if ok else 'FAIL'} {area}: {name}", flush=True)
            results.append({"area": area, "case": name, "handled": ok})
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    print("\n| area | tried | handled cleanly |\n|---|---|---|")
    areas = list(dict.fromkeys(r["area"] for r in results))
    for area in areas + ["all"]:
        rows = [r for r in results if area in ("all", r["area"])]
        print(f"| {area} | {len(rows)} | {sum(r['handled'] for r in rows)} |")
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
