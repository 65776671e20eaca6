"""Checkpoints: what a run saves, how it is written so nothing is ever half-written, and how it is
read back without running anyone's code.

    checksums     chunked, parallel file checksums (integrity, not origin)
    durable       atomic folder writes: temporary folder, fsync, meta.json last, rename
    model_folder  a model on disk: model.safetensors + model_config.json
    format        the checkpoint folder: its parts, verify, find the newest usable one, load, rotate
    sharded       FSDP2 shards through torch.distributed.checkpoint (read through safe_pickle)
    safe_pickle   pickles from folders someone else may have made: allow-lists, before any library reads them
    publish       a model folder written into a path the user names, never deleting what is there
    background    host snapshots and the writer thread of background saves
    checkpointer  the Checkpointer the training loop talks to: save, load, best model
"""
