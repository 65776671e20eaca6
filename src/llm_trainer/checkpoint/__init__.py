"""Checkpoints: what a run saves, how it is written so nothing is ever half-written, and how it is
read back without running anyone's code.

    layout        the files of a checkpoint folder, by name, and the kinds of checkpoint
    checksums     chunked, parallel file checksums (integrity, not origin)
    folder_files  the one rule for every file read from a folder we may not have written; reads checked once
    verify        checks of a folder we may not have written: meta.json's types, names, links, checksums
    durable       atomic folder writes: temporary folder, fsync, meta.json last, rename
    model_folder  a model on disk: model.safetensors + model_config.json
    tensors       optimizer state split into safetensors and a plain structure, and joined back
    find          which checkpoint a path or "latest" means (the newest usable one)
    store         save, load and rotate checkpoint folders
    sharded       FSDP2 shards through torch.distributed.checkpoint (its metadata read through safe_pickle)
    safe_pickle   pickles from folders someone else may have made: torch's weights-only unpickler, allow-lists
    publish       a model folder written into a path the user names, never deleting what is there
    background    host snapshots and the writer thread of background saves
    train_state   TrainState: the run's counters a checkpoint saves and a resume restores, train_state.json's schema
    checkpointer  the Checkpointer the training loop talks to: save, load, best model
"""
