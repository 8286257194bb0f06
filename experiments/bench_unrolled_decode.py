"""The engine's decode loop on CPU: the model's layers unrolled against the layer scan.

The scan (`ModelConfig.scan_layers`) slices every layer's weights out of the stacked
params at every step; unrolled, each layer's weights are a static slice XLA can read in
place, but the loop's code grows with the layers. `programs.unrolled_decode` picks
unrolled up to `programs.UNROLL_UP_TO_SLOTS` slots; this bench is what backs that rule.

Workload (per config and slot count, fast numerics, random bf16 weights, one CPU process):
`slots` requests of 16 random prompt tokens and 64 new tokens each, greedy, no stop
token (every slot runs the whole call): one `DecodeEngine.generate` per timing. The two
engines (scan, unrolled; `DecodeEngine(unroll_layers=)`) alternate, `--rounds` times;
reported: each side's median tokens/s and the median of per-round ratios
scan_time / unrolled_time (> 1: unrolled faster), the rule's pick and whether it picked
the faster, and the share of greedy tokens the two sample alike (fast numerics: XLA fuses
the two loops differently, so near-ties may break differently). Last line: one JSON object.

  .venv/bin/python experiments/bench_unrolled_decode.py [--rounds=7]
"""

import json

from absl import app, flags
import jax
import numpy as np

from experiments import engine_rounds, machine_info
from experiments.engine_rounds import NEW, PROMPT
from rljax.engine import programs
from rljax.engine.engine import DecodeEngine
from rljax.model import ModelConfig, init_params
from rljax.numerics import Numerics

_ROUNDS = flags.DEFINE_integer("rounds", 7, "alternating timing rounds")
CONFIGS = ("tiny_moe", "arith_tiny")
SLOTS = (8, 16, 32, 64, 128, 256)


def _measure(cfg: ModelConfig, params, slots: int, rounds: int) -> dict:
  fast = Numerics("fast")
  engines = {name: DecodeEngine(cfg, params, numerics=fast, num_slots=slots,
                                max_seq_len=PROMPT + NEW, unroll_layers=unroll)
             for name, unroll in (("scan", False), ("unrolled", True))}
  tokens, seconds = engine_rounds.generate_rounds(
      engines, engine_rounds.greedy_prompts(cfg.vocab_size, slots, seed=slots), rounds,
      warmups=2)
  ratio = engine_rounds.median_ratio(seconds["scan"], seconds["unrolled"])
  picks_unrolled = programs.unrolled_decode("cpu", fast, slots, cfg.num_hidden_layers)
  return {"slots": slots,
          "tok_s": {name: engine_rounds.tok_s(v, slots) for name, v in seconds.items()},
          "scan_over_unrolled": round(ratio, 3),
          "rule_picks": "unrolled" if picks_unrolled else "scan",
          "rule_picks_the_faster": picks_unrolled == (ratio > 1),
          "tokens_alike": round(float(np.mean(tokens["scan"] == tokens["unrolled"])), 3)}


def main(_):
  results = []
  for name in CONFIGS:
    cfg = engine_rounds.fast_model(name)
    params = init_params(cfg, jax.random.key(0))
    for slots in SLOTS:
      row = {"config": name, **_measure(cfg, params, slots, _ROUNDS.value)}
      print(json.dumps(row), flush=True)
      results.append(row)
  print(json.dumps({
      "bench": "unrolled_decode",
      "workload": f"per config and slot count: that many requests of {PROMPT} random prompt "
                  f"tokens + {NEW} new tokens, greedy, no stop token; the configs' shapes "
                  "(max_position_embeddings raised to 80 where smaller), random bf16 "
                  "weights, fast numerics, DecodeEngine.generate",
      "timing": "scan and unrolled engines alternate in one process; scan_over_unrolled = "
                "median of per-round scan_time / unrolled_time (> 1: unrolled faster)",
      "rounds": _ROUNDS.value,
      "rule": f"unrolled up to {programs.UNROLL_UP_TO_SLOTS} slots (CPU, fast numerics, "
              f"<= {programs.UNROLL_MAX_LAYERS} layers)",
      "rule_picks_the_faster": f"{sum(r['rule_picks_the_faster'] for r in results)}/"
                               f"{len(results)}",
      "results": results, "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
