"""BigLSTM (Jozefowicz et al. 2016, "Exploring the limits of language modeling"):
an LSTM language model with projection (LSTMP), as a flat list of layers:
embedding, one layer per LSTMP layer, softmax.

Full size is the paper's 2-layer LSTM-8192-1024 on the One Billion Word vocabulary
(793,471 words): 8192 cells per layer projected to 1024, 1024-wide embeddings.

Softmax: full by default. `num_sampled=K > 0` switches *training* to sampled softmax
(Jean et al. 2015): per step K negative classes are drawn with replacement from a
log-uniform (Zipfian) distribution — right when token ids are sorted by decreasing
frequency, as in the 1B-word vocabulary — and the logits are corrected by subtracting
log(expected count) (Bengio & Senecal 2008); samples that hit the true class are
masked. Evaluation (train=False) always uses the full softmax. The head needs the
targets, so with `num_sampled > 0` the model's inputs are (tokens, targets) and the
targets travel beside the activations ({"x": ..., "targets": ...}); the training
output is {"logits": [B, T, 1 + K], "labels": zeros} (the true class is column 0),
which `loss_fn` understands. Sampling draws from the "dropout" rng, so training with
sampled softmax needs an rng (the pipeline passes one per microbatch and layer).
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
                                   normal_init, zeros_init)

SIZES = {
    "tiny": dict(vocab_size=257, hidden=32, projection=16, num_layers=2, seq_len=16,
                 dropout_rate=0.0, pad_id=256),
    "small": dict(vocab_size=257, hidden=512, projection=128, num_layers=2, seq_len=64,
                  dropout_rate=0.1, pad_id=256),
    "full": dict(vocab_size=793471, hidden=8192, projection=1024, num_layers=2, seq_len=20,
                 dropout_rate=0.25, pad_id=None),
}
DEFAULTS = dict(vocab_size=793471, hidden=8192, projection=1024, num_layers=2, seq_len=20,
                dropout_rate=0.25, pad_id=None, num_sampled=0, dtype="float32")


def _split(x):
    return (x["x"], x["targets"]) if isinstance(x, dict) else (x, None)


def _join(y, targets):
    return y if targets is None else {"x": y, "targets": targets}


class Embedding(nn.Module):
    """tokens [B, T] (or (tokens, targets)) -> embeddings [B, T, projection]."""
    vocab_size: int
    features: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        tokens, targets = x if isinstance(x, tuple) else (x, None)
        y = nn.Embed(self.vocab_size, self.features, dtype=self.dtype,
                     embedding_init=normal_init(1.0, "vocab", "embed"))(tokens)
        return _join(nn.Dropout(self.dropout_rate, deterministic=not train)(y), targets)


class LSTMPLayer(nn.Module):
    """LSTM with projection over the sequence, dropout on its output."""
    hidden: int
    projection: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        h, targets = _split(x)
        y = LSTM(self.hidden, self.projection, dtype=self.dtype)(h)
        return _join(nn.Dropout(self.dropout_rate, deterministic=not train)(y), targets)


def log_uniform_log_prob(ids, vocab_size: int):
    """log P(id) under the log-uniform (Zipfian) sampler over [0, vocab_size)."""
    ids = ids.astype(jnp.float32)
    return jnp.log(jnp.log1p(1.0 / (ids + 1.0)) / np.log(vocab_size + 1.0))


def sample_log_uniform(key, num: int, vocab_size: int):
    """`num` ids drawn with replacement, P(k) = log((k+2)/(k+1)) / log(V+1)."""
    u = jax.random.uniform(key, (num,))
    ids = jnp.floor(jnp.exp(u * np.log(vocab_size + 1.0))).astype(jnp.int32) - 1
    return jnp.clip(ids, 0, vocab_size - 1)


class SoftmaxHead(nn.Module):
    """[B, T, P] -> logits [B, T, V]; sampled softmax in training if num_sampled > 0."""
    vocab_size: int
    num_sampled: int = 0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        h, targets = _split(x)
        # [V, P] like the embedding, so sampled rows are a gather of contiguous rows.
        w = self.param("kernel", normal_init(h.shape[-1] ** -0.5, "vocab", "embed"),
                       (self.vocab_size, h.shape[-1]))
        b = self.param("bias", zeros_init("vocab"), (self.vocab_size,))
        cd = self.dtype
        h = h.astype(cd)
        if not (train and self.num_sampled):
            logits = jnp.einsum("btp,vp->btv", h, w.astype(cd),
                                preferred_element_type=jnp.float32)
            return logits + b
        if targets is None:
            raise ValueError("SoftmaxHead: sampled softmax needs inputs (tokens, targets).")
        K, V = self.num_sampled, self.vocab_size
        ids = sample_log_uniform(self.make_rng("dropout"), K, V)
        log_expected = lambda i: jnp.log(float(K)) + log_uniform_log_prob(i, V)
        true_logit = (jnp.einsum("btp,btp->bt", h, w[targets].astype(cd),
                                 preferred_element_type=jnp.float32)
                      + b[targets] - log_expected(targets))
        sampled = (jnp.einsum("btp,kp->btk", h, w[ids].astype(cd),
                              preferred_element_type=jnp.float32)
                   + b[ids] - log_expected(ids))
        sampled = jnp.where(ids == targets[..., None], -1e9, sampled)   # accidental hits
        logits = jnp.concatenate([true_logit[..., None], sampled], -1)
        return {"logits": logits, "labels": jnp.zeros(targets.shape, jnp.int32)}


def make_layers(cfg: dict) -> list[nn.Module]:
    dtype = jnp.dtype(cfg["dtype"])
    return [Embedding(cfg["vocab_size"], cfg["projection"], cfg["dropout_rate"], dtype),
            *[LSTMPLayer(cfg["hidden"], cfg["projection"], cfg["dropout_rate"], dtype)
              for _ in range(cfg["num_layers"])],
            SoftmaxHead(cfg["vocab_size"], cfg["num_sampled"], dtype)]


def _sample_batch(cfg, batch_size: int, seed: int = 0):
    r = np.random.RandomState(seed)
    high = cfg["vocab_size"] if cfg["pad_id"] is None else cfg["pad_id"]
    seq = r.randint(0, high, size=(batch_size, cfg["seq_len"] + 1)).astype(np.int32)
    tokens, targets = seq[:, :-1], seq[:, 1:]
    return ((tokens, targets) if cfg["num_sampled"] else tokens), targets


def build(size: str, **overrides) -> ModelSpec:
    cfg = check_overrides("biglstm", DEFAULTS, {**SIZES[size], **overrides})
    if not 0 <= cfg["num_sampled"] < cfg["vocab_size"]:
        raise ValueError(f"biglstm: num_sampled={cfg['num_sampled']} must be in "
                         f"[0, vocab_size={cfg['vocab_size']}).")
    return ModelSpec(name="biglstm", size=size, config=cfg, layers=make_layers(cfg),
                     loss_fn=TokenLoss(cfg["pad_id"]), metrics_fn=TokenMetrics(cfg["pad_id"]),
                     task="language_model", sample_batch=functools.partial(_sample_batch, cfg))
