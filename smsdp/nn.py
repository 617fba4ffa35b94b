"""``smsdp.nn`` is ``smsdp.smp.nn``: SMP v1 scripts import ``smdistributed.modelparallel.torch.nn``,
and changing only the package name must keep working (``from smsdp.nn import ...``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("smsdp.smp.nn")
