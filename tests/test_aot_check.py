"""experiments/aot_check.py: the GRPO train step and the engine's decode step lower on
abstract inputs, and its per-device bytes equal a hand computation (total bytes / shards).

The tiny run compiles on 8 simulated CPU devices, so it runs in its own process (the
device count must be set before JAX starts); the full Qwen3-30B-A3B run only lowers (an
AbstractMesh of 64 devices needs no devices at all). Both from config.model's shape, with
no checkpoint directory (`:tiny_random`; the full config with `--config.init_from=`).
"""

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "experiments" / "aot_check.py"
GIB = 2 ** 30


def run_check(*args: str) -> dict:
  proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                        timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
  lines = proc.stdout.strip().splitlines()
  assert "per device GiB" in proc.stdout  # the table came before the JSON
  return json.loads(lines[-1])


@pytest.fixture(scope="module")
def tiny():
  # tiny_moe shapes with the example tokenizer's vocab 512: hidden 64, 3 layers (layer 0
  # dense), 4 heads, 2 KV heads, head_dim 16, 8 experts of width 32, page 16
  return run_check("--config=configs/qwen3_30b_a3b.py:tiny_random", "--config.mesh.fsdp=2",
                   "--config.mesh.expert=2", "--config.mesh.model=2", "--host_devices=8",
                   "--num_slots=8", "--max_seq_len=64")


@pytest.mark.multidevice
def test_tiny_steps_lower_and_compile(tiny):
  for step in ("train", "decode"):
    assert tiny[step]["lowered"] and tiny[step]["compiled"], tiny[step]
    assert tiny[step]["memory"]["argument"] > 0
    # XLA:CPU's HLO, loops counted as they run (rljax.hlo_flops): the MoE layers' scan,
    # the decode loop's steps
    hlo = tiny[step]["hlo"]
    assert hlo["matmul_flops_per_chip"] > 1.3 * hlo["matmul_flops_per_chip_loops_once"] > 0
    assert not hlo["unknown_loops"], hlo
  assert tiny["abstract_mesh"] and tiny["platform"] == "cpu"
  assert tiny["mesh"] == {"data": 1, "fsdp": 2, "expert": 2, "model": 2}


@pytest.mark.multidevice
def test_tiny_per_device_bytes_match_hand_computation(tiny):
  v, d, e, f, layers, kv, hd, page = 512, 64, 8, 32, 3, 2, 16, 16
  fsdp, expert, model = 2, 2, 2
  arrays = tiny["arrays"]
  # embedding [vocab, embed]: vocab -> model, embed -> fsdp (training); decode rules keep
  # embed whole
  emb = arrays["embed/embedding"]
  assert emb["f32_per_device"] == v * d * 4 // (model * fsdp)
  assert emb["serving_per_device"] == v * d * 2 // model
  # an expert weight [embed, expert, mlp]: split over all three axes (8 ways) in training
  # (layers 1, 2: the MoE stack, its leading "layers" axis replicated)
  gate = arrays["layers/moe/moe/gate"]
  assert gate["shape"] == [2, d, e, f]
  assert gate["f32_per_device"] == 2 * d * e * f * 4 // (fsdp * expert * model)
  assert gate["serving_per_device"] == 2 * d * e * f * 2 // (expert * model)
  # a norm scale head_dim: replicated (layer 0: the dense stack)
  assert arrays["layers/dense/attn/q_norm"]["f32_per_device"] == hd * 4
  # KV pages: 1 + slots * blocks pages rounded up to a multiple of the slots' shards
  # (fsdp x expert: the decode rules split the pages with the slots), k and v, kv heads over
  # `model`, in the compute dtype's bits: fast numerics on a CPU computes in f32 unless it
  # has native bf16 dots (ModelConfig.dtype "auto")
  from rljax.model.config import cpu_has_native_bf16  # pylint: disable=import-outside-toplevel
  num_pages = 4 * math.ceil((1 + 8 * math.ceil(64 / page)) / 4)
  kv_total = layers * num_pages * page * kv * hd * 2 * (2 if cpu_has_native_bf16() else 4)
  assert tiny["kv"]["num_pages"] == num_pages == 36
  assert tiny["kv"]["spec"] == "P(None, ('fsdp', 'expert'), None, 'model', None)"
  assert tiny["global_bytes"]["kv_pages"] == kv_total
  assert tiny["per_device_bytes"]["kv_pages"] == kv_total // (fsdp * expert * model)
  # optimizer moments follow their params; globals are the whole model
  per = tiny["per_device_bytes"]
  assert per["adam_mu"] == per["adam_nu"] == per["params_f32"]
  assert per["params_f32"] == 2 * per["params_bf16_train"]
  assert tiny["global_bytes"]["params_f32"] == 4 * tiny["params_total"]
  # the compiled programs alias exactly what they donate: the train state, the KV pools
  assert tiny["train"]["memory"]["alias"] == per["train_state"]
  assert tiny["decode"]["memory"]["alias"] == per["kv_pages"]
  assert tiny["train"]["memory"]["argument"] >= per["train_state"] + per["train_batch"]
  # LoRA (rank 16 by default): adapters' masters and moments, the frozen base in bf16
  assert per["lora_adam"] == 2 * per["lora_adapters_f32"] > 0
  assert per["lora_train_state"] == (per["params_bf16_train"] + per["lora_adapters_f32"]
                                     + per["lora_adam"] + per["lora_counts"])


def test_full_qwen3_30b_a3b_lowers():
  """The real shape on its 64-device plan, lowering only (~15 s on the 2-core machine)."""
  out = run_check("--config=configs/qwen3_30b_a3b.py", "--config.init_from=", "--nocompile",
                  "--num_slots=64", "--max_seq_len=4096")
  assert out["train"]["lowered"] and out["decode"]["lowered"], out
  assert out["params_total"] == 30_532_122_624
  assert out["mesh"] == {"data": 1, "fsdp": 8, "expert": 8, "model": 1}
  d, e, f, layers = 2048, 128, 768, 48
  gate = out["arrays"]["layers/moe/moe/gate"]
  assert gate["f32_per_device"] == layers * d * e * f * 4 // 64
  assert gate["serving_per_device"] == layers * d * e * f * 2 // 8  # decode rules: experts only
  # the engine on config.engine.mesh (one 8-chip host, experts split 8 ways): the pages
  # split 8 ways with the slots
  assert out["decode_mesh"] == {"data": 1, "fsdp": 1, "expert": 8, "model": 1}
  num_pages = 8 * math.ceil((1 + 64 * 4096 // 16) / 8)
  assert out["per_device_bytes"]["kv_pages"] == layers * num_pages // 8 * 16 * 4 * 128 * 2 * 2
  per = out["per_device_bytes"]
  assert per["train_state"] / GIB < 8 and per["engine"] / GIB < 40  # fits an 80 GB chip
  # LoRA rank 16 on attention and every expert's gate / up / down: A [in, r], B [r, out]
  h, kv, hd, r = 32, 4, 128, 16
  per_layer = r * (2 * (d + h * hd) + 2 * (d + kv * hd) + 3 * e * (d + f))
  assert out["lora"]["rank"] == r and out["lora"]["adapter_params"] == layers * per_layer
  # each factor splits as its base's axes it keeps do (embed: fsdp 8, expert: 8; the rank
  # and heads (model 1) whole): q, k, v A [d, r] / 8, B [r, out] whole; o A [h hd, r] whole,
  # B [r, d] / 8; experts' gate, up A [d, E, r] / 64, B [E, r, f] / 8; down A [E, f, r]
  # / 8, B [E, r, d] / 64
  attn = d * r // 8 * 3 + r * (h * hd + 2 * kv * hd) + h * hd * r + r * d // 8
  experts = 2 * (d * e * r // 64 + e * r * f // 8) + e * f * r // 8 + e * r * d // 64
  assert per["lora_adapters_f32"] == 4 * layers * (attn + experts)
  # the frozen base in bf16 (2 B/param) beside 12 B per adapter param, vs 12 B/param
  assert per["lora_train_state"] < 0.25 * per["train_state"]
