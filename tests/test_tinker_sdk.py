"""The official Tinker SDK (`tinker` 0.38.0, unchanged) against rljax's Tinker server
(rljax.tinker) on the tiny test model: LoRA training clients, the SDK's built-in losses,
AdamW steps, two clients on one base, and the errors a client gets."""

import json
import socket
import threading
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from rljax.model import ModelConfig, forward, init_params
from rljax.model.params import cast
from rljax.numerics import Numerics
from rljax.tinker.service import Service
from rljax.tinker.server import make_server
from tests.shapes import TINY

tinker = pytest.importorskip("tinker")  # pinned in the test extras: a missing one fails below
from tinker import types  # noqa: E402

MODEL = "rljax/tiny"
DET = Numerics("deterministic")  # engine = trainer bit for bit


def test_the_sdk_is_installed():
  assert tinker.__version__ == "0.38.0"


@pytest.fixture(scope="module")
def server(monkeypatch_module, tmp_path_factory):
  cfg = ModelConfig(**TINY).resolved("cpu", DET)
  base = cast(init_params(cfg, jax.random.key(0), "float32"), "bfloat16")
  service = Service(cfg, base, numerics=DET, model_name=MODEL, max_tokens=256,
                    state_root=str(tmp_path_factory.mktemp("tinker_states")))
  srv = make_server(service, "127.0.0.1", 0)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  monkeypatch_module.setenv("TINKER_API_KEY", "tml-local")
  monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
  yield service, f"http://127.0.0.1:{srv.server_address[1]}"
  srv.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


@pytest.fixture(scope="module")
def client(server):
  service_client = tinker.ServiceClient(base_url=server[1])
  yield service_client
  service_client.close("success").result()


def _sequences(n, length, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, TINY["vocab_size"], size=length).tolist() for _ in range(n)]


def _sft_data(seqs):
  return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                      loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
          for s in seqs]


def _logprobs(result):
  return [np.asarray(out["logprobs"].data, np.float32) for out in result.loss_fn_outputs]


def test_supervised_steps_lower_the_loss_and_logprobs_are_the_models(server, client):
  service = server[0]
  tc = client.create_lora_training_client(base_model=MODEL, rank=8).result()
  info = tc.get_info()
  assert info.model_data.model_name == MODEL and info.lora_rank == 8 and info.is_lora
  data = _sft_data(_sequences(4, 20) + _sequences(2, 33, seed=1))
  losses = []
  for _ in range(6):
    fb = tc.forward_backward(data, "cross_entropy").result()
    step = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    losses.append(fb.metrics["loss:sum"])
    assert step.metrics["optim/datums:sum"] == len(data)
  assert losses[-1] < 0.95 * losses[0], losses  # measured 368.6 -> 335.9 on 4 rows
  # the loss is the sum of -logprob over the weighted tokens, and the log-probs are the
  # merged model's own, bit for bit (deterministic numerics: packing does not change them)
  after = tc.forward(data, "cross_entropy").result()
  lps = _logprobs(after)
  assert [len(lp) for lp in lps] == [19] * 4 + [32] * 2
  np.testing.assert_allclose(after.metrics["loss:sum"], -sum(lp.sum() for lp in lps),
                             rtol=1e-5)
  trainer = service.model(tc.model_id).trainer
  tokens = np.asarray(data[4].model_input.to_ints(), np.int32)[None]
  own = forward(trainer.merged(), tokens, np.arange(tokens.shape[1], dtype=np.int32)[None],
                cfg=trainer.cfg, numerics=DET,
                targets=np.asarray(data[4].loss_fn_inputs["target_tokens"].data,
                                   np.int32)[None]).logprobs[0]
  np.testing.assert_array_equal(lps[4], np.asarray(own))


def test_importance_sampling_and_ppo_follow_the_advantages(client):
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  seqs = _sequences(4, 17, seed=2)
  sft = _sft_data(seqs)
  q = _logprobs(tc.forward(sft, "cross_entropy").result())
  advantages = [np.full(16, a, np.float32) for a in (1.0, 1.0, -1.0, -1.0)]
  rl = [types.Datum(model_input=d.model_input,
                    loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                    "logprobs": lp.tolist(), "advantages": a.tolist()})
        for d, lp, a in zip(sft, q, advantages)]
  first = tc.forward_backward(rl, "importance_sampling").result()
  # on-policy the ratio is 1: the loss is -sum(A) = 0 here, up to the log-probs' rounding
  assert abs(first.metrics["loss:sum"]) < 1e-3, first.metrics
  ppo = tc.forward_backward(rl, "ppo", {"clip_low_threshold": 0.8,
                                        "clip_high_threshold": 1.2}).result()
  assert abs(ppo.metrics["loss:sum"]) < 1e-3, ppo.metrics
  for _ in range(3):
    tc.forward_backward(rl, "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
  now = _logprobs(tc.forward(sft, "cross_entropy").result())
  gain = [float((n - old).mean()) for n, old in zip(now, q)]
  assert gain[0] > 0 and gain[1] > 0 and gain[2] < 0 and gain[3] < 0, gain


def test_two_clients_on_one_base_train_independently(client):
  a = client.create_lora_training_client(base_model=MODEL, rank=8).result()
  b = client.create_lora_training_client(base_model=MODEL, rank=8).result()
  data = _sft_data(_sequences(3, 12, seed=3))
  b_before = _logprobs(b.forward(data, "cross_entropy").result())
  for _ in range(2):
    a.forward_backward(data, "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
  b_after = _logprobs(b.forward(data, "cross_entropy").result())
  a_after = _logprobs(a.forward(data, "cross_entropy").result())
  for x, y in zip(b_before, b_after):
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))  # bitwise untouched
  assert not all(np.array_equal(x, y) for x, y in zip(b_after, a_after))


def test_errors_are_the_sdks_own_exceptions(server, client):
  with pytest.raises(tinker.NotFoundError, match="not served here"):
    client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).result()
  with pytest.raises(tinker.BadRequestError, match="rank"):
    client.create_lora_training_client(base_model=MODEL, rank=0).result()
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  data = _sft_data(_sequences(2, 10, seed=4))
  with pytest.raises(tinker.RequestFailedError, match="'dpo' is not supported"):
    tc.forward_backward(data, "dpo").result()
  short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                      loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]})
  with pytest.raises(tinker.RequestFailedError, match=r"shape \[2\], model_input has 3"):
    tc.forward_backward([short], "cross_entropy").result()
  big = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 999], "weights": [1.0, 1.0]})
  with pytest.raises(tinker.RequestFailedError, match="target_tokens must be in"):
    tc.forward_backward([big], "cross_entropy").result()
  missing = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": [2, 3]})
  with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs"):
    tc.forward_backward([missing], "importance_sampling").result()
  with pytest.raises(tinker.RequestFailedError, match="adam_params"):
    tc.optim_step(types.AdamParams(learning_rate=-1.0)).result()
  # the client still works after its bad requests (each took its seq_id), in order
  assert tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_client_killed_mid_request_does_not_stop_the_server(server):
  host, port = server[1][len("http://"):].split(":")
  with socket.create_connection((host, int(port))) as s:  # half a protobuf body, then gone
    s.sendall(b"POST /api/v1/forward_backward HTTP/1.1\r\nContent-Length: 1000\r\n"
              b"Content-Type: application/x-protobuf\r\n\r\n\x0a\x05abc")
  fresh = tinker.ServiceClient(base_url=server[1])
  tc = fresh.create_lora_training_client(base_model=MODEL, rank=4).result()
  assert tc.forward(_sft_data(_sequences(1, 8)), "cross_entropy").result().metrics
  fresh.close("success").result()
  # (the SDK itself refuses a closed client's calls, after its own timeout); the server
  # answers a request for a closed session's model with a 404 naming it
  request = urllib.request.Request(
      f"{server[1]}/api/v1/optim_step", method="POST",
      data=json.dumps({"model_id": tc.model_id, "seq_id": 9, "type": "optim_step",
                       "adam_params": {}}).encode(),
      headers={"Content-Type": "application/json"})
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(request, timeout=30)
  assert e.value.code == 404 and "was closed" in json.loads(e.value.read())["detail"]


def test_sampling_clients_sample_the_trained_weights_with_the_trainers_logprobs(client):
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  tc.forward_backward(_sft_data(_sequences(2, 12, seed=5)), "cross_entropy").result()
  tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
  sampler = tc.save_weights_and_get_sampling_client()
  prompt = [5, 6, 7, 8]
  res = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                       types.SamplingParams(max_tokens=6, seed=1)).result()
  assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
  for s in res.sequences:
    assert len(s.tokens) == len(s.logprobs) == 6 and s.stop_reason == "length"
    # the sampler's log-probs are forward's bits for the same tokens
    tokens = prompt + list(s.tokens)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:],
                                        "weights": [1.0] * (len(tokens) - 1)})
    trained = _logprobs(tc.forward([datum], "cross_entropy").result())[0][-6:]
    assert np.array_equal(np.asarray(s.logprobs, np.float32).view(np.uint32),
                          trained.view(np.uint32))
  prompt_lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
  datum = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                      loss_fn_inputs={"target_tokens": prompt[1:], "weights": [1.0] * 3})
  assert prompt_lps[0] is None
  np.testing.assert_array_equal(np.asarray(prompt_lps[1:], np.float32),
                                _logprobs(tc.forward([datum], "cross_entropy").result())[0])
  # a snapshot: the client's later steps (which donate its live adapters) leave it as it was
  tc.forward_backward(_sft_data(_sequences(2, 12, seed=7)), "cross_entropy").result()
  tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
  again = sampler.sample(types.ModelInput.from_ints(prompt), 3,
                         types.SamplingParams(max_tokens=6, seed=1)).result()
  assert [(s.tokens, s.logprobs) for s in again.sequences] == [
      (s.tokens, s.logprobs) for s in res.sequences]
  # a named snapshot, sampled greedily through a sampling client made from its path
  path = tc.save_weights_for_sampler("final").result().path
  assert path == f"tinker://{tc.model_id}/sampler_weights/final"
  named = client.create_sampling_client(model_path=path)
  greedy = [named.sample(types.ModelInput.from_ints(prompt), 1,
                         types.SamplingParams(max_tokens=4, temperature=0.0)).result()
            for _ in range(2)]
  assert greedy[0].sequences[0].tokens == greedy[1].sequences[0].tokens
  with pytest.raises(tinker.BadRequestError, match="stop strings need the server.s tokenizer"):
    named.sample(types.ModelInput.from_ints(prompt), 1,
                 types.SamplingParams(max_tokens=4, stop=["User:"])).result()
  with pytest.raises(tinker.BadRequestError, match="max_tokens"):
    named.sample(types.ModelInput.from_ints(prompt), 1,
                 types.SamplingParams(max_tokens=10_000)).result()
  with pytest.raises(tinker.NotFoundError, match="no sampler weights"):
    missing = client.create_sampling_client(
        model_path=f"tinker://{tc.model_id}/sampler_weights/x")
    missing.sample(types.ModelInput.from_ints(prompt), 1,
                   types.SamplingParams(max_tokens=4)).result()


def test_saved_states_load_back_bitwise(client):
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  data = _sft_data(_sequences(2, 10, seed=6))

  def step():
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

  step()
  saved = _logprobs(tc.forward(data, "cross_entropy").result())
  path = tc.save_state("s1").result().path
  assert path == f"tinker://{tc.model_id}/weights/s1"
  step()
  moved = _logprobs(tc.forward(data, "cross_entropy").result())
  assert not np.array_equal(moved[0], saved[0])
  tc.load_state(path).result()
  back = _logprobs(tc.forward(data, "cross_entropy").result())
  fresh = client.create_training_client_from_state_with_optimizer(path).result()
  again = _logprobs(fresh.forward(data, "cross_entropy").result())
  for x, y, z in zip(saved, back, again):
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    assert np.array_equal(x.view(np.uint32), z.view(np.uint32))
  # with the optimizer state, the next step is the same step from either client
  tc.load_state_with_optimizer(path).result()
  for c in (tc, fresh):
    c.forward_backward(data, "cross_entropy").result()
    c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
  a, b = (_logprobs(c.forward(data, "cross_entropy").result()) for c in (tc, fresh))
  assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
  with pytest.raises(tinker.RequestFailedError, match="saved at .* already"):
    tc.save_state("s1").result()
  with pytest.raises(tinker.RequestFailedError, match="no training state"):
    tc.load_state(f"tinker://{tc.model_id}/weights/nope").result()
  with pytest.raises(tinker.RequestFailedError, match="path must be a name"):
    tc.save_state("../escape").result()
  other = client.create_lora_training_client(base_model=MODEL, rank=8).result()
  with pytest.raises(tinker.RequestFailedError, match="LoRA rank 4, this client 8"):
    other.load_state(path).result()


def _post(base_url, route, body):
  request = urllib.request.Request(f"{base_url}/api/v1/{route}", method="POST",
                                   data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=30) as r:
      return r.status, r.read()  # JSON or a protobuf
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_finished_results_are_dropped_after_their_ttl(server, client, monkeypatch):
  """A long-lived server keeps a finished request's result `result_ttl_s` (an hour) for the
  client to fetch, then drops it: fetching it is a 404 saying so, and its seq_id a 400
  (already ran), never a rerun; results still within their ttl stay."""
  service, url = server
  now = [1e9]
  monkeypatch.setattr(service, "clock", lambda: now[0])
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  data = _sft_data(_sequences(2, 8, seed=6))
  tc.forward(data, "cross_entropy").result()
  mine = [i for i, f in service.futures.items() if f.done and f.done_at == now[0]]
  assert mine and all(_post(url, "retrieve_future", {"request_id": i})[0] == 200 for i in mine)
  held = len(service.futures)
  now[0] += service.result_ttl_s + 1
  tc.forward(data, "cross_entropy").result()  # a new request: the old results go
  assert len(service.futures) <= held - len(mine) + 1
  for i in mine:
    status, body = _post(url, "retrieve_future", {"request_id": i})
    assert status == 404 and "finished more than 3600 s ago" in body["detail"], body
  status, body = _post(url, "optim_step", {"model_id": tc.model_id, "seq_id": 1,
                                           "type": "optim_step", "adam_params": {}})
  assert status == 400 and "already ran" in body["detail"], body
  assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0
