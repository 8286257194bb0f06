"""The engine's decode steps per device call (`steps_per_call`): host round trips against
slots idling inside a call, on RL-like varied lengths and on fixed ones.

One decode call runs up to N one-token steps on device; the host's scheduling, page
grants and records are paid once per call, so a larger N pays them less often. But a slot
whose sequence ends inside a call idles (computed, masked) until the call ends, and a new
request takes the slot only at the next call, so a larger N idles more when lengths vary.

Workloads (configs/tiny_moe.py's shapes, random weights, fast numerics, one CPU process,
16-token prompts, no EOS):
* "varied": 4 x num_slots requests, each with its own max_new_tokens drawn uniformly from
  [8, 128] (seeded), through num_slots slots: continuous batching refills slots as
  sequences end, as an RL rollout's varied completion lengths do;
* "fixed": num_slots requests of 64 new tokens each (one static batch, no slot idles).
Slots 32 and 256; N in STEPS. Timing: the N's engines alternate (A B C D, repeated) on
identical requests; tokens/s from medians; ratios are medians of per-round ratios against
N = 8 (the default before this bench). Also each run's slot-steps computed per token
generated (1.0: no slot idled), and whether every N sampled the same greedy tokens (fast
numerics is not batch-invariant: on varied lengths the N's batch compositions differ, so
near-ties may break differently; deterministic numerics gives the same tokens for any N,
tests/test_engine.py). Last line: one JSON object.
"""

import json
import statistics
import time

from absl import app, flags
import jax
import numpy as np

from configs import tiny_moe
from experiments import machine_info
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.model import ModelConfig, init_params
from rljax.numerics import Numerics

_ROUNDS = flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
STEPS = (4, 8, 16, 32)
SLOTS = (32, 256)
PROMPT = 16


def _requests(workload: str, slots: int, vocab: int) -> list[Request]:
  rng = np.random.default_rng(0)
  count = 4 * slots if workload == "varied" else slots
  lengths = rng.integers(8, 129, count) if workload == "varied" else np.full(count, 64)
  return [Request(i, rng.integers(3, vocab, PROMPT),
                  sampling=SamplingParams(temperature=0.0, max_new_tokens=int(n)))
          for i, n in enumerate(lengths)]


def _measure(cfg, params, workload: str, slots: int, rounds: int) -> dict:
  fast = Numerics("fast")
  engines = {n: DecodeEngine(cfg, params, numerics=fast, num_slots=slots,
                             max_seq_len=PROMPT + 128, steps_per_call=n) for n in STEPS}
  reqs = _requests(workload, slots, cfg.vocab_size)
  tokens = sum(r.sampling.max_new_tokens for r in reqs)
  outs = {}
  for n, e in engines.items():  # compile, and the tokens each N samples
    outs[n] = {(t.request_id, tuple(t.completion_ids)) for t in e.generate(reqs)}
  slot_steps = {}
  times = {n: [] for n in STEPS}
  for _ in range(rounds):
    for n, e in engines.items():
      before = e.stats["decode_steps"], e.stats["decode_calls"]
      t0 = time.perf_counter()
      e.generate(reqs)
      times[n].append(time.perf_counter() - t0)
      steps = e.stats["decode_steps"] - before[0]
      slot_steps[n] = {"decode_calls": e.stats["decode_calls"] - before[1],
                       "slot_steps_per_token": round(steps * slots / tokens, 3)}
  return {"workload": workload, "slots": slots, "requests": len(reqs), "new_tokens": tokens,
          "same_tokens_every_n": all(outs[n] == outs[8] for n in STEPS),
          "tok_s": {n: round(tokens / statistics.median(times[n]), 1) for n in STEPS},
          "speedup_vs_8": {n: round(statistics.median(a / b for a, b in zip(times[8], times[n])),
                                    3) for n in STEPS},
          "per_n": slot_steps}


def main(_):
  base = ModelConfig.from_dict(tiny_moe.get_config().model.to_dict())
  cfg = base.resolved(jax.default_backend(), Numerics("fast"))
  params = init_params(cfg, jax.random.key(0))
  rows = []
  for workload in ("varied", "fixed"):
    for slots in SLOTS:
      rows.append(_measure(cfg, params, workload, slots, _ROUNDS.value))
      print(json.dumps(rows[-1]), flush=True)
  print(json.dumps({"bench": "steps_per_call", "config": "configs/tiny_moe.py (fast, random)",
                    "steps": STEPS, "rounds": _ROUNDS.value, "rows": rows,
                    "machine": machine_info.machine()}))


if __name__ == "__main__":
  app.run(main)
