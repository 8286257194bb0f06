"""The Colab notebooks in notebooks/ run headless, without errors, on the .venv python.

Each notebook is executed with nbclient in a kernel started from `sys.executable` (the
interpreter running pytest, i.e. .venv's) with RLJAX_NOTEBOOK_FAST=1; their `assert` cells
check the results. The committed notebooks must carry no outputs.
"""

import json
import os
import pathlib
import sys
import time

import nbclient  # test extras: a missing one fails the run, never skips it
import nbformat
import pytest

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; the notebooks together take ~2.5 min on 2 CPU cores


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_outputs_are_stripped(path):
  book = nbformat.read(path, as_version=4)
  nbformat.validate(book)
  for cell in book.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.source[:60])
  first = next(c for c in book.cells if c.cell_type == "code")
  assert 'find_spec("rljax")' in first.source and "pip" in first.source  # Colab install


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_colab_install_cell_asks_for_the_repo_url(path, monkeypatch):
  """Where rljax is not importable and REPO_URL is left empty the cell stops with a clear
  error (it does not pip-install a placeholder)."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
  monkeypatch.setattr(subprocess, "check_call", lambda *a, **k: pytest.fail("pip ran"))
  with pytest.raises(RuntimeError, match="set REPO_URL"):
    exec(first.source, {})  # pylint: disable=exec-used


def _venv_kernel(tmp_path):
  """A kernelspec that starts ipykernel with this interpreter, whatever else is installed."""
  spec_dir = tmp_path / "kernels" / "rljax-test"
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "rljax .venv", "language": "python"}))
  ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
  return KernelManager(kernel_name="rljax-test", kernel_spec_manager=ksm)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
  monkeypatch.setenv("RLJAX_NOTEBOOK_FAST", "1")
  book = nbformat.read(path, as_version=4)
  km = _venv_kernel(tmp_path)
  client = nbclient.NotebookClient(book, km=km, timeout=CELL_TIMEOUT_S,
                                   resources={"metadata": {"path": str(tmp_path)}})
  t0 = time.perf_counter()
  try:
    client.execute()  # raises CellExecutionError on the first failing cell
  finally:
    # nbclient shuts down only kernels it made; this one (~0.8 GB resident after a
    # notebook) would otherwise live until pytest exits
    if km.has_kernel:
      km.shutdown_kernel(now=True)
  print(f"{path.name}: {time.perf_counter() - t0:.1f} s")
  code = [c for c in book.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in code)
  errors = [o for c in code for o in c.outputs if o.output_type == "error"]
  assert not errors, errors
  images = [o for c in code for o in c.outputs
            if o.output_type == "display_data" and "image/png" in o.get("data", {})]
  assert images, f"{path.name} made no plot"
