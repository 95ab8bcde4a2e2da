"""Issue 43's smaller items: a range error names both bounds, a huge value is not echoed
whole, an over-long compilation_cache_dir is refused before the cache fails silently, and
an exception out of a gin configurable is reported by its own first line (not gin's
"In call to configurable ..." wrapper)."""
import gin
import pytest

from mmjax.errors import UserError, first_line, shown
from mmjax.settings import _int, check
from mmjax.train.preemption import Preempted
from mmjax.train.run_files import use_compilation_cache
from mmjax.train.validate import positive_int


def test_a_value_above_the_int_range_names_the_upper_bound():
    with pytest.raises(UserError) as e:
        check("train.steps", 10 ** 12, _int(30, 1))
    assert str(e.value) == ("train.steps=1000000000000: must be an int >= 1 and <= "
                            "2,147,483,647 (the default is 30)")
    with pytest.raises(UserError) as e:
        check("train.steps", 0, _int(30, 1))
    assert str(e.value) == "train.steps=0: must be an int >= 1 (the default is 30)"
    with pytest.raises(UserError) as e:
        positive_int("train.steps", 10 ** 12)
    assert str(e.value) == "train.steps=1000000000000: must be an int >= 1 and <= 2,147,483,647"


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
