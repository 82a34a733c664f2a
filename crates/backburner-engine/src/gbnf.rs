//! llama-server's `grammar` field is GBNF (`root ::= "yes" | "no"`); the grammar engine reads Lark. This turns one
//! into the other, token by token: `name ::= body` rules become `g_name: body` (names lower-cased, `-` → `_`, a
//! prefix so that no name collides with Lark's), `start: g_root` is added, string literals are re-escaped as JSON
//! strings, character classes `[…]` and `.` become regular expressions, and grouping, alternation and repetition
//! (`( ) | * + ? {m,n}`) pass through. A grammar that is already Lark (it starts with `%llguidance`, or has no `::=`)
//! passes unchanged.

/// The Lark form of `g`. Errors: a message naming what could not be read (an unterminated string or class, a
/// character GBNF does not have, no `root` rule).
pub fn to_lark(g: &str) -> Result<String, String> {
    if g.trim_start().starts_with("%llguidance") || !g.contains("::=") {
        return Ok(g.to_string());
    }
    let toks = tokenize(g)?;
    let mut out = String::from("start: g_root\n");
    let mut has_root = false;
    let mut i = 0;
    while i < toks.len() {
        match (&toks[i], toks.get(i + 1)) {
            (Tok::Name(n), Some(Tok::Define)) => {
                has_root |= n == "root";
                if i > 0 {
                    out.push('\n');
                }
                out.push_str(&rule_name(n));
                out.push(':');
                i += 2;
            }
            (Tok::Define, _) => return Err("`::=` without a rule name before it".into()),
            (t, _) => {
                let postfix = matches!(t, Tok::Op(o) if o != "(" && o != ")" && o != "|");
                if !postfix {
                    out.push(' ');
                }
                out.push_str(&t.lark());
                i += 1;
            }
        }
    }
    if !has_root {
        return Err("no `root` rule".into());
    }
    out.push('\n');
    Ok(out)
}

fn rule_name(n: &str) -> String {
    format!("g_{}", n.to_ascii_lowercase().replace('-', "_"))
}

#[derive(Debug, PartialEq)]
enum Tok {
    Name(String),
    Define,
    /// A string literal's characters.
    Literal(String),
    /// A character class as written, brackets included.
    Class(String),
    Any,
    /// `( ) | * + ?` or a `{m,n}` repetition, as written.
    Op(String),
}

impl Tok {
    fn lark(&self) -> String {
        match self {
            Tok::Name(n) => rule_name(n),
            Tok::Define => unreachable!("handled by the caller"),
            Tok::Literal(s) => serde_json::to_string(s).expect("a string serializes"),
            Tok::Class(c) => format!("/{}/", c.replace('/', "\\/")),
            Tok::Any => "/(?s:.)/".into(),
            Tok::Op(o) => o.clone(),
        }
    }
}

fn tokenize(g: &str) -> Result<Vec<Tok>, String> {
    let cs: Vec<char> = g.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        match c {
            c if c.is_whitespace() => i += 1,
            '#' => {
                while i < cs.len() && cs[i] != '\n' {
                    i += 1;
                }
            }
            ':' if cs[i..].starts_with(&[':', ':', '=']) => {
                out.push(Tok::Define);
                i += 3;
            }
            '"' => {
                let (s, next) = literal(&cs, i + 1)?;
                out.push(Tok::Literal(s));
                i = next;
            }
            '[' => {
                let start = i;
                i += 1;
                while i < cs.len() && cs[i] != ']' {
                    i += if cs[i] == '\\' { 2 } else { 1 };
                }
                if i >= cs.len() {
                    return Err(format!("unterminated character class at character {start}"));
                }
                i += 1;
                out.push(Tok::Class(cs[start..i].iter().collect()));
            }
            '.' => {
                out.push(Tok::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                out.push(Tok::Op(c.to_string()));
                i += 1;
            }
            '{' => {
                let start = i;
                while i < cs.len() && cs[i] != '}' {
                    i += 1;
                }
                let rep: String = cs[start..(i + 1).min(cs.len())].iter().collect();
                if i >= cs.len()
                    || !rep[1..rep.len() - 1]
                        .chars()
                        .all(|c| c.is_ascii_digit() || c == ',' || c == ' ')
                {
                    return Err(format!("malformed repetition {rep:?}"));
                }
                out.push(Tok::Op(rep.replace(' ', "")));
                i += 1;
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == '-' => {
                let start = i;
                while i < cs.len()
                    && (cs[i].is_ascii_alphanumeric() || cs[i] == '_' || cs[i] == '-')
                {
                    i += 1;
                }
                out.push(Tok::Name(cs[start..i].iter().collect()));
            }
            other => return Err(format!("unexpected {other:?} at character {i}")),
        }
    }
    Ok(out)
}

/// The characters of a string literal whose text starts at `i` (after the quote), GBNF escapes read, and the
/// index after the closing quote.
fn literal(cs: &[char], mut i: usize) -> Result<(String, usize), String> {
    let start = i;
    let mut s = String::new();
    while i < cs.len() {
        match cs[i] {
            '"' => return Ok((s, i + 1)),
            '\\' => {
                let e = *cs.get(i + 1).ok_or("unterminated string")?;
                let hex = |n: usize| -> Result<char, String> {
                    let h: String = cs
                        .get(i + 2..i + 2 + n)
                        .ok_or("short escape")?
                        .iter()
                        .collect();
                    u32::from_str_radix(&h, 16)
                        .ok()
                        .and_then(char::from_u32)
                        .ok_or(format!("bad escape \\{e}{h}"))
                };
                let (ch, len) = match e {
                    'n' => ('\n', 2),
                    'r' => ('\r', 2),
                    't' => ('\t', 2),
                    '\\' | '"' | '[' | ']' => (e, 2),
                    'x' => (hex(2)?, 4),
                    'u' => (hex(4)?, 6),
                    'U' => (hex(8)?, 10),
                    other => return Err(format!("unknown escape \\{other}")),
                };
                s.push(ch);
                i += len;
            }
            c => {
                s.push(c);
                i += 1;
            }
        }
    }
    Err(format!("unterminated string at character {}", start - 1))
}

#[cfg(test)]
mod tests {
    use super::to_lark;

    #[test]
    fn rules_literals_classes_and_repetitions_become_lark() {
        let g = "# yes or no\nroot ::= answer (\" \" [0-9]{1,3})?\nanswer ::= \"yes\\n\" | \"n\\x6f\" | my-rule*\nmy-rule ::= [^\"/] .\n";
        assert_eq!(
            to_lark(g).unwrap(),
            "start: g_root\ng_root: g_answer ( \" \" /[0-9]/{1,3} )?\ng_answer: \"yes\\n\" | \"no\" | g_my_rule*\ng_my_rule: /[^\"\\/]/ /(?s:.)/\n"
        );
    }

    #[test]
    fn lark_passes_and_broken_gbnf_is_named() {
        assert_eq!(to_lark("start: \"a\"").unwrap(), "start: \"a\"");
        assert_eq!(
            to_lark("%llguidance {}\nstart: x").unwrap(),
            "%llguidance {}\nstart: x"
        );
        assert!(to_lark("root ::= \"a")
            .unwrap_err()
            .contains("unterminated string"));
        assert!(to_lark("root ::= [a-")
            .unwrap_err()
            .contains("unterminated character class"));
        assert!(to_lark("item ::= \"a\"").unwrap_err().contains("no `root`"));
        assert!(to_lark("root ::= \"a\" ; b")
            .unwrap_err()
            .contains("unexpected ';'"));
        assert!(to_lark("root ::= \"\\q\"")
            .unwrap_err()
            .contains("unknown escape"));
    }
}
