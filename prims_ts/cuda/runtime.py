"""NVRTC runtime: compile -> disk cache -> per-device module -> launch.

* Sources are header-free CUDA C++ (``prims_ts/cuda/*.cu`` plus ``include/*.cuh``);
  a kernel is a source text whose one ``extern "C"`` entry point is generated for
  its key (``keys.KernelKey`` and each API's module: ``prefill.py``, ``decode.py``,
  ``block_sparse.py``).
* Compiled to cubin for the device's architecture (``sm_90a`` on Hopper, ``sm_XY``
  elsewhere), so the driver never JIT-compiles PTX.
* Disk cache under ``$PRIMS_TS_CACHE_DIR`` (default ``~/.cache/prims_ts``), keyed
  by a hash of the source, every include, the options, the NVRTC version and the
  arch; entries are written to a temporary file and renamed; a corrupt entry is
  recompiled.
* In-memory cache per (device index, key); launches go to the current torch
  stream of the tensor's device under a device guard, never synchronise, and
  work inside CUDA-graph capture once the module is loaded.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
INCLUDE_DIR = HERE / "include"
_CUBIN_MAGIC = b"\x7fELF"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel; the message carries the key and the compiler log."""


class KernelPerformanceWarning(UserWarning):
    """ptxas serialised a kernel's wgmma pipeline (it runs correctly, and slower)."""


# ptxas's wgmma-pipeline notes (C75xx: "Potential Performance Loss: wgmma.mma_async
# instructions are serialized ...", "warpgroup.wait is injected ..."): each one means that
# a kernel lost its asynchronous MMA overlap. Kept per (arch, kernel name) as compiled in
# this process (a cached cubin is not recompiled); `warmup --strict` fails on any.
_PERF_NOTE = re.compile(r"^.*\(C75\d\d\).*$", re.MULTILINE)
perf_notes: Dict[Tuple[str, str], List[str]] = {}


class KernelLaunchError(RuntimeError):
    """The driver refused to load or launch a kernel."""


def cache_dir() -> Path:
    d = os.environ.get("PRIMS_TS_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "prims_ts"


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except Exception as e:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "prims_ts needs CuPy with NVRTC to compile its kernels "
            "(pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12, or cupy-cuda13x on CUDA 13)"
        ) from e
    return nvrtc


def nvrtc_version() -> Tuple[int, int]:
    return tuple(_nvrtc().getVersion())


def include_sources() -> Dict[str, str]:
    return {p.name: p.read_text() for p in sorted(INCLUDE_DIR.glob("*.cuh"))}


def arch_for_capability(major: int, minor: int) -> str:
    """The NVRTC target for a device: sm_90a on Hopper (wgmma, setmaxnreg), sm_XY elsewhere."""
    if (major, minor) == (9, 0):
        return "sm_90a"
    return f"sm_{major}{minor}"


def _options(arch: str) -> list:
    return [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "--use_fast_math",
        "--extra-device-vectorization",
        "-default-device",
    ]


@dataclass(frozen=True)
class KernelSource:
    """What NVRTC compiles for one kernel key."""

    key: str  # human-readable, e.g. "prefill:bf16:d128:causal:bm128:bn64"
    name: str  # the extern "C" entry point
    source: str  # full translation unit (includes resolved from include/)


def _digest(ks: KernelSource, arch: str, headers: Dict[str, str]) -> str:
    h = hashlib.sha256()
    for part in (ks.source, ks.name, arch, repr(_options(arch)), repr(nvrtc_version())):
        h.update(part.encode())
        h.update(b"\0")
    for name, text in headers.items():
        h.update(name.encode())
        h.update(text.encode())
    return h.hexdigest()[:32]


_compile_lock = threading.Lock()


def cache_path(ks: KernelSource, arch: str) -> Path:
    return cache_dir() / arch / f"{ks.name}-{_digest(ks, arch, include_sources())}.cubin"


def compile_cubin(ks: KernelSource, arch: str, use_cache: bool = True) -> bytes:
    """Compile (or fetch from the disk cache) one kernel for `arch`; returns cubin bytes."""
    headers = include_sources()
    path = cache_path(ks, arch)
    if use_cache:
        try:
            data = path.read_bytes()
            if data.startswith(_CUBIN_MAGIC) and len(data) > 64:
                return data
        except OSError:
            pass
    nvrtc = _nvrtc()
    with _compile_lock:
        prog = nvrtc.createProgram(
            ks.source, f"{ks.name}.cu", [v.encode() for v in headers.values()], [n.encode() for n in headers]
        )
        try:
            try:
                nvrtc.compileProgram(prog, _options(arch))
            except Exception as e:
                try:
                    log = nvrtc.getProgramLog(prog)
                except Exception:
                    log = "(no log)"
                raise KernelCompileError(f"NVRTC failed to compile kernel {ks.key!r} for {arch}: {e}\n{log}") from None
            data = nvrtc.getCUBIN(prog)
            try:
                log = nvrtc.getProgramLog(prog)
            except Exception:
                log = ""
        finally:
            nvrtc.destroyProgram(prog)
    if isinstance(data, str):  # older CuPy returns str
        data = data.encode("latin-1")
    notes = [n.strip() for n in _PERF_NOTE.findall((log or "").replace("\0", ""))]
    if notes:
        perf_notes[(arch, ks.name)] = notes
        warnings.warn(f"kernel {ks.key!r} ({arch}): " + "; ".join(notes), KernelPerformanceWarning, stacklevel=2)
    _atomic_write(path, data)
    return data


def compile_ptx(source: str, name: str, arch: str) -> str:
    """The PTX of one translation unit (the include/ headers available) for `arch`'s virtual
    architecture (sm_90a: compute_90a): what tests and tools read of a kernel without a GPU.
    No cache; a compile error raises ``KernelCompileError`` with NVRTC's log."""
    nvrtc, headers = _nvrtc(), include_sources()
    prog = nvrtc.createProgram(source, f"{name}.cu", [v.encode() for v in headers.values()],
                               [n.encode() for n in headers])
    try:
        try:
            nvrtc.compileProgram(prog, [o.replace(arch, "compute_" + arch[3:]) for o in _options(arch)])
        except Exception as e:
            raise KernelCompileError(f"NVRTC failed to compile {name!r} for {arch}: {e}\n"
                                     f"{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _atomic_write(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs recompiles


# ----------------------------------------------------------------------------
# Loading and launching (needs a GPU)
# ----------------------------------------------------------------------------


@dataclass
class LoadedKernel:
    func: int  # CUfunction
    smem: int  # dynamic shared memory bytes
    threads: int
    ctx: int = 0  # the CUcontext the module was loaded into (the device's primary context)
    smem_max: int = 0  # the function's dynamic shared memory limit as set (reserve_smem)
    module: int = 0  # the CUmodule (its globals: a measurement aid's, e.g. PT_TWIN_TRACE's)


_loaded: Dict[Tuple[int, str], LoadedKernel] = {}
_load_lock = threading.Lock()


def _driver():
    from cupy_backends.cuda.api import driver

    return driver


def device_arch(device_index: int) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device_index)
    return arch_for_capability(major, minor)


def get_kernel(device_index: int, ks: KernelSource, smem: int, threads: int) -> LoadedKernel:
    """The loaded kernel for (device, key), compiling and loading on first use.

    Loading is not allowed during CUDA-graph capture: warm every key first.
    """
    k = _loaded.get((device_index, ks.key))
    if k is not None:
        return k
    import torch

    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"prims_ts kernel {ks.key!r} is not loaded yet on cuda:{device_index}; "
            "run the call once before CUDA-graph capture (or call prims_ts warmup)"
        )
    with _load_lock:
        k = _loaded.get((device_index, ks.key))
        if k is not None:
            return k
        arch = device_arch(device_index)
        drv = _driver()
        with torch.cuda.device(device_index):
            torch.cuda.init()
            torch.cuda.current_stream(device_index)  # make torch's primary context current
            for use_cache in (True, False):  # a cached cubin the driver rejects is rebuilt once
                cubin = compile_cubin(ks, arch, use_cache=use_cache)
                try:
                    mod = drv.moduleLoadData(cubin)
                    func = drv.moduleGetFunction(mod, ks.name)
                    break
                except Exception as e:
                    if not use_cache:
                        raise KernelLaunchError(f"could not load kernel {ks.key!r} on cuda:{device_index}: {e}") from e
            try:
                if smem > 48 * 1024:
                    drv.funcSetAttribute(func, drv.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
            except Exception as e:
                raise KernelLaunchError(
                    f"kernel {ks.key!r} needs {smem} bytes of shared memory, more than cuda:{device_index} allows: {e}"
                ) from e
            ctx = _libcuda().current_context()
        k = LoadedKernel(func=func, smem=smem, threads=threads, ctx=ctx, smem_max=smem, module=mod)
        _loaded[(device_index, ks.key)] = k
        return k


@contextlib.contextmanager
def _in_context(ctx: int):
    """Plan-time driver calls in a kernel's context (`ctx` current, the caller's restored);
    launches inline the same switch."""
    lib = _libcuda()
    cur = lib.current_context()
    if cur != ctx:
        lib.cuCtxSetCurrent(ctypes.c_void_p(ctx))
    try:
        yield lib
    finally:
        if cur != ctx:
            lib.cuCtxSetCurrent(ctypes.c_void_p(cur))


def reserve_smem(kernel: LoadedKernel, smem: int, name: str) -> None:
    """Let `kernel` launch with `smem` bytes of dynamic shared memory (more than its key's:
    a launch shape that keeps extra bytes, e.g. decode's cluster merge). Plans call it, not
    runs: it may call the driver."""
    if smem <= max(kernel.smem_max, 48 * 1024):
        return
    with _in_context(kernel.ctx):  # the kernel's context current, as its loading had it
        try:
            _driver().funcSetAttribute(kernel.func, _driver().CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
        except Exception as e:
            raise KernelLaunchError(f"kernel {name!r} cannot take {smem} bytes of shared memory: {e}") from e
    kernel.smem_max = smem


class TensorMap(ctypes.Structure):
    """CUtensorMap: 128 opaque bytes (pt::TmaMap, 64-byte aligned in a kernel's parameters)."""

    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def padded_to(cls, align: int):
    """`cls` (a ctypes.Structure) with tail bytes up to a multiple of `align`: the size of a C++
    struct whose alignment is `align` (a member declared alignas(align))."""
    name, kind = cls._fields_[-1][:2]
    end = getattr(cls, name).offset + ctypes.sizeof(kind)
    pad = (-end) % align
    if not pad:
        return cls
    return type(cls.__name__, (ctypes.Structure,),
                {"__doc__": cls.__doc__, "_fields_": list(cls._fields_) + [("_tail", ctypes.c_uint8 * pad)]})


_TMA_DTYPES = {"f16": 6, "bf16": 9}  # CUtensorMapDataType


class TileMapEncoder:
    """cuTensorMapEncodeTiled for one tensor layout: a map over `dims` (innermost first) with
    byte strides `strides` (dims 1..), boxes of `box` elements, the 128-byte swizzle and zeros
    for elements outside the tensor; ``encode(map, address)`` writes the map of the tensor at
    `address` (a plan re-encodes only when an address changes). The driver wants the map it
    writes 64-byte aligned (128 on newer drivers), which a ctypes struct is not: it encodes
    into an aligned scratch map of its own and copies the bytes (a map is position-free)."""

    __slots__ = ("_args", "_fn", "what", "_scratch", "_map")

    def __init__(self, dtype: str, dims: Sequence[int], strides: Sequence[int], box: Sequence[int], what: str):
        rank = len(dims)
        u64s, u32s = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
        self.what = what
        self._fn = _libcuda().cuTensorMapEncodeTiled
        if self._fn is None:
            raise KernelLaunchError("this CUDA driver has no cuTensorMapEncodeTiled (CUDA 12.0+), which TMA keys need")
        self._args = (ctypes.c_int(_TMA_DTYPES[dtype]), ctypes.c_uint32(rank), u64s(*dims),
                      (ctypes.c_uint64 * (rank - 1))(*strides), u32s(*box), u32s(*([1] * rank)),
                      ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(2), ctypes.c_int(0))
        self._scratch = (ctypes.c_uint8 * (2 * ctypes.sizeof(TensorMap)))()
        at = ctypes.addressof(self._scratch)
        self._map = ctypes.c_void_p(at + (-at) % 128)

    def encode(self, out: TensorMap, address: int) -> None:
        a = self._args
        rc = self._fn(self._map, a[0], a[1], ctypes.c_void_p(address), *a[2:])
        if rc:
            raise KernelLaunchError(f"cuTensorMapEncodeTiled failed for {self.what}: {_libcuda().error(rc)}")
        ctypes.memmove(ctypes.addressof(out), self._map, ctypes.sizeof(TensorMap))


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig: grid, block, shared memory and stream of one cuLaunchKernelEx."""

    _fields_ = [(n, ctypes.c_uint) for n in (
        "gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY", "blockDimZ", "sharedMemBytes")] + [
        ("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


class _LaunchAttr(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value (here a cluster shape)."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_uint), ("x", ctypes.c_uint), ("y", ctypes.c_uint),
                ("z", ctypes.c_uint), ("rest", ctypes.c_ubyte * 52)]


_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
assert ctypes.sizeof(_LaunchAttr) == 72


class _LibCuda:
    """The libcuda entry points a launch calls, through ctypes with prepared arguments (a
    launch through CuPy's wrapper costs several microseconds more; ctypes converts each
    argument of a call, so a launch passes four: cuLaunchKernelEx with a prepared config,
    where the driver has it, CUDA 12.0 on)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.cuLaunchKernel = lib.cuLaunchKernel
        self.cuLaunchKernelEx = getattr(lib, "cuLaunchKernelEx", None)
        self.cuTensorMapEncodeTiled = getattr(lib, "cuTensorMapEncodeTiled", None)
        self.cuCtxGetCurrent = lib.cuCtxGetCurrent
        self.cuCtxSetCurrent = lib.cuCtxSetCurrent
        self.cuGetErrorString = lib.cuGetErrorString
        self.cuMemcpyDtoHAsync = lib.cuMemcpyDtoHAsync_v2
        self.cuMemcpyHtoDAsync = lib.cuMemcpyHtoDAsync_v2
        self.cuStreamSynchronize = lib.cuStreamSynchronize
        self.cuOccupancyMaxActiveClusters = getattr(lib, "cuOccupancyMaxActiveClusters", None)
        self.cuEventCreate = lib.cuEventCreate
        self.cuEventRecord = lib.cuEventRecord
        self.cuEventSynchronize = lib.cuEventSynchronize
        self.cuMemHostAlloc = lib.cuMemHostAlloc
        self.cuMemHostAlloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint)
        self.cuMemFreeHost = lib.cuMemFreeHost
        self.cuMemFreeHost.argtypes = (ctypes.c_void_p,)
        self.cuMemHostGetDevicePointer = lib.cuMemHostGetDevicePointer_v2
        self.cuMemHostGetDevicePointer.argtypes = (ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint)
        for f in (self.cuMemcpyDtoHAsync, self.cuMemcpyHtoDAsync):
            f.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        self._ctx = ctypes.c_void_p()
        self._ctx_ref = ctypes.byref(self._ctx)

    def current_context(self) -> int:
        rc = self.cuCtxGetCurrent(self._ctx_ref)
        if rc:
            raise KernelLaunchError(f"cuCtxGetCurrent failed: {self.error(rc)}")
        return self._ctx.value or 0

    def error(self, rc: int) -> str:
        msg = ctypes.c_char_p()
        self.cuGetErrorString(rc, ctypes.byref(msg))
        return f"CUDA error {rc}" + (f" ({msg.value.decode()})" if msg.value else "")


_libcuda_handle = None


def _libcuda() -> _LibCuda:
    global _libcuda_handle
    if _libcuda_handle is None:
        _libcuda_handle = _LibCuda()
    return _libcuda_handle


class PreparedLaunch:
    """A loaded kernel with its grid, block, shared memory and by-value parameter struct:
    what a plan owns. The caller writes the live fields of ``params`` (pointers, strides)
    and calls ``launch(stream)``; the driver copies the struct at launch, so the next call
    may rewrite it at once (and a CUDA graph keeps the values it captured). One thread at a
    time: a plan is not shared between threads that launch concurrently."""

    __slots__ = ("name", "params", "ctx", "empty", "grid", "kernel", "cluster", "smem", "_cfg", "_attr", "_launch",
                 "_args", "_argv")

    def __init__(self, kernel: LoadedKernel, name: str, grid: Sequence[int], params: ctypes.Structure,
                 cluster: int = 1, smem: Optional[int] = None):
        """`cluster` > 1: blocks of that many CTAs along x form one thread block cluster (sm_90;
        gx a multiple of it); `smem`: dynamic shared memory other than the kernel's own
        (raised on the function first: reserve_smem)."""
        gx, gy, gz = (list(grid) + [1, 1])[:3]
        self.name, self.kernel = name, kernel
        self.params = params
        self.ctx = kernel.ctx
        self.empty = gx * gy * gz == 0
        self.grid = (gx, gy, gz)
        self.cluster = cluster
        self.smem = kernel.smem if smem is None else smem
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self._attr = None
        drv = _libcuda()
        if cluster > 1 and (drv.cuLaunchKernelEx is None or gx % cluster):
            raise KernelLaunchError(f"{name}: a cluster of {cluster} CTAs needs cuLaunchKernelEx and a grid x "
                                    f"that it divides, got {gx}")
        if drv.cuLaunchKernelEx is not None:
            if cluster > 1:
                self._attr = (_LaunchAttr * 1)()
                self._attr[0].id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                self._attr[0].x, self._attr[0].y, self._attr[0].z = cluster, 1, 1
            self._cfg = _LaunchConfig(gx, gy, gz, kernel.threads, 1, 1, self.smem, None,
                                      None if self._attr is None else ctypes.addressof(self._attr),
                                      0 if self._attr is None else 1)
            self._args = (ctypes.byref(self._cfg), ctypes.c_void_p(kernel.func), self._argv, None)
            self._launch = drv.cuLaunchKernelEx
        else:
            self._cfg = None
            self._args = (ctypes.c_void_p(kernel.func), ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz),
                          ctypes.c_uint(kernel.threads), ctypes.c_uint(1), ctypes.c_uint(1), ctypes.c_uint(self.smem))
            self._launch = drv.cuLaunchKernel

    def with_params(self, params: ctypes.Structure) -> "PreparedLaunch":
        """The same kernel, grid, cluster and shared memory over another parameter struct (a
        plan's own copy)."""
        return PreparedLaunch(self.kernel, self.name, self.grid, params, self.cluster, self.smem)

    def set_grid_x(self, gx: int) -> None:
        """Another x extent of the grid (a kernel whose block count follows its work: the read)."""
        self.grid = (gx,) + self.grid[1:]
        self.empty = gx * self.grid[1] * self.grid[2] == 0
        if self._cfg is not None:
            self._cfg.gridDimX = gx
        else:
            self._args = (self._args[0], ctypes.c_uint(gx)) + self._args[2:]

    def active_clusters(self) -> Optional[int]:
        """How many of this launch's clusters the device holds at once (an SM partition, e.g.
        under MPS, may hold none; a GPC's SMs that do not make a whole cluster hold none of
        them). Plans ask it, not runs; None without a cluster or without the driver's query, 0
        (with a warning) when the query fails."""
        lib = _libcuda()
        if self.cluster <= 1 or lib.cuOccupancyMaxActiveClusters is None:
            return None
        n = ctypes.c_int(0)
        with _in_context(self.ctx):
            rc = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(self.kernel.func),
                                                  ctypes.byref(self._cfg))
        if rc:  # an unanswered query: the launch without a cluster (always valid), said once
            warnings.warn(f"prims_ts: cuOccupancyMaxActiveClusters failed for {self.name!r} ({lib.error(rc)}); "
                          "launching without a thread block cluster", RuntimeWarning, stacklevel=2)
            return 0
        return n.value

    def launch(self, stream: int) -> None:
        """Launch on `stream` (a raw CUstream) in the kernel's context. No host sync."""
        if self.empty:
            return
        drv = _libcuda_handle
        cur = drv.current_context()
        if cur != self.ctx:
            drv.cuCtxSetCurrent(ctypes.c_void_p(self.ctx))
        try:
            if self._cfg is not None:
                self._cfg.hStream = stream
                rc = self._launch(*self._args)
            else:
                rc = self._launch(*self._args, ctypes.c_void_p(stream), self._argv, None)
        finally:
            if cur != self.ctx:
                drv.cuCtxSetCurrent(ctypes.c_void_p(cur))
        if rc:
            raise KernelLaunchError(f"launch of {self.name!r} grid={self.grid} failed: {drv.error(rc)}")


# ----------------------------------------------------------------------------
# Metadata between the host and a device: one pinned buffer per thread and device
# ----------------------------------------------------------------------------

_CU_EVENT_DISABLE_TIMING = 2
_contexts: Dict[int, int] = {}


def _device_context(device_index: int) -> int:
    """torch's (primary) context of a device, which the copies below run in."""
    ctx = _contexts.get(device_index)
    if ctx is None:
        import torch

        with torch.cuda.device(device_index):
            torch.cuda.current_stream(device_index)
            ctx = _libcuda().current_context()
        _contexts[device_index] = ctx
    return ctx


class _Pinned:
    """A page-locked int32 host buffer (a torch tensor and its NumPy view) and, for uploads,
    the event of the last copy that read it."""

    __slots__ = ("tensor", "array", "address", "event", "pending")

    def __init__(self, n: int):
        import torch

        self.tensor = torch.empty(n, dtype=torch.int32, pin_memory=True)
        self.array = self.tensor.numpy()
        self.address = self.tensor.data_ptr()
        self.event = None
        self.pending = False

    def __del__(self):
        # an upload may still read the buffer (its thread ended right after a one-shot): the
        # host allocator must not hand the memory on before it has
        if self.pending and self.event is not None and _libcuda_handle is not None:
            try:
                _libcuda_handle.cuEventSynchronize(self.event)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


class _Mapped:
    """A page-locked int32 host buffer mapped into the device address space (what a kernel
    writes to directly): its NumPy view, host and device addresses."""

    __slots__ = ("device_index", "address", "device_address", "array", "__weakref__")

    _DEVICEMAP_PORTABLE = 0x03  # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP

    def __init__(self, device_index: int, n: int):
        import numpy as np

        drv = _libcuda()
        self.device_index = device_index
        ptr, dev = ctypes.c_void_p(), ctypes.c_uint64()
        with _OnDevice(device_index):
            _check(drv.cuMemHostAlloc(ctypes.byref(ptr), 4 * n, self._DEVICEMAP_PORTABLE), "cuMemHostAlloc")
            self.address = ptr.value
            _check(drv.cuMemHostGetDevicePointer(ctypes.byref(dev), ptr, 0), "cuMemHostGetDevicePointer")
        self.device_address = dev.value
        view = (ctypes.c_int32 * n).from_address(self.address)
        view.owner = self  # every NumPy view of the memory keeps it allocated
        self.array = np.ctypeslib.as_array(view)
        self.array[:] = 0

    def __del__(self):
        if getattr(self, "address", None) and _libcuda_handle is not None:
            try:
                with _OnDevice(self.device_index):
                    _libcuda_handle.cuMemFreeHost(ctypes.c_void_p(self.address))
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


READ_THREADS = 256
READ_MAX_SPANS = 8  # pt::kReadMaxSpans (read_int32.cu)
_READ_BLOCK = 4096  # elements a block of the read kernel copies, at least
_READ_MAX_BLOCKS = 64
_READ_SPIN_S = 200e-6  # then a blocking wait (which releases the GIL) for a longer queue


def read_source() -> "KernelSource":
    """The read kernel (read_int32.cu): compiled and loaded like any key, listed by warmup."""
    entry = (f'extern "C" __global__ void __launch_bounds__({READ_THREADS})\n'
             "pt_read_int32(const __grid_constant__ pt::ReadParams p) {\n  pt::read_int32(p);\n}\n")
    return KernelSource(key="read_int32", name="pt_read_int32", source=(HERE / "read_int32.cu").read_text() + entry)


class _ReadParams(ctypes.Structure):
    """pt::ReadParams (read_int32.cu)."""

    _fields_ = [("src", ctypes.c_void_p * READ_MAX_SPANS), ("start", ctypes.c_int * (READ_MAX_SPANS + 1)),
                ("n", ctypes.c_int), ("chunk", ctypes.c_int), ("seq", ctypes.c_int), ("dst", ctypes.c_void_p),
                ("flags", ctypes.c_void_p)]


class _Reader:
    """One thread's read kernel on one device: its parameter struct and launch, the mapped
    buffers the kernel writes (the values, a flag a block) and the last flag value."""

    __slots__ = ("device_index", "params", "launch", "data", "flags", "seq", "pending")  # pending: a stream

    def __init__(self, device_index: int):
        self.device_index = device_index
        self.params = _ReadParams()
        ks = read_source()
        self.launch = PreparedLaunch(get_kernel(device_index, ks, 0, READ_THREADS), ks.name, (1, 1, 1), self.params)
        self.flags = _Mapped(device_index, _READ_MAX_BLOCKS)
        self.params.flags = self.flags.device_address
        self.data = None
        self.seq = 0
        self.pending = None  # the stream of a read launched and not seen landing (its wait was interrupted)

    def buffer(self, n: int) -> _Mapped:
        if self.pending is not None:  # that read's kernel may still write the buffers: let it finish first
            with _OnDevice(self.device_index):
                _check(_libcuda().cuStreamSynchronize(ctypes.c_void_p(self.pending)), "cuStreamSynchronize")
            self.pending = None
        if self.data is None or self.data.array.shape[0] < n:
            self.data = _Mapped(self.device_index, max(n, 4096, 2 * (self.data.array.shape[0] if self.data else 0)))
            self.params.dst = self.data.device_address
        return self.data


class _Staging(threading.local):
    def __init__(self):
        self.readers: Dict[int, _Reader] = {}
        self.up: Dict[int, _Pinned] = {}


_staging = _Staging()


def _check(rc: int, what: str) -> None:
    if rc:
        raise KernelLaunchError(f"{what} failed: {_libcuda().error(rc)}")


def _buffer(table: Dict[int, _Pinned], device_index: int, n: int) -> _Pinned:
    buf = table.get(device_index)
    if buf is None or buf.array.shape[0] < n:
        if buf is not None and buf.pending:  # a copy may still read the old buffer
            _check(_libcuda().cuEventSynchronize(buf.event), "cuEventSynchronize")
            buf.pending = False
        grown = _Pinned(max(n, 4096, 2 * (buf.array.shape[0] if buf is not None else 0)))
        if buf is not None:
            grown.event = buf.event  # one event per thread and device
        table[device_index] = buf = grown
    return buf


class _OnDevice:
    """torch's context of a device made current for a few driver calls (the caller's context
    restored after); entering gives torch's current raw stream on the device."""

    __slots__ = ("ctx", "cur", "stream")

    def __init__(self, device_index: int):
        self.ctx = _device_context(device_index)
        self.stream = current_stream(device_index)

    def __enter__(self) -> int:
        self.cur = _libcuda().current_context()
        if self.cur != self.ctx:
            _libcuda_handle.cuCtxSetCurrent(ctypes.c_void_p(self.ctx))
        return self.stream

    def __exit__(self, *exc) -> None:
        if self.cur != self.ctx:
            _libcuda_handle.cuCtxSetCurrent(ctypes.c_void_p(self.cur))


def read_int32(device_index: int, spans: Sequence[Tuple[int, int]]):
    """The int32 values of device ranges (address, element count; at most READ_MAX_SPANS), back
    to back in one NumPy array, in stream order on torch's current stream: one launch of the
    read kernel, which writes them into host-mapped memory and raises a flag a block; the host
    spins on the flags (and after _READ_SPIN_S waits for the stream, which raises a pending
    CUDA error). The array is a view of this thread's mapped buffer, valid until its next read:
    copy what is kept. Not during CUDA-graph capture."""
    if len(spans) > READ_MAX_SPANS:
        raise ValueError(f"read_int32: at most {READ_MAX_SPANS} ranges a read, got {len(spans)}")
    total = sum(n for _, n in spans)
    reader = _staging.readers.get(device_index)
    if reader is None:
        reader = _staging.readers[device_index] = _Reader(device_index)
    buf = reader.buffer(total)
    if total == 0:
        return buf.array[:0]
    p = reader.params
    at = 0
    for s, (address, n) in enumerate(spans):
        p.src[s] = address
        p.start[s] = at
        at += n
    p.start[len(spans)] = at
    p.n = len(spans)
    blocks = min(-(-total // _READ_BLOCK), _READ_MAX_BLOCKS)
    p.chunk = -(-total // blocks)
    reader.seq = seq = reader.seq % 0x7FFFFFFF + 1  # never 0, the flags' first value
    p.seq = seq
    if reader.launch.grid[0] != blocks:
        reader.launch.set_grid_x(blocks)
    stream = current_stream(device_index)
    reader.pending = stream
    reader.launch.launch(stream)
    flags = reader.flags.array
    if blocks == 1:
        landed = lambda: flags[0] == seq  # noqa: E731
    else:
        part = flags[:blocks]
        landed = lambda: bool((part == seq).all())  # noqa: E731
    spins, deadline = 0, None
    while not landed():
        spins += 1
        if spins & 63:
            continue
        now = time.perf_counter()
        if deadline is None:
            deadline = now + _READ_SPIN_S
        elif now > deadline:  # a long queue ahead: block (releasing the GIL), then the flags
            with _OnDevice(device_index):
                _check(_libcuda_handle.cuStreamSynchronize(ctypes.c_void_p(stream)), "cuStreamSynchronize")
            if not landed():
                raise KernelLaunchError(f"read of device metadata on cuda:{device_index}: the stream completed "
                                        f"but {blocks} block flag(s) did not reach {seq}")
            break
    reader.pending = None
    return buf.array[:total]


def write_int32(device_index: int, values, address: int) -> None:
    """Copy a host int32 array (C-contiguous) to device memory at `address`, asynchronously on
    torch's current stream, through this thread's pinned upload buffer (whose previous copy is
    waited for before it is overwritten: an event, normally long complete). Not during
    CUDA-graph capture."""
    n = values.size
    if not n:
        return
    with _OnDevice(device_index) as stream:
        drv = _libcuda_handle
        buf = _buffer(_staging.up, device_index, n)
        if buf.event is None:
            ev = ctypes.c_void_p()
            _check(drv.cuEventCreate(ctypes.byref(ev), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            buf.event = ev
        elif buf.pending:
            _check(drv.cuEventSynchronize(buf.event), "cuEventSynchronize")
        buf.array[:n] = values.reshape(-1)
        _check(drv.cuMemcpyHtoDAsync(address, buf.address, 4 * n, stream), "cuMemcpyHtoDAsync")
        _check(drv.cuEventRecord(buf.event, ctypes.c_void_p(stream)), "cuEventRecord")
        buf.pending = True


def current_stream(device_index: int) -> int:
    """The raw CUstream of torch's current stream on `device_index` (no Stream object)."""
    import torch

    return torch._C._cuda_getCurrentRawStream(device_index)
