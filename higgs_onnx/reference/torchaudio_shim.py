"""A stand-in ``torchaudio`` module so transformers' Higgs Audio v2 codec runs without torchaudio.

torchaudio has no build for the torch we pin, yet ``modeling_higgs_audio_v2_tokenizer`` does
``import torchaudio`` at module top, gates the model behind ``@requires(backends=("torchaudio",))`` (an
``importlib.util.find_spec("torchaudio")`` probe) and only ever calls ``torchaudio.functional.resample``.
:func:`install` registers a minimal ``torchaudio`` whose ``functional.resample`` is our own re-implementation
(:mod:`higgs_onnx.reference.resample`) -- but only when no working torchaudio can be imported.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
from typing import Any

from higgs_onnx.reference.resample import resample

SHIM_VERSION = "0.0.0+higgs.onnx.shim"
_MARKER = "__higgs_onnx_shim__"


def _missing_attr(modname: str) -> Any:
    def __getattr__(name: str) -> Any:
        raise AttributeError(
            f"module {modname!r} is higgs_onnx's torchaudio stand-in (real torchaudio is not importable); "
            f"it only provides torchaudio.functional.resample, not {name!r}"
        )

    return __getattr__


def _new_module(name: str, is_package: bool) -> types.ModuleType:
    module = types.ModuleType(name, f"higgs_onnx stand-in for {name}")
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=is_package)
    module.__loader__ = None
    if is_package:
        module.__path__ = []  # a package with no search locations: unknown submodules fail to import
    module.__getattr__ = _missing_attr(name)  # type: ignore[method-assign]
    setattr(module, _MARKER, True)
    return module


def is_installed() -> bool:
    """Whether the ``torchaudio`` in ``sys.modules`` is this stand-in."""
    return getattr(sys.modules.get("torchaudio"), _MARKER, False) is True


def _refresh_transformers() -> None:
    """Forget transformers' cached "torchaudio is missing" answers, if transformers is already imported."""
    iu = sys.modules.get("transformers.utils.import_utils")
    if iu is None:
        return
    for fn_name in ("is_torchaudio_available", "is_speech_available"):
        cache_clear = getattr(getattr(iu, fn_name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    lazy_cls, dummy_cls = getattr(iu, "_LazyModule", None), getattr(iu, "DummyObject", None)
    if lazy_cls is None:
        return
    # `import transformers` records, per object, the backends that were missing at that time; objects whose
    # only missing backend was torchaudio are served as placeholders that raise. Un-record those.
    for mod in list(sys.modules.values()):
        missing = getattr(mod, "_object_missing_backend", None) if isinstance(mod, lazy_cls) else None
        if not isinstance(missing, dict):
            continue
        for key, backends in list(missing.items()):
            if backends and all(b == "torchaudio" for b in backends):
                del missing[key]
                if dummy_cls is not None and isinstance(mod.__dict__.get(key), dummy_cls):
                    delattr(mod, key)


def install() -> bool:
    """Register the stand-in ``torchaudio`` unless a real one imports; return True iff the stand-in is active.

    Idempotent. A torchaudio that is installed but fails to import (e.g. ``OSError`` loading its C++
    extension against a mismatched torch) counts as missing: its partial modules are dropped and replaced.
    """
    if is_installed():
        return True
    try:
        importlib.import_module("torchaudio")
        return False
    # ImportError, OSError loading the C++ extension, ABI breakage (RuntimeError / AttributeError from torch
    # ops registration): all mean "installed but not usable".
    except (ImportError, OSError, RuntimeError, AttributeError):
        for name in [n for n in sys.modules if n == "torchaudio" or n.startswith("torchaudio.")]:
            del sys.modules[name]

    package = _new_module("torchaudio", is_package=True)
    package.__version__ = SHIM_VERSION  # type: ignore[attr-defined]
    functional = _new_module("torchaudio.functional", is_package=False)
    functional.resample = resample  # type: ignore[attr-defined]
    package.functional = functional  # type: ignore[attr-defined]
    sys.modules["torchaudio"] = package
    sys.modules["torchaudio.functional"] = functional
    importlib.invalidate_caches()
    _refresh_transformers()
    return True


def load_codec_class() -> type:
    """Install the stand-in if needed and return ``transformers``' ``HiggsAudioV2TokenizerModel`` class."""
    install()
    # The submodule import is the real class even if `import transformers` ran before install() did.
    from transformers.models.higgs_audio_v2_tokenizer.modeling_higgs_audio_v2_tokenizer import (
        HiggsAudioV2TokenizerModel,
    )

    return HiggsAudioV2TokenizerModel
