"""The device a workspace or a layer runs on, and the check that it is an NVIDIA Hopper GPU, made before anything
touches CUDA (the extension is built for sm_90a only):

    mok.require_hopper()        # torch.device("cuda", i) of torch's current CUDA device, or RuntimeError:
    # "mok needs an NVIDIA Hopper GPU (sm_90); found no CUDA device (torch.cuda.is_available() is False; ...)"
    # "mok needs an NVIDIA Hopper GPU (sm_90); found NVIDIA A100-SXM4-80GB (sm_80) on cuda:0"

Every torch.cuda call here is behind torch.cuda.is_available(), so a machine without a driver gets this message,
not torch's own "Found no NVIDIA driver".
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .arguments import describe

HOPPER_REQUIRED = "mok needs an NVIDIA Hopper GPU (sm_90); found "
HOPPER_CAPABILITY = (9, 0)


def parse_device(device, name: str = "device") -> Optional[torch.device]:
    """None, or device as a torch.device: a str ("cuda:1", "meta"), an int (a CUDA index) or a torch.device.
    TypeError or ValueError naming `name` otherwise. Touches no GPU."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{name}: expected None, a str, an int or a torch.device, got {describe(device)}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{name}: expected a CUDA device index >= 0, got {device}")
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name}: {device!r} is not a device ({e})") from None


def _cuda_index(device: Optional[torch.device], name: str) -> Optional[int]:
    if device is not None and device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA device, got {device}")
    return None if device is None else device.index


def hopper_problem(device=None, name: str = "device") -> Optional[str]:
    """None when `device` (a CUDA device as parse_device takes it; None or "cuda": torch's current one) is a
    usable Hopper GPU, else what was found instead: "no CUDA device (...)", "cuda:1 but only 1 CUDA device is
    visible", "NVIDIA A100-SXM4-80GB (sm_80) on cuda:0". ValueError for a device that is not a CUDA device."""
    index = _cuda_index(parse_device(device, name), name)
    if not torch.backends.cuda.is_built():
        return "no CUDA device (PyTorch was built without CUDA)"
    if getattr(torch.version, "hip", None):
        return f"no CUDA device (PyTorch was built for ROCm {torch.version.hip})"
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "CUDA_VISIBLE_DEVICES not set" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
        return f"no CUDA device (torch.cuda.is_available() is False; {shown})"
    if index is None:
        index = torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        return f"cuda:{index} but only {count} CUDA device{' is' if count == 1 else 's are'} visible"
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != HOPPER_CAPABILITY:
        return f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}) on cuda:{index}"
    return None


def require_hopper(device=None, name: str = "device") -> torch.device:
    """torch.device("cuda", index) of `device` (None or "cuda": torch's current CUDA device; an int, a str or a
    torch.device) when it is an NVIDIA Hopper GPU (sm_90); else RuntimeError "mok needs an NVIDIA Hopper GPU
    (sm_90); found ..." saying what was found (see hopper_problem). Call it before any other CUDA call."""
    problem = hopper_problem(device, name)
    if problem is not None:
        raise RuntimeError(HOPPER_REQUIRED + problem)
    index = _cuda_index(parse_device(device, name), name)
    return torch.device("cuda", torch.cuda.current_device() if index is None else index)


def check_layer_device(device, name: str = "device") -> Optional[torch.device]:
    """The device of a workspace or a layer as given, checked without touching a GPU: None (torch's current CUDA
    device), a CUDA device or "meta" (shapes only); TypeError or ValueError naming `name` otherwise ("cpu")."""
    parsed = parse_device(device, name)
    if parsed is not None and parsed.type not in ("cuda", "meta"):
        raise ValueError(f"{name}: expected a CUDA device (or meta), got {parsed}")
    return parsed


def layer_device(device, name: str = "device") -> torch.device:
    """check_layer_device's device resolved: "meta" as it is, a CUDA device through require_hopper."""
    parsed = check_layer_device(device, name)
    if parsed is not None and parsed.type == "meta":
        return parsed
    return require_hopper(parsed, name)
