"""Deterministic vs fast numerics: exactness and cost, side by side in one run.

Workload (`--config`, default configs/tiny_moe.py; configs/sparse_moe_tiny.py has
Qwen3-30B-A3B's 128 experts top-8; bf16): a training step = jitted value_and_grad of the
masked mean NLL over 8 packed rows of 128 tokens; a decode step = one token for each of
32 slots over a paged KV cache (8 pages of 16 per slot, 40 tokens already cached).
Exactness: 8 sequences (lengths 9..70) decoded one token at a time through the paged
engine path vs the training forward; max |log-prob difference| over all tokens.
Timing: the two modes alternate (A B A B ...), each sample is the median of a few calls,
and the reported ratio is the median of per-pair ratios. This process runs both modes, so
it installs the deterministic XLA flags first. Child processes alternate to show what a
fast-mode process gains by not having them: `det_xla_flags_cost_fast_train` is the fast
bf16 train step in a child with the flags over one without (a fast-mode process, which
also reports whether XLA contracted a*b+c into an FMA, which the flags forbid).
`fast_f32_over_bf16`: in the fast-mode children, train and decode steps with f32
activations and matmuls over bf16 ones (the same bf16 weights; what `ModelConfig.dtype =
"auto"` chooses between on a CPU).
Expert paths: `routed_over_dense` is the train step with the routed-only tiles
(`train_experts="tiled"`) over the dense all-experts path, in each mode, and the fast
decode step at 256 slots (`engine_experts`), and the whole fast engine generating for 256
requests at once (16-token prompts, 32 new tokens: `fast_engine_256_slots`, tokens/s);
the fast-mode figures come from a fast-mode child process (no deterministic flags, as in
a fast run), and the engine's also from this process, with the flags
(`..._with_det_flags`);
`expert_flops` counts each path's expert matmul FLOPs per train step (dense: every expert
for every token; tiled: the tiles the plan allows), and `xla_flops` is XLA's cost analysis
of each whole step. `qwen3_30b_a3b_moe_layer_flops_over_routed_4096_tokens`: one MoE
layer of that model's shape on 4,096 tokens, XLA's FLOPs over the routed expert FLOPs, per
mode. Last line: one JSON object.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from configs import qwen3_30b_a3b
from experiments import machine_info
from rljax import aot
from rljax import numerics as numerics_lib
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.model import ModelConfig, PagedKV, forward, init_params, scoring
from rljax.model.attention import raw_dtype
from rljax.model.packing import pack
from rljax.model.params import cast, scale_matrices
from rljax.numerics import Numerics

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny_moe.py",
                                          "the policy (its `model` block) to measure")
_PAIRS = flags.DEFINE_integer("pairs", 15, "interleaved A/B timing pairs")
_CALLS = flags.DEFINE_integer("calls", 3, "calls per timing sample (median taken)")
_ROUNDS = flags.DEFINE_integer("flag_rounds", 3, "child-process pairs for the flags' cost")
_CHILD = flags.DEFINE_enum("child", None, ["fast_process", "with_det_flags", "fast_paths"],
                           "internal: time fast steps in bf16 and f32, print one JSON line")


def _params(cfg):
  p = init_params(cfg, jax.random.key(0), "float32")  # sharpen: x10 on matrices
  return cast(scale_matrices(p, 10.0), cfg.param_dtype)


def _decode_vs_train(cfg, params, numerics, seqs):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  train = scoring.packed_logprobs(params, seqs, cfg=cfg, numerics=numerics, row_len=128)
  decode = scoring.paged_decode_logprobs(params, seqs, cfg=cfg, numerics=numerics,
                                         shuffle_pages_seed=1)
  return scoring.max_abs_diff(train, decode)


TRAIN_ROWS, ROW_LEN = 8, 128


def _train_step(cfg, numerics):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  rng = np.random.default_rng(2)
  seqs = [rng.integers(1, cfg.vocab_size, size=int(n)) for n in rng.integers(20, 60, size=16)]
  p = pack(seqs, ROW_LEN, cfg.page_size, num_rows=TRAIN_ROWS)
  mask = (p.segment_ids > 0).astype(np.float32)
  batch = (p.tokens, p.positions, p.segment_ids, scoring.next_token_targets(p.tokens), mask)

  def loss(params, batch):
    tokens, positions, segs, targets, mask = batch
    lp = forward(params, tokens, positions, cfg=cfg, numerics=numerics, segment_ids=segs,
                 targets=targets).logprobs
    return -jnp.sum(lp * mask) / jnp.sum(mask)

  fn = jax.jit(jax.value_and_grad(loss))
  step = lambda params: fn(params, batch)  # noqa: E731
  step.jitted, step.args = fn, (batch,)
  return step


def _decode_step(cfg, numerics, slots=32, cached=40, pages_per_slot=8):
  cfg = cfg.resolved(jax.default_backend(), numerics)
  table = 1 + np.arange(slots * pages_per_slot).reshape(slots, pages_per_slot)
  shape = (cfg.num_hidden_layers, 1 + slots * pages_per_slot, cfg.page_size,
           cfg.num_key_value_heads, cfg.head_dim)
  rng = np.random.default_rng(3)
  # pools of raw bits, as the engine keeps them (XLA:CPU scatters a bf16 array by
  # converting all of it to f32 and back: a page write would cost the whole pool twice)
  bits = lambda: jax.lax.bitcast_convert_type(  # noqa: E731
      jnp.asarray(rng.standard_normal(shape), cfg.compute_dtype), raw_dtype(cfg.compute_dtype))
  kv = PagedKV(bits(), bits(), jnp.asarray(table, jnp.int32))
  tokens = rng.integers(1, cfg.vocab_size, size=(slots, 1)).astype(np.int32)
  pos = np.full((slots, 1), cached, np.int32)
  fn = jax.jit(lambda prm, kv: forward(prm, tokens, pos, cfg=cfg, numerics=numerics, kv=kv,
                                       targets=tokens))
  step = lambda params: fn(params, kv)  # noqa: E731
  step.jitted, step.args = fn, (kv,)
  return step


def _expert_flops(cfg, path):
  """Expert matmul FLOPs (gate, up, down) of one train step's forward over its tokens."""
  tokens, k = TRAIN_ROWS * ROW_LEN * len(cfg.moe_layers()), cfg.num_experts_per_tok
  per_row = 2 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
  if path == "dense":
    return tokens * cfg.num_experts * per_row
  tile = cfg.expert_row_tile
  per_layer = -(-TRAIN_ROWS * ROW_LEN * k // tile) + cfg.num_experts
  return len(cfg.moe_layers()) * per_layer * tile * per_row


def _xla_flops(make, cfg, numerics, params):
  fn = make(cfg, numerics)
  return fn.jitted.lower(params, *fn.args).compile().cost_analysis()["flops"]


def _time(fn, params, calls):
  samples = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(params))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def _ratio(make_a, make_b, params):
  """Median over interleaved pairs of time(a) / time(b), and the median times."""
  a, b = make_a(), make_b()
  for fn in (a, b):
    jax.block_until_ready(fn(params))  # compile
  ratios, t_a, t_b = [], [], []
  for _ in range(_PAIRS.value):
    ta, tb = _time(a, params, _CALLS.value), _time(b, params, _CALLS.value)
    ratios.append(ta / tb)
    t_a.append(ta)
    t_b.append(tb)
  return statistics.median(ratios), statistics.median(t_a), statistics.median(t_b)


def _modes(make, cfg, params):
  return _ratio(lambda: make(cfg, Numerics("deterministic")),
                lambda: make(cfg, Numerics("fast")), params)


def _with_path(cfg, path):
  # one path for both forwards (deterministic mode refuses a dense / routed mix)
  return dataclasses.replace(cfg, train_experts=path, engine_experts=path)


def _train_paths(cfg, params, num):
  """The train step with the routed-only tiles over the dense all-experts path."""
  ratio, t_tiled, t_dense = _ratio(lambda: _train_step(_with_path(cfg, "tiled"), num),
                                   lambda: _train_step(_with_path(cfg, "dense"), num), params)
  return {"routed_over_dense": round(ratio, 3),
          "ms": {"routed": round(1e3 * t_tiled, 2), "dense": round(1e3 * t_dense, 2)},
          "xla_flops": {p: _xla_flops(_train_step, _with_path(cfg, p), num, params)
                        for p in ("tiled", "dense")}}


def _engine_paths(cfg, params):
  ratio, t_tiled, t_dense = _ratio(lambda: _engine_run(_with_path(cfg, "tiled")),
                                   lambda: _engine_run(_with_path(cfg, "dense")), params)
  tokens = ENGINE_SLOTS * ENGINE_NEW
  return {"routed_over_dense": round(ratio, 3),
          "tokens_per_s": {"routed": round(tokens / t_tiled), "dense": round(tokens / t_dense)}}


def _fast_paths(cfg, params):
  """In a fast-mode process (no deterministic flags, as a fast run has): the train step,
  the decode step at 256 slots and the whole engine at 256 slots, routed over dense."""
  fast = Numerics("fast")
  out = {"det_flags": numerics_lib.deterministic_xla_flags_set(),
         "fast_train": _train_paths(cfg, params, fast)}
  ratio, t_tiled, t_dense = _ratio(
      lambda: _decode_step(_with_path(cfg, "tiled"), fast, slots=256),
      lambda: _decode_step(_with_path(cfg, "dense"), fast, slots=256), params)
  out["fast_decode_256_slots"] = {
      "routed_over_dense": round(ratio, 3),
      "ms": {"routed": round(1e3 * t_tiled, 2), "dense": round(1e3 * t_dense, 2)},
      "tokens_per_s": {"routed": round(256 / t_tiled), "dense": round(256 / t_dense)}}
  out[f"fast_engine_{ENGINE_SLOTS}_slots"] = _engine_paths(cfg, params)
  return out


def _paths(cfg, params):
  """Routed-only tiles over the dense all-experts path: the deterministic train step here,
  the fast-mode steps and engine in a fast-mode child (and the fast engine here too, with
  the deterministic flags, for comparison); expert FLOPs of each."""
  out = {"deterministic_train": _train_paths(cfg, params, Numerics("deterministic"))}
  child = _run_child("fast_paths")
  if child.pop("det_flags"):
    raise AssertionError("the fast-mode child has the deterministic flags")
  out.update(child)
  out[f"fast_engine_{ENGINE_SLOTS}_slots_with_det_flags"] = _engine_paths(cfg, params)
  out["expert_flops_per_train_step"] = {p: _expert_flops(cfg, p) for p in ("tiled", "dense")}
  return out


ENGINE_SLOTS, ENGINE_PROMPT, ENGINE_NEW = 256, 16, 32


def _engine_run(cfg):
  """The fast-mode engine generating for ENGINE_SLOTS requests at once (prompts of
  ENGINE_PROMPT tokens, ENGINE_NEW greedy tokens each, no stop): admission, prefill, the
  decode loop and the scheduler, end to end."""
  fast = Numerics("fast")
  cfg = cfg.resolved(jax.default_backend(), fast)
  prompts = np.random.default_rng(4).integers(1, cfg.vocab_size,
                                              size=(ENGINE_SLOTS, ENGINE_PROMPT))
  greedy = SamplingParams(temperature=0.0, max_new_tokens=ENGINE_NEW)
  cache = {}

  def run(params):
    if "engine" not in cache:
      cache["engine"] = DecodeEngine(cfg, params, numerics=fast, num_slots=ENGINE_SLOTS,
                                     max_seq_len=ENGINE_PROMPT + ENGINE_NEW)
    return cache["engine"].generate([Request(i, prompts[i].astype(np.int32), sampling=greedy)
                                     for i in range(ENGINE_SLOTS)])

  return run


def _moe_flops_at_real_shape():
  """One Qwen3-30B-A3B MoE layer on 4,096 tokens (XLA's cost analysis, abstract shapes):
  each numerics mode's expert path over the routed expert FLOPs."""
  cfg = ModelConfig.from_dict(qwen3_30b_a3b.get_config().model.to_dict())
  routed = aot.routed_expert_flops(cfg, 4096)
  out = {}
  for mode in ("deterministic", "fast"):
    c = cfg.resolved(jax.default_backend(), mode)
    out[f"{mode}_{c.train_experts}"] = round(
        aot.moe_layer_flops(c, 4096, Numerics(mode), c.train_experts) / routed, 4)
  return out


def _fma_contracted() -> bool:
  """Whether XLA fuses a*b+c into one FMA in this process."""
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
  fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
  return not np.array_equal(fused, (a * b).astype(np.float32) + c)


def _child(cfg, params):
  """Fast-mode train and decode steps, f32 over bf16 compute, in this child process."""
  fast, f32 = Numerics("fast"), dataclasses.replace(cfg, dtype="float32")
  out = {"det_flags": numerics_lib.deterministic_xla_flags_set(),
         "fma_contracted": _fma_contracted()}
  for name, make in (("train", _train_step), ("decode", _decode_step)):
    ratio, t32, t16 = _ratio(lambda: make(f32, fast), lambda: make(cfg, fast), params)
    out[name] = {"f32_over_bf16": ratio, "bf16_ms": 1e3 * t16, "f32_ms": 1e3 * t32}
  print(json.dumps(out))


def _run_child(kind):
  """This benchmark as a `--child=kind` process, started without the deterministic flags
  (a "with_det_flags" child installs them itself); its last line's JSON object."""
  flags_off = [f for f in os.environ.get("XLA_FLAGS", "").split()
               if f not in numerics_lib.DETERMINISTIC_XLA_FLAGS]
  env = {**os.environ, "XLA_FLAGS": " ".join(flags_off)}
  out = subprocess.run([sys.executable, __file__, f"--child={kind}",
                        f"--config={config_flags.get_config_filename(flags.FLAGS['config'])}",
                        f"--pairs={_PAIRS.value}", f"--calls={_CALLS.value}"],
                       env=env, capture_output=True, text=True, check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def _children(rounds):
  """Alternating children with and without the deterministic flags."""
  cost, fast = [], []
  for _ in range(rounds):
    pair = {kind: _run_child(kind) for kind in ("with_det_flags", "fast_process")}
    if pair["fast_process"]["det_flags"] or not pair["with_det_flags"]["det_flags"]:
      raise AssertionError(f"children with the wrong flags: {pair}")
    cost.append(pair["with_det_flags"]["train"]["bf16_ms"] /
                pair["fast_process"]["train"]["bf16_ms"])
    fast.append(pair["fast_process"])
  med = lambda xs: round(statistics.median(xs), 3)
  return {"det_xla_flags_cost_fast_train": med(cost),
          "fast_process_fma_contracted": all(c["fma_contracted"] for c in fast),
          "fast_f32_over_bf16": {k: med([c[k]["f32_over_bf16"] for c in fast])
                                 for k in ("train", "decode")},
          "fast_process_step_ms": {k: {d: med([c[k][f"{d}_ms"] for c in fast])
                                       for d in ("bf16", "f32")} for k in ("train", "decode")}}


def main(_):
  if _CHILD.value not in ("fast_process", "fast_paths"):  # the parent runs both modes
    numerics_lib.install_deterministic_xla_flags()
  # resolved for deterministic numerics: both modes measured on the same (reference) paths
  cfg = ModelConfig.from_dict(_CONFIG.value.model.to_dict()).resolved(
      jax.default_backend(), "deterministic")
  params = _params(cfg)
  if _CHILD.value == "fast_paths":
    print(json.dumps(_fast_paths(cfg, params)))
    return
  if _CHILD.value:
    _child(cfg, params)
    return
  rng = np.random.default_rng(0)
  seqs = [rng.integers(1, cfg.vocab_size, size=n) for n in (9, 16, 17, 33, 40, 51, 64, 70)]
  det_diff = _decode_vs_train(cfg, params, Numerics("deterministic"), seqs)
  fast_diff = _decode_vs_train(cfg, params, Numerics("fast"), seqs)
  train, t_train_det, t_train_fast = _modes(_train_step, cfg, params)
  dec, t_dec_det, t_dec_fast = _modes(_decode_step, cfg, params)
  print(json.dumps({
      "workload": f"{config_flags.get_config_filename(flags.FLAGS['config'])} "
                  f"({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}) bf16; train: "
                  "fwd+bwd 8x128 packed; decode: 32 slots x 1 token, 40 cached; exactness: 8 "
                  "seqs (9..70 tokens) paged decode vs train forward",
      "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
      "det_max_abs_logprob_diff": det_diff,
      "fast_max_abs_logprob_diff": fast_diff,
      "det_over_fast_train_step": round(train, 3),
      "det_over_fast_decode_step": round(dec, 3),
      "train_step_ms": {"det": round(1e3 * t_train_det, 2), "fast": round(1e3 * t_train_fast, 2)},
      "decode_step_ms": {"det": round(1e3 * t_dec_det, 2), "fast": round(1e3 * t_dec_fast, 2)},
      "xla_flops": {m: {"train": _xla_flops(_train_step, cfg, Numerics(m), params),
                        "decode": _xla_flops(_decode_step, cfg, Numerics(m), params)}
                    for m in ("deterministic", "fast")},
      "expert_paths": _paths(cfg, params),
      "qwen3_30b_a3b_moe_layer_flops_over_routed_4096_tokens": _moe_flops_at_real_shape(),
      **_children(_ROUNDS.value),
      "pairs": _PAIRS.value,
      "machine": machine_info.machine(),
  }))


if __name__ == "__main__":
  app.run(main)
