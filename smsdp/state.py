"""``smsdp.state`` is ``smsdp.smp.state``: SMP v1 scripts import ``smdistributed.modelparallel.torch.state``,
and changing only the package name must keep working (``from smsdp.state import ...``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("smsdp.smp.state")
