"""Issue 44 item 3: stored Responses on the real stack (JetStream KV bucket, real engine processes, the
official ``openai`` client): ``store: true``, ``previous_response_id`` continuing the chain as one session
(its KV read back), ``GET`` / ``DELETE /v1/responses/{id}``, another tenant's id a 404."""

from __future__ import annotations

import openai
import pytest

from services.router.auth import key_hash
from tests.integration.conftest import engine, stack_config, start_stack

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
KEY_A, KEY_B = "sk-issue44-tenant-a-key", "sk-issue44-tenant-b-key"
INSTRUCTIONS = "You are a terse assistant that answers in one line. " * 8  # several KV pages


@pytest.fixture(scope="module")
def stack(models_dir):
    keys = [{"sha256": key_hash(KEY_A), "tenant": "a"}, {"sha256": key_hash(KEY_B), "tenant": "b"}]
    s = start_stack(stack_config(models_dir, [engine("r-0", MODEL)], max_tokens_limit=512, auth={"api_keys": keys}))
    yield s
    s.stop()


def client(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.api}/v1", api_key=key, max_retries=0, timeout=60)


def test_stored_chain_continues_as_one_session_and_is_tenant_scoped(stack):
    a, b = client(stack, KEY_A), client(stack, KEY_B)
    first = a.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS, input="Name a colour.", max_output_tokens=4, temperature=0, store=True)
    r1 = first.parse()
    assert r1.store is True and r1.id.startswith("resp_")
    got = a.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    second = a.responses.with_raw_response.create(model=MODEL, instructions=INSTRUCTIONS, previous_response_id=r1.id, input="Another one.",
                                                  max_output_tokens=4, temperature=0, store=True)
    r2 = second.parse()
    assert r2.previous_response_id == r1.id
    # the chain is one session: the return goes where its KV is and reads it (instructions + turn 1 + answer)
    assert second.headers["x-talaria-instance"] == first.headers["x-talaria-instance"]
    assert r2.usage.input_tokens_details.cached_tokens > 0 and r2.usage.input_tokens > r1.usage.input_tokens
    # the continuation holds the whole conversation: its prompt is the first one's plus the answer and the new turn
    assert r2.usage.input_tokens >= r1.usage.input_tokens + r1.usage.output_tokens

    with pytest.raises(openai.NotFoundError):  # tenant b cannot read, continue or delete tenant a's responses
        b.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError) as ei:
        b.responses.create(model=MODEL, previous_response_id=r1.id, input="x", max_output_tokens=2)
    assert ei.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        b.responses.delete(r1.id)

    a.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r1.id)
    assert a.responses.retrieve(r2.id).id == r2.id  # deleting one response leaves the rest of the chain


def test_streamed_responses_are_stored_too_and_unstored_ones_are_not(stack):
    """``store`` absent is OpenAI's default, true; ``store: false`` is not stored."""
    a = client(stack, KEY_A)
    events = list(a.responses.create(model=MODEL, input="Say hi", max_output_tokens=3, temperature=0, store=True, stream=True))
    final = events[-1].response  # response.completed, or response.incomplete at max_output_tokens
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.store is True and a.responses.retrieve(final.id).output_text == final.output_text
    plain = a.responses.create(model=MODEL, input="Say hi", max_output_tokens=2, store=False)
    assert plain.store is False
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(plain.id)
    default = a.responses.create(model=MODEL, input="Say hi", max_output_tokens=2)  # OpenAI's default: stored
    assert default.store is True and a.responses.retrieve(default.id).id == default.id


@pytest.mark.parametrize("kw,param,exc", [
    ({"store": "yes"}, "store", openai.BadRequestError),
    ({"previous_response_id": 5}, "previous_response_id", openai.BadRequestError),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", openai.NotFoundError),
])
def test_bad_store_fields_name_the_field(stack, kw, param, exc):
    with pytest.raises(exc) as ei:
        client(stack, KEY_A).responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body=kw)
    assert ei.value.body["param"] == param
