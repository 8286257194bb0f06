"""Attention over a block view of the KV: one function for training and decoding.

Keys are grouped in blocks of `page_size` tied to absolute positions (block j holds
positions [j*P, (j+1)*P) of its sequence). In training the blocks are the packed row
itself (identity page table); in the engine they are gathered from the page pool through
the sequence's page table. Because a sequence always starts on a block boundary, the
blocks that hold its keys, and the lanes inside them, are the same in both cases; blocks
of other sequences and lanes past the query are masked, and a masked block is an exact
no-op of the online softmax (its running max, sum and accumulator pass through
unchanged). That, plus the fixed-order primitives of `rljax.numerics`, is what makes a
decode step's logits the same bits as the training forward's.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from rljax.numerics import Numerics, det_exp, tree_sum

NEG = -1e30  # masked score; finite so that masked lanes never make NaN gradients


def as_values(x: jax.Array, dtype) -> jax.Array:
  """Pool contents as `dtype` values (they may be stored as raw bits)."""
  if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
    return lax.bitcast_convert_type(x, dtype)
  return x.astype(dtype)


def gather_blocks(pool: jax.Array, page_table: jax.Array, layer: int | None = None,
                  dtype=None) -> jax.Array:
  """[num_pages, P, Hkv, D] (or [L, ...] with `layer`) x [B, NB] -> [B, NB * P, Hkv, D]
  (as `dtype` values when given; required for a pool of raw bits)."""
  b, nb = page_table.shape
  blocks = pool[page_table] if layer is None else pool[layer, page_table]  # [B, NB, P, ...]
  if dtype is not None:
    blocks = as_values(blocks, dtype)
  return blocks.reshape(b, nb * pool.shape[-3], *pool.shape[-2:])


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array, *,
           page_size: int, numerics: Numerics, scale: float,
           q_segments: jax.Array | None = None,
           kv_segments: jax.Array | None = None) -> jax.Array:
  """Causal grouped-query attention of q over a block view of keys.

  q: [B, T, H, D]; k, v: [B, N, Hkv, D] with N a multiple of `page_size` (key n sits at
  index n of its row); q_index: [B, T] index of each query in the same row (its
  position); a key is visible to a query when n <= q_index (and, given segments, when
  both are in the same segment). Returns [B, T, H, D] in q's dtype.
  """
  b, t, h, d = q.shape
  n, hkv = k.shape[1], k.shape[2]
  if n % page_size:
    raise ValueError(f"key count {n} is not a multiple of page_size {page_size}")
  g = h // hkv
  # rows of a KV head: (query, group member), matching HF's repeat_kv head order
  qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  kt = k.transpose(0, 2, 1, 3)  # [B, Hkv, N, D]
  vt = v.transpose(0, 2, 1, 3)
  key_index = jnp.arange(n, dtype=jnp.int32)
  visible = key_index[None, None, :] <= q_index[:, :, None]  # [B, T, N]
  if q_segments is not None:
    visible &= kv_segments[:, None, :] == q_segments[:, :, None]
  visible = jnp.repeat(visible, g, axis=1)[:, None]  # [B, 1, T*G, N]

  if numerics.deterministic:
    out = _det_attention(qg, kt, vt, visible, scale, page_size)
  else:
    out = _dense_attention(qg, kt, vt, visible, scale)
  out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
  return out.astype(q.dtype)


def _dense_attention(qg, kt, vt, visible, scale):
  """Masked softmax attention with dots (fast mode): [B, Hkv, M, D] f32."""
  s = jnp.einsum("bhmd,bhnd->bhmn", qg, kt, preferred_element_type=jnp.float32) * scale
  p = jax.nn.softmax(jnp.where(visible, s, NEG), axis=-1).astype(vt.dtype)
  return jnp.einsum("bhmn,bhnd->bhmd", p, vt, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _det_attention(qg, kt, vt, visible, scale, page_size):
  """Deterministic attention: [B, Hkv, M, D] f32, the same bits in every graph.

  No dot kernels: which kernel XLA:CPU picks for a batched bf16 dot (bf16, or upcast to
  f32 when its operands come out of a fusion) differs between graphs, and the two round
  differently. bf16 x bf16 products are exact in f32, so a fixed tree of adds over
  head_dim gives the same scores everywhere. Only the forward must be invariant: the
  backward is the VJP of the dot-based `_dense_attention`, the same function.
  """
  prod = qg.astype(jnp.float32)[:, :, :, None, :] * kt.astype(jnp.float32)[:, :, None, :, :]
  s = jnp.where(visible, tree_sum(prod) * scale, NEG)
  return _online_softmax_blocks(s, visible, vt, page_size)


def _det_attention_fwd(qg, kt, vt, visible, scale, page_size):
  return _det_attention(qg, kt, vt, visible, scale, page_size), (qg, kt, vt, visible)


def _det_attention_bwd(scale, page_size, residuals, g):
  del page_size
  qg, kt, vt, visible = residuals
  _, vjp = jax.vjp(lambda q, k, v: _dense_attention(q, k, v, visible, scale), qg, kt, vt)
  return (*vjp(g), None)


_det_attention.defvjp(_det_attention_fwd, _det_attention_bwd)


def _online_softmax_blocks(s, visible, vt, page_size):
  """Online softmax over key blocks in order, reductions in fixed order.

  Every block's p @ v (a fixed tree over its page_size keys) is computed at once; only
  the running rescale, which is what fixes the order across blocks, walks the blocks.
  """
  b, hkv, m, n = s.shape
  nb = n // page_size
  s = s.reshape(b, hkv, m, nb, page_size)
  visible = visible.reshape(visible.shape[:3] + (nb, page_size))
  block_max = jnp.max(s, axis=-1)  # exact in any order
  run_max = lax.cummax(block_max, axis=3)
  p = jnp.where(visible, det_exp(s - run_max[..., None]), 0.0)
  block_sum = tree_sum(p)  # [B, Hkv, M, NB]
  vb = vt.reshape(b, hkv, nb, page_size, vt.shape[-1]).astype(jnp.float32)
  # p rounded to v's dtype (as the fast path's p @ v sees it), so products are exact in f32
  p_v = p.astype(vt.dtype).astype(jnp.float32)
  prod = p_v[:, :, :, :, :, None] * vb[:, :, None]  # [B, Hkv, M, NB, P, D]
  pv = jnp.moveaxis(tree_sum(jnp.moveaxis(prod, 4, -1)), 3, 2)  # [B, Hkv, NB, M, D]
  prev_max = jnp.concatenate([jnp.full_like(run_max[..., :1], NEG), run_max[..., :-1]], axis=-1)
  alpha = det_exp(prev_max - run_max)  # exactly 1 where a block changes nothing

  def step(carry, xs):
    l, acc = carry
    alpha_j, sum_j, pv_j = xs
    return (l * alpha_j + sum_j, acc * alpha_j[..., None] + pv_j), None

  init = (jnp.zeros((b, hkv, m), jnp.float32), jnp.zeros((b, hkv, m, vt.shape[-1]), jnp.float32))
  xs = (jnp.moveaxis(alpha, -1, 0), jnp.moveaxis(block_sum, -1, 0), jnp.moveaxis(pv, 2, 0))
  (l, acc), _ = lax.scan(step, init, xs)
  return acc / jnp.where(l == 0.0, 1.0, l)[..., None]
