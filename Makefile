# The two entry points named at the top of README.md. Both create/reuse .venv and install everything first.
.PHONY: demo test lint format venv

venv:
	@bash scripts/bootstrap.sh

demo: venv
	.venv/bin/python scripts/demo.py

test: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/python -m pytest -q

lint: venv
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: venv
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .
