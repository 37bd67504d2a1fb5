"""Testbed: four seeded task families with exact evaluators (issue: testbed).

The tiny backbone and its four task adapters are not trained yet; `make_tasks()` gives the tasks.
"""

from .tasks import Task, make_tasks

__all__ = ["Task", "make_tasks"]
