import contextlib
import os
import zlib
import time

import pytest
import torch

# Linear routing is measured per machine by default; the suite pins the fixed policy so every run takes the
# same paths (tests/test_routing.py tests the measurement itself). ATB_ROUTING=measure runs it measured.
os.environ.setdefault("ATB_ROUTING", "crossover")

import atb  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--fuzz-cases", type=int, default=None,
                     help="cases for tests/test_fuzz.py (default: $ATB_FUZZ_CASES, else 300)")


@pytest.fixture
def fuzz_cases(request):
    n = request.config.getoption("--fuzz-cases")
    return n if n is not None else int(os.environ.get("ATB_FUZZ_CASES", "300"))


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, reproducible from the test's name when it fails (crc32, not hash():
    # str hashes change from one process to the next).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield
    atb.set_soc("host")


ALL_SOCS = atb.soc_names()

# Every model family variant the tests run, listed once: name -> (model_type, config overrides applied on a
# test's own tiny base config). Adding a family = its adapter in models/ + its variants here.
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16, "rope_theta": 500000.0}
FAMILIES = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),                 # o/gate/up/down bias too
    "llama3-rope": ("llama", dict(rope_parameters=_LLAMA3)),
    "llama-dynamic-rope": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                                         max_position_embeddings=16)),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2-bias": ("qwen2", {}),                                                        # q/k/v bias
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=24)),                                              # q/k RMSNorm
}


def family_names(*without: str) -> list[str]:
    """FAMILIES' names, minus those a test cannot run (say why at the call)."""
    return [n for n in FAMILIES if n not in without]


def family_model(name: str, base: dict, dtype=torch.float32, seed: int = 0):
    """A random-weight model of one family variant on ``base``; biases made non-zero so they count."""
    from atb.checkpoints import random_model

    model_type, extra = FAMILIES[name]
    model = random_model({**base, **extra}, dtype, model_type=model_type, seed=seed)
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if name_.endswith(".bias"):
                p.normal_(std=0.1)
    return model


# Every SIMD table this machine can run (natively: avx512 / avx2 / portable), plus "avx512-simde" (the
# AVX-512 source built against SIMDe) when the build has it: a CPU without AVX-512 still tests that code.
ISAS = atb.available_isas()


@contextlib.contextmanager
def forced_isa(isa: str):
    """The SIMD table forced to ``isa`` inside the block, then back to the table in use before: a run under
    ``ATB_ISA`` keeps that table for its later tests (``set_isa("auto")`` would switch them to the fastest)."""
    before = atb._C.isa()
    atb.set_isa(isa)
    try:
        yield isa
    finally:
        atb.set_isa(before)


@contextlib.contextmanager
def fp32_decode_copy(on: bool):
    """atb.set_fp32_decode_copy(on) inside the block, then the default again."""
    atb.set_fp32_decode_copy(on)
    try:
        yield on
    finally:
        atb.set_fp32_decode_copy(None)


@contextlib.contextmanager
def fp32_batch_copy(on: bool):
    """Batch decode's packed-x GEMM reading fp32 rows4 copies of rows under 16 KiB (on) or only where rows alias
    (off) inside the block (the native setting, by CPU vendor by default), then the default again."""
    from atb import _C

    _C.set_fp32_batch_copy(int(on))
    try:
        yield on
    finally:
        _C.set_fp32_batch_copy(-1)


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test with each SIMD table forced in turn."""
    with forced_isa(request.param):
        yield request.param


_MODELS = {}


def load_smollm2(dtype=torch.float32):
    """The real SmolLM2-135M-Instruct checkpoint, loaded once per test session per dtype.

    Tests must not modify the returned model permanently (unpatch what you patch).
    """
    if dtype not in _MODELS:
        from atb.checkpoints import load_model

        _MODELS[dtype] = load_model(dtype=dtype)
    return _MODELS[dtype]


@pytest.fixture(scope="session")
def smollm2_fp32():
    return load_smollm2(torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16():
    return load_smollm2(torch.bfloat16)


@pytest.fixture(scope="session")
def smollm2_q4_k(tmp_path_factory):
    """(fp32 model, tokenizer, path): the embedded SmolLM2 GGUF re-quantized in part as a Q4_K_M file of it would
    be: ffn_down (K = 1536, the one projection width that is a multiple of the K-quants' 256) to Q4_K in even
    layers and Q6_K in odd ones (a Q4_K_M file gives some layers' ffn_down more bits), every attn_v to Q5_0
    (llama.cpp's fallback for rows of other widths), from the file's own Q4_1 values; every attn_output to
    Q5_1, a type with no native form; the other tensors as shipped. The model is what transformers loads from
    that file."""
    import gguf
    from atb.checkpoints import default_model_path, load_model
    from gguf_blocks import copy_gguf, quantize_q4_k, quantize_q6_k

    src = default_model_path()
    replace = {}
    writers = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
    for t in gguf.GGUFReader(src).tensors:
        layer, name = (t.name.split(".", 2)[1:] + [""])[:2] if t.name.startswith("blk.") else ("", t.name)
        kind = {"ffn_down.weight": "Q4_K" if int(layer or 0) % 2 == 0 else "Q6_K", "attn_v.weight": "Q5_0",
                "attn_output.weight": "Q5_1"}.get(name)
        if kind is None:
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
        write = writers.get(kind) or (lambda v, kind=gguf.GGMLQuantizationType[kind]: gguf.quants.quantize(v, kind))
        replace[t.name] = (write(w), gguf.GGMLQuantizationType[kind])
    path = str(tmp_path_factory.mktemp("q4_k") / "SmolLM2-135M-Instruct.Q4_K-Q5_0.gguf")
    copy_gguf(src, path, replace)
    model, tok = load_model(path, dtype=torch.float32, progress=False)
    return model, tok, path


def wait_health(url: str, procs, timeout: float = 180.0) -> None:
    """Waits for the server at ``url`` to answer ``/health``; fails with a process's stderr tail if one of
    ``procs`` (the server's processes) exits first."""
    import httpx

    deadline = time.time() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.2)
