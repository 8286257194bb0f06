"""Decode engine throughput vs naive recompute and Hugging Face `generate`, plus exactness.

Workload: a tiny random Qwen3-MoE (configs/tiny_moe.py shapes: 3 layers, hidden 64,
8 experts top-2, vocab 128) built in transformers, saved with save_pretrained and loaded
into rljax through the HF importer. Batch 32, prompts of 16 tokens, 64 new tokens each,
greedy, no stop token, one CPU process. Engine: bf16 (the config's dtype); HF: float32
and eager attention (the fastest HF setting measured on this CPU; bf16 matmuls on CPU
torch are slower), timed each round with 1 and with 2 torch threads and the faster one
counted: on a loaded 2-core machine torch's 2-thread matmuls slowed HF 10-20x (its
threads wait on each other), which made the ratio meaningless; naive: rljax's own forward
over the whole padded sequence every step, through a fresh paged KV (the engine's MoE and
attention paths; nothing cached between steps).
Timing: the contenders alternate (A B C, repeated), and ratios are medians of per-round
ratios. Last line: one JSON object.
"""

import json
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import tiny_moe
from experiments import machine_info
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.model import ModelConfig, PagedKV, forward, scoring
from rljax.model.hf_import import hf_config_kwargs, load_hf_checkpoint
from rljax.model.packing import pack, unpack
from rljax import numerics
from rljax.numerics import Numerics

_ROUNDS = flags.DEFINE_integer("rounds", 5, "alternating timing rounds")
BATCH, PROMPT, NEW, GROUP = 32, 16, 64, 8


def _hf_model(model_cfg):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  hf_cfg = transformers.Qwen3MoeConfig(**hf_config_kwargs(model_cfg))
  hf_cfg._attn_implementation = "eager"
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(hf_cfg).float().eval()
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim >= 2:
        p.normal_(0.0, 0.2)
  return model


def _time(fn):
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main(_):
  numerics.set_up_process("deterministic")  # both modes' engines run here
  import torch  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(2)
  hf = _hf_model(ModelConfig.from_dict(tiny_moe.get_config().model.to_dict()))
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    cfg, params = load_hf_checkpoint(d, dtype="bfloat16", page_size=16)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, cfg.vocab_size, size=(BATCH, PROMPT)).astype(np.int32)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW)
  max_len = PROMPT + NEW

  engines = {m: DecodeEngine(cfg.resolved(jax.default_backend(), m), params,
                             numerics=Numerics(m), num_slots=BATCH, max_seq_len=max_len)
             for m in ("fast", "deterministic")}

  def run_engine(mode):
    return engines[mode].generate([Request(i, prompts[i], sampling=greedy) for i in range(BATCH)])

  cfg = cfg.resolved(jax.default_backend(), "fast")  # the fast engine's choices
  # naive: the whole padded sequence through a fresh paged KV every step. `forward` picks
  # its MoE and attention paths by whether it gets a KV (the engine's: dense experts on
  # CPU, paged attention), so the naive baseline runs the engine's path, reusing nothing.
  blocks = -(-max_len // cfg.page_size)
  pool = (cfg.num_hidden_layers, 1 + BATCH * blocks, cfg.page_size, cfg.num_key_value_heads,
          cfg.head_dim)
  table = jnp.asarray(1 + np.arange(BATCH * blocks).reshape(BATCH, blocks), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (BATCH, max_len))
  naive_fwd = jax.jit(lambda p, t: forward(
      p, t, positions, cfg=cfg, kv=PagedKV(jnp.zeros(pool, cfg.compute_dtype),
                                           jnp.zeros(pool, cfg.compute_dtype), table)).logits)

  def run_naive():
    toks = np.zeros((BATCH, max_len), np.int32)
    toks[:, :PROMPT] = prompts
    for i in range(PROMPT, max_len):
      logits = naive_fwd(params, toks)
      toks[:, i] = np.asarray(jnp.argmax(logits[:, i - 1], axis=-1))
    return toks

  def run_hf(threads=None):
    if threads is not None:
      torch.set_num_threads(threads)
    with torch.no_grad():
      return hf.generate(torch.as_tensor(prompts, dtype=torch.long), max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)

  for fn in (lambda: run_engine("fast"), lambda: run_engine("deterministic"), run_naive,
             lambda: run_hf(1), lambda: run_hf(2)):
    fn()  # compile / warm up
  tokens = BATCH * NEW
  rounds = {"engine": [], "det": [], "naive": [], "hf": []}
  hf_threads = []
  for _ in range(_ROUNDS.value):
    rounds["engine"].append(_time(lambda: run_engine("fast")))
    per_threads = {n: _time(lambda n=n: run_hf(n)) for n in (1, 2)}
    hf_threads.append(min(per_threads, key=per_threads.get))
    rounds["hf"].append(per_threads[hf_threads[-1]])
    rounds["det"].append(_time(lambda: run_engine("deterministic")))
    rounds["naive"].append(_time(run_naive))
  med = {k: statistics.median(v) for k, v in rounds.items()}
  ratio = lambda a, b: statistics.median(x / y for x, y in zip(rounds[a], rounds[b]))  # noqa: E731

  # prefix sharing: one group of 8 with a 37-token prompt
  share = DecodeEngine(cfg, params, numerics=Numerics("fast"), num_slots=BATCH, max_seq_len=max_len)
  share.generate([Request(0, rng.integers(3, cfg.vocab_size, size=37), n=GROUP,
                          sampling=SamplingParams(max_new_tokens=16))])
  prefill_ratio = GROUP * 37 / share.stats["prefill_tokens"]

  # exactness: sampled (T=1) groups in deterministic mode vs the trainer's forward
  det = engines["deterministic"]
  trajs = det.generate([Request(100 + i, rng.integers(3, cfg.vocab_size, size=int(n)), n=4,
                                sampling=SamplingParams(max_new_tokens=40), seed=3)
                        for i, n in enumerate((5, 16, 17, 30))])
  pk = pack([t.tokens for t in trajs], 128, cfg.page_size)
  targets = np.concatenate([pk.tokens[:, 1:], np.zeros_like(pk.tokens[:, :1])], axis=1)
  lp = jax.jit(lambda p: forward(p, pk.tokens, pk.positions, cfg=cfg, numerics=Numerics(
      "deterministic"), segment_ids=pk.segment_ids, targets=targets).logprobs)(params)
  rows = unpack(np.asarray(lp), pk)
  diff = scoring.max_abs_diff(  # NaN anywhere -> NaN
      [row[len(t.prompt_ids) - 1:len(t.prompt_ids) - 1 + len(t.completion_ids)]
       for t, row in zip(trajs, rows)], [t.behaviour_logprobs for t in trajs])
  waste = max(e.max_waste_pages for e in (*engines.values(), share))
  print(json.dumps({
      "workload": f"tiny Qwen3-MoE via HF importer; batch {BATCH}, prompt {PROMPT}, {NEW} new "
                  "tokens, greedy; engine bf16, HF f32 eager; 1 CPU process",
      "engine_tok_s": round(tokens / med["engine"], 1),
      "engine_det_tok_s": round(tokens / med["det"], 1),
      "naive_tok_s": round(tokens / med["naive"], 1),
      "hf_tok_s": round(tokens / med["hf"], 1),
      "hf_threads_per_round": hf_threads,
      "ratio_vs_hf": round(ratio("hf", "engine"), 2),
      "ratio_vs_naive": round(ratio("naive", "engine"), 2),
      "prefill_tokens_ratio_group8": round(prefill_ratio, 2),
      "kv_pages_waste_max": round(waste, 4),
      "det_over_fast_decode": round(ratio("det", "engine"), 3),
      "det_engine_vs_trainer_max_abs_diff": diff,
      "decode_traces": {m: e.trace_counts["decode"] for m, e in engines.items()},
      "rounds": _ROUNDS.value,
      "machine": machine_info.machine(),
  }))


if __name__ == "__main__":
  app.run(main)
