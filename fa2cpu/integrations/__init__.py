"""Integrations of fa2cpu with other libraries.

Each submodule imports the library it integrates (``fa2cpu.integrations.transformers`` imports
torch and transformers); importing this package imports nothing else.
"""
