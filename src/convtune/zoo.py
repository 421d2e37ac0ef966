"""Built-in layer tables: the convolutions of real networks, to tune and to benchmark on.

``resnet50``, ``resnet18``, ``vgg16``, ``mobilenet_v2``, ``resnext50_32x4d`` (grouped),
``densenet121``, ``googlenet``: the unique Conv2d layers of torchvision's models at 224x224 (each
with how often it occurs); ``deepbench``: DeepBench's training convolutions
(each row with its own batch). A layer file of your own works the same way (``load_layers``): JSON
``{"layers": [{"c", "k", "spatial", "kernel", "stride", "padding", "dilation", "groups", "count"}]}``
or a CSV with DeepBench's columns ``w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h``.

    >>> layers = network_layers("resnet50", batch=32)
    >>> len(layers), sum(layer.count for layer in layers)
    (23, 53)
    >>> layers[0].problem.kernel_size
    (7, 7)
"""

from __future__ import annotations

import csv
import dataclasses
import difflib
import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

from .problem import ConvProblem
from .units import parse_int

MODELS = ("resnet50", "resnet18", "vgg16", "mobilenet_v2", "resnext50_32x4d", "densenet121", "googlenet")
NETWORKS = (*MODELS, "deepbench")
DEFAULT_BATCH = 32


@dataclasses.dataclass(frozen=True)
class Layer:
    """One unique convolution of a network and how many times the network runs it."""

    name: str
    problem: ConvProblem
    count: int = 1


@functools.cache
def _models() -> dict[str, Any]:
    text = resources.files("convtune").joinpath("data/model_conv_layers.json").read_text(encoding="utf-8")
    return json.loads(text)["models"]


def _dims(value: Any) -> Any:
    """JSON lists become tuples; ints and anything else go to ConvProblem to validate."""
    return tuple(value) if isinstance(value, list) else value


LAYER_FIELDS = ("c", "k", "spatial", "kernel", "stride", "padding", "dilation", "groups", "count", "transposed")


def _from_entries(entries: list[dict[str, Any]], source: str, batch: int | None, **fields: Any) -> list[Layer]:
    layers = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: layer {i} is {entry!r}, not an object with c, k, spatial and kernel")
        unknown = [key for key in entry if key not in LAYER_FIELDS]
        if unknown:  # a misspelled field would otherwise be left out, and another layer tuned than meant
            near = difflib.get_close_matches(str(unknown[0]), LAYER_FIELDS, n=1)
            raise ValueError(f"{source}: layer {i} has the field {unknown[0]!r}, which a layer does not have"
                             + (f" (did you mean {near[0]!r}?)" if near else "")
                             + f"; a layer's fields: {', '.join(LAYER_FIELDS[:-1])}")
        transposed = entry.get("transposed", False)
        if not isinstance(transposed, bool):  # "no" or "false" would read as true, 0 or null as false
            raise ValueError(f"{source}: layer {i} has transposed {transposed!r}; transposed is true or false (a "
                             f"JSON boolean, default false)")
        if transposed:
            raise ValueError(f"{source}: layer {i} is transposed (transposed: true), and transposed convolutions "
                             f"are not supported; give false or leave the field out")
        try:
            problem = ConvProblem(
                n=batch or DEFAULT_BATCH, c=entry["c"], k=entry["k"], input_size=_dims(entry["spatial"]),
                kernel_size=_dims(entry["kernel"]), stride=_dims(entry.get("stride", 1)),
                padding=_dims(entry.get("padding", 0)), dilation=_dims(entry.get("dilation", 1)),
                groups=entry.get("groups", 1), **fields)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{source}: layer {i} is not a valid convolution ({type(exc).__name__}: {exc})") from None
        count = entry.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{source}: layer {i} has count {count!r}; a count is how often the layer runs, "
                             f"an integer of 1 or more")
        layers.append(Layer(f"L{i:02d}", problem, count))
    return layers


CSV_COLUMNS = ("w", "h", "c", "n", "k", "s", "r", "pad_w", "pad_h", "stride_w", "stride_h")  # DeepBench's


def _from_deepbench_csv(text: str, source: str, batch: int | None, **fields: Any) -> list[Layer]:
    """Layers from DeepBench-style CSV: a header row naming exactly ``CSV_COLUMNS`` (in any order), then a row of
    integers per layer. A column it does not know is refused, not left out (``groups=4`` left out is another
    layer tuned than meant)."""
    lines = [line for line in text.lstrip("\ufeff").splitlines() if line.strip() and not line.startswith("#")]
    rows = list(csv.reader(lines))
    if not rows:
        return []
    header = [name.strip() for name in rows[0]]
    columns = ",".join(CSV_COLUMNS)
    if all(name.lstrip("-").isdigit() for name in header):
        raise ValueError(f"{source}: the first row ({','.join(header)}) is not a header; a DeepBench-style CSV "
                         f"starts with the row {columns}")
    unknown = [name for name in header if name not in CSV_COLUMNS]
    if unknown:
        near = difflib.get_close_matches(unknown[0], CSV_COLUMNS, n=1)
        raise ValueError(f"{source}: the column {unknown[0]!r} is not one of DeepBench's"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; the columns must be {columns} (groups or dilation: give a JSON layer file)")
    missing = [name for name in CSV_COLUMNS if name not in header]
    if missing or len(set(header)) < len(header):
        raise ValueError(f"{source}: the header {','.join(header)} "
                         + (f"lacks {', '.join(missing)}" if missing else "names a column twice")
                         + f"; the columns must be {columns}")
    layers = []
    for i, cells in enumerate(rows[1:]):
        if len(cells) != len(header):
            raise ValueError(f"{source}: row {i + 1} has {len(cells)} cells, where the header names {len(header)} "
                             f"columns ({columns})")
        try:
            v = {name: parse_int(value, name) for name, value in zip(header, cells)}
            problem = ConvProblem(
                n=batch or v["n"], c=v["c"], k=v["k"], input_size=(v["h"], v["w"]), kernel_size=(v["r"], v["s"]),
                stride=(v["stride_h"], v["stride_w"]), padding=(v["pad_h"], v["pad_w"]), **fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: row {i + 1} is not a valid convolution ({type(exc).__name__}: "
                             f"{exc})") from None
        layers.append(Layer(f"D{i:02d}", problem))
    return layers


def network_layers(name: str, batch: int | None = None, *, direction: str = "fwd", dtype: str = "float32",
                   layout: str = "channels_first", device: str = "cpu", allow_tf32: bool = True) -> list[Layer]:
    """The layers of a built-in network as problems (``batch`` defaults to 32; DeepBench keeps its own)."""
    fields = dict(direction=direction, dtype=dtype, layout=layout, device=device, allow_tf32=allow_tf32)
    if name == "deepbench":
        text = resources.files("convtune").joinpath("data/deepbench_conv_training.csv").read_text(encoding="utf-8")
        return _from_deepbench_csv(text, name, batch, **fields)
    if name not in MODELS:
        raise ValueError(f"unknown network {name!r}; built-in networks: {', '.join(NETWORKS)} (or give a layer file)")
    return _from_entries(_models()[name]["layers"], name, batch, **fields)


class _GivenTwice(Exception):
    """A JSON object names a field twice (``json.loads`` would keep the last value)."""


def _once_each(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's fields as a dict; ``_GivenTwice`` naming a field given twice."""
    fields: dict[str, Any] = {}
    for name, value in pairs:
        if name in fields:
            raise _GivenTwice(name, _shown(pairs))
        fields[name] = value
    return fields


def _shown(pairs: list[tuple[str, Any]], most: int = 6, width: int = 24) -> str:
    """A JSON object's first fields as a reader finds it in the file: 'c=4, k=4, spatial=[6, 6], ...'."""
    def value(v: Any) -> str:
        text = json.dumps(v)
        if len(text) <= width:
            return text
        return "..." if isinstance(v, (dict, list)) else text[:width - 3] + "..."

    shown = ", ".join(f"{name}={value(v)}" for name, v in pairs[:most])
    return shown + (", ..." if len(pairs) > most else "")


def load_layers(path: str | Path, batch: int | None = None, **fields: Any) -> list[Layer]:
    """Layers from a JSON or DeepBench-style CSV file (see the module docstring for the formats)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read layer file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"layer file {path} is not text (byte {exc.start} is not UTF-8): give a JSON or CSV "
                         f"layer file") from None
    if path.suffix.lower() == ".csv":
        layers = _from_deepbench_csv(text, str(path), batch, **fields)
    else:
        try:
            data = json.loads(text.removeprefix("\ufeff"), object_pairs_hook=_once_each)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"layer file {path} is not valid JSON: {exc}") from None
        except _GivenTwice as exc:  # the value kept would be the last, another layer than the first one meant
            raise ValueError(f"layer file {path} gives the field {exc.args[0]!r} twice in one object (the one with "
                             f"{exc.args[1]}); give it once") from None
        entries = data.get("layers") if isinstance(data, dict) else data
        if not isinstance(entries, list):
            raise ValueError(f"layer file {path} must hold a list of layers, or an object with a 'layers' list")
        layers = _from_entries(entries, str(path), batch, **fields)
    if not layers:
        raise ValueError(f"layer file {path} holds no layers; give at least one (docs/api.md, 'Layer files')")
    return layers


def resolve(name_or_path: str, batch: int | None = None, **fields: Any) -> list[Layer]:
    """A built-in network by name, else a layer file by path."""
    if name_or_path in NETWORKS:
        return network_layers(name_or_path, batch, **fields)
    if Path(name_or_path).exists():
        return load_layers(name_or_path, batch, **fields)
    raise ValueError(
        f"{name_or_path!r} is neither a built-in network ({', '.join(NETWORKS)}) nor an existing layer file"
    )
