"""The SFT warm start of a run: reference completions of train tasks (`sft`), saved to
and loaded from a checkpoint (`save_params`, `load_params`); `warm_start` is the one a
loop calls (the checkpoint `sft.load`, or a warm start saved to the run's SFT directory).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Callable, Iterator

from etils import epath
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rljax.checkpoint import Checkpointer
from rljax.envs.base import Env, Task
from rljax.pipeline.core import Run, params_only, task_stream
from rljax.pipeline.evaluate import greedy_groups, success_rate
from rljax.pipeline.run import block_optimizer, check_vocabulary
from rljax.rl import learner
from rljax.rl.batch import build_batch, split_microbatches
from rljax.rl.trajectory import FinishReason, Trajectory


def sft_trajectory(env: Env, task: Task) -> Trajectory:
  target = env.sft_target(task)
  c = len(target.completion_ids)
  return Trajectory(task.prompt_ids, target.completion_ids, target.loss_mask,
                    np.zeros(c, np.float32), np.zeros(c, np.int32), None, FinishReason.EOS)


def sft(run: Run, progress: Callable[[Iterator], Iterator] = iter,
        env: Env | None = None) -> dict:
  """SFT warm start on reference completions of train tasks (fresh optimizer): `env`'s
  (its tasks, its tokenizer, its probe; its vocabulary checked against the model's) when
  given, else run.env's.

  With `sft.target_pass1 > 0` it stops early, at the first `sft.probe_every` boundary where
  greedy pass@1 on a probe set of *train* tasks reaches the target: when a warm start
  "works" varies a lot between seeds (a sharp transition), and GRPO should start from a
  comparable policy whatever the seed. Once the probe passes `sft.slow_down_at`, the
  learning rate is multiplied by `sft.slow_down_factor` and the probe runs every
  `sft.probe_every_slow` steps: at a high constant rate, probed coarsely, the policy jumps
  across the transition (probe 0.5 -> 0.85 in 25 steps), so where it stops would be luck.
  The held-out split is never looked at here.
  """
  c = run.config.sft
  if env is None:
    env = run.env
  else:
    check_vocabulary(env.tokenizer, run.cfg, f"the SFT env's tokenizer ({env.name})")
    if not getattr(env, "has_sft_targets", True):
      raise ValueError(f"the SFT env ({env.name}) has no SFT targets")
    if c.target_pass1 and run.engine and env.tokenizer.eos_id != run.engine.eos_id:
      raise ValueError(f"the SFT env's EOS {env.tokenizer.eos_id} is not the engine's "
                       f"{run.engine.eos_id}: its probe cannot run (sft.target_pass1 = 0)")

  def make_step(lr_factor: float):
    # the optimizer state does not depend on the schedule: a slower step continues it
    optimizer = block_optimizer(c, lr_factor=lr_factor)
    return optimizer, learner.make_sft_step(run.cfg, optimizer, numerics=run.numerics,
                                            sharding=run.sharding)

  optimizer, step_fn = make_step(1.0)
  state = learner.init_state(run.state.params, optimizer)
  slowed = False
  tasks = task_stream(env, c.num_tasks, run.config.seed + 1)
  shape = run.batch_shape(c.batch_size)
  probe = env.prompts("train", c.probe_tasks, run.config.seed + 2) if c.target_pass1 else []
  metrics, probe_pass1, step = {}, 0.0, 0
  t0 = time.perf_counter()
  for step in progress(range(1, c.steps + 1)):
    trajs = [sft_trajectory(env, t) for t in itertools.islice(tasks, c.batch_size)]
    batch = build_batch(trajs, np.zeros(len(trajs)), np.ones(len(trajs), bool), **shape)
    state, metrics = step_fn(state, split_microbatches(batch, c.microbatches))
    if step % c.log_every == 0 or step == c.steps:
      run.log.write("sft", step, jax.device_get(metrics))
    if probe and step % (c.probe_every_slow if slowed else c.probe_every) == 0:
      run.engine.update_weights(run.serve(state), 0)
      probe_pass1 = success_rate(greedy_groups(run.engine, env, probe, seed=0,
                                               max_new_tokens=run.config.rl.max_new_tokens,
                                               failures=run.failures))
      run.log.write("sft_probe", step, {"train_probe_pass1": probe_pass1})
      if probe_pass1 >= c.target_pass1:
        break
      if not slowed and probe_pass1 >= c.slow_down_at:
        if c.slow_down_factor != 1.0:  # 1.0: only the probe gets finer (no recompile)
          _, step_fn = make_step(c.slow_down_factor)
        slowed = True
        run.log.write("sft_slow_down", step, {"lr_factor": c.slow_down_factor})
  run.state = params_only(state.params)
  out = {"sft_steps": step, "sft_s": time.perf_counter() - t0,
         "sft_nll": float(metrics["nll"]) if "nll" in metrics else None}
  if probe:  # the last line must stay strict JSON: no NaN for "not probed"
    out["sft_train_probe_pass1"] = probe_pass1
  return out


def save_params(run: Run, directory: str) -> None:
  """run.state's params (a LoRA run's GRPO state: the base with its adapters merged, as
  f32), the tree `load_params` and `experiments/export_hf.py --params` read."""
  params = run.state.params
  if run.base is not None:
    params = jax.tree.map(lambda x: x.astype(jnp.float32), run.serve(run.state))
  with Checkpointer(directory, keep_last=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": params}, stream_version=None)


def load_params(run: Run, directory: str) -> None:
  with Checkpointer(directory, keep_last=1) as ckpt:
    restored = ckpt.restore({"params": run.state.params})
  run.state = params_only(restored.state["params"])


def check_sft_dir(config: ml_collections.ConfigDict, sft_dir: str) -> None:
  """A warm start must not overwrite an earlier run's SFT checkpoint."""
  if not config.sft.load and config.sft.steps and epath.Path(sft_dir).exists():
    raise FileExistsError(f"{sft_dir} exists (an earlier run's): use a fresh workdir (several "
                          f"trainer processes: a fresh root), or --config.sft.load={sft_dir} "
                          "to start from it")


def warm_start(run: Run, sft_dir: str, progress: Callable[..., Iterator]) -> dict:
  """The SFT checkpoint `sft.load`, or an SFT warm start saved to `sft_dir` (nothing with
  sft.steps 0). Returns the summary's sft fields."""
  c = run.config.sft
  if c.load:
    load_params(run, c.load)
    return {"sft_loaded_from": c.load}
  if not c.steps:
    return {}
  check_sft_dir(run.config, sft_dir)
  out = sft(run, functools.partial(progress, desc="sft"))
  save_params(run, sft_dir)
  return out


def reload(run: Run, sft_dir: str) -> None:
  """A resumed run's warm start, not run again: the params GRPO started from (the
  checkpoint `sft.load`, or the one `warm_start` saved to `sft_dir`; nothing with
  sft.steps 0: `setup`'s initial params), bit for bit."""
  c = run.config.sft
  if c.load or c.steps:
    load_params(run, c.load or sft_dir)
