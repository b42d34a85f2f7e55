"""Writes what the script sees of its launch (argv, sys.path, cwd, __name__, ...) to --out as JSON.

Run it with plain python and under perfmon, then compare the two files.
"""

import json
import os
import sys


def main() -> None:
    out = None
    for i, arg in enumerate(sys.argv):
        if arg == "--out" and i + 1 < len(sys.argv):
            out = sys.argv[i + 1]
    main_mod = sys.modules["__main__"]
    info = {
        "argv": sys.argv,
        "argv_repr": repr(sys.argv),
        "path0": sys.path[0],
        "path": sys.path,
        "cwd": os.getcwd(),
        "name": __name__,
        "file": globals().get("__file__"),
        "package": globals().get("__package__"),
        "spec_is_none": globals().get("__spec__") is None,
        "main_is_this": getattr(main_mod, "main", None) is main,
        "torch_imported": "torch" in sys.modules,
        "stdin_isatty": sys.stdin.isatty() if sys.stdin else None,
    }
    if out:
        with open(out, "w") as f:
            json.dump(info, f, indent=2)
    print(f"argv_echo {sys.argv!r}")


if __name__ == "__main__":
    main()
