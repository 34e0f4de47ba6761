"""A request whose logits are not finite fails alone over gRPC: INTERNAL for it, one log line in all, and the
requests beside it finish exactly as they would alone."""

from __future__ import annotations

import logging
import math
import threading

import grpc
import pytest
import torch

from tests.inference_svc.server.conftest import make_server

POISON = 300  # a token whose embedding row is NaN: every sequence that reads it gets NaN logits


def test_nan_logits_fail_one_request_with_one_log_line(bundle_dir, caplog) -> None:
    srv = make_server(bundle_dir)
    try:
        with srv.client(timeout=60) as c:
            alone = c.generate([5, 6, 7, 8], max_new_tokens=8, ignore_eos=True)
            engine = srv.server.engine
            assert engine is not None
            with torch.no_grad():
                engine.engine.runner.model.embed_tokens.weight[POISON] = math.nan
            results: dict[str, object] = {}

            def bystander() -> None:
                results["bystander"] = c.generate([5, 6, 7, 8], max_new_tokens=8, ignore_eos=True)

            caplog.clear()
            with caplog.at_level(logging.WARNING):
                t = threading.Thread(target=bystander)
                t.start()
                with pytest.raises(grpc.RpcError) as info:
                    c.generate([5, POISON, 7], request_id="poisoned", max_new_tokens=8, ignore_eos=True)
                t.join(60)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "non-finite logits" in info.value.details()
            assert list(results["bystander"].token_ids) == list(alone.token_ids)  # type: ignore[attr-defined]
            errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert [r.getMessage() for r in errors] == [
                "request poisoned: the model's logits are not finite; failing it alone"
            ]
            assert errors[0].exc_info is None
            assert c.health() == "SERVING"
    finally:
        srv.close()
