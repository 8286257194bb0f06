"""Decode throughput: rljax's DecodeEngine against Tunix 0.1.7's Sampler, same weights.

Workload, per config (configs/tiny_moe.py, configs/arith_tiny.py) and batch (32, 256):
`batch` prompts of 16 random token ids in [3, vocab) (the same on both sides), 64 new
tokens each, greedy, no stop token (every row gets exactly 64 tokens on both sides).
The model is the config's shape with two changes, so that both sides run the same model:
`mlp_only_layers=()` (Tunix's Qwen3 makes every layer MoE) and `rope_theta=1e6` (Tunix's
`apply_rope` ignores the config's and always uses 1e6); `max_position_embeddings` is
raised to 80 where smaller (arith_tiny: 64; rljax refuses a longer engine sequence).
Random params are made by `rljax.model.init_params`, written once as a Hugging Face
checkpoint by `rljax.model.hf_export`, and each side loads that checkpoint with its own
loader: rljax's `load_hf_checkpoint`, Tunix's `qwen3.params.create_model_from_safe_tensors`.

What each side does per generate call:
- rljax (`.venv`): `DecodeEngine.generate` with fast numerics, `num_slots=batch`,
  `max_seq_len=80`: one prefill of the prompts (sampling each row's first token), then
  the 63 remaining one-token steps in decode calls of `--steps_per_call` steps each, on a
  paged KV cache (attention reads only live pages; experts `by_tokens`, which for 8
  experts top-2 is every expert densely, `moe.dense_mixture`, by
  `moe.TILED_BEATS_DENSE_AT`); each step also keeps the sampled token's log-prob (an
  f32 log-softmax) and the routing ids, which Tunix does not; every call's tokens come
  back to the host scheduler, which builds the Trajectory records.
- Tunix (`.venv-tunix`, made by `make tunix`): `Sampler.__call__` with a KV cache of 80
  positions: one prefill (first token), then one `lax.while_loop` of one-token steps,
  each attending over all 80 cache positions under a mask (experts: its CPU path, dense
  over every expert), argmax of the f32 logits, nothing else kept. Its loop runs while
  `decoding_step < prompt + 64`, i.e. 64 steps: the last step's token falls outside the
  token buffer and is dropped, so Tunix computes one forward step more than it returns
  (1/64 extra work). `eos_tokens=[-1]` (no id can stop a row). The Sampler takes strings
  through a tokenizer: `_IdTokenizer` passes each prompt's id list through unchanged
  (encode = list(ids), no BOS, pad id -1 so no generated id is masked as padding, decode
  returns ""). Compute dtype: the one rljax's fast numerics resolves on this CPU.

Timing: each side is a long-lived worker process that loads the checkpoint, compiles and
warms up once per batch, then on the driver's command (a JSON line on stdin) times one
full generate call (host to host: results are on the host when it returns) and answers
with the seconds and the token ids. The driver alternates rljax, Tunix in every round;
only one worker runs at a time. Reported: median tokens/s of each side and the median
of per-round ratios tunix_time / rljax_time (> 1: rljax faster). Correctness: the same
comparison run once (the warm-up call) in float32 params and compute on both sides; the
greedy tokens must be identical (else exit 1 after the JSON line). The timed runs are bf16
params; their tokens' agreement is reported too (bf16 rounding differs between the sides).
Last stdout line: one JSON object.

  .venv/bin/python experiments/bench_vs_tunix.py [--config=tiny_moe] [--batches=32,256]
      [--rounds=5] [--steps_per_call=N]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

PROMPT, NEW = 16, 64
ROPE_THETA = 1_000_000.0
_CONFIG = flags.DEFINE_list("config", ["tiny_moe", "arith_tiny"], "configs/<name>.py")
_BATCHES = flags.DEFINE_list("batches", ["32", "256"], "prompts per generate call")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
_STEPS = flags.DEFINE_integer("steps_per_call", None, "DecodeEngine steps_per_call "
                              "(default: the engine's own)")
_TUNIX_PY = flags.DEFINE_string("tunix_python", ".venv-tunix/bin/python", "make tunix's")
# worker mode (the driver starts these)
_WORKER = flags.DEFINE_enum("worker", None, ["rljax", "tunix"], "internal: run a worker")
_CKPT = flags.DEFINE_string("ckpt", None, "internal: the worker's checkpoint directory")


# ---- workers: read {"batch": B, "cmd": "warm" | "run"} lines, answer one JSON line each --

def _rljax_generate(ckpt: str, steps_per_call):
  import jax  # pylint: disable=g-import-not-at-top
  from rljax.engine.engine import DecodeEngine, Request, SamplingParams
  from rljax.model.hf_import import load_hf_checkpoint
  from rljax.numerics import Numerics
  with open(os.path.join(ckpt, "bench.json")) as f:
    meta = json.load(f)
  fast = Numerics("fast")
  cfg, params = load_hf_checkpoint(ckpt, dtype=meta["param_dtype"], page_size=meta["page_size"],
                                   compute_dtype=meta["compute_dtype"])
  cfg = cfg.resolved(jax.default_backend(), fast)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
  extra = {} if steps_per_call is None else {"steps_per_call": steps_per_call}
  engines = {}

  def generate(prompts):
    b = len(prompts)
    if b not in engines:
      engines[b] = DecodeEngine(cfg, params, numerics=fast, num_slots=b,
                                max_seq_len=PROMPT + NEW, **extra)
    trajs = engines[b].generate([Request(i, prompts[i], sampling=greedy) for i in range(b)])
    trajs = sorted(trajs, key=lambda t: t.request_id)
    return [np.asarray(t.completion_ids).tolist() for t in trajs]
  return generate, {"compute_dtype": str(cfg.compute_dtype),
                    "engine_experts": cfg.engine_experts,
                    "decode_attention": cfg.decode_attention}


class _IdTokenizer:
  """Token ids in, token ids out: the Sampler's `encode` gets a prompt's id list."""

  def encode(self, ids, **_):
    return list(ids)

  def decode(self, ids, **_):
    return ""

  def bos_id(self):
    return None  # no BOS prepended

  def eos_id(self):
    return -1

  def pad_id(self):
    return -1  # never a generated id: Tunix masks buffer positions equal to pad_id


def _tunix_generate(ckpt: str, _):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tunix.generate import sampler as sampler_lib
  from tunix.models.qwen3 import model as qwen3_model
  from tunix.models.qwen3 import params as qwen3_params
  with open(os.path.join(ckpt, "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(ckpt, "bench.json")) as f:
    meta = json.load(f)
  assert hf["rope_theta"] == ROPE_THETA and not hf["mlp_only_layers"], hf
  cfg = qwen3_model.ModelConfig(
      num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
      embed_dim=hf["hidden_size"], hidden_dim=hf["moe_intermediate_size"],
      num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
      num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
      norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
      num_experts=hf["num_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
      dtype=jnp.dtype(meta["tunix_compute_dtype"]), param_dtype=jnp.dtype(meta["param_dtype"]))
  model = qwen3_params.create_model_from_safe_tensors(ckpt, cfg, dtype=cfg.param_dtype)
  cache = sampler_lib.CacheConfig(cache_size=PROMPT + NEW, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  sampler = sampler_lib.Sampler(model, _IdTokenizer(), cache)

  def generate(prompts):
    out = sampler([list(map(int, p)) for p in prompts], max_generation_steps=NEW,
                  max_prompt_length=PROMPT, echo=False, eos_tokens=[-1], temperature=0.0)
    return [np.asarray(t).tolist() for t in out.tokens]
  return generate, {"compute_dtype": str(cfg.dtype), "experts": "dense over all experts "
                    "(its CPU path)", "attention": "dense over the 80-position cache"}


def _worker(side: str, ckpt: str) -> None:
  make = {"rljax": _rljax_generate, "tunix": _tunix_generate}[side]
  t0 = time.perf_counter()
  generate, info = make(ckpt, _STEPS.value)
  prompts = np.load(os.path.join(ckpt, "prompts.npy"))
  _reply({"ready": True, "load_s": round(time.perf_counter() - t0, 2), **info})
  for line in sys.stdin:
    cmd = json.loads(line)
    p = prompts[:cmd["batch"]]
    t0 = time.perf_counter()
    tokens = generate(p)
    seconds = time.perf_counter() - t0
    assert all(len(t) == NEW for t in tokens), [len(t) for t in tokens]
    _reply({"seconds": seconds, "tokens": tokens})


def _reply(obj) -> None:
  sys.stdout.write(json.dumps(obj) + "\n")
  sys.stdout.flush()


# ---- driver -------------------------------------------------------------------------

class _Worker:
  """A worker process, driven by JSON lines (its stderr goes to ours)."""

  def __init__(self, python: str, side: str, ckpt: str):
    args = [python, os.path.abspath(__file__), f"--worker={side}", f"--ckpt={ckpt}"]
    if _STEPS.value is not None and side == "rljax":
      args.append(f"--steps_per_call={_STEPS.value}")
    self.side = side
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # both sides alike
    self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, cwd=os.getcwd(), env=env)
    self.info = self._read()

  def _read(self) -> dict:
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"{self.side} worker exited (rc {self.proc.wait()})")
    return json.loads(line)

  def generate(self, batch: int) -> dict:
    self.proc.stdin.write(json.dumps({"batch": batch}) + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self) -> None:
    self.proc.stdin.close()
    self.proc.wait()


def _write_checkpoint(name: str, dtype: str, prompts: np.ndarray, out_dir: str) -> dict:
  """The config's shape (as the module docstring says), random params, as an HF checkpoint."""
  import importlib  # pylint: disable=g-import-not-at-top
  import jax
  from rljax.model import ModelConfig, init_params
  from rljax.model.hf_export import export_hf
  from rljax.numerics import Numerics
  cfg = importlib.import_module(f"configs.{name}").get_config()
  shape = cfg.model.to_dict()
  shape.update(mlp_only_layers=(), rope_theta=ROPE_THETA,
               max_position_embeddings=max(shape["max_position_embeddings"], PROMPT + NEW))
  model = ModelConfig.from_dict(shape)
  params = init_params(model, jax.random.key(0), dtype="float32")
  if dtype != "float32":
    params = jax.tree.map(lambda x: x.astype(dtype), params)
  export_hf(params, model, out_dir)
  fast_dtype = str(model.resolved(jax.default_backend(), Numerics("fast")).dtype)
  meta = {"param_dtype": dtype, "page_size": model.page_size,
          "compute_dtype": "float32" if dtype == "float32" else "auto",
          "tunix_compute_dtype": "float32" if dtype == "float32" else fast_dtype}
  with open(os.path.join(out_dir, "bench.json"), "w") as f:
    json.dump(meta, f)
  np.save(os.path.join(out_dir, "prompts.npy"), prompts)
  return {k: v for k, v in shape.items() if k in (
      "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
      "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
      "moe_intermediate_size", "mlp_only_layers", "rope_theta", "max_position_embeddings")}


def _workers(ckpt: str) -> dict:
  return {"rljax": _Worker(sys.executable, "rljax", ckpt),
          "tunix": _Worker(_TUNIX_PY.value, "tunix", ckpt)}


def _agreement(a: list, b: list) -> dict:
  a, b = np.asarray(a), np.asarray(b)
  return {"identical": bool(np.array_equal(a, b)),
          "rows_equal": f"{int((a == b).all(axis=1).sum())}/{len(a)}",
          "tokens_equal": f"{int((a == b).sum())}/{a.size}"}


def _bench_config(name: str, batches: list, tmp: str) -> dict:
  import importlib  # pylint: disable=g-import-not-at-top
  vocab = importlib.import_module(f"configs.{name}").get_config().model.vocab_size
  prompts = np.random.default_rng(0).integers(3, vocab, (max(batches), PROMPT)).astype(np.int32)
  out = {"batches": {}}
  for dtype in ("float32", "bfloat16"):
    ckpt = os.path.join(tmp, f"{name}_{dtype}")
    out["model"] = _write_checkpoint(name, dtype, prompts, ckpt)
    w = _workers(ckpt)
    out[f"{dtype}_workers"] = {s: w[s].info for s in w}
    try:
      for b in batches:
        row = out["batches"].setdefault(str(b), {"batch": b})
        first = {s: w[s].generate(b) for s in w}  # compile + warm up (one call each)
        if dtype == "float32":
          row["f32_tokens"] = _agreement(first["rljax"]["tokens"], first["tunix"]["tokens"])
          row["f32_tokens_identical"] = row["f32_tokens"]["identical"]
          continue
        row["bf16_tokens"] = _agreement(first["rljax"]["tokens"], first["tunix"]["tokens"])
        times = {s: [] for s in w}
        for _ in range(_ROUNDS.value):
          for s in ("rljax", "tunix"):  # one at a time: the other worker waits on stdin
            times[s].append(w[s].generate(b)["seconds"])
        tok = b * NEW
        row.update(
            rljax_tok_s=round(tok / statistics.median(times["rljax"]), 1),
            tunix_tok_s=round(tok / statistics.median(times["tunix"]), 1),
            ratio=round(statistics.median(t / r for t, r in zip(times["tunix"],
                                                                times["rljax"])), 3),
            seconds={s: [round(x, 4) for x in v] for s, v in times.items()})
        print(json.dumps({"config": name, **row}), flush=True)
    finally:
      for x in w.values():
        x.close()
  out["batches"] = list(out["batches"].values())
  return out


def main(_):
  if _WORKER.value:
    return _worker(_WORKER.value, _CKPT.value)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU bench: no accelerator probing
  from experiments import machine_info  # pylint: disable=g-import-not-at-top
  batches = [int(b) for b in _BATCHES.value]
  with tempfile.TemporaryDirectory() as tmp:
    results = {name: _bench_config(name, batches, tmp) for name in _CONFIG.value}
  print(json.dumps({
      "bench": "vs_tunix",
      "workload": f"greedy decode, {PROMPT}-token random prompts + {NEW} new tokens per row, "
                  "no stop token; the config's shape with mlp_only_layers=() and "
                  f"rope_theta={ROPE_THETA:g} on both sides (Tunix 0.1.7's Qwen3: every "
                  "layer MoE, rope_theta fixed at 1e6); bf16 params timed, f32 checked",
      "timing": "one worker process per side, compiled and warmed once per batch; one full "
                "generate call per side per round, alternating rljax then Tunix; ratio = "
                "median of per-round tunix_time / rljax_time (> 1: rljax faster)",
      "tunix": "google-tunix==0.1.7 Sampler (make tunix: .venv-tunix), its own safetensors "
               "loader, greedy, eos_tokens=[-1], cache 80",
      "rljax_engine": {"numerics": "fast", "max_seq_len": PROMPT + NEW,
                       "steps_per_call": _STEPS.value or "engine default"},
      "rounds": _ROUNDS.value, "results": results,
      "machine": machine_info.machine()}))
  bad = [(n, r["batch"]) for n, res in results.items() for r in res["batches"]
         if not r["f32_tokens_identical"]]
  if bad:  # after the JSON line, so the numbers are kept
    raise SystemExit(f"float32 greedy tokens differ between rljax and Tunix at {bad}")


if __name__ == "__main__":
  app.run(main)
