"""convtune's PyTorch integration: drop-in conv modules, their custom operators, ``optimize`` and ``explain``.

One concept per module: ``workspace`` (the run-time scratch buffers), ``ops`` (the custom
operators ``torch.ops.convtune.conv`` and ``run``), ``tuning`` (one layer's choices),
``modules`` (Conv1d/2d/3d, public as ``convtune.nn``), ``optimize`` and ``explain``.
Inside this package ``import torch`` is PyTorch itself: every import here is absolute. The
public names are ``convtune.optimize``, ``convtune.explain`` (``explain.explain_table`` prints
it) and ``convtune.nn``; nothing is re-exported here, so each submodule keeps its name.
"""
