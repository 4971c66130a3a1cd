"""Controlled counting data: the scene model and the organism's task scenes."""

from countlens.datasets.scene import PALETTE, SHAPES, Obj, Scene, place_objects
from countlens.datasets.tasks import TASKS, TaskSample, task_sample, task_samples

__all__ = ["PALETTE", "SHAPES", "TASKS", "Obj", "Scene", "TaskSample", "place_objects", "task_sample", "task_samples"]
