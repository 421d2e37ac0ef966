"""One table of every layer-benchmark configuration, from the result files in bench/results/.

Later files override earlier ones for the same configuration (``layers.json`` first, then the
rest by name). Writes bench/results/SUMMARY.md.

    python bench/summary.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    files = sorted(common.RESULTS.glob("layers*.json"), key=lambda p: (p.name != "layers.json", p.name))
    latest, envs = {}, {}
    for path in files:
        data = json.loads(path.read_text())
        envs[path.name] = data["environment"]
        for s in data["summaries"]:
            latest[s["config"]] = (path.name, s)
    rows = []
    for config, (name, s) in latest.items():
        g, t, w = s["geomean_vs_exhaustive"], s["summed_ms"], s["tuning_s"]
        rows.append([config, f"[{name}]({name.replace('.json', '.md')})", *(f"{g[k]:.3f}" for k in (
            "get_pick_ms", "find_pick_ms", "heurA_ms", "heurB_ms", "torch_bench0_ms", "torch_bench1_ms")),
            f"{t['find_pick_ms']:.3f}", f"{t['exhaustive_best_ms']:.3f}", f"{t['floor_ms']:.3f}",
            f"{w['find']:.1f}", f"{w['exhaustive']:.1f}"])
    env = next(iter(envs.values()))
    runs = sorted({f"{e['date']} (revision {e.get('revision', 'not recorded')})" for e in envs.values()})
    text = (f"# Layer benchmark: every configuration\n\n{env.get('gpu')}, torch {env['torch']}, cuDNN {env.get('cudnn')}; "
            f"runs of {', '.join(runs)}.\n"
            "Ratios: geometric mean over layers of time / exhaustive cuDNN best. Sums in ms, each layer weighted by "
            "how often the network runs it. Tuning times in seconds.\n\n")
    text += common.md_table(["config", "file", "get", "find", "heur A", "heur B", "torch bm=0", "torch bm=1",
                             "find sum", "exhaustive sum", "floor sum", "find s", "exhaustive s"], rows)
    (common.RESULTS / "SUMMARY.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
