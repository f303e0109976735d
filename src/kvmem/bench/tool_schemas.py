"""Twenty tool definitions of the kind agents send (OpenAI ``tools`` entries), for ``kvmem bench tools``: a
personal assistant's calendar, mail, files, web and errands. Data only; the benchmark takes the first n."""

from __future__ import annotations


def _tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    params = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


_S, _I, _B = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}


def _d(kind: dict, text: str, **more) -> dict:
    return {**kind, "description": text, **more}


TOOLS: list[dict] = [
    _tool(
        "get_weather",
        "Get the current weather and today's forecast for a city.",
        {
            "city": _d(_S, "City name, e.g. 'Lisbon'"),
            "unit": _d(_S, "Temperature unit", enum=["celsius", "fahrenheit"]),
        },
        ["city"],
    ),
    _tool(
        "send_email",
        "Send an email from the user's account.",
        {
            "to": _d({"type": "array", "items": _S}, "Recipient addresses"),
            "subject": _d(_S, "Subject line"),
            "body": _d(_S, "Plain-text body"),
            "cc": _d({"type": "array", "items": _S}, "Carbon-copy addresses"),
        },
        ["to", "subject", "body"],
    ),
    _tool(
        "search_email",
        "Search the user's mailbox and return matching messages, newest first.",
        {
            "query": _d(_S, "Words to look for in sender, subject or body"),
            "folder": _d(_S, "Folder to search", enum=["inbox", "sent", "archive", "all"]),
            "limit": _d(_I, "Most messages to return", minimum=1, maximum=50),
        },
        ["query"],
    ),
    _tool(
        "create_calendar_event",
        "Create an event in the user's calendar and invite attendees.",
        {
            "title": _d(_S, "Event title"),
            "start": _d(_S, "Start time, ISO 8601 (2026-12-08T09:30)"),
            "end": _d(_S, "End time, ISO 8601"),
            "attendees": _d({"type": "array", "items": _S}, "Email addresses to invite"),
            "location": _d(_S, "Where the event takes place"),
        },
        ["title", "start", "end"],
    ),
    _tool(
        "list_calendar_events",
        "List the user's calendar events between two dates.",
        {"from_date": _d(_S, "First day, YYYY-MM-DD"), "to_date": _d(_S, "Last day, YYYY-MM-DD")},
        ["from_date", "to_date"],
    ),
    _tool(
        "set_reminder",
        "Remind the user of something at a given time.",
        {
            "text": _d(_S, "What to remind the user of"),
            "at": _d(_S, "When, ISO 8601"),
            "repeat": _d(_S, "Repeat the reminder", enum=["never", "daily", "weekly", "monthly"]),
        },
        ["text", "at"],
    ),
    _tool(
        "web_search",
        "Search the web and return the top results with their titles, links and snippets.",
        {"query": _d(_S, "Search terms"), "num_results": _d(_I, "How many results", minimum=1, maximum=10)},
        ["query"],
    ),
    _tool(
        "fetch_url",
        "Download a web page and return its readable text.",
        {"url": _d(_S, "An http or https URL"), "max_chars": _d(_I, "Truncate the text to this many characters")},
        ["url"],
    ),
    _tool(
        "read_file",
        "Read a text file from the user's documents folder.",
        {"path": _d(_S, "Path relative to the documents folder"), "encoding": _d(_S, "Text encoding, default utf-8")},
        ["path"],
    ),
    _tool(
        "write_file",
        "Write text to a file in the user's documents folder, replacing it if it exists.",
        {
            "path": _d(_S, "Path relative to the documents folder"),
            "content": _d(_S, "The text to write"),
            "append": _d(_B, "Append instead of replacing"),
        },
        ["path", "content"],
    ),
    _tool(
        "add_todo",
        "Add an item to the user's to-do list.",
        {
            "title": _d(_S, "What needs doing"),
            "due": _d(_S, "Due date, YYYY-MM-DD"),
            "priority": _d(_S, "Priority", enum=["low", "normal", "high"]),
            "list": _d(_S, "Which list, e.g. 'work' or 'home'"),
        },
        ["title"],
    ),
    _tool(
        "list_todos",
        "List open items of the user's to-do list.",
        {"list": _d(_S, "Which list"), "include_done": _d(_B, "Include finished items")},
        [],
    ),
    _tool(
        "get_stock_quote",
        "Get the latest price and the day's change of a stock or fund.",
        {"symbol": _d(_S, "Ticker symbol, e.g. 'AAPL'"), "exchange": _d(_S, "Exchange code, e.g. 'NASDAQ'")},
        ["symbol"],
    ),
    _tool(
        "convert_currency",
        "Convert an amount between currencies at today's rate.",
        {
            "amount": _d({"type": "number"}, "Amount to convert"),
            "from_currency": _d(_S, "ISO 4217 code, e.g. 'EUR'"),
            "to_currency": _d(_S, "ISO 4217 code, e.g. 'USD'"),
        },
        ["amount", "from_currency", "to_currency"],
    ),
    _tool(
        "translate_text",
        "Translate text into another language.",
        {
            "text": _d(_S, "Text to translate"),
            "target_language": _d(_S, "Target language, ISO 639-1 code"),
            "formality": _d(_S, "Register of the translation", enum=["default", "formal", "informal"]),
        },
        ["text", "target_language"],
    ),
    _tool(
        "find_contact",
        "Look a person up in the user's address book.",
        {"name": _d(_S, "Full or partial name"), "field": _d(_S, "What to return", enum=["email", "phone", "all"])},
        ["name"],
    ),
    _tool(
        "send_chat_message",
        "Post a message to a team chat channel or a person.",
        {
            "channel": _d(_S, "Channel name (#general) or a person's handle (@ines)"),
            "text": _d(_S, "Message text, Markdown allowed"),
            "thread_id": _d(_S, "Reply in this thread"),
        },
        ["channel", "text"],
    ),
    _tool(
        "create_issue",
        "Open an issue in a code repository's tracker.",
        {
            "repository": _d(_S, "owner/name"),
            "title": _d(_S, "Issue title"),
            "body": _d(_S, "Description, Markdown"),
            "labels": _d({"type": "array", "items": _S}, "Labels to add"),
        },
        ["repository", "title"],
    ),
    _tool(
        "get_directions",
        "Plan a route between two places and return the steps and the travel time.",
        {
            "origin": _d(_S, "Start address or place"),
            "destination": _d(_S, "End address or place"),
            "mode": _d(_S, "How to travel", enum=["driving", "walking", "bicycling", "transit"]),
            "depart_at": _d(_S, "Departure time, ISO 8601"),
        },
        ["origin", "destination"],
    ),
    _tool(
        "book_restaurant",
        "Reserve a table at a restaurant.",
        {
            "restaurant": _d(_S, "Restaurant name and city"),
            "date": _d(_S, "YYYY-MM-DD"),
            "time": _d(_S, "HH:MM, 24-hour"),
            "party_size": _d(_I, "Number of people", minimum=1, maximum=20),
            "notes": _d(_S, "Requests for the restaurant"),
        },
        ["restaurant", "date", "time", "party_size"],
    ),
]

assert len(TOOLS) == 20 and len({t["function"]["name"] for t in TOOLS}) == 20
