"""The `opd` command line: one entry point, one small function per subcommand.

Each command's function imports its module lazily, so `opd --help` and `opd validate` start fast and never
pull in torch or Ray. A user error (`OpdError`) is printed as `error: ...` lines and exits 2; a traceback only
ever means a bug in this project.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from opd.errors import OpdError

if TYPE_CHECKING:
    from opd.spec import ExperimentSpec


def _spec_arguments(parser: argparse.ArgumentParser) -> None:
    """CONFIG, --set and --no-path-check: shared by every command that runs from a spec."""
    parser.add_argument("config", metavar="CONFIG", help="YAML experiment spec, e.g. configs/tiny.yaml")
    parser.add_argument("--set", "-s", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, value parsed as YAML (repeatable), e.g. --set optim.lr=1e-4")
    parser.add_argument("--no-path-check", action="store_true",
                        help="do not require model and data paths to exist (e.g. validating a cluster config)")


def _load(args: argparse.Namespace) -> ExperimentSpec:
    from opd.spec import load_spec

    return load_spec(args.config, args.overrides, check_paths=not args.no_path_check)


def _validate(args: argparse.Namespace) -> int:
    sys.stdout.write(_load(args).to_yaml())
    return 0


# name -> (one-line help, argument setup, handler). Later commands (train, eval, sft, build-tiny, run,
# reproduce) add one row here and one handler that imports its module inside the function.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "validate": ("check a spec and print it fully resolved as YAML", _spec_arguments, _validate),
}


def build_parser() -> argparse.ArgumentParser:
    """The `opd` parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="opd", description="Draft-OPD: on-policy distillation of DFlash speculative-decoding drafters.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, handler) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `opd` command; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except OpdError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
