//! The `Experts` tensor section (docs/PROTOCOL.md, version 7), shared by host and worker: the rows `[n_rows, hidden]`
//! f32, then each segment as `row: u32`, `n_pairs: u32` and `n_pairs` × (`expert: u32`, `weight: f32`), all
//! little-endian. Decoding trusts nothing: every count is checked against the bytes left before anything is
//! allocated for it.

use backburner_link::frame::{bytes_f32, f32_bytes};
use backburner_model::Segment;

/// Encodes `rows` (f32, already gathered) and `segments` as one tensor section.
pub(crate) fn encode(rows: &[f32], segments: &[Segment]) -> Vec<u8> {
    let pairs: usize = segments.iter().map(|s| s.pairs.len()).sum();
    let mut out = f32_bytes(rows);
    out.reserve(8 * segments.len() + 8 * pairs);
    for s in segments {
        out.extend_from_slice(&s.row.to_le_bytes());
        out.extend_from_slice(&(s.pairs.len() as u32).to_le_bytes());
        for &(e, p) in &s.pairs {
            out.extend_from_slice(&e.to_le_bytes());
            out.extend_from_slice(&p.to_le_bytes());
        }
    }
    out
}

/// A little-endian reader over a byte slice that fails instead of reading past it.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn u32(&mut self) -> Result<u32, String> {
        let (head, rest) = self
            .0
            .split_first_chunk::<4>()
            .ok_or("the segments end early")?;
        self.0 = rest;
        Ok(u32::from_le_bytes(*head))
    }
}

/// Decodes a tensor section of `n_rows` rows of `hidden` and `n_segments` segments. Errors: a message when the
/// bytes are too short, too long, or a count does not fit the bytes left.
pub(crate) fn decode(
    bytes: &[u8],
    n_rows: usize,
    n_segments: usize,
    hidden: usize,
) -> Result<(Vec<f32>, Vec<Segment>), String> {
    let row_bytes = n_rows
        .checked_mul(hidden)
        .and_then(|v| v.checked_mul(4))
        .filter(|&b| b <= bytes.len())
        .ok_or_else(|| format!("{n_rows} rows of {hidden} do not fit {} bytes", bytes.len()))?;
    let rows = bytes_f32(&bytes[..row_bytes]).map_err(|e| e.to_string())?;
    let mut r = Reader(&bytes[row_bytes..]);
    // a segment takes at least 16 bytes (a header and one pair)
    if n_segments > r.0.len() / 16 {
        return Err(format!(
            "{n_segments} segments do not fit {} bytes",
            r.0.len()
        ));
    }
    let mut segments = Vec::with_capacity(n_segments);
    for _ in 0..n_segments {
        let row = r.u32()?;
        let n = r.u32()? as usize;
        if n > r.0.len() / 8 {
            return Err(format!(
                "a segment of {n} pairs does not fit {} bytes",
                r.0.len()
            ));
        }
        let mut pairs = Vec::with_capacity(n);
        for _ in 0..n {
            let e = r.u32()?;
            pairs.push((e, f32::from_bits(r.u32()?)));
        }
        segments.push(Segment { row, pairs });
    }
    if !r.0.is_empty() {
        return Err(format!("{} bytes follow the last segment", r.0.len()));
    }
    Ok((rows, segments))
}

/// Decodes an `ExpertsDone` tensor section of `n` vectors of `hidden` f32. Errors: a length that differs, or a
/// value that is not finite (a sum of finite products from finite rows is finite unless it overflows, which the
/// host's own run would show as non-finite logits: a worker sending one is faulty).
pub(crate) fn decode_answer(bytes: &[u8], n: usize, hidden: usize) -> Result<Vec<f32>, String> {
    if n.checked_mul(hidden).and_then(|v| v.checked_mul(4)) != Some(bytes.len()) {
        return Err(format!(
            "{} bytes are not {n} vectors of {hidden} f32",
            bytes.len()
        ));
    }
    let v = bytes_f32(bytes).map_err(|e| e.to_string())?;
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(format!("value {i} of the answer is not finite ({})", v[i])),
        None => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_round_trip_and_bad_sections_are_refused() {
        let segs = vec![
            Segment {
                row: 1,
                pairs: vec![(3, 0.25), (7, -1.5)],
            },
            Segment {
                row: 0,
                pairs: vec![(2, f32::MIN_POSITIVE)],
            },
        ];
        let rows = [1.0f32, -2.0, 0.5, 8.0];
        let b = encode(&rows, &segs);
        assert_eq!(b.len(), 16 + (8 + 16) + (8 + 8));
        let (r, s) = decode(&b, 2, 2, 2).unwrap();
        assert_eq!((r.as_slice(), s), (&rows[..], segs));
        assert!(decode(&b, 2, 3, 2).is_err(), "a missing segment");
        assert!(decode(&b, 2, 1, 2).is_err(), "bytes after the segments");
        assert!(decode(&b[..b.len() - 1], 2, 2, 2).is_err(), "a cut pair");
        assert!(decode(&b, usize::MAX, 0, 2).is_err(), "rows past the bytes");
        assert!(decode(&b, 3, 0, 2).is_err());
        // a pair count far past the bytes is refused before any allocation
        let mut huge = encode(&[], &[]);
        huge.extend_from_slice(&0u32.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&[0; 8]);
        assert!(decode(&huge, 0, 1, 2).unwrap_err().contains("does not fit"));
        assert_eq!(decode_answer(&b[..16], 2, 2).unwrap(), rows);
        assert!(decode_answer(&b[..12], 2, 2).is_err());
        let nan = encode(&[1.0, f32::NAN], &[]);
        assert!(decode_answer(&nan, 1, 2)
            .unwrap_err()
            .contains("not finite"));
    }
}
