"""Post-training Qwen3-30B-A3B (30.5B total, 3.3B active) from its Hugging Face directory
with GRPO on your JSONL and reward function; every block of the async pipeline.

  .venv/bin/python experiments/pipeline.py --config=configs/qwen3_30b_a3b.py \\
      --config.init_from=hf:/path/to/Qwen3-30B-A3B --workdir=/tmp/NAME \\
      --root=gs://BUCKET/runs/NAME --hosts=0 [--config.env.kwargs.path=rows.jsonl ...]

`init_from` is a placeholder: give the checkpoint directory (config.json, safetensors,
tokenizer) with --config.init_from=hf:DIR. The tokenizer is that directory's
(`tokenizer.path = ""`), every machine needs the directory (rollout hosts read its
config.json and tokenizer; weights reach them through the stream). `config.model` is the
architecture of Qwen/Qwen3-30B-A3B's config.json, which init_from must agree with (a
checkpoint of another shape: one error names every field that differs; the `:tiny` variant
pins none).
The AOT check needs no checkpoint: `experiments/aot_check.py --config=configs/qwen3_30b_a3b.py
--config.init_from=` lowers config.model's shape.

The env is `DatasetEnv` on examples/gsm_tiny/train.jsonl (GSM8K's fields: `question`,
`answer` ending in "#### <number>"), scored by `rljax.envs.math_answer:reward_fn` ("####"
or \\boxed{} answers). Your data: --config.env.kwargs.path=... (and prompt_field,
answer_field, reward_fn="package.module:function"); rl.num_tasks and eval.num_tasks are
sized for the example's 59 train / 11 held-out rows.

The stop tokens (`tokenizer.stop_tokens = ()`) are the tokenizer's EOS and the
`eos_token_id`s of the checkpoint's generation_config.json (Qwen3: <|im_end|>, <|endoftext|>).

`get_config("tiny")`: the same blocks shrunk to run on a CPU, for any Qwen3-MoE checkpoint:
config.model sets only backend fields, and its architecture fields are placeholders
(None): init_from's config.json sets them (one given on the command line,
--config.model.rope_theta=..., must agree with it). `examples/make_tiny_hf_checkpoint.py DIR`
writes a tiny random one with transformers (and a byte-level BPE tokenizer):
--config=configs/qwen3_30b_a3b.py:tiny --config.init_from=hf:DIR.
`get_config("tiny_random")`: the tiny blocks without a checkpoint (`init_from = ""`), on
`tiny_architecture()` (tiny_moe's shape with the example tokenizer's 512 ids): what
make_tiny_hf_checkpoint.py writes and the AOT check plans.
"""

import os

import ml_collections
from ml_collections import config_dict

from configs import tiny_moe

EXAMPLE_ROWS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "examples", "gsm_tiny", "train.jsonl")


VARIANTS = ("full", "tiny", "tiny_random")


def get_config(variant: str = "full") -> ml_collections.ConfigDict:
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; use one of {list(VARIANTS)}")
  c = ml_collections.ConfigDict()
  c.name = "qwen3_30b_a3b"
  c.seed = 0
  # fast: ragged_dot's grouped GEMM on TPU; deterministic numerics (engine = trainer bit for
  # bit: the Pallas grouped matmul and attention kernels) fits v5p:4x4x4 too, at 30% of HBM
  c.numerics = "fast"
  c.init_from = "hf:/path/to/Qwen3-30B-A3B"  # placeholder: --config.init_from=hf:DIR
  # a v5p-64 / 8x8 H100 plan: experts over 8 devices, fsdp over the rest
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 8, "expert": 8, "model": 1})
  c.model = ml_collections.ConfigDict(dict(
      vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
      num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
      moe_intermediate_size=768, intermediate_size=6144, mlp_only_layers=(),
      decoder_sparse_step=1, norm_topk_prob=True, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
      tie_word_embeddings=False, max_position_embeddings=40960, page_size=16,
      dtype="bfloat16", param_dtype="bfloat16", remat=True))
  c.tokenizer = ml_collections.ConfigDict(dict(
      kind="hf", path="", chat_template=True, stop_tokens=()))
  c.env = ml_collections.ConfigDict()
  c.env.name = "dataset"
  c.env.kwargs = ml_collections.ConfigDict(dict(
      path=EXAMPLE_ROWS, prompt_field="question", answer_field="answer", id_field="id",
      reward_fn="rljax.envs.math_answer:reward_fn", held_out_fraction=0.2,
      max_prompt_tokens=512, verifier_processes=8, verifier_timeout_s=5.0))
  # A rollout host is one 8-chip machine: experts split 8 ways (16 a chip), attention and
  # embeddings replicated, slots and KV pages split 8 ways. Per chip (aot_check): 9.6 GiB
  # of bf16 weights + 3.0 GiB of KV pages for 64 slots x 4096 tokens (98 KB a token).
  # The TPU compiler (aot_check --topology=v5p:4x4x4): decode 22% of a v5p chip's HBM, a
  # prefill of all 64 slots x 4,096 tokens 59%; a v6e host (32 GB a chip) needs
  # max_prefill_tokens=16384 (0: a prefill call takes every admitted slot at once)
  c.engine = ml_collections.ConfigDict(dict(num_slots=64, max_seq_len=4096,
                                            mesh={"expert": 8}, max_prefill_tokens=0))

  c.sft = ml_collections.ConfigDict(dict(
      load="", steps=0,  # a pretrained (instruction-tuned) model: no warm start
      target_pass1=0.0, probe_every=25, slow_down_at=0.5, slow_down_factor=1.0,
      probe_every_slow=10, probe_tasks=32, batch_size=512, microbatches=8,
      learning_rate=1e-6, warmup_steps=10, final_lr_frac=1.0, weight_decay=0.0,
      num_tasks=48, log_every=10))

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 200
  # 64 prompts x 8 samples = 512 episodes an update
  c.rl.prompts_per_step = 64
  c.rl.group_size = 8
  c.rl.num_tasks = 48  # distinct train rows used (the example has 59); yours: its size
  c.rl.max_new_tokens = 3584  # + a prompt of <= max_prompt_tokens fits max_seq_len
  c.rl.temperature = 1.0
  c.rl.top_k = 0
  c.rl.top_p = 1.0
  c.rl.advantage = "grpo"
  # a pretrained model solves many grade-school problems in every sample: groups whose
  # rewards all tie carry no advantage, and up to 2 * (2 - 1) * 64 of them an update are
  # replaced by fresh prompts
  c.rl.dynamic_sampling_rounds = 2
  c.rl.learning_rate = 1e-6  # a pretrained 30B model: small, constant after the warmup
  c.rl.warmup_steps = 10
  c.rl.final_lr_frac = 1.0
  c.rl.adam_b2 = 0.999
  c.rl.weight_decay = 0.0
  c.rl.clip_norm = 1.0
  # 512 sequences of <= 4096 tokens, one a row: 8 microbatches of one row per device of
  # the 64 (the AOT check's plan: train state < 8 GiB a device)
  c.rl.microbatches = 8
  c.rl.router_replay = True  # the trainer replays the experts the engine routed to
  c.rl.overlong = "score"  # an episode cut by the context: see configs/arith_tiny.py
  c.rl.loss = ml_collections.ConfigDict(dict(
      clip_low=0.2, clip_high=0.28, aggregation="token_mean", max_tokens=None, tis=True,
      tis_cap=2.0, mis=False, mis_low=0.5, mis_high=2.0, kl_coef=0.0, entropy_coef=0.0))

  c.train = ml_collections.ConfigDict(dict(row_len=0))
  c.eval = ml_collections.ConfigDict(dict(num_tasks=8, k=4, n=4, temperature=1.0, seed=0,
                                          every=25))
  c.log = ml_collections.ConfigDict(dict(tensorboard=True))
  # Rollout hosts run on their own machines (experiments/rollout_host.py). One version of
  # staleness: hosts sample the next batch while the trainer trains on this one (TIS
  # corrects it). A host holds 8 groups (64 sequences for its 32 slots); a lease lasts
  # 30 min (a group's 8 x 3584 tokens on a busy host take minutes). check_versions_groups
  # 0: the check holds max_staleness + 2 copies of the serving weights on the trainer
  c.async_rl = ml_collections.ConfigDict(dict(
      hosts=0, host_groups=8, max_staleness=1, lease_s=1800.0, lease_ttl_s=120.0, poll_s=1.0,
      keyframe_every=10, checkpoint_every=10, check_versions_groups=0, weight_update="keep",
      batch_timeout_s=3600.0))
  if variant in ("tiny", "tiny_random"):
    shrink_to_tiny(c, random_init=variant == "tiny_random")
  return c


def tiny_architecture() -> dict:
  """tiny_moe's architecture with the example tokenizer's 512 ids (ModelConfig fields)."""
  model = tiny_moe.get_config().model.to_dict()
  model["vocab_size"] = 512
  # (rljax.pipeline.run.BACKEND_FIELDS that tiny_moe sets: how to run it, not its shape)
  return {k: v for k, v in model.items()
          if k not in ("page_size", "dtype", "param_dtype", "remat")}


def shrink_to_tiny(c: ml_collections.ConfigDict, random_init: bool = False) -> None:
  """The same blocks at CPU size, a few short GRPO steps, one local rollout host. The
  architecture is init_from's checkpoint's (config.model: backend fields, and every
  architecture field a typed placeholder, None, that the command line may set as a check),
  or with `random_init` tiny_architecture(), randomly initialised (init_from "")."""
  c.name = "qwen3_30b_a3b_tiny"
  c.init_from = "hf:/path/to/tiny_qwen3_moe"  # examples/make_tiny_hf_checkpoint.py DIR
  c.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "expert": 1, "model": 1})
  arch = tiny_architecture()
  if random_init:
    c.init_from = ""
    model = dict(arch)
  else:
    model = {k: config_dict.placeholder(type(v)) for k, v in arch.items()}
  c.model = ml_collections.ConfigDict(dict(model, page_size=16, dtype="auto",
                                           param_dtype="bfloat16", remat=False))
  c.env.kwargs.update(dict(max_prompt_tokens=80, verifier_processes=1))
  c.engine = ml_collections.ConfigDict(dict(num_slots=16, max_seq_len=128))
  c.sft.update(dict(batch_size=8, microbatches=1))
  c.rl.update(dict(steps=3, prompts_per_step=2, group_size=4, max_new_tokens=48,
                   microbatches=1, learning_rate=1e-4, warmup_steps=1,
                   dynamic_sampling_rounds=1))
  c.eval = ml_collections.ConfigDict(dict(num_tasks=2, k=2, n=2, temperature=1.0, seed=0,
                                          every=0))
  c.log.tensorboard = False
  c.async_rl.update(dict(hosts=1, host_groups=2, lease_s=120.0, lease_ttl_s=15.0, poll_s=0.05,
                         checkpoint_every=3, batch_timeout_s=300.0))
