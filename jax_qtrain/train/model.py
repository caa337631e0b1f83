"""A small decoder-only byte-level transformer whose feed-forward layers are pluggable.

    embed (tied with the output head, high precision) + learned positions
    num_layers × [ RMSNorm → causal self-attention → +  ;  RMSNorm → feed-forward → + ]
    RMSNorm → logits = h · embeddingᵀ

The attention's query/key/value and output projections and every feed-forward GEMM are
`jax_qtrain.nn` layers without a recipe of their own, so they quantize with whatever
`jax_qtrain.autocast` is active when the model runs (none: high precision; the last
`ModelConfig.high_precision_layers` blocks always run without). The attention
score and value products, the norms, the softmax, the MoE router and the output head stay in
high precision, as in TransformerEngine.

A feed-forward block maps (batch, seq, d_model) to the same shape plus an auxiliary loss (the
MoE load-balancing loss; 0 for a dense block) and is built by `build_feed_forward` from
`ModelConfig.feed_forward`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from jax_qtrain import nn as qnn
from jax_qtrain.ops.context import autocast
from jax_qtrain.train.corpus import VOCAB_SIZE

FeedForwardKind = Literal["moe", "dense"]
FEED_FORWARD_KINDS: tuple[str, ...] = ("moe", "dense")
AttentionKind = Literal["auto", "plain", "cudnn"]
ATTENTION_KINDS: tuple[str, ...] = ("auto", "plain", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of the model. `compute_dtype` is what the GEMMs see; parameters are float32."""

    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 64
    feed_forward: FeedForwardKind = "moe"
    num_experts: int = 4
    experts_per_token: int = 2
    expert_hidden: int = 128
    compute_dtype: str = "bfloat16"
    vocab_size: int = VOCAB_SIZE
    # Run the blocks as one `lax.scan` over their stacked parameters: one copy of each layer's
    # kernels and GEMMs in the compiled step, not num_layers (same parameters and values). Off
    # by default: it compiles 2-3x faster but steps slower, ~11 ms on the H200 at the h200
    # preset (docs/benchmarks.md, run E) and 5-30% on the CPU.
    scan_layers: bool = False
    # Keep only q, k and v for the attention's backward and recompute the scores and softmax
    # there, instead of saving (batch, heads, seq, seq) arrays (the probabilities in float32
    # and in the compute dtype, and more; in the h200 preset's scanned step 3 GB of them are
    # stacked across layers and zero-filled first: docs/benchmarks.md, stop 26). The same
    # values either way; off by default because the recomputation costs more than the saved
    # traffic: ~1 ms (3%) slower a step on the H200 at the h200 preset (stop 27).
    recompute_attention: bool = False
    # The attention core: "plain" is `_causal_attention` below (scores, mask and softmax as
    # separate XLA ops); "cudnn" is cuDNN's fused flash attention through
    # `jax.nn.dot_product_attention` (CUDA GPUs, 16-bit compute dtypes); "auto" takes cudnn
    # where it applies (`attention_implementation`) and plain elsewhere, so CPU runs are the
    # same with either of "auto" and "plain".
    attention: AttentionKind = "auto"
    # How many of the last decoder blocks compute without quantization (`autocast(None)`: their
    # GEMMs in `compute_dtype`) whatever the run's recipe: NVIDIA's NVFP4 pretraining recipe
    # keeps a few numerically sensitive layers, chiefly the final blocks, in high precision
    # ("selective high-precision layers", arXiv 2509.25149). 0 (the default) quantizes every
    # block; with scan_layers the quantized and the high-precision blocks are two scans.
    high_precision_layers: int = 0

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by {self.num_heads} heads")
        if self.feed_forward not in FEED_FORWARD_KINDS:
            raise ValueError(
                f"feed_forward must be one of {list(FEED_FORWARD_KINDS)}, got {self.feed_forward!r}"
            )
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in 1..num_experts ({self.num_experts}), "
                f"got {self.experts_per_token}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"attention must be one of {list(ATTENTION_KINDS)}, got {self.attention!r}"
            )
        jnp.dtype(self.compute_dtype)  # raises on an unknown dtype name
        for name in ("scan_layers", "recompute_attention"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if (
            isinstance(self.high_precision_layers, bool)
            or not isinstance(self.high_precision_layers, int)
            or not 0 <= self.high_precision_layers <= self.num_layers
        ):
            raise ValueError(
                f"high_precision_layers must be an int in 0..num_layers ({self.num_layers}), "
                f"got {self.high_precision_layers!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)


class FeedForward(Protocol):
    """The call convention of `jax_qtrain.nn.MoE`."""

    def __call__(self, x: jax.Array, *, return_aux_loss: bool) -> jax.Array | tuple:
        """(batch, seq, d_model) → same shape, and the auxiliary loss with return_aux_loss."""
        ...


class DenseFeedForward(nnx.Module):
    """SwiGLU with `expert_hidden` units, down(silu(gate(x)) · up(x)); auxiliary loss 0.

    The dense baseline for `feed_forward="dense"`, with MoE's call convention.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d, hidden = config.d_model, config.expert_hidden
        linear = dict(use_bias=False, dtype=config.dtype, param_dtype=jnp.float32, rngs=rngs)
        self.gate_up = qnn.Linear(d, 2 * hidden, **linear)
        self.down = qnn.Linear(hidden, d, **linear)

    def __call__(self, x: jax.Array, *, return_aux_loss: bool = False):
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        y = self.down(jax.nn.silu(gate) * up)
        return (y, jnp.zeros((), jnp.float32)) if return_aux_loss else y


def build_feed_forward(config: ModelConfig, rngs: nnx.Rngs) -> FeedForward:
    """`jax_qtrain.nn.MoE` (top-k routed SwiGLU experts on grouped GEMMs; the router stays in
    float32) or the dense SwiGLU block. The load-balancing loss is returned unscaled
    (coefficient 1: 1.0 means perfectly uniform routing); the trainer weights it."""
    if config.feed_forward == "dense":
        return DenseFeedForward(config, rngs)
    return qnn.MoE(
        config.d_model,
        config.expert_hidden,
        config.num_experts,
        top_k=config.experts_per_token,
        activation="swiglu",
        aux_loss_coef=1.0,
        dtype=config.dtype,
        param_dtype=jnp.float32,
        rngs=rngs,
    )


def cudnn_attention_applies(config: ModelConfig) -> bool:
    """Whether cuDNN's fused attention can run `config`'s attention here: a CUDA backend, a
    16-bit compute dtype and a head size cuDNN's flash attention takes (a multiple of 8, at
    most 128)."""
    return (
        jax.default_backend() == "gpu"
        and config.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and config.head_dim % 8 == 0
        and config.head_dim <= 128
    )


def attention_implementation(config: ModelConfig) -> Literal["plain", "cudnn"]:
    """The attention core `config.attention` runs on this backend ("auto" resolved)."""
    if config.attention == "auto":
        return "cudnn" if cudnn_attention_applies(config) else "plain"
    if config.attention == "cudnn" and not cudnn_attention_applies(config):
        raise ValueError(
            "attention='cudnn' needs a CUDA GPU, compute_dtype bfloat16 or float16 and a head "
            f"size that is a multiple of 8 up to 128; here: backend {jax.default_backend()!r}, "
            f"compute_dtype {config.compute_dtype}, head size {config.head_dim}. Use "
            "attention='auto' (cuDNN where it applies) or 'plain'"
        )
    return config.attention


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        d = config.d_model
        linear = dict(use_bias=False, dtype=config.dtype, param_dtype=jnp.float32, rngs=rngs)
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = qnn.Linear(d, 3 * d, **linear)
        self.out = qnn.Linear(d, d, **linear)
        self.recompute = config.recompute_attention
        self.implementation = attention_implementation(config)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        qkv = self.qkv(x).reshape(batch, seq, 3, self.num_heads, self.head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        attend = _cudnn_causal_attention if self.implementation == "cudnn" else _causal_attention
        if self.recompute:
            attend = jax.checkpoint(attend)
        return self.out(attend(q, k, v).reshape(batch, seq, d))


def _cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`_causal_attention` as one cuDNN flash-attention kernel (and one for its backward):
    the (batch, heads, seq, seq) scores never reach memory."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(q·kᵀ / √head_dim, causal) · v for (batch, seq, heads, head_dim) q, k, v; scores
    and softmax in float32, the value product in v's dtype."""
    seq, head_dim = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(head_dim))
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.attention_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.attention = CausalSelfAttention(config, rngs)
        self.feed_forward_norm = nnx.RMSNorm(config.d_model, rngs=rngs)
        self.feed_forward = build_feed_forward(config, rngs)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x + self.attention(self.attention_norm(x).astype(x.dtype))
        update, aux_loss = self.feed_forward(
            self.feed_forward_norm(x).astype(x.dtype), return_aux_loss=True
        )
        return x + update.astype(x.dtype), aux_loss


class Transformer(nnx.Module):
    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(config.vocab_size, config.d_model, embedding_init=init, rngs=rngs)
        self.positions = nnx.Param(init(rngs.params(), (config.seq_len, config.d_model)))
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """tokens (batch, seq) int → (float32 logits (batch, seq, vocab), summed aux loss)."""
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.positions[...][:seq]
        x = x.astype(self.config.dtype)
        aux_loss = jnp.zeros((), jnp.float32)
        quantized = len(self.blocks) - self.config.high_precision_layers
        x, aux_loss = self._run_blocks(self.blocks[:quantized], x, aux_loss)
        if self.config.high_precision_layers:
            with autocast(None):
                x, aux_loss = self._run_blocks(self.blocks[quantized:], x, aux_loss)
        h = self.final_norm(x.astype(jnp.float32))
        logits = h @ self.embed.embedding[...].T
        return logits, aux_loss

    def _run_blocks(
        self, blocks: Sequence[Block], x: jax.Array, aux_loss: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """`blocks` one after the other, their aux losses added to `aux_loss` in order."""
        if self.config.scan_layers and len(blocks) > 1:
            return self._scanned_blocks(blocks, x, aux_loss)
        for block in blocks:
            x, block_aux = block(x)
            aux_loss = aux_loss + block_aux
        return x, aux_loss

    def _scanned_blocks(
        self, blocks: Sequence[Block], x: jax.Array, aux_loss: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """`blocks` as one `lax.scan` over their states stacked on a leading layer axis.

        The parameters stay one module per layer (checkpoints and `model.blocks[i]` unchanged);
        the stack is built in the call, and its gradient is sliced back per layer. What a block
        sows (the MoE's `nnx.Intermediate` statistics) comes out stacked and is written back to
        each block, as the loop would have left it.
        """
        graphdef = nnx.graphdef(blocks[0])  # every block has the same structure
        states = [nnx.state(block) for block in blocks]
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

        def layer(x, state):
            block = nnx.merge(graphdef, state)
            x, aux_loss = block(x)
            return x, (aux_loss, nnx.state(block, nnx.Intermediate))

        x, (aux_losses, intermediates) = jax.lax.scan(layer, x, stacked)
        for i, block in enumerate(blocks):
            nnx.update(block, jax.tree.map(lambda leaf, i=i: leaf[i], intermediates))
        for i in range(len(blocks)):  # summed in the loop's order
            aux_loss = aux_loss + aux_losses[i]
        return x, aux_loss


def count_parameters(model: nnx.Module) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
