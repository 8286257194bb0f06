"""The test suite's canonical shapes, shared by test files and the worker processes they
start, so a program compiles once per run and XLA's persistent cache serves every later
file and process (compiling is most of what the suite costs on CPU).

TINY has one dense and one MoE layer: every kind of layer the model has, at the fewest
layers (a third layer, a second MoE one, added 30-40% to every compile: the det GRPO step
7.0 -> 4.9 s). Tests about depth (layer scans, stacked routing) build their own.
"""

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, intermediate_size=96, mlp_only_layers=(0,),
            max_position_embeddings=256, page_size=16)

# Config-driven runs (grpo.py) that test plumbing, not learning: arith_tiny with 2 of its 4
# layers compiles and runs in about half the time.
TWO_LAYERS = ("--config.model.num_hidden_layers=2",)


def sharp_params(cfg):
  """`cfg`'s params, matrices x10, in bf16: std 0.02 init makes a nearly uniform policy;
  larger weights make routing and attention sharp enough that a one-ulp difference shows."""
  import jax  # pylint: disable=g-import-not-at-top  (workers import this module first)
  from rljax.model import init_params  # pylint: disable=g-import-not-at-top
  from rljax.model.params import cast, scale_matrices  # pylint: disable=g-import-not-at-top
  return cast(scale_matrices(init_params(cfg, jax.random.key(0), "float32"), 10.0),
              "bfloat16")


# The engine shape tests share unless a test is about shapes (slot counts, page pressure):
# 8 slots, 128-token rows, 65 pages (8 x 8 + the null page), one prefill program.
ENGINE = dict(num_slots=8, max_seq_len=128, num_pages=65, prefill_buckets=False)
