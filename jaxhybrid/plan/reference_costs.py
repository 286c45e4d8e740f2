"""Analytic per-layer costs of the full-size paper models (Pal et al. 2019's workloads) and
their projection defaults.

Profiling Inception-V3 at 299 px, GNMT-8 or the 1.8B-parameter BigLSTM on a 2-core CPU is
slow (and XLA's cost analysis counts a `scan` body once, not once per time step), so the
projection uses these closed forms. The layer lists follow `jaxhybrid.models` ("full"
size) one for one, so a partition of these costs is a partition of those models.

Counting rules (per microbatch of m examples; bytes as float32, the hardware's
`bytes_scale` converts to the training dtype):
  matmul / conv  forward 2 * MACs; backward 2x forward (input and weight gradients),
                 1x for the first layer (no input gradient);
  conv + BN + ReLU  bytes: read input, write conv output, BN+ReLU read and write it
                 (4 * (in + 3 out) per example) + the weights once; saved for backward:
                 conv input, conv output, BN output;
  LSTM step      gates 2 * 4H (I + R) per example (R = recurrent width: H, or the
                 projection P), projection 2 H P; the weights are re-read every time step
                 (forward once, backward read + gradient read/write: 3x) - this is what
                 makes small microbatches memory-bound on a GPU; saved per step: input,
                 recurrent state, 4 gates, cell and output;
  embeddings / sampled softmax  gathers; their gradients touch only the used rows
                 (`table_rows` etc., see `hybrid.grad_params`) for BigLSTM, whose
                 TensorFlow recipe exchanges them as sparse IndexedSlices; GNMT's dense.
"""
from __future__ import annotations

import dataclasses
import functools

from jaxhybrid.plan.costs import LayerCost

F32 = 4


@dataclasses.dataclass
class RefLayerCost(LayerCost):
    """LayerCost plus a sparse-gradient table: `table_rows` rows of `row_params`; a step
    touches `sparse_rows` rows per example plus `sparse_fixed_rows`."""
    table_rows: int = 0
    row_params: int = 0
    sparse_rows: float = 0.0
    sparse_fixed_rows: float = 0.0


def _layer(name, m, *, flops, bwd_factor=2.0, param_count=0, param_reads=1.0, act_bytes=0.0,
           in_elems=0.0, out_elems=0.0, saved_elems=0.0, state_bytes=0, **sparse) -> RefLayerCost:
    """One layer at microbatch m from per-example quantities (elements, FLOPs)."""
    pb = param_count * F32
    return RefLayerCost(
        name=name, batch_size=m, fwd_flops=flops * m, bwd_flops=bwd_factor * flops * m,
        fwd_bytes=act_bytes * m + param_reads * pb, bwd_bytes=2 * act_bytes * m + 3 * param_reads * pb,
        param_bytes=pb, param_count=int(param_count), in_bytes=int(in_elems * F32 * m),
        out_bytes=int(out_elems * F32 * m), saved_bytes=int(saved_elems * F32 * m),
        saved_bytes_remat=int(in_elems * F32 * m), fwd_time=0.0, bwd_time=0.0, measured=False,
        state_bytes=int(state_bytes), **sparse)


# --- Inception-V3 (299 x 299, Szegedy et al. 2016) -----------------------------------
def _conv_path(ops, h, c):
    """Runs conv ops (cout, kh, kw, stride[, "valid"]) from (h, c); 'same' padding at
    stride 1 unless marked "valid", 'valid' at stride 2. Returns (flops, params, act
    bytes, saved elems, bn channels, h, c)."""
    fl = pr = ab = sv = bn = 0.0
    for cout, kh, kw, st, *pad in ops:
        ho = (h - kh) // st + 1 if (st > 1 or pad) else h
        fl += 2 * ho * ho * c * cout * kh * kw
        pr += c * cout * kh * kw + 2 * cout
        ab += F32 * (h * h * c + 3 * ho * ho * cout)
        sv += h * h * c + 2 * ho * ho * cout
        bn += cout
        h, c = ho, cout
    return fl, pr, ab, sv, bn, h, c


def _block(name, m, h, c, branches, pool=None, first=False):
    """Branches from one input, outputs concatenated; `branches` entries are op lists or
    (op list, [op lists forked from its end]); pool: 'avg'/'max'/None for the pool branch
    (avg pool is followed by a 1x1 conv given as an ordinary branch)."""
    tot = [0.0] * 5
    c_out, h_out = 0, h
    for br in branches:
        prefix, forks = (br, None) if not isinstance(br, tuple) else br
        r = _conv_path(prefix, h, c)
        tot = [a + b for a, b in zip(tot, r[:5])]
        h_out = r[5]
        if forks:
            for f in forks:
                q = _conv_path(f, r[5], r[6])
                tot = [a + b for a, b in zip(tot, q[:5])]
                c_out += q[6]
        else:
            c_out += r[6]
    if pool == "max":   # stride-2 max-pool branch passes the input channels through
        h_out = (h - 3) // 2 + 1
        c_out += c
        tot[0] += 9 * h_out * h_out * c
        tot[2] += F32 * (h * h * c + h_out * h_out * c)
    fl, pr, ab, sv, bn = tot
    return _layer(name, m, flops=fl, bwd_factor=1.0 if first else 2.0, param_count=pr,
                  act_bytes=ab, in_elems=h * h * c, out_elems=h_out * h_out * c_out,
                  saved_elems=sv, state_bytes=2 * bn * F32), h_out, c_out


def inception_v3(m: int, num_classes: int = 1000) -> list[RefLayerCost]:
    out, h, c = [], 299, 3
    stem = [("Conv2d_1a_3x3", (32, 3, 3, 2)), ("Conv2d_2a_3x3", (32, 3, 3, 1, "valid")),
            ("Conv2d_2b_3x3", (64, 3, 3, 1)), ("Conv2d_3b_1x1", (80, 1, 1, 1)),
            ("Conv2d_4a_3x3", (192, 3, 3, 1, "valid"))]
    for i, (name, op) in enumerate(stem):
        if name == "Conv2d_3b_1x1":
            h = (h - 3) // 2 + 1            # max-pool before it
        layer, h, c = _block(name, m, h, c, [[op]], first=i == 0)
        out.append(layer)
    h = (h - 3) // 2 + 1                    # max-pool at the start of Mixed_5b
    A = lambda pf: [[(64, 1, 1, 1)], [(48, 1, 1, 1), (64, 5, 5, 1)],  # noqa: E731
                    [(64, 1, 1, 1), (96, 3, 3, 1), (96, 3, 3, 1)], [(pf, 1, 1, 1)]]
    C = lambda c7: [[(192, 1, 1, 1)], [(c7, 1, 1, 1), (c7, 1, 7, 1), (192, 7, 1, 1)],  # noqa: E731
                    [(c7, 1, 1, 1), (c7, 7, 1, 1), (c7, 1, 7, 1), (c7, 7, 1, 1), (192, 1, 7, 1)],
                    [(192, 1, 1, 1)]]
    E = [[(320, 1, 1, 1)], ([(384, 1, 1, 1)], [[(384, 1, 3, 1)], [(384, 3, 1, 1)]]),
         ([(448, 1, 1, 1), (384, 3, 3, 1)], [[(384, 1, 3, 1)], [(384, 3, 1, 1)]]), [(192, 1, 1, 1)]]
    blocks = [("Mixed_5b", A(32), None), ("Mixed_5c", A(64), None), ("Mixed_5d", A(64), None),
              ("Mixed_6a", [[(384, 3, 3, 2)], [(64, 1, 1, 1), (96, 3, 3, 1), (96, 3, 3, 2)]], "max"),
              *[(f"Mixed_6{x}", C(c7), None) for x, c7 in zip("bcde", (128, 160, 160, 192))],
              ("Mixed_7a", [[(192, 1, 1, 1), (320, 3, 3, 2)],
                            [(192, 1, 1, 1), (192, 1, 7, 1), (192, 7, 1, 1), (192, 3, 3, 2)]], "max"),
              ("Mixed_7b", E, None), ("Mixed_7c", E, None)]
    for name, branches, pool in blocks:
        layer, h, c = _block(name, m, h, c, branches, pool)
        out.append(layer)
    fc = c * num_classes + num_classes
    out.append(_layer("Classifier", m, flops=2 * fc + h * h * c, param_count=fc,
                      act_bytes=F32 * (h * h * c + c + num_classes), in_elems=h * h * c,
                      out_elems=num_classes, saved_elems=c + num_classes))
    return out


# --- LSTM models ---------------------------------------------------------------------
def _lstm(name, m, T, I, H, P=0, extra_flops=0.0, extra_params=0, carry=0.0):
    """One LSTM layer over T steps (optionally projected to P); `carry`: elements per
    example riding along in the activation (e.g. encoder outputs in the decoder)."""
    R = P or H
    w = 4 * H * (I + R) + 4 * H + H * P
    flops = T * (8 * H * (I + R) + 2 * H * P + 10 * H) + extra_flops
    out_w = P or H
    return _layer(name, m, flops=flops, param_count=w + extra_params, param_reads=T,
                  act_bytes=F32 * T * (I + 10 * H + out_w), in_elems=T * I + carry,
                  out_elems=T * out_w + carry, saved_elems=T * (I + R + 6 * H))


def gnmt(m: int, *, vocab: int = 32000, H: int = 1024, enc_layers: int = 8, dec_layers: int = 8,
         src_len: int = 30, tgt_len: int = 30) -> list[RefLayerCost]:
    """GNMT v2 as in jaxhybrid.models.gnmt (bidirectional first encoder layer, normalised
    Bahdanau attention on the first decoder layer, context fed to every later one)."""
    S, T, V = src_len, tgt_len, vocab
    emb = lambda n, t, carry: _layer(n, m, flops=0.0, param_count=V * H, param_reads=0,  # noqa: E731
                                     act_bytes=F32 * t * H, in_elems=carry, out_elems=t * H + carry)
    out = [emb("SourceEmbed", S, 0)]
    out.append(_lstm("Encoder_1_bi", m, S, H, H, extra_flops=0))
    bi = out[-1]
    out[-1] = dataclasses.replace(bi, fwd_flops=2 * bi.fwd_flops, bwd_flops=2 * bi.bwd_flops,
                                  fwd_bytes=2 * bi.fwd_bytes, bwd_bytes=2 * bi.bwd_bytes,
                                  param_count=2 * bi.param_count, param_bytes=2 * bi.param_bytes,
                                  saved_bytes=2 * bi.saved_bytes, out_bytes=2 * bi.out_bytes)
    out.append(_lstm("Encoder_2", m, S, 2 * H, H))
    out += [_lstm(f"Encoder_{i}", m, S, H, H) for i in range(3, enc_layers + 1)]
    out.append(emb("TargetEmbed", T, S * H))
    attn_flops = 2 * S * H * H + 2 * T * H * H + 4 * T * S * H + 2 * T * S * H
    out.append(_lstm("Decoder_1_attention", m, T, H, H, extra_flops=attn_flops,
                     extra_params=2 * H * H + 2 * H, carry=S * H + T * H))
    out += [_lstm(f"Decoder_{i}", m, T, 2 * H, H, carry=T * H) for i in range(2, dec_layers + 1)]
    out.append(_layer("Softmax", m, flops=2 * T * H * V, param_count=H * V + V,
                      act_bytes=F32 * T * (H + 2 * V), in_elems=T * 2 * H, out_elems=T * V,
                      saved_elems=T * (H + V)))
    return out


def biglstm(m: int, *, vocab: int = 793471, H: int = 8192, P: int = 1024, layers: int = 2,
            seq_len: int = 20, num_sampled: int = 8192) -> list[RefLayerCost]:
    """BIG LSTM (Jozefowicz et al. 2016: 2 x LSTM-8192 with 1024 projection, 1.8B
    parameters) with its sampled softmax (num_sampled candidates per step)."""
    T, V = seq_len, vocab
    out = [_layer("Embed", m, flops=0.0, param_count=V * P, param_reads=0, act_bytes=F32 * T * P,
                  out_elems=T * P, table_rows=V, row_params=P, sparse_rows=T)]
    out += [_lstm(f"LSTM_{i}", m, T, P, H, P) for i in range(1, layers + 1)]
    out.append(_layer("SampledSoftmax", m, flops=2 * T * P * (num_sampled + 1),
                      param_count=V * (P + 1), param_reads=0,
                      act_bytes=F32 * T * (P + 2 * num_sampled) + F32 * num_sampled * P / m,
                      in_elems=T * P, out_elems=T * (num_sampled + 1),
                      saved_elems=T * (P + num_sampled), table_rows=V, row_params=P + 1,
                      sparse_rows=T, sparse_fixed_rows=num_sampled))
    return out


# --- projection defaults --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PaperModel:
    """What the projection needs of a paper model beyond its costs."""
    costs: callable            # microbatch size -> list[LayerCost]
    per_worker_batch: int
    optimizer_states: int
    note: str


PAPER_MODELS = {
    # Per-GPU batch 64 at 299 px: the common V100 setting (TF benchmarks, Pal et al.'s
    # weak scaling per worker); momentum SGD (Goyal et al.): one state.
    "inception_v3": PaperModel(inception_v3, 64, 1, "per-worker batch 64 images, momentum SGD"),
    # NVIDIA's GNMT recipe: 128 sentence pairs per GPU, Adam (two states).
    "gnmt": PaperModel(gnmt, 128, 2, "per-worker batch 128 sentence pairs (~30 tokens), Adam"),
    # Jozefowicz et al. / Kuchaiev & Ginsburg: 128 sequences x 20 steps per GPU, Adagrad.
    "biglstm": PaperModel(biglstm, 128, 1, "per-worker batch 128 sequences x 20 tokens, Adagrad"),
}


def paper_model(name: str) -> PaperModel:
    if name not in PAPER_MODELS:
        raise ValueError(f"no reference costs for {name!r}; known: {', '.join(PAPER_MODELS)} "
                         f"(for another model use costs='profile').")
    return PAPER_MODELS[name]


@functools.lru_cache(maxsize=None)
def param_count(name: str) -> int:
    return int(sum(c.param_count for c in paper_model(name).costs(1)))


def total_flops(name: str) -> float:
    """Forward FLOPs per example (2 x MACs), for checking against published counts."""
    return float(sum(c.fwd_flops for c in paper_model(name).costs(1)))

