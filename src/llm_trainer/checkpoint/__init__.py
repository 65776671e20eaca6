"""Checkpoints: what a run saves, how it is written so nothing is ever half-written, and how it is
read back without running anyone's code (the file rules themselves: `llm_trainer.files`).

    layout        the files of a checkpoint folder, by name, and the kinds of checkpoint
    verify        checks of a folder we may not have written: meta.json's types, names, links, checksums
    durable       a checkpoint folder written atomically (files.atomic): checksums, fsync, meta.json last;
                  the leftovers of an interrupted save recovered or removed
    model_folder  a model on disk: model.safetensors + model_config.json
    fused_projections  files of the older layout (one q|k|v matrix, one gate|up matrix) cut into today's parts
    tensors       optimizer state split into safetensors and a plain structure, and joined back
    find          which checkpoint a path or "latest" means (the newest usable one)
    reading       a checkpoint held while another process reads it, which a running training's rotation passes over
    local         save, load and rotate checkpoint folders on this machine's disk
    remote        the same checkpoints in a store (training.checkpoint_dir a URL), with the promises they keep on disk
    sharded       FSDP2 shards through torch.distributed.checkpoint (its metadata read through files.safe_pickle)
    publish       a model folder written into a path the user names, never deleting what is there
    background    host snapshots and the writer thread of background saves
    train_state   TrainState: the run's counters a checkpoint saves and a resume restores, train_state.json's schema
    checkpointer  the Checkpointer the training loop talks to: save, load, best model
"""
