"""`attnres eval`: lm-evaluation-harness on GPQA, MATH and HumanEval, side by side with the source model."""

from .harness import (
    DEFAULT_TASKS,
    TASK_ALIASES,
    EvalError,
    EvalReport,
    EvalRow,
    evaluate,
    load_model,
    run_eval,
)

__all__ = [
    "DEFAULT_TASKS",
    "TASK_ALIASES",
    "EvalError",
    "EvalReport",
    "EvalRow",
    "evaluate",
    "load_model",
    "run_eval",
]
