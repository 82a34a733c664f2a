//! The frame codec, free of I/O: encodes frames into byte buffers and decodes them from byte buffers, sealing and
//! opening them with the session keys after the handshake. The blocking connection ([`crate::conn`]) and the tests
//! drive it; an async codec can wrap [`FrameDecoder`] as is.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::crypto::{FrameKey, TAG_LEN};
use crate::error::LinkError;
use crate::frame::{Frame, Header, Kind, HEADER_LEN, MAX_CONTROL};

/// Encodes a control struct with postcard. Errors: [`LinkError::FrameTooLarge`] over [`MAX_CONTROL`] bytes.
pub fn encode_control<T: Serialize>(msg: &T) -> Result<Vec<u8>, LinkError> {
    let c = postcard::to_stdvec(msg).map_err(|e| LinkError::Malformed(e.to_string()))?;
    if c.len() > MAX_CONTROL {
        return Err(LinkError::FrameTooLarge {
            len: c.len(),
            max: MAX_CONTROL,
        });
    }
    Ok(c)
}

/// Decodes a control section as `T`; every byte must be used. Errors: [`LinkError::Malformed`].
pub fn decode_control<T: DeserializeOwned>(kind: Kind, bytes: &[u8]) -> Result<T, LinkError> {
    match postcard::take_from_bytes::<T>(bytes) {
        Ok((v, [])) => Ok(v),
        Ok((_, rest)) => Err(LinkError::Malformed(format!(
            "{kind:?} control section has {} trailing bytes",
            rest.len()
        ))),
        Err(e) => Err(LinkError::Malformed(format!(
            "{kind:?} control section: {e}"
        ))),
    }
}

/// The header a frame with these sections gets. Errors: [`LinkError::FrameTooLarge`] when a length does not fit
/// its u32 field or the control section is over [`MAX_CONTROL`] (a sender never truncates).
pub fn header_for(
    kind: Kind,
    control: &[u8],
    tensor: &[u8],
    session: u64,
) -> Result<Header, LinkError> {
    let too_large = |len: usize, max: usize| LinkError::FrameTooLarge { len, max };
    if control.len() > MAX_CONTROL {
        return Err(too_large(control.len(), MAX_CONTROL));
    }
    let tensor_len =
        u32::try_from(tensor.len()).map_err(|_| too_large(tensor.len(), u32::MAX as usize))?;
    if tensor_len > 0 && !kind.has_tensor() {
        return Err(LinkError::Malformed(format!(
            "{kind:?} carries no tensor section"
        )));
    }
    Ok(Header {
        kind,
        control_len: control.len() as u32,
        tensor_len,
        session,
    })
}

/// Bytes that follow a header on the wire: the body, plus the tag when the frame is sealed.
pub fn wire_body_len(h: &Header, sealed: bool) -> usize {
    h.body_len() + if sealed { TAG_LEN } else { 0 }
}

/// Encodes one frame into `out` (cleared first): header, control, tensor and, with `key`, the body encrypted in
/// place and the tag appended. Returns the header.
///
/// Errors: as [`header_for`]; [`LinkError::Integrity`] if the key's counter is exhausted.
pub fn encode_frame(
    out: &mut Vec<u8>,
    kind: Kind,
    control: &[u8],
    tensor: &[u8],
    session: u64,
    key: Option<&mut FrameKey>,
) -> Result<Header, LinkError> {
    let h = header_for(kind, control, tensor, session)?;
    out.clear();
    out.reserve(HEADER_LEN + wire_body_len(&h, key.is_some()));
    let hb = h.encode();
    out.extend_from_slice(&hb);
    out.extend_from_slice(control);
    out.extend_from_slice(tensor);
    if let Some(k) = key {
        let tag = k.seal(&hb, &mut out[HEADER_LEN..])?;
        out.extend_from_slice(&tag);
    }
    Ok(h)
}

/// Decodes the bytes after a header (`wire` holds exactly [`wire_body_len`] bytes): with `key`, checks the tag and
/// decrypts, then splits control and tensor.
///
/// Errors: [`LinkError::Malformed`] for a wrong length, [`LinkError::Integrity`] for a tag that does not verify.
pub fn decode_body(
    h: Header,
    mut wire: Vec<u8>,
    key: Option<&mut FrameKey>,
) -> Result<Frame, LinkError> {
    if wire.len() != wire_body_len(&h, key.is_some()) {
        return Err(LinkError::Malformed(format!(
            "{:?} body is {} bytes, the header says {}",
            h.kind,
            wire.len(),
            wire_body_len(&h, key.is_some())
        )));
    }
    if let Some(k) = key {
        let n = k.open(&h.encode(), &mut wire)?;
        wire.truncate(n);
    }
    let c = h.control_len as usize;
    let control = wire[..c].to_vec();
    wire.drain(..c);
    Ok(Frame {
        header: h,
        control,
        tensor: wire,
    })
}

/// Incremental decoder over a byte buffer (the shape of an async codec's `decode`): call [`FrameDecoder::decode`]
/// whenever bytes were appended; it removes and returns one whole frame once all of it is there.
#[derive(Debug)]
pub struct FrameDecoder {
    /// Bound on the tensor section (bytes).
    pub max_tensor: usize,
    /// The receiving direction's key once the handshake is done.
    pub key: Option<FrameKey>,
}

impl FrameDecoder {
    /// Returns the next frame if `buf` holds all of it (consuming its bytes), `None` if more bytes are needed.
    ///
    /// Errors: any header error of [`Header::decode`] as soon as the header is complete (before the body arrives),
    /// and the errors of [`decode_body`].
    pub fn decode(&mut self, buf: &mut Vec<u8>) -> Result<Option<Frame>, LinkError> {
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let hb: [u8; HEADER_LEN] = buf[..HEADER_LEN].try_into().expect("header length");
        let h = Header::decode(&hb, self.max_tensor)?;
        let need = HEADER_LEN + wire_body_len(&h, self.key.is_some());
        if buf.len() < need {
            return Ok(None);
        }
        let wire = buf[HEADER_LEN..need].to_vec();
        buf.drain(..need);
        decode_body(h, wire, self.key.as_mut()).map(Some)
    }
}
