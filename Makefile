# Two entry points: `make train` runs the default job, `make test` runs the suite.
# Both create the virtual environment on first use. `make fuzz` is the long fuzz run of the codec kernels.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: venv train test fuzz clean

venv: $(STAMP)

# torch is pinned for the dev environment: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/tiershard train

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The codec kernels against the torch reference (docs/codecs.md, "Fuzzing"): 20,000 random cases on three C builds
# with AddressSanitizer and UndefinedBehaviorSanitizer, then the Triton kernels in their interpreter if installed.
fuzz: $(STAMP)
	$(BIN)/python benchmarks/fuzz_codecs.py --seed 0 --cases 20000 --builds native avx2 portable --triton-cases 300

clean:
	rm -rf $(VENV) runs .pytest_cache
