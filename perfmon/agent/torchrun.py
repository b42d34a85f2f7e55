"""``python -m perfmon.agent.torchrun [torchrun options] SCRIPT|-m MODULE [ARGS]``: the real torchrun.

This is ``torch.distributed.run`` itself (its own parser, rendezvous, elastic agent and restarts), with one
change: each worker runs ``python -m perfmon.agent SCRIPT ARGS`` instead of ``python SCRIPT ARGS``, so
every rank starts under the agent and records in ``RUN/rank-K/``. Nothing else of the command line is
touched.
"""

from __future__ import annotations

import os
import sys

from perfmon import paths

USAGE = "usage: perfmon torchrun [torchrun options] SCRIPT [ARGS...] (or -m MODULE [ARGS...])"
HELP = """\
usage: perfmon [OPTIONS] torchrun [TORCHRUN OPTIONS] SCRIPT [ARGS...]

Every rank of a torchrun job, as one job: perfmon runs torchrun (the options before SCRIPT are torchrun's own:
torchrun --help), each rank records in RUN/rank-K/, and the dashboard's ranks view (7) or the headless job
summary compares them. perfmon's OPTIONS go before "torchrun" (perfmon --help)."""


def worker_command(script: str, script_args: list[str], module: bool) -> tuple[str, list[str]]:
    """What torchrun should run in each worker (as ``python -m``): the agent, then the user's target."""
    return "perfmon.agent", ["-m", script, *script_args] if module else [script, *script_args]


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    from torch.distributed import run as torchrun

    args = torchrun.parse_args(argv)
    if args.no_python:
        print("perfmon: error: perfmon torchrun runs Python training scripts; --no-python starts a program "
              "perfmon cannot instrument", file=sys.stderr)
        return 2
    if getattr(args, "run_path", False):
        print("perfmon: error: --run-path cannot be combined with perfmon torchrun (each worker runs "
              "python -m perfmon.agent SCRIPT)", file=sys.stderr)
        return 2
    if not args.module and not os.path.isfile(args.training_script):
        print(f"perfmon: error: can't open file {args.training_script!r}: No such file or directory",
              file=sys.stderr)
        return 2
    target = args.training_script  # what torchrun names in its report: the script as given, or the module
    args.training_script, args.training_script_args = worker_command(
        args.training_script, list(args.training_script_args), bool(args.module))
    args.module = True
    os.environ[paths.RANKS_ENV] = "1"  # every worker records as a rank, even in a world of one
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(args)  # raises ChildFailedError when a worker fails; its message names the rank
    except ChildFailedError as exc:
        # torchrun's own report (which rank, exit code, error file), raised on as torchrun's main raises it (its
        # traceback, then exit 1): named for the script, not for perfmon.agent, which each worker runs first
        raise ChildFailedError(name=target, failures=exc.failures).with_traceback(exc.__traceback__) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
