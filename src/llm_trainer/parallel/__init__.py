"""How one model trains on many devices, applied from outside the model:

distributed       the process group (from the launcher's environment, which `llm_trainer.launcher` reads),
                  all-reduce and barrier helpers that are no-ops in one process
mesh              the mesh's degrees (data replicate/shard, tensor, pipeline, context): settings checked, one layout
parallelize       the fixed order every run takes: float8 -> tensor parallelism -> activation checkpointing ->
                  compile -> DDP/FSDP2 -> the optimizer
tensor_parallel   the tensor (and sequence) parallel plan of our blocks on DTensor
pipeline_parallel  the model cut into stages by layer, run by a torch.distributed.pipelining schedule
context_parallel  each rank's share of every row's positions, with PyTorch's ring attention during the step
grad_norm         the gradient norm and its clipping over parameters on several device meshes
float8            training.float8 through torchao's float8 linear layers, refused where the GPU lacks it
attention_kernel  training.sdpa_backend: the SDPA kernel checked at setup and held around the loop
strategies        Parallelism and its DDP, FSDP, Pipeline and DeepSpeed strategies: the loop's only view of a backend
deepspeed_engine  DeepSpeed's engine built from our config, and its checkpoint files read safely
"""
