"""How one model trains on many devices: the launcher's environment, the process group, and the
wrappers (DDP, FSDP2, DeepSpeed, activation checkpointing, compile) applied from outside the model."""
