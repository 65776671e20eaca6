#!/usr/bin/env bash
# Ours beside nanoGPT's own train.py on one GPU, plus our 1.0B and a per-kernel breakdown, in one device
# call of under 9 minutes (bench/gpu_compare.py says what each step measures):
#
#     bash bench/gpu_compare.sh --stage              # here, once: nanoGPT into bench/.peers (git-ignored)
#     bash bench/gpu_compare.sh "$OUT"               # on the GPU machine; carry bench/.peers
#     bash bench/gpu_compare.sh --cpu-dry-run [DIR]  # every step with tiny shapes on the CPU (~2 min)
#     bash bench/gpu_compare.sh --followup --best-batch B --baseline FIRST.json "$OUT"   # the shorter second
#                                                    # call: float8, saved tensors, the estimate's CUDA test
#
# Writes gpu_compare.json, readme_lines.md (for bench/README "On an H100") and logs.txt into the folder.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
exec python bench/gpu_compare.py "$@"
