"""The layer rules (README "Development"), checked on the source (imports anywhere in a module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "perfmon"

# The layout shows the two processes: what runs inside the training job (agent/, collectors/, protocol,
# paths, the public API) never imports what runs outside it (monitor/, analysis/, tui/).
INSIDE_BANNED = {"textual", "rich", "perfmon.tui", "perfmon.monitor", "perfmon.analysis"}
# module path prefix -> packages it must never import
FORBIDDEN = {
    "agent": INSIDE_BANNED,
    "collectors": INSIDE_BANNED,
    "protocol.py": INSIDE_BANNED | {"torch"},
    "messages": INSIDE_BANNED | {"torch"},  # the typed messages: stdlib only, any side may read them
    "paths.py": INSIDE_BANNED | {"torch"},
    "recording.py": INSIDE_BANNED | {"torch"},  # reading a recording: the report's and the monitor's
    "tail.py": INSIDE_BANNED | {"torch"},
    "_api.py": INSIDE_BANNED | {"torch"},
    "auto.py": INSIDE_BANNED,
    "__init__.py": INSIDE_BANNED,
    # analysis is what the monitor, the report and the dashboard build on: it never reaches back into them
    "analysis": {"textual", "rich", "torch", "perfmon.tui", "perfmon.monitor", "perfmon.agent", "perfmon.collectors"},
    "monitor": {"torch", "perfmon.agent", "perfmon.collectors"},
    "tui": {"torch", "perfmon.agent", "perfmon.collectors"},
}
# The one outside module that reads collectors: the launcher samples its job's host and GPUs from outside the job
# (they read a process by its pid, through /proc, psutil and NVML: no torch, nothing of the job's own state).
EXEMPT = {"monitor/host_feed.py": {"perfmon.collectors.host", "perfmon.collectors.nvml"}}


def imports(path: Path, package: tuple[str, ...] | None = None) -> set[str]:
    """Every module ``path`` imports, anywhere in it: relative imports resolved (against ``package``, by default
    where it lies), and ``from pkg import name`` counted as ``pkg.name`` too (it may be a module: ``from perfmon
    import analysis``)."""
    if package is None:
        package = path.relative_to(PKG.parent).with_suffix("").parts[:-1]  # e.g. ("perfmon", "agent")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def test_imports_sees_relative_and_from_package_imports(tmp_path):
    """The layer check itself: what a module could slip past it."""
    probe = tmp_path / "probe.py"
    probe.write_text("from .. import analysis\nfrom ..tui import app\nfrom perfmon import monitor\n")
    seen = imports(probe, ("perfmon", "agent"))
    assert {"perfmon.analysis", "perfmon.tui.app", "perfmon.monitor"} <= seen


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for prefix, banned in FORBIDDEN.items():
            if rel == prefix or rel.startswith(prefix + "/"):
                yield pytest.param(path, banned, EXEMPT.get(rel, set()), id=rel)


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("path, banned, exempt", list(modules()))
def test_module_respects_layer_rules(path, banned, exempt):
    bad = {n for n in imports(path) for b in banned if _under(n, b) and not any(_under(n, e) for e in exempt)}
    assert not bad, f"{path.name} imports {bad}"


def test_textual_is_imported_only_by_tui():
    offenders = [
        p.relative_to(PKG).as_posix()
        for p in PKG.rglob("*.py")
        if not p.relative_to(PKG).as_posix().startswith("tui/")
        and any(n == "textual" or n.startswith("textual.") for n in imports(p))
    ]
    assert offenders == []


def test_import_perfmon_is_light():
    # the public API must not drag torch or textual into a script that imports it
    code = "import sys, perfmon; perfmon.step(); print(sorted(m for m in ('torch','textual','rich') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_training_process_never_loads_the_analysis(tmp_path):
    """Run a real (tiny) job under the agent: state, report and rules stay out of its sys.modules."""
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(5):\n"
        "    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "import atexit\n"
        "atexit.register(lambda: print(sorted(n for n in sys.modules if n in "
        "('perfmon.analysis.state', 'perfmon.analysis.report', 'perfmon.analysis.rules', 'textual'))))\n")
    env = dict(__import__("os").environ, PERFMON_RUN_DIR=str(tmp_path / "run"),
               PERFMON_RUNTIME_DIR=str(tmp_path / "rt"))
    out = subprocess.run([sys.executable, "-m", "perfmon.agent", str(script)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
