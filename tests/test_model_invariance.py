"""The numerics contract: deterministic mode gives the same bits for a token's log-prob
however it is computed (packed, alone, prefix, incremental decode, replayed, jitted or
not, inside a training step or not). Fast mode reports its differences instead."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.model import PagedKV, forward, scoring
from rljax.model.packing import pack, unpack
from rljax.numerics import Numerics

DET, FAST = Numerics("deterministic"), Numerics("fast")
ROW = 64


def _sequences(n, lengths, vocab, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, size=l).astype(np.int32) for l in lengths[:n]]


def _targets(tokens):
  return np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)


@functools.lru_cache(maxsize=None)
def _jitted(cfg, numerics):
  def run(params, tokens, positions, segments, targets):
    return forward(params, tokens, positions, cfg=cfg, numerics=numerics,
                   segment_ids=segments, targets=targets).logprobs
  return jax.jit(run)


def _packed_logprobs(params, cfg, numerics, seqs, num_rows=None, row_len=ROW):
  p = pack(seqs, row_len, cfg.page_size, num_rows=num_rows)
  lp = _jitted(cfg, numerics)(params, p.tokens, p.positions, p.segment_ids, _targets(p.tokens))
  return [x[:-1] for x in unpack(np.asarray(lp), p)]  # the last target crosses a boundary


def _max_diff(a, b):
  return scoring.max_abs_diff(a, b)  # NaN anywhere -> NaN (Python's max would hide it)


def _check(numerics, expected, actual, what):
  if numerics.deterministic:
    chex.assert_trees_all_equal(expected, actual)
  else:
    d = _max_diff(expected, actual)
    print(f"fast mode, {what}: max |dlogprob| = {d:.3g}")
    assert np.isfinite(d) and d < 0.5


@pytest.mark.parametrize("numerics", [DET, FAST], ids=["det", "fast"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_packed_equals_alone(tiny_cfg, tiny_params, numerics, batch):
  seqs = _sequences(12, [37, 20, 9, 16, 30, 5, 44, 17, 26, 12, 3, 40], tiny_cfg.vocab_size)
  alone = [_packed_logprobs(tiny_params, tiny_cfg, numerics, [s], num_rows=1)[0] for s in seqs]
  # `batch` rows, the sequences spread over them with different neighbours and offsets
  packed = []
  for start in range(0, len(seqs), 2 * batch):
    packed += _packed_logprobs(tiny_params, tiny_cfg, numerics, seqs[start:start + 2 * batch],
                               num_rows=batch, row_len=128)
  _check(numerics, alone, packed, f"packed in batch {batch} vs alone")


@pytest.mark.parametrize("numerics", [DET, FAST], ids=["det", "fast"])
def test_prefix_equals_full(tiny_cfg, tiny_params, numerics):
  (seq,) = _sequences(1, [50], tiny_cfg.vocab_size, seed=1)
  full = _packed_logprobs(tiny_params, tiny_cfg, numerics, [seq], num_rows=1)[0]
  prefixes = []
  for n in (2, 15, 16, 17, 33, 49):
    lp = _packed_logprobs(tiny_params, tiny_cfg, numerics, [seq[:n]], num_rows=1)[0]
    prefixes.append((lp, full[:n - 1]))
  _check(numerics, [p for p, _ in prefixes], [f for _, f in prefixes], "prefix vs full")


def _decode_logprobs(params, cfg, numerics, seqs, prefill, page_tables, num_pages=24):
  """Prefill `prefill` tokens of every row, then one token per step; the paged engine path."""
  b = len(seqs)
  n = max(len(s) for s in seqs)
  tokens = np.zeros((b, n), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  targets = _targets(tokens)
  shape = (cfg.num_hidden_layers, num_pages, cfg.page_size, cfg.num_key_value_heads, cfg.head_dim)
  kv = PagedKV(jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype),
               jnp.asarray(page_tables, jnp.int32))
  step = jax.jit(lambda p, t, pos, kv, tg: forward(p, t, pos, cfg=cfg, numerics=numerics, kv=kv,
                                                   targets=tg))
  out = np.zeros((b, n), np.float32)
  spans = [(0, prefill)] + [(i, i + 1) for i in range(prefill, n)]
  for lo, hi in spans:
    pos = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (b, hi - lo)).copy()
    lengths = np.array([len(s) for s in seqs])[:, None]
    pos = np.where(pos < lengths, pos, -1)  # finished rows write to the null page
    res = step(params, tokens[:, lo:hi], pos, kv, targets[:, lo:hi])
    kv = res.kv
    out[:, lo:hi] = np.asarray(res.logprobs)
  return [out[i, :len(s) - 1] for i, s in enumerate(seqs)]


@pytest.mark.parametrize("numerics", [DET, FAST], ids=["det", "fast"])
@pytest.mark.parametrize("prefill", [1, 20])
def test_incremental_decode_equals_full(tiny_cfg, tiny_params, numerics, prefill):
  seqs = _sequences(3, [45, 30, 38], tiny_cfg.vocab_size, seed=2)
  full = [_packed_logprobs(tiny_params, tiny_cfg, numerics, [s], num_rows=1)[0] for s in seqs]
  # scrambled, disjoint pages per row; unused blocks point at the null page 0
  tables = [[7, 3, 11, 0], [2, 19, 0, 0], [23, 5, 14, 0]]
  dec = _decode_logprobs(tiny_params, tiny_cfg, numerics, seqs, prefill, tables)
  _check(numerics, full, dec, f"decode (prefill {prefill}) vs training forward")


@pytest.mark.parametrize("numerics", [DET, FAST], ids=["det", "fast"])
def test_replaying_own_routing_changes_nothing(tiny_cfg, tiny_params, numerics):
  seqs = _sequences(4, [40, 22, 17, 30], tiny_cfg.vocab_size, seed=3)
  p = pack(seqs, ROW, tiny_cfg.page_size)
  run = jax.jit(lambda params, routing: forward(
      params, p.tokens, p.positions, cfg=tiny_cfg, numerics=numerics, segment_ids=p.segment_ids,
      targets=_targets(p.tokens), routing=routing))
  first = run(tiny_params, None)
  assert first.routing.shape == p.tokens.shape + (len(tiny_cfg.moe_layers()),
                                                  tiny_cfg.num_experts_per_tok)
  replayed = run(tiny_params, first.routing)
  chex.assert_trees_all_equal(first.logprobs, replayed.logprobs)
  chex.assert_trees_all_equal(first.routing, replayed.routing)


def test_jit_equals_eager(tiny_cfg, tiny_params):
  seqs = _sequences(3, [33, 18, 12], tiny_cfg.vocab_size, seed=4)
  p = pack(seqs, ROW, tiny_cfg.page_size)
  args = (tiny_params, p.tokens, p.positions)
  kwargs = dict(cfg=tiny_cfg, numerics=DET, segment_ids=p.segment_ids, targets=_targets(p.tokens))
  eager = forward(*args, **kwargs).logprobs
  jitted = jax.jit(lambda *a: forward(*a, **kwargs).logprobs)(*args)
  chex.assert_trees_all_equal(eager, jitted)


def test_training_graph_equals_forward_graph(tiny_cfg, tiny_params):
  """The log-probs inside a jitted value_and_grad are the forward-only graph's bits."""
  seqs = _sequences(3, [33, 18, 12], tiny_cfg.vocab_size, seed=5)
  p = pack(seqs, ROW, tiny_cfg.page_size)
  kwargs = dict(cfg=tiny_cfg, numerics=DET, segment_ids=p.segment_ids, targets=_targets(p.tokens))

  def loss(params):
    lp = forward(params, p.tokens, p.positions, **kwargs).logprobs
    return -jnp.sum(lp * (p.segment_ids > 0)), lp

  (_, lp_train), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(tiny_params)
  lp_fwd = jax.jit(lambda params: forward(params, p.tokens, p.positions, **kwargs).logprobs)(
      tiny_params)
  chex.assert_trees_all_equal(lp_train, lp_fwd)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("scale", [1.0, 1.05])
def test_target_logprob_graph_equals_logits_graph(tiny_cfg, tiny_params, scale):
  """Returning only target log-probs lets XLA fuse the LM head with its neighbours (a YNN
  dot fusion); it must not change the bits (caught once: 1e-2 without the rljax flag).
  Checked to fail under --xla_cpu_experimental_ynn_fusion_type=dot."""
  params = jax.tree.map(lambda x: (x * scale).astype(x.dtype), tiny_params)
  seqs = _sequences(3, [57, 18, 12], tiny_cfg.vocab_size, seed=7)
  p = pack(seqs, 128, tiny_cfg.page_size)
  targets = _targets(p.tokens)
  kwargs = dict(cfg=tiny_cfg, numerics=DET, segment_ids=p.segment_ids)
  lp = jax.jit(lambda prm: forward(prm, p.tokens, p.positions, targets=targets, **kwargs).logprobs)(
      params)
  logits = forward(params, p.tokens, p.positions, **kwargs).logits  # eager: nothing fused
  manual = jnp.take_along_axis(DET.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  chex.assert_trees_all_equal(lp, manual)


def test_logits_at_one_position_are_that_positions_bits(tiny_cfg, tiny_params):
  """forward(logits_at=...) (the engine's prefill: the head on one position per row) gives,
  in deterministic numerics, the bits of the full forward's logits at those positions."""
  seqs = _sequences(3, [57, 18, 12], tiny_cfg.vocab_size, seed=11)
  p = pack(seqs, 64, tiny_cfg.page_size)  # two rows
  at = jnp.asarray([56, 40], jnp.int32)
  kwargs = dict(cfg=tiny_cfg, numerics=DET, segment_ids=p.segment_ids)
  run = jax.jit(lambda prm, at: forward(prm, p.tokens, p.positions, logits_at=at,
                                        **kwargs).logits)
  full = jax.jit(lambda prm: forward(prm, p.tokens, p.positions, **kwargs).logits)(tiny_params)
  picked = run(tiny_params, at)
  assert picked.shape == (p.tokens.shape[0], 1, tiny_cfg.vocab_size)
  chex.assert_trees_all_equal(picked[:, 0], jnp.take_along_axis(full, at[:, None, None],
                                                                axis=1)[:, 0])


@pytest.mark.parametrize("numerics", [DET, FAST], ids=["det", "fast"])
def test_entropy_is_the_softmax_entropy_and_leaves_the_logprobs_bitwise(tiny_cfg, tiny_params,
                                                                        numerics):
  """forward(entropy=True): the entropy of softmax(logits / temperature) per position,
  from the log-softmax the log-probs come from; asking for it changes no log-prob bit.
  Against float64 numpy on the same logits: rtol 1e-5 (f32 log-softmax, exp within 2 ulp
  in deterministic mode, an f32 sum over 128 terms: ~1e-6 relative; measured 3.5e-7)."""
  seqs = _sequences(3, [33, 18, 12], tiny_cfg.vocab_size, seed=9)
  p = pack(seqs, ROW, tiny_cfg.page_size)
  temperature = 0.7
  kwargs = dict(cfg=tiny_cfg, numerics=numerics, segment_ids=p.segment_ids,
                temperature=temperature)
  run = lambda **kw: jax.jit(lambda prm: forward(prm, p.tokens, p.positions, **kwargs, **kw))(  # noqa: E731
      tiny_params)
  with_entropy = run(targets=_targets(p.tokens), entropy=True)
  without = run(targets=_targets(p.tokens))
  assert without.entropy is None and with_entropy.logits is None
  chex.assert_trees_all_equal(with_entropy.logprobs, without.logprobs)
  logits = run(entropy=True)  # no targets: the logits and their entropy
  chex.assert_trees_all_equal(logits.entropy, with_entropy.entropy)
  z = np.asarray(logits.logits, np.float64) / temperature
  z -= z.max(axis=-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
  expected = -(np.exp(logp) * logp).sum(axis=-1)
  assert with_entropy.entropy.dtype == jnp.float32
  assert with_entropy.entropy.shape == p.tokens.shape
  np.testing.assert_allclose(np.asarray(with_entropy.entropy), expected, rtol=1e-5)


def test_fast_and_det_agree_closely(tiny_cfg, tiny_params):
  """Both modes compute the same function; bf16 rounding bounds the difference."""
  seqs = _sequences(4, [40, 22, 17, 30], tiny_cfg.vocab_size, seed=6)
  det = _packed_logprobs(tiny_params, tiny_cfg, DET, seqs)
  fast = _packed_logprobs(tiny_params, tiny_cfg, FAST, seqs)
  # bf16 activations carry ~3 significant digits; routing flips on near-ties move a
  # token's log-prob by more, so compare the bulk of tokens, not the worst one.
  diffs = np.concatenate([np.abs(a - b) for a, b in zip(det, fast)])
  assert np.median(diffs) < 0.05, np.median(diffs)


def test_scoring_helpers_agree_bitwise(tiny_cfg, tiny_params):
  seqs = _sequences(4, [9, 33, 17, 40], tiny_cfg.vocab_size, seed=8)
  train = scoring.packed_logprobs(tiny_params, seqs, cfg=tiny_cfg, numerics=DET, row_len=64)
  decode = scoring.paged_decode_logprobs(tiny_params, seqs, cfg=tiny_cfg, numerics=DET,
                                         shuffle_pages_seed=3)
  chex.assert_trees_all_equal(train, decode)
  assert [len(x) for x in train] == [8, 32, 16, 39]


def test_default_experiment_runs_end_to_end():
  """`make run`'s experiment, as a subprocess: its last line is JSON with exact agreement."""
  import json, pathlib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  root = pathlib.Path(__file__).parent.parent
  proc = subprocess.run([sys.executable, "experiments/run_default.py"], cwd=root,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["max_abs_logprob_diff_train_vs_decode"] == 0.0 and out["tokens"] > 0
