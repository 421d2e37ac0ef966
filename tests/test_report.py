"""The HTML plan report and the CLI's workspace budget: `tune --workspace-budget` and `report`.

Most tests store hand-made measurements in a temporary TuningDB, so the plan (and so every
value the report shows) is known exactly; one test per command measures for real on the CPU.
"""

import json
import re
from pathlib import Path

import pytest
from PIL import Image

from convtune import zoo
from convtune.cli import main
from convtune.db import TuningDB
from convtune.html_report import default_budgets, write_report
from convtune.plan import plan
from convtune.results import PerfResult

LAYERS = {"layers": [
    {"c": 4, "k": 8, "spatial": [8, 8], "kernel": [3, 3], "padding": [1, 1], "count": 2},
    {"c": 8, "k": 8, "spatial": [8, 8], "kernel": [3, 3], "stride": [2, 2], "padding": [1, 1]},
    {"c": 8, "k": 4, "spatial": [4, 4], "kernel": [1, 1]},
]}
KiB = 1024
# Per layer: (algorithm, time_ms, workspace_bytes); the fastest needs the most workspace.
MEASURED = [
    [("x:lean", 3.0, 0), ("x:mid", 2.0, 4 * KiB), ("x:fast", 1.0, 64 * KiB), ("x:slow", 9.0, 8 * KiB)],
    [("x:lean", 5.0, 2 * KiB), ("x:fast", 2.5, 32 * KiB)],
    [("x:only", 0.5, 0)],
]


@pytest.fixture(autouse=True)
def _quick_timing(quick_timing):
    yield


@pytest.fixture
def network(tmp_path):
    """(layer file, database path, the layers) with MEASURED stored for each layer."""
    path = tmp_path / "layers.json"
    path.write_text(json.dumps(LAYERS))
    layers = zoo.load_layers(path, batch=2, direction="fwd", dtype="float32", layout="channels_first",
                             device="cpu", allow_tf32=True)
    db_path = tmp_path / "measured.sqlite"
    with TuningDB(db_path) as db:
        for layer, rows in zip(layers, MEASURED):
            db.store(layer.problem, [PerfResult(a, "ok", time_ms=t, workspace_bytes=w) for a, t, w in rows])
    return path, db_path, layers


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def check_self_contained(html_path: Path) -> list[str]:
    """The HTML refers to nothing outside its folder and every image it shows is a valid PNG there."""
    text = html_path.read_text(encoding="utf-8")
    assert not re.search(r"https?://", text) and "<script" not in text and "<link" not in text
    images = re.findall(r'<img src="([^"]+)"', text)
    assert images
    for name in images:
        assert "/" not in name and name.endswith(".png"), name  # relative, beside the HTML
        png = html_path.parent / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(png) as image:
            image.verify()
        with Image.open(png) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    return images


def table_rows(text: str) -> list[list[str]]:
    body = text.split("<tbody>", 1)[1].split("</tbody>", 1)[0]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in body.split("</tr>") if "<td" in row]


def test_report_holds_the_plan_table_and_its_figures(network, tmp_path):
    _, db_path, layers = network
    problems = [layer.problem for layer in layers for _ in range(layer.count)]
    names = [layer.name for layer in layers for _ in range(layer.count)]
    with TuningDB(db_path) as db:
        p = plan(problems, "8KiB", db=db)
        path = write_report(p, tmp_path / "out" / "net.html", "test net", db=db, names=names)
    assert path == tmp_path / "out" / "net.html" and path.exists()
    images = check_self_contained(path)
    assert images == ["net_budget.png", "net_layer00.png", "net_layer01.png", "net_layer02.png"]
    text = path.read_text(encoding="utf-8")
    rows = table_rows(text)
    # Shared 8 KiB: L00 takes x:mid (2 ms, 1 ms lost, 60 KiB saved) twice; L01 x:lean; L02 x:only.
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [("L00", "2", "x:mid", "2.000"), ("L01", "1", "x:lean", "5.000"),
                                                        ("L02", "1", "x:only", "0.5000")]
    assert rows[0][7] == "1.000" and rows[0][8] == "60.0 KiB" and rows[1][7] == "2.500"
    assert rows[0][6] == "x:fast (1.000 ms, 64.0 KiB)" and rows[2][6] == "same"  # what the budget displaced
    from convtune.hardware import roofline_ms

    assert rows[0][9] == f"{100 * roofline_ms(layers[0].problem) / 2.0:.1f}%"
    footer = re.findall(r"<td[^>]*>(.*?)</td>", text.split("<tfoot>", 1)[1])
    assert footer[2] == "4" and footer[4] == f"{2 + 2 + 5 + 0.5:.3f}" and footer[5] == "4.0 KiB"
    assert "cpu|" in text and "torch" in text  # the device fingerprint and the software versions


def test_a_divided_budget_can_give_the_runs_of_one_layer_different_choices(network, tmp_path):
    _, db_path, layers = network
    problems = [layers[0].problem] * 2
    with TuningDB(db_path) as db:
        p = plan(problems, 68 * KiB, mode="divided", db=db)  # x:fast + x:mid (3 ms) is the one best fit
        path = write_report(p, tmp_path / "d.html", "divided", db=db, names=["conv", "conv"])
    check_self_contained(path)
    rows = table_rows(path.read_text(encoding="utf-8"))
    assert sorted((r[0], r[2], r[3]) for r in rows) == [("conv", "1", "x:fast"), ("conv", "1", "x:mid")]


def test_default_budgets_cover_every_step_of_a_shared_plan(network):
    _, db_path, layers = network
    with TuningDB(db_path) as db:
        p = plan([layer.problem for layer in layers], None, db=db)
    budgets = default_budgets(p)
    assert budgets[0] == 0 and {0, 2 * KiB, 4 * KiB, 32 * KiB, 64 * KiB} <= set(budgets) and max(budgets) > 64 * KiB


def test_names_must_match_the_plans_problems(network, tmp_path):
    _, db_path, layers = network
    with TuningDB(db_path) as db:
        p = plan([layers[0].problem], None, db=db)
        with pytest.raises(ValueError, match="one name per problem"):
            write_report(p, tmp_path / "x.html", "x", db=db, names=["a", "b"])


def test_cli_tune_applies_the_workspace_budget(capsys, network):
    path, db_path, _ = network
    code, out, _ = run(capsys, "tune", path, "--batch", 2, "--device", "cpu", "--db", db_path,
                       "--workspace-budget", "4KiB", "--json")
    data = json.loads(out)
    assert code == 0
    assert [(r["layer"], r["count"], r["algorithm"]) for r in data["layers"]] == [
        ("L00", 2, "x:mid"), ("L01", 1, "x:lean"), ("L02", 1, "x:only")]
    assert data["plan"]["total_time_ms"] == pytest.approx(2 * 2.0 + 5.0 + 0.5)
    assert data["plan"]["workspace_bytes"] == 4 * KiB and data["plan"]["unconstrained_time_ms"] == pytest.approx(5.0)
    code, out, _ = run(capsys, "tune", path, "--batch", 2, "--device", "cpu", "--db", db_path,
                       "--workspace-budget", "64KiB", "--budget-mode", "divided")
    text = " ".join(out.split())  # the caption may wrap
    assert code == 0 and "planned for a divided workspace budget of 64.0 KiB: 7.000 ms, workspace 40.0 KiB" in text
    assert "x:fast" in text  # 2 x 4 KiB for L00 leave room for L01's fastest


def test_cli_report_writes_the_html_and_prints_its_path(capsys, network, tmp_path):
    path, db_path, _ = network
    target = tmp_path / "rep" / "report.html"
    code, out, _ = run(capsys, "report", path, "--batch", 2, "--device", "cpu", "--db", db_path,
                       "--workspace-budget", "4KiB", "--out", target, "--budgets", "0,2KiB,1MiB")
    assert code == 0 and out.strip() == str(target)
    assert len(check_self_contained(target)) == 4 and "x:mid" in target.read_text(encoding="utf-8")


@pytest.mark.parametrize("command", ["tune", "report"])
@pytest.mark.parametrize("mode, smallest", [("shared", 2 * KiB), ("divided", 2 * KiB)])
def test_an_infeasible_budget_names_the_smallest_feasible_one_and_exits_2(capsys, network, tmp_path, command, mode,
                                                                          smallest):
    path, db_path, _ = network
    last = ["--out", tmp_path / "r.html"] if command == "report" else ["--json"]
    code, _, err = run(capsys, command, path, "--batch", 2, "--device", "cpu", "--db", db_path,
                       "--workspace-budget", "1KiB", "--budget-mode", mode, *last)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"smallest feasible budget is 2.0 KiB ({smallest} bytes)" in err and mode in err
    assert not (tmp_path / "r.html").exists()


def test_cli_tune_and_report_measure_for_real(capsys, tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"layers": [{"c": 4, "k": 4, "spatial": [6, 6], "kernel": [3, 3], "padding": [1, 1]},
                                           {"c": 4, "k": 8, "spatial": [6, 6], "kernel": [1, 1], "count": 2}]}))
    db = tmp_path / "real.sqlite"
    code, out, _ = run(capsys, "tune", path, "--batch", 1, "--device", "cpu", "--db", db, "--workspace-budget",
                       "1GiB", "--json")
    data = json.loads(out)
    assert code == 0 and [r["count"] for r in data["layers"]] == [1, 2]
    assert all(r["status"] == "ok" and r["time_ms"] > 0 for r in data["layers"])
    assert data["plan"]["total_time_ms"] == pytest.approx(data["plan"]["unconstrained_time_ms"])  # 1 GiB: no cost
    target = tmp_path / "real.html"
    code, out, _ = run(capsys, "report", path, "--batch", 1, "--device", "cpu", "--db", db, "--workspace-budget",
                       "1GiB", "--out", target)
    assert code == 0 and out.strip() == str(target) and len(check_self_contained(target)) == 3
