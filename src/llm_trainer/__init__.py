"""llm-trainer: pretrain transformer language models with PyTorch, from raw text to a model others can use."""

from .api import build_loaders, build_model, build_trainer, train
from .config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig
from .config_loader import load_experiment
from .data.prepare import prepare_data
from .hf.interop import save_pretrained
from .model import Transformer
from .train.callbacks import Callback
from .train.trainer import Trainer

# `model.save_pretrained(dir, tokenizer=None, *, overwrite=False)`, the method code written for transformers
# models calls: the folder `llm-trainer export` writes. Attached here, since model.py is the architecture alone.
Transformer.save_pretrained = save_pretrained

__version__ = "0.1.0"
__all__ = [
    "Callback",
    "DataConfig",
    "ExperimentConfig",
    "ModelConfig",
    "TrainingConfig",
    "Trainer",
    "Transformer",
    "build_loaders",
    "build_model",
    "build_trainer",
    "load_experiment",
    "prepare_data",
    "train",
]
