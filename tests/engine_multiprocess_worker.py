"""One of 2 jax.distributed processes x 4 simulated CPU devices (see
test_engine_multiprocess.py): `python engine_multiprocess_worker.py PORT PROCESS_ID`.

Both processes build the same deterministic engine on the trainer's mesh (config.mesh
fsdp 4 x expert 2 over all 8 devices, `Built.trainer_engine_sharding()`: the decode rules),
from serving params as the trainer holds them (bf16 global arrays by the training rules),
submit the same requests and step in lockstep: 4 sampled groups of 4 sharing their
prompt's pages and a greedy pair, new weights (a second trainer-layout tree) in
flight after two steps. Process 0 then serves the same on a
1-device engine of the same `Built` with the params gathered to host.

Prints one JSON object: each finished sample's records (token ids, log-prob bits, versions,
routing, finish reason) from the 8-device engine, and on process 0 the 1-device engine's;
where the params and the page pool sit.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from rljax.numerics import install_deterministic_xla_flags  # noqa: E402

install_deterministic_xla_flags()

import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import arith_tiny  # noqa: E402
from rljax import distributed  # noqa: E402
from rljax.engine.engine import Request, SamplingParams  # noqa: E402
from rljax.envs.base import StepResult, Verdict  # noqa: E402
from rljax.model.params import cast, init_sharded, scale_matrices  # noqa: E402
from rljax.pipeline import run  # noqa: E402
from rljax.pipeline.rollout import generate_groups  # noqa: E402
from rljax.rl.trajectory import Outcome  # noqa: E402

NEEDS = ("model", "mesh", "env", "engine")
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=16, intermediate_size=32)
STEPS_BEFORE_UPDATE = 1  # engine steps (a decode call of 16 tokens each) on version 0


def config():
  c = arith_tiny.get_config()
  c.model.update(SMALL_MODEL)
  c.numerics = "deterministic"
  c.mesh.update({"fsdp": 4, "expert": 2})
  # 8 slots per device, the fewest check_slots allows in deterministic numerics
  c.engine.update({"num_slots": 64, "max_seq_len": 48})
  return c


def requests(vocab_size: int) -> list[Request]:
  rng = np.random.default_rng(0)
  sampled = [Request(request_id=100 + i, n=4, seed=11, group_id=i,
                     prompt_ids=rng.integers(3, vocab_size, size=int(rng.integers(5, 24))),
                     sampling=SamplingParams(max_new_tokens=20)) for i in range(4)]
  greedy = Request(request_id=200, n=2, prompt_ids=rng.integers(3, vocab_size, size=9),
                   sampling=SamplingParams(temperature=0.0, max_new_tokens=20))
  return sampled + [greedy]


def trainer_params(built, seed: int):
  """Serving params as the trainer holds them: bf16 global arrays on config.mesh by the
  training rules (sharpened: routing and attention sharp enough that an ulp would show)."""
  return cast(scale_matrices(init_sharded(built.cfg, seed, built.sharding, "float32"), 10.0),
              "bfloat16")


def serve(engine, reqs, new_params) -> dict:
  """Submits every request, steps twice, takes version 1's weights, runs to the end. On
  the 8-device engine both processes step in lockstep; the engine's programs start
  together at their first run (`distributed.started_together`: Gloo gives a peer that
  compiles more slowly only 30 s)."""
  for r in reqs:
    engine.submit(r)
  trajs = []
  for _ in range(STEPS_BEFORE_UPDATE):
    trajs += engine.step()
  engine.update_weights(new_params, 1)
  trajs += engine.run()
  return {f"{t.request_id}/{t.sample_index}": {
      "prompt": t.prompt_ids.tolist(), "completion": t.completion_ids.tolist(),
      "logprob_bits": t.behaviour_logprobs.view(np.uint32).tolist(),
      "versions": t.versions.tolist(), "routing": t.expert_ids.tolist(),
      "finish": t.finish_reason.value} for t in trajs}


class ProcessDependentEnv:
  """Two turns on the arithmetic env's tasks whose every answer depends on the process that
  computes it: the observation after turn 1 (its tokens and length), the reward and the
  outcome. Driven by both processes of one SPMD engine, every episode must still see and
  score process 0's answers (rollout.py: process 0's env answers are the job's)."""

  name, max_turns = "process_dependent", 2

  def __init__(self, env):
    self.env, self.tokenizer, self.stop_ids = env, env.tokenizer, env.stop_ids

  def prompts(self, split, n, seed):
    return self.env.prompts(split, n, seed)

  def sft_target(self, task):
    return self.env.sft_target(task)

  def step(self, task, history_ids, action_ids):
    if len(history_ids):  # the second action ends the episode
      return StepResult(None, done=True)
    me = jax.process_index()
    obs = np.full(2 + 3 * me, 5 + me, np.int32)  # 2 tokens on process 0, 5 on process 1
    return StepResult(obs, done=False, info={"tool_calls": 1 + me})

  def verify(self, task, completion_ids):
    me = jax.process_index()
    return (Verdict(0.25 + len(completion_ids) % 3, Outcome.MODEL_FAILURE) if me == 0
            else Verdict.success())


def episodes(built, engine) -> dict:
  """Two-turn episodes of 3 tasks x 2 samples on `engine` with ProcessDependentEnv."""
  env = ProcessDependentEnv(built.env)
  groups = generate_groups(engine, env, env.prompts("train", 3, 0), group_size=2,
                           sampling=SamplingParams(max_new_tokens=6), seed=3,
                           first_request_id=300)
  return {f"{g.request_id}/{t.sample_index}": {
      "completion": t.completion_ids.tolist(), "loss_mask": t.loss_mask.tolist(),
      "reward": t.reward, "outcome": t.outcome.value, "info": t.info}
          for g in groups for t in g.trajectories}


HLO_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")  # f32[1,32,4,16] -> "1,32,4,16"


def reshard_largest_value(params, engine) -> float:
  """The largest value (elements) in the compiled trainer -> engine reshard of any leaf
  (the program device_put runs between shardings of one device set), in units of the
  leaf's block on the engine: a full copy of an expert-split tensor would be 2. Elements,
  not bytes: XLA:CPU all-gathers bf16 as f32."""
  ratios = []
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(engine.params)):
    hlo = jax.jit(lambda t: t, out_shardings=y.sharding).lower(x).compile().as_text()
    largest = max(math.prod(int(d) for d in dims.split(",") if d)
                  for dims in HLO_SHAPE.findall(hlo))
    ratios.append(largest / math.prod(y.sharding.shard_shape(y.shape)))
  return max(ratios)


def placement(engine, trainer) -> dict:
  gate = engine.params["layers"]["moe"]["moe"]["gate"]
  trainer_gate = trainer["layers"]["moe"]["moe"]["gate"]
  pool = engine.pools[0]
  return {"trainer_gate_spec": str(trainer_gate.sharding.spec),
          "trainer_gate_fully_addressable": trainer_gate.is_fully_addressable,
          "reshard_largest_value": reshard_largest_value(trainer, engine),
          "engine_gate_spec": str(gate.sharding.spec),
          "engine_gate_block": list(gate.addressable_shards[0].data.shape),
          "engine_gate_shape": list(gate.shape),
          "pool_pages": pool.shape[1],
          "pool_pages_per_device": pool.addressable_shards[0].data.shape[1]}


def main():
  port, process_id = int(sys.argv[1]), int(sys.argv[2])
  distributed.initialize(f"127.0.0.1:{port}", 2, process_id, local_device_count=4,
                         timeout_s=120)
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  built = run.build(config(), NEEDS)
  p0, p1 = trainer_params(built, 0), trainer_params(built, 1)
  reqs = requests(built.cfg.vocab_size)

  t0 = time.perf_counter()
  engine = built.make_engine(p0, sharding=built.trainer_engine_sharding())
  out = {"process": jax.process_index(), "engine": serve(engine, reqs, p1),
         "placement": placement(engine, p1), "episodes": episodes(built, engine)}
  print(f"process {process_id}: 8-device engine {time.perf_counter() - t0:.1f} s, traces "
        f"{dict(engine.trace_counts)}", file=sys.stderr)

  # the params in the decode loop's own layout (what accelerators run): its decode loop is
  # compiled ahead of time and started together through the same barrier
  with built.config.unlocked():
    built.config.engine.serving_layout = True
  laid_out = built.make_engine(p0, sharding=built.trainer_engine_sharding())
  out["serving_layout"] = serve(laid_out, reqs, p1)
  out["serving_layout_chosen"] = laid_out.programs.param_formats is not None

  host = [distributed.gather(p) for p in (p0, p1)]  # a collective: both processes
  if distributed.is_primary():
    t0 = time.perf_counter()
    out["reference"] = serve(built.make_engine(host[0]), reqs, host[1])
    print(f"1-device engine {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  # process 1 waits here (up to 600 s), not in JAX's shutdown barrier, which fails after
  # 300 s: a loaded CI machine has let process 0's reference take that long
  distributed.barrier("done", timeout_s=600)
  print(json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
