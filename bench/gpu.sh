#!/usr/bin/env bash
# Issue #17's measurements on a lent GPU, in one device call of under 9 minutes:
#
#     bench/gpu.sh [OUT_DIR]        # OUT_DIR defaults to $OUT (the device machine's) or bench/out/gpu
#
# Each step has its own time limit, so one that hangs or fails leaves the others their time.
# What it writes into OUT_DIR (each file small enough to come back from the device machine):
#   env.json          GPU, driver, torch and the Python packages found
#   tests.log         the GPU-only tests (tests/test_gpu.py: bf16/fp16, GradScaler, pinned saves, exact
#                     resume, KV cache, FlexAttention) and the memory estimate against
#                     max_memory_allocated for six configs (tests/test_estimate_measured.py); all twelve:
#                     `python bench/estimate_check.py --device cuda` (12 fresh CUDA processes, over 2 min)
#   gpt2.json         GPT-2 124M (context 1024, bf16, compile, fused AdamW): tokens/s, MFU, data wait
#   llama1b.json      a 1.0B LLaMA-style model, FSDP2 on one GPU + activation checkpointing: MFU,
#                     peak memory, and `llm-trainer estimate`'s prediction of it
# Not covered: the whole CPU suite (CI runs it), the largest model with CPU offload, float8 through
# torchao, dcp.async_save.
# Data: the built-in python-stdlib corpus (no download; the device machine has no network).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench/out/gpu}}
mkdir -p "$OUT_DIR"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d)

python - > "$OUT_DIR/env.json" <<'EOF'
import importlib.util, json, torch
mods = ["safetensors", "tokenizers", "numpy", "yaml", "tqdm", "transformers", "matplotlib", "torchao", "deepspeed"]
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
                  "packages": {m: importlib.util.find_spec(m) is not None for m in mods}}))
EOF
cat "$OUT_DIR/env.json"

# 1. every test that needs CUDA (they skip on CPU); CI runs the rest
timeout 130 python -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py \
  "tests/test_estimate_measured.py::test_the_estimated_peak_is_within_10_percent_of_the_measured_one[cuda]" \
  tests/test_tools.py::test_peak_memory_prediction_on_gpu_gpt2_small \
  tests/test_speedrun_options.py::test_flex_document_mask_trains_like_the_dense_mask_on_cuda \
  tests/test_profiling.py::test_memory_snapshot_on_cuda_is_written_after_the_profiled_steps \
  tests/test_checkpoint.py::test_checkpoint_from_another_device_loads_on_cpu > "$OUT_DIR/tests.log" 2>&1
tail -3 "$OUT_DIR/tests.log"

summarise() {  # RUN_DIR NAME [estimate.json]: the run's steady-state rows as one JSON object
  python - "$@" <<'EOF'
import json, statistics, sys
run, name = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
train = [r for r in rows if r["kind"] == "train"]
train = train[len(train) // 2:]  # the second half: past compilation and the speed window's warm-up
out = {"name": name, "steps": rows[-1]["step"],
       **{key: statistics.median(r[key] for r in train if r.get(key) is not None)
          if any(r.get(key) is not None for r in train) else None
          for key in ("tokens_per_s", "mfu", "peak_memory_mb", "data_wait_fraction", "step_time_s")},
       "summary": rows[-1]}
if len(sys.argv) > 3:
    estimate = json.load(open(sys.argv[3]))
    out["estimate"] = estimate
print(json.dumps(out))
EOF
}

# 2. GPT-2 124M: bf16, compile, fused AdamW (configs/gpt2-small.yaml), flash attention through SDPA
timeout 180 python -m llm_trainer train --config configs/gpt2-small.yaml training.device=cuda training.max_steps=50 \
  training.gradient_accumulation_steps=1 training.logging_steps=5 training.eval_steps=0 training.save_steps=0 training.eval_max_batches=10 \
  training.output_dir="$WORK/gpt2" data.cache_dir="$WORK/cache" > "$OUT_DIR/gpt2.log" 2>&1 \
  && summarise "$WORK/gpt2" gpt2-124M > "$OUT_DIR/gpt2.json"
tail -2 "$OUT_DIR/gpt2.log"

# 3. ~1.0B LLaMA-style (1,017,526,272 parameters with the 50,257 vocabulary): 2048 wide, 18 layers, 16 heads (4 KV heads), context 2048, FSDP2 on a world of 1
LLAMA=(model.architecture=llama model.d_model=2048 model.n_layers=18 model.n_heads=16 model.n_kv_heads=4
       model.d_ff=5632 model.max_seq_len=2048 training.batch_size=8 training.gradient_checkpointing=true
       training.gradient_accumulation_steps=1)
python -m llm_trainer estimate --config configs/gpt2-small.yaml "${LLAMA[@]}" training.distributed_strategy=fsdp \
  --world-size 1 --json \
  > "$WORK/llama1b_estimate.json" 2> "$OUT_DIR/llama1b.log"
timeout 140 python -m torch.distributed.run --nproc_per_node=1 -m llm_trainer train --config configs/gpt2-small.yaml "${LLAMA[@]}" \
  training.distributed_strategy=fsdp training.device=cuda training.max_steps=40 training.logging_steps=5 \
  training.eval_steps=0 training.save_steps=0 training.eval_max_batches=10 \
  training.output_dir="$WORK/llama1b" data.cache_dir="$WORK/cache" >> "$OUT_DIR/llama1b.log" 2>&1 \
  && summarise "$WORK/llama1b" llama-1.0B "$WORK/llama1b_estimate.json" > "$OUT_DIR/llama1b.json"
tail -2 "$OUT_DIR/llama1b.log"
cat "$OUT_DIR"/*.json
rm -rf "$WORK"
