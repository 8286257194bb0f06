"""Runs in its own process (see test_hf_import.py): writes, or loads sharded, a synthetic
~1 GB Hugging Face checkpoint, and reports host memory (resident anonymous memory, sampled
every millisecond).

  hf_load_worker.py write DIR   a random f32 Qwen3-MoE (~1.1 GB) exported into DIR
  hf_load_worker.py load DIR    DIR loaded onto an 8-device mesh (expert 4 x fsdp 2):
                                prints one JSON object with peak memory above baseline,
                                the bytes the loaded shards hold, the largest tensor, and
                                whether the sharded params equal an unsharded load bitwise
"""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rljax import sharding as sharding_lib  # noqa: E402
from rljax.model import ModelConfig, abstract_params, param_shardings  # noqa: E402
from rljax.model.hf_export import export_hf  # noqa: E402
from rljax.model.hf_import import load_hf_checkpoint, load_hf_params  # noqa: E402

# 276M params: 4 MoE layers of 16 experts x (1024 x 1024) x 3, vocab 32000 x 1024 twice
CFG = ModelConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
                  moe_intermediate_size=1024, dtype="float32", param_dtype="float32")


def anon_rss() -> int:
  """Resident anonymous memory: what the process allocated. (VmRSS also counts the pages
  of memory-mapped files, which are page cache the kernel can drop at any time.)"""
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakSampler(threading.Thread):
  """Samples anon_rss every millisecond until stopped; `peak` is the largest sample."""

  def __init__(self):
    super().__init__(daemon=True)
    self.peak, self._stop_event = anon_rss(), threading.Event()

  def run(self):
    while not self._stop_event.is_set():
      self.peak = max(self.peak, anon_rss())
      time.sleep(0.001)

  def stop(self) -> int:
    self._stop_event.set()
    self.join()
    return max(self.peak, anon_rss())


def main(mode: str, directory: str):
  if mode == "write":
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32) * 0.02,
                          abstract_params(CFG, np.float32))
    export_hf(params, CFG, directory)
    return
  sharding = sharding_lib.Sharding(sharding_lib.make_mesh({"expert": 4, "fsdp": 2}))
  shardings = param_shardings(CFG, sharding)
  jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # the backend is up
  baseline = anon_rss()
  sampler = PeakSampler()
  sampler.start()
  params = load_hf_params(directory, CFG, "float32", shardings)
  jax.block_until_ready(params)
  peak = sampler.stop()
  held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
  sharded_ok = all(x.sharding == s for x, s in zip(jax.tree.leaves(params),
                                                   jax.tree.leaves(shardings)))
  from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  f = safe_open(os.path.join(directory, "model.safetensors"), "numpy")  # one file: < 5 GB
  largest = max(int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys())  # f32
  _, whole = load_hf_checkpoint(directory, dtype="float32")
  equal = all(np.array_equal(np.asarray(a), np.asarray(b))
              for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole)))
  print(json.dumps({"baseline_anon_rss": baseline, "peak_anon_rss": peak, "held_by_shards": held,
                    "peak_above_baseline_and_shards": peak - baseline - held,
                    "largest_tensor": largest, "sharded_as_asked": sharded_ok,
                    "equal_to_unsharded_load": equal}))


if __name__ == "__main__":
  main(*sys.argv[1:])
