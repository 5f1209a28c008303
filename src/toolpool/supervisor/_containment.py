"""The supervisor's side of containment: which layers this machine gives the pool's workers,
and the report of what protects them (``pool.containment()``, ``toolpool doctor``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ..core import WorkerStartError
from ..sandbox import LAYERS, Profile
from ..sandbox._cgroups import CgroupSet
from ..sandbox._profile import _human as _human_size
from ._results import ContainmentReport, Layer

__all__ = ("containment_report", "supervisor_layers", "warn_inactive_layers")

_log = logging.getLogger("toolpool.supervisor")

Layers = dict[str, tuple[bool, str]]


def supervisor_layers(
    profile: Profile, *, subreaper: bool, cgroup_name: str
) -> tuple[Layers, CgroupSet]:
    """Detect and prepare the supervisor-side layers; refuse to start without required
    ones (:class:`toolpool.WorkerStartError`)."""
    layers: Layers = {}
    layers["session"] = (True, "each worker leads its own session and process group")
    layers["subreaper"] = (
        (True, "workers and the reaper are child subreapers: daemons stay in the tree")
        if subreaper
        else (False, "PR_SET_CHILD_SUBREAPER is not available")
    )
    try:
        os.close(os.pidfd_open(os.getpid()))
        layers["pidfd"] = (True, "process deaths are awaited without polling")
    except (AttributeError, OSError) as exc:
        layers["pidfd"] = (False, f"pidfd_open: {exc}")
    if "cgroups" in profile.disable:
        cg = CgroupSet(reasons=dict.fromkeys(("v2", "memory", "pids"), "disabled by the profile"))
    else:
        cg = CgroupSet.create(
            cgroup_name, memory=profile.memory is not None, pids=profile.max_processes is not None
        )
    layers["cgroup_kill"] = (
        (True, f"cgroup v2 per worker, cgroup.kill + populated 0 ({cg.base['v2']})")
        if "v2" in cg.base
        else (False, f"cgroup v2: {cg.reasons.get('v2', 'unavailable')}")
    )
    for name, hierarchy, wanted in (
        ("cgroup_memory", "memory", profile.memory),
        ("cgroup_pids", "pids", profile.max_processes),
    ):
        if wanted is None:
            layers[name] = (False, "no limit requested by the profile")
        elif hierarchy in cg.base:
            shown = _human_size(wanted) if name == "cgroup_memory" else str(wanted)
            layers[name] = (True, f"limit {shown} per worker tree ({cg.base[hierarchy]})")
        else:
            layers[name] = (False, cg.reasons.get(hierarchy, "unavailable"))
    layers["scratch_dir"] = (
        (True, "a private working directory per worker, removed when it is gone")
        if profile.scratch_dir
        else (False, "not requested by the profile")
    )
    layers["env_allowlist"] = (
        (True, f"only {', '.join(profile.env_allowlist or ())} (+ toolpool's own)")
        if profile.env_allowlist is not None
        else (False, "workers inherit the supervisor's environment")
    )
    missing = [
        f"{name}: {layers[name][1]}"
        for name in sorted(profile.require)
        if name in layers and not layers[name][0]
    ]
    if missing:
        cg.remove()
        raise WorkerStartError(
            "the profile requires containment layers this machine lacks: " + "; ".join(missing)
        )
    return layers, cg


def containment_report(
    profile: Profile, supervisor: Layers, worker: Mapping[str, Any] | None
) -> ContainmentReport:
    """What protects the workers, layer by layer; worker-side layers (rlimits, namespaces,
    Landlock, uid) as the first worker reported them."""
    merged: Layers = dict(supervisor)
    worker = worker or {}
    if "rlimits" in worker:
        merged["rlimits"] = (bool(worker["rlimits"][0]), str(worker["rlimits"][1]))
    if profile.network:
        merged["netns"] = (False, "network allowed by the profile")
    elif "netns" in worker:
        merged["netns"] = (bool(worker["netns"][0]), str(worker["netns"][1]))
    requested = (
        ("ipcns", profile.private_ipc),
        ("landlock", profile.landlock),
        ("readonly_fs", profile.readonly_fs),
        ("uid", profile.user),
    )
    for layer, wanted in requested:
        if wanted is None or wanted is False:
            merged[layer] = (False, "not requested by the profile")
        elif layer in worker:
            merged[layer] = (bool(worker[layer][0]), str(worker[layer][1]))
    if "cgroups_joined" in worker and not worker["cgroups_joined"][0]:
        for name in ("cgroup_kill", "cgroup_memory", "cgroup_pids"):
            if merged.get(name, (False, ""))[0]:
                merged[name] = (False, f"worker could not join: {worker['cgroups_joined'][1]}")
    order = {name: i for i, name in enumerate(LAYERS)}
    layers = tuple(
        Layer(name, active, detail)
        for name, (active, detail) in sorted(merged.items(), key=lambda kv: order.get(kv[0], 99))
    )
    return ContainmentReport(profile.name, profile.describe(), layers)


def warn_inactive_layers(profile: Profile, report: ContainmentReport) -> None:
    """Say once, loudly, which layers the profile asked for that workers could not apply."""
    asked = {
        "netns": not profile.network,
        "ipcns": profile.private_ipc,
        "landlock": profile.landlock,
        "readonly_fs": profile.readonly_fs,
        "uid": profile.user is not None,
    }
    for layer in report.layers:
        if asked.get(layer.name) and not layer.active:
            _log.warning(
                "profile %r asks for %s, which is not active: %s",
                profile.name,
                layer.name,
                layer.detail,
            )
