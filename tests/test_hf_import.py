"""The Hugging Face Qwen3-MoE importer and exporter: logits parity with transformers'
Qwen3MoeForCausalLM for both expert layouts, clear errors for checkpoints that do not match,
and exports that re-import bit for bit and that transformers loads with the same logits."""

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
# test extras (pyproject [test]): plain imports, so a missing one fails the run instead of
# skipping the strongest oracle silently
import torch
import transformers

import chex
import jax  # (rljax, imported by conftest, installs the XLA flags first)
import numpy as np
from safetensors.numpy import load_file, save_file

from rljax.envs.tokenizer import CharTokenizer
from rljax.model import forward
from rljax.model.hf_export import export_hf, hf_tensors
from rljax.model.hf_import import (config_from_hf, hf_config_kwargs, load_hf_checkpoint,
                                   load_hf_params)
from rljax.numerics import Numerics

HF_CONFIG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=[0],
                 norm_topk_prob=True, max_position_embeddings=256,
                 # not transformers' defaults (1e4, 1e-6), so parity checks that they are read
                 rope_theta=1e6, rms_norm_eps=1e-5)
SEED = 0
BATCH, LENGTH = 2, 40
# Everything runs in f32 on both sides, so logits differ only by summation order (XLA vs
# torch matmuls, softmax and RMSNorm reductions; the deterministic mode's tree sums) and
# by RoPE cos/sin, which rope_table takes in f64 of f32 angles and torch in f32 (<= 1 ulp).
# With weights of std 0.2 the logits reach ~6 and the measured max diff is ~8e-6 in both
# modes (a few f32 ulps of the logits); 1e-4 leaves a wide margin, while a mapping error
# (swapped gate/up, q/k norms or experts, wrong rope_theta, norm_topk_prob or
# rms_norm_eps 1e-6 vs 1e-5) was measured to move the logits by 8e-4 to 4.
ATOL = 1e-4
# A near-tie between the k-th and (k+1)-th router probability could flip an expert choice
# under f32 reordering, and the logits would then differ by O(1) for a correct import.
# The test asserts that our routing equals HF's top-k on every token and that SEED has a
# margin well above f32 noise (it is deterministic: the same seed, the same margin), so a
# failure can never be a near-tie flake.
MIN_ROUTER_MARGIN = 1e-4


def _hf_model():
  cfg = transformers.Qwen3MoeConfig(**HF_CONFIG)
  cfg._attn_implementation = "eager"
  cfg._experts_implementation = "eager"  # the reference per-expert loop
  torch.manual_seed(SEED)
  model = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for _, p in model.named_parameters():
      if p.ndim >= 2:  # std 0.2: sharp attention and clearly non-uniform routing
        p.normal_(0.0, 0.2)
      else:  # norm scales away from 1, so a misplaced norm weight shows
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The HF model saved in each layout, with its logits and routing on a fixed batch."""
  model = _hf_model()
  root = tmp_path_factory.mktemp("hf")
  dirs = {"save_pretrained": root / "hub", "save_pretrained_fused": root / "fused",
          "handwritten_per_expert": root / "manual"}
  # transformers 5 reverts its fused in-memory experts to the hub's per-expert keys by
  # default (save_original_format=True); save_original_format=False keeps the fused tensors.
  model.save_pretrained(dirs["save_pretrained"])
  model.save_pretrained(dirs["save_pretrained_fused"], save_original_format=False)
  _write_per_expert_by_hand(model, dirs["handwritten_per_expert"], dirs["save_pretrained"])

  rng = np.random.default_rng(SEED)
  tokens = rng.integers(0, HF_CONFIG["vocab_size"], size=(BATCH, LENGTH)).astype(np.int32)
  positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (BATCH, LENGTH)).copy()
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(),
                position_ids=torch.from_numpy(positions).long(), output_router_logits=True)
  router_logits = [r.float().numpy() for r in out.router_logits]  # per MoE layer [B*T, E]
  return dict(dirs=dirs, tokens=tokens, positions=positions, logits=out.logits.float().numpy(),
              router_logits=router_logits, state_dict=_numpy_state_dict(model))


def _numpy_state_dict(model):
  return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def _write_per_expert_by_hand(model, out_dir, config_src):
  """The hub layout, written from the in-memory fused tensors without transformers' saver."""
  os.makedirs(out_dir)
  shutil.copy(config_src / "config.json", out_dir / "config.json")
  f = HF_CONFIG["moe_intermediate_size"]
  tensors = {}
  for k, v in _numpy_state_dict(model).items():
    if k.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows, then up rows
      pre = k[:-len("gate_up_proj")]
      for e in range(v.shape[0]):
        tensors[f"{pre}{e}.gate_proj.weight"] = np.ascontiguousarray(v[e, :f])
        tensors[f"{pre}{e}.up_proj.weight"] = np.ascontiguousarray(v[e, f:])
    elif k.endswith("mlp.experts.down_proj"):  # [E, D, F]
      pre = k[:-len("down_proj")]
      for e in range(v.shape[0]):
        tensors[f"{pre}{e}.down_proj.weight"] = np.ascontiguousarray(v[e])
    else:
      tensors[k] = v
  # two shards, to exercise reading every file in the directory
  names = sorted(tensors)
  save_file({k: tensors[k] for k in names[::2]}, str(out_dir / "model-00001-of-00002.safetensors"))
  save_file({k: tensors[k] for k in names[1::2]}, str(out_dir / "model-00002-of-00002.safetensors"))


@functools.lru_cache(maxsize=None)
def _jitted_forward(cfg, numerics):
  def run(params, tokens, positions):
    out = forward(params, tokens, positions, cfg=cfg.resolved(jax.default_backend(), numerics),
                  numerics=numerics, segment_ids=None)
    return out.logits, out.routing
  return jax.jit(run)


def _check_routing(ref, routing, cfg):
  """Our chosen experts equal HF's top-k on every token of every MoE layer."""
  k = cfg.num_experts_per_tok
  routing = np.asarray(routing).reshape(BATCH * LENGTH, len(cfg.moe_layers()), k)
  for j, logits in enumerate(ref["router_logits"]):
    probs = torch.softmax(torch.from_numpy(logits), dim=-1).numpy()
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(probs, order, axis=-1)
    margin = (sorted_probs[:, k - 1] - sorted_probs[:, k]).min()
    assert margin > MIN_ROUTER_MARGIN, (
        f"MoE layer {j}: near-tie routing (margin {margin}), pick another SEED")
    np.testing.assert_array_equal(np.sort(routing[:, j], axis=-1), np.sort(order[:, :k], axis=-1),
                                  err_msg=f"MoE layer {j}: routing differs from HF")


@pytest.mark.parametrize("layout", ["save_pretrained", "save_pretrained_fused",
                                    "handwritten_per_expert"])
@pytest.mark.parametrize("mode", ["fast", "deterministic"])
def test_logits_match_transformers(reference, layout, mode):
  cfg, params = load_hf_checkpoint(str(reference["dirs"][layout]), dtype="float32",
                                   param_dtype="float32", compute_dtype="float32")
  assert cfg.dtype == "float32" and cfg.param_dtype == "float32"
  assert len(cfg.moe_layers()) == 2 and cfg.dense_layers() == (0,)
  logits, routing = _jitted_forward(cfg, Numerics(mode))(params, reference["tokens"],
                                                          reference["positions"])
  _check_routing(reference, routing, cfg)
  diff = np.abs(np.asarray(logits) - reference["logits"]).max()
  print(f"{layout} {mode}: max |logits - HF logits| = {diff:.3g}")
  assert diff <= ATOL, diff


def test_layouts_give_identical_params(reference):
  trees = [load_hf_checkpoint(str(d), dtype="float32")[1] for d in reference["dirs"].values()]
  for other in trees[1:]:
    jax.tree.map(np.testing.assert_array_equal, trees[0], other)
  # and the mapping itself, spot-checked against the torch tensors
  sd, p = reference["state_dict"], trees[0]
  f = HF_CONFIG["moe_intermediate_size"]
  # layers 1, 2 are entries 0, 1 of the MoE stack; layer 0 entry 0 of the dense stack
  np.testing.assert_array_equal(p["layers"]["moe"]["moe"]["gate"][0, :, 3, :],
                                sd["model.layers.1.mlp.experts.gate_up_proj"][3, :f].T)
  np.testing.assert_array_equal(p["layers"]["moe"]["moe"]["down"][1, 5],
                                sd["model.layers.2.mlp.experts.down_proj"][5].T)
  np.testing.assert_array_equal(p["layers"]["dense"]["mlp"]["down"][0],
                                sd["model.layers.0.mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(p["lm_head"]["kernel"], sd["lm_head.weight"].T)


def _rewrite(src, dst, edit):
  os.makedirs(dst)
  shutil.copy(src / "config.json", dst / "config.json")
  tensors = load_file(str(src / "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(dst / "model.safetensors"))
  return str(dst)


def test_missing_and_unexpected_tensors_raise(reference, tmp_path):
  src = reference["dirs"]["save_pretrained"]
  missing = _rewrite(src, tmp_path / "missing",
                     lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
  with pytest.raises(ValueError, match=r"missing tensors \(1\).*experts\.5\.up_proj"):
    load_hf_checkpoint(missing)

  def add(t):
    t["model.layers.1.mlp.shared_expert.up_proj.weight"] = np.zeros((4, 64), np.float32)
  extra = _rewrite(src, tmp_path / "extra", add)
  with pytest.raises(ValueError, match=r"unexpected tensors \(1\).*shared_expert\.up_proj"):
    load_hf_checkpoint(extra)

  def reshape(t):
    t["model.norm.weight"] = np.ones((65,), np.float32)
  wrong = _rewrite(src, tmp_path / "wrong_shape", reshape)
  with pytest.raises(ValueError, match=r"1 tensors .* model\.norm\.weight in model\.safetensors: "
                     r"\(65,\), the config \(hidden_size 64.*expects \(64,\)"):
    load_hf_checkpoint(wrong)


def test_bad_checkpoint_directories_fail_naming_the_file(reference, tmp_path):
  src = reference["dirs"]["save_pretrained"]
  cfg, params = load_hf_checkpoint(str(src), dtype="float32")
  sharded = tmp_path / "sharded"
  export_hf(params, cfg, str(sharded), max_shard_bytes=100_000)
  index = json.loads((sharded / "model.safetensors.index.json").read_text())
  gone = sorted(set(index["weight_map"].values()))[1]
  shutil.copytree(sharded, tmp_path / "missing")
  os.remove(tmp_path / "missing" / gone)
  with pytest.raises(FileNotFoundError, match=f"{gone} is listed in .*index.json but missing"):
    load_hf_checkpoint(str(tmp_path / "missing"))
  shutil.copytree(sharded, tmp_path / "adapter")
  save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "adapter" / "adapter_model.safetensors"))
  with pytest.raises(ValueError, match="adapter_model.safetensors is a PEFT adapter"):
    load_hf_checkpoint(str(tmp_path / "adapter"))
  key = next(iter(index["weight_map"]))
  index["weight_map"][key] = gone if index["weight_map"][key] != gone else "other.safetensors"
  shutil.copytree(sharded, tmp_path / "misfiled")
  (tmp_path / "misfiled" / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match="does not match its files: 1 tensors"):
    load_hf_checkpoint(str(tmp_path / "misfiled"))
  # a stray file that is not the model's is not read: the index (or model.safetensors) rules
  save_file({"x": np.zeros(2, np.float32)}, str(sharded / "optimizer.safetensors"))
  chex.assert_trees_all_equal(load_hf_checkpoint(str(sharded), dtype="float32")[1], params)


@pytest.mark.parametrize("layout", ["save_pretrained", "save_pretrained_fused"])
def test_every_slice_of_a_param_reads_as_the_slice_of_the_whole(reference, layout):
  # what each device's callback asks for when the params load sharded: only its slice
  from rljax.model import hf_import  # pylint: disable=g-import-not-at-top
  path = str(reference["dirs"][layout])
  cfg, whole = load_hf_checkpoint(path, dtype="float32")
  reader = hf_import._Reader(path)  # pylint: disable=protected-access
  recipes = hf_import._recipes(cfg, set(reader.where))  # pylint: disable=protected-access
  rng = np.random.default_rng(0)
  is_recipe = hf_import._is_recipe  # pylint: disable=protected-access
  for recipe, x in zip(jax.tree.leaves(recipes, is_leaf=is_recipe), jax.tree.leaves(whole)):
    for _ in range(3):
      index = []
      for n in x.shape:
        a = int(rng.integers(0, n))
        index.append(slice(a, int(rng.integers(a + 1, n + 1))))
      index = tuple(index)
      np.testing.assert_array_equal(recipe.read(reader.read, index), np.asarray(x)[index])


def test_a_1gb_checkpoint_loads_onto_8_devices_without_a_whole_copy_in_memory(tmp_path):
  """Each device's shard is read from the files straight into place: host memory peaks
  less than twice the largest tensor above the baseline plus the shards themselves (on a
  CPU the devices' memory is host memory)."""
  worker = [sys.executable, str(pathlib.Path(__file__).parent / "hf_load_worker.py")]
  for mode in ("write", "load"):
    proc = subprocess.run(worker + [mode, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  print("sharded load of a 1.1 GB checkpoint:", out)
  assert out["sharded_as_asked"] and out["equal_to_unsharded_load"]
  assert out["peak_above_baseline_and_shards"] < 2 * out["largest_tensor"], out


def test_bf16_checkpoint(reference, tmp_path):
  """bf16 tensors (which safetensors' numpy framework cannot return) load exactly."""
  from safetensors.torch import save_file as torch_save_file
  src = reference["dirs"]["save_pretrained"]
  os.makedirs(tmp_path / "bf16")
  shutil.copy(src / "config.json", tmp_path / "bf16" / "config.json")
  tensors = {k: torch.from_numpy(v).to(torch.bfloat16)
             for k, v in load_file(str(src / "model.safetensors")).items()}
  torch_save_file(tensors, str(tmp_path / "bf16" / "model.safetensors"))
  cfg, params = load_hf_checkpoint(str(tmp_path / "bf16"), dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16" and cfg.dtype == "bfloat16"
  q = params["layers"]["moe"]["attn"]["q"][0]  # layer 1
  assert q.dtype == jax.numpy.bfloat16
  want = tensors["model.layers.1.self_attn.q_proj.weight"].float().numpy().T
  np.testing.assert_array_equal(np.asarray(q, np.float32), want)
  _, params32 = load_hf_checkpoint(str(tmp_path / "bf16"), dtype="float32")
  np.testing.assert_array_equal(
      np.asarray(params32["layers"]["moe"]["moe"]["up"]),
      np.asarray(params["layers"]["moe"]["moe"]["up"], np.float32))


BASE_JSON = dict(HF_CONFIG, num_local_experts=8)
del BASE_JSON["num_experts"]


def test_config_from_hf():
  cfg = config_from_hf(dict(BASE_JSON, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1e6}))
  assert (cfg.num_experts, cfg.rope_theta, cfg.head_dim, cfg.mlp_only_layers) == (8, 1e6, 16, (0,))
  # transformers 4.x: top-level rope_theta, rope_scaling null
  hf4 = dict(HF_CONFIG, rope_theta=5e5, rope_scaling=None)
  hf4.pop("head_dim")
  cfg = config_from_hf(hf4, page_size=8)
  assert (cfg.rope_theta, cfg.head_dim, cfg.page_size) == (5e5, 16, 8)
  cfg = config_from_hf(dict(HF_CONFIG, rope_scaling={"rope_type": "default"}))
  assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.norm_topk_prob) == (1e6, 1e-5, True)
  # keys left out take transformers' Qwen3MoeConfig defaults
  bare = {k: v for k, v in BASE_JSON.items() if k not in ("rope_theta", "norm_topk_prob")}
  cfg = config_from_hf(bare)
  assert (cfg.rope_theta, cfg.norm_topk_prob) == (1e4, False)


@pytest.mark.parametrize("bad, message", [
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "unsupported RoPE scaling type 'yarn'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "unsupported RoPE scaling type 'linear'"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_config_from_hf_rejects(bad, message):
  with pytest.raises(ValueError, match=message):
    config_from_hf(dict(BASE_JSON, **bad))


def test_tied_embeddings(reference, tmp_path):
  """A tied checkpoint without lm_head loads; one whose stored head differs is rejected."""
  src = reference["dirs"]["save_pretrained"]
  dst = tmp_path / "tied"
  os.makedirs(dst)
  hf = json.loads((src / "config.json").read_text())
  (dst / "config.json").write_text(json.dumps(dict(hf, tie_word_embeddings=True)))
  tensors = load_file(str(src / "model.safetensors"))
  head = tensors.pop("lm_head.weight")
  save_file(tensors, str(dst / "model.safetensors"))
  cfg, params = load_hf_checkpoint(str(dst))
  assert cfg.tie_word_embeddings and "lm_head" not in params
  save_file(dict(tensors, **{"lm_head.weight": head}), str(dst / "model.safetensors"))
  with pytest.raises(ValueError, match="lm_head.weight differs"):
    load_hf_checkpoint(str(dst))


def test_hf_config_kwargs_round_trips():
  from configs import tiny_moe  # pylint: disable=g-import-not-at-top
  from rljax.model import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.from_dict(tiny_moe.get_config().model.to_dict())
  hf = transformers.Qwen3MoeConfig(**hf_config_kwargs(cfg))
  back = config_from_hf(hf.to_dict(), dtype=cfg.dtype, param_dtype=cfg.param_dtype)
  assert back == cfg


def test_export_round_trips_bitwise_and_transformers_reloads_it(reference, tmp_path):
  cfg, params = load_hf_checkpoint(str(reference["dirs"]["save_pretrained"]), dtype="float32")
  # our own weights (not the file's): every tensor moved, so a copied input would fail
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda x: x + rng.normal(0, 0.01, x.shape).astype(np.float32), params)
  out, tokenizer_dir = tmp_path / "export", tmp_path / "tok"
  char = CharTokenizer()
  char.to_hf(cfg.vocab_size).save_pretrained(tokenizer_dir)  # a tokenizer directory
  # 40 KB shards: the tiny model's 0.36 MB spread over several files and an index
  written = export_hf(params, cfg, str(out), max_shard_bytes=40_000,
                      tokenizer_dir=str(tokenizer_dir),
                      config_extra={"eos_token_id": 1, "pad_token_id": 0})
  shards = sorted(p.name for p in out.glob("model-*.safetensors"))
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert len(shards) > 3 and sorted(set(index["weight_map"].values())) == shards
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in hf_tensors(params, cfg).values())
  assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(written)
  chex.assert_trees_all_equal(load_hf_params(str(out), cfg, "float32"), params)

  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  model.config._experts_implementation = "eager"
  assert transformers.AutoTokenizer.from_pretrained(str(out))("12+3")["input_ids"] == [
      char.bos_id, *char.encode("12+3")]
  with torch.no_grad():
    hf_logits = model.eval()(input_ids=torch.from_numpy(reference["tokens"]).long(),
                             position_ids=torch.from_numpy(reference["positions"]).long()
                             ).logits.numpy()
  f32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
  logits, _ = _jitted_forward(f32, Numerics("fast"))(params, reference["tokens"],
                                                      reference["positions"])
  diff = np.abs(np.asarray(logits) - hf_logits).max()
  print(f"export: max |logits - transformers(export) logits| = {diff:.3g}")
  assert diff <= ATOL, diff  # ATOL: see its comment (a mapping error moves logits >= 8e-4)


def test_bf16_export_round_trips_bitwise_and_refuses_to_overwrite(reference, tmp_path):
  cfg, params = load_hf_checkpoint(str(reference["dirs"]["save_pretrained"]), dtype="bfloat16")
  out = tmp_path / "bf16"
  assert export_hf(params, cfg, str(out)) == ["model.safetensors", "config.json"]
  assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
  chex.assert_trees_all_equal(load_hf_params(str(out), cfg, "bfloat16"), params)
  with pytest.raises(FileExistsError, match="already holds a checkpoint"):
    export_hf(params, cfg, str(out))
  with pytest.raises(ValueError, match="structure"):
    export_hf({"embed": params["embed"]}, cfg, str(tmp_path / "partial"))


def test_init_from_an_hf_checkpoint_takes_its_architecture_and_weights(reference, tmp_path,
                                                                       monkeypatch):
  import ml_collections  # pylint: disable=g-import-not-at-top
  from configs import arith_tiny  # pylint: disable=g-import-not-at-top
  from rljax.pipeline import core  # pylint: disable=g-import-not-at-top
  from rljax.pipeline.run import LOCKSTEP, ConfigError, build  # pylint: disable=g-import-not-at-top
  src = str(reference["dirs"]["save_pretrained"])
  config = arith_tiny.get_config()
  config.init_from = f"hf:{src}"
  config.model = ml_collections.ConfigDict(dict(page_size=16, remat=False))  # backend only
  config.log.tensorboard = False
  monkeypatch.setattr(core, "init_sharded", lambda *a, **k: pytest.fail("random init ran"))
  run = core.setup(build(config, LOCKSTEP), str(tmp_path / "run"), engine=False)
  cfg, want = load_hf_checkpoint(src, dtype="float32")
  assert run.cfg.hidden_size == cfg.hidden_size == 64 and run.cfg.rms_norm_eps == 1e-5
  chex.assert_trees_all_equal(run.state.params, want)

  config.model.hidden_size = 128
  with pytest.raises(ConfigError, match=r"hidden_size=128 \(the checkpoint's: 64\)"):
    build(config, LOCKSTEP)
  del config.model["hidden_size"]
  config.init_from = src  # no scheme
  with pytest.raises(ConfigError, match="expected 'hf:/path/to/checkpoint_dir'"):
    build(config, LOCKSTEP)
  config.init_from = f"hf:{tmp_path / 'nowhere'}"
  with pytest.raises(ConfigError, match="nowhere/config.json"):
    build(config, LOCKSTEP)


# A Qwen3-MoE of another shape than any config's: head_dim not hidden / heads, 3 KV heads,
# its second layer dense (mlp_only_layers), another rope_theta, a 320-id vocabulary
ODD_SHAPE = dict(vocab_size=320, hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=3, head_dim=20, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=24, intermediate_size=40, mlp_only_layers=[1],
                 norm_topk_prob=True, max_position_embeddings=512, rope_theta=5e5,
                 rms_norm_eps=1e-5)


def test_a_checkpoint_of_any_shape_runs_with_only_init_from_data_and_reward(tmp_path):
  """configs/qwen3_30b_a3b.py:tiny takes the architecture and the stop tokens from the
  checkpoint; an override that disagrees names every differing field at once; rows
  without an answer need SFT off only."""
  from configs import qwen3_30b_a3b  # pylint: disable=g-import-not-at-top
  from rljax.envs.tokenizer import train_byte_level_bpe  # pylint: disable=g-import-not-at-top
  from rljax.pipeline.run import ASYNC_TRAINER, ConfigError, build  # pylint: disable=g-import-not-at-top
  ckpt = tmp_path / "odd"
  rows = [{"question": f"What is {i} plus {2 * i}?", "id": str(i)} for i in range(40)]
  train_byte_level_bpe([r["question"] for r in rows] * 3, str(ckpt), vocab_size=320)
  tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
  stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
  torch.manual_seed(SEED)
  model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
      **ODD_SHAPE, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
  model.generation_config.eos_token_id = stops
  model.float().eval().save_pretrained(str(ckpt))
  data = tmp_path / "rows.jsonl"  # no answer field
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))

  config = qwen3_30b_a3b.get_config("tiny")
  config.init_from = f"hf:{ckpt}"
  config.env.kwargs.path = str(data)
  config.env.kwargs.reward_fn = "rljax.envs.math_answer:reward_fn"
  built = build(config, ASYNC_TRAINER, devices=False)
  cfg = built.cfg
  assert {k: getattr(cfg, k) for k in ODD_SHAPE} == {**ODD_SHAPE, "mlp_only_layers": (1,)}
  assert cfg.dense_layers() == (1,) and cfg.page_size == 16  # the config's backend field
  # the stop tokens: the tokenizer's EOS, then generation_config.json's eos_token_ids
  assert built.env.stop_ids == tuple(stops) and built.env.tokenizer.eos_id == stops[0]
  assert not built.env.has_sft_targets  # and SFT is off: fine
  built.env.close()

  # the checkpoint runs as transformers runs it (f32 logits; odd head_dim, GQA 6:3)
  params = load_hf_params(str(ckpt), cfg, "float32")
  tokens = np.asarray([tok.encode(rows[3]["question"])], np.int32)
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  f32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
  logits, _ = _jitted_forward(f32.resolved("cpu", "fast"), Numerics("fast"))(params, tokens,
                                                                             positions)
  model.config._experts_implementation = "eager"  # pylint: disable=protected-access
  with torch.no_grad():
    hf_logits = model(input_ids=torch.from_numpy(tokens).long()).logits.numpy()
  assert np.abs(np.asarray(logits) - hf_logits).max() <= ATOL

  # an override that agrees is fine; disagreeing ones are named together, with the
  # checkpoint's values
  config.model.head_dim = 20
  build(config, ("model",), devices=False)
  config.model.update(dict(hidden_size=64, num_key_value_heads=2, rope_theta=1e6,
                           mlp_only_layers=(0,)))
  with pytest.raises(ConfigError, match="sets 4 architecture field") as e:
    build(config, ("model",), devices=False)
  for field in ("hidden_size=64 (the checkpoint's: 48)", "num_key_value_heads=2 (the "
                "checkpoint's: 3)", "rope_theta=1000000.0 (the checkpoint's: 500000.0)",
                "mlp_only_layers=(0,) (the checkpoint's: (1,))"):
    assert field in str(e.value), field
  # without init_from the tiny config has no architecture, and says so
  config = qwen3_30b_a3b.get_config("tiny")
  config.init_from = ""
  with pytest.raises(ConfigError, match=r"config.model.\{.*hidden_size.*\} unset: without "
                     "init_from"):
    build(config, ("model",), devices=False)
  # SFT needs the answers the rows lack
  config = qwen3_30b_a3b.get_config("tiny")
  config.init_from = f"hf:{ckpt}"
  config.env.kwargs.path = str(data)
  config.sft.steps = 5
  with pytest.raises(ConfigError, match=r"no SFT targets \(40 of 40 rows of .* have no text "
                     "answer field 'answer'"):
    build(config, ASYNC_TRAINER, devices=False)
