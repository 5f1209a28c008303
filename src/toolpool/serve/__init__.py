"""``toolpool serve``: a pool as a service that operators run, watch, scale and drain.

See ``docs/service.md``. The command is the usual way in; :class:`Service` runs the same from
Python, and :func:`control` talks to a running service's control socket.
"""

from ._config import ProviderConfig, load_config, parse_autoscale, parse_tools
from ._control import ControlError, default_control_path
from ._control import request as control
from ._logs import LogFormat, configure_logging
from ._service import Service, ServiceOptions, ServiceState

__all__ = (
    "ControlError",
    "LogFormat",
    "ProviderConfig",
    "Service",
    "ServiceOptions",
    "ServiceState",
    "configure_logging",
    "control",
    "default_control_path",
    "load_config",
    "parse_autoscale",
    "parse_tools",
)
