"""``atb convert``: rewrite a checkpoint as sharded safetensors of one float dtype, in bounded memory.

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
  not care about shape). safetensors data is read with ``readinto`` rather than through
  ``safe_open``'s memory map, because file pages touched through a map stay resident
  (and count in RSS) until the map is closed, i.e. up to a whole input shard. For the
  ``.bin`` zip, which ``torch.load`` can only map, each chunk's pages are released with
  ``madvise(MADV_DONTNEED)`` once converted (the map is private and never written, so the
  kernel re-reads them from the file if touched again).
* GGUF tensors are dequantized whole, one at a time, with the ``gguf`` package and
  transformers' own GGUF name mapping and per-architecture tensor processing (the code
  ``from_pretrained(gguf_file=...)`` runs), so the result is what transformers would load.

Writes are atomic at the directory level: everything goes into a hidden temporary
directory next to DST, renamed to DST only when complete. Any problem with the input is a
:class:`ConvertError` whose one-line message names the file and, where one is involved, the
tensor; nothing is left behind.
"""
from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import re
import resource
import shutil
import struct
import sys
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
    # it may be a view of ``scratch`` (a uint8 buffer of at least that many bytes). None for whole-tensor sources.
    read: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
    # load() -> the whole tensor in its final layout (GGUF: dequantized and processed).
    load: Callable[[], torch.Tensor] | None = None

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
            self.tensors.append(SourceTensor(name, path, dtype, shape, need, read=self._reader(begin, dtype)))

    def _reader(self, begin: int, dtype: torch.dtype):
        def read(start: int, stop: int, scratch: torch.Tensor) -> torch.Tensor:
            buf = scratch[:(stop - start) * dtype.itemsize]
            with open(self.path, "rb", buffering=0) as f:
                f.seek(self.base + begin + start * dtype.itemsize)
                got = f.readinto(memoryview(buf.numpy()))
            if got != buf.numel():
                raise ConvertError(f"{self.path}: file shrank while reading")
            return buf.view(dtype)
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
            def read(start: int, stop: int, scratch: torch.Tensor, flat=t.reshape(-1)) -> torch.Tensor:
                chunk = scratch[:(stop - start) * flat.element_size()].view(flat.dtype)
                chunk.copy_(flat[start:stop])
                _release_pages(flat[start:stop])
                return chunk
            entry.read = read
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

    # The tensor data comes through gguf's reader; the config through transformers' own GGUF parse, turned into
    # a config object as AutoConfig.from_pretrained(gguf_file=...) does (without parsing the file a third time).
    try:
        reader = gguf.GGUFReader(path)
        arch = read_field(reader, "general.architecture")[0]
    except Exception as e:  # the reader raises ValueError/struct.error/IndexError on damaged files
        raise ConvertError(f"{path}: not a readable GGUF file ({e})") from None
    if is_gguf_arch_supported(arch):
        # transformers loads these through its packed-GGUF path with its own conversions, not the per-tensor one.
        raise ConvertError(f"{path}: GGUF architecture '{arch}' is not supported by convert")
    directory, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    try:
        parsed = load_gguf_checkpoint(path, return_tensors=False)
        config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(dict(parsed["config"]))
    except (ValueError, KeyError, NotImplementedError) as e:
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
        tensors.append(SourceTensor(names[t.name], path, dtype, shape, int(t.n_bytes), load=load))

    def write_extras(dst: str, dtype: torch.dtype) -> None:
        config.dtype = dtype
        config.save_pretrained(dst)
        GenerationConfig.from_model_config(config).save_pretrained(dst)
        AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(dst)

    return Source("gguf", path, tensors, write_extras=write_extras)


def open_source(src: str) -> Source:
    """Reads every header of SRC and checks it; no tensor data is read yet."""
    if os.path.isdir(src):
        return _open_dir(src)
    if os.path.isfile(src) and src.endswith(".gguf"):
        return _open_gguf(src)
    if os.path.exists(src):
        raise ConvertError(f"{src}: expected an HF model directory or a .gguf file")
    raise ConvertError(f"{src}: not found")


# ---------------------------------------------------------------------------------------------- output
def _out_dtype(t: SourceTensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.dtype in FLOAT_DTYPES else t.dtype


def plan_shards(tensors: list[SourceTensor], dtype: torch.dtype, max_shard: int) -> list[list[SourceTensor]]:
    """Tensors in source order, greedily packed into shards of at most ``max_shard`` output bytes
    (a larger tensor gets a shard of its own)."""
    shards: list[list[SourceTensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.numel * _out_dtype(t, dtype).itemsize
        if shards[-1] and size + n > max_shard:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _header(shard: list[SourceTensor], dtype: torch.dtype, metadata: dict) -> bytes:
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for t in shard:
        od = _out_dtype(t, dtype)
        n = t.numel * od.itemsize
        entries[t.name] = {"dtype": ST_CODES[od], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(entries, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(blob)) + blob


def _chunks(shard: list[SourceTensor]):
    """(tensor, start, stop) element ranges in file order; (tensor, None, None) for a whole-tensor source."""
    for t in shard:
        if t.load is not None:
            yield t, None, None
            continue
        step = CHUNK_BYTES // t.dtype.itemsize
        for start in range(0, max(t.numel, 1), step):  # an empty tensor still gets its (empty) entry
            yield t, start, min(t.numel, start + step)


def write_shards(directory: str, shards: list[list[SourceTensor]], dtype: torch.dtype, metadata: dict,
                 progress: bool = True) -> tuple[dict[str, str], int]:
    """Writes planned shards as ``model-0000i-of-0000n.safetensors`` into ``directory``, tensor by tensor,
    chunk by chunk; returns (tensor name -> file name, bytes written)."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    bytes_out = 0
    # Buffers reused for every chunk (fresh ones would page-fault on every chunk): two for reading (the next
    # chunk is read while this one is cast and written), one for the cast, at up to twice the source width
    # (float16 -> float32).
    scratch_in = (torch.empty(CHUNK_BYTES, dtype=torch.uint8), torch.empty(CHUNK_BYTES, dtype=torch.uint8))
    scratch_out = torch.empty(2 * CHUNK_BYTES, dtype=torch.uint8)
    # One thread: a cast is memory-bound, one thread runs it at several GB/s, and a second one only adds
    # OpenMP hand-offs (measured 4 vs 0.7 GB/s for fp32 -> bf16 on a shared 2-core machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, shard in enumerate(shards):
            bytes_out += _write_shard(directory, i, n, shard, dtype, metadata, progress, weight_map,
                                      scratch_in, scratch_out)
    finally:
        torch.set_num_threads(threads)
    return weight_map, bytes_out


def _write_shard(directory: str, i: int, n: int, shard: list[SourceTensor], dtype: torch.dtype, metadata: dict,
                 progress: bool, weight_map: dict[str, str], scratch_in: tuple[torch.Tensor, torch.Tensor],
                 scratch_out: torch.Tensor) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    items = list(_chunks(shard))

    def fetch(k: int):
        t, start, stop = items[k]
        return None if start is None else t.read(start, stop, scratch_in[k % 2])

    # File reads, casts and writes all release the GIL: one reader thread overlaps the next chunk's read with
    # this chunk's cast and write. Chunk k's buffer is only reused for chunk k + 2, submitted after k is written.
    with open(os.path.join(directory, fname), "wb") as f, ThreadPoolExecutor(1) as reader, \
            tqdm(total=sum(t.nbytes for t in shard), unit="B", unit_scale=True, desc=f"shard {i + 1}/{n}",
                 disable=not progress, leave=False, file=sys.stderr) as bar:
        f.write(_header(shard, dtype, metadata))
        pending = reader.submit(fetch, 0)
        for k, (t, start, stop) in enumerate(items):
            chunk = pending.result()
            if k + 1 < len(items):
                pending = reader.submit(fetch, k + 1)
            od = _out_dtype(t, dtype)
            if chunk is None:
                chunk = t.load().to(od).contiguous().reshape(-1)
            elif od != t.dtype:
                out = scratch_out[:(stop - start) * od.itemsize].view(od)
                out.copy_(chunk)
                chunk = out
            f.write(memoryview(chunk.view(torch.uint8).numpy()))
            if start is None or stop == t.numel:
                bar.set_postfix_str(t.name, refresh=False)
                bar.update(t.nbytes)
                weight_map[t.name] = fname
        return f.tell()


def write_index(directory: str, tensors: list[SourceTensor], dtype: torch.dtype, weight_map: dict[str, str],
                metadata: dict) -> None:
    total = sum(t.numel * _out_dtype(t, dtype).itemsize for t in tensors)
    index = {"metadata": {"total_size": total, **{k: v for k, v in metadata.items() if k != "format"}},
             "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
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
                f"{self.seconds:.1f} s ({self.bytes_in / 1e6 / max(self.seconds, 1e-9):.0f} MB/s read)")


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
            force: bool = False, progress: bool = True) -> Summary:
    """Converts SRC (HF directory or .gguf) into DST (sharded safetensors of ``dtype``); see the module doc."""
    import atb

    t0 = time.perf_counter()
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConvertError(f"--dtype: expected one of {', '.join(DTYPES)}, got '{dtype}'")
        dtype = DTYPES[dtype]
    if dtype not in DTYPES.values():
        raise ConvertError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype}")
    max_shard = parse_size(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    if max_shard < 1:
        raise ConvertError(f"max_shard_size must be positive, got {max_shard_size}")
    dtype_name = str(dtype).replace("torch.", "")
    if os.path.realpath(src) == os.path.realpath(dst):
        raise ConvertError(f"{dst}: the destination is the source")
    check_destination(dst, force)
    source = open_source(src)
    if not source.tensors:
        raise ConvertError(f"{src}: no tensors to convert")
    shards = plan_shards(source.tensors, dtype, max_shard)
    metadata = {"format": "pt", "source": os.path.abspath(src), "source_format": source.kind, "dtype": dtype_name,
                "atb_version": atb.__version__}

    _clean_stale(dst)
    parent, base = os.path.split(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{base}{_PARTIAL}{os.getpid()}-{os.urandom(3).hex()}")
    os.mkdir(tmp)
    try:
        weight_map, bytes_out = write_shards(tmp, shards, dtype, metadata, progress)
        write_index(tmp, source.tensors, dtype, weight_map, metadata)
        for path in source.copy_files:
            shutil.copy2(path, tmp)
        config_path = os.path.join(tmp, "config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
            config["dtype"] = dtype_name  # what from_pretrained(dtype="auto") picks
            config.pop("torch_dtype", None)
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        if source.write_extras is not None:
            source.write_extras(tmp, dtype)
        _publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Summary(len(source.tensors), len(shards), sum(t.nbytes for t in source.tensors), bytes_out, peak_rss_bytes(),
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
