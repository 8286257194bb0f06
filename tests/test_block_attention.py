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

from tests.shapes import TINY
from rljax import block_attention
from rljax.model import ModelConfig, PagedKV, forward, init_params, scoring
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
