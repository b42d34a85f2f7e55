"""Outside the job: launching it, connecting to it, reading its messages (socket or recording), finding runs."""
