"""tinker-cookbook recipes, unchanged but for base URL, model name and sizes, run end to
end on rljax's Tinker server (rljax.tinker), and the server's stop strings.

The recipes are `tinker_cookbook.recipes.rl_basic` (GSM8K, the `role_colon` renderer, whose
stop sequence is the string "\\n\\nUser:", importance-sampling updates) and
`tinker_cookbook.recipes.sl_basic` (supervised chat fine-tuning on no_robots, its held-out
NLL evaluated by a sampling client), each run in its own process the way its `__main__`
runs it, on one server. What a machine without the Hub lacks is laid where the cookbook
looks: the tokenizer of its model name as a local directory of that name (a byte-level
BPE, the served model's vocabulary), `openai/gsm8k` as a `datasets` cache
(examples/gsm_tiny's problems, GSM8K's format) and `HuggingFaceH4/no_robots` as one (short
arithmetic chats in its format).
"""

import json
import math
import os
import pathlib
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from rljax.envs.tokenizer import TransformersTokenizer, train_byte_level_bpe
from rljax.model import ModelConfig
from rljax.numerics import Numerics
from rljax.tinker.sampling import sample_args
from rljax.tinker.service import Service
from rljax.tinker.server import make_server
from rljax.tinker.stops import stop_cut
from rljax.tinker.training import UserError
from tests.shapes import TINY, sharp_params

tinker = pytest.importorskip("tinker")  # pinned in the test extras: a missing one fails below
from tinker import types  # noqa: E402
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

MODEL = "Qwen/Qwen3-8B-Base"  # a cookbook model whose renderer is role_colon
DET = Numerics("deterministic")  # engine = trainer bit for bit
GSM_TINY = pathlib.Path(__file__).resolve().parents[1] / "examples" / "gsm_tiny" / "train.jsonl"
STEPS, BATCH, GROUP, MAX_TOKENS = 2, 2, 4, 16
# rl_basic.py's `__main__`, its config then sized (chz takes no sub-field of the dataset
# builder's instance from the command line)
RECIPE = """
import sys, chz
from tinker_cookbook.recipes import rl_basic
model_name, batch, group, *argv = sys.argv[1:]
config = rl_basic.build_config_blueprint(model_name).make_from_argv(argv)
config = chz.replace(config, dataset_builder=chz.replace(
    config.dataset_builder, batch_size=int(batch), group_size=int(group)))
rl_basic.main(config)
"""
# sl_basic: SL_ROWS chats in batches of SL_BATCH, one epoch (the recipe's), its evaluation
# every 8 steps (the recipe's) at steps 0 and 8; lr 3e-2, linear decay (the recipe's
# schedule; its 2e-4 is sized for 8B models, this LoRA on a random tiny model needs more:
# 1e-2 took the NLL 7.92 -> 4.84 in the 9 steps, 3e-2 to 2.66)
SL_ROWS, SL_BATCH, SL_LR = 36, 4, 3e-2
SL_STEPS = SL_ROWS // SL_BATCH
SL_RECIPE = """
import sys, chz
from tinker_cookbook.recipes import sl_basic
model_name, batch, *argv = sys.argv[1:]
config = sl_basic.build_config_blueprint(model_name).make_from_argv(argv)
builder = config.dataset_builder
config = chz.replace(config, dataset_builder=chz.replace(builder, common_config=chz.replace(
    builder.common_config, batch_size=int(batch))))
sl_basic.main(config)
"""


def test_the_cookbook_is_installed():
  import tinker_cookbook  # pylint: disable=g-import-not-at-top
  assert tinker_cookbook.__version__ == "0.6.1"


def _rows():
  return [json.loads(line) for line in GSM_TINY.read_text().splitlines() if line.strip()]


def _datasets_cache(directory: pathlib.Path, repo: str, config: str, features: dict,
                    splits: dict[str, list[dict]]) -> None:
  """`load_dataset(repo, config)`'s offline cache under `directory`: one arrow file a split."""
  import datasets  # pylint: disable=g-import-not-at-top
  from datasets.arrow_writer import ArrowWriter  # pylint: disable=g-import-not-at-top
  owner, name = repo.split("/")
  out = directory / f"{owner}___{name}" / config / "0.0.0" / "rljax_tests"
  out.mkdir(parents=True)
  features = datasets.Features(features)
  info = datasets.DatasetInfo(features=features, config_name=config, dataset_name=name)
  info.splits = datasets.SplitDict(dataset_name=name)
  for split, rows in splits.items():
    with ArrowWriter(features=features, path=str(out / f"{name}-{split}.arrow")) as writer:
      for r in rows:
        writer.write(r)
      n, size = writer.finalize()
    info.splits.add(datasets.SplitInfo(name=split, num_examples=n, num_bytes=size,
                                       dataset_name=name))
  info.write_to_directory(str(out))


def _gsm8k_cache(directory: pathlib.Path) -> None:
  """`load_dataset("openai/gsm8k", "main")`: examples/gsm_tiny's train and test splits."""
  import datasets  # pylint: disable=g-import-not-at-top
  rows = [{"question": r["question"], "answer": r["answer"]} for r in _rows()]
  _datasets_cache(directory, "openai/gsm8k", "main",
                  {"question": datasets.Value("string"), "answer": datasets.Value("string")},
                  {"train": rows[:60], "test": rows[60:]})


def _chats(n: int, seed: int) -> list[dict]:
  """no_robots rows of one short pattern ("What is 3 plus 4?" / "3 plus 4 is 7."): text a
  tiny model learns in a few steps."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    a, b = (int(x) for x in rng.integers(0, 10, size=2))
    q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    rows.append({"prompt": q, "prompt_id": f"{seed}-{i}", "category": "Math",
                 "messages": [{"content": q, "role": "user"},
                              {"content": ans, "role": "assistant"}]})
  return rows


def _no_robots_cache(directory: pathlib.Path) -> None:
  """`load_dataset("HuggingFaceH4/no_robots")`: its features, SL_ROWS train rows and a
  batch (SL_BATCH: the evaluator scores whole batches) of test rows of `_chats`."""
  import datasets  # pylint: disable=g-import-not-at-top
  text = datasets.Value("string")
  _datasets_cache(directory, "HuggingFaceH4/no_robots", "default",
                  {"prompt": text, "prompt_id": text, "category": text,
                   "messages": [{"content": text, "role": text}]},
                  {"train": _chats(SL_ROWS, seed=0), "test": _chats(SL_BATCH, seed=1)})


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """The recipe's working directory: `MODEL` as a tokenizer directory, the datasets cache."""
  work = tmp_path_factory.mktemp("cookbook")
  texts = [f"User: {r['question']}\n\nAssistant: {r['answer']}" for r in _rows()]
  train_byte_level_bpe(texts, str(work / MODEL), vocab_size=512)
  _gsm8k_cache(work / "hf_datasets")
  _no_robots_cache(work / "hf_datasets")
  return work


@pytest.fixture(scope="module")
def server(workdir, tmp_path_factory):
  tokenizer = TransformersTokenizer.from_dir(str(workdir / MODEL))
  cfg = ModelConfig(**{**TINY, "vocab_size": tokenizer.vocab_size,
                       "max_position_embeddings": 512}).resolved("cpu", DET)
  # sharp weights (x10): at the init's std 0.02 the frozen head bounds every logit to about
  # +-1.3 (|row| 0.16 x |normed h| 8), so no adapter could take the NLL much below 5 nats
  base = sharp_params(cfg)
  service = Service(cfg, base, numerics=DET, model_name=MODEL, max_tokens=512,
                    state_root=str(tmp_path_factory.mktemp("tinker_states")),
                    tokenizer=tokenizer)
  srv = make_server(service, "127.0.0.1", 0)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  yield service, f"http://127.0.0.1:{srv.server_address[1]}"
  srv.shutdown()


def _run_recipe(workdir, script: str, *argv: str) -> None:
  """`script` in its own process in `workdir`, offline (the Hub and datasets from disk)."""
  env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0",
         "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
         "HF_DATASETS_CACHE": str(workdir / "hf_datasets")}
  run = subprocess.run([sys.executable, "-c", script, *argv], cwd=workdir, env=env,
                       capture_output=True, text=True, timeout=240, check=False)
  assert run.returncode == 0, run.stderr[-6000:]


def _jsonl(path: pathlib.Path) -> list[dict]:
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_rl_basic_runs_end_to_end(server, workdir):
  log_path = workdir / "rl_basic"
  _run_recipe(workdir, RECIPE, MODEL, str(BATCH), str(GROUP), f"base_url={server[1]}",
              f"log_path={log_path}", f"max_tokens={MAX_TOKENS}", f"max_steps={STEPS}",
              "lora_rank=8")
  records = _jsonl(log_path / "metrics.jsonl")
  steps = [r for r in records if "optim/entropy" in r]
  assert [r["step"] for r in steps] == list(range(STEPS)), records
  for r in steps:
    # every episode of the batch sampled, scored and trained on
    assert r["env/all/total_episodes"] == r["optim/datums:sum"] == BATCH * GROUP
    assert 0 < r["env/all/ac_tokens_per_turn"] <= MAX_TOKENS
    for key in ("env/all/reward/total", "env/all/correct", "env/all/format", "optim/entropy",
                "optim/kl_sample_train_v1", "optim/kl_sample_train_v2", "optim/lr"):
      assert math.isfinite(r[key]), (key, r)
    # the sampler's log-probs are the trainer's bits (deterministic numerics): no KL
    assert r["optim/kl_sample_train_v1"] == r["optim/kl_sample_train_v2"] == 0.0, r
  final = _jsonl(log_path / "checkpoints.jsonl")[-1]
  assert final["name"] == "final" and final["state_path"].startswith("tinker://")
  assert final["sampler_path"] in server[0].saved


def test_sl_basic_lowers_the_nll(server, workdir):
  log_path = workdir / "sl_basic"
  _run_recipe(workdir, SL_RECIPE, MODEL, str(SL_BATCH), f"base_url={server[1]}",
              f"log_path={log_path}", f"learning_rate={SL_LR}", "lora_rank=8")
  records = _jsonl(log_path / "metrics.jsonl")
  steps = [r for r in records if "train_mean_nll" in r]
  assert [r["step"] for r in steps] == list(range(SL_STEPS)), records
  for r in steps:
    assert r["num_sequences"] == SL_BATCH and r["optim/datums:sum"] == SL_BATCH, r
    for key in ("train_mean_nll", "train_mean_bpb", "learning_rate", "optim/grad_norm:mean"):
      assert math.isfinite(r[key]), (key, r)
  nll = [r["train_mean_nll"] for r in steps]
  print("sl_basic train_mean_nll per step:", [round(x, 3) for x in nll])
  # each step's NLL is of its batch before that step's update; measured 7.92 7.02 5.56 4.72
  # 4.02 3.40 2.95 2.78 2.66 (a third of the start; the base's uniform guess is ln 512 = 6.2)
  assert nll[-1] < 0.5 * nll[0], nll
  # the recipe's held-out evaluation (a sampling client's compute_logprobs of the test
  # split) before steps 0 and 8: measured 7.86 -> 2.45
  test_nll = [r["test/nll"] for r in records if "test/nll" in r]
  print("sl_basic test/nll:", test_nll)
  assert len(test_nll) == 2 and all(map(math.isfinite, test_nll))
  assert test_nll[1] < 0.5 * test_nll[0], test_nll
  final = _jsonl(log_path / "checkpoints.jsonl")[-1]
  assert final["name"] == "final" and final["state_path"].startswith("tinker://")
  assert final["sampler_path"] in server[0].saved


# ---- stop strings ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sampler(server):
  client = tinker.ServiceClient(base_url=server[1], api_key="tml-local")
  yield client.create_sampling_client(base_model=MODEL).result()
  client.close("success").result()


def _sample(sampler, stop, max_tokens=20):
  """One sequence of the base model (seed 3: the same draws every call)."""
  res = sampler.sample(types.ModelInput.from_ints([5, 6, 7, 8]), 1,
                       types.SamplingParams(max_tokens=max_tokens, seed=3, stop=stop)).result()
  s = res.sequences[0]
  return list(s.tokens), np.asarray(s.logprobs, np.float32), s.stop_reason


def _text(server, ids):
  return server[0].tokenizer.decode_sampled(ids)


def test_a_stop_string_cuts_after_the_token_that_completes_it(server, sampler):
  full, lps, reason = _sample(sampler, [])  # []: no stop at all, not even EOS
  assert len(full) == 20 and reason == "length"
  text = [_text(server, full[:k]) for k in range(21)]  # text[k]: the first k tokens'
  ok = lambda c: c and c != "\ufffd"  # noqa: E731  (a character a stop string may hold)
  # a stop string across a token boundary: the last character of token i's text and the
  # first of token i+1's, found nowhere before
  piece = [_text(server, [t]) for t in full]
  i, across = next((i, a + b) for i in range(1, 19)
                   for a, b in [(piece[i][-1:], piece[i + 1][:1])]
                   if ok(a) and ok(b) and a + b not in text[i + 1] and a + b in text[i + 2])
  tokens, cut_lps, reason = _sample(sampler, [across])
  assert reason == "stop" and tokens == full[:i + 2], (across, tokens, full)
  assert np.array_equal(cut_lps.view(np.uint32), lps[:i + 2].view(np.uint32))
  # matched at the very first token
  first = next(c for c in text[1] if ok(c))
  assert _sample(sampler, [first])[0::2] == (full[:1], "stop")
  # never found: all tokens, stopped by length
  assert _sample(sampler, ["\x00never\x00"])[0::2] == (full, "length")
  # several stops: the earliest match ends it, whatever their order; a lone string too
  late = next(text[20][j:j + 2] for j in range(len(text[20]) - 2, -1, -1)
              if text[20][j:j + 2] not in text[i + 2] and all(map(ok, text[20][j:j + 2])))
  assert _sample(sampler, [late, across])[0] == full[:i + 2]
  assert _sample(sampler, across)[0] == full[:i + 2]


def test_token_and_string_stops_together(server, sampler):
  full, _, _ = _sample(sampler, [])
  assert _sample(sampler, [full[12]])[0] == full[:full.index(full[12]) + 1]
  service = server[0]
  base = service._base  # pylint: disable=protected-access  (the base model's snapshot)

  def sample(stop):  # the SDK sends strings or ids; a mixed list (the server's) by hand
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8]}]},
            "num_samples": 1, "sampling_params": {"max_tokens": 20, "seed": 3, "stop": stop}}
    args = sample_args(body, service.cfg.vocab_size, 512, eos_id=service.tokenizer.eos_id,
                       can_match_text=True)
    out = pb.SampleResponse.FromString(service.sampler.sample(base, args))
    seq = out.sequences[0]
    return np.frombuffer(seq.tokens, np.int32).tolist(), seq.stop_reason, args

  tokens, reason, args = sample([full[12], "\x00never\x00"])
  assert args.sampling.stop_tokens == (service.tokenizer.eos_id, full[12])
  assert args.stop_strings == ("\x00never\x00",)
  assert tokens == full[:full.index(full[12]) + 1] and reason == pb.STOP_REASON_STOP
  # whichever comes first ends the sequence: here a string completed before the token
  j, early = next((j, c) for j in range(full.index(full[12]))
                  for c in _text(server, full[j:j + 1])
                  if c != "\ufffd" and c not in _text(server, full[:j]))
  assert sample([full[12], early])[:2] == (full[:j + 1], pb.STOP_REASON_STOP)


def test_default_stops_are_eos_and_empty_means_none(server):
  service = server[0]
  body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
          "sampling_params": {"max_tokens": 4}}
  eos = service.tokenizer.eos_id

  def stops(stop):
    body["sampling_params"]["stop"] = stop
    args = sample_args(body, service.cfg.vocab_size, 512, eos_id=eos, can_match_text=True)
    return args.sampling.stop_tokens, args.stop_strings

  assert stops(None) == ((eos,), ())
  assert stops([]) == ((), ())
  assert stops(["\n\nUser:"]) == ((eos,), ("\n\nUser:",))
  assert stops([7, 7, eos]) == ((eos, 7), ())
  for bad, message in (([1.5], "string or a token id"), ([""], "1 to 256 characters"),
                       (["x" * 257], "1 to 256"), ([True], "string or a token id"),
                       ([10 ** 6], r"not in \[0, "),
                       ([t for t in range(9) if t != eos][:4], "at most 4 token ids"),
                       ({"s": 1}, "must be a string, a list"), (["\ufffd"], "U\\+FFFD")):
    with pytest.raises(UserError, match=message):
      stops(bad)
  with pytest.raises(UserError, match="need the server's tokenizer"):
    sample_args({**body, "sampling_params": {"stop": ["x"]}}, service.cfg.vocab_size, 512)


def test_bad_stops_are_the_sdks_errors_not_500(server, sampler):
  with pytest.raises(tinker.BadRequestError, match="1 to 256 characters"):
    _sample(sampler, [""])
  with pytest.raises(tinker.BadRequestError, match="not in"):
    _sample(sampler, [10 ** 6])
  # what the SDK's own types refuse to send: a 400 naming it, by plain HTTP
  service = server[0]
  session = service.create_session()
  sampler_id = service.create_sampling_session(
      {"session_id": session, "base_model": MODEL})["sampling_session_id"]
  request = urllib.request.Request(
      f"{server[1]}/api/v1/asample", method="POST",
      data=json.dumps({"sampling_session_id": sampler_id, "num_samples": 1, "type": "sample",
                       "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
                       "sampling_params": {"max_tokens": 2, "stop": [1.5]}}).encode(),
      headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(request, timeout=30)
  assert e.value.code == 400 and "string or a token id" in json.loads(e.value.read())["detail"]


def test_stop_cut_on_text(server):
  text_of = server[0].tokenizer.decode_sampled
  ids = server[0].tokenizer.encode("Mia has 12 stickers.\n\nUser: more").tolist()
  k = stop_cut(ids, ["\n\nUser:"], text_of)
  assert "\n\nUser:" in text_of(ids[:k]) and "\n\nUser:" not in text_of(ids[:k - 1])
  assert stop_cut(ids, [text_of(ids[:1])[:1]], text_of) == 1
  assert stop_cut(ids, ["absent"], text_of) is None and stop_cut([], ["x"], text_of) is None
  # an id beyond the tokenizer's vocabulary reads as U+FFFD, never raises
  assert text_of([5, server[0].tokenizer.vocab_size + 1]) == text_of([5]) + "\ufffd"
