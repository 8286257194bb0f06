"""An OpenAI-compatible HTTP endpoint on a `DecodeEngine` that records every call as a
token-space `Trajectory`: an external agent loop (any OpenAI client, someone else's
harness) drives the engine, and the trainer gets the episodes like env-made ones.

Endpoints (JSON over HTTP/1.1, `http.server.ThreadingHTTPServer`, non-streaming):

  POST /v1/episodes                  {"episode_id"?, "group_id"?} -> {"episode_id", ...}
  POST /v1/chat/completions          messages -> one assistant reply (the chat template)
  POST /v1/completions               prompt (text, or token ids) -> one completion
  POST /v1/episodes/{id}/finish      {"reward": r, "outcome"?} -> the episode is a Trajectory
  GET  /v1/episodes/{id}             the record so far (turns, token counts, state)
  DELETE /v1/episodes/{id}           forget an unfinished episode (its group stops waiting)
  GET  /v1/models, GET /health

Episodes. Every generation call belongs to an episode the harness registered first
(`POST /v1/episodes`; an unknown id is a 404, never a silently new episode). A call names
it by `extra_body={"episode_id": ...}`, by the header `X-Episode-Id`, or by its base URL:
`OpenAI(base_url=f"{server}/episodes/{id}/v1")` serves that episode's calls with no extra
field at all (for harnesses that cannot add one). One call at a time per episode (409).
`group_id` (default: the episode id) groups episodes for GRPO: the trainer takes complete
groups (`Endpoint.take_groups(group_size)`: `group_size` finished episodes, none open).

Token space. An episode is one growing token sequence, as a multi-turn env episode is:
turn n's prompt is every earlier prompt and sampled token of the episode followed by the
tokens of only what the harness appended since (never a re-tokenization of the history).
The engine keeps the sequence parked between turns (`Request(keep_pages=True)`) and
continues it with `extend` (only the new tokens are prefilled: the earlier turns' KV is
reused). When more episodes are open than the page pool holds (`max_resident`, default
what the pool holds at max_seq_len each), the least recently used parked one is released;
its next turn is a fresh `submit` of the recorded tokens plus the new ones under the same
request id, so the sampling keys (seed, request id, sample 0, position) and, in
deterministic numerics, every recorded bit are what `extend` would have given (tested).
A turn whose sampling differs from the parked request's (other stop tokens) takes the same
fresh path.

Chat templating is incremental. The first call's messages are rendered by the tokenizer's
chat template with the generation prompt and tokenized. A later call must repeat the
recorded conversation exactly (every earlier message, and the assistant replies exactly as
this server returned them: role and content compared) and append at least one non-assistant
message; otherwise 400 `history_mismatch` (a harness that edits history starts a new
episode). The appended tokens are the template applied to the delta, in context: the
conversation is rendered with the last reply's content replaced by a sentinel and the new
messages after it; only the text after the sentinel (the template's close of the reply,
the new messages, the generation prompt) is tokenized. If the reply ended on a stop token
whose text begins that close (`<|im_end|>`), that text is dropped (the token was sampled);
a reply cut by max_tokens gets the close as observation tokens. Templates that rewrite
earlier turns (Qwen3 drops old reasoning) therefore never change recorded tokens: the
policy's context is what it sampled. Tokenizers without a chat template (the char
tokenizer) serve `/v1/completions` only.

Completions: `prompt` is text or a list of token ids, fixed per episode. Text: a later
prompt must start with the episode's text so far (its prompts and the returned completion
texts, without a final stop token's text); the rest is tokenized. Token ids: a later
prompt must start with every token of the episode (stop tokens included); the rest is
appended as is. No BOS is added.

Recorded per episode (the Trajectory at finish): prompt_ids = the first call's prompt;
completion = every later token, sampled ones with loss_mask True, behaviour log-prob and
engine version, appended (observation/template) ones with loss_mask False, log-prob 0 and
version -1; expert_ids for every position (the engine's routing of each fed token; the
last sampled token is never fed: zeros). Every response also carries these ids in an
`rljax` field (prompt_token_ids: the tokens this call appended, completion_token_ids,
completion_logprobs), so a harness can check token in / token out itself.

Sampling is the server's (`sampling`, e.g. the config's rl block: the trainer's loss
assumes the behaviour temperature): a request's `temperature` / `top_p` other than the
server's is a 400; `max_tokens` (or `max_completion_tokens`) caps the turn, within the
room max_seq_len leaves (a prompt that leaves none: 400 `context_length_exceeded`);
`stop` may name single tokens only; `n` must be 1 (a GRPO group is several episodes);
`logprobs` returns the behaviour log-probs (`top_logprobs` unsupported).

Long episodes: one whose reply reached max_seq_len (`finish_reason` "length"), or whose
last call was refused with `context_length_exceeded`, finishes as an episode cut by the
context (`FinishReason.CONTEXT`; the trainer's `config.rl.overlong` says what it trains).

Threads. One engine-owner thread drives the engine (submits, extends, releases,
`step`, `update_weights`); HTTP handler threads validate, tokenize, enqueue a turn and wait
for it. Concurrent calls are decoded in the same engine steps (continuous batching);
`pause` / `resume` hold new turns back (those in the engine go on). No handler thread
calls JAX. An engine failure fails the calls in flight with 500 and every
later one with 503.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import queue
import re
import threading
import time
import uuid
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.engine.engine import DecodeEngine, OutOfPages, Request, SamplingParams
from rljax.engine.pages import pages_for
from rljax.envs.base import Task
from rljax.pipeline.rollout import Group
from rljax.rl.trajectory import FinishReason, Outcome, Trajectory

__all__ = ["ApiError", "Endpoint", "EpisodeRecord"]

_MAX_REQUEST_ID = 2**31 - 1
SENTINEL = "\u2063rljax-end-of-reply\u2063"  # stands for the last reply's content in a render
_EPISODE_PATH = re.compile(r"^/episodes/([^/]+)(/v1/.*)$")
_ID = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


class ApiError(Exception):
  """An error answered to the client: HTTP status, message, OpenAI-style type and code."""

  def __init__(self, status: int, message: str, code: str | None = None,
               kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.code, self.kind = status, message, code, kind

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "code": self.code,
                      "param": None}}


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
  text: str | None = None  # completion (text mode): the episode's text so far
  ids_mode: bool = False  # completion prompts are token ids
  busy: bool = False  # a call is in flight
  resident: bool = False  # the engine holds its sequence (parked, waiting or running)
  sampling: SamplingParams | None = None  # of the resident request
  last_used: float = 0.0
  finished: Trajectory | None = None
  taken: bool = False  # handed to the trainer by take_groups

  def summary(self) -> dict:
    return {"episode_id": self.episode_id, "group_id": self.group_id,
            "request_id": self.request_id, "kind": self.kind, "turns": self.turns,
            "prompt_tokens": self.prompt_len, "tokens": len(self.tokens),
            "sampled_tokens": int(sum(self.loss_mask)), "busy": self.busy,
            "finished": self.finished is not None,
            "reward": None if self.finished is None else float(self.finished.reward),
            "outcome": None if self.finished is None else self.finished.outcome.value}


@dataclasses.dataclass(eq=False)
class _Turn:
  episode: EpisodeRecord
  new_ids: list[int]  # appended before sampling (the whole prompt on the first turn)
  sampling: SamplingParams  # max_new_tokens = this turn's budget
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  start: int = 0  # episode length before new_ids
  sampled: list[int] = dataclasses.field(default_factory=list)
  sampled_logprobs: list[float] = dataclasses.field(default_factory=list)
  error: ApiError | None = None


@dataclasses.dataclass(eq=False)
class _Op:
  """Work for the engine-owner thread other than a turn: release, weights, stop."""
  kind: str
  args: tuple = ()
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  error: BaseException | None = None


def _content_text(content: Any, where: str) -> str:
  if isinstance(content, str):
    return content
  if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in content):
    return "".join(p["text"] for p in content)
  raise ApiError(400, f"{where}: content must be a string or a list of text parts")


def _messages(raw: Any) -> list[dict]:
  """The request's messages as {role, content[, name, tool_call_id]} with text content."""
  if not isinstance(raw, list) or not raw:
    raise ApiError(400, "messages must be a non-empty list")
  out = []
  for i, m in enumerate(raw):
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
      raise ApiError(400, f"messages[{i}] must be an object with a string role")
    msg = {"role": m["role"], "content": _content_text(m.get("content") or "",
                                                        f"messages[{i}]")}
    for key in ("name", "tool_call_id"):
      if isinstance(m.get(key), str):
        msg[key] = m[key]
    if m.get("tool_calls"):
      raise ApiError(400, f"messages[{i}]: tool_calls are not supported (the model's tool "
                     "calls are text in its reply's content)")
    out.append(msg)
  return out


def _same_message(a: Mapping, b: Mapping) -> bool:
  return a["role"] == b["role"] and a["content"] == b["content"]


class Endpoint:
  """The OpenAI-compatible endpoint over `engine` (which must carry only this endpoint's
  work from now on: the owner thread drives it). `tokenizer`: the env tokenizer whose ids
  the engine's model uses (`hf.apply_chat_template` for chat). `sampling`: the server's
  sampling (max_new_tokens = the default max_tokens); `seed`: the sampling key seed.
  `max_resident`: episodes whose sequences the engine may hold at once (default: as many
  as its page pool holds at max_seq_len). `model_name`: what responses name."""

  def __init__(self, engine: DecodeEngine, tokenizer, *, sampling: SamplingParams,
               seed: int = 0, max_resident: int | None = None, model_name: str = "rljax",
               host: str = "127.0.0.1", port: int = 0, first_request_id: int = 1):
    if not engine.idle or engine.parked:
      raise ValueError("the engine has work of its own; the endpoint needs it idle")
    self.engine, self.tokenizer, self.seed, self.model_name = engine, tokenizer, seed, model_name
    stops = tuple(t for t in tokenizer.stop_ids if t != engine.eos_id)
    self.sampling = dataclasses.replace(sampling, stop_tokens=tuple(sampling.stop_tokens) + stops)
    if len(self.sampling.stop_tokens) > engine.max_stop_tokens:
      raise ValueError(f"{len(self.sampling.stop_tokens)} stop tokens; the engine takes "
                       f"{engine.max_stop_tokens}")
    self.stop_ids = frozenset(self.sampling.stop_tokens) | (
        frozenset() if engine.eos_id is None else {engine.eos_id})
    fits = engine.pool.free_count // pages_for(engine.max_seq_len, engine.page_size)
    self.max_resident = max(1, fits if max_resident is None else max_resident)
    self.stats = collections.Counter()
    self._lock = threading.Lock()
    self._episodes: dict[str, EpisodeRecord] = {}
    self._by_rid: dict[int, EpisodeRecord] = {}
    self._in_flight: dict[int, _Turn] = {}  # by request id (the owner thread's)
    self._resident: dict[int, EpisodeRecord] = {}  # held by the engine (the owner thread's)
    self._groups: dict[str, list[EpisodeRecord]] = {}  # group id -> episodes, in order
    self._group_index: dict[str, int] = {}
    self._next_rid = first_request_id
    self._finished_cv = threading.Condition(self._lock)
    self._inbox: queue.Queue = queue.Queue()
    self._pending: collections.deque[_Turn] = collections.deque()
    self._broken: BaseException | None = None
    self._paused = threading.Event()  # set: no turn starts (those in flight go on)
    self._owner = threading.Thread(target=self._own_engine, name="rljax-engine", daemon=True)
    self._server = http.server.ThreadingHTTPServer((host, port), _handler(self))
    self._server.daemon_threads = True
    self._http = threading.Thread(target=self._server.serve_forever, name="rljax-http",
                                  daemon=True)
    self._owner.start()
    self._http.start()

  # ---- the Python API (the trainer's side) ---------------------------------------------

  @property
  def url(self) -> str:
    host, port = self._server.server_address[:2]
    return f"http://{host}:{port}"

  def close(self) -> None:
    """Stops serving, releases every sequence the engine still holds for an episode and
    stops the owner thread (the engine is idle and free for other work afterwards)."""
    self._server.shutdown()
    self._server.server_close()
    if self._owner.is_alive():
      self._call_owner("stop")
    self._owner.join()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def update_weights(self, params: Any, version: int) -> None:
    """New weights, between two engine steps (the engine's weight-update policy applies)."""
    self._call_owner("weights", params, version)

  def pause(self) -> None:
    """Starts no new turn until `resume` (turns already in the engine go on): e.g. to
    gather a batch of calls before any of them runs."""
    self._paused.set()

  def resume(self) -> None:
    self._paused.clear()

  @property
  def waiting_turns(self) -> int:
    """Calls the engine-owner thread has received and not started yet."""
    return len(self._pending)

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
      if self._next_rid > _MAX_REQUEST_ID:
        raise ApiError(503, "request ids exhausted", kind="server_error")
      ep = EpisodeRecord(episode_id, group_id, self._next_rid, time.time())
      self._next_rid += 1
      self._episodes[episode_id] = ep
      self._by_rid[ep.request_id] = ep
      self._groups.setdefault(group_id, []).append(ep)
      self._group_index.setdefault(group_id, len(self._group_index))
    return episode_id

  def finish(self, episode_id: str, reward: float, outcome: str | Outcome | None = None
             ) -> Trajectory:
    """Closes an episode with its reward (`outcome` default: success if reward > 0, else
    model_failure); returns its Trajectory. The engine's copy of it is released."""
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
      ep = self._episode(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      if ep.busy:
        raise ApiError(409, f"episode {episode_id!r} has a call in flight", "episode_busy")
      if ep.turns == 0:
        raise ApiError(400, f"episode {episode_id!r} has no turns (drop it instead)",
                       "empty_episode")
      ep.busy = True  # no call may start while its sequence is released
    try:
      self._call_owner("release", ep)
    finally:
      with self._lock:
        ep.busy = False
    with self._lock:
      ep.finished = self._trajectory(ep, reward, outcome)
      self._finished_cv.notify_all()
    return ep.finished

  def drop(self, episode_id: str) -> None:
    """Forgets an unfinished episode (`DELETE /v1/episodes/{id}`): its group no longer
    waits for it, and the engine's copy of it is released."""
    with self._lock:
      ep = self._episode(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      if ep.busy:
        raise ApiError(409, f"episode {episode_id!r} has a call in flight", "episode_busy")
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

  def episode(self, episode_id: str) -> EpisodeRecord:
    with self._lock:
      return self._episode(episode_id)

  def take_groups(self, group_size: int, *, wait_for: int = 0,
                  timeout_s: float = 0.0) -> list[Group]:
    """Removes and returns the complete groups (`group_size` finished episodes, none open),
    in the order they were first registered; each Trajectory's `group_id` is the group's
    index, `sample_index` its episode's place in the group. `wait_for` > 0: waits up to
    `timeout_s` until that many are complete. A group with more episodes than group_size
    is an error (ValueError)."""
    deadline = time.monotonic() + timeout_s
    with self._lock:
      while True:
        ready = []
        for gid, eps in self._groups.items():
          if len(eps) > group_size:
            raise ValueError(f"group {gid!r} has {len(eps)} episodes, more than {group_size}")
          if len(eps) == group_size and all(e.finished is not None for e in eps):
            ready.append(gid)
        left = deadline - time.monotonic()
        if len(ready) >= wait_for or left <= 0:
          break
        self._finished_cv.wait(left)
      out = []
      for gid in ready:
        eps = self._groups.pop(gid)
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

  # ---- request handling (handler threads) ----------------------------------------------

  def _episode(self, episode_id: Any) -> EpisodeRecord:
    ep = self._episodes.get(episode_id) if isinstance(episode_id, str) else None
    if ep is None:
      raise ApiError(404, f"unknown episode {str(episode_id)[:80]!r}: register it first with "
                     "POST /v1/episodes", "unknown_episode")
    return ep

  def _sampling(self, body: Mapping) -> tuple[SamplingParams, int]:
    """This call's SamplingParams (without its budget) and its max_tokens."""
    for key, ours in (("temperature", self.sampling.temperature),
                      ("top_p", self.sampling.top_p)):
      value = body.get(key)
      if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                or float(value) != float(ours)):
        raise ApiError(400, f"{key}={body[key]}: this server samples with {key}={ours} (the "
                       "trainer's behaviour policy)", "unsupported_sampling")
    if body.get("n", 1) != 1:
      raise ApiError(400, "n must be 1: a GRPO group is several episodes with one group_id")
    if body.get("stream"):
      raise ApiError(400, "streaming is not supported", "unsupported_stream")
    if body.get("top_logprobs"):
      raise ApiError(400, "top_logprobs is not supported")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    extra = []
    for s in stop:
      t = self.tokenizer.token_to_id(s) if isinstance(s, str) else None
      if t is None:
        raise ApiError(400, f"stop {s!r}: only single tokens of the vocabulary can stop")
      if t not in self.stop_ids and t not in extra:
        extra.append(t)
    sampling = dataclasses.replace(self.sampling,
                                   stop_tokens=self.sampling.stop_tokens + tuple(extra))
    if len(sampling.stop_tokens) > self.engine.max_stop_tokens:
      raise ApiError(400, f"at most {self.engine.max_stop_tokens} stop tokens in all")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = self.sampling.max_new_tokens if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ApiError(400, f"max_tokens must be an int >= 1, got {max_tokens!r}")
    return sampling, max_tokens

  def _claim(self, body: Mapping, path_episode: str | None, headers, kind: str
             ) -> EpisodeRecord:
    episode_id = path_episode or body.get("episode_id") or headers.get("X-Episode-Id")
    if episode_id is None:
      raise ApiError(400, "no episode: pass extra_body={'episode_id': ...}, the X-Episode-Id "
                     "header, or base_url=<server>/episodes/<id>/v1", "missing_episode")
    with self._lock:
      if self._broken is not None:
        raise ApiError(503, f"the engine failed: {self._broken!r}", kind="server_error")
      ep = self._episode(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      if ep.busy:
        raise ApiError(409, f"episode {episode_id!r} has a call in flight", "episode_busy")
      if ep.kind not in (None, kind):
        raise ApiError(400, f"episode {episode_id!r} is a {ep.kind} episode", "wrong_kind")
      ep.busy = True
    return ep

  def _run_turn(self, ep: EpisodeRecord, new_ids: Sequence[int], sampling: SamplingParams,
                max_tokens: int) -> _Turn:
    new_ids = [int(t) for t in new_ids]
    if any(not 0 <= t < self.engine.cfg.vocab_size for t in new_ids):
      raise ApiError(400, "token ids outside the model's vocabulary")
    if ep.turns == 0 and not new_ids:
      raise ApiError(400, "empty prompt")
    room = self.engine.max_seq_len - len(ep.tokens) - len(new_ids)
    if room < 1:
      if ep.turns:  # finished as it is, the episode was cut by the context (a later turn
        with self._lock:  # that fits, e.g. a shorter observation, ends otherwise)
          ep.finish_reason = FinishReason.CONTEXT
      raise ApiError(400, f"the episode's context would be {len(ep.tokens) + len(new_ids)} "
                     f"tokens; this engine's max_seq_len is {self.engine.max_seq_len} (one "
                     "token must stay free for the reply)", "context_length_exceeded")
    turn = _Turn(ep, new_ids, dataclasses.replace(sampling,
                                                  max_new_tokens=min(max_tokens, room)))
    self._inbox.put(turn)
    turn.done.wait()
    if turn.error is not None:
      raise turn.error
    return turn

  def chat(self, body: Mapping, path_episode: str | None = None, headers=None) -> dict:
    sampling, max_tokens = self._sampling(body)
    messages = _messages(body.get("messages"))
    if not getattr(getattr(self.tokenizer, "hf", None), "chat_template", None):
      raise ApiError(400, "this server's tokenizer has no chat template: use /v1/completions",
                     "no_chat_template")
    ep = self._claim(body, path_episode, headers or {}, "chat")
    try:
      if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must not be the assistant's")
      if ep.turns == 0:
        new_ids = self._render_ids(messages, None)
      else:
        known = ep.messages
        for i, m in enumerate(known):
          if i >= len(messages) or not _same_message(messages[i], m):
            raise ApiError(400, f"history_mismatch: messages[{i}] ({m['role']}) differs from "
                           "the episode's recorded conversation (earlier messages and replies "
                           "must be sent back unchanged; start a new episode to branch)",
                           "history_mismatch")
        new = messages[len(known):]  # not empty: the last message is not the reply
        if any(m["role"] == "assistant" for m in new):
          raise ApiError(400, "history_mismatch: an assistant message the engine did not "
                         "sample; replies must be this server's", "history_mismatch")
        new_ids = self._render_ids(known, new, stopped_on=ep.last_stop_id)
      turn = self._run_turn(ep, new_ids, sampling, max_tokens)
      reply = self._reply_text(turn.sampled)
      with self._lock:
        ep.kind = "chat"
        ep.messages = messages + [{"role": "assistant", "content": reply}]
    finally:
      with self._lock:
        ep.busy = False
    choice = {"index": 0, "message": {"role": "assistant", "content": reply},
              "finish_reason": _finish(ep.finish_reason), "logprobs": None}
    if body.get("logprobs"):
      choice["logprobs"] = {"content": [
          {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
          for s, lp in zip(self._pieces(turn.sampled), turn.sampled_logprobs)]}
    return self._response("chat.completion", "chatcmpl", ep, turn, choice)

  def complete(self, body: Mapping, path_episode: str | None = None, headers=None) -> dict:
    sampling, max_tokens = self._sampling(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    ids_mode = isinstance(prompt, list)
    if ids_mode and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      raise ApiError(400, "prompt must be a string or one list of token ids")
    if not ids_mode and not isinstance(prompt, str):
      raise ApiError(400, "prompt must be a string or one list of token ids")
    if body.get("echo") or body.get("suffix") or body.get("best_of", 1) != 1:
      raise ApiError(400, "echo, suffix and best_of are not supported")
    ep = self._claim(body, path_episode, headers or {}, "completion")
    try:
      if ep.turns and ids_mode != ep.ids_mode:
        raise ApiError(400, f"episode {ep.episode_id!r} takes its prompts as "
                       f"{'token ids' if ep.ids_mode else 'text'}", "history_mismatch")
      if ids_mode:
        if prompt[:len(ep.tokens)] != ep.tokens:
          raise ApiError(400, "history_mismatch: the prompt's ids do not start with the "
                         "episode's tokens", "history_mismatch")
        new_ids = prompt[len(ep.tokens):]
      else:
        known = ep.text or ""
        if not prompt.startswith(known):
          raise ApiError(400, "history_mismatch: the prompt does not start with the "
                         "episode's text so far (its prompts and completions)",
                         "history_mismatch")
        try:
          new_ids = self.tokenizer.encode(prompt[len(known):]).tolist()
        except ValueError as e:
          raise ApiError(400, f"prompt: {e}") from None
      turn = self._run_turn(ep, new_ids, sampling, max_tokens)
      text = self._reply_text(turn.sampled)
      with self._lock:
        ep.kind, ep.ids_mode = "completion", ids_mode
        ep.text = None if ids_mode else prompt + text
    finally:
      with self._lock:
        ep.busy = False
    choice = {"index": 0, "text": text, "finish_reason": _finish(ep.finish_reason),
              "logprobs": None}
    if body.get("logprobs") is not None:
      pieces = self._pieces(turn.sampled)
      choice["logprobs"] = {"tokens": pieces, "token_logprobs": turn.sampled_logprobs,
                            "top_logprobs": None,
                            "text_offset": np.cumsum([0] + [len(p) for p in pieces[:-1]]
                                                     ).tolist()}
    return self._response("text_completion", "cmpl", ep, turn, choice)

  def _response(self, obj: str, prefix: str, ep: EpisodeRecord, turn: _Turn,
                choice: dict) -> dict:
    prompt_tokens = turn.start + len(turn.new_ids)
    return {"id": f"{prefix}-{ep.episode_id}-{ep.turns}", "object": obj,
            "created": int(time.time()), "model": self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(turn.sampled),
                      "total_tokens": prompt_tokens + len(turn.sampled)},
            "rljax": {"episode_id": ep.episode_id, "group_id": ep.group_id, "turn": ep.turns,
                      "request_id": ep.request_id, "prompt_token_ids": turn.new_ids,
                      "completion_token_ids": turn.sampled,
                      "completion_logprobs": turn.sampled_logprobs}}

  def _reply_text(self, sampled: list[int]) -> str:
    ids = sampled[:-1] if sampled and sampled[-1] in self.stop_ids else sampled
    return self._decode(ids)

  def _pieces(self, ids: list[int]) -> list[str]:
    return [self._decode([t]) for t in ids]

  def _decode(self, ids: list[int]) -> str:
    """Text of sampled ids; an id of the model's vocabulary that is no token of the
    tokenizer's (the model's table may be larger) reads as U+FFFD. Never raises: the text
    is the episode's record of what was said, the ids are the truth."""
    out, run = [], []
    for t in list(ids) + [None]:
      if t is not None and 0 <= t < self.tokenizer.vocab_size:
        run.append(t)
        continue
      if run:
        out.append(self.tokenizer.decode(run))
        run = []
      if t is not None:
        out.append("\ufffd")
    return "".join(out)

  def _render(self, messages: list[dict]) -> str:
    return self.tokenizer.hf.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)

  def _render_ids(self, history: list[dict], new: list[dict] | None, *,
                  stopped_on: int | None = None) -> list[int]:
    """First turn (`new` None): the messages rendered with the generation prompt. Later:
    the template applied to the delta in context (see the module docstring)."""
    try:
      if new is None:
        return self.tokenizer.encode(self._render(history)).tolist()
      context = [dict(m) for m in history]
      context[-1]["content"] = SENTINEL
      text = self._render(context + new)
    except ApiError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (a template's own errors)
      raise ApiError(400, f"the chat template failed on these messages: {e}") from None
    if text.count(SENTINEL) != 1:
      raise ApiError(500, "the chat template does not render the last reply's content once",
                     kind="server_error")
    after = text[text.index(SENTINEL) + len(SENTINEL):]
    if stopped_on is not None:
      stop_text = self._decode([stopped_on])
      if stop_text and after.startswith(stop_text):
        after = after[len(stop_text):]
    return self.tokenizer.encode(after).tolist()

  # ---- the engine-owner thread ---------------------------------------------------------

  def _call_owner(self, kind: str, *args) -> None:
    op = _Op(kind, args)
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
        if isinstance(item, _Turn):
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
      key = dataclasses.replace(turn.sampling, max_new_tokens=0)
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
                                     sampling=turn.sampling, seed=self.seed,
                                     group_id=ep.request_id, keep_pages=True))
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
      ep.versions += traj.versions[fed - p:].tolist()
      if traj.expert_ids is not None:  # rows of positions fed this turn (and the new last)
        keep = max(start - 1, 0)
        ep.routing = ep.routing[:keep] + list(traj.expert_ids[keep:])
      ep.turns += 1
      ep.finish_reason = traj.finish_reason
      ep.last_stop_id = sampled[-1] if sampled and sampled[-1] in self.stop_ids else None
      ep.last_used = time.monotonic()
    self.stats["turns"] += 1
    turn.sampled, turn.sampled_logprobs = sampled, lps
    turn.done.set()

  def _fail(self, turn: _Turn, error: ApiError) -> None:
    turn.error = error
    turn.done.set()

  def _trajectory(self, ep: EpisodeRecord, reward: float, outcome: Outcome) -> Trajectory:
    p = ep.prompt_len
    return Trajectory(
        prompt_ids=np.asarray(ep.tokens[:p], np.int32),
        completion_ids=np.asarray(ep.tokens[p:], np.int32),
        loss_mask=np.asarray(ep.loss_mask, bool),
        behaviour_logprobs=np.asarray(ep.logprobs, np.float32),
        versions=np.asarray(ep.versions, np.int32),
        expert_ids=np.stack(ep.routing).astype(np.int32) if ep.routing else None,
        finish_reason=ep.finish_reason, request_id=ep.request_id, group_id=ep.request_id,
        sample_index=0, reward=reward, outcome=outcome)


def _finish(reason: FinishReason) -> str:
  return "length" if reason in (FinishReason.LENGTH, FinishReason.CONTEXT) else "stop"


def _handler(endpoint: Endpoint):

  class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rljax-endpoint"

    def log_message(self, *args):  # quiet: no line per request on stderr
      pass

    def _send(self, status: int, body: dict) -> None:
      data = json.dumps(body, allow_nan=False).encode()
      self.send_response(status)
      self.send_header("Content-Type", "application/json")
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def _body(self) -> dict:
      n = int(self.headers.get("Content-Length") or 0)
      raw = self.rfile.read(n) if n else b""
      try:
        body = json.loads(raw or b"{}")
      except ValueError:
        raise ApiError(400, "the body is not JSON") from None
      if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
      return body

    def _route(self, method: str) -> None:
      try:
        path, episode = self.path.split("?")[0].rstrip("/"), None
        m = _EPISODE_PATH.match(path)
        if m:
          episode, path = m.group(1), m.group(2)
        body = self._body()  # read whatever came, so a kept-alive connection stays in step
        endpoint.stats["http_requests"] += 1
        if method == "POST" and path == "/v1/chat/completions":
          out = endpoint.chat(body, episode, self.headers)
        elif method == "POST" and path == "/v1/completions":
          out = endpoint.complete(body, episode, self.headers)
        elif method == "POST" and path == "/v1/episodes":
          out = endpoint.episode(endpoint.register(body.get("episode_id"),
                                                   body.get("group_id"))).summary()
        elif method == "POST" and path.startswith("/v1/episodes/") and path.endswith("/finish"):
          eid = path[len("/v1/episodes/"):-len("/finish")]
          if "reward" not in body:
            raise ApiError(400, "finish needs {'reward': number}")
          endpoint.finish(eid, body["reward"], body.get("outcome"))
          out = endpoint.episode(eid).summary()
        elif method == "DELETE" and path.startswith("/v1/episodes/"):
          endpoint.drop(path[len("/v1/episodes/"):])
          out = {"deleted": True}
        elif method == "GET" and path.startswith("/v1/episodes/"):
          out = endpoint.episode(path[len("/v1/episodes/"):]).summary()
        elif method == "GET" and path == "/v1/models":
          out = {"object": "list", "data": [{"id": endpoint.model_name, "object": "model",
                                             "created": 0, "owned_by": "rljax"}]}
        elif method == "GET" and path == "/health":
          out = {"ok": endpoint._broken is None}  # pylint: disable=protected-access
        else:
          raise ApiError(404, f"no route {method} {path}", "not_found")
        self._send(200, out)
      except ApiError as e:
        endpoint.stats[f"http_{e.status}"] += 1
        self._send(e.status, e.body())
      except Exception as e:  # pylint: disable=broad-except
        endpoint.stats["http_500"] += 1
        self._send(500, ApiError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

    def do_GET(self):  # pylint: disable=invalid-name
      self._route("GET")

    def do_POST(self):  # pylint: disable=invalid-name
      self._route("POST")

    def do_DELETE(self):  # pylint: disable=invalid-name
      self._route("DELETE")

  return Handler
