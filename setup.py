"""The optional C hot path of the hooks; everything else is in pyproject.toml.

``optional=True``: where no C compiler (or no Python headers) exists, the build of this one extension is
skipped with a warning and perfmon installs all the same, its hooks in pure Python.
"""

import sys

from setuptools import Extension, setup

# fma() is libm's; an interpreter that does not load libm itself would otherwise leave it unresolved
libm = [] if sys.platform == "win32" else ["m"]
setup(ext_modules=[Extension("perfmon.agent._hot", ["perfmon/agent/_hot.c"], libraries=libm, optional=True)])
