"""One LSTM layer over a whole sequence, shared by GNMT and BigLSTM.

The input projection of every time step is one large matmul before the recurrence; only
the recurrent matmul runs inside a `lax.scan` over time, so the layer is jittable at any
sequence length with no Python loop over time. Optional projection (LSTMP, Sak et al.
2014; used by BigLSTM) maps the cell output h (hidden) to a smaller recurrent state r.
Optional mask: at masked (padding) steps the state is carried unchanged and the output
is zero, so a reverse-direction layer over right-padded sequences starts on the first
real token and results never depend on how much padding follows.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxhybrid.models.spec import dense_init, logical


def _gate_bias_init(hidden: int):
    # Forget-gate bias 1 (Gers et al. 2000; Jozefowicz et al. 2015) so that early in
    # training the cell remembers by default. Gate order: input, forget, cell, output.
    def init(key, shape, dtype=jnp.float32):
        return jnp.zeros(shape, dtype).at[hidden:2 * hidden].set(1.0)
    return logical(init, "lstm_gates")


class LSTM(nn.Module):
    """x [B, T, D] (-> mask [B, T] bool) -> outputs [B, T, projection or hidden]."""
    hidden: int
    projection: int | None = None
    reverse: bool = False
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask=None):
        H = self.hidden
        R = self.projection or H
        state_axis = "embed" if self.projection else "lstm_hidden"
        w_in = self.param("input_kernel", dense_init("lstm_in", "lstm_gates"),
                          (x.shape[-1], 4 * H))
        w_rec = self.param("recurrent_kernel", dense_init(state_axis, "lstm_gates"), (R, 4 * H))
        bias = self.param("bias", _gate_bias_init(H), (4 * H,))
        w_proj = (self.param("projection_kernel", dense_init("lstm_hidden", "embed"), (H, R))
                  if self.projection else None)
        cd = self.dtype
        gates_in = jnp.dot(x.astype(cd), w_in.astype(cd),
                           preferred_element_type=jnp.float32) + bias
        B, T = x.shape[:2]
        mask = jnp.ones((B, T), bool) if mask is None else mask
        xs = (jnp.swapaxes(gates_in, 0, 1), jnp.swapaxes(mask, 0, 1))    # time-major
        w_rec, w_proj = w_rec.astype(cd), None if w_proj is None else w_proj.astype(cd)

        def step(carry, inputs):
            r, c = carry
            g_in, m = inputs
            z = g_in + jnp.dot(r, w_rec, preferred_element_type=jnp.float32)
            i, f, g, o = jnp.split(z, 4, axis=-1)
            c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h_new = (jax.nn.sigmoid(o) * jnp.tanh(c_new)).astype(cd)
            r_new = h_new if w_proj is None else jnp.dot(h_new, w_proj)
            m = m[:, None]
            carry = (jnp.where(m, r_new, r), jnp.where(m, c_new, c))
            return carry, jnp.where(m, r_new, jnp.zeros_like(r_new))

        init = (jnp.zeros((B, R), cd), jnp.zeros((B, H), jnp.float32))
        _, ys = jax.lax.scan(step, init, xs, reverse=self.reverse)
        return jnp.swapaxes(ys, 0, 1)
