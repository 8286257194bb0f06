"""Decode engine: fidelity to the training forward, batching, sharing, sampling, records.

Engines share conftest's `ENGINE` shape (8 slots, 65 pages of 16, rows of 128, one
prefill program) unless a test is about shapes, so their programs compile once per run
(the persistent compile cache shares them across files too). The reference run
("slots8") prefills in power-of-two buckets: every other run, one prefill shape, must
give its tokens and log-probs bit for bit."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.engine import sampling
from rljax.engine.engine import DecodeEngine, Request, SamplingParams
from rljax.engine.pages import OutOfPages
from rljax.model import forward
from rljax.model.packing import pack, unpack
from rljax.numerics import Numerics
from rljax.rl.trajectory import FinishReason

from tests.shapes import ENGINE

DET = Numerics("deterministic")
EOS = 2
POOL = {k: v for k, v in ENGINE.items() if k != "num_slots"}


def _requests(cfg, count, n=1, seed=0, max_new=24, **sampling):
  rng = np.random.default_rng(seed)
  return [Request(request_id=100 + i, prompt_ids=rng.integers(3, cfg.vocab_size,
                                                              size=int(rng.integers(3, 40))),
                  n=n, seed=11, sampling=SamplingParams(max_new_tokens=max_new, **sampling))
          for i in range(count)]


@functools.partial(jax.jit, static_argnames=("cfg", "numerics", "temperature"))
def _packed_forward(params, tokens, positions, segment_ids, targets, *, cfg, numerics,
                    temperature):
  out = forward(params, tokens, positions, cfg=cfg, numerics=numerics,
                segment_ids=segment_ids, targets=targets, temperature=temperature)
  return out.logprobs, out.routing


def _trainer_view(params, cfg, trajs, numerics=DET, temperature=1.0):
  """Trainer-side log-probs of each trajectory's completion tokens and its routing. The
  rows are padded to a power of two (rows are independent: batch invariance), so calls
  with other trajectory counts share one compiled forward."""
  p = pack([t.tokens for t in trajs], 128, cfg.page_size)
  extra = ((0, (1 << (len(p.tokens) - 1).bit_length()) - len(p.tokens)), (0, 0))
  p = dataclasses.replace(p, tokens=np.pad(p.tokens, extra), positions=np.pad(p.positions, extra),
                          segment_ids=np.pad(p.segment_ids, extra))  # what pack pads with
  targets = np.concatenate([p.tokens[:, 1:], np.zeros_like(p.tokens[:, :1])], axis=1)
  logprobs, routing = _packed_forward(params, p.tokens, p.positions, p.segment_ids, targets,
                                      cfg=cfg, numerics=numerics, temperature=temperature)
  lps = unpack(np.asarray(logprobs), p)
  routes = unpack(np.asarray(routing), p)
  views = []
  for t, lp, r in zip(trajs, lps, routes):
    n_p, n_c = len(t.prompt_ids), len(t.completion_ids)
    views.append((lp[n_p - 1:n_p - 1 + n_c], r))
  return views


def _executables(eng):
  """Executables the engine's programs hold: one per traced shape, unless a program was
  compiled again for an argument's placement (fresh pools or params are uncommitted, a
  program's outputs committed)."""
  p = eng.programs
  return sum(1 if isinstance(f, jax.stages.Compiled) else f._cache_size()  # pylint: disable=protected-access
             for f in (p.decode, p.prefill, p.sample, p.copy))


def _by_key(trajs):
  return {(t.request_id, t.sample_index): t for t in trajs}


@pytest.fixture(scope="module")
def det_runs(tiny_cfg, tiny_params):
  """The same 6 requests (groups of 4) through engines with different slot counts and
  submission orders and decode steps per device call: different batch compositions,
  slots, companions and chunking; one with the params in the serving layout (the
  decode loop compiled ahead of time, what accelerators run); and one without `overlap`
  (every other engine dispatches a call before reading the previous one back)."""
  reqs = _requests(tiny_cfg, 6, n=4)
  runs = {}
  shuffled = [reqs[i] for i in (3, 0, 5, 1, 4, 2)]
  # the capped run's prefill program is one row of max_seq_len (its admissions here are
  # single groups; test_a_capped_prefill_... splits admissions)
  for name, slots, order, steps, cap in (("slots8", 8, reqs, 8, 0),
                                         ("slots3_reversed_1step", 3, reqs[::-1], 1, 0),
                                         ("slots5_shuffled_3steps", 5, shuffled, 3, 0),
                                         ("slots5_capped_unbucketed", 5, shuffled, 3, 128)):
    shape = POOL | dict(prefill_buckets=name == "slots8",
                        max_prefill_tokens=cap)
    eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=slots, **shape,
                       eos_id=EOS, steps_per_call=steps)
    runs[name] = (eng, eng.generate(order))
  alone = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL, eos_id=EOS)
  runs["alone"] = (alone, alone.generate([reqs[2]]))
  laid_out = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL,
                          eos_id=EOS, serving_layout=True)
  runs["serving_layout"] = (laid_out, laid_out.generate(reqs))
  one_at_a_time = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL,
                               eos_id=EOS, overlap=False)
  runs["one_call_at_a_time"] = (one_at_a_time, one_at_a_time.generate(reqs))
  return runs


def test_engine_logprobs_are_bitwise_the_trainers(tiny_cfg, tiny_params, det_runs):
  for name, (_, trajs) in det_runs.items():
    for t, (train_lp, train_routing) in zip(trajs, _trainer_view(tiny_params, tiny_cfg, trajs)):
      chex.assert_trees_all_equal(t.behaviour_logprobs, train_lp, custom_message=name)
      # routing of every token fed to the model (the last sampled token never is)
      chex.assert_trees_all_equal(t.expert_ids[:-1], train_routing[:-1], custom_message=name)


def test_tokens_do_not_depend_on_slot_or_companions(det_runs):
  base = _by_key(det_runs["slots8"][1])
  for name in ("slots3_reversed_1step", "slots5_shuffled_3steps", "slots5_capped_unbucketed",
               "alone", "serving_layout", "one_call_at_a_time"):
    for key, t in _by_key(det_runs[name][1]).items():
      np.testing.assert_array_equal(t.completion_ids, base[key].completion_ids, err_msg=name)
      chex.assert_trees_all_equal(t.behaviour_logprobs, base[key].behaviour_logprobs)
      np.testing.assert_array_equal(t.expert_ids[:-1], base[key].expert_ids[:-1], err_msg=name)
      assert t.finish_reason == base[key].finish_reason, name
  reasons = {t.finish_reason for t in det_runs["slots8"][1]}
  assert {FinishReason.EOS, FinishReason.LENGTH} <= reasons, reasons  # stops inside calls


def test_no_recompiles_and_pages_freed(det_runs):
  for name, (eng, trajs) in det_runs.items():
    assert eng.trace_counts["decode"] == 1, (name, eng.trace_counts)
    assert eng.trace_counts["sample"] == 1
    assert all(v == 1 for k, v in eng.trace_counts.items() if k.startswith("prefill_"))
    prefills = sorted(k for k in eng.trace_counts if k.startswith("prefill_"))
    if eng.prefill_buckets:  # the reference run's admissions came in several shapes
      assert len(prefills) > 1, prefills
    else:  # one shape: num_slots rows (or what the cap leaves of them) x max_seq_len
      assert prefills == [f"prefill_{eng.prefill_rows}x128"], (name, prefills)
    for key in prefills:
      rows, width = map(int, key.removeprefix("prefill_").split("x"))
      assert rows * width <= eng.max_prefill_tokens, (name, key)
    assert eng.pool.used_count == 0 and eng.idle, name
    assert eng.max_waste_pages < 1.0
    assert _executables(eng) == sum(eng.trace_counts.values()), name
  assert len(det_runs["slots3_reversed_1step"][1]) == 24  # 6 groups x 4 through 3 slots


def test_a_capped_prefill_splits_into_calls_and_changes_no_bit(tiny_cfg, tiny_params):
  """max_prefill_tokens=128: four 40-token prompts admitted together are prefilled two rows
  of 64 at a time (buckets) or one row of 128 at a time (no buckets); tokens and log-probs
  are the uncapped engine's, bit for bit (deterministic numerics)."""
  rng = np.random.default_rng(5)
  reqs = [Request(i, rng.integers(1, tiny_cfg.vocab_size, size=40),
                  sampling=SamplingParams(max_new_tokens=6)) for i in range(4)]
  base = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8,
                      **POOL | dict(prefill_buckets=True))
  expected = _by_key(base.generate(reqs))
  assert base.stats["prefill_calls"] == 1
  for buckets, calls, program in ((True, 2, "prefill_2x64"), (False, 4, "prefill_1x128")):
    eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8,
                       **POOL | dict(prefill_buckets=buckets, max_prefill_tokens=128))
    got = _by_key(eng.generate(reqs))
    assert eng.stats["prefill_calls"] == calls and program in eng.trace_counts, eng.trace_counts
    for key, t in expected.items():
      np.testing.assert_array_equal(got[key].completion_ids, t.completion_ids)
      chex.assert_trees_all_equal(got[key].behaviour_logprobs, t.behaviour_logprobs)
  with pytest.raises(ValueError, match="less than one row of max_seq_len"):
    DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL,
                 max_prefill_tokens=100)


def test_group_prefix_is_prefilled_once(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL)
  prompt = np.arange(3, 3 + 37) % tiny_cfg.vocab_size  # 2 full pages + 5 tokens
  trajs = eng.generate([Request(1, prompt, n=8, sampling=SamplingParams(max_new_tokens=10))])
  assert len(trajs) == 8 and eng.stats["prefill_tokens"] == 37
  assert eng.stats["page_copies"] == 7  # the partial page, copied by all but its last holder
  assert len({tuple(t.completion_ids) for t in trajs}) > 1  # different samples


def test_stop_conditions(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL)
  (t,) = eng.generate(_requests(tiny_cfg, 1, max_new=5))
  assert t.finish_reason == FinishReason.LENGTH and len(t.completion_ids) == 5
  greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
  (g,) = eng.generate([Request(1, np.array([5, 6, 7]), sampling=greedy)])
  stop = int(g.completion_ids[3])
  (s,) = eng.generate([Request(1, np.array([5, 6, 7]), sampling=SamplingParams(
      temperature=0.0, max_new_tokens=20, stop_tokens=(stop,)))])
  assert s.finish_reason == FinishReason.STOP and s.completion_ids[-1] == stop
  assert len(s.completion_ids) <= 4
  eos_eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL, eos_id=stop)
  (e,) = eos_eng.generate([Request(1, np.array([5, 6, 7]), sampling=greedy)])
  assert e.finish_reason == FinishReason.EOS
  np.testing.assert_array_equal(e.completion_ids, s.completion_ids)
  (m,) = eng.generate([Request(1, np.arange(3, 124), sampling=SamplingParams(max_new_tokens=50))])
  assert m.finish_reason == FinishReason.CONTEXT and len(m.tokens) == 128  # max_seq_len


def test_sampling_modes(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL)
  prompt = np.array([9, 8, 7, 6])

  def one(**kw):
    return eng.generate([Request(3, prompt, sampling=SamplingParams(max_new_tokens=12, **kw))])[0]

  greedy = one(temperature=0.0)
  (lp, _), = _trainer_view(tiny_params, tiny_cfg, [greedy])
  chex.assert_trees_all_equal(greedy.behaviour_logprobs, lp)  # greedy records the T=1 log-prob
  logits = forward(tiny_params, greedy.tokens[None, :-1],
                   np.arange(len(greedy.tokens) - 1)[None], cfg=tiny_cfg, numerics=DET).logits
  np.testing.assert_array_equal(np.argmax(np.asarray(logits[0, 3:]), -1), greedy.completion_ids)
  np.testing.assert_array_equal(one(top_k=1).completion_ids, greedy.completion_ids)
  np.testing.assert_array_equal(one(top_p=1e-6).completion_ids, greedy.completion_ids)
  # a truncated distribution records the renormalised log-prob
  t2 = one(top_k=2)
  full = np.asarray(DET.log_softmax(forward(
      tiny_params, t2.tokens[None, :-1], np.arange(len(t2.tokens) - 1)[None], cfg=tiny_cfg,
      numerics=DET).logits))[0, 3:]
  top2 = np.sort(full, axis=-1)[:, -2:]
  want = full[np.arange(len(full)), t2.completion_ids] - np.log(np.exp(top2).sum(-1))
  # f32 on both sides, det_log/det_exp (<= 2 ulp) vs numpy's: ~1e-6 at |log p| ~ 5
  np.testing.assert_allclose(t2.behaviour_logprobs, want, atol=1e-5)
  # temperature: behaviour log-probs are those of logits / T, as the trainer computes them
  hot = one(temperature=0.7)
  (lp_hot, _), = _trainer_view(tiny_params, tiny_cfg, [hot], temperature=0.7)
  chex.assert_trees_all_equal(hot.behaviour_logprobs, lp_hot)


def test_a_requests_sampling_id_stands_for_its_id_in_the_sampling_keys(tiny_cfg, tiny_params):
  # Request.sampling_id (what the OpenAI endpoint's `seed` uses): requests with other ids
  # and the same seed and sampling id sample the same tokens, those of a request whose id
  # it is
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL)
  prompt, sp = np.array([9, 8, 7, 6]), SamplingParams(max_new_tokens=12)
  out = _by_key(eng.generate([Request(3, prompt, sampling=sp, seed=5, sampling_id=77),
                              Request(4, prompt, sampling=sp, seed=5, sampling_id=77),
                              Request(77, prompt, sampling=sp, seed=5),
                              Request(5, prompt, sampling=sp, seed=5)]))
  for rid in (4, 77):
    chex.assert_trees_all_equal(out[(3, 0)].completion_ids, out[(rid, 0)].completion_ids)
    chex.assert_trees_all_equal(out[(3, 0)].behaviour_logprobs, out[(rid, 0)].behaviour_logprobs)
  assert out[(3, 0)].completion_ids.tolist() != out[(5, 0)].completion_ids.tolist()


@pytest.mark.parametrize("policy, serving_layout",
                         [("keep", False), ("recompute", False), ("recompute", True)])
def test_in_flight_weight_update(tiny_cfg, tiny_params, policy, serving_layout):
  new_params = jax.tree.map(lambda x: (x * 1.05).astype(x.dtype), tiny_params)
  # committed weights, as a trainer's step hands them over (the pools start uncommitted)
  params = jax.device_put(tiny_params, jax.devices()[0])
  eng = DecodeEngine(tiny_cfg, params, numerics=DET, num_slots=8, **POOL, steps_per_call=8,
                     weight_update=policy, serving_layout=serving_layout)
  for r in _requests(tiny_cfg, 4, max_new=30, seed=5):
    eng.submit(r)
  finished = []
  for _ in range(2):  # 1 + 2 x 8 tokens each (steps_per_call 8) of 30
    finished += eng.step()
  running = sum(s is not None for s in eng.slots)
  assert running == 4
  eng.update_weights(new_params, version=1)
  finished += eng.run()
  assert len(finished) == 4  # nothing dropped
  for t in finished:
    v = t.versions
    assert v[0] == 0 and v[-1] == 1 and np.all(np.diff(v) >= 0)
    after = v == 1
    (lp_new, _), = _trainer_view(new_params, tiny_cfg, [t])
    if policy == "recompute":  # KV recomputed: the new tokens are exactly the new policy's
      chex.assert_trees_all_equal(t.behaviour_logprobs[after], lp_new[after])
    else:  # stale KV from the old weights: close to, but not, the new policy
      assert np.max(np.abs(t.behaviour_logprobs[after] - lp_new[after])) > 0
  if policy == "recompute":
    assert eng.stats["recompute_tokens"] > 0
  assert _executables(eng) == sum(eng.trace_counts.values())  # new weights: no new programs


def test_multi_turn_extension_prefills_only_new_tokens(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8, **POOL)
  req = Request(7, np.array([4, 5, 6, 7, 8]), n=2, keep_pages=True,
                sampling=SamplingParams(max_new_tokens=6))
  first = eng.generate([req])
  assert len(eng.parked) == 2
  before = eng.stats["prefill_tokens"]
  obs = np.array([30, 31, 32])
  eng.extend(7, 0, obs, max_new_tokens=5)
  (second,) = eng.run()
  assert eng.stats["prefill_tokens"] - before == 1 + len(obs)  # last action token + observation
  t0 = _by_key(first)[(7, 0)]
  np.testing.assert_array_equal(second.tokens[:len(t0.tokens)], t0.tokens)
  np.testing.assert_array_equal(second.completion_ids[len(t0.completion_ids):][:3], obs)
  assert not second.loss_mask[len(t0.completion_ids):][:3].any()
  (lp, _), = _trainer_view(tiny_params, tiny_cfg, [second])
  mask = second.loss_mask
  chex.assert_trees_all_equal(second.behaviour_logprobs[mask], lp[mask])
  eng.release(7, 0)
  eng.release(7, 1)
  assert eng.pool.used_count == 0


def test_preemption_under_page_pressure_changes_nothing(tiny_cfg, tiny_params, det_runs):
  reqs = _requests(tiny_cfg, 6, n=4)
  tight = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8,
                       **(POOL | dict(num_pages=14)), eos_id=EOS)
  trajs = _by_key(tight.generate(reqs))
  assert tight.stats["preemptions"] > 0
  for key, t in _by_key(det_runs["slots8"][1]).items():
    np.testing.assert_array_equal(trajs[key].completion_ids, t.completion_ids)
    chex.assert_trees_all_equal(trajs[key].behaviour_logprobs, t.behaviour_logprobs)


def test_overlap_under_page_pressure_reads_back_first_and_changes_nothing(tiny_cfg,
                                                                          tiny_params):
  # every sample has a slot from the start (no backlog: calls go ahead), but the pages
  # run out as they grow: a call that would need a preemption is not dispatched ahead
  reqs = _requests(tiny_cfg, 4, n=2, seed=3, max_new=60)
  runs = {}
  for overlap in (True, False):
    eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=8,
                       **(POOL | dict(num_pages=14)), overlap=overlap)
    runs[overlap] = (eng, _by_key(eng.generate(reqs)))
  eng = runs[True][0]
  assert eng.stats["decode_calls_ahead"] > 0 and eng.stats["preemptions"] > 0
  assert eng.stats["decode_calls_not_ahead_for_pages"] > 0, eng.stats
  assert eng.pool.used_count == 0 and eng.idle
  for key, t in runs[False][1].items():
    got = runs[True][1][key]
    np.testing.assert_array_equal(got.completion_ids, t.completion_ids)
    chex.assert_trees_all_equal(got.behaviour_logprobs, t.behaviour_logprobs)
    np.testing.assert_array_equal(got.expert_ids, t.expert_ids)


def test_bad_requests_are_rejected(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, num_slots=2, max_seq_len=32)
  with pytest.raises(ValueError, match="non-empty"):
    eng.submit(Request(1, np.array([], np.int32)))
  with pytest.raises(ValueError, match="no room"):
    eng.submit(Request(1, np.arange(40) % 100))
  with pytest.raises(ValueError, match="vocabulary"):
    eng.submit(Request(1, np.array([tiny_cfg.vocab_size])))
  with pytest.raises(ValueError, match="weight_update"):
    DecodeEngine(tiny_cfg, tiny_params, weight_update="sometimes")
  assert eng.idle


def _hf_initialised_tiny(tiny_cfg, tmp_path):
  """The bench_decode weights: transformers' tiny Qwen3-MoE, N(0, 0.2) matrices, seed 0."""
  import torch  # pylint: disable=g-import-not-at-top  (test extra: missing = a failure)
  import transformers  # pylint: disable=g-import-not-at-top
  from rljax.model import hf_import  # pylint: disable=g-import-not-at-top
  hf_cfg = transformers.Qwen3MoeConfig(**hf_import.hf_config_kwargs(tiny_cfg))
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(hf_cfg).float().eval()
  with torch.no_grad():
    for prm in model.parameters():
      if prm.ndim >= 2:
        prm.normal_(0.0, 0.2)
  model.save_pretrained(tmp_path)
  return hf_import.load_hf_checkpoint(str(tmp_path), dtype="bfloat16",
                                      page_size=tiny_cfg.page_size,
                                      decode_attention=tiny_cfg.decode_attention,
                                      det_attention=tiny_cfg.det_attention,
                                      train_experts=tiny_cfg.train_experts,
                                      engine_experts=tiny_cfg.engine_experts,
                                      expert_kernel=tiny_cfg.expert_kernel)


def test_full_batch_of_long_samples_is_bitwise_the_trainers(tiny_cfg, tmp_path):
  """32 slots x 64 tokens on the bench_decode weights and prompts: the workload where
  batched-dot attention once got a different XLA:CPU kernel in the decode graph (bf16 dot
  upcast to f32) than in the training graph, drifting by 1e-2 from token 32 of one
  sequence on. Checked to fail with that attention."""
  cfg, params = _hf_initialised_tiny(tiny_cfg, tmp_path)
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, cfg.vocab_size, size=(32, 16))
  eng = DecodeEngine(cfg, params, numerics=DET, num_slots=32, max_seq_len=80,
                     prefill_buckets=False)
  trajs = eng.generate([Request(i, prompts[i], sampling=SamplingParams(
      temperature=0.0, max_new_tokens=64)) for i in range(32)])
  for t, (train_lp, _) in zip(trajs, _trainer_view(params, cfg, trajs)):
    chex.assert_trees_all_equal(t.behaviour_logprobs, train_lp)


def test_pages_held_by_parked_sequences_raise_instead_of_hanging(tiny_cfg, tiny_params):
  eng = DecodeEngine(tiny_cfg, tiny_params, numerics=DET, num_slots=2, max_seq_len=64,
                     num_pages=4, prefill_buckets=False)
  eng.generate([Request(1, np.arange(3, 20), keep_pages=True,
                        sampling=SamplingParams(max_new_tokens=4))])  # parks 2 of 3 pages
  eng.submit(Request(2, np.arange(3, 23), sampling=SamplingParams(max_new_tokens=4)))
  with pytest.raises(OutOfPages, match="parked"):
    eng.run()
  eng.release(1, 0)
  (t,) = eng.run()  # the waiting request was kept and now fits
  assert t.request_id == 2 and eng.pool.used_count == 0


def test_top_p_one_never_truncates_even_when_the_rounded_mass_passes_one():
  # Peaked rows: the f32 cumsum of the sorted probabilities reaches 1.0 before the last
  # tokens. top_p = 1 must still keep them, so the behaviour log-prob is the plain
  # log-softmax the trainer recomputes (a 1-4 ulp mismatch in deterministic runs before).
  rng = np.random.default_rng(0)
  rows, vocab = 512, 64
  logits = jnp.asarray(rng.normal(0, 6, (rows, vocab)), jnp.float32)
  logp = DET.log_softmax(logits)
  sorted_p = np.sort(np.exp(np.asarray(logp, np.float64)).astype(np.float32), -1)[:, ::-1]
  mass_before = np.cumsum(sorted_p, -1, dtype=np.float32) - sorted_p
  assert (mass_before >= 1.0).any(), "the case this test is about does not occur"
  keys = sampling.token_keys(*(jnp.arange(rows, dtype=jnp.int32),) * 4)
  ones, zeros = jnp.ones(rows, jnp.float32), jnp.zeros(rows, jnp.int32)
  tokens, behaviour = jax.jit(lambda l, k: sampling.sample(l, k, ones, zeros, ones, DET))(
      logits, keys)
  want = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
  chex.assert_trees_all_equal(behaviour, want)


@pytest.mark.parametrize("numerics", [DET, Numerics("fast")])
def test_all_greedy_batches_skip_the_draw_but_not_the_result(numerics):
  # An all-greedy batch takes the no-draw branch; a greedy slot beside a sampled one takes
  # the drawing branch: the greedy slots' tokens and log-probs are the same bits in both.
  rng = np.random.default_rng(1)
  rows, vocab = 8, 64
  logits = jnp.asarray(rng.normal(0, 3, (rows, vocab)), jnp.float32)
  keys = sampling.token_keys(*(jnp.arange(rows, dtype=jnp.int32),) * 4)
  zeros_i, ones = jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.float32)
  run = jax.jit(lambda l, t: sampling.sample(l, keys, t, zeros_i, ones, numerics))
  all_greedy = run(logits, jnp.zeros(rows, jnp.float32))
  mixed = run(logits, jnp.zeros(rows, jnp.float32).at[0].set(1.0))
  chex.assert_trees_all_equal(all_greedy[0][1:], mixed[0][1:])
  chex.assert_trees_all_equal(all_greedy[1][1:], mixed[1][1:])
  np.testing.assert_array_equal(all_greedy[0], np.argmax(np.asarray(logits), -1))


def test_greedy_tokens_are_numpys_argmax_on_ties_infinities_and_nans():
  rng = np.random.default_rng(2)
  logits = rng.normal(0, 1, (9, 33)).astype(np.float32)
  logits[0] = 0.5  # all tied: the first
  logits[1, [4, 20]] = 9.0  # a tie for the top: the first of them
  logits[2] = -np.inf
  logits[3, 7] = np.inf
  logits[4, [3, 30]] = np.nan  # numpy's argmax returns the first NaN
  logits[5, [2, 6]] = [np.inf, np.nan]
  logits[6] = np.nan
  logits[7, -1] = 50.0
  logits[8, 0] = -0.0
  got = jax.jit(sampling.first_argmax)(logits)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.argmax(logits, -1))


@pytest.mark.parametrize("numerics", [DET, Numerics("fast")])
def test_paged_attention_reads_only_visible_blocks_with_the_same_result(numerics):
  # attend_paged gathers the smallest power-of-two block count covering max(q_index);
  # masked blocks are exact no-ops, so deterministic mode gives the same bits as `attend`
  # over every block of the table (fast mode: the same up to summation order).
  from rljax.model import attention  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(2)
  layers, pages, page, hkv, d, b, blocks, h = 2, 40, 16, 2, 16, 4, 7, 4
  pool = lambda: jnp.asarray(rng.normal(size=(layers, pages, page, hkv, d)), jnp.bfloat16)
  k_pool, v_pool = pool(), pool()
  table = jnp.asarray(1 + rng.permutation(pages - 1)[:b * blocks].reshape(b, blocks), jnp.int32)
  q = jnp.asarray(rng.normal(size=(b, 1, h, d)), jnp.bfloat16)
  for top in (0, 15, 16, 40, 70, 111):  # 1, 1, 2, 4, 7 (of 7) blocks needed
    q_index = jnp.asarray(np.minimum(rng.integers(0, top + 1, (b, 1)), top), jnp.int32)
    q_index = q_index.at[0, 0].set(top).at[1, 0].set(-1)  # a padding row
    got = jax.jit(lambda q, qi: attention.attend_paged(
        q, k_pool, v_pool, table, qi, layer=1, dtype=jnp.bfloat16, numerics=numerics,
        scale=0.25))(q, q_index)
    keys, values = (attention.gather_blocks(p, table, 1, dtype=jnp.bfloat16)
                    for p in (k_pool, v_pool))
    want = jax.jit(lambda q, qi: attention.attend(q, keys, values, qi, page_size=page,
                                                  numerics=numerics, scale=0.25))(q, q_index)
    if numerics.deterministic:
      chex.assert_trees_all_equal(got, want)
    else:  # a fully masked row is a uniform average in fast mode: padding, not compared
      live = np.asarray(q_index[:, 0] >= 0)  # bf16 outputs (|out| <~ 3): a few ulps of 2^-8
      np.testing.assert_allclose(np.asarray(got, np.float32)[live],
                                 np.asarray(want, np.float32)[live], atol=2e-2)
