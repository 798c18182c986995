"""Load a Hugging Face checkpoint (safetensors) into its registered model class (``registry.py``), and
allocate the paged KV pool in the architecture's KV layout.

Parameter names of our module equal the checkpoint names, so loading is a strict 1:1 copy: every expected
tensor must be present with the right shape; unknown tensors are an error (except ``lm_head.weight`` of a
tied model and legacy ``rotary_emb.inv_freq`` buffers, which are ignored).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .batch import KVCache
from .config import ModelConfig
from .llama import LlamaForCausalLM
from .registry import lookup

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX-BF16 flags in /proc/cpuinfo)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"avx512_bf16", "amx_bf16"})
    return False


def auto_dtype(device: str | torch.device, cpuinfo: str | None = None) -> torch.dtype:
    """The engine's compute dtype for ``dtype: auto``: bfloat16 where the device computes it natively (a
    CUDA device with bf16 support, a CPU with AVX512-BF16/AMX), float32 otherwise."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_bf16(cpuinfo) else torch.float32


def engine_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """Config dtype name (``auto``, ``float32``, ``bfloat16``, ``float16``) -> torch dtype for ``device``."""
    if name == "auto":
        return auto_dtype(device)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


def _resolve_dtype(dtype: torch.dtype | str | None, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype is not None else (config.dtype or "float32")
    name = str(name).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}")
    return _DTYPES[name]


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _ignorable(name: str, config: ModelConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    fuse: bool = True,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from ``path/config.json`` and copy in every tensor from its safetensors file(s);
    with ``fuse`` (default) fuse its projections (see ``LlamaForCausalLM.fuse_projections``)."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
    torch_dtype = _resolve_dtype(dtype, config)
    device = torch.device(device)

    with torch.device("meta"):
        model = lookup(config.architecture).model_class(config)
    model = model.to_empty(device=device).to(torch_dtype)
    if config.tie_word_embeddings:  # to_empty() re-creates parameters; re-tie them
        model.lm_head.weight = model.model.embed_tokens.weight
    expected = dict(model.named_parameters())  # de-duplicated: a tied lm_head is not listed

    seen: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    param = expected.get(name)
                    if param is None:
                        if not _ignorable(name, config):
                            unexpected.append(name)
                        continue
                    if name in seen:
                        raise ValueError(f"tensor {name!r} appears in more than one shard")
                    t = f.get_tensor(name)
                    if tuple(t.shape) != tuple(param.shape):
                        raise ValueError(
                            f"shape mismatch for {name!r}: checkpoint {tuple(t.shape)}, "
                            f"model expects {tuple(param.shape)} ({file.name})"
                        )
                    param.copy_(t)
                    seen.add(name)
    if unexpected:
        raise ValueError(f"unexpected tensors in checkpoint {path}: {sorted(unexpected)}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"missing tensors in checkpoint {path}: {missing}")
    model.eval()
    model.requires_grad_(False)
    if fuse:
        model.fuse_projections()  # q/k/v and gate/up as one matmul each; parameters become views
    return model, config


def allocate_kv_cache(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> KVCache:
    """One zeroed tensor ``[2, layers, num_pages * page_size, *slab]`` in the architecture's KV shape (MHA:
    slab ``[kv_heads, head_dim]``); ``k[l]``/``v[l]`` are views into it, so the pool's addresses never change."""
    if num_pages <= 0 or page_size <= 0:
        raise ValueError("num_pages and page_size must be positive")
    shape = lookup(config.architecture).kv_shape(config).pool_shape(num_pages * page_size)
    pool = torch.zeros(*shape, dtype=dtype, device=device)
    return KVCache(
        k=[pool[0, l] for l in range(config.num_hidden_layers)],
        v=[pool[1, l] for l in range(config.num_hidden_layers)],
        page_size=page_size,
    )
