"""A run's state, the ground both GRPO loops stand on.

`setup(built, workdir)` makes a `Run` (params, engine, metrics logger) from `build(config)`;
`initial_params` are its params before any training (serve.py's too); `task_stream` its
train tasks. Above it: `sft` warm-starts a run on reference completions, `report` scores
held-out tasks with the engine and raises the alarms, `grpo_update` makes the learner of
the `rl` block and runs one update on scored groups (`train_on_groups`). The lockstep
loop (rljax.pipeline.lockstep) and the async trainer (rljax.pipeline.async_loop) are two
ways of feeding `train_on_groups`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rljax.engine.engine import DecodeEngine
from rljax.envs.base import Env, Task
from rljax.model import count_params, init_sharded, param_shardings
from rljax.model.hf_import import load_hf_params
from rljax.model.packing import aligned_length
from rljax.pipeline.metrics import (FallAlarm, MetricsLogger, NullLogger, RunningMax,
                                    SuccessFallAlarm)
from rljax.pipeline.rollout import FailureLog
from rljax.pipeline.run import Built, init_from_hf, rows_for
from rljax.pipeline.watch import MAX_ALL_INFRA_UPDATES, RolloutWatch
from rljax.rl import learner


def task_stream(env: Env, n: int, seed: int) -> Iterator[Task]:
  """The run's train tasks: n distinct ones, reshuffled on every pass."""
  tasks = env.prompts("train", n, seed)
  rng = np.random.default_rng(seed)
  while True:
    for i in rng.permutation(len(tasks)):
      yield tasks[i]


def params_only(params: Any) -> learner.TrainState:
  """The state between phases: f32 params; each phase builds its own optimizer state."""
  return learner.TrainState(params, (), jnp.zeros((), jnp.int32))


# a held-out fall from the best that raises the collapse alarm, unless config.eval.collapse_fall
# says otherwise: healthy runs of the recipe study fell at most 0.08 (evaluation noise
# included); the collapse that started it fell 0.36
COLLAPSE_FALL = 0.15
# the training signal's alarm (metrics.SuccessFallAlarm), unless config.rl.collapse_fall /
# config.rl.collapse_window say otherwise: the moving average of the sampled success
# fraction over this many updates, this far below its first full window's
TRAIN_COLLAPSE_FALL = 0.15
TRAIN_COLLAPSE_WINDOW = 10


@dataclasses.dataclass
class Run:
  """Everything one run holds; made by `setup`, driven by `sft`, the loops and `run_eval`."""

  built: Built
  heldout: list[Task]
  engine: DecodeEngine | None
  state: learner.TrainState
  serve: Callable[[learner.TrainState], Any]
  log: MetricsLogger | NullLogger
  version: int = 0
  # config.lora, once GRPO trains adapters: the frozen base (state = the adapters')
  base: Any = None
  # over the tokens sampled by the version each update trained (see grpo_update)
  mismatch: RunningMax = dataclasses.field(default_factory=RunningMax)
  # held-out pass@1 from the warm start on
  heldout_fall: FallAlarm = dataclasses.field(default_factory=lambda: FallAlarm(COLLAPSE_FALL))
  # the sampled success fraction of every update (process 0 logs it; a resumed async
  # trainer starts it afresh: its start is the first full window after the resume)
  train_fall: SuccessFallAlarm = dataclasses.field(
      default_factory=lambda: SuccessFallAlarm(TRAIN_COLLAPSE_FALL, TRAIN_COLLAPSE_WINDOW))
  timings: dict = dataclasses.field(default_factory=lambda: {"rollout_s": 0.0, "train_s": 0.0})
  # infra failures of this process's episodes (each kind logged once) and of every update
  failures: FailureLog = dataclasses.field(default_factory=FailureLog)
  watch: RolloutWatch = dataclasses.field(default_factory=RolloutWatch)

  config = property(lambda self: self.built.config)
  cfg = property(lambda self: self.built.cfg)
  numerics = property(lambda self: self.built.numerics)
  sharding = property(lambda self: self.built.sharding)
  env = property(lambda self: self.built.env)

  @property
  def max_seq_len(self) -> int:
    return self.config.engine.max_seq_len

  def batch_shape(self, num_seqs: int) -> dict[str, int]:
    """Packed rows for num_seqs sequences. `train.row_len` 0: one longest sequence per row
    (page-aligned). Rows are sized for the longest sequences, so longer rows hold no fewer
    tokens in all; they only widen every row's attention (cost ~ row_len^2)."""
    row_len = (self.config.train.row_len
               or aligned_length(self.max_seq_len, self.cfg.page_size))
    return dict(row_len=row_len, num_seqs=num_seqs, page_size=self.cfg.page_size,
                num_rows=rows_for(num_seqs, self.max_seq_len, row_len, self.cfg.page_size))


def initial_params(built: Built, dtype: Any = jnp.float32) -> Any:
  """The run's params before any training, as `dtype`: `config.init_from`'s checkpoint
  (read as `dtype`, each device's shard from the files, no random init first), else a
  random init from `config.seed` (drawn in f32, then cast); on `built.sharding` (None: one
  device)."""
  cfg, sharding = built.cfg, built.sharding
  hf_dir = init_from_hf(built.config)
  if hf_dir is None:
    params = init_sharded(cfg, built.config.seed, sharding, dtype=jnp.float32)
    return (params if jnp.dtype(dtype) == jnp.float32
            else jax.tree.map(lambda x: x.astype(dtype), params))
  return load_hf_params(hf_dir, cfg, dtype,
                        None if sharding is None else param_shardings(cfg, sharding))


def setup(built: Built, workdir: str, *, engine: bool = True) -> Run:
  """The run's held-out tasks, initial params, engine and metrics logger. `engine=False`:
  no DecodeEngine. The engine runs on the trainer's mesh with the decode rules
  (`Built.trainer_engine_sharding`). Several processes (jax.distributed): each holds its
  part of the params and the same engine, one SPMD program over the whole mesh that every
  process drives in lockstep; records are written by process 0 only."""
  config, cfg = built.config, built.cfg
  heldout = built.env.prompts("held_out", config.eval.num_tasks, config.eval.seed)
  params = initial_params(built)
  serve = jax.jit(lambda state: learner.serving_params(state, cfg))
  state = params_only(params)
  decode = (built.make_engine(serve(state), sharding=built.trainer_engine_sharding())
            if engine else None)
  log = (MetricsLogger(workdir, tensorboard=config.log.tensorboard)
         if jax.process_index() == 0 else NullLogger(workdir))
  log.write("run", 0, {"params": count_params(params), "devices": jax.device_count(),
                       "processes": jax.process_count()})
  rl = config.rl if "rl" in config else ml_collections.ConfigDict()
  return Run(built, heldout, decode, state, serve, log,
             heldout_fall=FallAlarm(config.eval.get("collapse_fall", COLLAPSE_FALL)),
             train_fall=SuccessFallAlarm(rl.get("collapse_fall", TRAIN_COLLAPSE_FALL),
                                         rl.get("collapse_window", TRAIN_COLLAPSE_WINDOW)),
             watch=RolloutWatch(rl.get("max_all_infra_updates", MAX_ALL_INFRA_UPDATES)))
