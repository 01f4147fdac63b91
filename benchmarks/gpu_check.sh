#!/usr/bin/env bash
# The CUDA paths in one script, for the day a GPU is lent (under 8 minutes on one GPU): engine exactness against
# dflash and plain greedy decoding (fp32, bf16), replay against exhaustive labelling, the pipeline on the device, the
# labelling throughput benchmark, the SDPA kernel probe, Qwen3-8B-shaped step costs and vLLM's labelling costs, then
# one summary block. The steps, their sizes and the summary are benchmarks/gpu_check.py's (`run`); see its --help.
#
#   bash benchmarks/gpu_check.sh                 # on a GPU machine (cuda): each step in a process of its own
#   bash benchmarks/gpu_check.sh --device cpu    # the same steps on CPU, smaller, in one process (CI's dry run)
#   bash benchmarks/gpu_check.sh --out DIR       # where logs and JSON go (default runs/gpu-check)
#   (any other argument goes to gpu_check.py run, e.g. --steps replay,throughput)
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,10p' "$0"; exit 0 ;; esac
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py run "$@"
