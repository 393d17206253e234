#!/usr/bin/env python3
"""The official `openai` Python client through the kvgate gateway, streaming and not.

Usage: python3 tests/gateway_openai.py BASE_URL   (e.g. http://127.0.0.1:8080/v1)

Run by the Rust test `gateway_ops::openai_python_client_through_the_gateway`, which starts
simulated workers and a gateway in-process and passes the gateway's URL. Exits non-zero with a
clear message when the `openai` package is missing (`python3 -m pip install openai`).
"""
import json
import sys


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    base_url = sys.argv[1]
    try:
        import openai
    except ImportError:
        print("the `openai` package is not installed: python3 -m pip install openai", file=sys.stderr)
        return 3

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 4},
        {"role": "user", "content": "Say hello."},
    ]

    # Non-streaming.
    r = client.chat.completions.create(model="smol", messages=messages, max_tokens=5)
    assert r.choices, r
    assert isinstance(r.choices[0].message.content, str), r
    assert r.usage is not None and r.usage.prompt_tokens > 0, r.usage
    print(f"non-streaming ok: {r.usage.prompt_tokens} prompt tokens, "
          f"{r.usage.completion_tokens} completion tokens")

    # The same conversation again: KV-exact routes it to the worker holding the prefix.
    r2 = client.chat.completions.with_raw_response.create(model="smol", messages=messages, max_tokens=3)
    worker = r2.headers.get("x-kvgate-worker")
    reason = r2.headers.get("x-kvgate-route-reason")
    assert worker, "the gateway did not name the worker"
    print(f"second turn: worker {worker}, reason {reason}")

    # Streaming, with usage in the last chunk.
    stream = client.chat.completions.create(
        model="smol",
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = 0
    usage = None
    text = ""
    for chunk in stream:
        chunks += 1
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert chunks >= 2, f"only {chunks} chunks"
    assert usage is not None and usage.completion_tokens > 0, usage
    print(f"streaming ok: {chunks} chunks, {usage.completion_tokens} completion tokens")

    # The models the gateway's services name (`match.models`), listed by the gateway itself.
    models = sorted(m.id for m in client.models.list())
    assert models == ["smol", "smol-rr"], models
    assert client.models.retrieve("smol-rr").id == "smol-rr"
    try:
        client.models.retrieve("no-such-model")
    except openai.NotFoundError as e:
        code = e.body.get("code") if isinstance(e.body, dict) else None
        assert code == "model_not_found", e.body
    else:
        raise AssertionError("an unknown model was found")
    print(f"models ok: {models}")

    # JSON mode, as the client sends it: the (simulated) answer is a JSON object, or a prefix
    # of one when max_tokens cuts it.
    j = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=24,
        logit_bias={"5": -100},
    )
    text = j.choices[0].message.content
    assert text.lstrip().startswith("{"), text
    if j.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict), text
    print(f"json mode ok: {j.choices[0].finish_reason}")

    # Several choices (`n`), streamed through the gateway: each choice's text under its index.
    parts = {}
    for chunk in client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Two answers, please."}],
        n=2, max_tokens=6, temperature=1.0, seed=3, stream=True,
    ):
        for ch in chunk.choices:
            parts.setdefault(ch.index, []).append(ch.delta.content or "")
    assert sorted(parts) == [0, 1] and all("".join(p) for p in parts.values()), parts
    print("n=2 ok")

    # OpenAI's prompt-cache hints and safety identifier, as the client sends them: accepted
    # (kvgate's routing matches the prompt itself), on both APIs.
    hinted = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Hello again."}], max_tokens=3,
        prompt_cache_key="conversation-42", prompt_cache_retention="24h",
        prompt_cache_options={"mode": "implicit", "ttl": "30m"}, safety_identifier="user-7f3a")
    assert hinted.choices[0].message.content is not None, hinted
    hinted = client.responses.create(
        model="smol", input="Hello again.", max_output_tokens=3, store=False,
        prompt_cache_key="conversation-42", safety_identifier="user-7f3a")
    assert hinted.output, hinted
    try:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "x"}], max_tokens=2,
            prompt_cache_options={"mode": "explicit"})
        raise AssertionError("explicit cache breakpoints accepted")
    except openai.BadRequestError as e:
        assert e.code == "unsupported_parameter", e
    print("prompt cache hints ok")

    # The Responses API through the gateway (KV-exact: the gateway reads it as the worker does).
    rr = client.responses.create(model="smol", input="Say hello.", max_output_tokens=6)
    assert rr.object == "response" and rr.output and rr.usage.output_tokens > 0, rr
    kinds = [e.type for e in client.responses.create(
        model="smol", input="Say hello.", max_output_tokens=6, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed", "response.incomplete"), kinds
    print("responses ok")

    # Stored responses: the gateway keeps the answer and continues the conversation from it.
    second = client.responses.create(
        model="smol", previous_response_id=rr.id, input="And then?", max_output_tokens=4,
        temperature=0)
    assert second.usage.input_tokens > rr.usage.input_tokens, (second.usage, rr.usage)
    # The answers say what the gateway did: stored, and which turn they continue.
    assert rr.store is True and rr.previous_response_id is None, rr
    assert second.store is True and second.previous_response_id == rr.id, second
    kept = client.responses.retrieve(rr.id)
    assert kept.id == rr.id and kept.output[0].type == rr.output[0].type, kept
    streamed = list(client.responses.create(
        model="smol", previous_response_id=second.id, input="Last.", max_output_tokens=3,
        stream=True))
    third = streamed[-1].response
    assert third.store is True and third.previous_response_id == second.id, third
    assert client.responses.retrieve(third.id).previous_response_id == second.id
    items = list(client.responses.input_items.list(second.id))
    assert len(items) == 1 and items[0].content[0].text == "And then?", items
    client.responses.delete(rr.id)
    try:
        client.responses.create(model="smol", previous_response_id=third.id, input="x")
    except openai.BadRequestError as e:
        assert e.body.get("code") == "previous_response_not_found", e.body
    else:
        raise AssertionError("a conversation with a deleted turn was continued")
    try:
        client.responses.retrieve(rr.id)
    except openai.NotFoundError as e:
        assert e.body.get("code") == "response_not_found", e.body
    else:
        raise AssertionError("a deleted response was found")
    print("stored responses ok")

    # Background responses: answered queued, polled to the answer, cancel answers it as it is.
    import time
    bg = client.responses.create(
        model="smol", input="Say hello.", max_output_tokens=5, temperature=0, background=True)
    assert bg.status in ("queued", "in_progress") and bg.background is True, bg
    assert bg.store is True and bg.output == [], bg
    deadline = time.monotonic() + 20
    while bg.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.05)
        bg = client.responses.retrieve(bg.id)
    assert bg.status in ("completed", "incomplete") and bg.output, bg
    assert bg.background is True and bg.usage.output_tokens == 5, bg
    assert client.responses.cancel(bg.id).status == bg.status
    later = client.responses.create(
        model="smol", previous_response_id=bg.id, input="Again.", max_output_tokens=2)
    assert later.previous_response_id == bg.id, later
    try:
        client.responses.cancel(later.id)
    except openai.BadRequestError as e:
        assert e.body.get("code") == "response_not_background", e.body
    else:
        raise AssertionError("a response not made in the background was cancelled")
    print("background responses ok")

    # Streamed in the background: read a few events, go, resume from the last one read.
    stream = client.responses.create(
        model="smol", input="Tell a story.", max_output_tokens=12, temperature=0,
        background=True, stream=True)
    first = []
    for event in stream:
        first.append(event)
        if len(first) == 5:
            break
    stream.close()
    assert first[0].type == "response.created" and first[0].response.background is True, first
    rid, cursor = first[0].response.id, first[-1].sequence_number
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=cursor))
    assert rest[0].sequence_number == cursor + 1, rest[0]
    assert rest[-1].type in ("response.completed", "response.incomplete"), rest[-1]
    text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
    assert text == rest[-1].response.output_text, (text, rest[-1].response.output_text)
    print("background streams ok")

    # A conversation over the context, truncated from its start.
    turns = [{"role": "system", "content": "You are brief."}]
    for i in range(80):
        turns.append({"role": "user", "content": f"Turn {i}: tell me about the harbour. " * 12})
        turns.append({"role": "assistant", "content": f"Answer {i}."})
    turns.append({"role": "user", "content": "And now?"})
    try:
        client.responses.create(model="smol", input=turns, max_output_tokens=4)
    except openai.BadRequestError as e:
        assert e.body.get("code") == "context_length_exceeded", e.body
    else:
        raise AssertionError("a conversation over the context was accepted without truncation")
    cut = client.responses.create(model="smol", input=turns, max_output_tokens=4, truncation="auto")
    assert cut.truncation == "auto" and cut.usage.input_tokens + 4 <= 8192, cut.usage
    print("truncation ok")

    # Counting input tokens: what a create of the same request is charged, a continued
    # conversation counted whole; on a round-robin service (no profile) a worker counts.
    ask = dict(model="smol", instructions="Be brief.", input="Where is the harbour?")
    n = client.responses.input_tokens.count(**ask)
    made = client.responses.create(max_output_tokens=4, temperature=0, **ask)
    assert n.object == "response.input_tokens" and n.input_tokens == made.usage.input_tokens, (n, made.usage)
    on = dict(model="smol", previous_response_id=made.id, input="And the ships?")
    n2 = client.responses.input_tokens.count(**on)
    made2 = client.responses.create(max_output_tokens=4, **on)
    assert n.input_tokens < n2.input_tokens == made2.usage.input_tokens, (n2, made2.usage)
    assert client.responses.input_tokens.count(model="smol", input=turns, truncation="auto").input_tokens \
        == cut.usage.input_tokens
    rr = dict(ask, model="smol-rr")
    assert client.responses.input_tokens.count(**rr).input_tokens == n.input_tokens
    print(f"input tokens ok: {n.input_tokens}, continued {n2.input_tokens}")

    # Conversations: made, two turns in one (the second sent with the first), items added,
    # read and deleted, the metadata changed, deleted.
    conv = client.conversations.create(
        items=[{"type": "message", "role": "system", "content": "You are brief."}],
        metadata={"topic": "harbour"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "harbour"}, conv
    a = client.responses.create(model="smol", conversation=conv.id, input="Where is the harbour?",
                                max_output_tokens=4, temperature=0)
    assert a.conversation is not None and a.conversation.id == conv.id, a
    counted = client.responses.input_tokens.count(model="smol", conversation=conv.id, input="And the ships?")
    b = client.responses.create(model="smol", conversation={"id": conv.id}, input="And the ships?",
                                max_output_tokens=4, temperature=0)
    assert counted.input_tokens == b.usage.input_tokens > a.usage.input_tokens, (counted, a.usage, b.usage)
    listed = list(client.conversations.items.list(conv.id, order="asc", limit=2))
    assert [i.role for i in listed] == ["system", "user", "assistant", "user", "assistant"], listed
    assert listed[2].id == a.output[0].id, (listed[2], a.output[0])
    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": "A note."}])
    note = added.data[0].id
    assert client.conversations.items.retrieve(note, conversation_id=conv.id).id == note
    client.conversations.items.delete(note, conversation_id=conv.id)
    assert len(list(client.conversations.items.list(conv.id))) == 5
    assert client.conversations.update(conv.id, metadata={"topic": "ships"}).metadata == {"topic": "ships"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "ships"}
    assert client.conversations.delete(conv.id).deleted is True
    try:
        client.conversations.retrieve(conv.id)
    except openai.NotFoundError as e:
        assert e.body.get("code") == "conversation_not_found", e.body
    else:
        raise AssertionError("a deleted conversation was found")
    print("conversations ok")

    # A legacy completion.
    c = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=3)
    assert c.choices and isinstance(c.choices[0].text, str), c
    print("completions ok")

    # An error: the OpenAI client raises BadRequestError with the gateway's code.
    try:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "x " * 20000}], max_tokens=4)
    except openai.BadRequestError as e:
        code = e.body.get("code") if isinstance(e.body, dict) else None
        assert code == "context_length_exceeded", e.body
        print("error ok: context_length_exceeded")
    else:
        raise AssertionError("an over-budget prompt was accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
