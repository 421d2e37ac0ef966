"""What cuDNN's execution plans cost, in the cost model's terms.

Apart from ``cudnn.py``, which needs the cuDNN frontend: a machine without it still prices cuDNN's names
(another machine's measurements, judged or learned from here), as it would where the frontend loads
(``registry.OPTIONAL_MODULES``).
"""

from __future__ import annotations

from ..costmodel import Cost, gemm_dims, shape_factor
from ..problem import ConvProblem

EFFICIENCY = 0.7  # of the roofline, for any one of cuDNN's execution plans (the database corrects each)


def execution_plan_cost(p: ConvProblem, workspace_bytes: int = 0) -> Cost:
    """One fused kernel at EFFICIENCY of the roofline, the same for every execution plan (cuDNN's own order
    of its plans tells them apart: ``Algorithm.place``). Its workspace is used inside the kernel (cuDNN's
    fp32 NCHW execution plans transpose through 50 MB and still lead), so it is no traffic term here."""
    return Cost(p.flops, EFFICIENCY * shape_factor(*gemm_dims(p)), p.min_bytes, 1, composed=False)
