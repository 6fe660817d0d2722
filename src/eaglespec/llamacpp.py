"""llama.cpp through llama-cpp-python, an optional package (never in the default install): the bench's `llamacpp`
peer and `eaglespec train data --engine llamacpp` import it here, so a missing or broken install is one clear line."""

from __future__ import annotations

import importlib.util

from .errors import EagleSpecError, MissingPackageError

LLAMA_CPP_PIP = "pip install llama-cpp-python"


def llama_class(what: str) -> type:
    """llama_cpp.Llama, for `what` (e.g. "the llamacpp peer"): a MissingPackageError with the pip command where the
    package is not installed, an EagleSpecError where it is but cannot be imported (installed with --no-deps, say)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise MissingPackageError(f"{what} (package llama-cpp-python)", LLAMA_CPP_PIP)
    try:
        from llama_cpp import Llama
    except ImportError as error:
        raise EagleSpecError(f"llama-cpp-python is installed but cannot be imported ({error}); reinstall it with its "
                             f"dependencies: {LLAMA_CPP_PIP}") from error
    return Llama


def installed() -> bool:
    """Whether llama-cpp-python is installed (not imported)."""
    return importlib.util.find_spec("llama_cpp") is not None
