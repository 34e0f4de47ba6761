"""Print pip's package-source settings as `uv pip install` flags, one argument per line (for scripts/bootstrap.sh).

uv does not read pip's configuration. This reads it the way pip does (`pip config list`: files and PIP_* variables,
each value printed as a Python literal) and passes on what says where packages come from: `index-url`,
`extra-index-url`, `find-links`, `no-index` and `constraint` (each may list several values, separated by spaces or
newlines). A `file://` index or a find-links folder that does not exist is left out, as pip skips it ("is neither a
file nor a directory"); uv would refuse it. Where more than one index is given, `--index-strategy
unsafe-best-match` makes uv pick the best version across them, as pip does (uv's default stops at the first index
that has the package). `cert` is printed as `SSL_CERT_FILE=PATH` for the caller to export: uv reads that variable.

Usage: python scripts/pip_settings_for_uv.py   (run with the venv's python; exits non-zero if pip cannot be asked)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def pip_settings() -> dict[str, list[str]]:
    """key -> values, over every scope pip reads (a later scope adds to an earlier one, duplicates dropped)."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    settings: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, sep, literal = line.partition("=")
        if not sep or "." not in name:
            continue
        key = name.rsplit(".", 1)[1]
        try:
            value = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            continue
        for item in str(value).split():
            if item not in settings.setdefault(key, []):
                settings[key].append(item)
    return settings


def usable(location: str) -> bool:
    """False for a local path (or file:// URL) that does not exist; remote URLs are left to uv."""
    parsed = urlparse(location)
    if parsed.scheme in ("http", "https"):
        return True
    path = Path(parsed.path) if parsed.scheme == "file" else Path(location)
    return path.exists()


def main() -> int:
    settings = pip_settings()
    args: list[str] = []
    indexes = 0
    for key, flag in FLAGS.items():
        for value in settings.get(key, []):
            if usable(value):
                args += [flag, value]
                indexes += key != "find-links"
    if any(v.lower() in ("1", "true", "yes", "on") for v in settings.get("no-index", [])):
        args.append("--no-index")
    for value in settings.get("constraint", []):
        if Path(value).is_file():
            args += ["--constraint", value]
    if indexes > 1 or (indexes == 1 and not settings.get("index-url")):
        args += ["--index-strategy", "unsafe-best-match"]  # an extra index beside PyPI, or several
    cert = next((c for c in settings.get("cert", []) if Path(c).is_file()), None)
    if cert is not None:
        args.append(f"SSL_CERT_FILE={cert}")
    print("\n".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
