"""Training a small MoE byte-level language model with any recipe: the `jax-qtrain train` and
`jax-qtrain compare` commands, importable as functions.

    from jax_qtrain.train import PRESETS, compare, train
    summary = train(PRESETS["cpu"].replace(recipe="mxfp8", steps=50), "runs/mxfp8")
"""

from jax_qtrain.train.compare import compare, compare_over_seeds
from jax_qtrain.train.config import PRESETS, RECIPE_NAMES, TrainConfig, recipe_for
from jax_qtrain.train.corpus import Corpus, load_corpus
from jax_qtrain.train.model import ModelConfig, Transformer
from jax_qtrain.train.trainer import RunError, RunSummary, read_metrics, restore_model, train

__all__ = [
    "PRESETS",
    "RECIPE_NAMES",
    "Corpus",
    "ModelConfig",
    "RunError",
    "RunSummary",
    "TrainConfig",
    "Transformer",
    "compare",
    "compare_over_seeds",
    "load_corpus",
    "read_metrics",
    "recipe_for",
    "restore_model",
    "train",
]
