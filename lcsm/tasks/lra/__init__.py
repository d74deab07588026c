"""The Long Range Arena tasks (Tay et al. 2020, section 3), one module each: ``listops`` and
``pathfinder`` generated as the paper describes; ``image``, ``text`` and ``retrieval`` on the real
data reachable here, substitutes for the paper's (each module says which and why).

Every module of this package registers its task when imported, and ``lcsm.tasks`` imports this
package, so importing it imports them all.
"""

import importlib
import pkgutil

for _mod in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_mod.name}")
