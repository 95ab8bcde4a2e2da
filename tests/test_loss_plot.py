"""DIR/loss.png plots the metrics the run logged: every loss curve and the learning rate,
read back from the figure's lines (train/loss_plot.py, scripts/plot_metrics.py)."""
import importlib.util
import json
import os

import pytest

from mmjax.train.loss_plot import figure, plot_workdir, read_metrics

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


def _rows():
    rows = [{"step": s, "loss": 7.0 - 0.1 * s, "lm_loss": 6.0 - 0.1 * s,
             "diffusion_loss": 1.0, "learning_rate": 1e-3 * s} for s in range(1, 11)]
    rows[4]["eval_loss"], rows[9]["eval_loss"] = 6.5, 6.1
    return rows


def _write(workdir, rows):
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_the_figure_holds_exactly_the_logged_metrics(tmp_path):
    rows = _rows()
    _write(tmp_path, rows)
    fig = figure({"run": read_metrics(str(tmp_path))})
    ax, lr = fig.axes
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
    assert set(lines) == {"loss", "lm_loss", "diffusion_loss", "eval_loss"}
    for key in ("loss", "lm_loss", "diffusion_loss"):
        assert lines[key] == ([r["step"] for r in rows], [r[key] for r in rows])
    assert lines["eval_loss"] == ([5, 10], [6.5, 6.1])
    (x, y), = [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in lr.lines]
    assert y == pytest.approx([r["learning_rate"] for r in rows]) and x == list(range(1, 11))
    assert plot_workdir(str(tmp_path)) == 10
    assert os.path.getsize(tmp_path / "loss.png") > 5000


def test_no_generator_no_diffusion_curve_and_several_runs_side_by_side(tmp_path, capsys):
    a = [{**r, "diffusion_loss": 0.0} for r in _rows()]
    fig = figure({"a": a, "b": _rows()})
    labels = {ln.get_label() for ln in fig.axes[0].lines}
    assert "a: diffusion_loss" not in labels and "b: diffusion_loss" in labels
    _write(tmp_path / "a", a)
    _write(tmp_path / "b", _rows())
    spec = importlib.util.spec_from_file_location(
        "plot_metrics", os.path.join(REPO, "scripts", "plot_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = str(tmp_path / "both.png")
    assert mod.main([str(tmp_path / "a"), str(tmp_path / "b"), f"--out={out}"]) == 0
    assert os.path.getsize(out) > 5000 and f"wrote {out}" in capsys.readouterr().out
    from mmjax.errors import UserError
    with pytest.raises(UserError, match="no metrics.jsonl"):
        mod.main([str(tmp_path / "none")])


def test_steps_without_a_generated_image_are_no_diffusion_points(tmp_path):
    """diffusion_loss is 0.0 on a step with no generated image: not plotted (no saw-tooth
    down to 0), the steps with one are."""
    rows = _rows()
    for r in rows[1::3]:
        r["diffusion_loss"] = 0.0
    fig = figure({"run": rows})
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_label() == "diffusion_loss"]
    kept = [r["step"] for r in rows if r["diffusion_loss"] != 0.0]
    assert list(line.get_xdata()) == kept and len(kept) == 7
    assert all(y == 1.0 for y in line.get_ydata())


def test_plot_metrics_never_writes_over_the_runs_own_loss_png(tmp_path, capsys):
    from helpers import load_script
    from mmjax.errors import UserError

    _write(tmp_path, _rows())
    (tmp_path / "loss.png").write_bytes(b"the run's own")
    mod = load_script("plot_metrics")
    assert mod.main([str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").read_bytes() == b"the run's own"
    assert os.path.getsize(tmp_path / "loss_curves.png") > 5000
    with pytest.raises(UserError, match="the run's own loss.png"):
        mod.main([str(tmp_path), f"--out={tmp_path / 'loss.png'}"])
