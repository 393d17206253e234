"""The official `openai` Python client's tool-calling flow against kvgate (a worker, or the gateway).

Usage: python3 tests/openai_tools.py BASE_URL MODEL [gateway]   (e.g. http://127.0.0.1:8101/v1 smollm2)

The worker must run SmolLM2-135M-Instruct with `--tool-call-parser hermes`. The conversation
carries two worked examples of the Hermes `<tool_call>` format, after which the model (greedy)
answers the third question with a call (measured: `get_weather {"city": "Paris"}`). Checks:
tools → `tool_calls` (finish reason `tool_calls`, content null), the same streamed (the deltas
accumulate to the same call), then the tool result sent back → a final answer; then forced
calls (`tool_choice` naming the function, and `required`) without the worked examples. With
`gateway` (BASE_URL is a kvgate gateway, which stores responses): the same flow through the
Responses API as an agent runs it — the call, then only the tool's output sent with
`previous_response_id` — answered from the prefix the first request left cached, with the answer
the whole conversation sent at once gets. Exits non-zero on any failure; prints one line per check.
"""
import json
import sys

try:
    import openai
except ImportError:
    sys.exit("the `openai` package is missing: python3 -m pip install openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def example(city: str) -> str:
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"<tool_call>\n{call}\n</tool_call>"


def main() -> None:
    base, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    messages = [
        {
            "role": "system",
            "content": "You call the tool get_weather(city) for weather questions, "
            "replying only with a <tool_call> block.",
        },
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": example("Rome")},
        {"role": "user", "content": "What is the weather in Berlin?"},
        {"role": "assistant", "content": example("Berlin")},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    r = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="auto",
        max_tokens=40, temperature=0,
    )
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls", r
    assert calls and len(calls) == 1, r
    call = calls[0]
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name == "get_weather", call
    assert json.loads(call.function.arguments) == {"city": "Paris"}, call
    assert choice.message.content is None, choice.message
    print("tool call:", call.function.name, call.function.arguments, call.id)

    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=40, temperature=0, stream=True,
    )
    acc: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.content:
                content += c.delta.content
            for d in c.delta.tool_calls or []:
                slot = acc.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    slot["id"] = d.id
                if d.function and d.function.name:
                    slot["name"] += d.function.name
                if d.function and d.function.arguments:
                    slot["arguments"] += d.function.arguments
            if c.finish_reason:
                finish = c.finish_reason
    assert finish == "tool_calls", finish
    assert content == "", repr(content)
    assert list(acc) == [0], acc
    assert acc[0]["name"] == "get_weather", acc
    assert json.loads(acc[0]["arguments"]) == {"city": "Paris"}, acc
    print("streamed tool call:", acc[0])

    # Without tools offered the same text is plain content.
    plain = client.chat.completions.create(
        model=model, messages=messages, max_tokens=40, temperature=0
    )
    assert plain.choices[0].message.tool_calls is None, plain
    assert "<tool_call>" in plain.choices[0].message.content, plain
    print("no tools: content", repr(plain.choices[0].message.content[:30]))

    # The tool result goes back; the model answers. (SmolLM2's template concatenates every
    # message's content, so the call's turn carries "" rather than null: jinja2 refuses null.)
    messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, max_tokens=24, temperature=0
    )
    fc = final.choices[0]
    assert fc.finish_reason in ("stop", "length", "tool_calls"), final
    assert fc.message.content or fc.message.tool_calls, final
    assert final.usage.prompt_tokens > r.usage.prompt_tokens, (final.usage, r.usage)
    print("after the tool result:", fc.finish_reason, repr(fc.message.content), fc.message.tool_calls)
    print("tool flow ok")

    # Forced calls (no worked examples): a named function, `required` with one call
    # (`parallel_tool_calls=False`), then `required` as OpenAI's default (parallel calls: a
    # list of 1 to 16). The answer is held to the calls' JSON whatever the model would write.
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, parallel in ((named, None), ("required", False), ("required", None)):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        f = client.chat.completions.create(
            model=model, messages=ask, tools=TOOLS, tool_choice=choice, max_tokens=80,
            temperature=0, **extra,
        )
        fc = f.choices[0]
        assert fc.finish_reason == "tool_calls" and fc.message.content is None, f
        calls = fc.message.tool_calls
        if choice == "required" and parallel is None:
            assert 1 <= len(calls) <= 16, f
        else:
            assert len(calls) == 1, f
        assert len({c.id for c in calls}) == len(calls), f
        for forced in calls:
            args = json.loads(forced.function.arguments)
            assert forced.function.name == "get_weather", forced
            assert list(args) == ["city"] and isinstance(args["city"], str), forced
        print("forced", json.dumps(choice), extra, "->",
              [(c.function.name, c.function.arguments) for c in calls])
    print("forced calls ok")
    if len(sys.argv) > 3 and sys.argv[3] == "gateway":
        stored_flow(client, model, messages[:6])


def stored_flow(client, model: str, messages: list) -> None:
    """The tool flow through the Responses API with `previous_response_id` (the gateway's
    stored responses)."""
    tools = [dict(type="function", **t["function"]) for t in TOOLS]
    instructions = messages[0]["content"]
    items = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    first = client.responses.create(
        model=model, instructions=instructions, input=items, tools=tools,
        max_output_tokens=40, temperature=0,
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}, calls[0]
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}
    # Only the tool's output, continuing the stored response: the gateway sends (and routes)
    # the whole conversation, to the worker that holds its prefix.
    second = client.responses.create(
        model=model, previous_response_id=first.id, instructions=instructions, tools=tools,
        input=[result], max_output_tokens=24, temperature=0,
    )
    cached = second.usage.input_tokens_details.cached_tokens
    assert second.usage.input_tokens > first.usage.input_tokens, (second.usage, first.usage)
    assert cached >= 64, second.usage
    call = {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
            "arguments": calls[0].arguments}
    whole = client.responses.create(
        model=model, instructions=instructions, tools=tools, input=items + [call, result],
        max_output_tokens=24, temperature=0,
    )
    assert second.output_text == whole.output_text, (second.output_text, whole.output_text)
    assert whole.usage.input_tokens == second.usage.input_tokens, (whole.usage, second.usage)
    print(f"stored: {cached} of {second.usage.input_tokens} input tokens cached, "
          f"answer {second.output_text!r}")
    print("stored responses flow ok")


if __name__ == "__main__":
    main()
