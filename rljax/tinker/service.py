"""The Tinker service's state: sessions, training clients and futures, with each client's
requests run in its `seq_id` order on one worker thread (JAX programs run one at a time).

Every submission returns a future id at once; `result` long-polls it. A request fails in
one of two ways the SDK knows: at submission (`ApiError`: an HTTP status the SDK raises as
its own exception class, e.g. 404 NotFoundError for an unknown model) or in its future
(`{"error", "category"}`: `RequestFailedError`, category "user" for a bad datum, "server"
for anything else, which is logged). No request makes the server answer 500.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import traceback
import uuid
from typing import Any, Callable

from rljax.model import lora as lora_lib
from rljax.tinker import wire
from rljax.tinker.sampling import Sampler, sample_args
from rljax.tinker.states import States, check_name, path_of
from rljax.tinker.training import AdamParams, LoraTrainer, Snapshot, UserError
from rljax.tinker.weights import ExternalWeights, WeightsNotFound

LONG_POLL_S = 20.0  # a poll waits this long before answering 408 (the SDK re-polls at once)
# a finished request's result is kept this long for the client to fetch (and re-fetch, as
# the SDK does after a dropped connection), then dropped: a long-lived server's memory
# does not grow with the requests it has answered
RESULT_TTL_S = 3600.0


class ApiError(Exception):
  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class Future:
  request_id: str
  done: bool = False
  done_at: float | None = None  # the service's clock
  json: dict | None = None
  proto: bytes | None = None
  error: dict | None = None


@dataclasses.dataclass
class Model:
  model_id: str
  session_id: str
  trainer: LoraTrainer
  next_seq: int = 1
  waiting: dict[int, tuple[Future, Callable]] = dataclasses.field(default_factory=dict)
  seen: dict[int, Future] = dataclasses.field(default_factory=dict)


def _model_seq_id(body: dict) -> int:
  seq = body.get("model_seq_id")
  if not isinstance(seq, int) or seq < 0:
    raise ApiError(400, f"model_seq_id must be an int >= 0, got {seq!r}")
  return seq


class Service:
  """`base`: the model's params in its serving dtype; every training client is a LoRA on it.
  `tokenizer` (`rljax.envs.tokenizer.TransformersTokenizer`, optional): its EOS stops
  sampling by default, and stop strings are matched on its text; `tokenizer_id` (what
  `get_info` tells clients to load) defaults to its directory."""

  def __init__(self, cfg, base: Any, *, numerics, model_name: str, max_tokens: int,
               state_root: str, tokenizer_id: str | None = None, tokenizer=None,
               result_ttl_s: float = RESULT_TTL_S, clock: Callable[[], float] = time.monotonic):
    self.cfg, self.base, self.numerics = cfg, base, numerics
    self.result_ttl_s, self.clock = result_ttl_s, clock
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
      raise ValueError(f"the tokenizer has {tokenizer.vocab_size} ids, the model "
                       f"{cfg.vocab_size}")
    self.model_name, self.max_tokens, self.tokenizer = model_name, max_tokens, tokenizer
    self.tokenizer_id = tokenizer_id or (
        getattr(tokenizer.hf, "name_or_path", None) if tokenizer is not None else None)
    self.sessions: dict[str, bool] = {}  # id -> open
    self.models: dict[str, Model] = {}
    self.closed_models: set[str] = set()
    self.futures: dict[str, Future] = {}
    self.sampler = Sampler(cfg, base, numerics, max_tokens, tokenizer=tokenizer)
    self.states = States(state_root)
    self.external = ExternalWeights(os.path.join(state_root, "external_weights"), cfg,
                                    model_name)
    self.saved: dict[str, Snapshot] = {}  # tinker://<model>/sampler_weights/<name>
    self.samplers: dict[str, tuple[Snapshot, str | None]] = {}  # session -> (weights, path)
    self._base = Snapshot()
    self._ids = itertools.count(1)
    self._cond = threading.Condition()
    self._work: list[tuple[Future, Callable]] = []
    self._worker = threading.Thread(target=self._run, name="tinker-worker", daemon=True)
    self._worker.start()

  # ---- sessions and models --------------------------------------------------------------
  def create_session(self) -> str:
    session_id = f"s{uuid.uuid4().hex[:12]}"
    with self._cond:
      self.sessions[session_id] = True
    return session_id

  def open_session(self, session_id: str) -> None:
    if session_id not in self.sessions:
      raise ApiError(404, f"session {session_id!r} does not exist")
    if not self.sessions[session_id]:
      raise ApiError(400, f"session {session_id!r} was closed")

  def finish_session(self, session_id: str) -> None:
    with self._cond:
      if session_id in self.sessions:
        self.sessions[session_id] = False
      for model_id in [m for m, model in self.models.items() if model.session_id == session_id]:
        del self.models[model_id]
        self.closed_models.add(model_id)

  def create_model(self, body: dict) -> Future:
    session_id = str(body.get("session_id", ""))
    self.open_session(session_id)
    if body.get("base_model") != self.model_name:
      raise ApiError(404, f"base_model {body.get('base_model')!r} is not served here; this "
                          f"server trains {self.model_name!r}")
    lora = body.get("lora_config") or {}
    rank = lora.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 1024:
      raise ApiError(400, f"lora_config.rank must be an int in [1, 1024], got {rank!r}")
    seq = _model_seq_id(body)
    seed = lora.get("seed")
    return self._new_model(session_id, seq, rank, int(seed) if seed is not None else seq,
                           lambda model: {"model_id": model.model_id, "type": "create_model"})

  def _new_model(self, session_id: str, seq: int, rank: int, seed: int, first) -> Future:
    """Model `{session}:train:{seq}` with fresh rank-`rank` adapters; its request 0 is
    `first(model)` (run now: its result is the create's future)."""
    model_id = f"{session_id}:train:{seq}"
    with self._cond:
      if model_id in self.models:  # a retried submission
        if 0 not in self.models[model_id].seen:
          raise ApiError(400, f"model {model_id!r} was created more than "
                              f"{self.result_ttl_s:.0f} s ago")
        return self.models[model_id].seen[0]
      trainer = LoraTrainer(self.cfg, self.base, lora_lib.LoraConfig(rank=rank), seed=seed,
                            numerics=self.numerics, max_tokens=self.max_tokens)
      model = self.models[model_id] = Model(model_id, session_id, trainer)
      future = model.seen[0] = self._future()
    try:
      future.json = first(model)
    except UserError as e:
      future.error = {"error": str(e), "category": "user"}
    future.done, future.done_at = True, self.clock()
    return future

  def model(self, model_id: str) -> Model:
    with self._cond:
      if model_id in self.models:
        return self.models[model_id]
    if model_id in self.closed_models:
      raise ApiError(404, f"model {model_id!r} was closed with its session")
    raise ApiError(404, f"model {model_id!r} does not exist")

  def info(self, model_id: str) -> dict:
    model = self.model(model_id)
    return {"model_id": model_id, "is_lora": True, "lora_rank": model.trainer.lora.rank,
            "model_name": self.model_name, "type": "get_info",
            "model_data": {"arch": "qwen3_moe", "model_name": self.model_name,
                           "tokenizer_id": self.tokenizer_id}}

  # ---- training requests, in seq_id order -----------------------------------------------
  def submit(self, model_id: str, seq_id: Any, work: Callable[[LoraTrainer], Any]) -> Future:
    """Queues `work(trainer)` as the model's request `seq_id`; it runs after every earlier
    one (requests may arrive out of order). A repeated seq_id returns its future."""
    model = self.model(model_id)
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
      raise ApiError(400, f"seq_id must be an int >= 1, got {seq_id!r}")
    with self._cond:
      if seq_id in model.seen:
        return model.seen[seq_id]
      if seq_id < model.next_seq:
        raise ApiError(400, f"seq_id {seq_id} of model {model_id!r} already ran")
      future = model.seen[seq_id] = self._future()
      model.waiting[seq_id] = (future, lambda: work(model.trainer))
      while model.next_seq in model.waiting:
        self._work.append(model.waiting.pop(model.next_seq))
        model.next_seq += 1
      self._cond.notify_all()
      return future

  # A request's content is checked when it runs, not at submission: the SDK has given it
  # its seq_id, so a refusal there would leave a gap that every later request waits on.
  def forward_backward(self, body: bytes) -> Future:
    try:
      req = wire.forward_backward_request(body)
    except UserError as e:
      raise ApiError(400, str(e)) from None

    def work(trainer):
      datums = [wire.datum(d, i) for i, d in enumerate(req.data)]
      logprobs, metrics = trainer.forward_backward(datums, req.loss_fn, wire.loss_config(req),
                                                   backward=not req.forward_only)
      return wire.forward_backward_output(logprobs, metrics)
    return self.submit(req.model_id, req.seq_id, work)

  def optim_step(self, body: dict) -> Future:
    def work(trainer):
      try:
        adam = AdamParams.from_dict(body.get("adam_params") or {})
      except (TypeError, ValueError) as e:
        raise UserError(f"adam_params: {e}") from None
      return {"metrics": trainer.optim_step(adam)}
    return self.submit(str(body.get("model_id")), body.get("seq_id"), work)

  def save_weights_for_sampler(self, body: dict) -> Future:
    """Named: the weights under a tinker:// path; unnamed: a sampling session bound to
    them (both a snapshot as of this request's place in the client's order)."""
    model_id, name = str(body.get("model_id")), body.get("path")
    if name is not None and (not isinstance(name, str) or not name or "/" in name):
      raise ApiError(400, f"path must be a name without '/', got {name!r}")

    def work(trainer):
      weights = trainer.snapshot()
      if name is not None:
        path = f"tinker://{model_id}/sampler_weights/{name}"
        self.saved[path] = weights
        return {"path": path, "type": "save_weights_for_sampler"}
      return {"sampling_session_id": self._new_sampler(weights, None),
              "type": "save_weights_for_sampler"}
    return self.submit(model_id, body.get("seq_id"), work)

  def save_state(self, body: dict) -> Future:
    model_id = str(body.get("model_id"))

    def work(trainer):
      path = path_of(model_id, check_name(body.get("path")))
      self.states.save(trainer, path, overwrite=bool(body.get("overwrite")))
      return {"path": path, "type": "save_weights"}
    return self.submit(model_id, body.get("seq_id"), work)

  def save_weights_external(self, body: dict) -> Future:
    """The client's adapters as a PEFT adapter (`rljax.tinker.weights`), downloadable."""
    model_id = str(body.get("model_id"))

    def work(trainer):
      path, size = self.external.save(
          model_id, body.get("path"), trainer.lora, trainer.adapters,
          ttl_seconds=body.get("ttl_seconds"), recipients=body.get("age_encryption_recipients"))
      return {"path": path, "size_bytes": size, "type": "save_weights_external"}
    return self.submit(model_id, body.get("seq_id"), work)

  def checkpoint(self, method: str, model_id: str, checkpoint_id: str, action: str,
                 body: dict, server_url: str) -> dict:
    """An external weights export's download urls (GET .../external_weights_urls), TTL
    (PUT .../ttl) or deletion (DELETE)."""
    try:
      if (method, action) == ("GET", "external_weights_urls"):
        return self.external.urls(model_id, checkpoint_id, server_url)
      if (method, action) == ("PUT", "ttl"):
        self.external.set_ttl(model_id, checkpoint_id, body.get("ttl_seconds"))
        return {}
      if (method, action) == ("DELETE", ""):
        self.external.delete(model_id, checkpoint_id)
        return {}
    except WeightsNotFound as e:
      raise ApiError(404, str(e)) from None
    except UserError as e:
      raise ApiError(400, str(e)) from None
    raise ApiError(404, f"no route {method} .../checkpoints/{checkpoint_id}/{action}")

  def external_file(self, token: str, name: str) -> str:
    try:
      return self.external.file(token, name)
    except WeightsNotFound as e:
      raise ApiError(404, str(e)) from None

  def load_state(self, body: dict) -> Future:
    """`load_weights`: onto a client (its next request in order), or, with session_id and
    model_seq_id, a new client made from the state (its request 0)."""
    path, optimizer = body.get("path"), bool(body.get("optimizer"))
    if "model_id" in body:
      def work(trainer):
        self.states.load(trainer, path, optimizer=optimizer)
        return {"path": path, "type": "load_weights"}
      return self.submit(str(body.get("model_id")), body.get("seq_id"), work)
    session_id = str(body.get("session_id"))
    self.open_session(session_id)
    seq = _model_seq_id(body)
    try:
      if not self.states.exists(path):
        raise ApiError(404, f"no training state at {path!r}")
      rank = self.states.rank(path)
    except UserError as e:
      raise ApiError(400, str(e)) from None

    def first(model):
      self.states.load(model.trainer, path, optimizer=optimizer)
      return {"model_id": model.model_id, "path": path, "type": "load_weights"}
    return self._new_model(session_id, seq, rank, seq, first)

  def create_sampling_session(self, body: dict) -> dict:
    self.open_session(str(body.get("session_id")))
    path, base_model = body.get("model_path"), body.get("base_model")
    if path is not None:
      if path not in self.saved:
        raise ApiError(404, f"no sampler weights at {path!r}")
      return {"sampling_session_id": self._new_sampler(self.saved[path], path)}
    if base_model != self.model_name:
      raise ApiError(404, f"base_model {base_model!r} is not served here; this server "
                          f"samples {self.model_name!r}")
    return {"sampling_session_id": self._new_sampler(self._base, None)}

  def _new_sampler(self, weights, path) -> str:
    sampler_id = f"ss{uuid.uuid4().hex[:12]}"
    with self._cond:
      self.samplers[sampler_id] = (weights, path)
    return sampler_id

  def _sampling_session(self, sampler_id: str) -> tuple[Snapshot, str | None]:
    """(its weights, their tinker:// path or None)."""
    if sampler_id not in self.samplers:
      raise ApiError(404, f"sampling session {sampler_id!r} does not exist")
    return self.samplers[sampler_id]

  def sampler_info(self, sampler_id: str) -> dict:
    return {"sampler_id": sampler_id, "base_model": self.model_name,
            "model_path": self._sampling_session(sampler_id)[1]}

  def sample(self, body: dict) -> tuple[Future, int]:
    """(the future of a SampleResponse, its number of samples); checked at submission."""
    weights = self._sampling_session(str(body.get("sampling_session_id")))[0]
    try:
      args = sample_args(body, self.cfg.vocab_size, self.max_tokens,
                         eos_id=None if self.tokenizer is None else self.tokenizer.eos_id,
                         can_match_text=self.tokenizer is not None)
    except UserError as e:
      raise ApiError(400, str(e)) from None
    with self._cond:
      future = self._future()
      self._work.append((future, lambda: self.sampler.sample(weights, args)))
      self._cond.notify_all()
    return future, args.num_samples

  # ---- futures ---------------------------------------------------------------------------
  def _future(self) -> Future:
    self._drop_old_results()
    future = Future(f"r{next(self._ids)}")
    self.futures[future.request_id] = future
    return future

  def _drop_old_results(self) -> None:
    """Forgets requests that finished more than `result_ttl_s` ago (their futures, and the
    seq_ids that returned them: a repeat of one is then refused as already run)."""
    cutoff = self.clock() - self.result_ttl_s
    old = {i for i, f in self.futures.items() if f.done and f.done_at < cutoff}
    if not old:
      return
    for i in old:
      del self.futures[i]
    for model in self.models.values():
      model.seen = {seq: f for seq, f in model.seen.items() if f.request_id not in old}

  def result(self, request_id: str, timeout: float = LONG_POLL_S) -> Future:
    """The future, once done or after `timeout` seconds (then still pending)."""
    with self._cond:
      future = self.futures.get(request_id)
      if future is None:
        raise ApiError(404, f"no request {request_id!r} (unknown, or finished more than "
                            f"{self.result_ttl_s:.0f} s ago: results are kept that long)")
      self._cond.wait_for(lambda: future.done, timeout=timeout)
      return future

  def _run(self) -> None:
    while True:
      with self._cond:
        self._cond.wait_for(lambda: self._work)
        future, work = self._work.pop(0)
      try:
        out = work()
        result = {"proto": out} if isinstance(out, bytes) else {"json": out}
      except UserError as e:
        result = {"error": {"error": str(e), "category": "user"}}
      except Exception as e:  # pylint: disable=broad-except
        logging.error("tinker request %s failed:\n%s", future.request_id,
                      traceback.format_exc())
        result = {"error": {"error": f"{type(e).__name__}: {e}", "category": "server"}}
      with self._cond:
        for k, v in result.items():
          setattr(future, k, v)
        future.done, future.done_at = True, self.clock()
        self._cond.notify_all()
