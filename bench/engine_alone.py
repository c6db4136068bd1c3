"""The ending every engine-alone benchmark shares (bench/choices_beside.py, first_use.py, long_prefill.py,
write_landing.py): vLLM's CPU settings put in this process's environment before vLLM is imported, the measurement
run, its markdown report headed by the CPU line (model and flags: ratios compare only within one run and machine),
printed and written to --out."""
from __future__ import annotations

from pathlib import Path
from typing import Callable


def measure_and_report(measure: Callable[[str], str], out: Path | None) -> int:
    """`measure(cpu_line)` runs the benchmark and returns its report; returns main()'s exit status."""
    from inferscale_core.vllm_env import set_vllm_cpu_env

    set_vllm_cpu_env(1)
    from bench.service import cpu_description, cpu_line

    text = measure(cpu_line(cpu_description()))
    print(text)
    if out:
        out.write_text(text)
    return 0
