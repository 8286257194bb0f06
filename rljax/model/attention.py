"""The engine's paged KV cache and attention over it.

`PagedKV` (a page pool per layer and each row's page table), `write_pages`, and
`attend_paged`: `rljax.block_attention.attend` over the pages a row's queries can see.
The block schedule that makes a decode step's logits the training forward's bits is
described in `rljax.block_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

# NEG, attend and gather_blocks are part of this module's API too (the engine's tests)
from rljax.block_attention import NEG, as_values, attend, gather_blocks  # noqa: F401
from rljax.numerics import Numerics


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
  """The engine's KV cache: a page pool per layer and each row's page table.

  k, v: [layers, num_pages, page_size, kv_heads, head_dim] values, or their raw bits
  (`raw_dtype`; what the engine keeps); page 0 is the null page
  (table entries of unused blocks point at it, and writes of padding tokens land there).
  page_table: [batch, max_blocks] int32.
  """

  k: jax.Array
  v: jax.Array
  page_table: jax.Array

  @property
  def page_size(self) -> int:
    return self.k.shape[2]


def raw_dtype(dtype) -> jnp.dtype:
  """The unsigned integer type of the same width: how the engine stores its pools."""
  return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def write_pages(pool: jax.Array, new: jax.Array, page_table: jax.Array,
                positions: jax.Array, layer: int | None = None) -> jax.Array:
  """Writes new[b, t] (one layer's [B, T, Hkv, D]) at its position's page slot.

  `pool` is one layer's [num_pages, P, Hkv, D], or with `layer` the stack of all layers
  [L, num_pages, P, Hkv, D] (written in place: no per-layer slice is copied out and back).
  It holds values, or their raw bits (`raw_dtype`): XLA:CPU scatters into a bf16 array by
  converting all of it to f32 and back, so the engine keeps its pools as bits.
  Tokens with a negative position (padding) are written to the null page.
  """
  page_size = pool.shape[-3]
  valid = positions >= 0
  pos = jnp.where(valid, positions, 0)
  pages = jnp.take_along_axis(page_table, pos // page_size, axis=1)
  pages = jnp.where(valid, pages, 0)
  index = (pages, pos % page_size) if layer is None else (layer, pages, pos % page_size)
  if jnp.issubdtype(pool.dtype, jnp.unsignedinteger):
    return pool.at[index].set(lax.bitcast_convert_type(new, pool.dtype))
  return pool.at[index].set(new.astype(pool.dtype))


def attend_paged(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                 q_index: jax.Array, *, layer: int | None = None, dtype, numerics: Numerics,
                 scale: float) -> jax.Array:
  """`attend` over the row's pages, reading only the blocks some query can see.

  The gathered width is chosen on device among power-of-two block counts (1, 2, 4, ...,
  max_blocks; a `lax.switch`, so shapes stay static and nothing recompiles): the smallest
  that covers max(q_index). Blocks past it are masked for every query, and a masked block
  is an exact no-op (module docstring), so the result is the same bits as over all
  `max_blocks`; the work follows the longest live sequence, not `max_seq_len`.
  q: [B, T, H, D]; pools: see `gather_blocks`; page_table [B, max_blocks]; q_index [B, T].
  """
  page_size = k_pool.shape[-3]
  max_blocks = page_table.shape[1]
  widths = sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)})
  needed = jnp.max(q_index) // page_size + 1  # padding rows (-1) need none
  branch = jnp.clip(jnp.searchsorted(jnp.asarray(widths, jnp.int32), needed), 0,
                    len(widths) - 1)

  def over(nb):
    def f(q, k_pool, v_pool, page_table, q_index):
      keys = gather_blocks(k_pool, page_table[:, :nb], layer, dtype=dtype)
      values = gather_blocks(v_pool, page_table[:, :nb], layer, dtype=dtype)
      return attend(q, keys, values, q_index, page_size=page_size, numerics=numerics,
                    scale=scale)
    return f

  if len(widths) == 1:
    return over(max_blocks)(q, k_pool, v_pool, page_table, q_index)
  return lax.switch(branch, [over(nb) for nb in widths], q, k_pool, v_pool, page_table,
                    q_index)
