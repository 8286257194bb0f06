"""DecodeEngine: continuous batching over a paged KV cache, calling the policy's `forward`.

One jitted decode call serves a fixed number of slots (static shapes: requests coming and
going never recompile it) and runs up to `steps_per_call` one-token steps on device, each
slot feeding back its own sampled token and stopping at its stop ids or token budget, so
the host's bookkeeping and dispatch are paid once per call, not per token. Every step is
the plain one-token step, so tokens and log-probs do not depend on the chunking. Prompts
admitted together are prefilled in one call. A request `(prompt, n)` is prefilled once; its n samples share
the prompt's pages by reference and copy a shared page only when they first write into
it (copy on write), so a group pays one prefill and at most one page copy per sample.
Pages are allocated as sequences grow, for exactly the positions the next call writes,
so no running sequence holds more than one partly empty page. When the pool runs out, the most recently admitted sequence is preempted: its pages
are released and its tokens re-prefilled when it is admitted again (its records are kept).

Multi-turn episodes: a request with `keep_pages=True` parks its sequence when the turn
ends; `extend()` appends observation tokens and queues it again, and only the tokens not
yet in the cache are prefilled (sequence extension).

In-flight weight updates (`update_weights`) happen between steps. Policy "keep" (the
default, as in AReaL/PipelineRL) lets running sequences continue on their existing KV and
stamps each new token with the version that sampled it; "recompute" re-prefills every
running sequence's cached tokens under the new weights first.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from rljax import sharding as sharding_lib
from rljax.engine import sampling
from rljax.engine.pages import OutOfPages, PagePool, pages_for, table_row
from rljax.model import ModelConfig, PagedKV, forward
from rljax.model.attention import raw_dtype
from rljax.numerics import FAST, Numerics
from rljax.rl.trajectory import FinishReason, Trajectory

WeightUpdatePolicy = Literal["keep", "recompute"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  max_new_tokens: int = 64
  stop_tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Request:
  request_id: int
  prompt_ids: np.ndarray
  n: int = 1  # samples sharing this prompt (a GRPO group)
  sampling: SamplingParams = SamplingParams()
  seed: int = 0
  group_id: int = -1
  keep_pages: bool = False  # park the sequence at the end of the turn (multi-turn)


@dataclasses.dataclass(eq=False)
class _Seq:
  request: Request
  sample_index: int
  tokens: list[int]
  prompt_len: int
  cached: int = 0  # positions whose K/V are in the pages
  pages: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  loss_mask: list[bool] = dataclasses.field(default_factory=list)
  routing: list[np.ndarray] = dataclasses.field(default_factory=list)  # one row per fed token
  turn_tokens: int = 0  # tokens generated in the current turn
  turn_budget: int = 0
  admitted_at: int = 0

  @property
  def key(self) -> tuple[int, int]:
    return self.request.request_id, self.sample_index


class DecodeEngine:
  """Continuous-batching sampler over paged KV. Not thread-safe; drive it from one loop."""

  def __init__(self, cfg: ModelConfig, params: Any, *, numerics: Numerics = FAST,
               num_slots: int = 32, max_seq_len: int = 256, num_pages: int | None = None,
               eos_id: int | None = None, version: int = 0,
               weight_update: WeightUpdatePolicy = "keep",
               sharding: sharding_lib.Sharding | None = None, steps_per_call: int = 8,
               max_stop_tokens: int = 4):
    if weight_update not in ("keep", "recompute"):
      raise ValueError(f"weight_update must be 'keep' or 'recompute', got {weight_update!r}")
    if steps_per_call < 1 or max_stop_tokens < 0:
      raise ValueError("need steps_per_call >= 1 and max_stop_tokens >= 0")
    if max_seq_len > cfg.max_position_embeddings:
      raise ValueError("max_seq_len exceeds the model's max_position_embeddings")
    self.cfg, self.params, self.numerics = cfg, params, numerics
    self.num_slots, self.max_seq_len, self.eos_id = num_slots, max_seq_len, eos_id
    self.version, self.weight_update, self.sharding = version, weight_update, sharding
    self.page_size = cfg.page_size
    self.steps_per_call, self.max_stop_tokens = steps_per_call, max_stop_tokens
    self.max_blocks = pages_for(max_seq_len, self.page_size)
    num_pages = num_pages or 1 + num_slots * self.max_blocks
    self.pool = PagePool(num_pages)
    shape = (cfg.num_hidden_layers, num_pages, self.page_size, cfg.num_key_value_heads,
             cfg.head_dim)
    # the page pools (k, v), donated to every jitted call; page tables travel per call
    raw = raw_dtype(cfg.compute_dtype)  # K/V stored as bits (see attention.write_pages)
    self.pools = (jnp.zeros(shape, raw), jnp.zeros(shape, raw))
    self.n_moe = len(cfg.moe_layers())
    self.slots: list[_Seq | None] = [None] * num_slots
    self.waiting: collections.deque[Request | _Seq] = collections.deque()
    self.ready: collections.deque[_Seq] = collections.deque()
    self.parked: dict[tuple[int, int], _Seq] = {}
    self.trace_counts: collections.Counter[str] = collections.Counter()
    self.stats = collections.Counter()
    self.max_waste_pages = 0.0
    self._clock = itertools.count()
    self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
    self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
    self._sample = jax.jit(self._sample_fn)
    self._copy = jax.jit(_copy_pages, donate_argnums=(0,))

  # ---- jitted bodies (trace counts guard against recompiles) ---------------------------

  def _decode_fn(self, params, pools, tokens, positions, budgets, table, key_ids, temperature,
                 top_k, top_p, stop_ids):
    """Up to `steps_per_call` decode steps on device; slot i runs budgets[i] of them or
    stops earlier on a stop id. Each step is exactly the one-token step (same forward,
    same sampling keys), so the tokens and log-probs do not depend on the chunking."""
    self.trace_counts["decode"] += 1
    seed, request_id, sample_index, first_pos = key_ids
    s, chunk = tokens.shape[0], self.steps_per_call
    k = max(self.cfg.num_experts_per_tok, 1)
    outputs = (jnp.zeros((chunk, s), jnp.int32), jnp.zeros((chunk, s), jnp.float32),
               jnp.zeros((chunk, s, self.n_moe, k), jnp.int32))

    def live(j, done):
      return (j < budgets) & ~done

    def cond(carry):
      j, _, _, done, _ = carry
      return (j < chunk) & jnp.any(live(j, done))

    def body(carry):
      j, pools, tok, done, (toks, lps, routes) = carry
      on = live(j, done)
      out = forward(params, tok[:, None], jnp.where(on, positions + j, -1)[:, None],
                    cfg=self.cfg, numerics=self.numerics, kv=PagedKV(*pools, table),
                    sharding=self.sharding)
      keys = sampling.token_keys(seed, request_id, sample_index, first_pos + j)
      new, lp = sampling.sample(out.logits[:, 0], keys, temperature, top_k, top_p,
                                self.numerics)
      new = jnp.where(on, new, tok)
      done = done | (on & jnp.any(new[:, None] == stop_ids, axis=-1))
      routing = (out.routing[:, 0] if out.routing is not None
                 else jnp.zeros((s, 0, k), jnp.int32))
      toks, lps, routes = (toks.at[j].set(new), lps.at[j].set(lp),
                           routes.at[j].set(routing.astype(jnp.int32)))
      return j + 1, (out.kv.k, out.kv.v), new, done, (toks, lps, routes)

    init = (jnp.zeros((), jnp.int32), pools, tokens, jnp.zeros(s, bool), outputs)
    steps, pools, _, _, (toks, lps, routes) = jax.lax.while_loop(cond, body, init)
    return toks, lps, routes, steps, pools

  def _prefill_fn(self, params, pools, tokens, positions, table, last):
    """Rows of new tokens (one sequence each) into their pages; logits at row `last`,
    padded to num_slots rows (the first-token sampler's fixed width)."""
    self.trace_counts[f"prefill_{tokens.shape[0]}x{tokens.shape[1]}"] += 1
    kv = PagedKV(*pools, table)
    out = forward(params, tokens, positions, cfg=self.cfg, numerics=self.numerics, kv=kv,
                  sharding=self.sharding)
    b = tokens.shape[0]
    logits = jnp.take_along_axis(out.logits, last[:, None, None], axis=1)[:, 0]
    logits = jnp.pad(logits, ((0, self.num_slots - b), (0, 0)))
    routing = out.routing if out.routing is not None else jnp.zeros(tokens.shape + (0, 0))
    return logits, routing, (out.kv.k, out.kv.v)

  def _sample_fn(self, logits, rows, key_ids, temperature, top_k, top_p):
    self.trace_counts["sample"] += 1
    return sampling.sample(logits[rows], sampling.token_keys(*key_ids), temperature, top_k,
                           top_p, self.numerics)

  # ---- public API ----------------------------------------------------------------------

  def submit(self, request: Request) -> None:
    prompt = np.asarray(request.prompt_ids, np.int32)
    if prompt.ndim != 1 or len(prompt) == 0:
      raise ValueError("prompt_ids must be a non-empty 1-D sequence of token ids")
    if len(prompt) >= self.max_seq_len:
      raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_seq_len "
                       f"{self.max_seq_len}")
    if np.any(prompt < 0) or np.any(prompt >= self.cfg.vocab_size):
      raise ValueError("prompt_ids out of the vocabulary")
    if request.n < 1 or request.sampling.max_new_tokens < 1:
      raise ValueError("need n >= 1 and max_new_tokens >= 1")
    if len(request.sampling.stop_tokens) > self.max_stop_tokens:
      raise ValueError(f"{len(request.sampling.stop_tokens)} stop tokens; this engine takes at "
                       f"most max_stop_tokens={self.max_stop_tokens}")
    self.waiting.append(dataclasses.replace(request, prompt_ids=prompt))

  def extend(self, request_id: int, sample_index: int, observation_ids, max_new_tokens: int):
    """Continues a parked multi-turn sequence: observations in, then a new turn."""
    seq = self.parked.pop((request_id, sample_index))
    obs = [int(t) for t in observation_ids]
    if len(seq.tokens) + len(obs) >= self.max_seq_len:
      self.parked[seq.key] = seq
      raise ValueError("the extended sequence would exceed max_seq_len")
    seq.tokens += obs
    seq.logprobs += [0.0] * len(obs)
    seq.versions += [-1] * len(obs)
    seq.loss_mask += [False] * len(obs)
    seq.turn_tokens, seq.turn_budget = 0, max_new_tokens
    self.waiting.append(seq)

  def release(self, request_id: int, sample_index: int) -> None:
    """Frees a parked sequence's pages (the episode is over)."""
    self.pool.release(self.parked.pop((request_id, sample_index)).pages)

  def update_weights(self, params: Any, version: int) -> None:
    """New weights between decode steps; running sequences are never dropped."""
    self.params, self.version = params, version
    if self.weight_update == "recompute":
      running = [(s, 0, s.cached) for s in self.slots if s is not None and s.cached]
      running += [(s, 0, s.cached) for s in self.ready if s.cached]
      for i in range(0, len(running), self.num_slots):  # overwrite the cached K/V in place
        self._run_prefill(running[i:i + self.num_slots])
      self.stats["recompute_tokens"] += sum(hi for _, _, hi in running)

  @property
  def idle(self) -> bool:
    return not (self.waiting or self.ready or any(s is not None for s in self.slots))

  def step(self) -> list[Trajectory]:
    """Admit what fits, then one decode step for every active slot; returns finished."""
    finished: list[Trajectory] = []
    self._admit(finished)
    active = [i for i, s in enumerate(self.slots) if s is not None]
    if active:
      finished += self._decode_active(active)
    elif self.waiting and not self.ready and not finished:
      # nothing runs, so no pages will come free: drop the cache of a waiting multi-turn
      # continuation (it is re-prefilled when admitted); only parked ones remain to blame
      if self._evict_waiting_cache():
        return finished
      raise OutOfPages(f"waiting work needs more than the {self.pool.free_count} free pages; "
                       f"{len(self.parked)} parked multi-turn sequences hold the rest "
                       "(release() them) or raise num_pages")
    return finished

  def run(self) -> list[Trajectory]:
    out = []
    while not self.idle:
      out += self.step()
    return out

  def generate(self, requests) -> list[Trajectory]:
    for r in requests:
      self.submit(r)
    return self.run()

  # ---- admission and prefill ------------------------------------------------------------

  def _admit(self, finished: list[Trajectory]) -> None:
    """Admits waiting work while slots and pages allow, all of it in one prefill call."""
    works, forks_wanted, pages_wanted = [], 0, 0
    free_slots = self.slots.count(None) - len(self.ready)
    for work in self.waiting:
      if forks_wanted >= free_slots:
        break
      seq = work if isinstance(work, _Seq) else self._new_prototype(work)
      need = pages_for(len(seq.tokens), self.page_size) - len(seq.pages) + 1
      if pages_wanted + need > self.pool.free_count:
        if not works and not isinstance(work, _Seq) and self.pool.used_count == 0:
          raise OutOfPages("the page pool cannot hold a single prompt")
        break
      works.append((work, seq))
      forks_wanted += 1 if isinstance(work, _Seq) else work.n
      pages_wanted += need
    if works:
      for _ in works:
        self.waiting.popleft()
      logits = self._run_prefill([(seq, seq.cached, len(seq.tokens)) for _, seq in works])
      forks, rows = [], []
      for row, (work, seq) in enumerate(works):
        n = 1 if isinstance(work, _Seq) else work.n
        forks += [seq] + [self._fork(seq, i) for i in range(1, n)]
        rows += [row] * n
      for s, (tok, lp) in zip(forks, self._sample_first(forks, rows, logits)):
        self._append(s, tok, lp)
        done = self._finish_reason(s, tok)
        if done is None:
          self.ready.append(s)
        else:
          finished.append(self._retire(s, done))
    self._fill_slots()

  def _new_prototype(self, req: Request) -> _Seq:
    return _Seq(request=req, sample_index=0, tokens=[int(t) for t in req.prompt_ids],
                prompt_len=len(req.prompt_ids), turn_budget=req.sampling.max_new_tokens)

  def _fork(self, proto: _Seq, index: int) -> _Seq:
    return _Seq(request=proto.request, sample_index=index, tokens=list(proto.tokens),
                prompt_len=proto.prompt_len, cached=proto.cached,
                pages=self.pool.share(proto.pages), logprobs=list(proto.logprobs),
                versions=list(proto.versions), loss_mask=list(proto.loss_mask),
                routing=list(proto.routing), turn_budget=proto.turn_budget)

  def _fill_slots(self) -> None:
    for i, s in enumerate(self.slots):
      if s is None and self.ready:
        seq = self.ready.popleft()
        seq.admitted_at = next(self._clock)
        self.slots[i] = seq

  def _run_prefill(self, items: list[tuple[_Seq, int, int]]):
    """Feeds each seq's tokens[lo:hi] at positions lo..hi-1 into its pages, all sequences
    in one call (rows padded to power-of-two buckets); returns logits [num_slots, V] whose
    row i follows the last fed token of items[i]. At most num_slots items, none empty."""
    if not 0 < len(items) <= self.num_slots or any(hi <= lo for _, lo, hi in items):
      raise AssertionError("prefill takes 1..num_slots non-empty token ranges")
    copies = []
    for seq, lo, hi in items:
      for block in range(lo // self.page_size, pages_for(hi, self.page_size)):
        copies += self._writable_block(seq, block, defer_copy=True)
    if copies:
      self._flush_copies(copies)
    longest = max(hi - lo for _, lo, hi in items)
    width = self.page_size * (1 << max(0, (pages_for(longest, self.page_size) - 1).bit_length()))
    rows = min(1 << (len(items) - 1).bit_length(), self.num_slots)
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    table = np.zeros((rows, self.max_blocks), np.int32)
    last = np.zeros(rows, np.int32)
    for i, (seq, lo, hi) in enumerate(items):
      tokens[i, :hi - lo] = seq.tokens[lo:hi]
      positions[i, :hi - lo] = np.arange(lo, hi)
      table[i] = table_row(seq.pages, self.max_blocks)
      last[i] = hi - lo - 1
    logits, routing, self.pools = self._prefill(self.params, self.pools, tokens, positions, table,
                                                last)
    routing = np.asarray(routing)
    for i, (seq, lo, hi) in enumerate(items):
      seq.routing[lo:hi] = list(routing[i, :hi - lo])
      seq.cached = max(seq.cached, hi)
      self.stats["prefill_tokens"] += hi - lo
    return logits

  def _sample_first(self, seqs: list[_Seq], rows: list[int], logits) -> list[tuple[int, float]]:
    """First token of each seq from its prefill row of `logits`, num_slots at a time."""
    out = []
    for chunk in range(0, len(seqs), self.num_slots):
      group = seqs[chunk:chunk + self.num_slots]
      idx = np.zeros(self.num_slots, np.int32)
      idx[:len(group)] = rows[chunk:chunk + self.num_slots]
      toks, lps = self._sample(logits, idx, *self._sampling_arrays(group, self.num_slots))
      toks, lps = np.asarray(toks), np.asarray(lps)
      out += [(int(toks[i]), float(lps[i])) for i in range(len(group))]
    return out

  def _sampling_arrays(self, seqs: list[_Seq | None], width: int):
    seed = np.zeros(width, np.int32)
    rid = np.zeros(width, np.int32)
    sidx = np.zeros(width, np.int32)
    pos = np.zeros(width, np.int32)
    temp = np.ones(width, np.float32)
    top_k = np.zeros(width, np.int32)
    top_p = np.ones(width, np.float32)
    for i, s in enumerate(seqs):
      if s is None:
        continue
      sp = s.request.sampling
      seed[i], rid[i], sidx[i], pos[i] = s.request.seed, s.request.request_id, s.sample_index, len(
          s.tokens)
      temp[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
    return (seed, rid, sidx, pos), temp, top_k, top_p

  # ---- decode ---------------------------------------------------------------------------

  def _decode_active(self, active: list[int]) -> list[Trajectory]:
    """One device call of up to `steps_per_call` steps for every active slot. A slot's
    budget is capped by its token limits and by the pages it could get: pages are
    allocated for exactly the positions it will write (so < 1 page idles per sequence)."""
    copies: list[tuple[int, int]] = []
    budgets: dict[int, int] = {}
    for i in sorted(active, key=lambda i: self.slots[i].admitted_at):
      seq = self.slots[i]
      if seq is None:
        continue  # preempted by an earlier slot of this call
      first = len(seq.tokens) - 1  # the position this call feeds first
      budget = min(self.steps_per_call, seq.turn_budget - seq.turn_tokens,
                   self.max_seq_len - len(seq.tokens))
      granted = self._grant_pages(seq, first, budget, copies)
      budgets[id(seq)] = granted
    if copies:
      self._flush_copies(copies)
    seqs = list(self.slots)
    s = self.num_slots
    tokens = np.zeros(s, np.int32)
    positions = np.full(s, -1, np.int32)
    steps = np.zeros(s, np.int32)
    table = np.zeros((s, self.max_blocks), np.int32)
    stop_ids = np.full((s, self.max_stop_tokens + 1), -1, np.int32)
    for i, seq in enumerate(seqs):
      if seq is not None:
        tokens[i], positions[i] = seq.tokens[-1], len(seq.tokens) - 1
        steps[i] = budgets[id(seq)]
        table[i] = table_row(seq.pages, self.max_blocks)
        stops = seq.request.sampling.stop_tokens + (
            () if self.eos_id is None else (self.eos_id,))
        stop_ids[i, :len(stops)] = stops
    key_ids, temp, top_k, top_p = self._sampling_arrays(seqs, s)
    toks, lps, routing, ran, self.pools = self._decode(
        self.params, self.pools, tokens, positions, steps, table, key_ids, temp, top_k, top_p,
        stop_ids)
    toks, lps, routing = np.asarray(toks), np.asarray(lps), np.asarray(routing)
    self.stats["decode_calls"] += 1
    self.stats["decode_steps"] += int(ran)
    finished = []
    for i, seq in enumerate(seqs):
      if seq is None:
        continue
      # the slot ran steps[i] steps unless it sampled a stop id first; only its last token
      # can end it (budgets stop at the token limits)
      n = int(steps[i])
      if stop_ids[i, 0] >= 0:
        hit = np.flatnonzero(np.isin(toks[:n, i], stop_ids[i][stop_ids[i] >= 0]))
        n = int(hit[0]) + 1 if hit.size else n
      new = toks[:n, i].tolist()
      seq.routing += list(routing[:n, i])
      seq.tokens += new
      seq.logprobs += lps[:n, i].tolist()
      seq.versions += [self.version] * n
      seq.loss_mask += [True] * n
      seq.turn_tokens += n
      seq.cached = len(seq.tokens) - 1
      self.stats["generated_tokens"] += n
      done = self._finish_reason(seq, new[-1])
      if done is not None:
        self.slots[i] = None
        finished.append(self._retire(seq, done))
      else:
        waste = (len(seq.pages) * self.page_size - seq.cached) / self.page_size
        self.max_waste_pages = max(self.max_waste_pages, waste)
    self._fill_slots()
    return finished

  def _grant_pages(self, seq: _Seq, first: int, budget: int, copies: list) -> int:
    """Writable pages for positions first.. first + budget - 1, as many as the pool gives;
    returns how many of those positions are covered (>= 1: preempts younger work)."""
    granted = 0
    for block in range(first // self.page_size, pages_for(first + budget, self.page_size)):
      while True:
        try:
          copies += self._writable_block(seq, block, defer_copy=True)
          break
        except OutOfPages:
          if granted:
            return granted  # run to the end of the pages it has; more next call
          self._preempt_youngest(exclude=seq)  # may free nothing: repeat until it does
      granted = min(budget, (block + 1) * self.page_size - first)
    return granted

  def _writable_block(self, seq: _Seq, block: int, defer_copy: bool = False):
    """Makes seq's page for `block` exist and be unshared; returns deferred copies."""
    if block < len(seq.pages):
      if not self.pool.is_shared(seq.pages[block]):
        return []
      (new,) = self.pool.alloc(1)
      old, seq.pages[block] = seq.pages[block], new
      self.pool.release([old])
      self.stats["page_copies"] += 1
      if defer_copy:
        return [(old, new)]
      self._flush_copies([(old, new)])
      return []
    if block != len(seq.pages):
      raise AssertionError("pages must be allocated in order")
    seq.pages += self.pool.alloc(1)
    return []

  def _flush_copies(self, copies):
    # a page released by a preemption and taken again may be a destination twice: the
    # last copy into it is the live one (duplicate scatter indices have no defined order)
    copies = [(src, dst) for dst, src in {dst: src for src, dst in copies}.items()]
    width = self.num_slots
    for i in range(0, len(copies), width):
      chunk = copies[i:i + width]
      src = np.zeros(width, np.int32)
      dst = np.zeros(width, np.int32)
      src[:len(chunk)] = [c[0] for c in chunk]
      dst[:len(chunk)] = [c[1] for c in chunk]
      self.pools = self._copy(self.pools, src, dst)

  def _preempt_youngest(self, exclude: _Seq) -> None:
    """Frees the pages of the sequence admitted last (waiting-for-slot ones first, then
    running ones, then the caches of waiting continuations)."""
    if self.ready:
      seq = self.ready.pop()
    else:
      candidates = [(s.admitted_at, i) for i, s in enumerate(self.slots)
                    if s is not None and s is not exclude]
      if not candidates:
        # no other sequence runs: waiting multi-turn continuations may hold the pages
        # (they are re-prefilled when admitted)
        if self._evict_waiting_cache():
          return
        raise OutOfPages("a single sequence does not fit the page pool; raise num_pages")
      _, i = max(candidates)
      seq = self.slots[i]
      self.slots[i] = None
    self.pool.release(seq.pages)
    seq.pages, seq.cached = [], 0
    seq.routing = []
    self.stats["preemptions"] += 1
    self.waiting.appendleft(seq)

  def _evict_waiting_cache(self) -> bool:
    """Releases the pages of the newest waiting sequence that holds any."""
    for seq in reversed(self.waiting):
      if isinstance(seq, _Seq) and seq.pages:
        self.pool.release(seq.pages)
        seq.pages, seq.cached, seq.routing = [], 0, []
        self.stats["preemptions"] += 1
        return True
    return False

  # ---- records --------------------------------------------------------------------------

  def _append(self, seq: _Seq, token: int, logprob: float) -> None:
    seq.tokens.append(token)
    seq.logprobs.append(logprob)
    seq.versions.append(self.version)
    seq.loss_mask.append(True)
    seq.turn_tokens += 1
    self.stats["generated_tokens"] += 1

  def _finish_reason(self, seq: _Seq, token: int) -> FinishReason | None:
    if self.eos_id is not None and token == self.eos_id:
      return FinishReason.EOS
    if token in seq.request.sampling.stop_tokens:
      return FinishReason.STOP
    if seq.turn_tokens >= seq.turn_budget or len(seq.tokens) >= self.max_seq_len:
      return FinishReason.LENGTH
    return None

  def _retire(self, seq: _Seq, reason: FinishReason) -> Trajectory:
    if seq.request.keep_pages:
      keep = pages_for(seq.cached, self.page_size)  # pages granted past a stop go back
      self.pool.release(seq.pages[keep:])
      seq.pages = seq.pages[:keep]
      self.parked[seq.key] = seq
    else:
      self.pool.release(seq.pages)
      seq.pages = []
    p = seq.prompt_len
    routing = np.zeros((len(seq.tokens), self.n_moe, self.cfg.num_experts_per_tok), np.int32)
    if self.n_moe and seq.routing:
      routing[:len(seq.routing)] = np.stack(seq.routing)
    return Trajectory(
        prompt_ids=np.asarray(seq.tokens[:p], np.int32),
        completion_ids=np.asarray(seq.tokens[p:], np.int32),
        loss_mask=np.asarray(seq.loss_mask, bool),
        behaviour_logprobs=np.asarray(seq.logprobs, np.float32),
        versions=np.asarray(seq.versions, np.int32),
        expert_ids=routing if self.n_moe else None,
        finish_reason=reason, request_id=seq.request.request_id,
        group_id=seq.request.group_id, sample_index=seq.sample_index)


def _copy_pages(pools, src: jax.Array, dst: jax.Array):
  """pool[:, dst] = pool[:, src] for every layer and both pools ((0, 0) pairs are no-ops)."""
  return tuple(p.at[:, dst].set(p[:, src]) for p in pools)
