"""The engine's paged KV cache and attention over it.

`PagedKV` (a page pool per layer and each row's page table), `write_pages`, and
`attend_paged`: `rljax.block_attention.attend` over the pages a row's queries can see;
in deterministic numerics optionally by the Pallas kernels of the same tiling
(`attend_det_kernel`, `attend_paged_det_kernel`). XLA cannot partition a kernel call, so on a
mesh the kernels run under `jax.shard_map`, each device on its own rows and heads
(`per_device`); there the engine gathers a row's pages first (a sharded pool does not keep a
slot's pages on the slot's device) and the packed kernel attends over them.
The block schedule that makes a decode step's logits the training forward's bits is
described in `rljax.block_attention`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import det_attention as det_kernels
# NEG, attend and gather_blocks are part of this module's API too (the engine's tests)
from rljax.block_attention import NEG, as_values, attend, gather_blocks  # noqa: F401
from rljax.model.config import KERNELS
from rljax.numerics import FAST, Numerics
from rljax.sharding import Sharding


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
                 scale: float, per_kv_head: bool = True, kernel: str | None = None,
                 sharding: Sharding | None = None) -> jax.Array:
  """`attend` over the row's pages, reading only the blocks some query can see.

  The gathered width is chosen on device among power-of-two block counts (1, 2, 4, ...,
  max_blocks; a `lax.switch`, so shapes stay static and nothing recompiles): the smallest
  that covers max(q_index). Blocks past it are masked for every query, and a masked block
  is an exact no-op (module docstring), so the result is the same bits as over all
  `max_blocks`; the work follows the longest live sequence, not `max_seq_len`.
  q: [B, T, H, D]; pools: see `gather_blocks`; page_table [B, max_blocks]; q_index [B, T].
  `kernel` (deterministic numerics): the gathered blocks are attended by that Pallas
  kernel (`attend_det_kernel`, per device on `sharding`'s mesh) instead of `attend`.
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
      if kernel is not None:
        return attend_det_kernel(q, keys, values, q_index, None, None, page_size, scale,
                                 kernel, sharding)
      return attend(q, keys, values, q_index, page_size=page_size, numerics=numerics,
                    scale=scale, per_kv_head=per_kv_head)
    return f

  if len(widths) == 1:
    return over(max_blocks)(q, k_pool, v_pool, page_table, q_index)
  return lax.switch(branch, [over(nb) for nb in widths], q, k_pool, v_pool, page_table,
                    q_index)


def _det_kernel_args(kernel: str) -> dict:
  """`ModelConfig.det_attention` (one of config.KERNELS but "jnp", the jnp path of
  `block_attention`) as `pallas_kernels.det_attention` arguments: TPU / GPU, or the GPU
  kernel interpreted on CPU (the jnp path's bits, tested)."""
  if kernel not in KERNELS[1:]:
    raise ValueError(f"unknown deterministic attention kernel {kernel!r}; expected one of "
                     f"{KERNELS[1:]}")
  return {"backend": "tpu" if kernel == "pallas_tpu" else "gpu",
          "interpret": kernel == "pallas_interpret"}


def per_device(fn, sharding: Sharding | None, *args):
  """fn(*args) run by each device on its own rows and heads (`jax.shard_map` over the
  mesh), or as it is off a mesh. args: [B, T, H, D] arrays (split by row and head),
  [B, T] arrays (by row) or None; fn returns a [B, T, H, D] array. Rows and heads are
  independent in attention, so this is the same result, row for row, as one device's."""
  if sharding is None or sharding.mesh.size == 1:
    return fn(*args)
  heads = sharding.spec(("batch", None, "heads", None))
  rows = sharding.spec(("batch", None))
  specs = tuple(None if a is None else heads if a.ndim == 4 else rows for a in args)
  return jax.shard_map(fn, mesh=sharding.mesh, in_specs=specs, out_specs=heads,
                       check_vma=False)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def attend_det_kernel(q, k, v, q_index, q_segments, kv_segments, page_size, scale, kernel,
                      sharding=None):
  """`attend` in deterministic numerics, by the Pallas kernel `kernel` (see
  `_det_kernel_args`), per device on `sharding`'s mesh.

  The backward is the VJP of `attend`'s fast path (the same function; gradients need not
  be batch-invariant), as for the jnp path; XLA partitions it.
  """
  def call(q, k, v, q_index, q_segments, kv_segments):
    return det_kernels.det_attention(q, k, v, q_index, page_size=page_size, scale=scale,
                                     q_segments=q_segments, kv_segments=kv_segments,
                                     **_det_kernel_args(kernel))
  return per_device(call, sharding, q, k, v, q_index, q_segments, kv_segments)


def _attend_det_kernel_fwd(q, k, v, q_index, q_segments, kv_segments, page_size, scale, kernel,
                           sharding):
  out = attend_det_kernel(q, k, v, q_index, q_segments, kv_segments, page_size, scale, kernel,
                          sharding)
  return out, (q, k, v, q_index, q_segments, kv_segments)


def _attend_det_kernel_bwd(page_size, scale, kernel, sharding, residuals, g):
  del kernel, sharding
  q, k, v, q_index, q_segments, kv_segments = residuals
  _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, q_index, page_size=page_size,
                                          numerics=FAST, scale=scale, q_segments=q_segments,
                                          kv_segments=kv_segments), q, k, v)
  return (*vjp(g), None, None, None)


attend_det_kernel.defvjp(_attend_det_kernel_fwd, _attend_det_kernel_bwd)


def attend_paged_det_kernel(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                            page_table: jax.Array, positions: jax.Array, *, layer,
                            dtype, scale: float, kernel: str) -> jax.Array:
  """`attend_paged` in deterministic numerics by the Pallas kernel `kernel`: one layer's
  pages (`layer` of the stacked pools, raw bits or values) read in place by the kernel."""
  k_layer, v_layer = (as_values(pool[layer], dtype) for pool in (k_pool, v_pool))
  return det_kernels.det_paged_attention(q, k_layer, v_layer, page_table, positions,
                                         scale=scale, **_det_kernel_args(kernel))
