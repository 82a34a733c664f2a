"""Records how transformers (Jinja2 in transformers' sandboxed environment) renders chat templates, so the Rust
rendering (crates/backburner-model/src/chat/) can be tested against it without Python:

- `template_cases`: small templates that probe every filter, method and test chat templates use (trim, strip,
  split, startswith, tojson with its options, string, items, length, is string/mapping/sequence/iterable, ...) on
  awkward values (Python whitespace such as \\x1c-\\x1f, \\x85, \\xa0, U+2028, U+3000; floats; non-ASCII; quotes).
- `chat_cases`: the Qwen3.5 template (assets/qwen3.5/chat_template.jinja) on conversations with tools, tool calls,
  reasoning, several tool results, content parts, control characters, enable_thinking and add_generation_prompt.
  `openai_messages`, where present, is the same conversation as an OpenAI client sends it (tool-call arguments as
  JSON strings, `content: null`), which must render to the same text after normalization.
- `error_cases`: conversations the template rejects with `raise_exception`, and its message.

Set up once and run from the repository root:

    python3 -m venv .venv-chat && .venv-chat/bin/pip install jinja2 transformers tokenizers
    .venv-chat/bin/python scripts/chat_template_vectors.py

Writes assets/qwen3.5/chat_template_vectors.json.
"""
import copy
import gzip
import json
import tempfile
from pathlib import Path

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template

root = Path(__file__).resolve().parent.parent
assets = root / "assets" / "qwen3.5"
template_src = (assets / "chat_template.jinja").read_text()

WS = ["\x1c", "\x1d", "\x1e", "\x1f", "\x85", "\xa0", "\u2028", "\u2029", "\u3000", "\u1680", "\u202f", "\x0b", "\x0c"]

# ---- template cases: one template, one context, the rendered text (or the error) ----

STRS = [
    "plain",
    "  both sides \t\n",
    "\x1fends in unit separator\x1f",
    "\x1cfile sep start",
    "record sep end\x1e",
    "\x1dgroup\x1d",
    "\x85next line\x85",
    "\xa0nbsp\xa0",
    "\u2028line sep\u2029",
    "\u3000ideographic\u3000",
    "\u200bzero width is not space\u200b",
    "".join(WS),
    "a\x1fb\x1cc d\u3000e\xa0f",
    "",
    "\n\nnewlines only around\n\n",
    "  a  b  ",
]
template_cases = [
    ("trim_and_strip", "{% for s in strs %}[{{ s|trim }}][{{ s.strip() }}][{{ s.lstrip() }}][{{ s.rstrip() }}]\n{% endfor %}", {"strs": STRS}),
    ("strip_chars", "{% for s in strs %}[{{ s.strip('\\n') }}][{{ s.lstrip('\\x1f') }}][{{ s.rstrip(' \\n\\t') }}][{{ s|trim('ad') }}]\n{% endfor %}", {"strs": STRS}),
    ("split_whitespace", "{% for s in strs %}{{ s.split()|tojson }} {{ s.split(none, 1)|tojson }} {{ s.rsplit(none, 1)|tojson }}\n{% endfor %}", {"strs": STRS}),
    ("split_sep", "{% for s in strs %}{{ s.split('</think>')|tojson }} {{ s.split(' ')|tojson }} {{ s.split('a', 1)|tojson }} {{ s.rsplit('a', 1)|tojson }}\n{% endfor %}",
     {"strs": STRS + ["<think>\nr\n</think>\n\nanswer", "x</think>y</think>z", "a,b,,c"]}),
    ("splitlines", "{% for s in strs %}{{ s.splitlines()|tojson }} {{ s.splitlines(true)|tojson }}\n{% endfor %}",
     {"strs": ["a\nb\r\nc\rd\x1ce\x85f\u2028g", "x\n", "", "\n\n"]}),
    ("isspace", "{% for s in strs %}{{ s.isspace() }} {% endfor %}", {"strs": STRS + [" ", "\x1f", "\u200b"]}),
    ("startswith_endswith",
     "{% for s in strs %}{{ s.startswith('<tool_response>') }} {{ s.endswith('</tool_response>') }} {{ s.startswith(('x', '\\x1f')) }} {{ s.endswith(('q', 'd')) }} {{ s.startswith('e', 1) }}\n{% endfor %}",
     {"strs": STRS + ["<tool_response>\nok\n</tool_response>", "ends in d"]}),
    ("find_count", "{% for s in strs %}{{ s.find('e') }} {{ s.rfind('e') }} {{ s.count('e') }} {{ s.count('') }}\n{% endfor %}",
     {"strs": ["héllo wörld here", "\u3000e\u3000e", "none"]}),
    ("tojson_default", "{{ v|tojson }}", {"v": {
        "zeta": 1, "alpha": [1, 2.5, -0.0, 1.0, 1e16, 1.5e-05, 0.1, 123456789.125, 1e-07, 12345678901234567890],
        "nested": {"b": True, "a": None, "list": [], "obj": {}},
        "text": "<>&'\"\\ quote, slash /, tab\t, nl\n, cr\r, bell\x07, del\x7f, \x1f, é ü 中文 😀, \u2028",
    }}),
    ("tojson_options",
     "{{ v|tojson(indent=2) }}\n{{ v|tojson(indent=0) }}\n{{ v|tojson(indent='\\t') }}\n{{ v|tojson(separators=(',', ':')) }}\n{{ v|tojson(sort_keys=true) }}\n{{ v|tojson(ensure_ascii=true) }}\n{{ v|tojson(indent=1, separators=(', ', ' = ')) }}",
     {"v": {"b": [1, {"y": "é😀", "x": []}], "a": {}, "c": "<&>"}}),
    ("tojson_scalars", "{% for v in vals %}{{ v|tojson }} {% endfor %}", {"vals": [None, True, False, 0, -7, 3.0, 2.5e-10, "s", [], {}]}),
    ("string_filter",
     "{% for v in vals %}{{ v|string }}|{{ v }}|{{ v|safe }}\n{% endfor %}",
     {"vals": [None, True, False, 0, -7, 3.0, 1e16, 1.5e-05, 0.1, "text", [1, "a", None, True], {"a": 1, "b": "it's", "c": [False, 2.0], "d": "say \"hi\""},
               ["both ' and \"", "tab\tnl\n", "\x1f\x85\xa0\u2028\u3000", "é中", "back\\slash"]]}),
    ("items_length",
     "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %} {{ d|length }} {{ s|length }} {{ l|length }} {{ missing|length }}{% for k, v in missing|items %}x{% endfor %}",
     {"d": {"z": 1, "a": [1, 2], "m": {"n": None}}, "s": "héllo 中文", "l": [1, 2, 3]}),
    ("tests",
     "{% for v in vals %}{{ v is string }}{{ v is mapping }}{{ v is sequence }}{{ v is iterable }}{{ v is none }}{{ v is defined }} {% endfor %}|{{ missing is iterable }}{{ missing is defined }}{{ missing is sequence }}",
     {"vals": ["s", "", {"a": 1}, {}, [1], [], 1, 1.5, True, None]}),
    ("mapping_args_render",
     "{% for args_name, args_value in args|items %}<{{ args_name }}>{% set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}{{ args_value }}</{{ args_name }}>\n{% endfor %}",
     {"args": {"s": "text with 'quotes' and \"dq\"", "i": 42, "f": 2.0, "t": True, "n": None, "o": {"k": [1, {"z": False}]}, "l": ["a", 1.5], "e": "", "u": "中文"}}),
    ("loop_and_namespace",
     "{% set ns = namespace(n=0, last='') %}{% for m in msgs[::-1] %}{% set ns.n = ns.n + 1 %}{% if loop.previtem %}{{ loop.previtem.role }}>{% endif %}{{ m.role }}{% if loop.nextitem %}<{{ loop.nextitem.role }}{% endif %};{% endfor %}{{ ns.n }}",
     {"msgs": [{"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "tool"}]}),
    ("whitespace_control",
     "{%- if a %}\n    A\n{%- endif %}\n  {% if b %}\n  B\n  {% endif %}\n{{ 'x' }}  \n{# c #}\nend\n",
     {"a": True, "b": True}),
]

# ---- chat cases on the Qwen3.5 template ----

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Météo à <city> & \"region\" — it's 100% ok; 天气",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City <name>"},
            "units": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"},
                                                        "tags": {"type": "array", "items": {"type": "string"}}}},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {"name": "run_code", "description": "Runs code.\nTwo lines.",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "number"}}}}},
]

CALL_ARGS = {"city": "Zürich <&> 'old town'", "days": 3, "where": {"lat": 47.37, "lon": 8.54, "tags": ["lake", "中文"], "alt": None},
             "metric": True, "ratio": 1.0, "tiny": 1e-07, "code": "print('hi')\nif a < b:\n    pass\n", "empty": "", "num_text": "123"}


def call(name, args, cid):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def conv_tools():
    return [
        {"role": "system", "content": "  You are a helpful agent.\x1e"},
        {"role": "user", "content": "\x1cWhat's the weather in Zürich? Also run code.\x1f"},
        {"role": "assistant", "content": None, "reasoning_content": "\nThe user wants weather.\n",
         "tool_calls": [call("get_weather", CALL_ARGS, "call_a"), call("run_code", {"code": "1+1", "timeout": 2.5}, "call_b")]},
        {"role": "tool", "tool_call_id": "call_a", "content": "\u3000{\"temp\": 21, \"sky\": \"clear\"}\x85"},
        {"role": "tool", "tool_call_id": "call_b", "content": "2"},
        {"role": "tool", "tool_call_id": "call_c", "content": " third result \n"},
        {"role": "assistant", "content": "It is 21 °C and clear.\xa0", "reasoning_content": "Both tools answered.\u2028"},
        {"role": "user", "content": "Thanks!\u2029"},
    ]


def openai_shape(messages):
    """The same conversation as an OpenAI client sends it: arguments as JSON strings (compact), null content kept."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.dumps(c["function"]["arguments"], separators=(",", ":"))
    return out


chat_convs = [
    ("control_chars_user_system", [
        {"role": "system", "content": "\x1f\x1eSystem prompt ends in RS\x1e"},
        {"role": "user", "content": "\x1cStarts with FS, ends in US\x1f"},
    ], None),
    ("control_chars_every_kind", [
        {"role": "user", "content": "\x85\xa0nel nbsp\xa0\x85"},
        {"role": "assistant", "content": "\u2028answer\u3000\x1d"},
        {"role": "user", "content": "\u3000ideographic\u2029\x0b\x0c"},
    ], None),
    ("tools_only_system", [{"role": "user", "content": "Weather?"}], TOOLS),
    ("tools_with_system", [{"role": "system", "content": "Be brief.\x1f"}, {"role": "user", "content": "Weather?"}], TOOLS),
    ("tool_calls_full", conv_tools(), TOOLS),
    ("tool_calls_pending", conv_tools()[:6], TOOLS),
    ("content_and_tool_call", [
        {"role": "user", "content": "Run it"},
        {"role": "assistant", "content": "Running the code now.\n\n", "tool_calls": [call("run_code", {"code": "x = [1, 2]\n", "timeout": 10}, "c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ], TOOLS),
    ("multi_step_tools", [
        {"role": "user", "content": "Step by step"},
        {"role": "assistant", "content": "", "tool_calls": [call("run_code", {"code": "a"}, "c1")]},
        {"role": "tool", "content": "A"},
        {"role": "assistant", "content": None, "reasoning_content": "next", "tool_calls": [call("run_code", {"code": "b", "flags": [True, False, None, 0, -1.5]}, "c2")]},
        {"role": "tool", "content": "B"},
    ], TOOLS),
    ("inline_think_in_content", [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nold answer"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>\n\nnew reasoning\n\n</think>\n\nnew answer\x1f"},
    ], None),
    ("reasoning_alias", [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "via the reasoning field"},
    ], None),
    ("content_parts", [
        {"role": "system", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two.\x1f"}]},
        {"role": "user", "content": [{"type": "text", "text": "\x1cHello "}, {"type": "text", "text": "world"}]},
    ], None),
    ("tool_response_only_user", [
        {"role": "user", "content": "real question"},
        {"role": "user", "content": "<tool_response>\nnot a query\n</tool_response>"},
    ], None),
]

error_convs = [
    ("no_user_query", [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], None),
    ("system_not_first", [{"role": "user", "content": "u"}, {"role": "system", "content": "s"}], None),
    ("unknown_role", [{"role": "user", "content": "u"}, {"role": "critic", "content": "c"}], None),
]


def main():
    with tempfile.TemporaryDirectory() as d:
        tok_file = Path(d) / "tokenizer.json"
        tok_file.write_bytes(gzip.decompress((assets / "tokenizer.json.gz").read_bytes()))
        tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = template_src

    tcases = []
    for name, src, ctx in template_cases:
        entry = {"name": name, "template": src, "context": ctx}
        try:
            entry["text"] = _compile_jinja_template(src).render(**ctx)
        except Exception as e:  # recorded: the Rust side must fail too
            entry["error"] = f"{type(e).__name__}: {e}"
        tcases.append(entry)

    ccases = []
    for name, msgs, tools in chat_convs:
        entry = {"name": name, "messages": msgs, "tools": tools}
        if any(m.get("tool_calls") for m in msgs):
            entry["openai_messages"] = openai_shape(msgs)
        entry["renders"] = []
        for agp in (True, False):
            for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
                if not agp and kwargs:
                    continue  # enable_thinking only changes the generation prompt
                text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=agp, **kwargs)
                entry["renders"].append({"add_generation_prompt": agp, "kwargs": kwargs, "text": text,
                                         "ids": tok.encode(text, add_special_tokens=False)})
        ccases.append(entry)

    ecases = []
    for name, msgs, tools in error_convs:
        try:
            tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
            raise SystemExit(f"{name}: expected the template to raise")
        except jinja2.exceptions.TemplateError as e:
            ecases.append({"name": name, "messages": msgs, "tools": tools, "error": str(e)})

    out = {
        "about": "Jinja2 renderings in transformers' chat template environment: probes of filters/methods/tests, and the Qwen3.5 template on tool/reasoning conversations",
        "generator": f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}",
        "template_cases": tcases,
        "chat_cases": ccases,
        "error_cases": ecases,
    }
    # One line per case keeps the file small and its diffs readable.
    lines = ["{"]
    for i, (key, value) in enumerate(out.items()):
        comma = "," if i + 1 < len(out) else ""
        if isinstance(value, list):
            items = ",\n".join("  " + json.dumps(v, ensure_ascii=False) for v in value)
            lines.append(f"{json.dumps(key)}: [\n{items}\n]{comma}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}{comma}")
    lines.append("}")
    (assets / "chat_template_vectors.json").write_text("\n".join(lines) + "\n")
    n = sum(len(c["renders"]) for c in ccases)
    print(f"wrote {len(tcases)} template cases, {len(ccases)} conversations ({n} renderings), {len(ecases)} error cases")


if __name__ == "__main__":
    main()
