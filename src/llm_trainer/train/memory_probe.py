"""The real peak memory of a few training steps, to check `estimate_memory` against.

    python -m llm_trainer.train.memory_probe '{"model": {...}, "training": {...}, "seq_len": 128}'

prints one JSON line: {"peak_bytes", "device", "baseline_bytes"}. `train.batch_size.measure_peak` runs it in a fresh
process, so nothing an earlier measurement allocated (or a test before it) is counted.

What is measured: the Trainer's own loop (`Trainer.train`, `max_steps` steps on random tokens),
from before the model is built to the end of the last step (before the final checkpoint):

* CUDA: `torch.cuda.max_memory_allocated` (what the estimate's `peak` means on a GPU; the CUDA
  context and the allocator's cached-but-free blocks are not in it).
* CPU: the peak resident set size (VmHWM, reset through /proc/self/clear_refs once the data is
  built) minus the resident size just before the model is built. glibc is told to serve every
  allocation of 64 KiB or more with its own mmap (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves the
  resident set at once instead of staying in the heap: resident memory then follows the live tensors,
  as `max_memory_allocated` does on a GPU. One thread (OMP_NUM_THREADS=1): no per-thread scratch
  buffers of other threads. Repeated runs of the same config agree within about 1 MiB.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _probe(spec: dict) -> dict:
    import tempfile

    import torch

    from ..config import ModelConfig, TrainingConfig
    from ..model import Transformer
    from .callbacks import Callback
    from .trainer import Trainer

    torch.set_num_threads(1)
    model_config = ModelConfig(**spec["model"])
    seq_len = spec["seq_len"]
    values = {
        "max_steps": 3,
        "save_steps": 0,
        "eval_steps": 0,
        "report_to": [],
        "progress_bar": False,
        "async_checkpoint": False,
        **spec["training"],
        "output_dir": tempfile.mkdtemp(),
    }
    training = TrainingConfig(**values, logging_steps=values["max_steps"])  # callbacks see the last step
    b = training.batch_size
    tokens = torch.randint(0, model_config.vocab_size, (b * training.max_steps, seq_len + 1))
    batches = [(tokens[i : i + b, :-1], tokens[i : i + b, 1:]) for i in range(0, len(tokens), b)]
    cuda = training.device.startswith("cuda")
    result: dict = {"device": "cuda" if cuda else "cpu"}

    class AtLastStep(Callback):  # the peak of the steps, before the final checkpoint is written
        def on_step_end(self, trainer, row):
            if row["step"] == training.max_steps:
                if cuda:
                    torch.cuda.synchronize()
                    result["peak_bytes"] = torch.cuda.max_memory_allocated()
                else:
                    result["peak_bytes"] = _status_kib("VmHWM") * 1024 - result["baseline_bytes"]

    # A one-step run of a tiny model first: the imports and one-time set-up of every code path the
    # measured run takes (optimizer, autograd, kernels) are then already in the baseline.
    # Its heads: two of 16 dimensions (FlexAttention's least), sharing one key/value head where the model's
    # heads share them, so that the grouped-query path is the one set up.
    grouped = model_config.n_kv_heads is not None and model_config.n_kv_heads < model_config.n_heads
    shape = {"d_model": 32, "n_heads": 2, "n_kv_heads": 1 if grouped else 2, "d_ff": None, "n_layers": 1}
    warm = ModelConfig(**{**spec["model"], **shape, "vocab_size": 64})
    warm_training = TrainingConfig(**{**values, "max_steps": 1, "output_dir": tempfile.mkdtemp()})
    warm_batches = [(t[:, :16] % 64, t[:, 1:17] % 64) for t, _ in batches[:1]]
    Trainer(Transformer(warm), warm_training, train_dataloader=warm_batches).train()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        result["baseline_bytes"] = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current resident size
        result["baseline_bytes"] = _status_kib("VmRSS") * 1024
    torch.manual_seed(0)
    model = Transformer(model_config)
    Trainer(model, training, train_dataloader=batches, callbacks=[AtLastStep()]).train()
    return result


if __name__ == "__main__":
    print(json.dumps(_probe(json.loads(sys.argv[1]))))
