"""Tools around training, each usable alone: generate text, estimate memory and FLOPs, plot runs,
find a learning rate, sweep hyperparameters, keep a model registry. They may use `train/`; the
training loop never uses them."""
