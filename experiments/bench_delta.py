"""Weight-stream codecs on real RL updates: size, speed, pause, exactness.

Workload: a 15.5M-parameter MoE policy (hidden 256, 4 layers, 16 experts, vocab 4096),
standard init (std 0.02), briefly trained (next-token NLL on sequences of a sparse Markov
chain over the first 1024 tokens, AdamW 3e-3), then an RL phase with a fresh optimizer, as
GRPO would run it: clip_by_global_norm 1.0 + AdamW(lr 1e-6, weight decay 0.01), on a
policy-gradient loss (-advantage x log-prob) whose reward is consistent from step to step
(the fraction of a sequence's tokens in the lower half of the chain's vocabulary; group-
normalised advantages over 8 sequences), f32 master params. Each RL step's bf16 cast is
one stream version; steps `--measure_from`..`--rl_steps` are the steady state measured.
(This workload changes ~0.3% of the bf16 values per step, fewer than the ~1.4% of the
design notes' measurement; the 5-version catch-up deltas have that density, so their
ratio is the one to compare with it.)

Second workload (`--workload=grpo` or `both`, the default): real GRPO updates of the
`configs/arith_tiny.py` run (rljax.pipeline.lockstep: SFT warm start for `--grpo_sft_steps`,
then GRPO steps with the in-process engine), each version's serving bf16 params
snapshotted, at the config's own learning rate and at 1e-6 (the design notes' regime).

Per codec (every delta codec in rljax.sync.codecs), over the steady-state steps:
  delta_bytes                 mean bytes of one step's delta (all tensors)
  ratio_vs_full_bf16          full bf16 bytes / delta_bytes
  encode_MB_s                 full bf16 MB / median time to code one step on the trainer
                              (find changes, code, xxh3 of the new bits and of the object)
  apply_MB_s                  full bf16 MB / median time to decode, apply in place and
                              verify the xxh3 of the new bits (numpy buffers, one core)
  apply_pause_ms_per_100MB    the part of that during which the weights are unusable
                              (apply + verify; decoding runs before) per 100 MB
  bitwise_equal               every step's checksum verified, and the last snapshot rebuilt
                              bit for bit by chaining all steps' deltas from the first
  catch_up                    deltas spanning 2, 5 and 10 versions
`stream_e2e` runs the real Publisher -> memory store -> Subscriber (device arrays donated,
jitted scatter) with the default codec.

LoRA (`--workload=lora`, or with `markov`/`both` when `--lora_ranks` is not empty): the
markov workload's RL phase again, from the same pretrained policy on the same batches,
training rank-r adapters (rljax.model.lora's default targets: attention q/k/v/o and every
expert's gate/up/down; alpha = 2r) on its frozen bf16 cast with the same optimizer, at each
`--lora_learning_rates`. Each step's adapters (f32 masters: what the async trainer
publishes with config.lora, rljax/pipeline/adapter_stream.py) go through the real
Publisher, beside the full model's bf16 versions:
  full_model.bytes_per_version      the full-model stream's delta per version (default codec)
  rank_R.lr_L.bytes_per_version     the adapter stream's delta per version (its codec)
  rank_R.lr_L.codecs                mean delta bytes per version under every delta codec
  rank_R.base_bytes_once            the base's one keyframe (bf16, raw)
  ..._vs_full_model_delta           adapter bytes / full-model delta bytes per version
  ...merged_model_bytes_per_version  the same LoRA run's merged bf16 model, delta-coded as
                                    a full-model stream would carry it (default codec)
Only bytes: nothing is timed (`--workload=lora` runs on a busy machine). Last line: one
JSON object.
"""

import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import zstandard

from experiments import machine_info
from rljax.model import ModelConfig, count_params, forward, init_params
from rljax.model import lora as lora_lib
from rljax.numerics import Numerics
from rljax.pipeline import adapter_stream
from rljax.sync import Publisher, Store, Subscriber, codecs
from rljax.sync import manifest as fmt

_PRETRAIN = flags.DEFINE_integer("pretrain_steps", 100, "supervised steps before RL")
_RL_STEPS = flags.DEFINE_integer("rl_steps", 60, "RL steps (the last one is measured)")
_FROM = flags.DEFINE_integer("measure_from", 40, "first RL step of the steady state")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timing repeats per step (min taken)")
_WORKLOAD = flags.DEFINE_enum("workload", "both", ["markov", "grpo", "both", "lora"],
                              "markov: AdamW on a synthetic PG loss; grpo: arith_tiny GRPO; "
                              "lora: markov's stream bytes per version, full model vs LoRA "
                              "adapters (no timings)")
_LORA_RANKS = flags.DEFINE_list("lora_ranks", ["16"], "LoRA ranks whose adapter stream is "
                                "measured on the markov workload (empty: none)")
_LORA_LRS = flags.DEFINE_list("lora_learning_rates", ["1e-6", "1e-4"],
                              "AdamW learning rates of the LoRA RL phases (1e-6: the full "
                              "model's)")
_GRPO_SFT = flags.DEFINE_integer("grpo_sft_steps", 300, "SFT warm-start steps before GRPO")

CFG = ModelConfig(vocab_size=4096, hidden_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                  num_experts_per_tok=2, moe_intermediate_size=256,
                  max_position_embeddings=256, page_size=16, dtype="float32",
                  param_dtype="float32", decode_attention="reference", train_experts="ragged",
                  engine_experts="ragged", det_attention="jnp", expert_kernel="jnp")
BATCH, SEQ = 8, 64
DATA_VOCAB = 1024  # the Markov chain's tokens
CATCH_UP = (2, 5, 10)
GOALS = {"ratio_vs_full_bf16": 100, "encode_MB_s": 500, "apply_MB_s": 1000,
         "apply_pause_ms_per_100MB": 100}


# ---- workload ----


def _markov_batches(rng):
  successors = rng.integers(0, DATA_VOCAB, size=(DATA_VOCAB, 4))
  while True:
    toks = np.zeros((BATCH, SEQ + 1), np.int32)
    toks[:, 0] = rng.integers(0, DATA_VOCAB, BATCH)
    for t in range(SEQ):
      toks[:, t + 1] = successors[toks[:, t], rng.integers(0, 4, BATCH)]
    yield toks


def _train_step(optimizer):
  positions = jnp.tile(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, 1))
  segments = jnp.ones((BATCH, SEQ), jnp.int32)

  def loss_fn(params, toks, advantages):
    logprobs = forward(params, toks[:, :-1], positions, cfg=CFG, numerics=Numerics("fast"),
                       segment_ids=segments, targets=toks[:, 1:]).logprobs
    return -jnp.mean(advantages[:, None] * logprobs)

  @jax.jit
  def step(params, opt_state, toks, advantages):
    loss, grads = jax.value_and_grad(loss_fn)(params, toks, advantages)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def _bf16_bits(params):
  return {p: np.asarray(x.astype(jnp.bfloat16)).view(np.uint16).reshape(-1)
          for p, x in fmt.flatten(params).items()}


def _rl_optimizer(learning_rate: float) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(learning_rate, weight_decay=0.01))


def _advantages(toks: np.ndarray) -> np.ndarray:
  reward = (toks[:, 1:] < DATA_VOCAB // 2).mean(axis=1)
  return ((reward - reward.mean()) / (reward.std() + 1e-6)).astype(np.float32)


def pretrained():
  """The pretrained policy (f32), the RL phase's batches (the same for every RL phase) and
  the workload's facts."""
  rng = np.random.default_rng(0)
  batches = _markov_batches(rng)
  params = init_params(CFG, jax.random.key(0), "float32")
  pre = optax.adamw(optax.linear_onecycle_schedule(_PRETRAIN.value, 3e-3), weight_decay=0.01)
  step, opt_state = _train_step(pre), pre.init(params)
  t0 = time.perf_counter()
  losses = []
  for _ in range(_PRETRAIN.value):
    params, opt_state, loss = step(params, opt_state, next(batches), np.ones(BATCH, np.float32))
    losses.append(loss)
  losses = [float(x) for x in losses]
  rl_batches = [next(batches) for _ in range(_RL_STEPS.value)]
  facts = {"params": count_params(params), "pretrain_steps": _PRETRAIN.value,
           "pretrain_loss_first_last": [round(losses[0], 3), round(losses[-1], 3)],
           "rl_steps": _RL_STEPS.value, "measured_rl_steps": [_FROM.value + 1, _RL_STEPS.value],
           "pretrain_seconds": round(time.perf_counter() - t0, 1)}
  return params, rl_batches, facts


def rl_snapshots(params, rl_batches, facts):
  """{rl_step: {tensor: bf16 bits [n]}} of the full model for the steady-state steps."""
  rl = _rl_optimizer(1e-6)
  step, opt_state = _train_step(rl), rl.init(params)  # a fresh Adam at RL start
  t0 = time.perf_counter()
  snaps = {}
  for i, toks in enumerate(rl_batches, 1):
    params, opt_state, _ = step(params, opt_state, toks, _advantages(toks))
    if i >= _FROM.value:
      snaps[i] = _bf16_bits(params)
  facts = facts | {"rl_seconds": round(time.perf_counter() - t0, 1)}
  return snaps, facts


def lora_snapshots(params, rl_batches, lora, learning_rate):
  """{rl_step: {tensor: f32 bits [n]}} of the adapters (the f32 masters the async trainer
  publishes) for the steady-state steps: the RL phase on the frozen bf16 base; and
  {rl_step: {tensor: bf16 bits}} of the merged model (what a full-model stream of the same
  LoRA run would carry)."""
  base = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  positions = jnp.tile(jnp.arange(SEQ, dtype=jnp.int32), (BATCH, 1))
  segments = jnp.ones((BATCH, SEQ), jnp.int32)

  def loss_fn(adapters, toks, advantages):
    logprobs = forward(lora_lib.merge(base, adapters, lora), toks[:, :-1], positions, cfg=CFG,
                       numerics=Numerics("fast"), segment_ids=segments,
                       targets=toks[:, 1:]).logprobs
    return -jnp.mean(advantages[:, None] * logprobs)

  optimizer = _rl_optimizer(learning_rate)

  @jax.jit
  def step(adapters, opt_state, toks, advantages):
    grads = jax.grad(loss_fn)(adapters, toks, advantages)
    updates, opt_state = optimizer.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state

  merge = jax.jit(lambda adapters: lora_lib.merge(base, adapters, lora))
  adapters = lora_lib.init_adapters(CFG, lora, jax.random.key(1))
  opt_state = optimizer.init(adapters)
  snaps, merged = {}, {}
  for i, toks in enumerate(rl_batches, 1):
    adapters, opt_state = step(adapters, opt_state, toks, _advantages(toks))
    if i >= _FROM.value:
      snaps[i] = {p: np.asarray(x).view(np.uint32).reshape(-1)
                  for p, x in fmt.flatten(adapters).items()}
      merged[i] = _bf16_bits(merge(adapters))
  return snaps, merged, count_params(adapters)


def grpo_snapshots(learning_rates=(None, 1e-6)):
  """{lr: ({version: bf16 bits}, facts)}: arith_tiny's GRPO loop at each learning rate
  (None = the config's), from one shared SFT warm start."""
  import tempfile  # pylint: disable=import-outside-toplevel
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core, lockstep, sft  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  config = arith_tiny.get_config()
  config.sft.steps = _GRPO_SFT.value
  config.rl.steps = _RL_STEPS.value
  config.eval.every = 0
  config.log.tensorboard = False
  run = core.setup(build(config), tempfile.mkdtemp(prefix="bench_delta_grpo_"))
  sft.sft(run)
  warm = run.state
  out = {}
  for lr in learning_rates:
    config.rl.learning_rate = lr or arith_tiny.get_config().rl.learning_rate
    run.state, run.version = warm, 0
    snaps = {}

    def keep(record):
      if record["step"] >= _FROM.value:
        snaps[record["step"]] = _bf16_bits(run.engine.params)

    t0 = time.perf_counter()
    lockstep.grpo(run, on_step=keep)
    out[config.rl.learning_rate] = (snaps, {
        "model": "arith_tiny", "params": count_params(warm.params),
        "sft_steps": _GRPO_SFT.value, "rl_steps": _RL_STEPS.value,
        "learning_rate": config.rl.learning_rate,
        "measured_rl_steps": [_FROM.value + 1, _RL_STEPS.value],
        "rl_seconds": round(time.perf_counter() - t0, 1)})
  run.log.close()
  return out


# ---- measurements ----


def _encode_version(codec, new, old):
  out = {}
  for p, bits in new.items():
    data = codec.encode(bits, old[p])
    out[p] = (data, fmt.checksum(bits), fmt.checksum(data))
  return out


def _apply_version(codec, objects, target):
  """Decode (weights still usable), then apply + verify (the pause). Returns (total, pause)."""
  t0 = time.perf_counter()
  patches = {}
  for p, (data, _, object_sum) in objects.items():
    if fmt.checksum(data) != object_sum:
      raise AssertionError(f"object checksum {p}")
    patches[p] = codec.decode(data, target[p].size, 2)
  t1 = time.perf_counter()
  for p, patch in patches.items():
    codecs.apply_patch(patch, target[p])
    if fmt.checksum(target[p]) != objects[p][1]:
      raise AssertionError(f"checksum mismatch after applying {p}")
  t2 = time.perf_counter()
  return t2 - t0, t2 - t1


def _frac_changed(a, b):
  changed = sum(int(np.count_nonzero(a[p] != b[p])) for p in a)
  return changed / sum(x.size for x in a.values())


def measure_codec(name, snaps, full_bytes):
  codec = codecs.get(name)
  steps = sorted(snaps)[1:]
  sizes, enc_s, app_s, pause_s = [], [], [], []
  state = {p: x.copy() for p, x in snaps[steps[0] - 1].items()}
  for t in steps:
    objs = None
    times = []
    for _ in range(_REPEATS.value):
      t0 = time.perf_counter()
      objs = _encode_version(codec, snaps[t], snaps[t - 1])
      times.append(time.perf_counter() - t0)
    enc_s.append(min(times))
    sizes.append(sum(len(o[0]) for o in objs.values()))
    best = None
    for r in range(_REPEATS.value):
      target = state if r == _REPEATS.value - 1 else {p: x.copy() for p, x in state.items()}
      total, pause = _apply_version(codec, objs, target)
      best = (total, pause) if best is None or total < best[0] else best
    app_s.append(best[0])
    pause_s.append(best[1])
  last = steps[-1]
  bitwise = all(np.array_equal(state[p], snaps[last][p]) for p in state)
  mb = full_bytes / 1e6
  delta_bytes = statistics.mean(sizes)
  catch_up = {}
  for k in CATCH_UP:
    pairs = [(t - k, t) for t in steps if t - k in snaps]
    ks = [sum(len(o[0]) for o in _encode_version(codec, snaps[b], snaps[a]).values())
          for a, b in pairs[-5:]]
    catch_up[str(k)] = {
        "frac_bf16_changed": round(statistics.mean(
            _frac_changed(snaps[a], snaps[b]) for a, b in pairs[-5:]), 5),
        "delta_bytes": int(statistics.mean(ks)),
        "ratio_vs_full_bf16": round(full_bytes / statistics.mean(ks), 1)}
  return {"delta_bytes": int(delta_bytes),
          "ratio_vs_full_bf16": round(full_bytes / delta_bytes, 1),
          "encode_MB_s": round(mb / statistics.median(enc_s), 1),
          "apply_MB_s": round(mb / statistics.median(app_s), 1),
          "apply_pause_ms_per_100MB": round(1e3 * statistics.median(pause_s) * 100 / mb, 2),
          "bitwise_equal": bool(bitwise), "catch_up": catch_up}


def stream_e2e(snaps, full_bytes):
  """Publisher -> memory store -> Subscriber (device arrays), default codec."""
  store = Store.open("memory://")
  pub = Publisher(store, keyframe_every=1000)
  sub = Subscriber(store)
  shapes = {p: s.shape for p, s in fmt.flatten(jax.eval_shape(
      lambda: init_params(CFG, jax.random.key(0), "float32"))).items()}

  def as_params(bits):
    return fmt.unflatten({p: b.view(ml_dtypes.bfloat16).reshape(shapes[p])
                          for p, b in bits.items()})

  steps = sorted(snaps)
  publish_s, poll_s, pause_s, sizes = [], [], [], []
  equal = True
  for i, t in enumerate(steps):
    t0 = time.perf_counter()
    m = pub.publish(as_params(snaps[t]), t)
    t1 = time.perf_counter()
    sub.poll()
    t2 = time.perf_counter()
    equal &= sub.version == t and all(
        np.array_equal(np.asarray(x).view(np.uint16).reshape(-1), snaps[t][p])
        for p, x in fmt.flatten(sub.params).items())
    if i >= 3:  # after the keyframe and the compiles of the first deltas
      publish_s.append(t1 - t0)
      poll_s.append(t2 - t1)
      pause_s.append(sub.stats.last_apply_pause_s)
      sizes.append(m.bytes_written)
  mb = full_bytes / 1e6
  return {"codec": codecs.DEFAULT_DELTA, "versions": len(steps),
          "bytes_per_version": int(statistics.mean(sizes)),
          "publish_MB_s": round(mb / statistics.median(publish_s), 1),
          "poll_apply_MB_s": round(mb / statistics.median(poll_s), 1),
          "apply_pause_ms_per_100MB": round(1e3 * statistics.median(pause_s) * 100 / mb, 2),
          "bitwise_equal": bool(equal), "errors": sub.stats.errors}


def _shapes(tree):
  return {p: tuple(x.shape) for p, x in fmt.flatten(tree).items()}


def published_bytes(snaps, shapes, dtype, delta_codec):
  """Each steady-state step through the real Publisher (memory store, no keyframe after
  the first): (mean delta bytes per version, the first version's keyframe bytes)."""
  pub = Publisher(Store.open("memory://"), keyframe_every=10**6, dtype=dtype,
                  delta_codec=delta_codec)
  sizes, keyframe = [], None
  for t in sorted(snaps):
    params = fmt.unflatten({p: b.view(dtype).reshape(shapes[p]) for p, b in snaps[t].items()})
    m = pub.publish(params, t)
    if keyframe is None:
      keyframe = m.bytes_written
    else:
      sizes.append(m.delta_bytes)
  return int(statistics.mean(sizes)), keyframe


def codec_bytes(snaps):
  """Mean delta bytes per steady-state step under every delta codec (no timing)."""
  steps = sorted(snaps)[1:]
  return {name: int(statistics.mean(
      sum(len(o[0]) for o in _encode_version(codecs.get(name), snaps[t], snaps[t - 1]).values())
      for t in steps)) for name in codecs.names() if not codecs.get(name).keyframe}


def measure_lora(params, rl_batches, facts, full_snaps):
  """The adapter stream's bytes per version beside the full model's, per rank and rate."""
  full_bytes = 2 * sum(x.size for x in full_snaps[min(full_snaps)].values())
  full_delta, _ = published_bytes(full_snaps, _shapes(params), ml_dtypes.bfloat16,
                                  codecs.DEFAULT_DELTA)
  out = {"workload": facts | {"lora_targets": list(lora_lib.DEFAULT_TARGETS),
                              "lora_alpha": "2 x rank", "adapter_stream_dtype": "float32",
                              "adapter_delta_codec": adapter_stream.ADAPTER_DELTA_CODEC},
         "full_model": {"params": facts["params"], "bf16_bytes": full_bytes,
                        "codec": codecs.DEFAULT_DELTA, "bytes_per_version": full_delta,
                        "codecs": codec_bytes(full_snaps)}}
  for rank in map(int, _LORA_RANKS.value):
    lora = lora_lib.LoraConfig(rank=rank, alpha=2.0 * rank)
    entry = {}
    for lr in map(float, _LORA_LRS.value):
      snaps, merged, n_adapter = lora_snapshots(params, rl_batches, lora, lr)
      merged_delta, _ = published_bytes(merged, _shapes(params), ml_dtypes.bfloat16,
                                        codecs.DEFAULT_DELTA)
      shapes = _shapes(jax.eval_shape(lambda: lora_lib.init_adapters(  # noqa: B023
          CFG, lora, jax.random.key(1))))
      per_version, keyframe = published_bytes(snaps, shapes, np.float32,
                                              adapter_stream.ADAPTER_DELTA_CODEC)
      entry |= {"adapter_params": n_adapter, "adapter_f32_bytes": 4 * n_adapter,
                "adapter_f32_frac_of_model_bf16": round(4 * n_adapter / full_bytes, 4),
                "base_bytes_once": full_bytes}
      entry[f"lr_{lr:g}"] = {
          "bytes_per_version": per_version, "keyframe_bytes": keyframe,
          "frac_of_model_bf16": round(per_version / full_bytes, 4),
          "ratio_vs_full_model_delta": round(per_version / full_delta, 2),
          "merged_model_bytes_per_version": merged_delta,
          "codecs": codec_bytes(snaps)}
      print(f"lora rank {rank} lr {lr:g}", json.dumps(entry[f"lr_{lr:g}"]), flush=True)
    out[f"rank_{rank}"] = entry
  return out


def measure_window(snaps, params_count):
  """One entry per delta codec over consecutive snapshots {rl_step: bits}; full bytes."""
  first = snaps[min(snaps)]
  full_bytes = 2 * sum(x.size for x in first.values())
  zstd_full = sum(len(zstandard.ZstdCompressor(level=3).compress(x.tobytes()))
                  for x in snaps[max(snaps)].values())
  steps = sorted(snaps)[1:]
  frac = statistics.mean(_frac_changed(snaps[t - 1], snaps[t]) for t in steps)
  results = {}
  for name in codecs.names():
    if codecs.get(name).keyframe:
      continue
    entry = {"params": params_count, "frac_bf16_changed": round(frac, 5),
             "full_bf16_bytes": full_bytes, "zstd_full_bytes": zstd_full}
    entry.update(measure_codec(name, snaps, full_bytes))
    results[name] = entry
    print(name, json.dumps(entry), flush=True)
  return results, full_bytes


def _goals(entry):
  return {k: {"goal": v, "got": entry[k],
              "met": entry[k] <= v if k.startswith("apply_pause") else entry[k] >= v}
          for k, v in GOALS.items()}


def main(_):
  out = {"bench": "delta", "default_codec": codecs.DEFAULT_DELTA}
  if _WORKLOAD.value in ("markov", "both", "lora"):
    params, rl_batches, facts = pretrained()
    snaps, facts = rl_snapshots(params, rl_batches, facts)
    if _WORKLOAD.value != "lora":  # timed: run it on an otherwise idle machine
      results, full_bytes = measure_window(snaps, facts["params"])
      e2e = stream_e2e(snaps, full_bytes)
      print("stream_e2e", json.dumps(e2e), flush=True)
      out.update(workload=facts, codecs=results,
                 goals=_goals(results[codecs.DEFAULT_DELTA]), stream_e2e=e2e)
    if _LORA_RANKS.value:
      out["lora"] = measure_lora(params, rl_batches, facts, snaps)
  if _WORKLOAD.value in ("grpo", "both"):
    out["grpo"] = {}
    for lr, (snaps, facts) in grpo_snapshots().items():
      results, _ = measure_window(snaps, facts["params"])
      out["grpo"][f"lr_{lr:g}"] = {"workload": facts, "codecs": results}
  out["machine"] = machine_info.machine()
  print(json.dumps(out))


if __name__ == "__main__":
  app.run(main)
