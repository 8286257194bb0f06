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


QUERY_CHUNK = 512  # queries per attention call over a longer row (`attend`)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array, *,
           page_size: int, numerics: Numerics, scale: float,
           q_segments: jax.Array | None = None, kv_segments: jax.Array | None = None,
           per_kv_head: bool = True, query_chunk: int | None = None) -> jax.Array:
  """Causal grouped-query attention of q over a block view of keys (`_attend`).

  More than `query_chunk` (default QUERY_CHUNK) queries (a training row, a long prefill)
  are taken in chunks of at most that many, in a `lax.map` whose body is rematerialised:
  scores, masks and what the backward keeps are then [chunk, keys], not [queries, keys],
  so memory grows with the row, not its square (a 1M-param model's train step on one
  4,096-token row held 5 GB of such temporaries on a TPU). The last chunk is padded with
  queries that see no key (q_index -1), dropped after. Each query's result is computed by
  the same operations on the same keys, so deterministic numerics gives the same bits
  either way (its dots are per query tile; tested bitwise); fast numerics agrees up to
  XLA's rounding choices.
  """
  b, t = q.shape[:2]
  query_chunk = query_chunk or QUERY_CHUNK
  kw = dict(page_size=page_size, numerics=numerics, scale=scale, per_kv_head=per_kv_head)
  if t <= query_chunk:
    return _attend(q, k, v, q_index, q_segments=q_segments, kv_segments=kv_segments, **kw)
  chunks = -(-t // query_chunk)
  size = -(-t // chunks)
  pad = chunks * size - t

  def split(x, fill):  # [B, T, ...] -> [chunks, B, size, ...]
    if x is None:
      return None
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(b, chunks, size, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def one_chunk(xs):
    q_c, index_c, segments_c = xs
    return _attend(q_c, k, v, index_c, q_segments=segments_c, kv_segments=kv_segments, **kw)

  out = lax.map(one_chunk, (split(q, 0), split(q_index, -1), split(q_segments, 0)))
  return jnp.moveaxis(out, 0, 1).reshape(b, chunks * size, *q.shape[2:])[:, :t]


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, q_index: jax.Array, *,
            page_size: int, numerics: Numerics, scale: float,
            q_segments: jax.Array | None = None,
            kv_segments: jax.Array | None = None, per_kv_head: bool = True) -> jax.Array:
  """Causal grouped-query attention of q over a block view of keys.

  q: [B, T, H, D]; k, v: [B, N, Hkv, D] with N a multiple of `page_size` (key n sits at
  index n of its row); q_index: [B, T] index of each query in the same row (its
  position); a key is visible to a query when n <= q_index (and, given segments, when
  both are in the same segment). Returns [B, T, H, D] in q's dtype.

  Fast mode computes one KV head at a time (`per_kv_head`), batched over sequences only,
  so the keys need no transpose: for a batched dot XLA:CPU copies out a transposed key
  array, and one-token decode attention took 1.5x as long (256 slots, 2 KV heads, CPU).
  Turn it off when the heads are sharded: a slice per head would cross devices.
  """
  b, t, h, d = q.shape
  n, hkv = k.shape[1], k.shape[2]
  if n % page_size:
    raise ValueError(f"key count {n} is not a multiple of page_size {page_size}")
  g = h // hkv
  key_index = jnp.arange(n, dtype=jnp.int32)
  visible = key_index[None, None, :] <= q_index[:, :, None]  # [B, T, N]
  if q_segments is not None:
    visible &= kv_segments[:, None, :] == q_segments[:, :, None]
  # rows of a KV head: (query, group member), matching HF's repeat_kv head order
  visible = jnp.repeat(visible, g, axis=1)  # [B, T*G, N]

  if not numerics.deterministic and per_kv_head:
    out = [_dense_attention(q[:, :, j * g:(j + 1) * g].reshape(b, t * g, d), k[:, :, j],
                            v[:, :, j], visible, scale).reshape(b, t, g, d)
           for j in range(hkv)]
    return jnp.concatenate(out, axis=2).astype(q.dtype)
  qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
  kt = k.transpose(0, 2, 1, 3)  # [B, Hkv, N, D]
  vt = v.transpose(0, 2, 1, 3)
  if numerics.deterministic:
    out = _det_attention(qg, kt, vt, visible[:, None], scale, page_size)
  else:
    out = _dense_attention(qg, kt, vt, visible[:, None], scale)
  out = out.reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
  return out.astype(q.dtype)


def _dense_attention(qg, kt, vt, visible, scale):
  """Masked softmax attention with dots (fast mode): qg [..., M, D], kt and vt [..., N, D],
  visible [..., M, N] -> [..., M, D] f32."""
  s = jnp.einsum("...md,...nd->...mn", qg, kt, preferred_element_type=jnp.float32) * scale
  p = jax.nn.softmax(jnp.where(visible, s, NEG), axis=-1).astype(vt.dtype)
  return jnp.einsum("...mn,...nd->...md", p, vt, preferred_element_type=jnp.float32)


ROW_TILE = 8  # query rows per deterministic score/value dot


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _det_attention(qg, kt, vt, visible, scale, page_size):
  """Deterministic attention: [B, Hkv, M, D] f32, the same bits in every graph.

  Every product is one fixed-shape dot per (query tile of ROW_TILE rows, key block):
  scores (ROW_TILE x D) @ (D x page_size) and values (ROW_TILE x page_size) @
  (page_size x D), batched over (sequence, KV head, query tile, key block), with f32
  operands holding bf16 values (bf16 x bf16 products are exact in f32). A fixed dot shape
  fixes the order of its sums, whatever the graph, the tile count or a row's place in its
  tile: the training forward (many query tiles), a prefill and a one-token decode step (one
  tile, the KV head's G query rows padded) reduce each query alike. bf16 operands would
  leave the kernel to XLA:CPU (a bf16 dot, or an upcast to f32 when an operand comes out of
  a fusion), and the two round differently. Only the forward must be invariant: the
  backward is the VJP of the dot-based `_dense_attention`, the same function.
  """
  b, hkv, m, d = qg.shape
  n = kt.shape[2]
  nb = n // page_size
  mp = -(-m // ROW_TILE) * ROW_TILE
  nt = mp // ROW_TILE
  if mp != m:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
    visible = jnp.pad(visible, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  # [B, Hkv, tiles, blocks, rows, ...]: every (tile, block) pair is one batch entry
  q_tiles = jnp.broadcast_to(qg.astype(jnp.float32).reshape(b, hkv, nt, 1, ROW_TILE, d),
                             (b, hkv, nt, nb, ROW_TILE, d))
  k_blocks = jnp.broadcast_to(kt.astype(jnp.float32).reshape(b, hkv, 1, nb, page_size, d),
                              (b, hkv, nt, nb, page_size, d))
  s = jnp.einsum("bhtjrd,bhtjpd->bhtjrp", q_tiles, k_blocks)
  vis = visible.reshape(b, 1, nt, ROW_TILE, nb, page_size).transpose(0, 1, 2, 4, 3, 5)
  s = jnp.where(vis, s * scale, NEG)
  out = _online_softmax_blocks(s, vis, vt, page_size)  # [B, Hkv, tiles, rows, D]
  return out.reshape(b, hkv, mp, d)[:, :, :m]


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

  s, visible: [B, Hkv, tiles, blocks, rows, page_size]; vt [B, Hkv, N, D] -> [B, Hkv,
  tiles, rows, D] f32. Every block's p @ v (one fixed-shape dot) is computed at once; only
  the running rescale, which is what fixes the order across blocks, walks the blocks.
  """
  b, hkv, nt, nb, r, _ = s.shape
  d = vt.shape[-1]
  block_max = jnp.max(s, axis=-1)  # exact in any order; [B, Hkv, tiles, blocks, rows]
  run_max = lax.cummax(block_max, axis=3)
  p = jnp.where(visible, det_exp(s - run_max[..., None]), 0.0)
  block_sum = tree_sum(p)
  # p rounded to v's dtype (as the fast path's p @ v sees it), so products are exact in f32
  p_v = p.astype(vt.dtype).astype(jnp.float32)
  v_blocks = jnp.broadcast_to(vt.astype(jnp.float32).reshape(b, hkv, 1, nb, page_size, d),
                              (b, hkv, nt, nb, page_size, d))
  pv = jnp.einsum("bhtjrp,bhtjpd->bhtjrd", p_v, v_blocks)
  prev_max = jnp.concatenate([jnp.full_like(run_max[:, :, :, :1], NEG), run_max[:, :, :, :-1]],
                             axis=3)
  alpha = det_exp(prev_max - run_max)  # exactly 1 where a block changes nothing

  def step(carry, xs):
    l, acc = carry
    alpha_j, sum_j, pv_j = xs
    return (l * alpha_j + sum_j, acc * alpha_j[..., None] + pv_j), None

  init = (jnp.zeros((b, hkv, nt, r), jnp.float32), jnp.zeros((b, hkv, nt, r, d), jnp.float32))
  xs = (jnp.moveaxis(alpha, 3, 0), jnp.moveaxis(block_sum, 3, 0), jnp.moveaxis(pv, 3, 0))
  (l, acc), _ = lax.scan(step, init, xs)
  return acc / jnp.where(l == 0.0, 1.0, l)[..., None]
