"""What every script under scripts/ shares: strict gin parsing and one-line user errors.

A user error (bad setting, plan, data, checkpoint, device count: every input error is a
`UserError`) prints `error: <what> (<how to fix>)` on one line and exits 2;
XLA's RESOURCE_EXHAUSTED prints one line with the settings to change (exit 1); anything else
is a bug and keeps its traceback. `--debug` shows the traceback of a user
error too.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from mmjax.errors import UserError
from mmjax.train.preemption import EXIT_INTERRUPTED

EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 1  # not bad input: the run itself did not fit


def user_error_types() -> tuple[type, ...]:
    """The exception types that mean bad input: `UserError`, which every such type
    (PlanError, PretrainedError, CheckpointMismatch, ...) subclasses."""
    return (UserError,)


def run_main(main, argv=None) -> int:
    """`main(argv)`'s exit code (0 when it returns a non-int, e.g. a benchmark's record); a
    user error -> one line on stderr, exit 2 (`--debug` in argv: re-raised with its
    traceback); a Ctrl-C the script does not handle itself (during imports, gin, set-up)
    -> one line, exit 130, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        rc = main([a for a in argv if a != "--debug"])
        return rc if isinstance(rc, int) and not isinstance(rc, bool) else 0
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted (Ctrl-C): stopped at once", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if not debug and not isinstance(e, user_error_types()):
            from mmjax.train.memory_check import out_of_memory_line

            line = out_of_memory_line(e)  # XLA's RESOURCE_EXHAUSTED: a hint, no traceback
            if line:
                print(line, file=sys.stderr)
                return EXIT_OUT_OF_MEMORY
        if debug or not isinstance(e, user_error_types()):
            raise
        # gin appends "In call to configurable ..." on further lines: the first says it all
        print(f"error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return EXIT_USER_ERROR


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors (unknown flag, missing value) are one-line user errors (exit
    2 through `run_main`), not a usage block."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def add_debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of a user error (bad setting, plan, "
                             "data, checkpoint) instead of its one-line message")


def register_configurables() -> None:
    """Import every module with gin configurables the scripts' gin files bind."""
    import mmjax.data.loader  # noqa: F401
    import mmjax.train.manual_plan  # noqa: F401
    import mmjax.train.trainer  # noqa: F401 (and train.run_spec: `train.*`)


def parse_gin(files: list[str], params: list[str], finalize: bool = True) -> None:
    """Parse the gin files, then each --gin_param binding, then finalize, before any work,
    strictly (an unknown configurable or parameter is an error, never skipped), so an error
    names the culprit: the file, or the binding as given. Raises UserError."""
    import gin

    register_configurables()
    for f in files:
        if not os.path.exists(f):
            raise UserError(f"gin file {f!r} not found (run from the repo root or pass a path)")
    # gin raises several exception types; every one means "this piece of config is bad"
    for f in files:
        try:
            gin.parse_config_file(f)
        except Exception as e:
            raise UserError(f"bad gin file {f}: {type(e).__name__}: {_flat(e)} (fix the "
                            f"file)") from e
    refuse_duplicate_bindings(params)
    for b in params:
        try:
            gin.parse_config(b)
        except Exception as e:
            bare = unquoted_string(b)
            if bare is not None:
                key, value = bare
                raise UserError(f"--gin_param={b!r}: {value} is not a gin value: if a "
                                f"string is meant, quote it (--gin_param=\"{key}="
                                f"'{value}'\")") from e
            raise UserError(f"bad gin binding --gin_param={b!r}: {type(e).__name__}: "
                            f"{_flat(e)} (check the name's spelling: configurable.parameter "
                            f"= value)") from e
    if not finalize:
        return
    try:
        gin.finalize()
    except Exception as e:
        raise UserError(f"bad gin config ({', '.join(files)} + --gin_param bindings) at "
                        f"finalize: {type(e).__name__}: {_flat(e)}") from e


_BARE = re.compile(r"[A-Za-z_./~-][\w./~:+-]*")
_GIN_WORDS = ("True", "False", "None")


def unquoted_string(binding: str) -> tuple[str, str] | None:
    """(key, value) when `binding`'s value is a bare word or path gin cannot read (a string
    without its quotes, e.g. `loader_source.path=data/x.arrayrecord`), else None."""
    if "=" not in binding:
        return None
    key, value = (part.strip() for part in binding.split("=", 1))
    if value in _GIN_WORDS or not _BARE.fullmatch(value):
        return None
    return key, value


def refuse_duplicate_bindings(params: list[str]) -> None:
    """The same key bound twice on the command line is an error, not a silent last-wins."""
    seen: dict[str, str] = {}
    for b in params:
        if "=" not in b:
            continue
        key = "".join(b.split("=", 1)[0].split())
        if key in seen:
            raise UserError(f"--gin_param: {key} is bound twice ({seen[key]!r} and {b!r}): "
                            f"keep one")
        seen[key] = b


def _flat(e: BaseException) -> str:
    return " ".join(str(e).split())


def binding_key(binding: str) -> str:
    """`'manual_plan.dp = {...}'` -> `'manual_plan.dp'` (scope prefixes dropped)."""
    return binding.split("=", 1)[0].strip().rsplit("/", 1)[-1]


def refuse_unused_bindings(params: list[str], plan: str | None) -> None:
    """A --gin_param binding this run would not read is an error, not a silent no-op:
    `manual_plan.*` is read only with --plan=manual. (gin files may carry them as
    defaults for that mode.)"""
    for b in params:
        key = binding_key(b)
        if key.startswith("manual_plan.") and plan != "manual":
            raise UserError(f"--gin_param={b!r}: manual_plan.* is read only with "
                            f"--plan=manual (add --plan=manual, or drop the binding)")


def write_json(path: str, obj) -> None:
    """A benchmark's results: `obj` as indented JSON at `path` (folders made), and a line
    saying where."""
    import json
    import os

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    print(f"wrote {path}")
