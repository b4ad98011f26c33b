//! Incremental parsing of OpenAI-style server-sent event streams.
//!
//! Network reads split an SSE stream anywhere, including inside a UTF-8 character or
//! between `\r` and `\n`, so [`SseParser`] buffers bytes and yields each complete event's
//! `data` once its blank-line terminator has arrived. [`parse_chunk`] then reads the
//! OpenAI fields the load generator needs: whether the chunk carries generated text
//! (`choices[0].delta.content` for chat, `choices[0].text` for completions) and the final
//! `usage`.

use serde::Deserialize;

/// Splits a byte stream into SSE events and returns each event's `data` payload.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

/// The longest event the parser buffers before treating the stream as broken: far above
/// any chunk a model server sends (a few hundred bytes), small enough to bound memory.
pub const MAX_EVENT_BYTES: usize = 4 * 1024 * 1024;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew past [`MAX_EVENT_BYTES`] without a terminator.
    #[error("event larger than {MAX_EVENT_BYTES} bytes")]
    TooLarge,
}

impl SseParser {
    /// An empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the `data` of every event completed by them, in order
    /// (several `data:` lines of one event are joined with `\n`, as the SSE spec says).
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            if let Some(data) = event_data(&event) {
                events.push(data);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(SseError::TooLarge);
        }
        Ok(events)
    }

    /// True when bytes of an unfinished event are buffered.
    pub fn has_partial(&self) -> bool {
        self.buf.iter().any(|b| !b.is_ascii_whitespace())
    }
}

/// Finds the first blank-line event terminator: returns (event length, separator length).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i] == b'\n' {
            if buf.get(i + 1) == Some(&b'\n') {
                return Some((i, 2));
            }
            if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                return Some((i, 3));
            }
        }
        if buf[i] == b'\r' && buf.get(i + 1) == Some(&b'\n') {
            // "\r\n\r\n"
            if buf.get(i + 2) == Some(&b'\r') && buf.get(i + 3) == Some(&b'\n') {
                return Some((i, 4));
            }
        }
        i += 1;
    }
    None
}

/// The joined `data:` lines of one event, or `None` for an event without data
/// (comments such as `: keep-alive`, or `event:`/`id:` only).
fn event_data(event: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(event);
    let mut data: Option<String> = None;
    for line in text.split('\n') {
        let line = line.strip_suffix('\r').unwrap_or(line);
        if let Some(rest) = line.strip_prefix("data:") {
            let rest = rest.strip_prefix(' ').unwrap_or(rest);
            match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(rest);
                }
                None => data = Some(rest.to_string()),
            }
        }
    }
    data
}

/// What one streamed chunk carries.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chunk {
    /// The chunk carries non-empty generated text.
    pub has_content: bool,
    /// `usage.completion_tokens`, when the chunk reports usage.
    pub completion_tokens: Option<u64>,
    /// The chunk is an error object (`{"error": ...}`).
    pub error: Option<String>,
}

/// A parsed SSE data payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// The `[DONE]` terminator.
    Done,
    /// A JSON chunk.
    Chunk(Chunk),
}

#[derive(Deserialize)]
struct RawChunk {
    #[serde(default)]
    choices: Vec<RawChoice>,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct RawChoice {
    #[serde(default)]
    delta: Option<RawDelta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct RawDelta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    completion_tokens: Option<u64>,
}

/// Parses one event's data. `Err` carries the JSON error for a payload that is neither
/// `[DONE]` nor a JSON object.
pub fn parse_chunk(data: &str) -> Result<Event, String> {
    let data = data.trim();
    if data == "[DONE]" {
        return Ok(Event::Done);
    }
    let raw: RawChunk = serde_json::from_str(data).map_err(|e| e.to_string())?;
    let has_content = raw.choices.first().is_some_and(|c| {
        c.delta
            .as_ref()
            .and_then(|d| d.content.as_deref())
            .is_some_and(|s| !s.is_empty())
            || c.text.as_deref().is_some_and(|s| !s.is_empty())
    });
    Ok(Event::Chunk(Chunk {
        has_content,
        completion_tokens: raw.usage.and_then(|u| u.completion_tokens),
        error: raw.error.map(|e| e.to_string()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
        : keep-alive\n\n\
        data: {\"choices\":[{\"delta\":{\"content\":\"Hé\"}}]}\r\n\r\n\
        data: {\"choices\":[{\"text\":\"llo\"}]}\n\n\
        data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
        data: [DONE]\n\n";

    fn events_of(parts: &[&[u8]]) -> Vec<String> {
        let mut p = SseParser::new();
        parts.iter().flat_map(|b| p.feed(b).unwrap()).collect()
    }

    #[test]
    fn whole_stream_yields_data_events_and_skips_comments() {
        let ev = events_of(&[STREAM.as_bytes()]);
        assert_eq!(ev.len(), 5);
        assert_eq!(parse_chunk(&ev[4]), Ok(Event::Done));
        let chunks: Vec<Chunk> = ev[..4]
            .iter()
            .map(|d| match parse_chunk(d) {
                Ok(Event::Chunk(c)) => c,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert!(!chunks[0].has_content, "a role-only delta is not content");
        assert!(chunks[1].has_content);
        assert!(
            chunks[2].has_content,
            "completions put text in choices[0].text"
        );
        assert_eq!(chunks[3].completion_tokens, Some(2));
    }

    #[test]
    fn multi_line_data_is_joined_and_errors_are_reported() {
        let ev = events_of(&[b"data: {\"error\":\ndata: {\"message\":\"x\"}}\n\n"]);
        assert_eq!(ev, vec!["{\"error\":\n{\"message\":\"x\"}}".to_string()]);
        match parse_chunk(&ev[0]) {
            Ok(Event::Chunk(c)) => assert!(c.error.is_some()),
            other => panic!("unexpected {other:?}"),
        }
        assert!(parse_chunk("not json").is_err());
    }

    #[test]
    fn an_unterminated_event_is_held_back() {
        let mut p = SseParser::new();
        assert!(p.feed(b"data: [DONE]\n").unwrap().is_empty());
        assert!(p.has_partial());
        assert_eq!(p.feed(b"\n").unwrap(), vec!["[DONE]".to_string()]);
        assert!(!p.has_partial());
    }

    proptest! {
        #[test]
        fn splitting_the_stream_anywhere_gives_the_same_events(cuts in proptest::collection::vec(0usize..STREAM.len(), 0..6)) {
            let bytes = STREAM.as_bytes();
            let mut cuts = cuts;
            cuts.sort_unstable();
            let mut parts: Vec<&[u8]> = Vec::new();
            let mut last = 0;
            for c in cuts {
                parts.push(&bytes[last..c]);
                last = c;
            }
            parts.push(&bytes[last..]);
            prop_assert_eq!(events_of(&parts), events_of(&[bytes]));
        }
    }
}
