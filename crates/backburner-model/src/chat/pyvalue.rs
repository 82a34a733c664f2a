//! Python's view of template values: `str()` / `repr()` (what Jinja2 prints and what `|string` gives) and
//! `json.dumps` (what transformers' `tojson` filter gives), written out for minijinja values.

use minijinja::value::{Value, ValueKind};
use minijinja::{Error, ErrorKind};

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, msg.into())
}

/// `str(value)` as Python gives it for a template value: strings as they are, `True`/`False`, `None`, numbers as
/// Python writes them, containers as their `repr`, and undefined as the empty string (Jinja2's `Undefined`).
pub fn py_str(v: &Value) -> String {
    match v.as_str() {
        Some(s) if v.kind() == ValueKind::String => s.to_string(),
        _ if v.is_undefined() => String::new(),
        _ => py_repr(v),
    }
}

/// `repr(value)` as Python gives it (strings quoted and escaped, dicts as `{'a': 1}`).
pub fn py_repr(v: &Value) -> String {
    let mut out = String::new();
    write_repr(&mut out, v);
    out
}

fn write_repr(out: &mut String, v: &Value) {
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_repr(v)),
        ValueKind::String => out.push_str(&str_repr(v.as_str().unwrap_or_default())),
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item);
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key);
                out.push_str(": ");
                write_repr(out, &v.get_item(&key).unwrap_or_default());
            }
            out.push('}');
        }
        // Macros, namespaces and other objects: minijinja's own text (Python would print an object address).
        _ => out.push_str(&v.to_string()),
    }
}

/// Python's repr of a number value: integers in decimal, floats by [`float_repr`].
fn number_repr(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN))
    }
}

/// `repr(x)` of a Python float: the shortest digits that round-trip, in positional notation for exponents -4..16 and
/// scientific (`1e+16`, `1.5e-05`) outside, always with a `.0` or a fraction when positional.
pub fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{:e}", x.abs()); // shortest round-trip digits: "1.5e-5"
    let (mant, exp) = sci.split_once('e').expect("{:e} writes an exponent");
    let exp: i32 = exp.parse().expect("{:e} writes an integer exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() {
            String::new()
        } else {
            format!(".{tail}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{esign}{:02}", exp.abs());
    }
    if exp < 0 {
        let zeros = "0".repeat((-exp - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let point = exp as usize + 1;
    if digits.len() <= point {
        let zeros = "0".repeat(point - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        format!("{sign}{}.{}", &digits[..point], &digits[point..])
    }
}

/// Whether Python's `str.isprintable` holds for `c` (what `repr` keeps unescaped). Covers the categories Cc, Cf, Zs
/// (but the space), Zl, Zp and Co; unassigned code points (Cn) count as printable here, unlike in Python.
fn is_printable(c: char) -> bool {
    let u = c as u32;
    let control = u < 0x20 || (0x7f..=0x9f).contains(&u);
    let separator = c != ' ' && c.is_whitespace() && !control;
    let format = matches!(u,
        0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x890..=0x891 | 0x8e2 | 0x180e | 0x200b..=0x200f
        | 0x202a..=0x202e | 0x2060..=0x2064 | 0x2066..=0x206f | 0xfeff | 0xfff9..=0xfffb | 0x110bd | 0x110cd
        | 0x13430..=0x13438 | 0x1bca0..=0x1bca3 | 0x1d173..=0x1d17a | 0xe0001 | 0xe0020..=0xe007f);
    let private = matches!(u, 0xe000..=0xf8ff | 0xf0000..=0xffffd | 0x100000..=0x10fffd);
    !(control || separator || format || private)
}

/// Python's `repr` of a string: single quotes unless the text has `'` and no `"`, backslash escapes for the quote,
/// `\\`, `\t`, `\n`, `\r`, and `\xhh` / `\uhhhh` / `\Uhhhhhhhh` for what is not printable.
pub fn str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) <= 0xff => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if (c as u32) <= 0xffff => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push_str(&format!("\\U{:08x}", c as u32)),
        }
    }
    out.push(quote);
    out
}

/// Options of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Clone, Debug, Default)]
pub struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (surrogate pairs above the BMP).
    pub ensure_ascii: bool,
    /// `None`: one line; `Some(s)`: a newline and `s` repeated per level before every item.
    pub indent: Option<String>,
    /// Item and key separators; `None` gives `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    /// Write the keys of every mapping in sorted order.
    pub sort_keys: bool,
}

/// `json.dumps(value, **opts)` for a template value. Errors for values JSON cannot hold (undefined, macros).
pub fn json_dumps(v: &Value, opts: &DumpOptions) -> Result<String, Error> {
    let (item_sep, key_sep) = match &opts.separators {
        Some((a, b)) => (a.as_str(), b.as_str()),
        None if opts.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut w = JsonWriter {
        out: String::new(),
        opts,
        item_sep,
        key_sep,
    };
    w.value(v, 0)?;
    Ok(w.out)
}

struct JsonWriter<'a> {
    out: String,
    opts: &'a DumpOptions,
    item_sep: &'a str,
    key_sep: &'a str,
}

impl JsonWriter<'_> {
    fn value(&mut self, v: &Value, level: usize) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self
                .out
                .push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.out.push_str(&json_number(v)),
            ValueKind::String => self.string(v.as_str().unwrap_or_default()),
            ValueKind::Seq => {
                let items: Vec<Value> = v.try_iter()?.collect();
                self.container('[', ']', items.len(), level, |w, i, level| {
                    w.value(&items[i], level)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<(String, Value)> = Vec::new();
                for k in v.try_iter()? {
                    keys.push((json_key(&k)?, k));
                }
                if self.opts.sort_keys {
                    keys.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.container('{', '}', keys.len(), level, |w, i, level| {
                    w.string(&keys[i].0);
                    w.out.push_str(w.key_sep);
                    w.value(&v.get_item(&keys[i].1)?, level)
                })?;
            }
            ValueKind::Undefined => {
                return Err(invalid("Object of type Undefined is not JSON serializable"))
            }
            kind => {
                return Err(invalid(format!(
                    "Object of type {kind} is not JSON serializable"
                )))
            }
        }
        Ok(())
    }

    /// Writes `open items close`, one item per line when indenting, as Python's encoder lays them out.
    fn container(
        &mut self,
        open: char,
        close: char,
        n: usize,
        level: usize,
        mut item: impl FnMut(&mut Self, usize, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if n == 0 {
            self.out.push(close);
            return Ok(());
        }
        let indent = self.opts.indent.clone();
        let newline = |depth: usize| indent.as_ref().map(|s| format!("\n{}", s.repeat(depth)));
        if let Some(nl) = newline(level + 1) {
            self.out.push_str(&nl);
        }
        for i in 0..n {
            if i > 0 {
                self.out.push_str(self.item_sep);
                if let Some(nl) = newline(level + 1) {
                    self.out.push_str(&nl);
                }
            }
            item(self, i, level + 1)?;
        }
        if let Some(nl) = newline(level) {
            self.out.push_str(&nl);
        }
        self.out.push(close);
        Ok(())
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.out.push_str(&format!("\\u{:04x}", c as u32)),
                c if self.opts.ensure_ascii && (c as u32) > 0x7e => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        self.out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

/// A number as `json.dumps` writes it: integers in decimal, floats as `repr` with `NaN` / `Infinity` spelled as
/// JavaScript does.
fn json_number(v: &Value) -> String {
    if v.is_integer() {
        return v.to_string();
    }
    let x = f64::try_from(v.clone()).unwrap_or(f64::NAN);
    match float_repr(x).as_str() {
        "nan" => "NaN".into(),
        "inf" => "Infinity".into(),
        "-inf" => "-Infinity".into(),
        s => s.into(),
    }
}

/// A mapping key as `json.dumps` converts it: strings as they are, numbers, booleans and None spelled as JSON.
fn json_key(k: &Value) -> Result<String, Error> {
    match k.kind() {
        ValueKind::String => Ok(k.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => Ok(json_number(k)),
        ValueKind::Bool => Ok(if k.is_true() { "true" } else { "false" }.into()),
        ValueKind::None => Ok("null".into()),
        kind => Err(invalid(format!(
            "keys must be str, int, float, bool or None, not {kind}"
        ))),
    }
}
