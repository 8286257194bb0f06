"""DecodeEngine: continuous batching over a paged KV cache, calling the policy's `forward`.

The engine is a scheduler (`rljax.engine.scheduler`: slots, queues, pages, records; plain
Python) driving four device programs (`rljax.engine.programs`: prefill, first-token
sampling, the decode loop, page copies; jitted once per engine shape). This class turns the
scheduler's state into the programs' arrays and their results back into records.

One decode call serves a fixed number of slots (static shapes: requests coming and going
never recompile it) and runs up to `steps_per_call` one-token steps on device, each slot
feeding back its own sampled token and stopping at its stop ids or token budget, so the
host's bookkeeping and dispatch are paid once per call, not per token. Every step is the
plain one-token step, so tokens and log-probs do not depend on the chunking. Prompts
admitted together are prefilled in one call; a group's samples share its prompt's pages
(copy on write); pages are granted as sequences grow and the youngest sequence is
preempted (recomputed later) when they run out.

Multi-turn episodes: a request with `keep_pages=True` parks its sequence when the turn
ends; `extend()` appends observation tokens and queues it again, and only the tokens not
yet in the cache are prefilled (sequence extension).

In-flight weight updates (`update_weights`) happen between steps. Policy "keep" (the
default, as in AReaL/PipelineRL) lets running sequences continue on their existing KV and
stamps each new token with the version that sampled it; "recompute" re-prefills every
running sequence's cached tokens under the new weights first.

On a mesh (`sharding`, e.g. `Built.trainer_engine_sharding()`) the programs run SPMD, and
the mesh may span several jax.distributed processes: then every process builds the same
engine, submits the same requests in the same order and calls `step` / `update_weights`
in lockstep. The scheduler is deterministic Python, so each process makes the same
decisions and hands the programs the same host arrays; every result read back is
replicated, so each process reads it from its own devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from rljax import distributed
from rljax import sharding as sharding_lib
from rljax.engine.pages import OutOfPages, PagePool, pages_for, table_row
from rljax.engine.programs import STEPS_PER_CALL, EnginePrograms, platform
from rljax.engine.scheduler import Prefill, Request, SamplingParams, Scheduler, Seq
from rljax.model import ModelConfig
from rljax.numerics import FAST, Numerics
from rljax.rl.trajectory import Trajectory

__all__ = ["DecodeEngine", "OutOfPages", "Request", "SamplingParams", "WeightUpdatePolicy"]

WeightUpdatePolicy = Literal["keep", "recompute"]


@dataclasses.dataclass(eq=False)
class _Call:
  """A decode call dispatched and not read back yet."""
  outputs: tuple  # (tokens [N, S], log-probs [N, S], routing [N, S, M, K], steps run)
  last: tuple  # (last tokens [S], stopped [S]): where its slots' next call continues
  seqs: list[Seq | None]  # the sequence of each slot's column (None: runs no step)
  budgets: list[int]
  version: int  # of the weights it samples with


class DecodeEngine:
  """Continuous-batching sampler over paged KV. Not thread-safe; drive it from one loop."""

  def __init__(self, cfg: ModelConfig, params: Any, *, numerics: Numerics = FAST,
               num_slots: int = 32, max_seq_len: int = 256, num_pages: int | None = None,
               eos_id: int | None = None, version: int = 0,
               weight_update: WeightUpdatePolicy = "keep",
               sharding: sharding_lib.Sharding | None = None,
               steps_per_call: int = STEPS_PER_CALL,
               max_stop_tokens: int = 4, prefill_buckets: bool = True,
               max_prefill_tokens: int = 0, serving_layout: bool | None = None,
               unroll_layers: bool | None = None, overlap: bool = True):
    """`prefill_buckets`: a prefill call's rows and width are padded to powers of two (at
    most num_slots rows, max_seq_len tokens): least padding, one program per (rows, width)
    bucket, up to (log2 num_slots + 1) x (log2 pages per sequence + 1) compiles. False:
    every prefill call is num_slots rows x max_seq_len tokens, one program, for runs whose
    cost is compiling (CPU, tests, short contexts). The tokens and log-probs are the same
    either way in deterministic numerics (batch invariance, tested).
    `max_prefill_tokens` (0: num_slots x max_seq_len, no limit): the most tokens (rows x
    width, padding included) one prefill call may take; more admitted work is prefilled in
    several calls. What a prefill holds grows with its tokens (Qwen3-235B-A22B's 64 x 4,096
    needs 109 GB of temporaries a chip on a 16-chip v5p host); at least one row of
    max_seq_len.
    `serving_layout` (None: on accelerators, off on CPU, where every layout is the default
    one): the weights are kept in the layout the decode loop's compiler chose, relaid out
    once per version instead of copied at every decode call (`EnginePrograms`); the decode
    loop then compiles here.
    `unroll_layers` (None: `programs.unrolled_decode`'s rule: CPU, fast numerics, few
    slots): the decode loop runs the layers unrolled instead of in the layer scan.
    `overlap`: each decode call is dispatched before the previous one is read back (its
    slots continue from that call's last tokens, on device), so the host's records and
    scheduling run while the device decodes; a call's finished sequences come back one
    step later. The tokens are the same either way (each step is the one-token step with
    its own sampling keys); off: one call at a time."""
    if weight_update not in ("keep", "recompute"):
      raise ValueError(f"weight_update must be 'keep' or 'recompute', got {weight_update!r}")
    if steps_per_call < 1 or max_stop_tokens < 0:
      raise ValueError("need steps_per_call >= 1 and max_stop_tokens >= 0")
    if max_seq_len > cfg.max_position_embeddings:
      raise ValueError("max_seq_len exceeds the model's max_position_embeddings")
    self.cfg, self.numerics, self.sharding = cfg, numerics, sharding
    self.num_slots, self.max_seq_len, self.eos_id = num_slots, max_seq_len, eos_id
    self.version, self.weight_update = version, weight_update
    self.page_size = cfg.page_size
    self.steps_per_call, self.max_stop_tokens = steps_per_call, max_stop_tokens
    self.prefill_buckets = prefill_buckets
    self.max_blocks = pages_for(max_seq_len, self.page_size)
    full_width = self.max_blocks * self.page_size
    self.max_prefill_tokens = max_prefill_tokens or num_slots * full_width
    if self.max_prefill_tokens < full_width:
      raise ValueError(f"max_prefill_tokens={max_prefill_tokens} is less than one row of "
                       f"max_seq_len ({full_width} tokens)")
    # rows of a call whatever its width (every call's, without buckets)
    self.prefill_rows = min(num_slots, self.max_prefill_tokens // full_width)
    num_pages = num_pages or 1 + num_slots * self.max_blocks
    if sharding is not None:
      check_slots(sharding, numerics, num_slots)
    if serving_layout is None:
      serving_layout = platform(sharding) != "cpu"
    self.programs = EnginePrograms(cfg, numerics, num_slots=num_slots,
                                   max_blocks=self.max_blocks, steps_per_call=steps_per_call,
                                   max_stop_tokens=max_stop_tokens, sharding=sharding,
                                   serving_layout=serving_layout,
                                   unroll_layers=unroll_layers)
    num_pages = self.programs.round_pages(num_pages)  # the pool splits evenly
    if serving_layout:
      self.programs.prepare_serving_layout(num_pages)
    self.n_moe = len(cfg.moe_layers())
    self.scheduler = Scheduler(
        num_slots=num_slots, max_seq_len=max_seq_len, page_size=self.page_size,
        num_pages=num_pages, steps_per_call=steps_per_call, vocab_size=cfg.vocab_size,
        eos_id=eos_id, max_stop_tokens=max_stop_tokens, moe_layers=self.n_moe,
        experts_per_token=cfg.num_experts_per_tok)
    self.params = self.programs.place_params(params)
    # the page pools (k, v), donated to every program call; page tables travel per call
    self.pools = self.programs.empty_pools(num_pages)
    self.overlap = overlap
    self._in_flight: _Call | None = None  # the decode call on device (overlap)
    self._finished: list[Trajectory] = []  # read back outside `step`, returned by the next
    # a first call's "previous call": placed like a call's outputs (one program for both)
    none = (np.zeros(num_slots, np.int32), np.zeros(num_slots, bool))
    self._no_previous = none if sharding is not None else sharding_lib.committed(none)

  # ---- the scheduler's and the programs' state, as attributes of the engine --------------

  @property
  def pool(self) -> PagePool:
    return self.scheduler.pool

  @property
  def slots(self) -> list[Seq | None]:
    return self.scheduler.slots

  @property
  def waiting(self):
    return self.scheduler.waiting

  @property
  def ready(self):
    return self.scheduler.ready

  @property
  def parked(self) -> dict[tuple[int, int], Seq]:
    return self.scheduler.parked

  @property
  def stats(self):
    return self.scheduler.stats

  @property
  def max_waste_pages(self) -> float:
    return self.scheduler.max_waste_pages

  @property
  def spans_processes(self) -> bool:
    """Whether the engine's mesh holds devices of several processes: each of them drives
    it in lockstep and must feed it the same requests and tokens."""
    return self.sharding is not None and distributed.spans_processes(self.sharding.mesh)

  @property
  def trace_counts(self):
    """Traces per program ("decode", "sample", "prefill_{rows}x{width}", "copy")."""
    return self.programs.trace_counts

  # ---- public API ----------------------------------------------------------------------

  def submit(self, request: Request) -> None:
    self.scheduler.submit(request)

  def extend(self, request_id: int, sample_index: int, observation_ids, max_new_tokens: int):
    """Continues a parked multi-turn sequence: observations in, then a new turn."""
    self.scheduler.extend(request_id, sample_index, observation_ids, max_new_tokens)

  def release(self, request_id: int, sample_index: int) -> None:
    """Frees a parked sequence's pages (the episode is over)."""
    self.scheduler.release(request_id, sample_index)

  def update_weights(self, params: Any, version: int) -> None:
    """New weights between decode steps; running sequences are never dropped. `params`:
    host arrays, or global arrays on any sharding of the engine's devices (the trainer's:
    resharded on device, see `EnginePrograms.place_params`)."""
    if self.weight_update == "recompute":
      self._drain()  # the cached tokens include that call's
    self.params, self.version = self.programs.place_params(params), version
    if self.weight_update == "recompute":
      running = self.scheduler.cached_ranges()
      for i in range(0, len(running), self.num_slots):  # overwrite the cached K/V in place
        self._prefill(running[i:i + self.num_slots])
      self.stats["recompute_tokens"] += sum(hi for _, _, hi in running)

  @property
  def idle(self) -> bool:
    return self.scheduler.idle and self._in_flight is None and not self._finished

  def step(self) -> list[Trajectory]:
    """Admit what fits, then one decode call for every active slot; returns finished.
    With `overlap`, the call is dispatched before the previous one is read back, so the
    records of a call (and the sequences it finished) come in one step later. What was
    read back before an exception (OutOfPages) is returned by the next step."""
    if self._in_flight is not None:
      # with work waiting for a slot, read the call back first: a slot it frees takes
      # that work in the next call, not one call later
      backlog = self.scheduler.waiting or self.scheduler.ready
      ahead = None if backlog else self._launch(self._in_flight)
      self._finished += self._collect(self._in_flight, ahead)
      self._in_flight = ahead
    self._finished += self._admit()
    if self._in_flight is None and self.scheduler.active():
      call = self._launch(None)
      if self.overlap:
        self._in_flight = call
      elif call is not None:
        self._finished += self._collect(call, None)
    elif self._in_flight is None and self.waiting and not self.ready and not self._finished:
      self.scheduler.relieve_stall()
    finished, self._finished = self._finished, []
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

  # ---- admission: prefill and first tokens ---------------------------------------------

  def _admit(self) -> list[Trajectory]:
    """Admits waiting work while slots and pages allow, all of it in one prefill call."""
    finished = []
    works = self.scheduler.take_admissible()
    if works:
      logits = self._prefill([(seq, seq.cached, len(seq.tokens)) for _, seq in works])
      forks, rows = self.scheduler.fork_groups(works)
      for seq, (tok, lp) in zip(forks, self._sample_first(forks, rows, logits)):
        done = self.scheduler.record_first(seq, tok, lp, self.version)
        if done is not None:
          finished.append(done)
    self.scheduler.fill_slots()
    return finished

  def _prefill(self, items: list[Prefill]):
    """Feeds each seq's tokens[lo:hi] at positions lo..hi-1 into its pages, in as few calls
    as `max_prefill_tokens` allows (rows and width padded: `prefill_buckets`); returns
    logits [num_slots, V] whose row i follows the last fed token of items[i]. At most
    num_slots items, none empty."""
    if not 0 < len(items) <= self.num_slots or any(hi <= lo for _, lo, hi in items):
      raise AssertionError("prefill takes 1..num_slots non-empty token ranges")
    calls, longest = [[]], 0  # longest: of the last call's ranges
    for item in items:
      length = item[2] - item[1]
      rows, width = self._prefill_shape(len(calls[-1]) + 1, max(longest, length))
      if calls[-1] and (len(calls[-1]) == rows or rows * width > self.max_prefill_tokens):
        calls.append([])
        longest = 0
      calls[-1].append(item)
      longest = max(longest, length)
    if len(calls) == 1:
      return self._prefill_call(items)
    # each call's rows in order, on device (where the sampler's program takes them)
    logits = jnp.concatenate([self._prefill_call(c)[:len(c)] for c in calls])
    return jnp.pad(logits, ((0, self.num_slots - len(items)), (0, 0)))

  def _prefill_shape(self, count: int, longest: int) -> tuple[int, int]:
    """(rows, width) of one prefill call of `count` token ranges, the longest `longest`."""
    if not self.prefill_buckets:
      return self.prefill_rows, self.max_blocks * self.page_size
    pages = pages_for(longest, self.page_size)
    width = self.page_size * (1 << max(0, (pages - 1).bit_length()))
    return min(1 << (count - 1).bit_length(), self.num_slots), width

  def _prefill_call(self, items: list[Prefill]):
    """One prefill program call of `items` (fitting its shape); logits [num_slots, V]."""
    self._copy_pages(self.scheduler.prefill_pages(items))
    rows, width = self._prefill_shape(len(items), max(hi - lo for _, lo, hi in items))
    tokens = np.zeros((rows, width), np.int32)
    positions = np.full((rows, width), -1, np.int32)
    table = np.zeros((rows, self.max_blocks), np.int32)
    last = np.zeros(rows, np.int32)
    for i, (seq, lo, hi) in enumerate(items):
      tokens[i, :hi - lo] = seq.tokens[lo:hi]
      positions[i, :hi - lo] = np.arange(lo, hi)
      table[i] = table_row(seq.pages, self.max_blocks)
      last[i] = hi - lo - 1
    logits, routing, self.pools = self.programs.prefill(self.params, self.pools, tokens,
                                                        positions, table, last)
    self.stats["prefill_calls"] += 1
    self.scheduler.record_prefill(items, np.asarray(routing))
    return logits

  def _sample_first(self, seqs: list[Seq], rows: list[int], logits) -> list[tuple[int, float]]:
    """First token of each seq from its prefill row of `logits`, num_slots at a time."""
    out = []
    for chunk in range(0, len(seqs), self.num_slots):
      group = seqs[chunk:chunk + self.num_slots]
      idx = np.zeros(self.num_slots, np.int32)
      idx[:len(group)] = rows[chunk:chunk + self.num_slots]
      toks, lps = self.programs.sample(logits, idx, *_sampling_arrays(group, self.num_slots))
      toks, lps = np.asarray(toks), np.asarray(lps)
      out += [(int(toks[i]), float(lps[i])) for i in range(len(group))]
    return out

  # ---- decode ---------------------------------------------------------------------------

  def _launch(self, previous: _Call | None) -> _Call | None:
    """Dispatches one decode call of up to `steps_per_call` steps for every active slot;
    with `previous` (a call not read back yet), the slots it ran continue from its end,
    on device. None when no slot can run (with `previous`: none without a preemption)."""
    s = self.num_slots
    ahead = None if previous is None else [
        b if seq is not None and seq is self.slots[i] else 0
        for i, (seq, b) in enumerate(zip(previous.seqs, previous.budgets))]
    budgets, copies = self.scheduler.grant_decode(ahead)  # may preempt (without `ahead`)
    self._copy_pages(copies)
    if budgets is None:
      self.stats["decode_calls_not_ahead_for_pages"] += 1
      return None
    if not any(budgets):
      return None
    seqs, ahead = list(self.slots), ahead or [0] * s
    live = [i for i in range(s) if budgets[i]]
    tokens = np.zeros(s, np.int32)
    positions = np.full(s, -1, np.int32)
    table = np.zeros((s, self.max_blocks), np.int32)
    stop_ids = np.full((s, self.max_stop_tokens + 1), -1, np.int32)
    tokens[live] = [seqs[i].tokens[-1] for i in live]  # a following slot's: on device
    positions[live] = [len(seqs[i].tokens) - 1 + ahead[i] for i in live]
    for i in live:
      table[i] = table_row(seqs[i].pages, self.max_blocks)
      stops = self.scheduler.stop_ids(seqs[i])
      stop_ids[i, :len(stops)] = stops
    follow = np.asarray(ahead, np.int32) > 0
    last = self._no_previous if previous is None else previous.last
    toks, lps, routing, ran, last, self.pools = self.programs.decode(
        self.params, self.pools, tokens, positions, np.asarray(budgets, np.int32), table,
        *_sampling_arrays(seqs, s, ahead), stop_ids, follow, last)
    self.stats["decode_calls_ahead"] += previous is not None
    return _Call((toks, lps, routing, ran), last,
                 [seq if b else None for seq, b in zip(seqs, budgets)], budgets, self.version)

  def _collect(self, call: _Call, following: _Call | None) -> list[Trajectory]:
    """Reads `call` back into the records; `following`: the call dispatched after it."""
    toks, lps, routing, ran = call.outputs
    # each slot's column, read back and converted once for all slots
    toks, lps = np.asarray(toks).T.tolist(), np.asarray(lps).T.tolist()
    routing = np.asarray(routing).swapaxes(0, 1)
    self.stats["decode_calls"] += 1
    self.stats["decode_steps"] += int(ran)
    finished = []
    for i, seq in enumerate(call.seqs):
      if seq is None:
        continue
      if self.slots[i] is not seq:
        raise AssertionError(f"slot {i} changed hands while its decode call was on device")
      follows = following is not None and following.seqs[i] is seq
      done = self.scheduler.record_decode(i, toks[i], lps[i], routing[i], call.budgets[i],
                                          call.version, following.budgets[i] if follows else 0)
      if done is not None:
        finished.append(done)
        if follows:  # it stopped: it runs no step in the following call
          following.seqs[i] = None
    self.scheduler.fill_slots()
    return finished

  def _drain(self) -> None:
    """Reads back the call on device, if any (its finished sequences: the next step's)."""
    if self._in_flight is not None:
      self._finished += self._collect(self._in_flight, None)
      self._in_flight = None

  def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
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
      self.pools = self.programs.copy(self.pools, src, dst)


def check_slots(sharding: sharding_lib.Sharding, numerics: Numerics, num_slots: int) -> None:
  """In deterministic numerics every device must decode at least `numerics.row_tile` (8)
  of the slots, the same number each: the row padding that makes a bf16 dot's sums
  independent of its row count applies to the global rows, and XLA:CPU's bf16 dot sums in
  another order below 8 rows on some CPUs (measured: 2-7 rows on a Xeon with AVX512-BF16 /
  AMX, 1 row on an AMD EPYC; 2 slots per device on 8 devices gave log-probs 5e-7 off)."""
  shards = sharding.shards("batch")
  least = numerics.row_tile
  if numerics.deterministic and (num_slots % shards or num_slots // shards < least):
    raise ValueError(f"deterministic numerics on a mesh that splits the slots {shards} ways "
                     f"needs num_slots a multiple of {shards} with at least {least} per "
                     f"device (so >= {least * shards}), got {num_slots}")


def _sampling_arrays(seqs: list[Seq | None], width: int, ahead: list[int] | None = None):
  """The sampling inputs of `width` slots: key ids (seed, request id (or the request's
  `sampling_id`), sample index, the next token's position), temperature, top_k, top_p;
  empty slots get inert defaults. `ahead[i]`: slot i's tokens sampled but not recorded yet."""
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
    key_rid = s.request.request_id if s.request.sampling_id is None else s.request.sampling_id
    pos[i] = len(s.tokens) + (ahead[i] if ahead else 0)
    seed[i], rid[i], sidx[i] = s.request.seed, key_rid, s.sample_index
    temp[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
  return (seed, rid, sidx, pos), temp, top_k, top_p
