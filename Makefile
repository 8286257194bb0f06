# rljax build skeleton. Recipes use tabs.
PY := .venv/bin/python
PIP := .venv/bin/pip
PYTEST_ARGS ?=

.PHONY: install run test bench clean tunix

install: .venv/.installed

.venv/bin/python:
	python3 -m venv .venv

# editable_mode=compat: a plain .pth pointing at the repo root, so top-level
# packages created after the install (rljax/, pallas_kernels/, configs/) still import.
.venv/.installed: pyproject.toml | .venv/bin/python
	$(PIP) install -q -e '.[test]' --config-settings editable_mode=compat
	# tinker-cookbook without its requirements: they are in .[test] but tml-renderers>=0.4.1,
	# which no registry we reach has (pyproject.toml's test extra says why that is fine)
	$(PIP) install -q --no-deps tinker-cookbook==0.6.1
	touch $@

# The async pipeline on configs/arith_tiny.py: trainer + 2 rollout-host processes on a
# file:// root in a fresh temp workdir (printed in the last line's JSON).
run: install
	$(PY) experiments/pipeline.py --config=configs/arith_tiny.py

# Two pytest-xdist workers (one per core), each taking whole test files (--dist loadfile:
# a module's fixtures are built once) in the order tests/conftest.py puts them, heaviest
# first (--no-loadscope-reorder keeps that order). PYTEST_ARGS comes last, so e.g.
# PYTEST_ARGS="-n 0 tests/test_moe.py" runs one file serially.
# pytest exit 5 (no tests collected) is reported and propagated.
test: install
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "ERROR: pytest ran no tests (exit 5)"; fi; exit $$rc

bench: install tunix
	@set -e; for f in experiments/bench_*.py; do \
		[ -e "$$f" ] || { echo "no experiments/bench_*.py found"; exit 1; }; \
		echo "== $$f"; $(PY) "$$f"; \
	done

# Tunix 0.1.7 in a venv of its own (its pins never touch .venv's), for
# experiments/bench_vs_tunix.py; experiments/tunix_requirements.txt pins every package.
tunix: .venv-tunix/.installed

.venv-tunix/.installed: experiments/tunix_requirements.txt
	python3 -m venv .venv-tunix
	.venv-tunix/bin/pip install -q -r experiments/tunix_requirements.txt
	touch $@

clean:
	rm -rf .venv .venv-tunix .pytest_cache .hypothesis build *.egg-info
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
