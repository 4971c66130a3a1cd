"""Helpers the bench scripts that rehearse at 7B widths share: the process's peak memory and random
transcoders.

On the CPU the peak is the process's ``VmHWM`` (``/proc/self/status``), reset to the resident set of
the moment through ``/proc/self/clear_refs`` after ``malloc_trim`` (so freed arenas do not count);
on a GPU, torch's ``max_memory_allocated`` after ``reset_peak_memory_stats``.
"""

from __future__ import annotations

import ctypes
import gc

import torch


def reset_peak(device: str = "cpu") -> None:
    """Start a new peak: on the CPU ``VmHWM`` back to the resident set now, on a GPU torch's counter."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        return
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the resident set now


def read_peak(device: str = "cpu") -> int:
    """Bytes at the peak since `reset_peak` (the CPU: the whole process's resident set at its peak)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def random_transcoders(vlm, width: int, k: int):
    """TopK transcoders on every layer of ``vlm``, random as training starts them (``W_enc`` ~
    N(0, 1/d_model), ``W_dec`` rows of unit norm, so every token keeps ``k`` features), in the model's
    dtype, on its device; seeded (0), the same on every device's generator."""
    from countlens.features import Transcoder, TranscoderSet

    d, dtype, device = vlm.arch.d_model, vlm.hf.dtype, vlm.device
    gen = torch.Generator(device=device).manual_seed(0)
    sets = []
    for _ in range(vlm.arch.n_layers):
        tc = Transcoder(d, width, "topk", k=k, dtype=dtype).to(device)
        with torch.no_grad():
            tc.W_enc.copy_(torch.randn(width, d, generator=gen, device=device) / d**0.5)
            dec = torch.randn(width, d, generator=gen, device=device)
            tc.W_dec.copy_(dec / dec.norm(dim=1, keepdim=True))
        sets.append(tc)
    return TranscoderSet(sets, list(range(vlm.arch.n_layers)), model_name=vlm.name)
