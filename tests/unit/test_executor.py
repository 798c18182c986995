"""Executor end-to-end on the tiny synthesized models (CPU, float32, short outputs)."""

from __future__ import annotations

import pytest
import torch

from services.engine.executor import (
    ContextLengthError,
    DuplicateRequestError,
    EmptyPromptError,
    Engine,
    InvalidSamplingError,
)
from services.engine.types import EngineRequest, FinishReason, SamplingParams
from tests.unit.engine_fixtures import one_thread  # noqa: F401 - autouse fixture

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PAGE = 4


def make_engine(path, **kw):
    kw.setdefault("page_size", PAGE)
    kw.setdefault("num_pages", 256)
    return Engine(path, **kw)


def prompts(engine, n=8):
    texts = [f"request {i}: the quick brown fox {'jumps ' * i}over the lazy dog" for i in range(n)]
    return [engine.tokenizer.encode(t) for t in texts]


def run(engine, req: EngineRequest):
    """Run one request to completion; returns (token ids, text, final RequestOutput)."""
    engine.add_request(req)
    toks, text, final = [], "", None
    while final is None:
        for out in engine.step():
            assert out.request_id == req.request_id
            toks += out.new_token_ids
            text += out.new_text
            if out.finished:
                final = out
    engine.check_integrity()
    return toks, text, final


@pytest.fixture(scope="module")
def llama(synth_models):
    return synth_models["tiny-llama"]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_lone_prefill_in_one_step_gives_the_chunked_tokens(synth_models, name):
    """A step with nothing decoding prefills a long prompt in one chunk (``lone_prefill_tokens``): same greedy
    tokens as in 12-token chunks, in fewer steps."""
    chunked = make_engine(synth_models[name], max_num_batched_tokens=12)
    lone = make_engine(synth_models[name], max_num_batched_tokens=12, lone_prefill_tokens=256)
    ps = prompts(chunked)
    long = [t for p in ps for t in p][:90]
    runs = {}
    for label, eng in (("chunked", chunked), ("lone", lone)):
        before = eng.stats().num_steps
        got = eng.generate([long], GREEDY)
        runs[label] = (eng.stats().num_steps - before, got)
    assert runs["lone"][1] == runs["chunked"][1]
    assert runs["lone"][0] == GREEDY.max_tokens and runs["chunked"][0] == GREEDY.max_tokens + 7  # 90 tokens: 8 chunks of 12
    # the batched mix of prompts is identical too (later prompts arrive while others decode: normal chunks)
    assert lone.generate(ps, GREEDY) == chunked.generate(ps, GREEDY)
    lone.check_integrity()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_batched_equals_unbatched_greedy(synth_models, name):
    # small token budget: the batched run also exercises chunked prefill mixed with decodes
    batched_engine = make_engine(synth_models[name], max_num_batched_tokens=24)
    ps = prompts(batched_engine)
    assert len({len(p) for p in ps}) > 1
    batched = batched_engine.generate(ps, GREEDY)
    single_engine = make_engine(synth_models[name])
    single = []
    for p in ps:
        single += single_engine.generate([p], GREEDY)
        single_engine.flush_cache()  # no prefix sharing between the one-by-one runs
    assert batched == single
    assert all(len(t) == GREEDY.max_tokens for t in batched)
    assert len({tuple(t) for t in batched}) > 1  # not a degenerate model
    batched_engine.check_integrity()


def test_calls_arriving_together_compute_their_shared_prefix_once(llama):
    """Issue 42 item 2: six calls behind one ~40-token "system prompt", added together, compute it once: the
    first is admitted, the others wait for its forward and reuse its pages; greedy tokens are those of each
    call run alone on a fresh engine."""
    e = make_engine(llama, max_num_batched_tokens=512)
    system = e.tokenizer.encode("you are a careful agent; answer briefly and call tools when they help " * 2)
    ps = [system + e.tokenizer.encode(f" task {i}: list the files of directory {i}") for i in range(6)]
    shared = (len(system) // PAGE) * PAGE
    for i, p in enumerate(ps):
        e.add_request(EngineRequest(f"r{i}", p, GREEDY))
    finals, toks = {}, {f"r{i}": [] for i in range(6)}
    while e.has_unfinished():
        for out in e.step():
            toks[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    e.check_integrity()
    assert finals["r0"].usage.cached_tokens == 0
    assert all(finals[f"r{i}"].usage.cached_tokens >= shared for i in range(1, 6))
    alone = make_engine(llama)
    for i, p in enumerate(ps):
        assert toks[f"r{i}"] == alone.generate([p], GREEDY)[0]
        alone.flush_cache()


def test_prefix_hit_same_prompt_and_full_prompt_cached(llama):
    e = make_engine(llama)
    p = prompts(e, 1)[0]
    p = p[: (len(p) // PAGE) * PAGE]  # page-aligned: the second run has the *whole* prompt cached
    cold_toks, _, cold = run(make_engine(llama), EngineRequest("cold", p, GREEDY))
    toks1, _, out1 = run(e, EngineRequest("a", p, GREEDY))
    toks2, _, out2 = run(e, EngineRequest("b", p, GREEDY))
    assert toks1 == cold_toks and toks2 == cold_toks
    assert out1.usage.cached_tokens == 0
    assert out2.usage.cached_tokens == len(p) - 1  # last token recomputed into a private copy
    # a longer prompt sharing the prefix: the full pages are served from the radix cache
    longer = p + e.tokenizer.encode(" and then some more words")
    cold_long, _, _ = run(make_engine(llama), EngineRequest("cold2", longer, GREEDY))
    toks3, _, out3 = run(e, EngineRequest("c", longer, GREEDY))
    assert toks3 == cold_long
    assert out3.usage.cached_tokens >= len(p)
    assert e.stats().prefix_hit_rate > 0


def test_session_second_call_reuses_committed_kv(llama):
    e = make_engine(llama)
    p1 = e.tokenizer.encode("user: list the files in the current directory")
    toks1, _, out1 = run(e, EngineRequest("t1", p1, GREEDY, session_id="S"))
    info = e.session_info("S")
    assert info is not None and info.where == "device" and info.committed_tokens == len(p1) + len(toks1) - 1
    p2 = p1 + toks1 + e.tokenizer.encode(" tool: a.txt b.txt")
    cold, _, _ = run(make_engine(llama), EngineRequest("cold", p2, GREEDY))
    toks2, _, out2 = run(e, EngineRequest("t2", p2, GREEDY, session_id="S"))
    assert toks2 == cold
    assert out2.usage.cached_tokens == len(p1) + len(toks1) - 1
    assert e.session_info("S").committed_tokens == len(p2) + len(toks2) - 1
    # a third call that diverges inside a page of the committed tokens (edit of the last turn)
    cut = len(p2) - 3
    p3 = p2[:cut] + e.tokenizer.encode(" tool: c.txt")
    cold3, _, _ = run(make_engine(llama), EngineRequest("cold3", p3, GREEDY))
    shared = {pg: e.kv_cache.k[0][pg * PAGE : (pg + 1) * PAGE].clone() for pg in e.kv.radix.pages()}
    toks3, _, out3 = run(e, EngineRequest("t3", p3, GREEDY, session_id="S"))
    for pg, rows in shared.items():  # copy-on-write: pages shared with the radix cache are never written
        assert torch.equal(e.kv_cache.k[0][pg * PAGE : (pg + 1) * PAGE], rows), f"shared page {pg} was written"
    assert toks3 == cold3
    assert out3.usage.cached_tokens >= cut
    # the diverging call must not have written into pages it shared with the radix cache
    toks4, _, out4 = run(e, EngineRequest("t4", p2, GREEDY))
    assert toks4 == cold and out4.usage.cached_tokens >= cut - cut % PAGE
    st = e.stats()
    assert [s.session_id for s in st.sessions] == ["S"]


def test_seeded_sampling_reproducible(llama):
    e = make_engine(llama)
    p = prompts(e, 1)[0]

    def sample(seed, rid):
        sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=12, ignore_eos=True)
        return run(e, EngineRequest(rid, p, sp))[0]

    a, b, c = sample(7, "a"), sample(7, "b"), sample(8, "c")
    assert a == b
    assert a != c
    # batched with other requests: still the same tokens
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=7, max_tokens=12, ignore_eos=True)
    others = prompts(e, 4)[1:]
    res = e.generate([p] + others, [sp] + [GREEDY] * 3)
    assert res[0] == a


def test_stop_string_truncates_and_streams_consistently(llama):
    e = make_engine(llama)
    p = prompts(e, 1)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    toks, text, final = run(e, EngineRequest("full", p, sp))
    assert final.finish_reason == FinishReason.LENGTH
    assert text == e.tokenizer.decode(toks)
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expect = text[: text.index(stop)]
    toks2, text2, final2 = run(e, EngineRequest("stop", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=(stop,))))
    assert final2.finish_reason == FinishReason.STOP
    assert text2 == expect
    assert toks2 == toks[: len(toks2)] and len(toks2) < len(toks)


def test_stop_token_and_ignore_eos(llama):
    e = make_engine(llama)
    p = prompts(e, 1)[0]
    toks, _, final = run(e, EngineRequest("a", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    assert len(toks) == 10 and final.usage.completion_tokens == 10
    assert final.finish_reason == FinishReason.LENGTH and final.usage.prompt_tokens == len(p)
    third = toks[2]
    toks2, _, final2 = run(e, EngineRequest("b", p, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(third,))))
    assert toks2 == toks[: toks.index(third) + 1] and final2.finish_reason == FinishReason.STOP
    # EOS ends a request unless ignore_eos: make the model's EOS the token it will emit
    e.outputs.eos_token_ids = frozenset({toks[0]})
    toks3, _, final3 = run(e, EngineRequest("c", p, SamplingParams(temperature=0.0, max_tokens=10)))
    assert toks3 == toks[:1] and final3.finish_reason == FinishReason.STOP
    toks4, _, _ = run(e, EngineRequest("d", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    assert toks4 == toks


def test_kv_pressure_preemption_matches_unpressured(llama):
    ref_engine = make_engine(llama)
    ps = prompts(ref_engine)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = ref_engine.generate(ps, sp)
    # longest request needs ceil((prompt + 10) / 4) pages; the pool is barely above that
    need = max(-(-(len(p) + sp.max_tokens) // PAGE) for p in ps)
    tight = make_engine(llama, num_pages=need + 2)
    # a cached session entry and radix pages that must be evicted first
    run(tight, EngineRequest("warm", ps[0][:8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), session_id="S"))
    assert tight.stats().session_pages > 0
    out = tight.generate(ps, sp)
    assert out == ref
    st = tight.stats()
    assert st.num_preemptions > 0
    assert st.session_pages == 0
    tight.check_integrity()


def test_intake_validation(llama):
    e = make_engine(llama, num_pages=16)  # 64-token pool caps the context
    assert e.max_context == 64
    with pytest.raises(EmptyPromptError):
        e.add_request(EngineRequest("a", []))
    with pytest.raises(InvalidSamplingError):
        e.add_request(EngineRequest("a", [5], SamplingParams(max_tokens=0)))
    with pytest.raises(ContextLengthError) as ei:
        e.add_request(EngineRequest("a", [5] * 60, SamplingParams(max_tokens=5)))
    assert "60" in str(ei.value) and "64" in str(ei.value) and isinstance(ei.value, ValueError)
    e.add_request(EngineRequest("a", [5] * 59, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    with pytest.raises(DuplicateRequestError):
        e.add_request(EngineRequest("a", [5]))
    toks = []
    while e.has_unfinished():
        for o in e.step():
            toks += o.new_token_ids
    assert len(toks) == 5


def test_abort_releases_everything(llama):
    e = make_engine(llama)
    p = prompts(e, 2)
    e.add_request(EngineRequest("a", p[0], GREEDY))
    e.add_request(EngineRequest("b", p[1], GREEDY))
    e.step()
    e.abort("a")
    e.abort("b")
    e.abort("unknown")
    outs = e.step()
    assert sorted(o.request_id for o in outs) == ["a", "b"]
    assert all(o.finished and o.finish_reason == FinishReason.ABORT for o in outs)
    assert not e.has_unfinished()
    st = e.stats()
    assert st.num_running == 0 and st.kv_pages_free == st.kv_pages_total - st.radix_pages
    e.flush_cache()
    assert e.stats().kv_pages_free == st.kv_pages_total
    e.check_integrity()


def test_stop_string_buffer_holds_back_partial_matches():
    from services.engine.output_processor import StopStringBuffer

    b = StopStringBuffer(("</tool>", "STOP"))
    assert b.feed("hello <") == ("hello ", False)  # "<" may start "</tool>"
    assert b.feed("/to") == ("", False)
    assert b.feed("p> x") == ("</top> x", False)  # not a stop after all: released
    assert b.feed(" ST") == (" ", False)
    assert b.feed("OP and more") == ("", True)  # completes "STOP": truncated before it
    assert b.text == "hello </top> x "
    b2 = StopStringBuffer(("ab",))
    assert b2.feed("xa", final=True) == ("xa", False)  # final: nothing held back
    assert StopStringBuffer().feed("anything") == ("anything", False)


def test_intake_from_another_thread(llama):
    import threading

    e = make_engine(llama)
    ps = prompts(e, 6)
    ref = make_engine(llama).generate(ps, GREEDY)

    def producer():
        for i, p in enumerate(ps):
            e.add_request(EngineRequest(f"t{i}", p, GREEDY))

    th = threading.Thread(target=producer)
    th.start()
    got: dict[str, list[int]] = {f"t{i}": [] for i in range(len(ps))}
    done = 0
    while done < len(ps):
        for o in e.step():
            got[o.request_id] += o.new_token_ids
            done += o.finished
        e.stats()  # readable at any time
    th.join()
    assert [got[f"t{i}"] for i in range(len(ps))] == ref
    st = e.stats()
    assert st.tokens_generated == len(ps) * GREEDY.max_tokens and st.num_unfinished == 0
