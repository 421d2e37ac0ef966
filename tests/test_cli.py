"""The command line end to end, on the CPU portfolio, in a temporary tuning database."""

import json
import logging
from pathlib import Path

import pytest

from convtune.cli import main
from convtune.settings import settings

SMALL = ["--n", "2", "--c", "8", "--k", "8", "--size", "10x10", "--kernel", "3", "--pad", "1", "--device", "cpu"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _quick_timing(quick_timing):
    yield


def test_get_prints_a_ranking_and_json(capsys):
    code, out, _ = run(capsys, "get", *SMALL)
    assert code == 0 and "predicted" in out and "torch:native" in out
    code, out, _ = run(capsys, "get", *SMALL, "--json")
    data = json.loads(out)
    assert code == 0 and data["choices"] and all(c["predicted_ms"] > 0 for c in data["choices"])


def test_get_says_what_it_priced_from(capsys, tmp_path):
    from convtune import ConvProblem, PerfResult, TuningDB, learned

    db = str(tmp_path / "t.sqlite")
    TuningDB(db).close()  # an empty database: get only reads one
    code, out, _ = run(capsys, "get", *SMALL, "--db", db)
    assert code == 0 and "priced from the analytic model" in out and "(0 of this direction's problems" in out
    p = ConvProblem("fwd", n=2, c=8, k=8, input_size=(10, 10), kernel_size=3, padding=1)
    with TuningDB(db) as tuning:  # enough problems of the direction measured: priced from them
        for i in range(learned.MIN_MEASURED):
            tuning.store(p.replace(n=3 + i), [PerfResult("torch:native", "ok", time_ms=1.0 + i),
                                              PerfResult("direct:taps", "ok", time_ms=2.0 + i)])
    code, out, _ = run(capsys, "get", *SMALL, "--db", db, "--json")
    assert code == 0 and json.loads(out)["priced_from"].startswith("how each candidate ran on the 30 measured")


def test_a_command_that_reads_or_clears_refuses_a_missing_database_and_none_takes_over_a_file_that_is_not_one(
        capsys, tmp_path):
    missing = tmp_path / "typo" / "t.sqlite"
    # (cache clear made an empty database there and said it removed 0 results)
    for command in (["get", *SMALL], ["cache", "ls"], ["cache", "export", str(tmp_path / "out.jsonl")],
                    ["cache", "clear"]):
        code, _, err = run(capsys, *command, "--db", str(missing))
        assert code == 2 and f"--db {missing}: no such file, so no tuning database at {missing}" in err, (command, err)
    assert not missing.parent.exists()  # nothing made in its place
    script = tmp_path / "mine.py"
    script.write_text("print(1)\n")
    for command in (["cache", "ls"], ["find", *SMALL]):
        code, _, err = run(capsys, *command, "--db", str(script))
        assert code == 2 and f"--db {script}: TuningDB path {script} is not a tuning database (not a SQLite" in err
    assert script.read_text() == "print(1)\n" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.py"]
    # a tuning database whose header was damaged is the library's case too: moved aside, what still reads salvaged
    from convtune import ConvProblem, PerfResult, TuningDB

    damaged = tmp_path / "damaged.sqlite"
    with TuningDB(damaged) as db:
        db.store(ConvProblem("fwd", n=1, c=2, k=2, input_size=(5, 5), kernel_size=3),
                 [PerfResult("x", "ok", time_ms=1.0)])
    damaged.write_bytes(b"\0" * 100 + damaged.read_bytes()[100:])
    code, out, _ = run(capsys, "cache", "ls", "--db", str(damaged), "--json")
    assert code == 0 and len(json.loads(out)) == 1


def test_a_default_database_that_cannot_be_opened_is_named_by_its_own_path(capsys, tmp_path):
    (tmp_path / "afile").write_text("")
    with settings.override(cache_dir=str(tmp_path / "afile" / "sub")):  # a folder below a file
        code, _, err = run(capsys, "cache", "ls")
    assert code == 2 and "--db" not in err and str(tmp_path / "afile") in err


def test_find_measures_checks_and_stores(capsys, tmp_path):
    db = str(tmp_path / "t.sqlite")
    code, out, _ = run(capsys, "find", *SMALL, "--db", db, "--json")
    results = json.loads(out)["results"]
    assert code == 0 and results[0]["status"] == "ok" and results[0]["time_ms"] > 0
    assert all(r["rel_error"] is not None for r in results if r["status"] == "ok")
    code, out, _ = run(capsys, "cache", "ls", "--db", db, "--json")
    entries = json.loads(out)
    assert code == 0 and len(entries) == 1 and entries[0]["usable"]


def test_find_respects_a_workspace_limit(capsys):
    code, out, _ = run(capsys, "find", *SMALL, "--workspace-limit", "0", "--json")
    results = json.loads(out)["results"]
    assert code == 0
    assert all(r["workspace_bytes"] == 0 for r in results if r["status"] == "ok")
    assert any(r["status"] == "over_workspace_limit" for r in results)


def test_algorithms_lists_support_and_reasons(capsys):
    code, out, _ = run(capsys, "algorithms", *SMALL, "--stride", "2", "--json")
    rows = json.loads(out)
    assert code == 0
    assert any(r["supports"] for r in rows) and any(not r["supports"] and r["reason"] for r in rows)


def test_tune_a_network_prints_the_layer_table_and_totals(capsys, tmp_path):
    db = str(tmp_path / "t.sqlite")
    code, out, _ = run(capsys, "tune", "resnet18", "--batch", "1", "--layers", "2", "--device", "cpu", "--db", db)
    assert code == 0 and "L00" in out and "L01" in out and "total" in out
    code, out, _ = run(capsys, "tune", "resnet18", "--batch", "1", "--layers", "2", "--db", db, "--mode",
                       "db_then_get", "--json")
    rows = json.loads(out)["layers"]
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["time_ms"] for r in rows)  # answered from the db


def test_tune_a_layer_file(capsys, tmp_path):
    path = tmp_path / "layers.json"
    path.write_text(json.dumps({"layers": [{"c": 4, "k": 8, "spatial": [9, 9], "kernel": [3, 3], "padding": [1, 1],
                                            "count": 2}]}))
    code, out, _ = run(capsys, "tune", str(path), "--batch", "2", "--device", "cpu", "--mode", "get", "--json")
    rows = json.loads(out)["layers"]
    assert code == 0 and rows[0]["count"] == 2 and rows[0]["algorithm"]


def test_the_layer_file_of_the_docs_loads_and_empty_or_binary_files_are_refused_by_name(capsys, tmp_path):
    import re

    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    example = re.search(r"## Layer files.*?```json\n(.*?)```", text, re.S).group(1)
    path = tmp_path / "net.json"
    path.write_text(example)
    code, out, _ = run(capsys, "tune", str(path), "--batch", "2", "--device", "cpu", "--mode", "get", "--json")
    rows = json.loads(out)["layers"]
    assert code == 0 and [r["count"] for r in rows] == [1, 3]
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "header.csv").write_text("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h\n")
    (tmp_path / "noise.json").write_bytes(bytes(range(250, 256)) * 40)
    for name, words in (("empty.json", "holds no layers"), ("header.csv", "holds no layers"),
                        ("noise.json", "is not text (byte 0 is not UTF-8)")):
        code, _, err = run(capsys, "tune", str(tmp_path / name), "--batch", "2", "--mode", "get")
        assert code == 2 and f"layer file {tmp_path / name} {words}" in err, err


@pytest.mark.parametrize("text, words", [
    # a column DeepBench's format lacks was left out: groups=4 and dilation 2 tuned as a dense, undilated layer
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h,groups\n8,8,4,2,4,3,3,1,1,1,1,4\n",
     "the column 'groups' is not one of DeepBench's; the columns must be"),
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,strideh\n8,8,4,2,4,3,3,1,1,1,1\n",
     "the column 'strideh' is not one of DeepBench's (did you mean 'stride_h'?)"),
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w\n8,8,4,2,4,3,3,1,1,1\n", "lacks stride_h"),
    ("8,8,4,2,4,3,3,1,1,1,1\n", "the first row (8,8,4,2,4,3,3,1,1,1,1) is not a header"),
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h\n8,8,4,2,4,3,3,1,1,1\n",
     "row 1 has 10 cells, where the header names 11"),
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h\n8,8,4,2,4,3,3,1,1,1,x\n", "row 1 is not a valid convolution"),
    ("w,h,c,n,k,s,r,pad_w,pad_h,stride_w,stride_h\n8,8,4,2,4,3,3,1,1,1,1_0\n",  # it was read as 10
     "row 1 is not a valid convolution (ValueError: stride_h '1_0' is not a whole number"),
])
def test_a_csv_layer_file_that_is_not_deepbenchs_format_is_refused_by_what_is_wrong(capsys, tmp_path, text, words):
    path = tmp_path / "layers.csv"
    path.write_text(text)
    code, _, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get")
    assert code == 2 and words in err, err


def test_a_csv_layer_file_may_start_with_a_byte_order_mark_and_put_its_columns_in_any_order(capsys, tmp_path):
    path = tmp_path / "layers.csv"
    path.write_text("\ufeffn,c,k,h,w,r,s,pad_h,pad_w,stride_h,stride_w\n2,4,4,8,6,3,3,1,1,1,1\n", encoding="utf-8")
    code, out, _ = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["layers"][0]["problem"].startswith("fwd|n2|c4|k4|in8x6|r3x3|s1x1|p1x1")


def test_cache_export_import_clear_answer_in_json_when_asked(capsys, tmp_path):
    db, dump = str(tmp_path / "a.sqlite"), str(tmp_path / "dump.jsonl")
    assert run(capsys, "find", *SMALL, "--db", db)[0] == 0
    for action, path in (("export", dump), ("import", dump), ("clear", None)):
        code, out, _ = run(capsys, "cache", action, *([path] if path else []), "--db", db, "--json")
        answer = json.loads(out)
        assert code == 0 and answer["action"] == action and answer["results"] > 0 and answer["file"] == path


def test_a_default_database_that_cannot_be_opened_leaves_the_commands_it_is_a_means_for_running(capsys, tmp_path,
                                                                                                 caplog):
    # (a cache folder that cannot be made or written: get, find and tune go on with a temporary database, warned;
    # the cache commands, which act on the database itself, say why they cannot)
    (tmp_path / "file").write_text("")
    with settings.override(cache_dir=str(tmp_path / "file" / "cache")), caplog.at_level(logging.WARNING):
        for command in (("get", *SMALL), ("find", *SMALL)):
            assert run(capsys, *command)[0] == 0, command
        code, _, err = run(capsys, "cache", "ls")
    assert code == 2 and "cannot make the folder of the tuning database" in err
    assert "temporary database" in caplog.text


def test_cache_export_import_clear(capsys, tmp_path):
    db, other, dump = str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite"), str(tmp_path / "dump.jsonl")
    assert run(capsys, "find", *SMALL, "--db", db)[0] == 0
    code, out, _ = run(capsys, "cache", "export", dump, "--db", db)
    assert code == 0 and "exported" in out
    code, out, _ = run(capsys, "cache", "import", dump, "--db", other)
    assert code == 0 and "imported" in out
    code, out, _ = run(capsys, "cache", "ls", "--db", other, "--json")
    assert len(json.loads(out)) == 1
    code, out, _ = run(capsys, "cache", "clear", "--db", other)
    assert code == 0 and "removed" in out


def test_cache_commands_on_a_default_database_never_made_make_none(capsys, tmp_path):
    # (ls, export and clear made an empty database, and its folder, to show that it was empty)
    cache = tmp_path / "cache"
    with settings.override(cache_dir=str(cache)):
        code, out, _ = run(capsys, "cache", "ls")
        assert code == 0 and "no tuning database at" in out and "yet" in out
        assert run(capsys, "cache", "ls", "--json")[:2] == (0, "[]\n")
        code, out, _ = run(capsys, "cache", "clear", "--json")
        assert code == 0 and json.loads(out)["results"] == 0
        code, _, err = run(capsys, "cache", "export", str(tmp_path / "dump.jsonl"))
        assert code == 2 and "nothing to export" in err and not (tmp_path / "dump.jsonl").exists()
        assert not cache.exists()
        assert run(capsys, "find", *SMALL)[0] == 0  # a tuning command makes it
        code, out, _ = run(capsys, "cache", "ls", "--json")
        assert code == 0 and len(json.loads(out)) == 1


def test_cache_guards_what_a_mistyped_command_would_lose(capsys, tmp_path):
    db, other = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    assert run(capsys, "find", *SMALL, "--db", str(db))[0] == 0
    other.write_bytes(db.read_bytes())
    # 'cache clear FILE' names no database: refused, neither file touched (it once cleared the default database)
    for action in ("clear", "ls"):
        code, _, err = run(capsys, "cache", action, str(other), "--db", str(db))
        assert code == 2 and f"convtune cache {action} --db {other}" in err, err
    # an export over a database (its own, another one) or over a read-only file is refused
    for target in (db, other, db.with_name(db.name + "-wal")):  # (its write-ahead log too)
        code, _, err = run(capsys, "cache", "export", str(target), "--db", str(db))
        assert code == 2 and "is a SQLite database" in err, err
    locked = tmp_path / "kept.jsonl"
    locked.write_text("mine")
    locked.chmod(0o444)
    code, _, err = run(capsys, "cache", "export", str(locked), "--db", str(db))
    assert code == 2 and f"{locked} is read-only" in err and locked.read_text() == "mine", err
    for path in (db, other):
        code, out, _ = run(capsys, "cache", "ls", "--db", str(path), "--json")
        assert code == 0 and len(json.loads(out)) == 1


def test_cache_import_of_a_folder_or_of_no_file_says_what_to_give(capsys, tmp_path):
    # (a folder was "[Errno 21] Is a directory", a missing file "[Errno 2] No such file or directory", and the
    # database named by --db was made first)
    db = tmp_path / "new.sqlite"
    for source, what in ((tmp_path, "a folder"), (tmp_path / "typo.jsonl", "no file")):
        code, _, err = run(capsys, "cache", "import", str(source), "--db", str(db))
        assert code == 2 and f"{source} is {what}, not an export file; give a file that `convtune cache export`" \
            in " ".join(err.split()), err
    assert not db.exists()


def test_a_layer_files_misspelled_field_is_refused_with_the_field_it_meant(capsys, tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps([{"c": 2, "k": 2, "spatial": [6, 6], "kernel": 3, "pad": 1}]))
    code, _, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get")
    assert code == 2 and "layer 0 has the field 'pad'" in err and "did you mean 'padding'?" in err, err


def test_a_layer_files_transposed_field_takes_true_or_false_only(capsys, tmp_path):
    # ("no" and "false" were refused as transposed convolutions, 0 and null taken as false)
    path = tmp_path / "layers.json"
    for value in ("no", "false", 0, 1, None):
        path.write_text(json.dumps([{"c": 2, "k": 2, "spatial": [6, 6], "kernel": 3, "transposed": value}]))
        code, _, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu")
        assert code == 2 and f"layer 0 has transposed {value!r}; transposed is true or false" in err, err
    path.write_text(json.dumps([{"c": 2, "k": 2, "spatial": [6, 6], "kernel": 3, "transposed": True}]))
    code, _, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu")
    assert code == 2 and "transposed convolutions are not supported" in err, err
    path.write_text(json.dumps([{"c": 2, "k": 2, "spatial": [6, 6], "kernel": 3, "transposed": False}]))
    assert run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu")[0] == 0


def test_train_get_refuses_an_output_it_cannot_write_before_building(capsys, tmp_path, monkeypatch):
    from convtune import learned

    db = tmp_path / "a.sqlite"
    assert run(capsys, "find", *SMALL, "--db", str(db))[0] == 0
    blocker = tmp_path / "file"
    blocker.write_text("x")
    kept = tmp_path / "kept.pt"
    kept.write_text("mine")
    kept.chmod(0o444)
    built = []
    train = learned.train
    monkeypatch.setattr(learned, "train", lambda *args: built.append(args) or train(*args))
    for out in (blocker / "model.pt", tmp_path, kept):
        code, stdout, err = run(capsys, "train-get", "--device", "cpu", "--db", str(db), "--out", str(out))
        assert code == 2 and str(out) in err and "internal error" not in err and not stdout, err
    assert not built and kept.read_text() == "mine"  # refused before the model was built
    deeper = tmp_path / "missing" / "deeper" / "model.pt"  # missing folders are made, as for the default path
    code, _, err = run(capsys, "train-get", "--device", "cpu", "--db", str(db), "--out", str(deeper))
    assert code == 0 and deeper.exists() and built, err


def test_an_export_to_standard_output_through_a_pipe(capsys, tmp_path):
    import os
    import subprocess
    import sys

    db = tmp_path / "a.sqlite"
    assert run(capsys, "find", *SMALL, "--db", str(db))[0] == 0
    out = subprocess.run([sys.executable, "-m", "convtune.cli", "cache", "export", "/dev/stdout", "--db", str(db)],
                         env={**os.environ, "CONVTUNE_CACHE_DIR": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert sum(line.startswith("{") for line in out.stdout.splitlines()) >= 1


@pytest.mark.parametrize("argv, words", [
    (["get", "--c", "8", "--k", "8"], "required"),
    (["get", *SMALL, "--dtype", "float64"], "float64"),
    (["get", *SMALL[:-2], "--device", "cuda"], "CUDA"),
    (["find", *SMALL, "--workspace-limit", "lots"], "lots"),
    (["find", *SMALL, "--workspace-limit", "-64MiB"], "--workspace-limit: -64MiB is negative"),
    (["tune", "resnet18", "--workspace-budget", "-5MiB"], "--workspace-budget: -5MiB is negative"),
    (["find", *SMALL, "--workspace-lim", "-0.5"], "--workspace-limit: -0.5 is negative"),  # abbreviated too
    (["report", "resnet18", "--workspace-budget", "1MiB", "--budgets", "-1MiB,0"], "-1MiB is negative"),
    (["report", "resnet18", "--workspace-budget", "1MiB", "--budgets", "0,1MiB,xx"], "'xx' is not a size"),
    (["find", *SMALL, "--workspace-limit", "\uff16\uff14MiB"], "'\uff16\uff14MiB' is not a size"),  # read as 64MiB
    (["get", "--c", "8", "--k", "8", "--size", "10x10", "--kernel", "3x3x3"], "kernel_size"),
    (["get", "--c", "8", "--k", "8", "--size", "ten"], "--size"),
    (["get", "--c", "8", "--k", "8", "--size", "5_5"], "--size '5_5' is not a size"),  # it was read as 55
    (["get", "--c", "1_6", "--k", "8", "--size", "8x8"], "--c: '1_6' is not a whole number"),  # read as 16
    (["tune", "resnet18", "--batch", "3_2"], "--batch: '3_2' is not a whole number"),  # read as 32
    (["tune", "alexnet"], "alexnet"),
    (["tune", "resnet50", "--batch", "0"], "--batch"),
    (["cache", "export"], "path"),
    (["cache", "import", "/nonexistent/file.jsonl"], "nonexistent"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err


def test_a_bad_workspace_budget_is_refused_before_anything_is_tuned(capsys, tmp_path):
    db = tmp_path / "t.sqlite"
    code, _, err = run(capsys, "tune", "resnet18", "--batch", "1", "--device", "cpu", "--db", str(db),
                       "--workspace-budget", "lots")
    assert code == 2 and "--workspace-budget: 'lots' is not a size" in err and len(err.strip().splitlines()) == 1
    assert not db.exists()  # refused while the arguments were read: no layer was tuned, no database opened


def test_settings_lists_every_setting(capsys):
    code, out, _ = run(capsys, "settings")
    assert code == 0 and "CONVTUNE_CACHE_DIR" in out


def test_find_with_micro_batching_offers_a_split_under_a_tight_limit(capsys):
    # im2col's column matrix for n=4 is 4x its n=1 size: a limit between the two leaves only splits for it.
    problem = ["--n", "4", "--c", "4", "--k", "4", "--size", "8x8", "--kernel", "3", "--pad", "1", "--device", "cpu"]
    from convtune import ConvProblem, get_algorithm

    p = ConvProblem("fwd", n=4, c=4, k=4, input_size=(8, 8), kernel_size=3, padding=1)
    limit = str(get_algorithm("gemm:im2col").buffer_bytes(p.replace(n=1)))
    code, out, _ = run(capsys, "find", *problem, "--workspace-limit", limit, "--micro-batching", "--json")
    names = [r["algorithm"] for r in json.loads(out)["results"]]
    assert code == 0 and any(n.startswith("mb:") for n in names)
    code, out, _ = run(capsys, "find", *problem, "--workspace-limit", limit, "--json")
    assert not any(r["algorithm"].startswith("mb:") for r in json.loads(out)["results"])


def test_a_budget_in_a_mode_that_never_measures_asks_for_measurements_first(capsys, tmp_path):
    db = str(tmp_path / "t.sqlite")
    code, out, err = run(capsys, "tune", "resnet18", "--batch", "1", "--layers", "1", "--device", "cpu", "--db", db,
                         "--mode", "db_then_get", "--workspace-budget", "1MiB")
    assert code == 2 and "--mode hybrid" in err and len(err.strip().splitlines()) == 1
    assert run(capsys, "tune", "resnet18", "--batch", "1", "--layers", "1", "--device", "cpu", "--db", db,
               "--workspace-budget", "1MiB")[0] == 0
    code, out, err = run(capsys, "tune", "resnet18", "--batch", "1", "--layers", "1", "--device", "cpu", "--db", db,
                         "--mode", "db_then_get", "--workspace-budget", "1MiB")
    assert code == 0


@pytest.mark.parametrize("case", ["db_folder", "db_device", "deep_json", "layer_not_object", "negative_layers",
                                  "zero_count"])
def test_bad_input_gets_one_line_and_status_2_never_an_internal_error(capsys, tmp_path, case):
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    layer_file = tmp_path / "layers.json"
    layer_file.write_text("[1]")
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"layers": [{"c": 4, "k": 4, "spatial": [6, 6], "kernel": [1, 1], "count": 0}]}))
    argv = {"db_folder": ["cache", "ls", "--db", str(tmp_path)],
            "db_device": ["cache", "ls", "--db", "/dev/null"],
            "deep_json": ["cache", "import", str(deep), "--db", str(tmp_path / "t.sqlite")],
            "layer_not_object": ["tune", str(layer_file)],
            "negative_layers": ["tune", "resnet18", "--layers", "-1"],
            "zero_count": ["tune", str(zero), "--device", "cpu"]}[case]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "internal error" not in err and err.strip(), err


def test_a_layer_count_too_large_to_plan_is_refused_before_anything_is_tuned(capsys, tmp_path):
    # A plan lists every run of every layer: a count of 10**23 made tune --workspace-budget and report build that list
    # until the process was killed for its memory.
    from convtune.network import MAX_PLANNED_RUNS

    path, db = tmp_path / "layers.json", tmp_path / "t.sqlite"
    path.write_text(json.dumps([{"c": 4, "k": 4, "spatial": [6, 6], "kernel": 3, "count": MAX_PLANNED_RUNS},
                                {"c": 4, "k": 8, "spatial": [6, 6], "kernel": 1}]))
    for command in (["tune", "--workspace-budget", "1MiB"], ["report", "--workspace-budget", "1MiB", "--out",
                                                             str(tmp_path / "r.html")]):
        code, _, err = run(capsys, command[0], str(path), *command[1:], "--batch", "1", "--device", "cpu", "--db",
                           str(db))
        assert code == 2 and f"run {MAX_PLANNED_RUNS + 1} times in all" in err and "internal error" not in err, err
    assert not db.exists()  # refused while the layers were read: nothing tuned
    code, out, _ = run(capsys, "tune", str(path), "--batch", "1", "--device", "cpu", "--mode", "get", "--json")
    assert code == 0 and json.loads(out)["layers"][0]["count"] == MAX_PLANNED_RUNS  # no plan: a count only weighs


def test_an_empty_out_path_is_refused_by_name_before_anything_is_built(capsys, tmp_path, monkeypatch):
    # train-get --out "" (a variable left unset) wrote the model to the default path, where get then used it; report
    # --out "" tuned the network, then failed with "PosixPath('.') has an empty name".
    from convtune import learned

    db = tmp_path / "a.sqlite"
    assert run(capsys, "find", *SMALL, "--db", str(db))[0] == 0
    monkeypatch.setattr(learned, "default_path", lambda device: tmp_path / "default.pt")
    code, _, err = run(capsys, "train-get", "--device", "cpu", "--db", str(db), "--out", "")
    assert code == 2 and "--out '' is an empty path" in err and not (tmp_path / "default.pt").exists(), err
    fresh = tmp_path / "fresh.sqlite"
    code, _, err = run(capsys, "report", "resnet18", "--layers", "1", "--batch", "1", "--device", "cpu",
                       "--workspace-budget", "1GiB", "--out", "", "--db", str(fresh))
    assert code == 2 and "--out '' is an empty path" in err and not fresh.exists(), err


def test_a_json_layer_file_may_start_with_a_byte_order_mark_and_may_not_give_a_field_twice(capsys, tmp_path):
    # A BOM was refused with Python's advice ("decode using utf-8-sig"), where a CSV file's is read; a field given
    # twice took its last value, and another layer was tuned than one of them meant.
    path = tmp_path / "layers.json"
    path.write_text('\ufeff[{"c": 4, "k": 4, "spatial": [6, 6], "kernel": 3}]', encoding="utf-8")
    code, out, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["layers"][0]["problem"].startswith("fwd|n2|c4|k4|in6x6|r3x3"), err
    path.write_text('{"layers": [{"c": 4, "k": 4, "spatial": [6, 6], "kernel": 3, "c": 8}]}')
    code, _, err = run(capsys, "tune", str(path), "--batch", "2", "--mode", "get", "--device", "cpu")
    assert code == 2 and f"layer file {path} gives the field 'c' twice in one object (the one with c=4, k=4, " \
        f"spatial=[6, 6], kernel=3, c=8)" in err, err  # which layer: its fields
