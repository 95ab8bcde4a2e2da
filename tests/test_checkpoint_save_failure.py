"""A checkpoint that cannot be written (issue 43 item 1): the run stops at once in one line
naming the directory and the space needed, the earlier checkpoints stay, the unfinished
save's temporary directory goes, and the next run resumes from the newest good one. The
write failure is injected (too little free space; a file-size limit in a child process, so
the background write itself fails) or real (a small tmpfs, root only)."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.train.checkpoint import Checkpointer
from mmjax.train.checkpoint_space import MB, SaveFailed, needed_bytes, write_failure_reason

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIKE = {"w": jnp.zeros((1 << 18,), jnp.float32), "step": jnp.zeros((), jnp.int32)}


def state_at(step):
    return {"w": jnp.full((1 << 18,), step, jnp.float32), "step": jnp.asarray(step, jnp.int32)}


def test_too_little_free_space_stops_before_writing_and_keeps_the_earlier_checkpoint(tmp_path):
    d = str(tmp_path / "ck")
    free = {"bytes": 100 * MB}
    ck = Checkpointer(d, free_space=lambda _: free["bytes"])
    ck.save(2, state_at(2), {"next": 2})
    ck.wait()
    free["bytes"] = MB  # the state is 1 MB: with orbax's files it needs about 1.3 MB
    with pytest.raises(SaveFailed) as e:
        ck.save(4, state_at(4), {"next": 4})
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot write checkpoint step 4 to {d}: not enough free space "
                          f"(1.0 MB free there, a checkpoint needs about 1.3 MB;")
    assert needed_bytes((1 << 18) * 4 + 4) == int(((1 << 18) * 4 + 4) * 1.05) + MB // 4
    ck.close()
    assert sorted(os.listdir(d)) == ["2"]
    step, state, data = Checkpointer(d).restore_latest(LIKE)
    assert step == 2 and data == {"next": 2}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((1 << 18,), 2, np.float32))


CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    import jax.numpy as jnp
    import numpy as np
    from mmjax.train.checkpoint import Checkpointer
    from mmjax.train.checkpoint_space import SaveFailed
    d = sys.argv[1]
    ck = Checkpointer(d)
    ck.save(2, {"w": jnp.full((1 << 10,), 2.0)}, {"next": 2})
    ck.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(
        resource.RLIMIT_FSIZE)[1]))
    rand = np.random.default_rng(0).standard_normal(1 << 18, np.float32)  # incompressible
    ck.save(4, {"w": jnp.asarray(rand)}, {"next": 4})
    try:
        ck.wait()
        out = {"error": None}
    except SaveFailed as e:
        out = {"error": str(e)}
    ck.close()
    out["left"] = sorted(os.listdir(d))
    print(json.dumps(out))
""")


def test_a_write_failing_in_the_background_is_one_line_and_leaves_no_temporary(tmp_path):
    d = str(tmp_path / "ck")
    env = {**os.environ, "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, "-c", CHILD, d], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["left"] == ["2"]  # the earlier checkpoint, no <step>.orbax-checkpoint-tmp
    assert out["error"].startswith(f"cannot write checkpoint step 4 to {d}: a file is larger "
                                   f"than allowed ("), out["error"]
    assert "Traceback" not in p.stderr and "ERROR:absl" not in p.stderr, p.stderr[-3000:]


def test_write_failure_reasons_name_the_os_error():
    tensorstore = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "leaf_00321/0.0" in OCDBT database at local file '
        '"/w/checkpoints/4.orbax-checkpoint-tmp/state": Failed to write 698306 bytes to file '
        "18: No space left on device [os_error_code='28']")
    assert write_failure_reason(tensorstore) == "the disk is full"
    assert write_failure_reason(OSError(122, "Disk quota exceeded")) == \
        "the disk quota is exceeded"
    assert write_failure_reason(PermissionError(13, "Permission denied")) == "permission denied"
    assert write_failure_reason(RuntimeError("odd")) == "RuntimeError: odd"


def _tmpfs(path, size) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_full_disk_stops_the_run_in_one_line_and_the_next_run_resumes(tmp_path):
    """The issue's case: an 8 MB tmpfs as the workdir, 8 steps, a checkpoint every 2
    (3.7 MB each). The first checkpoints fit, a later one does not: the run stops at that
    step in one line (exit 1), the earlier checkpoints stay, no temporary directory; with
    room, a rerun resumes from the newest and finishes, every step in metrics.jsonl once."""
    mnt = tmp_path / "small"
    if not _tmpfs(mnt, "8m"):
        pytest.skip("needs root to mount a tmpfs")
    try:
        work = mnt / "run"
        env = {**os.environ, "PYTHONPATH": REPO}
        cmd = [sys.executable, os.path.join(REPO, "scripts", "train.py"), f"--workdir={work}",
               "--gin_param=train.steps=8", "--gin_param=train.checkpoint_every=2",
               "--gin_param=train.progress=False",
               f"--gin_param=train.compilation_cache_dir='{tmp_path / 'cache'}'"]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 1, p.stderr[-3000:]
        assert "Traceback" not in p.stderr and "ERROR" not in p.stderr, p.stderr[-3000:]
        err = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
        m = re.fullmatch(rf"error: cannot write checkpoint step (\d) to {work}/checkpoints: "
                         rf"not enough free space \(.* MB free there, a checkpoint needs "
                         rf"about .* MB; .*\); last good checkpoint: step (\d) in "
                         rf"{work}/checkpoints", err[0]) if len(err) == 1 else None
        assert m and int(m.group(2)) == int(m.group(1)) - 2, p.stderr[-3000:]
        good = int(m.group(2))
        assert sorted(os.listdir(work / "checkpoints")) == [str(s) for s in range(2, good + 1, 2)]
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        assert f"resumed from {work}/checkpoints step {good}" in p.stdout + p.stderr
        steps = [json.loads(ln)["step"] for ln in open(work / "metrics.jsonl")]
        assert steps == list(range(1, 9))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
