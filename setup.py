"""The optional C hot path of the hooks; everything else is in pyproject.toml.

``optional=True``: where no C compiler (or no Python headers) exists, the build of this one extension is
skipped with a warning and perfmon installs all the same, its hooks in pure Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("perfmon.agent._hot", ["perfmon/agent/_hot.c"], optional=True)])
