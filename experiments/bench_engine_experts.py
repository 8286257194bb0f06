"""The engine's expert path on CPU: every expert for every token ("dense") against only the
routed experts in tiles ("tiled"), by experts, top-k and tokens per call.

Workload: one MoE layer's experts and the combine of each token's k outputs, as the
engine's `moe_block` runs them on one device (dense: `moe.dense_mixture`, the combine
folded into one down-projection dot; tiled: `moe_tiles.experts_tiled(exact=False)`, the
tiles "by_tokens" runs (operands in the compute dtype), then `moe.combine`), fast
numerics, the engine's compute dtype on this CPU
(`ModelConfig(dtype="auto").resolved("cpu", "fast")`), jitted, on T tokens of random
activations routed uniformly at random (Dirichlet routing weights), for tiny_moe's
experts (8, top-2, hidden 64, width 32), arith_tiny's (8, top-2, 128, 128), 32 experts
top-4 and Qwen3-30B-A3B's count (128, top-8) at widths 128 / 64;
T from a decode step of 8 slots to a prefill of 2,048 tokens. The decision variable is
`moe.dense_work_ratio`: the dense path's rows (T x E) over the tiled path's (T x k slots +
E x row tile of padding at most), against `moe.TILED_BEATS_DENSE_AT`. Timing: dense and
tiled alternate (A B, repeated), each call blocked on; the ratio is the median of per-round ratios
dense / tiled (> 1: tiled is faster). Then the whole engine (`DecodeEngine.generate`:
16-token prompts, 64 new tokens each, greedy, fast numerics) on configs/tiny_moe.py's
and configs/arith_tiny.py's shapes (max_position_embeddings at least 80) with random
weights, at 32 and 256 slots, with `engine_experts="dense"` against "tiled" (the
trainer's exact tiles) and "by_tokens" (the rule), alternating; ratios = medians of
per-round times over by_tokens' (> 1: the rule's choice is faster). Last
line: one JSON object.
"""

import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import engine_rounds, machine_info
from rljax.engine.engine import DecodeEngine
from rljax.model import ModelConfig, init_params, moe, moe_tiles
from rljax.numerics import Numerics

_ROUNDS = flags.DEFINE_integer("rounds", 7, "alternating timing rounds")
_REPS = flags.DEFINE_integer("reps", 5, "calls per timing")
SHAPES = (  # (experts, top_k, hidden, width)
    (8, 2, 64, 32), (8, 2, 128, 128), (32, 4, 128, 64), (128, 8, 128, 64))
TOKENS = (8, 32, 128, 512, 2048)
ROW_TILE = 32
CONFIGS = ("tiny_moe", "arith_tiny")


def _timed(fn, args, reps):
  t0 = time.perf_counter()
  for _ in range(reps):
    jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t0) / reps


def _engine_rounds(name: str, slots: int, rounds: int) -> dict:
  """generate() times of the engine with each CPU expert path, alternating."""
  fast = Numerics("fast")
  base = engine_rounds.fast_model(name, "cpu")
  params = init_params(base, jax.random.key(0))
  engines = {path: DecodeEngine(engine_rounds.fast_model(name, "cpu", engine_experts=path),
                                params, numerics=fast, num_slots=slots, max_seq_len=80)
             for path in ("dense", "tiled", "by_tokens")}
  _, times = engine_rounds.generate_rounds(
      engines, engine_rounds.greedy_prompts(base.vocab_size, slots, seed=1), rounds)
  ratio = lambda a: round(engine_rounds.median_ratio(times[a], times["by_tokens"]), 3)  # noqa: E731
  return {"config": name, "slots": slots, "tokens": slots * 64,
          "tok_s": {p: engine_rounds.tok_s(t, slots) for p, t in times.items()},
          "dense_over_by_tokens": ratio("dense"), "tiled_over_by_tokens": ratio("tiled")}


def main(_):
  fast = Numerics("fast")
  dtype = jnp.dtype(ModelConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=8,
                                num_experts=2, num_experts_per_tok=1,
                                moe_intermediate_size=8).resolved("cpu", fast).dtype)
  rows = []
  for e, k, d, f in SHAPES:
    rng = np.random.default_rng(e)
    gate, up = (jnp.asarray(rng.standard_normal((d, e, f)) * 0.1, dtype) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((e, f, d)) * 0.1, dtype)
    for t in TOKENS:
      x = jnp.asarray(rng.standard_normal((t, d)), dtype)
      ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]),
                        jnp.int32)
      w = jnp.asarray(rng.dirichlet(np.ones(k), t), jnp.float32)
      fns = {"dense": jax.jit(lambda x, ids, w: moe.dense_mixture(
                 x, ids, w, gate, up, down, fast)),
             "tiled": jax.jit(lambda x, ids, w: moe.combine(moe_tiles.experts_tiled(
                 x, ids, gate, up, down, fast, ROW_TILE, "jnp", exact=False), w))}
      for fn in fns.values():
        jax.block_until_ready(fn(x, ids, w))  # compile
      ratios, times = [], {"dense": [], "tiled": []}
      for _ in range(_ROUNDS.value):
        for path, fn in fns.items():
          times[path].append(_timed(fn, (x, ids, w), _REPS.value))
        ratios.append(times["dense"][-1] / times["tiled"][-1])
      row = {"experts": e, "top_k": k, "hidden": d, "width": f, "tokens": t,
             "dense_work_ratio": round(moe.dense_work_ratio(t, e, k, ROW_TILE), 3),
             "dense_ms": round(1e3 * statistics.median(times["dense"]), 3),
             "tiled_ms": round(1e3 * statistics.median(times["tiled"]), 3),
             "dense_over_tiled": round(statistics.median(ratios), 3)}
      rows.append(row)
      print(json.dumps(row), flush=True)
  engine = [_engine_rounds(name, slots, 3) for name in CONFIGS for slots in (32, 256)]
  for row in engine:
    print(json.dumps(row), flush=True)
  agree = [r for r in rows if (r["dense_over_tiled"] > 1) == moe.tiled_beats_dense(
      r["tokens"], r["experts"], r["top_k"], ROW_TILE)]
  print(json.dumps({
      "bench": "engine_experts", "dtype": str(dtype), "row_tile": ROW_TILE,
      "rounds": _ROUNDS.value, "reps": _REPS.value, "rows": rows,
      "rule": f"tiled when dense_work_ratio > {moe.TILED_BEATS_DENSE_AT}",
      "rule_picks_the_faster": f"{len(agree)}/{len(rows)}",
      "rule_misses": [r for r in rows if r not in agree],
      "engine": engine,
      "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
