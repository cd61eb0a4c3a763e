"""Quality of the quantized formats against the unquantized model, teacher-forced.

Run: ``python -m atb.bench.quality [--model smollm2|tinyllama] [--tokens 256] [--prompts 8]``.
The unquantized model (bf16 by default) greedily continues each prompt for ``--tokens`` tokens; every
format then reads the same sequences (prompt + that continuation) in one stateless forward, and at every
continuation position we compare its next-token distribution with the unquantized one: mean
KL(unquantized || quantized) in nats and top-1 agreement (the fraction of positions whose argmax is
the same token). SmolLM2 uses 8 varied chat prompts; the random-weight TinyLlama-shaped model random
token prompts. Note that SmolLM2's float weights are themselves dequantized Q4_1 (group 32, scale + min),
so W4A16 with group 32 can reproduce most of its layers almost exactly and "native" is the file itself.
"""
from __future__ import annotations

import argparse

import torch

import atb

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a ten-year-old.",
    "List three prime numbers and explain why each one is prime.",
    "Translate 'good morning' into Spanish and German.",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "Write a short story about a robot who learns to paint.",
]
FORMATS = ["w8a16", "w4a16", "w4a16-g128"]


def _prompts(tok, n: int, vocab: int) -> list[list[int]]:
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (24,), generator=g).tolist() for _ in range(n)]
    return [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"])
            for p in PROMPTS[:n]]


def measure(model, tok=None, formats=FORMATS, tokens: int = 256, prompts: int = 8, dtype=torch.bfloat16) -> list[dict]:
    """Mean KL and top-1 agreement of each format vs the unquantized model (teacher-forced)."""
    vocab = model.config.vocab_size
    ps = _prompts(tok, prompts, vocab)
    max_len = max(len(p) for p in ps) + tokens + 1
    ref = atb.TransformerInfer(model, max_seq_len=max_len, max_batch_size=len(ps), dtype=dtype)
    conts = ref.generate(ps, max_new_tokens=tokens, eos_token_id=[])  # no EOS: every continuation is full length
    seqs = [p + c for p, c in zip(ps, conts)]

    def logits_of(engine, seq, start):
        out = engine.forward(torch.tensor([seq]))[0].float()
        return out[start - 1:len(seq) - 1]  # the distributions that predicted each continuation token

    base = [logits_of(ref, s, len(p)) for s, p in zip(seqs, ps)]
    rows = []
    for fmt in formats:
        engine = atb.TransformerInfer(model, max_seq_len=max_len, max_batch_size=1, dtype=dtype, quantize=fmt)
        kl_sum, agree, n = 0.0, 0, 0
        for s, p, b in zip(seqs, ps, base):
            q = logits_of(engine, s, len(p))
            lp, lq = torch.log_softmax(b, -1), torch.log_softmax(q, -1)
            kl_sum += float((lp.exp() * (lp - lq)).sum())
            agree += int((b.argmax(-1) == q.argmax(-1)).sum())
            n += b.shape[0]
        ms = engine.memory_summary()
        rows.append(dict(format=fmt, kl=kl_sum / n, top1=agree / n, positions=n, weights_bytes=ms["weights_bytes"],
                         unquantized_bytes=ms["weights_bytes_unquantized"]))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m atb.bench.quality", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tinyllama"],
                   help="smollm2: the embedded checkpoint; tinyllama: a random-weight TinyLlama-1.1B-shaped model")
    p.add_argument("--tokens", type=int, default=256, help="greedy continuation per prompt")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--formats", nargs="+", default=None,
                   help=f"default: {' '.join(FORMATS)} (plus native for smollm2)")
    a = p.parse_args(argv)
    if a.model == "smollm2":
        from atb.checkpoints import load_model

        model, tok = load_model(dtype=torch.bfloat16)
        formats = a.formats or FORMATS + ["native"]
    else:
        from atb.checkpoints import random_model

        model, tok = random_model("tinyllama-1.1b", dtype=torch.bfloat16), None
        formats = a.formats or FORMATS
    rows = measure(model, tok, formats, a.tokens, a.prompts)
    print(f"# {a.model}: teacher-forced over {a.prompts} prompts x {a.tokens} greedy bf16 tokens; vs bf16")
    print(f"{'format':12} {'mean KL (nats)':>15} {'top-1 agree':>12} {'weights MB':>11} {'of bf16':>8}")
    for r in rows:
        print(f"{r['format']:12} {r['kl']:15.5f} {r['top1']:12.1%} {r['weights_bytes'] / 1e6:11.1f} "
              f"{r['weights_bytes'] / r['unquantized_bytes']:8.0%}")


if __name__ == "__main__":
    main()
