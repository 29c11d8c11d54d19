"""ONNX Runtime sessions with an explicit execution-provider choice that is checked.

onnxruntime-gpu falls back to the CPU silently when CUDA cannot be loaded; here a session that
did not get the provider asked for is an error unless ``allow_fallback`` is set, and the
provider it really got is always readable from :func:`session_provider`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import onnxruntime as ort

from models.errors import ProviderUnavailableError

log = logging.getLogger(__name__)

#: Short names accepted everywhere (CLI flags, settings, manifests).
PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def resolve_providers(providers: str | Sequence[str]) -> list[str]:
    """Turn ``"cuda,cpu"`` or ``["cuda", "cpu"]`` into ONNX Runtime provider names."""
    if isinstance(providers, str):
        providers = [p.strip() for p in providers.split(",") if p.strip()]
    resolved = []
    for name in providers:
        full = PROVIDER_NAMES.get(name.lower(), name)
        if full not in PROVIDER_NAMES.values():
            raise ValueError(f"unknown execution provider {name!r}; known: {sorted(PROVIDER_NAMES)}")
        resolved.append(full)
    if not resolved:
        raise ValueError("at least one execution provider is needed")
    return resolved


#: Whether sessions opened from now on use ONNX Runtime's CPU memory arena (see
#: :func:`use_cpu_memory_arena`).
_cpu_memory_arena = True


def use_cpu_memory_arena(enabled: bool) -> None:
    """Open later sessions with or without ONNX Runtime's CPU memory arena (on by default).

    The arena keeps the largest activations a session ever ran and never hands them back. Batch
    work wants it: without it every run of a 64-crop batch maps and faults in its activations
    afresh (LFW with ``sphereface_celeba``: 265 s against 196 s, a minute of it system time). A
    serving worker does not: pyramid levels and batches vary per photo, and without the arena what
    a large photo needed is malloc'd per run, so a trim gives it back (``service.memory``), at the
    same CPU time per photo (docs/results/face-path.md)."""
    global _cpu_memory_arena
    _cpu_memory_arena = bool(enabled)


def create_session(
    model_path: str | Path,
    providers: str | Sequence[str] = "cpu",
    *,
    intra_op_threads: int = 0,
    allow_fallback: bool = False,
) -> ort.InferenceSession:
    """Open an ONNX model on the first provider of ``providers`` and check that it got it.

    Args:
        model_path: path of the ``.onnx`` file.
        providers: preference order, e.g. ``"cuda,cpu"``; the first one is the one asked for.
        intra_op_threads: threads per operator; 0 lets ONNX Runtime choose (one per core).
        allow_fallback: if False (default), raise when the first provider is not the one the
            session really runs on; if True, log a warning and go on with what it got.

    Raises:
        ProviderUnavailableError: the requested provider is not installed or failed to load.
    """
    wanted = resolve_providers(providers)
    if "CUDAExecutionProvider" in wanted:
        _preload_cuda_libraries()
    available = ort.get_available_providers()
    missing = [p for p in wanted if p not in available]
    if wanted[0] in missing and not allow_fallback:
        raise ProviderUnavailableError(
            f"{wanted[0]} is not available in this onnxruntime build "
            f"(available: {', '.join(available)}); install the 'gpu' extra for CUDA"
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    # Idle intra-op threads spin-wait for the next operator by default. Between the many short
    # runs of the detector and the Python work around them, that spinning takes a core from the
    # request's own thread: measured 274 -> 200 ms per /v1/verify on 2 cores (docs/results/service.md).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_cpu_mem_arena = _cpu_memory_arena
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(
        str(model_path), sess_options=options, providers=[p for p in wanted if p in available]
    )
    got = session_provider(session)
    if got != wanted[0]:
        if not allow_fallback:
            raise ProviderUnavailableError(
                f"asked for {wanted[0]} but the session for {Path(model_path).name} runs on {got}"
            )
        log.warning("%s: asked for %s, running on %s", Path(model_path).name, wanted[0], got)
    return session


def _preload_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of the nvidia-* PyPI wheels (the 'gpu' extra installs
    them), so that no system CUDA is needed; a no-op for onnxruntime builds before 1.21."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    try:
        preload()
    except Exception as exc:  # noqa: BLE001 - a system CUDA may still serve; the check below says
        log.warning("could not preload the CUDA libraries of the nvidia wheels: %s", exc)


def session_provider(session: ort.InferenceSession) -> str:
    """The execution provider a session really runs on (the first it was given)."""
    return session.get_providers()[0]
