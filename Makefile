# `make demo` and `make test` each create .venv when missing, then run.
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# CPU runs: DeepSpeed's CPU accelerator (gloo), W&B offline.
CPU_ENV := DS_ACCELERATOR=cpu WANDB_MODE=offline

.PHONY: venv demo test test-quick test-compile gpu-check lint format docs
# .venv with requirements.txt installed (again when requirements.txt changes).
venv: $(INSTALLED)

$(INSTALLED): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

# The tiny GPT as a 2-stage pipeline on 2 CPU processes, on the embedded corpus (stdlib sources), with the val
# loss every 30 steps, into a run directory of its own (fixed once per make run); then a sample from it.
DEMO_DIR := outputs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: venv
	$(CPU_ENV) $(VENV)/bin/deepspeed --num_gpus 2 train.py hydra.run.dir=$(DEMO_DIR) +recompute=selective \
		train.device=cpu train.steps=150 train.micro_batches=4 train.micro_batch_size=4 train.log_every=10 \
		train.eval_every=30 train.eval_batches=4
	$(CPU_ENV) $(PY) generate.py checkpoint=$(DEMO_DIR) 'prompt="def "' max_new_tokens=120 temperature=0.8 \
		top_k=40 seed=0

# Every test: real deepspeed launches on gloo, Hydra, W&B offline, the local Slurm cluster; then the 25 slowest, so
# the next regression shows. Multi-process runs share one launch per kind and world size (tests/shared_runs.py).
# Two pytest-xdist workers, one per core: a launch's ranks wait on each other and on their start-up far more than
# they compute, and the other worker's in-process tests fill those waits; each shared launch keeps to one worker
# (its group, tests/xdist_groups.py).
XDIST := -n 2 --dist loadscope
test: venv
	$(CPU_ENV) $(PY) -m pytest -q tests -m "not compile" $(XDIST) --durations=25

# The inner loop: every test that starts no process group (no `multiproc` or `slurm` marker). A test that starts
# one without its marker fails under STAGECHECK_QUICK_TIER (tests/runs.py, tests/conftest.py).
test-quick: venv
	$(CPU_ENV) STAGECHECK_QUICK_TIER=1 $(PY) -m pytest -q tests -m "not multiproc and not slurm and not compile" \
		$(XDIST) --durations=10

# The compiled exactness matrix (train.compile: every accepted recompute mode, both families), +recompute=auto compiled
# through the launcher (tests/test_compile_auto_run.py), 2 stages x 2 data-parallel ranks with ZeRO-1 compiled
# (tests/test_compile_zero1_run.py) and the planner's compiled bytes against the meters (tests/test_compile_bytes.py),
# which make test leaves out for their compile time (a representative compiled 2-rank run through the launcher, the
# refusals and the planner's reading of compiled bytes stay in make test: tests/test_compile.py).
test-compile: venv
	$(CPU_ENV) $(PY) -m pytest -q tests -m compile $(XDIST) --durations=10

# On a machine with CUDA: the GPU tests (tests/test_gpu.py), gpt2 per recompute mode on one GPU and, with two or
# more, 2-stage NCCL runs under a timeout; writes docs/gpu_figures.md (docs/gpu.md). At most 10 minutes on one GPU.
gpu-check: venv
	WANDB_MODE=disabled $(PY) -m bench.gpu_check

# ruff's lint and format checks (pyproject.toml).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# What lint checks, fixed in place: ruff's fixable findings, then its formatting.
format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# docs/configuration.md, generated from the config dataclasses' docstrings, and the docs' tables that quote the dry
# run (harness/doc_tables.py); a test checks each is current.
docs: venv
	$(PY) -m schema.reference --write
	$(CPU_ENV) $(PY) -m harness.doc_tables --write
