"""CLEVR (Johnson et al., CVPR 2017): questions about rendered 3-D scenes of shapes, answered from
their attributes and spatial relations — Counting Circuits' spatial-reasoning task.

Expected layout of ``root`` (as the dataset is distributed): ``questions/CLEVR_<split>_questions.json``,
a JSON object whose ``questions`` list holds records with ``question``, ``answer``,
``image_filename``, ``image_index`` and ``question_family_index`` (the test split has no answers, so
it cannot be scored); the images in ``images/<split>/<image_filename>``; and optionally
``scenes/CLEVR_<split>_scenes.json`` (``scenes``: one record per image with its ``objects`` and
``relationships``), which, when present, must describe every image a question is asked about: each
loaded question's program is then run on its scene (`countlens.datasets.loaders.clevr_program`) and
must find the objects it names and give the file's answer. Answers are CLEVR's words
(``yes``, ``no``, ``0`` … ``10``, colours, shapes, materials, sizes).
"""

from __future__ import annotations

from pathlib import Path

from countlens.datasets.loaders.clevr_program import ProgramError, run_program
from countlens.datasets.loaders.common import (
    LoaderError,
    PathLike,
    QuestionSample,
    check_limit,
    read_json,
    record_field,
    require_images,
)

_FIX = "download CLEVR v1.0 and pass the directory that holds questions/ and images/ as root"


def load_clevr(
    root: PathLike, split: str = "val", *, limit: int | None = None, relations_only: bool = True
) -> list[QuestionSample]:
    """The questions of one CLEVR split as `QuestionSample` (task "spatial"), in file order; with
    ``relations_only`` (default) only those whose functional program relates objects in space (a
    ``relate`` step: "left of", "behind" …), since CLEVR also asks plain counting and attribute
    questions, which would make a "spatial" task count. ``limit`` applies after that filter."""
    check_limit(limit)
    root = Path(root)
    if not root.is_dir():
        raise LoaderError(f"{root}: CLEVR root directory not found; {_FIX}")
    file = root / "questions" / f"CLEVR_{split}_questions.json"
    data = read_json(file, _FIX)
    if not isinstance(data, dict) or not isinstance(data.get("questions"), list):
        raise LoaderError(f"{file}: expected a JSON object with a 'questions' list")
    records = [(i, r) for i, r in enumerate(data["questions"])]
    if relations_only:
        records = [(i, r) for i, r in records if _relates(r, file, f"question {i}")]
    records = records[:limit] if limit is not None else records
    scenes_file = root / "scenes" / f"CLEVR_{split}_scenes.json"
    scenes = _scenes(scenes_file)
    images = root / "images" / split
    out = []
    for i, record in records:
        rid = f"question {i}"
        question = record_field(record, "question", str, file, rid)
        answer = record_field(
            record, "answer", (str, int), file, rid, fix=f"split {split!r} has no answers; load 'val' or 'train'"
        )
        image = record_field(record, "image_filename", str, file, rid)
        index = record_field(record, "image_index", int, file, rid)
        if scenes is not None and index not in scenes:
            raise LoaderError(
                f"{file}: {rid}: image_index {index} has no scene in scenes/CLEVR_{split}_scenes.json; the "
                "questions and scenes files come from different copies: take both from one download"
            )
        if scenes is not None and isinstance(record.get("program"), list):
            try:
                computed = run_program(record["program"], scenes[index])
            except (ProgramError, KeyError, IndexError, TypeError) as err:
                detail = (
                    str(err) if isinstance(err, ProgramError) else f"a malformed step ({type(err).__name__}: {err})"
                )
                raise LoaderError(
                    f"{file}: {rid}: on the scene of image {index} ({scenes_file.name}), {detail}; the question and "
                    "its scene disagree: take both files from one CLEVR download"
                ) from None
            if computed != str(answer):
                raise LoaderError(
                    f"{file}: {rid}: its program gives {computed!r} on the scene of image {index}, the file's "
                    f"answer is {str(answer)!r}; take the questions and scenes files from one CLEVR download"
                )
        family = record_field(record, "question_family_index", int, file, rid, default=None)
        out.append(
            QuestionSample(
                image_path=images / image,
                image_bytes=None,
                question=question,
                answer=str(answer),
                task="spatial",
                source="clevr",
                id=f"{split}_{i}",
                split=split,
                meta={"file": str(file), "image_index": index, "question_family_index": family},
            )
        )
    require_images(out, images, f"images of split {split!r}", f"extract CLEVR's images/{split} folder there")
    return out


def _relates(record, file: Path, rid: str) -> bool:
    """Whether a question's program has a spatial ``relate`` step (its nodes name their step by
    ``function``, or ``type`` in older copies)."""
    if not isinstance(record, dict):
        raise LoaderError(f"{file}: {rid}: a question must be a JSON object")
    program = record.get("program")
    if not isinstance(program, list):
        raise LoaderError(
            f"{file}: {rid}: field 'program' is missing; relations_only=True reads it (or pass relations_only=False)"
        )
    return any(
        isinstance(node, dict) and "relate" in str(node.get("function") or node.get("type") or "") for node in program
    )


def _scenes(path: Path) -> dict[int, dict] | None:
    """The scenes file's scenes by image index (None when there is no scenes file)."""
    if not path.exists():
        return None
    data = read_json(path, _FIX)
    scenes = data.get("scenes") if isinstance(data, dict) else None
    if not isinstance(scenes, list):
        raise LoaderError(f"{path}: expected a JSON object with a 'scenes' list")
    out = {}
    for i, scene in enumerate(scenes):
        index = record_field(scene, "image_index", int, path, f"scene {i}") if isinstance(scene, dict) else None
        if index is None or not isinstance(scene.get("objects"), list):
            raise LoaderError(f"{path}: scene {i}: expected an object with 'image_index' and an 'objects' list")
        out[index] = scene
    return out
