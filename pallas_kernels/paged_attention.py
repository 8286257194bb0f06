"""Decode paged attention: a Pallas kernel and the jnp reference it follows.

One query token per sequence attends over its paged KV cache. The kernel walks the same
fixed KV-block schedule as `rljax.block_attention.attend` (the path the CPU runs): block
j of row b holds absolute positions [j*P, (j+1)*P) and is one page, `page_table[b, j]`;
blocks are visited in order j = 0, 1, ... with an online softmax in f32 (running max m,
sum l, accumulator acc, rescaled by exp(m_old - m_new)), masked lanes scored -1e30 (the
reference's NEG) and given exactly zero probability.

Kernel design (written for the Pallas Triton lowering on GPUs; runs on CPU with
`interpret=True`):

* grid (B, Hkv): one program per (sequence, KV head). It takes that KV head's G query
  heads together as the rows of its dots (HF repeat_kv order: query head h uses KV head
  h // G), padded to a multiple of 16 rows because Triton's `tl.dot` needs tiles >= 16.
  Every program computes its rows alone, in a fixed order, so a row's result does not
  depend on the batch it sits in.
* q and out are blocked ([Gp, D] per program). The page pools, the page table and the
  lengths are whole refs (`memory_space=pl.ANY`, no blocking): the program reads its
  length and, in a `fori_loop` over ceil(length / P) blocks, the page id
  `page_table[b, j]`, then loads that page's [P, D] slice of K and V for its KV head by
  dynamic ref indexing (`k_ref[page, :, h, :]`, a strided pointer load under Triton).
  Only the pages that hold valid keys are read, which is the HBM traffic the GPU check
  counts. Triton has no scalar prefetch, hence the scalar loads from global refs.
* Dots: q @ k^T and p @ v with operands in the input dtype and f32 accumulation
  (`precision=HIGHEST`, so f32 inputs use IEEE fp32 rather than TF32 on GPUs); scores are
  scaled after the dot, and p is cast to v's dtype before p @ v, as in the reference's
  deterministic path (`_online_softmax_blocks`).

Triton constraints (not checked in interpret mode): D and P powers of two, P >= 16.
On TPU this kernel does not lower (Mosaic cannot load from `ANY` refs without DMAs);
`jax.experimental.pallas.ops.tpu.paged_attention` is the TPU kernel, and the tests use it
as an oracle.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.experimental.pallas as pl
from jax.experimental.pallas import triton as plgpu
import jax.numpy as jnp

from rljax import numerics as numerics_lib
from rljax.block_attention import NEG, attend, gather_blocks
from rljax.numerics import Numerics

ROW_TILE = 16  # Triton's minimum dot tile; the G query rows of a KV head are padded to it


def _kernel(lengths_ref, page_table_ref, q_ref, k_ref, v_ref, o_ref, *, scale: float):
  """One (sequence b, KV head h) program. q_ref, o_ref: [Gp, D]; the rest whole refs."""
  b = pl.program_id(0)
  h = pl.program_id(1)
  rows, d = q_ref.shape
  page_size = k_ref.shape[1]
  max_blocks = page_table_ref.shape[1]
  length = lengths_ref[b]
  num_blocks = jnp.minimum((length + page_size - 1) // page_size, max_blocks)
  q = q_ref[...]
  lane = lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)

  def block(j, carry):
    m, l, acc = carry
    page = page_table_ref[b, j]
    k = k_ref[page, :, h, :]  # [P, D]
    v = v_ref[page, :, h, :]
    s = lax.dot_general(q, k.astype(q.dtype), (((1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * scale  # [Gp, P]
    visible = j * page_size + lane < length
    s = jnp.where(visible, s, NEG)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)  # exactly 1 where the block does not raise the max
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)  # [Gp, D]
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

  init = (jnp.full((rows,), NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros((rows, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, num_blocks, block, init)
  out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]  # l == 0 only when length == 0: acc == 0
  o_ref[...] = out.astype(o_ref.dtype)


def _check(q, k_pages, v_pages, page_table, lengths):
  b, h, d = q.shape
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be "
                     "[num_pages, page_size, kv_heads, head_dim]")
  hkv = k_pages.shape[2]
  if h % hkv or k_pages.shape[3] != d:
    raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape}")
  if page_table.shape[0] != b or lengths.shape != (b,):
    raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} vs batch {b}")
  return b, h, d, hkv, h // hkv


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "num_warps", "num_stages"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                    page_table: jax.Array, lengths: jax.Array, *, scale: float,
                    interpret: bool = False, num_warps: int = 4,
                    num_stages: int = 2) -> jax.Array:
  """Decode attention of one query per sequence over its paged KV (Pallas kernel).

  q: [B, H, D]; k_pages, v_pages: [num_pages, P, Hkv, D] (H = Hkv * G); page_table:
  [B, max_blocks] int32 (block j of row b is page page_table[b, j]); lengths: [B] int32,
  the number of valid keys (query position + 1; 0 gives zeros; clipped to max_blocks * P).
  Only the ceil(length / P) pages holding valid keys are read; the lanes past `length` in
  the last of them must be finite (their p is 0, and 0 * inf is NaN), as in the reference.
  Returns [B, H, D] in q's dtype. num_warps / num_stages: Triton launch parameters.
  """
  b, h, d, hkv, g = _check(q, k_pages, v_pages, page_table, lengths)
  rows = -(-g // ROW_TILE) * ROW_TILE
  qg = q.reshape(b, hkv, g, d)
  if rows != g:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  whole = pl.BlockSpec(memory_space=pl.ANY)
  rows_spec = pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0))
  compiler_params = None if interpret else plgpu.CompilerParams(num_warps=num_warps,
                                                                num_stages=num_stages)
  out = pl.pallas_call(
      functools.partial(_kernel, scale=scale),
      grid=(b, hkv),
      in_specs=[whole, whole, rows_spec, whole, whole],
      out_specs=rows_spec,
      out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), q.dtype),
      interpret=interpret,
      compiler_params=compiler_params,
      name="paged_attention_decode",
  )(lengths.astype(jnp.int32), page_table.astype(jnp.int32), qg, k_pages, v_pages)
  return out[:, :, :g].reshape(b, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "numerics"))
def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, lengths: jax.Array, *, scale: float,
                              numerics: Numerics | str = "deterministic") -> jax.Array:
  """The same computation through `attend`, the attention the model runs (pure jnp; the CPU path).

  Gathers every block of the page table (`gather_blocks`) and attends with q at index
  lengths - 1. Rows with length 0 are set to zeros (in fast mode `attend` would return
  the mean of v over the fully masked row; in deterministic mode it already gives 0).
  """
  b, h, d, _, _ = _check(q, k_pages, v_pages, page_table, lengths)
  numerics = numerics_lib.get(numerics)
  k = gather_blocks(k_pages, page_table)
  v = gather_blocks(v_pages, page_table)
  q_index = (lengths.astype(jnp.int32) - 1)[:, None]
  out = attend(q.reshape(b, 1, h, d), k, v, q_index, page_size=k_pages.shape[1],
               numerics=numerics, scale=scale)[:, 0]
  return jnp.where((lengths > 0)[:, None, None], out, jnp.zeros_like(out))
