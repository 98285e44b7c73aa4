"""A multi-document question, its prompt, and its dataset row.

The prompt puts the instruction and the documents first and the question
last. Questions about the same documents then share everything but their last
line, which is the prefix ZoRRo computes once in training and FCA reads once
in decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from recipes.common.records import chat_prompt, rl_row

ABILITY = "qa"
ANSWER_TAG = "answer"

INSTRUCTION = (
    "Read the documents below, then answer the question that follows them. Think step by step if it helps, and give "
    f"the final answer as a short phrase inside <{ANSWER_TAG}></{ANSWER_TAG}> tags."
)


@dataclass(frozen=True)
class Document:
    """One titled passage; ``is_supporting`` marks the passages the answer needs."""

    title: str
    text: str
    is_supporting: bool = False


@dataclass(frozen=True)
class QAExample:
    """A question over documents with its accepted answers.

    Examples with the same ``context_id`` have the same documents in the same
    order; only ``is_supporting``, which the prompt does not show, may differ.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[Document, ...]
    context_id: str

    def __post_init__(self):
        if not self.answers:
            raise ValueError(f"example {self.id!r}: answers must hold at least one answer, got ()")
        if not self.documents:
            raise ValueError(f"example {self.id!r}: documents must hold at least one document, got ()")


def render_context(documents: Sequence[Document]) -> str:
    """The documents as the model reads them: numbered, each with its title."""
    return "\n\n".join(f"Document [{i}] {doc.title}\n{doc.text}" for i, doc in enumerate(documents, start=1))


def context_prefix(documents: Sequence[Document]) -> str:
    """The part of the prompt all questions on ``documents`` share: instruction and documents."""
    return f"{INSTRUCTION}\n\n{render_context(documents)}"


def build_prompt(example: QAExample) -> list[dict[str, str]]:
    """The chat prompt: shared prefix (instruction, documents), then the question."""
    return chat_prompt(f"{context_prefix(example.documents)}\n\nQuestion: {example.question}")


def to_row(example: QAExample, data_source: str, split: str, index: int, **extra: Any) -> dict[str, Any]:
    """One verl row; ``ground_truth`` is the list of accepted answers. ``extra`` adds to ``extra_info``."""
    return rl_row(
        data_source=data_source,
        prompt=build_prompt(example),
        ability=ABILITY,
        ground_truth=list(example.answers),
        extra_info={
            "split": split,
            "index": index,
            "id": example.id,
            "context_id": example.context_id,
            "question": example.question,
            "supporting_titles": [doc.title for doc in example.documents if doc.is_supporting],
            "num_documents": len(example.documents),
            **extra,
        },
    )
