"""Deprecated: the PyTorch integration is ``convtune.pytorch`` (a package named ``torch`` read like PyTorch).

Importing ``convtune.torch`` or one of its modules still works, with a DeprecationWarning, so code
and pickled models that name the old modules keep loading.
"""

import sys
import warnings

from convtune import pytorch
from convtune.pytorch import explain, modules, ops, optimize, runtime, tuning, workspace

warnings.warn("convtune.torch is now convtune.pytorch; import that instead", DeprecationWarning, stacklevel=2)

for _module in (explain, modules, ops, optimize, runtime, tuning, workspace):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module

__all__ = ["pytorch", "explain", "modules", "ops", "optimize", "runtime", "tuning", "workspace"]
