"""GNMT (Wu et al. 2016): LSTM encoder-decoder with attention and residual connections,
as a flat list of layers.

Layout follows the GNMT v2 of the MLPerf reference (NVIDIA's PyTorch GNMT):
* encoder: layer 1 bidirectional (forward and backward halves concatenated, 2H wide),
  layer 2 unidirectional 2H -> H, layers 3.. unidirectional with residual connections;
* decoder: layer 1 is an LSTM over the target embeddings whose outputs query a
  normalised Bahdanau attention over the encoder outputs (for all time steps at once:
  no input feeding, so the decoder stays a stack of sequence-wide scans); every later
  decoder layer reads [previous output, attention context] (2H wide); residuals from
  layer 3 on; a softmax projection of the top decoder output ends the model.

Inputs are (src_tokens [B, S], tgt_in_tokens [B, T]) int32, right-padded with `pad_id`;
targets are tgt_out_tokens [B, T] (padding ignored by the loss). Activations between
layers are dicts that carry what later layers need: source tokens (for the attention
mask), target tokens (until the target embedding), encoder outputs beside the decoder
state, and the attention context.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.models.lstm import LSTM
from jaxhybrid.models.spec import (ModelSpec, TokenLoss, TokenMetrics, check_overrides,
                                   dense_init, logical, normal_init, zeros_init)

SIZES = {
    "tiny": dict(vocab_size=32, hidden=16, encoder_layers=4, decoder_layers=4,
                 src_len=8, tgt_len=8, dropout_rate=0.0),
    "small": dict(vocab_size=64, hidden=128, encoder_layers=4, decoder_layers=4,
                  src_len=17, tgt_len=17, dropout_rate=0.1),
    "full": dict(vocab_size=32000, hidden=1024, encoder_layers=8, decoder_layers=8,
                 src_len=50, tgt_len=50, dropout_rate=0.2),
}
DEFAULTS = dict(vocab_size=32000, hidden=1024, encoder_layers=8, decoder_layers=8,
                src_len=50, tgt_len=50, dropout_rate=0.2, pad_id=0, bos_id=1, eos_id=2,
                dtype="float32")


class _Layer(nn.Module):
    hidden: int = 1024
    dropout_rate: float = 0.2
    dtype: Any = jnp.float32

    def drop(self, x, train):
        return nn.Dropout(self.dropout_rate, deterministic=not train)(x)


class SourceEmbed(_Layer):
    """(src, tgt_in) -> {"src", "tgt", "x": source embeddings}."""
    vocab_size: int = 32000

    @nn.compact
    def __call__(self, x, train: bool = False):
        src, tgt = x
        emb = nn.Embed(self.vocab_size, self.hidden, dtype=self.dtype,
                       embedding_init=normal_init(0.1, "vocab", "embed"))(src)
        return {"src": src, "tgt": tgt, "x": emb}


class EncoderLayer(_Layer):
    """One encoder LSTM layer; layer 0 is bidirectional, residual from `residual` on."""
    bidirectional: bool = False
    residual: bool = False
    pad_id: int = 0

    @nn.compact
    def __call__(self, x, train: bool = False):
        mask = x["src"] != self.pad_id
        h = self.drop(x["x"], train)
        y = LSTM(self.hidden, dtype=self.dtype)(h, mask)
        if self.bidirectional:
            y = jnp.concatenate([y, LSTM(self.hidden, reverse=True, dtype=self.dtype)(h, mask)],
                                -1)
        if self.residual:
            y = y + x["x"]
        return {**x, "x": y}


class TargetEmbed(_Layer):
    """-> {"src", "enc": encoder outputs, "x": target embeddings}."""
    vocab_size: int = 32000

    @nn.compact
    def __call__(self, x, train: bool = False):
        emb = nn.Embed(self.vocab_size, self.hidden, dtype=self.dtype,
                       embedding_init=normal_init(0.1, "vocab", "embed"))(x["tgt"])
        return {"src": x["src"], "enc": x["x"], "x": emb}


def _symmetric_uniform(scale: float):
    # nn.initializers.uniform(s) draws from [0, s): an all-positive attention vector.
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -scale, scale)
    return init


class BahdanauAttention(nn.Module):
    """Normalised additive attention: score = g * v/|v| . tanh(Wq q + Wk k + b)."""
    attention_dim: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, query, keys, key_mask):
        A, cd = self.attention_dim, self.dtype
        q = nn.Dense(A, use_bias=False, dtype=cd, name="query",
                     kernel_init=dense_init("lstm_hidden", "attention"))(query)
        k = nn.Dense(A, use_bias=False, dtype=cd, name="key",
                     kernel_init=dense_init("lstm_hidden", "attention"))(keys)
        b = self.param("bias", zeros_init("attention"), (A,))
        v = self.param("v", logical(_symmetric_uniform(1 / np.sqrt(A)), "attention"), (A,))
        g = self.param("g", logical(nn.initializers.constant(1 / np.sqrt(A))), ())
        v = (g * v / jnp.linalg.norm(v)).astype(cd)
        hidden = jnp.tanh(q[:, :, None, :] + k[:, None, :, :] + b.astype(cd))   # [B,T,S,A]
        scores = jnp.einsum("btsa,a->bts", hidden, v).astype(jnp.float32)
        scores = jnp.where(key_mask[:, None, :], scores, -1e9)
        weights = jax.nn.softmax(scores, axis=-1).astype(cd)
        return jnp.einsum("bts,bsh->bth", weights, keys.astype(cd))


class AttentionDecoderLayer(_Layer):
    """Decoder layer 1 + attention -> {"x": decoder outputs, "ctx": attention context}."""
    pad_id: int = 0

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = LSTM(self.hidden, dtype=self.dtype)(self.drop(x["x"], train))
        ctx = BahdanauAttention(self.hidden, self.dtype)(y, x["enc"], x["src"] != self.pad_id)
        return {"x": y, "ctx": ctx}


class DecoderLayer(_Layer):
    """Decoder layers 2..: LSTM over [x, ctx], residual from layer 3 on."""
    residual: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = self.drop(jnp.concatenate([x["x"], x["ctx"].astype(x["x"].dtype)], -1), train)
        y = LSTM(self.hidden, dtype=self.dtype)(h)
        if self.residual:
            y = y + x["x"]
        return {"x": y, "ctx": x["ctx"]}


class Softmax(_Layer):
    """Top decoder output -> vocabulary logits [B, T, V] (float32)."""
    vocab_size: int = 32000

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = self.drop(x["x"], train)
        return nn.Dense(self.vocab_size, dtype=self.dtype,
                        kernel_init=dense_init("embed", "vocab"),
                        bias_init=zeros_init("vocab"))(h).astype(jnp.float32)


def make_layers(cfg: dict) -> list[nn.Module]:
    c = dict(hidden=cfg["hidden"], dropout_rate=cfg["dropout_rate"],
             dtype=jnp.dtype(cfg["dtype"]))
    layers = [SourceEmbed(vocab_size=cfg["vocab_size"], **c)]
    for i in range(cfg["encoder_layers"]):
        layers.append(EncoderLayer(bidirectional=i == 0, residual=i >= 2,
                                   pad_id=cfg["pad_id"], **c))
    layers.append(TargetEmbed(vocab_size=cfg["vocab_size"], **c))
    layers.append(AttentionDecoderLayer(pad_id=cfg["pad_id"], **c))
    for i in range(1, cfg["decoder_layers"]):
        layers.append(DecoderLayer(residual=i >= 2, **c))
    layers.append(Softmax(vocab_size=cfg["vocab_size"], **c))
    return layers


def _random_tokens(r, cfg, batch_size, length):
    """Right-padded random sequences: tokens after the specials, random lengths >= 1."""
    first = max(cfg["pad_id"], cfg["bos_id"], cfg["eos_id"]) + 1
    tokens = r.randint(first, cfg["vocab_size"], size=(batch_size, length))
    lengths = r.randint(1, length + 1, size=(batch_size, 1))
    return np.where(np.arange(length) < lengths, tokens, cfg["pad_id"]).astype(np.int32)


def _sample_batch(cfg, batch_size: int, seed: int = 0):
    r = np.random.RandomState(seed)
    src = _random_tokens(r, cfg, batch_size, cfg["src_len"])
    tgt_out = _random_tokens(r, cfg, batch_size, cfg["tgt_len"])
    bos = np.full((batch_size, 1), cfg["bos_id"], np.int32)
    tgt_in = np.concatenate([bos, tgt_out[:, :-1]], 1)
    return (src, tgt_in), tgt_out


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("gnmt", DEFAULTS, {**SIZES[size], **overrides})
    if cfg["encoder_layers"] < 2 or cfg["decoder_layers"] < 1:
        raise ValueError("gnmt: needs encoder_layers >= 2 (bidirectional + one "
                         "unidirectional) and decoder_layers >= 1.")
    return ModelSpec(name="gnmt", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=TokenLoss(cfg["pad_id"]), metrics_fn=TokenMetrics(cfg["pad_id"]),
                     task="translation", sample_batch=functools.partial(_sample_batch, cfg))
