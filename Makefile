# Two commands do everything on a fresh machine with Python 3.11+ and make:
#   make book    build the executed book into _build/html
#   make test    build the book with warnings as errors, then run the tests and check its pages
# Both create the virtual environment from requirements.txt on first use.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# TORCH=system: keep the torch that is already installed (a GPU container's) instead of
# installing the pinned CPU build: the environment then sees the system site-packages.
TORCH  ?= pinned
LAB    ?= grad_averaging
NPROC  ?= 2
ARGS   ?=
PORT   ?= 8000
# Python writes each module's bytecode the first time a process imports it, even where the
# environment says not to: every lab starts torch in each of its ranks, and compiling torch
# again in every process would double its start. pip installs without compiling (--no-compile):
# compiling all 1.4 GB of packages costs more than the few modules the labs and book import.
export PYTHONDONTWRITEBYTECODE :=
# The sizing page's Pyodide release, pinned once in _config.yml
PYODIDE_VERSION := $(shell sed -n 's/^ *sizing_pyodide_version: "\(.*\)"/\1/p' _config.yml)
PYODIDE := $(VENV)/pyodide-$(PYODIDE_VERSION)
# MathJax for a site that reads offline (OFFLINE=1), pinned once in _config.yml
MATHJAX_VERSION := $(shell sed -n 's/^ *offline_mathjax_version: "\(.*\)"/\1/p' _config.yml)
MATHJAX := $(VENV)/mathjax-$(MATHJAX_VERSION)
# OFFLINE=1: the built site makes no request outside itself (book/_ext/offline_site.py):
# MathJax and Pyodide come from npm's packages, copied into the site. `make test` builds it
# so wherever npm is present, and its browser test checks that nothing else is requested.
OFFLINE ?=
OFFLINE_ASSETS = $(MAKE) --no-print-directory pyodide mathjax && \
	test -f $(PYODIDE)/pyodide.js -a -f $(MATHJAX)/tex-mml-chtml.js || { echo \
	"make book OFFLINE=1: npm is needed once, to take MathJax and Pyodide from its registry"; exit 1; }
OFFLINE_ENV = BOOK_MATHJAX_DIR=$(abspath $(MATHJAX)) BOOK_PYODIDE_DIR=$(abspath $(PYODIDE))
# -W: warnings are errors; -n: nitpicky (every reference must resolve); --all: write every
# page again. A chapter executes again only when its cells, or the labs, results or pinned
# packages changed (scripts/book_cache.py empties the execution cache then).
JB_FLAGS := --all -W -n --keep-going

.PHONY: help venv book test test-start test-setup pytest htmlcheck checks lab serve linkcheck notebooks clean pyodide mathjax \
	gpu-references

help:
	@echo "make book       build the executed book into _build/html"
	@echo "make book OFFLINE=1   the same, reading offline: MathJax and Pyodide served by the site (needs npm once)"
	@echo "make test       build the book with warnings as errors, then run the tests and check its pages"
	@echo "make lab LAB=grad_averaging NPROC=4 ARGS='--steps 50'   run one lab under torchrun"
	@echo "make gpu-references   every chapter's labs on this box's GPUs with NCCL, into results/<gpu>-x<N>/"
	@echo "make serve      serve _build/html on http://127.0.0.1:$(PORT)"
	@echo "make linkcheck  check the book's external links"
	@echo "make notebooks  write .ipynb copies of the chapters into _notebooks/"
	@echo "make clean      remove _build and _notebooks (make clean-all: also .venv)"

# Without pip (ensurepip took 6 s of the environment's 15 here): uv installs it with the rest
$(BIN)/activate:
ifeq ($(TORCH),system)
	$(PYTHON) -m venv --system-site-packages $(VENV)
else
	$(PYTHON) -m venv --without-pip $(VENV)
endif

# The pinned packages, the CPU build of torch among them, are installed with uv, which unpacks
# wheels in parallel and links them from its cache: 11 s from nothing to an environment where
# pip took 40 (2-core machine, warm caches). uv reads no pip configuration, so it is handed
# the wheel folders pip is configured to look in (find-links: a machine that keeps torch's
# CPU build on disk). Where uv cannot be installed or fails, and for TORCH=system, pip
# installs, upgraded first to a pinned release: Python 3.11's own (23.2) spends 17 s of CPU
# resolving these pins, 26.1 6 s.
# uv itself is taken by the system's pip into a folder of its own (the environment has no
# pip yet), or, where the system has none, by the pip ensurepip puts in the environment.
# uv first installs from its cache alone (--offline): on a machine that installed these
# pins before, the registries are not asked again (they answer every revalidation as
# modified here, and DeepSpeed's source was built again each time: 4 s); where anything is
# missing from the cache, it installs as usual. The environment's pip is installed by uv.
PIP_VERSION := 26.1
UV_VERSION := 0.13.9
UV_DIR := $(VENV)/uv-$(UV_VERSION)
UV_GET = $(PYTHON) -m pip install --no-compile --no-deps -q --root-user-action=ignore --target $(UV_DIR) uv==$(UV_VERSION) \
	|| { $(BIN)/python -m ensurepip -q && $(BIN)/python -m pip install --no-compile --no-deps -q \
		--target $(UV_DIR) uv==$(UV_VERSION); }
UV_INSTALL = $(UV_DIR)/bin/uv pip install --python $(BIN)/python $(PIP_WHEEL_FOLDERS) \
	pip==$(PIP_VERSION) -r requirements.txt
PIP_WHEEL_FOLDERS = $$($(PYTHON) -m pip config list 2>/dev/null \
	| sed -n "s/^.*\.find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u | sed 's/^/--find-links /')

# Then the bytecode of what the labs and the book import is written once, in one process,
# rather than by the first chapter that imports each (scripts/compile_imports.py).
$(VENV)/.installed: requirements.txt | $(BIN)/activate
ifeq ($(TORCH),system)
	$(BIN)/python -m pip install --no-compile -q pip==$(PIP_VERSION)
	$(BIN)/python -c "import torch; print('using the installed torch', torch.__version__)"
	$(BIN)/python scripts/system_requirements.py requirements.txt > $(VENV)/requirements-system.txt
	$(BIN)/python -m pip install --no-compile -r $(VENV)/requirements-system.txt
else
	{ { $(UV_GET); } && { $(UV_INSTALL) --offline 2>/dev/null \
		|| { echo "uv: not all of it in uv's cache, installing from the registries"; $(UV_INSTALL); }; }; } \
	|| { echo "uv failed: installing with pip"; \
		{ $(BIN)/python -m pip --version >/dev/null 2>&1 || $(BIN)/python -m ensurepip -q; } \
		&& $(BIN)/python -m pip install --no-compile -q pip==$(PIP_VERSION) \
		&& $(BIN)/python -m pip install --no-compile -r requirements.txt; }
endif
	$(BIN)/python scripts/compile_imports.py
	touch $@

venv: $(VENV)/.installed

book: venv
	$(BIN)/python scripts/book_cache.py
	$(if $(filter 1,$(OFFLINE)),$(OFFLINE_ASSETS))
	$(if $(filter 1,$(OFFLINE)),$(OFFLINE_ENV)) $(BIN)/jupyter-book build . $(JB_FLAGS)

# The labs and cost models; tests/book checks the built pages, after the book (htmlcheck).
# Two test files at a time (most of a lab's time is spent starting processes and waiting on
# its peers), the `timed` ones among them: their bounds come from what the same run
# measured, so a busy machine widens them instead of failing them. Files in the order
# tests/conftest.py gives them, the longest first (--no-loadscope-reorder keeps it). The labs
# start forked from a process that imported torch once (tests/fork_launch.py);
# LABS_FORK_LAUNCH=0 starts each as a fresh Python under real torchrun, as the book does.
PYTEST_TWO = $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder
PYTEST_LABS = $(PYTEST_TWO) tests --ignore=tests/book
pytest: venv
	$(PYTEST_LABS) --durations=15

# The built pages, and the sizing page in Chromium with a local Pyodide (npm's package at
# the pinned release). Without npm, Chromium or chromedriver the browser test says it skipped.
# Two files at a time: a browser's page loads leave a core idle (their timing bounds are wide).
# The slowest five are printed: this phase took 20 s in some fresh builds and 50 s in others.
PYTEST_PAGES = $(BIN)/python -m pytest tests/book -rs -n 2 --dist loadfile --durations=5
htmlcheck: venv pyodide
	$(PYTEST_PAGES)

# make checks, on a built book: the labs' tests and the page checks side by side, since
# both wait more than they compute (a lab's ranks on their peers, a browser on its pages;
# one after the other they left a core idle half the time), the page checks' output printed
# once they end. The `timed` tests then run without the browser beside them: the bubble
# under controlled time is bounded by what its own launch measured, but beside the browser
# and two more workers a short step still left its bound (1F1B at p = 3 and m = 1 measured
# 0.80 against 0.75), and all of it at once took longer here (189 s against 163).
PAGES_LOG = _build/htmlcheck.log
# The page checks start once the labs' tests have been collected (about 8 s alone; 19 s with
# the browser starting beside them), which leaves the page checks' slack behind the labs'
# tests (90 s against 170) for the collection the labs' tests wait on
PAGES_AFTER_S = 10
# the files that hold timed tests: only they are collected again for the last phase
TIMED_FILES = $(shell grep -l "pytest.mark.timed" tests/test_*.py)
checks: venv pyodide
	@mkdir -p _build; { sleep $(PAGES_AFTER_S); $(PYTEST_PAGES); } > $(PAGES_LOG) 2>&1 & pages=$$!; \
	$(PYTEST_LABS) -m "not timed" --durations=15; labs=$$?; \
	wait $$pages; pages=$$?; echo "== the page checks, run beside them:"; cat $(PAGES_LOG); \
	$(PYTEST_TWO) $(TIMED_FILES) -m timed; timed=$$?; \
	test $$labs -eq 0 -a $$pages -eq 0 -a $$timed -eq 0

# npm's pyodide package, the files the browser needs, in $(PYODIDE) (nothing without npm)
pyodide: $(PYODIDE)/pyodide.js

$(PYODIDE)/pyodide.js: _config.yml | $(BIN)/activate
	@if command -v npm >/dev/null; then \
		rm -rf $(PYODIDE) $(VENV)/package && \
		npm pack --silent pyodide@$(PYODIDE_VERSION) --pack-destination $(VENV) >/dev/null && \
		tar xzf $(VENV)/pyodide-$(PYODIDE_VERSION).tgz -C $(VENV) && \
		rm $(VENV)/pyodide-$(PYODIDE_VERSION).tgz && mv $(VENV)/package $(PYODIDE); \
	else echo "npm not found: no local Pyodide, the sizing page's browser test will skip"; fi

# npm's mathjax package, its es5/ folder (what the site loads) in $(MATHJAX)
mathjax: $(MATHJAX)/tex-mml-chtml.js

$(MATHJAX)/tex-mml-chtml.js: _config.yml | $(BIN)/activate
	@if command -v npm >/dev/null; then \
		rm -rf $(MATHJAX) $(VENV)/package && \
		npm pack --silent mathjax@$(MATHJAX_VERSION) --pack-destination $(VENV) >/dev/null && \
		tar xzf $(VENV)/mathjax-$(MATHJAX_VERSION).tgz -C $(VENV) && \
		rm $(VENV)/mathjax-$(MATHJAX_VERSION).tgz && mv $(VENV)/package/es5 $(MATHJAX) && \
		rm -rf $(VENV)/package; \
	else echo "npm not found: no local MathJax, so no offline site"; fi

# make test runs the same checks, but starts the labs' tests as soon as the chapters have
# executed and the unit has been measured again (book/_ext/chapter_times.py writes
# CHAPTERS_EXECUTED then), while Sphinx writes the pages on one core (8 to 10 s here), and the
# page checks once the book is built: the labs' tests need nothing the build writes. Their
# output is printed when they end, the page checks' after it; a book that fails to build
# still has its labs tested, and its pages left unchecked.
CHAPTERS_EXECUTED = _build/.chapters_executed
LABS_LOG = _build/pytest.log
# the book's make, named through a variable of its own: a recipe line that names $(MAKE)
# runs even under `make -n`, which would run all of make test's checks to print them
BOOK_MAKE := $(MAKE) --no-print-directory book
# Where npm is present, the site the tests check is the one that reads offline
test: OFFLINE = $(if $(shell command -v npm),1)
test: test-start test-setup
	@mkdir -p _build; rm -f $(CHAPTERS_EXECUTED); \
	BOOK_CHAPTERS_EXECUTED=$(abspath $(CHAPTERS_EXECUTED)) \
		$(BOOK_MAKE) OFFLINE=$(OFFLINE) & book=$$!; \
	while [ ! -f $(CHAPTERS_EXECUTED) ] && kill -0 $$book 2>/dev/null; do sleep 1; done; \
	$(PYTEST_LABS) -m "not timed" --durations=15 > $(LABS_LOG) 2>&1 & labs=$$!; \
	wait $$book; book=$$?; pages=1; \
	if [ $$book -eq 0 ]; then $(PYTEST_PAGES) > $(PAGES_LOG) 2>&1; pages=$$?; fi; \
	wait $$labs; labs=$$?; \
	echo "== the labs' tests, started once the chapters had executed:"; cat $(LABS_LOG); \
	if [ $$book -eq 0 ]; then echo "== the page checks, run beside them:"; cat $(PAGES_LOG); \
	else echo "== no page checks: the book did not build"; fi; \
	$(PYTEST_TWO) $(TIMED_FILES) -m timed; timed=$$?; \
	$(BIN)/python scripts/make_test_units.py; \
	test $$book -eq 0 -a $$labs -eq 0 -a $$pages -eq 0 -a $$timed -eq 0

# the start of `make test`, before the environment exists: its units are counted from here
test-start:
	@python3 scripts/make_test_units.py --start

# The environment, with npm's Pyodide and MathJax taken beside it (2 to 4 s on a fresh
# clone): uv's install leaves a core idle
# (the makes named through a variable, as BOOK_MAKE below, so that `make -n` runs neither)
ASSETS_LOG = _build/assets.log
SETUP_MAKE := $(MAKE) --no-print-directory
test-setup: | $(BIN)/activate
	@mkdir -p _build; $(SETUP_MAKE) pyodide mathjax > $(ASSETS_LOG) 2>&1 & assets=$$!; \
	$(SETUP_MAKE) venv; venv=$$?; wait $$assets; cat $(ASSETS_LOG); test $$venv -eq 0

lab: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python -m torch.distributed.run \
		--standalone --nproc_per_node=$(NPROC) labs/$(LAB).py $(ARGS)

# On a GPU box: each chapter's labs with NCCL on every GPU, one JSON per lab with what it ran
# on, in results/<gpu>-x<N>/ (benchmarks/gpu_references.py; ARGS='--labs memory' for some)
gpu-references: venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(BIN)/python benchmarks/gpu_references.py $(ARGS)

serve:
	$(BIN)/python -m http.server $(PORT) --bind 127.0.0.1 --directory _build/html

linkcheck: venv
	$(BIN)/jupyter-book build . --builder linkcheck

notebooks: venv
	$(BIN)/jupytext --sync book/*.md

clean:
	rm -rf _build _notebooks

clean-all: clean
	rm -rf $(VENV)
