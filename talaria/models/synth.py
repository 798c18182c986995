"""Synthesize small random-weight Hugging Face checkpoints (Llama / Qwen2 / Qwen3 / Mistral) with a real,
freshly trained byte-level BPE tokenizer.

Everything is a pure function of ``seed`` and the running Python's standard library (the tokenizer corpus
is built from docstrings and sources of a fixed list of stdlib modules plus a small embedded multilingual
text), so two calls with the same seed in the same environment write byte-identical files.

Weights are float32. Initialisation is chosen so that random models are *not* degenerate: embeddings have
a larger scale than the residual updates (greedy decoding depends on the current token rather than
collapsing onto one token), q/k projections are larger than the rest (attention is far from uniform, so
position/mask bugs show up in parity tests), and norm weights / biases are random rather than 1 / 0 (so a
parameter that is silently not loaded changes the output).
"""

from __future__ import annotations

import importlib
import inspect
import json
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
VOCAB_SIZE = 4096

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown message role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None  # None => hidden_size // num_attention_heads (not written to config)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    extra: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


MODEL_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "tiny-llama", "LlamaForCausalLM", "llama", 256, 4, 8, 2, 512,
            rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128},
            rms_norm_eps=1e-5,
            extra={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
            description="Llama, GQA 8/2, llama3 rope scaling",
        ),
        ModelSpec(
            "tiny-qwen2", "Qwen2ForCausalLM", "qwen2", 256, 4, 8, 2, 512,
            tie_word_embeddings=True, qkv_bias=True, rope_theta=1000000.0,
            extra={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 4},
            description="Qwen2, q/k/v bias, tied embeddings",
        ),
        ModelSpec(
            "tiny-qwen3", "Qwen3ForCausalLM", "qwen3", 256, 4, 8, 4, 512,
            head_dim=48, qk_norm=True, rope_theta=1000000.0,
            extra={"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                   "max_window_layers": 4},
            description="Qwen3, q/k norm, head_dim 48 != 256/8",
        ),
        ModelSpec(
            "tiny-mistral", "MistralForCausalLM", "mistral", 256, 4, 8, 4, 512,
            rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
            rms_norm_eps=1e-5, extra={"sliding_window": None},
            description="Mistral, linear rope scaling",
        ),
        ModelSpec(
            "small-llama", "LlamaForCausalLM", "llama", 512, 8, 8, 2, 1536,
            rope_theta=500000.0, rms_norm_eps=1e-5,
            extra={"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
            description="Llama, 8 layers, hidden 512 (benchmarks)",
        ),
    )
}
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")

# --------------------------------------------------------------------------------------------- corpus

_CORPUS_DOC_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "functools", "glob", "hashlib",
    "heapq", "http.client", "itertools", "json", "logging", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tempfile", "textwrap",
    "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)
_CORPUS_SOURCE_MODULES = ("textwrap", "heapq", "bisect", "string", "fractions", "glob", "shlex", "colorsys")

# Written for this project: a little non-ASCII text so that multibyte characters get merged tokens.
_EMBEDDED_TEXT = """\
The engine streams tokens to the router, which forwards them to the client as server-sent events.
Une requête peut être annulée à tout moment ; le moteur libère alors ses pages de cache.
Die Anfrage wird abgebrochen, sobald der Client die Verbindung schließt. Größe, Übergröße, Maß.
El modelo genera texto paso a paso; cada paso añade un token por secuencia. ¿Listo? ¡Sí!
Модель генерирует текст по одному токену за шаг. Привет, мир!
模型每一步为每个序列生成一个词元。你好，世界！缓存命中率很高。
モデルは一度に一つのトークンを生成します。こんにちは、世界！
모델은 한 번에 하나의 토큰을 생성합니다. 안녕하세요!
Status: ✅ done, ⚠️ warning, ❌ failed, 🚀 launched, 🙂 ok, 👍 thanks, 🔥 hot path, ≤ ≥ ≠ → ← ∑ π ∞ °C €5 £3 ¥100
"""


def _chat_samples() -> str:
    turns = []
    for i, (q, a) in enumerate(
        [
            ("What is the capital of France?", "The capital of France is Paris."),
            ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
            ("Call the weather tool for Berlin.", '{"name": "get_weather", "arguments": {"city": "Berlin"}}'),
            ("Summarize the log output.", "The service started, handled 12 requests and shut down cleanly."),
        ]
    ):
        turns.append(
            f"<|im_start|>system\nYou are a helpful assistant #{i}.<|im_end|>\n"
            f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n<|endoftext|>"
        )
    return "\n".join(turns)


def build_corpus() -> list[str]:
    """Deterministic list of text chunks (docstrings, some stdlib source, embedded text, chat samples)."""
    chunks: list[str] = []
    for name in _CORPUS_DOC_MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            chunks.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated aliases such as typing.io
                obj = getattr(mod, attr)
                doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and doc.strip() and getattr(obj, "__module__", None) == mod.__name__:
                chunks.append(inspect.cleandoc(doc))
    for name in _CORPUS_SOURCE_MODULES:
        chunks.append(inspect.getsource(importlib.import_module(name)))
    chunks.extend([_EMBEDDED_TEXT] * 20)
    chunks.extend([_chat_samples()] * 20)
    return chunks


def train_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with the ChatML special tokens at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


# --------------------------------------------------------------------------------------------- weights


def tensor_shapes(spec: ModelSpec, vocab_size: int = VOCAB_SIZE) -> list[tuple[str, tuple[int, ...], str]]:
    """``(hf_name, shape, kind)`` for every tensor of the checkpoint, in a fixed order."""
    h, hd = spec.hidden_size, spec.hd
    q, kvs = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab_size, h), "embed")]
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (q, h), "qk"),
            (p + "self_attn.k_proj.weight", (kvs, h), "qk"),
            (p + "self_attn.v_proj.weight", (kvs, h), "linear"),
        ]
        if spec.qkv_bias:
            out += [
                (p + "self_attn.q_proj.bias", (q,), "bias"),
                (p + "self_attn.k_proj.bias", (kvs,), "bias"),
                (p + "self_attn.v_proj.bias", (kvs,), "bias"),
            ]
        if spec.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,), "norm"), (p + "self_attn.k_norm.weight", (hd,), "norm")]
        out += [
            (p + "self_attn.o_proj.weight", (h, q), "linear"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (spec.intermediate_size, h), "linear"),
            (p + "mlp.up_proj.weight", (spec.intermediate_size, h), "linear"),
            (p + "mlp.down_proj.weight", (h, spec.intermediate_size), "linear"),
        ]
    out.append(("model.norm.weight", (h,), "norm"))
    if not spec.tie_word_embeddings:
        out.append(("lm_head.weight", (vocab_size, h), "head"))
    return out


_STD = {"embed": 0.5, "qk": 0.08, "linear": 0.02, "bias": 0.02, "head": 0.05}
# With tied embeddings a large embedding scale makes every token predict itself (logits = E . norm(e));
# keep the embedding small there and the layers' (token- and context-dependent) updates larger.
_TIED_STD = {**_STD, "embed": 0.02, "linear": 0.05}


def make_weights(spec: ModelSpec, seed: int, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % (2**63))
    stds = _TIED_STD if spec.tie_word_embeddings else _STD
    tensors = {}
    for name, shape, kind in tensor_shapes(spec, vocab_size):
        t = torch.randn(shape, generator=gen, dtype=torch.float32)
        if kind == "norm":
            t = 1.0 + 0.1 * t
        else:
            t = t * stds[kind]
        tensors[name] = t.contiguous()
    return tensors


def make_config(spec: ModelSpec, vocab_size: int = VOCAB_SIZE) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if spec.head_dim is not None:
        cfg["head_dim"] = spec.head_dim
    if spec.rope_scaling is not None:
        cfg["rope_scaling"] = dict(spec.rope_scaling)
    cfg.update(spec.extra)
    return cfg


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }


def _dump_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def synthesize(out_dir: str | Path, seed: int = 0, names: list[str] | tuple[str, ...] | None = None) -> list[Path]:
    """Write one checkpoint directory per model name under ``out_dir``; return their paths (in order).

    ``names`` defaults to every model in :data:`MODEL_SPECS`. The tokenizer is trained once and shared.
    """
    from safetensors.torch import save_file

    names = list(names) if names else list(MODEL_SPECS)
    unknown = [n for n in names if n not in MODEL_SPECS]
    if unknown:
        raise ValueError(f"unknown model name(s) {unknown}; known: {sorted(MODEL_SPECS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = train_tokenizer().to_str(pretty=True)
    written = []
    for name in names:
        spec = MODEL_SPECS[name]
        d = out / name
        d.mkdir(parents=True, exist_ok=True)
        _dump_json(d / "config.json", make_config(spec))
        _dump_json(
            d / "generation_config.json",
            {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID},
        )
        (d / "tokenizer.json").write_text(tok_json, encoding="utf-8")
        _dump_json(d / "tokenizer_config.json", _tokenizer_config())
        save_file(make_weights(spec, seed), str(d / "model.safetensors"), metadata={"format": "pt"})
        written.append(d)
    return written


# --------------------------------------------------------------------------------------- scripted models

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# The default script (every token once with the synth tokenizer of any seed: the tokenizer does not depend on it).
SCRIPT_REASONING, SCRIPT_CONTENT = "A greeting: reply in kind.", "Hello there, friend!"

# A reasoning model's chat template (DeepSeek-R1 / newer Qwen style): the generation prompt opens the
# reasoning, so the output starts inside it; ``enable_thinking: false`` (Qwen3's switch) closes it at once.
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown message role: ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think></think>' }}"
    "{%- else %}{{- '<think>' }}{%- endif %}{%- endif %}"
)

SCRIPTED_SPEC = ModelSpec(
    "tiny-think", "Qwen3ForCausalLM", "qwen3", 256, 2, 8, 4, 512,
    head_dim=32, qk_norm=True, rope_theta=1000000.0,
    extra={"attention_bias": False, "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2},
    description="Qwen3 with a thinking template; greedy output follows a fixed token script",
)


def _token_id(tok: Tokenizer, text: str) -> int:
    """The id of ``text``, a token of ``tok``'s vocabulary (KeyError when it is not one)."""
    i = tok.token_to_id(text)
    if i is None:
        raise KeyError(f"{text!r} is not a token of this tokenizer")
    return i


def script_ids(tok: Tokenizer, reasoning: str, content: str) -> list[int]:
    """The scripted output as token ids: ``reasoning``, ``</think>``, ``content``, then ``<|im_end|>``.
    Raises ValueError when a token repeats (the next token is a function of the current one only, so each
    token may appear once)."""
    ids: list[int] = tok.encode(reasoning, add_special_tokens=False).ids + [_token_id(tok, THINK_CLOSE)]
    ids += tok.encode(content, add_special_tokens=False).ids + [IM_END_ID]
    chain = [_token_id(tok, THINK_OPEN)] + ids
    seen: set[int] = set()
    for t in chain[:-1]:
        if t in seen:
            raise ValueError(f"token {tok.id_to_token(t)!r} occurs twice in the script; reword it (each token once)")
        seen.add(t)
    return ids


def scripted_weights(spec: ModelSpec, seed: int, vocab_size: int, chain: list[int], scale: float = 30.0) -> dict[str, Any]:
    """Weights whose greedy decoding follows ``chain``: after token ``chain[i]`` comes ``chain[i + 1]``.

    Design note: every layer's output projections (``o_proj``, ``down_proj``) are zero, so each layer adds
    nothing and the final hidden state is the current token's embedding; with the final norm's weight 1 it is
    ``n = E[t] / rms(E[t])``. ``lm_head`` row ``chain[i + 1]`` is ``scale * n_i / |n_i|`` (all other rows
    zero), so token ``chain[i]``'s logits peak at ``chain[i + 1]`` by ``scale * sqrt(hidden)`` against
    cross terms of random directions (~``scale * 3``): a margin no dtype or kernel changes."""
    import torch

    w = make_weights(spec, seed, vocab_size)
    for name, t in w.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            t.zero_()
    w["model.norm.weight"] = torch.ones(spec.hidden_size)
    head = torch.zeros(vocab_size, spec.hidden_size)
    emb = w["model.embed_tokens.weight"]
    for src, dst in zip(chain, chain[1:]):
        head[dst] = scale * emb[src] / emb[src].norm()
    w["lm_head.weight"] = head
    return w


def synthesize_scripted(out_dir: str | Path, reasoning: str = SCRIPT_REASONING, content: str = SCRIPT_CONTENT, seed: int = 0, name: str = "tiny-think",
                        tokenizer_json: str | None = None) -> Path:
    """Write a reasoning model whose greedy output, after a prompt ending in ``<think>`` (its template's
    generation prompt), is ``reasoning</think>content`` then end of turn; after ``<think></think>``
    (``enable_thinking: false``) it is ``content``. ``tokenizer_json`` reuses a trained synth tokenizer
    (else one is trained); ``<think>`` and ``</think>`` are added to it as tokens of their own, as Qwen3 has
    them. Returns the checkpoint directory."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(tokenizer_json) if tokenizer_json else train_tokenizer()
    tok.add_tokens([AddedToken(THINK_OPEN, normalized=False, special=False), AddedToken(THINK_CLOSE, normalized=False, special=False)])
    vocab = tok.get_vocab_size(with_added_tokens=True)
    chain = [_token_id(tok, THINK_OPEN)] + script_ids(tok, reasoning, content)
    spec = SCRIPTED_SPEC if name == SCRIPTED_SPEC.name else ModelSpec(**{**SCRIPTED_SPEC.__dict__, "name": name})
    d = Path(out_dir) / name
    d.mkdir(parents=True, exist_ok=True)
    _dump_json(d / "config.json", make_config(spec, vocab))
    _dump_json(d / "generation_config.json", {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "pad_token_id": ENDOFTEXT_ID})
    (d / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    tcfg = _tokenizer_config()
    tcfg["chat_template"] = THINK_TEMPLATE
    for t in (THINK_OPEN, THINK_CLOSE):
        tcfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                                                  "single_word": False, "special": False}
    _dump_json(d / "tokenizer_config.json", tcfg)
    save_file(scripted_weights(spec, seed, vocab, chain), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d
