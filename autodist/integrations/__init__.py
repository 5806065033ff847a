"""Adapters between autodist plans and other training frameworks, one module each.

Nothing here is imported by ``import autodist`` or by the applier: a module is loaded only when
asked for by name, e.g. ``from autodist.integrations.paddleformers import install``.
"""
