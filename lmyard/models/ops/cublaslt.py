"""cuBLASLt matrix products with fused epilogues, called through ctypes on the library torch loaded.

torch calls cuBLASLt for `addmm` with a bias epilogue, but not for the epilogues a GELU MLP's
training step can use: GELU_AUX_BIAS (one product writes both gelu(x @ w.T + b) and its input) and
DGELU (the gradient's product multiplied by gelu'(input) as it is written). Each saves a pass of an
elementwise kernel over the (tokens, 4d) activations. (DGELU_BGRAD, which also sums the bias
gradient, runs that sum as a second, slower kernel on H100: docs/history/benchmarks-log.md.)

Design notes: docs/models.md, `lmyard/models/ops/cublaslt.py`.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

EPILOGUES = {"gelu_aux_bias": 164, "dgelu": 192}  # cublasLtEpilogue_t
_DATA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}  # cudaDataType
_COMPUTE_32F, _OP_N, _OP_T = 68, 0, 1
_TRANSA, _TRANSB, _EPILOGUE, _BIAS_POINTER, _AUX_POINTER, _AUX_LD = 3, 4, 7, 8, 11, 12  # matmul desc attributes
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", ctypes.c_uint64 * 8),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_P, _I, _U64, _I64, _SZ = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
_SIGNATURES = {
    "cublasLtCreate": [_P],
    "cublasLtMatmulDescCreate": [_P, _I, _I],
    "cublasLtMatmulDescSetAttribute": [_P, _I, _P, _SZ],
    "cublasLtMatrixLayoutCreate": [_P, _I, _U64, _U64, _I64],
    "cublasLtMatmulPreferenceCreate": [_P],
    "cublasLtMatmulPreferenceSetAttribute": [_P, _I, _P, _SZ],
    "cublasLtMatmulAlgoGetHeuristic": [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P],
    "cublasLtMatmul": [_P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _SZ, _P],
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """libcublasLt as this process loaded it with torch's CUDA runtime, or None (no CUDA, not loaded)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "libcublasLt.so" in line), None)
    except OSError:  # not Linux
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@functools.cache
def _handle(device: int) -> tuple[ctypes.c_void_p, torch.Tensor]:
    """One cuBLASLt handle and workspace per device."""
    lib = library()
    assert lib is not None
    handle = ctypes.c_void_p()
    _check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    return handle, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device}")


def _set(
    lib: ctypes.CDLL, desc: ctypes.c_void_p, attr: int, value: ctypes.c_int | ctypes.c_int64 | ctypes.c_void_p
) -> None:
    _check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "set attribute")


def _layout(lib: ctypes.CDLL, dtype: int, rows: int, cols: int) -> ctypes.c_void_p:
    """A column-major rows x cols matrix, packed (ld = rows): a row-major (cols, rows) tensor."""
    layout = ctypes.c_void_p()
    _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), dtype, rows, cols, rows), "layout")
    return layout


@dataclass(frozen=True)
class _Plan:
    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    d: ctypes.c_void_p
    algo: _Heuristic


_Key = tuple[int, str, torch.dtype, int, int, int, bool]  # device, epilogue, dtype, m, n, k, w_t
_PLANS: dict[_Key, _Plan | None] = {}


def _plan(key: _Key, bias: torch.Tensor | None, aux: torch.Tensor | None) -> _Plan | None:
    """Descriptors and the heuristic's first algorithm for D (n x m, column-major) = op(W) (n x k) @ X^T (k x m):
    the row-major (m, n) product of x (m, k) and w; made on the first call with `key`'s shapes. None where
    cuBLASLt has no algorithm for it."""
    if key not in _PLANS:
        _PLANS[key] = _new_plan(key, bias, aux)
    return _PLANS[key]


def _new_plan(key: _Key, bias: torch.Tensor | None, aux: torch.Tensor | None) -> _Plan | None:
    device, epilogue, dtype, m, n, k, w_t = key
    lib, (handle, _) = library(), _handle(device)
    assert lib is not None
    dt = _DATA_TYPE[dtype]
    desc = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _DATA_TYPE[torch.float32]), "desc")
    _set(lib, desc, _TRANSA, ctypes.c_int(_OP_N if w_t else _OP_T))
    _set(lib, desc, _TRANSB, ctypes.c_int(_OP_N))
    _set(lib, desc, _EPILOGUE, ctypes.c_int(EPILOGUES[epilogue]))
    _set(lib, desc, _AUX_LD, ctypes.c_int64(n))
    _set_pointers(lib, desc, bias, aux)  # the heuristic reads their alignment
    a = _layout(lib, dt, n, k) if w_t else _layout(lib, dt, k, n)
    b, d = _layout(lib, dt, k, m), _layout(lib, dt, n, m)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
    size = ctypes.c_size_t(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8), "pref")
    found, count = _Heuristic(), ctypes.c_int(0)
    status = lib.cublasLtMatmulAlgoGetHeuristic(
        handle, desc, a, b, d, d, pref, 1, ctypes.byref(found), ctypes.byref(count)
    )
    if status != 0 or count.value == 0:
        return None
    return _Plan(desc, a, b, d, found)


def _set_pointers(lib: ctypes.CDLL, desc: ctypes.c_void_p, bias: torch.Tensor | None, aux: torch.Tensor | None) -> None:
    if bias is not None:
        _set(lib, desc, _BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
    if aux is not None:
        _set(lib, desc, _AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))


def planned() -> set[str]:
    """The epilogues this process has a plan for: those its products actually ran through cuBLASLt."""
    return {key[1] for key, plan in _PLANS.items() if plan is not None}


def _aligned(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    epilogue: str,
    bias: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    w_t: bool = False,
) -> torch.Tensor | None:
    """`x @ w.T` (or `x @ w` with `w_t`) through cuBLASLt with `epilogue` (EPILOGUES), or None where it cannot
    run (no library, no plan, unaligned or strided operands): the caller falls back to torch.

    - "gelu_aux_bias": out = gelu_tanh(x @ w.T + bias); `aux` (M, N) receives x @ w.T + bias.
    - "dgelu": out = (x @ w) * gelu_tanh'(aux).
    """
    m, k = x.shape
    n = w.size(1) if w_t else w.size(0)
    ok = library() is not None and x.dtype in _DATA_TYPE and x.dtype == w.dtype and x.is_cuda
    if not (ok and x.is_contiguous() and w.is_contiguous() and _aligned(x, w, bias, aux) and n % 8 == 0):
        return None
    plan = _plan((x.device.index, epilogue, x.dtype, m, n, k, w_t), bias, aux)
    if plan is None:
        return None
    lib = library()
    assert lib is not None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _set_pointers(lib, plan.desc, bias, aux)
    handle, workspace = _handle(x.device.index)
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    status = lib.cublasLtMatmul(
        handle, plan.desc, ctypes.byref(one), w.data_ptr(), plan.a, x.data_ptr(), plan.b, ctypes.byref(zero),
        out.data_ptr(), plan.d, out.data_ptr(), plan.d, ctypes.byref(plan.algo.algo), workspace.data_ptr(),
        WORKSPACE_BYTES, stream,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(
            f"cuBLASLt matmul ({epilogue}, {m}x{n}x{k}, {x.dtype}) failed with status {status}; "
            "LMYARD_MLP_EPILOGUES=0 in the environment runs GPT-2's MLP without cuBLASLt's epilogues"
        )
    return out
