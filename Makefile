# The two entry points named at the top of README.md. Both create/reuse .venv and install everything first.
.PHONY: demo test test-fast lint format venv

venv:
	@bash scripts/bootstrap.sh

# The demo writes bytecode as it imports (each module compiled once, at its first import, and only what it imports),
# not the whole venv's first: scripts/bootstrap.sh, --bytecode.
demo:
	@bash scripts/bootstrap.sh --bytecode lazy
	PYTHONDONTWRITEBYTECODE= .venv/bin/python scripts/demo.py

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
