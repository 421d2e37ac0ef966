"""The benchmark scripts run on the CPU, and their result files can be written again from their JSON."""

import dataclasses
import gzip
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_script(name: str):
    """A fixture yielding bench/<name>.py imported as a module (the scripts import their neighbours)."""
    @pytest.fixture(name=name)
    def fixture():
        sys.path.insert(0, str(BENCH))
        try:
            yield importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))
    return fixture


tuning_cost = _bench_script("tuning_cost")
sweep = _bench_script("sweep")


@pytest.mark.slow
def test_tuning_cost_profiles_a_whole_network_cold_and_warm_on_the_cpu(tmp_path, tuning_cost):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    layers = tmp_path / "net.json"  # a small network of its own (a layer file): ResNet-18's whole took 155 s here
    layers.write_text(json.dumps([{"c": 3, "k": 16, "spatial": [32, 32], "kernel": 7, "stride": 2, "padding": 3},
                                  {"c": 16, "k": 16, "spatial": [16, 16], "kernel": 3, "padding": 1, "count": 2},
                                  {"c": 16, "k": 32, "spatial": [16, 16], "kernel": 1, "stride": 2},
                                  {"c": 32, "k": 32, "spatial": [8, 8], "kernel": 3, "padding": 1, "groups": 32}]))
    subprocess.run([sys.executable, str(BENCH / "tuning_cost.py"), "--device", "cpu", "--network", str(layers),
                    "--batch", "1", "--dtype", "float32", "--layout", "nchw", "--layers", "1", "--whole",
                    "--compile-threads", "3", "--out", str(tmp_path), "--name", "t"], check=True, env=env,
                   capture_output=True, timeout=300)
    payload = json.loads((tmp_path / "t.json").read_text())
    whole = payload["whole"]
    phases = whole["phases_s"]  # timed by wrapping the functions, where find and select look them up
    assert whole["problems"] > 0 and 0 < phases["find, in all"] <= whole["wall_s"]
    assert 0 < phases["verification runs (with the compiles they wait for)"] < phases["find, in all"]
    assert 0 < phases["float64 references"] and 0 < phases["database writes"] and whole["compile_threads"] == 3
    assert whole["warm"]["wall_s"] > 0 and whole["warm"]["top_cumulative_s"]
    assert whole["warm"]["phases_s"]["database lookups"] > 0
    assert len(payload["tuning"]) == 3  # the first layer in three directions
    text = (tmp_path / "t.md").read_text()
    assert "convtune's costliest functions" in text
    assert text.rstrip("\n") == tuning_cost.markdown(payload).rstrip("\n")


def _run(script: str, tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0", **(env or {}))
    out = subprocess.run([sys.executable, str(BENCH / script), "--device", "cpu", "--tiny", "--out", str(tmp_path),
                          "--steps", "1", *args], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / f"{Path(script).stem}.json").read_text())


@pytest.mark.slow
def test_dynamic_shapes_times_every_step_of_each_configuration_in_its_own_process(tmp_path):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, str(BENCH / "dynamic_shapes.py"), "--device", "cpu", "--tiny", "--batch", "2",
                          "--sizes", "16,24", "--repeat", "2", "--cycles", "2", "--dtype", "bfloat16",  # (float16: slow
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)  # on a CPU)
    assert out.returncode == 0, out.stderr[-3000:]
    configs = json.loads((tmp_path / "dynamic_shapes_tiny_b2.json").read_text())["configs"]
    assert [configs[c]["status"]
            for c in ("torch_bm1", "torch_bm0", "convtune_background", "convtune_hybrid")] == ["ok"] * 4
    for r in configs.values():
        assert [size for size, _ in r["steps"]] == [16, 16, 24, 24, 16, 24, 16, 24]
        assert set(r["summary"]["steady_ms"]) == {"16", "24"} and r["summary"]["worst_ratio"] > 0
    md = (tmp_path / "dynamic_shapes_tiny_b2.md").read_text()
    assert "| convtune_background |" in md and "choices unlike hybrid" in md
    assert (sum(configs["convtune_background"]["runtimes"].values())
            == len(configs["convtune_background"]["choices"]) > 0)


@pytest.mark.slow
def test_e2e_runs_families_at_once_each_on_a_gpu_of_its_own(tmp_path):
    grid = ("--styles", "eager", "--dtypes", "bfloat16", "--batches", "4,2", "--repeats", "1", "--no-profile",
            "--modes", "convtune,torch_bm1", "--gpus", "2")
    rows = _run("e2e.py", tmp_path, *grid, env={"CUDA_VISIBLE_DEVICES": "5,3,9"})["configs"]
    assert len(rows) == 4 and all(row["status"] == "ok" for row in rows.values())
    for batch in (4, 2):  # a family's rows ran on one GPU, which its processes alone saw; its first database cold
        family = [rows[f"tiny:b{batch}:bfloat16:eager:{mode}"] for mode in ("convtune", "torch_bm1")]
        assert family[0]["gpu"] == family[1]["gpu"] in ("5", "3") and family[0]["workers"] == 2
        assert all(row["visible_gpus"] == row["gpu"] for row in family) and family[0]["db"] == "cold"
    assert {rows[f"tiny:b{batch}:bfloat16:eager:convtune"]["gpu"] for batch in (4, 2)} == {"5", "3"}  # at once
    assert "one of 2 workers" in (tmp_path / "e2e.md").read_text()
    out = subprocess.run([sys.executable, str(BENCH / "e2e.py"), "--device", "cpu", "--tiny", "--out", str(tmp_path),
                          "--gpus", "3"], env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "--gpus 3: this machine shows 2 GPU(s)" in out.stderr


e2e = _bench_script("e2e")


def test_e2e_finds_where_the_device_waited_for_the_host_and_after_which_op(e2e):
    # two steps: kernels (start, end, correlation id) and their launches (start, the op that made them)
    kernels = [(0, 100, 1), (150, 200, 2), (200, 300, 3), (310, 400, 4),  # step 1
               (1000, 1100, 5), (1180, 1200, 6), (1190, 1250, 7)]  # step 2 (two streams overlap: no gap)
    launches = {1: (0, "aten::mm"), 2: (120, "aten::fill_"), 3: (10, "aten::mm"), 4: (20, "aten::mm"),
                5: (990, "aten::mm"), 6: (1150, "aten::fill_"), 7: (30, "aten::mm")}
    idle = e2e.gpu_idle(kernels, launches, steps=2)
    # idle: 50 + 10 (4 launched at 20, before the gap: the device's own) + 600 (between the steps) + 80 us
    assert idle["idle_ms"] == pytest.approx((50 + 10 + 600 + 80) / 2e3)
    assert idle["host_late_ms"] == pytest.approx((50 + 600 + 80) / 2e3)
    assert idle["after"] == [dict(op="aten::mm", ms=pytest.approx(0.3), gaps=0.5),
                             dict(op="aten::fill_", ms=pytest.approx(0.065), gaps=1.0)]
    assert idle["unmatched_ms"] == 0
    assert e2e.gpu_idle([(0, 10, 1), (30, 40, 2)], {1: (0, "aten::mm")}, steps=1)["unmatched_ms"] == 0.02
    none = e2e.gpu_idle([], {}, steps=3)  # a CPU run: no kernels, no idle time
    assert none == dict(idle_ms=0.0, host_late_ms=0.0, unmatched_ms=0.0, after=[])
    # the op a launch is credited to: the innermost above it that is not a range around many ops
    event = types.SimpleNamespace
    graph = event(name="## Call CompiledFxGraph f1 ##", cpu_parent=None)
    fill = event(name="aten::fill_", cpu_parent=event(name="CompiledFunctionBackward", cpu_parent=graph))
    assert e2e._launching_op(event(name="cudaLaunchKernel", cpu_parent=fill)) == "aten::fill_"
    assert e2e._launching_op(event(name="cuLaunchKernel", cpu_parent=graph)) == "cuLaunchKernel"
    profile = dict(idle=idle)
    table = e2e.idle_table(dict(idle=dict(idle_ms=0.1, host_late_ms=0.0, unmatched_ms=0.0, after=[])), profile)
    assert "| **idle in all** | 0.100 | 0.370 |" in table and "| after `aten::fill_` | - | 0.065 (1) |" in table


@pytest.mark.parametrize("gpus", ["1", "2"])
def test_e2e_stops_and_raises_where_a_worker_fails(e2e, tmp_path, monkeypatch, gpus):
    calls: list[int] = []
    taking_turns = threading.Lock()

    def child(cfg, timeout_s, gpu=None):  # the second process's results cannot be written, say
        with taking_turns:
            calls.append(cfg["batch"])
            second = len(calls) == 2
        if second:
            raise OSError(28, "No space left on device")
        time.sleep(0.05)  # a process takes a while: a failure is seen before a worker looks for its next group
        return dict(status="ok")

    monkeypatch.setattr(e2e, "in_subprocess", child)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--device", "cpu", "--tiny", "--out", str(tmp_path), "--styles",
                                      "eager", "--dtypes", "bfloat16", "--batches", "4,2,1", "--modes",
                                      "convtune,torch_bm1", "--gpus", gpus])
    with pytest.raises(OSError, match="No space left"):
        e2e.main()
    # No group starts after the failure: the third (batch 1) never runs. With two workers the other's group in
    # flight ends (its two modes); the failing one's, where the failure was its first call, stops there.
    assert 1 not in calls and len(calls) <= 4, calls
    if gpus == "1":
        assert calls == [4, 4]


@pytest.mark.slow
def test_warm_start_times_each_stage_in_its_own_process_and_names_its_files_by_network(tmp_path):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, str(BENCH / "warm_start.py"), "--device", "cpu", "--tiny", "--batch", "2",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads((tmp_path / "warm_start_tiny_b2.json").read_text())
    stages = payload["stages"]
    assert [stages[s]["status"] for s in ("cold", "warm", "profiled", "torch")] == ["ok"] * 4
    assert stages["warm"]["db_entries"] > 0 and stages["warm"]["optimize_s"] > 0  # the cold stage filled the database
    assert sum(stages["warm"]["runtimes"].values()) == stages["warm"]["layers"] > 0
    assert stages["profiled"]["profile"]["phases"]
    assert "| warm |" in (tmp_path / "warm_start_tiny_b2.md").read_text()


@pytest.mark.slow
def test_e2e_and_ab_run_a_small_network_on_the_cpu_and_rewrite_their_reports(tmp_path):
    tree = {"BENCH_SOURCE": "tree1"}  # the library's src/ tree, as a run names it (here: whatever the checkout's is)
    rows = _run("e2e.py", tmp_path, "--styles", "eager", "--modes", "convtune,torch_bm1", "--repeats", "1",
                "--dtypes", "bfloat16", "--batches", "4", "--processes", "2", env=tree)["configs"]
    assert set(rows) == {"tiny:b4:bfloat16:eager:convtune", "tiny:b4:bfloat16:eager:torch_bm1"}
    ours = rows["tiny:b4:bfloat16:eager:convtune"]
    assert ours["status"] == "ok" and ours["db"] == "cold" and ours["training"]["ms"] > 0 and ours["algorithms"]
    assert ours["host_profile"]["functions"]  # cProfile of the eager training step, in the first process
    assert ours["processes"] == 2 and len(ours["later_tune_s"]) == 1  # the second process found the database warm
    spread = ours["training"]["process_ms"]
    assert len(spread) == 2 and min(spread) <= ours["training"]["ms"] <= max(spread)
    # each process counted the calls that left the layers' hot path while timed: none in a steady state
    assert ours["training"]["full_path_calls"] == ours["inference"]["full_path_calls"] == [0, 0]
    assert "full_path_calls" not in rows["tiny:b4:bfloat16:eager:torch_bm1"]["training"]
    # each process's database, its CPU time over the wall time while timed, and its threads then
    assert ours["process_db"] == ["cold", "warm"]
    for workload in ("inference", "training"):
        ratios = ours[workload]["cpu_per_wall"]
        assert len(ratios) == 2 and all(c > 0 for c in ratios)
        assert len(ours[workload]["host_probe_us"]) == 2 and all(us > 0 for us in ours[workload]["host_probe_us"])
        assert all("MainThread" in names for names in ours[workload]["threads"])
        assert all(names is None or len(names) >= 1 for names in ours[workload]["os_threads"])
        # and what each held meanwhile (a CPU run: no allocator's figures)
        assert [sorted(state) for state in ours[workload]["process"]] == [sorted(ours[workload]["process"][0])] * 2
        assert all(state["python_objects"] > 0 and "cuda_segments" not in state for state in ours[workload]["process"])
        assert all(state.get("rss_mb", 1) > 0 for state in ours[workload]["process"])
    assert ours["host_probe_start_us"] > 0  # the host probe before tuning (a process of one row: its own)
    report = (tmp_path / "e2e.md").read_text()
    # each group's host probes, PyTorch's process over convtune's (the median of each row's processes)
    probes = [line.split("|")[-3].strip() for line in report.splitlines() if line.startswith("| tiny | b4 |")][-1]
    inference_ratio, training_ratio = (float(r) for r in probes.split(" / "))
    assert inference_ratio > 0 and training_ratio > 0
    (tmp_path / "e2e.md").unlink()
    subprocess.run([sys.executable, str(BENCH / "e2e.py"), "--report", "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    assert (tmp_path / "e2e.md").read_text() == report  # the markdown comes from the JSON alone
    # --missing measures only what the file lacks: a group again, PyTorch's rows with it, once the library's src/
    # tree is another, so that a cell's rows come from one run
    grid = ("--styles", "eager", "--dtypes", "bfloat16", "--batches", "4", "--repeats", "1", "--no-profile",
            "--missing", "--modes", "convtune,torch_bm1")
    assert _run("e2e.py", tmp_path, *grid, env=tree)["configs"] == rows
    assert _run("e2e.py", tmp_path, *grid, env={"BENCH_SOURCE": "tree1+"})["configs"] != rows  # changes: measured
    moved = _run("e2e.py", tmp_path, *grid, env={"BENCH_SOURCE": "another"})["configs"]
    assert moved["tiny:b4:bfloat16:eager:torch_bm1"]["source"] == "another" != ours["source"]
    assert moved["tiny:b4:bfloat16:eager:convtune"]["source"] == "another"
    assert "convtune's src/" in (tmp_path / "e2e.md").read_text()
    # --budget-s: a run on a machine lent for a limited time starts no group the longest one so far would carry past
    # the budget, and --missing goes on from there
    two_groups = (*grid, "--batches", "4,2")  # the last --batches counts
    cut = _run("e2e.py", tmp_path, *two_groups, "--budget-s", "1", env={"BENCH_SOURCE": "third"})["configs"]
    assert cut["tiny:b4:bfloat16:eager:convtune"]["source"] == "third" and "tiny:b2:bfloat16:eager:convtune" not in cut
    rest = _run("e2e.py", tmp_path, *two_groups, env={"BENCH_SOURCE": "third"})["configs"]
    assert rest["tiny:b2:bfloat16:eager:convtune"]["source"] == "third"
    assert rest["tiny:b4:bfloat16:eager:convtune"] == cut["tiny:b4:bfloat16:eager:convtune"]

    results = _run("ab.py", tmp_path, "--styles", "eager", "--rounds", "2", "--dtypes", "bfloat16",
                   "--batches", "4", "--profile", "--around-tuning")["results"]
    cells = results["tiny:b4:bfloat16"]["rows"]
    assert set(cells) == {"eager:inference", "eager:training"}
    runtimes = results["tiny:b4:bfloat16"]["runtimes"]
    assert sum(runtimes.values()) > 0
    for row in cells.values():
        assert row["torch_ms"] > 0 and row["convtune_ms"] > 0 and row["rounds"] == 2
        assert row["ratio_range"][0] <= row["ratio"] <= row["ratio_range"][1]
        assert len(row["ratios"]) == 2 and row["ratio_interval"] is None  # two rounds bound no median at 95%
        if "python" not in runtimes:  # native and PyTorch calls take the hot path once tuned
            assert row["full_path_calls"] == 0
    profile = (tmp_path / "ab_profile_tiny_b4_bfloat16.txt").read_text()
    assert "## torch: host-side profile" in profile and "## convtune: host-side profile" in profile
    # PyTorch's model timed just before and just after the copy's cold tuning, with what the process held each time
    around = results["tiny:b4:bfloat16"]["torch_around_tuning"]
    assert around["before_ms"] > 0 and around["after_ms"] > 0
    assert around["after"]["python_objects"] > 0 and sorted(around["before"]) == sorted(around["after"])
    assert "| tiny | b4 | bfloat16 | " in (tmp_path / "ab.md").read_text().split("before and after the tuning")[1]
    # --control: PyTorch against an untouched copy, kept beside the convtune rows
    results = _run("ab.py", tmp_path, "--styles", "eager", "--rounds", "2", "--dtypes", "bfloat16",
                   "--batches", "4", "--control", "--around-tuning")["results"]
    assert set(results) == {"tiny:b4:bfloat16", "tiny A/A:b4:bfloat16"}
    control = results["tiny A/A:b4:bfloat16"]
    assert control["runtimes"] == {} and control["tune_s"] is None  # nothing optimized
    assert control["torch_around_tuning"]["before_ms"] > 0  # the same timings with nothing tuned between
    assert all(row["full_path_calls"] is None for row in control["rows"].values())
    assert "| tiny A/A | b4 |" in (tmp_path / "ab.md").read_text()


@pytest.mark.slow
def test_compile_profile_counts_each_compiled_models_work_per_step(tmp_path):
    results = _run("compile_profile.py", tmp_path, "--batches", "2", "--workloads", "inference")["results"]
    row = results["tiny:b2:float16"]["inference"]
    for who in ("torch", "convtune"):
        assert row[who]["wall_ms"] > 0 and row[who]["kernels"] > 0 and row[who]["host_events"] > 0
        assert abs(sum(k["count"] for k in row[who]["by_name"].values()) - row[who]["kernels"]) < 1e-9
    text = (tmp_path / "compile_profile.md").read_text()
    assert "| tiny | b2 | float16 | inference |" in text and "the host's events that differ most" in text


def test_the_sweep_can_draw_its_depthwise_problems_with_large_kernels_and_leaves_the_rest_alone(sweep):
    layers = sweep.seeds()
    plain = [sweep.sample(i, 0, "cuda", False, layers) for i in range(400)]
    large = [sweep.sample(i, 0, "cuda", False, layers, (9, 13, 31)) for i in range(400)]
    depthwise = [p for p in large if p.groups == p.c > 1]
    assert len(depthwise) > 20 and {p.kernel_size[0] for p in depthwise} == {9, 13, 31}
    assert all(len(set(p.kernel_size)) == 1 and p.dilation == (1,) * p.ndim for p in depthwise)
    assert all(a == b for a, b in zip(plain, large) if not b.groups == b.c > 1)  # the others are drawn as before
    assert large == [sweep.sample(i, 0, "cuda", False, layers, (9, 13, 31)) for i in range(400)]
    with pytest.raises(SystemExit):
        sweep.main(["--depthwise-kernels", "7,x", "--count", "0"])


def test_the_sweep_draws_the_same_problems_and_covers_what_networks_contain(sweep):
    layers = sweep.seeds()
    assert len(layers) > 100  # the built-in networks' unique layers and DeepBench's
    drawn = [sweep.sample(i, 0, "cuda", False, layers) for i in range(600)]
    assert drawn[:50] == [sweep.sample(i, 0, "cuda", False, layers) for i in range(50)]  # a resumed run agrees
    assert drawn[:50] != [sweep.sample(i, 1, "cuda", False, layers) for i in range(50)]  # another seed differs
    assert {p.direction for p in drawn} == {"fwd", "bwd_data", "bwd_filter"}
    assert {(p.dtype, p.allow_tf32) for p in drawn} == set(sweep.DTYPES)
    assert {p.layout for p in drawn} == set(sweep.LAYOUTS)
    depthwise = [p for p in drawn if p.groups == p.c > 1]
    grouped = [p for p in drawn if 1 < p.groups < p.c]
    assert depthwise and grouped and any(p.k == 2 * p.c for p in depthwise)
    assert any(p.ndim == 2 and p.kernel_size[0] != p.kernel_size[1] for p in drawn)  # 1xN, Nx1, DeepBench's
    assert any(max(p.dilation) > 1 for p in drawn) and any(max(p.stride) > 1 for p in drawn)
    # first layers (an image's 1, 3 or 4 channels in), of which the seeds hold few: a share of the draws
    first = [p for p in drawn if p.c <= sweep.IMAGE_CHANNELS and p.groups == 1]
    assert len(first) >= 0.5 * sweep.FIRST_LAYERS * len(drawn) and {p.c for p in first} == {1, 3, 4}
    assert any(p.ndim == 2 and p.kernel_size == (7, 7) and p.stride == (2, 2) and p.input_size[0] >= 96 for p in first)
    assert all(max(math.prod(s) for s in p.operand_shapes) <= sweep.MAX_ELEMENTS or p.n == 1 for p in drawn)


def test_a_sweep_measures_every_candidate_resumes_and_exports_what_the_database_imports(tmp_path, sweep, capsys):
    import convtune as ct

    db_path, export = tmp_path / "sweep.sqlite", tmp_path / "sweep.jsonl"
    args = ["--device", "cpu", "--tiny", "--count", "3", "--db", str(db_path), "--export", str(export)]
    assert sweep.main(args) == 0
    assert "measured 3 problems, 0 already" in capsys.readouterr().out
    with ct.TuningDB(db_path) as db:
        problems = [sweep.sample(i, 0, "cpu", True, sweep.seeds()) for i in range(3)]
        for p in problems:
            supported = {a.name for a in ct.algorithms(p)}
            timed = {r.algorithm for r in db.results(p) if r.ok}
            # the search's rules are off: every supporting candidate ran (a wrong one is recorded, not timed)
            assert {r.algorithm for r in db.results(p)} >= supported and timed, p.key
    lines = export.read_text().splitlines()
    assert lines and all(json.loads(line)["problem"] in {p.key for p in problems} for line in lines)
    with ct.TuningDB(tmp_path / "fresh.sqlite") as fresh:
        assert fresh.import_(export) == len(lines)
    assert sweep.main(args) == 0
    assert "measured 0 problems, 3 already" in capsys.readouterr().out  # a second run resumes: nothing again


learned_get = _bench_script("learned_get")


def test_learned_get_holds_each_network_out_and_reports_every_ranking(tmp_path, learned_get, sweep):
    # A database filled with made-up measurements (fast to make): on this "machine" direct:taps takes half
    # of torch:native's price on 3x3 layers and twice it elsewhere, gemm:im2col 1.5 times it; torch:native
    # is as priced. The analytic model prices each by its own terms, so it misses direct:taps' wins.
    import convtune as ct
    from convtune import costmodel
    from convtune.results import PerfResult

    db_path = tmp_path / "sweep.sqlite"
    names = ("torch:native", "gemm:im2col", "direct:taps")
    layers = sweep.seeds()
    problems = [p for _, p in sweep.network_problems(["resnet18", "mobilenet_v2"], 1, ["float32"], ["channels_first"],
                                                     "cpu", 6)]
    problems += [sweep.sample(i, 0, "cpu", True, layers) for i in range(300)]
    with ct.TuningDB(db_path) as db:
        for p in problems:
            three = p.kernel_size[0] == 3
            factors = {"torch:native": 1.0, "gemm:im2col": 1.5, "direct:taps": 0.5 if three else 2.0}
            base = costmodel.analytic_ms("torch:native", p)
            db.store(p, [PerfResult(n, "ok", time_ms=base * factors[n]) for n in names])
    out = tmp_path / "out"
    assert learned_get.main(["--db", str(db_path), "--device", "cpu", "--networks", "resnet18,mobilenet_v2",
                             "--batch", "1", "--dtypes", "float32", "--layouts", "channels_first", "--layers", "6",
                             "--out", str(out)]) == 0
    payload = json.loads((out / "learned_get.json").read_text())
    assert {key.split("/")[0] for key in payload["by_network"]} == {"resnet18", "mobilenet_v2"}
    for summary in payload["by_network"].values():
        assert summary["learned"]["problems"] >= 1 and summary["torch_bm0"]  # every held-out problem judged
        assert summary["cudnn_A"] == {}  # no GPU here: cuDNN's heuristics are not asked
    split = payload["random_split"]
    assert split["analytic_geomean"] > 1.1 and split["learned_geomean"] < split["analytic_geomean"], split
    # every judged problem in one group by the distance to its nearest measured problem
    judged = sum(s["learned"]["problems"] for s in payload["by_network"].values() if s["learned"])
    assert sum(s["learned"]["problems"] for s in payload["by_distance"].values() if s["learned"]) == judged
    assert "geomean / worst / top-1" in (out / "learned_get.md").read_text()
    # what the prices got wrong, per family of the candidates (error_table, tested on its own below)
    errors = payload["price_errors"]
    assert {key.split("/")[-1] for key in errors} == {"torch", "gemm", "direct"}
    assert "What the learned prices get wrong" in (out / "learned_get.md").read_text()
    assert all("errors" not in row and row["pick"]["learned"][0] in names for row in payload["rows"].values())
    for summary in payload["rules"].values():  # the other picking rules, judged on the same problems
        assert all(summary[rule]["problems"] == summary["learned"]["problems"] for rule in learned_get.RULES)
        assert summary["cudnn_B"] == {}  # no B here: its rules keep the cheapest (the learned pick)
        assert summary["b10"] == summary["learned"]


def test_learned_get_rules_pick_cudnns_first_plan_unless_the_learned_price_is_lower_by_the_margin(learned_get):
    from convtune.learned import Sample
    from convtune.problem import ConvProblem

    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(8, 8), kernel_size=3)
    first, second, other = (Sample(p, "cudnn:eng1", 1.0, 1.0, 0), Sample(p, "cudnn:eng2", 1.0, 1.0, 3),
                            Sample(p, "gemm:x", 1.0, 1.0, None))
    order = [(second, 0.80), (other, 0.85), (first, 1.0)]  # the learned prices: eng2 cheapest, 20% below eng1
    picks = learned_get.rule_picks(order, "gemm:x")
    assert picks["top2"] == "gemm:x" and picks["top3"] == "gemm:x"  # eng2 is cuDNN's fourth: left out
    assert picks["a10"] == "cudnn:eng2" and picks["a20"] == "cudnn:eng1" and picks["a30"] == "cudnn:eng1"
    assert picks["b10"] == picks["b20"] == "gemm:x"  # heuristics B's first: 0.80 is not 10% below its 0.85
    picks = learned_get.rule_picks(order, "cudnn:eng1")
    assert picks["b10"] == "cudnn:eng2" and picks["b20"] == "cudnn:eng1"
    # the price-error table: per family, the median log2(price / measured), its median size, the share over 2x
    errors, _ = learned_get.error_table({("all", "fwd", "float16"): [{"errors": {"cudnn": [1.0, -2.0]}},
                                                                      {"errors": {"cudnn": [0.5], "gemm": [0.0]}}]})
    assert errors["all/fwd/float16/cudnn"] == dict(candidates=3, median=0.5, median_size=1.0, over_2x=1 / 3)
    assert errors["all/fwd/float16/gemm"] == dict(candidates=1, median=0.0, median_size=0.0, over_2x=0.0)
    # the worst picks: each problem once, its worst network first and the others named, the worst problem first
    def row(network, problem, ratio):
        return dict(network=network, problem=problem, learned=ratio, cudnn_B=1.0,
                    pick=dict(learned=["cudnn:eng2", 0.5, ratio], best=["cudnn:eng1", 0.7, 1.0], cudnn_B="cudnn:eng1"))
    text = learned_get.worst_table({("a", "fwd", "float16"): [row("a", "p1|cuda", 2.0), row("a", "p2|cuda", 3.0)],
                                    ("b", "fwd", "float16"): [row("b", "p1|cuda", 2.5)]}, count=2)
    lines = text.splitlines()[2:]
    assert [line.split(" | ")[:3] for line in lines] == [["| a", "p2", "3.00"], ["| b, a", "p1", "2.50"]]
    # the price-error table's families: a backend, and convtune's Triton kernels by kernel
    assert [learned_get.family(n) for n in ("cudnn:eng1_k2=3", "triton:grouped_bwd_data_p64c32w4", "torch:native")] \
        == ["cudnn", "triton:grouped", "torch"]


def test_learned_get_judges_another_machines_measurements_on_this_one(tmp_path, learned_get, sweep):
    # The shipped dataset's situation: rows of a GPU machine, judged here (no GPU needed), priced for that GPU.
    import convtune as ct
    from convtune import costmodel, hardware
    from convtune.db_file import SCHEMA_VERSION
    from convtune.results import PerfResult

    h200 = "cuda|NVIDIA H200|sm90|driver580|cuda13.0"
    problems = [p for _, p in sweep.network_problems(["resnet18"], 32, ["float16"], ["channels_last"], "cuda", 4)]
    problems += [sweep.sample(i, 0, "cuda", False, sweep.seeds()) for i in range(30)]
    lines = []
    with hardware.measured_on(h200):
        for p in problems:
            base = costmodel.analytic_ms("torch:native", p)
            for name, factor in (("torch:native", 1.0), ("gemm:im2col", 3.0 if p.kernel_size[0] == 1 else 0.5)):
                result = PerfResult(name, "ok", time_ms=base * factor)
                lines.append(json.dumps({"schema": SCHEMA_VERSION, "fingerprint": h200, "software": "torch2.11",
                                         "problem": p.key, "stored_at": 1.7e9, "result": result.to_dict()}) + "\n")
    (tmp_path / "h200.jsonl").write_text("".join(lines))
    db_path = tmp_path / "h200.sqlite"
    with ct.TuningDB(db_path) as db:
        assert db.import_(tmp_path / "h200.jsonl") == len(lines)
    out = tmp_path / "out"
    assert learned_get.main(["--db", str(db_path), "--measured-on", "auto", "--networks", "resnet18", "--layers", "4",
                             "--out", str(out)]) == 0
    payload = json.loads((out / "learned_get.json").read_text())
    assert payload["samples"] == len(lines) and {k.split("/")[0] for k in payload["by_network"]} == {"resnet18"}
    assert f"measured on {h200}" in (out / "learned_get.md").read_text()
    assert hardware.assumed_gpu() is None
    named = tmp_path / "named"  # the fingerprint named, on any machine (this one's --device default included)
    assert learned_get.main(["--db", str(db_path), "--measured-on", h200, "--networks", "resnet18", "--layers", "4",
                             "--out", str(named)]) == 0
    assert json.loads((named / "learned_get.json").read_text())["measured_on"] == h200
    # the random splits judged with cuDNN's heuristics' first plans where the machine that measured recorded them
    # (bench/cudnn_order.py's file): here heuristics A 'picks' PyTorch's call, B the other candidate
    orders = tmp_path / "orders.json.gz"
    with gzip.open(orders, "wt") as f:
        json.dump({"problems": {p.key: {"plans": [], "A": "torch:native", "B": "gemm:im2col"} for p in problems}}, f)
    ordered = tmp_path / "ordered"
    assert learned_get.main(["--db", str(db_path), "--measured-on", h200, "--networks", "resnet18", "--layers", "4",
                             "--orders", str(orders), "--out", str(ordered)]) == 0
    splits = json.loads((ordered / "learned_get.json").read_text())["random_splits_by_ranking"]
    assert splits and all(group["cudnn_A"] == group["torch_bm0"] for group in splits.values())
    assert all(group["cudnn_B"]["problems"] == group["learned"]["problems"] for group in splits.values())
    assert "problems whose cuDNN heuristics' first plans A and B are both known" in (
        ordered / "learned_get.md").read_text()
    for bad in ("auto", "cpu|AMD EPYC|threads2"):  # no CUDA fingerprint to take; a machine outside the peaks table
        with pytest.raises(SystemExit):
            learned_get.main(["--db", str(tmp_path / "empty.sqlite"), "--measured-on", bad, "--out", str(out)])


get_corrections = _bench_script("get_corrections")


def test_get_corrections_prices_held_out_layers_with_and_without_the_other_problems_measurements(
        tmp_path, get_corrections, sweep, monkeypatch):
    # Another machine's rows: torch:native runs at its price, gemm:im2col in half that time everywhere. With the
    # other problems' measurements get always picks gemm:im2col; without, by price alone, it misses some.
    import convtune as ct
    from convtune import costmodel, hardware, learned
    from convtune.db_file import SCHEMA_VERSION
    from convtune.results import PerfResult

    h200 = "cuda|NVIDIA H200|sm90|driver580|cuda13.0"
    held = [p for _, p in sweep.network_problems(["resnet18"], 32, ["float16"], ["channels_last"], "cuda", 6)]
    problems = held + [sweep.sample(i, 0, "cuda", False, sweep.seeds()) for i in range(250)]
    lines = []
    with hardware.measured_on(h200):
        for p in problems:
            for name, factor in (("torch:native", 1.0), ("gemm:im2col", 0.5)):
                result = PerfResult(name, "ok", time_ms=costmodel.analytic_ms("torch:native", p) * factor)
                lines.append(json.dumps({"schema": SCHEMA_VERSION, "fingerprint": h200, "software": "torch2.11",
                                         "problem": p.key, "stored_at": 1.7e9, "result": result.to_dict()}) + "\n")
    (tmp_path / "h200.jsonl").write_text("".join(lines))
    with ct.TuningDB(tmp_path / "h200.sqlite") as db:
        db.import_(tmp_path / "h200.jsonl")
    out = tmp_path / "out"
    seen = []  # what each held-out network's corrections were made of: none of its layers
    made_of = costmodel.Corrections.of

    def recording(pairs):
        pairs = list(pairs)
        seen.extend(pairs)
        return made_of(pairs)

    small_databases = get_corrections.small_databases
    monkeypatch.setattr(get_corrections, "small_databases", lambda pairs, by_problem: {})  # judged below
    monkeypatch.setattr(costmodel.Corrections, "of", staticmethod(recording))
    assert get_corrections.main(["--db", str(tmp_path / "h200.sqlite"), "--networks", "resnet18",
                                 "--out", str(out)]) == 0
    assert seen and not {p.key for p, _ in seen} & {p.key for p in held}
    summary = json.loads((out / "get_corrections.json").read_text())["summary"]
    assert summary, "no held-out layer judged"
    for cells in summary.values():
        assert cells["with_db"]["top1"] == 1.0 and cells["with_db"]["geomean"] == pytest.approx(1.0)
        assert cells["without"]["geomean"] >= cells["with_db"]["geomean"]
        assert cells["cudnn_A"] == {}  # cuDNN's first plan for made-up problems: not among the measured
    assert any(cells["without"]["geomean"] > 1.0 for cells in summary.values())  # the price alone misses some
    assert "| fwd | float16 |" in (out / "get_corrections.md").read_text()
    assert hardware.assumed_gpu() is None
    # databases of a few random problems: each size below the problems there are, every ratio of a timed pick
    monkeypatch.setattr(costmodel.Corrections, "of", made_of)
    with ct.TuningDB(tmp_path / "h200.sqlite") as db, hardware.measured_on(h200):
        pairs = db.measurements("cuda", h200)
        by_problem: dict = {}
        for p, r in pairs:
            by_problem.setdefault(p, []).append(learned.Sample(p, r.algorithm, costmodel.analytic_ms(r.algorithm, p),
                                                               r.time_ms))
        small = small_databases(pairs, by_problem, draws=1, judged=10)
    assert [k[0].strip() for k in small] == [str(n) for n in get_corrections.SIZES if n < len(by_problem)]
    assert all(r["without"] >= 1.0 and r["with_db"] >= 1.0 for rows in small.values() for r in rows)


verification_margins = _bench_script("verification_margins")


def test_verification_margins_measures_a_networks_layers_in_its_time_and_reports_by_the_factor_in_force(
        tmp_path, verification_margins):
    from convtune.settings import settings

    problems = verification_margins.network_problems("resnet18", 1, "cpu", ["float32"])
    assert len(problems) == len(set(problems)) and {p.direction for p in problems} == {"fwd", "bwd_data", "bwd_filter"}
    rows, measured = verification_margins.measure(problems[:2])
    assert measured == 2 and {r["problem"] for r in rows} == {p.key for p in problems[:2]}
    assert all("error" not in r for r in rows)
    assert verification_margins.measure(problems, minutes=0) == ([], 0)  # none started after the time given
    payload = {"environment": {"date": "d", "python": "3"}, "device": "cpu", "network": "resnet18", "batch": 1,
               "problems": len(problems), "problems_measured": 2, "rows": rows}
    md = verification_margins.report(payload)
    assert f"2 of {len(problems)} problems measured" in md and "| float32 |" in md
    worst = max(r["worst_over_tolerance"] for r in rows)
    with settings.override(element_factor=2 * settings.element_factor):  # the bound's share halves, the figure not
        again = verification_margins.report(payload)
    assert f"{worst:.3f}" in md and f"{worst:.3f}" in again and md != again


host_probe = _bench_script("host_probe")


def test_host_probe_measures_each_probe_layer_in_its_own_process_on_the_cpu(tmp_path, host_probe):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, str(BENCH / "host_probe.py"), "--device", "cpu", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads((tmp_path / "host_probe.json").read_text())
    assert [row["layer"] for row in payload["rows"]] == [host_probe.label(*s) for s in host_probe.PROBES["cpu"]]
    assert all({"python", "python backward"} <= set(row["overheads"]) for row in payload["rows"])
    assert (tmp_path / "host_probe.md").read_text() == host_probe.markdown(payload["env"], payload["rows"])


def test_layer_host_times_every_convolution_of_a_network_against_pytorch(tmp_path):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, str(BENCH / "layer_host.py"), "--device", "cpu", "--tiny", "--batch", "2",
                          "--dtype", "bfloat16", "--grad", "--calls", "2", "--rounds", "3", "--out", str(tmp_path),
                          "--name", "lh"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads((tmp_path / "lh.json").read_text())
    assert payload["grad"] and len(payload["rows"]) == 4  # the tiny network's four convolutions
    for row in payload["rows"]:
        assert row["runtime"] in ("native", "torch", "python") and row["fwd"]
        assert row["torch_host_us"] > 0 and row["convtune_host_us"] > 0 and row["torch_gpu_us"] is None
    text = (tmp_path / "lh.md").read_text()
    assert all(f"| {row['layer']} |" in text for row in payload["rows"])


def test_native_copy_times_torch_native_both_ways_on_each_layer(tmp_path):
    env = dict(os.environ, CONVTUNE_CACHE_DIR=str(tmp_path / "cache"), CONVTUNE_PROGRESS="0")
    out = subprocess.run([sys.executable, str(BENCH / "native_copy.py"), "--device", "cpu", "--network", "resnet18",
                          "--batch", "1", "--dtype", "float32", "--layers", "2", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads((tmp_path / "native_copy_cpu.json").read_text())
    assert [r["layer"] for r in payload["rows"]] == ["L00", "L01"]
    for row in payload["rows"]:
        assert row["run_ms"] > 0 and row["launcher_ms"] > 0 and row["ratio"] == row["run_ms"] / row["launcher_ms"]
    assert "revision" in (tmp_path / "native_copy_cpu.md").read_text()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the GPU run is bench/gpu_checks.sh heuristics")
def test_heuristics_cost_says_it_needs_a_gpu_and_writes_nothing(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH / "heuristics_cost.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "need a GPU" in out.stderr
    assert not list(tmp_path.iterdir())


heuristics_cost = _bench_script("heuristics_cost")


def test_heuristics_cost_times_each_graph_and_counts_the_problems_offered_nothing(heuristics_cost):
    class Graph:
        def __init__(self, problem, modes):
            if problem == "none":
                raise RuntimeError("no plan")
            self.names = ["a"] * problem

    made = []

    def make(problem, modes):
        made.append((problem, modes))
        return Graph(problem, modes)

    r = heuristics_cost.timed_graphs([1, "none", 2, 4, 6], ("B",), make)
    assert made == [(p, ("B",)) for p in (1, "none", 2, 4, 6)]
    assert r["problems"] == 5 and r["refused"] == 1 and r["plans_median"] == 3  # of 1, 2, 4, 6 plans
    assert 0 <= r["median_ms"] <= r["p90_ms"] <= r["max_ms"] and r["first_ms"] >= 0
    assert heuristics_cost.timed_graphs([1, "none", 2], ("B",), make) == dict(problems=3, refused=1)  # too few


common = _bench_script("common")


def test_the_medians_interval_is_the_order_statistics_whose_coverage_reaches_the_confidence(common):
    assert common.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # five rounds: at most 93.75%
    assert common.median_interval([3.0, 1.0, 2.0, 7.0, 5.0, 6.0, 4.0]) == (1.0, 7.0, 1 - 2 / 128)  # the whole range
    low, high, coverage = common.median_interval([float(v) for v in range(11)])
    assert (low, high) == (1.0, 9.0) and coverage == 1 - 2 * 12 / 2048  # the second lowest to the second highest
    low, high, coverage = common.median_interval([float(v) for v in range(21)], confidence=0.99)
    assert (low, high) == (4.0, 16.0) and coverage >= 0.99


depthwise = _bench_script("depthwise")


def test_the_depthwise_table_shows_the_strip_banded_and_rows_families_beside_the_best_of_all(depthwise):
    key = "fwd|n32|c96|k96|in56x56|r7x7|s1x1|p3x3|d1x1|g96|float16|channels_last|cuda|tf32=1"
    row = dict(problem=key, floor_ms=0.0157, cudnn_ms=0.07, ours_ms=0.035,
               ours_best="triton:depthwise_band_fwd_r32n16c8w4",
               ours={"triton:depthwise_fwd_p64c32w4": 0.1, "triton:depthwise_band_fwd_r32n16c8w4": 0.035,
                     "triton:depthwise_band_fwd_r64n32c1w4": None, "triton:depthwise_strip_fwd_t4b32c32w4": 0.05})
    older = dict(row, problem=key.replace("fwd", "bwd_data"), ours={"triton:depthwise_bwd_data_p64c32w4": 0.05},
                 ours_best="triton:depthwise_bwd_data_p64c32w4", ours_ms=0.05)
    wgrad = dict(row, problem=key.replace("fwd", "bwd_filter"),
                 ours_best="triton:depthwise_rows_bwd_filter_r8q16c16w4",
                 ours={"triton:depthwise_strip_bwd_filter_t8b16c32w4s8": 0.14,
                       "triton:depthwise_rows_bwd_filter_r8q16c16w4": 0.035}, ours_ms=0.035)
    assert depthwise.family_ms(row, "band") == 0.035 and depthwise.family_ms(older, "band") is None
    assert depthwise.family_ms(row, "strip") == 0.05 and depthwise.family_ms(wgrad, "rows") == 0.035
    text = depthwise.markdown({"date": "d", "gpu": "g"}, {"a": row, "b": older, "c": wgrad})
    assert "| fwd | ≥7 | 1 | 2.00 | 1.40 (1) | 2.00 (1) | - |" in text
    assert "| bwd_data | ≥7 | 1 | 1.40 | - | - | - |" in text
    assert "| bwd_filter | ≥7 | 1 | 2.00 | 0.50 (1) | - | 2.00 (1) |" in text
    assert "| 0.0350 | 0.0500 | 0.0350 | - | 0.0700 |" in text and "| 0.0500 | - | - | - | 0.0700 |" in text
    assert "| 0.0350 | 0.1400 | - | 0.0350 | 0.0700 |" in text


def test_tie_paths_times_five_copies_of_a_network_and_says_what_each_variant_changed(tmp_path):
    from convtune.pytorch import runtime

    if not runtime.available():
        pytest.skip("the C++ extension is not available here: the copies would all call PyTorch")
    result = _run("tie_paths.py", tmp_path, "--batch", "2", "--rounds", "2")["results"]
    row = result["tiny:b2:float16"]
    for workload in ("inference", "training"):
        for variant in ("torch", "tuned", "no_grad_off", "ties_off", "cudnn_ties"):
            assert len(row["rows"][workload][variant]["times"]) == 2 and row["rows"][workload][variant]["ms"] > 0
        assert row["rows"][workload]["torch"]["ratio"] == 1.0
    # the CPU has no cuDNN plan to force a tie onto; whatever optimize moved was a direction ties_off left on
    # torch:native
    native = row["torch_native_directions"]
    assert row["changed"]["cudnn_ties"] == 0 and native["cudnn_ties"] == native["ties_off"] > 0
    assert row["changed"]["tuned"] == native["ties_off"] - native["tuned"]
    assert row["changed"]["no_grad_off"] == row["changed"]["tuned"]  # the same move, without the no-gradient path
    # what the rule saw as optimize tuned the copy: the layers it moved are those it judged cheaper moved (which
    # layers reach a judgement, a tie given to torch:native, depends on which candidates win on this CPU: none may)
    assert "native" in row["host_costs_us"]
    assert all(len(j) == 3 and j[1] >= 0 and j[2] >= 0 for j in row["tie_judgements"]), row["tie_judgements"]
    assert set(row["moved_problems"]) == {p for p, chosen, moved in row["tie_judgements"] if moved < chosen}
    assert row["no_grad_paths"]["ties_off"] == row["no_grad_paths"]["no_grad_off"] == 0  # (turned off there)
    again = row["host_costs_again_us"]  # the measurement made again (5 times by default)
    assert len(again) == 5 and all("native" in costs for costs in again)
    assert "| tiny | b2 | float16 | training |" in (tmp_path / "tie_paths.md").read_text()


ab = _bench_script("ab")


def test_ab_merges_other_runs_files_row_by_row_newest_first(ab, tmp_path):
    def row(date, ratio):
        return dict(torch_ms=1.0, convtune_ms=1.0 / ratio, ratio=ratio, ratio_range=[ratio, ratio], rounds=21, steps=10,
                    full_path_calls=0, date=date, revision=date[-1])

    def env(date):
        return {"date": date, "gpu": "g", "revision": date[-1]}

    committed = {"environment": env("2026-12-01 a"), "results": {
        "m:b32:float16": {"rows": {"eager:inference": row("2026-12-01 a", 1.0),
                                   "eager:training": row("2026-12-01 a", 1.1)},
                          "tune_s": 5.0, "runtimes": {"native": 1}}}}
    call1 = json.loads(json.dumps(committed))  # started from the committed file, measured inference again
    call1["environment"] = env("2026-12-04 b")
    call1["results"]["m:b32:float16"].update(tune_s=7.0, runtimes={"native": 2})
    call1["results"]["m:b32:float16"]["rows"]["eager:inference"] = row("2026-12-04 b", 1.2)
    call2 = json.loads(json.dumps(committed))  # and another cell, a new entry
    call2["environment"] = env("2026-12-04 c")
    call2["results"]["m A/A:b32:float16"] = {"rows": {"eager:training": row("2026-12-04 c", 0.99)}, "tune_s": None,
                                             "runtimes": {}}
    paths = []
    for i, payload in enumerate((committed, call1, call2)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(payload))
    merged = ab.merge(json.loads(paths[0].read_text()), [json.loads(p.read_text()) for p in paths[1:]])
    entry = merged["results"]["m:b32:float16"]
    assert entry["rows"]["eager:inference"]["ratio"] == 1.2 and entry["rows"]["eager:training"]["ratio"] == 1.1
    assert entry["tune_s"] == 7.0 and entry["runtimes"] == {"native": 2}  # from the file of its newest row
    assert merged["results"]["m A/A:b32:float16"]["tune_s"] is None
    assert merged["environment"]["date"] == "2026-12-04 c"
    # an older file changes nothing
    again = ab.merge(json.loads(json.dumps(merged)), [committed])
    assert again == merged
    # the command writes the merged file and its table, measuring nothing
    out = tmp_path / "out"
    out.mkdir()
    (out / "ab.json").write_text(paths[0].read_text())
    subprocess.run([sys.executable, str(BENCH / "ab.py"), "--out", str(out), "--merge", str(paths[1]), str(paths[2])],
                   check=True, capture_output=True, timeout=120)
    assert json.loads((out / "ab.json").read_text()) == merged
    # nothing to merge into and nothing taken: a clear error, no file written
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "other.json").write_text(json.dumps({"results": {}}))
    run = subprocess.run([sys.executable, str(BENCH / "ab.py"), "--out", str(empty), "--merge",
                          str(empty / "other.json")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "holds a row" in run.stderr and not (empty / "ab.json").exists()
    table = (out / "ab.md").read_text()
    assert "| m | b32 | float16 | eager | inference |" in table and "| m A/A | b32 |" in table


sass_counts = _bench_script("sass_counts")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_sass_counts_compiles_a_kernel_for_the_gpu_and_counts_its_machine_code(sass_counts, tmp_path):
    from convtune.algorithms.registry import get_algorithm
    from convtune.problem import ConvProblem

    p = ConvProblem("fwd", n=2, c=16, k=16, groups=4, input_size=(6, 6), kernel_size=3, padding=1, dtype="float16",
                    layout="channels_last", device="cuda")
    launches = sass_counts.count(p, get_algorithm("triton:grouped_fwd_p64c32w4"), 90)
    assert len(launches) == 1
    launch = launches[0]
    assert launch["kernel"] == "_forward" and launch["registers"] > 0 and launch["spilled_bytes"] == 0
    assert launch["tensor_core"] > 0 and 0 < launch["global_loads"] < launch["instructions"]
    assert launch["grid"] == [2, 1]  # 72 positions in tiles of 64; 4 groups of 4 packed into one tile of 16
    # a second revision's rows of the same kernels stand beside the first's
    rows = {f"{rev}": dict(problem=p.key, algorithm="triton:grouped_fwd_p64c32w4", revision=rev, launches=launches)
            for rev in ("aaa", "bbb")}
    text = sass_counts.markdown({"date": "d", "cpu": "c", "arch": 90, "revision": "bbb"}, rows)
    assert text.count("| fwd n2 c16 k16 g4 6x6 r3x3 s1 d1 float16 channels_last | grouped_fwd_p64c32w4 |") == 2
    # two nested loops: the innermost (the shorter body) is the turn counted
    sass = ("/*0000*/ IMAD R0, R1, R2, R3 ;\n/*0010*/ HMMA.16816.F32 R0, R1, R2, R3 ;\n"
            "/*0020*/ @P0 BRA 0x10 ;\n/*0030*/ LDG.E R4, [R2.64] ;\n/*0040*/ @P1 BRA 0x0 ;")
    assert sass_counts.instruction_counts(sass) == dict(instructions=5, tensor_core=1, global_loads=1, shared_stores=0,
                                                        loops=2, nested=True, outer_loop=5, inner_loop=2,
                                                        inner_loop_tensor_core=1)
    side_by_side = sass.replace("@P1 BRA 0x0", "@P1 BRA 0x30")
    assert sass_counts.instruction_counts(side_by_side)["nested"] is False
    one_loop = sass.replace("@P1 BRA 0x0", "@P1 BRA 0x10")  # two branches back to one start: one loop, not nested
    assert {k: v for k, v in sass_counts.instruction_counts(one_loop).items() if k in ("loops", "nested")} == dict(
        loops=1, nested=False)
    # the grouped kernels' loops' turns are not known: no issue-bound time
    assert "issue_bound_us" not in launch and text.splitlines()[-1].endswith("| - |")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_sass_counts_bounds_the_banded_kernels_time_by_their_loops_turns(sass_counts):
    from convtune.algorithms.registry import get_algorithm
    from convtune.problem import ConvProblem

    # 3 kernel rows, read against the loops the machine code kept: the forward turns per kernel row; the data gradient
    # of a channel multiplier of 2 per kernel row in a loop over the multiple, or over the multiple alone where the
    # rows are unrolled; the weight gradient's runs of 256 rows (of 2·40 here: 80) in tiles of 32 rows 3 times per
    # kernel row, and of 15·20 = 300 rows 8 and 2 times (a mean of 5); loops of another shape (copies side by side,
    # say) are not counted
    p = ConvProblem("fwd", n=2, c=8, k=16, groups=8, input_size=(40, 40), kernel_size=3, padding=1, dtype="float16",
                    layout="channels_last", device="cuda")
    name = "triton:depthwise_band_{}_r32n16c8w4"

    def turns(direction, problem=p, **launch):
        algorithm = get_algorithm(name.format(direction) + ("s256" if direction == "bwd_filter" else ""))
        return sass_counts.banded_turns(problem.with_direction(direction), algorithm, launch)

    assert turns("fwd", kernel="_forward", loops=1) == ((3,), 1)
    assert turns("fwd", kernel="_forward", loops=0) == ((1,), 1)
    assert turns("fwd", kernel="_forward", loops=2, nested=True) is None
    assert turns("bwd_data", kernel="_backward_data", loops=1) == ((2,), 1)
    assert turns("bwd_data", kernel="_backward_data", loops=2, nested=True) == ((3,), 2)
    assert turns("bwd_data", kernel="_backward_data", loops=2, nested=False) is None
    assert turns("bwd_data", problem=p.replace(k=8), kernel="_backward_data", loops=1) == ((3,), 1)
    assert turns("bwd_filter", kernel="_backward_filter_partials", loops=2, nested=True) == ((3,), 3)
    longer = p.replace(n=15, input_size=(20, 40))
    assert turns("bwd_filter", problem=longer, kernel="_backward_filter_partials", loops=2, nested=True) == ((8, 2), 3)
    assert turns("bwd_filter", kernel="_backward_filter_partials", loops=3, nested=True) is None
    assert turns("bwd_filter", kernel="_sum_partials", loops=1) is None
    (launch,) = sass_counts.count(p, get_algorithm(name.format("fwd")), 90)
    programs = launch["grid"][0] * launch["grid"][1] * launch["grid"][2]
    per_warp = launch["instructions"] + 2 * launch["inner_loop"]  # the loop 3 times
    # 2·40 rows in tiles of 32 × 40 columns in tiles of 16 × 16 output channels in tiles of 8: 18 programs, fewer
    # than the SMs, so the bound is one warp's instructions one a clock (not all of them spread over every scheduler)
    assert launch["loops"] == 1 and programs == 18
    assert launch["issue_bound_us"] == pytest.approx(per_warp / sass_counts.CLOCK * 1e6)

    def bound(grid, warps, shares, outer=1):
        # 100 instructions: 40 in the loop around the innermost (the innermost's 10 included), 60 outside both
        launch = dict(grid=grid, warps=warps, instructions=100, outer_loop=40 if outer > 1 else 0, inner_loop=10)
        return sass_counts.issue_bound_us(launch, (shares, outer)) * 1e-6 * sass_counts.CLOCK  # in clocks

    # a warp of 90 instructions and a loop of 10 turning 3 times: 120. 400 programs of 8 warps on 132 SMs put 4 on
    # some, 2 warps a scheduler each: 8 warps; 132·80 fill every scheduler evenly, the same as spread over all
    assert bound([400, 1, 1], 8, (3,)) == pytest.approx(120 * 8)
    assert bound([132 * 80, 1, 1], 8, (3,)) == pytest.approx(120 * 132 * 80 * 8 / (132 * 4))
    # two equal shares turning 3 and 1 times (120 and 100 instructions a warp), 8 warps: evenly spread where there
    # are many, and where there are 264 (132 of each), an SM takes two: at best one of each, 220 × 2 warps
    assert bound([132 * 80, 1, 1], 8, (3, 1)) == pytest.approx(110 * 132 * 80 * 8 / (132 * 4))
    assert bound([2, 66, 2], 8, (3, 1)) == pytest.approx(220 * 2)
    # the loop around turns 4 times: its own 30 and the innermost's 10 × 3 each time, the other 60 once
    assert bound([1, 1, 1], 4, (3,), outer=4) == pytest.approx(60 + 4 * (30 + 10 * 3))
    assert "issue_bound_us" not in sass_counts.count(p, get_algorithm(name.format("fwd")), 80)[0]  # not sm_90's rate
    # --replace drops a family's rows by their configuration's name, registered or not
    names = ("triton:depthwise_band_fwd_r32n16c8w4", "triton:depthwise_fwd_p64c32w4ut",
             "triton:grouped_bwd_filter_p32c64w4s1024", "cudnn:eng0")
    assert [sass_counts.common.family_of(n) for n in names] == ["depthwise_band", "depthwise", "grouped", ""]


def test_sass_counts_reads_the_strip_kernels_loops(sass_counts):
    from convtune.algorithms.registry import get_algorithm
    from convtune.problem import ConvProblem

    # 3 kernel rows: the forward and the data gradient turn once per kernel row (within a loop over a multiple of 2
    # for the data gradient, or over the multiple alone where one kernel row leaves no loop); the weight gradient's
    # runs of 8 output rows (of 2·40 = 80: ten runs) in steps of 32 strips (10 strips of 4 a row: 80 a run, 3 steps),
    # a kernel row a program
    p = ConvProblem("fwd", n=2, c=8, k=16, groups=8, input_size=(40, 40), kernel_size=3, padding=1, dtype="float16",
                    layout="channels_last", device="cuda")

    def turns(direction, name, problem=p, **launch):
        algorithm = get_algorithm(f"triton:depthwise_strip_{direction}_{name}")
        return sass_counts.strip_turns(problem.with_direction(direction), algorithm, launch)

    assert turns("fwd", "t4b32c32w4", kernel="_strips", loops=1) == ((3,), 1)
    assert turns("fwd", "t4b32c32w4", kernel="_lay_out_weights", loops=0) == ((1,), 1)
    assert turns("bwd_data", "t4b32c32w4", kernel="_strips", loops=2, nested=True) == ((3,), 2)
    assert turns("bwd_data", "t4b32c32w4", kernel="_strips", loops=1) is None  # 3 rows and a multiple of 2: not one
    one_row = p.replace(kernel_size=(1, 3), padding=(0, 1))
    assert turns("bwd_data", "t4b32c32w4", problem=one_row, kernel="_strips", loops=1) == ((2,), 1)
    # a stride-2 data gradient: one launch per phase of dx's rows, each meeting kernel rows 0 and 2, or 1 alone
    strided = p.replace(stride=2)
    assert turns("bwd_data", "t4b32c32w4", problem=strided, kernel="_strips", loops=2, nested=True,
                 integers=dict(r_first=0, r_step=2)) == ((2,), 2)
    assert turns("bwd_data", "t4b32c32w4", problem=strided, kernel="_strips", loops=2, nested=True,
                 integers=dict(r_first=1, r_step=2)) == ((1,), 2)
    assert turns("bwd_filter", "t4b32c32w4s8", kernel="_filter_partials", loops=1) == ((3,) * 10, 1)  # a row a program
    assert turns("bwd_filter", "t4b32c32w4s8", kernel="_sum_partials", loops=1) is None
    assert turns("bwd_filter", "t4b32c32w4s8", kernel="_filter_partials", loops=2, nested=True) is None


def test_the_depthwise_benchmark_times_one_family_again_and_keeps_the_others(depthwise, monkeypatch):
    from convtune.problem import ConvProblem

    # Times made up per family (no GPU here): measure's bookkeeping, not the kernels, is under test.
    made_up = {"depthwise": 3.0, "depthwise_band": 5.0, "depthwise_strip": 2.0}
    monkeypatch.setattr(depthwise, "time_algorithm", lambda p, a, inputs, ref: (made_up[a.family], 0.0, "ok"))
    monkeypatch.setattr(depthwise, "reference", lambda p, *inputs: None)
    monkeypatch.setattr(ConvProblem, "random_inputs", lambda self, seed=0: (None, None))
    monkeypatch.setattr(depthwise.hardware, "roofline_ms", lambda p: 0.5)
    p = depthwise.make_problem("96:56:7:1", "fwd", 32, "float16", "channels_last")
    monkeypatch.setattr(depthwise.common, "revision", lambda: "r1")
    first = depthwise.measure(p, {"cudnn_ms": 4.0})  # an earlier row: cuDNN's time kept, every family of ours timed
    assert {depthwise.common.family_of(n) for n in first["ours"]} == set(made_up)
    assert first["ours_best"].startswith("triton:depthwise_strip_") and first["ours_ms"] == 2.0
    assert first["ours_revisions"] == {f: "r1" for f in made_up} and first["cudnn_ms"] == 4.0
    made_up["depthwise_strip"] = 4.0  # the strips measured again, slower now: the tap-by-tap kernels' 3.0 is best
    monkeypatch.setattr(depthwise.common, "revision", lambda: "r2")
    again = depthwise.measure(p, first, ("depthwise_strip",))
    assert again["ours"] == {n: 4.0 if "strip" in n else t for n, t in first["ours"].items()}
    assert again["ours_best"].startswith("triton:depthwise_fwd_") and again["ours_ms"] == 3.0
    assert again["ours_revisions"] == {"depthwise": "r1", "depthwise_band": "r1", "depthwise_strip": "r2"}
    nothing = depthwise.measure(p, again, ("grouped",))  # no grouped kernel computes a depthwise layer: all kept
    assert nothing["ours"] == again["ours"] and nothing["ours_revision"] == "r2"
    no_cudnn = types.SimpleNamespace(BACKEND=types.SimpleNamespace(algorithms=lambda p: []))  # none here
    monkeypatch.setitem(sys.modules, "convtune.algorithms.cudnn", no_cudnn)
    assert depthwise.measure(p, None, ("depthwise_band",))["ours"].keys() == first["ours"].keys()  # a new row: all
    legacy = {k: v for k, v in first.items() if k != "ours_revisions"} | {"ours_revision": "r0"}
    monkeypatch.setattr(depthwise.common, "revision", lambda: "r3")
    assert depthwise.measure(p, legacy, ("depthwise",))["ours_revisions"] == {
        "depthwise": "r3", "depthwise_band": "r0", "depthwise_strip": "r0"}
    for arguments, words in ((["--ours-again", "--families", "depthwise_strips"],
                              "--families depthwise_strips: each must be one of depthwise,"),
                             (["--families", "depthwise_strip"], "--families needs --ours-again")):
        script = subprocess.run([sys.executable, str(BENCH / "depthwise.py"), *arguments], capture_output=True,
                                text=True, timeout=120)
        assert script.returncode == 2 and words in script.stderr, script.stderr


def test_the_depthwise_benchmark_takes_grouped_shapes_and_times_the_grouped_family_on_them(depthwise):
    from convtune.algorithms.registry import registered

    p = depthwise.make_problem("128:56:3:1:4", "fwd", 32, "float16", "channels_last")
    assert (p.c, p.k, p.groups) == (128, 128, 32)
    assert {a.name.split("_")[0] for a in registered() if depthwise.ours(a, p)} == {"triton:grouped"}
    q = depthwise.make_problem("96:56:7:1", "fwd", 32, "float16", "channels_last")
    assert q.groups == 96
    assert {a.name.rsplit("_", 2)[0] for a in registered() if depthwise.ours(a, q)} == {
        "triton:depthwise", "triton:depthwise_band", "triton:depthwise_strip"}
    with pytest.raises(ValueError, match="whole number of groups"):
        depthwise.parse_shape("130:56:3:1:4")
    for bad in ("128:56:3", "128:56:3:1:0", "128:56:3:1:-4", "128:56:x:1"):
        with pytest.raises(ValueError, match="channels:spatial:kernel:stride"):
            depthwise.parse_shape(bad)
    assert all(depthwise.parse_shape(s) for s in depthwise.GROUPED_SHAPES)
    row = dict(problem=p.key, floor_ms=0.01, cudnn_ms=0.05, ours_ms=0.1, ours_best="triton:grouped_fwd_p64c32w4",
               ours={"triton:grouped_fwd_p64c32w4": 0.1})
    text = depthwise.markdown({"date": "d", "gpu": "g"}, {"a": row})
    assert "| fwd | grouped, 4 a group | 1 | 0.50 | - |" in text and "| 128 | 4 | 56 | 3 | 1 | 0.1000 | - |" in text


def test_the_depthwise_benchmark_takes_first_layers_and_times_the_folded_family_on_them(depthwise):
    from convtune.algorithms.registry import registered

    p = depthwise.make_problem("3:224:7:2:3:64", "fwd", 32, "bfloat16", "channels_last")
    assert (p.c, p.k, p.groups, p.padding, p.output_size) == (3, 64, 1, (3, 3), (112, 112))
    assert {a.name.rsplit("_", 2)[0] for a in registered() if depthwise.ours(a, p)} == {"triton:folded"}
    patch = depthwise.make_problem("3:224:16:16:3:768", "bwd_filter", 32, "bfloat16", "channels_last")
    assert (patch.k, patch.padding, patch.output_size) == (768, (0, 0), (14, 14))  # a patch embedding: no padding
    assert not any(depthwise.ours(a, patch) for a in registered() if a.directions == ("bwd_data",))
    assert all(depthwise.parse_shape(s) for s in depthwise.FIRST_SHAPES)
    assert depthwise.parse_shape("96:56:7:1") == (96, 56, 7, 1, 1, 96)  # the output's channels: the input's
    assert depthwise.parse_shape("8:56:3:1:4:6")[5] == 6  # 6 outputs in 2 groups of 4 inputs
    with pytest.raises(ValueError, match="channels:spatial:kernel:stride"):
        depthwise.parse_shape("3:224:7:2:3:0")
    with pytest.raises(ValueError, match="whole number of groups"):
        depthwise.parse_shape("8:56:3:1:4:5")  # 5 output channels in 2 groups
    row = dict(problem=p.key, floor_ms=0.1, cudnn_ms=0.8, ours_ms=0.2, ours_best="triton:folded_fwd_p128c64w4",
               ours={"triton:folded_fwd_p128c64w4": 0.2})
    text = depthwise.markdown({"date": "d", "gpu": "g"}, {"a": row})
    assert "| fwd | first layer, 7x7 | 1 | 4.00 | - |" in text and "| 32 | 3>64 | 3 | 224 | 7 | 2 | 0.2000 |" in text


def test_a_test_runs_phases_are_logged_as_they_end_where_a_times_file_is_named(tmp_path, monkeypatch):
    # bench/gpu_checks.sh names a times file beside each GPU test log: a run its time limit cuts still shows where
    # its time went (pytest's --durations print only at the end)
    import conftest

    times = tmp_path / "times.txt"
    report = types.SimpleNamespace(duration=63.9, when="setup", outcome="passed", nodeid="tests/gpu/t.py::test[a]")
    monkeypatch.delenv("CONVTUNE_TEST_TIMES", raising=False)
    conftest.pytest_runtest_logreport(report)
    assert not times.exists()
    monkeypatch.setenv("CONVTUNE_TEST_TIMES", str(times))
    conftest.pytest_runtest_logreport(report)
    conftest.pytest_runtest_logreport(types.SimpleNamespace(duration=1.5, when="call", outcome="failed",
                                                            nodeid="tests/gpu/t.py::test[a]"))
    assert times.read_text().splitlines() == ["    63.90 s  setup     passed   tests/gpu/t.py::test[a]",
                                              "     1.50 s  call      failed   tests/gpu/t.py::test[a]"]
    assert "CONVTUNE_TEST_TIMES" in (Path(__file__).parents[1] / "bench" / "gpu_checks.sh").read_text()


def test_results_of_another_gpu_are_never_merged_into_a_results_file(tmp_path, common):
    # e2e.py, ab.py and depthwise.py add their rows to a results file; its tables compare those rows, so a run on
    # another GPU (an H100 where the file's rows are the H200's) must write elsewhere, told how
    path = tmp_path / "e2e.json"
    assert common.extendable(path, dict(gpu="NVIDIA H200"), "e2e") == {}
    path.write_text(json.dumps(dict(environment=dict(gpu="NVIDIA H200"), configs={"a": 1})))
    assert common.extendable(path, dict(gpu="NVIDIA H200"), "e2e")["configs"] == {"a": 1}
    with pytest.raises(SystemExit, match=r"measured on NVIDIA H200, and this run is on NVIDIA H100 80GB HBM3: .*"
                                         r"--name \(e\.g\. --name e2e_h100\)"):
        common.extendable(path, dict(gpu="NVIDIA H100 80GB HBM3"), "e2e")
    with pytest.raises(SystemExit, match=r"this run is on AMD EPYC: write them to another results file with --name$"):
        common.extendable(path, dict(cpu="AMD EPYC"), "e2e")
    for script in ("e2e.py", "ab.py", "depthwise.py"):
        assert "common.extendable(json_path, env, args.name)" in (Path(common.__file__).parent / script).read_text()


get_latency = _bench_script("get_latency")


def test_get_latency_times_each_distinct_problem_once_cold_and_warm(get_latency, tmp_path):
    # ResNet-18's layers at batch 1 on the CPU: each distinct problem timed twice (its first get, then again), once
    # across the networks named (a network that repeats another's problems adds none), and the file says so
    import json

    from sweep import network_problems

    assert get_latency.main(["--networks", "resnet18,resnet18", "--batch", "1", "--dtypes", "float32", "--device",
                             "cpu", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "get_latency.json").read_text())
    distinct = len(set(p for _, p in network_problems(["resnet18"], 1, ["float32"], ["channels_last"], "cpu")))
    assert list(payload["results"]) == ["resnet18"]
    for kind in ("cold", "warm"):
        row = payload["results"]["resnet18"][kind]
        assert row["problems"] == distinct and 0 < row["median_ms"] <= row["p90_ms"] <= row["max_ms"]
    assert "| resnet18 | warm |" in (tmp_path / "get_latency.md").read_text()
    # where the cold calls' time went: the phases that exist here (cuDNN's, where its frontend loads, unused on a
    # CPU), within the cold calls' total
    ranking = importlib.import_module("convtune.get").ranked_predictions  # the module's (the package's ``get`` is
    # the function)
    phases = payload["cold_phases_ms"]["resnet18"]
    assert {"cold gets, in all", "candidates listed", "priced and ranked"} <= set(phases)
    assert all(ms == 0 for p, ms in phases.items() if p.startswith("cuDNN"))
    assert 0 < phases["priced and ranked"] < phases["cold gets, in all"] and 0 < phases["candidates listed"]
    assert ranking.__qualname__ == "ranked_predictions"  # unwrapped after
    # then the same network's problems at batch 2, each cold under cProfile: get holds the rest (they nest)
    top = payload["cold_profile_ms"]["resnet18"]
    assert list(payload["cold_profile_ms"]) == ["resnet18"] and top[0][1] == "get.py:get"
    assert all(0 < ms <= top[0][0] for ms, _ in top)
    assert "resnet18's problems at batch 2, each asked cold under cProfile" in (tmp_path / "get_latency.md").read_text()


fit_triton_prices = _bench_script("fit_triton_prices")


def _timed_once(common, path, gpu: str, problems: list, names: dict) -> Path:
    """A bench/depthwise.py results file at ``path`` (of ``gpu``) in which each of ``names`` took 1 ms on each problem
    of its direction."""
    env = dict(common.environment(), gpu=gpu, revision="test")
    path.write_text(json.dumps({"environment": env, "rows": {p.key: {"ours": {n: 1.0 for n in names
                                                                             if f"_{p.direction}_" in n}}
                                                               for p in problems}}))
    return path


def test_fitting_the_triton_prices_recovers_each_configurations_measured_factor(fit_triton_prices, tmp_path):
    # Results whose every time is its configuration's roofline price times a factor of its own: the fit gives those
    # factors back, over the strips' fastest one's in each direction, and get's first pick becomes the fastest.
    ct, common = fit_triton_prices.ct, fit_triton_prices.common
    problems = [ct.ConvProblem(d, n=32, c=c, k=c, input_size=(s, s), kernel_size=k, padding=k // 2, groups=c,
                               dtype="float16", layout="channels_last", device="cuda")  # the work outweighs a launch
                for d in ("fwd", "bwd_filter") for c, s, k in ((96, 56, 7), (384, 14, 7))]
    wanted = {"triton:depthwise_strip_fwd_t8b16c32w4": 0.5, "triton:depthwise_strip_fwd_t2b64c16w4": 2.0,
              "triton:depthwise_band_fwd_r32n16c8w4": 3.0, "triton:depthwise_strip_bwd_filter_t8b16c32w4s8": 1.5,
              "triton:depthwise_rows_bwd_filter_r8q16c8w4": 4.5}
    results = _timed_once(common, tmp_path / "depthwise.json", "NVIDIA H200", problems, wanted)
    _, rows = fit_triton_prices.raw_prices(results)
    for row in rows:  # the same file, each time made its work's price times its factor
        for name, (_, work, launch, workspace) in row["entries"].items():
            row["entries"][name] = (work * wanted[name], work, launch, workspace)
    payload = json.loads(results.read_text())
    for row in rows:
        payload["rows"][row["problem"].key]["ours"] = {n: e[0] for n, e in row["entries"].items()}
    payload["rows"][problems[0].key]["ours"]["triton:grouped_fwd_p64c32w4"] = 1.0  # another family's: not fitted
    payload["rows"][problems[0].key]["ours"]["triton:depthwise_fwd_p8c8w1"] = 1.0  # no such configuration now
    results.write_text(json.dumps(payload))
    out = tmp_path / "prices.json"
    assert fit_triton_prices.main(["--results", str(results), "--out", str(out)]) == 0
    factors = json.loads(out.read_text())["factors"]
    expected = {n: f / (0.5 if "_fwd_" in n else 1.5) for n, f in wanted.items()}  # the strips' least: 1
    assert factors == pytest.approx(expected)
    assert all(v == [1.0] * len(v) for v in fit_triton_prices.picks(rows, factors).values())


def test_the_folded_kernels_prices_are_fitted_against_cudnns_fastest_plan(fit_triton_prices, tmp_path):
    # First layers (no earlier balance to keep): each folded configuration's factor is its measured time over its
    # price, over cuDNN's fastest plan's measured time over a plan's price on the same layers, so that get picks
    # between them as their times stood.
    ct, common = fit_triton_prices.ct, fit_triton_prices.common
    problems = [ct.ConvProblem(d, n=128, c=3, k=k, input_size=(224, 224), kernel_size=r, stride=s, padding=r // 2,
                               dtype="bfloat16", layout="channels_last", device="cuda")
                for d in ("fwd", "bwd_filter") for k, r, s in ((64, 7, 2), (32, 3, 2))]
    wanted = {"triton:folded_fwd_p128c64w4": 2.0, "triton:folded_fwd_p64c32w4": 3.0,
              "triton:folded_bwd_filter_p64c64w4s4096": 4.0}
    cudnn_over_price = {"fwd": 8.0, "bwd_filter": 2.0}  # cuDNN's fastest plan: its price times this
    gpu = "NVIDIA H100 80GB HBM3"
    results = _timed_once(common, tmp_path / "first_layers.json", gpu, problems, wanted)
    _, rows = fit_triton_prices.raw_prices(results)
    payload = json.loads(results.read_text())
    for row in rows:
        key = row["problem"].key
        payload["rows"][key]["ours"] = {n: work * wanted[n] for n, (_, work, _, _) in row["entries"].items()}
        plan = dataclasses.replace(fit_triton_prices.execution_plan_cost(row["problem"]), launches=0)
        with fit_triton_prices.hardware.measured_on(f"cuda|{gpu}|fit|fit|fit"):
            price = fit_triton_prices.costmodel.roofline_ms(plan, row["problem"], True)
        payload["rows"][key]["cudnn_ms"] = price * cudnn_over_price[row["problem"].direction]
    results.write_text(json.dumps(payload))
    out = tmp_path / "prices.json"
    assert fit_triton_prices.main(["--results", str(results), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["anchors"]["folded"] == "cudnn"
    expected = {n: f / cudnn_over_price["fwd" if "_fwd_" in n else "bwd_filter"] for n, f in wanted.items()}
    assert written["factors"] == pytest.approx(expected)
    _, rows = fit_triton_prices.raw_prices(results)
    # fitted, get picks the faster of the two on every layer: the forwards' folded kernels (2x, against cuDNN's 8x),
    # cuDNN's plan for the weight gradients (2x, against 4x)
    assert all(v == pytest.approx([1.0] * len(v)) for v in fit_triton_prices.against_cudnn(rows, expected).values())


def test_the_sampled_depthwise_sweep_takes_every_kernel_in_turns_and_the_same_shapes_each_time(depthwise):
    shapes = depthwise.sampled_shapes(3, seed=1)
    kernels = [depthwise.parse_shape(s)[2] for s in shapes]
    grid = depthwise.FULL["kernels"]
    assert kernels[:len(grid)] == list(grid) and len(shapes) == 3 * len(grid) == len(set(shapes))
    assert set(shapes) <= set(depthwise.full_shapes()) and shapes == depthwise.sampled_shapes(3, seed=1)
    assert shapes != depthwise.sampled_shapes(3, seed=2)


def test_host_noise_times_each_variant_in_its_own_processes_and_pins_where_asked(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, str(BENCH / "host_noise.py"), "--tiny", "--processes", "1",
                          "--cpus", str(cpu), "--steps", "1", "--repeats", "1", "--rounds", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    variants = json.loads((tmp_path / "host_noise.json").read_text())["variants"]
    assert list(variants) == ["free", f"pinned to CPU {cpu}"]
    pinned = variants[f"pinned to CPU {cpu}"][0]
    assert pinned["status"] == "ok" and pinned["affinity"] == pinned["cpus"] == [cpu] and len(pinned["samples"]) == 2
    assert variants["free"][0]["affinity"] == sorted(os.sched_getaffinity(0))
    assert f"| pinned to CPU {cpu} | 1 |" in (tmp_path / "host_noise.md").read_text()
    bad = subprocess.run([sys.executable, str(BENCH / "host_noise.py"), "--cpus", "x"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--cpus 'x' must be CPU numbers" in bad.stderr


timer_methods = _bench_script("timer_methods")


def test_timer_methods_reads_its_methods_and_sums_up_hand_made_rows(timer_methods):
    assert timer_methods.parse_method("eager=0.1/sample=0.25") == {"timing_eager_above_ms": 0.1,
                                                                   "timing_sample_ms": 0.25}
    assert timer_methods.parse_method("graph=16/eager=0") == {"timing_graph_calls": 16, "timing_eager_above_ms": 0.0}
    with pytest.raises(ValueError, match="'size' is not one of sample, eager, graph"):
        timer_methods.parse_method("size=1")
    with pytest.raises(ValueError, match="graph takes a whole number of calls, 0 or more, not '1.5'"):
        timer_methods.parse_method("graph=1.5")
    with pytest.raises(ValueError, match="'x' is not a number of ms"):
        timer_methods.parse_method("sample=x")
    with pytest.raises(ValueError, match="sample must be a finite number of ms above 0"):
        timer_methods.parse_method("sample=0")
    rows = {"p1": {"a": {"default": (1.0, 0.5), "fast": (1.1, 0.1)}, "b": {"default": (2.0, 0.5), "fast": (1.0, 0.1)}},
            "p2": {"a": {"default": (3.0, 0.5), "fast": (3.0, 0.1)}, "b": {"default": (4.0, 0.5), "fast": (5.0, 0.1)}},
            "p3": {"a": {"default": (3.0, 0.5), "fast": (1.0, 0.1)}}, "p4": {}}
    default, fast = timer_methods.summary(rows, ["default", "fast"])
    assert default == ["default", "2.50", "1.000", "1.000-1.000", "0 of 2", "-"]
    # p1's fastest moves from a to b, which the default timed at 2.0 against a's 1.0 (p3's one candidate: no choice)
    assert fast[:2] == ["fast", "0.50"] and fast[4:] == ["1 of 2", "2.000 / 2.000"]
    assert timer_methods.summary({"p1": {}}, ["default"]) == [["default", "0.00", "-", "-", "0 of 0", "-"]]
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(BENCH / "timer_methods.py")], capture_output=True, text=True)
        assert out.returncode == 2 and "needs --device cuda and a GPU" in out.stderr


def test_timer_methods_times_only_candidates_that_compute_right(timer_methods):
    from convtune import ConvProblem
    from convtune.algorithms import registry
    from fakes import Fake, NoWrite, WrongResult

    p = ConvProblem("fwd", n=1, c=4, k=4, input_size=(6, 6), kernel_size=3, padding=1)
    plugins = [WrongResult("fake:wrong"), NoWrite("fake:nowrite"), Fake("fake:good"), Fake("fake:good2")]
    with registry.isolated(*plugins, builtins=False):
        chosen = timer_methods.candidates_of(p, 3)
    assert sorted(name for name, _ in chosen) == ["fake:good", "fake:good2"]
    assert all(call() is not None for _, call in chosen)


def test_e2e_merges_results_files_group_by_group_from_the_one_measured_last(tmp_path):
    grid = json.loads((BENCH / "results" / "e2e.json").read_text())
    groups = sorted({cid.rsplit(":", 1)[0] for cid in grid["configs"]})
    assert len(groups) >= 3  # what the test relies on
    kept, newer, only_there = groups[:3]
    base = dict(grid, configs={c: r for c, r in grid["configs"].items() if not c.startswith(only_there + ":")})
    # the other file: one group measured later, one measured earlier, one the base lacks (its rows marked)
    other = dict(grid, configs={})
    for cid, row in grid["configs"].items():
        group = cid.rsplit(":", 1)[0]
        date = {kept: "2000-01-01 00:00 UTC", newer: "2999-01-01 00:00 UTC"}.get(group, row.get("date"))
        if group in (kept, newer, only_there):
            other["configs"][cid] = dict(row, date=date, marked=True)
    (tmp_path / "e2e.json").write_text(json.dumps(base))
    (tmp_path / "other.json").write_text(json.dumps(other))
    run = [sys.executable, str(BENCH / "e2e.py"), "--out", str(tmp_path)]
    subprocess.run([*run, "--merge", str(tmp_path / "other.json")], check=True, capture_output=True)
    rows = json.loads((tmp_path / "e2e.json").read_text())["configs"]
    assert set(rows) == set(grid["configs"])
    for cid, row in rows.items():  # each group whole from the file that measured it last
        assert row.get("marked", False) == cid.startswith((newer + ":", only_there + ":")), cid
    assert (tmp_path / "e2e.md").exists()
    elsewhere = dict(other, environment=dict(other["environment"], gpu="Another GPU"))
    (tmp_path / "elsewhere.json").write_text(json.dumps(elsewhere))
    refused = subprocess.run([*run, "--merge", str(tmp_path / "elsewhere.json")], capture_output=True, text=True)
    assert refused.returncode == 2 and "elsewhere.json: measured on Another GPU" in refused.stderr


def test_heuristics_cost_checks_whether_two_graphs_list_what_a_graph_asked_for_both_lists(heuristics_cost):
    class Graph:  # what a frontend might do: problem 1 lists A's then FALLBACK's not among them, 2 FALLBACK's
        def __init__(self, problem, modes):  # first, 3 one more plan joined, 4 refuses FALLBACK alone
            if problem == 4 and modes == ("FALLBACK",):
                raise RuntimeError("no plan")
            plans = {"A": ["a", "b", "c"], "FALLBACK": ["c", "f"]}
            self.names = [n for m in modes for n in plans[m]]
            if len(modes) == 2:
                self.names = list(dict.fromkeys(self.names if problem != 2 else self.names[::-1]))
                self.names += ["g"] if problem == 3 else []

    r = heuristics_cost.separate([1, 2, 3, 4], ("A",), ("FALLBACK",), Graph)
    assert (r["problems"], r["same"], r["same_set_other_order"], r["failed"]) == (4, 1, 1, 1)
    assert (r["names_only_in_the_joined_graph"], r["names_only_in_the_separate_graphs"]) == (1, 0)
