"""The engine's scheduler: plain Python bookkeeping of requests, slots and pages.

Requests wait in `waiting`; admitted sequences wait for a decode slot in `ready`, run in
`slots`, and multi-turn ones park in `parked` between turns. A request `(prompt, n)` is
prefilled once; its n samples share the prompt's pages by reference and copy a shared page
only when they first write into it (copy on write), so a group pays one prefill and at most
one page copy per sample. Pages are granted as sequences grow, for exactly the positions
the next decode call writes, so no running sequence holds more than one partly empty page.
When the pool runs out, the most recently admitted sequence is preempted: its pages are
released and its tokens re-prefilled when it is admitted again (its records are kept).

Nothing here touches the device: page copies come back as (src, dst) pairs for the engine
to run, and the records of what the device sampled come in through `record_*`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from rljax.engine.pages import OutOfPages, PagePool, pages_for
from rljax.rl.trajectory import FinishReason, Trajectory

PageCopies = list[tuple[int, int]]  # (src, dst) page ids


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
  sampling_id: int | None = None  # the request id in its tokens' sampling keys (None: request_id)


@dataclasses.dataclass(eq=False)
class Seq:
  """One sample's tokens, its pages and its per-token records."""
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


Prefill = tuple[Seq, int, int]  # feed seq.tokens[lo:hi] at positions lo..hi-1


class Scheduler:
  """Slots, queues, pages and records of a `DecodeEngine`. Not thread-safe."""

  def __init__(self, *, num_slots: int, max_seq_len: int, page_size: int, num_pages: int,
               steps_per_call: int, vocab_size: int, eos_id: int | None, max_stop_tokens: int,
               moe_layers: int, experts_per_token: int):
    self.num_slots, self.max_seq_len, self.page_size = num_slots, max_seq_len, page_size
    self.steps_per_call = steps_per_call
    self.vocab_size, self.eos_id, self.max_stop_tokens = vocab_size, eos_id, max_stop_tokens
    self.moe_layers, self.experts_per_token = moe_layers, experts_per_token
    self.pool = PagePool(num_pages)
    self.slots: list[Seq | None] = [None] * num_slots
    self.waiting: collections.deque[Request | Seq] = collections.deque()
    self.ready: collections.deque[Seq] = collections.deque()
    self.parked: dict[tuple[int, int], Seq] = {}
    self.stats = collections.Counter()
    self.max_waste_pages = 0.0
    self._clock = itertools.count()

  # ---- requests in ----------------------------------------------------------------------

  def submit(self, request: Request) -> None:
    prompt = np.asarray(request.prompt_ids, np.int32)
    if prompt.ndim != 1 or len(prompt) == 0:
      raise ValueError("prompt_ids must be a non-empty 1-D sequence of token ids")
    if len(prompt) >= self.max_seq_len:
      raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_seq_len "
                       f"{self.max_seq_len}")
    if np.any(prompt < 0) or np.any(prompt >= self.vocab_size):
      raise ValueError("prompt_ids out of the vocabulary")
    if request.n < 1 or request.sampling.max_new_tokens < 1:
      raise ValueError("need n >= 1 and max_new_tokens >= 1")
    if len(request.sampling.stop_tokens) > self.max_stop_tokens:
      raise ValueError(f"{len(request.sampling.stop_tokens)} stop tokens; this engine takes at "
                       f"most max_stop_tokens={self.max_stop_tokens}")
    self.waiting.append(dataclasses.replace(request, prompt_ids=prompt))

  def extend(self, request_id: int, sample_index: int, observation_ids, max_new_tokens: int):
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
    self.pool.release(self.parked.pop((request_id, sample_index)).pages)

  @property
  def idle(self) -> bool:
    return not (self.waiting or self.ready or any(s is not None for s in self.slots))

  def active(self) -> list[int]:
    return [i for i, s in enumerate(self.slots) if s is not None]

  def cached_ranges(self) -> list[Prefill]:
    """Every running or ready sequence's cached tokens (to re-prefill under new weights)."""
    running = [(s, 0, s.cached) for s in self.slots if s is not None and s.cached]
    return running + [(s, 0, s.cached) for s in self.ready if s.cached]

  # ---- admission --------------------------------------------------------------------------

  def take_admissible(self) -> list[tuple[Request | Seq, Seq]]:
    """Pops the waiting work that slots and pages allow, as (work, the sequence to prefill:
    a new prompt's prototype or the continuation itself)."""
    works, forks_wanted, pages_wanted = [], 0, 0
    free_slots = self.slots.count(None) - len(self.ready)
    for work in self.waiting:
      if forks_wanted >= free_slots:
        break
      seq = work if isinstance(work, Seq) else self._new_prototype(work)
      need = pages_for(len(seq.tokens), self.page_size) - len(seq.pages) + 1
      if pages_wanted + need > self.pool.free_count:
        if not works and not isinstance(work, Seq) and self.pool.used_count == 0:
          raise OutOfPages("the page pool cannot hold a single prompt")
        break
      works.append((work, seq))
      forks_wanted += 1 if isinstance(work, Seq) else work.n
      pages_wanted += need
    for _ in works:
      self.waiting.popleft()
    return works

  def fork_groups(self, works: list[tuple[Request | Seq, Seq]]) -> tuple[list[Seq], list[int]]:
    """After their prefill: every sample of each work (a request's n - 1 siblings share
    the prototype's pages) and the prefill row each samples its first token from."""
    forks, rows = [], []
    for row, (work, seq) in enumerate(works):
      n = 1 if isinstance(work, Seq) else work.n
      forks += [seq] + [self._fork(seq, i) for i in range(1, n)]
      rows += [row] * n
    return forks, rows

  def _new_prototype(self, req: Request) -> Seq:
    return Seq(request=req, sample_index=0, tokens=[int(t) for t in req.prompt_ids],
               prompt_len=len(req.prompt_ids), turn_budget=req.sampling.max_new_tokens)

  def _fork(self, proto: Seq, index: int) -> Seq:
    return Seq(request=proto.request, sample_index=index, tokens=list(proto.tokens),
               prompt_len=proto.prompt_len, cached=proto.cached,
               pages=self.pool.share(proto.pages), logprobs=list(proto.logprobs),
               versions=list(proto.versions), loss_mask=list(proto.loss_mask),
               routing=list(proto.routing), turn_budget=proto.turn_budget)

  def fill_slots(self) -> None:
    for i, s in enumerate(self.slots):
      if s is None and self.ready:
        seq = self.ready.popleft()
        seq.admitted_at = next(self._clock)
        self.slots[i] = seq

  def relieve_stall(self) -> None:
    """Nothing runs, so no pages will come free: drops the cache of a waiting multi-turn
    continuation (re-prefilled when admitted); raises when only parked ones are to blame."""
    if not self._evict_waiting_cache():
      raise OutOfPages(f"waiting work needs more than the {self.pool.free_count} free pages; "
                       f"{len(self.parked)} parked multi-turn sequences hold the rest "
                       "(release() them) or raise num_pages")

  # ---- pages ------------------------------------------------------------------------------

  def prefill_pages(self, items: list[Prefill]) -> PageCopies:
    """Writable pages for every position the prefill of `items` writes."""
    copies = []
    for seq, lo, hi in items:
      for block in range(lo // self.page_size, pages_for(hi, self.page_size)):
        copies += self._writable_block(seq, block)
    return copies

  def grant_decode(self, ahead: list[int] | None = None) -> tuple[list[int] | None, PageCopies]:
    """Pages for the next decode call, oldest slot first; returns each slot's step budget
    (0 = empty; slots may be emptied by preemption) and the page copies to run first. A
    budget is capped by the token limits and by the pages it could get: pages are granted
    for exactly the positions a slot will write (so < 1 page idles per sequence).

    `ahead` (the engine's overlap): slot i's sequence is `ahead[i]` steps further on, in a
    call not read back yet (its records are not in). Then nothing is preempted: when a slot
    would need that, the budgets are None (read the call back first); the copies are still
    the engine's to run, and pages granted so far stay with their sequences."""
    copies: PageCopies = []
    budgets: dict[int, int] = {}
    for i in sorted(self.active(), key=lambda i: self.slots[i].admitted_at):
      seq = self.slots[i]
      if seq is None:
        continue  # preempted by an earlier slot of this call
      further = ahead[i] if ahead else 0
      budget = min(self.steps_per_call, seq.turn_budget - seq.turn_tokens - further,
                   self.max_seq_len - len(seq.tokens) - further)
      if budget <= 0:  # it ends in the call ahead
        budgets[id(seq)] = 0
        continue
      granted = self._grant_pages(seq, len(seq.tokens) - 1 + further, budget, copies,
                                  preempt=ahead is None)
      if not granted:
        return None, copies
      budgets[id(seq)] = granted
    return [0 if s is None else budgets[id(s)] for s in self.slots], copies

  def _grant_pages(self, seq: Seq, first: int, budget: int, copies: PageCopies,
                   preempt: bool = True) -> int:
    """Writable pages for positions first.. first + budget - 1, as many as the pool gives;
    returns how many of those positions are covered (>= 1: preempts younger work, unless
    not `preempt`: then 0 when the pool has no page for the first)."""
    granted = 0
    for block in range(first // self.page_size, pages_for(first + budget, self.page_size)):
      while True:
        try:
          copies += self._writable_block(seq, block)
          break
        except OutOfPages:
          if granted or not preempt:
            return granted  # run to the end of the pages it has; more next call
          self._preempt_youngest(exclude=seq)  # may free nothing: repeat until it does
      granted = min(budget, (block + 1) * self.page_size - first)
    return granted

  def _writable_block(self, seq: Seq, block: int) -> PageCopies:
    """Makes seq's page for `block` exist and be unshared; returns the copy it needs."""
    if block < len(seq.pages):
      if not self.pool.is_shared(seq.pages[block]):
        return []
      (new,) = self.pool.alloc(1)
      old, seq.pages[block] = seq.pages[block], new
      self.pool.release([old])
      self.stats["page_copies"] += 1
      return [(old, new)]
    if block != len(seq.pages):
      raise AssertionError("pages must be allocated in order")
    seq.pages += self.pool.alloc(1)
    return []

  def _preempt_youngest(self, exclude: Seq) -> None:
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
      if isinstance(seq, Seq) and seq.pages:
        self.pool.release(seq.pages)
        seq.pages, seq.cached, seq.routing = [], 0, []
        self.stats["preemptions"] += 1
        return True
    return False

  # ---- records ----------------------------------------------------------------------------

  def stop_ids(self, seq: Seq) -> tuple[int, ...]:
    return seq.request.sampling.stop_tokens + (() if self.eos_id is None else (self.eos_id,))

  def record_prefill(self, items: list[Prefill], routing: np.ndarray) -> None:
    """routing [rows, width, M, K] of the prefill call that fed `items` (row i = item i)."""
    for i, (seq, lo, hi) in enumerate(items):
      seq.routing[lo:hi] = list(routing[i, :hi - lo])
      seq.cached = max(seq.cached, hi)
      self.stats["prefill_tokens"] += hi - lo

  def record_first(self, seq: Seq, token: int, logprob: float, version: int) -> Trajectory | None:
    """A new sample's first token; the sequence goes to `ready` unless it ended."""
    seq.tokens.append(token)
    seq.logprobs.append(logprob)
    seq.versions.append(version)
    seq.loss_mask.append(True)
    seq.turn_tokens += 1
    self.stats["generated_tokens"] += 1
    done = self._finish_reason(seq, token)
    if done is None:
      self.ready.append(seq)
      return None
    return self._retire(seq, done)

  def record_decode(self, slot: int, tokens: list[int], logprobs: list[float],
                    routing: np.ndarray, steps: int, version: int,
                    ahead: int = 0) -> Trajectory | None:
    """The slot's column of a decode call (tokens / logprobs: lists of N, routing [N, M, K]):
    it ran `steps` steps unless it sampled a stop id first (only its last token can end it:
    budgets stop at the token limits). Frees the slot when the sequence ended. `ahead`:
    the steps granted to it in a call already dispatched (the engine's overlap)."""
    seq = self.slots[slot]
    new = tokens[:steps]
    stops = self.stop_ids(seq)
    n = next((j + 1 for j, t in enumerate(new) if t in stops), steps)
    del new[n:]
    seq.routing += list(routing[:n])
    seq.tokens += new
    seq.logprobs += logprobs[:n]
    seq.versions += [version] * n
    seq.loss_mask += [True] * n
    seq.turn_tokens += n
    seq.cached = len(seq.tokens) - 1
    self.stats["generated_tokens"] += n
    done = self._finish_reason(seq, new[-1])
    if done is not None:
      self.slots[slot] = None
      return self._retire(seq, done)
    waste = (len(seq.pages) * self.page_size - seq.cached - ahead) / self.page_size
    self.max_waste_pages = max(self.max_waste_pages, waste)
    return None

  def _finish_reason(self, seq: Seq, token: int) -> FinishReason | None:
    if self.eos_id is not None and token == self.eos_id:
      return FinishReason.EOS
    if token in seq.request.sampling.stop_tokens:
      return FinishReason.STOP
    if len(seq.tokens) >= self.max_seq_len:
      return FinishReason.CONTEXT
    if seq.turn_tokens >= seq.turn_budget:
      return FinishReason.LENGTH
    return None

  def _retire(self, seq: Seq, reason: FinishReason) -> Trajectory:
    if seq.request.keep_pages:
      keep = pages_for(seq.cached, self.page_size)  # pages granted past a stop go back
      self.pool.release(seq.pages[keep:])
      seq.pages = seq.pages[:keep]
      self.parked[seq.key] = seq
    else:
      self.pool.release(seq.pages)
      seq.pages = []
    routing = np.zeros((len(seq.tokens), self.moe_layers, self.experts_per_token), np.int32)
    if self.moe_layers and seq.routing:  # rows [M, K]: one concatenate (3x np.stack)
      routing[:len(seq.routing)] = np.concatenate(seq.routing).reshape(len(seq.routing),
                                                                       *routing.shape[1:])
    return Trajectory.from_sequence(
        seq.tokens, seq.prompt_len, seq.loss_mask, seq.logprobs, seq.versions,
        expert_ids=routing if self.moe_layers else None,
        finish_reason=reason, request_id=seq.request.request_id,
        group_id=seq.request.group_id, sample_index=seq.sample_index)
