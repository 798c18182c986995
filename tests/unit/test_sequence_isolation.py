"""Issue 18 (1): a failure in one sequence's sampling, stop handling or detokenizing ends that sequence only;
tiny temperatures behave as greedy. Real tiny model on CPU; the two injected failures stand for bugs that no
valid request can trigger any more (the one that could — temperature 1e-45 — is the first test)."""

from __future__ import annotations

import pytest

from services.engine.executor import Engine
from services.engine.sampling import Sampler
from services.engine.types import EngineRequest, FinishReason, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(synth_models):
    return synth_models["tiny-llama"]


def make(model_dir) -> Engine:
    return Engine(model_dir, page_size=4, num_pages=256)


def prompts(n: int = 6) -> list[list[int]]:
    return [[5 + i, 17, 42 + i, 99, 7 * i + 3] for i in range(n)]


def run_all(eng: Engine, reqs: list[EngineRequest]) -> dict[str, tuple[list[int], object]]:
    """Run every request to completion; request id -> (tokens, final output)."""
    for r in reqs:
        eng.add_request(r)
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    final: dict[str, object] = {}
    while len(final) < len(reqs):
        for o in eng.step():  # a step that raises fails the test: that was the bug
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o
    eng.check_integrity()
    return {rid: (toks[rid], final[rid]) for rid in toks}


def batch(sps: list[SamplingParams]) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts(len(sps)), sps))]


def test_denormal_temperature_is_greedy_and_disturbs_no_one(model_dir):
    sps = [SAMPLED, GREEDY, SAMPLED, GREEDY, SAMPLED]
    clean = run_all(make(model_dir), batch(sps))
    tiny = SamplingParams(temperature=1e-45, max_tokens=6, ignore_eos=True)
    got = run_all(make(model_dir), batch(sps + [tiny]))
    assert tiny.greedy
    greedy_alone = run_all(make(model_dir), [EngineRequest("r5", prompts(6)[5], GREEDY)])
    assert got["r5"][0] == greedy_alone["r5"][0] and got["r5"][1].finish_reason == FinishReason.LENGTH
    for rid, (toks, out) in clean.items():
        assert got[rid][0] == toks and got[rid][1].finish_reason == out.finish_reason and not got[rid][1].error


class _FailsFor(Sampler):
    """A sampler with a bug that only one request's rows hit."""

    def __init__(self, bad: str) -> None:
        super().__init__("cpu")
        self.bad = bad

    def sample(self, logits, request_ids, params):
        if self.bad in request_ids:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return super().sample(logits, request_ids, params)


def test_sampling_failure_ends_only_its_sequence(model_dir):
    sps = [SAMPLED, GREEDY, SAMPLED, GREEDY]
    clean = run_all(make(model_dir), batch(sps))
    eng = make(model_dir)
    eng.outputs.sampler = _FailsFor("r2")
    got = run_all(eng, batch(sps))
    assert got["r2"][1].finish_reason == FinishReason.ERROR and "inf, nan" in got["r2"][1].error
    for rid in ("r0", "r1", "r3"):
        assert got[rid][0] == clean[rid][0] and got[rid][1].finish_reason == FinishReason.LENGTH and not got[rid][1].error
    assert not eng.has_unfinished()


def test_detokenizer_failure_ends_only_its_sequence(model_dir):
    sps = [GREEDY] * 4
    clean = run_all(make(model_dir), batch(sps))
    eng = make(model_dir)
    reqs = batch(sps)
    for r in reqs:
        eng.add_request(r)
    toks: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    final = {}
    outs = eng.step()  # intake and the first token: the request states exist now

    def broken(_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    eng.outputs.requests["r1"].decoder.step = broken  # a detokenizer bug hit by one sequence
    while len(final) < len(reqs):
        for o in outs:
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                final[o.request_id] = o
        outs = eng.step()
    assert final["r1"].finish_reason == FinishReason.ERROR and "UnicodeDecodeError" in final["r1"].error
    for rid in ("r0", "r2", "r3"):
        assert toks[rid] == clean[rid][0] and final[rid].finish_reason == FinishReason.LENGTH
    eng.check_integrity()
    assert not eng.has_unfinished()
