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
import numpy as np

from rljax import distributed
from rljax.model import forward
from rljax.pipeline.metrics import RunningMax
from rljax.rl.batch import TrainBatch, build_batch
from rljax.rl.trajectory import Trajectory


class VersionCheck:
  """Holds recent versions' serving params and re-scores sampled groups with them."""

  def __init__(self, run: Any, *, groups: int, keep_versions: int):
    self.run, self.groups, self.keep_versions = run, groups, keep_versions
    self.params: dict[int, Any] = {}
    self.mismatch = RunningMax()
    self.unchecked_tokens = 0
    rl = run.config.rl
    cfg, numerics = run.cfg, run.numerics

    def score(params, batch: TrainBatch):
      return forward(params, batch.tokens, batch.positions, cfg=cfg, numerics=numerics,
                     segment_ids=batch.segment_ids, targets=batch.targets,
                     temperature=rl.temperature,
                     routing=batch.routing if rl.router_replay else None).logprobs

    self._score = jax.jit(score)

  def hold(self, version: int, params: Any) -> None:
    """The serving params of a newly published version (read-only from here on)."""
    self.params[version] = params
    oldest = version - self.keep_versions + 1
    self.params = {v: p for v, p in self.params.items() if v >= oldest}

  def check(self, groups: Sequence[Sequence[Trajectory]]) -> None:
    """Re-scores the first `groups` groups of a batch (every process: the scoring forward
    runs on the trainer's mesh and its result is gathered)."""
    trajs = [t for g in groups[:self.groups] for t in g]
    if not trajs:
      return
    batch = build_batch(trajs, np.zeros(len(trajs), np.float32), np.ones(len(trajs), bool),
                        with_routing=self.run.config.rl.router_replay,
                        **self.run.batch_shape(len(trajs)))
    on = batch.loss_mask & (batch.seq_ids >= 0)
    for version in np.unique(batch.versions[on]):
      mine = on & (batch.versions == version)
      if int(version) not in self.params:
        self.unchecked_tokens += int(mine.sum())
        continue
      lp = distributed.gather(self._score(self.params[int(version)], batch))
      diff = np.abs(lp - batch.behaviour_logprobs)[mine]
      self.mismatch.add(float(diff.max()), int(mine.sum()))

  def summary(self) -> dict[str, Any]:
    return {"own_version_mismatch_max_abs": self.mismatch.value,
            "own_version_tokens": {"checked": self.mismatch.tokens,
                                   "unchecked": self.unchecked_tokens}}
