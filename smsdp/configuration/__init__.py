"""The modules behind ``smsdp.config`` (import from there): one concern each, see its docstring."""
