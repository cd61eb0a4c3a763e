"""The linear routing policy: forced modes, and the measurement with its on-disk cache (timings stubbed, so the
decisions are deterministic)."""
import json
import subprocess
import sys

import pytest
import torch

import atb
import atb.kernels.linear  # noqa: F401  (atb.kernels.linear is also a function's name: take the module)
from conftest import forced_isa

routing = sys.modules["atb.kernels.linear"]


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """Measure mode with a private cache directory and a fake clock: native takes `native_us`, torch `torch_us`."""
    monkeypatch.setenv("ATB_CACHE_DIR", str(tmp_path))
    calls = []
    speeds = {"native": 10.0, "torch": 20.0}

    def fake_measure(rows, dtype, k=1024, n=1024, op="linear"):
        calls.append((rows, dtype) if op == "linear" else (rows, dtype, op))
        native = speeds.get(op, speeds["native"])
        return {"rows": rows, "k": k, "n": n, "native_us": native, "torch_us": speeds["torch"],
                "native": native <= speeds["torch"]}

    monkeypatch.setattr(routing, "measure_linear", fake_measure)
    routing._decisions.clear()
    routing.set_routing("measure")
    yield calls, speeds, tmp_path
    routing.set_routing(None)
    routing._decisions.clear()


def test_forced_modes():
    try:
        routing.set_routing("native")
        assert routing.native_linear_wins(4096, torch.float32)
        routing.set_routing("torch")
        assert not routing.native_linear_wins(1, torch.bfloat16)
        routing.set_routing("crossover")
        assert routing.native_linear_wins(31, torch.float32) and not routing.native_linear_wins(32, torch.float32)
        assert routing.native_linear_wins(4096, torch.bfloat16)
    finally:
        routing.set_routing(None)
    with pytest.raises(ValueError, match="set_routing: mode must be one of measure, native, torch, crossover"):
        routing.set_routing("fastest")


def test_measures_once_per_bucket_and_caches_on_disk(measured):
    calls, speeds, tmp_path = measured
    assert routing.native_linear_wins(1, torch.float32)
    assert routing.native_linear_wins(1, torch.float32)
    assert routing.native_linear_wins(5, torch.float32)   # bucket 2-7, measured at 4 rows
    assert routing.native_linear_wins(6, torch.float32)   # same bucket: no new measurement
    assert calls == [(1, torch.float32), (4, torch.float32)]
    data = json.loads((tmp_path / "routing.json").read_text())
    (machine, per_dtype), = data["machines"].items()
    assert atb.build_info()["isa"] in machine and f"{atb.get_num_threads()} threads" in machine
    assert per_dtype["float32"]["1"]["native"] is True and set(per_dtype["float32"]) == {"1", "4"}
    # A new process (here: cleared memory) reads the cache instead of measuring; the file's answer wins.
    per_dtype["float32"]["4"]["native"] = False
    (tmp_path / "routing.json").write_text(json.dumps(data))
    routing._decisions.clear()
    routing.set_routing("measure")
    speeds["native"] = 1e9  # would now lose, but the cached decisions are used
    assert routing.native_linear_wins(1, torch.float32) and not routing.native_linear_wins(4, torch.float32)
    assert len(calls) == 2
    assert atb.build_info()["routing"]["measured"] == {"float32": {"1": "native", "4": "torch"}}


def test_slower_native_routes_to_torch_and_isa_is_part_of_the_key(measured):
    calls, speeds, _ = measured
    speeds["native"] = 30.0
    assert not routing.native_linear_wins(300, torch.bfloat16)
    assert calls == [(512, torch.bfloat16)]
    with forced_isa(next(i for i in atb.available_isas() if i != atb.build_info()["isa"])):
        speeds["native"] = 5.0
        assert routing.native_linear_wins(300, torch.bfloat16)  # another ISA: measured again
    assert not routing.native_linear_wins(300, torch.bfloat16)
    assert len(calls) == 2


def test_unwritable_or_corrupt_cache_is_not_fatal(measured, monkeypatch):
    calls, _, tmp_path = measured
    (tmp_path / "routing.json").write_text("{not json")
    assert routing.native_linear_wins(1, torch.float16)
    monkeypatch.setenv("ATB_CACHE_DIR", str(tmp_path / "file" / "sub"))
    (tmp_path / "file").write_text("a file where a directory should be")
    routing._decisions.clear()
    routing.set_routing("measure")  # forgets the per-call memo too
    assert routing.native_linear_wins(1, torch.float16)
    assert len(calls) == 2


def test_each_op_is_decided_on_its_own(measured):
    # A fused entry can win where the plain GEMM loses (torch pays separate elementwise passes): one decision
    # per (op, bucket, dtype), each cached under its own key, and the layers ask with their op.
    calls, speeds, tmp_path = measured
    speeds.update({"native": 30.0, "swiglu": 12.0})
    assert not routing.native_linear_wins(300, torch.bfloat16)
    assert routing.native_linear_wins(300, torch.bfloat16, "swiglu")
    assert not routing.native_linear_wins(300, torch.bfloat16, "residual")
    assert calls == [(512, torch.bfloat16), (512, torch.bfloat16, "swiglu"), (512, torch.bfloat16, "residual")]
    cached = json.loads((tmp_path / "routing.json").read_text())["machines"]
    keys = set(next(iter(cached.values()))["bfloat16"])
    assert keys == {"512", "swiglu 512", "residual 512"}
    assert routing.measured_decisions()["bfloat16"] == {"512": "torch", "residual 512": "torch", "swiglu 512": "native"}
    x = torch.randn(300, 32).to(torch.bfloat16)
    gate, up, w = (torch.randn(48, 32).to(torch.bfloat16) for _ in range(3))
    from atb.layers import linear as layers
    assert torch.equal(layers.swiglu(x, gate, up), atb.kernels.linear_swiglu(x, gate, up))
    plain = layers.linear(x, w)
    assert torch.equal(plain, torch.nn.functional.linear(x, w))
    speeds["qkv"] = 12.0   # the fused q/k/v launch is its own op too
    fused = layers.linear_multi(x, [w, gate], [None, None])
    assert all(torch.equal(a, b) for a, b in zip(fused, atb.kernels.linear_multi(x, [w, gate])))
    assert calls[-1] == (512, torch.bfloat16, "qkv")
    with pytest.raises(ValueError, match="op must be one of"):
        routing.native_linear_wins(300, torch.bfloat16, "gelu")


@pytest.mark.parametrize("op", routing.ROUTED_OPS)
def test_routing_table_and_real_measurement(tmp_path, monkeypatch, op):
    # The real timer on a small shape: both sides of the op run and a decision lands in the cache.
    monkeypatch.setenv("ATB_CACHE_DIR", str(tmp_path))
    r = routing.measure_linear(3, torch.float32, k=64, n=64, op=op)
    assert r["native_us"] > 0 and r["torch_us"] > 0 and r["native"] == (r["native_us"] <= r["torch_us"])
    routing.set_routing("native")
    try:
        everywhere = {"1": "native", "2-7": "native", "8-31": "native", "32-127": "native", "128-255": "native",
                      ">=256": "native"}
        assert routing.routing_table([torch.float32]) == {"float32": everywhere}
        for o in routing.ROUTED_OPS:
            assert routing.routing_table([torch.float32], o) == {"float32": everywhere}
    finally:
        routing.set_routing(None)


def test_bad_env_mode_is_rejected():
    proc = subprocess.run([sys.executable, "-c", "import atb, torch; atb.kernels.linear_auto(torch.ones(1, 4), "
                           "torch.ones(2, 4))"], capture_output=True, text=True,
                          env={**__import__("os").environ, "ATB_ROUTING": "fast"})
    assert proc.returncode != 0 and "ATB_ROUTING must be one of measure, native, torch, crossover" in proc.stderr
