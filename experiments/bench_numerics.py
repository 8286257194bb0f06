"""Deterministic vs fast numerics: exactness and cost, side by side in one run.

Workload (configs/tiny_moe.py, bf16): a training step = jitted value_and_grad of the
masked mean NLL over 8 packed rows of 128 tokens; a decode step = one token for each of
32 slots over a paged KV cache (8 pages of 16 per slot, 40 tokens already cached).
Exactness: 8 sequences (lengths 9..70) decoded one token at a time through the paged
engine path vs the training forward; max |log-prob difference| over all tokens.
Timing: the two modes alternate (A B A B ...), each sample is the median of a few calls,
and the reported ratio is the median of per-pair ratios. `rljax_xla_flags_cost_fast_train`
is fast-mode train step time with / without all of the process-wide XLA flags that
rljax sets (alternating child processes; the "without" child puts XLA_FLAGS back as it
found it after `import rljax` appended them, before JAX starts, and reports whether XLA
then contracts a*b+c into an FMA, which the flags forbid). Last line: one JSON object.
"""

import os
import sys

# `import rljax` appends its flags to XLA_FLAGS; XLA reads them when the backend starts.
_XLA_FLAGS_BEFORE_RLJAX = os.environ.get("XLA_FLAGS")
import rljax  # noqa: E402,F401  (XLA flags first)
if "--child_without_rljax_flags" in sys.argv:
  if _XLA_FLAGS_BEFORE_RLJAX is None:
    del os.environ["XLA_FLAGS"]
  else:
    os.environ["XLA_FLAGS"] = _XLA_FLAGS_BEFORE_RLJAX

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import tiny_moe  # noqa: E402
from experiments import machine_info  # noqa: E402
from rljax.model import ModelConfig, PagedKV, forward, init_params, scoring  # noqa: E402
from rljax.model.packing import pack  # noqa: E402
from rljax.model.params import cast, scale_matrices  # noqa: E402
from rljax.numerics import Numerics  # noqa: E402

_PAIRS = flags.DEFINE_integer("pairs", 15, "interleaved A/B timing pairs")
_CALLS = flags.DEFINE_integer("calls", 3, "calls per timing sample (median taken)")
_ROUNDS = flags.DEFINE_integer("flag_rounds", 3, "child-process pairs for the flags' cost")
# The flags rljax installs apply to the whole process, fast mode included. To show what
# they cost, child processes with and without them alternate, timing fast train steps.
_CHILD = flags.DEFINE_bool("child_fast_train", False,
                           "internal: time fast train steps, print one JSON line")
_CHILD_WITHOUT = flags.DEFINE_bool("child_without_rljax_flags", False,
                                   "internal: with --child_fast_train, XLA's default flags")


def _params(cfg):
  p = init_params(cfg, jax.random.key(0), "float32")  # sharpen: x10 on matrices
  return cast(scale_matrices(p, 10.0), cfg.param_dtype)


def _decode_vs_train(cfg, params, numerics, seqs):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  train = scoring.packed_logprobs(params, seqs, cfg=cfg, numerics=numerics, row_len=128)
  decode = scoring.paged_decode_logprobs(params, seqs, cfg=cfg, numerics=numerics,
                                         shuffle_pages_seed=1)
  return scoring.max_abs_diff(train, decode)


def _train_step(cfg, numerics):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  rng = np.random.default_rng(2)
  seqs = [rng.integers(1, cfg.vocab_size, size=int(n)) for n in rng.integers(20, 60, size=16)]
  p = pack(seqs, 128, cfg.page_size, num_rows=8)
  mask = (p.segment_ids > 0).astype(np.float32)
  batch = (p.tokens, p.positions, p.segment_ids, scoring.next_token_targets(p.tokens), mask)

  def loss(params, batch):
    tokens, positions, segs, targets, mask = batch
    lp = forward(params, tokens, positions, cfg=cfg, numerics=numerics, segment_ids=segs,
                 targets=targets).logprobs
    return -jnp.sum(lp * mask) / jnp.sum(mask)

  fn = jax.jit(jax.value_and_grad(loss))
  return lambda params: fn(params, batch)


def _decode_step(cfg, numerics, slots=32, cached=40, pages_per_slot=8):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  table = 1 + np.arange(slots * pages_per_slot).reshape(slots, pages_per_slot)
  shape = (cfg.num_hidden_layers, 1 + slots * pages_per_slot, cfg.page_size,
           cfg.num_key_value_heads, cfg.head_dim)
  rng = np.random.default_rng(3)
  kv = PagedKV(jnp.asarray(rng.standard_normal(shape), cfg.compute_dtype),
               jnp.asarray(rng.standard_normal(shape), cfg.compute_dtype),
               jnp.asarray(table, jnp.int32))
  tokens = rng.integers(1, cfg.vocab_size, size=(slots, 1)).astype(np.int32)
  pos = np.full((slots, 1), cached, np.int32)
  fn = jax.jit(lambda prm, kv: forward(prm, tokens, pos, cfg=cfg, numerics=numerics, kv=kv,
                                       targets=tokens))
  return lambda params: fn(params, kv)


def _time(fn, params, calls):
  samples = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def _ratio(make, cfg, params, pairs, calls):
  det, fast = make(cfg, Numerics("deterministic")), make(cfg, Numerics("fast"))
  for fn in (det, fast):
    jax.block_until_ready(fn(params))  # compile
  ratios, t_det, t_fast = [], [], []
  for _ in range(pairs):
    a, b = _time(det, params, calls), _time(fast, params, calls)
    ratios.append(a / b)
    t_det.append(a)
    t_fast.append(b)
  return statistics.median(ratios), statistics.median(t_det), statistics.median(t_fast)


def _fma_contracted() -> bool:
  """Whether XLA fuses a*b+c into one FMA here (rljax's --xla_cpu_max_isa=AVX forbids it)."""
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
  fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
  return not np.array_equal(fused, (a * b).astype(np.float32) + c)


def _child_fast_train(cfg, params):
  fn = _train_step(cfg, Numerics("fast"))
  jax.block_until_ready(fn(params))
  ms = 1e3 * statistics.median(_time(fn, params, _CALLS.value) for _ in range(_PAIRS.value))
  print(json.dumps({"ms": ms, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "fma_contracted": _fma_contracted()}))


def _flags_cost(rounds):
  """Median over alternating child processes of fast train step time, rljax flags on/off,
  and the "off" children's evidence that the flags were off."""
  env = dict(os.environ)  # this process's XLA_FLAGS has rljax's: start children without
  env.pop("XLA_FLAGS")
  if _XLA_FLAGS_BEFORE_RLJAX is not None:
    env["XLA_FLAGS"] = _XLA_FLAGS_BEFORE_RLJAX
  ratios, off = [], []
  for _ in range(rounds):
    times = []
    for extra in ([], ["--child_without_rljax_flags"]):
      out = subprocess.run([sys.executable, __file__, "--child_fast_train",
                            f"--pairs={_PAIRS.value}", f"--calls={_CALLS.value}", *extra],
                           env=env, capture_output=True, text=True, check=True).stdout
      child = json.loads(out.strip().splitlines()[-1])
      times.append(child["ms"])
      if extra:
        off.append(child)
    ratios.append(times[0] / times[1])
  if any(flag.split("=")[0] in c["xla_flags"] for c in off for flag in rljax.REQUIRED_XLA_FLAGS):
    raise AssertionError(f"a child meant to run without rljax's flags had them: {off}")
  return statistics.median(ratios), all(c["fma_contracted"] for c in off)


def main(_):
  # resolved for deterministic numerics: both modes measured on the same (reference) paths
  cfg = ModelConfig.from_dict(tiny_moe.get_config().model.to_dict()).resolved(
      jax.default_backend(), "deterministic")
  params = _params(cfg)
  if _CHILD.value:
    _child_fast_train(cfg, params)
    return
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, cfg.vocab_size, size=n) for n in (9, 16, 17, 33, 40, 51, 64, 70)]
  det_diff = _decode_vs_train(cfg, params, Numerics("deterministic"), seqs)
  fast_diff = _decode_vs_train(cfg, params, Numerics("fast"), seqs)
  train, t_train_det, t_train_fast = _ratio(_train_step, cfg, params, _PAIRS.value, _CALLS.value)
  dec, t_dec_det, t_dec_fast = _ratio(_decode_step, cfg, params, _PAIRS.value, _CALLS.value)
  flags_cost, without_fma = _flags_cost(_ROUNDS.value)
  print(json.dumps({
      "workload": "tiny_moe bf16; train: fwd+bwd 8x128 packed; decode: 32 slots x 1 token, "
                  "40 cached; exactness: 8 seqs (9..70 tokens) paged decode vs train forward",
      "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
      "det_max_abs_logprob_diff": det_diff,
      "fast_max_abs_logprob_diff": fast_diff,
      "det_over_fast_train_step": round(train, 3),
      "det_over_fast_decode_step": round(dec, 3),
      "train_step_ms": {"det": round(1e3 * t_train_det, 2), "fast": round(1e3 * t_train_fast, 2)},
      "decode_step_ms": {"det": round(1e3 * t_dec_det, 2), "fast": round(1e3 * t_dec_fast, 2)},
      "rljax_xla_flags_cost_fast_train": round(flags_cost, 3),
      "without_flags_child_fma_contracted": without_fma,
      "pairs": _PAIRS.value,
      "machine": machine_info.machine(),
  }))


if __name__ == "__main__":
  app.run(main)
