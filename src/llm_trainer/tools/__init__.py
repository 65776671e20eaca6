"""Tools around training, each usable alone; they may use `train/`, the training loop never uses them:

    estimate    `llm-trainer estimate`: parameters, FLOPs and memory of a run, as a report
    layout_advice  the device mesh `estimate --nodes` advises for a cluster: the cheapest that fits
    lr_finder   the learning-rate range test (`llm-trainer lr-find`)
    sweep       hyperparameter sweeps (`llm-trainer sweep`)
    registry    a model registry (`llm-trainer registry`)
    status      `llm-trainer status`: a run folder at a glance

Text generation is `llm_trainer.generate` (beside the model), plots are `train.plots`.
"""
