"""Tool definitions, the question and the call check the tool-call tests share (OpenAI's ``tools`` format)."""

import json

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
EMAIL = {
    "type": "function",
    "function": {
        "name": "send_email",
        "description": "Send an email",
        "parameters": {
            "type": "object",
            "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
            "required": ["to", "body"],
        },
    },
}
TOOLS = [WEATHER, EMAIL]
ASK = [{"role": "user", "content": "What's the weather like where I live?"}]


def checked_call(call, name: str) -> dict:
    """The call's arguments, checked: an OpenAI call of ``name`` whose arguments parse and match its schema."""
    import jsonschema

    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"])
    return args
