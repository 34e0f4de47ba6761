"""Run a docker-compose.yml's services as local processes (no Docker engine), to prove its commands and paths.

Contract:
- `interpolate(text, env)` substitutes variables the way Compose does: `$$` is a literal `$`; `$NAME`, `${NAME}`;
  `${NAME:-default}` / `${NAME-default}`; `${NAME:?err}` / `${NAME?err}` (raise `InterpolationError`);
  `${NAME:+alt}` / `${NAME+alt}`; defaults and alternatives may nest. An unset plain variable becomes "".
- `LocalCompose(compose_file, env, workdir)` reads the file, interpolates every value (not keys) with `env`, and
  `plan(service)` turns a service into a `ServicePlan`: the argv (image ENTRYPOINT from the service's Dockerfile,
  or `entrypoint:`, + `command:` split like a shell), the working directory and the environment.
- Each service gets its own emulated container root `workdir/<service>/root`. Named volumes, bind mounts, secrets
  and the Dockerfile's `COPY <context path> <dest>` into the final stage are symlinks inside that root; absolute
  paths in arguments (alone or after `=`) are re-rooted there; `tandem` and `python` resolve to this interpreter's
  venv; a service name used as a host (`inference:50051`) and the container wildcard `0.0.0.0` become 127.0.0.1.
  Nothing else in the command changes.
- `order(profiles)` lists the services to run in dependency order (those without `build:` — external images — are
  left out and reported by `external(profiles)`).
- `run_one_shot` / `start` / `wait_healthy` / `stop` run the plans with bounded timeouts; logs go to
  `workdir/<service>.log`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_NAME = re.compile(r"[_a-zA-Z][_a-zA-Z0-9]*")


class InterpolationError(ValueError):
    """A `${VAR?err}` / `${VAR:?err}` variable was missing, or the syntax is invalid."""


def _braced_end(text: str, start: int) -> int:
    """Index of the `}` closing the `${` that starts at `start`."""
    depth, i = 0, start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unclosed ${{ in {text!r}")


def _expand(expr: str, env: Mapping[str, str]) -> str:
    m = _NAME.match(expr)
    if m is None:
        raise InterpolationError(f"invalid variable expression ${{{expr}}}")
    name, rest = m.group(0), expr[m.end() :]
    value = env.get(name)
    if rest == "":
        return value or ""
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            present = value is not None and (value != "" or ":" not in op)
            if op.endswith("-"):
                return value if present else interpolate(arg, env)  # type: ignore[return-value]
            if op.endswith("?"):
                if not present:
                    raise InterpolationError(f"required variable {name} is missing: {interpolate(arg, env)}")
                return value  # type: ignore[return-value]
            return interpolate(arg, env) if present else ""
    raise InterpolationError(f"invalid variable expression ${{{expr}}}")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c != "$":
            out.append(c)
            i += 1
            continue
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _braced_end(text, i)
            out.append(_expand(text[i + 2 : end], env))
            i = end + 1
        else:
            m = _NAME.match(text, i + 1)
            if m is None:
                out.append("$")
                i += 1
            else:
                out.append(env.get(m.group(0)) or "")
                i = m.end()
    return "".join(out)


def interpolate_tree(obj: Any, env: Mapping[str, str]) -> Any:
    if isinstance(obj, str):
        return interpolate(obj, env)
    if isinstance(obj, list):
        return [interpolate_tree(v, env) for v in obj]
    if isinstance(obj, dict):
        return {k: interpolate_tree(v, env) for k, v in obj.items()}
    return obj


def parse_duration(text: str | int | float) -> float:
    """Compose durations: '1m30s', '500ms', '10s', '2h'."""
    if isinstance(text, (int, float)):
        return float(text)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"([0-9.]+)(ms|us|h|m|s)", text)
    if not parts or "".join(a + b for a, b in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(a) * units[b] for a, b in parts)


@dataclass(frozen=True)
class DockerfileFacts:
    """What the final stage of a Dockerfile gives a container: entrypoint, working dir, files copied from context."""

    entrypoint: list[str]
    workdir: str
    copies: list[tuple[str, str]]


def read_dockerfile(path: Path) -> DockerfileFacts:
    lines = path.read_text().replace("\\\n", " ").splitlines()
    stage: list[str] = []
    for line in lines:
        if re.match(r"\s*FROM\s", line, re.I):
            stage = []
        stage.append(line)
    entrypoint: list[str] = []
    workdir = "/"
    copies: list[tuple[str, str]] = []
    for line in stage:
        words = line.split()
        if not words:
            continue
        instr = words[0].upper()
        if instr == "ENTRYPOINT":
            entrypoint = json.loads(line.split(None, 1)[1])
        elif instr == "WORKDIR":
            workdir = words[1]
        elif instr == "COPY" and not any(w.startswith("--from") for w in words):
            args = [w for w in words[1:] if not w.startswith("--")]
            copies += [(src, args[-1]) for src in args[:-1]]
    return DockerfileFacts(entrypoint, workdir, copies)


@dataclass
class ServicePlan:
    name: str
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    root: Path
    healthcheck: list[str] | None = None
    health_budget_s: float = 60.0
    stop_grace_s: float = 10.0
    depends_on: dict[str, str] = field(default_factory=dict)


class LocalCompose:
    def __init__(self, compose_file: Path, env: Mapping[str, str], workdir: Path) -> None:
        self.file = compose_file.resolve()
        self.project_dir = self.file.parent
        self.raw = yaml.safe_load(self.file.read_text())
        self.env = dict(env)
        self.config = interpolate_tree(self.raw, self.env)
        self.workdir = workdir
        self.bin_dir = Path(sys.executable).parent
        self.procs: dict[str, subprocess.Popen] = {}

    # -------------------------------------------------------------- reading
    def services(self, profiles: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
        return {
            name: svc
            for name, svc in self.config["services"].items()
            if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)
        }

    def external(self, profiles: tuple[str, ...] = ()) -> list[str]:
        return [n for n, s in self.services(profiles).items() if "build" not in s]

    def order(self, profiles: tuple[str, ...] = ()) -> list[str]:
        svcs = {n: s for n, s in self.services(profiles).items() if "build" in s}
        done: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in done:
                return
            if name in path:
                raise ValueError(f"dependency cycle: {' -> '.join((*path, name))}")
            for dep in _depends(svcs[name]):
                if dep in svcs:
                    visit(dep, (*path, name))
            done.append(name)

        for name in svcs:
            visit(name, ())
        return done

    # -------------------------------------------------------------- planning
    def _link(self, root: Path, target: str, source: Path) -> None:
        link = root / target.lstrip("/")
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists() and not link.is_symlink():
            link.symlink_to(source)

    def plan(self, name: str) -> ServicePlan:
        svc = self.config["services"][name]
        root = self.workdir / name / "root"
        root.mkdir(parents=True, exist_ok=True)
        build = svc["build"]
        facts = read_dockerfile(self.project_dir / build.get("context", ".") / build["dockerfile"])
        context = (self.project_dir / build.get("context", ".")).resolve()
        for src, dest in facts.copies:
            if dest.startswith("/") and not dest.endswith("/") and (context / src).is_dir():
                self._link(root, dest, context / src)
        for vol in svc.get("volumes", []):
            source, target = vol.split(":")[:2]
            if source.startswith((".", "/")):
                host = (self.project_dir / source).resolve()
                host.mkdir(parents=True, exist_ok=True)
            else:
                host = self.workdir / "volumes" / source
                host.mkdir(parents=True, exist_ok=True)
            self._link(root, target, host)
        for secret in svc.get("secrets", []):
            secret_file = self.config["secrets"][secret]["file"]
            self._link(root, f"/run/secrets/{secret}", (self.project_dir / secret_file).resolve())
        workdir = svc.get("working_dir", facts.workdir)
        cwd = root / workdir.lstrip("/")
        cwd.mkdir(parents=True, exist_ok=True)
        entry = svc.get("entrypoint", facts.entrypoint)
        entry = shlex.split(entry) if isinstance(entry, str) else list(entry)
        command = svc.get("command", [])
        command = shlex.split(command) if isinstance(command, str) else list(command)
        argv = [self._map_arg(a, root) for a in entry + command]
        argv[0] = self._resolve_program(argv[0])
        env = dict(os.environ)
        environment = svc.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.split("=", 1) for item in environment)
        env.update({k: str(v) for k, v in environment.items()})
        health = svc.get("healthcheck")
        check = None
        budget = 60.0
        if health and not health.get("disable"):
            test = health["test"]
            assert test[0] in ("CMD", "CMD-SHELL"), test
            check = [self._map_arg(a, root) for a in test[1:]]
            check[0] = self._resolve_program(check[0])
            interval = parse_duration(health.get("interval", "30s"))
            budget = parse_duration(health.get("start_period", "0s")) + interval * int(health.get("retries", 3))
        return ServicePlan(
            name,
            argv,
            cwd,
            env,
            root,
            healthcheck=check,
            health_budget_s=budget,
            stop_grace_s=parse_duration(svc.get("stop_grace_period", "10s")),
            depends_on=_depends(svc),
        )

    def _resolve_program(self, program: str) -> str:
        if program in ("python", "python3"):
            return sys.executable
        local = self.bin_dir / program
        return str(local) if local.exists() else program

    def _map_arg(self, arg: str, root: Path) -> str:
        if arg == "0.0.0.0":
            return "127.0.0.1"
        for svc in self.config["services"]:
            arg = re.sub(rf"(?<![\w.-]){re.escape(svc)}(?=:\d)", "127.0.0.1", arg)
        return re.sub(r"(^|=)(/\S*)", lambda m: m.group(1) + str(root) + m.group(2), arg)

    # -------------------------------------------------------------- running
    def _log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def run_one_shot(self, plan: ServicePlan, timeout: float) -> subprocess.CompletedProcess:
        with self._log(plan.name).open("w") as log:
            proc = subprocess.run(
                plan.argv, cwd=plan.cwd, env=plan.env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        return subprocess.CompletedProcess(plan.argv, proc.returncode, self._log(plan.name).read_text(), "")

    def start(self, plan: ServicePlan) -> subprocess.Popen:
        log = self._log(plan.name).open("w")
        proc = subprocess.Popen(plan.argv, cwd=plan.cwd, env=plan.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs[plan.name] = proc
        return proc

    def wait_healthy(self, plan: ServicePlan, limit: float) -> float:
        """Run the healthcheck until it passes; return seconds waited. Raises TimeoutError or RuntimeError."""
        assert plan.healthcheck is not None
        t0 = time.monotonic()
        deadline = t0 + min(limit, plan.health_budget_s)
        while time.monotonic() < deadline:
            proc = self.procs.get(plan.name)
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{plan.name} exited with {proc.returncode} before it was healthy")
            rc = subprocess.run(plan.healthcheck, env=plan.env, capture_output=True, timeout=30).returncode
            if rc == 0:
                return time.monotonic() - t0
            time.sleep(0.5)
        raise TimeoutError(f"{plan.name} was not healthy within {min(limit, plan.health_budget_s):.0f} s")

    def stop(self, plan: ServicePlan) -> int | None:
        """SIGTERM (compose's stop_signal), wait stop_grace_period, then SIGKILL; the exit code."""
        proc = self.procs.pop(plan.name, None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(plan.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
                return None
        return proc.returncode

    def log(self, name: str) -> str:
        path = self._log(name)
        return path.read_text() if path.exists() else ""


def _depends(svc: dict[str, Any]) -> dict[str, str]:
    deps = svc.get("depends_on", {})
    if isinstance(deps, list):
        return dict.fromkeys(deps, "service_started")
    return {k: (v or {}).get("condition", "service_started") for k, v in deps.items()}
