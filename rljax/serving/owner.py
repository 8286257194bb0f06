"""The engine-owner thread: the one thread that drives the `DecodeEngine` (submits,
extends, releases, steps, weight updates). Handler threads hand it turns (`Turn`) and other
work (`Op`) through `_inbox`. A mixin of `Endpoint` (it holds `engine`, `seed`, `stats`,
`max_resident`, `stop_ids`, `_lock`, `_inbox`, `_pending`, `_in_flight`, `_resident`,
`_paused`, `_broken`)."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import numpy as np

from rljax.engine.engine import OutOfPages, Request, SamplingParams
from rljax.rl.trajectory import FinishReason, Trajectory
from rljax.serving.api import ApiError
from rljax.serving.episodes import EpisodeRecord


@dataclasses.dataclass(eq=False)
class Turn:
  episode: EpisodeRecord
  new_ids: list[int]  # appended before sampling (the whole prompt on the first turn)
  sampling: SamplingParams  # max_new_tokens = this turn's budget
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  start: int = 0  # episode length before new_ids
  sampled: list[int] = dataclasses.field(default_factory=list)
  sampled_logprobs: list[float] = dataclasses.field(default_factory=list)
  error: ApiError | None = None
  seed: int = 0  # the sampling keys' seed and request id (None: the episode's request id)
  sampling_id: int | None = None
  stop_texts: tuple[str, ...] = ()  # the turn ends where its text first holds one of these
  text: str = ""  # the reply's text (without a stop token's or a stop string's text)
  extra_text: str = ""  # recorded text after `text` (a stop string and what its token held)
  progress: Any = None  # a streamed turn: a queue of its sampled tokens so far, step by step
  reported: int = 0


@dataclasses.dataclass(eq=False)
class Op:
  """Work for the engine-owner thread other than a turn: release, weights, stop."""
  kind: str
  args: tuple = ()
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None



class EngineOwner:
  """What runs on the engine-owner thread."""

  # ---- the engine-owner thread ---------------------------------------------------------

  def _call_owner(self, kind: str, *args) -> None:
    op = Op(kind, args)
    self._inbox.put(op)
    op.done.wait()
    if op.error is not None:
      raise op.error

  def _own_engine(self) -> None:
    stopping = False
    while not stopping:
      block = self.engine.idle and (not self._pending or self._paused.is_set())
      try:
        items = [self._inbox.get(timeout=0.05)] if block else []
      except queue.Empty:
        items = []
      while True:
        try:
          items.append(self._inbox.get_nowait())
        except queue.Empty:
          break
      for item in items:
        if isinstance(item, Turn):
          if self._broken is not None:
            self._fail(item, ApiError(503, f"the engine failed: {self._broken!r}",
                                      kind="server_error"))
          else:
            self._pending.append(item)
          continue
        try:
          if item.kind == "release":
            if item.args[0].resident:
              self._release(item.args[0])
          elif item.kind == "weights":
            self.engine.update_weights(*item.args)
          elif item.kind == "stop":
            stopping = True
        except Exception as e:  # pylint: disable=broad-except
          item.error = e
        if item.kind != "stop":
          item.done.set()
        else:
          stop_op = item
      if self._broken is None:
        try:
          if not self._paused.is_set():
            self._start_pending()
          if not self.engine.idle:
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self._in_flight))
            for traj in self._step():
              self._turn_ended(traj)
            self._report_progress()
        except Exception as e:  # pylint: disable=broad-except
          self._broken = e
          for turn in list(self._in_flight.values()) + list(self._pending):
            self._fail(turn, ApiError(500, f"the engine failed: {e!r}", kind="server_error"))
          self._in_flight.clear()
          self._pending.clear()
    for turn in list(self._pending):  # stopping: nothing new starts
      self._fail(turn, ApiError(503, "the endpoint is closing", kind="server_error"))
    while self._in_flight and self._broken is None:
      for traj in self._step():
        self._turn_ended(traj)
    for ep in list(self._resident.values()):
      self._release(ep)
    stop_op.done.set()

  def _step(self) -> list[Trajectory]:
    """One engine step; when only parked episodes hold the pages a waiting turn needs,
    the least recently used one is released and the step retried."""
    while True:
      try:
        return self.engine.step()
      except OutOfPages:
        if not self._evict_one():
          raise

  def _evict_one(self) -> bool:
    parked = [ep for ep in self._resident.values() if ep.request_id not in self._in_flight]
    if not parked:
      return False
    self._release(min(parked, key=lambda e: e.last_used))
    self.stats["evictions"] += 1
    return True

  def _release(self, ep: EpisodeRecord) -> None:
    self.engine.release(ep.request_id, 0)
    del self._resident[ep.request_id]
    ep.resident, ep.sampling = False, None

  def _start_pending(self) -> None:
    for _ in range(len(self._pending)):
      turn = self._pending.popleft()
      ep = turn.episode
      key = (dataclasses.replace(turn.sampling, max_new_tokens=0), turn.seed, turn.sampling_id)
      if ep.resident and ep.sampling != key:
        self._release(ep)  # other sampling: a fresh request under the same id
      if not ep.resident:
        if len(self._resident) >= self.max_resident and not self._evict_one():
          self._pending.append(turn)  # every resident episode is decoding: wait
          continue
      turn.start = len(ep.tokens)
      try:  # the scheduler's own checks (the handler checked the same): the turn's error
        if ep.resident:
          self.engine.extend(ep.request_id, 0, turn.new_ids, turn.sampling.max_new_tokens)
          self.stats["extends"] += 1
        else:
          self.engine.submit(Request(ep.request_id, np.asarray(ep.tokens + turn.new_ids,
                                                               np.int32),
                                     sampling=turn.sampling, seed=turn.seed,
                                     group_id=ep.request_id, keep_pages=True,
                                     sampling_id=turn.sampling_id))
          self.stats["resubmits" if ep.turns else "submits"] += 1
          ep.resident, ep.sampling = True, key
          self._resident[ep.request_id] = ep
      except ValueError as e:
        self._fail(turn, ApiError(400, str(e)))
        continue
      self._in_flight[ep.request_id] = turn

  def _turn_ended(self, traj: Trajectory) -> None:
    turn = self._in_flight.pop(traj.request_id)
    ep, start = turn.episode, turn.start
    tokens = traj.tokens.tolist()
    fed = start + len(turn.new_ids)
    if tokens[:fed] != ep.tokens + turn.new_ids:
      raise AssertionError(f"episode {ep.episode_id}: the engine's sequence does not extend "
                           "the record")
    p = len(traj.prompt_ids)
    sampled = tokens[fed:]
    lps = traj.behaviour_logprobs[fed - p:].tolist()
    versions = traj.versions[fed - p:].tolist()
    routing = None if traj.expert_ids is None else list(traj.expert_ids)
    finish_reason, cut_short = traj.finish_reason, False
    cut = self._stop_cut(sampled, turn.stop_texts)
    if cut is None:
      turn.text = self._reply_text(sampled)
    else:  # a stop string: the record ends with the token that completed it
      k, turn.text, turn.extra_text = cut
      finish_reason = FinishReason.STOP
      if k < len(sampled):
        cut_short = True  # the engine's copy holds tokens the record does not
        sampled, lps, versions, tokens = sampled[:k], lps[:k], versions[:k], tokens[:fed + k]
        if routing is not None:  # the last recorded token was fed; the record's never is
          routing = routing[:fed + k]
          routing[-1] = np.zeros_like(routing[-1])
    with self._lock:
      if ep.turns == 0:
        ep.prompt_len = len(turn.new_ids)
      else:
        ep.loss_mask += [False] * len(turn.new_ids)
        ep.logprobs += [0.0] * len(turn.new_ids)
        ep.versions += [-1] * len(turn.new_ids)
      ep.tokens = tokens
      ep.loss_mask += [True] * len(sampled)
      ep.logprobs += lps
      ep.versions += versions
      if routing is not None:  # rows of positions fed this turn (and the new last)
        keep = max(start - 1, 0)
        ep.routing = ep.routing[:keep] + routing[keep:]
      ep.turns += 1
      ep.finish_reason = finish_reason
      ep.last_stop_id = sampled[-1] if sampled and sampled[-1] in self.stop_ids else None
      ep.last_used = time.monotonic()
    if cut_short and ep.resident:  # its next turn: a fresh submit of the record (same bits)
      self._release(ep)
      self.stats["stop_string_cuts"] += 1
    self.stats["turns"] += 1
    turn.sampled, turn.sampled_logprobs = sampled, lps
    turn.done.set()

  def _report_progress(self) -> None:
    """Streamed turns still decoding: their sampled tokens so far, when there are more."""
    for seq in self.engine.scheduler.slots:
      turn = None if seq is None else self._in_flight.get(seq.request.request_id)
      if turn is None or turn.progress is None:
        continue
      fed = turn.start + len(turn.new_ids)
      if len(seq.tokens) - fed > turn.reported:
        turn.reported = len(seq.tokens) - fed
        turn.progress.put(list(seq.tokens[fed:]))

  def _fail(self, turn: Turn, error: ApiError) -> None:
    turn.error = error
    turn.done.set()
