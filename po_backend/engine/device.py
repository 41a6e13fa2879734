"""Which device the engine runs on, resolved once at start-up: "auto"/None picks CUDA when it is
there; a device that was asked for but is absent (CUDA on a CPU-only torch or machine, cuda:3 on
a one-GPU box) is a `DeviceUnavailableError` naming the flag, never a crash inside the loader.
Also what a CUDA device computes well (`cuda_dtype`)."""

from __future__ import annotations

import logging

import torch

from po_backend.core.cpu import cpu_model
from po_backend.core.errors import DeviceUnavailableError

log = logging.getLogger(__name__)

# Device types the engine's code paths are written for; others (xla, xpu, ...) are refused up
# front rather than failing somewhere in the forward.
SUPPORTED_TYPES = ("cpu", "cuda", "mps")


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:1", a torch.device, or None/"auto" for cuda when available)
    as a torch.device that exists on this machine. A bare "cuda" gets the current device's index,
    so logs and /server_info name the GPU that runs."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailableError(
            f"device={device!r} is not a device name ({e}); use cpu, cuda or cuda:N"
        ) from None
    if dev.type not in SUPPORTED_TYPES:
        raise DeviceUnavailableError(f"device={device!r}: the engine runs on {' | '.join(SUPPORTED_TYPES)}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                "this torch is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
            )
            raise DeviceUnavailableError(f"device={device!r} asks for CUDA but {why}; use device=cpu")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            raise DeviceUnavailableError(
                f"device={device!r}: this machine has {count} visible CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailableError(
            f"device={device!r} asks for MPS, which this machine lacks; use device=cpu"
        )
    return dev


def cuda_dtype(device: torch.device) -> torch.dtype:
    """The default dtype on a CUDA device: bf16 where its tensor cores take it (compute capability
    8.0 and up: A100, H100, RTX 30xx and later), else fp16 (V100, T4), whose tensor cores run it
    while bf16 there is emulated."""
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return torch.bfloat16
    log.info(
        "CUDA compute capability %d.%d has no bf16 tensor cores: the default dtype is fp16", major, minor
    )
    return torch.float16


def describe(device: torch.device) -> str:
    """The device for logs and reports: a GPU's name, compute capability and memory, or the CPU's
    model (a figure is only meaningful with the hardware it was measured on)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        total = torch.cuda.get_device_properties(device).total_memory
        name = torch.cuda.get_device_name(device)
        return f"{device}: {name} (compute capability {major}.{minor}, {total / 2**30:.0f} GiB)"
    if device.type == "cpu":
        return f"cpu: {cpu_model()}"
    return str(device)
