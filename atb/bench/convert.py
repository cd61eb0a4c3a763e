"""Benchmark of ``atb convert``: time, peak RSS and throughput against a plain file copy.

Run: ``python -m atb.bench.convert``. For each case a random-weight fp32 LLaMA checkpoint
is generated tensor by tensor into a scratch directory (never held in memory), then, in
the same run, (1) its shard files are copied with ``shutil.copyfile`` and (2) it is
converted to bf16 by ``python -m atb convert`` in a child process (peak RSS from
``getrusage(RUSAGE_CHILDREN)`` in a small launcher; time from the conversion's summary,
which leaves out interpreter start-up, shown separately as wall time), alternating
``--repeat`` times; times are medians, peak RSS the largest. Throughput is
source bytes per second; the copy reads the same bytes and writes twice as many as the
bf16 conversion. Both read from the page cache (the checkpoint
was just written), so this compares CPU work, not disk. The interpreter baseline is the
peak RSS of a child that only imports what the conversion imports.

Cases: ``300mb`` (hidden 512, 12 layers, 32k vocab: 4 shards, both safetensors and
pytorch_model*.bin) and ``tinyllama`` (TinyLlama-1.1B shapes: 4.4 GB fp32 in 1 GB shards).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from atb.convert import SourceTensor, plan_shards, write_index, write_shards

CASES = {
    "300mb": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                      tie_word_embeddings=False),
}
SOURCE_SHARD = {"300mb": 80_000_000, "tinyllama": 1_000_000_000}


def synthetic_tensors(config) -> list[SourceTensor]:
    """The parameters of a LLaMA of ``config``'s shape, as sources that produce random fp32 values chunk by chunk."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in LlamaForCausalLM(config).named_parameters()]
    out = []
    for i, (name, shape) in enumerate(shapes):
        def read(start: int, stop: int, scratch=None, i=i) -> torch.Tensor:
            g = torch.Generator().manual_seed(i * 1_000_003 + start)
            return torch.randn(stop - start, generator=g) * 0.02
        out.append(SourceTensor(name, "<random>", torch.float32, shape, 4 * int(torch.Size(shape).numel()), read=read))
    return out


def make_checkpoint(case: str, directory: str, fmt: str = "safetensors") -> int:
    """Writes the random fp32 checkpoint of ``case`` into ``directory``; returns its weight bytes."""
    from transformers import LlamaConfig

    config = LlamaConfig(**CASES[case])
    os.makedirs(directory)
    config.save_pretrained(directory)
    tensors = synthetic_tensors(config)
    shards = plan_shards(tensors, torch.float32, SOURCE_SHARD[case])
    if fmt == "safetensors":
        weight_map, _ = write_shards(directory, shards, torch.float32, {"format": "pt"}, progress=False)
        write_index(directory, tensors, torch.float32, weight_map, {})
    else:  # one shard in memory at a time: only the small case is generated this way
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"pytorch_model-{k + 1:05d}-of-{len(shards):05d}.bin"
            torch.save({t.name: t.read(0, t.numel).view(t.shape) for t in shard}, os.path.join(directory, fname))
            weight_map.update({t.name: fname for t in shard})
        with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return sum(t.nbytes for t in tensors)


# A child's ru_maxrss starts at its parent's resident size when it forks, so a child of this (large) process
# would report this process's peak. A bare interpreter (a few MB) starts the measured command and reports
# the command's own getrusage(RUSAGE_CHILDREN).
_LAUNCHER = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "r = subprocess.run(sys.argv[1:]); "
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
             "r.returncode)")


def run_child(argv: list[str]) -> tuple[float, int, int, str, str]:
    """(wall seconds, peak RSS bytes, exit status, stdout, stderr) of a command."""
    r = subprocess.run([sys.executable, "-S", "-c", _LAUNCHER, *argv], capture_output=True, text=True)
    *out, last = r.stdout.strip().splitlines()
    seconds, rss, code = last.split()
    return float(seconds), int(rss), int(code), "\n".join(out), r.stderr


def summary_seconds(line: str) -> float:
    """The conversion's own time from its summary line ("... 282.1 MB in, ... 0.07 s (4031 MB/s read)"): the
    bytes over the rate, which has four significant digits where the seconds have two decimals (a 70 ms
    conversion would be known to 7%). The wall time adds interpreter start-up and imports."""
    m = re.search(r"([\d.]+) MB in, .* ([\d.]+) s \((\d+) MB/s read\)", line)
    megabytes, seconds, rate = float(m.group(1)), float(m.group(2)), int(m.group(3))
    return megabytes / rate if rate else seconds


def baseline_rss() -> int:
    return run_child([sys.executable, "-c", "import torch, atb, atb.cli, atb.convert"])[1]


def copy_seconds(src: str, dst: str) -> float:
    os.makedirs(dst)
    t0 = time.perf_counter()
    for f in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return time.perf_counter() - t0


def bench_case(case: str, fmt: str, work: str, repeat: int = 3) -> dict:
    """Copy and conversion alternate ``repeat`` times on the same checkpoint (the machine may be shared: medians
    of interleaved runs, not one of each)."""
    import statistics

    src, dst, cp = (os.path.join(work, f"{case}-{fmt}-{x}") for x in ("fp32", "bf16", "copy"))
    for d in (src, dst, cp):
        shutil.rmtree(d, ignore_errors=True)
    nbytes = make_checkpoint(case, src, fmt)
    src_bytes = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    copies, convs, walls, rsss = [], [], [], []
    for _ in range(repeat):
        # Each timed run starts with no dirty pages: otherwise it pays for writing back the previous run's output
        # (or the freshly generated checkpoint), which belongs to neither.
        os.sync()
        copies.append(copy_seconds(src, cp))
        shutil.rmtree(cp)
        shutil.rmtree(dst, ignore_errors=True)
        os.sync()
        wall, rss, code, out, err = run_child([sys.executable, "-m", "atb", "convert", src, dst, "--dtype",
                                               "bfloat16", "--quiet"])
        if code != 0:
            raise RuntimeError(f"convert failed ({code}): {err.strip()}")
        convs.append(summary_seconds(out))
        walls.append(wall)
        rsss.append(rss)
    largest = max(os.path.getsize(os.path.join(dst, f)) for f in os.listdir(dst))
    shutil.rmtree(dst)
    shutil.rmtree(src)
    t_copy, t_conv, rss = statistics.median(copies), statistics.median(convs), max(rsss)
    return {"case": case, "format": fmt, "model_bytes": nbytes, "repeat": repeat, "convert_s": t_conv,
            "wall_s": statistics.median(walls), "copy_s": t_copy, "convert_s_all": convs, "copy_s_all": copies,
            "convert_mb_s": src_bytes / t_conv / 1e6, "copy_mb_s": src_bytes / t_copy / 1e6,
            "vs_copy": t_copy / t_conv, "peak_rss": rss, "rss_fraction": rss / nbytes,
            "largest_output_file": largest}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m atb.bench.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="300mb,tinyllama", help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--workdir", default=None, help="scratch directory for the generated checkpoints "
                                                   "(default: a new one under the system temp dir)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved copy/convert runs per case (medians; "
                                                           "default 3)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            p.error(f"unknown case '{c}'; known: {', '.join(CASES)}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: directory does not exist")
    if args.repeat < 1:
        p.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.workdir and not os.path.isdir(args.workdir):
        p.error(f"--workdir {args.workdir}: not a directory")

    work = tempfile.mkdtemp(prefix="atb-bench-convert-", dir=args.workdir)
    try:
        base = baseline_rss()
        print(f"interpreter baseline (import torch + atb): peak RSS {base / 1e6:.0f} MB; "
              f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
        print(f"{'case':<10}{'source':<13}{'model MB':>9}{'convert s':>10}{'MB/s':>7}{'copy s':>8}{'copy MB/s':>10}"
              f"{'vs copy':>8}{'peak RSS MB':>12}{'RSS/model':>10}{'wall s':>8}")
        rows = []
        for case in cases:
            for fmt in (("safetensors", "bin") if case == "300mb" else ("safetensors",)):
                r = bench_case(case, fmt, work, args.repeat)
                r["baseline_rss"] = base
                rows.append(r)
                print(f"{case:<10}{fmt:<13}{r['model_bytes'] / 1e6:>9.0f}{r['convert_s']:>10.2f}"
                      f"{r['convert_mb_s']:>7.0f}{r['copy_s']:>8.2f}{r['copy_mb_s']:>10.0f}{r['vs_copy']:>7.2f}x"
                      f"{r['peak_rss'] / 1e6:>12.0f}{100 * r['rss_fraction']:>9.1f}%{r['wall_s']:>8.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
