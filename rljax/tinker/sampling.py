"""Tinker sampling clients on rljax's decode engine: weight snapshots saved by training
clients (`save_weights_for_sampler`), and `asample` (sampled tokens with their log-probs,
optionally the prompt's log-probs) with a snapshot's weights.

One `DecodeEngine` serves every snapshot: a request runs with its snapshot's weights (the
base with the snapshot's adapters merged, `update_weights` when they differ from the
engine's), so a snapshot costs its adapters' memory, not a model's. The sampled tokens'
log-probs are the engine's (`behaviour_logprobs`), in deterministic numerics the training
forward's bits for the same tokens; prompt log-probs come from the training forward on the
snapshot. Stop token ids stop the engine; stop strings (`rljax.tinker.stops`) cut each
finished sequence after the token that completes the first match.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.model import forward
from rljax.rl.trajectory import FinishReason
from rljax.rl import learner
from rljax.tinker.stops import MAX_STOP_TOKENS, parse_stops, stop_cut
from rljax.tinker.training import Snapshot, UserError

DEFAULT_MAX_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class SampleArgs:
  prompt: np.ndarray  # [P] int32
  num_samples: int
  sampling: SamplingParams
  seed: int
  prompt_logprobs: bool
  stop_strings: tuple[str, ...] = ()


def sample_args(body: dict, vocab_size: int, max_tokens: int, *, eos_id: int | None = None,
                can_match_text: bool = False) -> SampleArgs:
  """The asample request's fields, checked (UserError names the first bad one). `eos_id`:
  the tokenizer's EOS, a stop token unless `stop` is `[]`; `can_match_text`: the server can
  decode tokens (stop strings need it)."""
  tokens = []
  for chunk in (body.get("prompt") or {}).get("chunks") or []:
    if chunk.get("type", "encoded_text") != "encoded_text":
      raise UserError(f"prompt: {chunk.get('type')} chunks are not supported (text models)")
    tokens.extend(chunk.get("tokens") or [])
  prompt = np.asarray(tokens, np.int64)
  if prompt.size == 0 or prompt.min() < 0 or prompt.max() >= vocab_size:
    raise UserError(f"prompt: needs 1 or more token ids in [0, {vocab_size})")
  n = body.get("num_samples", 1)
  if not isinstance(n, int) or not 1 <= n <= 256:
    raise UserError(f"num_samples must be an int in [1, 256], got {n!r}")
  for unsupported in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
    if body.get(unsupported):
      raise UserError(f"{unsupported} is not supported by this server")
  if body.get("prompt_logprobs_last_n") or body.get("target_prompt_logprobs"):
    raise UserError("prompt_logprobs_last_n / target_prompt_logprobs are not supported")
  params = body.get("sampling_params") or {}
  new = params.get("max_tokens") or DEFAULT_MAX_TOKENS
  if not isinstance(new, int) or new < 1 or prompt.size + new > max_tokens:
    raise UserError(f"max_tokens {new!r}: prompt ({prompt.size}) + max_tokens must be at "
                    f"most {max_tokens}")
  stops = parse_stops(params.get("stop"), vocab_size=vocab_size, eos_id=eos_id,
                      can_match_text=can_match_text)
  temperature = float(params.get("temperature", 1.0))
  top_k, top_p = int(params.get("top_k", -1)), float(params.get("top_p", 1.0))
  if temperature < 0 or not 0 < top_p <= 1 or top_k < -1 or top_k == 0:
    raise UserError(f"sampling_params out of range: temperature {temperature}, top_k "
                    f"{top_k}, top_p {top_p}")
  seed = params.get("seed", body.get("seed"))
  return SampleArgs(prompt.astype(np.int32), n, SamplingParams(
      temperature=temperature, top_k=max(top_k, 0), top_p=top_p, max_new_tokens=new,
      stop_tokens=stops.tokens),
      int(seed) if seed is not None else int(np.random.default_rng().integers(2 ** 31)),
      bool(body.get("prompt_logprobs")), stops.strings)


class Sampler:
  """The engine, with the weights of the snapshot it last sampled. `tokenizer`
  (`rljax.envs.tokenizer.TransformersTokenizer`, optional): what stop strings are matched
  with."""

  def __init__(self, cfg, base: Any, numerics, max_tokens: int, num_slots: int = 16,
               tokenizer=None):
    self.cfg, self.base, self.numerics, self.max_tokens = cfg, base, numerics, max_tokens
    self.text_of = tokenizer.decode_sampled if tokenizer is not None else None
    self.num_slots = num_slots
    self.engine: DecodeEngine | None = None
    self._snapshot: Snapshot | None = None
    self._params: Any = None
    self._requests = 0

  def _engine_with(self, snapshot: Snapshot) -> DecodeEngine:
    if self.engine is not None and snapshot is self._snapshot:
      return self.engine
    self._params = (self.base if snapshot.adapters is None else
                    learner.merged_params(self.base, snapshot.adapters, snapshot.lora))
    if self.engine is None:
      self.engine = DecodeEngine(self.cfg, self._params, numerics=self.numerics,
                                 num_slots=self.num_slots, max_seq_len=self.max_tokens,
                                 max_stop_tokens=MAX_STOP_TOKENS)
    else:
      self.engine.update_weights(self._params, self.engine.version + 1)
    self._snapshot = snapshot
    return self.engine

  def sample(self, snapshot: Snapshot, args: SampleArgs) -> bytes:
    """A serialized SampleResponse for `args` with the snapshot's weights."""
    self._requests += 1
    engine = self._engine_with(snapshot)
    # sampling_id 0: the request's seed alone keys its draws (the same seed, the same samples)
    trajs = engine.generate([Request(request_id=self._requests, prompt_ids=args.prompt,
                                     n=args.num_samples, sampling=args.sampling,
                                     seed=args.seed, sampling_id=0)])
    out = pb.SampleResponse()
    for t in sorted(trajs, key=lambda t: t.sample_index):
      tokens, logprobs = list(t.completion_ids), np.asarray(t.behaviour_logprobs, np.float32)
      stopped = t.finish_reason in (FinishReason.EOS, FinishReason.STOP)
      k = stop_cut(tokens, args.stop_strings, self.text_of) if args.stop_strings else None
      if k is not None:  # a stop string: the tokens end with the one completing it
        tokens, logprobs, stopped = tokens[:k], logprobs[:k], True
      seq = out.sequences.add()
      seq.tokens = np.asarray(tokens, np.int32).tobytes()
      seq.logprobs = logprobs.tobytes()
      seq.stop_reason = pb.STOP_REASON_STOP if stopped else pb.STOP_REASON_LENGTH
    if args.prompt_logprobs:
      out.prompt_logprobs = self.prompt_logprobs(self._params, args.prompt).tobytes()
    return out.SerializeToString()

  def prompt_logprobs(self, params, prompt: np.ndarray) -> np.ndarray:
    """log p(prompt[i] | prompt[:i]) for each position, NaN at 0 (nothing precedes it)."""
    tokens = prompt[None]
    lp = _prompt_forward(params, tokens, np.arange(prompt.size, dtype=np.int32)[None],
                         np.concatenate([prompt[1:], prompt[:1]])[None], cfg=self.cfg,
                         numerics=self.numerics)
    out = np.empty(prompt.size, np.float32)
    out[0] = np.nan
    out[1:] = np.asarray(lp)[0, :-1]
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "numerics"))
def _prompt_forward(params, tokens, positions, targets, cfg, numerics):
  return forward(params, tokens, positions, cfg=cfg, numerics=numerics, targets=targets).logprobs
