"""Per-process batch parts: with several trainer processes each packs and feeds only the
groups of its part of the batch rows (rljax.rl.batch.global_batch), and the update is the
whole batch's.

Two processes x 4 CPU devices (jax.distributed on 127.0.0.1), one 8-device mesh
(fsdp 4 x expert 2, as the multi-host pipeline test), deterministic numerics, router
replay on. The same 16 scored episodes on both processes; each trains on its 2 of the 4
groups. Checked in the workers (the test asserts what they print):
* each process's arrays hold only its own part: the addressable rows are its packed
  rows, its sequence slots are renumbered from its part's first, the per-sequence
  advantages are the whole batch's;
* the update from the parts equals, bit for bit, the update from the same global batch fed
  whole, as replicated numpy, to the same jitted step: its metrics and every parameter;
* the fidelity check (re-scoring every token with its version) over the parts reduces to
  the whole batch's figure bit for bit (deterministic log-probs do not depend on packing).

This file is also the worker: `python tests/test_batch_parts.py PORT PROCESS_ID WORKDIR`.
"""

import json
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, moe_intermediate_size=16, intermediate_size=32)
PROMPTS, GROUP = 4, 4
S = PROMPTS * GROUP


@pytest.mark.multidevice
def test_each_process_feeds_its_part_and_the_update_is_the_whole_batchs(tmp_path):
  from tests.process_group import free_port, run_together  # here: the script has no tests/
  port = free_port()
  results = run_together([[sys.executable, str(HERE), str(port), str(i),
                            str(tmp_path / f"process{i}")] for i in range(2)],
                          600, tmp_path / "logs", cwd=str(REPO))
  for i, r in enumerate(results):
    assert r["part"] == [i, 2]
    assert r["local_rows"] * 2 == r["global_rows"]  # fed only its half of every microbatch
    assert r["own_rows_fed"] and r["seq_ids"] == [8 * i, 8 * i + 7]
    assert r["advantages_whole"]
    assert r["metrics_equal"], (r["metrics"], r["ref_metrics"])
    assert r["update_size"] > 0, r  # the update moved the params
    assert r["params_max_abs_diff"] == 0.0, r  # the same program on the same global data
    assert r["check"]["parts"] == r["check"]["whole"] > 0
    assert r["check"]["tokens"] == r["check"]["whole_tokens"] > 0
    assert r["check"]["unchecked"] == r["check"]["whole_unchecked"] > 0
  assert results[0]["metrics"] == results[1]["metrics"]


def test_one_process_is_one_part_and_uneven_parts_are_refused(monkeypatch):
  import jax
  from configs import arith_tiny
  from rljax import sharding as sharding_lib
  from rljax.pipeline import core, grpo_update
  from rljax.pipeline.run import ASYNC_TRAINER, build
  mesh = sharding_lib.Sharding(sharding_lib.make_mesh({"data": 1}, jax.devices()[:1]))
  assert mesh.process_part("batch") == (0, 1)
  config = arith_tiny.get_config()
  config.model.update(SMALL_MODEL)
  built = build(config, ASYNC_TRAINER, devices=False)
  run = core.Run(built, [], None, None, None, None)
  assert grpo_update.batch_part(run) == (0, 1)  # one process: the whole batch
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(grpo_update, "batch_part", lambda _: (0, 3))
  object.__setattr__(built, "sharding", mesh)
  with pytest.raises(ValueError, match=r"prompts_per_step=16 groups do not split over the 3"):
    grpo_update.check_batch_parts(run)


# ---------------------------------------------------------------- the worker


def _groups(cfg, rng):
  """PROMPTS groups of GROUP scored episodes, random tokens, version 0 (group 0) or 1."""
  import numpy as np
  from rljax.rl.trajectory import FinishReason, Outcome, Trajectory
  groups = []
  for g in range(PROMPTS):
    group = []
    for i in range(GROUP):
      p, c = int(rng.integers(2, 6)), int(rng.integers(1, 8))
      mask = rng.random(c) < 0.9
      tokens = rng.integers(3, cfg.vocab_size, p + c).astype(np.int32)
      experts = np.stack([rng.permutation(cfg.num_experts)[:cfg.num_experts_per_tok]
                          for _ in range((p + c) * len(cfg.moe_layers()))])
      group.append(Trajectory(
          tokens[:p], tokens[p:], mask,
          np.where(mask, -rng.random(c) * 3, 0).astype(np.float32),
          np.where(mask, int(g > 0), -1).astype(np.int32),
          experts.reshape(p + c, len(cfg.moe_layers()), -1).astype(np.int32),
          FinishReason.EOS, group_id=g, sample_index=i,
          reward=float(rng.integers(0, 2)),
          outcome=Outcome.INFRA_FAILURE if (g, i) == (1, 3) else Outcome.SUCCESS))
    groups.append(group)
  return groups


def worker(port: int, process_id: int, workdir: str) -> None:
  sys.path.insert(0, str(REPO))
  from rljax.numerics import install_deterministic_xla_flags
  install_deterministic_xla_flags()
  import jax
  from rljax import distributed
  distributed.initialize(f"127.0.0.1:{port}", 2, process_id, local_device_count=4)
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  from configs import arith_tiny
  from rljax.pipeline import core, grpo_update
  from rljax.pipeline.fidelity import VersionCheck
  from rljax.pipeline.run import ASYNC_TRAINER, build
  from rljax.rl.batch import build_batch, global_batch, split_microbatches

  config = arith_tiny.get_config()
  config.model.update(SMALL_MODEL)
  config.numerics = "deterministic"
  config.mesh.update({"fsdp": 4, "expert": 2})
  # warmup 0: the first update moves the params (at warmup's first step the rate is 0)
  config.rl.update(dict(prompts_per_step=PROMPTS, group_size=GROUP, microbatches=2,
                        warmup_steps=0))
  config.sft.update(dict(steps=0, target_pass1=0.0))
  config.log.tensorboard = False
  built = build(config, ASYNC_TRAINER)
  run = core.setup(built, workdir, engine=False)
  grpo_update.check_batch_parts(run)
  part, parts = grpo_update.batch_part(run)
  groups = _groups(run.cfg, np.random.default_rng(0))
  mine = groups[part * PROMPTS // parts:(part + 1) * PROMPTS // parts]
  per_part = PROMPTS * GROUP // parts
  out = {"part": [part, parts]}

  parted = grpo_update.grpo_learner(run)
  adv = grpo_update.advantages_of(run, parted, groups)

  def part_batch(p, micro):
    """Part p's packed rows, its sequence slots renumbered from its first."""
    trajs = [t for g in groups[p * PROMPTS // parts:(p + 1) * PROMPTS // parts] for t in g]
    rows = slice(p * per_part, (p + 1) * per_part)
    b = split_microbatches(build_batch(trajs, adv.values[rows], adv.valid[rows],
                                       with_routing=True, **run.batch_shape(per_part)), micro)
    return dataclasses.replace(b, seq_ids=np.where(b.seq_ids >= 0, b.seq_ids + rows.start,
                                                   -1).astype(np.int32))

  # the global batch of the parts, and the same batch whole, as numpy, on every process
  local = [part_batch(p, config.rl.microbatches) for p in range(parts)]
  whole = jax.tree.map(lambda *xs: np.concatenate(xs, axis=1), *local)
  whole = dataclasses.replace(
      whole, advantages=np.broadcast_to(adv.values, (config.rl.microbatches, S)).copy(),
      valid=np.broadcast_to(adv.valid, (config.rl.microbatches, S)).copy())
  mine_rows = slice(part * per_part, (part + 1) * per_part)
  fed = global_batch(split_microbatches(build_batch(
      [t for g in mine for t in g], adv.values[mine_rows], adv.valid[mine_rows],
      with_routing=True, **run.batch_shape(per_part)), config.rl.microbatches),
      run.sharding, first_seq=mine_rows.start, advantages=adv.values, valid=adv.valid)
  out["local_rows"] = local[part].tokens.shape[1]
  out["global_rows"] = fed.tokens.shape[1]
  shards = {s.index[1].start or 0: np.asarray(s.data) for s in fed.seq_ids.addressable_shards}
  own = np.concatenate([shards[k] for k in sorted(shards)], axis=1)
  out["own_rows_fed"] = bool(np.array_equal(own, local[part].seq_ids))
  ids = own[own >= 0]
  out["seq_ids"] = [int(ids.min()), int(ids.max())]
  out["advantages_whole"] = bool(np.array_equal(np.asarray(fed.advantages)[0], adv.values))

  # the update from the parts, and from the whole batch fed as replicated numpy, both from
  # the start params (the reference learner is made before the parts' update)
  reference = grpo_update.grpo_learner(run)
  metrics = grpo_update.train_on_groups(run, parted, mine, adv)
  max_diff = jax.jit(lambda a, b: jnp.max(jnp.stack([jnp.max(jnp.abs(x - y)) for x, y in zip(
      jax.tree.leaves(a), jax.tree.leaves(b))])))  # a replicated scalar: every process reads it
  out["update_size"] = float(max_diff(run.state.params, reference.state.params))
  ref_state, ref_metrics = reference.step_fn(reference.state, whole, 0)
  ref_metrics = jax.device_get(ref_metrics)
  keys = sorted(set(ref_metrics) - set(adv.stats))  # the step's own figures
  out["metrics"] = {k: float(metrics[k]) for k in keys}
  out["ref_metrics"] = {k: float(ref_metrics[k]) for k in keys}
  out["metrics_equal"] = all(np.array_equal(metrics[k], ref_metrics[k]) for k in keys)
  out["params_max_abs_diff"] = float(max_diff(run.state.params, ref_state.params))

  # the fidelity check: the parts' figure is the whole batch's (version 1 is not held)
  check = VersionCheck(run, groups=PROMPTS, keep_versions=1)
  check.hold(0, run.serve(core.params_only(run.state.params)))
  check.check(mine, check.versions_of(groups, parts))
  whole_check = split_microbatches(build_batch(
      [t for g in groups for t in g], np.zeros(PROMPTS * GROUP, np.float32),
      np.ones(PROMPTS * GROUP, bool), with_routing=True,
      **run.batch_shape(PROMPTS * GROUP)), 1)  # packed whole, numpy on every process
  diff, tokens = check._score(check.params[0], whole_check, np.int32(0))
  out["check"] = {"parts": check.mismatch.value, "tokens": check.mismatch.tokens,
                  "whole": float(diff), "whole_tokens": int(tokens),
                  "unchecked": check.unchecked_tokens,
                  "whole_unchecked": int(check._count(whole_check, np.int32(1)))}
  print(json.dumps(out), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
