"""The episode store: registered episodes, their token records, groups, and complete
groups handed to the trainer (`take_groups`). A mixin of `Endpoint` (it holds `_lock`,
`_episodes`, `_by_rid`, `_groups`, `_group_index`, `_next_rid`, `_finished_cv`,
`_calls_cv`, `busy_wait_s`)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import time
import uuid
from typing import Any

import numpy as np

from rljax.engine.engine import SamplingParams
from rljax.envs.base import Task
from rljax.pipeline.rollout import Group
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory
from rljax.serving.api import ApiError

MAX_REQUEST_ID = 2**31 - 1
# how long a call waits for its episode's call in flight (a turn under load runs for up
# to max_tokens engine steps behind the others) before a 409 episode_busy
BUSY_WAIT_S = 300.0
_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")
# what a turn changes in a record (`snapshot` / `restore`: a turn rolled back exactly)
_RECORD = ("kind", "prompt_len", "tokens", "loss_mask", "logprobs", "versions", "routing",
           "turns", "finish_reason", "last_stop_id", "messages", "tools", "text",
           "unsent_text", "ids_mode")


@dataclasses.dataclass(eq=False)
class EpisodeRecord:
  """One episode's token record (positions 0..len(tokens)-1; per-position arrays cover the
  completion part, positions >= prompt_len) and its conversation state."""

  episode_id: str
  group_id: str
  request_id: int
  created: float
  kind: str | None = None  # "chat" or "completion" (fixed by the first call)
  prompt_len: int = 0
  tokens: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[bool] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routing: list[np.ndarray] = dataclasses.field(default_factory=list)  # one row per position
  turns: int = 0
  finish_reason: FinishReason = FinishReason.ABORTED
  last_stop_id: int | None = None  # the stop token the last turn ended on
  messages: list[dict] = dataclasses.field(default_factory=list)  # chat: as recorded
  tools: list[dict] | None = None  # chat: the tools its first call rendered
  text: str | None = None  # completion (text mode): the episode's text so far
  unsent_text: str = ""  # recorded after `text` (a stop string), not returned: a prompt may repeat it
  ids_mode: bool = False  # completion prompts are token ids
  busy: bool = False  # a call is in flight
  resident: bool = False  # the engine holds its sequence (parked, waiting or running)
  sampling: SamplingParams | None = None  # of the resident request
  last_used: float = 0.0
  finished: Trajectory | None = None
  taken: bool = False  # handed to the trainer by take_groups
  last_call: Any = None  # the last call's `Delivery` (a retry gets it again; rollback)

  def snapshot(self) -> dict:
    """The record as it is (copies): `restore` returns it to exactly this."""
    return {k: copy.copy(getattr(self, k)) for k in _RECORD}

  def restore(self, snapshot: dict) -> None:
    for k, v in snapshot.items():
      setattr(self, k, copy.copy(v))

  def summary(self) -> dict:
    return {"episode_id": self.episode_id, "group_id": self.group_id,
            "request_id": self.request_id, "kind": self.kind, "turns": self.turns,
            "prompt_tokens": self.prompt_len, "tokens": len(self.tokens),
            "sampled_tokens": int(sum(self.loss_mask)), "busy": self.busy,
            "finished": self.finished is not None,
            "reward": None if self.finished is None else float(self.finished.reward),
            "outcome": None if self.finished is None else self.finished.outcome.value}



class EpisodeStore:
  """Registration, finishing, dropping and grouping of episodes (the trainer's side)."""

  def register(self, episode_id: str | None = None, group_id: str | None = None) -> str:
    """A new episode (what `POST /v1/episodes` does); returns its id."""
    episode_id = episode_id or uuid.uuid4().hex
    group_id = group_id or episode_id
    for name, value in (("episode_id", episode_id), ("group_id", group_id)):
      if not isinstance(value, str) or not _ID.match(value):
        raise ApiError(400, f"{name} must be 1-200 characters of [A-Za-z0-9_.:-], got "
                       f"{str(value)[:80]!r}")
    with self._lock:
      if episode_id in self._episodes:
        raise ApiError(409, f"episode {episode_id!r} exists", "episode_exists")
      group = self._groups.get(group_id, [])
      if self.group_size is not None and len(group) >= self.group_size:
        raise ApiError(409, f"group {group_id!r} has its {self.group_size} episodes already",
                       "group_full")
      if group_id in self._taken_groups:
        raise ApiError(409, f"group {group_id!r} was complete and handed to the trainer",
                       "group_taken")
      if self._next_rid > MAX_REQUEST_ID:
        raise ApiError(503, "request ids exhausted", kind="server_error")
      ep = EpisodeRecord(episode_id, group_id, self._next_rid, time.time())
      self._next_rid += 1
      self._episodes[episode_id] = ep
      self._by_rid[ep.request_id] = ep
      self._groups.setdefault(group_id, []).append(ep)
      self._group_index.setdefault(group_id, len(self._group_index))
    return episode_id

  def _first_use(self, episode_id: str, group_id: str) -> None:
    """A generation call naming its group (`group_id` field, `X-Group-Id` header) registers
    an episode id the endpoint does not know in that group (within `group_size`): for
    harnesses that name each rollout themselves (verifiers' `extra_headers_from_state`)
    and cannot register it first. A known episode must be in that group."""
    with self._lock:
      ep = self._episodes.get(episode_id) if isinstance(episode_id, str) else None
    if ep is None:
      try:
        self.register(episode_id, group_id)
        self.stats["registered_on_first_use"] += 1
        return
      except ApiError as e:
        if e.code != "episode_exists":  # else: a concurrent first call registered it
          raise
      ep = self.episode(episode_id)
    if ep.group_id != group_id:
      raise ApiError(400, f"episode {episode_id!r} is in group {ep.group_id!r}, not "
                     f"{str(group_id)[:80]!r}", "wrong_group", param="group_id")

  def finish(self, episode_id: str, reward: float, outcome: str | Outcome | None = None
             ) -> Trajectory:
    """Closes an episode with its reward (`outcome` default: success if reward > 0, else
    model_failure); returns its Trajectory. The engine's copy of it is released. A last
    turn whose reply never reached the client is rolled back first (`deliveries.py`): no
    trained token was unseen by the harness."""
    try:
      reward = float(reward)
    except (TypeError, ValueError):
      raise ApiError(400, f"reward must be a number, got {reward!r}") from None
    if not np.isfinite(reward):
      raise ApiError(400, "reward must be finite")
    try:
      outcome = (Outcome.SUCCESS if reward > 0 else Outcome.MODEL_FAILURE) if outcome is None \
          else Outcome(outcome)
    except ValueError:
      raise ApiError(400, f"outcome must be one of {[o.value for o in Outcome]}") from None
    with self._lock:
      ep = self._wait_idle(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      rolled_back = self._roll_back_unseen(ep)  # a last turn its client never received
      if ep.turns == 0 and not rolled_back:
        raise ApiError(400, f"episode {episode_id!r} has no turns (drop it instead)",
                       "empty_episode")
      ep.busy = True  # no call may start while its sequence is released
    try:
      self._call_owner("release", ep)
    finally:
      self._set_idle(ep)
    if ep.turns == 0:
      raise ApiError(400, f"episode {episode_id!r}: its only turn never reached the client and "
                     "was rolled back; it has no turns (call again, or drop it)", "empty_episode")
    with self._lock:
      ep.finished = self._trajectory(ep, reward, outcome)
      self._finished_cv.notify_all()
    return ep.finished

  def drop(self, episode_id: str) -> None:
    """Forgets an unfinished episode (`DELETE /v1/episodes/{id}`): its group no longer
    waits for it, and the engine's copy of it is released."""
    with self._lock:
      ep = self._wait_idle(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      ep.busy = True
    self._call_owner("release", ep)
    with self._lock:
      del self._episodes[episode_id]
      del self._by_rid[ep.request_id]
      group = self._groups.get(ep.group_id, [])
      if ep in group:
        group.remove(ep)
      if not group:
        self._groups.pop(ep.group_id, None)
      self._finished_cv.notify_all()

  def _wait_idle(self, episode_id: str) -> EpisodeRecord:
    """(Under `_lock`.) The episode, once no call of it is in flight: a harness that gave
    up on a turn (its client timed out) may call again, or finish, while the turn still
    runs; that waits for it (then the turn is rolled back if its reply never arrived,
    `deliveries.py`). Still busy after `busy_wait_s`: 409 `episode_busy`."""
    ep = self._episode(episode_id)
    if ep.busy and not self._calls_cv.wait_for(lambda: not ep.busy, self.busy_wait_s):
      raise ApiError(409, f"episode {episode_id!r} has a call in flight (for more than "
                     f"{self.busy_wait_s:g} s)", "episode_busy")
    return self._episode(episode_id)  # (dropped meanwhile: 404)

  def _set_idle(self, ep: EpisodeRecord) -> None:
    with self._lock:
      ep.busy = False
      self._calls_cv.notify_all()

  def episode(self, episode_id: str) -> EpisodeRecord:
    with self._lock:
      return self._episode(episode_id)

  def take_groups(self, group_size: int | None = None, *, wait_for: int = 0,
                  timeout_s: float = 0.0) -> list[Group]:
    """Removes and returns the complete groups (`group_size` finished episodes, none open),
    in the order they were first registered; each Trajectory's `group_id` is the group's
    index, `sample_index` its episode's place in the group. `wait_for` > 0: waits up to
    `timeout_s` until that many are complete. `group_size` default: the endpoint's (which
    registration enforces). Never raises on the groups' contents: a group with more
    episodes than `group_size` (possible only when registration did not enforce it) is
    left out, logged once and counted in `stats["oversized_groups"]`."""
    group_size = self.group_size if group_size is None else group_size
    if not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    deadline = time.monotonic() + timeout_s
    with self._lock:
      while True:
        ready = []
        for gid, eps in self._groups.items():
          if len(eps) > group_size:
            if gid not in self._oversized:
              self._oversized.add(gid)
              self.stats["oversized_groups"] += 1
              logging.warning("group %r has %d episodes, more than %d: not taken", gid,
                              len(eps), group_size)
            continue
          if len(eps) == group_size and all(e.finished is not None for e in eps):
            ready.append(gid)
        left = deadline - time.monotonic()
        if len(ready) >= wait_for or left <= 0:
          break
        self._finished_cv.wait(left)
      out = []
      for gid in ready:
        eps = self._groups.pop(gid)
        self._taken_groups.add(gid)
        trajs = []
        for i, e in enumerate(eps):
          e.taken = True
          trajs.append(dataclasses.replace(e.finished, group_id=self._group_index[gid],
                                           sample_index=i))
        task = Task(env="openai_endpoint", task_id=gid, split_key=gid,
                    prompt_ids=trajs[0].prompt_ids, answer="",
                    data={"episode_ids": [e.episode_id for e in eps]})
        out.append(Group(task, trajs, self._group_index[gid]))
    return out


  def _episode(self, episode_id: Any) -> EpisodeRecord:
    ep = self._episodes.get(episode_id) if isinstance(episode_id, str) else None
    if ep is None:
      raise ApiError(404, f"unknown episode {str(episode_id)[:80]!r}: register it first with "
                     "POST /v1/episodes", "unknown_episode")
    return ep

  def _trajectory(self, ep: EpisodeRecord, reward: float, outcome: Outcome) -> Trajectory:
    return Trajectory.from_sequence(
        ep.tokens, ep.prompt_len, ep.loss_mask, ep.logprobs, ep.versions,
        expert_ids=np.stack(ep.routing).astype(np.int32) if ep.routing else None,
        finish_reason=ep.finish_reason, request_id=ep.request_id, group_id=ep.request_id,
        sample_index=0, reward=reward, outcome=outcome)

