# Two commands do all the set-up on a fresh machine (see README):
#   make demo   - build .venv if needed, then train Megatron-Core's GPT-MoE on CPU under
#                 source patches and show the activations it dumped
#   make test   - build .venv if needed, then run the test suite
# and: make rollout - a real SGLang engine on CPU under source patches (examples/rollout_sglang.py)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip install -q -c requirements/constraints.txt

.PHONY: demo rollout test setup browser clean

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

rollout: $(STAMP)
	$(BIN)/python examples/rollout_sglang.py --out sp-rollout

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

# The trace view's test drives Debian's headless Chromium (tests/test_trace_view.py).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }; }

clean:
	rm -rf $(VENV) build *.egg-info
