"""What convtune's Triton kernels compile to for a GPU, counted on any machine (no GPU needed).

Each configuration of the chosen families is compiled for the target (default: the H200's sm_90) exactly as a run
would launch it on the given problems (the same arguments, constants and Triton's own specializations: integers
equal to 1 as constants, pointers and integers divisible by 16 marked so), then its machine code is read with the
CUDA tools Triton ships (cuobjdump): registers and spilled bytes per thread, shared memory, and the static
instruction counts (all, tensor-core products, global loads, shared-memory stores, loops). ``warp instructions``
multiplies a kernel's static count by its programs and warps: the instructions issued if each loop ran once and
each branch both ways, exact for straight-line kernels. For kernels whose loops' turns are known here (the banded
and strip depthwise kernels: ``TURNS``), ``issue-bound`` counts them: the innermost loop's instructions times its
turns, the loop around it's times its own, the rest once, issued at one warp instruction a clock by each of the target's
schedulers (``ISSUE_RATE``), and no faster than the programs, placed whole on the SMs, leave the busiest scheduler
(``issue_bound_us``): the time a kernel limited by nothing but issuing instructions would take. This
is a prediction to check against a GPU's timing, not a timing: it tells which configurations spill, which never
reach the tensor cores, and how much work a kernel change removes.

    python bench/sass_counts.py                                  # the default problems of every family
    python bench/sass_counts.py --families grouped \
        --problems 'fwd|n32|c128|k128|in56x56|r3x3|s1x1|p1x1|d1x1|g32|float16|channels_last|cuda|tf32=1'

Results: bench/results/sass_counts.json and .md (or --out, --name); rows of other revisions in the file are kept,
so that two revisions' counts of the same kernels stand side by side (run it at each), unless --replace drops those
of the families counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import depthwise  # noqa: E402  (bench/depthwise.py: the layers of its default table)
from convtune.algorithms.registry import registered  # noqa: E402
from convtune.algorithms.triton_family import TritonAlgorithm  # noqa: E402
from convtune.problem import DIRECTIONS, ConvProblem  # noqa: E402

# Per family, the problems counted by default: layers of networks where the family is meant to win (ResNeXt-50's
# grouped layers; depthwise layers of 3x3 to 31x31; for the banded and strip kernels, whose issue-bound time is
# counted, every layer of bench/depthwise.py's default table, which holds the best cuDNN plan's time of each; networks'
# first layers, bench/depthwise.py's --sweep first), in the three directions.
GROUPED = ("c128|k128|in56x56|r3x3|s1x1|p1x1|g32", "c256|k256|in28x28|r3x3|s1x1|p1x1|g32",
           "c512|k512|in14x14|r3x3|s1x1|p1x1|g32")
DEPTHWISE = ("c96|k96|in56x56|r7x7|s1x1|p3x3|g96", "c672|k672|in14x14|r5x5|s1x1|p2x2|g672",
             "c144|k144|in56x56|r3x3|s2x2|p1x1|g144", "c512|k512|in14x14|r31x31|s1x1|p15x15|g512")
DEFAULTS = {"grouped": GROUPED, "depthwise": DEPTHWISE, "depthwise_band": depthwise.DEFAULT_SHAPES,
            "depthwise_strip": depthwise.DEFAULT_SHAPES, "depthwise_rows": depthwise.DEFAULT_SHAPES,
            "folded": depthwise.FIRST_SHAPES}
TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32"}
# An sm_90 GPU (H100, H200): 132 SMs of 4 schedulers, each issuing one warp instruction a clock at the 1.98 GHz boost
# clock. Other targets get no issue-bound time.
ISSUE_ARCH, SMS, SCHEDULERS, CLOCK = 90, 132, 4, 1.98e9
ISSUE_RATE = SMS * SCHEDULERS * CLOCK  # warp instructions a second


def issue_bound_us(launch: dict, turns: tuple[tuple[float, ...], int | tuple[int, ...]]) -> float:
    """The issue-bound time of a launch whose programs' innermost loop turns ``turns[0][i]`` times in the i-th of
    equal shares of its programs (one share where all turn alike), inside a loop of ``turns[1]`` turns, or of
    ``turns[1][i]`` in the i-th share (whose own instructions, ``outer_loop``, repeat with it; those outside every
    loop run once). One warp instruction a clock
    per scheduler, and a program's warps spread over its SM's schedulers: the longer of all the warps' instructions
    spread over every scheduler, and of what the programs, placed whole on the SMs, leave the busiest one (with m
    SMs, the (k·m+1)-th longest program's share puts k+1 such shares on some scheduler)."""
    shares, outer = turns
    outers = outer if isinstance(outer, tuple) else (outer,) * len(shares)
    loop, around = launch["inner_loop"], launch.get("outer_loop") or launch["inner_loop"]
    once = launch["instructions"] - around
    per_warp = [once + ((around - loop) + loop * t) * o for t, o in zip(shares, outers)]
    programs = math.prod(launch["grid"])
    warps = launch["warps"]
    assert programs % len(per_warp) == 0 and warps & (warps - 1) == 0, (launch["grid"], warps, shares)
    spread = sum(per_warp) / len(per_warp) * programs * warps / ISSUE_RATE
    # a program's load on each scheduler of its SM, the programs an SM takes side by side, and the longest first
    slots = SMS * max(1, SCHEDULERS // warps)
    load = sorted((w * -(-warps // SCHEDULERS) for w in per_warp for _ in range(programs // len(per_warp))),
                  reverse=True)
    busiest = max((k + 1) * load[k * slots] for k in range(-(-len(load) // slots)))
    return max(spread, busiest / CLOCK) * 1e6


def banded_turns(problem: ConvProblem, algorithm: TritonAlgorithm,
                 launch: dict) -> tuple[tuple[float, ...], int] | None:
    """The turns of a banded kernel's innermost loop, and of the loop around it (``kernels.banded``), read against
    the loops its machine code kept: the forward turns once per kernel row; the data gradient once per kernel row
    within a loop over the channel multiple (the compiler may unroll the kernel rows, keeping the multiple's loop
    alone); the weight gradient's partial sums once per BLOCK_M rows of a run (the last run may be shorter: one
    count per run, each the turns of an equal share of the programs), in a loop over the kernel rows. As (the
    innermost loop's turns per share, turns of the loop around); None for the partials' sum, and where the loops
    kept are not of a shape the source can give (copies side by side, say)."""
    from convtune.kernels.shared import geometry

    r, (loops, nested) = geometry(problem)[0], (launch["loops"], launch.get("nested", False))
    kernel = launch["kernel"]
    if kernel == "_sum_partials":
        return None
    if loops == 0:
        return (1,), 1  # straight-line code: each instruction issued once
    if kernel == "_forward" and loops == 1:
        return (r,), 1
    if kernel == "_backward_data":
        multiple = problem.k // problem.c
        if loops == 1:  # the kernel rows' loop, or (a multiple of 2 or more) the multiple's with the rows unrolled
            return ((multiple,) if multiple > 1 else (r,)), 1
        if loops == 2 and nested:
            return (r,), multiple
    if kernel == "_backward_filter_partials" and (loops == 2 and nested or loops == 1 and r == 1):
        return _run_turns(problem, algorithm.tile.chunk, 1, algorithm.tile.rows), r
    return None


def _run_turns(problem: ConvProblem, chunk: int, per_row: int, block: int) -> tuple[int, ...]:
    """A weight gradient's turns per run of ``chunk`` output rows (the last may be shorter), ``per_row`` items a row
    taken ``block`` at a time: one count per run."""
    from convtune.kernels.shared import sizes

    rows = problem.n * sizes(problem)[2]
    return tuple(-(-min(chunk, rows - first) * per_row // block) for first in range(0, rows, chunk))


def strip_turns(problem: ConvProblem, algorithm: TritonAlgorithm,
                launch: dict) -> tuple[tuple[float, ...], int] | None:
    """The turns of a strip kernel's loops (``kernels.strips``), as ``banded_turns`` gives them: the forward and
    the data gradient turn once per kernel row (each turn the row's columns unrolled; a strided data gradient's
    launch, one per phase of dx's rows, once per kernel row that meets dy's rows from it; strips of two rows once per
    input row both rows read), the data gradient within a loop over the channel multiple; the weight gradient once
    per BLOCK_STRIPS strips of a run (one count per run), a kernel row a program; the weights' layout is
    straight-line code; None for the partials' sum and for loops of another shape."""
    from convtune.kernels.shared import geometry, sizes
    from convtune.kernels.strips import row_shift

    r, (loops, nested) = geometry(problem)[0], (launch["loops"], launch.get("nested", False))
    kernel = launch["kernel"]
    if kernel == "_sum_partials":
        return None
    if loops == 0:
        return (1,), 1
    if kernel == "_strips" and algorithm.tile.rows == 2:
        # two output rows a strip: a loop over the input rows both rows read (r - shift turns); the rows only one of
        # them reads (shift each) are unrolled when the shift is 1, loops of their own otherwise (not counted here)
        shift = row_shift(problem)
        multiple = problem.k // problem.c if problem.direction == "bwd_data" else 1
        return ((r - shift,), 1) if loops == 1 and shift == 1 and multiple == 1 else None
    if kernel == "_strips":
        multiple = problem.k // problem.c if problem.direction == "bwd_data" else 1
        ints = launch.get("integers", {})
        rows = len(range(ints.get("r_first", 0), r, ints.get("r_step", 1)))  # the kernel rows this launch meets
        if loops == 1 and (multiple == 1 or rows == 1):
            return (rows * multiple,), 1
        if loops == 2 and nested:
            return (rows,), multiple
    if kernel == "_filter_partials" and loops == 1:  # a kernel row a program: the grid's third axis
        tile = algorithm.tile
        return _run_turns(problem, tile.chunk, -(-sizes(problem)[3] // tile.strip), tile.strips), 1
    return None


def rows_turns(problem: ConvProblem, algorithm: TritonAlgorithm,
               launch: dict) -> tuple[tuple[float, ...], tuple[int, ...]] | None:
    """The turns of the weight gradient by rows' loops (``kernels.rows``): once per block of output columns, within a
    loop over a run's input rows (one share per run of an image: the last may be shorter); None for the partials' sum
    and for loops of another shape."""
    from convtune.kernels.shared import sizes

    if launch["kernel"] != "_row_products" or launch["loops"] != 2 or not launch.get("nested", False):
        return None
    h, _, _, q = sizes(problem)
    rows, blocks = algorithm.tile.rows, -(-q // algorithm.tile.block_q)
    runs = tuple(min(rows, h - first) for first in range(0, h, rows))
    return (blocks,) * len(runs), runs


TURNS = {"depthwise_band": banded_turns, "depthwise_strip": strip_turns,
         "depthwise_rows": rows_turns}  # per family, where its loops' turns are known


def problem_keys(family: str, dtype: str, layout: str) -> list[str]:
    """The default problems of ``family`` (batch 32) as keys, in every direction."""
    if family in ("depthwise_band", "depthwise_strip", "depthwise_rows", "folded"):
        return [depthwise.make_problem(shape, d, 32, dtype, layout).key for shape in DEFAULTS[family]
                for d in DIRECTIONS]
    return [f"{d}|n32|{shape.replace('|g', '|d1x1|g')}|{dtype}|{layout}|cuda|tf32=1"
            for shape in DEFAULTS[family] for d in DIRECTIONS]


def tools() -> Path:
    """The folder of the CUDA tools Triton's NVIDIA backend ships (cuobjdump)."""
    import triton.backends.nvidia as nvidia

    return Path(nvidia.__file__).parent / "bin"


def specialized(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constants, attrs, options) of what Triton's launcher compiles for ``kernel(*args, **kwargs)``:
    keywords (and integers equal to 1) as constants, every (PyTorch-allocated, so aligned) pointer and integer
    divisible by 16 marked so, but not the kernel's ``do_not_specialize`` parameters (nor the divisibility of its
    ``do_not_specialize_on_alignment`` ones); num_warps/num_stages as options."""
    kwargs = dict(kwargs)
    warps = kwargs.pop("num_warps", 4)
    stages = kwargs.pop("num_stages", None)
    names = kernel.arg_names
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    signature, constants, attrs = {}, {}, {}
    fixed = {p.name for p in kernel.params if p.do_not_specialize}  # compiled as run-time values whatever they are
    unaligned = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}  # 1 a constant, no divisibility
    for index, (name, value) in enumerate(zip(names, values)):
        if isinstance(value, torch.Tensor):
            signature[name] = TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # Triton's specialization of aligned pointers
        elif name in kwargs or isinstance(value, (bool, str)) or value == 1 and name not in fixed:
            signature[name], constants[name] = "constexpr", value  # a constant, or an integer equal to 1
        else:
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0 and name not in fixed and name not in unaligned:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constants, attrs, {"num_warps": warps, **({"num_stages": stages} if stages is not None else {})}


def compile_launch(kernel, grid: tuple[int, ...], args: tuple, kwargs: dict, arch: int) -> dict:
    """Compile one launch ``kernel[grid](*args, **kwargs)`` for sm_<arch> and count its machine code."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs, options = specialized(kernel, args, kwargs)
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    names = kernel.arg_names
    values = list(args) + [kwargs[n] for n in names[len(args):]]
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools() / "cuobjdump", "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([tools() / "cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return dict(kernel=kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, grid=list(grid),
                integers={n: v for n, v in zip(names, values) if n not in kwargs and isinstance(v, int)
                          and not isinstance(v, bool)},  # the run-time integers (for TURNS; not kept)
                warps=options["num_warps"], registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                # ptxas reports spilled registers in the stack frame (STACK), local arrays in LOCAL
                spilled_bytes=sum(int(re.search(rf"{field}:(\d+)", usage).group(1)) for field in ("STACK", "LOCAL")),
                spill_instructions=len(re.findall(r"\b(?:STL|LDL)\b", sass)), shared_bytes=compiled.metadata.shared,
                **instruction_counts(sass))


def instruction_counts(sass: str) -> dict:
    """Static counts of a kernel's machine code (cuobjdump -sass): all instructions, tensor-core products (HMMA,
    HGMMA), global loads (into registers, or straight into shared memory: LDGSTS, UTMALDG), shared-memory stores,
    loops (backward branches), and the innermost loop's instructions and tensor-core products (one turn's work)."""
    lines = [(int(address, 16), op) for address, op in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;", sass)]
    ops = collections.Counter(op for _, op in lines)
    ends: dict[int, int] = {}  # each loop's first address: its last (several branches back to one start: one loop)
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*BRA[^;]*);", sass):
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if target and target.group(1) and int(target.group(1), 16) < int(address, 16):
            start = int(target.group(1), 16)
            ends[start] = max(ends.get(start, 0), int(address, 16))
    loops = list(ends.items())  # (first, last) address of each loop's body
    inner = min(loops, key=lambda span: span[1] - span[0], default=None)  # the innermost: the shortest body
    body = [op for address, op in lines if inner and inner[0] <= address <= inner[1]]
    around = [span for span in loops if span != inner and span[0] <= inner[0] and inner[1] <= span[1]]
    nested = bool(around)
    outer = min(around, key=lambda span: span[1] - span[0], default=None)  # the loop right around the innermost
    outer_loop = sum(1 for address, _ in lines if outer and outer[0] <= address <= outer[1])
    return dict(instructions=len(lines), tensor_core=ops["HMMA"] + ops["HGMMA"],
                global_loads=ops["LDG"] + ops["LDGSTS"] + ops["UTMALDG"],
                shared_stores=ops["STS"] + ops["STSM"], loops=len(loops), nested=nested, outer_loop=outer_loop,
                inner_loop=len(body),
                inner_loop_tensor_core=sum(op in ("HMMA", "HGMMA") for op in body))


def count(problem: ConvProblem, algorithm: TritonAlgorithm, arch: int) -> list[dict]:
    """Every launch one run of ``algorithm`` on ``problem`` makes, compiled and counted (nothing runs)."""
    from convtune.kernels import recording

    launches: list[dict] = []

    def compile_instead(kernel, grid, *args, **kwargs):
        launches.append(compile_launch(kernel, tuple(grid), args, kwargs, arch))

    def operand(shape):
        t = torch.empty(shape, dtype=problem.torch_dtype)
        return t.to(memory_format=torch.channels_last) if problem.layout == "channels_last" and t.dim() == 4 else t

    a, b = (operand(s) for s in problem.operand_shapes[:2])
    out = operand(problem.operand_shapes[2])
    buffers = {buf.name: torch.empty(buf.shape, dtype=buf.dtype) for buf in algorithm.buffers(problem)}
    with recording.intercepted(compile_instead):
        algorithm._run(problem, a, b, out, buffers)
    for launch in launches:
        known = algorithm.family in TURNS and arch == ISSUE_ARCH
        turns = TURNS[algorithm.family](problem, algorithm, launch) if known else None
        if turns:
            launch["issue_bound_us"] = issue_bound_us(launch, turns)
        del launch["integers"]
    return launches


def markdown(env: dict, rows: dict) -> str:
    lines = []
    for row in sorted(rows.values(), key=lambda r: (r["problem"], r["algorithm"], r["revision"])):
        p = ConvProblem.from_key(row["problem"])
        shape = (f"{p.direction} n{p.n} c{p.c} k{p.k} g{p.groups} {'x'.join(map(str, p.input_size))} "
                 f"r{'x'.join(map(str, p.kernel_size))} s{p.stride[0]} d{p.dilation[0]} {p.dtype} {p.layout}")
        for launch in row["launches"]:
            programs = math.prod(launch["grid"])
            total = launch["instructions"] * programs * launch["warps"]
            lines.append([shape, row["algorithm"].removeprefix("triton:"), row["revision"], launch["kernel"],
                          launch["registers"], f"{launch['spilled_bytes']} ({launch.get('spill_instructions', '-')})",
                          launch["shared_bytes"],
                          launch["instructions"], launch["tensor_core"], launch["global_loads"],
                          launch["shared_stores"], launch["loops"],
                          f"{launch.get('inner_loop', '-')} / {launch.get('inner_loop_tensor_core', '-')}", programs,
                          f"{total / 1e6:.2f}",
                          f"{launch['issue_bound_us']:.1f}" if "issue_bound_us" in launch else "-"])
    return (f"# convtune's Triton kernels in machine code\n\n{common.env_line(env)}; compiled by Triton "
            f"{env.get('triton', '?')} for sm_{env['arch']} "
            "and counted with cuobjdump, nothing run (`bench/sass_counts.py`). Per launch: registers and spilled "
            "bytes per thread (the stack frame, with the number of spill stores and loads), shared memory (bytes), "
            "static instruction counts (all, tensor-core products, global "
            "loads, shared-memory stores, loops; the innermost loop's instructions and tensor-core products: one "
            "turn a warp), programs, and warp instructions (millions): static count × programs × warps, the "
            "instructions issued if each loop ran once and every branch ran both ways (an estimate; exact for "
            "straight-line code); for the banded and strip kernels, whose loops' turns are known, the issue-bound "
            "time (µs): "
            "the innermost loop's instructions times its turns, the loop around it's times its turns, the rest once, "
            "issued at one warp instruction a clock per scheduler (132 SMs × 4 at 1.98 GHz), spread over all of them "
            "or, where the programs are too few or too uneven to share them evenly, as they fall on the busiest: the "
            "time of a kernel that nothing but issuing limits (a prediction, not a timing; both ways of a branch are "
            "counted). Rows of several revisions stand side by side.\n\n"
            + common.md_table(["problem", "configuration", "revision", "kernel", "registers", "spilled", "shared",
                               "instructions", "tensor core", "loads", "shared stores", "loops",
                               "innermost loop: instructions / tensor core", "programs", "warp instructions (M)",
                               "issue-bound (µs)"],
                              lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", type=lambda t: t.split(","), default=list(DEFAULTS),
                        help=f"comma-separated, of {', '.join(DEFAULTS)}")
    parser.add_argument("--problems", action="append", default=[], help="a problem key (repeatable; default: the "
                        "families' own problems)")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--layout", default="channels_last")
    parser.add_argument("--arch", type=int, default=90, help="the target's compute capability (90: H100, H200)")
    parser.add_argument("--replace", action="store_true", help="drop the rows the file holds of the families counted "
                        "at other revisions (without it they stand beside the new ones)")
    common.result_arguments(parser, "sass_counts")
    args = parser.parse_args()
    unknown = set(args.families) - set(DEFAULTS)
    if unknown:
        parser.error(f"--families {','.join(sorted(unknown))}: each must be one of {','.join(DEFAULTS)}")
    os.environ.pop("TRITON_INTERPRET", None)
    out_dir = Path(args.out or common.RESULTS)
    json_path = out_dir / f"{args.name}.json"
    payload = json.loads(json_path.read_text()) if json_path.exists() else {}
    import triton

    env = dict(common.environment(), arch=args.arch, triton=triton.__version__)
    rows = payload.get("rows", {})
    if args.replace:
        rows = {k: row for k, row in rows.items()
                if row["revision"] == env["revision"] or common.family_of(row["algorithm"]) not in args.families}
    for family in args.families:
        keys = args.problems or problem_keys(family, args.dtype, args.layout)
        for key in keys:
            problem = ConvProblem.from_key(key)
            for algorithm in registered():
                if (not isinstance(algorithm, TritonAlgorithm) or algorithm.family != family
                        or problem.direction not in algorithm.directions):
                    continue
                if not algorithm.supports(problem):  # a CUDA problem: its kernels' own refusals, on any machine
                    continue
                launches = count(problem, algorithm, args.arch)
                rows[f"{key}:{algorithm.name}:{env['revision']}"] = dict(
                    problem=key, algorithm=algorithm.name, revision=env["revision"], launches=launches)
                first = launches[0]
                print(f"{algorithm.name} {key}: {first['registers']} registers, {first['instructions']} instructions",
                      file=sys.stderr, flush=True)
    payload.update(environment=env, rows=rows)
    common.write(args.name, payload, markdown(env, rows), out_dir)


if __name__ == "__main__":
    main()
