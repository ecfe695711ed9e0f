"""`--avx2` for the PyTorch reference scripts (pytorch_gpt.py,
pytorch_encoder.py, pytorch_linear.py): PyTorch's CPU kernels at AVX2 at
most, as on a CPU without AVX-512 (ATen's dispatch, MKL's code path,
oneDNN's ISA). torch reads these at import, so a script calls
`limit_to_avx2_if_asked()` before `import torch`; `cpu_capability` in its
output says what ATen ran.
"""

import os
import sys


def limit_to_avx2_if_asked(argv=None):
    """Sets the AVX2 limits when `--avx2` is among the arguments."""
    if "--avx2" in (sys.argv if argv is None else argv):
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", "AVX2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
