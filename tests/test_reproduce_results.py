"""scripts/reproduce_results.py: every row of the README's results table has a reproducer
whose pattern reads the README's figures (so the README and the script cannot drift apart),
CPU rows are rerun and GPU rows listed, and the quick mode prints and writes the table."""
import json
import re

import pytest
from helpers import load_script

REPRO = load_script("reproduce_results")  # puts scripts/ on sys.path
import results_readme  # noqa: E402
from results_rows import ROWS  # noqa: E402


def test_every_readme_row_has_exactly_one_reproducer():
    table = results_readme.results_table()
    assert len(table) >= 10
    assert list(table) == [r.what for r in ROWS]  # same rows, same order
    assert len({r.key for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[r.key for r in ROWS])
def test_the_figures_parsed_from_the_readme_are_the_readme_text(row):
    figure, machine = results_readme.results_table()[row.what]
    numbers = results_readme.figures(row.pattern, figure)
    assert len(numbers) == len(row.labels)
    # each figure, as written, stands in the README's cell in the pattern's order
    written = re.search(row.pattern, figure).groups()
    assert [float(w.replace(",", "")) for w in written] == numbers
    pos = 0
    for w in written:
        pos = figure.index(w, pos) + len(w)
    with open(results_readme.README) as f:
        assert f"| {row.what} | {figure} | {machine} |" in f.read()
    # a row the README measures on a CPU is rerun; a GPU-only row is listed
    assert (row.measure is not None) == ("CPU" in machine), (row.key, machine)


def test_the_figures_follow_a_changed_readme(tmp_path):
    """The comparison reads the README, not a copy: a changed figure is what is compared."""
    with open(results_readme.README) as f:
        text = f.read()
    row = next(r for r in ROWS if r.key == "fuzz")
    figure = results_readme.results_table()[row.what][0]
    changed = tmp_path / "README.md"
    changed.write_text(text.replace(figure, figure.replace("0 hangs", "3 hangs")))
    assert results_readme.figures(row.pattern, results_readme.results_table(
        str(changed))[row.what][0]) == [0, 0, 3]
    changed.write_text(text.replace(figure, "no traceback"))
    with pytest.raises(ValueError, match="does not match"):
        results_readme.figures(row.pattern, results_readme.results_table(
            str(changed))[row.what][0])


def test_quick_run_reruns_cpu_rows_and_lists_gpu_rows(tmp_path, capsys):
    out = tmp_path / "repro.json"
    rc = REPRO.main(["--cpu", "--quick", "--rows=reorder,fuzz,attention", f"--json={out}"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["quick"] is True and res["machine"]["cores"] >= 1
    by = {r["key"]: r for r in res["rows"]}
    assert list(by) == ["reorder", "attention", "fuzz"]  # the README's order
    table = results_readme.results_table()
    for r in res["rows"]:
        row = next(x for x in ROWS if x.key == r["key"])
        assert r["readme_figure"] == table[row.what][0]
        assert r["readme_numbers"] == results_readme.figures(row.pattern, r["readme_figure"])
        assert r["labels"] == list(row.labels) and r["command"] == row.command
    assert by["attention"]["status"] == "GPU row, not rerun"
    assert by["attention"]["measured"] is None
    reorder, fuzz = by["reorder"], by["fuzz"]
    assert reorder["status"] == fuzz["status"] == "measured"
    local_search, alg3 = reorder["measured"]
    assert 1.0 <= local_search <= alg3  # the optimum is the least; local search starts at Alg. 3
    assert reorder["detail"]["cases"] == 10  # quick: one trial of each of the 10 shapes
    assert local_search <= reorder["detail"]["inter_reorder_worst"]
    assert fuzz["measured"] == [0, 0, 0] and fuzz["detail"]["mutations"] == 40
    assert sum(v for k, v in fuzz["detail"]["counts"].items()
               if k != "workdir left by a refused run") == 40
    printed = capsys.readouterr().out
    for r in res["rows"]:
        assert r["command"].split()[1] in printed  # each row's script is named
    assert "GPU row, not rerun" in printed
    assert "inter_reorder / optimum" in printed


@pytest.mark.parametrize("argv,says", [(["--cpu", "--rows=reorder,nope"], "unknown --rows nope"),
                                        (["--rows=reorder"], "nothing to rerun (pass --cpu")])
def test_user_errors_are_one_line(argv, says, capsys):
    assert REPRO.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {says}")
