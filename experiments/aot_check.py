"""Ahead-of-time check of a real-size config (rljax/aot.py says what is measured and how):

  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      --topology=v5p:4x4x4  # the TPU compiler, from this CPU
  python experiments/aot_check.py --config=configs/qwen3_30b_a3b.py --config.init_from= \
      [--platform=tpu | --host_devices=64]  # lower only, or compile with XLA:CPU

Prints a table; the last line is one JSON object.
"""

import json

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from rljax import aot, aot_report, numerics
from rljax.engine.programs import STEPS_PER_CALL

_CONFIG = config_flags.DEFINE_config_file("config", "configs/qwen3_30b_a3b.py",
                                          "config with `model` and `mesh`", lock_config=True)
_NUM_SLOTS = flags.DEFINE_integer("num_slots", 64, "engine decode slots")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 4096, "engine max sequence length")
_STEPS_PER_CALL = flags.DEFINE_integer("steps_per_call", STEPS_PER_CALL, "decode steps a call")
_MICROBATCH_TOKENS = flags.DEFINE_integer(
    "microbatch_tokens", 0, "tokens per training microbatch, all devices together (a "
    "multiple of row_len x batch shards); 0 = one row per batch shard")
_ROW_LEN = flags.DEFINE_integer("row_len", 0, "packed training row length (0 = max_seq_len)")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 1, "microbatches per train step")
_DECODE_MESH = flags.DEFINE_string("decode_mesh", "", "the engine's mesh, e.g. "
                                   "'expert=8' (default: the config's mesh)")
_DECODE_RULES = flags.DEFINE_enum("decode_rules", "decode", ["decode", "train"],
                                  "the engine's rules table: DECODE_RULES (weights "
                                  "replicated over fsdp) or RULES (the trainer's)")
_PLATFORM = flags.DEFINE_string("platform", None, "lowering platform: cpu, tpu, cuda, rocm "
                                "(default: the running backend)")
_COMPILE = flags.DEFINE_bool("compile", True, "compile too, where the devices allow")
_TOPOLOGY = flags.DEFINE_string("topology", None, "a TPU slice (v5p:4x4x4, v6e:2x2): "
                                "compile with the TPU compiler on its chips")
_DECODE_TOPOLOGY = flags.DEFINE_string("decode_topology", None, "the rollout host's slice")
_PREFILL_ROWS = flags.DEFINE_integer("prefill_rows", 0, "prefill rows (0: the largest call)")
_PREFILL_LEN = flags.DEFINE_integer("prefill_len", 0, "prefill width (0: max_seq_len)")
_PROGRAMS = flags.DEFINE_list("programs", list(aot.DEFAULT_PROGRAMS),
                              f"which of {list(aot.PROGRAMS)} to lower and compile")
_SERVING_LAYOUT = flags.DEFINE_enum("serving_layout", "auto", ["auto", "true", "false"],
                                    "params in the decode loop's layout (auto: off CPU)")
_HOST_DEVICES = flags.DEFINE_integer("host_devices", 0, "simulate this many CPU devices "
                                     "(>= mesh size, for compiling; 0 = leave as is)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  numerics.set_up_process(_CONFIG.value.numerics)  # before anything starts JAX's backend
  if _HOST_DEVICES.value:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      raise app.UsageError("--host_devices: the JAX backend already started")
    jax.config.update("jax_num_cpu_devices", _HOST_DEVICES.value)
  logging.info("devices: %s", jax.devices())
  report = aot.check(_CONFIG.value, name=config_flags.get_config_filename(flags.FLAGS["config"]),
                     num_slots=_NUM_SLOTS.value, max_seq_len=_MAX_SEQ_LEN.value,
                     steps_per_call=_STEPS_PER_CALL.value, microbatches=_MICROBATCHES.value,
                     microbatch_tokens=_MICROBATCH_TOKENS.value, row_len=_ROW_LEN.value,
                     decode_mesh=aot.parse_mesh(_DECODE_MESH.value) or None,
                     decode_rules=_DECODE_RULES.value, platform=_PLATFORM.value,
                     compile_=_COMPILE.value, topology=_TOPOLOGY.value,
                     prefill_rows=_PREFILL_ROWS.value, prefill_len=_PREFILL_LEN.value,
                     programs=tuple(_PROGRAMS.value), decode_topology=_DECODE_TOPOLOGY.value,
                     serving_layout={"true": True, "false": False}.get(_SERVING_LAYOUT.value))
  if report["topology"]:
    report["fit"], report["roofline"] = aot_report.fits(report), aot_report.roofline(report)
  print(aot_report.table(report), flush=True)
  print(json.dumps(report), flush=True)
  if not all(report[p]["lowered"] for p in _PROGRAMS.value):
    raise SystemExit(1)


if __name__ == "__main__":
  app.run(main)
