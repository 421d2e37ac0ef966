"""The GPU tests' grid: each layer in every direction, dtype and layout, with readable test ids."""

from convtune import problem
from convtune.problem import DIRECTIONS, LAYOUTS

DTYPES = tuple(problem.DTYPES)  # float32, float16, bfloat16


def cases(layers: list[dict]) -> list[tuple[dict, str, str, str]]:
    """(layer, direction, dtype, layout) for every layer and combination."""
    return [(layer, d, dt, lo) for layer in layers for d in DIRECTIONS for dt in DTYPES for lo in LAYOUTS]


def case_id(case: tuple[dict, str, str, str]) -> str:
    layer, d, dt, lo = case
    size = "x".join(map(str, layer["input_size"]))
    return f"c{layer['c']}k{layer['k']}s{size}r{layer['kernel_size']}g{layer.get('groups', 1)}-{d}-{dt}-{lo}"
