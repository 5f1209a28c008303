"""Tool descriptions: what a tool function's signature says about its arguments.

:func:`inspect_tool` reads a function's parameters once, when the tool is registered, into a
:class:`ToolSignature`: the JSON Schema of its arguments (the ``input_schema`` of a catalog
entry, what a consumer shows a model) and the check and conversion of the arguments a call
brings against that same description. It is a leaf: it imports nothing else of toolpool, so
whatever builds or reads catalogs can use it (the registry does, in a worker and in-process).
"""

from ._signature import ToolSignature, inspect_tool

__all__ = ("ToolSignature", "inspect_tool")
