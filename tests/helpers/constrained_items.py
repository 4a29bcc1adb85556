"""The constrained-decoding cases: JSON schemas, a choice list and a regex, the mix of constrained and free
requests the runs use, the extraction job's items, and the check that an output meets its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
from transformers import AutoTokenizer

from layerbus.broker.requests import GenerationRequest
from layerbus.wire.constraint import Constraint
from layerbus.wire.sampling import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"], "additionalProperties": False}
CHOICES = ["positive", "negative", "neutral"]
REGEX = r"[0-9]{3}-[a-z]{2,4}"
PRODUCT = {"type": "object", "properties": {"product": {"type": "string", "maxLength": 24},
                                            "price": {"type": "number", "minimum": 0},
                                            "in_stock": {"type": "boolean"}},
           "required": ["product", "price", "in_stock"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"event": {"type": "string", "maxLength": 24},
                                          "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
         "required": ["event", "year"], "additionalProperties": False}
PEOPLE = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth"]
CITIES = ["London", "Paris", "Oslo", "Lima", "Boston", "Zurich"]


def constraints() -> list[Constraint | None]:
    """The mix every run below uses: two schemas, any object, a choice, a regex, and free items."""
    return [Constraint.json_schema(PERSON), Constraint.json_schema(CITY), Constraint("json_object"),
            Constraint.choice(CHOICES), Constraint("regex", REGEX), None]


def check_output(constraint: Constraint | None, text: str) -> None:
    """An item that finished with "stop" matches its constraint: the schema (jsonschema), the choice or the regex."""
    if constraint is None:
        return
    if constraint.kind in ("json_schema", "json_object"):
        jsonschema.validate(json.loads(text), constraint.schema)
    elif constraint.kind == "choice":
        assert text in constraint.choices, f"{text!r} is not one of {constraint.choices}"
    else:
        assert re.fullmatch(constraint.value, text), f"{text!r} does not match {constraint.value!r}"


def mixed_requests(model_dir, count: int, max_new_tokens: int = 48) -> tuple[list[GenerationRequest], dict]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    kinds = constraints()
    requests, constraint_by_id = [], {}
    for i in range(count):
        constraint = kinds[i % len(kinds)]
        prompt = tokenizer.encode(f"item {i}: the broker sends rows")
        # Every other item samples (seeded): a mask must leave the seeded draw reproducible too.
        sampling = SamplingParams(temperature=0.8, top_k=50, seed=i) if i % 2 else SamplingParams()
        requests.append(GenerationRequest(f"r{i}", prompt, max_new_tokens=max_new_tokens, constraint=constraint,
                                          sampling=sampling))
        constraint_by_id[f"r{i}"] = constraint
    return requests, constraint_by_id


def extraction_items(count: int) -> list[tuple[str, Constraint]]:
    """An extraction job: prompts with per-item schemas (three different ones), a choice and a regex."""
    items = []
    for i in range(count):
        person, city = PEOPLE[i % len(PEOPLE)], CITIES[(i * 5) % len(CITIES)]
        kind = i % 5
        if kind == 0:
            items.append((f"{person} is {20 + i % 60} years old and lives in {city}. Extract the person as JSON "
                          "with name and age.", Constraint.json_schema(PERSON)))
        elif kind == 1:
            items.append((f"The shop in {city} sells a blue kettle for {10 + i % 40}.99 euros; it is "
                          f"{'in' if i % 2 else 'out of'} stock. Extract the product as JSON.", Constraint.json_schema(PRODUCT)))
        elif kind == 2:
            items.append((f"In {1900 + i % 120}, {person} gave a lecture in {city}. Extract the event and its year as "
                          "JSON.", Constraint.json_schema(EVENT)))
        elif kind == 3:
            items.append((f"Review {i}: the {city} hotel was {'wonderful' if i % 2 else 'dirty and loud'}. Is this "
                          "review positive, negative or neutral?", Constraint.choice(CHOICES)))
        else:
            items.append((f"Write the date {1 + i % 28} March {1950 + i % 70} in ISO form (YYYY-MM-DD).",
                          Constraint("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}")))
    return items
