# ferry build. `make test` and `make demo` install everything they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What `make` builds lives here; `make install PREFIX=...` copies it to a node.
BUILD := .ferry
PREFIX ?= /opt/ferry
UNIT_DIR ?= /etc/systemd/system
CRIU := $(BUILD)/criu/bin/criu
CRIU_PROTO := $(BUILD)/criu/share/criu/proto
CRIU_PATCHES := $(BUILD)/criu-patches.sha256
INIT := $(BUILD)/bin/ferry-init
STUBS := ferry/v1/agent_pb2.py agent/criu_pb/rpc_pb2.py
PYTEST_ARGS ?= --durations=25

.PHONY: FORCE all deps proto native criu slurm test unit integration gpu demo bench bench-faults bench-stragglers lint doctor install clean

all: deps criu proto native

# Python environment: runtime and dev dependencies (torch pinned to the CPU build).
deps: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' --config-settings editable_mode=compat
	touch $@

# CRIU >= 4.2.1: the system's when it works, else built from Debian's source tarball.
criu: $(CRIU)
$(CRIU) $(CRIU_PROTO)/rpc.proto: scripts/install-criu.sh $(CRIU_PATCHES)
	scripts/install-criu.sh $(BUILD)/criu
	touch -h $(CRIU) $(CRIU_PROTO)/rpc.proto
# The patches' names and digests: one removed, added or changed rebuilds CRIU. Rewritten only
# when it differs, so that an unchanged set rebuilds nothing.
$(CRIU_PATCHES): FORCE
	@mkdir -p $(BUILD) && sha256sum native/criu/*.patch > $@.new && \
	  if cmp -s $@.new $@; then rm $@.new; else mv $@.new $@; fi
FORCE:

# Generated stubs: ferry's API and CRIU's RPC/stats protos (never committed).
proto: $(STUBS)
ferry/v1/agent_pb2.py: proto/ferry/v1/agent.proto $(VENV)/.installed
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --mypy_out=. $<
agent/criu_pb/rpc_pb2.py: $(CRIU_PROTO)/rpc.proto $(VENV)/.installed
	mkdir -p agent/criu_pb && touch agent/criu_pb/__init__.py
	$(PY) -m grpc_tools.protoc -I $(CRIU_PROTO) --python_out=agent/criu_pb $(CRIU_PROTO)/rpc.proto $(CRIU_PROTO)/stats.proto

# The job's PID 1.
native: $(INIT)
$(INIT): native/ferry-init.c
	mkdir -p $(dir $@)
	$(CC) -O2 -Wall -Wextra -Werror -o $@ $<

# The GPU test app, built only where there is an nvcc. Machine code for A100 (sm_80) and
# H100/H200 (sm_90), plus sm_90 PTX for newer GPUs; cudart, libstdc++ and libgcc linked
# statically, so running it needs only the driver (r580+ for this toolkit's CUDA 13) and a
# glibc as new as the build host's.
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc /usr/local/cuda-13.0/bin/nvcc))
NVCC_FLAGS ?= -O2 -std=c++17 -cudart static \
	-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90 \
	-Xcompiler -Wall,-Wextra -Werror all-warnings -Xcompiler -static-libstdc++,-static-libgcc
CUDA_COUNTER := $(BUILD)/bin/cuda-counter
# The GPU self-test's kernels (agent/gpus/selftest.py), as PTX the driver compiles for its chip.
SELFTEST_PTX := $(BUILD)/bin/gpu-selftest.ptx
ifneq ($(NVCC),)
native: $(CUDA_COUNTER) $(SELFTEST_PTX)
$(CUDA_COUNTER): native/cuda_counter.cu
	mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -o $@ $<
$(SELFTEST_PTX): native/gpu_selftest.cu
	mkdir -p $(dir $@)
	$(NVCC) -ptx -arch=compute_80 -O3 -o $@ $<
else
native:
	@echo "nvcc not found: skipping the CUDA counter ($(CUDA_COUNTER)); set NVCC=/path/to/nvcc to build it"
endif

# Slurm's controller and node daemon (Debian's packages), for tests/integration/test_slurm.py.
SLURM_PKGS := slurmctld slurmd slurm-client
slurm:
	@command -v slurmctld >/dev/null && command -v slurmd >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(SLURM_PKGS) >/dev/null; }; }

# etcd's server (Debian's package; etcdctl from etcd-client for debugging), for
# tests/integration/test_etcd_client.py and agent/testing/etcd.py.
ETCD_PKGS := etcd-server etcd-client
ETCD_PB := ferry/etcdpb/rpc_pb2.py
.PHONY: etcd
etcd: $(ETCD_PB)
	@command -v etcd >/dev/null && command -v etcdctl >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(ETCD_PKGS) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(ETCD_PKGS) >/dev/null; }; }
# agent.coord.etcd's gRPC stubs, from the protos of the same etcd version (never committed).
proto: $(ETCD_PB)
$(ETCD_PB): scripts/gen-etcd-proto.sh $(VENV)/.installed
	scripts/gen-etcd-proto.sh $(PY) $(BUILD)/etcd-proto

# Two tests at a time (each has its own bed, agents, ports and staging), then those marked
# serial alone (they time a job against itself, or raise a sysctl every agent reads); both
# parts run, and either failing fails the target.
test: all slurm etcd
	$(PY) -m pytest -n 2 --dist loadfile -m "not serial" $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest -m serial $(PYTEST_ARGS); b=$$?; exit $$((a || b))

unit: all
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: all slurm etcd
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

# GPU tests (skipped, with the reason, where there is no GPU).
gpu: all
	$(PY) -m pytest tests/gpu -rs $(PYTEST_ARGS)

# ferry on this node as a service: PREFIX (default /opt/ferry) and the systemd unit in UNIT_DIR.
install: all
	scripts/install.sh $(abspath $(PREFIX)) $(UNIT_DIR)

demo: all
	$(PY) scripts/demo.py

bench: all etcd
	$(PY) scripts/bench_migrate.py
	$(PY) scripts/bench_link.py
	$(PY) scripts/bench_ranks.py
	$(PY) scripts/bench_snapshots.py
	$(PY) scripts/bench_faults.py
	$(PY) scripts/bench_stragglers.py

# How fast and how surely a member that holds its group back is found, and what moving it is worth.
bench-stragglers: all
	$(PY) scripts/bench_stragglers.py

# The same training run under the same failures with ferry, TorchFT and checkpoint-restart.
bench-faults: all etcd
	$(PY) scripts/bench_faults.py

lint: deps
	$(VENV)/bin/ruff check agent tests scripts
	$(VENV)/bin/ruff format --check agent tests scripts

doctor: all
	$(VENV)/bin/ferry doctor

clean:
	rm -rf $(VENV) $(BUILD) ferry agent/criu_pb build *.egg-info
