//! Reading prompts: text, files, token ids.

use anyhow::{bail, Context, Result};

/// Most bytes of a prompt or token-id file `run` reads (more than any context window holds).
pub const MAX_PROMPT_FILE: u64 = 256 << 20;
/// Most bytes of a text or token-id file `perplexity` reads (it scores long files in windows).
pub const MAX_SCORED_FILE: u64 = 1 << 30;
/// Most bytes of a small side file (a calibration).
pub const MAX_SIDE_FILE: u64 = 16 << 20;

/// Reads `path` (`-`: standard input) as UTF-8 text, at most `max` bytes: a larger file, or a stream that does not end (a device, a
/// FIFO), is refused once `max` bytes were read, naming `what`.
///
/// Errors: the file cannot be opened or read, is not UTF-8, or holds more than `max` bytes.
pub fn read_bounded(path: &std::path::Path, max: u64, what: &str) -> Result<String> {
    use std::io::Read;
    // `-` is standard input, as in llama-cli and most tools
    let f: Box<dyn Read> = if path == std::path::Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        Box::new(
            std::fs::File::open(path).with_context(|| format!("read {what} {}", path.display()))?,
        )
    };
    let mut buf = Vec::new();
    f.take(max.saturating_add(1))
        .read_to_end(&mut buf)
        .with_context(|| format!("read {what} {}", path.display()))?;
    if buf.len() as u64 > max {
        bail!(
            "{what} {} holds more than {} MiB; more than this command reads",
            path.display(),
            max >> 20
        );
    }
    String::from_utf8(buf).with_context(|| format!("{what} {} is not UTF-8 text", path.display()))
}

/// Parses token ids given as a JSON array (`[1, 2, 3]`) or separated by commas and/or whitespace (`1,2 3`).
pub fn parse_token_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    if t.starts_with('[') {
        let v: Vec<u32> = serde_json::from_str(t)
            .context("token ids: not a JSON array of non-negative integers")?;
        if v.is_empty() {
            bail!("token ids: none given (an empty array)");
        }
        return Ok(v);
    }
    if t.is_empty() {
        bail!("token ids: none given");
    }
    let mut out = Vec::new();
    for field in t.split(',') {
        // between two commas (or before / after one) there must be an id: `1,,2` is a typo, not two ids
        if field.trim().is_empty() {
            bail!("token ids: an empty field between commas in {t:?}");
        }
        for part in field.split_whitespace() {
            // digits only (u32's parser also takes a leading `+`)
            let id = part
                .bytes()
                .all(|b| b.is_ascii_digit())
                .then(|| part.parse::<u32>().ok())
                .flatten()
                .with_context(|| {
                    format!("token ids: {part:?} is not a non-negative integer below 2^32")
                })?;
            out.push(id);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_from_json_commas_and_whitespace() {
        assert_eq!(parse_token_ids("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        let e = parse_token_ids(" [ ] ").unwrap_err().to_string();
        assert_eq!(e, "token ids: none given (an empty array)");
        assert_eq!(
            parse_token_ids("1,2, 3\n4\t5").unwrap(),
            vec![1, 2, 3, 4, 5]
        );
        assert!(parse_token_ids("1,x").is_err());
        assert!(parse_token_ids("-1").is_err());
        assert!(parse_token_ids("  ").is_err());
        assert_eq!(parse_token_ids(" 7 ").unwrap(), vec![7]);
        // typos are refused rather than read as fewer or other ids
        for bad in ["1,,2", "1,2,", ",1", "+1", "1e3", "4294967296"] {
            let e = parse_token_ids(bad).unwrap_err().to_string();
            assert!(e.starts_with("token ids: "), "{bad}: {e}");
        }
    }

    #[test]
    fn bounded_reads_refuse_what_does_not_end_or_is_too_long() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("ids.txt");
        std::fs::write(&p, "1, 2, 3").unwrap();
        assert_eq!(read_bounded(&p, 7, "ids").unwrap(), "1, 2, 3");
        let e = read_bounded(&p, 6, "ids").unwrap_err().to_string();
        assert!(e.contains("holds more than 0 MiB"), "{e}");
        #[cfg(unix)]
        {
            let e = read_bounded(std::path::Path::new("/dev/zero"), 1 << 20, "ids")
                .unwrap_err()
                .to_string();
            assert!(e.contains("ids /dev/zero holds more than 1 MiB"), "{e}");
        }
        std::fs::write(&p, [0xff, 0xfe]).unwrap();
        assert!(read_bounded(&p, 10, "ids")
            .unwrap_err()
            .to_string()
            .contains("not UTF-8"));
    }
}
