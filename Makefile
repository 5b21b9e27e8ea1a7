# Every target sets the environment up by itself on first use (a .venv next to this file).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab demo test test-unit test-notebooks clean-runs

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $(STAMP)

lab: $(STAMP)  ## open the course in JupyterLab (token auth: use the URL it prints)
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(ROOT_FLAG)

demo: $(STAMP)  ## the headless main job: DDP on 2 ranks, progress, final accuracy, loss.png
	$(PY) -m mgtutorial ddp --nproc 2 --epochs 3 --dataset auto --runs-dir runs

test: $(STAMP)  ## unit + multi-rank tests, then every notebook under nbval
	$(PY) -m pytest tests notebooks --nbval-lax

test-unit: $(STAMP)
	$(PY) -m pytest tests

test-notebooks: $(STAMP)
	$(PY) -m pytest notebooks --nbval-lax

clean-runs:  ## delete run directories (logs, checkpoints, plots)
	rm -rf runs notebooks/runs
