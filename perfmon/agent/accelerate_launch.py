"""``python -m perfmon.agent.accelerate_launch launch [accelerate options] SCRIPT|-m MODULE [ARGS]``.

This is Hugging Face accelerate's own ``accelerate launch`` (its parser, its config file, its choice of launcher),
with one change: the process it starts runs ``python -m perfmon.agent SCRIPT ARGS`` instead of ``python SCRIPT
ARGS``. Where accelerate starts its workers with torchrun (``--multi_gpu``, FSDP, ``--num_processes N``), each
records as its rank, as under ``perfmon torchrun``; where it starts one process (the simple launcher), that process
records as rank 0 of a world of one (``paths.SOLE_RANK_ENV``: perfmon's own variable, never ``RANK``, which would
make accelerate set up a process group the script did not ask for). So the launcher reads either the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from perfmon import paths
from perfmon.agent.torchrun import worker_command

USAGE = "usage: perfmon accelerate launch [accelerate launch options] SCRIPT [ARGS...] (or -m MODULE [ARGS...])"
HELP = """\
usage: perfmon [OPTIONS] accelerate launch [ACCELERATE LAUNCH OPTIONS] SCRIPT [ARGS...]

A job that Hugging Face accelerate starts (`accelerate launch`), as one job: perfmon runs accelerate's own launch
command (the options before SCRIPT are accelerate's: accelerate launch --help; its config file is read as
usual), each process accelerate starts records in RUN/rank-K/ (one process: rank-0), and the dashboard's ranks
view (7) or the headless job summary compares them. perfmon's OPTIONS go before "accelerate" (perfmon --help).
Not followed: --no_python, --mpirun_hostfile (MPI starts the ranks), and more than one machine."""


def refusal(args: Any) -> str | None:
    """Why perfmon cannot follow this launch (one line), or None."""
    if getattr(args, "no_python", False):
        return ("perfmon accelerate launch runs Python training scripts; --no_python starts a program perfmon "
                "cannot instrument")
    if getattr(args, "mpirun_hostfile", None):
        return ("perfmon accelerate launch cannot follow ranks that MPI starts (--mpirun_hostfile); run "
                "`perfmon accelerate launch --multi_gpu ...` (torchrun) or perfmon.instrument() in the script")
    machines = getattr(args, "num_machines", None)
    if isinstance(machines, int) and machines > 1:
        return ("perfmon accelerate launch follows one machine; for a job on several, run "
                "`perfmon torchrun --nnodes N ...` on each node (accelerate takes its ranks from torchrun's "
                "environment)")
    return None


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]) or argv[:2] in (["launch", "-h"], ["launch", "--help"]):
        print(HELP)
        return 0
    if argv[:1] != ["launch"]:
        other = f"; `accelerate {argv[0]}` needs no perfmon: run it as it is" if argv else ""
        print(f"perfmon: error: perfmon follows `accelerate launch`{other}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError as exc:
        print(f"perfmon: error: accelerate cannot be imported in {sys.executable} ({exc}); install it there "
              "(pip install accelerate) or run the interpreter that has it (perfmon --python PATH)",
              file=sys.stderr)
        return 2
    args = launch_command_parser().parse_args(argv[1:])
    why = refusal(args)
    if why is not None:
        print(f"perfmon: error: {why}", file=sys.stderr)
        return 2
    script, script_args, module = args.training_script, list(args.training_script_args), bool(args.module)
    if not module and not os.path.isfile(script):
        print(f"perfmon: error: can't open file {script!r}: No such file or directory", file=sys.stderr)
        return 2
    args.training_script, args.training_script_args = worker_command(script, script_args, module)
    args.module = True
    os.environ[paths.RANKS_ENV] = "1"
    os.environ[paths.SOLE_RANK_ENV] = "1"  # read only where accelerate sets no RANK: its simple launcher
    import subprocess

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        launch_command(args)
    except ChildFailedError as exc:  # torchrun's report, named for the script (as under plain accelerate)
        raise ChildFailedError(name=script, failures=exc.failures).with_traceback(exc.__traceback__) from None
    except subprocess.CalledProcessError as exc:  # the simple launcher's, with the command it would have run
        exc.cmd = [sys.executable, *(["-m"] if module else []), script, *script_args]
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
