"""How one model trains on many devices: the process group (from the launcher's environment, which
`llm_trainer.launcher` reads), and the wrappers (DDP, FSDP2, DeepSpeed, activation checkpointing,
compile) applied from outside the model."""
