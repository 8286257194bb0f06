"""The engine's device programs called directly, without the engine's scheduler."""

import json
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.engine import programs as programs_lib
from rljax.engine.programs import EnginePrograms
from rljax.numerics import DETERMINISTIC_XLA_FLAGS, Numerics, with_xla_flags
from tests.xla_flags import production_env

DET = Numerics("deterministic")


def test_public_programs_reproduce_the_engine_bitwise(tiny_cfg, tiny_params):
  # One sampled request of 20 prompt tokens and 1 + 2 x 4 new tokens: the engine's run vs
  # prefill -> first-token sample -> two decode loops by hand on scrambled pages.
  slots, spc, max_len, num_pages = 2, 4, 64, 9
  prompt = (np.arange(20) * 7 + 3) % tiny_cfg.vocab_size
  req = Request(7, prompt, seed=5, sampling=SamplingParams(max_new_tokens=1 + 2 * spc))
  engine = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=slots,
                        max_seq_len=max_len, steps_per_call=spc)
  (want,) = engine.generate([req])
  assert len(want.completion_ids) == 1 + 2 * spc

  programs = EnginePrograms(tiny_cfg, DET, num_slots=slots, max_blocks=max_len // 16,
                            steps_per_call=spc)
  pools = programs.empty_pools(num_pages)
  pages = [5, 3, 0, 0]
  i32 = lambda *x: np.asarray(x, np.int32)  # noqa: E731
  tokens = np.zeros((1, 32), np.int32)
  positions = np.full((1, 32), -1, np.int32)
  tokens[0, :20], positions[0, :20] = prompt, np.arange(20)
  logits, prefill_routing, pools = programs.prefill(tiny_params, pools, tokens, positions,
                                                    i32(pages), i32(19))
  assert logits.shape == (slots, tiny_cfg.vocab_size)

  def sampling_arrays(position):  # slot 0 is the request's, slot 1 stays empty
    key_ids = (i32(5, 0), i32(7, 0), i32(0, 0), i32(position, 0))
    return key_ids, np.ones(slots, np.float32), i32(0, 0), np.ones(slots, np.float32)

  first, first_lp = programs.sample(logits, i32(0, 0), *sampling_arrays(20))
  got_tokens, got_lps = [int(first[0])], [np.asarray(first_lp)[:1]]
  got_routing = [np.asarray(prefill_routing)[0, :20]]
  table = np.zeros((slots, max_len // 16), np.int32)
  table[0] = pages
  stop_ids = np.full((slots, 5), -1, np.int32)
  for position in (20, 20 + spc):  # the position each call feeds first
    args = (tiny_params, pools, i32(got_tokens[-1], 0), i32(position, -1), i32(spc, 0), table,
            *sampling_arrays(position + 1), stop_ids, np.zeros(slots, bool),
            (np.zeros(slots, np.int32), np.zeros(slots, bool)))
    if position == 20:  # the abstract arguments aot_check lowers are these arrays' types
      spec = programs.decode_args(num_pages)
      chex.assert_trees_all_equal_shapes_and_dtypes(spec, args)
    toks, lps, routing, ran, _, pools = programs.decode(*args)
    assert int(ran) == spc
    got_tokens += np.asarray(toks)[:, 0].tolist()
    got_lps.append(np.asarray(lps)[:, 0])
    got_routing.append(np.asarray(routing)[:, 0])

  np.testing.assert_array_equal(got_tokens, want.completion_ids)
  chex.assert_trees_all_equal(np.concatenate(got_lps), want.behaviour_logprobs)
  # the last sampled token is never fed, so its routing row stays zero
  chex.assert_trees_all_equal(np.concatenate(got_routing), want.expert_ids[:-1])
  assert programs.trace_counts == {"prefill_1x32": 1, "sample": 1, "decode": 1}
  assert engine.trace_counts["decode"] == 1


def test_the_serving_layout_is_chosen_once_before_the_weights_arrive(tiny_cfg, tiny_params):
  """`serving_layout`: the decode loop compiles ahead of time for the pool and picks the
  params' layout; weights placed before that would sit in a layout no program asked for,
  and a second choice would strand the placed ones. Both are refused."""
  programs = EnginePrograms(tiny_cfg, DET, num_slots=8, max_blocks=8, serving_layout=True)
  with pytest.raises(ValueError, match="prepare_serving_layout first"):
    programs.place_params(tiny_params)
  programs.prepare_serving_layout(65)
  placed = programs.place_params(tiny_params)
  assert jax.tree.map(lambda a: a.format, placed) == programs.param_formats
  assert isinstance(programs.decode, jax.stages.Compiled)
  with pytest.raises(ValueError, match="chosen once per engine"):
    programs.prepare_serving_layout(65)
  with pytest.raises(ValueError, match=r"needs EnginePrograms\(serving_layout=True\)"):
    EnginePrograms(tiny_cfg, DET, num_slots=8, max_blocks=8).prepare_serving_layout(65)


_YNN_PROBE = """
import collections, json, re
from rljax import numerics
numerics.set_up_process("fast")
from rljax.engine import programs as P
from rljax.model import ModelConfig
from tests.shapes import TINY
fast = numerics.Numerics("fast")
cfg = ModelConfig(**TINY).resolved("cpu", fast)
out = {}
for label, options in (("engine", P.CPU_COMPILER_OPTIONS), ("xla_default", {})):
  P.CPU_COMPILER_OPTIONS = options
  programs = P.EnginePrograms(cfg, fast, num_slots=64, max_blocks=5)
  for name, args in (("decode", programs.decode_args(321)),
                     ("prefill", programs.prefill_args(321, 64, 16))):
    text = getattr(programs, name).lower(*args).compile().as_text()
    fused = re.findall(r'op_name="[^"]*/(\\w+)"[^\\n]*"kind":"__ynn_fusion"', text)
    out[f"{label} {name}"] = collections.Counter(fused)
print(json.dumps(out))
"""


def test_cpu_programs_keep_each_ynnpack_fusion_a_single_dot():
  # programs.CPU_COMPILER_OPTIONS, in a fast-numerics process (this one has the
  # deterministic flags, which set the same option process-wide): by XLA's default the
  # 64-slot programs' reductions (RMSNorm sums, softmax maxima) join YNNPACK fusions too;
  # the engine's decode and prefill keep only dots there.
  env = production_env()
  env["XLA_FLAGS"] = with_xla_flags(env["XLA_FLAGS"], without=DETERMINISTIC_XLA_FLAGS)
  out = subprocess.run([sys.executable, "-c", _YNN_PROBE], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  fused = json.loads(out.stdout.strip().splitlines()[-1])
  for name in ("decode", "prefill"):
    assert set(fused[f"engine {name}"]) == {"dot_general"}, fused
  assert set(fused["xla_default decode"]) > {"dot_general"}, fused  # the option matters


def test_unrolled_decode_is_the_scans_bits_and_the_cpu_rule(tiny_cfg, tiny_params):
  # Deterministic numerics: the unrolled layers are the layer scan's bits, so an engine
  # forced to unroll samples the same tokens with the same log-probs and routing.
  reqs = [Request(i, (np.arange(5 + 3 * i) * 11 + i) % tiny_cfg.vocab_size, seed=i,
                  sampling=SamplingParams(max_new_tokens=9)) for i in range(3)]
  runs = {}
  for unroll in (False, True):
    engine = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, max_seq_len=32,
                          steps_per_call=4, unroll_layers=unroll)
    assert engine.programs.unroll_layers is unroll
    runs[unroll] = sorted(engine.generate(reqs), key=lambda t: t.request_id)
  for scanned, unrolled in zip(runs[False], runs[True]):
    np.testing.assert_array_equal(scanned.completion_ids, unrolled.completion_ids)
    np.testing.assert_array_equal(scanned.behaviour_logprobs, unrolled.behaviour_logprobs)
    np.testing.assert_array_equal(scanned.expert_ids, unrolled.expert_ids)
  fast, layers = Numerics("fast"), tiny_cfg.num_hidden_layers
  assert programs_lib.unrolled_decode("cpu", fast, programs_lib.UNROLL_UP_TO_SLOTS, layers)
  assert not programs_lib.unrolled_decode("cpu", fast, programs_lib.UNROLL_UP_TO_SLOTS + 1,
                                          layers)
  assert not programs_lib.unrolled_decode("cpu", DET, 8, layers)  # the scan: numerics unmeasured
  assert not programs_lib.unrolled_decode("tpu", fast, 8, layers)
  assert not programs_lib.unrolled_decode("cpu", fast, 8, programs_lib.UNROLL_MAX_LAYERS + 1)
