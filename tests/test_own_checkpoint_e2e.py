"""Your own checkpoint, data and reward in; the trained model out, end to end.

A tiny random Qwen3-MoE written by `transformers`, with a byte-level BPE tokenizer and its
chat template in the same directory (examples/make_tiny_hf_checkpoint.py); the shipped
examples/gsm_tiny/train.jsonl scored by `rljax.envs.math_answer:reward_fn` in a verifier
process; GRPO through the async pipeline (experiments/pipeline.py on
configs/qwen3_30b_a3b.py:tiny, one rollout-host process); experiments/export_hf.py on the
run's final train state (its tokenizer taken from the config); `transformers` reloads the
export, and its logits are rljax's.
"""

import dataclasses
import importlib.util
import json
import pathlib
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
# test extras (pyproject [test])
import torch
import transformers

from configs import qwen3_30b_a3b
from rljax.checkpoint import Checkpointer
from rljax.model import abstract_params, forward
from rljax.model.hf_import import load_hf_params
from rljax.numerics import Numerics
from rljax.pipeline.metrics import read_jsonl
from rljax.pipeline.run import MODEL_ONLY, build
from rljax.rl import learner

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = "--config=configs/qwen3_30b_a3b.py:tiny"
# f32 on both sides: the logits differ by summation order only (test_hf_import measured
# ~8e-6 at larger weights; a mapping error moves them by >= 8e-4)
ATOL = 1e-4


def _make_checkpoint(directory: pathlib.Path) -> None:
  path = ROOT / "examples" / "make_tiny_hf_checkpoint.py"
  spec = importlib.util.spec_from_file_location("make_tiny_hf_checkpoint", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.main(str(directory))


def _run(script: str, *args: str) -> dict:
  proc = subprocess.run([sys.executable, str(ROOT / "experiments" / script), *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _final_params(config, checkpoints: str):
  """The trainer's last train state's f32 params (as export_hf.py restores them)."""
  built = build(config, MODEL_ONLY + ("rl",), devices=False)
  optimizer = built.rl_optimizer()
  params = abstract_params(built.cfg, jnp.float32)
  target = learner.TrainState(params, jax.eval_shape(optimizer.init, params),
                              jax.ShapeDtypeStruct((), jnp.int32))
  with Checkpointer(checkpoints, keep_last=1) as ckpt:
    return built.cfg, ckpt.restore({"state": target}).state["state"].params


def test_hf_checkpoint_jsonl_and_reward_in_grpo_async_then_export_loads_in_transformers(
    tmp_path):
  hf_dir, workdir, out = tmp_path / "tiny_qwen3_moe", tmp_path / "run", tmp_path / "export"
  _make_checkpoint(hf_dir)
  init_from = f"--config.init_from=hf:{hf_dir}"
  # A random policy never writes a right answer: every reward is 0 and so is every
  # advantage. Weight decay still moves the weights, so the export shows it holds the
  # trained state and not the checkpoint the run started from.
  summary = _run("pipeline.py", CONFIG, init_from, f"--workdir={workdir}", "--progress=false",
                 "--config.rl.weight_decay=0.1")
  assert summary["env"] == "dataset" and summary["updates"] == 3
  assert summary["host_exit_codes"] == [0] and summary["queue"]["trained"] == 3 * 2
  updates = [r for r in read_jsonl(str(workdir / "metrics.jsonl")) if r["phase"] == "async"]
  assert len(updates) == 3
  # every completion was scored by the reward_fn (a failing verifier is an infra failure)
  assert all(r["infra_failures"] == 0 and r["completion_tokens_mean"] > 0 for r in updates)

  # the export's tokenizer defaults to the config's (init_from's directory)
  exported = _run("export_hf.py", CONFIG, init_from, f"--checkpoint={summary['checkpoints']}",
                  f"--out={out}", "--dtype=float32")
  assert {"tokenizer.json", "config.json"} <= set(exported["files"])
  messages = [{"role": "user", "content": "What is 12+30?"}]
  prompts = [transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True) for d in (out, hf_dir)]
  assert prompts[0] == prompts[1] and prompts[0].endswith("<|im_start|>assistant\n")

  config = qwen3_30b_a3b.get_config("tiny")
  config.init_from = f"hf:{hf_dir}"
  cfg, final = _final_params(config, summary["checkpoints"])
  chex.assert_trees_all_equal(load_hf_params(str(out), cfg, "float32"), final)
  started = load_hf_params(str(hf_dir), cfg, "float32")
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, started, final)))

  tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
  tokens = np.asarray(tokenizer(prompts[0] + "The answer is 42. #### 42")["input_ids"],
                      np.int32)[None]
  positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
  model.config._experts_implementation = "eager"  # the reference per-expert loop
  with torch.no_grad():
    hf_logits = model.eval()(input_ids=torch.from_numpy(tokens).long(),
                             position_ids=torch.from_numpy(positions).long()).logits.numpy()
  f32 = dataclasses.replace(cfg, dtype="float32", param_dtype="float32")
  logits = forward(final, tokens, positions, cfg=f32.resolved(jax.default_backend(), "fast"),
                   numerics=Numerics("fast"), segment_ids=None).logits
  diff = float(np.abs(np.asarray(logits) - hf_logits).max())
  print(f"max |rljax - transformers(export)| logits = {diff:.3g} over {tokens.shape[1]} tokens")
  assert diff <= ATOL, diff
