"""`Endpoint`: the OpenAI-compatible endpoint on a `DecodeEngine` (see the package's
docstring): construction, the trainer's Python API, and the generation calls
(`chat`, `complete`) that handler threads run."""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any, Mapping, Sequence

import numpy as np

from rljax.engine.engine import DecodeEngine, SamplingParams
from rljax.engine.pages import pages_for
from rljax.rl.trajectory import FinishReason
from rljax.serving.api import (CHAT_FIELDS, COMPLETION_FIELDS, ApiError, check_fields,
                               finish_reason_name, parse_messages)
from rljax.serving.deliveries import Deliveries, Delivery
from rljax.serving.episodes import BUSY_WAIT_S, MAX_REQUEST_ID, EpisodeRecord, EpisodeStore
from rljax.serving.owner import EngineOwner, Turn
from rljax.serving.render import Renderer
from rljax.serving.tools import check_tools, load_tool_parser, parse_tool_calls, wire_tool_calls
from rljax.serving.server import make_server


@dataclasses.dataclass(frozen=True)
class _Call:
  """A generation call's parameters, checked."""
  sampling: SamplingParams  # without the turn's budget
  max_tokens: int
  seed: int
  sampling_id: int | None  # the sampling keys' request id (None: the episode's)
  stop_texts: tuple[str, ...]


class Endpoint(EpisodeStore, Deliveries, EngineOwner, Renderer):
  """The OpenAI-compatible endpoint over `engine` (which must carry only this endpoint's
  work from now on: the owner thread drives it). `tokenizer`: the env tokenizer whose ids
  the engine's model uses (`hf.apply_chat_template` for chat). `sampling`: the server's
  sampling (max_new_tokens = the default max_tokens); `seed`: the sampling key seed.
  `max_resident`: episodes whose sequences the engine may hold at once (default: as many
  as its page pool holds at max_seq_len). `model_name`: what responses name (and the one
  model a request may name). `group_size`: episodes a group holds (a registration beyond
  it is a 409 `group_full`; `take_groups`' default). `tool_parser`: how the model's tool
  calls are read from its text (`tools.load_tool_parser`: "hermes", "none" or
  `package.module:function`). `busy_wait_s`: how long a call (or finish, drop) waits for
  its episode's call in flight to end before a 409 `episode_busy`."""

  def __init__(self, engine: DecodeEngine, tokenizer, *, sampling: SamplingParams,
               seed: int = 0, max_resident: int | None = None, model_name: str = "rljax",
               host: str = "127.0.0.1", port: int = 0, first_request_id: int = 1,
               group_size: int | None = None, tool_parser: str | None = "hermes",
               busy_wait_s: float = BUSY_WAIT_S):
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
    self._in_flight: dict[int, Turn] = {}  # by request id (the owner thread's)
    self._resident: dict[int, EpisodeRecord] = {}  # held by the engine (the owner thread's)
    self._groups: dict[str, list[EpisodeRecord]] = {}  # group id -> episodes, in order
    self._group_index: dict[str, int] = {}
    self.tool_parser = load_tool_parser(tool_parser)  # the model's tool calls out of its text
    self.group_size = group_size  # episodes a group: registering more is a 409 (None: any)
    self._taken_groups: set[str] = set()  # handed to the trainer: registering into one is a 409
    self._oversized: set[str] = set()  # groups take_groups left out (logged once)
    self._next_rid = first_request_id
    self._finished_cv = threading.Condition(self._lock)
    # an episode's call ended, or a reply's delivery was reported
    self._calls_cv = threading.Condition(self._lock)
    self.busy_wait_s = busy_wait_s
    self._inbox: queue.Queue = queue.Queue()
    self._pending: collections.deque[Turn] = collections.deque()
    self._broken: BaseException | None = None
    self._paused = threading.Event()  # set: no turn starts (those in flight go on)
    self._owner = threading.Thread(target=self._own_engine, name="rljax-engine", daemon=True)
    self._server = make_server(self, host, port)
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


  # ---- request handling (handler threads) ----------------------------------------------

  def _params(self, body: Mapping, kind: str) -> _Call:
    """This call's parameters: each one honoured, or a 400 naming it."""
    check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and model != self.model_name:
      raise ApiError(404, f"the model {str(model)[:80]!r} does not exist; this server serves "
                     f"{self.model_name!r}", "model_not_found", param="model")
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    sampling = self.sampling
    temperature = body.get("temperature")
    if temperature is not None and number(temperature) and float(temperature) == 0.0:
      sampling = dataclasses.replace(sampling, temperature=0.0)  # greedy
    for key, ours in (("temperature", self.sampling.temperature),
                      ("top_p", self.sampling.top_p)):
      value = body.get(key)
      if value is None or (key == "temperature" and sampling.temperature == 0.0):
        continue
      if not number(value) or float(value) != float(ours):
        raise ApiError(400, f"{key}={body[key]}: this server samples with {key}={ours} (the "
                       "trainer's behaviour policy) or greedily (temperature=0)",
                       "unsupported_sampling", param=key)
    if body.get("n", 1) != 1:
      raise ApiError(400, "n must be 1: a GRPO group is several episodes with one group_id",
                     param="n")
    if body.get("top_logprobs"):
      raise ApiError(400, "top_logprobs is not supported", param="top_logprobs")
    seed, sampling_id = self.seed, None
    if body.get("seed") is not None:
      if not isinstance(body["seed"], int) or isinstance(body["seed"], bool):
        raise ApiError(400, f"seed must be an integer, got {body['seed']!r}", param="seed")
      # keyed by the seed alone (an id no episode has): same seed and tokens, same sample
      seed, sampling_id = body["seed"] % 2**31, MAX_REQUEST_ID
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(
        isinstance(x, str) and x for x in stop):
      raise ApiError(400, "stop must be a non-empty string or a list of at most 4",
                     param="stop")
    extra = []  # a stop string that is one token also stops the engine (no decode past it)
    for text in stop:
      try:
        ids = [int(t) for t in self.tokenizer.encode(text)]
      except ValueError:
        continue
      if len(ids) == 1 and ids[0] not in self.stop_ids and ids[0] not in extra and \
          self._decode(ids) == text and \
          len(sampling.stop_tokens) + len(extra) < self.engine.max_stop_tokens:
        extra.append(ids[0])
    sampling = dataclasses.replace(sampling, stop_tokens=sampling.stop_tokens + tuple(extra))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = self.sampling.max_new_tokens if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
      raise ApiError(400, f"max_tokens must be an int >= 1, got {max_tokens!r}",
                     param="max_tokens")
    return _Call(sampling, max_tokens, seed, sampling_id, tuple(stop))

  def _claim(self, body: Mapping, path_episode: str | None, headers, kind: str,
             delivery: Delivery | None = None) -> EpisodeRecord:
    episode_id = path_episode or body.get("episode_id") or headers.get("X-Episode-Id")
    if episode_id is None:
      raise ApiError(400, "no episode: pass extra_body={'episode_id': ...}, the X-Episode-Id "
                     "header, or base_url=<server>/episodes/<id>/v1", "missing_episode")
    group_id = body.get("group_id") or headers.get("X-Group-Id")
    if group_id is not None:  # a call naming its group registers a new id on first use
      self._first_use(episode_id, group_id)
    with self._lock:
      if self._broken is not None:
        raise ApiError(503, f"the engine failed: {self._broken!r}", kind="server_error")
      ep = self._wait_idle(episode_id)
      if ep.finished is not None:
        raise ApiError(409, f"episode {episode_id!r} is finished", "episode_finished")
      if ep.kind not in (None, kind):
        raise ApiError(400, f"episode {episode_id!r} is a {ep.kind} episode", "wrong_kind")
      ep.busy = True
      if delivery is not None:
        delivery.episode, delivery.before, delivery.prev = ep, ep.snapshot(), ep.last_call
        ep.last_call = delivery
    return ep

  def _run_turn(self, ep: EpisodeRecord, new_ids: Sequence[int], call: _Call,
                on_tokens=None) -> Turn:
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
    turn = Turn(ep, new_ids, dataclasses.replace(call.sampling,
                                                 max_new_tokens=min(call.max_tokens, room)),
                seed=call.seed, sampling_id=call.sampling_id, stop_texts=call.stop_texts)
    turn.progress = None if on_tokens is None else queue.Queue()
    self._inbox.put(turn)
    while on_tokens is not None and not turn.done.is_set():
      try:
        tokens = turn.progress.get(timeout=0.05)
      except queue.Empty:
        continue
      try:
        on_tokens(tokens)
      except Exception:  # pylint: disable=broad-except  (a stream's client went away:
        on_tokens = None  # the turn completes and is recorded; a retry gets it)
    turn.done.wait()
    if turn.error is not None:
      raise turn.error
    return turn

  def chat(self, body: Mapping, path_episode: str | None = None, headers=None,
           on_tokens=None, reports_delivery: bool = False) -> dict:
    """One chat call. `on_tokens(sampled so far)`: as the engine decodes.
    `reports_delivery`: the caller reports whether the response reached its client
    (`delivered`; the HTTP server does), else it is taken as delivered."""
    return self._once("chat", body, path_episode, headers, self._chat, on_tokens,
                      reports_delivery)

  def complete(self, body: Mapping, path_episode: str | None = None, headers=None,
               on_tokens=None, reports_delivery: bool = False) -> dict:
    return self._once("completion", body, path_episode, headers, self._complete, on_tokens,
                      reports_delivery)

  def _chat(self, body: Mapping, path_episode: str | None, headers, delivery, on_tokens
            ) -> dict:
    call = self._params(body, "chat")
    messages = parse_messages(body.get("messages"))
    tools = check_tools(body.get("tools"), body.get("tool_choice"))
    if body.get("parallel_tool_calls") is False:
      raise ApiError(400, "parallel_tool_calls=false: the model's calls are not limited to one",
                     "unsupported_parameter", param="parallel_tool_calls")
    if not getattr(getattr(self.tokenizer, "hf", None), "chat_template", None):
      raise ApiError(400, "this server's tokenizer has no chat template: use /v1/completions",
                     "no_chat_template")
    ep = self._claim(body, path_episode, headers or {}, "chat", delivery)
    try:
      if messages[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must not be the assistant's")
      new_ids = self._fit(ep, delivery, lambda: self._chat_ids(ep, messages, tools))
      turn = self._run_turn(ep, new_ids, call, on_tokens)
      message = {"role": "assistant", "content": turn.text}
      finish = finish_reason_name(ep.finish_reason)
      parsed = parse_tool_calls(self.tool_parser, turn.text) if (
          tools and body.get("tool_choice") != "none") else None
      if parsed is not None:
        content, calls = parsed
        message = {"role": "assistant", "content": content,
                   "tool_calls": wire_tool_calls(calls, f"call_{ep.turns}")}
        finish = "tool_calls"
        self.stats["tool_calls"] += len(calls)
      with self._lock:
        ep.kind, ep.tools = "chat", tools
        ep.messages = messages + [dict(message, content=message["content"] or "")]
    finally:
      self._set_idle(ep)
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if body.get("logprobs"):
      choice["logprobs"] = {"content": [
          {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
          for s, lp in zip(self._pieces(turn.sampled), turn.sampled_logprobs)]}
    return self._response("chat.completion", "chatcmpl", ep, turn, choice)

  def _complete(self, body: Mapping, path_episode: str | None, headers, delivery, on_tokens
                ) -> dict:
    call = self._params(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]
    ids_mode = isinstance(prompt, list)
    if ids_mode and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
      raise ApiError(400, "prompt must be a string or one list of token ids")
    if not ids_mode and not isinstance(prompt, str):
      raise ApiError(400, "prompt must be a string or one list of token ids")
    if body.get("echo") or body.get("suffix") or body.get("best_of", 1) != 1:
      raise ApiError(400, "echo, suffix and best_of are not supported",
                     "unsupported_parameter",
                     param=next((k for k in ("echo", "suffix") if body.get(k)), "best_of"))
    ep = self._claim(body, path_episode, headers or {}, "completion", delivery)
    try:
      new_ids = self._fit(ep, delivery, lambda: self._completion_ids(ep, prompt, ids_mode))
      turn = self._run_turn(ep, new_ids, call, on_tokens)
      text = turn.text
      with self._lock:
        ep.kind, ep.ids_mode = "completion", ids_mode
        ep.text = None if ids_mode else prompt + text
        ep.unsent_text = "" if ids_mode else turn.extra_text
    finally:
      self._set_idle(ep)
    choice = {"index": 0, "text": text, "finish_reason": finish_reason_name(ep.finish_reason),
              "logprobs": None}
    if body.get("logprobs") is not None:
      pieces = self._pieces(turn.sampled)
      choice["logprobs"] = {"tokens": pieces, "token_logprobs": turn.sampled_logprobs,
                            "top_logprobs": None,
                            "text_offset": np.cumsum([0] + [len(p) for p in pieces[:-1]]
                                                     ).tolist()}
    return self._response("text_completion", "cmpl", ep, turn, choice)

  def _response(self, obj: str, prefix: str, ep: EpisodeRecord, turn: Turn,
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

