"""Where and how a run executes: device, precision, compilation, distributed setup, and timing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from creditlab.config import ConfigError, TrainConfig

T = TypeVar("T")


@dataclass
class Runtime:
    device: torch.device
    param_dtype: torch.dtype  # dtype the parameters are stored in
    autocast_dtype: torch.dtype | None  # matmul dtype under autocast, or None for none
    compile: bool
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """The precision context of a forward pass."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def launched_processes() -> int:
    """How many processes torchrun started for this command (1 without torchrun); read before joining a group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve(cfg: TrainConfig) -> Runtime:
    """Pick device, dtypes and compilation from the config; join the process group under torchrun."""
    world_size = launched_processes()
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is visible; use --set train.device=cpu")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    dtype = {"auto": "bf16" if use_cuda else "float32"}.get(cfg.dtype, cfg.dtype)
    if dtype == "bf16" and not use_cuda:
        raise ConfigError("train.dtype=bf16 (autocast) needs CUDA; use float32 or float64 on the CPU")
    param_dtype = torch.float64 if dtype == "float64" else torch.float32
    autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
    compile_ = cfg.compile == "on" or (cfg.compile == "auto" and use_cuda)
    return Runtime(device, param_dtype, autocast_dtype, compile_, rank, world_size, local_rank)


def leave_process_group() -> None:
    """End the process group a run joined under torchrun, so NCCL shuts down cleanly rather than at exit."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def maybe_compile(fn, runtime: Runtime):
    """torch.compile when asked; if compilation fails at the first call, warn and fall back to eager."""
    if not runtime.compile:
        return fn
    state = {"fn": torch.compile(fn)}

    def call(*args, **kwargs):
        try:
            return state["fn"](*args, **kwargs)
        except torch.OutOfMemoryError:
            raise  # running out of memory is a result (a capacity miss), not a compiler failure
        except Exception as exc:  # noqa: BLE001 - any compiler failure falls back, loudly
            if state["fn"] is fn:
                raise
            warnings.warn(f"torch.compile failed ({type(exc).__name__}: {exc}); falling back to eager",
                          stacklevel=2)
            state["fn"] = fn
            return fn(*args, **kwargs)

    return call


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in dtype: t itself where it already is, never a same-dtype .to(). torch 2.11's compiler drops the
    gradient of an autograd.Function whose output is such a .to() (its compiled backward gave zeros)."""
    return t if t.dtype == dtype else t.to(dtype)


class Timer:
    """Synchronized wall time of a region."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    def __enter__(self):
        self.runtime.synchronize()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.runtime.synchronize()
        self.seconds = time.perf_counter() - self.start


class HostCopy:
    """A device tensor copied to the host behind the work queued so far, without waiting for it: `get` waits for
    the copy alone. A read that queued device work of its own (`.item()` on a device tensor, say) would wait for
    everything queued before that work, the next update included. On the CPU, the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.copied = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = tensor

    def get(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host


def peak_memory_mib(runtime: Runtime) -> tuple[float | None, float | None]:
    """(allocated, reserved) peaks since the last reset, in MiB; None on the CPU."""
    if not runtime.is_cuda:
        return None, None
    return (torch.cuda.max_memory_allocated(runtime.device) / 2**20,
            torch.cuda.max_memory_reserved(runtime.device) / 2**20)


def reset_peak_memory(runtime: Runtime) -> None:
    if runtime.is_cuda:
        torch.cuda.reset_peak_memory_stats(runtime.device)


def gpu_benchmark_folder(out: str) -> Path | None:
    """A GPU benchmark's output folder, made; None, after saying so on stderr, where no CUDA GPU is visible
    (the script then exits 2, having spent nothing)."""
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return None
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_benchmark(folder: Path, stem: str, result: dict, lines: list[str]) -> None:
    """A GPU benchmark's results: DIR/stem.json (the numbers) and DIR/stem.md (its table, also printed)."""
    (folder / f"{stem}.json").write_text(json.dumps(result, indent=2))
    text = "\n".join(lines)
    (folder / f"{stem}.md").write_text(text + "\n")
    print(text, flush=True)


def largest_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest entry of |got - want| over the largest entry of |want|, in float64: how benchmarks report a
    kernel's error against a reference (NaN anywhere gives NaN)."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def cuda_ms(fn, repeats: int = 30, warmup: int = 3) -> float:
    """Mean milliseconds of fn() on the current CUDA device, timed by events around `repeats` calls after
    `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def measure_matmul_tflops(runtime: Runtime, size: int = 8192, repeats: int = 10) -> float | None:
    """The bf16 matrix rate of this GPU on random data, for MFU; None on the CPU."""
    if not runtime.is_cuda:
        return None
    a = torch.randn(size, size, device=runtime.device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=runtime.device, dtype=torch.bfloat16)
    with torch.cuda.device(runtime.device):
        ms = cuda_ms(lambda: a @ b, repeats)
    return 2 * size**3 / (ms / 1e3) / 1e12


def environment(runtime: Runtime | None = None) -> dict:
    """What a record needs to be re-run: software versions, hardware and the source revision."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
           "cuda": torch.version.cuda, "git_sha": git_sha(), "git_dirty": git_dirty(),
           "source_sha256": source_sha256()}
    if runtime is not None:
        env.update(device=str(runtime.device), world_size=runtime.world_size)
        if runtime.is_cuda:
            props = torch.cuda.get_device_properties(runtime.device)
            env.update(gpu=props.name, gpu_memory_mib=props.total_memory / 2**20,
                       driver=_nvidia_smi("driver_version"), sm_count=props.multi_processor_count)
    return env


def source_sha256(root: Path | None = None) -> str:
    """SHA256 over the package's own source files (relative path and bytes, in path order): identifies the code
    that ran even where the checkout's git metadata is missing or stale."""
    root = root or Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _run_git(*args: str) -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_sha() -> str | None:
    return _run_git("rev-parse", "HEAD")


def git_dirty() -> bool | None:
    status = _run_git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
