# Every target builds the environment first; it is a no-op when .venv is up to date (the
# stamp is newer than pyproject.toml). The library needs torch, numpy and safetensors; the
# `train` extra adds what the application, the tests and the benchmarks use (SciPy,
# matplotlib, tqdm, tokenizers), `hf` transformers (Hugging Face models), `dev` the test
# and lint tools (pytest, hypothesis, ruff, mypy); pytorch-optimizer (no dependencies) is
# Shampoo's published cross-check.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test check test-numerics test-clients lint venv clean bench bench-peers gpu-check

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[train,dev,hf]"
	$(PY) -m pip install --quiet --no-deps "pytorch-optimizer==4.1.0"  # Shampoo's cross-check
	touch $(VENV_STAMP)

venv: $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m raggedfsdp demo

lint: $(VENV_STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# tests/clients (torchtitan, transformers, accelerate, torchao, Lightning, torchtune) take
# minutes each:
# `make test-clients` runs them. `make check` is lint and test.
test: $(VENV_STAMP)
	$(PY) -m pytest -q tests --ignore=tests/clients

check: lint test

# The tests that compare numbers (marked `numerics`), rerun with the kernel choices that
# differ from one machine to another: ATen's scalar kernels instead of its vectorized ones,
# MKL's portable GEMM path, two intra-op threads, torch's deterministic algorithms. Their
# bounds are derived from the reference's own sensitivity (tests/numerics.py), so both this
# run and `make test` pass.
NUMERICS_ENV := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE \
	RAGGEDFSDP_TEST_THREADS=2 RAGGEDFSDP_TEST_DETERMINISTIC=1

test-numerics: $(VENV_STAMP)
	$(NUMERICS_ENV) $(PY) -m pytest -q tests -m numerics --ignore=tests/clients

# The clients extra goes into .venv with torch pinned by a constraint file, so that pip can
# never replace it (any other torch would be a multi-GB CUDA build).
CLIENTS_STAMP := .venv/.clients-installed

$(CLIENTS_STAMP): $(VENV_STAMP) pyproject.toml
	echo "torch==2.13.0" > .venv/constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv/constraints.txt $(PY) -m pip install --quiet -e ".[clients]"
	$(PY) -c "import torch, sys; v = torch.__version__; \
		sys.exit(0 if v.split('+')[0] == '2.13.0' else f'.venv has torch {v}, not 2.13.0')"
	touch $(CLIENTS_STAMP)

test-clients: $(CLIENTS_STAMP)
	$(PY) -m pytest -q tests/clients

# The accelerator check (tests/gpu): train on the accelerator with its native backend and every
# visible device, parity with FSDP2, copies, streams and overlap, max_memory_reserved against
# FSDP2's; writes benchmarks/results/gpu.md. Without an accelerator every test skips;
# `make gpu-check DEVICE=cpu` is the dry run (the same tests on gloo ranks, nothing written).
gpu-check: $(VENV_STAMP)
	$(PY) -m pytest -q -rs tests/gpu $(if $(DEVICE),--device $(DEVICE))

# Benchmarks (benchmarks/run_all.py): planner, step, optim, and peers when .venv-peers exists.
bench: $(VENV_STAMP)
	$(PY) benchmarks/run_all.py

# Peers (DeepSpeed ZeRO-3, Megatron-FSDP) live in their own optional environment, with
# torch pinned by a constraint so that no package can replace it; a peer that fails to
# install is left out (its log stays in .venv-peers/) and benchmarks/peers.py says so.
PEERS_PY := .venv-peers/bin/python
PEERS_STAMP := .venv-peers/.installed
PEERS_PIP := PIP_CONSTRAINT=$(CURDIR)/.venv-peers/constraints.txt DS_BUILD_OPS=0 $(PEERS_PY) -m pip

$(PEERS_STAMP): pyproject.toml
	python3 -m venv .venv-peers
	echo "torch==2.13.0" > .venv-peers/constraints.txt
	$(PEERS_PIP) install --quiet --upgrade pip
	$(PEERS_PIP) install --quiet "torch==2.13.0"
	$(PEERS_PIP) install --quiet -e ".[train]"
	$(PEERS_PIP) install "deepspeed==0.19.*" > .venv-peers/install-deepspeed.log 2>&1 \
		|| echo "deepspeed not installed: see .venv-peers/install-deepspeed.log"
	$(PEERS_PIP) install "megatron-fsdp==0.6.*" > .venv-peers/install-megatron-fsdp.log 2>&1 \
		|| echo "megatron-fsdp not installed: see .venv-peers/install-megatron-fsdp.log"
	$(PEERS_PY) -m pip list 2>/dev/null | grep -i -E "^(torch|deepspeed|megatron-fsdp) "
	$(PEERS_PY) -c "import torch, sys; v = torch.__version__; \
		sys.exit(0 if v.split('+')[0] == '2.13.0' else f'.venv-peers has torch {v}, not 2.13.0')"
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PEERS_PY) benchmarks/peers.py

clean:
	rm -rf .venv build *.egg-info
