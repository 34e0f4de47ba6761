"""Tokenizer jobs for the tests: module-level, so that a tokenizer process can import them by name. This module
imports nothing heavy (a child that runs one of them loads it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from inference_svc.errors import InvalidRequestError
from shared_model.tokenizer import Tokenizer


def pid_and_priority(tokenizer: Tokenizer) -> tuple[int, int]:
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0)


def refuse(tokenizer: Tokenizer, field: str) -> None:
    raise InvalidRequestError(field, "refused in the child")


def die(tokenizer: Tokenizer) -> None:
    os._exit(3)


def hang(tokenizer: Tokenizer) -> None:
    time.sleep(600)


def wait_for_file(tokenizer: Tokenizer, path: str) -> str:
    """Hold the tokenizer until `path` exists (bounded: 60 s), so that a test can act while a job provably runs."""
    deadline = time.monotonic() + 60
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)
    return "released"


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle rebuilds exceptions from args: (a, b) is not what it saved
        super().__init__(f"{a}+{b}")


def raise_unpicklable(tokenizer: Tokenizer) -> None:
    raise Unpicklable(1, 2)


def allocate(tokenizer: Tokenizer, n: int) -> int:
    """Build a string of `n` characters (the child's memory cap refuses a large one with MemoryError)."""
    return len("x" * n)
