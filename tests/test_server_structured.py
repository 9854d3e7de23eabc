"""Structured outputs through the HTTP API with the official openai client, on the demo model with
speculation on: ``chat.completions.parse`` with pydantic models of varied shape returns parsed objects that
validate against their schemas, streaming gives the same text, and the vLLM-style extras work on both routes."""

from __future__ import annotations

import enum
import json
import re
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
Short = Field(max_length=24)


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class City(BaseModel):
    name: str = Short
    country: str = Short
    population: int = Field(ge=0, le=10**9)


class Flag(BaseModel):
    is_capital: bool


class Paint(BaseModel):
    color: Color


class Mood(BaseModel):
    mood: Literal["happy", "sad", "neutral"]


class Tags(BaseModel):
    tags: list[str] = Field(max_length=3)


class Scores(BaseModel):
    scores: list[int] = Field(max_length=4)


class Point(BaseModel):
    x: float
    y: float


class Line(BaseModel):
    start: Point
    end: Point


class Address(BaseModel):
    street: str = Short
    city: str = Short


class Customer(BaseModel):
    name: str = Short
    address: Address


class Item(BaseModel):
    name: str = Short
    quantity: int = Field(ge=0, le=100)


class Order(BaseModel):
    items: list[Item] = Field(max_length=2)


class Nickname(BaseModel):
    name: str = Short
    nickname: str | None


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: str | None = Field(max_length=24)


class Weather(BaseModel):
    temperature_c: float
    sky: Literal["sunny", "cloudy", "rainy"]


class Book(BaseModel):
    title: str = Short
    year: int = Field(ge=1000, le=2100)
    genres: list[Literal["fiction", "science", "history"]] = Field(max_length=2)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float


class Meeting(BaseModel):
    day: Literal["monday", "tuesday", "wednesday", "thursday", "friday"]
    hour: int = Field(ge=0, le=23)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Short
    age: int = Field(ge=0, le=40)


class Team(BaseModel):
    lead: Person
    size: int = Field(ge=1, le=50)


class Translation(BaseModel):
    source: str = Short
    target: str = Short
    language: Literal["fr", "de", "es"]


CASES: list[tuple[type[BaseModel], str]] = [
    (Person, "Alice is 31 years old."),
    (City, "Paris is in France and has 2 million people."),
    (Flag, "Is Rome the capital of Italy?"),
    (Paint, "Pick a color for a sunny sky."),
    (Mood, "I just won the lottery!"),
    (Tags, "Tag this post: learning python and rust."),
    (Scores, "The scores were 3, 7 and 9."),
    (Point, "The point is at x 1.5, y 2."),
    (Line, "A line from (0, 0) to (3, 4)."),
    (Customer, "Bob lives at 12 Main Street, Springfield."),
    (Order, "Two apples and one pear."),
    (Nickname, "Robert, usually called Bob."),
    (Rating, "Five stars, great food."),
    (Weather, "It is 21 degrees and sunny."),
    (Book, "Dune, a 1965 science fiction novel."),
    (Answer, "Is water wet?"),
    (Meeting, "Let's meet Tuesday at 3 pm."),
    (Pet, "My dog Rex is 4."),
    (Team, "Carol, 40, leads a team of 6."),
    (Translation, "'cat' in French is 'chat'."),
]


def _messages(text: str, model: type[BaseModel]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Extract a {model.__name__} as JSON from: {text}"}]


@pytest.mark.parametrize("model,text", CASES, ids=[m.__name__ for m, _ in CASES])
def test_parse_returns_valid_objects_and_stream_matches(client, model, text):
    done = client.chat.completions.parse(model=MODEL, messages=_messages(text, model), response_format=model,
                                         temperature=0, max_tokens=160)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    parsed = choice.message.parsed
    assert isinstance(parsed, model)
    schema = model.model_json_schema()
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert done.usage is not None and done.usage.completion_tokens > 0
    # the json_schema form, streamed: the same text
    stream = client.chat.completions.create(
        model=MODEL, messages=_messages(text, model), temperature=0, max_tokens=160, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": model.__name__, "schema": schema,
                                                                "strict": True}})
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == choice.message.content


def test_speculation_was_on(client, server_engine):
    spec = server_engine.get_metrics()["speculative"]
    assert spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0


def test_json_object_mode(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat."}],
                                         response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    text = out.choices[0].message.content or ""
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_vllm_extras_on_both_routes(client):
    done = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", done.choices[0].text)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick one."}],
                                          max_tokens=8, temperature=0,
                                          extra_body={"guided_choice": ["left", "right"]})
    assert chat.choices[0].message.content in ("left", "right")
    grammar = 'root ::= "(" [a-z]+ ")"'
    g = client.completions.create(model=MODEL, prompt="A word in brackets:", max_tokens=12, temperature=0,
                                  extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"\([a-z]+\)", g.choices[0].text) or g.choices[0].finish_reason == "length"


def test_logit_bias_and_min_tokens(client, server_engine):
    tok = server_engine.tokenizer
    target = tok.encode(" banana", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt="My favourite fruit is", max_tokens=3, temperature=0,
                                    logit_bias={str(target): 100})
    assert out.choices[0].text.startswith(" banana")
    eos = sorted(server_engine.eos_token_ids)[0]
    end = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                         max_tokens=12, temperature=0, logit_bias={str(eos): 100},
                                         extra_body={"min_tokens": 5})
    assert end.usage is not None and end.usage.completion_tokens >= 5
