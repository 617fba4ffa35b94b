"""``smp.save_adapter``: a sharded peft model's adapter, as ``peft.PeftModel.from_pretrained`` loads it.

Its own module because it imports peft (and with it transformers): only a script that
saves an adapter pays for that import (see ``smsdp.pretrained.adapter``).
"""

from smsdp.pretrained.adapter import save_adapter

__all__ = ["save_adapter"]
