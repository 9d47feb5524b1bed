# meshlm: `make run` serves the whole mesh, `make test` runs every test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PROTOS := $(shell find proto -name '*.proto')
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install proto run test test-unit test-e2e bench bench-engine bench-peers lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) proto

# Generated code goes under services/ (gitignored): sglang.runtime.v1 and meshlm.v1.
proto: $(STAMP) services/meshlm/v1/.stamp

services/meshlm/v1/.stamp: $(PROTOS)
	$(PY) -m grpc_tools.protoc -I proto -I $(SITE) \
	  --python_out=services --pyi_out=services --grpc_python_out=services $(PROTOS)
	touch services/sglang/__init__.py services/sglang/runtime/__init__.py \
	  services/sglang/runtime/v1/__init__.py
	touch $@

run: install
	$(PY) -m meshlm.launch

test: install
	$(PY) -m pytest -q tests

test-unit: install
	$(PY) -m pytest -q tests/unit

test-e2e: install
	$(PY) -m pytest -q tests/e2e

bench: install
	$(PY) -m meshlm.bench

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $(BENCH_STAMP)

# The engine and the mesh vs HF generate and transformers serve (~4 minutes on 2 cores).
bench-engine: install $(BENCH_STAMP)
	$(PY) -m meshlm.bench.engine $(BENCH_ARGS)

# llama.cpp's llama-server, transformers serve and the mesh on one workload. The first run
# downloads the llama-cpp-python sdist and builds llama-server (CPU; cached in ~/.cache/meshlm).
# BENCH_ARGS=--sweep measures at concurrency 1, 4, 16 and 64 (or --concurrency 1,4,16) and
# writes PNG plots of throughput and TTFT by concurrency into bench-results/.
bench-peers: install $(BENCH_STAMP)
	$(PY) -m meshlm.bench.peers $(BENCH_ARGS)

lint: install
	$(PY) -m ruff check services tests
	$(PY) -m mypy services

clean:
	rm -rf $(VENV) services/sglang services/meshlm/v1/*_pb2* services/meshlm/v1/.stamp
