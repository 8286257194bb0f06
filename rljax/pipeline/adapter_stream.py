"""config.lora in the async pipeline: the frozen base goes out once, the adapters every version.

    trainer                                       storage root          rollout host
    frozen base (serving dtype) ── once ────────► base/   version 0 ──► read once, kept
    adapters' f32 masters ──── every version ───► stream/ delta   ────► applied in place
                                                                        engine weights =
                                                                        merged_params(base,
                                                                          adapters, lora)

What is on the wire. `base/` is a weight stream of one version: the base params the
adapters train on (the warm start's serving params, bf16), one keyframe, checksummed like
every version. `stream/` is the run's weight stream as without LoRA (deltas against the
parent, a keyframe every `async_rl.keyframe_every`, xxh3 of every shard's new bits), but
of the adapters' f32 masters, not of a merged model: the merge reads those masters (in
the trainer's differentiated step and in `learner.merged_params` alike), so a host needs
their exact bits to serve the trainer's weights, and bf16 would not give them. Each
update moves nearly every adapter value (Adam), so a delta is dense: about a fifth to a
third of the adapters' f32 bytes (`ADAPTER_DELTA_CODEC`). That is more than a full model's
bf16 delta where a small learning rate changes few bf16 values: on `experiments/
bench_delta.py --workload=lora` (15.5M parameters, rank 16) 1.47 MB per version at lr 1e-6
against 0.08 MB for full fine-tuning's model and 0.01 MB for the same LoRA run's merged
model (2.40 / 0.44 MB at lr 1e-4). What adapters buy is a host that keeps its base and
swaps only them, not fewer bytes (on this workload).

Why the base travels through the root. The base is whatever the warm start made (SFT'd,
loaded from `init_from`, or a random init) cast to the serving dtype. A rollout host on
another machine reaches only the storage root (gs:// across machines), so it reads the
base from there, once per host process (at its start, or after a restart), and needs no
trainer checkpoint or copy of its own; in a GCS deployment that is one sharded read of the
model per host, the same as joining a full-model stream at a keyframe, and every version
after it costs only the adapters' delta. The base never changes: hosts poll it once.

A host merges with `learner.merged_params`, the jitted function the trainer's
`run.serve(state)` calls: the merge is elementwise, so on the host's own devices and mesh
it gives the trainer's bits, and in deterministic numerics every sampled token's log-prob
is the one the trainer computes for it (mismatch 0).

Checkpoints. The trainer's checkpoints (`<trainer dir>/checkpoints`) hold the adapters'
train state (masters, optimizer moments, step) and the stream version, as without LoRA.
The base is saved once, before version 0, as `<trainer dir>/lora_base` (an orbax params
checkpoint, restored onto any mesh); a resumed trainer restores it and checks it against
`base/` shard by shard (the checksums of version 0) before anything else, so a resumed
run trains on, and serves, the very bits its hosts hold. `merged_from_checkpoint` gives
the merged policy of a checkpoint (experiments/export_hf.py --checkpoint).
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath
import jax
import jax.numpy as jnp

from rljax import sharding as sharding_lib
from rljax.checkpoint import Checkpointer
from rljax.model import ModelConfig, abstract_params, param_shardings
from rljax.model import lora as lora_lib
from rljax.pipeline.layout import base_url
from rljax.pipeline.run import Built
from rljax.rl import learner
from rljax.sync import manifest as fmt
from rljax.sync.publisher import Publisher

BASE_CHECKPOINT = "lora_base"
ADAPTER_DTYPE = jnp.float32  # the stream carries the adapters' masters bit for bit
# every update moves nearly every adapter value by hundreds to thousands of f32 ulps: the
# Rice codec's ulp steps escape to full words, XOR'd values in byte planes compress best
# (bench_delta --workload=lora, rank 16: sparse-zstd 1.47 MB per version, xor-zstd 1.74,
# rice-zstd 2.26, of 6.75 MB of adapters at lr 1e-6; 2.40 / 2.83 / 3.97 MB at lr 1e-4)
ADAPTER_DELTA_CODEC = "sparse-zstd"


def base_checkpoint_dir(trainer_dir: str) -> str:
  """Where a LoRA trainer saves its frozen base: beside its `checkpoints`."""
  return f"{str(trainer_dir).rstrip('/')}/{BASE_CHECKPOINT}"


def has_base(trainer_dir: str) -> bool:
  """Whether `trainer_dir` holds a LoRA run's frozen base (its checkpoints are adapters)."""
  return epath.Path(base_checkpoint_dir(trainer_dir)).exists()


def _base_publisher(root: str, base: Any) -> Publisher:
  dtypes = {jnp.dtype(x.dtype) for x in jax.tree.leaves(base)}
  if len(dtypes) != 1:
    raise ValueError(f"the frozen base must have one dtype (the serving dtype), not "
                     f"{sorted(d.name for d in dtypes)}")
  return Publisher(base_url(root), keyframe_every=1, retain=1, dtype=dtypes.pop())


def start_base(root: str, trainer_dir: str, base: Any) -> None:
  """A fresh LoRA run: saves `base` as `<trainer_dir>/lora_base`, then publishes it as
  version 0 of `<root>/base/` (before the adapters' version 0, so a host that sees that
  finds its base). Call on every trainer process. Refuses a workdir or root that holds an
  earlier run's base: a run's base is written once."""
  directory = base_checkpoint_dir(trainer_dir)
  if has_base(trainer_dir):
    raise FileExistsError(f"{directory} holds an earlier LoRA run's frozen base but there is "
                          "no checkpoint to resume: use a fresh workdir and root")
  publisher = _base_publisher(root, base)  # every process has checked: it waits for all
  if publisher.version is not None:
    raise ValueError(f"{base_url(root)} already holds a frozen base (an earlier run's): use a "
                     "fresh root")
  with Checkpointer(directory, keep_last=1, async_save=False) as ckpt:
    ckpt.save(0, {"params": base}, stream_version=0)
  publisher.publish(base, 0)


def base_target(cfg: ModelConfig, sharding: sharding_lib.Sharding | None) -> Any:
  """ShapeDtypeStructs of the base (serving dtype) placed by the training rules of
  `sharding` (None: the first device)."""
  abstract = abstract_params(cfg, cfg.weight_dtype)
  if sharding is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                        abstract)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, param_shardings(cfg, sharding))


def restore_base(trainer_dir: str, cfg: ModelConfig,
                 sharding: sharding_lib.Sharding | None) -> Any:
  """The frozen base a LoRA trainer saved (`start_base`), onto `sharding`'s mesh."""
  directory = base_checkpoint_dir(trainer_dir)
  if not has_base(trainer_dir):
    raise FileNotFoundError(f"{directory} is missing: a config.lora run's checkpoints need "
                            "the frozen base saved beside them (was this run started "
                            "without config.lora?)")
  with Checkpointer(directory, keep_last=1) as ckpt:
    return ckpt.restore({"params": base_target(cfg, sharding)}).state["params"]


def verify_base(root: str, base: Any, trainer_dir: str) -> None:
  """A resumed run: every shard of `base` this process holds has the bits of `<root>/base/`
  version 0 (what the hosts hold), or StreamError. Call on every trainer process."""
  try:
    _base_publisher(root, base).resume(base, 0)
  except fmt.StreamError as e:
    raise fmt.StreamError(f"the frozen base in {base_checkpoint_dir(trainer_dir)} is not the "
                          f"one the hosts read from {base_url(root)}: {e}") from e


def adapter_shardings(cfg: ModelConfig, lora: lora_lib.LoraConfig,
                      sharding: sharding_lib.Sharding | None) -> Any:
  """Where each adapter leaf goes on `sharding`'s mesh (each like its base weight); None
  on one device."""
  if sharding is None:
    return None
  return sharding.tree_shardings(lora_lib.adapter_axes(cfg, lora))


def adapters_from_checkpoint(built: Built, checkpoints_dir: str, step: int | None = None
                             ) -> Any:
  """The adapters (f32 masters) of a LoRA trainer's checkpoint `step` (the latest if
  None), on the first device (experiments/export_hf.py --peft)."""
  cfg, lora = built.cfg, built.lora
  if lora is None:
    raise ValueError("adapters_from_checkpoint reads a config.lora run's checkpoints")
  optimizer = built.rl_optimizer()
  adapters = jax.eval_shape(lambda k: lora_lib.init_adapters(cfg, lora, k), jax.random.key(0))
  target = learner.TrainState(adapters, jax.eval_shape(optimizer.init, adapters),
                              jax.ShapeDtypeStruct((), jnp.int32))
  with Checkpointer(checkpoints_dir, keep_last=1) as ckpt:
    return ckpt.restore({"state": target}, step).state["state"].params


def merged_from_checkpoint(built: Built, checkpoints_dir: str, step: int | None = None) -> Any:
  """The merged policy (f32 leaves holding the serving bits) of a LoRA trainer's
  checkpoint `step` (the latest if None): its adapters merged into the base saved beside
  the checkpoints, by the function the trainer served and published with."""
  adapters = adapters_from_checkpoint(built, checkpoints_dir, step)
  path = str(checkpoints_dir).rstrip("/")
  trainer_dir = (path if "://" in path else os.path.abspath(path)).rsplit("/", 1)[0]
  base = restore_base(trainer_dir, built.cfg, None)
  merged = learner.merged_params(base, adapters, built.lora)
  return jax.tree.map(lambda x: x.astype(jnp.float32), merged)
