"""LoRA adapters out as a PEFT adapter (rljax.model.lora_export) and merged into full
Hugging Face weights (hf_export of lora.merge): `peft.PeftModel.from_pretrained` on the
exported base gives our logits on the merged params; the merged export gives PEFT's (and
PEFT's own `merge_and_unload`'s) logits; a corrupted adapter file is caught; bad adapters
fail naming the weight."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
# test extras (pyproject [test]): plain imports, so a missing one fails the run
import peft
import torch
import transformers

import chex
import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from rljax.checkpoint import Checkpointer
from rljax.model import count_params
from rljax.model.hf_export import export_hf
from rljax.model.hf_import import load_hf_checkpoint, load_hf_params
from rljax.model.lora import DEFAULT_TARGETS, LoraConfig, init_adapters, merge
from rljax.model.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, export_peft,
                                     peft_tensors)
from rljax.numerics import Numerics
from rljax.pipeline.run import MODEL_ONLY, build
from rljax.rl import learner
from tests import test_hf_import as hf_test

# the HF twin's fixture: a random Qwen3-MoE (std 0.2 weights, norms away from 1; layer 0
# dense, layers 1-2 MoE) saved by transformers, and a fixed token batch
reference = hf_test.reference
_jitted_forward = hf_test._jitted_forward  # pylint: disable=protected-access
_check_routing = hf_test._check_routing  # pylint: disable=protected-access
# Everything runs in f32 on both sides; PEFT adds scale * B(A x) beside the base layer (or
# a delta to the fused experts) where we run x @ (W + scale * A @ B), so the logits differ
# by summation order only, as in test_hf_import: measured 7.6e-6 here (8e-6 there). ATOL is
# its 1e-4; each corruption below (one factor's ranks permuted, two experts' or gate/up
# factors swapped, one module's delta dropped) was measured to move the logits by 1.1 to 6.
ATOL = hf_test.ATOL
# The adapters' std: scale * sqrt(rank) * 0.15^2 ~ 0.09 per delta element, against base
# weights of std 0.2: the adapted model differs from the base by O(1) logits, so a target
# PEFT failed to adapt (or adapted wrongly) cannot hide under the tolerance.
ADAPTER_STD = 0.15
ROOT = pathlib.Path(__file__).resolve().parents[1]
FULL = LoraConfig(rank=4, alpha=8.0, targets=DEFAULT_TARGETS + ("moe.router",))
# PEFT warns (and leaves the module at its fresh init, B = 0) where a file lacks keys its
# config targets: here that is an export mistake, so it fails the test by name
pytestmark = pytest.mark.filterwarnings("error:Found missing adapter keys:UserWarning")


def _random_adapters(cfg, lora, seed=1):
  """Random A and B (a fresh B is zero, which would make every check trivial)."""
  leaves, tree = jax.tree.flatten(init_adapters(cfg, lora, jax.random.key(0)))
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [ADAPTER_STD * jax.random.normal(k, x.shape, x.dtype)
                                   for k, x in zip(keys, leaves)])


def _torch_logits(model, ref, router_logits=False):
  with torch.no_grad():
    out = model.eval()(input_ids=torch.from_numpy(ref["tokens"]).long(),
                       position_ids=torch.from_numpy(ref["positions"]).long(),
                       output_router_logits=router_logits)
  logits = out.logits.float().numpy()
  if router_logits:
    return logits, [r.float().numpy() for r in out.router_logits]
  return logits


def _hf_model(path):
  model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
  model.config._experts_implementation = "eager"  # the reference per-expert loop
  return model


def _peft_model(base_dir, adapter_dir):
  return peft.PeftModel.from_pretrained(_hf_model(base_dir), str(adapter_dir))


def _our_logits(cfg, params, ref):
  f32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
  logits, routing = _jitted_forward(f32, Numerics("fast"))(params, ref["tokens"],
                                                           ref["positions"])
  return np.asarray(logits), routing


def _max_diff(a, b):
  return float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def exported(reference, tmp_path_factory):
  """Our base (the reference's weights) and random FULL adapters, exported: the base by
  hf_export, the adapters by export_peft, their merge by hf_export."""
  cfg, base = load_hf_checkpoint(str(reference["dirs"]["save_pretrained"]), dtype="float32")
  adapters = _random_adapters(cfg, FULL)
  root = tmp_path_factory.mktemp("lora_export")
  dirs = {"base": root / "base", "adapter": root / "adapter", "merged": root / "merged"}
  export_hf(base, cfg, str(dirs["base"]))
  written = export_peft(adapters, cfg, FULL, str(dirs["adapter"]),
                        base_model_name_or_path=str(dirs["base"]))
  assert written == [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
  merged = merge(base, adapters, FULL)
  export_hf(merged, cfg, str(dirs["merged"]))
  return dict(cfg=cfg, base=base, adapters=adapters, merged=merged, dirs=dirs)


def test_peft_loads_the_adapter_onto_the_exported_base_with_our_logits(reference, exported):
  cfg, dirs = exported["cfg"], exported["dirs"]
  config = json.loads((dirs["adapter"] / ADAPTER_CONFIG).read_text())
  assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
  assert config["target_modules"] == ["down_proj", "gate", "gate_proj", "k_proj", "o_proj",
                                      "q_proj", "up_proj", "v_proj"]
  # layer 0 is dense: its MLP by parameter, which PEFT's expert conversion leaves alone
  assert config["target_parameters"] == ["mlp.down_proj.weight", "mlp.gate_proj.weight",
                                         "mlp.up_proj.weight"]
  tensors = load_file(str(dirs["adapter"] / ADAPTER_WEIGHTS))
  e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  # 3 layers x 4 attention + dense gate/up/down + 2 MoE layers x (router + E x 3), A and B
  assert len(tensors) == 2 * (3 * 4 + 3 + 2 * (1 + e * 3))
  ad = exported["adapters"]["layers"]
  pre = f"{PEFT_PREFIX}model.layers.2.mlp.experts.5"  # MoE stack entry 1, expert 5
  np.testing.assert_array_equal(tensors[f"{pre}.gate_proj.lora_A.weight"],
                                np.asarray(ad["moe"]["moe"]["gate"]["a"][1, :, 5, :]).T)
  np.testing.assert_array_equal(tensors[f"{pre}.down_proj.lora_B.weight"],
                                np.asarray(ad["moe"]["moe"]["down"]["b"][1, 5]).T)
  assert tensors[f"{pre}.up_proj.lora_B.weight"].shape == (f, 4)
  assert tensors[f"{PEFT_PREFIX}model.layers.0.mlp.down_proj.lora_A.weight"].shape == (
      4, cfg.intermediate_size)
  assert tensors[f"{PEFT_PREFIX}model.layers.1.mlp.gate.lora_B.weight"].shape == (e, 4)
  assert tensors[f"{PEFT_PREFIX}model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, d)

  model = _peft_model(dirs["base"], dirs["adapter"])
  hf_logits, router_logits = _torch_logits(model, reference, router_logits=True)
  logits, routing = _our_logits(cfg, exported["merged"], reference)
  # our experts are PEFT's top-k on every token, with a margin far above f32 noise
  _check_routing(dict(router_logits=router_logits), routing, cfg)
  diff = _max_diff(logits, hf_logits)
  base_logits, _ = _our_logits(cfg, exported["base"], reference)
  moved = _max_diff(base_logits, hf_logits)
  print(f"max |rljax(merged) - peft(base + adapter)| logits = {diff:.3g} "
        f"(the adapter moves them by {moved:.3g})")
  assert diff <= ATOL, diff
  assert moved > 1000 * ATOL, moved


def _corrupt(src, dst, edit):
  os.makedirs(dst)
  (dst / ADAPTER_CONFIG).write_text((src / ADAPTER_CONFIG).read_text())
  tensors = load_file(str(src / ADAPTER_WEIGHTS))
  edit(tensors)
  save_file(tensors, str(dst / ADAPTER_WEIGHTS), metadata={"format": "pt"})
  return dst


def _key(layer, module, factor):
  return f"{PEFT_PREFIX}model.layers.{layer}.{module}.lora_{factor}.weight"


def _permute_ranks(module):  # A's ranks reordered without B's (shape-preserving)
  def edit(t):
    t[_key(1, module, "A")] = t[_key(1, module, "A")][::-1].copy()
  return edit


def _swap(one, other):
  def edit(t):
    for factor in ("A", "B"):
      a, b = _key(2, one, factor), _key(2, other, factor)
      t[a], t[b] = t[b], t[a]
  return edit


def _drop(layer, module):
  def edit(t):
    t[_key(layer, module, "B")] = np.zeros_like(t[_key(layer, module, "B")])
  return edit


@pytest.mark.parametrize("name, edit", [
    ("attention A's ranks permuted", _permute_ranks("self_attn.q_proj")),
    ("two experts swapped", _swap("mlp.experts.2.down_proj", "mlp.experts.6.down_proj")),
    ("gate and up swapped", _swap("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj")),
    ("router dropped", _drop(1, "mlp.gate")),
    ("dense MLP dropped", _drop(0, "mlp.up_proj")),
])
def test_a_corrupted_adapter_is_caught_by_the_logits(reference, exported, tmp_path, name, edit):
  """The parity check can fail: every kind of target reaches the logits well above ATOL."""
  bad = _corrupt(exported["dirs"]["adapter"], tmp_path / "bad", edit)
  logits, _ = _our_logits(exported["cfg"], exported["merged"], reference)
  diff = _max_diff(logits, _torch_logits(_peft_model(exported["dirs"]["base"], bad), reference))
  print(f"{name}: max |rljax(merged) - peft(corrupted)| logits = {diff:.3g}")
  assert diff > 10 * ATOL, (name, diff)


def test_the_merged_export_is_peft_s_model_and_its_merge_and_unload(reference, exported):
  cfg, dirs = exported["cfg"], exported["dirs"]
  # hf_export of the merge: our merged params, bit for bit
  chex.assert_trees_all_equal(load_hf_params(str(dirs["merged"]), cfg, "float32"),
                              exported["merged"])
  merged_model = _hf_model(dirs["merged"])
  merged_logits = _torch_logits(merged_model, reference)
  peft_model = _peft_model(dirs["base"], dirs["adapter"])
  peft_logits = _torch_logits(peft_model, reference)
  unloaded = peft_model.merge_and_unload()
  unloaded_logits = _torch_logits(unloaded, reference)
  diffs = {"peft": _max_diff(merged_logits, peft_logits),
           "merge_and_unload": _max_diff(merged_logits, unloaded_logits)}
  print(f"max |transformers(merged export) - ...| logits = {diffs}")
  assert max(diffs.values()) <= ATOL, diffs
  # and PEFT's merged weights are ours (f32: a few ulps of |W| <= ~1.5, by summation order)
  ours = merged_model.state_dict()
  theirs = unloaded.state_dict()
  assert set(ours) == set(theirs)
  weight_diff = max(_max_diff(ours[k].numpy(), theirs[k].numpy()) for k in ours)
  print(f"max |merged export - merge_and_unload| weights = {weight_diff:.3g}")
  assert weight_diff <= 1e-6, weight_diff


def test_one_expert_projection_alone_exports_zero_partners_peft_can_fuse(reference, exported,
                                                                         tmp_path):
  # PEFT's fusion of the experts refuses up_proj without gate_proj, and loads gate/up
  # without down_proj under the wrong key (missing keys: the experts unadapted): the export
  # adds gate's and down's factors as zeros (an exact zero delta). The dense MLP's down
  # alone is a parameter target.
  lora = LoraConfig(rank=2, alpha=3.0, targets=("moe.up", "mlp.down", "attn.v"))
  cfg, base = exported["cfg"], exported["base"]
  adapters = _random_adapters(cfg, lora, seed=2)
  export_peft(adapters, cfg, lora, str(tmp_path / "adapter"))
  config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
  assert config["lora_alpha"] == 3 and config["target_parameters"] == ["mlp.down_proj.weight"]
  assert config["target_modules"] == ["down_proj", "gate_proj", "up_proj", "v_proj"]
  tensors = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
  for module in ("mlp.experts.0.gate_proj", "mlp.experts.7.down_proj"):
    assert not any(tensors[_key(2, module, f)].any() for f in "AB")
  assert tensors[_key(2, "mlp.experts.7.up_proj", "B")].any()
  hf_logits = _torch_logits(_peft_model(exported["dirs"]["base"], tmp_path / "adapter"),
                            reference)
  logits, _ = _our_logits(cfg, merge(base, adapters, lora), reference)
  diff = _max_diff(logits, hf_logits)
  print(f"moe.up + mlp.down + attn.v: max |rljax - peft| logits = {diff:.3g}")
  assert diff <= ATOL, diff


def test_bad_adapters_fail_naming_the_weight(exported, tmp_path):
  cfg, adapters = exported["cfg"], exported["adapters"]
  with pytest.raises(ValueError, match=r"lora targets \['attn.qkv'\] are not among"):
    LoraConfig(targets=("attn.q", "attn.qkv"))
  no_router = LoraConfig(rank=4, alpha=8.0, targets=DEFAULT_TARGETS)
  with pytest.raises(ValueError, match=r"adapters hold \['moe.router \(moe layers, factor A\)'"
                     r".*not adapters of lora.targets"):
    export_peft(adapters, cfg, no_router, str(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"adapters lack \['moe.router \(moe layers, factor A\)'"):
    peft_tensors(_random_adapters(cfg, no_router), cfg, FULL)
  rank8 = dataclasses.replace(FULL, rank=8)
  with pytest.raises(ValueError, match=r"adapter attn.k \(dense layers, factor A\) has shape "
                     r"\(1, 64, 4\); rank 8 in this model config expects \(1, 64, 8\)"):
    export_peft(adapters, cfg, rank8, str(tmp_path / "b"))
  transposed = jax.tree.map(lambda x: x, adapters)
  a = transposed["layers"]["moe"]["attn"]["q"]["a"]
  transposed["layers"]["moe"]["attn"]["q"]["a"] = a.transpose(0, 2, 1)
  with pytest.raises(ValueError, match=r"adapter attn.q \(moe layers, factor A\) has shape "
                     r"\(2, 4, 64\); .* expects \(2, 64, 4\)"):
    export_peft(transposed, cfg, FULL, str(tmp_path / "c"))
  with pytest.raises(ValueError, match="adapters must be"):
    export_peft(adapters["layers"], cfg, FULL, str(tmp_path / "d"))
  assert not any((tmp_path / n).exists() for n in "abcd")  # nothing written on bad input
  export_peft(adapters, cfg, FULL, str(tmp_path / "e"))
  with pytest.raises(FileExistsError, match="already holds an adapter"):
    export_peft(adapters, cfg, FULL, str(tmp_path / "e"))


def _export_hf(*args):
  return subprocess.run([sys.executable, str(ROOT / "experiments" / "export_hf.py"), *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_export_hf_peft_writes_a_lora_trainer_checkpoint_s_adapters(tmp_path):
  # experiments/export_hf.py --peft on a config.lora trainer's checkpoint (its train state:
  # the adapters' masters, moments, step): the adapters the state holds, as export_peft
  # writes them, naming --base_model; without --base_model, a run whose base is no HF
  # checkpoint (arith_tiny: random init, SFT warm start) is refused
  config_file = tmp_path / "arith_tiny_lora_r2.py"
  config_file.write_text(textwrap.dedent("""
      import ml_collections
      from configs import arith_tiny

      def get_config():
        c = arith_tiny.get_config()
        c.lora = ml_collections.ConfigDict(
            dict(rank=2, alpha=4.0, targets=("attn.q", "moe.gate", "moe.router")))
        return c
      """))
  spec = importlib.util.spec_from_file_location("arith_tiny_lora_r2", config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  built = build(module.get_config(), MODEL_ONLY + ("rl",), devices=False)
  adapters = _random_adapters(built.cfg, built.lora, seed=3)
  checkpoints = tmp_path / "trainer" / "checkpoints"
  with Checkpointer(str(checkpoints), keep_last=1, async_save=False) as ckpt:
    ckpt.save(3, {"state": learner.init_state(adapters, built.rl_optimizer())},
              stream_version=3)
  common = [f"--config={config_file}", f"--checkpoint={checkpoints}", "--peft"]
  proc = _export_hf(*common, "--base_model=/models/base_hf", f"--out={tmp_path / 'peft'}")
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["files"] == [ADAPTER_WEIGHTS, ADAPTER_CONFIG] and out["dtype"] == "float32"
  assert out["adapter_params"] == count_params(adapters)
  config = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
  assert config["base_model_name_or_path"] == "/models/base_hf" and config["r"] == 2
  chex.assert_trees_all_equal(load_file(str(tmp_path / "peft" / ADAPTER_WEIGHTS)),
                              peft_tensors(adapters, built.cfg, built.lora))
  proc = _export_hf(*common, f"--out={tmp_path / 'refused'}")
  assert proc.returncode != 0 and "--peft: the run's frozen base is not an HF checkpoint" in (
      proc.stderr), proc.stderr[-4000:]
  assert not (tmp_path / "refused").exists()
