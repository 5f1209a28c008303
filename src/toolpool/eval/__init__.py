"""``toolpool eval``: score model-written code on HumanEval-style problems, with verdicts a
completion cannot forge (docs/eval.md)."""

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
