"""A real local stack per test module: nats-server, engine processes, router process."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import pytest

from talaria.config import parse_config
from talaria.up import LocalStack


def stack_config(models_dir, engines, kvstore: dict | None = None, **router) -> dict:
    return {
        "namespace": f"t{uuid.uuid4().hex[:8]}",
        "models_dir": str(models_dir),
        "synthesize_models": False,
        # the kvstore (host KV tier) only where a test asks for it: tests/integration/test_kvstore.py
        "kvstore": kvstore if kvstore is not None else {"enabled": False},

        "router": {"port": 0, "accept_timeout_s": 5, "idle_chunk_timeout_s": 20, "heartbeat_miss_limit": 3, **router},
        "engines": engines,
    }


def engine(eid: str, model: str, **kw) -> dict:
    # float32: these tests compare tokens and log-probabilities across paths (cached vs recomputed, streamed vs
    # not, batched vs alone); bf16 (the ``auto`` default on this CPU) rounds differently per batch shape, which
    # flips near-ties of the random-weight models. bf16 itself is checked against fp32 in test_model_parity.
    return {"id": eid, "models": [model], "heartbeat_period_s": 0.2, "kv_cache_mb": 32, "torch_threads": 1, "dtype": "float32", **kw}


def wait_until(pred, timeout: float = 20.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


def start_stack(cfg_dict) -> LocalStack:
    stack = LocalStack(parse_config(cfg_dict), say=lambda _m: None, quiet=True)
    stack.__enter__()
    # Ready = every engine has reported at least once.
    ids = {e["id"] for e in cfg_dict["engines"]}
    wait_until(lambda: ids <= {i for i, v in health(stack)["instances"].items() if v["healthy"]})
    return stack


def health(stack: LocalStack) -> dict:
    return httpx.get(f"{stack.api}/health", timeout=5).json()


@pytest.fixture(scope="module")
def models_dir(synth_models):
    return next(iter(synth_models.values())).parent


def client_for(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api}/v1", api_key="unused", max_retries=0, timeout=60)
