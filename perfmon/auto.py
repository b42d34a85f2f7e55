"""``import perfmon.auto``: start the agent in a script perfmon did not launch (Slurm, notebooks,
plain ``python train.py``), so that ``perfmon attach`` works. Same as ``perfmon.instrument()``."""

import perfmon

perfmon.instrument()
