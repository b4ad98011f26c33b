//! A single-pass scanner for chat and Messages API bodies in their common shapes: the hot path
//! of the filter.
//!
//! `serde_json` reads a 4 KB chat body at about 1 byte per nanosecond natively and several times
//! slower inside Envoy's V8, where every byte of a prompt would otherwise be visited two or three
//! times (validation, message fields, string unescaping). This scanner validates the whole body
//! as JSON and collects what the router needs in one pass over the bytes.
//!
//! It is deliberately partial: it answers only when it is certain, and returns `None` for
//! anything unusual (invalid JSON, a `\u` escape of a lone surrogate, a role with escapes, content
//! that is neither a string nor a list of part objects, duplicated fields, deep nesting, ...).
//! The caller then takes the `serde_json` paths, which decide. Property tests hold the two to
//! the same result on every body the scanner accepts.

use crate::bytes::has_prefix;
use std::borrow::Cow;

/// What the router needs from a chat body besides its messages, which [`chat_each`] hands over
/// one by one as it reads them.
#[derive(Debug)]
pub struct ChatHead<'a> {
    /// The `model` value's JSON string token, quotes included; `None` when absent or null.
    pub model: Option<&'a str>,
    /// The `stream` value's raw text.
    pub stream: Option<&'a str>,
    /// The `n` value's raw text (how many choices to generate).
    pub n: Option<&'a str>,
    /// The `tools` value's raw text (the chat template writes it into the prompt).
    pub tools: Option<&'a str>,
}

/// A chat body as [`chat`] reads it: the head and the messages in a list.
#[cfg(test)]
#[derive(Debug)]
pub struct ChatScan<'a> {
    /// The `model` value's JSON string token, quotes included; `None` when absent or null.
    pub model: Option<&'a str>,
    /// The `stream` value's raw text.
    pub stream: Option<&'a str>,
    pub messages: Vec<ChatMessage<'a>>,
}

/// What the router needs from a Messages API body besides its messages, which
/// [`messages_each`] hands over one by one as it reads them: a chat body's fields, and the
/// top-level `system` prompt (None when absent or null).
#[derive(Debug)]
pub struct MessagesHead<'a> {
    pub model: Option<&'a str>,
    pub stream: Option<&'a str>,
    pub system: Option<Content<'a>>,
    /// The `tools` value's raw text.
    pub tools: Option<&'a str>,
}

/// A Messages API body as [`messages`] reads it: the head and the messages in a list.
#[cfg(test)]
#[derive(Debug)]
pub struct MessagesScan<'a> {
    pub model: Option<&'a str>,
    pub stream: Option<&'a str>,
    pub system: Option<Content<'a>>,
    pub messages: Vec<ChatMessage<'a>>,
}

/// One message: role, content, and `tool_calls` as raw JSON.
#[derive(Debug)]
pub struct ChatMessage<'a> {
    pub role: Option<&'a str>,
    pub content: Option<Content<'a>>,
    pub tool_calls: Option<&'a str>,
}

/// A message's content (or a Messages body's `system`): a string, or a list of parts (OpenAI's
/// content parts, Anthropic's content blocks).
#[derive(Debug)]
pub enum Content<'a> {
    Text(Text<'a>),
    /// Boxed, not a `Vec`: the enum then takes no more room than the string (it is in every
    /// message the scanner collects).
    Parts(Box<[Part<'a>]>),
}

/// One part of a content list: an object whose `text` is a string gives that text (unescaped);
/// any other object (an image, a tool call or result, `text` null) its raw JSON.
#[derive(Debug, PartialEq)]
pub enum Part<'a> {
    Text(Text<'a>),
    Raw(&'a str),
}

/// A string value as the scanner read it: the contents of its token between the quotes, whose
/// escapes `Scanner::string` has checked, and whether there are any. Decoded only where it is
/// used, straight into the buffer it goes to ([`Text::append_to`]): an escaped content costs no
/// allocation of its own and one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Text<'a> {
    raw: &'a str,
    escaped: bool,
}

impl<'a> Text<'a> {
    pub const EMPTY: Text<'static> = Text {
        raw: "",
        escaped: false,
    };

    /// The text's length in bytes if it has no escapes, else a bound on it: escapes are longer
    /// than the characters they stand for.
    pub fn max_len(&self) -> usize {
        self.raw.len()
    }

    /// Appends the text to `out`.
    #[inline(always)]
    pub fn append_to(&self, out: &mut String) {
        if self.escaped {
            decode_into(out, self.raw);
        } else {
            crate::bytes::append(out, self.raw);
        }
    }

    /// The text: borrowed when it has no escapes.
    pub fn decoded(&self) -> Cow<'a, str> {
        if !self.escaped {
            return Cow::Borrowed(self.raw);
        }
        let mut out = String::new();
        decode_into(&mut out, self.raw);
        Cow::Owned(out)
    }
}

/// Chat roles read as literals (any other role, or one with escapes, takes the string scan).
const ROLES: [&str; 5] = ["user", "assistant", "system", "tool", "developer"];

/// Nesting deeper than this is left to `serde_json` (its own limit is 128).
const MAX_DEPTH: u32 = 64;

/// Where [`chat_each`] and [`messages_each`] put the messages they read, in order. A message in
/// a plain form (a role of [`ROLES`], and a string content or a list of text parts; see
/// [`Scanner::plain_message_to`] and [`Scanner::plain_part`]) is written straight into the sink's
/// text as the scanner reads it, when the sink opens it; any other message is handed over as
/// read.
pub trait ChatSink<'a> {
    /// A message as read.
    fn message(&mut self, m: ChatMessage<'a>);
    /// A plain message of `role` is to be written into [`ChatSink::text`]: whatever goes before
    /// its content is put there now. The content's text is at most `most` bytes. `false` to be
    /// handed the message by [`ChatSink::message`] instead.
    fn open(&mut self, role: &'static str, most: usize) -> bool;
    /// The text the opened message's content is appended to.
    fn text(&mut self) -> &mut String;
    /// Another text part of the list follows the one in the text (parts are joined as engines
    /// join them, see [`crate::request`]'s `PART_SEP`).
    fn between_parts(&mut self);
    /// The opened message's content is in the text.
    fn close(&mut self, role: &'static str);
    /// The message opened last is not in the plain form after all (another field follows its
    /// content, a part is not a text part, ...): the text is to be as it was before
    /// [`ChatSink::open`]. The message is then read again and handed over.
    fn undo(&mut self);
}

/// A sink that opens no message: every message is handed over, into `messages`.
#[derive(Default)]
pub struct Collect<'a> {
    pub messages: Vec<ChatMessage<'a>>,
    /// What [`ChatSink::text`] returns (never written: no message is opened).
    unused: String,
}

impl<'a> ChatSink<'a> for Collect<'a> {
    fn message(&mut self, m: ChatMessage<'a>) {
        self.messages.push(m);
    }
    fn open(&mut self, _: &'static str, _: usize) -> bool {
        false
    }
    fn text(&mut self) -> &mut String {
        &mut self.unused
    }
    fn between_parts(&mut self) {}
    fn close(&mut self, _: &'static str) {}
    fn undo(&mut self) {}
}

/// Scans a chat body, handing each message to `sink` in order as it is read; `None` means "not
/// certain: use the general parser" (possibly after some messages went to `sink`).
pub fn chat_each<'a>(body: &'a [u8], sink: &mut impl ChatSink<'a>) -> Option<ChatHead<'a>> {
    whole(body, |s| s.top(sink))
}

/// [`chat_each`] with the messages collected as read (none written into a text).
#[cfg(test)]
pub fn chat(body: &[u8]) -> Option<ChatScan<'_>> {
    let mut sink = Collect::default();
    let head = chat_each(body, &mut sink)?;
    Some(ChatScan {
        model: head.model,
        stream: head.stream,
        messages: sink.messages,
    })
}

/// Scans a Messages API body (Anthropic's), handing each message to `sink` in order as it is
/// read; `None` means "not certain: use the general parser" (possibly after some messages went
/// to `sink`). `messages` absent or null reads as no messages, as the general parser reads it.
pub fn messages_each<'a>(body: &'a [u8], sink: &mut impl ChatSink<'a>) -> Option<MessagesHead<'a>> {
    whole(body, |s| s.messages_top(sink))
}

/// [`messages_each`] with the messages collected.
#[cfg(test)]
pub fn messages(body: &[u8]) -> Option<MessagesScan<'_>> {
    let mut sink = Collect::default();
    let head = messages_each(body, &mut sink)?;
    Some(MessagesScan {
        model: head.model,
        stream: head.stream,
        system: head.system,
        messages: sink.messages,
    })
}

/// `top` over the whole body: UTF-8, and nothing but whitespace after the value it reads.
fn whole<'a, T>(body: &'a [u8], top: impl FnOnce(&mut Scanner<'a>) -> Option<T>) -> Option<T> {
    let text = utf8(body)?;
    let mut s = Scanner {
        text,
        b: body,
        i: 0,
    };
    let out = top(&mut s)?;
    s.ws();
    (s.i == s.b.len()).then_some(out)
}

struct Scanner<'a> {
    text: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        self.ws();
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// After a member of an object or array: `true` for a comma, `false` for the closing `end`.
    fn next_or_end(&mut self, end: u8) -> Option<bool> {
        self.ws();
        let c = self.peek()?;
        self.i += 1;
        match c {
            b',' => Some(true),
            c if c == end => Some(false),
            _ => None,
        }
    }

    /// A string token starting at the current position (after whitespace). Returns the token
    /// with its quotes and whether it holds escapes.
    fn string(&mut self) -> Option<(&'a str, bool)> {
        self.ws();
        let start = self.i;
        if self.peek()? != b'"' {
            return None;
        }
        self.i += 1;
        let mut escaped = false;
        loop {
            // Plain text runs up to the next quote, backslash or control character.
            self.i += special(self.b.get(self.i..)?)?;
            let c = self.peek()?;
            self.i += 1;
            match c {
                b'"' => {
                    // SAFETY: `start` is the opening quote's index and `self.i` follows the
                    // closing quote's (both read above, so `self.i <= len`): ASCII bytes, so
                    // both are character boundaries of `text` (`str::get` would check again).
                    return Some((unsafe { self.text.get_unchecked(start..self.i) }, escaped));
                }
                b'\\' => {
                    // Read as the decoder reads it ([`escape`]): a simple escape, a `\u`
                    // escape, or a surrogate pair (an emoji, as Python's `json.dumps` writes
                    // it). What it does not take (a lone surrogate, an unknown escape) is left
                    // to serde_json.
                    escaped = true;
                    let (_, len) = escape(self.b, self.i - 1);
                    if len == 1 {
                        return None;
                    }
                    self.i += len - 1;
                }
                0..=0x1f => return None,
                _ => {}
            }
        }
    }

    /// The string token at the position (its opening quote), read as [`Scanner::string`] reads
    /// it, with its text appended to `out`: `None` for a token `string` declines, with `out`'s
    /// text as it was (the bytes past its length are not kept).
    ///
    /// With WebAssembly SIMD, one pass: each block of thirty-two bytes (sixteen, then one by one,
    /// near the end of the body) is stored to `out` as it is loaded, and kept up to its first
    /// special byte (a quote ends the token, an escape is decoded there, a control character
    /// declines). The scan of a content is then also its copy into the prompt text, and its
    /// decoding: with the scan and then a copy (or [`decode_into`]) each content was read twice.
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    #[inline(always)]
    fn string_into(&mut self, out: &mut String) -> Option<()> {
        use std::arch::wasm32::{i8x16_lt, i8x16_splat, u8x16_bitmask, u8x16_eq, u8x16_splat};
        use std::arch::wasm32::{v128_load, v128_or, v128_store};
        let b = self.b;
        let n = b.len();
        if b.get(self.i) != Some(&b'"') {
            return None;
        }
        let from = self.i + 1;
        // The text is never longer than the token's contents, nor they than the rest of `b`.
        // Four more: a decoded character is written as a four-byte word (see `put`).
        out.reserve(n - from + 4);
        let quote = u8x16_splat(b'"');
        let backslash = u8x16_splat(b'\\');
        let limit = i8x16_splat(0x20);
        // SAFETY: `w`, the bytes written, never outnumbers `i - from`, the bytes read (an escape
        // is never shorter than its character's UTF-8), so a 16-byte store at `w` while
        // `i + 16 <= n` (two while `i + 32 <= n`) ends within the `n - from` bytes reserved
        // above, as does a byte written while `i < n`; a character's four-byte word (`put`) at
        // `w <= i - from` ends within `n - from + 4`. Every load is within `b` (checked before
        // it). The length is set only at the closing quote, after a run of `b`'s bytes (UTF-8,
        // see `whole`) that ends before an ASCII byte, or after a decoded character: `out`
        // stays UTF-8.
        unsafe {
            let v = out.as_mut_vec();
            let base = v.len();
            let dst = v.as_mut_ptr().add(base);
            let src = b.as_ptr();
            let (mut i, mut w) = (from, 0usize);
            // Quote, backslash, and below 0x20 signed (control characters and bytes >= 0x80,
            // which are dropped from the mask: a byte's top bit is the mask of the block itself).
            let hits = |x| {
                v128_or(
                    v128_or(u8x16_eq(x, quote), u8x16_eq(x, backslash)),
                    i8x16_lt(x, limit),
                )
            };
            loop {
                let c = if i + 32 <= n {
                    // Thirty-two bytes a step: one test for both halves.
                    let (x, y) = (
                        v128_load(src.add(i).cast()),
                        v128_load(src.add(i + 16).cast()),
                    );
                    v128_store(dst.add(w).cast(), x);
                    v128_store(dst.add(w + 16).cast(), y);
                    let (hx, hy) = (hits(x), hits(y));
                    let mut mask = 0;
                    if u8x16_bitmask(v128_or(hx, hy)) != 0 {
                        let two =
                            |a, b| u32::from(u8x16_bitmask(a)) | u32::from(u8x16_bitmask(b)) << 16;
                        mask = two(hx, hy) & !two(x, y);
                    }
                    if mask == 0 {
                        i += 32;
                        w += 32;
                        continue;
                    }
                    let run = mask.trailing_zeros() as usize;
                    i += run;
                    w += run;
                    *b.get_unchecked(i)
                } else if i + 16 <= n {
                    // The same step on sixteen bytes, written out: with the two steps sharing
                    // their end (the block's length and mask as values) it counted ~400 more
                    // instructions per request through Envoy (`chat`, `chat-lines`).
                    let x = v128_load(src.add(i).cast());
                    v128_store(dst.add(w).cast(), x);
                    let mut mask = u8x16_bitmask(hits(x));
                    if mask != 0 {
                        mask &= !u8x16_bitmask(x);
                    }
                    if mask == 0 {
                        i += 16;
                        w += 16;
                        continue;
                    }
                    let run = mask.trailing_zeros() as usize;
                    i += run;
                    w += run;
                    *b.get_unchecked(i)
                } else {
                    // The last bytes of `b`, one at a time.
                    let c = *b.get(i)?;
                    if c >= 0x20 && c != b'"' && c != b'\\' {
                        dst.add(w).write(c);
                        i += 1;
                        w += 1;
                        continue;
                    }
                    c
                };
                match c {
                    b'"' => {
                        v.set_len(base + w);
                        self.i = i + 1;
                        return Some(());
                    }
                    b'\\' => {
                        // A run of escapes (every character outside ASCII, as Python's
                        // `json.dumps` writes text by default) is decoded here one after the
                        // other: after a block step each would stop the next step at once, ~50
                        // instructions per escape for nothing.
                        escape_run(b, dst, &mut i, &mut w)?;
                    }
                    _ => return None,
                }
            }
        }
    }

    /// [`Scanner::string_into`] without WebAssembly SIMD (the dynamic module, the native tools):
    /// the token read by [`Scanner::string`], its text then appended.
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    #[inline(always)]
    fn string_into(&mut self, out: &mut String) -> Option<()> {
        let (tok, escaped) = self.string()?;
        text_of(tok, escaped)?.append_to(out);
        Some(())
    }

    fn number(&mut self) -> Option<()> {
        let digits = |s: &mut Self| {
            let from = s.i;
            while s.peek().is_some_and(|c| c.is_ascii_digit()) {
                s.i += 1;
            }
            s.i > from
        };
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                digits(self);
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if !digits(self) {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if !digits(self) {
                return None;
            }
        }
        Some(())
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// Validates any value; returns its raw text (no surrounding whitespace).
    fn value(&mut self, depth: u32) -> Option<&'a str> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        let start = self.i;
        match self.peek()? {
            b'"' => {
                self.string()?;
            }
            b'{' => self.object(|_, s| s.value(depth + 1).map(drop))?,
            b'[' => self.array(|s| s.value(depth + 1).map(drop))?,
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            _ => self.number()?,
        }
        self.text.get(start..self.i)
    }

    /// Calls `member(key, scanner)` for every member of an object; `member` reads the value.
    /// `key` is `None` when it holds escapes (it could spell any field).
    fn object(
        &mut self,
        mut member: impl FnMut(Option<&'a str>, &mut Self) -> Option<()>,
    ) -> Option<()> {
        self.eat(b'{')?;
        self.members(b'}', |s| {
            let (tok, escaped) = s.string()?;
            s.eat(b':')?;
            member(tok.get(1..tok.len() - 1).filter(|_| !escaped), s)
        })
    }

    /// [`Scanner::object`] for objects whose keys of interest are `names`: calls
    /// `member(slot, scanner)` with the key's index in `names` (`None` for any other key), each
    /// name accepted once (see [`field`]). A key spelled exactly as one of `names` is matched
    /// as a literal, without a string scan: most keys of a chat body are these few, and a string
    /// scan's fixed cost (~100 instructions) is most of what a short key costs.
    fn object_fields<const N: usize>(
        &mut self,
        names: [&str; N],
        seen: &mut [bool; N],
        mut member: impl FnMut(Option<usize>, &mut Self) -> Option<()>,
    ) -> Option<()> {
        self.eat(b'{')?;
        self.members(b'}', |s| {
            s.ws();
            let slot = match s.quoted_literal(&names) {
                Some(i) => Some(first_time(seen, i)?),
                None => {
                    let (tok, escaped) = s.string()?;
                    field(tok.get(1..tok.len() - 1).filter(|_| !escaped), names, seen)?
                }
            };
            s.eat(b':')?;
            member(slot, s)
        })
    }

    /// At a string token spelled exactly `"word"` for one of `words` (no escapes): consumes it
    /// and returns the word's index. Otherwise consumes nothing: the same token read by
    /// [`Scanner::string`] is then none of `words`, or holds escapes.
    fn quoted_literal(&mut self, words: &[&str]) -> Option<usize> {
        let rest = self.b.get(self.i..)?;
        let (&b'"', after) = rest.split_first()? else {
            return None;
        };
        let i = words.iter().position(|w| {
            let w = w.as_bytes();
            has_prefix(after, w) && after.get(w.len()) == Some(&b'"')
        })?;
        self.i += words.get(i)?.len() + 2;
        Some(i)
    }

    /// Calls `item(scanner)` for every element of an array; `item` reads it.
    fn array(&mut self, item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.eat(b'[')?;
        self.members(b']', item)
    }

    /// The members of an object or array, after its opening bracket up to its closing `end`.
    fn members(&mut self, end: u8, mut member: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.peek()? == end {
            self.i += 1;
            return Some(());
        }
        loop {
            member(self)?;
            if !self.next_or_end(end)? {
                return Some(());
            }
        }
    }

    fn top(&mut self, sink: &mut impl ChatSink<'a>) -> Option<ChatHead<'a>> {
        let mut model = None;
        let mut stream = None;
        let mut n = None;
        let mut tools = None;
        let mut messages = false;
        let mut seen = [false; 8];
        const FIELDS: [&str; 8] = [
            "model",
            "stream",
            "messages",
            "n",
            "prompt",
            "input",
            "instructions",
            "tools",
        ];
        self.object_fields(FIELDS, &mut seen, |slot, s| {
            match slot {
                Some(0) => model = s.model()?,
                Some(1) => stream = Some(s.value(1)?),
                Some(2) => {
                    s.messages_to(sink)?;
                    messages = true;
                }
                Some(3) => n = Some(s.value(1)?),
                Some(7) => tools = Some(s.value(1)?),
                _ => {
                    s.value(1)?;
                }
            }
            Some(())
        })?;
        messages.then_some(ChatHead {
            model,
            stream,
            n,
            tools,
        })
    }

    /// The `model` value: its string token, or `Some(None)` for null. Anything else declines
    /// (the general parser answers it with its typed error).
    fn model(&mut self) -> Option<Option<&'a str>> {
        let raw = self.value(1)?;
        match raw.as_bytes().first()? {
            b'"' => Some(Some(raw)),
            _ if raw == "null" => Some(None),
            _ => None,
        }
    }

    /// A Messages body's top level. Its known fields are these four (the OpenAI prompt fields
    /// are other fields here, as for the general parser).
    fn messages_top(&mut self, sink: &mut impl ChatSink<'a>) -> Option<MessagesHead<'a>> {
        let mut out = MessagesHead {
            model: None,
            stream: None,
            system: None,
            tools: None,
        };
        let mut seen = [false; 5];
        const FIELDS: [&str; 5] = ["model", "stream", "messages", "system", "tools"];
        self.object_fields(FIELDS, &mut seen, |slot, s| {
            match slot {
                Some(0) => out.model = s.model()?,
                Some(1) => out.stream = Some(s.value(1)?),
                Some(2) => {
                    s.ws();
                    if s.peek()? == b'[' {
                        s.messages_to(sink)?;
                    } else if s.value(1)? != "null" {
                        return None;
                    }
                }
                Some(3) => out.system = s.content(1)?,
                Some(4) => out.tools = Some(s.value(1)?),
                _ => {
                    s.value(1)?;
                }
            }
            Some(())
        })?;
        Some(out)
    }

    /// A content value: a string, a list of part objects, or null (`Some(None)`). Anything else
    /// declines.
    fn content(&mut self, depth: u32) -> Option<Option<Content<'a>>> {
        self.ws();
        match self.peek()? {
            b'"' => {
                let (tok, escaped) = self.string()?;
                Some(Some(Content::Text(text_of(tok, escaped)?)))
            }
            b'[' => {
                // Most lists hold one part: no reallocation when it is boxed.
                let mut parts = Vec::with_capacity(1);
                self.array(|s| {
                    parts.push(s.part(depth + 1)?);
                    Some(())
                })?;
                Some(Some(Content::Parts(parts.into_boxed_slice())))
            }
            _ => (self.value(depth)? == "null").then_some(None),
        }
    }

    /// One part of a content list; a part that is not an object declines.
    fn part(&mut self, depth: u32) -> Option<Part<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        if let Some(p) = self.plain_part() {
            return Some(p);
        }
        self.ws();
        if self.peek()? != b'{' {
            return None;
        }
        let start = self.i;
        let mut text = None;
        let mut seen = [false; 1];
        self.object_fields(["text"], &mut seen, |slot, s| {
            s.ws();
            if slot.is_some() && s.peek()? == b'"' {
                let (tok, escaped) = s.string()?;
                text = Some(text_of(tok, escaped)?);
            } else {
                s.value(depth + 1)?;
            }
            Some(())
        })?;
        Some(match text {
            Some(t) => Part::Text(t),
            None => Part::Raw(self.text.get(start..self.i)?),
        })
    }

    /// A list of messages (chat's or the Messages API's), each handed to `sink` as it is read:
    /// the plain form inline, here in the loop; the general path a call.
    #[inline(always)]
    fn messages_to(&mut self, sink: &mut impl ChatSink<'a>) -> Option<()> {
        self.array(|s| {
            if s.plain_message_to(sink).is_none() {
                sink.message(s.general_message()?);
            }
            Some(())
        })
    }

    /// A message not in the plain form: its fields in any order and spacing.
    fn general_message(&mut self) -> Option<ChatMessage<'a>> {
        let mut m = ChatMessage {
            role: None,
            content: None,
            tool_calls: None,
        };
        let mut seen = [false; 3];
        self.object_fields(["role", "content", "tool_calls"], &mut seen, |slot, s| {
            match slot {
                Some(0) => {
                    s.ws();
                    if let Some(r) = s.quoted_literal(&ROLES) {
                        m.role = ROLES.get(r).copied();
                    } else if s.peek()? == b'"' {
                        // A plain string only: escapes and other types go to serde_json.
                        let (tok, escaped) = s.string()?;
                        if escaped {
                            return None;
                        }
                        m.role = Some(tok.get(1..tok.len() - 1)?);
                    } else if s.value(2)? != "null" {
                        return None;
                    }
                }
                Some(1) => {
                    s.ws();
                    // A string, the usual content, without the general content step.
                    m.content = if s.peek()? == b'"' {
                        let (tok, escaped) = s.string()?;
                        Some(Content::Text(text_of(tok, escaped)?))
                    } else {
                        s.content(2)?
                    };
                }
                Some(2) => {
                    let raw = s.value(2)?;
                    m.tool_calls = (raw != "null").then_some(raw);
                }
                _ => {
                    s.value(2)?;
                }
            }
            Some(())
        })?;
        Some(m)
    }
}

impl<'a> Scanner<'a> {
    /// A message in one of the two forms nearly every client sends, matched byte for byte, handed
    /// to `sink`: `{"role": "R", "content": C}` (Python's `json.dumps`, the OpenAI and Anthropic
    /// Python SDKs) and `{"role":"R","content":C}` (`JSON.stringify`, `serde_json`, Go), with
    /// `R` one of [`ROLES`] and `C` a string or a list of text parts in the same spacing
    /// (`[{"type": "text", "text": "..."}, ...]`, as the Messages API's clients send every
    /// content). The general path spends most of a short message in its whitespace, key and
    /// separator steps; here they are a few prefix compares.
    ///
    /// The content is written straight into the sink's text when the sink opens the message
    /// ([`Scanner::string_into`]: one pass over each text, which the scan validates, decodes and
    /// copies at once); a string content is otherwise handed over as read. Anything else (other
    /// keys or key order, other spacing, another role, another content, a part with other
    /// fields) leaves the position and the sink's text as they were and returns `None`: the
    /// general path then reads the message, and decides.
    ///
    /// Inline in the scanners' message loops: ~1,000 fewer instructions per request in the VM
    /// than as a call (`make profile-wasm-instr`, 28 messages).
    #[inline(always)]
    fn plain_message_to(&mut self, sink: &mut impl ChatSink<'a>) -> Option<()> {
        // Not `or_back` with a closure: LLVM then kept the closure out of line (1,800 more
        // instructions per request under Node on the benchmark's body).
        let start = self.i;
        let got = self.plain_message_to_at(sink);
        if got.is_none() {
            self.i = start;
        }
        got
    }

    #[inline(always)]
    fn plain_message_to_at(&mut self, sink: &mut impl ChatSink<'a>) -> Option<()> {
        let (role, spaced) = self.plain_head()?;
        let list = match self.peek()? {
            b'"' => false,
            b'[' => true,
            _ => return None,
        };
        if !sink.open(role, self.b.len() - self.i) {
            if list {
                return None;
            }
            sink.message(self.plain_rest(role)?);
            return Some(());
        }
        let read = if list {
            self.plain_parts_into(sink, spaced)
        } else {
            self.string_into(sink.text())
        };
        if read.is_some() && self.peek() == Some(b'}') {
            self.i += 1;
            sink.close(role);
            return Some(());
        }
        sink.undo();
        None
    }

    /// `read`'s result, or `None` with the position back where it was.
    #[inline(always)]
    fn or_back<T>(&mut self, read: impl FnOnce(&mut Self) -> Option<T>) -> Option<T> {
        let start = self.i;
        let got = read(self);
        if got.is_none() {
            self.i = start;
        }
        got
    }

    /// A plain message's start, up to its content (where it leaves the position): its role,
    /// and whether it is in the spaced form.
    #[inline(always)]
    fn plain_head(&mut self) -> Option<(&'static str, bool)> {
        self.ws();
        let rest = self.b.get(self.i..)?;
        // `{"role":` then ` "` (spaced) or `"`; each literal below is then a word compare or two.
        if !has_prefix(rest, b"{\"role\":") {
            return None;
        }
        let spaced = match rest.get(8..10)? {
            [b' ', b'"'] => true,
            [b'"', _] => false,
            _ => return None,
        };
        let at = if spaced { 10 } else { 9 };
        let rest = rest.get(at..)?;
        // The role, by its first byte: one of `ROLES`, spelled out.
        let role: &'static str = match rest.first()? {
            b'u' if has_prefix(rest, b"user") => "user",
            b'a' if has_prefix(rest, b"assistant") => "assistant",
            b's' if has_prefix(rest, b"system") => "system",
            b't' if has_prefix(rest, b"tool") => "tool",
            b'd' if has_prefix(rest, b"developer") => "developer",
            _ => return None,
        };
        let after = rest.get(role.len()..)?;
        const NEXT: &[u8] = b"\",\"content\":";
        const NEXT_SPACED: &[u8] = b"\", \"content\": ";
        let next = if spaced {
            has_prefix(after, NEXT_SPACED).then_some(NEXT_SPACED.len())
        } else {
            has_prefix(after, NEXT).then_some(NEXT.len())
        };
        self.i += at + role.len() + next?;
        Some((role, spaced))
    }

    /// A list of text parts in the plain form, spaced as its message (`spaced`), at its `[`:
    /// each part's text written into the sink's text, with the sink's separator between two.
    /// `None` at anything else (an empty list, a part with other fields or spacing).
    #[inline(always)]
    fn plain_parts_into(&mut self, sink: &mut impl ChatSink<'a>, spaced: bool) -> Option<()> {
        let (form, comma): (&[u8], &[u8]) = if spaced {
            (b"{\"type\": \"text\", \"text\": \"", b", ")
        } else {
            (b"{\"type\":\"text\",\"text\":\"", b",")
        };
        self.i += 1;
        loop {
            if !has_prefix(self.b.get(self.i..)?, form) {
                return None;
            }
            // The text's opening quote is the form's last byte: the string scan starts there.
            self.i += form.len() - 1;
            self.string_into(sink.text())?;
            if self.peek()? != b'}' {
                return None;
            }
            self.i += 1;
            if self.peek()? == b']' {
                self.i += 1;
                return Some(());
            }
            if !has_prefix(self.b.get(self.i..)?, comma) {
                return None;
            }
            self.i += comma.len();
            sink.between_parts();
        }
    }

    /// A plain message after [`Scanner::plain_head`]: its content and the closing brace.
    #[inline(always)]
    fn plain_rest(&mut self, role: &'static str) -> Option<ChatMessage<'a>> {
        let (tok, escaped) = self.string()?;
        if self.peek()? != b'}' {
            return None;
        }
        self.i += 1;
        Some(ChatMessage {
            role: Some(role),
            content: Some(Content::Text(text_of(tok, escaped)?)),
            tool_calls: None,
        })
    }
}

impl<'a> Scanner<'a> {
    /// A text part in the form nearly every client sends, matched byte for byte as
    /// [`Scanner::plain_message_to`] matches a message: `{"type": "text", "text": "..."}` or
    /// `{"type":"text","text":"..."}`. Anything else (`cache_control` after the text, other
    /// spacing or order) leaves the position where it was and returns `None`.
    fn plain_part(&mut self) -> Option<Part<'a>> {
        self.or_back(Self::plain_part_at)
    }

    fn plain_part_at(&mut self) -> Option<Part<'a>> {
        const FORMS: [&[u8]; 2] = [
            b"{\"type\": \"text\", \"text\": \"",
            b"{\"type\":\"text\",\"text\":\"",
        ];
        self.ws();
        let rest = self.b.get(self.i..)?;
        let form = FORMS.iter().find(|f| has_prefix(rest, f))?;
        // The text's opening quote is the form's last byte: the string scan starts there.
        self.i += form.len() - 1;
        let (tok, escaped) = self.string()?;
        if self.peek()? != b'}' {
            return None;
        }
        self.i += 1;
        Some(Part::Text(text_of(tok, escaped)?))
    }
}

/// The [`Text`] of a string token read by [`Scanner::string`]. Inline: a call cost more than it
/// (~40 instructions per string in V8).
#[inline(always)]
fn text_of(tok: &str, escaped: bool) -> Option<Text<'_>> {
    match tok.as_bytes() {
        // SAFETY: the first and the last byte are ASCII quotes, so both ends of the slice are
        // character boundaries (`str::get` checks that with a call per string in V8).
        [b'"', .., b'"'] => Some(Text {
            raw: unsafe { tok.get_unchecked(1..tok.len() - 1) },
            escaped,
        }),
        _ => None,
    }
}

/// Appends the text of `inner`, a string token's contents between its quotes, to `out`: the runs
/// between escapes copied as they stand, each escape decoded, into room reserved once (the text
/// is never longer than `inner`).
///
/// For contents [`Scanner::string`] accepted, which is all a [`Text`] holds. Anything else it
/// cannot decode (an unknown escape, a `\u` escape that is not four hex digits or is a lone
/// surrogate) it copies as it stands, byte for byte, without failing.
///
/// The scanner used `serde_json::from_str::<String>` on each escaped token before: a second
/// validating pass, byte by byte, into a string grown as it goes and then copied into the
/// prompt text. A 4 KB chat body whose contents are written on several lines (newline escapes
/// in 27 of its 28 messages) cost 338,095 instructions per request through Envoy that way, and
/// 294,013 with this decoder, against 284,105 for the same body with each content on one line
/// (`scripts/envoy_instructions.py --body chat-lines`).
#[inline(never)]
fn decode_into(out: &mut String, inner: &str) {
    // Four more: a decoded character is written as a four-byte word (see `put`).
    out.reserve(inner.len() + 4);
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    // SAFETY: `decode_simd128` writes only into the room reserved above and leaves the string's
    // bytes UTF-8 (see there).
    unsafe {
        decode_simd128(out.as_mut_vec(), inner.as_bytes());
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        // The runs between escapes found by `special` (in a token's contents only backslashes
        // are special), copied whole.
        let b = inner.as_bytes();
        let mut i = 0;
        while let Some(rest) = b.get(i..).filter(|r| !r.is_empty()) {
            let run = special(rest).unwrap_or(rest.len());
            // Both ends are ASCII bytes or ends of `inner`: character boundaries.
            out.push_str(inner.get(i..i + run).unwrap_or_default());
            i += run;
            let (c, len) = match b.get(i) {
                Some(b'\\') => escape(b, i),
                // A quote or a control character (not from `Scanner::string`): as it stands.
                Some(&c) => (char::from(c), 1),
                None => break,
            };
            out.push(c);
            i += len;
        }
    }
}

/// The escape at `b[i]` (a backslash): the character it stands for and its length in `b`; the
/// backslash itself, one byte, when it is not a JSON escape this scanner takes (an unknown one,
/// a `\u` that is not four hex digits, a lone surrogate). [`Scanner::string`] declines a string
/// on that answer, so what it accepts is what the decoder decodes.
#[inline(always)]
fn escape(b: &[u8], i: usize) -> (char, usize) {
    match b.get(i + 1) {
        Some(b'"') => ('"', 2),
        Some(b'\\') => ('\\', 2),
        Some(b'/') => ('/', 2),
        Some(b'b') => ('\u{8}', 2),
        Some(b'f') => ('\u{c}', 2),
        Some(b'n') => ('\n', 2),
        Some(b'r') => ('\r', 2),
        Some(b't') => ('\t', 2),
        Some(b'u') => {
            let at = |k: usize| b.get(i + k..i + k + 4).and_then(hex4);
            match at(2) {
                Some(high) if HIGH_SURROGATES.contains(&high) => {
                    let low = at(8).filter(|l| {
                        LOW_SURROGATES.contains(l) && b.get(i + 6..i + 8) == Some(b"\\u")
                    });
                    match low.and_then(|low| {
                        char::from_u32(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
                    }) {
                        Some(ch) => (ch, 12),
                        None => ('\\', 1),
                    }
                }
                Some(v) => char::from_u32(v).map_or(('\\', 1), |ch| (ch, 6)),
                None => ('\\', 1),
            }
        }
        _ => ('\\', 1),
    }
}

/// The escape at `b[i]` (a backslash) when it is the one a run of escapes is nearly always made
/// of: `\uXXXX` of a character in the Basic Multilingual Plane, not a surrogate (how Python's
/// `json.dumps` writes every character of Chinese, Japanese or Korean text by default). The
/// character is then what [`escape`] reads there, with a length of six; `None` leaves every
/// other escape to `escape`. Tested before `escape`'s match, on its own: ~11 fewer instructions
/// per escape under Node (a Japanese chat body of 650 escapes, 92,547 -> 85,352 per request).
#[cfg(any(test, all(target_arch = "wasm32", target_feature = "simd128")))]
#[inline(always)]
fn bmp_escape(b: &[u8], i: usize) -> Option<char> {
    let &[b'u', h0, h1, h2, h3] = b.get(i + 1..i + 6)? else {
        return None;
    };
    // A surrogate is no `char`: `from_u32` leaves it to `escape`.
    char::from_u32(hex4(&[h0, h1, h2, h3])?)
}

/// Two escapes in a row, each as [`bmp_escape`] takes it (`\uXXXX\uYYYY`, both characters in
/// the Basic Multilingual Plane and not surrogates), read from the sixteen bytes at `p`, which
/// start with `\u` (the caller has checked): the second escape's `\u` as a sixteen-bit word, the
/// eight hex digits checked and turned into their values with WebAssembly SIMD, then folded into
/// the two numbers. `None` when the bytes are anything else.
///
/// Written for V8, which builds every vector constant where it is used (two or three
/// instructions each): signed compares (one instruction; an unsigned one is four), digit values
/// from the low four bits, the folding by shifts. On a Japanese chat body of 650 escapes the
/// filter's code counts 69,006 instructions per request under Node with this (69,598 with `u`
/// tested first, as [`escape_run`] does), 77,293 with unsigned compares, a multiply-add and nine
/// constants, and 85,352 one escape at a time.
///
/// # Safety
/// `p` is readable for sixteen bytes.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn bmp_pair(p: *const u8) -> Option<(char, char)> {
    use std::arch::wasm32::*;
    // SAFETY: the caller vouches for the sixteen bytes.
    let (x, mark) = unsafe { (v128_load(p.cast()), p.add(6).cast::<u16>().read_unaligned()) };
    if mark != u16::from_le_bytes(*b"\\u") {
        return None;
    }
    // A digit is the one byte that lands in 0x80..=0x89 when 0x50 is added, a letter (either
    // case, with its 0x20 bit set) the one that lands in 0x80..=0x85 with 0x1F more: the bottom
    // of the signed range.
    let lower = v128_or(x, u8x16_splat(0x20));
    let is_digit = i8x16_lt(i8x16_add(x, u8x16_splat(0x50)), i8x16_splat(-118));
    let is_letter = i8x16_lt(i8x16_add(lower, u8x16_splat(0x1F)), i8x16_splat(-122));
    // Bytes 2-5 and 8-11: hex digits.
    if u8x16_bitmask(v128_or(is_digit, is_letter)) & 0x0F3C != 0x0F3C {
        return None;
    }
    // A digit's value is its low four bits, a letter's those and nine.
    let value = i8x16_add(
        v128_and(x, u8x16_splat(0x0F)),
        v128_and(is_letter, u8x16_splat(9)),
    );
    // Each sixteen-bit lane's low byte is then its two digits' byte (16 * first + second):
    // bytes 2 and 4 the first escape's high and low byte, 8 and 10 the second's.
    let pairs = v128_or(i16x8_shl(value, 4), u16x8_shr(value, 8));
    let packed = i8x16_shuffle::<4, 2, 10, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0>(pairs, pairs);
    let word = i32x4_extract_lane::<0>(packed) as u32;
    let (v1, v2) = (word & 0xFFFF, word >> 16);
    let surrogate = |v: u32| v & 0xF800 == 0xD800;
    if surrogate(v1) || surrogate(v2) {
        return None;
    }
    // SAFETY: below 0x10000 and not a surrogate: a character.
    unsafe { Some((char::from_u32_unchecked(v1), char::from_u32_unchecked(v2))) }
}

/// The first and the second of a surrogate pair's two `\u` escapes.
const HIGH_SURROGATES: std::ops::Range<u32> = 0xD800..0xDC00;
const LOW_SURROGATES: std::ops::Range<u32> = 0xDC00..0xE000;

/// [`decode_into`] with WebAssembly SIMD: sixteen bytes at a time are stored to the output as
/// they are loaded, and kept up to the first backslash among them (one compare and a bit mask);
/// the escape is decoded there and the loop goes on after it. The tail under sixteen bytes goes
/// eight at a time, then byte by byte.
///
/// # Safety
/// `v` has room for `b.len() + 4` more bytes, and `b` is UTF-8 whose backslashes are ASCII (any
/// UTF-8). Then: the bytes written so far (`w`) never outnumber the bytes read (`i`), because
/// no escape is shorter than its character, so every 16-byte store at `w` with `i + 16 <= n`
/// stays in the room, and so does a character's four-byte word at `w <= i < n`; the bytes kept
/// are runs of `b` ending before a backslash or at its end, and decoded characters, so the
/// string stays UTF-8.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
unsafe fn decode_simd128(v: &mut Vec<u8>, b: &[u8]) {
    use std::arch::wasm32::{u8x16_bitmask, u8x16_eq, u8x16_splat, v128_load, v128_store};
    let n = b.len();
    let base = v.len();
    // SAFETY: see the function's contract; every access is commented where it is made.
    unsafe {
        let dst = v.as_mut_ptr().add(base);
        let src = b.as_ptr();
        let backslash = u8x16_splat(b'\\');
        let (mut i, mut w) = (0usize, 0usize);
        // `w` stays in the room when a character is put: the escape's bytes outnumber the
        // character's, and its four-byte word ends within the four bytes of room past `n`.
        while i + 16 <= n {
            // 16 bytes in `b` read; 16 written at `w <= i`, in the room (`w + 16 <= n`).
            let x = v128_load(src.add(i).cast());
            v128_store(dst.add(w).cast(), x);
            let mask = u8x16_bitmask(u8x16_eq(x, backslash));
            if mask == 0 {
                i += 16;
                w += 16;
                continue;
            }
            let run = mask.trailing_zeros() as usize;
            i += run;
            w += run;
            // A run of escapes one after the other, as in `Scanner::string_into`; a bad one
            // (never, in a string the scan took) is kept as its backslash.
            if escape_run(b, dst, &mut i, &mut w).is_none() {
                put(dst, &mut w, '\\');
                i += 1;
            }
        }
        // Eight at a time while eight are left (the same store-then-keep step on a word). The
        // step at a backslash is written out in each loop: as one closure taking the positions
        // by reference it counted 4,200 more instructions per request through Envoy
        // (`chat-lines`).
        while i + 8 <= n {
            // 8 bytes in `b` read; 8 written at `w <= i`, in the room.
            let x = src.add(i).cast::<u64>().read_unaligned();
            dst.add(w).cast::<u64>().write_unaligned(x);
            const ONES: u64 = 0x0101_0101_0101_0101;
            let y = x ^ (ONES * u64::from(b'\\'));
            // The usual zero-byte test: exact for the lowest flagged byte.
            let hit = y.wrapping_sub(ONES) & !y & (ONES << 7);
            if hit == 0 {
                i += 8;
                w += 8;
                continue;
            }
            let run = (hit.trailing_zeros() / 8) as usize;
            i += run;
            w += run;
            let (c, len) = escape(b, i);
            put(dst, &mut w, c);
            i += len;
        }
        while let Some(&c) = b.get(i) {
            if c == b'\\' {
                let (c, len) = escape(b, i);
                put(dst, &mut w, c);
                i += len;
            } else {
                dst.add(w).write(c);
                w += 1;
                i += 1;
            }
        }
        v.set_len(base + w);
    }
}

/// Decodes the run of escapes at `b[*i]` (a backslash) into `dst + *w`, one after the other up to
/// the first byte after the run that is not a backslash, advancing both positions; `None` at an
/// escape [`escape`] does not take, with the positions at it. `\u` escapes go two at a time
/// ([`bmp_pair`]) while sixteen bytes are left to load, else one ([`bmp_escape`]); any other
/// escape (a line break) goes straight to `escape`. Testing for `u` first, not only in the
/// pair's marks, costs a Japanese body of 650 escapes ~1,300 instructions through Envoy and saves
/// a body of 51 line breaks ~1,100.
///
/// # Safety
/// `dst + *w` is writable for `b.len() - *i + 4` bytes. That stays so: no escape is shorter than
/// its character's UTF-8, the four-byte word [`put`] writes for a character ends within it, and
/// a pair's two words (the second at most three bytes on) end within it while `*i + 16 <=
/// b.len()`.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn escape_run(b: &[u8], dst: *mut u8, i: &mut usize, w: &mut usize) -> Option<()> {
    // SAFETY: see the contract; the pair's sixteen bytes are checked to be within `b`.
    unsafe {
        loop {
            let u = b.get(*i + 1) == Some(&b'u');
            if u && *i + 16 <= b.len() {
                if let Some((c1, c2)) = bmp_pair(b.as_ptr().add(*i)) {
                    put(dst, w, c1);
                    put(dst, w, c2);
                    *i += 12;
                    if b.get(*i) != Some(&b'\\') {
                        return Some(());
                    }
                    continue;
                }
            }
            if let Some(c) = u.then(|| bmp_escape(b, *i)).flatten() {
                put(dst, w, c);
                *i += 6;
            } else {
                let (c, len) = escape(b, *i);
                if len == 1 {
                    return None;
                }
                put(dst, w, c);
                *i += len;
            }
            if b.get(*i) != Some(&b'\\') {
                return Some(());
            }
        }
    }
}

/// Writes `c`'s UTF-8 at `dst + *w` and advances `*w`: the bytes packed into a word, written
/// with one four-byte store (the bytes past the character's are left past the length). With the
/// bytes encoded by `char::encode_utf8` and written one by one (a loop over them compiles to a
/// `memory.copy`, a call out of the wasm code per escape), a body with 119 `\u` escapes cost
/// 339 more instructions per request under Node (`scripts/wasm_instructions.py --body`).
///
/// # Safety
/// `dst + *w` is writable for four bytes.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
#[inline(always)]
unsafe fn put(dst: *mut u8, w: &mut usize, c: char) {
    let c = u32::from(c);
    let (word, n) = if c < 0x80 {
        (c, 1)
    } else if c < 0x800 {
        (0x80C0 | c >> 6 | (c & 0x3F) << 8, 2)
    } else if c < 0x1_0000 {
        (
            0x0080_80E0 | c >> 12 | (c >> 6 & 0x3F) << 8 | (c & 0x3F) << 16,
            3,
        )
    } else {
        (
            0x8080_80F0
                | c >> 18
                | (c >> 12 & 0x3F) << 8
                | (c >> 6 & 0x3F) << 16
                | (c & 0x3F) << 24,
            4,
        )
    };
    // SAFETY: the caller vouches for the room; unaligned stores are allowed.
    unsafe { dst.add(*w).cast::<u32>().write_unaligned(word.to_le()) };
    *w += n;
}

/// Four hex digits' value, `None` unless `hex` is exactly four hex digits. Each digit by table,
/// the four checked at once: with `char::to_digit` per digit the filter's code counted 5,800
/// more instructions per request under Node on a body with 119 `\u` escapes, each read twice
/// (the scan checks it, the decoder decodes it; `scripts/wasm_instructions.py --body`).
#[inline(always)]
fn hex4(hex: &[u8]) -> Option<u32> {
    let &[a, b, c, d] = hex else { return None };
    let [a, b, c, d] = [a, b, c, d].map(|h| u32::from(HEX[usize::from(h)]));
    ((a | b | c | d) < 16).then_some(a << 12 | b << 8 | c << 4 | d)
}

/// Each byte's value as a hex digit, 0xFF for a byte that is not one.
const HEX: [u8; 256] = {
    let mut t = [0xFF; 256];
    let mut i = 0;
    while i < 16 {
        let v = i as u8;
        t[b"0123456789abcdef"[i] as usize] = v;
        t[b"0123456789ABCDEF"[i] as usize] = v;
        i += 1;
    }
    t
};

/// Which of `names` an object key is: `Some(Some(i))`, or `Some(None)` for any other key. Each
/// name is accepted once; a repeated one, or a key with escapes, makes the scanner decline
/// (`serde_json` rejects duplicates of the fields it knows).
fn field<const N: usize>(
    key: Option<&str>,
    names: [&str; N],
    seen: &mut [bool; N],
) -> Option<Option<usize>> {
    let key = key?;
    match names.iter().position(|n| *n == key) {
        Some(i) => first_time(seen, i).map(Some),
        None => Some(None),
    }
}

/// Marks name `i` as seen: `Some(i)` the first time, `None` (decline) for a repeat.
fn first_time(seen: &mut [bool], i: usize) -> Option<usize> {
    (!std::mem::replace(seen.get_mut(i)?, true)).then_some(i)
}

/// `body` as text, if it is UTF-8. Chat bodies are nearly always ASCII: checking that sixteen
/// bytes at a time (see [`special`]) costs a fraction of a full UTF-8 validation, which runs four
/// bytes at a time on wasm32. Anything else is validated in full.
fn utf8(body: &[u8]) -> Option<&str> {
    if is_ascii(body) {
        // SAFETY: every byte is below 0x80, and a sequence of ASCII bytes is valid UTF-8.
        return Some(unsafe { std::str::from_utf8_unchecked(body) });
    }
    std::str::from_utf8(body).ok()
}

fn is_ascii(b: &[u8]) -> bool {
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        use std::arch::wasm32::*;
        // Sixty-four bytes per iteration: four loads into one accumulator.
        let mut chunks = b.chunks_exact(64);
        let mut any = u8x16_splat(0);
        for chunk in &mut chunks {
            // SAFETY: `chunk` is 64 bytes in bounds; `v128_load` has no alignment requirement.
            unsafe {
                let p = chunk.as_ptr();
                let a = v128_or(v128_load(p.cast()), v128_load(p.add(16).cast()));
                let b = v128_or(v128_load(p.add(32).cast()), v128_load(p.add(48).cast()));
                any = v128_or(any, v128_or(a, b));
            }
        }
        u8x16_bitmask(any) == 0 && chunks.remainder().is_ascii()
    }
    #[cfg(not(all(target_arch = "wasm32", target_feature = "simd128")))]
    {
        b.is_ascii()
    }
}

/// Index of the first `"`, `\\` or control character (< 0x20) in `b`, eight bytes at a time
/// (SWAR: the usual zero-byte and less-than tests on a `u64`; in each test a false positive can
/// only sit above a true one, so the lowest flagged byte is exact).
fn special(b: &[u8]) -> Option<usize> {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
    {
        special_sse2(b)
    }
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    {
        special_simd128(b)
    }
    #[cfg(not(any(
        all(target_arch = "x86_64", target_feature = "sse2"),
        all(target_arch = "wasm32", target_feature = "simd128")
    )))]
    {
        special_swar(b)
    }
}

/// [`special`] with WebAssembly SIMD (the filter's build enables `simd128`, see
/// `.cargo/config.toml`; V8 compiles it to SSE/AVX or NEON), thirty-two bytes per iteration. The
/// control-character test is a signed less-than (one SSE instruction; the unsigned one is a
/// sequence), which also flags every byte >= 0x80: those are dropped from the mask when it is
/// not empty (a byte's top bit is the mask of `u8x16_bitmask(x)`), so a block holding non-ASCII
/// text costs a few more instructions, and ASCII text none.
#[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
fn special_simd128(b: &[u8]) -> Option<usize> {
    use std::arch::wasm32::*;
    let quote = u8x16_splat(b'"');
    let backslash = u8x16_splat(b'\\');
    let limit = i8x16_splat(0x20);
    // Quote, backslash, and below 0x20 signed (control characters and bytes >= 0x80).
    let hits = |x: v128| {
        v128_or(
            v128_or(u8x16_eq(x, quote), u8x16_eq(x, backslash)),
            i8x16_lt(x, limit),
        )
    };
    // The special bytes of block `x` as a bit mask, the non-ASCII ones left out.
    let exact = |x: v128| u8x16_bitmask(hits(x)) & !u8x16_bitmask(x);
    let mut i = 0;
    while let Some(chunk) = b.get(i..i + 32) {
        // SAFETY: `chunk` is 32 bytes in bounds; `v128_load` has no alignment requirement.
        let (x, y) = unsafe {
            let p = chunk.as_ptr();
            (v128_load(p.cast()), v128_load(p.add(16).cast()))
        };
        if v128_any_true(v128_or(hits(x), hits(y))) {
            let mask = u32::from(exact(x)) | (u32::from(exact(y)) << 16);
            if mask != 0 {
                return Some(i + mask.trailing_zeros() as usize);
            }
        }
        i += 32;
    }
    if let Some(chunk) = b.get(i..i + 16) {
        // SAFETY: `chunk` is 16 bytes in bounds; `v128_load` has no alignment requirement.
        let x = unsafe { v128_load(chunk.as_ptr().cast()) };
        let mask = exact(x);
        if mask != 0 {
            return Some(i + mask.trailing_zeros() as usize);
        }
        i += 16;
    }
    special_swar(b.get(i..)?).map(|p| i + p)
}

/// [`special`] sixteen bytes at a time (x86-64 always has SSE2: the dynamic-module build and the
/// native tools). Two compares and a signed less-than per block; the same answer as the SWAR
/// version (wasm builds without `simd128`, other targets).
#[cfg(all(target_arch = "x86_64", target_feature = "sse2"))]
fn special_sse2(b: &[u8]) -> Option<usize> {
    use std::arch::x86_64::*;
    let mut i = 0;
    // SAFETY: SSE2 is enabled for this target (cfg above); every load reads 16 bytes that
    // `b.get(i..i + 16)` has just shown to be in bounds.
    unsafe {
        let quote = _mm_set1_epi8(b'"' as i8);
        let backslash = _mm_set1_epi8(b'\\' as i8);
        // Bytes < 0x20 as unsigned: flip the sign bit and compare signed against 0x20 ^ 0x80.
        let flip = _mm_set1_epi8(i8::MIN);
        let limit = _mm_set1_epi8((0x20u8 ^ 0x80) as i8);
        while let Some(chunk) = b.get(i..i + 16) {
            let x = _mm_loadu_si128(chunk.as_ptr().cast());
            let hit = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, backslash)),
                _mm_cmplt_epi8(_mm_xor_si128(x, flip), limit),
            );
            let mask = _mm_movemask_epi8(hit) as u32;
            if mask != 0 {
                return Some(i + mask.trailing_zeros() as usize);
            }
            i += 16;
        }
    }
    special_swar(b.get(i..)?).map(|p| i + p)
}

fn special_swar(b: &[u8]) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let mut i = 0;
    while let Some(chunk) = b.get(i..i + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(chunk);
        let x = u64::from_le_bytes(w);
        let m = (zero(x ^ (ONES * u64::from(b'"')))
            | zero(x ^ (ONES * u64::from(b'\\')))
            | (x.wrapping_sub(ONES * 0x20) & !x))
            & HIGH;
        if m != 0 {
            return Some(i + (m.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    let tail = b.get(i..)?;
    tail.iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .map(|p| i + p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::strategy::Strategy as _;

    proptest::proptest! {
        /// Token soup that looks like JSON: never a panic, whatever the scanner decides.
        #[test]
        fn arbitrary_json_like_bytes_never_panic(parts in proptest::collection::vec(proptest::prop_oneof![
            proptest::strategy::Just("{".to_string()), proptest::strategy::Just("}".to_string()),
            proptest::strategy::Just("[".to_string()), proptest::strategy::Just("]".to_string()),
            proptest::strategy::Just(",".to_string()), proptest::strategy::Just(":".to_string()),
            proptest::strategy::Just("\"messages\"".to_string()), proptest::strategy::Just("\"role\"".to_string()),
            proptest::strategy::Just("\"content\"".to_string()), proptest::strategy::Just("\"model\"".to_string()),
            proptest::strategy::Just("null".to_string()), proptest::strategy::Just("-1.5e3".to_string()),
            proptest::strategy::Just("\"\\u12".to_string()), proptest::strategy::Just("\\".to_string()),
            "[ -~]{0,6}",
        ], 0..40)) {
            let body = format!("{{{}", parts.concat());
            let _ = chat(body.as_bytes());
        }

        /// The one-pass decoder gives serde_json's text for every token the string scan
        /// accepts, and whatever it is given it copies, never failing: a token the scan declines
        /// (a lone surrogate, an unknown escape, a bad `\u`, a raw quote or control character)
        /// as it stands.
        #[test]
        fn decoding_equals_serde_json(pieces in proptest::collection::vec(proptest::prop_oneof![
            4 => r"[ !#-\[\]-~]{0,40}",
            1 => proptest::sample::select(vec!["é", "日本", "\u{1F600}"]).prop_map(|s: &str| s.to_string()),
            3 => proptest::sample::select(vec![
                r"\n", r"\t", r#"\""#, r"\\", r"\/", r"\b", r"\f", r"\r",
                r"\u0041", r"\u00e9", r"\u20AC", r"\uffff", r"\u0000", r"\uD83D\uDE00", r"\ud83d\ude00",
            ]).prop_map(|s: &str| s.to_string()),
            1 => proptest::sample::select(vec![
                r"\uDE00", r"\uD83D", r"\x", r"\u12g4", r"\u+123", r"\u12",
                "\u{1}", "\"", "\\",
            ]).prop_map(|s: &str| s.to_string()),
        ], 0..12), pad in 0usize..24) {
            let inner = pieces.concat();
            let tok = format!("\"{inner}\"");
            let mut sc = Scanner { text: &tok, b: tok.as_bytes(), i: 0 };
            let read = sc.string().map(|t| (t, sc.i));
            let scanned = read.filter(|r| r.1 == tok.len()).map(|r| r.0);
            // The same token read and written at once, with `pad` bytes after it (its last
            // bytes then go by block or one by one), into a text with something in it: it
            // ends where the string scan ends, or declines as it does.
            let padded = format!("{tok}{}", "}".repeat(pad));
            let mut sc = Scanner { text: &padded, b: padded.as_bytes(), i: 0 };
            let mut into = String::from("y");
            let read_into = sc.string_into(&mut into).map(|()| sc.i);
            proptest::prop_assert_eq!(read_into, read.map(|r| r.1));
            if read.is_none() {
                proptest::prop_assert_eq!(into.as_str(), "y");
            }
            let mut out = String::from("x");
            match scanned {
                Some((t, escaped)) => {
                    let want = serde_json::from_str::<String>(&tok).ok();
                    proptest::prop_assert!(want.is_some());
                    let text = text_of(t, escaped).unwrap();
                    proptest::prop_assert_eq!(Some(text.decoded().into_owned()), want.clone());
                    text.append_to(&mut out);
                    proptest::prop_assert_eq!(Some(out), want.as_ref().map(|w| format!("x{w}")));
                    proptest::prop_assert_eq!(read_into, Some(tok.len()));
                    proptest::prop_assert_eq!(Some(into), want.map(|w| format!("y{w}")));
                }
                None => {
                    decode_into(&mut out, &inner);
                    // Never longer than its source: the room reserved for it is enough.
                    proptest::prop_assert!(out.len() <= 1 + inner.len());
                    proptest::prop_assert!(out.starts_with('x'));
                }
            }
        }

        #[test]
        fn special_finds_the_first_special_byte(b in proptest::collection::vec(proptest::prop_oneof![
            12 => proptest::strategy::Just(b'a'),
            1 => proptest::strategy::Just(b'"'),
            1 => proptest::strategy::Just(b'\\'),
            1 => 0u8..0x20,
            3 => 0x20u8..=0xff,
        ], 0..160)) {
            let want = b.iter().position(|&c| c == b'"' || c == b'\\' || c < 0x20);
            proptest::prop_assert_eq!(special(&b), want);
            proptest::prop_assert_eq!(special_swar(&b), want);
        }

        /// The ASCII shortcut takes exactly the bodies that are UTF-8, wherever a non-ASCII
        /// byte sits (first, last, in a 16-byte block or in the tail).
        #[test]
        fn utf8_equals_std(b in proptest::collection::vec(proptest::prop_oneof![
            20 => 0u8..0x80,
            1 => 0x80u8..=0xff,
            1 => proptest::strategy::Just(0xc3),
            1 => proptest::strategy::Just(0xa9),
        ], 0..140)) {
            proptest::prop_assert_eq!(utf8(&b), std::str::from_utf8(&b).ok());
            proptest::prop_assert_eq!(is_ascii(&b), b.is_ascii());
        }
    }

    /// A message read by the plain path, handed over as read (a sink that opens nothing).
    fn plain<'a>(sc: &mut Scanner<'a>) -> Option<ChatMessage<'a>> {
        let mut sink = Collect::default();
        sc.plain_message_to(&mut sink)?;
        sink.messages.pop()
    }

    /// The text of a string content; None for parts or none.
    fn as_text<'c>(c: &Content<'c>) -> Option<Cow<'c, str>> {
        match c {
            Content::Text(t) => Some(t.decoded()),
            Content::Parts(_) => None,
        }
    }

    fn text<'m>(m: &ChatMessage<'m>) -> Option<Cow<'m, str>> {
        m.content.as_ref().and_then(as_text)
    }

    /// A part's text, decoded; its raw JSON for any other part.
    fn part_text<'p>(p: &Part<'p>) -> Cow<'p, str> {
        match p {
            Part::Text(t) => t.decoded(),
            Part::Raw(raw) => Cow::Borrowed(raw),
        }
    }

    /// Long runs of `\u` escapes (a CJK text as Python's `json.dumps` writes it), across every
    /// block boundary and ending in each way: the run is decoded escape after escape, then the
    /// block steps go on, and a bad escape at the end of a run declines.
    #[test]
    fn runs_of_escapes_decode_as_serde_json_reads_them() {
        let text: String = "物流の几帳面なアシスタント😀é"
            .chars()
            .cycle()
            .take(90)
            .collect();
        let escaped = serde_json::to_string(&text)
            .unwrap()
            .chars()
            .flat_map(|c| match c {
                c if c.is_ascii() => vec![c.to_string()],
                c => c
                    .encode_utf16(&mut [0; 2])
                    .iter()
                    .map(|u| format!("\\u{u:04x}"))
                    .collect(),
            })
            .collect::<String>();
        let inner = &escaped[1..escaped.len() - 1];
        for cut in 0..inner.len() {
            for after in ["", "abc", r"\n", "abcdefghijklmnopqrstuvwxyz0123456789"] {
                let part = inner.get(..cut).filter(|p| !p.ends_with('\\'));
                let Some(part) = part else { continue };
                let tok = format!("\"{part}{after}\"}}");
                let want: Option<String> = serde_json::from_str(&tok[..tok.len() - 1]).ok();
                let mut sc = Scanner {
                    text: &tok,
                    b: tok.as_bytes(),
                    i: 0,
                };
                let mut into = String::from("y");
                let got = sc.string_into(&mut into).map(|()| into[1..].to_string());
                assert_eq!(got, want, "{tok}");
                if want.is_some() {
                    let mut out = String::new();
                    decode_into(&mut out, &tok[1..tok.len() - 2]);
                    assert_eq!(Some(out), want, "{tok}");
                }
            }
        }
        // Another escape followed by four hex digits and a `\u` escape is not a pair.
        for esc in [r"\n", r"\t", r#"\""#, r"\\", r"\/"] {
            let tok = format!("\"{esc}4e00\\u4e00\\u30a2 and some more text\"}}");
            let want: Option<String> = serde_json::from_str(&tok[..tok.len() - 1]).ok();
            assert!(want.is_some(), "{tok}");
            let mut sc = Scanner {
                text: &tok,
                b: tok.as_bytes(),
                i: 0,
            };
            let mut into = String::new();
            assert_eq!(sc.string_into(&mut into).map(|()| into), want, "{tok}");
            let mut out = String::new();
            decode_into(&mut out, &tok[1..tok.len() - 2]);
            assert_eq!(Some(out), want, "{tok}");
        }
        // A bad escape after a run: the scan declines, the text is left as it was.
        let tok = format!("\"{}\\uD83D\\u0041\"", &inner[..60]);
        let mut sc = Scanner {
            text: &tok,
            b: tok.as_bytes(),
            i: 0,
        };
        let mut into = String::from("y");
        assert_eq!(sc.string_into(&mut into), None);
        assert_eq!(into, "y");
    }

    /// Python's `json.dumps` (behind the OpenAI and Anthropic Python SDKs) writes every character
    /// outside ASCII as a `\u` escape, and one outside the BMP (an emoji) as a surrogate pair:
    /// the scanner reads the pair as the one character, instead of leaving the body to
    /// `serde_json` (five times the instructions for a 4 KB chat body with an emoji per user
    /// message).
    #[test]
    fn hex4_reads_exactly_four_hex_digits() {
        for v in 0..=0xFFFFu32 {
            for hex in [format!("{v:04x}"), format!("{v:04X}")] {
                assert_eq!(hex4(hex.as_bytes()), Some(v), "{hex}");
            }
        }
        for bad in [
            "", "12", "123", "12345", "12g4", "+123", "-123", " 123", "12:4", "12@4", "12`4",
        ] {
            assert_eq!(hex4(bad.as_bytes()), None, "{bad}");
        }
        // Every byte that is not a hex digit, in every position.
        for b in (0..=255u8).filter(|b| !b.is_ascii_hexdigit()) {
            for at in 0..4 {
                let mut hex = *b"0aF9";
                hex[at] = b;
                assert_eq!(hex4(&hex), None, "{hex:?}");
            }
        }
    }

    /// The shortcut for the usual escape of a run reads what [`escape`] reads wherever it
    /// answers, and leaves to it every escape that is not `\\u` and four hex digits of a
    /// character in the BMP outside the surrogates: every value in both cases, and every byte
    /// in every position.
    #[test]
    fn bmp_escape_reads_what_escape_reads() {
        let check = |b: &[u8]| {
            let want = match escape(b, 0) {
                (c, 6) if b[1] == b'u' && (c as u32) < 0x1_0000 => Some(c),
                _ => None,
            };
            assert_eq!(bmp_escape(b, 0), want, "{b:?}");
        };
        for v in 0..=0xFFFFu32 {
            for esc in [format!("\\u{v:04x}!"), format!("\\u{v:04X}")] {
                check(esc.as_bytes());
            }
        }
        for b in 0..=255u8 {
            for at in 1..6 {
                let mut esc = *b"\\u4e0A";
                esc[at] = b;
                check(&esc);
            }
        }
        // Cut short: no answer.
        assert_eq!(bmp_escape(b"\\u4e0", 0), None);
        assert_eq!(bmp_escape(b"\\u4e0A", 0), Some('\u{4e0a}'));
    }

    /// Two escapes read at once with SIMD are what [`bmp_escape`] reads of each, or `None` when
    /// either is not its kind: every value in either place (both cases), and every byte in every
    /// one of the sixteen positions but the first two, which the caller checks (the last four
    /// are not the pair's and change nothing).
    #[cfg(all(target_arch = "wasm32", target_feature = "simd128"))]
    #[test]
    fn bmp_pair_reads_two_escapes_as_bmp_escape_does() {
        let check = |b: &[u8; 16]| {
            // Called at `\u` only (as `bmp_escape` at a backslash); the pair checks the second.
            if &b[..2] != b"\\u" {
                return;
            }
            let marked = b[6] == b'\\';
            let want = bmp_escape(b, 0).zip(bmp_escape(b, 6)).filter(|_| marked);
            // SAFETY: sixteen bytes.
            assert_eq!(unsafe { bmp_pair(b.as_ptr()) }, want, "{b:?}");
        };
        for v in 0..=0xFFFFu32 {
            for (first, second) in [
                (format!("{v:04x}"), "4E00".to_string()),
                (format!("{v:04X}"), "30a2".to_string()),
                ("00e9".to_string(), format!("{v:04x}")),
                ("FFFF".to_string(), format!("{v:04X}")),
            ] {
                let s = format!("\\u{first}\\u{second}xyz\\");
                check(s.as_bytes().try_into().unwrap());
            }
        }
        for b in 0..=255u8 {
            for at in 0..16 {
                let mut pair = *b"\\u9aF0\\u3042\\u30";
                pair[at] = b;
                check(&pair);
            }
        }
    }

    #[test]
    fn a_surrogate_pair_is_one_character() {
        let s = chat(
            br#"{"model":"m","messages":[{"role":"user","content":"hi \ud83d\ude00 \u00e9!"}]}"#,
        )
        .unwrap();
        assert_eq!(
            text(&s.messages[0]).as_deref(),
            Some("hi \u{1F600} \u{e9}!")
        );
    }

    #[test]
    fn reads_content_parts_as_text_or_raw_json() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[
            {"type":"text","text":"a\nb","cache_control":{"type":"ephemeral"}},
            { "type" : "image_url" , "image_url" : {"url":"x"} },
            {"text":null,"type":"image"},
            {"text":5},
            {"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}
        ]},{"role":"assistant","content":[]}]}"#;
        let s = chat(body).unwrap();
        let Some(Content::Parts(parts)) = &s.messages[0].content else {
            panic!("{:?}", s.messages[0].content)
        };
        assert!(matches!(parts[0], Part::Text(_)));
        assert!(parts[1..].iter().all(|p| matches!(p, Part::Raw(_))));
        assert_eq!(
            parts.iter().map(part_text).collect::<Vec<_>>(),
            [
                "a\nb",
                r#"{ "type" : "image_url" , "image_url" : {"url":"x"} }"#,
                r#"{"text":null,"type":"image"}"#,
                r#"{"text":5}"#,
                r#"{"type":"tool_result","tool_use_id":"t","content":[{"type":"text","text":"r"}]}"#,
            ]
        );
        assert!(matches!(&s.messages[1].content, Some(Content::Parts(p)) if p.is_empty()));
    }

    #[test]
    fn reads_a_messages_api_body() {
        let body = br#"{"model":"m","max_tokens":64,"stream":true,
            "system":[{"type":"text","text":"be brief","cache_control":{"type":"ephemeral"}}],
            "messages":[{"role":"user","content":"hi"},
                {"role":"assistant","content":[{"type":"tool_use","id":"u","name":"f","input":{}}]}],
            "tools":[{"name":"f","input_schema":{"type":"object"}}],"prompt":"p","prompt":"q"}"#;
        let s = messages(body).unwrap();
        assert_eq!((s.model, s.stream), (Some("\"m\""), Some("true")));
        assert!(
            matches!(&s.system, Some(Content::Parts(p)) if matches!(p[..], [Part::Text(t)] if t.decoded() == "be brief"))
        );
        assert_eq!(s.messages.len(), 2);
        assert_eq!(text(&s.messages[0]).as_deref(), Some("hi"));
        // `system` as a string, absent, or null; `messages` absent or null.
        let s = messages(br#"{"system":"s","messages":null}"#).unwrap();
        assert_eq!(s.system.as_ref().and_then(as_text).as_deref(), Some("s"));
        assert!(s.messages.is_empty() && s.model.is_none());
        assert!(messages(br#"{"model":"m","system":null}"#)
            .unwrap()
            .system
            .is_none());
        for declined in [
            &br#"{"model":"m","system":5,"messages":[]}"#[..],
            br#"{"model":"m","system":"a","system":"b"}"#,
            br#"{"model":"m","messages":"hello"}"#,
            br#"{"model":"m","messages":[]} x"#,
        ] {
            assert!(
                messages(declined).is_none(),
                "{}",
                String::from_utf8_lossy(declined)
            );
        }
    }

    #[test]
    fn reads_the_common_shape() {
        let body = br#" {"model": "m", "stream": true, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "line\nnext \u00e9", "name": "x"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c"}]}
        ], "max_tokens": -1.5e3, "stop": [null, false]} "#;
        let s = chat(body).unwrap();
        assert_eq!(s.model, Some("\"m\""));
        assert_eq!(s.stream, Some("true"));
        assert_eq!(s.messages.len(), 3);
        assert_eq!(text(&s.messages[1]).as_deref(), Some("line\nnext é"));
        assert_eq!(s.messages[2].tool_calls, Some(r#"[{"id": "c"}]"#));
        assert!(s.messages[2].content.is_none());
    }

    #[test]
    fn plain_messages_in_both_forms_and_everything_else_by_the_general_path() {
        let body = br#"{"model":"m","messages":[{"role": "system", "content": "be brief"}, {"role":"user","content":"a\"b\u00e9"},{"role":"tool","content":""},{"role": "assistant", "content": "x", "name": "n"},{"role":"users","content":"y"}, {"role": "user" , "content": "z"},{"role":"user","content":null}]}"#;
        let s = chat(body).unwrap();
        let got: Vec<_> = s.messages.iter().map(|m| (m.role, text(m))).collect();
        let got: Vec<_> = got.iter().map(|(r, t)| (*r, t.as_deref())).collect();
        assert_eq!(
            got,
            [
                (Some("system"), Some("be brief")),
                (Some("user"), Some("a\"bé")),
                (Some("tool"), Some("")),
                // A third key, another role, other spacing, a null content: the general path.
                (Some("assistant"), Some("x")),
                (Some("users"), Some("y")),
                (Some("user"), Some("z")),
                (Some("user"), None),
            ]
        );
        // Every literal role, in both forms, is read by the plain path.
        for role in ROLES {
            for form in [
                format!(r#"{{"role": "{role}", "content": "q"}}"#),
                format!(r#"{{"role":"{role}","content":"q"}}"#),
            ] {
                let mut sc = Scanner {
                    text: &form,
                    b: form.as_bytes(),
                    i: 0,
                };
                let m = plain(&mut sc).unwrap_or_else(|| panic!("{form}"));
                assert_eq!((m.role, text(&m).as_deref()), (Some(role), Some("q")));
                assert_eq!(sc.i, form.len());
            }
        }
        // What the plain path matched it consumed exactly: the position is at the closing brace's
        // successor, and a mismatch leaves the position alone.
        for (form, matched) in [
            (&br#"{"role": "user", "content": "q"}"#[..], true),
            (br#"{"role":"user","content":"q"}"#, true),
            (br#"{"role":"user","content":"q" }"#, false),
            (br#"{"role":"user","content":"q","x":1}"#, false),
            (br#"{"content":"q","role":"user"}"#, false),
            // Near misses of the opening, the role and the separator, in either form.
            (br#"{"role" : "user", "content": "q"}"#, false),
            (br#"{"role": "usr", "content": "q"}"#, false),
            (br#"{"role": "user", "content":"q"}"#, false),
            (br#"{"role":"user", "content": "q"}"#, false),
            (br#"{"role": 'user', "content": "q"}"#, false),
            (br#"{"role": "useR", "content": "q"}"#, false),
        ] {
            let mut sc = Scanner {
                text: std::str::from_utf8(form).unwrap(),
                b: form,
                i: 0,
            };
            let m = plain(&mut sc);
            assert_eq!(m.is_some(), matched, "{}", sc.text);
            assert_eq!(sc.i, if matched { form.len() } else { 0 });
        }
    }

    #[test]
    fn keys_and_roles_read_as_literals_are_exact() {
        // Near misses of the literal keys and roles take the string scan and are other fields.
        let body = br#"{"models":"x","model":"m","messages":[
            {"roles":"system","role":"users","contents":1,"content":"a"},
            {"role" :"tool","content":"b","tool_call":[],"tool_calls":null},
            {"content":"c","role":"developer"},
            {"role":"assistant","content":"d"}]}"#;
        let s = chat(body).unwrap();
        assert_eq!(s.model, Some("\"m\""));
        let roles: Vec<_> = s.messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                Some("users"),
                Some("tool"),
                Some("developer"),
                Some("assistant")
            ]
        );
        let contents: Vec<_> = s.messages.iter().map(text).collect();
        let contents: Vec<_> = contents.iter().map(|t| t.as_deref()).collect();
        assert_eq!(contents, [Some("a"), Some("b"), Some("c"), Some("d")]);
        assert!(s.messages[1].tool_calls.is_none());
        // A key or a role with escapes (it could spell anything) is left to serde_json.
        assert!(
            chat(br#"{"model":"m","messages":[{"role":"user","r\u006fle":"user"}]}"#).is_none()
        );
        assert!(chat(br#"{"model":"m","messages":[{"role":"us\u0065r"}]}"#).is_none());
    }

    #[test]
    fn declines_what_it_is_not_certain_of() {
        for body in [
            &br#"{"model":"m","messages":[]} x"#[..],
            br#"{"model":"m","messages":[],}"#,
            br#"{"model":"m"}"#,
            br#"{"model":"m","messages":null}"#,
            br#"{"model":3,"messages":[]}"#,
            br#"{"model":"m","model":"n","messages":[]}"#,
            br#"{"m\u006fdel":"m","messages":[]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":["a"]}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":[{"text":"a","text":"b"}]}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":[{"t\u0065xt":"a"}]}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":{"text":"a"}}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
            br#"{"model":"m","messages":[{"role":"user","role":"user"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"\ud83d"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"\ude00\ud83d"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"\ud83d\ud83d"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"\ud83d\n"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"\ud83d\u00"}]}"#,
            br#"{"model":"m","messages":[{"role":"user","content":"tab	in"}]}"#,
            br#"{"model":"m","messages":[1]}"#,
            br#"{"model":"m","messages":[],"n":01}"#,
            br#"{"model":"m","messages":[],"n":1.}"#,
            br#"{"model":"m","messages":[],"n":tru}"#,
            b"{\"model\":\"m\",\"messages\":[],\"n\":\"\xff\"}",
        ] {
            assert!(chat(body).is_none(), "{}", String::from_utf8_lossy(body));
        }
        let deep = format!(
            r#"{{"messages":[],"x":{}{}}}"#,
            "[".repeat(100),
            "]".repeat(100)
        );
        assert!(chat(deep.as_bytes()).is_none());
    }
}
