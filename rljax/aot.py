"""Ahead-of-time check of a real-size config (`experiments/aot_check.py`): the GRPO train
step, the engine's decode loop and its largest prefill (and a LoRA run's step) lowered and
compiled on abstract inputs, with per-device bytes.

  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      --topology=v5p:4x4x4 [--programs=train,decode,prefill,lora_train]  # TPU compiler
  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      [--platform=tpu | --host_devices=64]  # lower only, or compile with XLA:CPU

(`--config.init_from=` plans config.model's shapes; `--config.init_from=hf:DIR` those of
DIR's config.json.)

Nothing of the model's size is allocated: params, optimizer state, batch and KV pages are
`jax.ShapeDtypeStruct`s carrying `NamedSharding`s (params from `jax.eval_shape`), and the
functions are the real ones: `learner.make_grpo_step(...).jitted` with its state
shardings (as `build(config)` wires it) and the engine's programs (`EnginePrograms`, on
the arguments `decode_args` / `prefill_args` describe, with explicit shardings).

`topology` (jax 0.10.2 with libtpu, measured): `get_topology_desc` gives a TPU slice's
chips on this CPU; the meshes are concrete meshes of them (laid out on the slice's torus),
and each program is compiled by the TPU compiler (Mosaic for Pallas kernels), whose
`memory_analysis` (per chip: arguments, outputs, aliases, temps) and `cost_analysis` are
the TPU's; each compiled program's `hlo` holds its optimized HLO's matmul FLOPs and bytes
per chip with loops counted as they run (`rljax.hlo_flops`). Without it the mesh is an
`AbstractMesh`: any size lowers for any platform
(`trace(...).lower(lowering_platforms=...)`); compiling that needs a device per mesh
position (`--host_devices=N` simulated CPUs), and XLA:CPU's temps are not a TPU's (it
expands `ragged_dot` densely over experts and upcasts bf16). An AbstractMesh lowered for
tpu compiles on XLA:CPU, hence the concrete mesh.

Per-device bytes come from each array's `NamedSharding.shard_shape` (padded shards count
in full; a TPU pads small arrays further). KV pages: [layers, num_pages, page_size,
kv_heads, head_dim] x 2 (k, v), as raw bits of the compute dtype, num_pages = 1 +
num_slots * ceil(max_seq_len / page_size), sharded by the rules table. The report's table
and roofline: `rljax.aot_report`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import ml_collections
import optax

from rljax import sharding as sharding_lib
from rljax.aot_compile import (abstract_mesh, lower_and_compile, running_platform, topology_chips,
                               topology_mesh)
from rljax.engine.pages import pages_for
from rljax.engine.programs import STEPS_PER_CALL, EnginePrograms
from rljax.model import ModelConfig, abstract_params, active_params, count_params
from rljax.model import lora as lora_lib
from rljax.pipeline.run import MODEL_ONLY, build
from rljax.rl import learner
from rljax.rl.batch import TrainBatch


GIB = 2.0 ** 30
# what `check` can lower and compile (`programs`), and what it does by default
PROGRAMS = ("train", "decode", "prefill", "lora_train")
DEFAULT_PROGRAMS = PROGRAMS[:3]
# the shape the roofline (rljax.aot_report) counts FLOPs and bytes from
MODEL_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                "moe_intermediate_size", "remat", "tie_word_embeddings")


def parse_mesh(text: str) -> dict[str, int]:
  """'data=1,expert=8' -> {"data": 1, "expert": 8}."""
  out = {}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, size = part.partition("=")
    out[name.strip()] = int(size)
  return out


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
          name: str | None = None, steps_per_call: int = STEPS_PER_CALL,
          microbatch_tokens: int = 0,
          row_len: int = 0, microbatches: int = 1, decode_mesh: dict[str, int] | None = None,
          decode_rules: str = "decode", platform: str | None = None,
          compile_: bool = True, lora_rank: int = 16, topology: str | None = None,
          prefill_rows: int = 0, prefill_len: int = 0,
          programs: tuple[str, ...] = DEFAULT_PROGRAMS,
          decode_topology: str | None = None, serving_layout: bool | None = None) -> dict:
  """Lowers (and compiles) the train step, the decode loop and the engine's largest prefill
  (`prefill_rows` x `prefill_len` tokens; 0: num_slots x max_seq_len) of `config`; returns
  the report (with the train state a LoRA run of rank `lora_rank` would hold, beside it).
  `topology` ("v5p:4x4x4"): the meshes are that TPU slice's chips and every program is
  compiled by the TPU compiler, from this CPU; a mesh larger than the slice is an error.
  `decode_topology`: the rollout host's own slice for the engine's programs (e.g. v6e:2x4
  beside a v6e:8x8 trainer; default `topology`).
  `programs`: which of PROGRAMS to lower ("lora_train": the GRPO step of a rank-`lora_rank`
  LoRA run on the frozen bf16 base); the others are reported as skipped.
  `serving_layout` (None: off CPU, as `DecodeEngine`): the engine's params in the decode
  loop's own layout (`EnginePrograms`); False measures what the default layout costs."""
  unknown = set(programs) - set(PROGRAMS)
  if unknown:
    raise ValueError(f"unknown programs {sorted(unknown)}; expected some of {PROGRAMS}")
  if topology:
    if platform not in (None, "tpu"):
      raise ValueError(f"--topology compiles for TPU, not platform {platform!r}")
    platform = "tpu"
  platform = {"gpu": "cuda"}.get(platform, platform) or running_platform()
  # backend choices for the platform lowered for, not the one this runs on
  built = build(config, MODEL_ONLY + (("rl",) if "rl" in config else ()), devices=False,
                platform=platform)
  cfg, numerics = built.cfg, built.numerics
  mesh_shape = {a: int(config.mesh.to_dict().get(a, 1)) for a in sharding_lib.MESH_AXES}
  engine_mesh = dict(config.engine.get("mesh", {})) if "engine" in config else {}
  decode_shape = {a: int((decode_mesh or engine_mesh or mesh_shape).get(a, 1))
                  for a in sharding_lib.MESH_AXES}
  if decode_topology and not topology:
    raise ValueError("decode_topology needs topology (the trainer's slice)")
  if topology:
    train_mesh = topology_mesh(mesh_shape, topology_chips(topology), topology)
    host = decode_topology or topology
    decode_mesh_ = topology_mesh(decode_shape, topology_chips(host), host)
  else:
    train_mesh, decode_mesh_ = abstract_mesh(mesh_shape), abstract_mesh(decode_shape)
  train_sh = sharding_lib.Sharding(train_mesh)
  decode_sh = sharding_lib.Sharding(
      decode_mesh_,
      sharding_lib.DECODE_RULES if decode_rules == "decode" else sharding_lib.RULES)
  mesh_size, decode_size = math.prod(mesh_shape.values()), math.prod(decode_shape.values())
  compile_kw = dict(platform=platform, compile_=compile_, concrete=bool(topology))

  def lower(name, jitted, args, size, keep=None):
    if name not in programs:
      return {"lowered": False, "compiled": False, "skipped": "not asked for"}
    report, program = lower_and_compile(jitted, args, mesh_size=size, **compile_kw)
    if keep is not None and report["compiled"]:
      keep(program)
    return report

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
  version = jax.ShapeDtypeStruct((), jnp.int32)
  train = lower("train", step.jitted, (state, batch, version, None, reference), mesh_size)
  train.update(rows_per_microbatch=rows, row_len=row_len, microbatches=microbatches,
               microbatch_tokens=rows * row_len, router_replay=replay)

  # ---- LoRA: adapters' f32 masters and moments, the frozen base in bf16 ------------------
  lora = lora_lib.LoraConfig(rank=lora_rank)
  lora_sharding = learner.state_shardings(cfg, optimizer, train_sh, lora)
  lora_state = with_shardings(jax.eval_shape(
      lambda k: learner.init_state(lora_lib.init_adapters(cfg, lora, k), optimizer),
      jax.random.key(0)), lora_sharding)
  lora_opt = split_opt_state(lora_state.opt_state)
  lora_step = learner.make_grpo_step(
      cfg, optimizer, numerics=numerics, loss_cfg=built.loss or learner.LossConfig(),
      replay=replay, sharding=train_sh, state_sharding=lora_sharding, lora=lora)
  lora_train = lower("lora_train", lora_step.jitted,
                     (lora_state, batch, version, serving_train, None), mesh_size)

  # ---- engine: the decode loop the engine runs, on abstract params and KV pages ----------
  # (as `DecodeEngine` builds them: the serving layout off CPU, the decode loop's params'
  # layout adopted by the prefill once it compiled)
  engine = EnginePrograms(cfg, numerics, num_slots=num_slots,
                          max_blocks=pages_for(max_seq_len, cfg.page_size),
                          steps_per_call=steps_per_call, sharding=decode_sh,
                          serving_layout=(platform != "cpu" if serving_layout is None
                                          else serving_layout))
  num_pages = engine.round_pages(1 + num_slots * pages_for(max_seq_len, cfg.page_size))
  decode_args = engine.decode_args(num_pages)
  serving, (pool, _) = decode_args[0], decode_args[1]
  pool_shape = pool.shape
  decode = lower("decode", engine.decode, decode_args, decode_size,
                 keep=engine.adopt_serving_layout if engine.serving_layout else None)
  decode.update(num_slots=num_slots, max_seq_len=max_seq_len, steps_per_call=steps_per_call,
                serving_layout=engine.serving_layout)
  # the engine's largest prefill call: every slot, or what config.engine.max_prefill_tokens
  # leaves of them at full width
  width = prefill_len or max_seq_len
  cap = int(config.engine.get("max_prefill_tokens", 0)) if "engine" in config else 0
  prefill_rows = prefill_rows or min(num_slots, cap // width if cap else num_slots)
  prefill = lower("prefill", engine.prefill,
                  engine.prefill_args(num_pages, prefill_rows, width), decode_size)
  prefill.update(rows=prefill_rows, width=width, params_layout=(
      "default" if not engine.serving_layout else "the decode loop's"
      if engine.param_formats is not None else "its own (the decode loop did not compile)"))

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
      "config": name or config.get("name", None), "platform": platform,
      "abstract_mesh": not topology,
      "params_total": count_params(state.params), "params_active": active_params(cfg),
      "mesh": mesh_shape, "decode_mesh": decode_shape, "decode_rules": decode_rules,
      "per_device_bytes": per_device, "global_bytes": per_global,
      "kv": {"num_pages": num_pages, "page_size": cfg.page_size, "shape": list(pool_shape),
             "spec": str(pool.sharding.spec),
             "bytes_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads
                                * cfg.head_dim * itemsize},
      "topology": topology, "chips": mesh_size if topology else None,
      "decode_topology": decode_topology or topology,
      "train": train, "decode": decode, "prefill": prefill, "lora_train": lora_train,
      "arrays": arrays,
      "lora": {"rank": lora.rank, "targets": list(lora.targets),
               "adapter_params": count_params(lora_state.params)},
      "model": {f: getattr(cfg, f) for f in MODEL_FIELDS} | {
          "moe_layers": len(cfg.moe_layers())},
      "numerics": numerics.mode,
      "kernels": {"det_attention": cfg.det_attention, "expert_kernel": cfg.expert_kernel}}
