//! The chat template environment, set up as transformers sets up Jinja2 (`ImmutableSandboxedEnvironment` with
//! `trim_blocks`, `lstrip_blocks`, loop controls, its own `tojson`, `raise_exception` and `strftime_now`), with the
//! Python semantics of [`super::pycompat`] in place of minijinja's Rust ones.

use minijinja::value::Value;
use minijinja::{Environment, ErrorKind};

use crate::error::{ModelError, Result};

use super::pycompat;

/// Marks errors raised by the template's own `raise_exception` (a verdict on the conversation, not a broken
/// template).
const RAISED: &str = "raise_exception: ";

/// A compiled chat template. Build it once ([`ChatTemplate::new`]) and render many conversations.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles a Jinja chat template. Errors: [`ModelError::ChatTemplate`] when it does not parse.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        // A template is code from the checkpoint: bound its work so a runaway loop fails instead of hanging.
        env.set_fuel(Some(50_000_000));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(pycompat::unknown_method);
        env.set_formatter(pycompat::formatter);
        env.add_filter("tojson", pycompat::tojson_filter);
        env.add_filter("trim", pycompat::trim_filter);
        env.add_filter("string", pycompat::string_filter);
        env.add_filter("safe", pycompat::safe_filter);
        env.add_filter("length", pycompat::length_filter);
        env.add_filter("count", pycompat::length_filter);
        env.add_filter("items", pycompat::items_filter);
        env.add_test("sequence", pycompat::is_sequence);
        env.add_test("iterable", pycompat::is_iterable);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::ChatTemplate(format!("{e:#}")))?;
        Ok(ChatTemplate { env })
    }

    /// Renders the template with `context` (a JSON object whose keys become the template's variables) exactly as
    /// given: no normalization. Errors: [`ModelError::InvalidChatRequest`] (field `messages`) when the template
    /// calls `raise_exception` (it rejects the conversation), [`ModelError::ChatTemplate`] for any other failure.
    pub fn render_json(&self, context: &serde_json::Value) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        let mut out = CappedWriter(Vec::new());
        match tmpl.render_captured_to(Value::from_serialize(context), &mut out) {
            Ok(_) => String::from_utf8(out.0)
                .map_err(|_| ModelError::ChatTemplate("the rendered prompt is not UTF-8".into())),
            Err(_) if out.0.len() >= MAX_RENDERED => Err(ModelError::ChatTemplate(format!(
                "the template's output passes {MAX_RENDERED} bytes"
            ))),
            Err(e) => Err(map_render_error(e)),
        }
    }
}

/// Most bytes a template may render (64 MiB, far past any prompt a context holds): a template from a file is
/// untrusted, and a few hundred bytes of it can emit gigabytes.
const MAX_RENDERED: usize = 64 << 20;

/// The rendered text, refusing to grow past [`MAX_RENDERED`].
struct CappedWriter(Vec<u8>);

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len().saturating_add(buf.len()) > MAX_RENDERED {
            self.0.resize(MAX_RENDERED, 0);
            return Err(std::io::Error::other("template output too large"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{msg}"),
    ))
}

fn map_render_error(e: minijinja::Error) -> ModelError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<minijinja::Error>() {
            if let Some(msg) = mj.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return ModelError::InvalidChatRequest {
                    field: "messages".into(),
                    message: msg.to_string(),
                };
            }
        }
        cur = err.source();
    }
    ModelError::ChatTemplate(format!("{e:#}"))
}

/// transformers' `strftime_now(format)`: the current time formatted by `strftime`. Supports `%Y %m %d %H %M %S %y
/// %B %b %A %a %j %p %I %e %%` in UTC (Python uses local time; servers here run in UTC).
fn strftime_now(fmt: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&fmt, secs)
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `strftime` of the UTC time `secs` after the epoch, for the directives [`strftime_now`] lists.
pub(crate) fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let tod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (tod / 3600, tod / 60 % 60, tod % 60);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_before_year(y) + 1;
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hh + 11) % 12 + 1)),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days from 1970-01-01 to January 1st of `year`.
fn days_before_year(year: i64) -> i64 {
    let y = year - 1;
    let leaps = |y: i64| y.div_euclid(4) - y.div_euclid(100) + y.div_euclid(400);
    365 * (year - 1970) + leaps(y) - leaps(1969)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_matches_python_in_utc() {
        // datetime.fromtimestamp(s, timezone.utc).strftime(FMT) in CPython.
        const FMT: &str = "%Y-%m-%d %H:%M:%S %A %a %B %b %j %y %I %p %e %%";
        for (secs, want) in [
            (
                0,
                "1970-01-01 00:00:00 Thursday Thu January Jan 001 70 12 AM  1 %",
            ),
            (
                1_709_210_096,
                "2024-02-29 12:34:56 Thursday Thu February Feb 060 24 12 PM 29 %",
            ),
            (
                4_102_444_799,
                "2099-12-31 23:59:59 Thursday Thu December Dec 365 99 11 PM 31 %",
            ),
            (
                951_782_400,
                "2000-02-29 00:00:00 Tuesday Tue February Feb 060 00 12 AM 29 %",
            ),
        ] {
            assert_eq!(strftime(FMT, secs), want, "{secs}");
        }
    }

    #[test]
    fn a_compiled_template_can_be_shared_between_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<ChatTemplate>();
        shared::<crate::TextTokenizer>();
    }
}
