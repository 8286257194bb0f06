"""The engine's device programs: pure functions of (params, KV pools, per-slot arrays).

The scheduler (`rljax.engine.scheduler`) decides what runs; these functions are what runs.
Each takes the params, the page pools `(k, v)` (each [layers, num_pages, page_size,
kv_heads, head_dim], raw bits of the compute dtype, see `attention.write_pages`) and plain
arrays, plus static settings passed as keywords. `EnginePrograms` binds the settings, jits
the functions (pools donated), counts traces and gives the abstract arguments of the
decode loop, so `experiments/aot_check.py` lowers exactly the program the engine runs.

Shapes: S = num_slots (decode rows), B = prefill rows (a power of two <= S), W = prefill
width (a multiple of page_size), N = steps_per_call, M = MoE layers, K = experts per token,
P = max_blocks (page-table width), X = max_stop_tokens + 1, V = vocabulary.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rljax import distributed
from rljax import sharding as sharding_lib
from rljax.engine import sampling
from rljax.model import ModelConfig, PagedKV, abstract_params, forward, param_shardings
from rljax.model.attention import raw_dtype
from rljax.numerics import Numerics

KV_AXES = ("layers", "pages", "page_slot", "kv_heads", "head_dim")

# Decode steps per device call, the engine's default: the host's scheduling and records
# are paid once per call, and a slot whose sequence ends inside a call idles to its end.
# experiments/bench_steps_per_call.py (tiny_moe, AMD EPYC 2 cores; tokens/s against 8):
# varied lengths (8-128 new tokens, 4x the slots in requests) 16: 1.04x at 32 slots,
# 1.05x at 256 (4: 0.90-0.93x, 32: 1.00-1.03x); fixed 64 tokens 16: 1.07x / 1.03x.
STEPS_PER_CALL = 16

# XLA:CPU options of the engine's decode and prefill programs (only theirs: the trainer's
# keep the process's). By default XLA:CPU fuses a dot's elementwise neighbours and small
# reductions (an RMSNorm's sum of squares, the rope's concatenate) into YNNPACK fusions,
# which on these one-token steps cost more than the ops alone (a [256, 4, 16] q-norm sum
# took 75 us, the unfused whole step less); "individual dot" keeps every dot a single
# library call and leaves the rest to XLA's own emitters, as deterministic numerics does
# process-wide. experiments/bench_vs_tunix.py's workload, with and without the options
# (AMD EPYC, 2 cores, interleaved processes): 256 slots 1.05x (tiny_moe) / 1.09x
# (arith_tiny), 32 slots 0.97x / 1.04x.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type":
                        "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

# The decode loop's layers on CPU in fast numerics: unrolled (`ModelConfig.scan_layers`
# False: each layer's weights a static slice of the stacks) up to this many slots, else
# the layer scan (which slices every layer's weights out of the stacks at every step).
# experiments/bench_unrolled_decode.py (AMD EPYC, 2 cores; unrolled over scan, 64 new
# tokens a slot, two runs): 8 slots 1.14x (tiny_moe) / 1.18-1.22x (arith_tiny), 16:
# 1.09-1.10x / 1.19-1.44x, 32: 0.99-1.03x / 1.08-1.12x, 64-256: 0.95-1.03x.
# Models of at most UNROLL_MAX_LAYERS layers: the unrolled loop compiles per layer.
UNROLL_UP_TO_SLOTS = 32
UNROLL_MAX_LAYERS = 8


def unrolled_decode(backend: str, numerics: Numerics, num_slots: int, num_layers: int) -> bool:
  """Whether the decode loop on `backend` ("cpu", "tpu", "gpu") unrolls the model's layers
  (see UNROLL_UP_TO_SLOTS)."""
  return (backend == "cpu" and not numerics.deterministic and num_slots <= UNROLL_UP_TO_SLOTS
          and num_layers <= UNROLL_MAX_LAYERS)


Pools = tuple[jax.Array, jax.Array]


def platform(sharding: sharding_lib.Sharding | None) -> str | None:
  """The platform the engine's programs run on ("cpu", "tpu", "gpu"); None on an
  `AbstractMesh` (`rljax.aot` lowers its programs for any platform)."""
  if sharding is None:
    return jax.devices()[0].platform
  if isinstance(sharding.mesh, AbstractMesh):
    return None
  return sharding.mesh.devices.flat[0].platform


def decode_loop(params, pools: Pools, tokens, positions, budgets, table, key_ids, temperature,
                top_k, top_p, stop_ids, follow, previous, *, cfg: ModelConfig,
                numerics: Numerics, steps_per_call: int,
                sharding: sharding_lib.Sharding | None = None):
  """Up to `steps_per_call` one-token decode steps in a `while_loop`.

  tokens [S] (each slot's last token), positions [S] (its position; -1 = empty slot),
  budgets [S] (steps slot i may run), table [S, P], key_ids = (seed, request_id,
  sample_index, first_pos) each [S] (first_pos: the position of the first token sampled),
  temperature / top_p [S] f32, top_k [S], stop_ids [S, X] (-1 = unused).
  Slot i runs budgets[i] steps or stops after sampling one of its stop ids; sampled tokens
  are fed back on device. Each step is exactly the one-token step (same forward, same
  sampling keys), so tokens and log-probs do not depend on the chunking.
  follow [S] bool, previous = (last tokens [S], stopped [S] bool) of the previous call, on
  device: a following slot continues from that call (dispatched before the host read it
  back): its token is the previous call's last one, and it runs no step if it stopped there.
  Returns (tokens [N, S], log-probs [N, S] f32, routing [N, S, M, K] int32, steps run [],
  (last tokens [S], stopped [S] bool), pools); rows past a slot's last step hold junk.
  """
  seed, request_id, sample_index, first_pos = key_ids
  tokens = jnp.where(follow, previous[0], tokens)
  budgets = jnp.where(follow & previous[1], 0, budgets)
  s, chunk = tokens.shape[0], steps_per_call
  n_moe, k = len(cfg.moe_layers()), max(cfg.num_experts_per_tok, 1)
  outputs = (jnp.zeros((chunk, s), jnp.int32), jnp.zeros((chunk, s), jnp.float32),
             jnp.zeros((chunk, s, n_moe, k), jnp.int32))

  def live(j, done):
    return (j < budgets) & ~done

  def cond(carry):
    j, _, _, done, _ = carry
    return (j < chunk) & jnp.any(live(j, done))

  def body(carry):
    j, pools, tok, done, (toks, lps, routes) = carry
    on = live(j, done)
    out = forward(params, tok[:, None], jnp.where(on, positions + j, -1)[:, None],
                  cfg=cfg, numerics=numerics, kv=PagedKV(*pools, table), sharding=sharding)
    keys = sampling.token_keys(seed, request_id, sample_index, first_pos + j)
    new, lp = sampling.sample(out.logits[:, 0], keys, temperature, top_k, top_p, numerics)
    new = jnp.where(on, new, tok)
    done = done | (on & jnp.any(new[:, None] == stop_ids, axis=-1))
    routing = (out.routing[:, 0] if out.routing is not None
               else jnp.zeros((s, 0, k), jnp.int32))
    toks, lps, routes = (toks.at[j].set(new), lps.at[j].set(lp),
                         routes.at[j].set(routing.astype(jnp.int32)))
    return j + 1, (out.kv.k, out.kv.v), new, done, (toks, lps, routes)

  init = (jnp.zeros((), jnp.int32), pools, tokens, jnp.zeros(s, bool), outputs)
  steps, pools, last, done, (toks, lps, routes) = jax.lax.while_loop(cond, body, init)
  return toks, lps, routes, steps, (last, done), pools


def prefill(params, pools: Pools, tokens, positions, table, last, *, cfg: ModelConfig,
            numerics: Numerics, num_slots: int, sharding: sharding_lib.Sharding | None = None):
  """Rows of new tokens (one sequence each) into their pages.

  tokens / positions [B, W] (position -1 = padding), table [B, P], last [B] (the column of
  each row's last token). Returns (logits [S, V] f32 at `last`, padded with zero rows to
  num_slots, the first-token sampler's fixed width; routing [B, W, M, K]; pools).
  """
  out = forward(params, tokens, positions, cfg=cfg, numerics=numerics,
                kv=PagedKV(*pools, table), logits_at=last, sharding=sharding)
  logits = out.logits[:, 0]
  logits = jnp.pad(logits, ((0, num_slots - tokens.shape[0]), (0, 0)))
  routing = out.routing if out.routing is not None else jnp.zeros(tokens.shape + (0, 0))
  return logits, routing, (out.kv.k, out.kv.v)


def sample_first(logits, rows, key_ids, temperature, top_k, top_p, *, numerics: Numerics):
  """First tokens: slot i samples from logits[rows[i]] ([S, V] -> tokens [S], log-probs [S]);
  key_ids and the sampling arrays as in `decode_loop`, key position = the token's."""
  return sampling.sample(logits[rows], sampling.token_keys(*key_ids), temperature, top_k,
                         top_p, numerics)


def copy_pages(pools: Pools, src, dst) -> Pools:
  """pool[:, dst] = pool[:, src] for every layer and both pools (src, dst [S]; (0, 0) pairs
  are no-ops)."""
  return tuple(p.at[:, dst].set(p[:, src]) for p in pools)


@dataclasses.dataclass(frozen=True, eq=False)
class EnginePrograms:
  """The four programs jitted for one engine shape, with trace counts.

  With a `sharding`, every program has explicit in/out shardings: params by the rules
  table, pools by `KV_AXES` (donated, so outputs alias inputs), all else replicated. On a
  mesh that spans processes, jit takes a host array under the replicated sharding as the
  global value (every process must pass the same), and a replicated result reads back
  with `np.asarray` on every process (jax 0.10.2; a sharded one would not).

  `serving_layout`: the params live in the memory layout the decode loop's compiler
  chooses for them (`Layout.AUTO`), put there once per weight version (`place_params`).
  Otherwise they arrive in the default layout and the decode program copies them into its
  own at every call: on TPU that copy is most of the decode temp (Qwen3-30B-A3B, 64 slots
  on 8 v5p chips: 6.95 GiB a chip, 2.01 with the serving layout). The decode loop is then
  compiled ahead of time (`prepare_serving_layout`, once per pool size; until then `decode`
  is the layout-choosing jit, for `rljax.aot` to lower) and the prefill takes the params in
  the decode's layout. Only the params' placement in memory changes: the arithmetic
  instructions keep their operand layouts (tested on the TPU compiler), so the bits are
  the same. On CPU every layout is the default one, so there it changes nothing.
  """

  cfg: ModelConfig
  numerics: Numerics
  num_slots: int
  max_blocks: int
  steps_per_call: int = STEPS_PER_CALL
  max_stop_tokens: int = 4
  sharding: sharding_lib.Sharding | None = None
  serving_layout: bool = False
  # the decode loop's layers unrolled instead of scanned (None: `unrolled_decode`'s rule)
  unroll_layers: bool | None = None
  trace_counts: collections.Counter = dataclasses.field(
      default_factory=collections.Counter, init=False)
  decode: Any = dataclasses.field(init=False, repr=False)
  prefill: Any = dataclasses.field(init=False, repr=False)
  sample: Any = dataclasses.field(init=False, repr=False)
  copy: Any = dataclasses.field(init=False, repr=False)
  _reshard: Any = dataclasses.field(init=False, repr=False, default=None)  # across processes
  # the params' Formats (serving layout) once the decode loop chose them
  param_formats: Any = dataclasses.field(init=False, repr=False, default=None)

  def __post_init__(self):
    if self.steps_per_call < 1 or self.max_stop_tokens < 0:
      raise ValueError("need steps_per_call >= 1 and max_stop_tokens >= 0")
    if self.unroll_layers is None:
      object.__setattr__(self, "unroll_layers", unrolled_decode(
          platform(self.sharding), self.numerics, self.num_slots, self.cfg.num_hidden_layers))
    params = self._param_placement()
    if self.serving_layout:
      params = jax.tree.map(lambda s: Format(Layout.AUTO, s), params)
    for name in ("decode", "prefill", "sample", "copy"):
      self._jit(name, params)
    self._jit_reshard(params)

  def _param_placement(self) -> Any:
    """The params' shardings: by the rules table on a mesh; the default device (serving
    layout: a Format needs a sharding), or wherever they are (None), off one."""
    if self.sharding is not None:
      return param_shardings(self.cfg, self.sharding)
    if self.serving_layout:
      device = SingleDeviceSharding(jax.devices()[0])
      return jax.tree.map(lambda _: device, abstract_params(self.cfg))
    return None

  def _jit(self, name: str, params: Any) -> None:
    """Binds program `name` (jitted, params in_shardings `params`) to the attribute."""
    cfg, numerics, sh = self.cfg, self.numerics, self.sharding
    kv, rep = (self.kv_sharding, self.kv_sharding), self._replicated
    fn, donate, ins, outs = {
        "decode": (functools.partial(decode_loop, numerics=numerics,
                                     cfg=dataclasses.replace(cfg, scan_layers=False)
                                     if self.unroll_layers else cfg,
                                     steps_per_call=self.steps_per_call, sharding=sh),
                   (1,), (params, kv) + (rep,) * 10 + ((rep, rep),),
                   (rep,) * 4 + ((rep, rep), kv)),
        "prefill": (functools.partial(prefill, cfg=cfg, numerics=numerics,
                                      num_slots=self.num_slots, sharding=sh),
                    (1,), (params, kv) + (rep,) * 4, (rep, rep, kv)),
        "sample": (functools.partial(sample_first, numerics=numerics), (),
                   (rep,) * 6, (rep, rep)),
        "copy": (copy_pages, (0,), (kv, rep, rep), kv),
    }[name]
    if sh is not None:
      shardings = {"in_shardings": ins, "out_shardings": outs}
    elif params is not None and name in ("decode", "prefill"):  # the serving layout
      shardings = {"in_shardings": (params,) + (None,) * (len(ins) - 1)}
    else:
      shardings = {}
    if name in ("decode", "prefill") and platform(self.sharding) == "cpu":
      shardings["compiler_options"] = CPU_COMPILER_OPTIONS
    jitted = jax.jit(self._counted(name, fn), donate_argnums=donate, **shardings)
    self._bind(name, jitted)

  def _bind(self, name: str, program: Any) -> None:
    object.__setattr__(self, name, distributed.started_together(
        program, f"engine {name}", self.sharding and self.sharding.mesh, every_call=False))

  def _jit_reshard(self, params: Any) -> None:
    """A mesh across processes: the whole tree moves to `params` in one program (see
    `place_params`)."""
    sh = self.sharding
    if sh is not None and distributed.spans_processes(sh.mesh):
      reshard = jax.jit(lambda p: p, out_shardings=params)
      object.__setattr__(self, "_reshard", distributed.started_together(
          reshard, "engine weights", sh.mesh, every_call=False))

  def prepare_serving_layout(self, num_pages: int) -> None:
    """Compiles the decode loop for `num_pages` pages, taking the params' layout it chose
    (`adopt_serving_layout`). Before `place_params`, once per engine."""
    if not self.serving_layout:
      raise ValueError("prepare_serving_layout needs EnginePrograms(serving_layout=True)")
    self._check_unchosen()
    self.adopt_serving_layout(self.decode.trace(*self.decode_args(num_pages)).lower().compile())

  def adopt_serving_layout(self, compiled_decode: Any) -> None:
    """The decode loop compiled with `Layout.AUTO` params becomes `decode`; its params'
    Formats become the prefill's and `place_params`'s."""
    self._check_unchosen()
    formats = compiled_decode.input_formats[0][0]
    object.__setattr__(self, "param_formats", formats)
    self._bind("decode", compiled_decode)
    self._jit("prefill", formats)
    self._jit_reshard(formats)

  def _check_unchosen(self) -> None:
    if self.param_formats is not None:
      raise ValueError("the serving layout is chosen once per engine")

  def _counted(self, name: str, fn):
    def traced(*args):
      key = f"prefill_{args[2].shape[0]}x{args[2].shape[1]}" if name == "prefill" else name
      self.trace_counts[key] += 1
      return fn(*args)
    traced.__name__ = traced.__qualname__ = name  # jit(decode) etc. in HLO and profiles
    return traced

  @property
  def kv_sharding(self) -> NamedSharding | None:
    return None if self.sharding is None else self.sharding.named(KV_AXES)

  @property
  def _replicated(self) -> NamedSharding | None:
    return None if self.sharding is None else NamedSharding(self.sharding.mesh, PartitionSpec())

  def round_pages(self, num_pages: int) -> int:
    """`num_pages` rounded up to a multiple of the devices the pool is split over."""
    shards = 1 if self.sharding is None else self.sharding.shards("pages")
    return -(-num_pages // shards) * shards

  def pool_shape(self, num_pages: int) -> tuple[int, ...]:
    c = self.cfg
    return (c.num_hidden_layers, num_pages, c.page_size, c.num_key_value_heads, c.head_dim)

  def empty_pools(self, num_pages: int) -> Pools:
    """Zeroed (k, v) pools, placed by `kv_sharding` when there is one."""
    shape, dtype = self.pool_shape(num_pages), raw_dtype(self.cfg.compute_dtype)
    return sharding_lib.committed(
        tuple(jnp.zeros(shape, dtype, device=self.kv_sharding) for _ in range(2)))

  def place_params(self, params: Any) -> Any:
    """Params on the programs' shardings (without one: committed where they are). Global arrays
    on another sharding of the same devices (the trainer's mesh and rules) move by
    device_put's jitted reshard, on device: from the training rules that is an all-gather
    over fsdp, and no device holds more than its block. On a mesh across processes the
    whole tree moves in one program, started together (device_put dispatches one program
    per leaf, each with its own collectives: a job once hung for 600 s inside them, both
    processes in the same device_put)."""
    if self.serving_layout and self.param_formats is None:
      raise ValueError("the serving layout is not chosen yet: prepare_serving_layout first")
    if self._reshard is not None:  # a mesh across processes
      return self._reshard(params)
    if self.param_formats is not None:  # relaid out on device, once per version
      return jax.device_put(params, self.param_formats)
    if self.sharding is None:
      return sharding_lib.committed(params)  # the programs compile once, not per placement
    return jax.device_put(params, param_shardings(self.cfg, self.sharding))

  def _abstract(self, num_pages: int) -> tuple:
    """(params, (pool, pool), sds) as ShapeDtypeStructs with the programs' shardings, and
    `sds(shape, dtype)`: a replicated one."""
    sh = self.sharding
    params = abstract_params(self.cfg)
    if sh is not None:
      params = jax.tree.map(
          lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params,
          param_shardings(self.cfg, sh))
    pool = jax.ShapeDtypeStruct(self.pool_shape(num_pages), raw_dtype(self.cfg.compute_dtype),
                                sharding=self.kv_sharding)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.dtype(dtype), sharding=self._replicated)
    return params, (pool, pool), sds

  def decode_args(self, num_pages: int) -> tuple:
    """`decode`'s arguments as ShapeDtypeStructs (with their shardings when the programs
    have one; the mesh may be abstract): lower it with `decode.trace(*args).lower(...)`."""
    params, pools, sds = self._abstract(num_pages)
    i32 = jnp.int32
    slots = lambda dtype, *extra: sds((self.num_slots, *extra), dtype)  # noqa: E731
    return (params, pools, slots(i32), slots(i32), slots(i32),
            slots(i32, self.max_blocks), tuple(slots(i32) for _ in range(4)),
            slots(jnp.float32), slots(i32), slots(jnp.float32),
            slots(i32, self.max_stop_tokens + 1), slots(bool), (slots(i32), slots(bool)))

  def prefill_args(self, num_pages: int, rows: int, width: int) -> tuple:
    """`prefill`'s arguments for a call of `rows` x `width` tokens, like `decode_args`."""
    if not (0 < rows <= self.num_slots and 0 < width <= self.max_blocks * self.cfg.page_size):
      raise ValueError(f"a prefill of {rows} x {width} tokens: the engine takes 1..{self.num_slots}"
                       f" rows of 1..{self.max_blocks * self.cfg.page_size} tokens")
    params, pools, sds = self._abstract(num_pages)
    i32 = jnp.int32
    return (params, pools, sds((rows, width), i32), sds((rows, width), i32),
            sds((rows, self.max_blocks), i32), sds((rows,), i32))
