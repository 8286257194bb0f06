"""The asynchronous GRPO trainer: rollout hosts keep sampling while the trainer learns.

    trainer                                      storage root              rollout hosts
    publish v ─────────────────────────────────► stream/         ◄── poll, apply in flight
    submit groups, grant leases (admission) ───► queue/trainer/  ◄── lease, generate, push
    complete groups, staleness <= max ◄──────── queue/hosts/*/results/
    update on P groups ─► v+1 ─► publish ...    run/hosts/*.json ◄── host status (applies)
    run over ──────────────────────────────────► run/done

The trainer's only link to its hosts is the storage root (`file://` on one machine, `gs://`
across many). Every update trains on `rl.prompts_per_step` complete groups (a group is
never split: its baseline needs all of its samples) whose staleness, the trainer's
version minus the oldest version that sampled any of its tokens, is at most
`async_rl.max_staleness`; staler groups are dropped and counted. Admission control is the
queue's: at most `prompts_per_step * (max_staleness + 1)` groups are granted and not yet
trained, so hosts cannot run further ahead than the staleness bound can use. Off-policy
tokens are corrected by the learner against the behaviour log-probs the hosts recorded
(TIS / MIS per `rl.loss`).

Versions are stream versions. A trainer restarted from a checkpoint at version v resumes
the stream there (`Publisher.resume`) and publishes its next version after the newest in
the store; versions published after v by the dead trainer are abandoned (hosts rejoin from
a keyframe). The queue resumes from its own state (`QueueOwner.open`): no group is ever
trained twice. Groups trained after the checkpoint lost their update with the dead
trainer: their tasks go back into the queue as new groups.

rl.kl_to_start: the start policy the step measures the KL to is saved once beside the
checkpoints (`kl_reference`; config.lora: the base is that policy) and restored on resume.

config.lora (rljax.pipeline.adapter_stream): GRPO trains adapters on a frozen base, and
each version of the stream is the adapters' f32 masters, not a merged model; the base goes
out once, as `<root>/base/`, and is saved once beside the checkpoints (`lora_base`), which
hold the adapters' train state. Hosts merge with the trainer's own jitted merge. A resume
restores both and checks the base against `base/`, bit for bit, before training on.

Fidelity: `async_rl.check_versions_groups` groups of every batch are re-scored with the
weights of the version that sampled each token (rljax.pipeline.fidelity): the summary's
`own_version_mismatch_max_abs`, with the tokens it covers. The learner's `mismatch_max_abs`
covers only tokens of the version being trained, often none in an async run (then null).

The lineage (rljax.pipeline.lineage, <workdir>/trained_groups.jsonl) lists the group ids,
hosts and tasks of every update (a restart cuts it back to its checkpoint).

Infra failures: hosts score episodes and log the first failure of each kind with its
traceback; the reasons reach the trainer on the wire (`Trajectory.infra_reason`) and the
first failures in the hosts' status records, which the trainer logs once each. Every
update's record counts them (`infra_failures`, `reward_errors`, `infra_failures_<reason>`);
every episode an infra failure for `rl.max_all_infra_updates` consecutive updates stops
the trainer (`watch.AllInfraFailures`, on every trainer process).

Metrics per update (JSONL + TensorBoard, phase "async"): ttb_s (seconds from asking for a
batch to having it: time-to-trainable-batch; all of it is trainer stall), train_s,
staleness mean/max over the batch's tokens, dropped_stale, queue accounting, and from the
hosts' status records: publish->apply latency and apply pause of the newest version each
host applied, rollout tokens/s, host idle fraction.

Several trainer processes (`jax.distributed`, rljax.distributed): together they hold the
train state on `config.mesh`, which must span every device of the job. Process 0 alone
owns the work queue, the lineage, the metrics, the reward curve and the `run/` keys (and
an entry point's local rollout hosts). Each update it broadcasts a plan of the groups it
took (ids, result keys, advantages: `share_update`); every process reads the groups of its
part of the batch rows (`grpo_update.batch_part`) from the storage root, packs only those and
feeds them as its slice of the global batch (`rljax.rl.batch.global_batch`), and all run
the same jitted sharded GRPO step. Every process publishes the stream shards it holds
(Publisher) and writes its part of each orbax checkpoint, under `<root>/trainer/` (a
directory all of them reach; one process keeps them in its workdir). Evaluations (and
SFT's probes) run on one DecodeEngine over the whole mesh that every process drives in
lockstep (rljax.pipeline.core.setup): no process gathers the params.
"""


from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from typing import Any, Callable, Iterator

from etils import epath
import jax
import ml_collections
import numpy as np

from rljax import distributed
from rljax.checkpoint import Checkpointer
from rljax.pipeline import adapter_stream, core, grpo_update, npz, report, sft, watch, wire
from rljax.pipeline.fidelity import VersionCheck
from rljax.pipeline.layout import (DONE_KEY, QUEUE_PREFIX, check_root, publish_fingerprint,
                                   read_host_status, stream_url, trainer_dir)
from rljax.pipeline.lineage import Lineage
from rljax.pipeline.metrics import host_metrics, plot_reward_curve, read_jsonl
from rljax.pipeline.queue_owner import QueueOwner
from rljax.pipeline.rollout import log_first_failure
from rljax.pipeline.run import ASYNC_TRAINER, Built, build
from rljax.pipeline.work_queue import GroupSpec, QueueConfig
from rljax.rl.trajectory import Trajectory
from rljax.sync.publisher import Publisher
from rljax.sync.store import Store


REFERENCE_CHECKPOINT = "kl_reference"


def reference_dir(trainer_dir: str) -> str:
  """Where a `rl.kl_to_start` trainer (full fine-tuning) saves its start policy: beside its
  `checkpoints`."""
  return f"{str(trainer_dir).rstrip('/')}/{REFERENCE_CHECKPOINT}"


def save_reference(trainer_dir: str, reference: Any) -> None:
  """A fresh `rl.kl_to_start` run's start policy (serving dtype), saved once: a resumed
  trainer keeps measuring the KL to it. Call on every trainer process."""
  directory = reference_dir(trainer_dir)
  if epath.Path(directory).exists():
    raise FileExistsError(f"{directory} holds an earlier run's start policy but there is no "
                          "checkpoint to resume: use a fresh workdir and root")
  with Checkpointer(directory, keep_last=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": reference}, stream_version=0)


def restore_reference(trainer_dir: str, built: Built) -> Any:
  """The start policy `save_reference` saved, onto the trainer's mesh."""
  directory = reference_dir(trainer_dir)
  if not epath.Path(directory).exists():
    raise FileNotFoundError(f"{directory} is missing: config.rl.kl_to_start needs the start "
                            "policy saved beside the checkpoints (was this run started "
                            "without it? resume with --config.rl.kl_to_start=False)")
  with Checkpointer(directory, keep_last=1) as ckpt:
    return ckpt.restore({"params": adapter_stream.base_target(built.cfg, built.sharding)}
                        ).state["params"]


def group_staleness(version: int, trajs: list[Trajectory]) -> int:
  """Trainer version minus the oldest version that sampled a token of the group."""
  oldest = [t.oldest_version for t in trajs if t.loss_mask.any()]
  return version - min(oldest) if oldest else 0


@dataclasses.dataclass(frozen=True)
class Update:
  """One update's batch as a trainer process holds it: `groups`, the groups of its part of
  the batch (all of them with one process) and the whole batch's `advantages` and
  fidelity-check `versions`. Process 0 also holds `taken`: every group of the batch with
  its ReadyGroup (queue, lineage and metrics are its)."""

  groups: list[list[Trajectory]]
  advantages: grpo_update.Advantages
  versions: list[int]
  taken: list[tuple[Any, list[Trajectory]]] | None = None


def share_update(take: Callable[[], Update], part: int, parts: int, store: Store) -> Update:
  """The update `take()` makes on process 0, on every process, each holding only its part
  of the groups. Process 0 broadcasts the plan (group ids, result keys, advantages,
  versions: bytes per sample, not per token); every other process reads its part's groups
  from the storage root, where they stay until process 0 finalizes them after the
  update. A take() that raised on process 0 raises on every process."""
  if jax.process_count() == 1:
    return take()
  if distributed.is_primary():
    try:
      update = take()
    except BaseException as err:
      distributed.broadcast_bytes(npz.encode({"kind": "error", "message": repr(err)}, {}))
      raise
    ids, keys = [r.group_id for r, _ in update.taken], [r.key for r, _ in update.taken]
    distributed.broadcast_bytes(npz.encode(
        {"kind": "update", "group_ids": ids, "keys": keys, "versions": update.versions},
        {"advantages": update.advantages.values, "valid": update.advantages.valid}))
  else:
    header, arrays = npz.decode(distributed.broadcast_bytes(None))
    if header["kind"] == "error":
      raise RuntimeError(f"trainer process 0 failed: {header['message']}")
    ids, keys = header["group_ids"], header["keys"]
    update = Update([], grpo_update.Advantages(arrays["advantages"], arrays["valid"], {}),
                    header["versions"])
  per_part = len(ids) // parts
  mine = slice(part * per_part, (part + 1) * per_part)
  if update.taken is not None:
    return dataclasses.replace(update, groups=[g for _, g in update.taken][mine])
  groups = []
  for gid, key, raw in zip(ids[mine], keys[mine], store.read_many(keys[mine])):
    if raw is None:
      raise RuntimeError(f"group {gid}'s result {key} is gone from the storage root before "
                         "its update")
    groups.append(wire.group_from_arrays(npz.decode(raw)[1], gid))
  return dataclasses.replace(update, groups=groups)


class AsyncTrainer:
  """One async run's trainer side; `run_async` drives it (on every trainer process).

  Its parts: admission (`_top_up`, the queue's max_outstanding), the batch filters
  (`_take_batch`: staleness, dynamic-sampling ties), publishing, checkpoints and resume;
  the lineage, the version check and the batch broadcast are their own pieces."""

  def __init__(self, built: Built, workdir: str, root: str, *, resume: bool = False):
    config = built.config
    self.config, self.root = config, root
    self.a, self.rl = config.async_rl, config.rl
    self.multi = jax.process_count() > 1
    self.primary = distributed.is_primary()
    if self.multi:
      distributed.check_mesh(config.mesh.to_dict())
    self.dir = trainer_dir(root, workdir)
    self.ckpt = Checkpointer(f"{self.dir.rstrip('/')}/checkpoints", keep_last=2)
    latest = self.ckpt.latest_step()
    if latest is not None and not resume:  # before any model work
      raise FileExistsError(
          f"{self.dir} holds the checkpoints of an earlier run (update {latest}): pass "
          "--resume to continue it, or use a fresh workdir and root")
    self.run = core.setup(built, workdir)
    self.store = Store.open(check_root(root))
    self.lineage = Lineage(self.run.log.workdir)
    self.part = grpo_update.batch_part(self.run)  # (this process's part, parts) of every batch
    if self.multi:
      grpo_update.check_batch_parts(self.run)
      # gloo (CPU) gives the first collective of a device set 30 s to gather: everyone, now
      distributed.broadcast_bytes(b"ready" if self.primary else None)
    self.publish_times: dict[int, float] = {}
    self.updates = 0
    self.dropped_stale = 0
    self.dropped_no_signal = 0
    self.sampled: list[Trajectory] = []  # fresh-enough episodes since the last update
    # dynamic sampling drops at most as many tied groups per update as the lockstep loop's
    # rounds can (2 * (rounds - 1) * prompts_per_step); past that, ties are trained on, so
    # a policy that fails (or solves) everything still makes progress
    self.tie_budget = 2 * (self.rl.dynamic_sampling_rounds - 1) * self.rl.prompts_per_step
    self.ties_dropped_this_update = 0
    self.totals = {"ttb_s": [], "staleness": [], "train_s": 0.0}
    self.pool: list[tuple[Any, list[Trajectory]]] = []
    self.extra: dict[str, Any] = {}
    self.check = (VersionCheck(self.run, groups=self.a.check_versions_groups,
                               keep_versions=self.a.max_staleness + 2)
                  if self.a.check_versions_groups > 0 else None)
    self.owner: QueueOwner | None = None  # process 0's
    # "<host>: <kind>" -> the first infra failure of that kind a host reported (logged once)
    self.host_errors: dict[str, dict] = {}
    # config.lora: the stream carries the adapters, the base goes out once (adapter_stream)
    self.lora = built.lora

  # ---- start or resume -------------------------------------------------------------------

  def start(self, progress: Callable[..., Iterator],
            on_published: Callable[[], None] | None = None) -> list[dict]:
    """SFT (or an SFT checkpoint) and version 0, or the latest checkpoint in `self.dir`;
    `on_published` runs once weights are in the stream (before the "before" evaluation,
    so hosts starting up overlap it). Returns the evaluations run so far."""
    run, evals = self.run, []
    if self.primary:  # before any weights: hosts check it once they see version 0
      publish_fingerprint(self.store, self.config)
    if self.ckpt.latest_step() is not None:  # --resume (else __init__ refused)
      self._resume()
    else:
      evals.append(self.evaluate(0, "init"))
      self.extra |= sft.warm_start(run, f"{self.dir.rstrip('/')}/sft_checkpoint", progress)
      self.grpo = grpo_update.grpo_learner(run)
      if self.grpo.ref_params is not None and self.lora is None:  # (LoRA's: the base)
        save_reference(self.dir, self.grpo.ref_params)
      self.publisher = self._stream_publisher()
      if self.publisher.version is not None:
        raise ValueError(f"{self.root} already holds a stream but {run.log.workdir} has no "
                         "checkpoint: use a fresh root, or the workdir that wrote it")
      if self.lora is not None:  # saved beside the checkpoints, and out to the hosts once
        adapter_stream.start_base(self.root, self.dir, run.base)
      self._publish()  # version 0
      if self.primary:
        self.owner = QueueOwner.open(self.store, self._queue_config(), prefix=QUEUE_PREFIX)
    if on_published is not None and self.primary:
      on_published()
    evals.append(self.evaluate(run.version, "before"))
    return evals

  def evaluate(self, step: int, name: str) -> dict:
    """report.run_eval (several processes: every one runs the SPMD engine; the figures are
    the same on all of them, process 0 writes them)."""
    return report.run_eval(self.run, step, name)

  def _queue_config(self) -> QueueConfig:
    return QueueConfig(max_outstanding=self.rl.prompts_per_step * (self.a.max_staleness + 1),
                       lease_s=self.a.lease_s, lease_ttl_s=self.a.lease_ttl_s)

  def _stream_publisher(self) -> Publisher:
    """The weight stream's publisher: the serving params (bf16) each version, or with
    config.lora the adapters' f32 masters (the bits the merge reads)."""
    if self.lora is None:
      return Publisher(stream_url(self.root), keyframe_every=self.a.keyframe_every)
    return Publisher(stream_url(self.root), keyframe_every=self.a.keyframe_every,
                     dtype=adapter_stream.ADAPTER_DTYPE,
                     delta_codec=adapter_stream.ADAPTER_DELTA_CODEC)

  def _stream_params(self) -> Any:
    """What a version of the stream holds: run.state's adapters (config.lora), else its
    serving params."""
    run = self.run
    return run.state.params if self.lora is not None else run.serve(run.state)

  def _resume(self) -> None:
    run = self.run
    base = None
    if self.lora is not None:  # the base it trained on, the very bits the hosts hold
      base = adapter_stream.restore_base(self.dir, run.cfg, run.sharding)
      adapter_stream.verify_base(self.root, base, self.dir)
    elif adapter_stream.has_base(self.dir):
      raise ValueError(f"{self.dir} holds a config.lora run's checkpoints (its frozen base "
                       f"{adapter_stream.base_checkpoint_dir(self.dir)}): resume it with the "
                       "config.lora block it ran with")
    reference = None  # rl.kl_to_start: the policy the run started from (LoRA's: the base)
    if run.built.kl_to_start and self.lora is None:
      reference = restore_reference(self.dir, run.built)
    fresh = grpo_update.grpo_learner(run, base=base, reference=reference)
    restored = self.ckpt.restore({"state": fresh.state})
    self.grpo = grpo_update.grpo_learner(run, state=restored.state["state"], base=base,
                                         reference=reference)
    run.state = self.grpo.state
    self.updates = restored.step
    self.publisher = self._stream_publisher()
    # the restored state's bits must be those of the version its checkpoint recorded
    self.publisher.resume(self._stream_params(), restored.stream_version)
    if self.check is not None:  # the checkpoint's version: groups hosts sampled with it
      self.check.hold(restored.stream_version, run.serve(run.state))
    # versions the dead trainer published after its checkpoint are abandoned: the restored
    # params go out again as the newest version, so hosts are back on this lineage
    self._publish()
    if self.primary:
      self.owner = QueueOwner.open(self.store, self._queue_config(), prefix=QUEUE_PREFIX)
      self.extra["requeued_after_rollback"] = self._requeue_lost(restored.step)
    self.extra["resumed_from_update"] = restored.step
    self.extra["resumed_stream_version"] = restored.stream_version

  def _requeue_lost(self, step: int) -> int:
    """Cuts the lineage back to the checkpoint's `step` updates and submits the groups of
    the updates after it again, as new groups with the same tasks: the queue had finalized
    them (their results are gone) but their update was lost with the dead trainer. A
    group the queue has not finalized (the trainer died before persisting it) is delivered
    again as it is. Returns how many groups went back into the queue."""
    lost = self.lineage.cut_back(step)
    tasks = [task for l in lost for gid, task in zip(l["groups"], l["tasks"])
             if self.owner.is_finalized(gid)]
    if tasks:
      first = self.owner.next_group_id
      self.owner.submit([GroupSpec(first + i, task, self.rl.group_size)
                         for i, task in enumerate(tasks)])
      self.owner.flush()
    return len(tasks)

  # ---- the loop ----------------------------------------------------------------------------

  def _publish(self) -> None:
    """Publishes run.state as the version after the store's newest (run.version's one
    unless a dead trainer published past our checkpoint)."""
    newest = self.publisher.version
    self.run.version = 0 if newest is None else newest + 1
    published = self._stream_params()  # read-only from here on: shared with the check
    self.publisher.publish(published, self.run.version)
    self.publish_times[self.run.version] = time.time()
    if self.check is not None:
      served = published if self.lora is None else self.run.serve(self.run.state)
      self.check.hold(self.run.version, served)

  def _top_up(self, tasks: Iterator) -> None:
    """Keeps enough groups submitted that hosts never wait on the trainer for work."""
    acc = self.owner.accounting()
    want = self._queue_config().max_outstanding + self.rl.prompts_per_step
    missing = want - (acc["pending"] + acc["leased"] + acc["ready"])
    if missing > 0:
      first = self.owner.next_group_id
      specs = [GroupSpec(first + i, wire.task_to_payload(task), self.rl.group_size)
               for i, task in enumerate(itertools.islice(tasks, missing))]
      self.owner.submit(specs)

  def _collect(self) -> None:
    self.owner.step()
    for ready in self.owner.ready():
      self.pool.append((ready, wire.group_from_arrays(ready.arrays, ready.group_id)))

  def _take_batch(self) -> list[tuple[Any, list[Trajectory]]]:
    """The oldest fresh-enough complete groups: drops the ones past max_staleness and,
    with dynamic sampling (rl.dynamic_sampling_rounds > 1, up to `tie_budget` per update),
    the ones whose rewards all tie (no advantage; hosts sample fresh prompts instead)."""
    keep = []
    for ready, trajs in self.pool:
      filter_ties = self.ties_dropped_this_update < self.tie_budget
      if group_staleness(self.run.version, trajs) > self.a.max_staleness:
        self.owner.mark_dropped(ready.group_id, "stale")
        self.dropped_stale += 1
      elif filter_ties and not grpo_update.has_signal(trajs, self.run.config.rl.overlong):
        self.owner.mark_dropped(ready.group_id, "no_signal")
        self.dropped_no_signal += 1
        self.ties_dropped_this_update += 1
        self.sampled += trajs
      else:
        keep.append((ready, trajs))
        self.sampled += trajs
    keep.sort(key=lambda item: item[0].group_id)
    p = self.rl.prompts_per_step
    self.pool = keep[p:]
    return keep[:p]

  def train(self, progress: Callable[..., Iterator]) -> None:
    run = self.run
    tasks = None
    if self.primary:  # group g is task g of the run's task stream: a resumed queue goes on
      tasks = itertools.islice(core.task_stream(run.env, self.rl.num_tasks, self.config.seed),
                               self.owner.next_group_id, None)
    e = self.config.eval
    for _ in progress(range(self.updates, self.rl.steps), desc="grpo-async"):
      t0 = time.perf_counter()
      update = share_update(functools.partial(self._next_update, tasks, t0), *self.part,
                            self.store)
      t1 = time.perf_counter()
      trained_version = run.version
      if self.check is not None:
        self.check.check(update.groups, update.versions)
      metrics = grpo_update.train_on_groups(run, self.grpo, update.groups, update.advantages)
      self._publish()
      self.updates += 1
      if self.primary:
        batch = update.taken
        for ready, _ in batch:
          self.owner.mark_trained(ready.group_id)
        self.lineage.append(self.updates, run.version, [r.group_id for r, _ in batch],
                            [r.host_id for r, _ in batch], [r.payload for r, _ in batch])
        t2 = time.perf_counter()
        self._log(metrics, [t for _, g in batch for t in g], trained_version, ttb=t1 - t0,
                  train_s=t2 - t1)
      self._stop_if_only_infra()
      if self.updates % self.a.checkpoint_every == 0 or self.updates == self.rl.steps:
        self.ckpt.save(self.updates, {"state": self.grpo.state},
                       stream_version=run.version)
        self.ckpt.wait()
        if self.primary:
          self.owner.flush()
      if e.every and self.updates % e.every == 0 and self.updates != self.rl.steps:
        self.evaluate(run.version, f"update{self.updates}")
    if self.primary:
      self.owner.flush()

  def _next_update(self, tasks: Iterator, t0: float) -> Update:
    """Process 0: the next batch, its advantages and the versions its check covers."""
    batch = self._next_batch(tasks, t0)
    groups = [g for _, g in batch]
    versions = [] if self.check is None else self.check.versions_of(groups, self.part[1])
    return Update(groups, grpo_update.advantages_of(self.run, self.grpo, groups), versions, batch)

  def _next_batch(self, tasks: Iterator, t0: float) -> list[tuple[Any, list[Trajectory]]]:
    """Process 0: `prompts_per_step` groups from the queue, waiting for the hosts."""
    batch: list = []
    while True:
      self._top_up(tasks)
      self._collect()
      batch += self._take_batch()
      if len(batch) >= self.rl.prompts_per_step:
        break
      if time.perf_counter() - t0 > self.a.batch_timeout_s:
        raise TimeoutError(
            f"{len(batch)} of {self.rl.prompts_per_step} groups after "
            f"{self.a.batch_timeout_s:.0f} s; queue {self.owner.accounting()}; hosts seen: "
            f"{sorted(read_host_status(self.store))}. Are rollout hosts running against "
            f"{self.root}?")
      time.sleep(max(self.a.poll_s, 0.05))  # each poll lists the hosts' keys
    self.pool = batch[self.rl.prompts_per_step:] + self.pool
    return batch[:self.rl.prompts_per_step]

  def _log(self, metrics: dict, trajs: list[Trajectory], trained_version: int, *, ttb: float,
           train_s: float) -> None:
    versions = np.concatenate([t.versions[t.loss_mask] for t in trajs])
    staleness = trained_version - versions
    self.totals["ttb_s"].append(ttb)
    self.totals["staleness"].append(float(staleness.mean()) if len(staleness) else 0.0)
    self.totals["train_s"] += train_s
    stats = watch.rollout_stats(self.sampled)
    record = metrics | stats | report.train_collapse(self.run, self.run.version,
                                                     stats["success_frac"]) | {
        "ttb_s": ttb, "trainer_stall_s": ttb, "train_s": train_s,
        "staleness_mean": self.totals["staleness"][-1],
        "staleness_max": int(staleness.max()) if len(staleness) else 0,
        "dropped_stale": self.dropped_stale, "dropped_no_signal": self.dropped_no_signal,
        "updates": self.updates,
    } | {f"queue_{k}": v for k, v in self.owner.accounting().items()}
    if self.check is not None and self.check.mismatch.value is not None:
      record["own_version_mismatch_max_abs"] = self.check.mismatch.value
      record["own_version_tokens"] = self.check.mismatch.tokens
    statuses = read_host_status(self.store)
    record |= host_metrics(statuses, self.publish_times)
    self._log_host_errors(statuses)
    self.run.log.write("async", self.run.version, record)
    self.run.watch.update(self.run.version, stats, max_new_tokens=self.rl.max_new_tokens,
                          stop_ids=self.run.env.stop_ids)
    self.sampled = []
    self.ties_dropped_this_update = 0

  def _log_host_errors(self, statuses: dict) -> None:
    """Logs each host's first infra failure of each kind once (the host logged it too)."""
    for host, status in sorted(statuses.items()):
      for kind, first in sorted((status.get("first_errors") or {}).items()):
        key = f"{host}: {kind}"
        if key not in self.host_errors and isinstance(first, dict) and "reason" in first:
          self.host_errors[key] = first
          log_first_failure(kind, first, f"rollout host {host}")

  def _stop_if_only_infra(self) -> None:
    """Raises AllInfraFailures on every trainer process when process 0's watch says every
    episode of rl.max_all_infra_updates consecutive updates was an infra failure."""
    message = ""
    if self.primary and self.run.watch.stop_message():
      # the hosts' newest status records, for their first failures in the message
      self._log_host_errors(read_host_status(self.store))
      message = self.run.watch.stop_message(self.host_errors | self.run.failures.first)
    if self.multi:
      message = distributed.broadcast_bytes(message.encode() if self.primary else None
                                            ).decode()
    if message:
      if self.primary:
        self.run.log.write("stopped", self.run.version,
                           {"all_infra_updates": self.run.watch.streak,
                            **self.run.watch.summary()})
      raise watch.AllInfraFailures(message)

  def finish(self) -> None:
    if self.primary:
      self.store.write(DONE_KEY, b"1")
    self.ckpt.close()
    if self.multi:  # the others wait here (not in jax.distributed's shutdown, which times
      distributed.broadcast_bytes(b"done" if self.primary else None)  # out) for the eval


def run_async(config: ml_collections.ConfigDict, workdir: str, root: str, *,
              progress: Callable[..., Iterator] | None = None,
              on_started: Callable[[], None] | None = None, resume: bool = False) -> dict:
  """The whole async experiment's trainer side; hosts run elsewhere against `root`.
  `on_started` runs once weights are published (e.g. to launch local hosts). `resume`:
  continue from the trainer's latest checkpoint if there is one (without it, a checkpoint
  of an earlier run is an error)."""
  t0 = time.perf_counter()
  bar = progress or (lambda it, **_: iter(it))
  trainer = AsyncTrainer(build(config, ASYNC_TRAINER), workdir, root, resume=resume)
  evals = trainer.start(bar, on_started)
  rl_start = time.perf_counter()
  trainer.train(bar)
  rl_wall = time.perf_counter() - rl_start
  run = trainer.run
  evals.append(trainer.evaluate(run.version, "after"))
  trainer.finish()
  if not trainer.primary:  # process 0 writes the run's outputs
    run.log.close()
    return {"process_index": jax.process_index(), "processes": jax.process_count(),
            "updates": trainer.updates, "steps": run.version,
            # every process ran the evaluation (SPMD): process 0's figure, computed here too
            "heldout_pass1_after": evals[-1]["pass1"]}
  by_name = {e["name"]: e for e in evals}
  if "init" not in by_name:  # resumed: the init eval is in the first process's log
    by_name["init"] = {"name": "init", "pass1": None}
  totals = trainer.totals
  extra = trainer.extra | {
      "mode": "async", "updates": trainer.updates, "rl_wall_s": round(rl_wall, 2),
      "processes": jax.process_count(), "devices": jax.device_count(),
      "mean_staleness": float(np.mean(totals["staleness"])) if totals["staleness"] else 0.0,
      "ttb_s": float(np.mean(totals["ttb_s"])) if totals["ttb_s"] else 0.0,
      "dropped_stale": trainer.dropped_stale, "dropped_no_signal": trainer.dropped_no_signal,
      "queue": trainer.owner.accounting(),
      # the last update's train state: experiments/export_hf.py --checkpoint=<this>
      "checkpoints": str(trainer.ckpt.directory)}
  if trainer.lora is not None:  # the checkpoints' adapters train on this base
    extra["lora_base"] = adapter_stream.base_checkpoint_dir(trainer.dir)
  if trainer.check is not None:
    extra |= trainer.check.summary()
  run.timings["train_s"] = totals["train_s"]
  run.timings["rollout_s"] = float(np.sum(totals["ttb_s"]))  # the trainer's wait for rollouts
  summary = report.summarize(run, list(by_name.values()), time.perf_counter() - t0, extra)
  run.log.write("summary", run.version, {k: v for k, v in summary.items()
                                         if isinstance(v, (int, float))})
  run.log.close()
  plot_reward_curve(read_jsonl(run.log.jsonl_path),
                    os.path.join(run.log.workdir, "reward_curve.png"),
                    title=f"{config.name} seed {config.seed} (async, {run.numerics.mode})")
  return summary
