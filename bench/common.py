"""What every benchmark script shares: environment facts, result files, one timer for everything."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

import convtune
from convtune import hardware, results

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    """Date, GPU and software versions: every result file carries them."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(), "torch": torch.__version__, "convtune": convtune.__version__,
        "software": hardware.software_versions(), "revision": revision(), "source": source_tree(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
        try:
            import cudnn

            env["cudnn_frontend_backend"] = cudnn.backend_version()
        except ImportError:
            pass
    else:
        env["cpu"] = hardware.cpu_model()
    return env


def where(env: dict) -> str:
    """The machine an environment measured on: its GPU's name, or its CPU's."""
    return env.get("gpu") or env.get("cpu") or "CPU"


def extendable(path: Path, env: dict, name: str) -> dict:
    """The results file at ``path`` that this run (of ``env``) adds its rows to, empty where there is none. Exits with
    a message where its rows were measured on another machine: rows of two GPUs never share one file, whose tables
    compare its rows with each other."""
    payload = json.loads(path.read_text()) if path.exists() else {}
    theirs = payload.get("environment")
    if theirs and where(theirs) != where(env):
        words = where(env).split()
        example = f" (e.g. --name {name}_{words[1].lower()})" if env.get("gpu") and len(words) > 1 else ""
        sys.exit(f"{path} holds results measured on {where(theirs)}, and this run is on {where(env)}: write them to "
                 f"another results file with --name{example}")
    return payload


def env_line(env: dict) -> str:
    """A result file's provenance in one line: when, where, which software and which revision measured it, and
    the library's src/ tree where recorded (it names the code measured even when the commit is not on main)."""
    where = env.get("gpu") or env.get("cpu") or "CPU"
    software = [f"torch {env.get('torch')}"]
    software += [f"CUDA {env['cuda']}"] if env.get("cuda") else []
    software += [f"cuDNN {env['cudnn']}"] if env.get("cudnn") else []
    software += [f"convtune {env['convtune']}"] if env.get("convtune") else []
    source = f" (src/ tree {env['source']})" if env.get("source") not in (None, "unknown") else ""
    return f"{env.get('date')}, {where}, {', '.join(software)}, revision {env.get('revision', 'not recorded')}{source}"


def revision() -> str:
    """The commit the code under measurement is: BENCH_REVISION (a copy of the tree without its .git
    sets it), else git's short hash ('+' when the tree has changes), else 'unknown'."""
    return _git_version("BENCH_REVISION", "HEAD")


def source_tree() -> str:
    """What the library's code under measurement is, whatever commit carries it: BENCH_SOURCE (a copy of the
    tree without its .git sets it), else git's short hash of the src/ tree ('+' when src/ has changes), else
    'unknown'. Commits that change only benchmarks, tests or docs share it, so results measured at any of them
    measured the same library."""
    return _git_version("BENCH_SOURCE", "HEAD:src", "src")


def _git_version(variable: str, obj: str, *paths: str) -> str:
    """$variable, else git's short hash of ``obj`` with '+' where the tracked files (of ``paths``) have changes."""
    if os.environ.get(variable):
        return os.environ[variable]
    top = Path(__file__).resolve().parent.parent
    try:
        short = subprocess.run(["git", "rev-parse", "--short", obj], cwd=top, capture_output=True, text=True,
                               check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths], cwd=top,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return short + ("+" if dirty else "")


def write(name: str, payload: dict, markdown: str, out_dir: Path | None = None) -> tuple[Path, Path]:
    """bench/results/<name>.json and .md (or under ``out_dir``)."""
    out_dir = Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(markdown)
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return json_path, md_path


def run_child(cmd: list[str], timeout: float) -> dict:
    """Run a benchmark's child process, ``cmd`` with ``--child-out FILE`` added, where it writes its JSON:
    {"status": "ok", **what it wrote}, or {"status": "failed (rc): its last error line", "stderr": ...}."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = subprocess.run(cmd + ["--child-out", f.name], capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            # the cuDNN frontend's bindings list the objects alive at exit after the error: not the cause
            lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith(("nanobind", " - "))]
            return {"status": f"failed ({proc.returncode}): {(lines or [''])[-1][:300]}",
                    "stderr": "\n".join(lines)[-4000:]}
        return {"status": "ok", **json.loads(Path(f.name).read_text())}


def result_arguments(parser, name: str) -> None:
    """--out (the results folder, default bench/results) and --name (of the .json and .md, default ``name``)."""
    parser.add_argument("--out", default=None, help="folder of the result files (default: bench/results)")
    parser.add_argument("--name", default=name, help=f"the result files' name (default: {name})")


def network_arguments(parser, device_help: str | None = None) -> None:
    """The options that name a network's layer set: --network, --batch, --dtype, --layout, --device."""
    parser.add_argument("--network", default="resnet50")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--layout", default="NHWC")
    parser.add_argument("--device", default="cuda", help=device_help)


def family_of(name: str) -> str:
    """The Triton family of a configuration's name ('triton:depthwise_band_fwd_r32n16c8w4': 'depthwise_band'), as
    registered or not (a row of an older revision may name one no longer registered); '' for another algorithm."""
    family = results.family_of(name)
    return family.removeprefix("triton:") if family.startswith("triton:") else ""


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    if not values:
        return float("nan")
    return float(torch.tensor(values, dtype=torch.float64).log().mean().exp())


def median_interval(values, confidence: float = 0.95) -> tuple[float, float, float] | None:
    """(low, high, coverage): the distribution-free interval of the median of ``values`` (independent rounds), the
    order statistics x_(j) and x_(n+1-j) with the largest j whose coverage, 1 - 2·P(Binomial(n, 1/2) < j), is at
    least ``confidence``; None for fewer than 6 values, where no such interval reaches 95%. Seven rounds give
    the whole range (98.4%), eleven the second lowest to the second highest (98.8%)."""
    ordered, n = sorted(values), len(values)
    below, best = 0.0, None
    for j in range(1, n // 2 + 1):  # below: P(X < j) of X ~ Binomial(n, 1/2)
        below += math.comb(n, j - 1) / 2 ** n
        if 1 - 2 * below < confidence:
            break
        best = (ordered[j - 1], ordered[n - j], 1 - 2 * below)
    return best


def costliest(stats: dict, top: int = 25, where: str | None = "convtune") -> list[tuple[float, str]]:
    """The ``top`` costliest functions of cProfile's ``stats`` (pstats.Stats(...).stats) by cumulative seconds, as
    (seconds, 'file.py:name'), those of files whose path contains ``where`` (None: every function)."""
    return sorted(((v[3], f"{Path(file).name}:{name}") for (file, _, name), v in stats.items()
                   if where is None or where in file), reverse=True)[:top]


@contextlib.contextmanager
def phase_clock(phases):
    """A dict label -> ms spent in each phase while the block runs: ``phases`` are (label, module, attribute)
    triples naming a callable where its callers look it up (``convtune.measure.check``, not ``convtune.verify.check``,
    since measure imported it by name; a class's method as ``Class.method``), each wrapped by ``setattr`` and restored
    after. The outermost calls count (a phase that calls itself once), in every thread, summed over the threads.
    A module that cannot be imported (cuDNN's frontend not installed) leaves its phases out. Unlike cProfile, it
    counts a call that ends in an exception, and costs only the wrapped calls."""
    spent: dict[str, float] = {}
    undo = []
    try:
        for label, module_name, attribute in phases:
            try:
                owner: object = importlib.import_module(module_name)
            except ImportError:
                continue
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            # a class's own function (a method of a base class is wrapped where it is defined)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if isinstance(original, (staticmethod, classmethod)) or not callable(original):
                raise TypeError(f"phase_clock: {module_name}.{attribute} is not a function or a plain method")
            depth = threading.local()

            def wrapped(*args, _original=original, _label=label, _depth=depth, **kwargs):
                outer = getattr(_depth, "n", 0) == 0
                _depth.n = getattr(_depth, "n", 0) + 1
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    _depth.n -= 1
                    if outer:
                        spent[_label] += 1e3 * (time.perf_counter() - start)  # one float add: atomic under the GIL
            setattr(owner, name, wrapped)
            undo.append((owner, name, original))
            spent[label] = 0.0
        yield spent
    finally:
        for owner, name, original in reversed(undo):
            setattr(owner, name, original)
