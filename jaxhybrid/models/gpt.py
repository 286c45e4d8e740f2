"""GPT (Radford et al. 2019): a pre-LayerNorm transformer decoder with causal attention
and learned positions, as a flat list of layers: embedding (tokens + positions), one
layer per block, final LayerNorm + vocabulary head.

Full size is GPT-2 small: 12 layers, d_model 768, 12 heads, 1024 positions, vocab
50257; parameter shapes match GPT-2's, so with a tied head the count is GPT-2's
124,439,808.

Tying. A pipeline stores parameters per layer, so the first layer's embedding and the
last layer's head cannot share one matrix across layers (and carrying the matrix in the
activation would send V x D floats over every stage boundary). Hence:
* `tied=False` (default): separate head matrix (+38.6M params at full size); the model
  is the flat list above, ready for pipelining.
* `tied=True`: the head reuses the embedding matrix, which keeps the whole model in ONE
  layer (`TiedGPT`): use it for data parallelism only (pipe=1) — or give the pipeline
  the whole model as one module (`GPT`, `models.module("gpt", tied=True)`), which the
  splitter cuts, holding the tied matrix in both the first and the last stage.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid import tensor_parallel
from jaxhybrid.models.spec import (ModelSpec, TokenLoss, TokenMetrics, check_overrides,
                                   normal_init, ones_init, zeros_init)

SIZES = {
    "tiny": dict(vocab_size=257, num_layers=2, d_model=32, num_heads=2, seq_len=16,
                 max_positions=64, dropout_rate=0.0, pad_id=256),
    "small": dict(vocab_size=257, num_layers=4, d_model=128, num_heads=4, seq_len=128,
                  max_positions=256, dropout_rate=0.1, pad_id=256),
    "full": dict(vocab_size=50257, num_layers=12, d_model=768, num_heads=12, seq_len=1024,
                 max_positions=1024, dropout_rate=0.1, pad_id=None),
}
DEFAULTS = dict(vocab_size=50257, num_layers=12, d_model=768, num_heads=12, seq_len=1024,
                max_positions=1024, dropout_rate=0.1, pad_id=None, tied=False,
                dtype="float32")
INIT_STD = 0.02          # GPT-2's initialiser


def _layer_norm(dtype, name=None):
    return nn.LayerNorm(epsilon=1e-5, dtype=dtype, name=name,
                        scale_init=ones_init("embed"), bias_init=zeros_init("embed"))


class Embedding(nn.Module):
    """tokens [B, T] -> token + position embeddings [B, T, D], dropout."""
    vocab_size: int
    d_model: int
    max_positions: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    def setup(self):
        self.wte = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype,
                            embedding_init=normal_init(INIT_STD, "vocab", "embed"))
        self.wpe = self.param("wpe", normal_init(0.01, "positions", "embed"),
                              (self.max_positions, self.d_model))
        self.dropout = nn.Dropout(self.dropout_rate)

    def __call__(self, tokens, train: bool = False):
        T = tokens.shape[1]
        if T > self.max_positions:   # else "Incompatible shapes for broadcasting"
            raise ValueError(f"GPT: sequences of {T} tokens, but the model has "
                             f"max_positions={self.max_positions}; use shorter sequences "
                             f"(data.options.seq_len <= {self.max_positions}) or more "
                             f"positions (the model's max_positions).")
        x = self.wte(tokens) + self.wpe[:T].astype(self.dtype)
        return self.dropout(x, deterministic=not train)

    def attend(self, x):
        """Logits against the embedding matrix (the tied head)."""
        return self.wte.attend(x)


class RowParallel(nn.Module):
    """y = sum over the contracted trailing `axes` of x and the kernel, + bias, with the
    kernel's first contracted dimension split over "model" (Megatron's row-parallel
    layer): each shard's partial product is summed over the model group before the
    (replicated) bias is added once. The parameters are nn.Dense / nn.DenseGeneral's
    ("kernel" [*contracted, features], "bias" [features]); at model degree 1 it is one."""
    features: int
    axes: int
    kernel_init: Any
    bias_init: Any
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (*x.shape[-self.axes:], self.features))
        bias = self.param("bias", self.bias_init, (self.features,))
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        dims = tuple(range(x.ndim - self.axes, x.ndim))
        y = jax.lax.dot_general(x, kernel, ((dims, tuple(range(self.axes))), ((), ())))
        return tensor_parallel.reduce_from_model(y) + bias


class Block(nn.Module):
    """x + attn(LN(x)); x + mlp(LN(x)) with causal multi-head self-attention.

    Tensor parallel over "model" (Megatron): the heads ("heads") and the MLP hidden
    width ("mlp") are split; c_attn and c_fc are column-parallel, c_proj and mlp_proj
    row-parallel (`RowParallel`), the LayerNorms replicated."""
    num_heads: int
    num_layers: int = 12
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        B, T, D = x.shape
        H, cd = tensor_parallel.local(self.num_heads, "num_heads"), self.dtype
        hd = D // self.num_heads
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * num_layers).
        proj_std = INIT_STD / np.sqrt(2 * self.num_layers)
        drop = lambda y: nn.Dropout(self.dropout_rate, deterministic=not train)(y)

        h = tensor_parallel.copy_to_model(_layer_norm(cd, "ln_1")(x))
        qkv = nn.DenseGeneral((3, H, hd), dtype=cd, name="c_attn",
                              kernel_init=normal_init(INIT_STD, "embed", "qkv", "heads", "kv"),
                              bias_init=zeros_init("qkv", "heads", "kv"))(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]           # [B, T, H, hd]
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        a = RowParallel(D, 2, normal_init(proj_std, "heads", "kv", "embed"),
                        zeros_init("embed"), cd, name="c_proj")(a)
        x = x + drop(a)

        h = tensor_parallel.copy_to_model(_layer_norm(cd, "ln_2")(x))
        h = nn.Dense(tensor_parallel.local(4 * D, "mlp width"), dtype=cd, name="c_fc",
                     kernel_init=normal_init(INIT_STD, "embed", "mlp"),
                     bias_init=zeros_init("mlp"))(h)
        h = RowParallel(D, 1, normal_init(proj_std, "mlp", "embed"), zeros_init("embed"), cd,
                        name="mlp_proj")(nn.gelu(h, approximate=True))
        return x + drop(h)


class Head(nn.Module):
    """Final LayerNorm -> vocabulary logits [B, T, V] (float32), untied, no bias (GPT-2)."""
    vocab_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        h = _layer_norm(self.dtype, "ln_f")(x)
        return nn.Dense(self.vocab_size, use_bias=False, dtype=self.dtype, name="lm_head",
                        kernel_init=normal_init(INIT_STD, "embed", "vocab"))(h).astype(
                            jnp.float32)


class GPT(nn.Module):
    """The whole model as one module (for `jp.Pipeline(model)` / config `model.module`,
    whose splitter cuts it into stages); with cfg["tied"] the head is the embedding
    matrix transposed, else the untied `Head`."""
    cfg: dict

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        c, dtype = self.cfg, jnp.dtype(self.cfg["dtype"])
        emb = Embedding(c["vocab_size"], c["d_model"], c["max_positions"], c["dropout_rate"],
                        dtype, name="embedding")
        x = emb(tokens, train)
        for i in range(c["num_layers"]):
            x = Block(c["num_heads"], c["num_layers"], c["dropout_rate"], dtype,
                      name=f"block_{i}")(x, train)
        if not c["tied"]:
            return Head(c["vocab_size"], dtype, name="head")(x)
        return emb.attend(_layer_norm(dtype, "ln_f")(x)).astype(jnp.float32)


TiedGPT = GPT   # the tied model as the one layer of a list (data parallelism only)


def make_layers(cfg: dict) -> list[nn.Module]:
    if cfg["tied"]:
        return [GPT(cfg)]
    dtype = jnp.dtype(cfg["dtype"])
    return [Embedding(cfg["vocab_size"], cfg["d_model"], cfg["max_positions"],
                      cfg["dropout_rate"], dtype),
            *[Block(cfg["num_heads"], cfg["num_layers"], cfg["dropout_rate"], dtype)
              for _ in range(cfg["num_layers"])],
            Head(cfg["vocab_size"], dtype)]


def _sample_batch(cfg, batch_size: int, seed: int = 0):
    r = np.random.RandomState(seed)
    high = cfg["vocab_size"] if cfg["pad_id"] is None else cfg["pad_id"]
    seq = r.randint(0, high, size=(batch_size, cfg["seq_len"] + 1)).astype(np.int32)
    return seq[:, :-1], seq[:, 1:]


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("gpt", DEFAULTS, {**SIZES[size], **overrides})
    if cfg["d_model"] % cfg["num_heads"]:
        raise ValueError(f"gpt: d_model={cfg['d_model']} must be divisible by "
                         f"num_heads={cfg['num_heads']}.")
    if cfg["seq_len"] > cfg["max_positions"]:
        raise ValueError(f"gpt: seq_len={cfg['seq_len']} exceeds max_positions="
                         f"{cfg['max_positions']}.")
    return ModelSpec(name="gpt", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=TokenLoss(cfg["pad_id"]), metrics_fn=TokenMetrics(cfg["pad_id"]),
                     task="language_model", sample_batch=functools.partial(_sample_batch, cfg))
