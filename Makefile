# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build lies on this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The stamp names the torch spec, so `make test TORCH_SPEC=...` reinstalls when it changes.
STAMP := $(VENV)/.installed-$(subst =,-,$(subst <,lt,$(subst >,gt,$(subst $(space),,$(TORCH_SPEC)))))
space := $(subst ,, )

.PHONY: demo test test-fast test-kernels coverage docs lint setup browser clean

setup: $(STAMP) browser

$(STAMP): pyproject.toml constraints.txt
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	@$(MAKE) --no-print-directory browser
	touch $(STAMP)

# The browser test of report.html (tests/integration/test_report_html.py) drives Debian's chromium
# through chromedriver: installed here where we can (apt-get, as root); elsewhere this says what is
# missing and how to install it (the test then fails under CI, where CI is set, and is skipped elsewhere).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && apt-get install -y chromium chromium-driver; \
	else \
	  echo "setup: /usr/bin/chromium or /usr/bin/chromedriver is missing (packages chromium, chromium-driver);"; \
	  echo "       install them as root: apt-get install -y chromium chromium-driver"; \
	fi

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/countlens discover --model toy --out runs/demo
	HF_HUB_OFFLINE=1 $(BIN)/countlens finetune --model toy --circuit runs/demo

# One pytest-xdist worker per core, one torch thread each (tests/conftest.py); worksteal keeps both busy
# to the end. Tiny checkpoints and converted vocabularies are built once into .pytest_cache/countlens/
# (tests/disk_cache.py) and read from there by every later worker and run.
WORKERS ?= 2
PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal

test: $(STAMP)
	$(PYTEST)

# The inner loop: everything but the end-to-end runs (the `slow` marker: subprocesses, the CLI, discover)
# and the per-family matrices beyond their first case (the `matrix` marker, tests/conftest.py).
test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# Line coverage of countlens/ over the whole suite (coverage.py through pytest-cov) into htmlcov/.
coverage: $(STAMP)
	$(PYTEST) --cov=countlens --cov-report=term:skip-covered --cov-report=html

# The numeric tests again under other CPU kernels: ATen's portable ones, AVX2 as on an AMD Zen 3 (ATen
# and MKL), and MKL's conservative path. A tolerance tuned to one CPU fails here. --kernel-subset:
# each numeric test once (its first case) and every family's circuit-matrix row; `make test` runs
# every case natively. tests/cpu_kernels.py prints which kernels each run got and a digest of their bits.
KERNELS := ATEN_CPU_CAPABILITY=default "ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2" MKL_CBWR=COMPATIBLE

test-kernels: $(STAMP)
	@for k in $(KERNELS); do \
	  env $$k $(BIN)/python tests/cpu_kernels.py && \
	  env $$k $(PYTEST) -m numeric --kernel-subset -p no:cacheprovider || exit 1; \
	done

# ruff's lint and its formatter (settings in pyproject.toml; the version pinned in the dev extra).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The documentation site (docs/, mkdocs.yml) into site/. --strict fails on any warning (a broken link
# or reference); its log is shown only then (--quiet would hide the very warnings --strict counts).
docs: $(STAMP)
	@log=$$(NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict 2>&1) || { printf '%s\n' "$$log"; exit 1; }; \
	echo "docs: site/ built, no warnings"

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis htmlcov .coverage
