"""llm-trainer: pretrain transformer language models with PyTorch, from raw text to a model others can use."""

from .api import build_loaders, build_model, build_trainer, train
from .config import DataConfig, ExperimentConfig, ModelConfig, TrainingConfig, load_experiment
from .data.prepare import prepare_data
from .model import Transformer
from .train.callbacks import Callback
from .train.trainer import Trainer

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
