"""Builds atb and its native core atb._C (C++17, pybind11, no libtorch link).

Every .cpp under csrc/ is compiled, in parallel, with baseline flags for the
target architecture; the AVX2 code path selects its ISA per file with a pragma
and is chosen at run time from CPUID, so one build runs on any x86-64 CPU.
No OpenMP: the runtime has its own thread pool, and a second OpenMP runtime
beside torch's would spin on the cores torch needs.
"""
import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


class ParallelBuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1


sources = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", "*.cpp"), recursive=True))

ext = Pybind11Extension(
    "atb._C",
    sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-Wall", "-Wno-unused-function"],
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": ParallelBuildExt},
    packages=["atb", "atb.kernels", "atb.layers", "atb.bench", "atb.quant", "atb.models"],
    package_dir={"atb.models": "models"},
)
