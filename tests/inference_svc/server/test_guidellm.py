"""guidellm, unchanged and with its defaults (streaming chat with vLLM's `continuous_usage_stats`), against a real
`tandem serve` on loopback ports: every request completes, and the token counts guidellm read from the stream's
usage are the server's (issue 35).

guidellm is a client with heavy dependencies (its own torch, transformers, datasets), so it never enters Tandem's
venv: the test builds one venv for it under the test cache (`~/.cache/tandem-tests/guidellm-<version>`, with this
torch's CPU wheel installed first), once per machine, and skips only when the package registry cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_svc.serve_process import ServeProcess, free_port
from tests.inference_svc.server.conftest import with_chat_template

pytestmark = pytest.mark.slow  # a venv for guidellm, a served subprocess (not in make test-fast)

GUIDELLM = "guidellm==0.8.1"
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
_OFFLINE = ("Could not find a version", "No matching distribution", "Temporary failure", "Network is unreachable")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 6, 48, 12


def _guidellm() -> Path:
    base = os.environ.get("TANDEM_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tandem-tests")
    venv = Path(base) / GUIDELLM.replace("==", "-")
    exe = venv / "bin" / "guidellm"
    if exe.is_file():
        return exe
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    for what in ([f"torch=={torch.__version__.split('+')[0]}"], [GUIDELLM]):  # the local CPU wheel, then guidellm
        proc = subprocess.run([*pip, *what], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            if any(h in proc.stdout + proc.stderr for h in _OFFLINE):
                shutil.rmtree(venv, ignore_errors=True)
                pytest.skip(f"package registry unreachable, cannot install {what}: {proc.stderr.strip()[-300:]}")
            raise AssertionError(f"pip install {what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    assert exe.is_file(), f"installing {GUIDELLM} left no guidellm in {venv}"
    return exe


@pytest.fixture(scope="module")
def chat_folder(bundle_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(bundle_dir, tmp_path_factory.mktemp("guidellm") / "chat-model", TEMPLATE)


def test_guidellm_defaults_complete_every_request(chat_folder: Path, tmp_path: Path) -> None:
    exe = _guidellm()
    http = free_port()
    out = tmp_path / "guidellm.json"
    with ServeProcess(
        chat_folder, ["--http-port", str(http), "--metrics-port", "0"], log=tmp_path / "serve.log"
    ) as srv:
        srv.wait_serving(120)
        cmd = [str(exe), "run", "--backend", f"kind=openai_http,target=http://127.0.0.1:{http}",
               "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
               "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
               "--tokenizer", f"kind=hf_auto,model={chat_folder}", "--disable-progress",
               "--output", f"kind=json,path={out}"]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # never a hub: the folder is local
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    errors = [r["info"].get("error") for r in requests["errored"]]
    assert not errors and not requests["incomplete"], errors[:3]
    assert len(requests["successful"]) == REQUESTS
    for r in requests["successful"]:
        # the counts guidellm took from the stream's usage: the server's, output exactly as asked (ignore_eos)
        assert r["output_tokens"] == OUTPUT_TOKENS, r["output_tokens"]
        assert r["prompt_tokens"] >= PROMPT_TOKENS
