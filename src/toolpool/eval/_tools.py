"""The tools module of ``toolpool eval``'s workers (``toolpool.eval._tools:registry``): the
checker's registry, and this worker's zygote, started as the worker loads this module, so
that its start overlaps the worker's own instead of delaying the first sample."""

from ._checker import registry, start_zygote

__all__ = ("registry",)

start_zygote()
