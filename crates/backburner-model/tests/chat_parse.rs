//! Parsing Qwen3.5 output into OpenAI fields: reasoning, content and tool calls, whole and streamed.

use backburner_model::{
    parse_output, prompt_opens_reasoning, ChatDelta, ChatOutputParser, ChatRequest, ChatTemplate,
    ParsedOutput,
};
use proptest::prelude::*;
use serde_json::{json, Value};

fn args(call: &backburner_model::ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap()
}

const SCRIPTED: &str = "Let me think.\nI need the weather.\n\n</think>\n\nI'll check both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=run_code>\n<parameter=code>\nprint(1)\nprint(2)\n</parameter>\n<parameter=opts>\n{\"fast\": true, \"n\": [1, 2.5, null]}\n</parameter>\n</function>\n</tool_call>";

#[test]
fn reasoning_content_and_two_tool_calls() {
    let p = parse_output(SCRIPTED, true, None);
    assert_eq!(
        p.reasoning.as_deref(),
        Some("Let me think.\nI need the weather.")
    );
    assert_eq!(p.content.as_deref(), Some("I'll check both."));
    assert_eq!(p.tool_calls.len(), 2);
    let (a, b) = (&p.tool_calls[0], &p.tool_calls[1]);
    assert_eq!(
        (a.index, a.id.as_str(), a.name.as_str()),
        (0, "call_0", "get_weather")
    );
    assert_eq!(a.arguments, r#"{"city":"Zürich","days":3}"#);
    assert_eq!(
        (b.index, b.id.as_str(), b.name.as_str()),
        (1, "call_1", "run_code")
    );
    assert_eq!(
        args(b),
        json!({"code": "print(1)\nprint(2)", "opts": {"fast": true, "n": [1, 2.5, null]}})
    );
}

#[test]
fn declared_parameter_types_decide_how_values_are_read() {
    let tools = [
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "s": {"type": "string"}, "i": {"type": "integer"}, "b": {"type": "boolean"}, "o": {"type": ["object", "null"]},
            "n": {"type": ["string", "null"]}, "arr": {"type": "array"}
        }}}}),
    ];
    let text = "<tool_call>\n<function=f>\n<parameter=s>\n123\n</parameter>\n<parameter=i>\n7\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\nnull\n</parameter>\n<parameter=n>\nnull\n</parameter>\n<parameter=arr>\nnot json\n</parameter>\n<parameter=x>\n1.5\n</parameter>\n<parameter=y>\n\"quoted\"\n</parameter>\n</function>\n</tool_call>";
    let typed = parse_output(text, false, Some(&tools));
    assert_eq!(typed.content, None);
    assert_eq!(
        args(&typed.tool_calls[0]),
        json!({"s": "123", "i": 7, "b": true, "o": null, "n": null, "arr": "not json", "x": 1.5, "y": "\"quoted\""})
    );
    let untyped = parse_output(text, false, None);
    assert_eq!(
        args(&untyped.tool_calls[0]),
        json!({"s": 123, "i": 7, "b": true, "o": null, "n": null, "arr": "not json", "x": 1.5, "y": "\"quoted\""})
    );
}

#[test]
fn malformed_tool_calls_come_back_as_content() {
    for text in [
        "Sure.\n<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>garbage</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
        "Text \n <tool_call>bad</tool_call> more <tool_call>",
        "<tool_call>\n<function=f\nx>\n</function>\n</tool_call>",
        "<tool_call>",
        "<tool_",
    ] {
        let p = parse_output(text, false, None);
        assert!(p.tool_calls.is_empty(), "{text:?}");
        assert_eq!(p.content.as_deref(), Some(text));
    }
}

#[test]
fn a_tool_call_inside_reasoning_is_reasoning() {
    let text = "Maybe <tool_call>\n<function=f>\n</function>\n</tool_call> no.\n</think>\n\nDone.";
    let p = parse_output(text, true, None);
    assert_eq!(
        p.reasoning.as_deref(),
        Some("Maybe <tool_call>\n<function=f>\n</function>\n</tool_call> no.")
    );
    assert_eq!(p.content.as_deref(), Some("Done."));
    assert!(p.tool_calls.is_empty());
}

#[test]
fn thinking_off_truncated_reasoning_and_a_restated_think() {
    assert_eq!(
        parse_output("Just the answer.", false, None),
        ParsedOutput {
            reasoning: None,
            content: Some("Just the answer.".into()),
            tool_calls: vec![]
        }
    );
    let truncated = parse_output("still thinking about", true, None);
    assert_eq!(
        (truncated.reasoning.as_deref(), truncated.content),
        (Some("still thinking about"), None)
    );
    let opened = parse_output("<think>\nhmm\n</think>\n\nYes.", false, None);
    assert_eq!(
        (opened.reasoning.as_deref(), opened.content.as_deref()),
        (Some("hmm"), Some("Yes."))
    );
    let restated = parse_output("<think>\nhmm\n</think>\n\nYes.", true, None);
    assert_eq!(restated, opened);
    let late = parse_output("A <think> B", false, None);
    assert_eq!(late.content.as_deref(), Some("A <think> B"));
    let empty = parse_output("\n</think>\n\n", true, None);
    assert_eq!(empty, ParsedOutput::default());
}

#[test]
fn prompts_that_open_reasoning() {
    assert!(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
    assert!(!prompt_opens_reasoning(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ));
    assert!(!prompt_opens_reasoning("<|im_start|>user\nhi<|im_end|>\n"));
}

#[test]
fn streaming_emits_at_once_what_cannot_be_a_tag() {
    let mut p = ChatOutputParser::new(true, None).with_id_prefix("call_req7_");
    assert_eq!(
        p.push("Thinking hard"),
        vec![ChatDelta::Reasoning("Thinking hard".into())]
    );
    assert_eq!(
        p.push(" now\n</th"),
        vec![ChatDelta::Reasoning(" now".into())]
    );
    assert_eq!(
        p.push("ink>\n\nThe answer is <"),
        vec![ChatDelta::Content("The answer is".into())]
    );
    assert_eq!(
        p.push("b>42</b> "),
        vec![ChatDelta::Content(" <b>42</b>".into())]
    );
    assert_eq!(p.push("\n<tool_call>\n<function=f>\n"), vec![]);
    let d = p.push("</function>\n</tool_call>");
    assert!(
        matches!(&d[..], [ChatDelta::ToolCall(c)] if c.id == "call_req7_0" && c.arguments == "{}"),
        "{d:?}"
    );
    assert_eq!(p.push("\n"), vec![]);
    assert_eq!(p.finish(), vec![]);
}

#[test]
fn rendered_tool_calls_parse_back_to_the_same_calls() {
    let tools = [
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"num_text": {"type": "string"}}}}}),
    ];
    let call_args = json!({"city": "Zürich <&>", "days": 3, "where": {"lat": 47.37, "tags": ["a", "中"], "alt": null},
        "flag": false, "code": "if a < b:\n    pass", "num_text": "123", "ratio": 1.5});
    let msgs = [
        json!({"role": "user", "content": "go"}),
        json!({"role": "assistant", "reasoning_content": "plan", "content": "Calling.",
               "tool_calls": [{"function": {"name": "f", "arguments": call_args.to_string()}},
                              {"function": {"name": "g", "arguments": {}}}]}),
    ];
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../assets/qwen3.5/chat_template.jinja"
    ));
    let t = ChatTemplate::new(&src.unwrap()).unwrap();
    let kwargs = serde_json::Map::new();
    let req = ChatRequest {
        messages: &msgs,
        tools: Some(&tools),
        add_generation_prompt: false,
        kwargs: &kwargs,
    };
    let text = t.render(&req, &[]).unwrap();
    let turn = text
        .rsplit("<|im_start|>assistant\n")
        .next()
        .unwrap()
        .trim_end_matches("<|im_end|>\n");
    let p = parse_output(turn, prompt_opens_reasoning(""), Some(&tools));
    assert_eq!(p.reasoning.as_deref(), Some("plan"));
    assert_eq!(p.content.as_deref(), Some("Calling."));
    assert_eq!(p.tool_calls.len(), 2);
    assert_eq!(args(&p.tool_calls[0]), call_args);
    assert_eq!(
        (
            p.tool_calls[1].name.as_str(),
            p.tool_calls[1].arguments.as_str()
        ),
        ("g", "{}")
    );
}

/// Splits `text` at the given char positions and streams it, merging the deltas.
fn streamed(text: &str, cuts: &[usize], in_reasoning: bool) -> ParsedOutput {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (chars.len() + 1)).collect();
    cuts.sort_unstable();
    let mut p = ChatOutputParser::new(in_reasoning, None);
    let mut deltas = Vec::new();
    let mut prev = 0;
    for c in cuts.into_iter().chain([chars.len()]) {
        deltas.extend(p.push(&chars[prev..c].iter().collect::<String>()));
        prev = c;
    }
    deltas.extend(p.finish());
    ParsedOutput::from_deltas(deltas)
}

const PIECES: [&str; 20] = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=f>",
    "<function=g>",
    "</function>",
    "<parameter=a>",
    "</parameter>",
    "\n",
    "\n\n",
    " ",
    "x",
    "42",
    "{\"k\": [1]}",
    "<",
    "</",
    "é中",
    "<tool",
    "think>",
];

proptest! {
    #[test]
    fn any_split_gives_the_same_result(cuts in prop::collection::vec(0usize..2000, 0..12), in_reasoning: bool) {
        prop_assert_eq!(streamed(SCRIPTED, &cuts, in_reasoning), parse_output(SCRIPTED, in_reasoning, None));
    }

    #[test]
    fn any_split_of_tag_soup_gives_the_same_result(
        picks in prop::collection::vec(0usize..PIECES.len(), 0..40),
        cuts in prop::collection::vec(0usize..400, 0..16),
        in_reasoning: bool,
    ) {
        let text: String = picks.iter().map(|&i| PIECES[i]).collect();
        prop_assert_eq!(streamed(&text, &cuts, in_reasoning), parse_output(&text, in_reasoning, None));
    }
}

/// Tool-call arguments typed by the whole JSON schema, as pydantic and zod write it: `anyOf`/`oneOf`, type arrays,
/// nullable types, `$ref` into `$defs`, enums, nested objects and arrays; a value a string alternative allows stays
/// a string.
#[test]
fn arguments_are_typed_by_the_whole_schema() {
    let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object",
    "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}},
              "Level": {"enum": [1, 2, 3]}},
    "properties": {
        "maybe_int": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "int_or_str": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
        "num_list": {"type": ["array", "null"], "items": {"type": "number"}},
        "nullable": {"type": "integer", "nullable": true},
        "point": {"$ref": "#/$defs/Point"},
        "level": {"$ref": "#/$defs/Level"},
        "color": {"enum": ["red", "green"]},
        "flag": {"const": true},
        "nested": {"properties": {"a": {"type": "string"}}},
        "zip": {"type": "string"},
        "free": {}
    }}}}]);
    let body = |name: &str, v: &str| {
        format!("<tool_call>\n<function=f>\n<parameter={name}>\n{v}\n</parameter>\n</function>\n</tool_call>")
    };
    let cases = [
        ("maybe_int", "7", json!(7)),
        ("maybe_int", "null", json!(null)),
        ("maybe_int", "None", json!(null)),
        ("int_or_str", "42", json!("42")),
        ("num_list", "[1, 2.5]", json!([1, 2.5])),
        ("num_list", "null", json!(null)),
        ("nullable", "null", json!(null)),
        ("nullable", "5", json!(5)),
        ("point", "{\"x\": 1.5}", json!({"x": 1.5})),
        ("level", "2", json!(2)),
        ("color", "red", json!("red")),
        ("flag", "true", json!(true)),
        ("nested", "{\"a\": \"b\"}", json!({"a": "b"})),
        ("zip", "01234", json!("01234")),
        ("free", "3.5", json!(3.5)),
        ("free", "text", json!("text")),
    ];
    for (name, raw, want) in cases {
        let out = parse_output(&body(name, raw), false, Some(tools.as_array().unwrap()));
        assert_eq!(out.tool_calls.len(), 1, "{name}");
        assert_eq!(args(&out.tool_calls[0])[name], want, "{name} = {raw:?}");
    }
}

/// `-0` (which JSON parsers read as the float -0.0) and `3.0` for an integer parameter come back as the integers 0
/// and 3, as strict clients need; a number parameter keeps the float, and 2.5 stays 2.5 (not an integer).
#[test]
fn integral_floats_for_integer_parameters_are_integers() {
    let tools = [
        json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
        "properties": {"i": {"type": "integer"}, "j": {"type": "integer"}, "k": {"type": "integer"},
                       "n": {"type": "number"}}}}}),
    ];
    let text = "<tool_call>\n<function=f>\n<parameter=i>\n-0\n</parameter>\n<parameter=j>\n3.0\n</parameter>\n<parameter=k>\n2.5\n</parameter>\n<parameter=n>\n-0\n</parameter>\n</function>\n</tool_call>";
    let a = args(&parse_output(text, false, Some(&tools)).tool_calls[0]);
    assert_eq!(a["i"], json!(0));
    assert!(a["i"].is_i64(), "{a}");
    assert_eq!(serde_json::to_string(&a["i"]).unwrap(), "0");
    assert_eq!(serde_json::to_string(&a["j"]).unwrap(), "3");
    assert_eq!(serde_json::to_string(&a["k"]).unwrap(), "2.5");
    assert_eq!(serde_json::to_string(&a["n"]).unwrap(), "-0.0");
}
