"""Offline twins of lm-eval's GPQA, MATH and HumanEval tasks (YAMLs for `TaskManager(include_path=...)`)."""
