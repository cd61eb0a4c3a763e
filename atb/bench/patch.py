"""Benchmark: ``atb.patch_hf_model`` vs the stock HF model, ``generate`` side by side in one run.

    python -m atb.bench.patch [--dtypes float32,bfloat16] [--prompt 128] [--new 128] [--repeats 3]

SmolLM2-135M-Instruct (the embedded checkpoint), batch 1, a ``--prompt``-token
prompt, ``--new`` greedy tokens (EOS suppressed so every run decodes the same
count). For each dtype, stock and patched runs alternate (same process, same
weights) and the medians are reported:

* prefill tok/s = prompt tokens / time of ``generate(max_new_tokens=1)``;
* decode tok/s = (new - 1) / (time of the full run - that prefill time).

Then a per-module breakdown of one prefill (ms per prompt) and of one decode
run (ms per generated token), with
timers around norm modules, rope (HF's ``apply_rotary_pos_emb`` / the fused
rope kernel), the attention core (the attention-interface function incl. its
mask handling), the attention module's remainder (q/k/v/o projections, cache
update, glue), MLP modules and the LM head; "other" is the HF model loop,
embedding, residual adds, sampling and ``generate`` bookkeeping. Timers add
~1 us per call, the same on both sides.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import torch

import atb


def _prompt_ids(tokenizer, n: int) -> torch.Tensor:
    text = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
            "books were made, sold and read across Europe. ")
    ids = tokenizer(text * (n // 8 + 2), return_tensors="pt").input_ids[:, :n]
    if ids.shape[1] != n:
        raise SystemExit(f"could not build a {n}-token prompt")
    return ids


def _generate(model, ids, new: int, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, pad_token_id=0, **kw)


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class _Timers:
    """Accumulates wall time per category while ``active`` (the decode steps of one generate call)."""

    def __init__(self, phase: str = "decode"):
        self.total: dict[str, float] = {}
        self.active = False
        self.phase = phase
        self.puts = 0
        self.start = self.stop = 0.0

    def wrap(self, name, fn):
        total = self.total
        total.setdefault(name, 0.0)
        perf = time.perf_counter

        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            t = perf()
            try:
                return fn(*args, **kwargs)
            finally:
                total[name] += perf() - t
        return timed

    # generate's streamer protocol: put(prompt), put(token 1) after prefill, ..., end(). The decode
    # window opens at the first generated token.
    # Prefill: the window opens at put(prompt) and closes at the first generated token.
    def put(self, value):
        self.puts += 1
        if self.puts == (1 if self.phase == "prefill" else 2):
            self.active, self.start = True, time.perf_counter()
        elif self.puts == 2 and self.phase == "prefill":
            self.end()

    def end(self):
        if self.active:
            self.active, self.stop = False, time.perf_counter()


@contextmanager
def _instrument(model, timers: _Timers):
    """Timers around the modules and functions of each category; everything is restored on exit."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modeling = sys.modules[type(model).__module__]
    undo = []

    def wrap_forward(mod, name):
        had = "forward" in mod.__dict__
        previous = mod.__dict__.get("forward")
        mod.forward = timers.wrap(name, mod.forward)
        undo.append(lambda: setattr(mod, "forward", previous) if had else mod.__dict__.pop("forward"))

    def wrap_attr(owner, attr, name):
        previous = getattr(owner, attr)
        setattr(owner, attr, timers.wrap(name, previous))
        undo.append(lambda: setattr(owner, attr, previous))

    for mod in model.modules():
        cls = type(mod).__name__
        if cls.endswith("RMSNorm"):
            wrap_forward(mod, "norm")
        elif cls.endswith("MLP"):
            wrap_forward(mod, "mlp")
        elif cls.endswith("Attention"):
            wrap_forward(mod, "attention module")
        elif cls.endswith("RotaryEmbedding"):
            wrap_forward(mod, "rope table")
    wrap_forward(model.lm_head, "lm_head")
    # Rope application: HF's module-level function (stock) and the kernel the patched forward calls.
    wrap_attr(modeling, "apply_rotary_pos_emb", "rope apply")
    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    for key in ("sdpa", atb.patch.ATTN_NAME):
        if key in mapping:
            previous = mapping[key]
            mapping[key] = timers.wrap("attention core", previous)
            undo.append(lambda key=key, previous=previous: mapping.__setitem__(key, previous))
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _breakdown(model, ids, new: int, patch: bool, phase: str = "decode") -> dict[str, float]:
    """ms per generated token (decode) or per prompt (prefill) in each category."""
    timers = _Timers(phase)
    kernels = atb.kernels
    # Kernels the patched forwards reach outside a timed module: rope inside the attention forward (timed
    # apart from it), and the MLP's projections that the decoder layer runs itself (fused residual add).
    bound = {"rope": "rope apply", "linear_swiglu": "mlp", "linear_residual": "mlp"}
    saved = {name: getattr(kernels, name) for name in bound}
    if patch:
        for name, category in bound.items():
            setattr(kernels, name, timers.wrap(category, saved[name]))
        atb.patch_hf_model(model)
    try:
        with _instrument(model, timers):
            _generate(model, ids, 1 if phase == "prefill" else new, streamer=timers)
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
        if patch:
            atb.unpatch_hf_model(model)
    steps = new - 1 if phase == "decode" else 1
    dec = {k: v / steps * 1e3 for k, v in timers.total.items()}
    # Nested timers: rope application and the core run inside the attention module; keep its remainder.
    dec["attention module"] -= dec.get("rope apply", 0.0) + dec.get("attention core", 0.0)
    dec["rope"] = dec.pop("rope apply", 0.0) + dec.pop("rope table", 0.0)
    dec["total"] = (timers.stop - timers.start) / steps * 1e3
    dec["other"] = dec["total"] - sum(v for k, v in dec.items() if k != "total")
    return dec


def run(dtypes, prompt: int, new: int, repeats: int) -> None:
    from atb.checkpoints import load_model

    print(f"atb.bench.patch: SmolLM2-135M-Instruct, batch 1, {prompt}-token prompt, {new} new tokens (greedy), "
          f"medians of {repeats}; threads={atb.get_num_threads()}, isa={atb.build_info()['isa']}")
    for dtype in dtypes:
        model, tokenizer = load_model(dtype=dtype)
        ids = _prompt_ids(tokenizer, prompt)
        # Same tokens both ways (the patch is checked, not assumed).
        ref = _generate(model, ids, min(new, 32))
        atb.patch_hf_model(model)
        same = torch.equal(_generate(model, ids, min(new, 32)), ref)
        atb.unpatch_hf_model(model)
        res = {"stock": {"pre": [], "tot": []}, "patched": {"pre": [], "tot": []}}
        for _ in range(repeats):
            for side in ("stock", "patched"):
                if side == "patched":
                    atb.patch_hf_model(model)
                res[side]["pre"].append(_time(lambda: _generate(model, ids, 1)))
                res[side]["tot"].append(_time(lambda: _generate(model, ids, new)))
                if side == "patched":
                    atb.unpatch_hf_model(model)
        name = str(dtype).replace("torch.", "")
        print(f"\n[{name}] greedy tokens identical to stock (first {min(new, 32)}): {same}")
        rates = {}
        for side, r in res.items():
            pre = statistics.median(r["pre"])
            dec = statistics.median([t - p for t, p in zip(r["tot"], r["pre"])])
            rates[side] = (prompt / pre, (new - 1) / dec)
            print(f"  {side:<8} prefill {rates[side][0]:8.1f} tok/s   decode {rates[side][1]:7.2f} tok/s")
        print(f"  speedup  prefill {rates['patched'][0] / rates['stock'][0]:8.2f}x      "
              f"decode {rates['patched'][1] / rates['stock'][1]:7.2f}x")
        for phase, unit in (("prefill", "ms per prompt"), ("decode", "ms per token")):
            stock_b = _breakdown(model, ids, new, patch=False, phase=phase)
            patched_b = _breakdown(model, ids, new, patch=True, phase=phase)
            print(f"  {phase} breakdown, {unit:<14}   stock   patched")
            for key in ("norm", "rope", "attention core", "attention module", "mlp", "lm_head", "other", "total"):
                label = "attention (q/k/v/o proj, cache)" if key == "attention module" else key
                print(f"    {label:<31} {stock_b.get(key, 0.0):7.2f}  {patched_b.get(key, 0.0):7.2f}")
        del model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    run(dtypes, a.prompt, a.new, a.repeats)


if __name__ == "__main__":
    main()
