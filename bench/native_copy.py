"""What the copy into a caller's buffer adds to torch:native's time, per layer of a built-in network.

A tuned layer runs an algorithm through ``Algorithm.execute``, which hands over PyTorch's own result where
the algorithm is torch:native; ``Algorithm.run`` checks the operands and copies that result into the output it
is given. ``find`` times ``Algorithm.launcher`` (what a tuned layer runs; ``hardware.MEASUREMENT_METHOD`` 2),
not ``run`` (method 1). Per layer, with the one timer (``convtune.timing.benchmark``): torch:native timed both
ways, the order alternating from layer to layer, and their ratio.

    python bench/native_copy.py --network resnet50 --batch 8 --dtype float32 --layout NHWC --device cpu

writes bench/results/native_copy_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from convtune import zoo  # noqa: E402
from convtune.algorithms.base import allocate_workspace  # noqa: E402
from convtune.algorithms.registry import get_algorithm  # noqa: E402
from convtune.timing import benchmark  # noqa: E402
from convtune.verify import reference, rel_error, tolerance  # noqa: E402


def measure(layer, launcher_first: bool) -> dict:
    p = layer.problem
    native = get_algorithm("torch:native", p)
    inputs = p.random_inputs(seed=0)
    out = p.empty(p.operand_shapes[2]).fill_(float("nan"))
    ws = allocate_workspace(native.buffer_bytes(p), p.device)
    native.run(p, *inputs, workspace=ws, out=out)  # checked once, as find checks before it times
    err = rel_error(out, reference(p, *inputs))
    if not err <= tolerance(p, native.notes(p)):
        raise SystemExit(f"{layer.name}: torch:native is off by {err:.3g} on {p.key}")
    calls = {"run": lambda: native.run(p, *inputs, workspace=ws, out=out),
             "launcher": native.launcher(p, *inputs, out, ws)}
    ms = {name: benchmark(calls[name], device=p.device).median_ms
          for name in (("launcher", "run") if launcher_first else ("run", "launcher"))}
    run_ms, launch_ms = ms["run"], ms["launcher"]
    return dict(layer=layer.name, problem=p.key, run_ms=run_ms, launcher_ms=launch_ms, ratio=run_ms / launch_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.network_arguments(parser)
    parser.add_argument("--layers", type=int, default=8, help="the network's first N distinct layers")
    common.result_arguments(parser, "native_copy")
    args = parser.parse_args()
    layers = zoo.network_layers(args.network, args.batch, dtype=args.dtype, layout=args.layout,
                                device=args.device)[:args.layers]
    rows = [measure(layer, launcher_first=i % 2 == 1) for i, layer in enumerate(layers)]
    env = common.environment()
    name = args.name if args.name != "native_copy" else f"native_copy_{args.device}"
    table = common.md_table(["layer", "problem", "run ms (checks, copy into out)", "launcher ms (as find times)",
                             "ratio"],
                            [[r["layer"], f"`{r['problem']}`", f"{r['run_ms']:.3f}", f"{r['launcher_ms']:.3f}",
                              f"{r['ratio']:.2f}"] for r in rows])
    ratios = [r["ratio"] for r in rows]
    markdown = (f"# torch:native timed with and without the copy into the output\n\n{common.env_line(env)}. "
                f"{args.network} b{args.batch} {args.dtype} {args.layout} on {args.device}, its first "
                f"{len(rows)} layers; medians of `convtune.timing.benchmark`; `bench/native_copy.py`. "
                f"Ratio: `run` / `launcher`, {min(ratios):.2f}-{max(ratios):.2f} "
                f"(geometric mean {common.geomean(ratios):.2f}).\n\n{table}")
    common.write(name, dict(environment=env, args=vars(args), rows=rows), markdown, args.out and Path(args.out))
    print(markdown)


if __name__ == "__main__":
    main()
