"""The inference engine: scheduler + model runner, with a request-level step API.

    from atb.engine import SamplingParams, RequestOutput
    rid = infer.add_request(prompt_ids, SamplingParams(max_new_tokens=64))
    while infer.has_unfinished():
        for out in infer.step():
            ...

``atb.TransformerInfer`` is the public facade (``generate`` and ``forward`` are
loops over this API). Modules: ``params`` (SamplingParams, RequestOutput, TokenLogprob),
``sampling`` (token selection), ``speculative`` (prompt-lookup drafts), ``scheduler`` (requests, queues, block
manager), ``runner`` (weights and executors), ``engine`` (the step loop and
its lock).
"""
from atb.engine.params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, RequestOutput, SamplingParams,
                               TokenLogprob)
from atb.engine.speculative import SpeculativeConfig

__all__ = ["MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MAX_PENALTY", "RequestOutput", "SamplingParams", "SpeculativeConfig",
           "TokenLogprob"]
