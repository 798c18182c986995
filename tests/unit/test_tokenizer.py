"""Tokenizer wrapper: round trips, special tokens, incremental decoding, chat templates."""

from __future__ import annotations

import json
import shutil

import pytest

from talaria.tokenizer import IncrementalDecoder, TemplateError, Tokenizer

TEXTS = [
    "Hello, world! The engine streams tokens.",
    "def add(a, b):\n    return a + b\n",
    "Größe und Maß — naïve café",
    "你好，世界！模型每一步生成一个词元。",
    "emoji: 🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷 done ✅",
    "mixed 日本語 and русский текст 🙂 end",
]


@pytest.fixture(scope="module")
def tok(synth_models) -> Tokenizer:
    return Tokenizer.from_dir(synth_models["tiny-llama"])


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_bpe_is_trained_not_bytes(tok):
    text = "The function returns the value of the argument."
    assert len(tok.encode(text)) < len(text.encode()) / 2.5


def test_special_tokens(tok):
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == 2
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[0] == 1
    assert set(tok.eos_token_ids) == {0, 2}  # tokenizer_config eos + config.json + generation_config
    assert tok.eos_token_ids[0] == 2
    assert tok.decode([1, 2], skip_special_tokens=True) == ""


def _stream(tok, ids, chunk=1, prompt=()):
    dec = IncrementalDecoder(tok, prompt_ids=prompt)
    deltas = [dec.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(dec.flush())
    return deltas, dec


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, dec = _stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == text == dec.text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_holds_back_split_characters(tok):
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "test needs an emoji that spans several byte-level tokens"
    dec = IncrementalDecoder(tok)
    assert [dec.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.step(ids[-1:]) == "🚀"
    # An incomplete character at the very end is released (as U+FFFD) only by flush().
    dec2 = IncrementalDecoder(tok)
    assert dec2.step(ids[:-1]) == ""
    assert dec2.flush() == "\ufffd" * len(tok.decode(ids[:-1]))


def test_incremental_with_prompt_context(tok):
    prompt = tok.encode("Say hi:", add_special_tokens=False)
    gen = tok.encode(" hello 世界 🚀 bye", add_special_tokens=False)
    deltas, _ = _stream(tok, gen, 1, prompt=prompt)
    assert "".join(deltas) == tok.decode(prompt + gen)[len(tok.decode(prompt)) :]


def test_chat_template(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tok.render_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert ids[: len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)


def test_chat_template_raise_exception(tok):
    with pytest.raises(TemplateError, match="Unknown message role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_chat_template_is_sandboxed(synth_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(synth_models["tiny-llama"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        Tokenizer.from_dir(d).render_chat_template([])


def test_fallback_chatml_template_and_jinja_file(synth_models, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(synth_models["tiny-qwen2"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(d)
    assert t.chat_template is None
    assert t.render_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert Tokenizer.from_dir(d).render_chat_template([{"role": "user", "content": "x"}]) == "[user]"


def test_matches_transformers_tokenizer(tok, synth_models):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(synth_models["tiny-llama"]))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂 你好"}]
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert tok.apply_chat_template(msgs) == list(ref)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
