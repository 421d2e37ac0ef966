"""The host-cost rule's measurement on several probe layers: what each path of a tuned layer costs the host over
``torch.nn.Conv2d``'s per direction (``convtune.pytorch.host_costs._measured``), on the layer the rule measures
(``host_costs.probe_problem``) and on others, each in its own process, so that one can see whether the layer the rule
measures on stands for a network's layers.

    python bench/host_probe.py                      # on CUDA: 8 channels at 4x4, 256 and 1024->256 at 14x14
    python bench/host_probe.py --device cpu --out /tmp/hp

Results: bench/results/host_probe.json and .md (or --out).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROBES = {"cuda": [(1, 8, 8, 4), (4, 256, 256, 14), (4, 1024, 256, 14), (4, 256, 256, 14)],
          "cpu": [(1, 8, 8, 4), (1, 64, 64, 8)]}
KINDS = ["native", "gemm_1x1", "cudnn", "python", "triton"]


def child(device: str, n: int, c: int, k: int, size: int) -> dict:
    from convtune.problem import ConvProblem
    from convtune.pytorch import host_costs

    p = ConvProblem("fwd", n=n, c=c, k=k, input_size=(size, size), kernel_size=1, layout="channels_last",
                    dtype="float16" if device == "cuda" else "float32", device=device)
    overheads = {kind: round(us, 1) for kind, us in host_costs._measured(device, p).items()}
    return {"problem": p.key, "layer": label(n, c, k, size), "overheads": overheads}


def label(n: int, c: int, k: int, size: int) -> str:
    return f"batch {n}, {c} to {k} channels, {size}x{size}"


def markdown(env: dict, rows: list[dict]) -> str:
    def cell(row: dict, kind: str) -> str:
        o = row["overheads"]
        if kind not in o:
            return "-"
        return f"{o[kind]:.1f} / {o[kind + ' backward']:.1f}" if kind + " backward" in o else f"{o[kind]:.1f}"
    table = [[row["layer"], *(cell(row, k) for k in KINDS)] for row in rows]
    return (f"# The host-cost rule's measurement on several layers\n\n{common.env_line(env)}. Host microseconds a "
            "tuned layer's path adds over `torch.nn.Conv2d`'s, forward / each gradient's share of the backward "
            "(`convtune.pytorch.host_costs._measured`; native: the op's forward on PyTorch's convolution; triton: the "
            "depthwise 3x3 layer of those channels); each layer in its own process, in the order listed. "
            "`bench/host_probe.py`.\n\n" + common.md_table(["probe layer (1x1)", *KINDS], table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds one probe's process may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.device, *map(int, args.child.split(",")))))
        return
    rows, seen = [], set()
    for shape in PROBES[args.device]:
        cmd = [sys.executable, __file__, "--device", args.device, "--child", ",".join(map(str, shape))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{shape}: timed out", file=sys.stderr)
            continue
        if proc.returncode != 0:
            print(f"{shape}: failed: {proc.stderr[-1500:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        if shape in seen:  # measured again: how far the measure moves between processes
            rows[-1]["layer"] += " (again)"
        seen.add(shape)
        print(rows[-1], flush=True)
    env = common.environment()
    common.write("host_probe", {"env": env, "rows": rows}, markdown(env, rows), args.out)


if __name__ == "__main__":
    main()
