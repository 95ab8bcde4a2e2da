"""launch_local's output filter: gloo connection chatter and absl info/warning lines go,
everything else (including lines gloo's text landed inside) stays."""
import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("launch_local_cli",
                                               os.path.join(REPO, "scripts", "launch_local.py"))
launch_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch_local)

GLOO = "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"


def test_noise_is_dropped_and_output_kept():
    q = launch_local.quiet
    assert q(GLOO) is None
    assert q("step 3/30  loss 6.8312" + GLOO) == "step 3/30  loss 6.8312"  # cut mid-line
    assert q(GLOO + "done: 3 steps") == "done: 3 steps"
    assert q("I0000 00:00:1732400000.123456   12345 coordination_service.cc:123] hello") is None
    assert q("W1123 21:50:01.000001  777 pjrt_client.cc:9] slow") is None
    assert q("WARNING: All log messages before absl::InitializeLog() is called are written "
             "to STDERR") is None
    # errors and the program's own lines, blank ones included, stay
    e = "E1123 21:50:01.000001  777 coordination_service.cc:9] peer lost"
    assert q(e) == e
    assert q("") == "" and q("error: bad setting (fix it)") == "error: bad setting (fix it)"
