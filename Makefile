# Two entry points: `make demo` (the main job) and `make test`. Both create or reuse .venv
# and install what they need; nothing has to be installed by hand.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.hetplan-installed
SHARED ?= ../shared
PROFILES := $(SHARED)/data/pipedream-profiles
OUT ?= out/demo
HETPLAN := $(BIN)/hetplan
# Python caches the compiled modules it imports (hetplan's own and the tests' are compiled at
# every start otherwise, in every worker and command a test starts)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test check lint clean

# where pip finds packages besides the index (this machine keeps torch's CPU build on disk), for uv too
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))

# uv installs the pinned set in seconds where pip takes one to two minutes (torch's files), where
# pip finds packages in folders of wheels (find-links: this machine's CPU torch), which uv is
# given too; pip does it elsewhere (uv reads none of pip's configuration: it could take another
# build of torch from PyPI than the one pip's own index would give) and where uv cannot be had.
# Nothing is compiled ahead: Python writes a module's bytecode the first time any process imports
# it (see unexport above), a fraction of compiling all of torch.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	if [ -n "$(strip $(FIND_LINKS))" ] && $(BIN)/python -m pip install --quiet -c constraints.txt uv && \
	   $(BIN)/python -m uv pip install --quiet --python $(BIN)/python -c constraints.txt \
	       $(foreach f,$(FIND_LINKS),--find-links $(f)) -e '.[dev]'; then :; \
	else $(BIN)/python -m pip install --quiet --no-compile -c constraints.txt -e '.[dev]'; fi
	touch $(STAMP)

demo: $(STAMP)
	@mkdir -p $(OUT)
	$(HETPLAN) profile gpt2-tiny --batch-size 8 --seq-len 64 --device cpu:1 --device cpu:2 --check -o $(OUT)/gpt2-tiny.json
	$(HETPLAN) info $(OUT)/gpt2-tiny.json
	$(HETPLAN) plan $(OUT)/gpt2-tiny.json --cluster local --planner uniform -o $(OUT)/plan-gpt2-tiny.json
	$(HETPLAN) import pipedream $(PROFILES)/resnet50/graph.txt -o $(OUT)/resnet50.json
	$(HETPLAN) info $(OUT)/resnet50.json
	$(HETPLAN) info hetero-4
	$(HETPLAN) plan $(OUT)/resnet50.json --cluster hetero-4 --planner single -o $(OUT)/plan-single.json
	$(HETPLAN) plan $(OUT)/resnet50.json --cluster hetero-4 --planner uniform -o $(OUT)/plan-uniform.json
	$(HETPLAN) plan $(OUT)/resnet50.json --cluster hetero-4 -o $(OUT)/plan-dp.json
	$(HETPLAN) compare $(OUT)/resnet50.json --cluster hetero-4 --budget-s 3
	$(HETPLAN) plan $(OUT)/resnet50.json --cluster cloud-mix --objective cost --min-samples-per-s 400 -o $(OUT)/plan-cost.json
	$(HETPLAN) import pipedream $(PROFILES)/vgg16/graph.txt -o $(OUT)/vgg16.json
	$(HETPLAN) plan $(OUT)/vgg16.json --cluster hetero-4 --planner uniform -o $(OUT)/plan-vgg16.json
	$(HETPLAN) simulate $(OUT)/plan-vgg16.json --graph $(OUT)/vgg16.json --cluster hetero-4 --gantt $(OUT)/vgg16-hetero-4.png --trace $(OUT)/vgg16-hetero-4.trace.json
	$(HETPLAN) plan $(OUT)/gpt2-tiny.json --cluster hetero-4 --planner uniform --microbatches 8 -o $(OUT)/plan-gpt2-tiny-hetero-4.json
	$(HETPLAN) simulate $(OUT)/plan-gpt2-tiny-hetero-4.json --graph $(OUT)/gpt2-tiny.json --cluster hetero-4 --gantt $(OUT)/gpt2-tiny-hetero-4.png
	$(HETPLAN) calibrate --cluster local -o $(OUT)/local-calibrated.json
	$(HETPLAN) demo --cluster $(OUT)/local-calibrated.json --out $(OUT)/report
	@echo "demo: files written to $(OUT)/"

# two pytest workers (pytest-xdist): the tests that run in one process take both cores of a
# 2-core VM; those that start worker processes already did
test: $(STAMP)
	$(BIN)/python -m pytest -n 2

# the quick part of the suite, for while you work; CI runs `make test`
check: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not slow" -q

lint: $(STAMP)
	$(BIN)/ruff check src tests bench

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
