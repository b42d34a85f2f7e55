"""Outside the job: what the monitor, the launcher and `perfmon report` / `perfmon trace` compute."""
