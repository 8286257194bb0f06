"""Re-scoring trained tokens with the weights that sampled them: the async run's mismatch.

An async batch mixes tokens of several versions, so the learner's own mismatch figure
(tokens of the version being trained) may cover none of them. `VersionCheck` keeps the
serving params of the versions a batch may still hold (the newest `max_staleness + 2`)
and recomputes the log-prob of every loss token in a sample of each batch's groups with
its own version's weights: |trainer - behaviour| is exactly 0.0 in deterministic numerics
when hosts recompute running sequences' KV on a weight update
(`async_rl.weight_update="recompute"`; with "keep", a token sampled after an update saw
keys and values of the older weights), and fast mode's mismatch otherwise. Tokens of
versions no longer held (abandoned by a trainer restart) are counted unchecked.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rljax.model import forward
from rljax.pipeline.grpo_update import batch_part
from rljax.pipeline.metrics import RunningMax
from rljax.rl.batch import TrainBatch, build_batch, global_batch, split_microbatches
from rljax.rl.trajectory import Trajectory


class VersionCheck:
  """Holds recent versions' serving params and re-scores sampled groups with them.

  With several trainer processes each re-scores the checked groups of its part of the
  batch (rljax.pipeline.grpo_update.batch_part) and the figures are reduced across all of them:
  every process is given the same `versions` (process 0 knows them: `versions_of`)."""

  def __init__(self, run: Any, *, groups: int, keep_versions: int):
    self.run, self.groups, self.keep_versions = run, groups, keep_versions
    self.params: dict[int, Any] = {}
    self.mismatch = RunningMax()
    self.unchecked_tokens = 0
    rl = run.config.rl
    cfg, numerics = run.cfg, run.numerics

    def covered(batch: TrainBatch, version):
      return batch.loss_mask & (batch.seq_ids >= 0) & (batch.versions == version)

    def score(params, batches: TrainBatch, version):
      batch = jax.tree.map(lambda x: x[0], batches)  # one microbatch
      lp = forward(params, batch.tokens, batch.positions, cfg=cfg, numerics=numerics,
                   segment_ids=batch.segment_ids, targets=batch.targets,
                   temperature=rl.temperature,
                   routing=batch.routing if rl.router_replay else None).logprobs
      mine = covered(batch, version)
      # jnp.max propagates a NaN on a covered token
      return (jnp.max(jnp.where(mine, jnp.abs(lp - batch.behaviour_logprobs), 0.0)),
              jnp.sum(mine.astype(jnp.int32)))

    def count(batches: TrainBatch, version):
      return jnp.sum(covered(jax.tree.map(lambda x: x[0], batches), version).astype(jnp.int32))

    self._score, self._count = jax.jit(score), jax.jit(count)

  def hold(self, version: int, params: Any) -> None:
    """The serving params of a newly published version (read-only from here on)."""
    self.params[version] = params
    oldest = version - self.keep_versions + 1
    self.params = {v: p for v, p in self.params.items() if v >= oldest}

  def checked(self, groups: Sequence[Sequence[Trajectory]], parts: int = 1) -> list:
    """The groups of a batch part that are re-scored: the first `groups` of the batch,
    spread evenly over its `parts` (every part checks as many)."""
    return list(groups[:-(-self.groups // parts)])

  def versions_of(self, groups: Sequence[Sequence[Trajectory]], parts: int = 1) -> list[int]:
    """The versions that sampled the checked tokens of the whole batch `groups`."""
    per_part = len(groups) // parts
    return sorted({int(v) for p in range(parts)
                   for g in self.checked(groups[p * per_part:(p + 1) * per_part], parts)
                   for t in g for v in t.versions[t.loss_mask]})

  def check(self, groups: Sequence[Sequence[Trajectory]],
            versions: Sequence[int] | None = None) -> None:
    """Re-scores the checked groups of this process's `groups` (the whole batch, or its
    part) with the weights of each of `versions` (default: `versions_of(groups)`; several
    processes must pass the whole batch's). Every process calls it: the scoring forward
    runs on the trainer's mesh and its figures are reduced over all of them."""
    part, parts = batch_part(self.run)
    if versions is None:
      if jax.process_count() > 1:
        raise ValueError("several processes re-score with the whole batch's versions")
      versions = self.versions_of(groups)
    trajs = [t for g in self.checked(groups, parts) for t in g]
    if not trajs:
      return
    batch = split_microbatches(build_batch(
        trajs, np.zeros(len(trajs), np.float32), np.ones(len(trajs), bool),
        with_routing=self.run.config.rl.router_replay,
        **self.run.batch_shape(len(trajs))), 1)
    if jax.process_count() > 1:
      batch = global_batch(batch, self.run.sharding, first_seq=part * len(trajs),
                           advantages=np.zeros(len(trajs) * parts, np.float32),
                           valid=np.ones(len(trajs) * parts, bool))
    for version in versions:
      if version not in self.params:
        self.unchecked_tokens += int(self._count(batch, np.int32(version)))
        continue
      diff, tokens = self._score(self.params[version], batch, np.int32(version))
      if int(tokens):
        self.mismatch.add(float(diff), int(tokens))

  def summary(self) -> dict[str, Any]:
    return {"own_version_mismatch_max_abs": self.mismatch.value,
            "own_version_tokens": {"checked": self.mismatch.tokens,
                                   "unchecked": self.unchecked_tokens}}
