"""convtune's PyTorch integration: drop-in conv modules, their custom operators, ``optimize`` and ``explain``.

One concept per module: ``runtime`` (the native executables of the C++ extension, run by the
ops ``torch.ops.convtune.tuned_conv`` and ``tuned_run``), ``host_costs`` (what a call on each path
costs the host over PyTorch's own), ``ops`` (the Python path: the custom operators
``torch.ops.convtune.conv`` and ``run``, for layers whose algorithms have no native executable),
``workspace`` (the Python path's workspace buffers), ``tuning`` (one layer's choices), ``modules``
(Conv1d/2d/3d, public as ``convtune.nn``), ``optimize`` and ``explain``.
(``convtune.torch``, its former name, still imports, with a DeprecationWarning.) The public names
are ``convtune.optimize``, ``convtune.explain`` (``explain.explain_table`` prints it) and
``convtune.nn``; nothing is re-exported here, so each submodule keeps its name.
"""
