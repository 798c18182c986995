"""The checkpoint synthesizer: determinism (across processes), file set, config validity, CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.model.config import ModelConfig
from talaria.models.synth import MODEL_SPECS, SPECIAL_TOKENS, synthesize

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
REPO = Path(__file__).resolve().parents[2]


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_is_byte_identical_across_processes(synth_models, tmp_path):
    # A separate interpreter (different hash seed, thread scheduling) must reproduce the session fixture.
    names = ["tiny-llama", "tiny-qwen2"]
    code = (
        "import sys; from talaria.models.synth import synthesize; "
        f"synthesize(sys.argv[1], seed=0, names={names!r})"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=REPO,
                   env={"PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                        "PATH": "/usr/bin:/bin"})
    root = synth_models["tiny-llama"].parent
    for name in names:
        ours = _hashes(tmp_path / name)
        ref = _hashes(root / name)
        assert set(ours) == set(FILES)
        assert ours == ref, name


def test_different_seed_changes_weights_only(tmp_path, synth_models):
    (d,) = synthesize(tmp_path, seed=1, names=["tiny-qwen3"])
    ref = synth_models["tiny-qwen3"]
    for f in FILES:
        same = (d / f).read_bytes() == (ref / f).read_bytes()
        assert same == (f != "model.safetensors"), f


def test_configs_load_in_transformers_and_ours(synth_models):
    transformers = pytest.importorskip("transformers")
    for name, path in synth_models.items():
        spec = MODEL_SPECS[name]
        hf = transformers.AutoConfig.from_pretrained(str(path))
        ours = ModelConfig.from_dir(path)
        assert hf.model_type == spec.model_type and ours.architecture == spec.architecture
        assert ours.num_key_value_heads == hf.num_key_value_heads == spec.num_key_value_heads
        assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
        assert ours.tie_word_embeddings == spec.tie_word_embeddings
        assert ours.vocab_size == 4096
    assert ModelConfig.from_dir(synth_models["tiny-qwen3"]).head_dim == 48
    assert ModelConfig.from_dir(synth_models["tiny-qwen3"]).qk_norm
    assert ModelConfig.from_dir(synth_models["tiny-qwen2"]).qkv_bias
    assert ModelConfig.from_dir(synth_models["tiny-llama"]).rope_scaling.rope_type == "llama3"


def test_tokenizer_files(synth_models):
    d = synth_models["tiny-llama"]
    tok = json.loads((d / "tokenizer.json").read_text())
    assert [t["content"] for t in tok["added_tokens"]] == list(SPECIAL_TOKENS)
    assert 3000 < len(tok["model"]["vocab"]) <= 4096
    tcfg = json.loads((d / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tcfg["chat_template"] and tcfg["eos_token"] == "<|im_end|>"


def test_unknown_name_rejected(tmp_path):
    with pytest.raises(ValueError, match="nope"):
        synthesize(tmp_path, names=["nope"])


def test_cli_list_and_synth(tmp_path, capsys):
    from talaria.models.cli import main

    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in MODEL_SPECS)
    assert main(["models", "synth", "--out", str(tmp_path), "--seed", "3", "--only", "tiny-mistral"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-mistral"]
    assert set(FILES) <= {p.name for p in (tmp_path / "tiny-mistral").iterdir()}


def test_scripted_model_follows_its_script_and_its_thinking_switch(synth_models, tmp_path):
    """Greedy decoding (Hugging Face's model, bf16) after the thinking template's generation prompt yields the
    script; with ``enable_thinking: false`` only the answer. Also through the CLI's ``--scripted``."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from talaria.cli import main
    from talaria.models.synth import SCRIPT_CONTENT, SCRIPT_REASONING, script_ids
    from talaria.tokenizer import Tokenizer

    assert main(["models", "synth", "--out", str(tmp_path), "--scripted", "tiny-think"]) == 0
    d = tmp_path / "tiny-think"
    tok = Tokenizer.from_dir(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.bfloat16)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    for kw, want in (({}, f"{SCRIPT_REASONING}</think>{SCRIPT_CONTENT}<|im_end|>"), ({"enable_thinking": False}, f"{SCRIPT_CONTENT}<|im_end|>")):
        ids = tok.encode(tok.render_chat_template(msgs, **kw), add_special_tokens=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
        assert tok.decode(out[0, len(ids):].tolist()) == want, kw
    with pytest.raises(ValueError, match="twice"):
        import tokenizers

        script_ids(tokenizers.Tokenizer.from_file(str(d / "tokenizer.json")), "a a a", "b")
