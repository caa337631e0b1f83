"""Training configuration: recipes by name, the run's hyper-parameters, and the presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_qtrain.recipes import Recipe, recipe_from_name
from jax_qtrain.train.model import ModelConfig

# "bf16" trains without quantization: every GEMM in bfloat16 with float32 accumulation.
RECIPE_NAMES: tuple[str, ...] = ("bf16", "fp8", "fp8-block", "mxfp8", "nvfp4")


def recipe_for(name: str) -> Recipe | None:
    """The jax_qtrain recipe a `--recipe` name stands for; None for "bf16"."""
    if name not in RECIPE_NAMES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPE_NAMES)}")
    return None if name == "bf16" else recipe_from_name(name)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run's losses (the output directory does not).

    The learning rate warms up linearly from 0 over `warmup_steps`, then follows a cosine down
    to `learning_rate * final_lr_fraction` at `steps`. AdamW (β = 0.9, 0.95), global-norm
    gradient clipping, weight decay on every parameter. `eval_every`, `checkpoint_every`: in
    steps; the last step is always evaluated and checkpointed.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    recipe: str = "bf16"
    steps: int = 120
    batch_size: int = 16
    learning_rate: float = 2e-3
    warmup_steps: int = 12
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip_norm: float = 1.0
    aux_loss_weight: float = 0.01
    seed: int = 0
    eval_every: int = 40
    eval_windows: int = 128
    checkpoint_every: int = 40

    def __post_init__(self):
        recipe_for(self.recipe)
        for name in ("steps", "batch_size", "eval_every", "eval_windows", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in 0..steps-1, got {self.warmup_steps}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        values = dict(values)
        values["model"] = ModelConfig(**values["model"])
        return cls(**values)

    def replace(self, **changes) -> TrainConfig:
        """A copy with some fields changed; model fields may be given by their own names."""
        model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
        model_changes = {k: v for k, v in changes.items() if k in model_fields}
        own_changes = {k: v for k, v in changes.items() if k not in model_fields}
        model = dataclasses.replace(self.model, **model_changes)
        return dataclasses.replace(self, model=model, **own_changes)


PRESETS: dict[str, TrainConfig] = {
    # 15-30 s per recipe on a 2-core CPU (docs/training.md has measured times).
    "cpu": TrainConfig(),
    # One H200: a 4-layer, d_model 512 MoE model on 512-byte windows. 1000 steps: on the H200
    # image's 10 MB corpus (its Python's standard library) 2000 steps were 6.5 epochs, and the
    # validation loss rose from step ~1000 (bf16 0.90 -> 1.12, docs/training.md).
    "h200": TrainConfig(
        model=ModelConfig(
            d_model=512,
            num_layers=4,
            num_heads=8,
            seq_len=512,
            num_experts=8,
            experts_per_token=2,
            expert_hidden=1024,
        ),
        steps=1000,
        batch_size=64,
        learning_rate=1e-3,
        warmup_steps=100,
        eval_every=250,
        eval_windows=256,
        checkpoint_every=250,
    ),
}
