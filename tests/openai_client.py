"""Talks to a kvgate worker with the official `openai` Python client.

Usage: python3 tests/openai_client.py BASE_URL   (e.g. http://127.0.0.1:8101/v1)

Checks: a non-streaming chat completion (text, finish reason, usage with cached tokens), the
same request streamed (same greedy text, usage chunk), a legacy completion, the model list,
`n` choices streamed and not, structured outputs from a pydantic model (pattern, date, date-time,
UUID, bounded integer; a URL, `format: uri`; untagged `Union`s; dicts, `Any`, a tuple and a set of
literals) parsed by the client, that a `oneOf` of alternatives that begin alike and an
out-of-range `n` raise BadRequestError naming them.
Exits non-zero on any failure; prints one line per check.
"""
import json
import sys

try:
    import openai
except ImportError:
    sys.exit("the `openai` package is missing: python3 -m pip install openai")


def main() -> None:
    base = sys.argv[1]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]

    models = client.models.list()
    assert len(models.data) >= 1, models
    print("models:", [m.id for m in models.data])

    r = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0, seed=7
    )
    text = r.choices[0].message.content
    assert r.object == "chat.completion", r
    assert text and text.strip(), r
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    print("chat:", repr(text), r.usage)

    again = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=12, temperature=0, seed=7
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0, again.usage
    assert again.choices[0].message.content == text
    print("cached_tokens on repeat:", cached)

    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(parts)
    assert streamed == text, (streamed, text)
    assert finish in ("stop", "length"), finish
    assert usage is not None and usage.completion_tokens > 0, usage
    print("stream:", repr(streamed), usage)

    c = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=5, temperature=0)
    assert c.choices[0].text is not None and c.usage.completion_tokens > 0, c
    print("completion:", repr(c.choices[0].text))

    # Scoring a prompt, as evaluation harnesses do: `echo` with `logprobs`, nothing generated
    # (`max_tokens=0`), or with one token generated after the prompt.
    s = client.completions.create(
        model="smollm2", prompt="The sky is blue", max_tokens=0, echo=True, logprobs=2,
    )
    lp = s.choices[0].logprobs
    assert s.choices[0].text == "The sky is blue", s
    assert s.usage.completion_tokens == 0 and s.usage.prompt_tokens == len(lp.tokens), s.usage
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:]), lp
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:]), lp
    assert "".join(lp.tokens) == s.choices[0].text, lp.tokens
    one = client.completions.create(
        model="smollm2", prompt="The sky is blue", max_tokens=1, echo=True, logprobs=2,
        temperature=0,
    )
    lp1 = one.choices[0].logprobs
    assert one.choices[0].text.startswith("The sky is blue"), one
    assert lp1.token_logprobs[: len(lp.tokens)] == lp.token_logprobs, (lp1, lp)
    assert len(lp1.tokens) == len(lp.tokens) + 1 and one.usage.completion_tokens == 1, one
    print("echo:", lp.tokens, [round(x, 3) for x in lp.token_logprobs[1:]])

    r = client.chat.completions.create(
        model="smollm2", messages=messages, n=3, max_tokens=8, temperature=1.0, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2], r
    assert all(c.message.content is not None for c in r.choices), r
    assert r.usage.completion_tokens <= 3 * 8 and r.usage.completion_tokens >= 3, r.usage
    print("n=3:", [c.message.content for c in r.choices], r.usage)

    parts = {}
    for chunk in client.chat.completions.create(
        model="smollm2", messages=messages, n=2, max_tokens=8, temperature=1.0, seed=5,
        stream=True,
    ):
        for c in chunk.choices:
            parts.setdefault(c.index, []).append(c.delta.content or "")
    streamed = ["".join(parts[i]) for i in sorted(parts)]
    assert streamed == [c.message.content for c in r.choices[:2]], (streamed, r.choices)
    print("n=2 streamed: the first two choices of n=3 (same seeds)")

    # The Responses API: the same conversation, the same greedy answer as chat gave.
    rr = client.responses.create(
        model="smollm2", instructions=messages[0]["content"], input=messages[1]["content"],
        max_output_tokens=12, temperature=0,
    )
    assert rr.object == "response" and rr.output_text == text, (rr, text)
    assert rr.usage.input_tokens == r.usage.prompt_tokens, (rr.usage, r.usage)
    events = [
        e for e in client.responses.create(
            model="smollm2", instructions=messages[0]["content"], input=messages[1]["content"],
            max_output_tokens=12, temperature=0, stream=True,
        )
    ]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text, (streamed, text)
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    assert events[-1].response.output_text == text, events[-1]
    print("responses:", repr(rr.output_text), [e.type for e in events][:3], "...")
    rl = client.responses.create(
        model="smollm2", instructions=messages[0]["content"], input=messages[1]["content"],
        max_output_tokens=12, temperature=0, include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    lps = rl.output[0].content[0].logprobs
    assert rl.output_text == text and lps, rl
    assert "".join(lp.token for lp in lps) == text, [lp.token for lp in lps]
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in lps), lps
    print("responses logprobs:", [(lp.token, round(lp.logprob, 3)) for lp in lps][:4], "...")

    # Structured outputs from a pydantic model, parsed and validated by the client: a pattern,
    # dates and times, a UUID, a bounded integer and a bounded number (`format`, `pattern`,
    # `minimum`, `maximum`, `exclusiveMaximum`, `multipleOf`).
    import datetime
    import uuid

    from pydantic import BaseModel, Field

    class Booking(BaseModel):
        code: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
        day: datetime.date
        starts: datetime.datetime
        guests: int = Field(ge=1, le=12)
        deposit: float = Field(ge=0, lt=1000)
        tip_percent: int = Field(ge=0, le=30, multiple_of=5)
        ref: uuid.UUID

    completions = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse

    def parsed(model, prompt, max_tokens):
        """The greedy answer to one user `prompt`, held to and parsed as pydantic `model`."""
        return completions(
            model="smollm2",
            messages=[{"role": "user", "content": prompt}],
            response_format=model,
            max_tokens=max_tokens,
            temperature=0,
        )
    booked = parsed(Booking, "Book a table for 4 people on 14 March 2025 at 19:30 UTC. Answer in JSON.", 160)
    b = booked.choices[0].message.parsed
    assert isinstance(b, Booking) and 1 <= b.guests <= 12 and 0 <= b.deposit < 1000, booked
    assert b.tip_percent % 5 == 0, booked
    print("structured (pydantic, parsed):", b.model_dump_json())
    # URLs (`format: uri`): pydantic's HttpUrl (at most 2,083 characters) and AnyUrl, checked
    # by pydantic's own URL parser.
    from pydantic import AnyUrl, HttpUrl

    class Site(BaseModel):
        name: str
        homepage: HttpUrl
        source: AnyUrl

    site = parsed(Site, "Give the name, homepage and source code URL of the Rust programming language as JSON.", 150)
    sp = site.choices[0].message.parsed
    assert isinstance(sp, Site) and sp.homepage.scheme and sp.source.scheme, site
    print("structured (pydantic AnyUrl, parsed):", sp.model_dump_json())
    # Untagged unions (`anyOf` whose alternatives begin alike, as pydantic writes `Union`s
    # without a discriminator): two models that both begin with `name`, a whole or
    # fractional number, and a date or a date-time (both begin with the date).
    from typing import Union

    class Person(BaseModel):
        name: str
        email: str

    class Company(BaseModel):
        name: str
        vat_number: str
        employees: int

    class Invoice(BaseModel):
        customer: Union[Person, Company]
        amount: Union[int, float]
        due: Union[datetime.date, datetime.datetime]

    invoice = parsed(Invoice, "Write an invoice for Acme Ltd (VAT GB123, 40 employees): 1250.50 due on 1 May 2025. Answer in JSON.", 160)
    inv = invoice.choices[0].message.parsed
    assert isinstance(inv, Invoice), invoice
    assert isinstance(inv.customer, (Person, Company)), inv
    assert isinstance(inv.due, (datetime.date, datetime.datetime)), inv
    print("structured (pydantic Union, parsed):", inv.model_dump_json())
    # Dicts (`additionalProperties`: keys of the model's choice) and `Any` (`{}`: any JSON).
    from typing import Any, Literal

    class Inventory(BaseModel):
        counts: dict[str, int]
        notes: dict[str, Any]
        extra: Any
        shelf: tuple[int, str]
        tags: set[Literal["fruit", "fresh", "local", "organic"]]
        by_colour: dict[Literal["red", "green", "yellow"], int]

    stock = parsed(Inventory, "We have 3 apples and 5 pears. Give the stock counts as JSON.", 400)
    inventory = stock.choices[0].message.parsed
    assert isinstance(inventory, Inventory), stock
    assert all(isinstance(v, int) for v in inventory.counts.values()), inventory
    assert isinstance(inventory.shelf[0], int) and isinstance(inventory.shelf[1], str), inventory
    answer = json.loads(stock.choices[0].message.content)
    assert len(answer["tags"]) == len(set(answer["tags"])), stock.choices[0].message.content
    assert set(inventory.by_colour) <= {"red", "green", "yellow"}, inventory
    print("structured (pydantic dict, Any, tuple and set, parsed):", inventory.model_dump_json())
    # Keys of the model's choice after the listed ones (pydantic's `extra="allow"`).
    from pydantic import ConfigDict

    class Note(BaseModel):
        model_config = ConfigDict(extra="allow")
        title: str

    note = parsed(Note, 'Answer in JSON with a "title" of "Shopping" and an "items" list: milk, eggs.', 150)
    written = note.choices[0].message.parsed
    assert isinstance(written, Note), note
    first_key = next(iter(json.loads(note.choices[0].message.content)))
    assert first_key == "title", note.choices[0].message.content
    assert written.model_extra, note.choices[0].message.content
    print("structured (pydantic extra=allow, parsed):", written.model_dump_json())
    # `oneOf` alternatives that begin alike are refused, naming the place (a text both
    # match would break `oneOf`).
    one_of = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    try:
        client.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "v", "schema": one_of}},
        )
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        assert err.get("code") == "unsupported_parameter", e.body
        assert "/properties/v" in err.get("message", "") and "anyOf" in err.get("message", ""), e.body
        print("oneOf of alike alternatives refused:", err.get("message"))
    else:
        raise AssertionError("an ambiguous oneOf was accepted")
    # The same model through the Responses API (`text.format`), parsed by the client.
    rp = client.responses.parse(
        model="smollm2",
        input="Book a table for 4 people on 14 March 2025 at 19:30 UTC. Answer in JSON.",
        text_format=Booking,
        max_output_tokens=160,
        temperature=0,
    )
    assert isinstance(rp.output_parsed, Booking), rp
    assert rp.output_parsed == b, (rp.output_parsed, b)
    print("structured via responses.parse: the same booking")

    try:
        client.chat.completions.create(model="smollm2", messages=messages, n=17, max_tokens=2)
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        assert err.get("param") == "n", e.body
        assert err.get("code") == "invalid_value", e.body
        print("n=17 refused:", err.get("message"))
    else:
        raise AssertionError("n=17 was accepted")

    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
