"""The TPU compiler, run from this CPU (libtpu's ahead-of-time client, pinned in the test
extras): a tiny config's GRPO step, decode loop and largest prefill compile for a TPU
slice's chips with the same code `experiments/aot_check.py --topology` runs at real size,
and the train step's temporaries grow with the row, not with its square.

Nothing here needs a TPU: `get_topology_desc` describes a slice's chips, and a program whose
arguments are laid out on a concrete mesh of them is compiled by the TPU compiler (memory
and cost analysis are the TPU's). The 30B / 235B tables come from `aot_check`, not tests.
"""

import pytest

from configs import qwen3_30b_a3b
from rljax import aot, aot_report, hlo_text
from rljax import sharding as sharding_lib
from rljax.aot_compile import topology_chips, topology_mesh, uncached
from rljax.engine.programs import STEPS_PER_CALL, EnginePrograms
from rljax.pipeline.run import MODEL_ONLY, build

GIB = 2 ** 30


def tiny(mesh: dict[str, int]):
  # tiny_moe's shape (hidden 64, 3 layers: 1 dense + 2 MoE, 8 experts top-2, 4 heads of 16,
  # 2 KV heads, vocab 512, page 16), fast numerics, no checkpoint
  config = qwen3_30b_a3b.get_config("tiny_random")
  config.mesh.update({"data": 1, "fsdp": 1, "expert": 1, "model": 1} | mesh)
  return config


@pytest.fixture(scope="module")
def sharded():
  return aot.check(tiny({"fsdp": 2, "expert": 2}), topology="v5p:2x2x1", num_slots=8,
                   max_seq_len=64)


def test_every_program_compiles_for_a_tpu_slice(sharded):
  assert sharded["platform"] == "tpu" and sharded["topology"] == "v5p:2x2x1"
  assert not sharded["abstract_mesh"] and sharded["chips"] == 4
  for name in aot.DEFAULT_PROGRAMS:
    r = sharded[name]
    assert r["lowered"] and r["compiled"], (name, r)
    m, cost = r["memory"], r["cost"]
    # the donated state (train) and the KV pools (decode, prefill) come back in place
    assert m["alias"] > 0 and m["alias"] <= min(m["argument"], m["output"]), (name, m)
    assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"]
    assert 0 < m["peak"] < 0.05 * GIB, (name, m)  # a 220k-param model
    assert cost["flops"] > 0 and cost["bytes_accessed"] > 0, (name, cost)
  assert sharded["lora_train"]["skipped"]  # only when asked for
  assert sharded["prefill"]["rows"] == 8 and sharded["prefill"]["width"] == 64


def test_the_hlo_counts_every_layer_and_decode_step(sharded):
  """The optimized HLO's matmul FLOPs with loops counted as they run (rljax.hlo_flops):
  the train step's scans over its 2 MoE layers (forward and backward) run twice, the
  engine's decode loop its steps_per_call steps (at most: it stops when every slot is
  done)."""
  train, decode = sharded["train"]["hlo"], sharded["decode"]["hlo"]
  assert not train["unknown_loops"] and not decode["unknown_loops"]
  assert sum(trips == 2 for _, trips in train["loops"]) >= 2, train["loops"]
  assert train["matmul_flops_per_chip"] > 1.3 * train["matmul_flops_per_chip_loops_once"]
  assert train["kernel_flops_per_chip"] > 0  # the TPU's ragged_dot: Mosaic cost estimates
  steps = sharded["decode"]["steps_per_call"]
  assert steps == STEPS_PER_CALL and ["jit(decode)/while", steps] in decode["loops"]
  assert decode["bounded_loops"] == ["jit(decode)/while"]
  assert decode["matmul_flops_per_chip"] > (steps - 1) * decode["matmul_flops_per_chip_loops_once"]


def test_the_roofline_predicts_from_the_compilers_counts(sharded):
  r = aot_report.roofline(sharded)
  for name in ("train", "decode"):
    x = r[name]
    assert x["source"] == "compiler", x
    assert x["step_s"] == max(x["compute_s"], x["memory_s"]) > 0
    assert x["compute_s"] == pytest.approx(x["compiler_flops_per_chip"] / r["peak_flops"])
    assert x["memory_s"] == pytest.approx(x["compiler_bytes_per_chip"] / r["hbm_bytes_per_s"])
    # remat, attention over whole key blocks, the router and small-model overheads: more
    # than the analytic count, not orders of magnitude more (measured 1.6x train, 1.35x
    # decode)
    assert 1 < x["compiler_over_analytic_flops"] < 3, x
  t = r["train"]
  assert t["mfu"] == pytest.approx(t["model_flops"] / (sharded["chips"] * r["peak_flops"]
                                                       * t["step_s"]))
  assert r["decode"]["tokens_per_s"] == pytest.approx(8 / r["decode"]["step_s"])
  assert "HLO, " in "\n".join(aot_report.topology_lines(sharded))


@pytest.fixture(scope="module")
def deterministic_sharded():
  """Deterministic numerics, so "auto" picks both kernels on TPU (head_dim 128: Mosaic's
  lane width, what the attention kernel needs); 8 slots per chip, as the deterministic
  engine asks."""
  config = tiny({"fsdp": 2, "expert": 2})
  config.numerics = "deterministic"
  config.model.head_dim = 128
  return aot.check(config, topology="v5p:2x2x1", num_slots=32, max_seq_len=64)


def test_the_kernels_compile_in_sharded_programs(deterministic_sharded):
  """On a mesh each kernel runs per chip under shard_map (XLA cannot partition a Mosaic
  call: without it, lowering these programs failed); Mosaic compiles them in the train
  step, the decode loop and the prefill."""
  r = deterministic_sharded
  assert r["kernels"] == {"det_attention": "pallas_tpu", "expert_kernel": "pallas_tpu"}
  for name in aot.DEFAULT_PROGRAMS:
    assert r[name]["compiled"], (name, r[name])
    kernels = r[name]["hlo"]["mosaic_kernels"]
    assert kernels.get("det_attention_tpu") and kernels.get("grouped_matmul_tpu"), (name, kernels)


def test_the_donated_train_state_is_aliased(sharded):
  """The compiler aliases at least the train state's per-chip bytes (its shards' sizes;
  TPU layouts pad small arrays to (8, 128) tiles, so the compiler's are larger): the step
  updates it in place rather than holding a second copy."""
  train = sharded["train"]["memory"]
  assert train["alias"] >= sharded["per_device_bytes"]["train_state"], train


def test_a_mesh_larger_than_the_slice_is_refused():
  with pytest.raises(ValueError, match=r"needs 8 chips; topology v5p:2x2x1 has 4"):
    aot.check(tiny({"fsdp": 4, "expert": 2}), topology="v5p:2x2x1", num_slots=8,
              max_seq_len=64, programs=("train",))
  with pytest.raises(ValueError, match="TPU topology 'v9z:1x1'"):
    aot.check(tiny({}), topology="v9z:1x1", num_slots=8, max_seq_len=64)


@pytest.fixture(scope="module")
def train_temps() -> dict[int, int]:
  return {}  # row length -> the train step's temporaries, filled by the tests in order


@pytest.mark.parametrize("row", [2048, 4096])
def test_train_temporaries_grow_with_the_row_not_its_square(train_temps, row):
  """One chip, one row per step, 2,048 then 4,096 tokens (one compile per test), tiny_moe's
  first two layers (one dense, one MoE): the compiler's temporaries grow at most 2x when
  the row doubles (measured 35 -> 56 MiB, 1.6x). Attention over the whole row at once held
  its square: 237 -> 1,000 MiB (4.2x), and arith_tiny's step on a 4,096-token row 4.98 GB;
  queries are now taken QUERY_CHUNK at a time (block_attention.attend)."""
  config = tiny({})
  config.model.num_hidden_layers = 2
  r = aot.check(config, topology="v5e:2x2", num_slots=8, max_seq_len=row, programs=("train",))
  assert r["train"]["compiled"], r["train"]
  train_temps[row] = r["train"]["memory"]["temp"]
  if row == 4096:
    assert 2048 in train_temps, "runs after the 2,048-token case (same module, in order)"
    assert train_temps[4096] <= 2 * train_temps[2048], train_temps
    assert train_temps[4096] < 128 * 2 ** 20, train_temps


def _decode_for_tpu(serving_layout: bool):
  """The engine's decode loop at Qwen3-30B-A3B's widths (one layer, vocabulary 8,192), fast
  numerics, 8 slots of 64 tokens on a 4-chip host (expert 4), compiled by the TPU
  compiler: the params in the default layout, or in the loop's own."""
  config = qwen3_30b_a3b.get_config()
  config.init_from = ""
  config.model.num_hidden_layers, config.model.vocab_size = 1, 8192
  built = build(config, MODEL_ONLY, devices=False, platform="tpu")
  mesh = topology_mesh({"expert": 4}, topology_chips("v5p:2x2x1"), "v5p:2x2x1")
  programs = EnginePrograms(built.cfg, built.numerics, num_slots=8, max_blocks=4,
                            sharding=sharding_lib.Sharding(mesh, sharding_lib.DECODE_RULES),
                            serving_layout=serving_layout)
  with uncached():
    pages = programs.round_pages(1 + 8 * 4)
    compiled = programs.decode.trace(*programs.decode_args(pages)).lower().compile()
  return compiled, built.cfg


def test_the_serving_layout_removes_the_decode_loops_weight_copy():
  """With the params in the layout the decode loop chose (`Layout.AUTO`, what the engine
  does off CPU), the loop no longer relays them out at every call: its temporaries drop
  by at least the gate and up experts' bytes on a chip (measured: 30B, 48 layers, 8 v5p
  chips: 6.95 -> 2.01 GiB: the 5.4 GiB of gate, up, q, k and v it copied per call). The
  matmuls and kernel calls are the same, operand layouts included, so the serving layout
  changes where the weights sit, not the arithmetic (the bits). Fast numerics here (a
  deterministic pair, with both Pallas kernels, takes 27 s; the full 30B deterministic
  decode loop compared the same way: 56 instructions, identical)."""
  default, cfg = _decode_for_tpu(False)
  serving, _ = _decode_for_tpu(True)
  # what the default layout copied: the gate and up experts (and q, k, v)
  experts_per_chip = (2 * cfg.num_hidden_layers * cfg.hidden_size * cfg.num_experts // 4
                      * cfg.moe_intermediate_size * 2)
  before = default.memory_analysis().temp_size_in_bytes
  after = serving.memory_analysis().temp_size_in_bytes
  assert before - after >= experts_per_chip, (before, after, experts_per_chip)
  assert hlo_text.arithmetic(serving.as_text()) == hlo_text.arithmetic(default.as_text())
  assert sum(hlo_text.arithmetic(default.as_text()).values()) > 10
