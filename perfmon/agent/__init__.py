"""The in-process agent: runs inside the training process (stdlib + torch + protocol + collectors)."""
