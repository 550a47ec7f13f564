# The two commands of the README. Each creates/refreshes .venv and installs the project.
PYTHON ?= python3
VENV ?= .venv
# CPU machines: the local CPU wheel. GPU hosts: `make serve TORCH_SPEC=` keeps their own torch.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The test tools, and the Triton the committed kernel table was compiled with (pyproject's dev
# extra): not for `make serve`, which keeps a GPU host's own Triton.
DEV_STAMP := $(VENV)/.installed-dev

.PHONY: serve test test-fast lint mutate kernels-table data

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

serve: $(STAMP)
	$(BIN)/python -m service

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

# Three pytest-xdist workers, each test in the lane of its folder (tests/lanes.py): the session
# service's tests (tests/service/) in one, the tests that start a Ray of their own
# (tests/own_ray/) in another (a lock keeps their timed parts apart), the tests
# without Ray in the background (a session of their own at nice 19) of the third and of any
# worker that is done. TEST_WORKERS=0 runs it all in this process, one test after another.
TEST_WORKERS ?= 3

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=25

# No Ray, no subprocess CLIs, no Triton interpreter: under a minute once the CPU kernels are
# built (the first run builds them, ~30 s).
test-fast: lint
	$(BIN)/python -m pytest -q -m "not service and not slow"

# The real data sets of docs/own-data.md from Debian's packages (apt-get download, ~32 MB):
# Fashion-MNIST as 14×14 pixel-id rows, Jane Austen's novels as 512-character windows, and
# the text task's n-gram baseline. Nothing is fetched at training or test time.
DATA ?= data
data: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[data]'
	$(BIN)/python -m mita.data.datasets fashion-mnist --out $(DATA)/fashion-mnist
	$(BIN)/python -m mita.data.datasets austen --window 512 --out $(DATA)/austen-512
	$(BIN)/python -m mita.data.datasets austen-persuasion --out $(DATA)/austen-persuasion

# The compiled resources of every Triton kernel specialisation (440 compiles, 15-40 min on 2
# cores) into mita/kernels/compiled.json, which make test checks by key and by a sample. Run it
# and commit the file with any change of a kernel, a launcher, mita/kernels/aot.py or Triton.
kernels-table: $(DEV_STAMP)
	$(BIN)/python -m mita.kernels.aot_table

# Mutation testing (docs/development.md), not part of `make test`: mutmut changes one
# thing at a time in the functions below, the code that computes what users read, and runs the
# fast tier against each change; then the hand-made mutants of tests/hand_mutants.py. Left out: network and process code (the load tester's sender,
# the advisor's and sweep's model runs, the Prometheus client), which the fast tier does not run.
MUTATE_SCOPE := \
	'loadtest.engine.x_summarize*' 'loadtest.engine.x_check_loopback*' 'loadtest.report.*' \
	'mita.quality.*' 'mita.timer.*' 'mita.records.*' 'mita.config.x_parse_setting*' \
	'mita.data.vocab.*' 'mita.tools.plots.x_figure*' 'mita.tools.plots.x_save*' 'mita.tools.plots.x_write_csv*' \
	'profiler.advise.x_compare*' 'profiler.advise_config.xǁConstraintǁ*' \
	'profiler.advise_config.x_parse_setting*' 'profiler.advise_config.x_default_grid*' \
	'profiler.advise.x_sequence_of_length*' 'profiler.recommend.x_report*' \
	'profiler.recommend.x__eligible*' 'profiler.recommend.x__recommend*' \
	'profiler.recommend.x__overall*' 'profiler.advise_config.x_drop_points*' \
	'profiler.advise_report.x_serve_snippet*' 'profiler.advise_report.x_markdown*' \
	'profiler.advise_report.x_cpu_sharing_warning*' 'profiler.advise_report.x_write_outputs*' \
	'profiler.sweep.x_landmarks_for*' 'profiler.sweep.x_attention_ms*' 'profiler.sweep.x_speedups*' \
	'profiler.sweep.x_markdown*' 'profiler.sweep.x_write_outputs*' \
	'service.recorder.xǁRecorderǁ[!_]*' 'service.recorder.xǁRecorderǁ_set_gauges*' \
	'service.stats.x_[!_gp]*' 'service.stats.x__[!g]*' 'service.stats.xǁStatsWindowǁ*' \
	'service.policy.*' 'service.config_file.*' 'service.inputs.*' 'service.schemas.*' \
	'service.settings.*' 'service.metrics.x_n_bucket*' 'service.metrics.x__one_two_five*'

# mutants/ is mutmut's copy of the tree and its results: removed first, so every mutant is run
# against the tests as they are now.
mutate: $(DEV_STAMP)
	rm -rf mutants
	$(BIN)/mutmut run $(MUTATE_SCOPE) > /dev/null
	$(BIN)/mutmut results --all true | awk -F': ' '$$2 != "not checked" {n[$$2]++; t++} \
		$$2 != "killed" && $$2 != "not checked" {print $$2 ":", $$1} \
		END {k = n["killed"] + n["timeout"]; printf "mutation score: %d of %d mutants killed " \
		"(%.1f %%; %d by a timeout), %d survived\n", k, t, 100 * k / t, n["timeout"], \
		n["survived"]}'
	$(BIN)/python -m tests.hand_mutants
