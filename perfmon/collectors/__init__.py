"""Telemetry collectors sampled by the agent's daemon thread: GPU (NVML), allocator, host."""
