"""Controlled counting data: scenes, COUNTINGTRICKS, count pairs, prompts, task scenes and loaders.

Every generated sample carries its ``recipe`` (the generator call that makes it again, as plain data);
`rebuild` makes a sample again from it (`countlens.datasets.recipe`)."""

from countlens.datasets.countingtricks import CASES, Case, capacity, countingtricks, trick_sample
from countlens.datasets.pairs import (
    KINDS,
    CountPair,
    count_pair,
    count_pairs,
    count_scene,
    count_scenes,
    count_table,
    pair_counts,
)
from countlens.datasets.prompts import PAIR_PROMPTS, PROMPTS, answer_text, make_question
from countlens.datasets.recipe import rebuild
from countlens.datasets.scene import PALETTE, SHAPES, Obj, Scene, place_objects
from countlens.datasets.tasks import TASKS, TaskSample, task_sample, task_samples

__all__ = [
    "CASES",
    "KINDS",
    "PAIR_PROMPTS",
    "PALETTE",
    "PROMPTS",
    "SHAPES",
    "TASKS",
    "Case",
    "CountPair",
    "Obj",
    "Scene",
    "TaskSample",
    "answer_text",
    "capacity",
    "count_pair",
    "count_pairs",
    "count_scene",
    "count_scenes",
    "count_table",
    "countingtricks",
    "make_question",
    "pair_counts",
    "place_objects",
    "rebuild",
    "task_sample",
    "task_samples",
    "trick_sample",
]
