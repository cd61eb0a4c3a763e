"""Perplexity over a text (atb.perplexity, `atb perplexity`): windows scored through the engine's prompt scoring
against HF's own float64 log-softmax over the same windows."""
import math
import subprocess
import sys

import pytest
import torch

import atb
from atb.checkpoints import random_model
from atb.perplexity import perplexity, windows

CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=128, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False)


def reference(model, ids, context, stride) -> tuple[float, int]:
    """HF's mean NLL (float64) over the tokens each window scores, and their count."""
    nll, n = 0.0, 0
    for b, e, f in windows(len(ids), context, stride):
        with torch.no_grad():
            logp = model(torch.tensor([ids[b:e]])).logits[0].double().log_softmax(-1)
        for j in range(f, e):
            nll -= logp[j - b - 1, ids[j]].item()
            n += 1
    return nll / n, n


def test_windows_score_every_token_once():
    for n, context, stride in ((50, 16, 8), (50, 16, 16), (17, 16, 5), (16, 16, 8), (3, 8, 8), (100, 10, 1)):
        spans = windows(n, context, stride)
        scored = [j for _, e, f in spans for j in range(f, e)]
        # Each token once, in order; unscored: token 0, and with disjoint windows each window's first token.
        unscored = {b for b, _, _ in spans} if stride == context else {0}
        assert scored == [j for j in range(n) if j not in unscored], (n, context, stride)
        assert all(e - b <= context and b < f for b, e, f in spans)
        # past the first window, a scored token sees at least context - stride tokens before it
        assert all(f - b >= context - stride for b, e, f in spans[1:] if e - b == context)


@pytest.mark.parametrize("context,stride", [(16, 8), (16, 16), (24, 5)])
def test_perplexity_matches_hf(context, stride):
    model = random_model(CFG, dtype=torch.float32, model_type="llama", seed=3)
    ids = [(11 * i + 7) % 128 for i in range(61)]
    infer = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=3, block_size=8, max_prefill_tokens=20)
    seen = []
    r = perplexity(infer, ids, context=context, stride=stride, progress=lambda d, t: seen.append((d, t)))
    mean, n = reference(model, ids, context, stride)
    assert r.tokens == n == sum(e - f for _, e, f in windows(len(ids), context, stride))
    assert r.windows == len(seen) == seen[-1][1]
    assert r.mean_nll == pytest.approx(mean, rel=1e-5) and r.perplexity == pytest.approx(math.exp(mean), rel=1e-5)
    assert infer.stats()["kv_blocks_used"] == 0 and not infer.has_unfinished()


def test_perplexity_errors():
    model = random_model(CFG, dtype=torch.float32, model_type="llama", seed=3)
    infer = atb.TransformerInfer(model, max_seq_len=32, max_batch_size=2, block_size=8)
    with pytest.raises(ValueError, match="context"):
        perplexity(infer, list(range(40)), context=33)
    with pytest.raises(ValueError, match="stride"):
        perplexity(infer, list(range(40)), context=16, stride=17)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(infer, [5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        perplexity(infer, list(range(20)) + [500] + list(range(20)), context=16, stride=16)
    assert infer.stats()["kv_blocks_used"] == 0 and not infer.has_unfinished()   # the queued windows were aborted


def test_cli_perplexity_on_smollm2(smollm2_fp32, tmp_path):
    """`atb perplexity --file` on the real checkpoint: the printed perplexity is HF's over the same windows."""
    model, tok = smollm2_fp32
    text = ("The cat sat on the mat. It was a sunny day, and the children were playing in the park. "
            "Paris is the capital of France, and Berlin is the capital of Germany. ") * 3
    path = tmp_path / "text.txt"
    path.write_text(text)
    out = subprocess.run([sys.executable, "-m", "atb", "perplexity", "--file", str(path), "--context", "48",
                          "--stride", "24", "--quiet"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    ppl = float(out.stdout.split("perplexity ")[1].split()[0])
    mean, n = reference(model, tok(text)["input_ids"], 48, 24)
    assert ppl == pytest.approx(math.exp(mean), rel=1e-3)
    assert f"over {n} tokens" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "atb", "perplexity", "--quiet"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--file or --text" in bad.stderr
