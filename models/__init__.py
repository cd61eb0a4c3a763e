"""Architecture-family adapters, installed as ``atb.models`` (setup.py maps this folder there).

One module per family (``llama``, ``mistral``, ``qwen2``, ``qwen3``), each
exposing ``ADAPTER``. Nothing is imported here: ``atb.registry`` imports a
family module by name when a model of that family is first seen.
"""
