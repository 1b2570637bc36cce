#!/usr/bin/env python3
"""Renders a set of Harmony conversations with the official openai-harmony package and writes
them, with their token ids, to fixtures/harmony/conversations.json. picchio's tests render the
same conversations and must produce identical ids. CI does not need Python: the output is
committed.

    pip install openai-harmony
    TIKTOKEN_ENCODINGS_BASE=DIR python3 tools/make_harmony_fixtures.py

DIR holds o200k_base.tiktoken (the tiktoken-rs crate ships it in its assets/ folder).
"""
import json
import pathlib

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

WEATHER = {
    "name": "get_current_weather",
    "description": "Gets the current weather in the provided location.",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            },
            "format": {
                "type": "string",
                "enum": ["celsius", "fahrenheit"],
                "default": "celsius",
            },
        },
        "required": ["location"],
    },
}
SEARCH = {
    "name": "search",
    "description": "Searches the web.",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "max_results": {"type": "integer", "description": "How many results", "default": 5},
            "fresh": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "score": {"type": "number"},
        },
        "required": ["query"],
    },
}
NOW = {"name": "get_time", "description": "Current time."}

# Each conversation: optional system and developer settings, then messages.
CONVERSATIONS = [
    {"name": "default_system_user", "system": {}, "messages": [{"role": "user", "content": "Say hi."}]},
    {
        "name": "no_system",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
    },
    {
        "name": "full_system_low_effort",
        "system": {
            "model_identity": "You are a helpful assistant.",
            "reasoning_effort": "low",
            "knowledge_cutoff": "2024-06",
            "conversation_start_date": "2026-11-29",
        },
        "messages": [{"role": "user", "content": "Tell me a joke about cats.\nKeep it short."}],
    },
    {
        "name": "developer_instructions_high_effort",
        "system": {"reasoning_effort": "high", "conversation_start_date": "2025-06-28"},
        "developer": {"instructions": "Always respond in riddles"},
        "messages": [{"role": "user", "content": "What's the capital of France?"}],
    },
    {
        "name": "multi_turn_drops_old_analysis",
        "system": {},
        "developer": {"instructions": "Be brief."},
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "channel": "analysis", "content": "Greet back."},
            {"role": "assistant", "channel": "final", "content": "Hello! How can I help?"},
            {"role": "user", "content": "What is 7 * 6?"},
        ],
    },
    {
        "name": "tools_call_and_result",
        "system": {"conversation_start_date": "2025-06-28"},
        "developer": {"instructions": "Use tools when useful.", "tools": [WEATHER, NOW]},
        "messages": [
            {"role": "user", "content": "What is the weather in Tokyo?"},
            {"role": "assistant", "channel": "analysis", "content": "Need to call the weather tool."},
            {
                "role": "assistant",
                "channel": "commentary",
                "recipient": "functions.get_current_weather",
                "content_type": "<|constrain|>json",
                "content": "{\"location\":\"Tokyo\"}",
            },
            {
                "role": "tool",
                "name": "functions.get_current_weather",
                "channel": "commentary",
                "content": "{\"temperature\": 20, \"sky\": \"clear\"}",
            },
        ],
    },
    {
        "name": "tools_without_instructions",
        "system": {"reasoning_effort": "medium"},
        "developer": {"tools": [SEARCH]},
        "messages": [{"role": "user", "content": "Find news about Rust 2024 edition."}],
    },
    {
        "name": "unicode_and_whitespace",
        "system": {},
        "messages": [{"role": "user", "content": "  Ciao, città! 東京 🌸\n\n\ttabs and  spaces  "}],
    },
]

EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


def system_message(settings):
    content = SystemContent.new()
    if "model_identity" in settings:
        content = content.with_model_identity(settings["model_identity"])
    if "reasoning_effort" in settings:
        content = content.with_reasoning_effort(EFFORT[settings["reasoning_effort"]])
    if "knowledge_cutoff" in settings:
        content = content.with_knowledge_cutoff(settings["knowledge_cutoff"])
    if "conversation_start_date" in settings:
        content = content.with_conversation_start_date(settings["conversation_start_date"])
    return Message.from_role_and_content(Role.SYSTEM, content)


def developer_message(settings):
    content = DeveloperContent.new()
    if "instructions" in settings:
        content = content.with_instructions(settings["instructions"])
    if "tools" in settings:
        content = content.with_function_tools(
            [ToolDescription.new(t["name"], t["description"], parameters=t.get("parameters")) for t in settings["tools"]]
        )
    return Message.from_role_and_content(Role.DEVELOPER, content)


def message(m):
    if m["role"] == "tool":
        out = Message.from_author_and_content(Author.new(Role.TOOL, m["name"]), m["content"]).with_recipient("assistant")
    else:
        out = Message.from_role_and_content(Role(m["role"]), m["content"])
    if "channel" in m:
        out = out.with_channel(m["channel"])
    if "recipient" in m:
        out = out.with_recipient(m["recipient"])
    if "content_type" in m:
        out = out.with_content_type(m["content_type"])
    return out


def main():
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    out = []
    for c in CONVERSATIONS:
        messages = []
        if "system" in c:
            messages.append(system_message(c["system"]))
        if "developer" in c:
            messages.append(developer_message(c["developer"]))
        messages += [message(m) for m in c["messages"]]
        ids = encoding.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)
        out.append({**c, "ids": ids, "text": encoding.decode_utf8(ids)})
    special = {name: encoding.encode(name, allowed_special="all")[0] for name in [
        "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
        "<|endoftext|>", "<|startoftext|>"]}
    path = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "harmony" / "conversations.json"
    path.write_text(json.dumps({
        "generator": "openai-harmony " + __import__("importlib.metadata").metadata.version("openai-harmony"),
        "special_tokens": special,
        "stop_tokens_for_assistant_actions": sorted(encoding.stop_tokens_for_assistant_actions()),
        "conversations": out,
    }, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} conversations to {path}")


if __name__ == "__main__":
    main()
