"""End-to-end prefill and decode throughput: HF stock, patch_hf_model, TransformerInfer.

Prefill time is a generate of one new token; decode tok/s is the remaining
(new_tokens - 1) steps per sequence over the rest of the time. Everything runs
side by side in one process on the same prompts; medians over repeats.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from atb.bench.roofline import decode_step_bytes, generate_rates, median_seconds


@dataclass
class E2ERow:
    engine: str
    batch: int
    prompt_len: int
    new_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_vs_stock: float
    roofline: float  # decode tok/s over (bandwidth / bytes read per decode step)

    def as_dict(self) -> dict:
        return asdict(self)


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    # Ids from the middle of the vocabulary: ordinary tokens, no specials.
    return torch.randint(100, vocab - 100, (batch, prompt_len), generator=g).tolist()


def _hf_generate(model, prompts, n):
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)


def end_to_end(model, *, prompt_len: int, new_tokens: int, batch: int, repeat: int, soc_type: str, machine,
               progress=None) -> list[E2ERow]:
    import atb

    n = max(2, new_tokens)
    vocab = model.config.vocab_size
    one = _prompts(vocab, 1, prompt_len)
    many = _prompts(vocab, batch, prompt_len)
    results = []

    def add(engine, b, t1, tn):
        pre, dec = generate_rates(t1, tn, b, prompt_len, n)
        limit = b * machine.bandwidth / decode_step_bytes(model, b, prompt_len + n // 2)
        results.append(E2ERow(engine, b, prompt_len, n, pre, dec, 0.0, dec / limit))

    # A prefill (generate with one new token) is cheap: more repeats steady its median on a noisy machine.
    repeat_prefill = max(repeat, 5) if repeat > 1 else 1
    steps = [("HF stock", 1), ("patch_hf_model", 1), ("TransformerInfer", 1), ("TransformerInfer", batch)]
    for i, (engine, b) in enumerate(steps):
        if progress:
            progress(f"end to end: {engine} batch {b}", i, len(steps))
        prompts = one if b == 1 else many
        if engine == "HF stock":
            t1 = median_seconds(lambda: _hf_generate(model, prompts, 1), repeat_prefill)
            tn = median_seconds(lambda: _hf_generate(model, prompts, n), repeat)
        elif engine == "patch_hf_model":
            atb.patch_hf_model(model, soc_type=soc_type)
            try:
                t1 = median_seconds(lambda: _hf_generate(model, prompts, 1), repeat_prefill)
                tn = median_seconds(lambda: _hf_generate(model, prompts, n), repeat)
            finally:
                atb.unpatch_hf_model(model)
        else:
            infer = atb.TransformerInfer(model, max_seq_len=prompt_len + n, soc_type=soc_type, max_batch_size=b)
            gen = lambda k: infer.generate(prompts, max_new_tokens=k, eos_token_id=[])  # noqa: E731
            t1 = median_seconds(lambda: gen(1), repeat_prefill)
            tn = median_seconds(lambda: gen(n), repeat)
        add(engine, b, t1, tn)
    stock = results[0].decode_tok_s
    for r in results:
        r.decode_vs_stock = r.decode_tok_s / stock
    return results


def format_table(rows: list[E2ERow]) -> str:
    # The ratio is of decode tok/s to HF stock batch 1 (prefill is compared in its own column's numbers).
    head = f"{'engine':<20}{'batch':>6}{'prefill tok/s':>15}{'decode tok/s':>14}{'decode vs HF':>14}{'roofline':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.engine:<20}{r.batch:>6}{r.prefill_tok_s:>15.0f}{r.decode_tok_s:>14.1f}"
                     f"{r.decode_vs_stock:>13.2f}x{r.roofline * 100:>9.0f}%")
    return "\n".join(lines)
