"""The import hook that lets ``import deepspeed`` reach hf_zero when the real DeepSpeed is not installed.

transformers and accelerate use DeepSpeed only if ``importlib.util.find_spec("deepspeed")`` finds a module *and*
``importlib.metadata.metadata("deepspeed")`` finds a distribution (then ``version("deepspeed") >= 0.9.3``).
:class:`DeepSpeedShimFinder`, put on ``sys.meta_path`` at interpreter start-up by the one-line
``hf_zero_deepspeed.pth``, answers both questions:

- ``find_spec("deepspeed")`` returns the package in ``deepspeed_shim/deepspeed/`` (a tree of forwarders onto
  hf_zero's native API); its submodules are then found through that package's ``__path__`` as usual.
- ``find_distributions`` answers a ``deepspeed`` distribution only to a lookup *by that name* on the default
  path (``importlib.metadata.version("deepspeed")`` and friends). Listings (``distributions()``, which is what
  ``pip list``, ``pip check`` and pip's resolver iterate) never see it, so pip still considers DeepSpeed absent
  and ``pip install deepspeed`` installs the real one.

Both stand aside -- and the real package wins -- whenever a real DeepSpeed is on ``sys.path``: a regular
``deepspeed`` package or module, or a ``deepspeed`` distribution (dist-info / egg-info, which also covers editable
installs). ``HF_ZERO_DISABLE_DEEPSPEED_SHIM=1`` turns the whole layer off (read at start-up by the ``.pth`` line
and again at each lookup).

This module is imported in every Python process, so it imports nothing heavy: no torch, no importlib.metadata
(a name-based metadata lookup has already imported it by the time it reaches :meth:`find_distributions`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

__all__ = ["DISABLE_ENV", "DEEPSPEED_API_VERSION", "DeepSpeedShimFinder", "disabled", "install", "shim_version"]

DISABLE_ENV = "HF_ZERO_DISABLE_DEEPSPEED_SHIM"
# The DeepSpeed release whose API the shim mirrors (ds_api_surface.md). transformers and accelerate gate features
# on this number: >= 0.9.3 to use DeepSpeed at all, >= 0.14.4 to call engine.compile under dynamo, ...
DEEPSPEED_API_VERSION = "0.19.8"

_TREE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed")
_TRUE = ("1", "true", "yes", "on")


def disabled() -> bool:
    """Whether ``HF_ZERO_DISABLE_DEEPSPEED_SHIM`` switches the shim off (1/true/yes/on, any case)."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in _TRUE


def shim_version() -> str:
    """The version the shim's ``deepspeed`` distribution reports: DeepSpeed's API version + hf_zero's as local tag."""
    from hf_zero import __version__

    return f"{DEEPSPEED_API_VERSION}+hfzero.{__version__}"


def _is_deepspeed(name: str | None) -> bool:
    return name is not None and name.replace("_", "-").replace(".", "-").lower() == "deepspeed"


def real_deepspeed_installed() -> bool:
    """A real DeepSpeed is on sys.path: an importable regular package/module, or an installed distribution."""
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    # A namespace package (a stray ``deepspeed/`` folder without __init__.py, e.g. of config files) has no origin;
    # it is not DeepSpeed, and the real one would beat it too.
    if spec is not None and spec.origin not in (None, "namespace"):
        return True
    import importlib.metadata as metadata  # deferred: ~20 ms, and only needed once someone asks for deepspeed

    context = metadata.DistributionFinder.Context(name="deepspeed")
    return next(iter(metadata.MetadataPathFinder.find_distributions(context)), None) is not None


class DeepSpeedShimFinder:
    """Maps the top-level module ``deepspeed`` (and so ``deepspeed.*``) onto hf_zero's shim tree.

    A meta path finder by protocol (``find_spec``, ``find_distributions``, ``invalidate_caches``) rather than by
    subclassing ``importlib.abc.MetaPathFinder``: importing ``importlib.abc`` pulls in importlib.resources,
    pathlib, tempfile and shutil, ~10 ms that every Python process would pay at start-up.
    """

    _hf_zero_deepspeed_shim = True  # how install() recognises an already installed finder

    def find_spec(self, fullname, path=None, target=None):
        # Submodules need no help: they are found through the shim package's __path__.
        if fullname != "deepspeed" or disabled() or real_deepspeed_installed():
            return None
        return importlib.util.spec_from_file_location(
            "deepspeed", os.path.join(_TREE, "__init__.py"), submodule_search_locations=[_TREE])

    def find_distributions(self, context=None):
        if context is None or not _is_deepspeed(getattr(context, "name", None)):
            return iter(())
        # Only the default search path: a lookup confined to explicit directories is about what is in them.
        if context.path is not sys.path or disabled() or real_deepspeed_installed():
            return iter(())
        return iter((_shim_distribution(),))

    def invalidate_caches(self):
        pass


_distribution = None


def _shim_distribution():
    """The ``deepspeed`` Distribution object (the class is built on first use: importlib.metadata is heavy)."""
    global _distribution
    if _distribution is None:
        import importlib.metadata as metadata

        class ShimDistribution(metadata.Distribution):
            """Metadata of the shim: name, version and a summary that says what it is. No files, no entry points."""

            def read_text(self, filename):
                if filename in ("METADATA", "PKG-INFO"):
                    return (
                        "Metadata-Version: 2.1\n"
                        "Name: deepspeed\n"
                        f"Version: {shim_version()}\n"
                        "Summary: hf_zero's DeepSpeed compatibility layer, not DeepSpeed: `import deepspeed` runs "
                        f"hf_zero. Set {DISABLE_ENV}=1 to turn it off; installing DeepSpeed replaces it.\n"
                    )
                return None

            def locate_file(self, path):
                return os.path.join(_TREE, str(path))

        _distribution = ShimDistribution()
    return _distribution


def install() -> bool:
    """Put the finder first on ``sys.meta_path`` (once per process); False when the shim is disabled."""
    if disabled():
        return False
    if not any(getattr(finder, "_hf_zero_deepspeed_shim", False) for finder in sys.meta_path):
        # First, so that a stray namespace folder named ``deepspeed`` cannot hide the shim; find_spec still stands
        # aside for a real DeepSpeed anywhere on the path.
        sys.meta_path.insert(0, DeepSpeedShimFinder())
    return True
