"""Orbax train-state checkpoints: async save, keep-last-N, the stream version they match,
restore onto another mesh (in an 8-device worker process: this file), and a restarted
trainer that resumes the weight stream exactly."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve()
REPO = HERE.parents[1]


def _state(seed=0):
  import jax.numpy as jnp
  from tests.test_sync_stream import make_params
  params = {k: {n: jnp.asarray(x) for n, x in v.items()} for k, v in make_params(seed).items()}
  opt = _optimizer()
  return {"params": params, "opt_state": opt.init(params), "step": jnp.int32(0)}


def _optimizer():
  import optax
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))


def _train_step(state, seed):
  """One AdamW step on a quadratic loss with a per-step target."""
  import jax
  global _JIT_STEP
  if _JIT_STEP is None:
    _JIT_STEP = jax.jit(_train_step_impl)
  return _JIT_STEP(state, seed)


_JIT_STEP = None


def _train_step_impl(state, seed):
  import jax
  import jax.numpy as jnp
  import optax
  key = jax.random.key(seed)

  def loss(params):
    leaves = jax.tree.leaves(params)
    keys = jax.random.split(key, len(leaves))
    return sum(jnp.sum((w - 0.01 * jax.random.normal(k, w.shape)) ** 2)
               for w, k in zip(leaves, keys))

  grads = jax.grad(loss)(state["params"])
  updates, opt_state = _optimizer().update(grads, state["opt_state"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
          "step": state["step"] + 1}


def _assert_trees_bitwise(a, b):
  import jax
  import numpy as np
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                                  np.asarray(y).reshape(-1).view(np.uint8))


def test_async_save_keep_last_and_restore(tmp_path):
  import jax
  from rljax.checkpoint import Checkpointer
  state = _state()
  saved = {}
  with Checkpointer(tmp_path / "ckpt", keep_last=2) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError):
      ckpt.restore(state)
    for step in range(1, 5):
      state = _train_step(state, step)
      ckpt.save(step, state, stream_version=100 + step)  # returns before the write ends
      saved[step] = state
    ckpt.wait()
    assert ckpt.steps() == [3, 4]
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=x.sharding), state)
    latest = ckpt.restore(target)
    assert (latest.step, latest.stream_version) == (4, 104)
    _assert_trees_bitwise(latest.state, saved[4])  # optax namedtuples come back as such
    older = ckpt.restore(state, step=3)
    assert older.stream_version == 103
    _assert_trees_bitwise(older.state, saved[3])
  with Checkpointer(tmp_path / "ckpt", keep_last=2) as reopened:  # a new process's view
    assert reopened.latest_step() == 4


def test_restarted_trainer_resumes_the_stream_exactly(tmp_path):
  from rljax.checkpoint import Checkpointer
  from rljax.sync import Publisher, StreamError, Subscriber
  from tests.test_sync_stream import assert_same
  url = f"file://{tmp_path}/stream"
  rollout = Subscriber(url)
  state = _state()
  pub = Publisher(url, keyframe_every=50)
  with Checkpointer(tmp_path / "ckpt", keep_last=2) as ckpt:
    for step in range(1, 6):
      state = _train_step(state, step)
      pub.publish(state["params"], step)
      if step % 2 == 0:
        ckpt.save(step, state, stream_version=step)
    assert rollout.poll() == 5  # the rollout host took version 5 ...
  del pub  # ... and the trainer crashed after publishing 5, before checkpointing it

  with Checkpointer(tmp_path / "ckpt", keep_last=2) as ckpt:
    restored = ckpt.restore(_state())
  assert (restored.step, restored.stream_version) == (4, 4)
  pub = Publisher(url, keyframe_every=50)
  assert pub.version == 5
  with pytest.raises(StreamError):
    pub.resume(_state()["params"], 4)  # wrong bits are refused
  pub.resume(restored.state["params"], 4)  # the exact bits of version 4
  state = _train_step(restored.state, 105)  # a different step 5 than the lost one
  m = pub.publish(state["params"], 6)
  assert not m.keyframe and m.parent == 4
  fresh = Subscriber(url)
  assert fresh.poll() == 6 and fresh.stats.keyframes_loaded == 1
  assert rollout.poll() == 6  # 5 is not in 6's chain: rejoin at keyframe 1, then 2..4, 6
  for sub in (fresh, rollout):
    assert_same(sub, state["params"])


@pytest.mark.multidevice
def test_restore_onto_a_different_mesh(tmp_path):
  proc = subprocess.run([sys.executable, str(HERE), str(tmp_path / "ckpt")],
                        capture_output=True, text=True, timeout=300, cwd=str(REPO))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["saved_specs"] != out["restored_specs"]
  assert out["restored_specs"] == out["target_specs"]
  assert out["bitwise_equal"] and out["stream_version"] == 7


def _worker(directory):
  """Saves a sharded train state on {fsdp: 8}, restores it onto {data: 2, expert: 4}."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8")
  sys.path.insert(0, str(REPO))
  import jax
  import numpy as np
  from rljax import sharding as sharding_lib
  from rljax.checkpoint import Checkpointer, abstract_like
  from tests.test_sync_multiprocess import _params, _shardings

  def state_shardings(sharding, state):
    """Params and Adam's mu/nu (which mirror them) by role; counts and step replicated."""
    params = _shardings(sharding)
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())

    def pick(path, _):
      group, name = (getattr(p, "key", None) for p in path[-2:]) if len(path) >= 2 else (
          None, None)
      return params.get(group, {}).get(name, replicated)

    return jax.tree_util.tree_map_with_path(pick, state)

  train = sharding_lib.Sharding(sharding_lib.make_mesh({"fsdp": 8}))
  params = _params(train)
  opt = _optimizer()
  state = {"params": params, "opt_state": opt.init(params), "step": jax.numpy.int32(6)}
  state = _train_step(state, 1)  # Adam's moments are no longer zeros
  state = jax.device_put(state, state_shardings(train, state))
  with Checkpointer(directory, keep_last=1) as ckpt:
    ckpt.save(7, state, stream_version=7)
    ckpt.wait()
    other = sharding_lib.Sharding(sharding_lib.make_mesh({"data": 2, "expert": 4}))
    target = abstract_like(state, state_shardings(other, state))
    restored = ckpt.restore(target)
  specs = lambda tree: [str(x.sharding.spec) for x in jax.tree.leaves(tree)]  # noqa: E731
  equal = all(np.array_equal(np.asarray(a), np.asarray(b))
              for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored.state)))
  print(json.dumps({"saved_specs": specs(state), "restored_specs": specs(restored.state),
                    "target_specs": specs(target), "bitwise_equal": bool(equal),
                    "stream_version": restored.stream_version}))


if __name__ == "__main__":
  _worker(sys.argv[1])
