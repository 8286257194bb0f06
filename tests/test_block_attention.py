"""Deterministic attention on dots (rljax.block_attention): a query's output is the same
bits in a long packed row, alone, behind extra masked blocks and as a one-token decode
query; it agrees with the fast path to bf16 rounding; and its products are dots of one
fixed tile shape. Isolated like this, XLA:CPU's plain dots happen to be invariant too; the
whole-model checks, where fusion changes XLA's choice of dot kernel, are in
test_model_invariance.py and test_engine.py."""

import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.mosaic import compile_for_tpu
from tests.shapes import TINY
from rljax import block_attention
from rljax.model import ModelConfig, PagedKV, forward, init_params, scoring
from rljax.model.attention import raw_dtype
from rljax.numerics import Numerics

DET = Numerics("deterministic")
FAST = Numerics("fast")
P, H, HKV, D = 16, 4, 2, 128
SCALE = D ** -0.5


def _row(n, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=(1, n, h, D)), jnp.bfloat16)
             for h in (H, HKV, HKV))
  return q, k, v


def _attend(q, k, v, q_index, numerics, q_seg=None, kv_seg=None):
  return jax.jit(lambda q, k, v, i, qs, ks: block_attention.attend(
      q, k, v, i, page_size=P, numerics=numerics, scale=SCALE, q_segments=qs,
      kv_segments=ks))(q, k, v, q_index, q_seg, kv_seg)


def test_a_querys_output_is_the_same_bits_in_every_shape():
  # one 96-token row of two sequences (a page-aligned second one at 48): the training
  # forward's shape; then each probed query alone as a decode step over its sequence's
  # blocks, with one more block of garbage past it, and a prefill of a few queries
  q, k, v = _row(96)
  seg = jnp.asarray([[1] * 48 + [2] * 48], jnp.int32)
  pos = jnp.asarray([list(range(48)) * 2], jnp.int32)
  index = jnp.arange(96, dtype=jnp.int32)[None]
  full = np.asarray(_attend(q, k, v, index, DET, seg, seg))
  for t in (0, 7, 16, 30, 47, 48, 63, 95):
    start = 0 if t < 48 else 48
    i = t - start  # the query's position in its sequence
    blocks = -(-(i + 1) // P) + 1  # its blocks plus one past it
    ks, vs = k[:, start:start + blocks * P], v[:, start:start + blocks * P]
    pad = blocks * P - ks.shape[1]
    ks, vs = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=7.0)
              for x in (ks, vs))
    one = np.asarray(_attend(q[:, t:t + 1], ks, vs, jnp.asarray([[i]], jnp.int32), DET))
    np.testing.assert_array_equal(one[0, 0], full[0, t], err_msg=f"decode query {t}")
    lo = max(start, t - 4)  # a prefill chunk ending at t
    chunk = np.asarray(_attend(q[:, lo:t + 1], ks, vs, pos[:, lo:t + 1], DET))
    np.testing.assert_array_equal(chunk[0, -1], full[0, t], err_msg=f"prefill query {t}")
  assert pos.shape == seg.shape


def test_deterministic_attention_agrees_with_the_fast_path():
  # the same exact bf16 products summed in other orders (f32), exp to <= 2 ulp, and p
  # rounded to bf16 before p @ v in both: a p a few f32 ulps apart can round one bf16 step
  # (<= 2^-8 relative) apart, so the f32 outputs differ by <= 2^-8 * sum_j p_j |v_j| <=
  # 2^-8 max|v|; both are then rounded to bf16 (output <= max|v|, one bf16 ulp <= 2^-7 of
  # it): |diff| <= 3 * 2^-8 * max|v|
  q, k, v = _row(64, seed=1)
  index = jnp.arange(64, dtype=jnp.int32)[None]
  det, fast = (np.asarray(_attend(q, k, v, index, n), np.float32) for n in (DET, FAST))
  bound = 3 * 2.0 ** -8 * float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  assert np.abs(det - fast).max() <= bound


def test_fast_attention_one_kv_head_at_a_time_matches_the_batched_heads():
  # the same per-head dots, batched differently: XLA:CPU may sum a row in another order
  # (f32), so outputs rounded to bf16 can sit one bf16 step apart (rtol 2^-7; atol for
  # f32 differences near zero, 1e-5 of max|v|); gradients likewise, against their largest
  # (2^-7 of it). Swapping two KV heads moves both by 10-30% of their largest value.
  q, k, v = _row(64, seed=4)
  seg = jnp.asarray([[1] * 32 + [2] * 32], jnp.int32)
  index = jnp.asarray([list(range(32)) * 2], jnp.int32)
  v_max = float(jnp.max(jnp.abs(v.astype(jnp.float32))))

  def run(per_kv_head, q, k, v, index, seg):
    return block_attention.attend(q, k, v, index, page_size=P, numerics=FAST, scale=SCALE,
                                  q_segments=seg, kv_segments=seg, per_kv_head=per_kv_head)

  f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)  # noqa: E731
  # a packed row of two sequences, and a one-token decode query over its sequence's keys
  for args in ((q, k, v, index, seg), (q[:, 40:41], k[:, 32:], v[:, 32:], index[:, 40:41] - 32,
                                       seg[:, 40:41])):
    per_head, batched = (f32(jax.jit(functools.partial(run, f))(*args)) for f in (True, False))
    chex.assert_trees_all_close(per_head, batched, rtol=2 ** -7, atol=1e-5 * v_max)
  loss = lambda f: lambda q, k, v: jnp.sum(  # noqa: E731
      run(f, q, k, v, index, seg).astype(jnp.float32) * jnp.arange(D, dtype=jnp.float32))
  per_head, batched = (f32(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v))
                       for f in (True, False))
  for a, b in zip(per_head, batched):
    np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=2 ** -7 * np.abs(b).max())


def test_deterministic_attention_runs_on_fixed_shape_dots():
  # the scores and p @ v are dots of (8 x D) @ (D x page) and (8 x page) @ (page x D)
  # tiles, batched, with f32 operands (bf16 values): no elementwise product trees
  q, k, v = _row(64, seed=2)
  index = jnp.arange(64, dtype=jnp.int32)[None]
  hlo = jax.jit(lambda q, k, v, i: block_attention.attend(
      q, k, v, i, page_size=P, numerics=DET, scale=SCALE)).lower(q, k, v, index).compile(
      ).as_text()
  rt = block_attention.ROW_TILE
  dots = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", hlo)
  assert any(s.endswith(f"{rt},{P}") for s in dots), dots  # scores
  assert any(s.endswith(f"{rt},{D}") for s in dots), dots  # p @ v


def test_the_model_runs_deterministic_attention_on_the_configured_kernel():
  # the tiny policy with `det_attention="pallas_interpret"` (the GPU kernel interpreted):
  # packed training forward and one-token paged decode steps over scrambled pages give the
  # jnp path's log-prob bits, and training gradients flow (the fast path's VJP); lowered
  # for a TPU with "pallas_tpu", the kernel is in the program
  base = ModelConfig(**TINY).resolved("cpu", DET)
  params = init_params(base, jax.random.key(0))
  rng = np.random.default_rng(3)
  seqs = [rng.integers(1, base.vocab_size, size=n) for n in (9, 17, 30)]
  kernel = dataclasses.replace(base, det_attention="pallas_interpret")
  jnp_lp = scoring.packed_logprobs(params, seqs, cfg=base, numerics=DET, row_len=64)
  for lps in (scoring.packed_logprobs(params, seqs, cfg=kernel, numerics=DET, row_len=64),
              scoring.paged_decode_logprobs(params, seqs, cfg=kernel, numerics=DET,
                                            shuffle_pages_seed=2)):
    assert scoring.max_abs_diff(lps, jnp_lp) == 0.0
  tokens = jnp.asarray(rng.integers(1, base.vocab_size, size=(1, 32)), jnp.int32)
  positions = jnp.arange(32, dtype=jnp.int32)[None]
  loss = lambda p, cfg: -jnp.sum(forward(  # noqa: E731
      p, tokens, positions, cfg=cfg, numerics=DET, targets=tokens).logprobs)
  grads = {c: jax.jit(jax.grad(loss), static_argnums=1)(params, cfg)
           for c, cfg in (("jnp", base), ("kernel", kernel))}
  chex.assert_trees_all_equal(grads["kernel"], grads["jnp"])
  tpu = dataclasses.replace(base, det_attention="pallas_tpu", head_dim=128)
  tpu_params = jax.eval_shape(lambda: init_params(tpu, jax.random.key(0)))
  lowered = jax.jit(lambda p: forward(p, tokens, positions, cfg=tpu, numerics=DET).logits
                    ).trace(tpu_params).lower(lowering_platforms=("tpu",))
  assert "tpu_custom_call" in lowered.as_text()
  # and a decode step over the engine's pools (raw bits)
  pool = jax.ShapeDtypeStruct((tpu.num_hidden_layers, 9, tpu.page_size, tpu.num_key_value_heads,
                               tpu.head_dim), jnp.uint16)
  kv = PagedKV(pool, pool, jax.ShapeDtypeStruct((2, 4), jnp.int32))
  step = jax.jit(lambda p, kv: forward(p, tokens[:, :2].T, positions[:, :2].T, cfg=tpu,
                                       numerics=DET, kv=kv).logits)
  assert "tpu_custom_call" in step.trace(tpu_params, kv).lower(
      lowering_platforms=("tpu",)).as_text()


# TINY at a head_dim the TPU attention kernel takes (a multiple of 128), resolved for a TPU
# in deterministic mode: "auto" picks both Pallas TPU kernels
TPU_TINY = ModelConfig(**{**TINY, "head_dim": 128})


def _int32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.int32)


def test_deterministic_mode_on_tpu_trains_on_the_kernels():
  # the GRPO learner's step on the tiny policy: packed rows' log-probs and their gradients,
  # compiled for one TPU chip; the program holds both kernels. One 2,048-token row and 32
  # query heads over 4 KV heads (Qwen3-30B-A3B's): at these shapes libtpu 0.0.42.1 aborted
  # the compile while a tile's last visible block was a reduce (pallas_kernels.det_attention)
  assert (TPU_TINY.resolved("tpu", DET).det_attention,
          TPU_TINY.resolved("tpu", DET).expert_kernel) == ("pallas_tpu", "pallas_tpu")
  cfg = dataclasses.replace(TPU_TINY, num_attention_heads=32, num_key_value_heads=4,
                            max_position_embeddings=2048).resolved("tpu", DET)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))

  def loss(p, tokens, positions, segments):
    return -jnp.sum(forward(p, tokens, positions, cfg=cfg, numerics=DET,
                            segment_ids=segments, targets=tokens).logprobs)

  text = compile_for_tpu(jax.value_and_grad(loss), params, *[_int32(1, 2048)] * 3).as_text()
  assert "det_attention_tpu" in text and "grouped_matmul_tpu" in text


@pytest.mark.parametrize("new_tokens", [1, 16])  # a decode step, a prefill chunk
def test_deterministic_mode_on_tpu_decodes_on_the_kernels(new_tokens):
  # the engine's forward over raw-bit page pools (paged attention kernel, routed tiles on
  # the grouped matmul kernel), compiled for one TPU chip
  cfg = TPU_TINY.resolved("tpu", DET)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  pool = jax.ShapeDtypeStruct((cfg.num_hidden_layers, 9, cfg.page_size,
                               cfg.num_key_value_heads, cfg.head_dim), raw_dtype(jnp.bfloat16))
  kv = PagedKV(pool, pool, _int32(2, 4))

  def step(p, tokens, positions, kv):
    out = forward(p, tokens, positions, cfg=cfg, numerics=DET, kv=kv)
    return out.logits, out.kv

  text = compile_for_tpu(step, params, _int32(2, new_tokens), _int32(2, new_tokens),
                         kv).as_text()
  assert "det_attention_tpu" in text and "grouped_matmul_tpu" in text


def test_query_chunks_give_the_same_bits_and_gradients():
  """A long row is attended `query_chunk` queries at a time (rematerialised). Deterministic
  numerics: the outputs and the queries' gradients are the same bits as one call over all
  queries (each query's dots are the same per-tile dots; its gradient involves its own row
  only). Key and value gradients sum over queries: per chunk in f32, then across chunks,
  another order than one dot over all queries, each rounded to bf16 once, so they may differ
  by one bf16 ulp at their scale (2^-7 of the largest; measured: 12-19% of elements one ulp
  apart). Fast numerics the same, its outputs within f32 rounding (atol 1e-6; measured 0).
  96 queries in chunks of 40 also checks the padded last chunk (3 chunks of 32)."""
  q, k, v = _row(96, seed=3)
  seg = jnp.asarray([[1] * 48 + [2] * 32 + [0] * 16], jnp.int32)
  index = jnp.arange(96, dtype=jnp.int32)[None]

  def run(numerics, chunk):
    def loss(q, k, v):
      out = block_attention.attend(q, k, v, index, page_size=P, numerics=numerics,
                                   scale=SCALE, q_segments=seg, kv_segments=seg,
                                   query_chunk=chunk)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(D))), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in grads]

  def assert_grads_close(got, want, what):
    np.testing.assert_array_equal(got[0], want[0], err_msg=f"{what}: dq")
    for name, a, b in zip("kv", got[1:], want[1:]):
      np.testing.assert_allclose(a, b, rtol=0, atol=2.0 ** -7 * np.abs(b).max(),
                                 err_msg=f"{what}: d{name}")

  whole, grads = run(DET, 512)
  for chunk in (16, 40):
    out, chunk_grads = run(DET, chunk)
    np.testing.assert_array_equal(out, whole, err_msg=f"chunk {chunk}")
    assert_grads_close(chunk_grads, grads, f"deterministic, chunk {chunk}")
  fast_whole, fast_grads = run(FAST, 512)
  fast_out, fast_chunk_grads = run(FAST, 16)
  np.testing.assert_allclose(fast_out, fast_whole, atol=1e-6, rtol=0)
  assert_grads_close(fast_chunk_grads, fast_grads, "fast, chunk 16")
