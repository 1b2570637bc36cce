#!/usr/bin/env bash
# GPU measurements anyone with a GPU can run from the repository root:
#
#   bash tools/gpu_bench.sh [--quick] [--out DIR]
#
# 1. lists the adapters (`picchio devices --json`),
# 2. checks the GPU tier against the CPU tier on every fixture (`picchio ab`: same tokens),
# 3. benches decode and prefill at VRAM budgets 100%, 50%, 25% and 0% with the roofline
#    (`picchio bench --backend gpu --roofline --json`): tokens/s, the adapter's own read
#    bandwidth, roofline fraction, dispatches, submissions and readbacks per token, and
#    (`--profile`, where the adapter has timestamps) each run's per-kernel time and GB/s,
# 4. and `generate --stats` once fully resident, for the GPU counters of one run, and
#    `generate --profile` for the time of each kernel (where the adapter has timestamps).
#
# The model is a synthetic gpt-oss-20b (`picchio synth`, 13.8 GB on disk; about 14 GB of VRAM
# for the resident run), or with --quick fixtures/tiny-routed (seconds; enough on lavapipe).
# Everything lands in DIR (default gpu-bench-<date>) as JSON, with the commands in run.log.
#
# A machine without network: build elsewhere (`cargo build --release`) and carry the binary;
# PICCHIO_BIN=path/to/picchio skips the build. PICCHIO_SYNTH_DIR=DIR reuses a synthetic model.
# On a software adapter (lavapipe), set PICCHIO_GPU_ALLOW_SOFTWARE=1.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
out="gpu-bench-$(date -u +%Y%m%d-%H%M)"
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --out) out="$2"; shift ;;
        *) echo "usage: bash tools/gpu_bench.sh [--quick] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$out"
log="$out/run.log"

bin="${PICCHIO_BIN:-}"
if [ -z "$bin" ]; then
    cargo build --release --locked
    bin=./target/release/picchio
fi
# Runs a command with its stderr in the log; the command line goes to the log and the terminal,
# never to stdout (which callers redirect into a JSON file).
run() {
    echo "+ $*" | tee -a "$log" >&2
    "$@" 2>>"$log"
}

echo "# $(date -u +%FT%TZ) on $(uname -srm), $("$bin" --version 2>/dev/null || echo picchio)" | tee -a "$log" >&2
run "$bin" devices --json > "$out/devices.json"
cat "$out/devices.json"

# Exactness first: the GPU tier's tokens are the CPU tier's on every fixture.
for dir in fixtures/tiny-*; do
    name=$(basename "$dir")
    run "$bin" ab --model "$dir" --backend gpu --max-new-tokens 16 --ids 1,2,3,4 --json \
        > "$out/ab-$name.json"
done

if [ "$quick" = 1 ]; then
    model=fixtures/tiny-routed
    prompt=8 gen=16
else
    model="${PICCHIO_SYNTH_DIR:-$out/synth-gpt-oss-20b}"
    if [ ! -f "$model/config.json" ]; then
        run "$bin" synth --shape gpt-oss-20b --out "$model"
    fi
    prompt=64 gen=32
fi

# --profile adds each run's per-kernel table (a second, profiled decode) where the adapter has
# timestamp queries.
profile_flag=""
if grep -q '"timestamp_query":true' "$out/devices.json"; then profile_flag="--profile"; fi
run "$bin" bench --model "$model" --backend gpu --vram-budgets 100%,50%,25%,0 \
    --prompt-tokens "$prompt" --gen-tokens "$gen" --roofline $profile_flag --json > "$out/bench.json"
run "$bin" generate --model "$model" --backend gpu --vram-budget 100% --ids 1,2,3,4,5,6,7,8 \
    --max-new-tokens "$gen" --ignore-eos --stats --json > "$out/generate-resident.json"
# Per-kernel device time, where the adapter has timestamp queries (a run of its own: profiling
# records each kernel in a pass of its own, which would skew the stats above).
if grep -q '"timestamp_query":true' "$out/devices.json"; then
    run "$bin" generate --model "$model" --backend gpu --vram-budget 100% --ids 1,2,3,4,5,6,7,8 \
        --max-new-tokens "$gen" --ignore-eos --profile --json > "$out/profile-resident.json"
fi

# A summary for the eye (the JSON has everything); needs python3, skipped without it.
python3 - "$out" <<'EOF' || true
import glob, json, os, sys
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "ab-*.json"))):
    ab = json.load(open(path))
    print(f"{os.path.basename(path)}: {ab['tokens_agreeing']} of {ab['steps']} tokens as the CPU tier's")
profile = os.path.join(out, "profile-resident.json")
if os.path.exists(profile):
    for row in json.load(open(profile))["profile"][:8]:
        rate = "-" if row.get("gb_per_s") is None else f"{row['gb_per_s']:.1f} GB/s"
        print(f"{row['kernel']:<32} {row['calls_per_token']:7.1f} calls {row['ms_per_token']:9.3f} ms/token {row['share']:6.1%} {rate}")
runs = json.load(open(os.path.join(out, "bench.json")))["runs"]
number = lambda x, f: "-" if x is None else format(x, f)
print("| VRAM budget | prefill tok/s | decode tok/s | prefill 512 / decode | roofline | dispatches/token | submits/token | readbacks/token |")
print("|---|---|---|---|---|---|---|---|")
for r in runs:
    print(f"| {r['vram_budget']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.2f} | "
          f"{number(r.get('prefill_512_over_decode'), '.2f')} | {number(r.get('roofline_fraction'), '.1%')} | {number(r.get('gpu_dispatches_per_token'), '.0f')} | "
          f"{number(r.get('gpu_submits_per_token'), '.2f')} | {number(r.get('gpu_readbacks_per_token'), '.2f')} |")
EOF
echo "results in $out/"
