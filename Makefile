# The README's two commands: `make demo` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build lies on this machine's disk; a bare `torch` would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# The stamp names the torch spec, so `make test TORCH_SPEC=...` reinstalls when it changes.
STAMP := $(VENV)/.installed-$(subst =,-,$(subst <,lt,$(subst >,gt,$(subst $(space),,$(TORCH_SPEC)))))
space := $(subst ,, )

.PHONY: demo test docs setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	rm -f $(VENV)/.installed-*
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/countlens discover --model toy --out runs/demo
	HF_HUB_OFFLINE=1 $(BIN)/countlens finetune --model toy --circuit runs/demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link or reference.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis
