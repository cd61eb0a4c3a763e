"""The SoC table, thread pool, SIMD selection and UB budget."""
import pytest
import torch

import atb
from atb import _C
from conftest import forced_isa


def test_soc_table_facts():
    s = atb.get_soc("Ascend910B4")
    assert (s.cube_core_num, s.vector_core_num, s.ub_size, s.l1_size, s.supports_bf16) == (20, 40, 192 * 1024, 512 * 1024, True)
    assert atb.get_soc("Ascend910B1").vector_core_num == 48
    assert not atb.get_soc("Ascend910").supports_bf16
    assert not atb.get_soc("Ascend310P3").supports_bf16
    assert atb.get_soc("Ascend310P").ub_size == atb.get_soc("Ascend310P3").ub_size
    # ATB's rule: the exact name Ascend910B is 910A-class (no bf16, 32 cores).
    b = atb.get_soc("Ascend910B")
    assert (b.vector_core_num, b.supports_bf16) == (32, False)
    h = atb.get_soc("host")
    assert h.vector_core_num == atb.get_num_threads() and h.supports_bf16


def test_unknown_soc_lists_valid_names():
    with pytest.raises(ValueError, match="Ascend910B4.*host|host.*Ascend910B4"):
        atb.get_soc("Ascend999")
    with pytest.raises(ValueError):
        atb.set_soc("nope")
    with pytest.raises(TypeError):
        atb.get_soc(910)


def test_set_soc_changes_default():
    atb.set_soc("Ascend910B3")
    assert atb.get_soc().name == "Ascend910B3"
    atb.set_soc("host")


def test_threads_roundtrip():
    n = atb.get_num_threads()
    atb.set_num_threads(1)
    assert atb.get_num_threads() == 1 and atb.get_soc("host").vector_core_num == 1
    x = torch.randn(64, 576)
    w = torch.randn(576)
    y1 = atb.kernels.rms_norm(x, w, soc_type="Ascend910B4")
    atb.set_num_threads(3)
    y3 = atb.kernels.rms_norm(x, w, soc_type="Ascend910B4")
    atb.set_num_threads(n)
    assert torch.equal(y1, y3)
    with pytest.raises(ValueError):
        atb.set_num_threads(0)


def test_build_info_reports_isa():
    with forced_isa("auto"):  # the fastest this CPU runs, whatever table the run forced
        info = atb.build_info()
    assert info["isa"] in ("avx512-amx", "avx512", "avx2", "portable")
    assert info["isa"] == info["available_isas"][0] and "portable" in info["available_isas"]
    assert "num_threads" in info and "cpu_features" in info


def test_portable_and_simd_paths_agree():
    x = torch.randn(33, 4097)
    w = torch.randn(4097)
    active = _C.isa()
    y_fast = atb.kernels.rms_norm(x, w)
    with forced_isa("portable"):
        y_port = atb.kernels.rms_norm(x, w)
    assert _C.isa() == active
    torch.testing.assert_close(y_fast, y_port, atol=1e-5, rtol=1e-5)


def test_many_launches_do_not_deadlock():
    x = torch.randn(4096, 64)
    w = torch.randn(64)
    for _ in range(2000):
        atb.kernels.rms_norm(x[:97], w, soc_type="Ascend910B1")


@pytest.fixture(params=["pool", "openmp"])
def threading_backend(request):
    atb.set_threading(request.param)
    yield request.param
    atb.set_threading("auto")


def _launch_in_child(conn, x, w, want):
    torch.set_num_threads(1)  # torch's own OpenMP team is not usable after a fork; only atb's pool is tested
    atb.set_num_threads(2)    # as the fuzz test's children do (with 1): it replaces the pool
    conn.send(torch.equal(atb.kernels.rms_norm(x, w, soc_type="Ascend910B1"), want))


def test_forked_child_launches_after_the_parent_used_the_pool():
    # The child of a fork has the parent's pool object but none of its threads: replacing that pool
    # (set_num_threads) joined threads that do not exist, and launching on it waited for them. Under
    # "auto" a decode graph step creates the pool, and the fuzz test forks its children after such steps.
    import multiprocessing as mp
    import time

    atb.set_threading("pool")
    try:
        x, w = torch.randn(257, 1000), torch.randn(1000)
        want = atb.kernels.rms_norm(x, w, soc_type="Ascend910B1")   # the pool exists, its workers spin
        time.sleep(0.05)                                    # ... then sleep on the condition variable
        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_launch_in_child, args=(send, x, w, want), daemon=True)
        child.start()
        send.close()
        answered = recv.poll(60)
        if not answered:
            child.kill()
        child.join(10)
        assert answered, "a forked child's first launch hung"
        assert recv.recv() is True
        assert child.exitcode == 0
    finally:
        atb.set_threading("auto")


def test_threading_backends_report_and_reject_bad_names():
    assert atb.build_info()["threading"].startswith("openmp")   # torch's OpenMP runtime is loaded
    with pytest.raises(ValueError, match="backend"):
        atb.set_threading("tbb")


def test_backends_give_identical_results(threading_backend):
    torch.manual_seed(0)
    x, w = torch.randn(257, 1000), torch.randn(1000)
    q, k = torch.randn(9, 4, 64), torch.randn(9, 2, 64)
    cos, sin = torch.randn(9, 64), torch.randn(9, 64)
    got = [atb.kernels.rms_norm(x, w, soc_type="Ascend910B1"),
           atb.kernels.rope(q, k, cos, sin, soc_type="Ascend910B1")[0]]
    atb.set_threading("pool")
    want = [atb.kernels.rms_norm(x, w, soc_type="Ascend910B1"),
            atb.kernels.rope(q, k, cos, sin, soc_type="Ascend910B1")[0]]
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_block_errors_propagate_from_every_backend(threading_backend, threads):
    n = atb.get_num_threads()
    atb.set_num_threads(threads)
    try:
        soc = atb.get_soc("Ascend910B4")
        _C._ub_carve_probe(soc.ub_size, soc, block_dim=7)
        with pytest.raises(ValueError, match="UB"):
            _C._ub_carve_probe(soc.ub_size + 1, soc, block_dim=7)
        _C._ub_carve_probe(soc.ub_size, soc, block_dim=7)   # the launcher is usable after an error
    finally:
        atb.set_num_threads(n)


def test_torch_ops_and_launches_interleave(threading_backend):
    # torch's parallel ops and kernel launches alternate on the same cores (the decode pattern).
    x, w = torch.randn(4096, 64), torch.randn(64)
    big = torch.randn(1 << 20)
    for _ in range(300):
        big.add_(1.0)
        atb.kernels.rms_norm(x[:97], w, soc_type="Ascend910B1")


def test_launches_from_several_python_threads(threading_backend):
    # Each caller thread gets its own team (openmp) or takes turns on the pool; results stay exact.
    import threading

    torch.manual_seed(1)
    xs = [torch.randn(257, 1000) for _ in range(3)]
    w = torch.randn(1000)
    want = [atb.kernels.rms_norm(x, w, soc_type="Ascend910B1") for x in xs]
    errors = []

    def work(i):
        for _ in range(100):
            if not torch.equal(atb.kernels.rms_norm(xs[i], w, soc_type="Ascend910B1"), want[i]):
                errors.append(i)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a launch hung"
    assert not errors


def test_engine_steps_off_the_main_thread_launch_on_the_pool_and_restore():
    import threading

    from atb.runtime import pool_launches_off_main_thread
    x, w = torch.randn(40, 96), torch.randn(24, 96)
    want = atb.kernels.linear(x, w)
    seen = {}

    def worker():
        with pool_launches_off_main_thread():
            seen["inside"] = _C.set_thread_prefers_pool(True)  # the scope set it
            seen["y"] = atb.kernels.linear(x, w)
        seen["after"] = _C.set_thread_prefers_pool(False)      # and restored it on exit

    t = threading.Thread(target=worker)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert seen["inside"] is True and seen["after"] is False
    assert torch.equal(seen["y"], want)
    with pool_launches_off_main_thread():  # the main thread stays as it was
        assert _C.set_thread_prefers_pool(False) is False
