"""The engine's overlap: each decode call dispatched before the previous one is read back.

With `DecodeEngine(overlap=True)` (the default) the host builds and dispatches call k+1
(its slots continue from call k's last tokens, on device) and then reads call k back and
records it, so the host's records and page grants run while the device decodes; when work
waits for a slot it reads call k back first (a freed slot takes that work in the next call,
not one call later). This bench is what backs the default.

Workloads (per config and slot count, fast numerics, random bf16 weights, one CPU process,
greedy, no stop token): "fixed": `slots` requests of 16 random prompt tokens and 64 new
tokens each (every slot runs every call; `bench_vs_tunix`'s workload); "varied": 4 x
`slots` requests of 16 prompt tokens and 8-63 new tokens (a backlog: slots free at
different calls and take waiting work). One `DecodeEngine.generate` per timing; the two
engines (overlap, one call at a time) alternate, `--rounds` times; reported: each side's
median tokens/s, the median of per-round ratios one_at_a_time_time / overlap_time (> 1:
overlap faster), and whether the two sampled the same tokens (they must: each step is the
same one-token step with the same sampling keys). Last line: one JSON object.

  .venv/bin/python experiments/bench_overlap.py [--rounds=9]
"""

import json
import statistics

from absl import app, flags
import jax
import numpy as np

from experiments import engine_rounds, machine_info
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.model import ModelConfig, init_params
from rljax.numerics import Numerics

_ROUNDS = flags.DEFINE_integer("rounds", 9, "alternating timing rounds")
CONFIGS = ("tiny_moe", "arith_tiny")
SLOTS = (32, 256)
PROMPT, MAX_SEQ = engine_rounds.PROMPT, engine_rounds.PROMPT + engine_rounds.NEW


def _requests(vocab_size: int, slots: int, workload: str) -> list[Request]:
  rng = np.random.default_rng(slots)
  count = slots if workload == "fixed" else 4 * slots
  prompts = rng.integers(3, vocab_size, (count, PROMPT)).astype(np.int32)
  new = np.full(count, 64) if workload == "fixed" else rng.integers(8, 64, count)
  return [Request(i, p, sampling=SamplingParams(temperature=0.0, max_new_tokens=int(n)))
          for i, (p, n) in enumerate(zip(prompts, new))]


def _measure(cfg: ModelConfig, params, slots: int, workload: str, rounds: int) -> dict:
  engines = {name: DecodeEngine(cfg, params, numerics=Numerics("fast"), num_slots=slots,
                                max_seq_len=MAX_SEQ, overlap=overlap)
             for name, overlap in (("overlap", True), ("one_at_a_time", False))}
  requests = _requests(cfg.vocab_size, slots, workload)
  tokens = sum(r.sampling.max_new_tokens for r in requests)

  sampled, seconds = engine_rounds.alternate(engines, requests, rounds, warmups=2)
  same = all(np.array_equal(a, b) for a, b in zip(sampled["overlap"], sampled["one_at_a_time"]))
  return {"slots": slots, "workload": workload, "requests": len(requests), "new_tokens": tokens,
          "tok_s": {name: round(tokens / statistics.median(v), 1) for name, v in seconds.items()},
          "one_at_a_time_over_overlap": round(engine_rounds.median_ratio(
              seconds["one_at_a_time"], seconds["overlap"]), 3),
          "tokens_identical": same}


def main(_):
  results = {}
  for name in CONFIGS:
    cfg = engine_rounds.fast_model(name)
    params = init_params(cfg, jax.random.key(0))
    rows = [_measure(cfg, params, slots, workload, _ROUNDS.value)
            for slots in SLOTS for workload in ("fixed", "varied")]
    for row in rows:
      print(name, json.dumps(row), flush=True)
    results[name] = rows
  print(json.dumps({
      "bench": "overlap",
      "workload": "greedy, 16-token random prompts, no stop token; fixed: one request per "
                  "slot, 64 new tokens; varied: 4 requests per slot, 8-63 new tokens; "
                  "max_seq_len 80; steps_per_call: the engine's default",
      "timing": "one process; the two engines alternate, one generate each per round; "
                "ratio = median of per-round one_at_a_time / overlap times",
      "rounds": _ROUNDS.value, "results": results, "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
