"""Ahead-of-time check of a real-size config (`experiments/aot_check.py`): the GRPO train step and the engine's decode
step lowered (and, given the devices, compiled) on abstract inputs, with per-device bytes.

  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      [--num_slots=64 --max_seq_len=4096 --microbatch_tokens=0 --platform=tpu]
  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      --host_devices=64  # compile

(`--config.init_from=` plans config.model's shapes; `--config.init_from=hf:DIR` those of
DIR's config.json.)

Nothing of the model's size is allocated: params, optimizer state, batch and KV pages are
`jax.ShapeDtypeStruct`s carrying `NamedSharding`s (params from `jax.eval_shape`), and the
functions lowered are the real ones: `learner.make_grpo_step(...).jitted` with its state
shardings (as `pipeline.grpo_update.grpo_learner` wires it, from `build(config)`) and the
engine's decode loop (`EnginePrograms(...).decode`, the jitted `steps_per_call`-step
program `DecodeEngine` runs, on the arguments `EnginePrograms.decode_args` describes, with
explicit shardings).

What works in jax 0.10.2 (measured): the mesh is a `jax.sharding.AbstractMesh` of the
config's shape, so any mesh size lowers on a 1-CPU machine, for any platform
(`jit(f).trace(*args).lower(lowering_platforms=("tpu",))`; cpu, tpu and cuda all lower;
a plain `.lower(...)` refuses a computation whose only mesh is abstract). Compiling needs a
device per mesh position: with `--host_devices=N` (>= the mesh size; sets
`jax_num_cpu_devices` before the CPU backend starts) the cpu lowering is compiled with
`device_assignment=` the first simulated devices and `memory_analysis()` is reported.
Those are XLA:CPU's buffers: arguments, outputs and aliases (the donated train state and
KV pools) are exact per device; temp is not a GPU/TPU number. XLA:CPU expands each
`ragged_dot` (fast-mode experts) into dense [local experts, tokens * k, hidden] f32 arrays
(32 GiB a layer for Qwen3-30B-A3B at one 4096-token row per device: a train-step temp of
~2.7 TB) and upcasts bf16 weights to f32; a temp for the target needs a compile there.
Qwen3-30B-A3B on this 2-core machine: lowering both steps ~15 s, compiling on 64
simulated devices ~2.5 min. The decode lowering takes the jnp attention path (the Pallas
kernel is chosen only when the running backend is a GPU).

Per-device bytes come from each array's `NamedSharding.shard_shape` (padded shards count
in full). KV pages: [layers, num_pages, page_size, kv_heads, head_dim] x 2 (k, v), stored
as raw bits of the compute dtype, num_pages = 1 + num_slots * ceil(max_seq_len / page_size)
(the engine's default), sharded by the rules table (`kv_heads` -> `model`; `pages` is
replicated). Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

from absl import logging
import jax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import optax

from rljax import sharding as sharding_lib
from rljax.engine.pages import pages_for
from rljax.engine.programs import EnginePrograms
from rljax.model import ModelConfig, abstract_params, active_params, count_params
from rljax.model import lora as lora_lib
from rljax.pipeline.run import MODEL_ONLY, build
from rljax.rl import learner
from rljax.rl.batch import TrainBatch


GIB = 2.0 ** 30


def parse_mesh(text: str) -> dict[str, int]:
  """'data=1,expert=8' -> {"data": 1, "expert": 8}."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, size = part.partition("=")
    out[name.strip()] = int(size)
  return out


def abstract_mesh(shape: dict[str, int]) -> AbstractMesh:
  unknown = set(shape) - set(sharding_lib.MESH_AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}")
  sizes = tuple(int(shape.get(a, 1)) for a in sharding_lib.MESH_AXES)
  return AbstractMesh(sizes, sharding_lib.MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(sizes))


def with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      tree, shardings)


def shard_bytes(x: jax.ShapeDtypeStruct) -> int:
  return math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize


def global_bytes(x: jax.ShapeDtypeStruct) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def tree_bytes(tree: Any, fn=shard_bytes) -> int:
  return int(sum(fn(x) for x in jax.tree.leaves(tree)))


def path_name(path) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path)


def split_opt_state(opt_state: Any) -> dict[str, list]:
  """Optimizer leaves by role: Adam's `mu`, `nu`, and the rest (its step counts)."""
  out = {"mu": [], "nu": [], "other": []}
  for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    names = {getattr(p, "name", None) for p in path}
    out["mu" if "mu" in names else "nu" if "nu" in names else "other"].append(leaf)
  return out


def running_platform() -> str:
  """The running backend as a lowering platform name (gpu -> cuda or rocm)."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  return xla_bridge.canonicalize_platform(jax.default_backend())


def memory_stats(compiled) -> dict[str, int] | None:
  m = compiled.memory_analysis()
  if m is None:
    return None
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
          "temp_size_in_bytes", "generated_code_size_in_bytes")
  return {k.removesuffix("_size_in_bytes"): int(getattr(m, k)) for k in keys}


def lower_and_compile(jitted, args: tuple, *, platform: str, mesh_size: int,
                      compile_: bool) -> tuple[dict, Any]:
  """Lowers `jitted` on abstract args; compiles on the first mesh_size devices if it can."""
  out: dict[str, Any] = {"lowered": False, "compiled": False}
  t0 = time.perf_counter()
  try:
    lowered = jitted.trace(*args).lower(lowering_platforms=(platform,))
  except Exception as e:  # pylint: disable=broad-except
    logging.error("lowering failed:\n%s", traceback.format_exc())
    return out | {"error": f"{type(e).__name__}: {str(e)[:500]}"}, None
  out.update(lowered=True, lower_s=round(time.perf_counter() - t0, 2))
  if not compile_:
    return out | {"compile_skipped": "--nocompile"}, lowered
  if platform != running_platform():
    return out | {"compile_skipped": f"lowered for {platform} on a "
                  f"{running_platform()} backend"}, lowered
  if jax.device_count() < mesh_size:
    return out | {"compile_skipped": f"needs {mesh_size} devices, have "
                  f"{jax.device_count()} (--host_devices={mesh_size})"}, lowered
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile(device_assignment=tuple(jax.devices()[:mesh_size]))
  except Exception as e:  # pylint: disable=broad-except
    logging.error("compile failed:\n%s", traceback.format_exc())
    return out | {"compile_error": f"{type(e).__name__}: {str(e)[:500]}"}, lowered
  out.update(compiled=True, compile_s=round(time.perf_counter() - t0, 2),
             memory=memory_stats(compiled))
  return out, lowered


def routed_expert_flops(cfg: ModelConfig, tokens: int) -> int:
  """FLOPs of one MoE layer's routed experts on `tokens` tokens: gate, up and down
  projections of each token's top-k experts."""
  return 2 * tokens * cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def moe_layer_flops(cfg: ModelConfig, tokens: int, numerics, path: str) -> float:
  """XLA's cost analysis of one MoE block (router, experts on `path`, combine) of `cfg`'s
  shape on `tokens` tokens, compiled for this process's backend from abstract shapes
  (nothing of the model's size is allocated)."""
  from rljax.model import moe  # pylint: disable=g-import-not-at-top
  d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  dtype = jnp.dtype(cfg.param_dtype)
  params = {"router": jax.ShapeDtypeStruct((d, e), dtype),
            "gate": jax.ShapeDtypeStruct((d, e, f), dtype),
            "up": jax.ShapeDtypeStruct((d, e, f), dtype),
            "down": jax.ShapeDtypeStruct((e, f, d), dtype)}
  fn = jax.jit(lambda x, p: moe.moe_block(
      x, p, top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
      numerics=numerics, path=path, row_tile=cfg.expert_row_tile,
      kernel=cfg.expert_kernel)[0])
  x = jax.ShapeDtypeStruct((tokens, d), jnp.bfloat16)
  return fn.lower(x, params).compile().cost_analysis()["flops"]


def train_batch_abstract(cfg: ModelConfig, sharding: sharding_lib.Sharding, *, microbatches: int,
                         rows: int, row_len: int, num_seqs: int, replay: bool) -> TrainBatch:
  """A GRPO batch as split_microbatches makes it: [M, R, L] rows sharded on `batch` (the
  sync loop passes host arrays, which jit replicates; a multi-host loader shards them)."""
  m, r, l = microbatches, rows, row_len
  rows_sh = sharding.named((None, "batch", "length"))
  seq_sh = NamedSharding(sharding.mesh, P())

  def sds(shape, dtype, sh):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sh)

  k = cfg.num_experts_per_tok
  routing = None
  if replay and cfg.moe_layers():
    routing = sds((m, r, l, len(cfg.moe_layers()), k), jnp.int32,
                  sharding.named((None, "batch", "length", None, None)))
  return TrainBatch(
      tokens=sds((m, r, l), jnp.int32, rows_sh), positions=sds((m, r, l), jnp.int32, rows_sh),
      segment_ids=sds((m, r, l), jnp.int32, rows_sh), targets=sds((m, r, l), jnp.int32, rows_sh),
      loss_mask=sds((m, r, l), jnp.bool_, rows_sh),
      behaviour_logprobs=sds((m, r, l), jnp.float32, rows_sh),
      versions=sds((m, r, l), jnp.int32, rows_sh), seq_ids=sds((m, r, l), jnp.int32, rows_sh),
      advantages=sds((m, num_seqs), jnp.float32, seq_sh),
      valid=sds((m, num_seqs), jnp.bool_, seq_sh), routing=routing)


def check(config: ml_collections.ConfigDict, *, num_slots: int, max_seq_len: int,
          name: str | None = None, steps_per_call: int = 8, microbatch_tokens: int = 0,
          row_len: int = 0, microbatches: int = 1, decode_mesh: dict[str, int] | None = None,
          decode_rules: str = "decode", platform: str | None = None,
          compile_: bool = True, lora_rank: int = 16) -> dict:
  """Lowers (and compiles) the train and decode steps of `config`; returns the report
  (with the train state a LoRA run of rank `lora_rank` would hold, beside it)."""
  platform = {"gpu": "cuda"}.get(platform, platform) or running_platform()
  # backend choices for the platform lowered for, not the one this runs on
  built = build(config, MODEL_ONLY + (("rl",) if "rl" in config else ()), devices=False,
                platform=platform)
  cfg, numerics = built.cfg, built.numerics
  mesh_shape = {a: int(config.mesh.to_dict().get(a, 1)) for a in sharding_lib.MESH_AXES}
  engine_mesh = dict(config.engine.get("mesh", {})) if "engine" in config else {}
  decode_shape = {a: int((decode_mesh or engine_mesh or mesh_shape).get(a, 1))
                  for a in sharding_lib.MESH_AXES}
  train_sh = sharding_lib.Sharding(abstract_mesh(mesh_shape))
  decode_sh = sharding_lib.Sharding(
      abstract_mesh(decode_shape),
      sharding_lib.DECODE_RULES if decode_rules == "decode" else sharding_lib.RULES)
  mesh_size, decode_size = math.prod(mesh_shape.values()), math.prod(decode_shape.values())

  # ---- train state and step (as pipeline.grpo_update.grpo_learner wires them) ----------------
  # without an rl block: the learner's defaults (the schedule does not change any shape)
  optimizer = (built.rl_optimizer() if built.loss
               else learner.make_optimizer(optax.linear_schedule(0.0, 1e-6, 10)))
  state_sharding = learner.state_shardings(cfg, optimizer, train_sh)
  state = with_shardings(
      jax.eval_shape(lambda p: learner.init_state(p, optimizer), abstract_params(cfg, jnp.float32)),
      state_sharding)
  serving_train = with_shardings(abstract_params(cfg), state_sharding.params)
  opt_parts = split_opt_state(state.opt_state)

  row_len = row_len or max_seq_len
  batch_shards = math.prod(train_sh.mesh.shape[a] for a in ("data", "fsdp", "expert"))
  rows = microbatch_tokens // row_len or batch_shards
  if microbatch_tokens % row_len or rows % batch_shards:
    raise ValueError(f"microbatch_tokens={microbatch_tokens} is not a multiple of "
                     f"row_len {row_len} x {batch_shards} batch shards")
  replay = bool(config.rl.router_replay) if built.loss else True
  batch = train_batch_abstract(cfg, train_sh, microbatches=microbatches, rows=rows,
                               row_len=row_len, num_seqs=rows * microbatches, replay=replay)
  if built.loss:
    step = built.grpo_step(optimizer, state_sharding, sharding=train_sh)
  else:
    step = learner.make_grpo_step(cfg, optimizer, numerics=numerics,
                                  loss_cfg=learner.LossConfig(), sharding=train_sh,
                                  state_sharding=state_sharding)
  # rl.kl_to_start: the step also takes the start policy's params (serving dtype, laid out
  # like the serving params of the train state)
  reference = serving_train if built.loss and built.kl_to_start else None
  train, _ = lower_and_compile(step.jitted,
                               (state, batch, jax.ShapeDtypeStruct((), jnp.int32), None,
                                reference),
                               platform=platform, mesh_size=mesh_size, compile_=compile_)
  train.update(rows_per_microbatch=rows, row_len=row_len, microbatches=microbatches,
               microbatch_tokens=rows * row_len, router_replay=replay)

  # ---- LoRA: adapters' f32 masters and moments, the frozen base in bf16 ------------------
  lora = lora_lib.LoraConfig(rank=lora_rank)
  lora_sharding = learner.state_shardings(cfg, optimizer, train_sh, lora)
  lora_state = with_shardings(jax.eval_shape(
      lambda k: learner.init_state(lora_lib.init_adapters(cfg, lora, k), optimizer),
      jax.random.key(0)), lora_sharding)
  lora_opt = split_opt_state(lora_state.opt_state)

  # ---- engine: the decode loop the engine runs, on abstract params and KV pages ----------
  programs = EnginePrograms(cfg, numerics, num_slots=num_slots,
                            max_blocks=pages_for(max_seq_len, cfg.page_size),
                            steps_per_call=steps_per_call, sharding=decode_sh)
  num_pages = programs.round_pages(1 + num_slots * pages_for(max_seq_len, cfg.page_size))
  decode_args = programs.decode_args(num_pages)
  serving, (pool, _) = decode_args[0], decode_args[1]
  pool_shape = pool.shape
  decode, _ = lower_and_compile(programs.decode, decode_args, platform=platform,
                                mesh_size=decode_size, compile_=compile_)
  decode.update(num_slots=num_slots, max_seq_len=max_seq_len, steps_per_call=steps_per_call)

  # ---- bytes ----------------------------------------------------------------------------
  parts = {
      "params_f32": state.params, "params_bf16_train": serving_train,
      "adam_mu": opt_parts["mu"], "adam_nu": opt_parts["nu"],
      "counts": (opt_parts["other"], state.step),
      "train_batch": batch, "kl_reference_bf16": reference,  # None: 0 bytes
      "params_bf16_serving": serving, "kv_pages": (pool, pool),
      "lora_adapters_f32": lora_state.params, "lora_adam": (lora_opt["mu"], lora_opt["nu"]),
      "lora_counts": (lora_opt["other"], lora_state.step)}
  per_device = {k: tree_bytes(v) for k, v in parts.items()}
  per_global = {k: tree_bytes(v, global_bytes) for k, v in parts.items()}
  for totals in (per_device, per_global):
    # all of TrainState: masters, moments, optimizer and step counts
    totals["train_state"] = sum(totals[k] for k in ("params_f32", "adam_mu", "adam_nu", "counts"))
    totals["engine"] = totals["params_bf16_serving"] + totals["kv_pages"]
    # a LoRA trainer holds the frozen base (bf16, the train layout) beside its state
    totals["lora_train_state"] = sum(totals[k] for k in (
        "params_bf16_train", "lora_adapters_f32", "lora_adam", "lora_counts"))
  arrays = {}
  for (path, master), serve in zip(jax.tree_util.tree_flatten_with_path(state.params)[0],
                                   jax.tree.leaves(serving)):
    key = path_name(path)
    arrays[key] = {"shape": list(master.shape), "train_spec": str(master.sharding.spec),
                    "f32_per_device": shard_bytes(master),
                    "serving_spec": str(serve.sharding.spec),
                    "serving_per_device": shard_bytes(serve)}
  itemsize = jnp.dtype(cfg.compute_dtype).itemsize
  return {
      "config": name or config.get("name", None), "platform": platform, "abstract_mesh": True,
      "params_total": count_params(state.params), "params_active": active_params(cfg),
      "mesh": mesh_shape, "decode_mesh": decode_shape, "decode_rules": decode_rules,
      "per_device_bytes": per_device, "global_bytes": per_global,
      "kv": {"num_pages": num_pages, "page_size": cfg.page_size, "shape": list(pool_shape),
             "spec": str(pool.sharding.spec),
             "bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                                * cfg.head_dim * itemsize},
      "train": train, "decode": decode, "arrays": arrays,
      "lora": {"rank": lora.rank, "targets": list(lora.targets),
               "adapter_params": count_params(lora_state.params)}}


# HBM per chip, in bytes (vendors' GB)
BUDGETS = {"H200": 141e9, "TPU v5p": 95e9, "H100": 80e9}


def table(report: dict) -> str:
  g, d = report["global_bytes"], report["per_device_bytes"]
  mesh = lambda m: " ".join(f"{k}={v}" for k, v in m.items())  # noqa: E731
  lines = [f"params {report['params_total'] / 1e9:.2f}B total, "
           f"{report['params_active'] / 1e9:.2f}B active; platform {report['platform']}",
           f"train mesh  [{mesh(report['mesh'])}]",
           f"decode mesh [{mesh(report['decode_mesh'])}] rules={report['decode_rules']}",
           "", f"{'':<38}{'global GiB':>12}{'per device GiB':>16}{'per device bytes':>18}"]
  rows = (("trainer: params f32 master", "params_f32"),
          ("trainer: params bf16 (serving bits)", "params_bf16_train"),
          ("trainer: adam mu", "adam_mu"), ("trainer: adam nu", "adam_nu"),
          ("trainer: step counts", "counts"),
          ("trainer: state (master + opt)", "train_state"),
          ("trainer, LoRA: adapters f32", "lora_adapters_f32"),
          ("trainer, LoRA: adam mu + nu", "lora_adam"),
          ("trainer, LoRA: base bf16 + state", "lora_train_state"),
          ("trainer: one step's batch", "train_batch"),
          ("trainer: kl_to_start reference bf16", "kl_reference_bf16"),
          ("engine: params bf16", "params_bf16_serving"),
          ("engine: KV pages (k + v)", "kv_pages"),
          ("engine: params + KV", "engine"))
  for label, key in rows:
    lines.append(f"{label:<38}{g[key] / GIB:>12.3f}{d[key] / GIB:>16.3f}{d[key]:>18,}")
  kv = report["kv"]
  lines.append(f"KV: {kv['shape']} spec {kv['spec']}, {kv['bytes_per_token']:,} B/token")
  for name in ("train", "decode"):
    r = report[name]
    status = (f"lowered in {r['lower_s']} s" if r["lowered"] else f"LOWERING FAILED: "
              f"{r.get('error')}")
    if r["compiled"]:
      status += f", compiled in {r['compile_s']} s"
    elif r["lowered"]:
      status += f"; not compiled: {r.get('compile_skipped') or r.get('compile_error')}"
    lines.append(f"{name} step: {status}")
    if r.get("memory"):
      lines.append("  memory_analysis per device (GiB): " + ", ".join(
          f"{k} {v / GIB:.3f}" for k, v in r["memory"].items()))
  lines.append("per-device budget (weights + KV or state + batch; compiled temporaries "
               "come on top):")
  for chip, budget in BUDGETS.items():
    fits = [f"{who} {need / budget:.0%}" for who, need in
            (("engine", d["engine"]),
             ("trainer", d["train_state"] + d["train_batch"] + d["kl_reference_bf16"]),
             (f"LoRA r{report['lora']['rank']} trainer",
              d["lora_train_state"] + d["train_batch"]))]
    lines.append(f"  {chip} ({budget / 1e9:.0f} GB): " + ", ".join(fits))
  return "\n".join(lines)
