"""Builds atb and its native core atb._C (C++17, pybind11, no libtorch link).

Every .cpp under csrc/ is compiled, in parallel, with baseline flags for the
target architecture; the AVX2 and AVX-512 code paths select their ISA per file
with a pragma and are chosen at run time from CPUID, so one build runs on any
x86-64 CPU. When SIMDe's headers are importable (the simde-py package, in the
`test` extra) the AVX-512 source is also compiled against them into the
test-only table "avx512-simde", which runs that code's logic on CPUs without
AVX-512.
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


def simde_include():
    try:
        import simde_py
    except ImportError:
        print("atb: simde-py not installed, building without the test-only 'avx512-simde' table "
              "(pip install simde-py before building to get it)")
        return []
    return [simde_py.get_include()]


sources = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "**", "*.cpp"), recursive=True))

compile_args = ["-O3", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
link_args = []
# Opt-in sanitizer build, e.g. ATB_SANITIZE=address,undefined (README: "Sanitizer build"). -O1 keeps the
# reports' stacks readable; python itself is not instrumented, so the runtime is LD_PRELOADed when testing.
SANITIZE = os.environ.get("ATB_SANITIZE", "").strip()
if SANITIZE:
    if not all(part.isidentifier() or part.replace("-", "_").isidentifier() for part in SANITIZE.split(",")):
        raise SystemExit(f"ATB_SANITIZE must be a comma-separated list of sanitizers, got {SANITIZE!r}")
    sanitize_flags = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all", "-g"]
    compile_args = ["-O1", "-fno-math-errno", "-Wall", "-Wno-unused-function"] + sanitize_flags
    link_args = sanitize_flags

ext = Pybind11Extension(
    "atb._C",
    sources,
    include_dirs=["csrc"] + simde_include(),
    cxx_std=17,
    extra_compile_args=compile_args,
    extra_link_args=link_args,
)

setup(
    ext_modules=[ext],
    cmdclass={"build_ext": ParallelBuildExt},
    packages=["atb", "atb.kernels", "atb.layers", "atb.bench", "atb.quant", "atb.models"],
    package_dir={"atb.models": "models"},
)
