"""What the processes `warm_launch` starts would import first, imported once by its forkserver (never
by a test) before it forks them, the way llm_trainer imports it."""

import importlib.util

import torch
import torch._dynamo  # noqa: F401  (torch's optimizers import it on first use)

import llm_trainer.cli  # noqa: F401

# DeepSpeed takes about as long to import as torch. It chooses its accelerator once, when imported, so it
# is imported here only where torch has no CUDA (the CPU one is the only one it can choose); a process
# that never uses it is not changed by its being imported.
if importlib.util.find_spec("deepspeed") is not None and not torch.backends.cuda.is_built():
    from llm_trainer.parallel.deepspeed_engine import _import_deepspeed

    _import_deepspeed(torch.device("cpu"))
