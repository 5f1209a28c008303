"""Process containment: profiles, cgroups and the worker-side set-up (a stdlib-only leaf).

Both sides use it: the supervisor creates cgroups and reports layers; the worker applies its
profile first thing. See ``docs/security.md``.
"""

from ._profile import DEFAULT_ENV_ALLOWLIST, LAYERS, Profile, parse_duration, parse_size

__all__ = ("DEFAULT_ENV_ALLOWLIST", "LAYERS", "Profile", "parse_duration", "parse_size")
