"""Trained weights downloaded through the official SDK and cookbook from rljax's Tinker
server (rljax.tinker.weights): a LoRA client trained a few steps, exported by
`save_weights_external`, fetched by `tinker_cookbook.weights.download` (and the SDK's
`RestClient.get_external_weights_urls`) unchanged, is a PEFT adapter that
`peft.PeftModel.from_pretrained` loads onto the base `rljax.model.hf_export` writes, with
rljax's logits for the merged params."""

import threading
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
# test extras (pyproject [test]): plain imports, so a missing one fails the run
import torch
from safetensors.numpy import load_file

from rljax.model import ModelConfig, forward
from rljax.model.hf_export import export_hf
from rljax.model.lora import merge
from rljax.model.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rljax.model.params import cast
from rljax.numerics import Numerics
from rljax.tinker.service import Service
from rljax.tinker.server import make_server
from tests.shapes import TINY, sharp_params
from tests.test_lora_export import _peft_model  # pylint: disable=protected-access

tinker = pytest.importorskip("tinker")  # pinned in the test extras: a missing one fails below
from tinker import types  # noqa: E402
from tinker_cookbook import weights as cookbook_weights  # noqa: E402
from tinker_cookbook.exceptions import WeightsDownloadError  # noqa: E402

MODEL = "rljax/tiny"
DET = Numerics("deterministic")
# PEFT adds scale * B(A x) beside each base layer where rljax runs x @ (W + scale * A @ B),
# both in f32: the logits differ by summation order only. ATOL is test_lora_export's
# (1e-4, measured 7.6e-6 there); the trained adapter moves these logits by ~100x more
# (asserted below), so a factor PEFT dropped or misplaced cannot hide under it.
ATOL = 1e-4
# PEFT warns (and leaves the module unadapted) where a file lacks keys its config targets:
# an export mistake, so it fails the test by name
pytestmark = pytest.mark.filterwarnings("error:Found missing adapter keys:UserWarning")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  """The server on the tiny model with a sharp base (x10 weights: logits of O(1), so the
  comparison below is not of near-zeros)."""
  cfg = ModelConfig(**TINY).resolved("cpu", DET)
  base = sharp_params(cfg)
  service = Service(cfg, base, numerics=DET, model_name=MODEL, max_tokens=256,
                    state_root=str(tmp_path_factory.mktemp("tinker_states")))
  srv = make_server(service, "127.0.0.1", 0)
  threading.Thread(target=srv.serve_forever, daemon=True).start()
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("TINKER_API_KEY", "tml-local")
    mp.setenv("TINKER_TELEMETRY", "0")
    yield service, f"http://127.0.0.1:{srv.server_address[1]}"
  srv.shutdown()


def _sft_data(n, length, seed):
  rng = np.random.default_rng(seed)
  seqs = [rng.integers(1, TINY["vocab_size"], size=length).tolist() for _ in range(n)]
  return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                      loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)})
          for s in seqs]


def _rljax_logits(base, adapters, lora, tokens):
  """rljax's forward on merge(base, adapters) in f32 (fast numerics)."""
  cfg = ModelConfig(**{**TINY, "dtype": "float32", "param_dtype": "float32"}).resolved(
      "cpu", Numerics("fast"))
  params = cast(base, "float32")
  if adapters is not None:
    params = merge(params, adapters, lora)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  out = jax.jit(lambda p: forward(p, tokens, positions, cfg=cfg, numerics=Numerics("fast"),
                                  segment_ids=None).logits)(params)
  return np.asarray(out)


def _peft_logits(model, tokens):
  with torch.no_grad():
    out = model.eval()(input_ids=torch.from_numpy(tokens).long())
  return out.logits.float().numpy()


def test_trained_adapters_download_as_a_peft_adapter_with_rljaxs_logits(server, tmp_path):
  service, url = server
  client = tinker.ServiceClient(base_url=url)
  tc = client.create_lora_training_client(base_model=MODEL, rank=4).result()
  data = _sft_data(4, 24, seed=0)
  for _ in range(2):
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
  sampler_path = tc.save_weights_for_sampler("s").result().path
  state_path = tc.save_state("trained").result().path
  path = tc.save_weights_external("trained").result().path
  assert path == f"tinker://{tc.model_id}/external_weights/trained"
  trainer = service.model(tc.model_id).trainer

  # the SDK's own call: one url per file, served by this server
  rest = tinker.RestClient(base_url=url)
  urls = rest.get_external_weights_urls(path).result().urls
  assert sorted(urls) == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
  assert all(u.startswith(f"{url}/api/v1/") for u in urls.values())
  # the cookbook's documented download, of the export and of the saved state (which it
  # loads into a new client, exports encrypted to a fresh age key, fetches, decrypts and
  # deletes): the same adapter file
  out = cookbook_weights.download(tinker_path=path, output_dir=str(tmp_path / "adapter"),
                                  base_url=url)
  via_state = cookbook_weights.download(tinker_path=state_path,
                                        output_dir=str(tmp_path / "from_state"), base_url=url)
  tensors = load_file(f"{out}/{ADAPTER_WEIGHTS}")
  assert tensors.keys() == load_file(f"{via_state}/{ADAPTER_WEIGHTS}").keys()
  for k, v in load_file(f"{via_state}/{ADAPTER_WEIGHTS}").items():
    np.testing.assert_array_equal(v, tensors[k])
  # the temporary export is gone (deleted by the cookbook), the user's stays
  exports = list(service.external._exports)  # pylint: disable=protected-access
  assert exports == [path], exports

  # the update moved the adapter: every B starts at zero (lora.init_adapters; A is random
  # at std 0.02), measured A 2.10, B 1.58 after the two steps
  b_norm = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum()
                             for k, v in tensors.items() if ".lora_B." in k)))
  a_norm = float(np.sqrt(sum((v.astype(np.float64) ** 2).sum()
                             for k, v in tensors.items() if ".lora_A." in k)))
  print(f"adapter norms: A {a_norm:.4f}, B {b_norm:.4f}")
  assert b_norm > 0.1, b_norm

  # PEFT on the exported base gives rljax's logits on the merged params
  export_hf(cast(service.base, "float32"), service.cfg, str(tmp_path / "base"))
  model = _peft_model(tmp_path / "base", out)
  tokens = np.asarray([d.model_input.to_ints() for d in data[:2]], np.int32)
  peft_logits = _peft_logits(model, tokens)
  ours = _rljax_logits(service.base, trainer.adapters, trainer.lora, tokens)
  base_logits = _rljax_logits(service.base, None, None, tokens)
  diff, moved = np.abs(peft_logits - ours).max(), np.abs(ours - base_logits).max()
  # measured: PEFT vs rljax 5.7e-6, the adapter moved the logits by 2.1
  print(f"logits: PEFT vs rljax max-abs {diff:.2e}; the adapter moved them {moved:.3f}")
  assert diff <= ATOL, diff
  assert moved > 100 * ATOL, moved

  # sampler weights are not downloadable: the SDK and the cookbook refuse them client-side
  with pytest.raises(ValueError, match="only accepts external weights"):
    rest.get_external_weights_urls(sampler_path).result()
  with pytest.raises(WeightsDownloadError, match="Sampler checkpoints cannot be downloaded"):
    cookbook_weights.download(tinker_path=sampler_path, output_dir=str(tmp_path / "x"),
                              base_url=url)
  client.close("success").result()


def test_bad_download_paths_are_the_sdks_errors(server):
  service, url = server
  client = tinker.ServiceClient(base_url=url)
  rest = tinker.RestClient(base_url=url)
  tc = client.create_lora_training_client(base_model=MODEL, rank=2).result()
  with pytest.raises(tinker.NotFoundError, match="no external weights"):
    rest.get_external_weights_urls(f"tinker://{tc.model_id}/external_weights/nope").result()
  with pytest.raises(tinker.RequestFailedError, match="path must be a name"):
    tc.save_weights_external("../up").result()
  with pytest.raises(tinker.RequestFailedError, match="ttl_seconds"):
    tc.save_weights_external("short", ttl_seconds=5).result()
  with pytest.raises(tinker.RequestFailedError, match="not an age or SSH public key"):
    tc.save_weights_external("enc", age_encryption_recipients=["nope"]).result()
  path = tc.save_weights_external("gone").result().path
  file_url = rest.get_external_weights_urls(path).result().urls[ADAPTER_CONFIG]
  assert urllib.request.urlopen(file_url, timeout=30).status == 200
  with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
    rest.set_checkpoint_ttl_from_tinker_path(path, 1).result()
  rest.delete_checkpoint_from_tinker_path(path).result()
  with pytest.raises(tinker.NotFoundError, match="no external weights"):
    rest.get_external_weights_urls(path).result()
  with pytest.raises(urllib.error.HTTPError) as e:  # its urls stop working with it
    urllib.request.urlopen(file_url, timeout=30)
  assert e.value.code == 404
  with pytest.raises(urllib.error.HTTPError) as e:
    urllib.request.urlopen(f"{url}/api/v1/external_weights_files/bad/token", timeout=30)
  assert e.value.code == 404
  # other checkpoints are not deleted or downloaded here: a 400 naming what is
  with pytest.raises(tinker.BadRequestError, match="external weights only"):
    rest.delete_checkpoint_from_tinker_path(f"tinker://{tc.model_id}/weights/x").result()
  # an expired export is gone
  expiring = tc.save_weights_external("expiring", ttl_seconds=3600).result().path
  export = service.external._exports[expiring]  # pylint: disable=protected-access
  export.expires_at = 0.0
  with pytest.raises(tinker.NotFoundError, match="no external weights"):
    rest.get_external_weights_urls(expiring).result()
  client.close("success").result()
