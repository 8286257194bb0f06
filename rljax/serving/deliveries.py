"""Replies and the clients that may never get them: retries and rollbacks.

Every generation call is a `Delivery` (the episode's `last_call`): its body's key, the
record before its turn, and, once the turn ran, its response. The HTTP server reports
whether each response reached its client (`Endpoint.delivered`): it did not when the client
had closed its end before the reply (a client timeout, a disconnect) or the write failed.

  - A call repeating the last call's body (an SDK's automatic retry) gets that response,
    waiting for it while it runs: the turn is recorded once (`stats["replayed_calls"]`).
  - A reply no client received (`Delivery.unseen`: lost, never delivered, no write under
    way) is rolled back when the episode's next call does not extend it: a call whose
    history is the record *before* that turn (the harness gave up on it and sent something
    else) first returns the record to exactly that state (token ids, masks, log-probs,
    versions, routing, conversation) and releases the engine's sequence, which held the
    turn: the call's turn is a fresh submit of the record under the same request id, the
    same bits as a fresh episode's (`stats["rolled_back_turns"]`).
  - Finishing an episode whose last turn is unseen rolls that turn back first
    (`EpisodeStore.finish`): no trained token was unseen by the harness.

A call that arrives while its episode's previous turn is still running or being written
(a harness that gave up on it) waits for that turn and for the server's word on its
delivery (`EpisodeStore._wait_idle`, `_fit`), so whether it was seen is known before the
call is checked against the record.

A mixin of `Endpoint` (it holds `_lock`, `_calls_cv`, `_episodes`, `stats`,
`_call_owner`)."""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Callable, Mapping

from rljax.serving.api import ApiError
from rljax.serving.episodes import EpisodeRecord

WRITE_REPORT_S = 10.0  # at most this long for the server's word on a reply's delivery


@dataclasses.dataclass(eq=False)
class Delivery:
  """One generation call of an episode: its body's key and, once it has run, its response."""
  key: str
  response: dict | None = None
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  episode: EpisodeRecord | None = None  # set when the call claims it
  before: dict | None = None  # the record before this call's turn (`EpisodeRecord.snapshot`)
  prev: Any = None  # the episode's call before this one (its last_call again if this fails)
  writing: int = 0  # callers holding the response that have not reported its delivery
  delivered: bool = False  # some client received it
  lost: bool = False  # some client's copy was not delivered

  @property
  def unseen(self) -> bool:
    """The turn was recorded and no client has it (nor may get it from a write under way)."""
    return self.response is not None and self.lost and not self.delivered and \
        self.writing == 0


class Deliveries:
  """Retries and rollbacks of `Endpoint`'s generation calls."""

  def delivered(self, response: Mapping, ok: bool) -> None:
    """The server's report on a generation call's `response`: written to its client
    (`ok`), or not (the client was gone, the write failed)."""
    episode_id = (response.get("rljax") or {}).get("episode_id")
    with self._lock:
      ep = self._episodes.get(episode_id) if isinstance(episode_id, str) else None
      call = None if ep is None else ep.last_call
      if call is not None and call.response is not response:
        # the episode's next call may have claimed it while this reply was being written
        # (it then waits for this report, as `prev`, before it fits its messages)
        call = call.prev
      if call is None or call.response is not response:
        return  # an older call's: the episode went on
      call.writing = max(0, call.writing - 1)
      call.delivered |= ok
      call.lost |= not ok
      self._calls_cv.notify_all()

  def _once(self, kind: str, body: Mapping, path_episode: str | None, headers, run,
            on_tokens, reports_delivery: bool) -> dict:
    """A call whose body is the episode's last call's, byte for byte after sorting keys (an
    SDK's automatic retry after a timeout or a dropped connection), gets that call's
    response (waiting for it while it runs) instead of a second turn or a
    `history_mismatch`: the turn is recorded once and delivered to the retry."""
    key = kind + json.dumps(body, sort_keys=True)
    episode_id = path_episode or body.get("episode_id") or (headers or {}).get("X-Episode-Id")
    with self._lock:
      ep = self._episodes.get(episode_id) if isinstance(episode_id, str) else None
      last = None if ep is None else ep.last_call
    if last is not None and last.key == key:
      last.done.wait()
      if last.response is not None:
        with self._lock:
          last.writing += int(reports_delivery)
          last.delivered |= not reports_delivery
        self.stats["replayed_calls"] += 1
        return last.response
    delivery = Delivery(key)
    try:
      response = run(body, path_episode, headers, delivery, on_tokens)
      with self._lock:  # a caller that reports no delivery has the response
        delivery.response, delivery.writing = response, int(reports_delivery)
        delivery.delivered = not reports_delivery
      return response
    except BaseException:
      ep = delivery.episode
      with self._lock:  # no turn: the call before stays the one a retry gets
        if ep is not None and ep.last_call is delivery and ep.turns == delivery.before["turns"]:
          ep.last_call = delivery.prev
      raise
    finally:
      delivery.done.set()

  def _fit(self, ep: EpisodeRecord, delivery: Delivery, new_ids: Callable[[], list]) -> list:
    """`new_ids()`: the call's new ids against the record (or an ApiError). When the
    episode's last turn is unseen and the call fits the record before it, that turn is
    rolled back and the call goes on from there."""
    prev = delivery.prev
    if prev is not None:  # its reply is on its way to a client: wait for the server's word
      prev.done.wait(self.busy_wait_s)
      with self._lock:
        self._calls_cv.wait_for(lambda: prev.writing == 0, WRITE_REPORT_S)
    with self._lock:
      unseen = prev is not None and prev.unseen
      now = ep.snapshot() if unseen else None
      if unseen:
        ep.restore(prev.before)
    if unseen:
      try:
        ids = new_ids()
      except ApiError:
        with self._lock:  # it does not fit before the turn either: the record stays
          ep.restore(now)
      else:
        self._call_owner("release", ep)  # the engine's sequence held the turn
        with self._lock:
          self.stats["rolled_back_turns"] += 1
          delivery.before, delivery.prev = ep.snapshot(), None
        return ids
    return new_ids()

  def _roll_back_unseen(self, ep: EpisodeRecord) -> bool:
    """(Under `_lock`, the episode idle.) Rolls the last turn back if no client received
    it; the caller releases the engine's sequence before any other call continues it."""
    last = ep.last_call
    if last is None or not last.unseen:
      return False
    ep.restore(last.before)
    ep.last_call = None
    self.stats["rolled_back_turns"] += 1
    return True
