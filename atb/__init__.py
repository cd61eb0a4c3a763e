"""atb: Ascend Transformer Boost-style fused Transformer kernels on the CPU.

Kernels are written AscendC-style (host tiling per SoC, Kernel<Op><T> with
Init/Process/CopyIn/Compute/CopyOut over a per-core Unified Buffer) in C++ and
run on this machine's cores. See README.md for the tour.
"""
import torch  # noqa: F401  (first: kernel launches share the OpenMP runtime torch loads)

from atb import _C  # noqa: F401  (the native core)
from atb import kernels
from atb.patch import PatchReport, check_model, patch_hf_model, unpatch_hf_model
from atb.runtime import (available_isas, build_info, fp32_decode_copy, get_num_threads, set_fp32_decode_copy, set_isa,
                         set_num_threads, set_stream_prefetch_kb, set_threading, stream_prefetch_kb)
from atb.soc import default_soc, get_soc, set_soc, soc_names
from atb.infer import TransformerInfer
from atb.engine import RequestOutput, SamplingParams
from atb.quant import dequantize, quantize

if torch.distributed.is_available() and not torch.distributed.is_initialized():
    # A user script that imports atb and then joins a process group gets the same protection as
    # atb's own init_process_group (see atb.distributed._import_world_capturing_modules).
    from atb.distributed import _import_world_capturing_modules

    _import_world_capturing_modules()

__version__ = "0.1.0"

__all__ = [
    "kernels", "build_info", "get_num_threads", "set_num_threads", "set_isa", "available_isas", "set_threading",
    "stream_prefetch_kb", "set_stream_prefetch_kb", "fp32_decode_copy", "set_fp32_decode_copy",
    "get_soc", "set_soc", "soc_names", "default_soc", "TransformerInfer", "SamplingParams", "RequestOutput",
    "patch_hf_model", "unpatch_hf_model", "check_model", "PatchReport", "quantize", "dequantize",
]
