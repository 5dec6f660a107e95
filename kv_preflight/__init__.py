"""kv-preflight: the one import namespace of its five packages (cli, shared, ingester, predictor, simulator).

In a wheel they sit inside this package (setup.py maps ``kv_preflight.shared`` to the ``shared/`` folder, and so
on), so site-packages gains only ``kv_preflight``. In a source checkout the folders stay at the top of the tree,
beside this one: there the package's search path is extended to the checkout root, so ``import
kv_preflight.shared`` works with nothing installed (``PYTHONPATH=<checkout>``) and from an editable install alike.
The extension happens only when the folders are *not* inside this package and the checkout's ``setup.py`` and
``shared/keys.py`` sit one level up, which never holds in site-packages, so an installed wheel never exposes
unrelated site-packages modules under this name.
"""
from pathlib import Path as _Path

_here = _Path(__file__).resolve().parent
_checkout = _here.parent
if (not (_here / "shared").is_dir() and (_checkout / "setup.py").is_file()
        and (_checkout / "shared" / "keys.py").is_file()):
    __path__.append(str(_checkout))  # noqa: F821 - the package's own __path__
del _Path, _here, _checkout
