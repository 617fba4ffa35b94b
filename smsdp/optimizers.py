"""``smsdp.optimizers`` is ``smsdp.smp.optimizers``: SMP v1 scripts import ``smdistributed.modelparallel.torch.optimizers``,
and changing only the package name must keep working (``from smsdp.optimizers import ...``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("smsdp.smp.optimizers")
