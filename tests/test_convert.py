"""`atb convert`: bounded memory, exact results, safe writes, one-line errors; the embedded model's cache."""
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

from atb import cli, convert

# A child's ru_maxrss starts at its parent's resident size at fork; pytest is large, so a bare interpreter
# (a few MB) starts the measured command and reports the command's own peak through RUSAGE_CHILDREN.
_LAUNCHER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(r.stderr); sys.stdout.write(r.stdout); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, r.returncode)")


def measured(*argv):
    """(exit status, peak RSS bytes, stdout, stderr) of a command."""
    r = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *argv], capture_output=True, text=True, timeout=600)
    *out, last = r.stdout.strip().splitlines()
    rss, code = map(int, last.split())
    return code, rss, "\n".join(out), r.stderr


def run_convert(*args):
    return subprocess.run([sys.executable, "-m", "atb", "convert", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


# ---------------------------------------------------------------------------------------------- the 300 MB model
@pytest.fixture(scope="module")
def llama300(tmp_path_factory):
    """A random ~280 MB fp32 llama, saved as 4 safetensors shards and as 4 pytorch_model-*.bin shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from atb.bench.convert import CASES

    root = tmp_path_factory.mktemp("llama300")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CASES["300mb"])).eval()
    sd = model.state_dict()
    total = sum(t.numel() * 4 for t in sd.values())
    model.config.save_pretrained(root / "safetensors")
    model.config.save_pretrained(root / "bin")
    names = list(sd)
    groups = [names[i::4] for i in range(4)]  # 4 shards of about 70 MB each
    from safetensors.torch import save_file

    for fmt, pattern, index in (("safetensors", "model-{:05d}-of-00004.safetensors", "model.safetensors.index.json"),
                                ("bin", "pytorch_model-{:05d}-of-00004.bin", "pytorch_model.bin.index.json")):
        weight_map = {}
        for k, group in enumerate(groups):
            fname = pattern.format(k + 1)
            part = {n: sd[n].contiguous() for n in group}
            if fmt == "safetensors":
                save_file(part, root / fmt / fname, metadata={"format": "pt"})
            else:
                torch.save(part, root / fmt / fname)
            weight_map.update({n: fname for n in group})
        (root / fmt / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    largest = max(t.numel() * 4 for t in sd.values())
    return {"model": model, "safetensors": root / "safetensors", "bin": root / "bin", "total": total,
            "largest": largest, "root": root}


@pytest.fixture(scope="module")
def baseline_rss():
    """Peak RSS of an interpreter that imports what `python -m atb convert` imports, and does nothing."""
    code, rss, _, err = measured(sys.executable, "-c", "import torch, tqdm.auto, atb, atb.cli, atb.convert")
    assert code == 0, err
    return rss


@pytest.mark.parametrize("fmt, dtype", [("safetensors", "bfloat16"), ("bin", "float16")])
def test_sharded_conversion_in_bounded_memory_loads_in_stock_hf(llama300, baseline_rss, tmp_path, fmt, dtype):
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    import atb

    src, dst = llama300[fmt], tmp_path / "out"
    max_shard = 50_000_000
    code, rss, out, err = measured(sys.executable, "-m", "atb", "convert", str(src), str(dst), "--dtype", dtype,
                                   "--max-shard-size", str(max_shard), "--quiet")
    assert code == 0, err
    shards = sorted(dst.glob("model-*.safetensors"))
    largest_shard = max(p.stat().st_size for p in shards)
    # Bound: largest tensor (fp32) + one output shard + the interpreter, plus 96 MB: the chunk buffers the
    # writer reuses (a 16 MB read, a 32 MB cast: 48 MB), a 1 MB pipe and allocator slack. The
    # actual use is far below (the writer streams into the file, it never holds a tensor or a shard).
    bound = llama300["largest"] + largest_shard + baseline_rss + (96 << 20)
    assert rss <= bound, (rss, bound)
    assert rss - baseline_rss < llama300["total"] / 3, (rss, baseline_rss)
    assert "tensors in" in out and "peak RSS" in out

    target = getattr(torch, dtype)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    meta = index["metadata"]
    assert meta["dtype"] == dtype and meta["atb_version"] == atb.__version__ and meta["source"] == str(src)
    assert set(index["weight_map"].values()) == {p.name for p in shards} and len(shards) >= 3
    assert largest_shard <= max_shard + (1 << 16)  # data within the limit, plus the JSON header
    with safe_open(str(shards[0]), "pt") as f:
        assert f.metadata()["dtype"] == dtype and f.metadata()["format"] == "pt"
    assert json.loads((dst / "config.json").read_text())["dtype"] == dtype

    got = LlamaForCausalLM.from_pretrained(dst).eval()  # stock HF, dtype from the converted config
    assert got.dtype == target
    ref = {k: v.to(target) for k, v in llama300["model"].state_dict().items()}
    sd = got.state_dict()
    assert set(sd) == set(ref)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k
    # model.to(dtype) also casts the rotary inv_freq buffer, which from_pretrained(dtype=...) keeps in fp32; the
    # logits are compared with the source loaded the HF way in the same dtype.
    stock = LlamaForCausalLM.from_pretrained(src, dtype=target).eval()
    ids = torch.randint(0, 32000, (2, 24))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, stock(ids).logits)


def test_float32_round_trip_keeps_every_bit(llama300, tmp_path):
    s = convert.convert(str(llama300["safetensors"]), str(tmp_path / "f32"), "float32", progress=False)
    assert s.tensors == len(llama300["model"].state_dict()) and s.bytes_out > s.bytes_in
    from safetensors.torch import load_file

    ref = llama300["model"].state_dict()
    for p in (tmp_path / "f32").glob("*.safetensors"):
        for k, v in load_file(p).items():
            assert torch.equal(v, ref[k]), k


# ---------------------------------------------------------------------------------------------- safe writes
@pytest.fixture
def tiny(tmp_path):
    """A tiny llama in 3 safetensors shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="150KB")
    assert len(list(src.glob("*.safetensors"))) >= 3
    return src


def leftovers(dst):
    """DST and any partial output next to it."""
    return sorted(p.name for p in dst.parent.iterdir() if p.name == dst.name or p.name.startswith(f".{dst.name}."))


def one_error(capsys, argv):
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse rejects a bad value while parsing
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("atb: error:"), err
    return err[0]


def _shard_of(src, tensor):
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return src / index["weight_map"][tensor]


def test_truncated_shard_names_file_and_tensor(tiny, tmp_path, capsys):
    shard = sorted(tiny.glob("model-*.safetensors"))[1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with open(shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    dst = tmp_path / "out"
    err = one_error(capsys, ["convert", str(tiny), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert shard.name in err and f"'{last}'" in err and "truncated" in err
    assert leftovers(dst) == []


def test_corrupt_header_names_file(tiny, tmp_path, capsys):
    shard = sorted(tiny.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    dst = tmp_path / "out"
    err = one_error(capsys, ["convert", str(tiny), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert shard.name in err and "corrupt" in err
    assert leftovers(dst) == []


def test_missing_shard_named_in_index(tiny, tmp_path, capsys):
    shard = _shard_of(tiny, "lm_head.weight")
    shard.unlink()
    dst = tmp_path / "out"
    err = one_error(capsys, ["convert", str(tiny), str(dst), "--dtype", "float16", "--quiet"])
    assert shard.name in err and "missing shard" in err and "'lm_head.weight'" in err
    assert leftovers(dst) == []


def test_unsupported_dtype_names_tensor(tmp_path, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"a.weight": torch.ones(4), "b.scale": torch.ones(4).to(torch.float8_e4m3fn)}, src / "model.safetensors")
    dst = tmp_path / "out"
    err = one_error(capsys, ["convert", str(src), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert "model.safetensors" in err and "'b.scale'" in err and "F8_E4M3" in err
    torch.save({"w": torch.ones(2, dtype=torch.complex64)}, src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    err = one_error(capsys, ["convert", str(src), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert "pytorch_model.bin" in err and "'w'" in err and "complex64" in err
    assert leftovers(dst) == []


@pytest.mark.parametrize("route", ["splice", "write", "splice fails"])
def test_small_and_mixed_tensors_keep_their_order_on_every_write_route(tmp_path, monkeypatch, route):
    """Casts share the buffer across tensors (tiny chunks here, so a tensor spans several writes and several
    tensors share one), with tensors stored as they are in between; the bytes reach the file by vmsplice +
    splice, by write where splice is missing, and by write after a splice fails half-way."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(convert, "CHUNK_BYTES", 4096)
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3000, generator=g), "b": torch.arange(10), "c": torch.randn(5, 7, generator=g).half(),
               "d": torch.tensor([True, False, True, True]), "e": torch.empty(0), "f": torch.randn(1000, generator=g),
               "g": torch.randn(2000, generator=g).bfloat16(), "h": torch.randn(300, generator=g).double()}
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file(tensors, src / "model.safetensors")
    splices = []
    real_splice = os.splice
    if route == "write":
        monkeypatch.delattr(os, "splice")
    elif route == "splice fails":
        def failing(*args):
            splices.append(args)
            raise OSError(22, "Invalid argument")
        monkeypatch.setattr(os, "splice", failing)
    else:
        monkeypatch.setattr(os, "splice", lambda *args: splices.append(args) or real_splice(*args))
    convert.convert(str(src), str(tmp_path / "out"), "bfloat16", progress=False)
    assert (route == "write") == (not splices)
    got = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_truncated_bin_names_file(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    torch.save({"w": torch.ones(1000)}, src / "pytorch_model.bin")
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    dst = tmp_path / "out"
    err = one_error(capsys, ["convert", str(src), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert "pytorch_model.bin" in err and "not a readable torch checkpoint" in err
    assert leftovers(dst) == []


def test_existing_destination_needs_force(tiny, tmp_path, capsys):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep").write_text("x")
    err = one_error(capsys, ["convert", str(tiny), str(dst), "--dtype", "bfloat16", "--quiet"])
    assert "already exists" in err and "--force" in err and (dst / "keep").exists()
    assert cli.main(["convert", str(tiny), str(dst), "--dtype", "bfloat16", "--quiet", "--force"]) == 0
    assert not (dst / "keep").exists() and (dst / "model.safetensors.index.json").exists()
    assert leftovers(dst) == ["out"]
    err = one_error(capsys, ["convert", str(tiny), str(tmp_path / "no" / "such" / "out"), "--dtype", "bfloat16"])
    assert "does not exist" in err
    err = one_error(capsys, ["convert", str(tmp_path / "nothing"), str(tmp_path / "o2"), "--dtype", "bfloat16"])
    assert "not found" in err
    err = one_error(capsys, ["convert", str(tiny), str(tmp_path / "o3"), "--dtype", "int8"])
    assert "--dtype" in err
    err = one_error(capsys, ["convert", str(tiny), str(tmp_path / "o3"), "--dtype", "float16", "--max-shard-size", "x"])
    assert "--max-shard-size" in err


# A conversion that slows to 5 s per chunk read after its first two, so the test can kill it mid-way.
_STALLING = ("import sys, time, atb.convert as c\n"
             "make, calls = c._SafetensorsFile._reader, []\n"
             "def reader(self, begin, dtype):\n"
             "    read = make(self, begin, dtype)\n"
             "    def slow(*a):\n"
             "        calls.append(1)\n"
             "        if len(calls) > 2: time.sleep(5)\n"
             "        return read(*a)\n"
             "    return slow\n"
             "c._SafetensorsFile._reader = reader\n"
             "from atb.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_conversion_leaves_no_destination(tiny, tmp_path, sig):
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _STALLING, "convert", str(tiny), str(dst), "--dtype", "bfloat16",
                          "--quiet"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(n.startswith(".out.atb-partial-") for n in os.listdir(tmp_path)):
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(sig)
    p.wait(timeout=60)
    assert not dst.exists()
    if sig == signal.SIGTERM:  # unwinds: the partial directory is removed too
        assert p.returncode == 130 and "interrupted" in p.stderr.read()
        assert leftovers(dst) == []
    # The next conversion (any process) removes a dead one's partial output and succeeds.
    r = run_convert(tiny, dst, "--dtype", "bfloat16", "--quiet")
    assert r.returncode == 0, r.stderr
    assert leftovers(dst) == ["out"]


def test_directory_without_index(tiny, tmp_path):
    from safetensors.torch import load_file

    (tiny / "model.safetensors.index.json").unlink()
    s = convert.convert(str(tiny), str(tmp_path / "out"), "float16", max_shard_size="1GB", progress=False)
    ref = {}
    for p in tiny.glob("*.safetensors"):
        ref.update(load_file(p))
    got = load_file(tmp_path / "out" / "model-00001-of-00001.safetensors")
    assert s.shards == 1 and set(got) == set(ref)
    assert all(torch.equal(got[k], ref[k].to(torch.float16)) for k in ref)


def test_size_parsing():
    assert convert.parse_size("2GB") == 2_000_000_000
    assert convert.parse_size("500MB") == 500_000_000
    assert convert.parse_size("1.5GiB") == int(1.5 * 2**30)
    assert convert.parse_size("1000") == 1000
    for bad in ("", "GB", "-1MB", "0", "2XB"):
        with pytest.raises(convert.ConvertError):
            convert.parse_size(bad)


# ---------------------------------------------------------------------------------------------- GGUF and the cache
def test_cached_embedded_model_is_bit_identical_to_gguf_load(tmp_path):
    from atb import checkpoints

    gguf_path = checkpoints.default_model_path()
    t0 = time.perf_counter()
    model, tok = checkpoints.load_model(progress=False)  # converts into the cache on first use
    first = time.perf_counter() - t0
    cached = os.path.join(checkpoints.cache_dir(), checkpoints._file_hash(gguf_path))
    assert os.path.isfile(os.path.join(cached, "model.safetensors.index.json"))
    assert model.config.name_or_path == cached
    t0 = time.perf_counter()
    model, tok = checkpoints.load_model(progress=False)
    second = time.perf_counter() - t0
    assert second < 15, (first, second)

    # transformers' own GGUF loader, as a user without atb would load the file.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gdir, gname = os.path.split(gguf_path)
    direct = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32)
    dtok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    a, b = model.state_dict(), direct.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert model.config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True) == dtok.apply_chat_template(
        chat, add_generation_prompt=True)
    assert model.generation_config.eos_token_id == direct.generation_config.eos_token_id
    # bf16 goes through the same fp32 values, cast once, in both paths.
    bf, _ = checkpoints.load_model(dtype=torch.bfloat16, progress=False)
    assert all(torch.equal(x, y.to(torch.bfloat16)) for x, y in zip(bf.state_dict().values(), b.values()))
    # An explicit GGUF path (not cached) is converted to the requested dtype for the load: the same tensors.
    once, _ = checkpoints.load_model(gguf_path, dtype=torch.bfloat16, progress=False)
    assert all(torch.equal(x, y) for x, y in zip(once.state_dict().values(), bf.state_dict().values()))
    meta = json.loads(open(os.path.join(cached, "model.safetensors.index.json")).read())["metadata"]
    assert meta["source_format"] == "gguf" and meta["dtype"] == "float32"


def test_cache_dir_follows_environment(tmp_path, monkeypatch):
    from atb import checkpoints

    monkeypatch.setenv("ATB_CACHE_DIR", str(tmp_path / "c"))
    assert checkpoints.cache_dir() == str(tmp_path / "c")
    monkeypatch.delenv("ATB_CACHE_DIR")
    assert checkpoints.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "atb")


def test_load_model_errors_name_the_problem(tmp_path):
    from atb import checkpoints

    with pytest.raises(checkpoints.ModelLoadError, match="config.json is missing"):
        checkpoints.load_model(str(tmp_path))
    with pytest.raises(checkpoints.ModelLoadError, match="not found"):
        checkpoints.load_model(str(tmp_path / "nope"))
