# Conveyor: one command per job. `make test` and `make demo` do all their own set-up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export KAFKA_PORT ?= 9092
export REDIS_PORT ?= 6379
export S3_PORT ?= 8333
export KAFKA_CLUSTER_PORT ?= 9292
export REDIS_CLUSTER_PORT ?= 7000
# The demo model is built here (not in the user's cache) so `make clean` removes it.
export CONVEYOR_MODEL_DIR ?= $(CURDIR)/.cache/models
PYTEST_ARGS ?=
# Test processes side by side (pytest-xdist), one a core of the 2-core machines the suite
# is timed on; PYTEST_WORKERS=0 runs every test in pytest's own process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: help install up up-s3 down test up-cluster down-cluster test-cluster unit lint format demo demo-video demo-fraud demo-text bench settings-doc clean

help:
	@echo "make install  virtual environment in $(VENV) with the worker, video, timm, hf, s3, tracing, gateway, demo, tabular and dev extras"
	@echo "make up       start Kafka (127.0.0.1:$(KAFKA_PORT)) and Redis (127.0.0.1:$(REDIS_PORT))"
	@echo "make up-s3    start SeaweedFS's S3 gateway (127.0.0.1:$(S3_PORT)), built from its Go module once"
	@echo "make down     stop what 'make up' and 'make up-s3' started"
	@echo "make test     install, up, run every test ($(PYTEST_WORKERS) processes side by side), down (even when tests fail)"
	@echo "make up-cluster    start a 3-broker Kafka (127.0.0.1:$(KAFKA_CLUSTER_PORT)-$$(($(KAFKA_CLUSTER_PORT)+2)))"
	@echo "                   and a Redis Cluster (127.0.0.1:$(REDIS_CLUSTER_PORT)-$$(($(REDIS_CLUSTER_PORT)+5)))"
	@echo "make down-cluster  stop what 'make up-cluster' started"
	@echo "make test-cluster  install, Redis and the clusters up, failover and scale-out tests, down"
	@echo "make demo     install, up, serve the bundled digits model and score it end to end"
	@echo "make demo-video  install, up, detect digits in a synthetic video streamed frame by frame"
	@echo "make demo-fraud  install, up, score a stream of synthetic card transactions (a GBDT, an MLP)"
	@echo "make demo-text   install, up, classify a stream of synthetic product reviews (a small BERT, hf:)"
	@echo "make bench    install, up, CPU benchmarks against the local broker (docs/benchmarks.md)"
	@echo "make unit     unit tests only (no Kafka or Redis needed)"
	@echo "make lint     ruff (lint + format check), mypy --strict and vulture (unused code), tests and benches included"
	@echo "make settings-doc  regenerate docs/settings.md from workers/config/worker.py"
	@echo "make clean    remove the venv, caches and local service data"

install: $(STAMP)

$(STAMP): pyproject.toml
	compose/local/tools.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[worker,video,timm,hf,quant,s3,tracing,gateway,demo,tabular,dev]' || compose/local/pip-failed.sh $(VENV)
	touch $(STAMP)

up:
	compose/local/up.sh

up-s3:
	compose/local/seaweedfs.sh start

down:
	compose/local/down.sh

test: install
	@status=0; $(MAKE) --no-print-directory up up-s3 && $(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS) || status=$$?; \
	  $(MAKE) --no-print-directory down; exit $$status

up-cluster:
	compose/local/kafka-cluster.sh start
	compose/local/redis-cluster.sh start

down-cluster:
	compose/local/kafka-cluster.sh stop
	compose/local/redis-cluster.sh stop

# The scale-out tests use the clusters and the plain Redis (not the single broker).
test-cluster: install
	@status=0; { compose/local/redis.sh start && $(MAKE) --no-print-directory up-cluster; } \
	  && $(PY) -m pytest -m cluster tests/cluster $(PYTEST_ARGS) || status=$$?; \
	  $(MAKE) --no-print-directory down-cluster; compose/local/redis.sh stop; exit $$status

unit: install
	$(PY) -m pytest -m "not integration" $(PYTEST_XDIST) $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/vulture

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: install
	@$(MAKE) --no-print-directory up
	$(PY) -m demo.models.digits
	$(PY) -m demo.digits --kafka-bootstrap 127.0.0.1:$(KAFKA_PORT) --redis-url redis://127.0.0.1:$(REDIS_PORT)/0

demo-video: install
	@$(MAKE) --no-print-directory up
	$(PY) -m demo.models.detector
	$(PY) -m demo.video --kafka-bootstrap 127.0.0.1:$(KAFKA_PORT) --redis-url redis://127.0.0.1:$(REDIS_PORT)/0

demo-fraud: install
	@$(MAKE) --no-print-directory up
	$(PY) -m demo.fraud --kafka-bootstrap 127.0.0.1:$(KAFKA_PORT) --redis-url redis://127.0.0.1:$(REDIS_PORT)/0

demo-text: install
	@$(MAKE) --no-print-directory up
	$(PY) -m demo.text --kafka-bootstrap 127.0.0.1:$(KAFKA_PORT) --redis-url redis://127.0.0.1:$(REDIS_PORT)/0

bench: install
	@$(MAKE) --no-print-directory up
	$(PY) -m bench.cpu --kafka-bootstrap 127.0.0.1:$(KAFKA_PORT) --redis-url redis://127.0.0.1:$(REDIS_PORT)/0

settings-doc: install
	$(PY) -c 'import workers.settings_doc as doc; print(doc.settings_reference(), end="")' >docs/settings.md

clean: down down-cluster
	rm -rf $(VENV) .cache .run .mypy_cache .ruff_cache .pytest_cache .hypothesis
