"""Doctest collection: modules whose optional dependency is missing here are not imported."""

import importlib.util

collect_ignore = ["src/convtune/torch.py"]  # the deprecated alias: importing it warns, by design
if importlib.util.find_spec("cudnn") is None:
    collect_ignore.append("src/convtune/algorithms/cudnn.py")
