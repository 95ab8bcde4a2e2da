"""train.compilation_cache_dir: on by default under the workdir, so a resume loads its
programs; the environment's cache wins over the default; "off" disables it."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PROBE = """
import sys, jax
from mmjax.train.run_files import use_compilation_cache
print(use_compilation_cache(sys.argv[1], sys.argv[2]))
jax.jit(lambda x: x * 3 + 1)(1.0).block_until_ready()
"""


def _probe(tmp_path, setting, env_cache=None):
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    if env_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = env_cache
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "run"), setting],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_default_cache_under_the_workdir_fills(tmp_path):
    path = _probe(tmp_path, "")
    assert path == str(tmp_path / "run" / "compilation_cache")
    assert os.listdir(path)  # the compiled program was written


def test_environment_cache_wins_over_the_default_and_off_disables(tmp_path):
    env_dir = str(tmp_path / "env_cache")
    assert _probe(tmp_path, "", env_cache=env_dir) == env_dir
    assert not os.path.exists(tmp_path / "run" / "compilation_cache")
    assert _probe(tmp_path, "off") == "None"
    assert not os.path.exists(tmp_path / "run" / "compilation_cache")


def test_bad_value_is_a_user_error(tmp_path):
    from mmjax.errors import UserError
    from mmjax.train.run_files import use_compilation_cache

    with pytest.raises(UserError, match="train.compilation_cache_dir"):
        use_compilation_cache(str(tmp_path), 3)
