//! Reading prompts: text, files, token ids.

use anyhow::{bail, Context, Result};

/// Parses token ids given as a JSON array (`[1, 2, 3]`) or separated by commas and/or whitespace (`1,2 3`).
pub fn parse_token_ids(s: &str) -> Result<Vec<u32>> {
    let t = s.trim();
    if t.starts_with('[') {
        let v: Vec<u32> = serde_json::from_str(t)
            .context("token ids: not a JSON array of non-negative integers")?;
        return Ok(v);
    }
    let mut out = Vec::new();
    for part in t.split(|c: char| c == ',' || c.is_whitespace()) {
        if part.is_empty() {
            continue;
        }
        out.push(
            part.parse::<u32>()
                .with_context(|| format!("token ids: {part:?} is not a non-negative integer"))?,
        );
    }
    if out.is_empty() {
        bail!("token ids: none given");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_parse_from_json_commas_and_whitespace() {
        assert_eq!(parse_token_ids("[1, 2,3]").unwrap(), vec![1, 2, 3]);
        assert_eq!(
            parse_token_ids("1,2, 3\n4\t5").unwrap(),
            vec![1, 2, 3, 4, 5]
        );
        assert!(parse_token_ids("1,x").is_err());
        assert!(parse_token_ids("-1").is_err());
        assert!(parse_token_ids("  ").is_err());
    }
}
