"""What a decode roofline counts as read per step (atb.bench.roofline.decode_step_bytes, the runner's
weight_tensors(decode_step=True)): the weights streamed once, an untied input embedding table not at all (a step
reads one row of it per sequence), a tied one once, plus the batch's K/V."""
import pytest
import torch

import atb
from atb.bench.roofline import decode_step_bytes, decode_token_flops, kv_bytes
from atb.checkpoints import random_model

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_bytes_counts_the_embedding_only_as_the_lm_head(tied, dtype):
    model = random_model({**SHAPE, "tie_word_embeddings": tied}, dtype)
    esz = dtype.itemsize
    emb = SHAPE["vocab_size"] * SHAPE["hidden_size"] * esz
    everything = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table appears once
    assert decode_step_bytes(model) == (everything if tied else everything - emb)
    kv = 2 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * esz * 3 * 40
    assert kv_bytes(model.config, 3, 40, esz) == kv
    assert decode_step_bytes(model, 3, 40) == decode_step_bytes(model) + kv


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("quantize", [None, "w8a16"])
def test_engine_decode_step_weights_leave_out_an_untied_embedding(tied, quantize):
    model = random_model({**SHAPE, "tie_word_embeddings": tied}, torch.float32)
    runner = atb.TransformerInfer(model, max_seq_len=64, max_batch_size=1, quantize=quantize).runner

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in ts}.values())

    every, per_step = nbytes(runner.weight_tensors()), nbytes(runner.weight_tensors(decode_step=True))
    assert (runner.weight_bytes(), runner.weight_bytes(decode_step=True)) == (every, per_step)
    if tied:
        assert per_step == every
    else:
        embed = runner.embed
        table = [embed.data, embed.scale] if quantize else [embed]
        assert per_step == every - nbytes(table)
        if not quantize:
            assert per_step == decode_step_bytes(model)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_token_flops_counts_every_linear_once_and_attention_over_the_context(tied):
    model = random_model({**SHAPE, "tie_word_embeddings": tied}, torch.float32)
    h, i, d = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"]
    heads, kv_heads, layers = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["num_hidden_layers"]
    per_layer = h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * i  # q, k + v, o, gate + up + down
    macs = layers * per_layer + SHAPE["vocab_size"] * h  # the LM head, tied or not
    assert decode_token_flops(model) == 2 * macs
    # Per query head and position: q.k and p.v, d multiply-adds each.
    assert decode_token_flops(model, 40) == 2 * macs + 2 * layers * heads * 2 * d * 40
