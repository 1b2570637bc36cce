"""A tiny Qwen3-MoE checkpoint that chats: a small byte-level BPE tokenizer in the Qwen2 format
(tokenizer.json: Qwen2's pre-tokenizer split, byte-level BPE, the ChatML, thinking and tool-call
tokens added), trained here on a short corpus, and a chat template (written for these tests in
the ChatML-with-thinking-and-tools shape Qwen3's follows, using the Jinja features Qwen3's
template uses), plus what transformers' `apply_chat_template` renders for a set of
conversations (`chat_reference.json`). picchio's template engine and tokenizer are checked
against those ids; a real checkpoint brings its own template, which picchio renders the same
way.
"""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

# Qwen2's pre-tokenizer pattern (contractions, letters with one leading non-letter, single
# digits, punctuation runs, newlines, spaces).
SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added but not special (decoded as text): what Qwen3's tokenizer adds for thinking and tools.
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

CORPUS = [
    "You are a helpful assistant. What is the weather in Paris today? It is sunny, 21 degrees.",
    "Let me think about this step by step. First, the user wants the temperature.",
    'Call the function get_weather with {"city": "Paris", "unit": "celsius"} and report back.',
    "The answer is 42. Numbers like 3.14159 and 2026-12-07 appear too; so do émigrés and naïve café.",
    "# Tools\n\nYou may call functions. Each call is a JSON object with a name and arguments.\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "I'm sure you'll like it; we've checked, they'd agree. DON'T SHOUT!",
    "Bonjour, ça va ? ¿Qué tal? 你好，世界。 Привет, мир!",
] * 8

TEMPLATE = r"""{#- A ChatML conversation with Qwen3's thinking and tool-call conventions, for picchio's tests. -#}
{%- set ns = namespace(last_user=-1, system='') %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if ns.last_user < 0 and message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
        {%- set ns.last_user = index %}
    {%- endif %}
{%- endfor %}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content | trim %}
{%- endif %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if ns.system %}{{- ns.system + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nFunctions you may call, one JSON object per line inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call one, answer with <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' }}
{%- elif ns.system %}
    {{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('only the first message may be a system message') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content if message.content is string else '' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.lstrip('\n') }}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set function = call.function if call.function is defined else call %}
                {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
                {{- '<tool_call>\n{"name": "' + function.name + '", "arguments": ' }}
                {%- if function.arguments is string %}{{- function.arguments }}{%- else %}{{- function.arguments | tojson }}{%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b <exact> & more",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}

# Each: (name, messages, tools, add_generation_prompt, extra template arguments).
CONVERSATIONS = [
    ("user_only", [{"role": "user", "content": "Hi there!"}], None, True, {}),
    (
        "system_thinking_off",
        [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 6 x 7?"}],
        None,
        True,
        {"enable_thinking": False},
    ),
    (
        "multi_turn_with_reasoning",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 6 x 7?"},
            {"role": "assistant", "content": "42.", "reasoning_content": "Six sevens are forty-two."},
            {"role": "user", "content": "And 6 x 8?"},
            {"role": "assistant", "content": "<think>\nAdd six.\n</think>\n\n48."},
        ],
        None,
        False,
        {},
    ),
    (
        "tools_calls_and_results",
        [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "Weather in Paris and Oslo? Also 2 + 3."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Three calls.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
                    },
                    {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
                ],
            },
            {"role": "tool", "content": '{"temperature": 21, "sky": "sunny"}'},
            {"role": "tool", "content": '{"temperature": -3, "sky": "snow"}'},
            {"role": "tool", "content": "5"},
        ],
        [WEATHER, ADD],
        True,
        {},
    ),
    (
        "tools_without_system_thinking_off",
        [
            {"role": "user", "content": "Add 2 and 2, then say done."},
            {
                "role": "assistant",
                "content": "Calling add.",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}],
            },
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "Thanks! ¿Qué tal? 你好"},
        ],
        [ADD],
        True,
        {"enable_thinking": False},
    ),
]


def train_tokenizer(vocab_size):
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL) - len(ADDED),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.add_tokens(ADDED)
    return tokenizer


def write_tokenizer(out_dir, vocab_size):
    """tokenizer.json, tokenizer_config.json (with the template) and the ids of the stop and
    special tokens; returns the vocabulary size."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tokenizer.token_to_id(t) for t in SPECIAL + ADDED}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 262144,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "add_bos_token": False,
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return tokenizer.get_vocab_size(), ids


def write_generation_config(out_dir, ids):
    config = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_chat_reference(out_dir):
    """What transformers renders for each conversation: the text and its ids."""
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    cases = []
    for name, messages, tools, generation_prompt, extra in CONVERSATIONS:
        kwargs = dict(tools=tools, add_generation_prompt=generation_prompt, **extra)
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        assert tokenizer.decode(ids) == text, f"{name}: ids do not decode to the text"
        cases.append(
            dict(
                name=name,
                messages=messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                template_arguments=extra,
                text=text,
                ids=list(ids),
            )
        )
    with open(os.path.join(out_dir, "chat_reference.json"), "w") as f:
        json.dump({"tokenizer_class": type(tokenizer).__name__, "cases": cases}, f, indent=1, ensure_ascii=False)
