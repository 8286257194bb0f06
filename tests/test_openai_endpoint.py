"""The OpenAI-compatible endpoint (rljax.serving): an agent loop written against
the `openai` package drives a run's engine over HTTP on 127.0.0.1, in deterministic
numerics; every call's tokens are checked against the engine driven directly with the same
ids (bitwise), re-scored by the trainer's forward (0.0), and the finished episodes go
through the wire and one GRPO update (mismatch_max_abs 0.0)."""

import dataclasses
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import chex
import ml_collections
import numpy as np
import openai
import pytest

from rljax.engine.engine import Request
from rljax.envs.tokenizer import train_byte_level_bpe
from rljax.model.scoring import max_abs_diff, packed_logprobs
from rljax.pipeline import wire
from rljax.serving import Endpoint
from rljax.serving.tools import hermes_tool_calls, load_tool_parser, parse_tool_calls
from rljax.rl.trajectory import FinishReason, Outcome

MAX_SEQ_LEN = 128
SYSTEM = "You are a calculator agent. Use the tool."
TEXTS = [SYSTEM, "What is 12 + 34?", "tool result: 46", "the answer is 46",
         "Compute 7 * 8 with the tool.", "result: 56", "<|im_start|>user\nhello<|im_end|>"] * 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  """A deterministic run (arith_tiny's blocks, a tiny model over a 384-id byte-level BPE
  with a chat template) and the endpoint on its engine."""
  from configs import arith_tiny  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import core  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.run import build  # pylint: disable=import-outside-toplevel
  tokdir = train_byte_level_bpe(TEXTS, str(tmp_path_factory.mktemp("tok")), vocab_size=384)
  config = arith_tiny.get_config()
  config.numerics = "deterministic"
  config.model.update(dict(vocab_size=384, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1,
                           moe_intermediate_size=16, intermediate_size=32,
                           max_position_embeddings=MAX_SEQ_LEN))
  config.tokenizer = ml_collections.ConfigDict(dict(
      kind="hf", path=tokdir, chat_template=True, stop_tokens=("<|im_end|>", "<|endoftext|>")))
  config.engine = ml_collections.ConfigDict(dict(num_slots=8, max_seq_len=MAX_SEQ_LEN))
  config.rl.update(dict(prompts_per_step=2, group_size=2, max_new_tokens=8))
  config.eval.num_tasks = 2
  config.log.tensorboard = False
  run = core.setup(build(config), str(tmp_path_factory.mktemp("run")))
  endpoint = Endpoint(run.engine, run.env.tokenizer, sampling=run.built.sampling, seed=7)
  yield run, endpoint
  endpoint.close()


@pytest.fixture(scope="module")
def reference_engine(served):
  run, _ = served
  return run.built.make_engine(run.serve(run.state))


def _client(endpoint, base=None):
  return openai.OpenAI(api_key="unused", base_url=base or f"{endpoint.url}/v1", max_retries=0,
                       timeout=120.0)


def _post(endpoint, path, body):
  req = urllib.request.Request(endpoint.url + path, data=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"}, method="POST")
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def _register(endpoint, episode_id, group_id=None):
  status, out = _post(endpoint, "/v1/episodes", {"episode_id": episode_id, "group_id": group_id})
  assert status == 200, out
  return out


def agent_loop(client, episode_id, task, turns, max_tokens=8, extra=True):
  """A minimal tool-using agent: after each reply the harness appends a tool message."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
  responses = []
  for k in range(turns):
    kwargs = {"extra_body": {"episode_id": episode_id}} if extra else {}
    r = client.chat.completions.create(model="rljax", messages=messages, max_tokens=max_tokens,
                                       logprobs=True, **kwargs)
    responses.append(r)
    messages.append({"role": "assistant", "content": r.choices[0].message.content})
    if k + 1 < turns:
      messages.append({"role": "tool", "content": f"result: {46 + k}"})
  return messages, responses


def _turns(traj):
  """(observation ids, sampled count) of each turn after the first, from the loss mask."""
  mask = traj.loss_mask
  edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
  runs = np.split(np.arange(len(mask)), edges)
  first = len(runs[0])
  rest = [(traj.completion_ids[obs], len(act)) for obs, act in zip(runs[1::2], runs[2::2])]
  return first, rest


def engine_reference(engine, endpoint, traj, budgets):
  """The same episode on the engine driven directly: the recorded prompt, then each
  turn's recorded observation ids by `extend`, each turn with the budget it was asked."""
  sampling = dataclasses.replace(endpoint.sampling, max_new_tokens=budgets[0])
  (out,) = engine.generate([Request(traj.request_id, traj.prompt_ids, sampling=sampling,
                                    seed=endpoint.seed, group_id=traj.request_id,
                                    keep_pages=True)])
  _, rest = _turns(traj)
  for (obs, _), budget in zip(rest, budgets[1:]):
    engine.extend(traj.request_id, 0, obs, budget)
    (out,) = engine.run()
  engine.release(traj.request_id, 0)
  assert engine.idle and engine.pool.used_count == 0
  return out


def assert_same_record(traj, ref):
  for name in ("prompt_ids", "completion_ids", "loss_mask", "behaviour_logprobs", "versions",
               "expert_ids"):
    chex.assert_trees_all_equal(getattr(traj, name), getattr(ref, name), custom_message=name)
  assert traj.finish_reason == ref.finish_reason


def rescore_diff(run, trajs):
  """max |trainer - behaviour| log-prob over the sampled tokens, by the training forward."""
  lps = packed_logprobs(run.serve(run.state), [t.tokens for t in trajs], cfg=run.cfg,
                        numerics=run.numerics, row_len=MAX_SEQ_LEN)
  ours, theirs = [], []
  for t, lp in zip(trajs, lps):
    p = len(t.prompt_ids)
    ours.append(lp[p - 1:][t.loss_mask])
    theirs.append(t.behaviour_logprobs[t.loss_mask])
  return max_abs_diff(ours, theirs)


def test_chat_agent_loop_records_the_engines_own_tokens(served, reference_engine):
  run, endpoint = served
  tok = run.env.tokenizer
  _register(endpoint, "solo", "solo-group")
  messages, responses = agent_loop(_client(endpoint), "solo", "What is 12 + 34?", turns=4,
                                   max_tokens=6)  # 40 + 4 x 6 + 3 x 20 tokens: < 128
  assert len(responses) == 4 and endpoint.stats["extends"] == 3  # KV of earlier turns kept
  traj = endpoint.finish("solo", reward=1.0)
  assert traj.outcome == Outcome.SUCCESS and traj.expert_ids is not None
  assert len(traj.expert_ids) == len(traj.tokens)

  # token in, token out: what each response reported is the record, call by call
  first, rest = _turns(traj)
  chex.assert_trees_all_equal(traj.prompt_ids, np.asarray(
      responses[0].rljax["prompt_token_ids"], np.int32))
  pos = 0
  for k, r in enumerate(responses):
    if k:
      obs = np.asarray(r.rljax["prompt_token_ids"], np.int32)
      chex.assert_trees_all_equal(traj.completion_ids[pos:pos + len(obs)], obs)
      assert not traj.loss_mask[pos:pos + len(obs)].any()
      pos += len(obs)
    ids = np.asarray(r.rljax["completion_token_ids"], np.int32)
    lps = np.asarray(r.rljax["completion_logprobs"], np.float32)
    chex.assert_trees_all_equal(traj.completion_ids[pos:pos + len(ids)], ids)
    chex.assert_trees_all_equal(traj.behaviour_logprobs[pos:pos + len(ids)], lps)
    chex.assert_trees_all_equal(
        np.asarray([c.logprob for c in r.choices[0].logprobs.content], np.float32), lps)
    assert traj.loss_mask[pos:pos + len(ids)].all()
    assert (traj.versions[pos:pos + len(ids)] == 0).all()
    pos += len(ids)
  assert pos == len(traj.completion_ids)
  assert (traj.behaviour_logprobs[~traj.loss_mask] == 0).all()
  assert (traj.versions[~traj.loss_mask] == -1).all()

  # the chat template, incrementally: the first prompt is the template's render; each
  # later turn appends exactly the template's text for the tool message (with the close
  # of the reply when the reply did not end on <|im_end|> itself)
  hf = tok.hf
  assert tok.decode(traj.prompt_ids) == hf.apply_chat_template(
      messages[:2], tokenize=False, add_generation_prompt=True)
  im_end = tok.token_to_id("<|im_end|>")
  for k, r in enumerate(responses[1:], start=1):
    prev = responses[k - 1].rljax["completion_token_ids"]
    close = "" if prev[-1] == im_end else "<|im_end|>"
    assert tok.decode(r.rljax["prompt_token_ids"]) == (
        f"{close}\n<|im_start|>tool\nresult: {46 + k - 1}<|im_end|>\n<|im_start|>assistant\n")

  # bitwise the engine's own tokens, log-probs and routing for the same ids, and the
  # trainer's forward gives the same log-probs
  budgets = [6] * 4
  assert_same_record(traj, engine_reference(reference_engine, endpoint, traj, budgets))
  assert rescore_diff(run, [traj]) == 0.0


def test_completions_extend_the_text_without_retokenizing(served, reference_engine):
  run, endpoint = served
  tok = run.env.tokenizer
  client = _client(endpoint)
  _register(endpoint, "text")
  prompt = "Compute 7 * 8 with the tool."
  r1 = client.completions.create(model="rljax", prompt=prompt, max_tokens=6,
                                 extra_headers={"X-Episode-Id": "text"}, logprobs=0)
  text = prompt + r1.choices[0].text
  r2 = client.completions.create(model="rljax", prompt=text + "\nresult: 56\n", max_tokens=6,
                                 extra_headers={"X-Episode-Id": "text"})
  assert r2.rljax["prompt_token_ids"] == tok.encode("\nresult: 56\n").tolist()
  with pytest.raises(openai.BadRequestError, match="history_mismatch"):
    client.completions.create(model="rljax", prompt="Compute 7 * 9", max_tokens=6,
                              extra_headers={"X-Episode-Id": "text"})
  traj = endpoint.finish("text", reward=0.0)
  assert traj.outcome == Outcome.MODEL_FAILURE
  chex.assert_trees_all_equal(traj.prompt_ids, tok.encode(prompt))
  assert_same_record(traj, engine_reference(reference_engine, endpoint, traj, [6, 6]))

  # token ids in: a base URL per episode, no extra field at all
  _register(endpoint, "ids")
  ids_client = _client(endpoint, f"{endpoint.url}/episodes/ids/v1")
  p = [5, 6, 7, 8]
  c1 = ids_client.completions.create(model="rljax", prompt=p, max_tokens=5)
  seq = p + c1.rljax["completion_token_ids"]
  c2 = ids_client.completions.create(model="rljax", prompt=seq + [9, 10], max_tokens=5)
  assert c2.rljax["prompt_token_ids"] == [9, 10]
  with pytest.raises(openai.BadRequestError, match="history_mismatch"):
    ids_client.completions.create(model="rljax", prompt=[5, 6, 7, 9], max_tokens=5)
  traj = endpoint.finish("ids", reward=0.5)
  assert traj.tokens[:len(seq)].tolist() == seq
  assert_same_record(traj, engine_reference(reference_engine, endpoint, traj, [5, 5]))
  assert rescore_diff(run, [traj]) == 0.0


def test_an_episode_that_outgrows_the_context_finishes_cut(served, reference_engine):
  # Long episodes: a reply that reaches max_seq_len, or a turn refused with
  # context_length_exceeded, finishes the episode as FinishReason.CONTEXT (what the trainer
  # trains of it is config.rl.overlong's); a turn that fits after a refused one is how the
  # episode ends instead.
  run, endpoint = served
  _register(endpoint, "full")
  full = _client(endpoint, f"{endpoint.url}/episodes/full/v1")
  prompt = [5 + i % 300 for i in range(MAX_SEQ_LEN - 2)]
  r = full.completions.create(model="rljax", prompt=prompt, max_tokens=50)
  assert len(r.rljax["completion_token_ids"]) == 2 and r.choices[0].finish_reason == "length"
  traj = endpoint.finish("full", reward=0.0)
  assert traj.finish_reason == FinishReason.CONTEXT and len(traj.tokens) == MAX_SEQ_LEN
  assert_same_record(traj, engine_reference(reference_engine, endpoint, traj, [50]))

  _register(endpoint, "refused")
  client = _client(endpoint, f"{endpoint.url}/episodes/refused/v1")
  seq = [5, 6, 7, 8]
  r = client.completions.create(model="rljax", prompt=seq, max_tokens=4)
  seq += r.rljax["completion_token_ids"]
  too_long = seq + [9] * (MAX_SEQ_LEN - len(seq))
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="rljax", prompt=too_long, max_tokens=4)
  assert e.value.code == "context_length_exceeded"
  assert endpoint.episode("refused").finish_reason == FinishReason.CONTEXT
  r = client.completions.create(model="rljax", prompt=seq + [9, 10], max_tokens=4)  # fits
  seq += [9, 10] + r.rljax["completion_token_ids"]
  assert endpoint.episode("refused").finish_reason != FinishReason.CONTEXT
  with pytest.raises(openai.BadRequestError, match="max_seq_len is 128"):
    client.completions.create(model="rljax", prompt=seq + [9] * MAX_SEQ_LEN, max_tokens=4)
  traj = endpoint.finish("refused", reward=1.0)
  assert traj.finish_reason == FinishReason.CONTEXT
  assert traj.tokens.tolist() == seq  # refused calls appended nothing
  assert rescore_diff(run, [traj]) == 0.0
  assert run.engine.pool.used_count == 0


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(served):
  run, endpoint = served
  client = _client(endpoint)
  with pytest.raises(openai.NotFoundError, match="unknown episode"):
    client.chat.completions.create(model="rljax", messages=[{"role": "user", "content": "hi"}],
                                   extra_body={"episode_id": "never-registered"})
  with pytest.raises(openai.BadRequestError, match="no episode"):
    client.chat.completions.create(model="rljax", messages=[{"role": "user", "content": "hi"}])
  assert _post(endpoint, "/v1/episodes", {"episode_id": "bad"})[0] == 200
  assert _post(endpoint, "/v1/episodes", {"episode_id": "bad"})[0] == 409
  assert _post(endpoint, "/v1/episodes/nobody/finish", {"reward": 1.0})[0] == 404
  assert _post(endpoint, "/v1/episodes/bad/finish", {"reward": 1.0})[0] == 400  # no turns
  extra = {"extra_body": {"episode_id": "bad"}}
  with pytest.raises(openai.BadRequestError, match="max_seq_len is 128") as e:
    client.chat.completions.create(model="rljax", messages=[
        {"role": "user", "content": "What is 12 + 34? " * 100}], **extra)
  assert e.value.code == "context_length_exceeded"
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.chat.completions.create(model="rljax", messages=[{"role": "user", "content": "hi"}],
                                   temperature=0.3, **extra)
  with pytest.raises(openai.BadRequestError, match="n must be 1"):
    client.chat.completions.create(model="rljax", messages=[{"role": "user", "content": "hi"}],
                                   n=2, **extra)
  messages, _ = agent_loop(client, "bad", "What is 12 + 34?", turns=2, max_tokens=4)
  recorded = endpoint.episode("bad").tokens[:]
  edited = [dict(m) for m in messages] + [{"role": "tool", "content": "result: 1"}]
  edited[1]["content"] = "What is 12 + 35?"  # an earlier message edited
  with pytest.raises(openai.BadRequestError, match=r"history_mismatch: messages\[1\]"):
    client.chat.completions.create(model="rljax", messages=edited, **extra)
  other = [dict(m) for m in messages] + [{"role": "tool", "content": "result: 1"}]
  other[-2]["content"] += " (edited)"  # not the reply the engine sampled
  with pytest.raises(openai.BadRequestError, match=r"history_mismatch: messages\[4\]"):
    client.chat.completions.create(model="rljax", messages=other, **extra)
  with pytest.raises(openai.BadRequestError, match="last message must not be the assistant"):
    client.chat.completions.create(model="rljax", messages=messages, **extra)
  assert endpoint.episode("bad").tokens == recorded  # refused calls changed nothing
  # the same episode continues correctly after its refused calls
  ok = client.chat.completions.create(
      model="rljax", messages=messages + [{"role": "tool", "content": "result: 1"}],
      max_tokens=4, **extra)
  assert ok.choices[0].finish_reason in ("stop", "length")
  req = urllib.request.Request(endpoint.url + "/v1/chat/completions", data=b"{not json",
                               method="POST")
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(req, timeout=30)
  assert e.value.code == 400 and "not JSON" in json.loads(e.value.read())["error"]["message"]
  with urllib.request.urlopen(endpoint.url + "/health", timeout=30) as r:
    assert json.loads(r.read()) == {"ok": True}
  assert [m.id for m in client.models.list().data] == ["rljax"]
  traj = endpoint.finish("bad", reward=0.0, outcome="infra_failure")
  assert traj.outcome == Outcome.INFRA_FAILURE
  assert _post(endpoint, "/v1/episodes/bad/finish", {"reward": 1.0})[0] == 409
  assert run.engine.pool.used_count == 0  # every finished episode's pages are back


def test_over_registration_and_malformed_requests_are_4xx_and_nothing_raises(served):
  # a third episode in a group of two is refused at registration (it used to be accepted,
  # and take_groups then raised in serve.py's loop); a group the endpoint did not bound
  # that outgrows take_groups' size is left out, never an exception
  run, endpoint = served
  endpoint.group_size = 2
  try:
    _register(endpoint, "pair-a", "pair")
    _register(endpoint, "pair-b", "pair")
    status, out = _post(endpoint, "/v1/episodes", {"episode_id": "pair-c", "group_id": "pair"})
    assert status == 409 and out["error"]["code"] == "group_full", out
    assert endpoint.take_groups() == []  # the endpoint's group size
  finally:
    endpoint.group_size = None
  for eid in ("big-a", "big-b", "big-c"):
    _register(endpoint, eid, "big")
  before = endpoint.stats["oversized_groups"]
  assert all(g.task.task_id != "big" for g in endpoint.take_groups(2))
  assert endpoint.stats["oversized_groups"] == before + 1
  for eid in ("pair-a", "pair-b", "big-a", "big-b", "big-c"):
    endpoint.drop(eid)
  # malformed HTTP: 400s, and the server answers the next request
  conn = http.client.HTTPConnection(endpoint.url[len("http://"):], timeout=30)
  conn.putrequest("POST", "/v1/episodes")
  conn.putheader("Content-Length", "lots")
  conn.endheaders()
  r = conn.getresponse()
  assert r.status == 400 and "Content-Length" in json.loads(r.read())["error"]["message"]
  conn.close()
  for path, body in (("/v1/episodes", {"episode_id": 5}), ("/v1/episodes", {"group_id": "a b"}),
                     ("/v1/chat/completions", {"messages": "hi", "episode_id": "x"}),
                     ("/v1/completions", {"prompt": [1.5], "episode_id": "x"}),
                     ("/v1/episodes/nobody/finish", {"reward": "high"})):
    status, out = _post(endpoint, path, body)
    assert 400 <= status < 500, (path, body, status, out)
  with urllib.request.urlopen(endpoint.url + "/health", timeout=30) as r:
    assert json.loads(r.read()) == {"ok": True}
  assert endpoint.stats["http_500"] == 0


def _chat(client, eid, messages, extra_body=None, **kwargs):
  return client.chat.completions.create(model="rljax", messages=messages,
                                        extra_body={"episode_id": eid, **(extra_body or {})},
                                        **kwargs)


def test_seed_greedy_stop_strings_and_limits_are_honoured(served):
  run, endpoint = served
  tok = run.env.tokenizer
  client = _client(endpoint)
  msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 + 34?"}]
  ids = lambda r: r.rljax["completion_token_ids"]  # noqa: E731
  # seed: the same seed and messages give the same tokens in two episodes, another seed not
  for eid in ("seed-a", "seed-b", "seed-c", "greedy-a", "greedy-b"):
    _register(endpoint, eid)
  a = _chat(client, "seed-a", msgs, max_tokens=8, seed=123)
  b = _chat(client, "seed-b", msgs, max_tokens=8, seed=123)
  c = _chat(client, "seed-c", msgs, max_tokens=8, seed=124)
  assert ids(a) == ids(b) and a.rljax["completion_logprobs"] == b.rljax["completion_logprobs"]
  assert ids(a) != ids(c)
  # temperature=0: greedy (no key at all: two episodes agree without a seed); the record
  # keeps the temperature-1 log-probs, the trainer's
  g1 = _chat(client, "greedy-a", msgs, max_tokens=6, temperature=0)
  g2 = _chat(client, "greedy-b", msgs, max_tokens=6, temperature=0.0)
  assert ids(g1) == ids(g2) and len(ids(g1)) <= 6
  # max_completion_tokens caps the turn
  m = _chat(client, "seed-c", msgs + [{"role": "assistant", "content": c.choices[0].message.content},
                                       {"role": "tool", "content": "result: 46"}],
            max_completion_tokens=2)
  assert len(ids(m)) <= 2
  trajs = [endpoint.finish(e, reward=1.0) for e in ("seed-a", "seed-c", "greedy-a")]
  endpoint.finish("seed-b", reward=0.0)
  endpoint.finish("greedy-b", reward=0.0)
  assert rescore_diff(run, trajs) == 0.0

  # stop as text: a string spanning two sampled tokens (found in a seeded reply) stops the
  # same seeded reply where its text first holds it; the content leaves it out, the record
  # keeps the sampled tokens through the one that completed it, and the episode continues
  dec = endpoint._decode  # pylint: disable=protected-access  (ids past the tokenizer's: U+FFFD)
  for seed in range(200, 230):
    _register(endpoint, f"probe-{seed}")
    probe = ids(_chat(client, f"probe-{seed}", msgs, max_tokens=8, seed=seed))
    endpoint.drop(f"probe-{seed}")
    body = [t for t in probe if t not in endpoint.stop_ids]
    spots = [i for i in range(1, len(body) - 1)
             if "\ufffd" not in dec(body[:i + 2]) and len(dec(body[i:i + 2])) >= 2
             and len(dec(body[i:i + 1])) >= 1]
    if spots:
      break
  assert spots, "no seeded reply with two clean tokens to stop on"
  i = spots[0]
  stop = dec(body[i:i + 2])
  k = next(n for n in range(1, len(body) + 1) if stop in dec(body[:n]))
  _register(endpoint, "stopped")
  cuts = endpoint.stats["stop_string_cuts"]
  r = _chat(client, "stopped", msgs, max_tokens=8, seed=seed, stop=[stop, "never-said-xyz"])
  assert ids(r) == body[:k] and r.choices[0].finish_reason == "stop"
  full = dec(body[:k])
  assert r.choices[0].message.content == full[:full.index(stop)]
  assert stop not in r.choices[0].message.content
  r2 = _chat(client, "stopped", msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                                        {"role": "tool", "content": "result: 46"}], max_tokens=4)
  assert tok.decode(r2.rljax["prompt_token_ids"]).startswith("<|im_end|>\n<|im_start|>tool")
  traj = endpoint.finish("stopped", reward=1.0)
  assert traj.completion_ids[:k].tolist() == body[:k] and traj.loss_mask[:k].all()
  assert not traj.loss_mask[k]  # the template's close and the tool message: observation
  assert rescore_diff(run, [traj]) == 0.0
  assert endpoint.stats["stop_string_cuts"] == cuts + (k < len(probe))  # engine's copy dropped
  assert run.engine.pool.used_count == 0


def test_unsupported_parameters_and_unknown_models_are_refused_by_name(served):
  run, endpoint = served
  client = _client(endpoint)
  _register(endpoint, "params")
  msgs = [{"role": "user", "content": "hi"}]
  for kwargs, param in ((dict(logit_bias={"5": 10}), "logit_bias"),
                        (dict(presence_penalty=0.5), "presence_penalty"),
                        (dict(frequency_penalty=1.0), "frequency_penalty"),
                        (dict(response_format={"type": "json_object"}), "response_format"),
                        (dict(stream_options={"include_usage": True}), "stream_options"),
                        (dict(n=2), "n"),
                        (dict(temperature=0.5), "temperature"), (dict(top_p=0.9), "top_p"),
                        (dict(seed="x"), "seed"), (dict(stop=["a"] * 5), "stop"),
                        (dict(extra_body={"repetition_penalty": 1.1}), "repetition_penalty")):
    with pytest.raises(openai.BadRequestError) as e:
      _chat(client, "params", msgs, **kwargs)
    assert e.value.param == param and param in e.value.message, (kwargs, e.value)
  with pytest.raises(openai.NotFoundError) as e:
    client.chat.completions.create(model="gpt-4o", messages=msgs,
                                   extra_body={"episode_id": "params"})
  assert e.value.code == "model_not_found"
  with pytest.raises(openai.BadRequestError) as e:
    client.completions.create(model="rljax", prompt="hi", best_of=2,
                              extra_body={"episode_id": "params"})
  assert e.value.param == "best_of"
  assert client.models.retrieve("rljax").id == "rljax"
  with pytest.raises(openai.NotFoundError) as e:
    client.models.retrieve("gpt-4o")
  assert e.value.code == "model_not_found"
  # no-op values some clients always send are served
  r = _chat(client, "params", msgs, max_tokens=2, presence_penalty=0, frequency_penalty=0.0,
            logit_bias={}, stream=False, user="someone")
  assert len(r.rljax["completion_token_ids"]) <= 2
  endpoint.finish("params", reward=0.0)
  assert endpoint.stats["http_500"] == 0


# a Qwen3-style template that renders tools, tool calls and tool replies
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n<tools>' }}{% for tool in tools %}"
    "{{ tool.function.name + ' ' }}{% endfor %}{{ '</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' + "
    "call.function.arguments + '}\\n</tool_call>' }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def always_calls(text):
  """A tool parser by import path, for tests: every reply is the call add(12, 34)."""
  del text
  return None, [{"name": "add", "arguments": json.dumps({"a": 12, "b": 34})}]


def test_hermes_tool_calls_are_parsed_and_malformed_ones_are_content():
  text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
  assert hermes_tool_calls(text) == ("Let me add.", [{"name": "add",
                                                      "arguments": '{"a": 1, "b": 2}'}])
  two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
  assert hermes_tool_calls(two) == (None, [{"name": "a", "arguments": "{}"},
                                           {"name": "b", "arguments": "{}"}])
  for bad in ("no call", "<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}'
              '</tool_call>', '<tool_call>{"name": "a"', '<tool_call>["a"]</tool_call>',
              '<tool_call>{"name": "a", "arguments": 3}</tool_call>'):
    assert hermes_tool_calls(bad) is None, bad
  assert parse_tool_calls(lambda t: 1 / 0, "x") is None  # a parser's error: no call
  assert load_tool_parser("none") is None and load_tool_parser("hermes") is hermes_tool_calls
  assert load_tool_parser(f"{__name__}:always_calls") is always_calls


def test_tools_are_rendered_by_the_template_and_tool_calls_round_trip(served):
  # tools reach the prompt through the checkpoint's template; the model's calls come back
  # as message.tool_calls (finish_reason tool_calls); the harness's assistant message with
  # them and its tool reply are accepted, and the next turn extends the recorded ids (a
  # re-render of the history would re-serialise the call into other tokens)
  run, endpoint = served
  tok = run.env.tokenizer
  hf = tok.hf
  template, parser = hf.chat_template, endpoint.tool_parser
  hf.chat_template = TOOLS_TEMPLATE
  try:
    client = _client(endpoint)
    msgs = [{"role": "user", "content": "What is 12 + 34?"}]  # short: the context is 128
    _register(endpoint, "tools-plain")
    r0 = _chat(client, "tools-plain", msgs, tools=TOOLS, tool_choice="auto", max_tokens=4)
    prompt = tok.decode(r0.rljax["prompt_token_ids"])
    assert prompt == hf.apply_chat_template(msgs, tools=TOOLS, tokenize=False,
                                            add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n<tools>add </tools>")
    # the hermes parser on a random model's text: no well-formed call, plain content
    assert not r0.choices[0].message.tool_calls
    assert r0.choices[0].finish_reason in ("stop", "length")
    endpoint.finish("tools-plain", reward=0.0)

    endpoint.tool_parser = load_tool_parser(f"{__name__}:always_calls")
    _register(endpoint, "tools")
    with pytest.raises(openai.BadRequestError) as e:
      _chat(client, "tools", msgs, tools=TOOLS, tool_choice="required")
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:  # a named function: forced too
      _chat(client, "tools", msgs, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "add"}})
    assert e.value.param == "tool_choice"
    _register(endpoint, "tools-none")  # "none": the tools rendered, no call parsed
    r = _chat(client, "tools-none", msgs, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert tok.decode(r.rljax["prompt_token_ids"]).startswith("<|im_start|>system\n<tools>add ")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"
    endpoint.drop("tools-none")
    r1 = _chat(client, "tools", msgs, tools=TOOLS, max_tokens=6)
    assert r1.choices[0].finish_reason == "tool_calls"
    (call,) = r1.choices[0].message.tool_calls
    assert call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 12, "b": 34}
    reply = r1.choices[0].message.model_dump(exclude_none=True)
    history = msgs + [reply, {"role": "tool", "tool_call_id": call.id, "content": "46"}]
    with pytest.raises(openai.BadRequestError) as e:  # other tools than the prompt's
      _chat(client, "tools", history, tools=TOOLS + TOOLS, max_tokens=4)
    assert e.value.param == "tools"
    edited = [dict(m) for m in history]
    edited[1] = dict(reply, tool_calls=[dict(reply["tool_calls"][0], function={
        "name": "add", "arguments": '{"a": 1, "b": 34}'})])
    with pytest.raises(openai.BadRequestError, match=r"history_mismatch: messages\[1\]"):
      _chat(client, "tools", edited, tools=TOOLS, max_tokens=4)
    r2 = _chat(client, "tools", history, tools=TOOLS, max_tokens=4)
    im_end = tok.token_to_id("<|im_end|>")
    close = "" if r1.rljax["completion_token_ids"][-1] == im_end else "<|im_end|>"
    assert tok.decode(r2.rljax["prompt_token_ids"]) == (
        close + "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    traj = endpoint.finish("tools", reward=1.0)
    first = r1.rljax["completion_token_ids"]
    assert traj.completion_ids[:len(first)].tolist() == first and traj.loss_mask[:len(first)].all()
    rerender = tok.encode(hf.apply_chat_template(
        [dict(m, content=m.get("content") or "") for m in history], tools=TOOLS,
        tokenize=False, add_generation_prompt=True)).tolist()
    assert traj.tokens[:len(rerender)].tolist() != rerender  # re-tokenizing would rewrite it
    assert rescore_diff(run, [traj]) == 0.0
    _register(endpoint, "tools-stream")  # streamed: the call as a tool-call delta
    chunks = list(_chat(client, "tools-stream", msgs, tools=TOOLS, max_tokens=6, stream=True))
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or ()) if c.choices]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in deltas] == [
        (0, "add", {"a": 12, "b": 34})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    endpoint.drop("tools-stream")
  finally:
    hf.chat_template, endpoint.tool_parser = template, parser
  assert endpoint.stats["http_500"] == 0


def test_streaming_sends_the_reply_as_events_and_records_the_same_tokens(served):
  run, endpoint = served
  client = _client(endpoint)
  msgs = [{"role": "user", "content": "What is 12 + 34?"}]
  for eid in ("plain-s", "streamed-s", "cmpl-s"):
    _register(endpoint, eid)
  # the text goes out as the engine steps (8 tokens a call) produce it, held back where
  # it may be the start of a stop string; joined, it is the non-streamed content
  kw = dict(max_tokens=20, seed=77, logprobs=True, stop=["e", "<t"])
  plain = _chat(client, "plain-s", msgs, **kw)
  chunks = list(_chat(client, "streamed-s", msgs, stream=True,
                      stream_options={"include_usage": True}, **kw))
  assert chunks[0].choices[0].delta.role == "assistant"
  pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
  assert "".join(pieces) == plain.choices[0].message.content
  assert len(pieces) >= 2 and plain.usage.completion_tokens == 20  # before the turn's end
  finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
  assert finish == [plain.choices[0].finish_reason]
  assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
  a, b = endpoint.finish("plain-s", reward=0.0), endpoint.finish("streamed-s", reward=0.0)
  for name in ("prompt_ids", "completion_ids", "loss_mask", "behaviour_logprobs", "versions",
               "expert_ids"):
    chex.assert_trees_all_equal(getattr(a, name), getattr(b, name), custom_message=name)
  c = list(client.completions.create(model="rljax", prompt="Compute 7 * 8", max_tokens=4,
                                     stream=True, extra_body={"episode_id": "cmpl-s"}))
  assert c[-1].choices[0].finish_reason in ("stop", "length")
  ep = endpoint.episode("cmpl-s")
  assert "".join(x.choices[0].text for x in c) == endpoint._reply_text(  # pylint: disable=protected-access
      ep.tokens[ep.prompt_len:])
  endpoint.finish("cmpl-s", reward=0.0)


def test_a_retried_call_gets_its_recorded_turn_and_records_it_once(served):
  # a client that lost a reply (a timeout, a dropped connection) and sends the same call
  # again gets the recorded turn, not a second turn or a history_mismatch
  run, endpoint = served
  _register(endpoint, "retry")
  body = {"model": "rljax", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
          "episode_id": "retry"}
  s1, r1 = _post(endpoint, "/v1/chat/completions", body)
  s2, r2 = _post(endpoint, "/v1/chat/completions", body)
  assert s1 == s2 == 200 and r1 == r2 and endpoint.episode("retry").turns == 1
  # the SDK's own retries after client timeouts while the turn waits in the endpoint
  replayed = endpoint.stats["replayed_calls"]
  client = openai.OpenAI(api_key="unused", base_url=f"{endpoint.url}/v1", max_retries=4,
                         timeout=1.0)
  msgs = body["messages"] + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                             {"role": "user", "content": "again"}]
  endpoint.pause()
  timer = threading.Timer(2.5, endpoint.resume)
  timer.start()
  try:
    r3 = client.chat.completions.create(model="rljax", messages=msgs, max_tokens=4,
                                        extra_body={"episode_id": "retry"})
  finally:
    timer.join()
    endpoint.resume()
  assert endpoint.stats["replayed_calls"] > replayed
  traj = endpoint.finish("retry", reward=0.0)
  assert endpoint.episode("retry").turns == 2
  ids = r3.rljax["completion_token_ids"]
  assert traj.completion_ids[-len(ids):].tolist() == ids
  assert rescore_diff(run, [traj]) == 0.0
  assert endpoint.stats["http_500"] == 0


def _hang_up(endpoint, body, *, first_bytes=False):
  """A chat call on a raw socket whose client closes it before reading the reply
  (`first_bytes`: after the reply's first byte, mid-stream)."""
  host, port = endpoint.url[len("http://"):].split(":")
  data = json.dumps(body).encode()
  sock = socket.create_connection((host, int(port)), timeout=60)
  sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
               f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
  if first_bytes:
    assert sock.recv(1)
  sock.close()


def _wait_unseen(endpoint, eid, turns):
  """Until the episode holds `turns` turns, the last one never delivered."""
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    with endpoint._lock:  # pylint: disable=protected-access
      ep = endpoint._episodes[eid]  # pylint: disable=protected-access
      if ep.turns == turns and not ep.busy and ep.last_call is not None and \
          ep.last_call.unseen:
        return
    time.sleep(0.01)
  raise AssertionError(f"{eid}: no undelivered turn {turns}")


def _turn_nobody_gets(endpoint, body):
  """The call's turn runs after its client hung up (held until the server has it)."""
  turns = endpoint.episode(body["episode_id"]).turns
  endpoint.pause()
  try:
    _hang_up(endpoint, body)
    deadline = time.monotonic() + 60
    while endpoint.waiting_turns < 1 and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    endpoint.resume()
  _wait_unseen(endpoint, body["episode_id"], turns + 1)


def _chat_ok(endpoint, eid, messages, **kw):
  status, r = _post(endpoint, "/v1/chat/completions",
                    {"model": "rljax", "messages": messages, "episode_id": eid, **kw})
  assert status == 200, r
  return r


def _reply(r):
  return {"role": "assistant", "content": r["choices"][0]["message"]["content"]}


def _twin_episodes(endpoint, lost, kept):
  """Two episodes with the same seeded first turn; the history after it."""
  for eid in (lost, kept):
    _register(endpoint, eid)
  msgs = [{"role": "user", "content": "What is 12 + 34?"}]
  r1 = [_chat_ok(endpoint, eid, msgs, max_tokens=6, seed=5) for eid in (lost, kept)]
  assert r1[0]["rljax"]["completion_token_ids"] == r1[1]["rljax"]["completion_token_ids"]
  return msgs + [_reply(r1[0])]


def test_a_turn_its_client_never_got_is_rolled_back_by_a_different_call(served):
  # the harness hangs up on a turn and sends something else (the same history with
  # another observation and budget): 200, and the episode is the one a harness without
  # the hang-up records (seeded calls: the same keys in both episodes), bit for bit
  run, endpoint = served
  before = dict(endpoint.stats)
  history = _twin_episodes(endpoint, "lost", "kept")
  _turn_nobody_gets(endpoint, {"model": "rljax", "episode_id": "lost", "max_tokens": 8,
                               "seed": 5, "messages": history + [
                                   {"role": "tool", "content": "result: 46"}]})
  history.append({"role": "tool", "content": "result: 47"})
  r2 = [_chat_ok(endpoint, eid, history, max_tokens=5, seed=5) for eid in ("lost", "kept")]
  assert endpoint.episode("lost").turns == 2
  history += [_reply(r2[0]), {"role": "user", "content": "again"}]
  r3 = [_chat_ok(endpoint, eid, history, max_tokens=7, seed=5) for eid in ("lost", "kept")]
  assert r3[0]["rljax"]["completion_token_ids"] == r3[1]["rljax"]["completion_token_ids"]
  a, b = endpoint.finish("lost", reward=1.0), endpoint.finish("kept", reward=1.0)
  assert_same_record(a, b)
  assert rescore_diff(run, [a]) == 0.0
  stats = {k: endpoint.stats[k] - before.get(k, 0) for k in endpoint.stats}
  assert stats["rolled_back_turns"] == 1 and stats["undelivered_replies"] == 1
  assert endpoint.stats["http_500"] == 0


def test_a_connection_on_a_descriptor_past_1024_gets_its_reply(served):
  # a busy server's connections get descriptors past select()'s 1024: its check whether a
  # client is gone must not mistake them for gone clients (no reply, "server disconnected")
  _, endpoint = served
  lost = endpoint.stats["undelivered_replies"]
  held = [os.open(os.devnull, os.O_RDONLY)]
  try:
    while held[-1] < 1100:
      held.append(os.open(os.devnull, os.O_RDONLY))
    _register(endpoint, "high-fd")
    r = _chat_ok(endpoint, "high-fd", [{"role": "user", "content": "hi"}], max_tokens=3)
    assert r["rljax"]["completion_token_ids"]
  finally:
    for fd in held:
      os.close(fd)
  endpoint.finish("high-fd", reward=0.0)
  assert endpoint.stats["undelivered_replies"] == lost


def test_a_call_while_the_turn_it_gave_up_on_still_runs_waits_and_rolls_it_back(served):
  # the client hangs up while its turn still waits in the endpoint, and the harness sends
  # something else at once (another observation): that call waits for the turn (no 409
  # episode_busy), learns its reply never arrived, rolls it back and runs; the episode is
  # the one a harness without the hang-up records, bit for bit
  run, endpoint = served
  before = dict(endpoint.stats)
  history = _twin_episodes(endpoint, "gave-up", "kept-g")
  other = history + [{"role": "tool", "content": "result: 47"}]
  result = {}
  endpoint.pause()
  try:
    _hang_up(endpoint, {"model": "rljax", "episode_id": "gave-up", "max_tokens": 8,
                        "seed": 5, "messages": history + [{"role": "tool",
                                                           "content": "result: 46"}]})
    deadline = time.monotonic() + 60  # until this episode's turn waits (not any turn)
    while not (endpoint.episode("gave-up").busy and endpoint.waiting_turns >= 1) and \
        time.monotonic() < deadline:
      time.sleep(0.01)
    assert endpoint.episode("gave-up").busy  # the lost turn is in flight
    call = threading.Thread(target=lambda: result.update(out=_post(
        endpoint, "/v1/chat/completions", {"model": "rljax", "episode_id": "gave-up",
                                           "messages": other, "max_tokens": 5, "seed": 5})))
    call.start()
  finally:
    endpoint.resume()
  call.join(120)
  status, r2 = result["out"]
  assert status == 200, r2
  kept = _chat_ok(endpoint, "kept-g", other, max_tokens=5, seed=5)
  assert r2["rljax"]["completion_token_ids"] == kept["rljax"]["completion_token_ids"]
  a, b = endpoint.finish("gave-up", reward=1.0), endpoint.finish("kept-g", reward=1.0)
  assert_same_record(a, b)
  assert rescore_diff(run, [a]) == 0.0
  stats = {k: endpoint.stats[k] - before.get(k, 0) for k in endpoint.stats}
  assert stats["rolled_back_turns"] == 1 and stats["undelivered_replies"] == 1
  assert stats.get("http_409", 0) == 0 and endpoint.stats["http_500"] == 0


def test_a_streamed_turn_cut_mid_stream_is_rolled_back_exactly(served, reference_engine):
  # the client reads the stream's first byte and hangs up while the engine decodes; the
  # next call (other observation, other budget) rolls the turn back: the record is the
  # engine's own, driven directly with the calls the harness made (bitwise)
  run, endpoint = served
  _register(endpoint, "lost-s")
  msgs = [{"role": "user", "content": "Compute 7 * 8 with the tool."}]
  r1 = _chat_ok(endpoint, "lost-s", msgs, max_tokens=6)
  history = msgs + [_reply(r1)]
  got, gone, step = threading.Event(), threading.Event(), run.engine.step

  def held_step():  # once the client has the stream's start, no step until it hung up
    if got.is_set():
      gone.wait(30)
    return step()

  run.engine.step = held_step
  try:
    host, port = endpoint.url[len("http://"):].split(":")
    body = {"model": "rljax", "episode_id": "lost-s", "max_tokens": 40, "stream": True,
            "messages": history + [{"role": "tool", "content": "result: 56"}]}
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    assert sock.recv(1)
    got.set()
    sock.close()
    gone.set()
    _wait_unseen(endpoint, "lost-s", 2)
  finally:
    del run.engine.step
  assert endpoint.episode("lost-s").turns == 2
  history.append({"role": "tool", "content": "result: 57"})
  r2 = _chat_ok(endpoint, "lost-s", history, max_tokens=5)
  history += [_reply(r2), {"role": "user", "content": "again"}]
  _chat_ok(endpoint, "lost-s", history, max_tokens=8)
  traj = endpoint.finish("lost-s", reward=0.0)
  assert_same_record(traj, engine_reference(reference_engine, endpoint, traj, [6, 5, 8]))
  assert rescore_diff(run, [traj]) == 0.0
  assert endpoint.stats["http_500"] == 0


def test_finishing_after_an_undelivered_last_turn_trains_on_what_the_harness_saw(served):
  run, endpoint = served
  _register(endpoint, "lost-f")
  msgs = [{"role": "user", "content": "What is 12 + 34?"}]
  r1 = _chat_ok(endpoint, "lost-f", msgs, max_tokens=6)
  seen = endpoint.episode("lost-f").snapshot()
  _turn_nobody_gets(endpoint, {"model": "rljax", "episode_id": "lost-f", "max_tokens": 8,
                               "messages": msgs + [_reply(r1), {"role": "tool",
                                                                "content": "result: 46"}]})
  assert endpoint.episode("lost-f").turns == 2
  endpoint.finish("lost-f", reward=1.0)
  (group,) = [g for g in endpoint.take_groups(1) if g.task.task_id == "lost-f"]
  (traj,) = group.trajectories
  p = seen["prompt_len"]
  assert traj.prompt_ids.tolist() == seen["tokens"][:p]
  assert traj.completion_ids.tolist() == seen["tokens"][p:]
  assert traj.loss_mask.tolist() == seen["loss_mask"] and traj.versions.tolist() == seen["versions"]
  chex.assert_trees_all_equal(traj.behaviour_logprobs, np.asarray(seen["logprobs"], np.float32))
  chex.assert_trees_all_equal(traj.expert_ids, np.stack(seen["routing"]).astype(np.int32))
  assert r1["rljax"]["completion_token_ids"] == traj.completion_ids.tolist()
  assert not endpoint.episode("lost-f").resident and rescore_diff(run, [traj]) == 0.0
  # an episode whose only turn never arrived has nothing to finish; a first call starts it
  _register(endpoint, "lost-0")
  _turn_nobody_gets(endpoint, {"model": "rljax", "episode_id": "lost-0", "max_tokens": 4,
                               "messages": msgs})
  status, out = _post(endpoint, "/v1/episodes/lost-0/finish", {"reward": 1.0})
  assert status == 400 and out["error"]["code"] == "empty_episode", out
  assert endpoint.episode("lost-0").turns == 0 and not endpoint.episode("lost-0").resident
  _chat_ok(endpoint, "lost-0", msgs, max_tokens=4)
  endpoint.drop("lost-0")
  assert endpoint.stats["http_500"] == 0


def test_a_call_naming_its_group_registers_its_episode_on_first_use(served):
  # (verifiers' run_group names its rollouts itself): within the group's size; a known
  # episode must be in the group named; without a group an unknown id is still a 404
  _, endpoint = served
  endpoint.group_size = 2
  msgs = [{"role": "user", "content": "hi"}]
  try:
    for eid in ("fu-a", "fu-b"):
      _chat_ok(endpoint, eid, msgs, max_tokens=2, group_id="fu-g")
    assert [e.episode_id for e in endpoint._groups["fu-g"]] == ["fu-a", "fu-b"]  # pylint: disable=protected-access
    status, out = _post(endpoint, "/v1/chat/completions", {
        "messages": msgs, "episode_id": "fu-c", "group_id": "fu-g", "max_tokens": 2})
    assert status == 409 and out["error"]["code"] == "group_full", out
    status, out = _post(endpoint, "/v1/chat/completions", {
        "messages": msgs, "episode_id": "fu-a", "group_id": "other", "max_tokens": 2})
    assert status == 400 and out["error"]["code"] == "wrong_group", out
    status, out = _post(endpoint, "/v1/chat/completions", {
        "messages": msgs, "episode_id": "fu-d", "max_tokens": 2})
    assert status == 404 and out["error"]["code"] == "unknown_episode", out
  finally:
    endpoint.group_size = None
  for eid in ("fu-a", "fu-b"):
    endpoint.drop(eid)
  assert endpoint.stats["http_500"] == 0


def test_load_64_concurrent_episodes_with_disconnects(served):
  # loopback load: 64 episodes at once (32 groups of 2, two turns each), every 8th
  # client dropping its first call's connection before the reply and sending it again;
  # no 500, the server alive, every finished episode in a complete group
  run, endpoint = served
  endpoint.group_size = 2
  errors, before = [], dict(endpoint.stats)
  host = endpoint.url[len("http://"):]

  def drive(n):
    eid = f"load-{n}"
    try:
      _register(endpoint, eid, f"load-g{n // 2}")
      msgs = [{"role": "user", "content": "What is 12 + 34?"}]
      body = {"model": "rljax", "messages": msgs, "max_tokens": 3, "episode_id": eid}
      if n % 8 == 0:  # sends the call and hangs up before the reply
        conn = http.client.HTTPConnection(host, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        conn.close()
      status, r = _post(endpoint, "/v1/chat/completions", body)
      assert status == 200, r
      msgs += [{"role": "assistant", "content": r["choices"][0]["message"]["content"]},
               {"role": "tool", "content": "result: 46"}]
      status, r = _post(endpoint, "/v1/chat/completions", dict(body, messages=msgs))
      assert status == 200, r
      endpoint.finish(eid, reward=float(n % 2))
    except Exception as e:  # pylint: disable=broad-except
      errors.append((n, e))

  try:
    threads = [threading.Thread(target=drive, args=(n,)) for n in range(64)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    groups = [g for g in endpoint.take_groups() if g.task.task_id.startswith("load-")]
  finally:
    endpoint.group_size = None
  assert not errors, errors[:3]
  assert len(groups) == 32 and all(len(g.trajectories) == 2 for g in groups)
  assert endpoint.stats["http_500"] == before.get("http_500", 0) == 0
  with urllib.request.urlopen(endpoint.url + "/health", timeout=30) as r:
    assert json.loads(r.read()) == {"ok": True}
  assert run.engine.pool.used_count == 0
  print("load:", {k: endpoint.stats[k] - before.get(k, 0) for k in endpoint.stats})


@pytest.fixture(scope="module")
def concurrent_groups(served, reference_engine):
  """Two groups of two episodes, 3 turns each, driven from 4 threads at once with room for
  only 2 resident episodes: batched in the engine, parked ones evicted and resubmitted
  (the first calls are held until all four arrived: two start together, and the other two
  evict them when they end, before their next calls come)."""
  run, endpoint = served
  resident, endpoint.max_resident = endpoint.max_resident, 2
  before = dict(endpoint.stats)
  tasks = {"g0-a": "What is 12 + 34?", "g0-b": "What is 12 + 34?",
           "g1-a": "Compute 7 * 8 with the tool.", "g1-b": "Compute 7 * 8 with the tool."}
  for eid in tasks:
    _register(endpoint, eid, eid[:2])
  out, errors = {}, []

  def drive(eid):
    try:
      out[eid] = agent_loop(_client(endpoint), eid, tasks[eid], turns=3, max_tokens=8)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  # the first calls of all four wait together; then two start, two wait for residency
  endpoint.pause()
  threads = [threading.Thread(target=drive, args=(eid,)) for eid in tasks]
  for t in threads:
    t.start()
  deadline = time.monotonic() + 60
  while endpoint.waiting_turns < len(tasks) and not errors and time.monotonic() < deadline:
    time.sleep(0.01)
  gathered = endpoint.waiting_turns
  endpoint.resume()
  for t in threads:
    t.join()
  assert gathered == len(tasks), errors
  endpoint.max_resident = resident
  assert not errors, errors
  stats = {k: endpoint.stats[k] - before.get(k, 0) for k in endpoint.stats}
  trajs = {eid: endpoint.finish(eid, reward=float(eid.endswith("a"))) for eid in tasks}
  refs = {eid: engine_reference(reference_engine, endpoint, t, [8, 8, 8])
          for eid, t in trajs.items()}
  return trajs, refs, stats


def test_concurrent_episodes_are_batched_and_bitwise_the_engines(served, concurrent_groups):
  run, endpoint = served
  trajs, refs, stats = concurrent_groups
  assert endpoint.stats["max_in_flight"] >= 2  # turns of several episodes in one engine step
  assert stats["resubmits"] > 0 and stats["evictions"] > 0  # the fresh-submit path ran
  for eid, traj in trajs.items():
    assert_same_record(traj, refs[eid])
  assert rescore_diff(run, list(trajs.values())) == 0.0


def test_finished_groups_train_like_env_groups(served, concurrent_groups):
  from rljax.pipeline import grpo_update  # pylint: disable=import-outside-toplevel
  run, endpoint = served
  trajs, _, _ = concurrent_groups
  groups = [g for g in endpoint.take_groups(2) if g.task.task_id in ("g0", "g1")]
  assert [g.task.task_id for g in groups] == ["g0", "g1"]
  assert endpoint.take_groups(2) == []  # taken once
  status, out = _post(endpoint, "/v1/episodes", {"episode_id": "late", "group_id": "g0"})
  assert status == 409 and out["error"]["code"] == "group_taken"
  decoded = []
  for g in groups:
    assert [t.sample_index for t in g.trajectories] == [0, 1]
    assert [t.reward for t in g.trajectories] == [1.0, 0.0]
    back = wire.group_from_arrays(wire.group_to_arrays(g.trajectories), g.request_id)
    for t, b in zip(g.trajectories, back):  # lossless through the wire
      for name in ("prompt_ids", "completion_ids", "loss_mask", "behaviour_logprobs",
                   "versions", "expert_ids"):
        chex.assert_trees_all_equal(getattr(t, name), getattr(b, name))
      assert (b.reward, b.outcome) == (t.reward, t.outcome)
    decoded.append(back)
  learner = grpo_update.grpo_learner(run)
  metrics = grpo_update.train_on_groups(run, learner, decoded)
  sampled = sum(int(t.loss_mask.sum()) for g in decoded for t in g)
  assert metrics["mismatch_tokens"] == sampled and metrics["mismatch_max_abs"] == 0.0
  assert np.isfinite(float(metrics["loss"])) and run.version == 1
  assert all(t.finish_reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP)
             for g in decoded for t in g)


def test_complete_groups_are_written_as_npz_files_a_trainer_reads(tmp_path):
  """experiments/serve.py --groups_dir: each group taken from the endpoint is one
  group_<n>.npz (header: group, index, episode ids; arrays: the wire's, bit for bit)."""
  from rljax.envs.base import Task  # pylint: disable=import-outside-toplevel
  from rljax.pipeline import npz  # pylint: disable=import-outside-toplevel
  from rljax.pipeline.rollout import Group  # pylint: disable=import-outside-toplevel
  from rljax.rl.trajectory import Trajectory  # pylint: disable=import-outside-toplevel
  from rljax.serving.group_files import write_group, write_groups  # pylint: disable=import-outside-toplevel
  trajs = []
  for i, reward in enumerate((1.0, 0.0)):
    t = Trajectory(np.array([5, 6, 7], np.int32), np.array([8, 9 + i], np.int32),
                   np.array([True, False]), np.array([-0.5, 0.0], np.float32),
                   np.array([3, -1], np.int32), None, FinishReason.EOS, sample_index=i)
    t.reward, t.outcome = reward, Outcome.SUCCESS if reward else Outcome.MODEL_FAILURE
    trajs.append(t)
  task = Task(env="endpoint", task_id="g7", split_key="", prompt_ids=trajs[0].prompt_ids,
              answer=None, data={"episode_ids": ["a", "b"]})
  group = Group(task, trajs, request_id=4)
  path = write_group(str(tmp_path), group)
  assert path == str(tmp_path / "group_4.npz") and sorted(p.name for p in tmp_path.iterdir()) == [
      "group_4.npz"]  # no .tmp left
  header, arrays = npz.decode((tmp_path / "group_4.npz").read_bytes())
  assert header == {"group_id": "g7", "index": 4, "episode_ids": ["a", "b"]}
  chex.assert_trees_all_equal(arrays, wire.group_to_arrays(trajs))

  class Taken:  # an endpoint whose groups finish one per take, then none
    def __init__(self, groups):
      self.groups = list(groups)

    def take_groups(self, wait_for, timeout_s):
      assert (wait_for, timeout_s) == (1, 1.0)
      return [self.groups.pop(0)] if self.groups else []

  second = dataclasses.replace(group, request_id=5)
  assert write_groups(Taken([group, second]), str(tmp_path / "out"), max_seconds=0.5) == 2
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["group_4.npz", "group_5.npz"]
  assert write_groups(Taken([group]), "", max_seconds=0.1) == 0  # no directory: dropped
