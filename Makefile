# The two entry points named at the top of README.md. Both create/reuse .venv and install everything first.
.PHONY: demo test test-fast lint format venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/python scripts/demo.py

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q --durations=15

# The inner loop: the unit tier (no test marked slow or distributed: no training runs, served subprocesses or
# compiles); README.md gives the time it took. `make test` (and .ci/run) still run everything.
test-fast: venv
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q -m "not slow and not distributed"

lint: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: venv
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .
