"""train.compilation_cache_dir: on by default, one cache per machine under the user's cache
directory ($XDG_CACHE_HOME, else ~/.cache), shared by every run (so a second run in another
workdir loads what the first compiled); the environment's cache wins over the default;
"off" disables it. Each probe points XDG_CACHE_HOME and HOME into tmp_path: nothing is
written to the real user cache."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBE = """
import sys, jax
from mmjax.train.run_files import use_compilation_cache
print(use_compilation_cache(sys.argv[1]))
jax.jit(lambda x: x * 3 + 1)(1.0).block_until_ready()
"""


def _probe(tmp_path, setting, env_cache=None, xdg=True):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["HOME"] = str(tmp_path / "home")
    if xdg:
        env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    if env_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = env_cache
    r = subprocess.run([sys.executable, "-c", _PROBE, setting], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_default_cache_is_the_machines_and_fills(tmp_path):
    path = _probe(tmp_path, "")
    assert path == str(tmp_path / "xdg" / "mmjax" / "jax-compilation")
    assert os.listdir(path)  # the compiled program was written
    # without XDG_CACHE_HOME: ~/.cache
    assert _probe(tmp_path, "", xdg=False) == str(
        tmp_path / "home" / ".cache" / "mmjax" / "jax-compilation")


def test_environment_cache_wins_over_the_default_and_off_disables(tmp_path):
    env_dir = str(tmp_path / "env_cache")
    assert _probe(tmp_path, "", env_cache=env_dir) == env_dir
    assert os.listdir(env_dir)
    assert not os.path.exists(tmp_path / "xdg")
    assert _probe(tmp_path, "off") == "None"
    assert _probe(tmp_path, str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert not os.path.exists(tmp_path / "xdg")


def test_bad_value_is_a_user_error():
    from mmjax.errors import UserError
    from mmjax.train.run_files import use_compilation_cache

    with pytest.raises(UserError, match="train.compilation_cache_dir"):
        use_compilation_cache(3)
