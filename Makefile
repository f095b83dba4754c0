# Two commands do all the set-up on a fresh machine (see README):
#   make demo   - build .venv if needed, then train Megatron-Core's GPT-MoE on CPU under
#                 source patches and show the activations it dumped
#   make test   - build .venv if needed, install the Debian packages the tests need
#                 (make browser: apt-get, with sudo when not root), then run the test suite
# and: make rollout [SPECS=my.yaml,...] - a real SGLang engine on CPU under source patches
#                   (examples/rollout_sglang.py), your own specs in every engine process too
#      make compat  - check the shipped specs against upstream releases, write docs/compat.md
#      make browser - only the Debian packages (what make test installs first)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip install -q -c requirements/constraints.txt

.PHONY: demo rollout test setup browser compat clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py requirements/*.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0        # the CPU build, first and alone
	$(PIP) -r requirements/cpu.txt
	$(PIP) -e '.[test]'
	$(PIP) --no-deps sglang==0.5.23
	$(PIP) --no-deps -r requirements/sglang-cpu.txt
	$(BIN)/source-patch hook install                     # editable installs lack the .pth
	touch $(STAMP)

demo: $(STAMP)
	SOURCE_PATCH=megatron_cpu,dump SOURCE_PATCH_DUMP_DIR=sp-dumps \
	  $(BIN)/python examples/train_moe.py --steps 5

# SPECS: more specs for the engine (files or bundled names), separated by commas or spaces.
SPECS ?=
rollout: $(STAMP)
	$(BIN)/python examples/rollout_sglang.py --out sp-rollout $(addprefix --spec ,$(SPECS))

# -n 2: one worker per core of CI's machine; each file (and the files sharing an SGLang
# server, tests/conftest.py) stays on one worker.
test: $(STAMP) browser
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup

# `source-patch matrix` over the releases the shipped specs support (docs/compat.md).
# Wheels are fetched once into $(RELEASES) (megatron-core >= 0.17 exists for Python 3.12
# only: fetched, never installed); a release that cannot be fetched is left out, said so.
MEGATRON_RELEASES := 0.14.0 0.15.0 0.15.1 0.15.2 0.15.3 0.16.0 0.16.1 0.17.0 0.17.1 0.18.0 0.18.2 0.19.0 0.19.2
SGLANG_RELEASES   := 0.5.20 0.5.21 0.5.22 0.5.23
RELEASES          := $(HOME)/.cache/source-patch/wheels
COMPAT_SPECS      := routing dump trace weight_sync features sentinels megatron_cpu sglang_cpu megatron_topk sglang_topk
FETCH             := $(BIN)/python -m pip download -q --no-deps --only-binary=:all: -d $(RELEASES)

compat: $(STAMP)
	@mkdir -p $(RELEASES)
	@for v in $(MEGATRON_RELEASES); do ls $(RELEASES)/megatron_core-$$v-*.whl >/dev/null 2>&1 || \
	  $(FETCH) --python-version 3.12 megatron-core==$$v 2>/dev/null || echo "compat: could not fetch megatron-core $$v"; done
	@for v in $(SGLANG_RELEASES); do ls $(RELEASES)/sglang-$$v-*.whl >/dev/null 2>&1 || \
	  $(FETCH) sglang==$$v 2>/dev/null || echo "compat: could not fetch sglang $$v"; done
	$(BIN)/source-patch matrix $(COMPAT_SPECS) --releases $(RELEASES)/*.whl --write docs/compat.md

# Debian packages the tests need: headless Chromium for the trace view's test
# (tests/test_trace_view.py), and the three libraries the Mooncake wheel links
# (tests/test_features_store.py starts a real Mooncake master). make test runs this first
# and says so in one line; it changes the system (apt-get, sudo when not root) only when
# a package is missing.
DEBIAN := chromium chromium-driver libibverbs1 ibverbs-providers libnuma1
browser:
	@if dpkg -s $(DEBIAN) >/dev/null 2>&1; then \
	  echo "make browser: the Debian packages the tests need are installed ($(DEBIAN))"; \
	else \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  echo "make browser: installing $(DEBIAN) with $${SUDO:+sudo }apt-get (the trace view's test drives headless Chromium, the feature store's a Mooncake master)"; \
	  $$SUDO apt-get install -y -q $(DEBIAN) >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q $(DEBIAN) >/dev/null; }; \
	fi

clean:
	rm -rf $(VENV) build *.egg-info
