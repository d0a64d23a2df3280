"""The GPU's TF32 tensor-core arithmetic, bit for bit, against the model the emulator's hw_math mode implements
(tests/tensor_core_model.py): skipped cleanly without CuPy or a usable GPU.

Why: on the first H100 run float32 ``precision="3xtf32"`` was 20x less accurate than naive float32 while the
emulator, then adding each product round-to-nearest, saw 1.2x. With the truncating model the emulator reproduced the
trend (4.3x at 2048 keys), and the 3xTF32 products now sum apart (kernels/wide_mma.cuh). This test says whether
the model is the hardware's: on a mismatch it reports how many elements each model of tests/tensor_core_model.py
gets right (round to nearest; truncation to 22-27 fraction bits of the largest exponent, products normalized or not,
toward zero or minus infinity, over the 8 products at once or in two groups of 4, C with them or apart), and prints
D bit for bit, so that the next model is fitted from data. The emulator's model was fitted so, to an H200's D
(2026-11-27).
"""
from pathlib import Path

import pytest

from cuflash.cuda.compile import KERNEL_OPTIONS
from cuflash.cuda.source import KERNELS_DIR, inline_includes

import gpu_support  # noqa: E402
import tensor_core_model as model

cp, pytestmark, _ = gpu_support.setup()

# the emulator test's kernel (mma.m16n8k8 .tf32 from global memory), after the header it needs
SOURCE = inline_includes(KERNELS_DIR / "arch.cuh") + \
    (Path(__file__).parent / "emulate" / "kernels" / "mma_tf32.cuh").read_text()


def _mma_on_gpu(a, b, c):
    cc = cp.cuda.Device().compute_capability
    if int(cc) < 80:
        pytest.skip(f"TF32 mma needs sm_80 or later; this GPU is sm_{cc}")
    fn = cp.RawModule(code=SOURCE, options=KERNEL_OPTIONS).get_function("mma_tf32_from_global")
    d = cp.full((16, 8), cp.nan, cp.float32)
    fn((1,), (32,), tuple(cp.asarray(x) for x in (a, b, c)) + (d,))
    return d.get()


@pytest.mark.parametrize("seed", range(4))
def test_tf32_mma_rounds_as_the_emulators_tensor_core_model(seed):
    a, b, c = model.operands(seed)
    d = _mma_on_gpu(a, b, c)
    matches = {name: int((d == fn(a, b, c)).sum()) for name, fn in model.MODELS.items()}
    best = sorted(matches.items(), key=lambda item: -item[1])[:6]
    print("elements matching each model (of 128):", matches, "rows 14, 15:", d[14:, 0])
    # the GPU's D bit for bit (operands: model.operands(seed)), so that a model can be fitted here, without a GPU
    print(f"seed {seed} D as float32 bits:", " ".join(f"{x:08x}" for x in d.view("uint32").ravel()))
    emulator = model.EMULATOR
    assert matches[emulator] == d.size, (
        f"the GPU's TF32 mma differs from the emulator's model (kernels/emulate/arch_emulated.h, tc_dot_rz) in "
        f"{d.size - matches[emulator]} of {d.size} elements; the closest models: {best}; "
        f"C = +-1 plus 0.75 ulp gave {d[14:, 0]}")
