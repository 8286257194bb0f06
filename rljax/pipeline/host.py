"""A rollout host of the async pipeline: its only link to the trainer is a storage root.

The root's layout is rljax.pipeline.layout's: the weight stream, the work queue, `run/done`
and this host's status record `run/hosts/<id>.json` (below; every few seconds and at exit).

The loop (`run`, one iteration = `run_once`):
  a. `Subscriber.poll()`; when the weights moved, `engine.update_weights` right away: the
     subscriber applies deltas to its arrays in place (donated), so the engine must never
     hold arrays across a poll that changed them. The pause (poll + update) is recorded.
     `async_rl.weight_update` ("keep" default, or "recompute": running sequences' KV is
     recomputed under the new weights first) is the engine's policy;
  b. `QueueClient.request(want)` (want = `async_rl.host_groups`): the level of groups this
     host holds at a time, rewritten at least every `heartbeat_s` as its heartbeat;
  c. `poll_lease()`: each new grant's payload is a task (`wire.task_from_payload`), added
     to the `EpisodeRunner` with request id = the trainer's group id, so every token's
     sampling key is (seed, group id, sample, position): a group's tokens are the same
     whichever host runs it. A revoked lease's group keeps decoding (the engine has no
     abort) but is not pushed, unless the group is granted to this host again, in which
     case the running group serves the new lease;
  d. while groups run, one `EpisodeRunner.step()`; each completed group is pushed as
     `wire.group_to_arrays` + meta {host_id, generate_s, tokens, versions_min/max};
  e. with nothing to run, sleep `async_rl.poll_s` (`run` only; `run_once` never sleeps);
  f. stop when `run/done` exists (or after `max_seconds`).
Storage is read (a-c, done) at most once per `poll_s`, whatever the decode rate.

Before it reads any weights the host waits for the trainer (saying so every
`wait_report_s`): its config's fingerprint must be the trainer's (`layout.check_fingerprint`:
model, numerics, tokenizer, env, sampling, seed and LoRA; a host that differs refuses to
start), then version 0 must appear.

config.lora (rljax.pipeline.adapter_stream): the host first reads the frozen base from
`<root>/base/` (once: it never changes), then follows the stream of adapters; whenever
they move it hands the engine `learner.merged_params(base, adapters)`, the trainer's own
jitted merge, so the engine serves the trainer's `run.serve(state)` bit for bit. It holds
the base, the adapters and the engine's merged weights (two of them while a new version is
merged and handed over).

Status record: {host_id, incarnation, pid, applied: [[version, published_at, applied_at,
apply_pause_s], ...] (last 50; published_at = the manifest's `created_unix`, or null),
tokens_generated, generate_s, idle_s, groups_pushed, groups_discarded, time, version,
in_flight, done, stream_errors (count), last_stream_error (a bad version is skipped: the
host keeps its verified weights and moves on at the next good one), infra_failures
({reason: count} of the episodes it scored), first_errors ({kind: {reason, task, error,
traceback}}: the first infra failure of each kind, which the host logs at ERROR when it
happens and the trainer logs once it reads the record)}.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Callable

from absl import logging
import ml_collections
import numpy as np
import tensorstore as ts

from rljax.model import param_shardings
from rljax.pipeline import adapter_stream, wire
from rljax.pipeline.layout import (DONE_KEY, FINGERPRINT_KEY, QUEUE_PREFIX, base_url,
                                   check_fingerprint, check_root, status_key, stream_url)
from rljax.pipeline.rollout import EpisodeRunner, FailureLog, Group
from rljax.pipeline.run import ROLLOUT_HOST, build
from rljax.pipeline.queue_client import QueueClient
from rljax.rl import learner
from rljax.sync import manifest as fmt
from rljax.sync.store import Store
from rljax.sync.subscriber import Subscriber

_APPLIED_KEPT = 50


class RunOver(Exception):
  """`run/done` appeared before this host could start (no engine was built)."""


@dataclasses.dataclass
class _Running:
  lease_id: int | None  # None: the lease was revoked (the group is not pushed)
  started: float  # perf_counter at add


class RolloutHost:
  """One rollout host: follows the weight stream, serves leased groups, pushes results."""

  def __init__(self, root: str, config: ml_collections.ConfigDict, host_id: str, *,
               clock: Callable[[], float] = time.time, context: ts.Context | None = None,
               first_version_timeout_s: float = 600.0, heartbeat_s: float = 1.0,
               status_every_s: float = 5.0, wait_report_s: float = 10.0):
    built = build(config, ROLLOUT_HOST, devices=False)
    a = config.async_rl
    if a.host_groups < 1 or a.poll_s <= 0:
      raise ValueError(f"need async_rl.host_groups >= 1 and poll_s > 0, got {a}")
    self.root, self.config, self.clock = root, config, clock
    self.want, self.poll_s = int(a.host_groups), float(a.poll_s)
    self.heartbeat_s, self.status_every_s = heartbeat_s, status_every_s
    self.store = Store.open(check_root(root), context=context)
    self.client = QueueClient(self.store, host_id, prefix=QUEUE_PREFIX, clock=clock)
    self.host_id = self.client.host_id
    # on a mesh (config.engine.mesh) keyframes land sharded and deltas patch each
    # device's block in place: no device ever holds the whole model
    self.sharding = built.engine_sharding()
    params_sharding = (None if self.sharding is None
                       else param_shardings(built.cfg, self.sharding))
    self.lora = built.lora
    self.base: Any = None  # config.lora: the frozen base, read once from base/
    self.base_sub = None
    stream_sharding = params_sharding
    if self.lora is not None:
      self.base_sub = Subscriber(Store.open(base_url(root), context=context),
                                 shardings=params_sharding)
      stream_sharding = adapter_stream.adapter_shardings(built.cfg, self.lora, self.sharding)
    self.sub = Subscriber(Store.open(stream_url(root), context=context),
                          shardings=stream_sharding)
    self.env, self.cfg = built.env, built.cfg
    self.applied: collections.deque[list] = collections.deque(maxlen=_APPLIED_KEPT)
    self.counts = dict(groups_pushed=0, groups_discarded=0, generate_s=0.0, idle_s=0.0)
    self._running: dict[int, _Running] = {}  # group id -> its lease
    self._last_control = self._last_heartbeat = self._last_status = -float("inf")
    self._done = False

    version, pause = self._wait_for_first_version(first_version_timeout_s, wait_report_s)
    self.engine = built.make_engine(self.serving_params(), version=version,
                                    weight_update=a.weight_update, sharding=self.sharding)
    self._held = self._arrays()
    self._record_applied(version, pause)
    self._tokens_at_start = self.engine.stats["generated_tokens"]
    self.failures = FailureLog(f"rollout host {self.host_id}")
    self.runner = EpisodeRunner(self.engine, self.env, sampling=built.sampling,
                                seed=config.seed, failures=self.failures)

  # ---- the loop ----

  def run(self, max_seconds: float | None = None) -> str:
    """Serves until `run/done` ("done") or `max_seconds` ("max_seconds"); writes the status
    record and withdraws the host's request (want 0) on the way out."""
    start = self.clock()
    try:
      while self.run_once():
        if max_seconds is not None and self.clock() - start >= max_seconds:
          return "max_seconds"
        if self.runner.idle:
          t0 = time.perf_counter()
          time.sleep(self.poll_s)
          self.counts["idle_s"] += time.perf_counter() - t0
      return "done"
    finally:
      self.close()

  def run_once(self) -> bool:
    """One iteration (never sleeps); False once the run is over."""
    if self._done:
      return False
    now = self.clock()
    if now - self._last_control >= self.poll_s:
      self._last_control = now
      if self.store.read(DONE_KEY) is not None:
        self._done = True
        return False
      self.sync_weights()
      if now - self._last_heartbeat >= self.heartbeat_s:
        self.client.request(self.want)
        self._last_heartbeat = now
      self._take_grants()
    if self.runner.busy:
      t0 = time.perf_counter()
      groups = self.runner.step()
      self.counts["generate_s"] += time.perf_counter() - t0
      for group in groups:
        self._push(group)
    if self.clock() - self._last_status >= self.status_every_s:
      self.write_status()
    return True

  def close(self) -> None:
    """Withdraws the request (no more grants) and writes the final status record."""
    self.client.request(0)
    self.runner.close()
    self.write_status()

  # ---- weights ----

  def sync_weights(self) -> int | None:
    """Polls the stream; hands the engine the subscriber's arrays whenever they changed
    (a new version, or arrays replaced by a rollback). Returns the new version or None.
    A stream error is recorded (status: stream_errors) and the host keeps its weights."""
    t0 = time.perf_counter()
    moved = self._poll()
    if moved is None and self._arrays_unchanged():
      return None
    self.engine.update_weights(self.serving_params(), self.sub.version)
    self._held = self._arrays()
    if moved is None:
      return None
    self._record_applied(moved, time.perf_counter() - t0)
    return moved

  def serving_params(self) -> Any:
    """The weights of the subscriber's version: its params, or with config.lora the base
    with its adapters merged in (a fresh tree: the subscriber's arrays stay its own)."""
    if self.lora is None:
      return self.sub.params
    return learner.merged_params(self.base, self.sub.params, self.lora)

  def _poll(self) -> int | None:
    """Subscriber.poll; a StreamError is recorded (the weights stay as they were)."""
    try:
      return self.sub.poll()
    except fmt.StreamError as e:
      self.sub.stats.error(f"poll: {e}")
      return None

  def _arrays(self) -> dict[str, int]:
    return {path: id(x) for path, x in fmt.flatten(self.sub.params).items()}

  def _arrays_unchanged(self) -> bool:
    return self._arrays() == self._held

  def _record_applied(self, version: int, pause_s: float) -> None:
    self.applied.append([int(version), self._published_at(version), self.clock(),
                         float(pause_s)])

  def _published_at(self, version: int) -> float | None:
    try:
      raw = self.sub.store.read(fmt.manifest_key(version))
      t = None if raw is None else json.loads(raw).get("created_unix")
      return float(t) if t is not None else None
    except (ValueError, TypeError, AttributeError):
      return None

  def _wait_for_first_version(self, timeout_s: float, report_s: float) -> tuple[int, float]:
    """Waits for the trainer's fingerprint (checked against this host's config), then
    (config.lora) for the frozen base, then for a first version of the stream."""
    start = time.monotonic()
    deadline, next_report = start + timeout_s, start + report_s
    checked = False
    while True:
      if self.store.read(DONE_KEY) is not None:
        raise RunOver(f"{DONE_KEY} exists under {self.root}: the run is over")
      if not checked and self.store.read(FINGERPRINT_KEY) is not None:
        check_fingerprint(self.store, self.config)
        checked = True
      if checked and self.lora is not None and self.base is None:
        self._read_base()
      if checked and (self.lora is None or self.base is not None):
        t0 = time.perf_counter()
        version = self._poll()
        if version is not None:
          return version, time.perf_counter() - t0
      now = time.monotonic()
      if now >= deadline:
        on_base = self.lora is not None and self.base is None
        last = (self.base_sub if on_base else self.sub).stats.errors[-1:] or ["none"]
        what = (f"trainer under {self.root} (no {FINGERPRINT_KEY})" if not checked else
                f"frozen base under {base_url(self.root)}" if on_base else
                f"weight-stream version under {stream_url(self.root)}")
        raise TimeoutError(f"no {what} after {timeout_s:.0f} s (last stream error: {last[0]})")
      if now >= next_report:
        logging.warning("host %s: waiting for the trainer's %s under %s (%.0f s of %.0f s)",
                        self.host_id, "first weights" if checked else "start", self.root,
                        now - start, timeout_s)
        next_report += report_s
      time.sleep(0.2)

  def _read_base(self) -> None:
    """config.lora: the frozen base, once it is in the store (version 0 of base/, checked
    like every version); it never changes, so it is never polled again."""
    try:
      version = self.base_sub.poll()
    except fmt.StreamError as e:
      self.base_sub.stats.error(f"poll: {e}")
      return
    if version is not None:
      if version != 0:
        raise fmt.StreamError(f"{base_url(self.root)} holds version {version}: a frozen base "
                              "is version 0 only (is this root a LoRA run's?)")
      self.base = self.base_sub.params

  # ---- work ----

  def _take_grants(self) -> None:
    for grant in self.client.poll_lease():
      task = wire.task_from_payload(grant.payload)
      if task.env != self.env.name:
        raise ValueError(f"group {grant.group_id} is a {task.env!r} task; this host runs "
                         f"{self.env.name!r}")
      running = self._running.get(grant.group_id)
      if running is not None:  # re-granted while its revoked attempt still runs here
        running.lease_id = grant.lease_id
        continue
      self.runner.add(grant.group_id, task, grant.group_size)
      self._running[grant.group_id] = _Running(grant.lease_id, time.perf_counter())
    for lease_id, grant in list(self.client.revoked.items()):
      running = self._running.get(grant.group_id)
      if running is not None and running.lease_id == lease_id:
        running.lease_id = None
      del self.client.revoked[lease_id]  # never pushed: the trainer would ignore it

  def _push(self, group: Group) -> None:
    running = self._running.pop(group.request_id)
    if running.lease_id is None:
      self.counts["groups_discarded"] += 1
      return
    generated = np.concatenate([t.versions[t.loss_mask] for t in group.trajectories])
    meta = dict(host_id=self.host_id, generate_s=time.perf_counter() - running.started,
                tokens=int(generated.size),
                versions_min=int(generated.min()) if generated.size else None,
                versions_max=int(generated.max()) if generated.size else None)
    self.client.push_result(running.lease_id, group.request_id,
                            wire.group_to_arrays(group.trajectories), meta=meta)
    self.counts["groups_pushed"] += 1

  # ---- status ----

  def status(self) -> dict[str, Any]:
    return dict(host_id=self.host_id, incarnation=self.client.incarnation, pid=os.getpid(),
                applied=list(self.applied),
                tokens_generated=int(self.engine.stats["generated_tokens"]
                                     - self._tokens_at_start),
                generate_s=self.counts["generate_s"], idle_s=self.counts["idle_s"],
                groups_pushed=self.counts["groups_pushed"],
                groups_discarded=self.counts["groups_discarded"], time=self.clock(),
                version=self.engine.version, in_flight=len(self._running), done=self._done,
                stream_errors=self.sub.stats.error_count,
                last_stream_error=(self.sub.stats.errors or [None])[-1],
                infra_failures=dict(self.failures.counts),
                first_errors=dict(self.failures.first))

  def write_status(self) -> None:
    self.store.write(status_key(self.host_id),
                     json.dumps(self.status(), allow_nan=False).encode())
    self._last_status = self.clock()
