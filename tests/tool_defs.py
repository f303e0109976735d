"""Tool definitions and the question the tool-call tests share (OpenAI's ``tools`` format)."""

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
