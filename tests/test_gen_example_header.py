"""configs/examples/llava_gen_tiny.gin's header commands run as written (make the data,
train, generate --output_image) and draw a recognisable red square."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIN = os.path.join(REPO, "configs", "examples", "llava_gen_tiny.gin")

# The training pictures (mmjax/data/example_data.py `_picture`): a red (220, 40, 30) square
# over the middle half of each side, on a grey (110, 110, 110) ground. A drawing is judged
# at the midpoints between the two colours: inside the square red above grey (R > 165 =
# (220 + 110) / 2, G and B < 75 ~ (110 + 40) / 2), red leading by over half of the square's
# lead of 180 (R - max(G, B) > 90); on the ground not red-led past that midpoint.
RED, GROUND = np.array([220, 40, 30]), 110.0


def header_commands(path: str = GIN) -> list[str]:
    """The shell commands of a config's header comment (`#   cmd`, `\\` continues)."""
    cmds, cur = [], ""
    for line in open(path):
        if not line.startswith("#   "):
            continue
        text = line[4:].strip()
        cur += (" " if cur else "") + text.rstrip("\\").strip()
        if not text.endswith("\\"):
            cmds.append(cur)
            cur = ""
    return cmds


def test_the_header_has_the_three_steps():
    cmds = header_commands()
    assert [re.match(r"python (\S+)", c).group(1) for c in cmds] == [
        "scripts/make_example_data.py", "scripts/train.py", "scripts/generate.py"]
    assert "--output_image=red_square.png" in cmds[-1] and "--image" not in cmds[-1]


def red_square_verdict(pixels: np.ndarray) -> dict:
    """Mean colour inside the square (the middle half) and on the ground (the outer
    quarter ring) of an [S, S, 3] picture, and whether it is a red square on grey."""
    s = pixels.shape[0]
    q = s // 4
    inside = pixels[q:s - q, q:s - q].reshape(-1, 3).mean(0)
    ring = np.ones((s, s), bool)
    ring[q:s - q, q:s - q] = False
    ground = pixels[ring].mean(0)
    lead = lambda c: c[0] - max(c[1], c[2])
    ok = (inside[0] > (RED[0] + GROUND) / 2 and max(inside[1], inside[2]) < (RED[1] + GROUND) / 2
          and lead(inside) > lead(RED) / 2 and lead(ground) < lead(RED) / 2)
    return {"inside": inside.round(1).tolist(), "ground": ground.round(1).tolist(), "ok": ok}


def test_the_verdict_tells_a_red_square_from_other_pictures():
    from PIL import Image

    from mmjax.data.example_data import _picture
    from mmjax.train.vae_latents import square_pixels

    rng = np.random.default_rng(0)
    as16 = lambda a: (square_pixels(Image.fromarray(a), 16) + 1) * 127.5
    assert red_square_verdict(as16(_picture(rng, 32, 32, "red", "square")))["ok"]
    for colour, shape in (("red", "stripe"), ("green", "square"), ("purple", "square")):
        assert not red_square_verdict(as16(_picture(rng, 32, 32, colour, shape)))["ok"]
    assert not red_square_verdict(np.full((16, 16, 3), [220, 40, 30], np.float64))["ok"]


@pytest.mark.slow
def test_header_commands_run_as_written_and_draw_a_red_square(tmp_path):
    from PIL import Image

    for d in ("scripts", "configs"):
        os.symlink(os.path.join(REPO, d), tmp_path / d)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("XLA_FLAGS", None)
    for cmd in header_commands():
        p = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=1500)
        assert p.returncode == 0, f"{cmd}\n{p.stdout[-1500:]}\n{p.stderr[-3000:]}"
    with Image.open(tmp_path / "red_square.png") as im:
        assert im.format == "PNG" and im.mode == "RGB" and im.size == (16, 16)
        verdict = red_square_verdict(np.asarray(im, np.float64))
    assert verdict["ok"], verdict
