"""Dense peak throughput of common GPUs, TFLOP/s, from the vendors' datasheets (no sparsity).

MFU is reported against the bf16 (or fp16) tensor-core peak, the usual convention;
``--peak-tflops`` overrides the table (and is the only way to get MFU on a CPU).
"""

from __future__ import annotations

# name fragment (lower case, most specific first) -> {dtype: TFLOP/s}
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("b200", {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 80}),
    ("h200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("h100 pcie", {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}),
    ("h100", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("gh200", {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67}),
    ("a100", {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}),
    ("a10g", {"bf16": 70, "fp16": 70, "tf32": 35, "fp32": 31.2}),
    ("a10", {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}),
    ("l40s", {"bf16": 362, "fp16": 362, "tf32": 183, "fp32": 91.6}),
    ("l4", {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}),
    ("a6000", {"bf16": 155, "fp16": 155, "tf32": 77, "fp32": 38.7}),
    ("4090", {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}),
    ("3090", {"bf16": 71, "fp16": 71, "tf32": 35.6, "fp32": 35.6}),
    ("v100", {"fp16": 125, "fp32": 15.7}),
    ("t4", {"fp16": 65, "fp32": 8.1}),
]


def peak_tflops(device_name: str | None, dtype: str = "bf16") -> float | None:
    """The table's peak for a device name (as NVML reports it), or None if unknown."""
    if not device_name:
        return None
    name = device_name.lower()
    for fragment, peaks in PEAKS:
        if fragment in name:
            return peaks.get(dtype) or peaks.get("fp16")
    return None
