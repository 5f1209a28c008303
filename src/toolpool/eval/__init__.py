"""``toolpool eval``: score model-written code on HumanEval-style problems, with verdicts a
completion cannot forge (docs/eval.md).

The names are loaded on first use: a worker imports ``toolpool.eval._checker`` (its tools
module) and must not pay for the driver's modules (the batch, the supervisor), nor the driver
for the checker's (the worker's registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from ._checker import Candidate, CandidateError, SampleVerdict
    from ._formats import Problem, TaskId, from_mbpp, mean_pass_at_k, pass_at_k, read_problems
    from ._run import EvalReport, ProblemScore, evaluate

__all__ = (
    "Candidate",
    "CandidateError",
    "EvalReport",
    "Problem",
    "ProblemScore",
    "SampleVerdict",
    "TaskId",
    "evaluate",
    "from_mbpp",
    "mean_pass_at_k",
    "pass_at_k",
    "read_problems",
)

_WHERE = {
    "Candidate": "_checker",
    "CandidateError": "_checker",
    "SampleVerdict": "_checker",
    "Problem": "_formats",
    "TaskId": "_formats",
    "from_mbpp": "_formats",
    "mean_pass_at_k": "_formats",
    "pass_at_k": "_formats",
    "read_problems": "_formats",
    "EvalReport": "_run",
    "ProblemScore": "_run",
    "evaluate": "_run",
}


__getattr__, __dir__ = lazy_names(__name__, _WHERE, globals(), __all__)
