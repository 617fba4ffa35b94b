"""``smsdp.amp`` is ``smsdp.smp.amp``: SMP v1 scripts import ``smdistributed.modelparallel.torch.amp``,
and changing only the package name must keep working (``from smsdp.amp import ...``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("smsdp.smp.amp")
