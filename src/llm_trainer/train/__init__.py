"""The training loop and what it is made of, one module each:

    trainer     the Trainer: setup, then the loop, top to bottom
    step        one optimizer step over its micro-batches (shared with the LR finder)
    state       TrainState: the counters a resume restores
    stop        StopControl: signals, early stopping and the reason the loop ends
    batches     any iterable of batches as the loader interface the loop reads
    optim       the optimizer and the learning-rate schedule
    evaluate    validation loss and perplexity
    speed       tokens/s, step time, data wait, MFU
    flops       parameter and FLOP counts, device peak FLOP/s
    rows        the metric rows, one type per kind
    metrics     metric backends (console, jsonl, TensorBoard, W&B, MLflow)
    callbacks   hooks into the loop

Nothing here imports `llm_trainer.tools`.
"""
