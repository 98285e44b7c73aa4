"""Synthetic long contexts: facts scattered among many look-alike documents, the same for the same seed.

Each context is a made-up world of people, organizations and cities. Every
document describes one person or one organization, with its facts among
filler sentences; a person founded one organization, whose document sits
elsewhere in the context. Questions ask for one fact (where someone was born,
when an organization was established) or chain two documents (the city of the
organization a person founded). Names are invented, so no model knows the
answers without reading.

A context grows, a founder and an organization at a time, up to
``context_tokens`` tokens of the given tokenizer (instruction and documents:
the prefix every question on the context shares), and several questions share
it. This is the workload where ZoRRo's shared-prefix computation pays most.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recipes.long_context_qa.examples import Document, QAExample, context_prefix

DATA_SOURCE = "synthetic_long_context"

_SYLLABLES = (
    "ka",
    "ri",
    "mo",
    "ven",
    "tal",
    "dor",
    "sil",
    "bra",
    "qu",
    "el",
    "ost",
    "mar",
    "lin",
    "zu",
    "per",
    "gan",
    "ne",
    "thi",
    "vol",
    "rak",
    "sa",
    "dun",
    "ith",
    "cor",
    "ple",
    "wy",
    "fen",
    "gor",
    "hal",
    "ju",
)
_ORG_KINDS = ("Institute", "Society", "Works", "Guild", "Foundation", "Observatory", "Company", "Academy")
_PROFESSIONS = (
    "cartographer",
    "glassblower",
    "astronomer",
    "shipwright",
    "botanist",
    "engraver",
    "archivist",
    "clockmaker",
    "surveyor",
    "linguist",
    "beekeeper",
    "metallurgist",
)
_FILLER = (
    "{name} is mentioned in several regional chronicles.",
    "Accounts of {name} differ in small details from one archive to the next.",
    "Little of the correspondence concerning {name} has survived.",
    "Local historians have written at length about {name}.",
    "A short entry on {name} appears in an old gazetteer.",
    "Visitors often asked about {name} when passing through the region.",
    "Some records about {name} were damaged in a flood and later restored.",
    "The story of {name} is retold in a number of travel diaries.",
)


def _invented_name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


@dataclass(frozen=True)
class _Founding:
    """A founder and the organization they founded: two documents, four facts."""

    person: str
    birth_city: str
    profession: str
    organization: str
    city: str
    year: int


def _unique(rng: random.Random, taken: set[str], make: Callable[[random.Random], str]) -> str:
    while (name := make(rng)) in taken:
        pass
    taken.add(name)
    return name


def _new_founding(rng: random.Random, taken: set[str], cities: list[str]) -> _Founding:
    person = _unique(rng, taken, lambda r: f"{_invented_name(r, 2)} {_invented_name(r, 3)}")
    organization = _unique(rng, taken, lambda r: f"{_invented_name(r, 3)} {r.choice(_ORG_KINDS)}")
    birth_city, city = rng.sample(cities, 2)
    return _Founding(person, birth_city, rng.choice(_PROFESSIONS), organization, city, rng.randint(1700, 1990))


def _with_filler(rng: random.Random, name: str, facts: list[str]) -> str:
    sentences = facts + [template.format(name=name) for template in rng.sample(_FILLER, rng.randint(2, 4))]
    rng.shuffle(sentences)
    return " ".join(sentences)


def _documents(rng: random.Random, founding: _Founding) -> tuple[Document, Document]:
    f = founding
    person = Document(
        f.person,
        _with_filler(
            rng,
            f.person,
            [
                f"{f.person} was born in {f.birth_city}.",
                f"{f.person} worked as a {f.profession}.",
                f"{f.person} founded the {f.organization}.",
            ],
        ),
    )
    organization = Document(
        f.organization,
        _with_filler(
            rng,
            f.organization,
            [
                f"The {f.organization} is based in {f.city}.",
                f"The {f.organization} was established in {f.year}.",
            ],
        ),
    )
    return person, organization


def _questions(founding: _Founding) -> list[tuple[str, str, tuple[str, ...]]]:
    """(question, answer, titles of the documents it needs) for one founding."""
    f = founding
    return [
        (f"In which city was {f.person} born?", f.birth_city, (f.person,)),
        (f"What did {f.person} work as?", f.profession, (f.person,)),
        (f"In which year was the {f.organization} established?", str(f.year), (f.organization,)),
        (f"Who founded the {f.organization}?", f.person, (f.person,)),
        (f"In which city is the organization founded by {f.person} based?", f.city, (f.person, f.organization)),
    ]


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Count tokens with a transformers or tokenizers tokenizer, a path to one, or any ``str -> int`` callable."""
    if isinstance(tokenizer, str | os.PathLike):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(f"tokenizer must be a tokenizer, a path to one, or a callable, got {type(tokenizer).__name__}")


def _context(
    rng: random.Random, context_tokens: int, count_tokens: Callable[[str], int]
) -> tuple[list[_Founding], list[Document], int]:
    """Foundings and their shuffled documents, as many as fit in ``context_tokens``; also the prefix's token count."""
    cities = [_invented_name(rng, 2) + rng.choice(("burg", "ford", "mouth", "vale", "holm")) for _ in range(12)]
    taken: set[str] = set()
    foundings: list[_Founding] = []
    documents: list[Document] = []
    budget = context_tokens - count_tokens(context_prefix([]))
    # Per-document counts add up to about the exact count; the exact count of
    # the whole prefix then decides, dropping the last founding if over.
    estimate = 0
    while True:
        founding = _new_founding(rng, taken, cities)
        pair = _documents(rng, founding)
        cost = sum(count_tokens(f"Document [{len(documents) + 1}] {doc.title}\n{doc.text}\n\n") for doc in pair)
        if estimate + cost > budget and foundings:
            break
        foundings.append(founding)
        documents.extend(pair)
        estimate += cost
    order = list(range(len(documents)))
    rng.shuffle(order)
    while True:
        shuffled = [documents[i] for i in order]
        tokens = count_tokens(context_prefix(shuffled))
        if tokens <= context_tokens:
            return foundings, shuffled, tokens
        if len(foundings) == 1:
            raise ValueError(
                f"context_tokens={context_tokens} cannot hold one founder and organization ({tokens} tokens needed)"
            )
        dropped = foundings.pop()
        order = [i for i in order if documents[i].title not in (dropped.person, dropped.organization)]


@dataclass(frozen=True)
class SyntheticContext:
    """One generated context: its questions and the exact token count of the prefix they share."""

    context_id: str
    tokens: int
    examples: tuple[QAExample, ...]


def generate(
    num_contexts: int,
    questions_per_context: int,
    context_tokens: int,
    tokenizer: Any,
    seed: int = 0,
) -> list[SyntheticContext]:
    """``num_contexts`` contexts of ``questions_per_context`` questions each; the same arguments give the same data.

    ``context_tokens`` bounds each shared prefix (instruction and documents)
    as ``tokenizer`` counts it. A context too short for ``questions_per_context``
    distinct questions (five per founder) gets all it has.
    """
    for field, value in (
        ("num_contexts", num_contexts),
        ("questions_per_context", questions_per_context),
        ("context_tokens", context_tokens),
    ):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    count_tokens = token_counter(tokenizer)
    contexts = []
    for context_index in range(num_contexts):
        rng = random.Random(seed * 1_000_003 + context_index)
        context_id = f"synthetic-{seed}-{context_index}"
        foundings, documents, tokens = _context(rng, context_tokens, count_tokens)
        candidates = [question for founding in foundings for question in _questions(founding)]
        chosen = rng.sample(candidates, min(questions_per_context, len(candidates)))
        examples = tuple(
            QAExample(
                id=f"{context_id}-q{q_index}",
                question=question,
                answers=(answer,),
                documents=tuple(Document(doc.title, doc.text, doc.title in needed) for doc in documents),
                context_id=context_id,
            )
            for q_index, (question, answer, needed) in enumerate(chosen)
        )
        contexts.append(SyntheticContext(context_id, tokens, examples))
    return contexts
