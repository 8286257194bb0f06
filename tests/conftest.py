import os
import pathlib

# Compiled programs are cached on disk for this process and every process it starts (the
# engine's programs compile again in every test that builds an engine, host and worker).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Compiling for speed of compiling (tests/xla_flags.py), in this process and every process
# it starts.
from tests import xla_flags

xla_flags.install()

# The suite runs both numerics modes in this one process, so it takes the deterministic
# XLA flags before JAX starts (fast-mode tests pay for them; entry points run in their own
# processes with their config's mode, see test_numerics).
from rljax.numerics import install_deterministic_xla_flags, skip_absent_accelerators

skip_absent_accelerators()  # libtpu is installed (the TPU compile tests): CPU, unprobed
install_deterministic_xla_flags()

import jax
import pytest

from tests.time_budget import (pytest_runtest_logreport, pytest_sessionfinish,  # noqa: F401
                               pytest_sessionstart, pytest_terminal_summary)

from rljax.model import ModelConfig

from tests.shapes import TINY, sharp_params


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
  # resolved for deterministic numerics: on a GPU, tests of both modes keep the reference
  # decode attention (a fast-mode resolution would hand det tests the Pallas kernel)
  return ModelConfig(**TINY).resolved(jax.default_backend(), "deterministic")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return sharp_params(tiny_cfg)


# `make test` hands whole files to two pytest-xdist workers in collection order
# (--dist loadfile --no-loadscope-reorder), so the files with the most work (cold compile
# cache) go first and the last ones to start are short; the rest keep pytest's order.
HEAVIEST_FIRST = (  # worker seconds per file, clean clone of 3b559f0, -n 2: 1463 s in all
    "test_pipeline.py", "test_learning_external.py",  # 124-100
    "test_notebooks.py", "test_sharded.py", "test_learner.py",  # 77-68
    "test_device_check.py", "test_python_tool_env.py", "test_engine.py",  # 62-59
    "test_tinker_cookbook.py",  # 50 (rl_basic + sl_basic; cold compile cache, -n 0, 2 cores)
    "test_lora_stream.py", "test_async_pipeline.py", "test_openai_endpoint.py",  # 50-48
    "test_model_invariance.py", "test_sandbox.py", "test_distributed_job.py",  # 43-42
    "test_learning.py", "test_function_call.py", "test_rollout_host.py",  # 40-36
    "test_engine_multiprocess.py",  # 34 (its workers' setup: 2 processes)
    "test_batch_parts.py",  # 33
    "test_hf_import.py", "test_own_checkpoint_e2e.py", "test_lora.py",  # 31-30
    "test_scan_layers.py", "test_det_attention_kernel.py", "test_engine_sharded.py",  # 29-25
)


# Last of all, when the other worker is likeliest idle or on short files:
# test_multihost's kill drill runs 2 trainer processes and a rollout host, which on a
# loaded core took 59 s of the 60 s budget (third in the order, beside test_pipeline:
# clean clone of a6602ef; 35-56 s, median 49 s, in 20 rounds of the multi-process files
# alone; 48-60.5 s in four clean clones of 9ba30a8 beside test_engine_multiprocess, then
# also last, whose two processes it ran against; 34 s alone, warm cache; 59.8 s in a clean
# clone of 5decc3a even alone last: since then the drill is two tests of one module
# fixture, the kill and abort (17 s alone) and the resume and its checks (17 s)).
LAST = ("test_multihost.py",)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  rank |= {name: len(HEAVIEST_FIRST) + 1 + i for i, name in enumerate(LAST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(HEAVIEST_FIRST)))  # stable
