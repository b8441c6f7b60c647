"""The linear layers a model's projections run as, one module per weight format:

    dense.Linear        float weight (oneDNN-packed on CPU)          --quantization none
    w8a8.W8A8Linear     INT8 weight per channel, INT8 activations     --quantization w8a8
    int4.Int4Linear     group-wise INT4 weight, float activations     --quantization int4
                        (W4A8 blocks of 32 on an x86 CPU, AVX2+)
    q8.Q8Linear         INT8 blocks of 32, INT8 activations           the LM head under int4 (CPU)
    amx.AmxRows         one of those two, and a bf16 copy for steps   int4 at the amx ISA level
                        with many rows (oneDNN on AMX tiles)
    fp8.Fp8Linear       e4m3 weight per channel, e4m3 activations     --quantization fp8

Each is called as `layer(x) -> [T, out]` in the model's dtype and reports `nbytes()`; which one
a projection gets is the quantization method's choice (`model/quantization.py`).
"""

from pipellm.services.compute.model.linear.dense import Linear
from pipellm.services.compute.model.linear.fp8 import Fp8Linear
from pipellm.services.compute.model.linear.int4 import Int4Linear
from pipellm.services.compute.model.linear.q8 import Q8Linear
from pipellm.services.compute.model.linear.w8a8 import W8A8Linear

__all__ = ["Fp8Linear", "Int4Linear", "Linear", "Q8Linear", "W8A8Linear"]
