"""Per-token log-probs of whole sequences, two ways: the training forward over packed
rows, and one-token decode steps over a paged KV cache. In deterministic numerics the two
are the same bits; experiments and benchmarks compare them with these helpers."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.model.attention import PagedKV
from rljax.model.config import ModelConfig
from rljax.model.packing import pack, unpack
from rljax.model.transformer import forward
from rljax.numerics import Numerics


def next_token_targets(tokens: np.ndarray) -> np.ndarray:
  """targets[:, i] = tokens[:, i + 1]; the last column (no next token) is 0."""
  return np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)


def packed_logprobs(params: Any, seqs: Sequence[np.ndarray], *, cfg: ModelConfig,
                    numerics: Numerics, row_len: int, **forward_kwargs) -> list[np.ndarray]:
  """log p(seq[i+1] | seq[:i+1]) for i < len(seq) - 1, from the packed training forward."""
  p = pack(seqs, row_len, cfg.page_size)
  lp = jax.jit(lambda prm: forward(prm, p.tokens, p.positions, cfg=cfg, numerics=numerics,
                                   segment_ids=p.segment_ids, targets=next_token_targets(
                                       p.tokens), **forward_kwargs).logprobs)(params)
  return [x[:-1] for x in unpack(np.asarray(lp), p)]


def paged_decode_logprobs(params: Any, seqs: Sequence[np.ndarray], *, cfg: ModelConfig,
                          numerics: Numerics, shuffle_pages_seed: int | None = None,
                          **forward_kwargs) -> list[np.ndarray]:
  """The same log-probs from one-token decode steps (all sequences in one batch) over a
  paged KV cache; `shuffle_pages_seed` scrambles which pages each sequence gets."""
  b, n = len(seqs), max(len(s) for s in seqs)
  tokens = np.zeros((b, n), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  targets = next_token_targets(tokens)
  blocks = -(-n // cfg.page_size)
  pages = np.arange(b * blocks)
  if shuffle_pages_seed is not None:
    pages = np.random.default_rng(shuffle_pages_seed).permutation(pages)
  table = 1 + pages.reshape(b, blocks)  # page 0 is the null page
  shape = (cfg.num_hidden_layers, 1 + b * blocks, cfg.page_size, cfg.num_key_value_heads,
           cfg.head_dim)
  kv = PagedKV(jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype),
               jnp.asarray(table, jnp.int32))
  step = jax.jit(lambda prm, t, pos, kv, tg: forward(prm, t, pos, cfg=cfg, numerics=numerics,
                                                     kv=kv, targets=tg, **forward_kwargs))
  lengths = np.array([len(s) for s in seqs])
  out = np.zeros((b, n), np.float32)
  for i in range(n - 1):
    pos = np.where(i < lengths, i, -1).astype(np.int32)[:, None]  # finished: null page
    res = step(params, tokens[:, i:i + 1], pos, kv, targets[:, i:i + 1])
    kv = res.kv
    out[:, i] = np.asarray(res.logprobs)[:, 0]
  return [out[i, :len(s) - 1] for i, s in enumerate(seqs)]


def nan_max(values: Iterable[Any]) -> float:
  """The largest element over scalars or arrays; NaN if any element is NaN.

  Python's `max` keeps whichever operand it compared first when a comparison with NaN is
  False, so `max(0.0, nan)` is 0.0 and a NaN anywhere but first vanishes from a check.
  """
  maxima = [np.max(np.asarray(v, np.float64)) for v in values if np.size(v)]
  if not maxima:
    raise ValueError("nan_max of nothing: no values to compare")
  return float(np.max(maxima))


def max_abs_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
  """max |x - y| over pairs of arrays of the same shapes; NaN if either side has a NaN
  anywhere (equal infinities count as equal). `== 0.0` is a bitwise check on finite
  values (up to the sign of zero)."""
  if len(a) != len(b):
    raise ValueError(f"max_abs_diff: {len(a)} arrays vs {len(b)}")
  diffs = []
  for i, (x, y) in enumerate(zip(a, b)):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.shape != y.shape:
      raise ValueError(f"max_abs_diff: array {i} has shape {x.shape} vs {y.shape}")
    diffs.append(np.where(x == y, 0.0, np.abs(x - y)))
  return nan_max(diffs)
