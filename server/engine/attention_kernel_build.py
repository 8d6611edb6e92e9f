"""The native CPU kernel for paged decode attention: built once, loaded with ctypes.

`csrc/paged_attention.c` has no Python or torch headers, so the system C
compiler (`$CC`, else `cc`) builds it in well under a second; the shared
library is kept in `$XDG_CACHE_HOME/batchpilot` (else `~/.cache/batchpilot`)
under a name that hashes the source and the flags, so a changed kernel is
rebuilt and an unchanged one is never rebuilt. A machine without a compiler
(or a read-only cache with no prebuilt library) gets `KernelUnavailableError`
with the reason; the engine then uses the torch path. A library that another
user could have replaced (its file or folder writable by others, or owned by
someone other than this user or root) is refused, not loaded.

Where torch runs on GNU libgomp (its Linux wheels), the kernel is built with
`-fopenmp` and shares a step's rows among the calling thread's OpenMP team: the
same libgomp and the same workers as torch's own ops (`shares_torch_openmp`).

ctypes releases the GIL for the call, so the event loop runs during it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11")
BUILD_TIMEOUT_S = 120.0


class KernelUnavailableError(RuntimeError):
    """The native kernel cannot be built or loaded here; the message says why."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchpilot"


def shares_torch_openmp() -> bool:
    """Whether torch runs on OpenMP and a GNU libgomp under its own soname
    (`libgomp.so.1`) is loaded in this process: a library linked with `-fopenmp` then
    binds to that same copy (the loader matches the soname), and its parallel regions
    run on the calling thread's team of torch workers. A renamed copy (a wheel's
    `libgomp-<hash>.so.1`) or another runtime (LLVM's, Intel's) would leave the kernel
    a second pool of threads beside torch's, each spinning for the cores the other
    needs, so the kernel is then built without OpenMP."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    loaded = {Path(line.split()[-1]).name for line in maps.splitlines() if "/" in line}
    return "libgomp.so.1" in loaded and torch.backends.openmp.is_available()


def flags() -> tuple[str, ...]:
    # -fopenmp-simd honours the source's `omp simd` reductions without -ffast-math and
    # leaves out its `omp parallel` (rows on the calling thread alone).
    openmp = "-fopenmp" if shares_torch_openmp() else "-fopenmp-simd"
    return (*BASE_FLAGS, openmp)


def library_path() -> Path:
    """Where the library for this source, these flags and this architecture lives."""
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(" ".join((*flags(), platform.machine())).encode())
    return cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"


def build(target: Path) -> None:
    """Compile to a temporary name, then rename: concurrent builders never see half a file."""
    compiler = os.environ.get("CC", "cc")
    try:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
    except OSError as exc:
        raise KernelUnavailableError(f"cannot write the kernel to {target.parent}: {exc}") from exc
    try:
        done = subprocess.run(
            [compiler, *flags(), "-o", scratch, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise KernelUnavailableError(
                f"{compiler} failed to build {SOURCE.name} (exit {done.returncode}): "
                f"{done.stderr.strip()[-500:]}"
            )
        os.chmod(scratch, 0o755)  # the linker leaves 0711: another user could not load it
        os.replace(scratch, target)
    except FileNotFoundError as exc:
        raise KernelUnavailableError(
            f"no C compiler to build {SOURCE.name}: {compiler!r} not found (set CC)"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise KernelUnavailableError(
            f"{compiler} took over {BUILD_TIMEOUT_S:.0f}s on {SOURCE.name}"
        ) from exc
    finally:
        Path(scratch).unlink(missing_ok=True)


def refuse_if_others_can_replace(path: Path) -> None:
    """Loading a library runs its code: it must be ours (or root's) and writable by no one else."""
    info = path.stat()
    if info.st_uid not in (os.getuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KernelUnavailableError(
            f"refusing to load the kernel: {path} is owned by uid {info.st_uid} with mode "
            f"{stat.S_IMODE(info.st_mode):o}; it must belong to you or root and be writable "
            "by no one else"
        )


@cache
def paged_decode_kernel() -> ctypes._CFuncPtr:
    """The kernel's C function, built on first use; raises `KernelUnavailableError`."""
    target = library_path()
    if not target.exists():
        build(target)
    for path in (target.parent, target):
        refuse_if_others_can_replace(path)
    try:
        library = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelUnavailableError(f"cannot load {target}: {exc}") from exc
    function = library.paged_decode_attention
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [
        *(pointer,) * 3,  # q, k_new, v_new
        *(integer,) * 2,  # q_stride, kv_stride
        *(pointer,) * 2,  # k_pool, v_pool
        integer,  # pool_bf16: the pool (and k_new, v_new) bfloat16, else float32
        pointer,  # tables
        integer,  # width
        pointer,  # lengths
        *(integer,) * 5,  # batch, heads, kv_heads, head_dim, block_size
        ctypes.c_float,  # scale
        pointer,  # out
        integer,  # threads: the most of the caller's OpenMP team the rows may use
    ]
    function.restype = integer  # 0, or -1: no memory for the attention weights
    return function
