"""``atb convert``: rewrite a checkpoint as sharded safetensors of one float dtype (or atb's W8A16 /
W4A16 formats), in bounded memory.

Sources: an HF model directory (``*.safetensors`` or ``pytorch_model*.bin`` shards, with
or without an index JSON) or a ``.gguf`` file. The output is a directory that stock
``transformers`` loads with ``from_pretrained``: ``model-0000i-of-0000n.safetensors``,
``model.safetensors.index.json``, and the config, generation config and tokenizer files.

Memory stays near one chunk of one tensor, never a shard or the model:

* Every tensor's name, dtype and shape is known before any data is read (safetensors
  headers, the ``.bin`` zip's records through ``torch.load(mmap=True)``, GGUF's tensor
  table), so the output shards are planned up front and each shard's header is written
  first; tensor data then goes straight from the source to its place in the output file.
* A tensor is converted in chunks of ``CHUNK_BYTES`` source bytes (elementwise casts do
  not care about shape), cast from a private memory map of the source file (the
  safetensors file, or the ``.bin`` zip that ``torch.load(mmap=True)`` maps) straight into
  a reused output buffer, written out once it holds about a chunk (small tensors share a
  write; see ``_ShardFile`` and ``_Appender``). File pages touched through a map stay
  resident (and count in RSS) until unmapped, so each chunk's pages are released with
  ``madvise(MADV_DONTNEED)`` once used (the map is private and never written, so the
  kernel re-reads them from the file if touched again).
* ``quantize=`` (``--quantize``): each projection, the embedding and the LM head is
  quantized by :func:`atb.quant.quantize_weight` in blocks of rows (its quantized parts,
  a quarter to an eighth of the float tensor, are the bound), or taken as the GGUF file's
  own Q8_0/Q5_0/Q4_0/Q4_1/Q4_K/Q6_K blocks, and stored as its parts (README "Converting checkpoints": the
  on-disk format).
* GGUF tensors are dequantized whole, one at a time, with the ``gguf`` package and
  transformers' own GGUF name mapping and per-architecture tensor processing (the code
  ``from_pretrained(gguf_file=...)`` runs), so the result is what transformers would load.

Writes are atomic at the directory level: everything goes into a hidden temporary
directory next to DST, renamed to DST only when complete. Any problem with the input is a
:class:`ConvertError` whose one-line message names the file and, where one is involved, the
tensor; nothing is left behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import mmap
import os
import re
import resource
import shutil
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Source dtypes that are cast to the target; integer and bool tensors (buffers) are copied unchanged.
FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
KEPT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
# safetensors dtype codes atb reads; anything else (F8_*, U16..U64, complex, ...) is refused by name.
ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
ST_CODES = {v: k for k, v in ST_DTYPES.items()}
# 16 MiB of source bytes per step: large enough that per-call overhead is noise, small next to any model.
CHUNK_BYTES = 16 << 20
DEFAULT_MAX_SHARD = "2GB"
# Files of an HF directory that are weights (rewritten) rather than configuration/tokenizer (copied).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf)$|.*\.index\.json$")
_PARTIAL = ".atb-partial-"


class ConvertError(Exception):
    """A problem with the input or output of a conversion, described in one line."""


def parse_size(text: str) -> int:
    """'2GB' / '500MB' / '1.5GiB' / '1000000' -> bytes (decimal units as HF uses them, *iB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConvertError(f"--max-shard-size: expected a size such as 2GB or 500MB, got '{text}'")
    base = 1024 if m.group(3) else 1000
    n = int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))
    if n < 1:
        raise ConvertError(f"--max-shard-size must be positive, got '{text}'")
    return n


def peak_rss_bytes() -> int:
    """Peak resident memory of this process since it started running Python.

    /proc's VmHWM is the peak of the current address space; ``ru_maxrss`` also counts the
    parent's resident memory at fork (a process started by a large one inherits its mark).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---------------------------------------------------------------------------------------------- sources
@dataclass
class SourceTensor:
    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int  # bytes read from the source for it (quantized GGUF: the packed blocks)
    # read(start, stop, scratch) -> 1-D tensor of elements [start, stop) in ``dtype``, valid until the next call;
    # it may be a view of ``scratch`` (a uint8 buffer of at least that many bytes) or, with ``mapped``, of the
    # memory-mapped source file (then released with _release_pages once used). None for whole-tensor sources.
    read: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
    mapped: bool = False
    # load() -> the whole tensor in its final layout (GGUF: dequantized and processed).
    load: Callable[[], torch.Tensor] | None = None
    # GGUF Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K: the block type, and blocks() -> the tensor as a QuantizedWeight read
    # from the file's blocks as they are (rows in HF order), for --quantize to keep instead of re-quantizing floats.
    native: str | None = None
    blocks: Callable[[], object] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Source:
    kind: str  # "safetensors" | "bin" | "gguf"
    path: str
    tensors: list[SourceTensor]
    copy_files: list[str] = field(default_factory=list)  # directory sources: config/tokenizer files
    write_extras: Callable[[str, torch.dtype], None] | None = None  # GGUF: writes config/tokenizer into DST
    config: object = None  # GGUF: the HF config parsed from the file (directories: read when needed)

    def tied(self) -> bool:
        """The model ties its LM head to the embedding (what HF does with a checkpoint's lm_head.weight)."""
        config = self.config
        if config is None:
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(self.path)
            except (OSError, ValueError, KeyError) as e:
                raise ConvertError(f"{self.path}: cannot read config.json ({str(e).splitlines()[0]})") from None
        return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def _check_dtype(dtype, path: str, name: str) -> None:
    if dtype not in FLOAT_DTYPES and dtype not in KEPT_DTYPES:
        raise ConvertError(f"{path}: tensor '{name}' has unsupported dtype {str(dtype).replace('torch.', '')} "
                           f"(convert casts float64/32/16 and bfloat16, and copies integer and bool tensors)")


class _SafetensorsFile:
    """One .safetensors file: header parsed and checked against the file size; data read by offset."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise ConvertError(f"{path}: corrupt or truncated safetensors header "
                                   f"(declares {n} header bytes, file has {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConvertError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{path}: corrupt safetensors header (not a JSON object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self.base = 8 + n
        data_size = size - self.base
        self.tensors: list[SourceTensor] = []
        for name, info in header.items():
            try:
                code, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise ConvertError(f"{path}: tensor '{name}': corrupt header entry {info!r}") from None
            if code not in ST_DTYPES:
                raise ConvertError(f"{path}: tensor '{name}' has unsupported dtype {code} "
                                   f"(convert reads {', '.join(ST_DTYPES)})")
            dtype = ST_DTYPES[code]
            need = math.prod(shape) * dtype.itemsize
            if not (0 <= begin <= end) or end - begin != need:
                raise ConvertError(f"{path}: tensor '{name}': corrupt header (offsets {begin}..{end} for "
                                   f"{need} bytes of {code}{list(shape)})")
            if end > data_size:
                raise ConvertError(f"{path}: truncated: tensor '{name}' ends at byte {self.base + end}, "
                                   f"the file has {size}")
            self.tensors.append(SourceTensor(name, path, dtype, shape, need, read=self._reader(begin, dtype),
                                             mapped=True))

    _map: torch.Tensor | None = None

    def _mapped(self) -> torch.Tensor:
        """The whole file as a uint8 tensor over a private read-only-in-practice map (never written, so no page
        is ever copied; private so that its pages can be dropped with MADV_DONTNEED after use)."""
        if self._map is None:
            with open(self.path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            if len(mm) != os.path.getsize(self.path):
                raise ConvertError(f"{self.path}: file changed size while reading")
            self._map = torch.frombuffer(mm, dtype=torch.uint8)
        return self._map

    def _reader(self, begin: int, dtype: torch.dtype):
        # Chunks are views of the mapped file: the cast reads the page cache directly, with no copy into a read
        # buffer first (readinto cost a third of the conversion time); each chunk's pages are released once used.
        def read(start: int, stop: int, scratch: torch.Tensor | None = None) -> torch.Tensor:
            first = self.base + begin + start * dtype.itemsize
            return self._mapped()[first:first + (stop - start) * dtype.itemsize].view(dtype)
        return read


_libc = None


def _release_pages(t: torch.Tensor) -> None:
    """Drops the resident pages of a chunk of a privately memory-mapped, never-written tensor."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = t.data_ptr() + t.numel() * t.element_size()
    _libc.madvise(start, end - start, 4)  # MADV_DONTNEED; a failure only costs memory, not correctness


def _bin_file(path: str) -> list[SourceTensor]:
    try:
        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises RuntimeError / pickle errors / OSError for bad archives
        raise ConvertError(f"{path}: not a readable torch checkpoint "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if not isinstance(sd, dict):
        raise ConvertError(f"{path}: expected a state dict (name -> tensor), found {type(sd).__name__}")
    out = []
    for name, t in sd.items():
        if not torch.is_tensor(t):
            raise ConvertError(f"{path}: entry '{name}' is a {type(t).__name__}, not a tensor")
        _check_dtype(t.dtype, path, name)
        entry = SourceTensor(name, path, t.dtype, tuple(t.shape), t.numel() * t.element_size())
        if t.is_contiguous():
            def read(start: int, stop: int, scratch: torch.Tensor | None = None, flat=t.reshape(-1)) -> torch.Tensor:
                return flat[start:stop]
            entry.read, entry.mapped = read, True
        else:  # a strided view was saved: read it whole (rare; costs one tensor)
            entry.load = lambda t=t: t.contiguous()
        out.append(entry)
    return out


def _dir_shards(src: str) -> tuple[str, list[str], dict[str, str] | None]:
    """(kind, shard files, weight_map from the index or None) of an HF model directory."""
    for kind, index_name, pattern in (
            ("safetensors", "model.safetensors.index.json", re.compile(r".*\.safetensors$")),
            ("bin", "pytorch_model.bin.index.json", re.compile(r"pytorch_model.*\.bin$"))):
        index = os.path.join(src, index_name)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConvertError(f"{index}: unreadable index ({e})") from None
            for name, shard in weight_map.items():
                if not os.path.isfile(os.path.join(src, shard)):
                    raise ConvertError(f"{os.path.join(src, shard)}: missing shard, named in {index_name} "
                                       f"for tensor '{name}'")
            files = sorted(set(weight_map.values()))
            return kind, [os.path.join(src, s) for s in files], weight_map
        files = sorted(f for f in os.listdir(src) if pattern.fullmatch(f))
        if files:
            return kind, [os.path.join(src, s) for s in files], None
    raise ConvertError(f"{src}: no weights found (expected *.safetensors or pytorch_model*.bin, "
                       f"with or without an index JSON)")


def _open_dir(src: str) -> Source:
    if not os.path.isfile(os.path.join(src, "config.json")):
        raise ConvertError(f"{src}: config.json is missing (not an HF model directory)")
    try:
        with open(os.path.join(src, "config.json")) as f:
            quantized = (json.load(f) or {}).get("quantization_config")
    except (OSError, ValueError, AttributeError) as e:
        raise ConvertError(f"{os.path.join(src, 'config.json')}: unreadable ({e})") from None
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ConvertError(f"{src}: already quantized (quant_method '{method}'); convert reads float checkpoints")
    kind, files, weight_map = _dir_shards(src)
    tensors: list[SourceTensor] = []
    for path in files:
        got = _SafetensorsFile(path).tensors if kind == "safetensors" else _bin_file(path)
        if weight_map is not None:
            shard = os.path.basename(path)
            # The index decides which file holds a tensor; a tensor only in a file is kept too (HF would load it).
            got = [t for t in got if weight_map.get(t.name, shard) == shard]
        tensors += got
    seen: dict[str, str] = {}
    for t in tensors:
        if t.name in seen:
            raise ConvertError(f"{t.file}: tensor '{t.name}' also in {seen[t.name]}")
        seen[t.name] = t.file
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in seen:
                raise ConvertError(f"{os.path.join(src, shard)}: tensor '{name}' named in the index is not in the file")
    copy = sorted(os.path.join(src, f) for f in os.listdir(src)
                  if os.path.isfile(os.path.join(src, f)) and not f.startswith(".") and not _WEIGHT_FILE.fullmatch(f))
    return Source(kind, src, tensors, copy_files=copy)


_GGUF_PATCH_LOCK = threading.Lock()  # one patch of the gguf module at a time (each restores what it replaced)


@contextlib.contextmanager
def _gguf_parsed_once(reader):
    """Inside, ``gguf.GGUFReader(reader's path)`` returns ``reader`` and ``gguf.get_tensor_name_map`` is memoized.

    transformers parses a GGUF file's metadata afresh for the config and again for the tokenizer's config, and
    builds gguf's tensor-name table once per module of the model (~400 times for a 30-layer llama); with a
    49k-token vocabulary in the metadata that was most of a first load (SmolLM2: 21.9 s, of which the three
    parses and the tables took ~12 s). Both look the names up in the ``gguf`` module when called, so they see
    these for the duration; the reader is only read, and a name table is never modified after it is built."""
    import gguf

    path = os.path.realpath(reader.data.filename)

    def shared_reader(p, *args, **kwargs):
        return reader if os.path.realpath(p) == path and not args and not kwargs else reader_class(p, *args, **kwargs)

    with _GGUF_PATCH_LOCK:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _open_gguf(path: str) -> Source:
    try:
        import gguf
    except ImportError:
        raise ConvertError("converting a GGUF file needs the gguf package: pip install gguf accelerate") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.integrations.gguf.utils import is_gguf_arch_supported
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    from atb.quant.gguf import NATIVE_TYPES, permute_rows, tensor_to_quantized

    # The tensor data comes through gguf's reader; the config through transformers' own GGUF parse (of the same
    # reader: _gguf_parsed_once), turned into a config object as AutoConfig.from_pretrained(gguf_file=...) does.
    try:
        reader = gguf.GGUFReader(path)
        arch = read_field(reader, "general.architecture")[0]
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on damaged files
        raise ConvertError(f"{path}: not a readable GGUF file ({e})") from None
    if is_gguf_arch_supported(arch):
        # transformers loads these through its packed-GGUF path with its own conversions, not the per-tensor one.
        raise ConvertError(f"{path}: GGUF architecture '{arch}' is not supported by convert")
    directory, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    with _gguf_parsed_once(reader):
        try:
            parsed = load_gguf_checkpoint(path, return_tensors=False)
            config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(dict(parsed["config"]))
        except (ValueError, KeyError, NotImplementedError) as e:  # transformers' errors for a config it cannot map
            raise ConvertError(f"{path}: cannot read the model configuration ({e})") from None
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=parsed["config"])
        names = get_gguf_hf_weights_map(skeleton, processor)
        del skeleton

    tensors = []
    for t in reader.tensors:
        if t.name not in names:
            continue  # as transformers does: tensors without an HF parameter (e.g. rope_freqs) are dropped
        shape = tuple(int(d) for d in reversed(t.shape))

        def load(t=t, shape=shape) -> torch.Tensor:
            import numpy as np

            weights = gguf.dequantize(t.data, t.tensor_type)
            res = processor.process(weights=weights, name=t.name, tensor_key_mapping=names,
                                    parsed_parameters=parsed)
            if res.name != t.name or tuple(res.weights.shape) != shape:
                raise ConvertError(f"{path}: tensor '{t.name}': the '{arch}' GGUF layout is not supported by convert")
            return torch.from_numpy(np.copy(res.weights))
        dtype = torch.float16 if t.tensor_type == gguf.GGMLQuantizationType.F16 else torch.float32
        entry = SourceTensor(names[t.name], path, dtype, shape, int(t.n_bytes), load=load)
        heads = _permuted_heads(processor, parsed["config"], t.name)
        if t.tensor_type.name in NATIVE_TYPES and len(shape) == 2 and heads is not False:
            entry.native = t.tensor_type.name

            def blocks(t=t, heads=heads):
                qw = tensor_to_quantized(t, t.name)
                return qw if heads is None else permute_rows(qw, heads)
            entry.blocks = blocks
        tensors.append(entry)

    def write_extras(dst: str, dtype: torch.dtype) -> None:
        config.dtype = dtype
        config.save_pretrained(dst)
        GenerationConfig.from_model_config(config).save_pretrained(dst)
        with _gguf_parsed_once(reader):
            AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(dst)

    return Source("gguf", path, tensors, write_extras=write_extras, config=config)


def _permuted_heads(processor, config: dict, name: str):
    """How transformers' GGUF processing reorders a tensor's rows, for keeping its blocks as they are:
    None (rows unchanged), the head count whose rope permutation it undoes (llama's attn_q / attn_k; the
    same row permutation as HF's, done on whole quantized rows), or False (some other processing: the
    blocks cannot be kept, the tensor is quantized from transformers' floats)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, TensorProcessor

    if type(processor) is TensorProcessor:
        return None
    if type(processor) is not LlamaTensorProcessor:
        return False
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if ".attn_q." not in name and ".attn_k." not in name or None in (heads, kv_heads):
        return None
    return heads if ".attn_q." in name else kv_heads


def open_source(src: str) -> Source:
    """Reads every header of SRC and checks it; no tensor data is read yet."""
    if os.path.isdir(src):
        return _open_dir(src)
    if os.path.isfile(src) and src.endswith(".gguf"):
        return _open_gguf(src)
    if os.path.exists(src):
        raise ConvertError(f"{src}: expected an HF model directory or a .gguf file")
    raise ConvertError(f"{src}: not found")


# ---------------------------------------------------------------------------------------------- quantization
# Which tensors --quantize turns into atb's formats: every decoder layer's seven projections, the embedding
# table and the LM head (as atb.quantize does in memory); everything else (norms, biases) stays float.
_PROJECTION = re.compile(r"(?:.*\.)?layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.weight")
_EMBED = re.compile(r"(?:.*\.)?embed_tokens\.weight")
_LM_HEAD = "lm_head.weight"
QUANT_FORMATS = ("w8a16", "w4a16")
EMBED_FORMATS = ("w8a16", "w4a16", "float")
# Stored parts of a quantized weight ``<module>.weight``: ``<module>.qweight`` (codes), ``<module>.scales``,
# ``<module>.mins`` (4-bit only); the per-tensor description is the shard's ``atb_quant`` metadata entry.
QUANT_PARTS = ("qweight", "scales", "mins")
# A quantized DST's weight files: not the names stock transformers looks for, so it cannot silently load
# the model with random projections (it ignores an unknown quantization_config with a warning and would).
QUANT_INDEX = "atb-model.safetensors.index.json"
# config.json's ``transformers_weights`` of a quantized DST: the weights file stock ``from_pretrained`` is told
# to load. transformers only warns about (and ignores) an unknown ``quant_method``; a ``transformers_weights``
# that names no safetensors file is a ValueError that quotes it, so this text is the reason stock transformers
# gives for refusing the directory.
QUANT_REFUSAL = ("this directory is an atb quantized checkpoint (atb convert --quantize {format}), which stock "
                 "transformers cannot load: load it with atb (atb.TransformerInfer(path), "
                 "atb.checkpoints.load_model(path), python -m atb generate --model path)")


@dataclass(frozen=True)
class QuantTarget:
    """What one tensor becomes: ``bits`` (8 or 4), ``group_size`` (0 = per channel), the scale dtype, and
    whether the source's own GGUF blocks are kept (no float round trip)."""

    bits: int
    group_size: int
    scale_dtype: torch.dtype
    keep_blocks: bool = False

    @property
    def format(self) -> str:
        return "w8a16" if self.bits == 8 else "w4a16"


def quant_prefix(name: str) -> str:
    return name[:-len(".weight")] if name.endswith(".weight") else name


def plan_quantization(tensors: list[SourceTensor], fmt: str, group_size: int | None, embed_format: str,
                      tied: bool) -> tuple[dict[str, QuantTarget], list[str]]:
    """(tensor name -> target, names of tensors dropped): the rules of ``atb.quantize(model, fmt, group_size,
    embed_format=...)``, with the same defaults (w8a16 per channel, w4a16 group 32, fp32 per-channel scales,
    fp16 group scales), so a converted checkpoint holds exactly the codes ``atb.quantize`` computes in memory.

    A GGUF Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K tensor whose bit width is the target's is kept as its blocks
    (group 32, Q6_K's 16, the file's own values: fp16 scales, fp32 for Q4_K's and Q6_K's exact products) unless
    an explicit ``group_size`` other than its own was asked for; under ``native`` every such tensor is, and the
    others stay float or take the format after its ``+``. A tied model's ``lm_head.weight``, if the checkpoint
    has one, is dropped: the embedding is the LM head.
    """
    from atb.quant.formats import quantize_weight
    from atb.quant.gguf import NATIVE_TYPES, native_bits, native_group

    native, rest = _native_spec(fmt, group_size)
    if not native and fmt not in QUANT_FORMATS:
        raise ConvertError(f"--quantize: expected one of {', '.join(QUANT_FORMATS)}, 'native' or 'native+<format>', "
                           f"got '{fmt}'")
    if embed_format not in EMBED_FORMATS:
        raise ConvertError(f"--embed-format: expected one of {', '.join(EMBED_FORMATS)}, got '{embed_format}'")
    if native and rest is None and not any(t.native for t in tensors):
        raise ConvertError(f"--quantize {fmt}: the source has no GGUF {'/'.join(NATIVE_TYPES)} tensors to keep "
                           f"(native+w8a16 would quantize its tensors instead)")
    layers_fmt, layers_group = rest if rest is not None else (fmt, group_size)
    plan, dropped = {}, []
    for t in tensors:
        table = _EMBED.fullmatch(t.name) or t.name == _LM_HEAD
        if tied and t.name == _LM_HEAD and any(_EMBED.fullmatch(o.name) for o in tensors):
            dropped.append(t.name)
            continue
        if not (table or _PROJECTION.fullmatch(t.name)) or t.dtype not in FLOAT_DTYPES or len(t.shape) != 2:
            continue
        if native and t.native is not None:  # the file's own blocks, whatever their width
            plan[t.name] = QuantTarget(native_bits(t.native), native_group(t.native), _gguf_scale_dtype(t),
                                       keep_blocks=True)
            continue
        if (table and embed_format == "float") or (native and rest is None):
            continue
        f = embed_format if table else layers_fmt
        # atb.quantize gives the tables the layers' group size only when they share the layers' format.
        g = layers_group if (not table or f == layers_fmt) else None
        bits = 8 if f == "w8a16" else 4
        if t.native is not None and native_bits(t.native) == bits and g in (None, native_group(t.native)):
            plan[t.name] = QuantTarget(bits, native_group(t.native), _gguf_scale_dtype(t), keep_blocks=True)
            continue
        try:  # validates the group size for the format, and gives the default scale dtype, on a 1x1 weight
            probe = quantize_weight(torch.zeros(1, 1), f, g)
        except ValueError as e:
            raise ConvertError(f"--group-size: {str(e).split(': ', 1)[-1]}") from None
        plan[t.name] = QuantTarget(bits, probe.group_size, probe.scale.dtype)
    return plan, dropped


def _native_spec(fmt: str, group_size: int | None) -> tuple[bool, tuple[str, int | None] | None]:
    """``--quantize native[+<format>]``: (True, the rest's (format, group) or None); (False, None) otherwise.
    The spec is parsed by ``atb.quant.engine.split_native``, as the engine's ``quantize=`` is; only the
    command-line wording of its errors is added here."""
    from atb.quant.engine import split_native

    if fmt != "native" and not fmt.startswith("native+"):
        return False, None
    if group_size is not None:
        raise ConvertError(f"--group-size: with --quantize {fmt} the file's blocks keep their own groups; give the "
                           f"other tensors' group in the format, e.g. native+w8a16-g32")
    try:
        head, rest = split_native(fmt)
    except ValueError:
        head = None
    if head != "native":  # a rest that is no format ("native+w8a16+x" parses as a path-like head)
        raise ConvertError(f"--quantize {fmt}: after 'native+' comes the format of the tensors with no native form: "
                           f"w8a16 or w4a16, optionally -g32, -g64 or -g128 (w8a16 also -g16)")
    return True, rest


def _gguf_scale_dtype(t: SourceTensor) -> torch.dtype:
    """fp16, as the blocks store it (Q4_K, Q6_K: fp32, where their products are exact; atb.quant.gguf.scale_dtype);
    Q4_0's min = -8 d is kept in fp32 (with d) where it overflows fp16, as atb.quant.gguf does, so a Q4_0
    tensor's blocks are read once here to know (Q4_0 files are rare)."""
    from atb.quant.gguf import scale_dtype

    return scale_dtype(t.native) if t.native != "Q4_0" else t.blocks().scale.dtype


def _parts(t: SourceTensor, q: QuantTarget) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    from atb.quant.formats import k_pad_of

    n, k = t.shape
    kp = k_pad_of(k)
    groups = 1 if q.group_size == 0 else -(-kp // q.group_size)
    prefix = quant_prefix(t.name)
    out = [(f"{prefix}.qweight", torch.int8 if q.bits == 8 else torch.uint8, (n, kp if q.bits == 8 else kp // 2)),
           (f"{prefix}.scales", q.scale_dtype, (n, groups))]
    if q.bits == 4:
        out.append((f"{prefix}.mins", q.scale_dtype, (n, groups)))
    return out


# ---------------------------------------------------------------------------------------------- output
def _out_dtype(t: SourceTensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.dtype in FLOAT_DTYPES else t.dtype


def outputs(t: SourceTensor, dtype: torch.dtype, quant: dict | None = None) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of what source tensor ``t`` is stored as: itself in ``dtype``, or its quantized parts."""
    q = (quant or {}).get(t.name)
    return [(t.name, _out_dtype(t, dtype), t.shape)] if q is None else _parts(t, q)


def _nbytes(parts) -> int:
    return sum(math.prod(shape) * d.itemsize for _, d, shape in parts)


def plan_shards(tensors: list[SourceTensor], dtype: torch.dtype, max_shard: int,
                quant: dict | None = None) -> list[list[SourceTensor]]:
    """Tensors in source order, greedily packed into shards of at most ``max_shard`` output bytes
    (a larger tensor gets a shard of its own)."""
    shards: list[list[SourceTensor]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(outputs(t, dtype, quant))
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _header(shard: list[SourceTensor], dtype: torch.dtype, metadata: dict, quant: dict | None = None) -> bytes:
    described = {}
    for t in shard:
        q = (quant or {}).get(t.name)
        if q is not None:
            described[quant_prefix(t.name)] = {"format": q.format, "group_size": q.group_size,
                                               "shape": list(t.shape),
                                               "source": f"gguf:{t.native}" if q.keep_blocks else "quantize"}
    if described:
        metadata = {**metadata, "atb_quant": json.dumps(described, separators=(",", ":"))}
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        for name, od, shape in outputs(t, dtype, quant):
            n = math.prod(shape) * od.itemsize
            entries[name] = {"dtype": ST_CODES[od], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(blob)) + blob


def _chunks(shard: list[SourceTensor], quant: dict | None = None):
    """(tensor, start, stop) element ranges in file order; (tensor, None, None) for a tensor handled whole
    (a whole-tensor source, or one to quantize)."""
    for t in shard:
        if t.load is not None or t.name in (quant or {}):
            yield t, None, None
            continue
        step = CHUNK_BYTES // t.dtype.itemsize
        for start in range(0, max(t.numel, 1), step):  # an empty tensor still gets its (empty) entry
            yield t, start, min(t.numel, start + step)


def write_shards(directory: str, shards: list[list[SourceTensor]], dtype: torch.dtype, metadata: dict,
                 progress: bool = True, quant: dict | None = None,
                 prefix: str = "model") -> tuple[dict[str, str], int]:
    """Writes planned shards as ``<prefix>-0000i-of-0000n.safetensors`` into ``directory``, tensor by tensor,
    chunk by chunk; returns (stored tensor name -> file name, bytes written)."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    bytes_out = 0
    # Buffers reused for every chunk (fresh ones would page-fault on every chunk): one for sources that are not
    # mapped, one for casts (a chunk's cast is at up to twice the source width: float16 -> float32).
    scratch_in = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    scratch_out = torch.empty(2 * CHUNK_BYTES, dtype=torch.uint8)
    appender = _Appender()
    # One thread: a cast is memory-bound, one thread runs it at several GB/s, and a second one only adds
    # OpenMP hand-offs (measured 4 vs 0.7 GB/s for fp32 -> bf16 on a shared 2-core machine). Quantizing (a
    # reduction per group, then rounding) is compute-bound and gets the caller's threads back.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, shard in enumerate(shards):
            fname = f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            bytes_out += _write_shard(os.path.join(directory, fname), f"shard {i + 1}/{n}", shard, dtype, metadata,
                                      progress, weight_map, scratch_in, scratch_out, appender, quant or {},
                                      threads)
    finally:
        torch.set_num_threads(threads)
        appender.close()
    return weight_map, bytes_out


def _quantized(t: SourceTensor, q: QuantTarget, threads: int):
    """Source tensor ``t`` as a QuantizedWeight: its own GGUF blocks, or ``quantize_weight`` of its rows.

    Quantization is row by row (each row's groups are its own), so it runs on blocks of rows of about
    ``CHUNK_BYTES`` of source, filling the whole tensor's outputs: the same codes as one call on the whole
    tensor, with the float temporaries of one block rather than several copies of the tensor."""
    from atb.quant.formats import QuantizedWeight, quantize_weight

    if q.keep_blocks:
        return t.blocks()
    n, k = t.shape
    whole = t.load() if t.load is not None else None
    rows = max(1, CHUNK_BYTES // (k * t.dtype.itemsize))
    data = scale = mins = None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            if whole is not None:
                w = whole[r0:r1]
            else:
                w = t.read(r0 * k, r1 * k, None if t.mapped else torch.empty((r1 - r0) * k * t.dtype.itemsize,
                                                                             dtype=torch.uint8)).view(r1 - r0, k)
            part = quantize_weight(w, q.format, q.group_size, q.scale_dtype)
            if data is None:
                data = torch.empty((n,) + tuple(part.data.shape[1:]), dtype=part.data.dtype)
                scale = torch.empty((n,) + tuple(part.scale.shape[1:]), dtype=part.scale.dtype)
                mins = None if part.min is None else torch.empty_like(scale)
            data[r0:r1], scale[r0:r1] = part.data, part.scale
            if mins is not None:
                mins[r0:r1] = part.min
            if t.mapped and whole is None:
                _release_pages(w)
    finally:
        torch.set_num_threads(previous)
    return QuantizedWeight(data, scale, mins, (n, k), q.bits, q.group_size, source="quantize")


class _NoBar:
    """The progress bar's interface, doing nothing (no tqdm import or lock when progress is off)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_postfix_str(self, *args, **kwargs):
        pass

    def update(self, n):
        pass


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_F_SETPIPE_SZ = 1031


class _Appender:
    """Appends tensors' bytes to open files.

    Through a pipe where Linux allows it: ``vmsplice`` lends the buffer's pages to the pipe and ``splice``
    copies them into the file's page cache, inside the kernel. ``write`` makes the same copy from user memory,
    and on this VM class it ran at times 5-10x slower, for seconds at a stretch (141 MB in 0.4-0.7 s instead of
    0.07 s), while the pipe route stayed at full speed (and kept within 20% of ``write`` at its best): the
    300 MB benchmark's conversions mostly ran in such stretches. Elsewhere, or if the pipe route fails (a
    file system without splice), ``write``.
    """

    def __init__(self):
        self._pipe = self._vmsplice = None
        if not hasattr(os, "splice"):
            return
        try:
            vmsplice = ctypes.CDLL(None, use_errno=True).vmsplice
        except (OSError, AttributeError):
            return
        vmsplice.argtypes = (ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint)
        vmsplice.restype = ctypes.c_ssize_t
        self._pipe, self._vmsplice = os.pipe(), vmsplice
        try:
            import fcntl

            fcntl.fcntl(self._pipe[1], _F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass  # the default 64 KB pipe works, in more steps

    def append(self, f, data: torch.Tensor) -> None:
        """Writes ``data`` (contiguous) at ``f``'s position; returns once its memory may be reused."""
        data = data.view(torch.uint8).reshape(-1)
        n, done = data.numel(), 0
        iov = _IoVec()
        while self._vmsplice is not None and done < n:
            iov.base, iov.len = data.data_ptr() + done, n - done
            lent = self._vmsplice(self._pipe[1], ctypes.byref(iov), 1, 0)
            if lent <= 0:
                self.close()
                break
            left = lent
            try:
                while left:  # the pipe is empty again before the buffer can change
                    left -= os.splice(self._pipe[0], f.fileno(), left)
            except OSError:  # what the pipe still holds goes by write, and so does everything after it
                while left:
                    piece = os.read(self._pipe[0], left)
                    _write_view(f, memoryview(piece))
                    left -= len(piece)
                self.close()
            done += lent
        _write_view(f, memoryview(data.numpy())[done:])

    def close(self) -> None:
        if self._pipe is not None:
            for fd in self._pipe:
                os.close(fd)
        self._pipe = self._vmsplice = None


def _write_view(f, view: memoryview) -> None:
    done = 0
    while done < len(view):  # an unbuffered write may be partial
        done += f.write(view[done:])


class _ShardFile:
    """One output file: casts go back to back into the cast buffer, several chunks (often several tensors:
    most are far smaller than a chunk) per write, and data stored as it is goes straight from where it lies.

    Written by the converting thread itself. A writer thread overlapping the writes with the next casts cost
    more than it saved on this 2-core machine class: the 300 MB benchmark took about 80 ms of CPU that way
    against 55 ms in one thread (the other thread reads the cast output back from another core's cache, and
    each hand-off waits for the other thread, which under load is a scheduler round trip), and more wall
    time whenever the machine was busy. Everything a shard casts is cast to one dtype: offsets stay aligned.
    """

    def __init__(self, f, buffer: torch.Tensor, appender: _Appender):
        self.f, self.buffer, self.appender, self.fill = f, buffer, appender, 0

    def cast(self, chunk: torch.Tensor, dtype: torch.dtype) -> None:
        """Appends ``chunk`` cast to ``dtype``."""
        n = chunk.numel() * dtype.itemsize
        if self.fill and self.fill + n > CHUNK_BYTES:
            self.flush()
        self.buffer[self.fill:self.fill + n].view(dtype).copy_(chunk)
        self.fill += n

    def put(self, data: torch.Tensor) -> None:
        """Appends ``data`` as it is."""
        self.flush()
        self.appender.append(self.f, data)

    def flush(self) -> None:
        if self.fill:
            self.appender.append(self.f, self.buffer[:self.fill])
            self.fill = 0


def _write_shard(path: str, label: str, shard: list[SourceTensor], dtype: torch.dtype, metadata: dict,
                 progress: bool, weight_map: dict[str, str], scratch_in: torch.Tensor, scratch_out: torch.Tensor,
                 appender: _Appender, quant: dict, threads: int) -> int:
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(t.nbytes for t in shard), unit="B", unit_scale=True, desc=label, leave=False,
                   file=sys.stderr)
    else:
        bar = _NoBar()
    fname = os.path.basename(path)

    with open(path, "wb", buffering=0) as f, bar:
        out = _ShardFile(f, scratch_out, appender)
        f.write(_header(shard, dtype, metadata, quant))
        for t, start, stop in _chunks(shard, quant):
            od = _out_dtype(t, dtype)
            if t.name in quant:
                qw = _quantized(t, quant[t.name], threads)
                stored = [p for p in (qw.data, qw.scale, qw.min) if p is not None]
                for (name, want_dtype, want_shape), part in zip(outputs(t, dtype, quant), stored):
                    if part.dtype != want_dtype or tuple(part.shape) != tuple(want_shape):
                        raise ConvertError(f"{t.file}: tensor '{t.name}': quantized {name} is {part.dtype} "
                                           f"{list(part.shape)}, planned {want_dtype} {list(want_shape)}")
                    out.put(part.contiguous())
                    weight_map[name] = fname
            elif start is None:
                out.put(t.load().to(od).contiguous().reshape(-1))
            else:
                chunk = t.read(start, stop, scratch_in)
                if od == t.dtype:
                    out.put(chunk)  # written straight from the source (the map, or the read buffer)
                else:
                    out.cast(chunk, od)
                if t.mapped:
                    _release_pages(chunk)
            if start is None or stop == t.numel:
                bar.set_postfix_str(t.name, refresh=False)
                bar.update(t.nbytes)
                if t.name not in quant:
                    weight_map[t.name] = fname
        out.flush()
        return f.tell()


def write_index(directory: str, tensors: list[SourceTensor], dtype: torch.dtype, weight_map: dict[str, str],
                metadata: dict, quant: dict | None = None, name: str = "model.safetensors.index.json") -> None:
    total = sum(_nbytes(outputs(t, dtype, quant)) for t in tensors)
    index = {"metadata": {"total_size": total, **{k: v for k, v in metadata.items() if k != "format"}},
             "weight_map": weight_map}
    with open(os.path.join(directory, name), "w") as f:
        json.dump(index, f, indent=2)


@dataclass
class Summary:
    tensors: int
    shards: int
    bytes_in: int
    bytes_out: int
    peak_rss: int
    seconds: float

    def line(self) -> str:
        return (f"{self.tensors} tensors in {self.shards} shard(s): {self.bytes_in / 1e6:.1f} MB in, "
                f"{self.bytes_out / 1e6:.1f} MB out, peak RSS {self.peak_rss / 1e6:.0f} MB, "
                f"{self.seconds:.2f} s ({self.bytes_in / 1e6 / max(self.seconds, 1e-9):.0f} MB/s read)")


def _clean_stale(dst: str) -> None:
    """Removes partial outputs of conversions to DST whose process is gone (killed mid-way)."""
    parent, base = os.path.split(os.path.abspath(dst))
    prefix = f".{base}{_PARTIAL}"
    for entry in os.listdir(parent):
        if entry.startswith(prefix):
            pid = entry[len(prefix):].split("-")[0]
            try:
                os.kill(int(pid), 0)
            except (ValueError, ProcessLookupError):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            except PermissionError:
                pass  # someone else's live process


def check_destination(dst: str, force: bool) -> None:
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise ConvertError(f"{dst}: the parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConvertError(f"{dst}: the parent directory {parent} is not writable")
    if os.path.lexists(dst) and not force:
        raise ConvertError(f"{dst} already exists (use --force to replace it)")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise ConvertError(f"{dst} exists and is not a directory")


def convert(src: str, dst: str, dtype: str | torch.dtype = "bfloat16", *, max_shard_size: int | str = DEFAULT_MAX_SHARD,
            force: bool = False, progress: bool = True, quantize: str | None = None, group_size: int | None = None,
            embed_format: str = "w8a16") -> Summary:
    """Converts SRC (HF directory or .gguf) into DST (sharded safetensors of ``dtype``); see the module doc.

    ``quantize`` ("w8a16" / "w4a16", ``group_size`` as for :func:`atb.quantize`) stores every projection in
    that atb format and the embedding / LM head in ``embed_format`` ("w8a16" by default, "w4a16", or
    "float"); the other tensors (norms, biases) are stored in ``dtype``. ``quantize="native"`` (a GGUF source)
    keeps every Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K tensor as its own blocks and the others float, or with
    ``"native+<format>"`` quantized to that format. See the README's "atb convert".
    """
    import atb

    t0 = time.perf_counter()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConvertError(f"--dtype: expected one of {', '.join(DTYPES)}, got '{dtype}'")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConvertError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype}")
    if quantize is None and group_size is not None:
        raise ConvertError("--group-size needs --quantize")
    if quantize is not None and quantize not in QUANT_FORMATS and not _native_spec(quantize, group_size)[0]:
        raise ConvertError(f"--quantize: expected one of {', '.join(QUANT_FORMATS)}, 'native' or 'native+<format>', "
                           f"got '{quantize}'")
    max_shard = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    if max_shard < 1:
        raise ConvertError(f"max_shard_size must be positive, got {max_shard_size}")
    dtype_name = str(dtype).replace("torch.", "")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ConvertError(f"{dst}: the destination is the source")
    check_destination(dst, force)
    source = open_source(src)
    tensors = source.tensors
    if not tensors:
        raise ConvertError(f"{src}: no tensors to convert")
    metadata = {"format": "pt", "source": os.path.abspath(src), "source_format": source.kind, "dtype": dtype_name,
                "atb_version": atb.__version__}
    quant, quant_config = None, None
    if quantize is not None:
        quant, dropped = plan_quantization(tensors, quantize, group_size, embed_format, source.tied())
        tensors = [t for t in tensors if t.name not in dropped]
        layer_groups = {q.group_size for name, q in quant.items() if _PROJECTION.fullmatch(name)}
        quant_config = {"quant_method": "atb", "format": quantize,
                        "group_size": layer_groups.pop() if len(layer_groups) == 1 else group_size,
                        "embed_format": embed_format, "weights_index": QUANT_INDEX,
                        "kept_gguf_blocks": sorted({t.native for t in tensors if t.name in quant
                                                    and quant[t.name].keep_blocks}),
                        "atb_version": atb.__version__}
        metadata["quantization"] = quantize
    shards = plan_shards(tensors, dtype, max_shard, quant)

    _clean_stale(dst)
    parent, base = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{base}{_PARTIAL}{os.getpid()}-{os.urandom(3).hex()}")
    os.mkdir(tmp)
    try:
        weight_map, bytes_out = write_shards(tmp, shards, dtype, metadata, progress, quant,
                                             prefix="atb-model" if quant else "model")
        write_index(tmp, tensors, dtype, weight_map, metadata, quant,
                    name=QUANT_INDEX if quant else "model.safetensors.index.json")
        for path in source.copy_files:
            shutil.copy2(path, tmp)
        if source.write_extras is not None:
            source.write_extras(tmp, dtype)
        config_path = os.path.join(tmp, "config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
            config["dtype"] = dtype_name  # what from_pretrained(dtype="auto") picks
            config.pop("torch_dtype", None)
            if quant_config is not None:
                config["quantization_config"] = quant_config
                config["transformers_weights"] = QUANT_REFUSAL.format(format=quantize)
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Summary(len(tensors), len(shards), sum(t.nbytes for t in tensors), bytes_out, peak_rss_bytes(),
                   time.perf_counter() - t0)


def _publish(tmp: str, dst: str) -> None:
    """Renames the finished directory to DST (an existing DST, allowed by --force, is replaced)."""
    if not os.path.lexists(dst):
        try:
            os.rename(tmp, dst)
        except OSError:
            raise ConvertError(f"{dst} appeared while converting; not replaced") from None
        return
    old = f"{tmp}-old"
    os.rename(dst, old)
    os.rename(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)
