"""Structured output on the real SmolLM2: SamplingParams(json_schema= / regex=) constrain the tokens to text the
schema or expression accepts (llguidance's grammar masks), greedy and sampled, alone and batched."""
import json
import re

import pytest
import torch

import atb
from atb.engine import SamplingParams

pytest.importorskip("llguidance")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"type": "string", "enum": ["cat", "dog", "fish"]}}}}


def is_person(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"name", "age", "pets"} and isinstance(value["name"], str)
            and isinstance(value["age"], int) and not isinstance(value["age"], bool)
            and isinstance(value["pets"], list) and len(value["pets"]) <= 3 and all(p in ("cat", "dog", "fish") for p in value["pets"]))


@pytest.fixture(scope="module")
def smollm2(smollm2_fp32):
    return smollm2_fp32


def chat(tok, text: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def run(infer, requests) -> list:
    """Adds ``(prompt, params)`` pairs and steps until all finish; their final outputs in order."""
    ids = [infer.add_request(p, sp) for p, sp in requests]
    last = {}
    while infer.has_unfinished():
        for o in infer.step():
            last[o.request_id] = o
    return [last[i] for i in ids]


def test_json_schema_and_regex_outputs_follow_their_grammar(smollm2):
    """Greedy and sampled outputs parse and match the schema (or the expression) and finish with "grammar"
    when complete; an unconstrained request beside them is unaffected; a constrained request's greedy tokens
    are the same alone, batched, and in Python mode."""
    model, tok = smollm2
    infer = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=8, tokenizer=tok)
    ask = chat(tok, "Describe a person and their pets.")
    plain = SamplingParams(max_new_tokens=24)
    reqs = [(ask, SamplingParams(max_new_tokens=96, json_schema=PERSON)),
            (chat(tok, "Is the sky blue? Answer yes or no."), SamplingParams(max_new_tokens=8, regex=r"(yes|no)")),
            (chat(tok, "Pick a date."), SamplingParams(max_new_tokens=16, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
            (ask, plain)]
    reqs += [(ask, SamplingParams(max_new_tokens=96, json_schema=PERSON, do_sample=True, temperature=1.0, seed=s))
             for s in range(3)]
    reqs.append((chat(tok, "Write any JSON object."), SamplingParams(max_new_tokens=120, json_schema={"type": "object"},
                                                                     do_sample=True, temperature=0.7, seed=9)))
    outs = run(infer, reqs)
    texts = [tok.decode(o.output_token_ids) for o in outs]
    for i in (0, 4, 5, 6):
        assert outs[i].finish_reason == "grammar", texts[i]
        assert is_person(json.loads(texts[i])), texts[i]
    assert outs[1].finish_reason == "grammar" and texts[1] in ("yes", "no")
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", texts[2]) and outs[2].finish_reason == "grammar"
    if outs[7].finish_reason == "grammar":
        assert isinstance(json.loads(texts[7]), dict)
    else:  # cut by max_new_tokens: still a prefix of a JSON object
        assert outs[7].finish_reason == "length" and texts[7].lstrip().startswith("{")
    # The plain request is the plain greedy answer; the constrained one differs from it.
    assert outs[3].output_token_ids == infer.generate([ask], 24)[0]
    assert outs[0].output_token_ids[:24] != outs[3].output_token_ids
    alone = atb.TransformerInfer(model, max_seq_len=512, max_batch_size=1, tokenizer=tok, graph_mode=False)
    assert run(alone, [reqs[0]])[0].output_token_ids == outs[0].output_token_ids
    assert infer.stats()["kv_blocks_used"] == 0


def test_constrained_greedy_is_the_best_allowed_token(smollm2):
    """Each greedy step's token is the model's most likely token among those the grammar allows: where the
    unconstrained argmax is allowed it is that token, and no token the grammar allows has a higher logit
    (checked with the model's own logits and an independent walk: every prefix of the output is a prefix of
    the regular language)."""
    model, tok = smollm2
    infer = atb.TransformerInfer(model, max_seq_len=512, tokenizer=tok)
    prompt = chat(tok, "How many legs does a spider have?")
    pattern = r"[0-9]{1,2} legs"
    out = run(infer, [(prompt, SamplingParams(max_new_tokens=12, regex=pattern))])[0].output_token_ids
    text = tok.decode(out)
    assert re.fullmatch(pattern, text)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]

    def viable(s: str) -> bool:   # s can still grow into a match of the pattern
        m = re.fullmatch(r"([0-9]{0,2})( ?l?e?g?s?)", s)
        return bool(m) and (m.group(1) != "" or s == "") and " legs".startswith(m.group(2))

    for j, t in enumerate(out):
        done = tok.decode(out[:j])
        allowed = [c for c in logits[j].argsort(descending=True)[:50].tolist() if viable(done + tok.decode([c]))]
        assert t == allowed[0], (j, done, tok.decode([t]), tok.decode([allowed[0]]))


def test_structured_output_errors(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="json_schema and regex"):
        SamplingParams(json_schema={"type": "object"}, regex="a")
    for bad in ("not json", "[1, 2]", 5):
        with pytest.raises((ValueError, TypeError), match="json_schema"):
            SamplingParams(json_schema=bad)
    no_tok = atb.TransformerInfer(model, max_seq_len=128)
    with pytest.raises(ValueError, match="json_schema needs the engine's tokenizer"):
        no_tok.add_request([1, 2, 3], SamplingParams(json_schema={"type": "object"}))
    infer = atb.TransformerInfer(model, max_seq_len=128, tokenizer=tok)
    with pytest.raises(ValueError, match="json_schema is not a usable grammar.*frobnicate"):
        infer.add_request([1, 2, 3], SamplingParams(json_schema={"type": "frobnicate"}))
    with pytest.raises(ValueError, match="regex is not a usable grammar"):
        infer.add_request([1, 2, 3], SamplingParams(regex="(unclosed"))
    assert not infer.has_unfinished() and infer.stats()["kv_blocks_used"] == 0   # nothing was queued
    # Setting the tokenizer later works too.
    no_tok.tokenizer = tok
    out = run(no_tok, [(chat(tok, "Say yes."), SamplingParams(max_new_tokens=4, regex="yes|no"))])[0]
    assert tok.decode(out.output_token_ids) in ("yes", "no")


def test_compiled_grammars_are_reused_with_independent_states(smollm2, monkeypatch):
    """A repeated grammar is compiled once (the last Grammars.CACHED distinct ones are kept): each request
    still gets its own state, and an unusable grammar is not kept."""
    from atb.engine.structured import Grammars

    model, tok = smollm2
    monkeypatch.setattr(Grammars, "CACHED", 2)
    g = Grammars(tok, model.config.vocab_size, [tok.eos_token_id])
    yes_no = SamplingParams(max_new_tokens=4, regex=r"(yes|no)")
    a, b = g.constraint(yes_no), g.constraint(yes_no)
    assert len(g._compiled) == 1
    y = tok.encode("yes", add_special_tokens=False)[0]
    assert a.accept(y) and a.complete and not b.complete and b.allowed()[y]
    for regex in (r"[0-9]+", r"(cat|dog)", r"(yes|no)"):
        g.constraint(SamplingParams(max_new_tokens=4, regex=regex))
    assert len(g._compiled) == 2
    with pytest.raises(ValueError, match="regex is not a usable grammar"):
        g.constraint(SamplingParams(max_new_tokens=4, regex=r"(unclosed"))
    assert len(g._compiled) == 2


def test_lark_grammar_constrains_the_output(smollm2):
    """SamplingParams(grammar=...): a context-free grammar in llguidance's Lark syntax; the output is a
    sentence of it (finish "grammar" once nothing else may follow), greedy and sampled; errors name the
    field."""
    model, tok = smollm2
    infer = atb.TransformerInfer(model, max_seq_len=512, tokenizer=tok)
    ask = chat(tok, "Is the sky blue?")
    yes_no = 'start: "The answer is " answer "."\nanswer: "yes" | "no"\n'
    pairs = 'start: item ("," item)* "."\nitem: NAME "=" NUMBER\nNAME: /[a-z]{1,8}/\nNUMBER: /[0-9]{1,3}/\n'
    outs = run(infer, [(ask, SamplingParams(max_new_tokens=16, grammar=yes_no)),
                       (ask, SamplingParams(max_new_tokens=60, grammar=pairs)),
                       (ask, SamplingParams(max_new_tokens=60, grammar=pairs, do_sample=True, seed=2))])
    assert outs[0].finish_reason == "grammar"
    assert re.fullmatch(r"The answer is (yes|no)\.", tok.decode(outs[0].output_token_ids))
    for o in outs[1:]:
        text = tok.decode(o.output_token_ids)
        if o.finish_reason == "grammar":
            assert re.fullmatch(r"[a-z]{1,8}=[0-9]{1,3}(,[a-z]{1,8}=[0-9]{1,3})*\.", text), text
        else:   # cut by max_new_tokens: a prefix of a sentence
            assert o.finish_reason == "length" and re.fullmatch(r"[a-z]{1,8}=[0-9]{1,3}(,[a-z]{0,8}=?[0-9]{0,3})*,?",
                                                                   text), text
    with pytest.raises(ValueError, match="sampling_params.grammar is not a usable grammar"):
        infer.add_request(ask, SamplingParams(max_new_tokens=4, grammar="start: undefined_rule"))
    with pytest.raises(ValueError, match="regex and grammar are exclusive"):
        SamplingParams(regex="a", grammar=yes_no)
    with pytest.raises(TypeError, match="grammar must be a str"):
        SamplingParams(grammar=3)
    assert infer.stats()["running"] == 0
