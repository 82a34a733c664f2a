//! Python semantics for the string methods, filters and tests chat templates use, where minijinja's own (Rust
//! semantics) differ from Jinja2 running under transformers: whitespace is Python's `str.isspace` set (which has
//! `\x1c`-`\x1f`, unlike Rust's `char::is_whitespace`), indices count code points, and `|string` / printing give
//! Python's `str()`.

use minijinja::value::{from_args, Kwargs, Rest, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

use super::pyvalue::{json_dumps, py_str, DumpOptions};

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// Python's `str.isspace` for one character: Rust's Unicode `White_Space` plus the ASCII information separators
/// `\x1c`-`\x1f`, which Python counts as whitespace (bidirectional class B/S).
pub fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.strip` / `lstrip` / `rstrip`: without `chars`, Python whitespace; with `chars`, any of its characters.
pub fn py_strip<'s>(s: &'s str, chars: Option<&str>, left: bool, right: bool) -> &'s str {
    let strip = |c: char| match chars {
        Some(set) => set.contains(c),
        None => is_py_space(c),
    };
    let mut out = s;
    if left {
        out = out.trim_start_matches(strip);
    }
    if right {
        out = out.trim_end_matches(strip);
    }
    out
}

/// Python's `str.split(sep, maxsplit)`; `rsplit` when `from_right`. Without `sep`, splits on runs of Python whitespace
/// and drops empty pieces. Errors: an empty separator (Python's `ValueError: empty separator`).
pub fn py_split(
    s: &str,
    sep: Option<&str>,
    maxsplit: i64,
    from_right: bool,
) -> Result<Vec<String>, Error> {
    let limit = if maxsplit < 0 {
        usize::MAX
    } else {
        maxsplit as usize
    };
    let mut parts: Vec<String> = match sep {
        Some("") => return Err(invalid("ValueError: empty separator")),
        Some(sep) if from_right => s
            .rsplitn(limit.saturating_add(1), sep)
            .map(String::from)
            .collect(),
        Some(sep) => s
            .splitn(limit.saturating_add(1), sep)
            .map(String::from)
            .collect(),
        None => split_whitespace(s, limit, from_right),
    };
    if from_right {
        parts.reverse();
    }
    Ok(parts)
}

/// Whitespace split with at most `limit` cuts; the uncut rest keeps its whitespace except the run at the cut. Pieces
/// come in scan order (reversed for `from_right`).
fn split_whitespace(s: &str, limit: usize, from_right: bool) -> Vec<String> {
    let chars: Vec<char> = if from_right {
        s.chars().rev().collect()
    } else {
        s.chars().collect()
    };
    let mut parts = Vec::new();
    let mut i = 0;
    let emit = |v: &[char]| -> String {
        if from_right {
            v.iter().rev().collect()
        } else {
            v.iter().collect()
        }
    };
    loop {
        while i < chars.len() && is_py_space(chars[i]) {
            i += 1;
        }
        if i == chars.len() {
            break;
        }
        if parts.len() == limit {
            parts.push(emit(&chars[i..]));
            break;
        }
        let start = i;
        while i < chars.len() && !is_py_space(chars[i]) {
            i += 1;
        }
        parts.push(emit(&chars[start..i]));
    }
    parts
}

/// Python's `str.splitlines(keepends)`: line boundaries are `\n`, `\r`, `\r\n`, `\v`, `\f`, `\x1c`-`\x1e`, `\x85`,
/// U+2028 and U+2029.
pub fn py_splitlines(s: &str, keepends: bool) -> Vec<String> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut it = s.char_indices().peekable();
    while let Some((i, c)) = it.next() {
        let is_break = matches!(
            c,
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}'
                ..='\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}'
        );
        if !is_break {
            continue;
        }
        let mut end = i + c.len_utf8();
        if c == '\r' && it.peek().map(|p| p.1) == Some('\n') {
            it.next();
            end += 1;
        }
        lines.push(s[start..if keepends { end } else { i }].to_string());
        start = end;
    }
    if start < s.len() {
        lines.push(s[start..].to_string());
    }
    lines
}

/// Python's `prefix`/`suffix` argument: one string or a tuple (list) of strings.
fn affixes(v: &Value, what: &str) -> Result<Vec<String>, Error> {
    if let Some(s) = v.as_str() {
        return Ok(vec![s.to_string()]);
    }
    if v.kind() != ValueKind::Seq {
        return Err(invalid(format!(
            "{what} first arg must be str or a tuple of str, not {}",
            v.kind()
        )));
    }
    v.try_iter()?
        .map(|p| {
            p.as_str().map(str::to_string).ok_or_else(|| {
                invalid(format!(
                    "tuple for {what} must only contain str, not {}",
                    p.kind()
                ))
            })
        })
        .collect()
}

/// Python slice bounds `start`/`end` (code points, negative from the end) applied to `s`.
fn py_slice(s: &str, start: Option<i64>, end: Option<i64>) -> &str {
    let n = s.chars().count() as i64;
    let clamp = |i: i64| if i < 0 { (n + i).max(0) } else { i.min(n) } as usize;
    let (a, b) = (clamp(start.unwrap_or(0)), clamp(end.unwrap_or(n)));
    if a >= b {
        return "";
    }
    let byte = |ci: usize| s.char_indices().nth(ci).map_or(s.len(), |(b, _)| b);
    &s[byte(a)..byte(b)]
}

/// Index in code points of the byte offset `b` of `s`.
fn char_index(s: &str, b: usize) -> i64 {
    s[..b].chars().count() as i64
}

/// The Python string methods implemented here (others go to minijinja-contrib's pycompat).
fn string_method(s: &str, method: &str, args: &[Value]) -> Option<Result<Value, Error>> {
    let r = match method {
        "strip" | "lstrip" | "rstrip" => from_args::<(Option<&str>,)>(args).map(|(chars,)| {
            let (l, r) = (method != "rstrip", method != "lstrip");
            Value::from(py_strip(s, chars, l, r))
        }),
        "split" | "rsplit" => {
            from_args::<(Option<&str>, Option<i64>)>(args).and_then(|(sep, max)| {
                py_split(s, sep, max.unwrap_or(-1), method == "rsplit").map(Value::from)
            })
        }
        "splitlines" => from_args::<(Option<bool>,)>(args)
            .map(|(keep,)| Value::from(py_splitlines(s, keep.unwrap_or(false)))),
        "startswith" | "endswith" => from_args::<(&Value, Option<i64>, Option<i64>)>(args)
            .and_then(|(affix, a, b)| {
                let hay = py_slice(s, a, b);
                let list = affixes(affix, method)?;
                Ok(Value::from(list.iter().any(|p| {
                    if method == "startswith" {
                        hay.starts_with(p.as_str())
                    } else {
                        hay.ends_with(p.as_str())
                    }
                })))
            }),
        "isspace" => {
            from_args::<()>(args).map(|()| Value::from(!s.is_empty() && s.chars().all(is_py_space)))
        }
        "find" | "rfind" => from_args::<(&str,)>(args).map(|(needle,)| {
            let hit = if method == "find" {
                s.find(needle)
            } else {
                s.rfind(needle)
            };
            Value::from(hit.map_or(-1, |b| char_index(s, b)))
        }),
        "count" => from_args::<(&str,)>(args).map(|(needle,)| {
            Value::from(if needle.is_empty() {
                s.chars().count() + 1
            } else {
                s.matches(needle).count()
            })
        }),
        _ => return None,
    };
    Some(r)
}

/// The environment's unknown-method callback: Python string methods with Python semantics, the rest (dict/list
/// methods, `upper`, `replace`, `format`, …) as minijinja-contrib's pycompat has them.
pub fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(s) = value.as_str().filter(|_| value.kind() == ValueKind::String) {
        if let Some(r) = string_method(s, method, args) {
            return r;
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Jinja2's `trim(value, chars=None)`: `str(value).strip(chars)`.
pub fn trim_filter(value: &Value, chars: Option<&str>) -> Value {
    let s = py_str(value);
    let out = py_strip(&s, chars, true, true).to_string();
    if value.is_safe() {
        Value::from_safe_string(out)
    } else {
        Value::from(out)
    }
}

/// Jinja2's `string`: `str(value)` (Python spelling of numbers, booleans, None and containers).
pub fn string_filter(value: &Value) -> Value {
    if value.kind() == ValueKind::String {
        return value.clone();
    }
    Value::from(py_str(value))
}

/// Jinja2's `safe`: `Markup(str(value))`.
pub fn safe_filter(value: &Value) -> Value {
    Value::from_safe_string(py_str(value))
}

/// Jinja2's `length`: Python `len()`; undefined has length 0.
pub fn length_filter(value: &Value) -> Result<usize, Error> {
    if value.is_undefined() {
        return Ok(0);
    }
    match value.kind() {
        ValueKind::String | ValueKind::Seq | ValueKind::Map => value
            .len()
            .ok_or_else(|| invalid(format!("object of type {} has no len()", value.kind()))),
        kind => Err(invalid(format!("object of type {kind} has no len()"))),
    }
}

/// Jinja2's `items`: the (key, value) pairs of a mapping; nothing for undefined.
pub fn items_filter(value: &Value) -> Result<Value, Error> {
    if value.is_undefined() {
        return Ok(Value::from(Vec::<Value>::new()));
    }
    if value.kind() != ValueKind::Map {
        return Err(invalid("Can only get item pairs from a mapping."));
    }
    let mut pairs = Vec::new();
    for k in value.try_iter()? {
        let v = value.get_item(&k)?;
        pairs.push(Value::from(vec![k, v]));
    }
    Ok(Value::from(pairs))
}

/// Jinja2's `sequence` test: has a length and item access (strings, lists, mappings, and undefined, whose length is
/// 0).
pub fn is_sequence(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map
        )
}

/// Jinja2's `iterable` test: `iter(value)` succeeds (strings, lists, mappings, and undefined, which iterates as
/// empty), but not None or numbers.
pub fn is_iterable(value: &Value) -> bool {
    value.is_undefined()
        || matches!(
            value.kind(),
            ValueKind::String | ValueKind::Seq | ValueKind::Map | ValueKind::Iterable
        )
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`: Python
/// `json.dumps` (no HTML escaping, key order kept, `, ` and `: ` separators, non-ASCII kept). Arguments may be
/// positional in that order or named.
pub fn tojson_filter(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
    let mut positional: Vec<Value> = args.0;
    let kwargs = match positional.last() {
        Some(last) if last.is_kwargs() => {
            let last = positional.pop().expect("checked non-empty");
            from_args::<(Kwargs,)>(&[last])?.0
        }
        _ => from_args::<(Kwargs,)>(&[])?.0,
    };
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(invalid("tojson() takes at most 5 arguments"));
    }
    let mut slots: [Option<Value>; 4] = Default::default();
    for (i, v) in positional.into_iter().enumerate() {
        slots[i] = Some(v);
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(invalid(format!(
                    "tojson() got multiple values for argument '{name}'"
                )));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = slots;
    let opts = DumpOptions {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        indent: indent
            .filter(|v| !v.is_none())
            .map(|v| indent_text(&v))
            .transpose()?,
        separators: separators
            .filter(|v| !v.is_none())
            .map(|v| separator_pair(&v))
            .transpose()?,
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
    };
    json_dumps(value, &opts).map(Value::from)
}

/// `indent` as Python's encoder takes it: an int is that many spaces (none when negative), a string is itself.
fn indent_text(v: &Value) -> Result<String, Error> {
    if let Some(s) = v.as_str() {
        return Ok(s.to_string());
    }
    let n = v
        .as_i64()
        .ok_or_else(|| invalid(format!("indent must be an int or a str, not {}", v.kind())))?;
    Ok(" ".repeat(n.max(0) as usize))
}

fn separator_pair(v: &Value) -> Result<(String, String), Error> {
    let items: Vec<Value> = v.try_iter()?.collect();
    match &items[..] {
        [a, b] if a.as_str().is_some() && b.as_str().is_some() => Ok((
            a.as_str().unwrap_or_default().into(),
            b.as_str().unwrap_or_default().into(),
        )),
        _ => Err(invalid("separators must be a pair of strings")),
    }
}

/// How `{{ value }}` prints: Python's `str(value)` (no autoescaping, as transformers renders).
pub fn formatter(out: &mut minijinja::Output, _state: &State, value: &Value) -> Result<(), Error> {
    out.write_str(&py_str(value))
        .map_err(|e| Error::new(ErrorKind::WriteFailure, e.to_string()))
}
