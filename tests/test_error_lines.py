"""Issue 43's smaller items: a range error names both bounds, a huge value is not echoed
whole, an over-long compilation_cache_dir is refused before the cache fails silently, and
an exception out of a gin configurable is reported by its own first line (not gin's
"In call to configurable ..." wrapper)."""
import os

import gin
import pytest

from mmjax.errors import UserError, first_line, shown
from mmjax.settings import _int, check
from mmjax.train.preemption import Preempted
from mmjax.train.run_files import use_compilation_cache
from mmjax.train.run_spec import RunSpec


def test_a_value_above_the_int_range_names_the_upper_bound():
    with pytest.raises(UserError) as e:
        check("train.steps", 10 ** 12, _int(30, 1))
    assert str(e.value) == ("train.steps=1000000000000: must be an int >= 1 and <= "
                            "2,147,483,647 (the default is 30)")
    with pytest.raises(UserError) as e:
        check("train.steps", 0, _int(30, 1))
    assert str(e.value) == "train.steps=0: must be an int >= 1 (the default is 30)"
    with pytest.raises(UserError) as e:
        RunSpec(steps=10 ** 12)
    assert str(e.value) == ("train.steps=1000000000000: must be an int >= 1 and <= "
                            "2,147,483,647 (the default is 30)")


def test_a_huge_value_is_named_by_its_start_and_length():
    with pytest.raises(UserError) as e:
        check("train.steps", "x" * 5000, _int(30, 1))
    assert str(e.value) == (f"train.steps='{'x' * 79}... (5,002 characters): must be an int "
                            f">= 1 (the default is 30)")
    assert shown("short") == "'short'"


def test_an_over_long_compilation_cache_dir_is_refused(tmp_path):
    with pytest.raises(UserError) as e:
        use_compilation_cache(str(tmp_path / ("c" * 5000)))
    assert "a name of 5000 bytes: the filesystem takes names of at most 255 bytes" in \
        str(e.value) and len(str(e.value)) < 400


@gin.configurable
def _preempted_inside_gin():
    raise Preempted("SIGTERM", 4, 4, "/w/checkpoints")


def test_an_exception_through_gin_is_reported_by_its_first_line():
    gin.clear_config()
    with pytest.raises(Preempted) as e:
        _preempted_inside_gin()
    assert first_line(e.value) == ("SIGTERM: stopped after step 4; the run will resume from "
                                   "step 4 (/w/checkpoints): rerun the same command")


# issue 41 item 7: errors that pointed the wrong way name the setting and the fix


@pytest.fixture
def cli(capsys):
    """(script name, argv) -> the one error line of a run that must refuse (exit 2)."""
    from helpers import load_script
    from mmjax.cli import run_main

    def refused(name, argv):
        try:
            assert run_main(load_script(name).main, argv) == 2
        finally:
            gin.clear_config()
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        return err[0]
    return refused


def test_an_unquoted_gin_string_says_to_quote_it(cli):
    line = cli("train", ["--check", "--gin_param=loader_source.path=data/tiny.arrayrecord"])
    assert line == ("error: --gin_param='loader_source.path=data/tiny.arrayrecord': "
                    "data/tiny.arrayrecord is not a gin value: if a string is meant, quote it "
                    "(--gin_param=\"loader_source.path='data/tiny.arrayrecord'\")")
    assert "train.steps='six'" in cli("train", ["--check", "--gin_param=train.steps=six"])


def test_a_key_bound_twice_is_refused(cli):
    line = cli("train", ["--check", "--gin_param=train.steps=3", "--gin_param=train.steps = 4"])
    assert line == ("error: --gin_param: train.steps is bound twice ('train.steps=3' and "
                    "'train.steps = 4'): keep one")


def test_manual_plan_divisibility_speaks_in_the_users_settings():
    from mmjax.train.validate import check_manual_batches

    with pytest.raises(UserError) as e:
        check_manual_batches(7, 2, {"llm": 2})
    assert str(e.value) == ("train.global_batch=7 is not divisible by manual_plan."
                            "num_microbatches=2: use a global batch that is a multiple of 2, "
                            "or a num_microbatches dividing 7")
    with pytest.raises(UserError) as e:
        check_manual_batches(6, 2, {"llm": 2})
    assert str(e.value) == ("manual_plan.dp['llm']=2 does not divide the microbatch size 3 "
                            "(train.global_batch=6 / manual_plan.num_microbatches=2): use a "
                            "global batch that is a multiple of 4, or a dp dividing 3")
    check_manual_batches(8, 2, {"llm": 2})  # fits
    with pytest.raises(UserError, match=r"^manual_plan.dp=4 does not divide"):
        check_manual_batches(6, 1, 4)


def test_auto_plan_on_too_few_cpu_devices_says_how_to_force_more():
    from mmjax.train.auto_plan import cpu_devices_hint

    assert cpu_devices_hint("too few GPUs: the smallest plan ... needs 3 GPUs (...)") == (
        " (on CPU, force host devices: XLA_FLAGS=--xla_force_host_platform_device_count=3 "
        "before the command)")
    assert "device_count=8 " in cpu_devices_hint("neither layout fits")


def test_a_missing_image_root_names_the_setting(tmp_path):
    from mmjax.data.sources import check_image_root, image_root_hint

    with pytest.raises(UserError, match=r"^llava_source.image_root='nothere': no such "
                                        r"directory"):
        check_image_root("llava_source.image_root", "nothere")
    check_image_root("llava_source.image_root", "")  # unset: paths relative to the JSON's
    check_image_root("llava_source.image_root", str(tmp_path))
    assert image_root_hint("llava_source.image_root", "").startswith(
        "images not found under llava_source.image_root='' (")


def test_a_global_batch_of_missing_images_names_the_image_root(tmp_path, monkeypatch, cli):
    """The README's LLaVA example with an image_root that holds no images (relative, to the
    wrong folder): the run says where it looked for them, naming the setting."""
    from helpers import load_script

    data = tmp_path / "data"
    load_script("make_example_data").main([f"--out={data}", "--num_samples=8", "--num_val=1"])
    monkeypatch.chdir(tmp_path)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    line = cli("train", [
        "--check", f"--gin_file={os.path.join(repo, 'configs', 'examples', 'llava_tiny.gin')}",
        f"--gin_param=tokenizer.path='{data}/tokenizer'",
        f"--gin_param=llava_source.json_path='{data}/train.json'",
        "--gin_param=llava_source.image_root='data'"])  # the images are in data/images
    assert f"images not found under llava_source.image_root='data' ({data})" in line, line


def test_generate_says_which_constraint_failed(tmp_path, cli):
    (tmp_path / "config.gin").write_text("")
    assert cli("generate", [f"--workdir={tmp_path}", "--prompt=hi", "--temperature=-1"]) == (
        "error: --temperature=-1.0: use >= 0 (0: greedy)")
    assert cli("generate", [f"--workdir={tmp_path}", "--prompt=hi", "--top_p=0"]) == (
        "error: --top_p=0.0: use 0 < top_p <= 1")


def test_make_example_data_into_an_unwritable_place_is_one_line(cli):
    line = cli("make_example_data", ["--out=/proc/x"])
    assert line.startswith("error: --out=/proc/x: cannot write there (")


def test_an_image_request_needs_no_input_image():
    """generate.py --output_image (configs/examples/llava_gen_tiny.gin's header) asks for a
    picture with a text prompt, as the image-output records do: no --image needed; a
    question to the same model without an image still needs one (or --text_only)."""
    from types import SimpleNamespace

    from helpers import load_script

    check = load_script("generate").check_inputs
    cfg = SimpleNamespace(name="llava_gen_tiny", encoders=[SimpleNamespace(modality="image")])
    ask = dict(image=None, audio=None, text_only=False)
    check(cfg, SimpleNamespace(**ask, output_image="red_square.png"))
    with pytest.raises(UserError, match=r"^--image: model llava_gen_tiny reads images"):
        check(cfg, SimpleNamespace(**ask, output_image=None))


def test_a_plan_made_for_another_model_says_so_first(tmp_path):
    """Issue 41: a Plan JSON from scripts/plan.py for another model is named as such (both
    models, the fix), then the first check that failed; a plan of this model fails as
    before."""
    import json

    from mmjax.models.tiny import tiny
    from mmjax.train.manual_plan import manual_plan
    from mmjax.train.run_setup import run_plan

    d = manual_plan(global_batch=8, model=tiny()).chosen.to_json()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**d, "global_batch": 128, "model": "disttrain/mllm_9b"}))
    with pytest.raises(UserError) as e:
        run_plan(str(path), tiny(), None, {}, 8, None)
    assert str(e.value) == (
        f"--plan={path} was made for model 'disttrain/mllm_9b', this run trains 'tiny': plan "
        f"this model (scripts/plan.py --gin_file=<this run's gin file> --json={path}) (plan "
        f"global_batch=128 differs from train.global_batch=8: make them equal)")
    path.write_text(json.dumps({**d, "global_batch": 128, "model": "tiny"}))
    with pytest.raises(UserError) as e:
        run_plan(str(path), tiny(), None, {}, 8, None)
    assert str(e.value) == "plan global_batch=128 differs from train.global_batch=8: make them equal"
