# Every target sets the environment up by itself on first use (a .venv next to this file).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
# The end-to-end test (tests/e2e) drives this browser; Playwright never downloads one of its own.
CHROMIUM ?= /usr/bin/chromium
export MGTUTORIAL_CHROMIUM := $(CHROMIUM)
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1

.PHONY: lab demo check test test-unit test-notebooks test-notebook test-e2e gpu-check chromium \
	clean-runs student

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[test,e2e]"
	@touch $(STAMP)

# NOTEBOOKS=student opens the student edition (make student) instead of the instructor edition.
NOTEBOOKS ?= notebooks
lab: $(STAMP)  ## open the course in JupyterLab (token auth: use the URL it prints)
	$(VENV)/bin/jupyter lab --notebook-dir=$(NOTEBOOKS) $(ROOT_FLAG)

# DEMO_ARGS: more ddp options (.venv/bin/python -m mgtutorial ddp --help), e.g. DEMO_ARGS="--epochs 1"
DEMO_ARGS ?= --epochs 3
demo: $(STAMP)  ## the headless main job: DDP on 2 ranks, progress, final accuracy, loss.png
	$(PY) -m mgtutorial ddp --nproc 2 --dataset auto --runs-dir runs $(DEMO_ARGS)

check: $(STAMP)  ## the laptop check for the morning of a workshop (WORKSHOP.md): a pass/fail table, exit 1 on a failure
	$(PY) -m mgtutorial check

# The tests run on PYTEST_WORKERS pytest-xdist workers (0: in this process, one after another): each
# notebook stays whole on one worker, every other test is spread (conftest.py). PYTEST_ARGS adds
# pytest options, e.g. PYTEST_ARGS="-x -k ddp".
PYTEST_WORKERS ?= 3
PYTEST_ARGS ?=
PYTEST := $(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test: $(STAMP) chromium  ## unit + multi-rank + end-to-end (JupyterLab in Chromium) tests and every notebook under nbval, on 3 xdist workers
	$(PYTEST) tests notebooks --nbval-lax

.PHONY: test-fast coverage coverage-report
test-fast: $(STAMP)  ## the inner loop, about two minutes: every test not marked slow (no notebook, no browser)
	$(PYTEST) tests -m "not slow"

test-unit: $(STAMP)
	$(PYTEST) tests

test-notebooks: $(STAMP)
	$(PYTEST) notebooks --nbval-lax

# One chapter under nbval, as make test runs it: NB=02 is notebooks/02_*.ipynb, NB=03a one
# notebook, NB=03 both 03a and 03b; PYTEST_ARGS adds pytest options here too.
NB ?=
test-notebook: $(STAMP)  ## one chapter under nbval: make test-notebook NB=02
	@files="$$(ls notebooks/$(NB)_*.ipynb notebooks/$(NB)[a-z]_*.ipynb 2>/dev/null)"; \
	if [ -z "$(NB)" ] || [ -z "$$files" ]; then \
		chapters="$$(ls notebooks/*.ipynb | sed 's|^notebooks/||; s|_.*||' | tr '\n' ' ')"; \
		echo "make test-notebook NB=<chapter>: NB=$(NB) names no notebooks/<NB>_*.ipynb;" \
			"the chapters are $${chapters}(or a number alone for all its parts: NB=03)"; \
		exit 2; \
	fi; \
	echo "$(PY) -m pytest -p no:cacheprovider --nbval-lax $(PYTEST_ARGS) $$files"; \
	$(PY) -m pytest -p no:cacheprovider --nbval-lax $(PYTEST_ARGS) $$files

test-e2e: $(STAMP) chromium  ## chapter 02 in JupyterLab in headless Chromium; screenshots in test-artifacts/e2e
	$(PY) -m pytest tests/e2e -v

# Line coverage of mgtutorial/ under the tests and notebooks of make test (less the browser), ranks
# included: every Python process they start measures itself ([tool.coverage.run] in pyproject.toml).
# Prints, per module, the lines never executed; COVERAGE_DIR keeps coverage.json and html/.
COVERAGE_DIR := test-artifacts/coverage
COVERAGE := COVERAGE_FILE=$(CURDIR)/$(COVERAGE_DIR)/.coverage $(PY) -m coverage
coverage: $(STAMP)  ## line coverage of mgtutorial/ on CPU (tests + notebooks, ranks included); the missed lines per module
	@rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	@$(COVERAGE) run -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS) tests notebooks --nbval-lax \
		--ignore=tests/e2e; status=$$?; $(COVERAGE) combine --quiet \
		&& $(MAKE) --no-print-directory coverage-report; exit $$status

coverage-report:  ## the last make coverage's figures again (terminal, coverage.json, html/)
	@$(COVERAGE) json --quiet -o $(COVERAGE_DIR)/coverage.json
	@$(COVERAGE) html --quiet -d $(COVERAGE_DIR)/html
	@$(COVERAGE) report
	@echo "coverage.json and html/index.html in $(COVERAGE_DIR)"

# Every CUDA-only path of the course, each item in its own process with a time limit; a few minutes on
# one GPU, more items with two or more. Report: gpu-check/report.md and report.json. Without CUDA
# every item is reported skipped and it exits 0. GPU_CHECK_ARGS: e.g. --notebooks, --only NAME,..., --list
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)  ## prove the GPU paths (NCCL, DDP on cuda, SyncBatchNorm, pipeline stages, FSDP2, TP, timing)
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

# Debian's chromium, installed with apt-get where it is missing and we may (root, apt-get). Where it
# cannot be installed, this says so and tests/e2e is skipped with the reason.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Debian's chromium for tests/e2e (apt-get)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
			|| echo "WARNING: could not install chromium: tests/e2e will be skipped"; \
	else \
		echo "WARNING: $(CHROMIUM) is missing and needs root and apt-get to install: tests/e2e will be skipped"; \
	fi

student: $(STAMP)  ## the student edition in student/ (solutions removed, exercise outputs cleared; an earlier one is moved aside)
	$(PY) -m mgtutorial.workshop.edition --src notebooks --out student

clean-runs:  ## delete run directories (logs, checkpoints, plots), the student editions' too
	rm -rf runs notebooks/runs student/runs student-previous-*/runs

# The course as a static website (book/build.py): every chapter from the committed notebooks, as
# committed (nothing is executed), with search, math and figures, loading nothing from another
# host. EDITION=student builds the student edition (as make student writes it) into its own folder.
EDITION ?= instructor
BOOK_STAMP := $(VENV)/.installed-book
$(BOOK_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e ".[book]"
	@touch $(BOOK_STAMP)

.PHONY: book
book: $(BOOK_STAMP)  ## the course as a website: book/_build/$(EDITION)/html/index.html (EDITION=student: the student edition)
	$(PY) book/build.py --edition $(EDITION)

# tests/e2e/test_book.py builds both books and reads them in Chromium
test test-unit test-e2e: $(BOOK_STAMP)
