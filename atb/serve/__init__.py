"""``atb serve``: an OpenAI-compatible HTTP inference service over ``TransformerInfer`` (the ``atb[serve]`` extra).

Modules: ``protocol`` (OpenAI request/response models), ``detokenize``
(incremental text and stop strings), ``engine_loop`` (the one engine thread),
``metrics`` (Prometheus text), ``app`` (FastAPI app and uvicorn runner),
``cli`` (the ``serve`` subcommand).
"""
