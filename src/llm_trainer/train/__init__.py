"""The training loop and what it is made of, one module each:

    trainer         the Trainer: `Trainer.from_config` (the one way from a config), setup, then the loop
    step            one optimizer step over its micro-batches (shared with the LR finder)
    stop            StopControl: signals, early stopping and the reason the loop ends
    batches         any iterable of batches as the loader interface the loop reads
    batch_size      `batch_size: auto`: the largest micro-batch that fits, estimated then measured once
    memory_estimate  the memory one training step takes, counted from the config
    memory_probe    the measured peak of a few real steps, in a fresh process (checks the estimate)
    optim muon      the optimizer (AdamW, Muon) and the learning-rate schedule
    evaluate        validation loss and perplexity
    speed           tokens/s, step time, data wait, MFU
    flops           parameter and FLOP counts, device peak FLOP/s
    spikes          the loss-spike monitor (warn, skip, rewind)
    profiling       profiler traces, allocator snapshots, out-of-memory reports
    layer_stats     per-block gradient/weight/update norms and histograms
    alerts          webhook/SMTP/W&B alerts, the stall watchdog, throughput and data-wait checks
    rows            the metric rows, one type per kind
    metrics         metric backends (console, jsonl, TensorBoard, W&B, MLflow)
    output_folder   the run folder: refuse to land on an old run, start over, URL output_dir, RunFilesAtStart
    run_lock        one run per output folder
    plots           PNG plots of runs' metrics (PlotsAtEnd: the run's own, when it ends)
    callbacks       hooks into the loop (below the Trainer: they name it in words only)

The counters a resume restores (TrainState) live in `checkpoint.train_state`. Nothing here imports
`llm_trainer.tools`.
"""
