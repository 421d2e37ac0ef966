"""convtune._C, the C++ extension that runs tuned layers: built on first use, cached, loaded once.

The sources are in ``convtune/csrc``. ``load()`` builds them with ``torch.utils.cpp_extension``
(g++ and ninja) into ``settings.extension_dir``/<tag> (the user's cache folder unless
``CONVTUNE_EXTENSION_DIR`` says otherwise; the tag hashes the
sources, the build flags, the torch, CUDA and Python versions and whether cuDNN is compiled in), so a
build happens once per machine and software stack, and again only when one of those changes; a
finished build is imported directly by the next process (no compiler, no ninja). Where PyTorch is a
CUDA build and cuDNN's headers are found (the ``nvidia-cudnn`` wheel PyTorch depends on, or
``CONVTUNE_CUDNN_HOME``), cuDNN execution plans are compiled in too.

Nothing here runs at ``import convtune``: the first tuned layer (or ``convtune native``, which
builds ahead of time) calls ``load``. When the build fails (no compiler, no headers) ``load``
returns None and warns once, saying why and how to fix it; layers then run on the Python path.

    >>> sorted(status())
    ['build_dir', 'cudnn', 'enabled', 'error', 'load_s', 'loaded']
    >>> build_dir().parent == Path(settings.extension_dir)  # one folder per tag under the cache folder
    True
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from convtune import forks
from convtune.settings import settings

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("ops.cpp", "layers.cpp", "registry.cpp", "algorithms.cpp", "cudnn.cpp", "cubin.cpp", "bindings.cpp")
HEADERS = ("executable.h", "layers.h")
MODULE_NAME = "convtune._C"
LIBRARY = "convtune_C"  # the built library's name

_lock = threading.Lock()
# (held while the extension builds: a child's own build waits on the build folder's lock instead,
# torch.utils.cpp_extension's, which the parent's build releases)
forks.renew_after_fork(globals(), _lock=threading.Lock)
_state: dict[str, Any] = {"module": None, "error": None, "build_s": None}


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why and how to fix it."""


def cudnn_dirs() -> tuple[Path, Path] | None:
    """(include, lib) folders of cuDNN for a CUDA build of PyTorch, or None: then the extension is built
    for the CPU only. None without a CUDA build, without a CUDA device (a CUDA build of PyTorch on a
    CPU-only machine), without the CUDA toolkit's headers, or without cuDNN's."""
    import torch

    cuda_home = _cuda_home() if torch.version.cuda is not None and torch.cuda.is_available() else None
    if cuda_home is None:
        return None
    if not any((include / "cuda_runtime_api.h").exists()
               for include in (Path(cuda_home) / "include", *Path(cuda_home).glob("targets/*/include"))):
        return None
    roots = []
    home = settings.cudnn_home
    if home:
        roots.append(Path(home))
    spec = importlib.util.find_spec("nvidia.cudnn") if importlib.util.find_spec("nvidia") else None
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    roots += [Path("/usr/local/cuda"), Path("/usr")]
    for root in roots:
        include = root / "include"
        if (include / "cudnn.h").exists():
            for lib in (root / "lib", root / "lib64", root / "lib" / "x86_64-linux-gnu"):
                if any(lib.glob("libcudnn.so*")):
                    return include, lib
    return None


def _cuda_home() -> str | None:
    """The CUDA toolkit's folder, searched as ``torch.utils.cpp_extension.CUDA_HOME`` is (CUDA_HOME, CUDA_PATH,
    the folder above ``nvcc`` on PATH, /usr/local/cuda) without importing that module, which imports
    setuptools: a tenth of a second of every warm start, where a finished build needs no compiler."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def _flags(cudnn: tuple[Path, Path] | None) -> tuple[list[str], list[str], list[str]]:
    """(compiler flags, linker flags, include folders) of the build."""
    cflags, ldflags, includes = ["-O2"], [], []
    if cudnn is not None:
        include, lib = cudnn
        cflags.append("-DCONVTUNE_WITH_CUDNN")
        includes.append(str(include))
        ldflags += [f"-L{lib}", "-l:libcudnn.so.9", f"-Wl,-rpath,{lib}", "-ldl"]  # -ldl: cubin.cpp opens libcuda
    return cflags, ldflags, includes


def _tag(cudnn: tuple[Path, Path] | None) -> str:
    import torch

    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.version.cuda}|{sys.version_info[:2]}|{_flags(cudnn)}".encode())
    if cudnn is not None and (cudnn[0] / "cudnn_version.h").exists():  # cuDNN upgraded in place: build again
        digest.update((cudnn[0] / "cudnn_version.h").read_bytes())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """Where this machine's build of the current sources lives."""
    return Path(settings.extension_dir) / _tag(cudnn_dirs())


BUILT = "built"  # the file a finished build leaves in its folder, naming the library it made


def _build(verbose: bool = False) -> ModuleType:
    """The extension of the current sources: the finished build in its folder loaded as it is, else built
    (``torch.utils.cpp_extension``, which runs ninja even when nothing changed: a fraction of a second)."""
    cudnn = cudnn_dirs()
    try:
        folder = build_dir()
    except ValueError as exc:  # CONVTUNE_EXTENSION_DIR set to what is no folder's path: warned, not retried each call
        raise BuildError(str(exc)) from None
    if (module := _load_finished(folder)) is not None:
        return module
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / BUILT).unlink(missing_ok=True)
        if not _writable(folder):  # a folder another user made: the compiler could not write there
            raise PermissionError(f"[Errno 13] Permission denied: '{folder}'")
    except OSError as exc:  # a read-only cache, a file where the folder should be
        raise BuildError(f"convtune's C++ extension cannot be built in {folder}: {_first_line(exc)}. Set "
                         f"CONVTUNE_EXTENSION_DIR to a folder this user can write, then run `convtune native "
                         f"--rebuild`; CONVTUNE_NATIVE=0 silences this and keeps the Python path") from exc
    try:
        from torch.utils import cpp_extension

        cflags, ldflags, includes = _flags(cudnn)
        module = cpp_extension.load(
            name=LIBRARY, sources=[str(SOURCE_DIR / s) for s in SOURCES], extra_cflags=cflags,
            extra_ldflags=ldflags, extra_include_paths=includes, build_directory=str(folder),
            with_cuda=cudnn is not None, verbose=verbose)
    except Exception as exc:  # compiler, ninja, headers or setuptools missing, compiler failing: all say the same
        raise BuildError(f"building convtune's C++ extension in {folder} failed: {_first_line(exc)}. Install a C++ "
                         f"compiler, ninja and setuptools (apt-get install g++; pip install ninja setuptools) and the "
                         f"headers of your "
                         f"torch build, then run `convtune native --rebuild`; CONVTUNE_NATIVE=0 silences this "
                         f"and keeps the Python path") from exc
    library = Path(module.__file__ or "")
    if library.parent == folder and library.exists():  # written last: a build cut short leaves no such file
        try:
            (folder / BUILT).write_text(library.name)
        except OSError as exc:  # a full disk, say: this process has the module; the next one builds it again
            log.warning("could not mark the build in %s finished (%s); the next process builds it again", folder, exc)
    sys.modules[MODULE_NAME] = module
    return module


def _writable(folder: Path) -> bool:
    return os.access(folder, os.W_OK | os.X_OK)


def _load_finished(folder: Path) -> ModuleType | None:
    """The library a finished build left in ``folder`` (its tag names these sources, this torch and these
    flags), imported directly; None where there is none or it does not import (then it is built again)."""
    try:
        library = folder / (folder / BUILT).read_text().strip()
        spec = importlib.util.spec_from_file_location(LIBRARY, library)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError) as exc:
        log.info("the finished build in %s does not load (%s); building again", folder, exc)
        return None
    sys.modules[MODULE_NAME] = module
    return module


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line for line in text.splitlines() if "error:" in line] or text.splitlines()
    return lines[0][:300]


def load(verbose: bool = False) -> ModuleType | None:
    """The extension module (built first if needed), or None when disabled or not buildable here (warned once)."""
    module = _state["module"]
    if module is not None or not settings.native:
        return module
    with _lock:
        if _state["module"] is None and _state["error"] is None:
            started = time.perf_counter()
            try:
                _state["module"] = _build(verbose)
                _state["build_s"] = time.perf_counter() - started
                log.info("convtune's C++ extension loaded in %.1f s from %s", _state["build_s"], build_dir())
            except BuildError as exc:
                _state["error"] = str(exc)
                warnings.warn(f"convtune: tuned layers run on the Python path, which costs more host time per call: "
                              f"{exc}", RuntimeWarning, stacklevel=2)
    return _state["module"]


def loaded() -> ModuleType | None:
    """The extension module where this process has loaded it, else None; never builds (compiled code's layers
    are made only once something else has loaded it)."""
    return _state["module"]


def reset() -> None:
    """Forget a failed build, so the next ``load`` tries again (a loaded module stays loaded)."""
    with _lock:
        _state["error"] = None


def status() -> dict[str, Any]:
    """What ``convtune native`` prints: enabled, loaded, the build folder, seconds to build or load it,
    cuDNN, the last error."""
    module = _state["module"]
    return {"enabled": bool(settings.native), "loaded": module is not None, "build_dir": str(build_dir()),
            "load_s": _state["build_s"], "cudnn": bool(module.with_cudnn()) if module is not None else None,
            "error": _state["error"]}
