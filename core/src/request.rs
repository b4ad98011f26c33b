//! Parsing of OpenAI-compatible request bodies (and Anthropic-style Messages API bodies): the
//! `model` (with its byte span, so an alias can be rewritten without re-serialising the body),
//! `stream`, and the prompt text used for prefix affinity.
//!
//! Chat bodies (the hot path) are read by a single-pass scanner when they have the common shape
//! (string contents; see `scan`), else in one typed pass of `serde_json` that borrows every
//! field it needs. Any other shape, and the other endpoints, take the general path: the
//! top-level fields as raw JSON, then the prompt parts visited a second time. All three give the
//! same result for the same body (a property test holds them to it). Unknown fields are skipped,
//! never interpreted. A duplicated `model` key
//! is an error (serde's derive rejects it), so the gateway and the model server can never disagree
//! about which model a body asks for.

use crate::bytes::append;
use crate::error::ApiError;
use crate::scan;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::ops::Range;

/// Which API endpoint a body belongs to; decides where the prompt lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/completions`: `prompt`.
    Completions,
    /// `/v1/embeddings`: `input`.
    Embeddings,
    /// `/v1/responses`: `instructions` and `input`.
    Responses,
    /// `/v1/messages` (Anthropic's Messages API, served by vLLM, SGLang and llama.cpp):
    /// `system`, then `messages` as in chat. Errors on this path and the next take Anthropic's
    /// shape ([`crate::error::ErrorStyle`]).
    Messages,
    /// `/v1/messages/count_tokens`: a Messages body whose tokens are counted, not generated. It
    /// needs its model's pool, not a pod's capacity (see `Prepared::model_only`).
    CountTokens,
    /// `/v1/rerank`, `/v2/rerank` (Cohere's and Jina's rerank APIs) and `/v1/score`, which vLLM
    /// serves for cross-encoder and late-interaction models: a `query` and `documents` (or
    /// `text_1` and `text_2`), no prompt to match against what a pod caches. The whole body's
    /// length stands for the request's prefill: every document is encoded.
    Rerank,
    /// `/tokenize` and `/detokenize` (vLLM's): text to token ids and back with the model's
    /// tokenizer, on the server's CPU. Like `CountTokens` it needs its model's pool, not a pod's
    /// capacity, and its text is not cached anywhere (see `Prepared::model_only`).
    Tokenize,
    /// Any other configured inference path: the first of the fields above that is present.
    Other,
}

impl Endpoint {
    /// Classifies a request path (query string already removed).
    pub fn from_path(path: &str) -> Endpoint {
        if path.ends_with("/messages") {
            Endpoint::Messages
        } else if path.ends_with("/messages/count_tokens") {
            Endpoint::CountTokens
        } else if path.ends_with("/chat/completions") {
            Endpoint::Chat
        } else if path.ends_with("/completions") {
            Endpoint::Completions
        } else if path.ends_with("/embeddings") {
            Endpoint::Embeddings
        } else if path.ends_with("/responses") {
            Endpoint::Responses
        } else if path.ends_with("/rerank") || path.ends_with("/score") {
            Endpoint::Rerank
        } else if path.ends_with("/tokenize") || path.ends_with("/detokenize") {
            Endpoint::Tokenize
        } else {
            Endpoint::Other
        }
    }
}

/// What the router needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub struct InferenceRequest<'a> {
    /// The `model` field; `None` when absent or `null`.
    pub model: Option<Cow<'a, str>>,
    /// Byte range of the `model` value (including its quotes) within the body.
    pub model_span: Option<Range<usize>>,
    /// `stream: true`.
    pub stream: bool,
    /// Canonical prompt text (roles and contents of chat messages, completion prompts, ...),
    /// truncated to the `prompt_limit` passed to [`parse`]. Identical leading conversations give
    /// identical leading text whatever the client's JSON formatting.
    pub prompt: String,
    /// Length of the full prompt text in bytes, before truncation; the token estimate uses it.
    pub prompt_len: usize,
    /// For conversations (chat messages, Responses API message items): the length of the
    /// leading part of `prompt` that identifies the conversation: everything before the first
    /// user message plus up to `home_chars` of it. Every later turn repeats it unchanged, and two
    /// conversations that share only a system prompt differ in it. The prompt limit does not cut
    /// into it (`PromptText::limit`): the text is then longer than the limit, up to the key's end.
    pub conversation_len: Option<usize>,
    /// Where the last assistant message of the text starts, as written ([`Self::history_len`]).
    pub last_assistant: Option<usize>,
    /// Responses API: the `previous_response_id` a turn continues (a stored response, held by
    /// the pod that made it).
    pub previous_response: Option<Cow<'a, str>>,
    /// The sequences the request runs on its pod: its `n` (chat and completions; 1 when absent
    /// or not a positive integer), times the prompts of a completions batch, at most
    /// [`MAX_SEQUENCES`]. vLLM's v1 engine runs each of the `n` choices as a child request of
    /// its own (`ParentRequest`), and each prompt of a batch as a request, each counted in its
    /// running and waiting gauges.
    pub sequences: u32,
}

/// The most sequences one request counts as: more than a rollout or an evaluation asks of a
/// prompt (tens of samples), and a bound on how busy an absurd `n` can make a pod look.
pub const MAX_SEQUENCES: u32 = 256;

/// A request's sequences from its raw `n` value ([`InferenceRequest::sequences`]).
fn sequences(raw: Option<&str>) -> u32 {
    match raw.map(str::parse::<u64>) {
        Some(Ok(n)) => n.clamp(1, u64::from(MAX_SEQUENCES)) as u32,
        _ => 1,
    }
}

impl InferenceRequest<'_> {
    /// The request with its sequences read from its raw `n` value.
    fn with_n(mut self, n: Option<&str>) -> Self {
        self.sequences = sequences(n);
        self
    }

    /// The text that identifies the conversation ([`InferenceRequest::conversation_len`]);
    /// `None` for a prompt without conversation structure.
    pub fn conversation_key_text(&self) -> Option<&[u8]> {
        self.conversation_len
            .and_then(|n| self.prompt.as_bytes().get(..n))
    }

    /// Whether the prompt text reached `limit` (the `prompt_limit` it was parsed with), so
    /// that what followed was left out.
    pub fn prompt_cut(&self, limit: usize) -> bool {
        self.prompt.len().saturating_add(CUT_SLACK) > limit
    }

    /// Where the conversation stood at its previous turn: the length of the leading part of
    /// `prompt` before its last assistant message (a turn repeats the previous turn's messages,
    /// then adds the answer and a new message). `None` without an assistant message after the
    /// first user message (an assistant message before it, a scripted greeting, is the same in
    /// every conversation that opens alike).
    pub fn history_len(&self) -> Option<usize> {
        // Recorded as the text was written: a search of the text for the last assistant role
        // cost ~2,000 Envoy instructions on a 4 KB chat request.
        self.last_assistant
            .filter(|&a| self.conversation_len.is_some_and(|key| a > key))
    }

    /// Prompt tokens, estimated at 4 bytes per token (the usual rule of thumb for English text
    /// with BPE tokenizers; OpenAI's tokenizer guide gives the same figure).
    pub fn estimated_prompt_tokens(&self) -> u32 {
        u32::try_from(self.prompt_len.div_ceil(4)).unwrap_or(u32::MAX)
    }
}

#[derive(Deserialize)]
struct Body<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

/// A chat body in the documented shape, read in one pass. The other endpoints' prompt fields are
/// declared (and skipped) so a duplicated one is rejected exactly as [`Body`] rejects it.
#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(borrow, default)]
    n: Option<&'a RawValue>,
    #[serde(default, rename = "prompt")]
    _prompt: Option<IgnoredAny>,
    #[serde(default, rename = "input")]
    _input: Option<IgnoredAny>,
    #[serde(default, rename = "instructions")]
    _instructions: Option<IgnoredAny>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

/// A Messages API body: the system prompt is a top-level field, not a message. The OpenAI
/// prompt fields are not declared: on this path they are unknown fields, skipped.
#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow, default)]
    role: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    content: Option<&'a RawValue>,
    #[serde(borrow, default)]
    tool_calls: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
}

/// Prompt tokens a content part carrying inline media (an image, audio or a file as base64)
/// counts for, in place of its bytes: a vision model spends on the order of a thousand tokens
/// on an image (LLaVA-1.5 576, a 1024x1024 image ~1,300 in Qwen2-VL, ~765 in OpenAI's tiling),
/// not one per 4 bytes of its base64 (a 3 MB JPEG read as a million tokens, and its pod as busy
/// for that long: an audit).
pub const MEDIA_PART_TOKENS: usize = 1024;

/// Whether a raw content part carries inline media: its base64 (`data:image/png;base64,...`,
/// Anthropic's `"type": "base64"` source, an `input_audio`'s or a file's data).
fn carries_media(raw: &str) -> bool {
    memchr::memmem::find(raw.as_bytes(), b"base64").is_some()
}

// Separators that cannot appear in normal text keep "ab"+"c" distinct from "a"+"bc". ASCII: one
// byte each (`PromptText::sep` relies on it).
const FIELD_SEP: char = '\u{1f}';
const ITEM_SEP: char = '\u{1e}';
/// Between two parts of a content list: a line break, as engines join a message's text parts
/// before the chat template reads them (vLLM's `"\n".join(texts)` in its chat_utils for the
/// string content format, TensorRT-LLM's OpenAI server alike). A content of one text part is
/// then the text of the same content as a string, and `["a", "b"]` that of `"a\nb"`: the same
/// prompt on the pod, the same cached prefix, so the same pods.
const PART_SEP: char = '\n';
const _: () = assert!(FIELD_SEP.is_ascii() && ITEM_SEP.is_ascii() && PART_SEP.is_ascii());

/// Appends a separator (ASCII, see [`FIELD_SEP`]) as one byte. `String::push` encodes any
/// character, and LLVM kept it out of line: a call per separator (~750 instructions per request
/// under Node on the benchmark's body).
#[inline(always)]
fn push_sep(text: &mut String, c: char) {
    if c.is_ascii() {
        // SAFETY: an ASCII character is one byte, and keeps the string UTF-8.
        unsafe { text.as_mut_vec().push(c as u8) };
    } else {
        text.push(c);
    }
}

/// The role whose messages end a turn's history ([`InferenceRequest::history_len`]).
const ASSISTANT: &str = "assistant";

/// The longest text a conversation's key may take before its first user message is read
/// ([`PromptText::limit`]): a system prompt longer still is cut there, and conversations with it
/// share one key again.
pub const KEY_TEXT_MAX: usize = 256 * 1024;

/// Bytes within which a text that reached the limit ends: a cut falls on a character boundary
/// (up to 3 bytes short of it), and a separator may follow.
const CUT_SLACK: usize = 4;

/// Parses a request body. `prompt_limit` caps the prompt text kept for hashing (bytes); the
/// full length is still measured. `home_chars` bounds how much of the first user message goes
/// into [`InferenceRequest::conversation_len`].
pub fn parse(
    body: &[u8],
    endpoint: Endpoint,
    prompt_limit: usize,
    home_chars: usize,
) -> Result<InferenceRequest<'_>, ApiError> {
    let trimmed = body.trim_ascii_start();
    if trimmed.first() != Some(&b'{') {
        return Err(ApiError::invalid_json(
            "the request body must be a JSON object",
        ));
    }
    // The prompt text is shorter than the body in every shape we read (a message's JSON around
    // its text is longer than the two separators that replace it): one allocation holds it.
    let keyed = matches!(
        endpoint,
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses
    );
    let prompt = || {
        let p = PromptText::new(prompt_limit, home_chars, body.len());
        if keyed {
            p.keyed()
        } else {
            p
        }
    };
    if endpoint == Endpoint::Chat {
        // Fast paths; a body they do not take (not valid JSON, `messages` absent, null or not a
        // list of message objects, ...) goes the general way, which decides.
        if let Some(r) = parse_chat_scan(body, prompt()) {
            return r;
        }
        if let Some(r) = parse_chat_serde(body, prompt()) {
            return r;
        }
    }
    if matches!(endpoint, Endpoint::Messages | Endpoint::CountTokens) {
        if let Some(r) = parse_messages_scan(body, prompt()) {
            return r;
        }
        return parse_messages(body, prompt());
    }
    parse_general(body, endpoint, prompt())
}

/// A Messages API body. The prompt text is the one the same conversation gives as a chat body
/// (`system` read as a leading system message): engines apply one chat template to both APIs,
/// so the pods' cached prefixes are the same, and a conversation keeps its pod when a client
/// switches API.
fn parse_messages(body: &[u8], mut prompt: PromptText) -> Result<InferenceRequest<'_>, ApiError> {
    let raw: MessagesBody<'_> = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_json(format!("invalid JSON body: {e}")))?;
    let model = model_field(body, raw.model.map(RawValue::get))?;
    if let Some(system) = raw.system.filter(|s| s.get() != "null") {
        prompt.message(Some("system"), |p| p.content(system));
        prompt.sep(ITEM_SEP);
    }
    prompt.messages(raw.messages);
    prompt.unhashed(raw.tools.map(RawValue::get));
    Ok(prompt.finish(model, is_true(raw.stream.map(RawValue::get))))
}

/// A Messages API body, first tier: the single-pass scanner. It reads what [`parse_messages`]
/// reads, or declines.
///
/// The prompt text starts with `system`, a top-level field that Anthropic's SDKs send after
/// `messages`. When the whole body fits under the prompt limit (then so does the text, which is
/// shorter), the messages go into the text as the scanner reads them, and the system prompt is
/// put in front of them at the end; otherwise they are collected first, so that the text is cut
/// at the limit where the general path cuts it.
fn parse_messages_scan(
    body: &[u8],
    mut prompt: PromptText,
) -> Option<Result<InferenceRequest<'_>, ApiError>> {
    let mut collected = scan::Collect::default();
    let head = if body.len() > prompt.base_limit {
        scan::messages_each(body, &mut collected)?
    } else {
        scan::messages_each(body, &mut prompt)?
    };
    Some(model_field(body, head.model).map(|model| {
        if let Some(system) = &head.system {
            prompt.system_first(system, body.len());
        }
        prompt.scanned(&collected.messages);
        prompt.unhashed(head.tools);
        prompt.finish(model, is_true(head.stream))
    }))
}

/// Chat, first tier: the single-pass scanner (string contents and lists of part objects).
fn parse_chat_scan(
    body: &[u8],
    mut prompt: PromptText,
) -> Option<Result<InferenceRequest<'_>, ApiError>> {
    // The messages go into the prompt text as they are read; if the scanner declines, the
    // caller starts the next tier with a new text.
    let head = scan::chat_each(body, &mut prompt)?;
    Some(model_field(body, head.model).map(|model| {
        prompt.unhashed(head.tools);
        prompt.finish(model, is_true(head.stream)).with_n(head.n)
    }))
}

/// Chat, second tier: one typed `serde_json` pass (any content shape).
fn parse_chat_serde(
    body: &[u8],
    mut prompt: PromptText,
) -> Option<Result<InferenceRequest<'_>, ApiError>> {
    let Ok(ChatBody {
        model,
        stream,
        messages: Some(messages),
        n,
        tools,
        ..
    }) = serde_json::from_slice::<ChatBody<'_>>(body)
    else {
        return None;
    };
    Some(model_field(body, model.map(RawValue::get)).map(|model| {
        prompt.message_list(&messages);
        prompt.unhashed(tools.map(RawValue::get));
        prompt
            .finish(model, is_true(stream.map(RawValue::get)))
            .with_n(n.map(RawValue::get))
    }))
}

/// The longest response id [`response_id`] takes (vLLM's and OpenAI's are ~40 bytes).
const MAX_RESPONSE_ID: usize = 256;

/// The id of a Responses API answer, from the first bytes of its body: the answer's own `id`,
/// the top-level one of a JSON answer (`{"id":"resp_...",...`), and in a stream the `id` of the
/// `response` its first event carries (`data: {"type":"response.created",...,"response":{"id":
/// "resp_...`). Read by structure, not as the first `"id"` anywhere: a server that writes its
/// keys sorted puts `conversation: {"id": "conv_..."}` first, and one that echoed a client's
/// `metadata` before the id would let that client name an id of another's (an audit; vLLM writes
/// the id first). `None` when it is not there (an error answer, bytes that end before it) or is
/// not a plain string of printable ASCII up to [`MAX_RESPONSE_ID`] bytes.
pub fn response_id(head: &[u8]) -> Option<&str> {
    let json = head.trim_ascii_start();
    let id = if json.first() == Some(&b'{') {
        member(json, b"id")?
    } else {
        let data = first_data(head)?;
        match member(data, b"response") {
            Some(response) => member(response, b"id")?,
            None => member(data, b"id")?,
        }
    };
    let (id, _) = json_string(id, 0)?;
    let plain = id.iter().all(|b| b.is_ascii_graphic() && *b != b'\\');
    if id.is_empty() || id.len() > MAX_RESPONSE_ID || !plain {
        return None;
    }
    std::str::from_utf8(id).ok()
}

/// The bytes after the first `data:` line start of an event stream.
fn first_data(b: &[u8]) -> Option<&[u8]> {
    let mut line = 0;
    loop {
        if let Some(rest) = b[line..].strip_prefix(b"data:") {
            return Some(rest);
        }
        line += b[line..].iter().position(|c| *c == b'\n')? + 1;
    }
}

/// Deepest nesting [`member`] walks through.
const MAX_JSON_DEPTH: usize = 32;

/// The value of `key` in the JSON object `b` starts with (after whitespace): the bytes from the
/// value on. `None` when the object does not have it, or `b` ends before it.
fn member<'a>(b: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(b, i);
        match b.get(i)? {
            b'}' => return None,
            b',' => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let (k, after) = json_string(b, i)?;
        i = skip_ws(b, after);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        if k == key {
            return b.get(i..);
        }
        i = skip_value(b, i, 0)?;
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The raw contents of the JSON string at `b[i]` (escapes kept) and where it ends.
fn json_string(b: &[u8], i: usize) -> Option<(&[u8], usize)> {
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        match b.get(j)? {
            b'\\' => j += 2,
            b'"' => return Some((b.get(i + 1..j)?, j + 1)),
            _ => j += 1,
        }
    }
}

/// Where the JSON value at `b[i]` ends; `None` when `b` ends first (or nests too deep).
fn skip_value(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => json_string(b, i).map(|(_, end)| end),
        open @ (b'{' | b'[') => {
            if depth >= MAX_JSON_DEPTH {
                return None;
            }
            let close = if open == b'{' { b'}' } else { b']' };
            let mut j = i + 1;
            loop {
                j = skip_ws(b, j);
                match *b.get(j)? {
                    c if c == close => return Some(j + 1),
                    b',' | b':' => j += 1,
                    _ => j = skip_value(b, j, depth + 1)?,
                }
            }
        }
        _ => {
            // A number or a literal: it ends where the structure goes on.
            let len = b[i..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']') || c.is_ascii_whitespace())?;
            Some(i + len.max(1))
        }
    }
}

/// Whether an answer's `:status` is a success (2xx).
pub fn is_success(status: &[u8]) -> bool {
    status.len() == 3 && status[0] == b'2'
}

/// The pod a Responses API answer's id is learned for, from the answer's head: `None` when it
/// is not learned. Only a success is (`status` 2xx), in plain bytes (no `content_encoding` but
/// `identity`): a 500 with an `id` in its body, or a gzip'd answer read as text, taught the
/// gateway ids no pod holds. The pod is the one that answered (`upstream`, the address Envoy
/// connected to), not necessarily the one picked (`picked`, 0 when the filter picked none): Envoy
/// retries a refused connection on the next endpoint, and fails open to its own balancer, and
/// the id belongs to the pod that stores the response. Without the upstream address, the pick.
pub fn response_learner(
    status: Option<&[u8]>,
    content_encoding: Option<&[u8]>,
    upstream: Option<&[u8]>,
    picked: u64,
) -> Option<u64> {
    if !status.is_some_and(is_success) {
        return None;
    }
    if content_encoding.is_some_and(|e| !e.trim_ascii().eq_ignore_ascii_case(b"identity")) {
        return None;
    }
    Some(answered_by(upstream, picked)).filter(|&k| k != 0)
}

/// The key of the pod that answered: the upstream address Envoy connected to
/// (`upstream.address`), or without it `picked`, the pod the filter picked (0: none). Envoy
/// retries a refused connection on the next endpoint, and picks the pod itself when the filter
/// fails open, so the two can differ.
pub fn answered_by(upstream: Option<&[u8]>, picked: u64) -> u64 {
    match upstream.and_then(|u| std::str::from_utf8(u).ok()) {
        Some(addr) if !addr.is_empty() => crate::prefix::pod_key(addr),
        _ => picked,
    }
}

/// A streamed Responses API answer read until its first event that is not part of its
/// preamble: vLLM sends `response.created` and `response.in_progress` (others
/// `response.queued` too) before the engine has produced anything, so the answer's first byte
/// is not its first token, as it is for a chat stream. The event that ends the preamble (an
/// output item, a delta, an error) ends the request's prefill. Events are read whole (they end
/// at a blank line), across chunks; one without a `data:` line (a keep-alive comment) is no
/// output. A preamble event named by its `event:` line is skipped to its end without being
/// kept, however long it is: vLLM's `response.created` and `response.in_progress` each carry
/// the response object, which echoes the request's instructions and tools (an agent's run to
/// tens of KB). One event past [`FIRST_OUTPUT_MAX`] bytes not known to be preamble ends the
/// reading, taken as the end.
#[derive(Debug, Default)]
pub struct FirstOutput {
    event: Vec<u8>,
    /// In a preamble event named by its `event:` line: `event` keeps only its last bytes, where
    /// its end may begin.
    skipping: bool,
}

/// How much of a Responses stream [`FirstOutput`] reads at most for its first output.
pub const FIRST_OUTPUT_MAX: usize = 64 * 1024;

impl FirstOutput {
    /// Reads the next chunk of the answer: whether it holds the first event past the preamble
    /// (or the reading gave up).
    pub fn push(&mut self, chunk: &[u8]) -> bool {
        self.event.extend_from_slice(chunk);
        loop {
            match event_end(&self.event) {
                Some((end, next)) => {
                    if !std::mem::take(&mut self.skipping) && is_output(&self.event[..end]) {
                        return true;
                    }
                    self.event.drain(..next);
                }
                None if self.skipping => {
                    // Its last bytes only: the blank line that ends it may start in them.
                    let keep = self.event.len().saturating_sub(3);
                    self.event.drain(..keep);
                    return false;
                }
                None if named_preamble(&self.event) => self.skipping = true,
                None => return self.event.len() >= FIRST_OUTPUT_MAX,
            }
        }
    }
}

/// Whether an event (its start) opens with an `event:` line naming a preamble event.
fn named_preamble(event: &[u8]) -> bool {
    let Some(eol) = event.iter().position(|&b| b == b'\n') else {
        return false;
    };
    let Some(name) = event[..eol].strip_prefix(b"event:") else {
        return false;
    };
    let name = name.trim_ascii();
    [
        &b"response.created"[..],
        b"response.in_progress",
        b"response.queued",
    ]
    .contains(&name)
}

/// Where the first event in `b` ends (before its blank line) and the next begins.
fn event_end(b: &[u8]) -> Option<(usize, usize)> {
    let at = b.windows(2).position(|w| w == b"\n\n" || w == b"\n\r")?;
    let next = if b[at + 1] == b'\n' {
        at + 2
    } else if b.get(at + 2) == Some(&b'\n') {
        at + 3
    } else {
        return event_end(&b[at + 2..]).map(|(e, n)| (at + 2 + e, at + 2 + n));
    };
    Some((at, next))
}

/// Whether an event is output: it has data, and is none of the preamble's (its type is the
/// only `"response.…"` string value in it; the response object it may carry has none).
fn is_output(event: &[u8]) -> bool {
    const PREAMBLE: [&[u8]; 3] = [
        b"\"response.created\"",
        b"\"response.in_progress\"",
        b"\"response.queued\"",
    ];
    let has = |pat: &[u8]| event.windows(pat.len()).any(|w| w == pat);
    has(b"data:") && !PREAMBLE.iter().any(|p| has(p))
}

/// The first bytes of a Responses API answer, gathered across the chunks it arrives in until
/// they give its id ([`response_id`]): a server may send the start of its body apart.
#[derive(Debug, Default)]
pub struct ResponseHead {
    bytes: Vec<u8>,
}

/// How much of an answer's start [`ResponseHead`] reads for its id.
pub const RESPONSE_HEAD_MAX: usize = 1024;

impl ResponseHead {
    /// How many more bytes it reads.
    pub fn room(&self) -> usize {
        RESPONSE_HEAD_MAX - self.bytes.len()
    }

    /// Adds the next chunk (what fits of it): the id once the bytes so far give it.
    pub fn push(&mut self, chunk: &[u8]) -> Option<String> {
        let n = chunk.len().min(self.room());
        self.bytes.extend_from_slice(&chunk[..n]);
        response_id(&self.bytes).map(str::to_owned)
    }
}

/// The response id in the path of a stored response's own calls: `GET` and `DELETE
/// /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`
/// (`path` without its query). `None` for any other path.
pub fn stored_response_path(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/v1/responses/")?;
    let (id, tail) = rest.split_once('/').unwrap_or((rest, ""));
    let known = matches!(tail, "" | "cancel" | "input_items");
    (known && !id.is_empty() && id.len() <= MAX_RESPONSE_ID).then_some(id)
}

/// The general path: top-level fields as raw JSON, then the prompt of the endpoint.
fn parse_general(
    body: &[u8],
    endpoint: Endpoint,
    mut prompt: PromptText,
) -> Result<InferenceRequest<'_>, ApiError> {
    let raw: Body<'_> = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_json(format!("invalid JSON body: {e}")))?;
    let model = model_field(body, raw.model.map(RawValue::get))?;
    let stream = is_true(raw.stream.map(RawValue::get));
    prompt.unhashed(raw.tools.map(RawValue::get));
    // Completions prompts the body holds (a batch is a request each on the pod).
    let mut prompts = 1;
    match endpoint {
        Endpoint::Chat => prompt.messages(raw.messages),
        Endpoint::Completions => prompts = prompt.value(raw.prompt),
        Endpoint::Embeddings => {
            prompt.value(raw.input);
        }
        Endpoint::Responses => {
            // As the engine reads it (vLLM's Responses API builds the chat it templates so):
            // `instructions` a leading system message, a string `input` one user message, a
            // list of input items each a message. The text is then a chat body's with the same
            // messages, whose prefix the pod caches alike.
            if let Some(instructions) = raw.instructions.filter(|s| s.get() != "null") {
                prompt.message(Some("system"), |p| p.content(instructions));
                prompt.sep(ITEM_SEP);
            }
            match raw.input {
                Some(input) if input.get().starts_with('"') => {
                    prompt.message(Some("user"), |p| p.content(input));
                    prompt.sep(ITEM_SEP);
                }
                input => {
                    prompt.value(input);
                }
            }
            // A string, or nothing: any other value is the server's to refuse.
            let previous = raw
                .previous_response_id
                .map(RawValue::get)
                .filter(|t| t.starts_with('"'))
                .and_then(json_str);
            let mut req = prompt.finish(model, stream);
            req.previous_response = previous;
            return Ok(req);
        }
        // Read by `parse_messages`; were it ever here, its messages are chat's.
        Endpoint::Messages | Endpoint::CountTokens => prompt.messages(raw.messages),
        Endpoint::Rerank => {
            let mut req = prompt.finish(model, stream);
            req.prompt_len = body.len();
            return Ok(req);
        }
        // Only the model matters: no pod is picked and nothing is hashed.
        Endpoint::Tokenize => {}
        Endpoint::Other => {
            if raw.messages.is_some() {
                prompt.messages(raw.messages);
            } else {
                prompt.value(raw.instructions);
                match raw.prompt {
                    Some(p) => prompts = prompt.value(Some(p)),
                    None => {
                        prompt.value(raw.input);
                    }
                }
            }
        }
    }
    let mut req = prompt.finish(model, stream);
    // The APIs with `n` (chat and completions; another path's body may be either). Each
    // prompt of a batch gets `n` choices.
    if matches!(
        endpoint,
        Endpoint::Chat | Endpoint::Completions | Endpoint::Other
    ) {
        let n = sequences(raw.n.map(RawValue::get));
        req.sequences = n.saturating_mul(prompts).min(MAX_SEQUENCES);
    }
    Ok(req)
}

/// A model name and the byte range of its JSON string in the body.
type ModelField<'a> = (Option<Cow<'a, str>>, Option<Range<usize>>);

/// The `model` value (its raw JSON text, borrowed from `body`): a string (unescaped, with its
/// span in the body), absent or null.
fn model_field<'a>(body: &[u8], raw: Option<&'a str>) -> Result<ModelField<'a>, ApiError> {
    match raw {
        None | Some("null") => Ok((None, None)),
        Some(text) => {
            if !text.starts_with('"') {
                return Err(ApiError::invalid_type("model", "string"));
            }
            let name = json_str(text)
                .ok_or_else(|| ApiError::invalid_json("invalid model: not a JSON string"))?;
            Ok((Some(name), span_of(body, text)))
        }
    }
}

/// `stream` (its raw JSON text) is the literal `true`.
fn is_true(raw: Option<&str>) -> bool {
    raw == Some("true")
}

/// The text of a JSON string token (`raw` includes the quotes and was validated by the parser
/// that produced it): borrowed as it stands when it has no escapes, unescaped otherwise.
fn json_str(raw: &str) -> Option<Cow<'_, str>> {
    let inner = raw.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        serde_json::from_str::<Cow<'_, str>>(raw).ok()
    } else {
        Some(Cow::Borrowed(inner))
    }
}

/// Byte range of `inner` (a slice borrowed from `outer`) within `outer`.
fn span_of(outer: &[u8], inner: &str) -> Option<Range<usize>> {
    let start = (inner.as_ptr() as usize).checked_sub(outer.as_ptr() as usize)?;
    let end = start.checked_add(inner.len())?;
    (end <= outer.len()).then_some(start..end)
}

/// A chat or Messages body's messages as the scanner reads them: a plain message (a role, and a
/// string content or a list of text parts) is written into the text by the scanner itself when
/// it fits under the limit at the length of the rest of the body (a bound on the content's
/// text and its separators), so its content is read once; any other message, and any that may
/// not fit, through [`PromptText::scanned_message`]. The same text and length either way.
impl<'a> scan::ChatSink<'a> for PromptText {
    #[inline(always)]
    fn message(&mut self, m: scan::ChatMessage<'a>) {
        self.scanned_message(&m);
    }

    #[inline(always)]
    fn open(&mut self, role: &'static str, most: usize) -> bool {
        // Role, field separator, content, item separator.
        let most = role.len().saturating_add(most).saturating_add(2);
        if self.text.len().saturating_add(most) > self.limit() {
            return false;
        }
        self.text.reserve(most);
        self.opened = self.text.len();
        append(&mut self.text, role);
        push_sep(&mut self.text, FIELD_SEP);
        true
    }

    #[inline(always)]
    fn text(&mut self) -> &mut String {
        &mut self.text
    }

    /// Two parts' texts are joined by [`PART_SEP`], as [`PromptText::scanned_content`] joins
    /// them. Within the room `open` checked: a part's JSON around its text is longer.
    #[inline(always)]
    fn between_parts(&mut self) {
        push_sep(&mut self.text, PART_SEP);
    }

    #[inline(always)]
    fn close(&mut self, role: &'static str) {
        let start = self.opened + role.len() + 1;
        if role == ASSISTANT {
            self.last_assistant = Some(self.opened);
        }
        if self.conversation_len.is_none() && role == "user" {
            self.key_ends(self.text.len().min(start + self.home_chars));
        }
        push_sep(&mut self.text, ITEM_SEP);
        self.len += self.text.len() - self.opened;
    }

    fn undo(&mut self) {
        self.text.truncate(self.opened);
    }
}

/// Accumulates canonical prompt text up to a limit while measuring the full length.
struct PromptText {
    text: String,
    len: usize,
    /// The prompt limit ([`parse`]'s `prompt_limit`); [`PromptText::limit`] is the text's.
    base_limit: usize,
    /// [`PromptText::limit`], kept as a field: the scanner reads it for every message.
    cut_at: usize,
    /// A conversational request (chat, Messages, Responses): its text is not cut before its
    /// conversation key is whole ([`PromptText::limit`]).
    keyed: bool,
    /// Where the first user message's text ends (once [`PromptText::conversation_len`] is set):
    /// past the prompt limit, the text is cut after that message's separator.
    key_end: usize,
    /// Where the last assistant message written whole into the text starts (its role's first
    /// byte): a turn's history ends there ([`InferenceRequest::history_len`]).
    last_assistant: Option<usize>,
    home_chars: usize,
    conversation_len: Option<usize>,
    /// Where the message the scanner opened last starts in `text` ([`scan::ChatSink::open`]).
    opened: usize,
}

impl PromptText {
    fn new(limit: usize, home_chars: usize, body_len: usize) -> Self {
        PromptText {
            text: String::with_capacity(limit.min(body_len)),
            len: 0,
            base_limit: limit,
            cut_at: limit,
            keyed: false,
            key_end: 0,
            last_assistant: None,
            home_chars,
            conversation_len: None,
            opened: 0,
        }
    }

    /// A conversational request's text ([`PromptText::keyed`]).
    fn keyed(mut self) -> Self {
        self.keyed = true;
        self.cut_at = self.base_limit.max(KEY_TEXT_MAX);
        self
    }

    /// The first user message ends at `key_end` in the text: the conversation key is whole, and
    /// the text is cut at the prompt limit from now on, or right after that message.
    #[inline]
    fn key_ends(&mut self, key_len: usize) {
        self.conversation_len = Some(key_len);
        self.key_end = self.text.len();
        // The message's item separator too, which every path writes after it.
        self.cut_at = self.base_limit.max(self.key_end + 1);
    }

    /// Where the text is cut. A conversation's text is not cut before its key is whole (the
    /// text before the first user message and `home_chars` of it, however long: an agent's
    /// rules and tool descriptions run to tens of KB, and with the key cut every conversation
    /// with that system prompt had the same one, an audit's 40 conversations on 2 of 8 pods);
    /// at most [`KEY_TEXT_MAX`], where a system prompt longer still merges conversations again.
    /// Then at the prompt limit, or at the end of the key's message when that is past it. The
    /// anchors hash at most `max_blocks` of it either way.
    #[inline(always)]
    fn limit(&self) -> usize {
        self.cut_at
    }

    /// Role, separator and content of one message; the first user message fixes the
    /// conversation key's extent.
    fn message(&mut self, role: Option<&str>, content: impl FnOnce(&mut Self)) {
        let at = self.text.len();
        if let Some(r) = role {
            self.push(r);
        }
        self.sep(FIELD_SEP);
        if role == Some(ASSISTANT) && self.text.len() == at + ASSISTANT.len() + 1 {
            self.last_assistant = Some(at);
        }
        let start = self.text.len();
        content(self);
        if self.conversation_len.is_none() && role == Some("user") {
            self.key_ends(self.text.len().min(start + self.home_chars));
        }
    }

    #[inline]
    fn push(&mut self, s: &str) {
        self.len += s.len();
        let room = self.limit().saturating_sub(self.text.len());
        if s.len() <= room {
            append(&mut self.text, s);
        } else if room > 0 {
            let mut cut = room;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            append(&mut self.text, &s[..cut]);
        }
    }

    /// A content part other than text, raw: its JSON goes into the text (different images give
    /// different text), and counts for its bytes, or for [`MEDIA_PART_TOKENS`] when it carries
    /// inline media.
    fn push_part(&mut self, raw: &str) {
        let before = self.len;
        self.push(raw);
        if carries_media(raw) {
            self.len = before + raw.len().min(MEDIA_PART_TOKENS * 4);
        }
    }

    /// Prompt the model reads that the text leaves out: a request's `tools`, which the chat
    /// template writes into the prompt (tens of KB for an agent's tool set), count toward its
    /// size; they are not hashed (where a template puts them differs).
    fn unhashed(&mut self, raw: Option<&str>) {
        self.len += raw.map_or(0, str::len);
    }

    /// One separator (ASCII, so one byte).
    #[inline]
    fn sep(&mut self, c: char) {
        self.len += 1;
        if self.text.len() < self.limit() {
            push_sep(&mut self.text, c);
        }
    }

    /// Chat `messages`: role and content of each message, in order.
    fn messages(&mut self, raw: Option<&RawValue>) {
        let Some(raw) = raw else { return };
        let Ok(messages) = serde_json::from_str::<Vec<Message<'_>>>(raw.get()) else {
            // Not the documented shape: still hash its raw text, so equal bodies stick together.
            self.push(raw.get());
            return;
        };
        self.message_list(&messages);
    }

    /// The parsed request, with this prompt text.
    fn finish(self, (model, model_span): ModelField<'_>, stream: bool) -> InferenceRequest<'_> {
        InferenceRequest {
            model,
            model_span,
            stream,
            prompt_len: self.len,
            conversation_len: self.conversation_len,
            last_assistant: self.last_assistant,
            prompt: self.text,
            previous_response: None,
            sequences: 1,
        }
    }

    /// A Messages body's `system`, read as a leading system message: written now when nothing
    /// is in the text yet, else (the messages written as they were read, all under the limit)
    /// put in front of them, the conversation's extent moved by as much. `room`: a bound on its
    /// text (the body's length).
    fn system_first(&mut self, system: &scan::Content<'_>, room: usize) {
        let write = |p: &mut PromptText| {
            p.message(Some("system"), |p| p.scanned_content(system));
            p.sep(ITEM_SEP);
        };
        if self.len == 0 {
            write(self);
            return;
        }
        let mut front = PromptText::new(self.base_limit, self.home_chars, room);
        if self.keyed {
            front = front.keyed();
        }
        write(&mut front);
        self.text.insert_str(0, &front.text);
        self.len += front.len;
        self.conversation_len = self.conversation_len.map(|n| n + front.text.len());
        self.key_end += front.text.len();
        if self.conversation_len.is_some() {
            self.cut_at = self.base_limit.max(self.key_end + 1);
        }
        self.last_assistant = self.last_assistant.map(|a| a + front.text.len());
    }

    /// Messages read by the scanner: contents already unescaped, `tool_calls` raw.
    fn scanned(&mut self, messages: &[scan::ChatMessage<'_>]) {
        for m in messages {
            self.scanned_message(m);
        }
    }

    /// One message read by the scanner. A chat body's messages come here one by one as the
    /// scanner reads them (`scan::chat_each`), with no list in between.
    ///
    /// In the usual case, a string content that fits under the limit with its role and
    /// separators (counted at its token's length, which an escaped content's text is under), the
    /// pieces are appended with no per-piece limit check, the content decoded straight into the
    /// text; otherwise [`PromptText::scanned_general`]. The same text and length either way.
    #[inline(always)]
    fn scanned_message(&mut self, m: &scan::ChatMessage<'_>) {
        let content = match &m.content {
            Some(scan::Content::Text(t)) => *t,
            Some(scan::Content::Parts(_)) => return self.scanned_general(m),
            None => scan::Text::EMPTY,
        };
        let role = m.role.unwrap_or_default();
        let calls = m.tool_calls.unwrap_or_default();
        // Role, field separator, content, tool calls, item separator.
        let most = role.len() + 1 + content.max_len() + calls.len() + 1;
        if self.text.len().saturating_add(most) > self.limit() {
            return self.scanned_general(m);
        }
        self.text.reserve(most);
        let before = self.text.len();
        append(&mut self.text, role);
        push_sep(&mut self.text, FIELD_SEP);
        if role == ASSISTANT {
            self.last_assistant = Some(before);
        }
        let start = self.text.len();
        content.append_to(&mut self.text);
        append(&mut self.text, calls);
        if self.conversation_len.is_none() && m.role == Some("user") {
            self.key_ends(self.text.len().min(start + self.home_chars));
        }
        push_sep(&mut self.text, ITEM_SEP);
        self.len += self.text.len() - before;
    }

    /// A text read by the scanner: decoded straight into the prompt text when it fits at its
    /// token's length, else through [`PromptText::push`], which cuts it at the limit.
    fn push_text(&mut self, t: scan::Text<'_>) {
        if t.max_len() <= self.limit().saturating_sub(self.text.len()) {
            let before = self.text.len();
            t.append_to(&mut self.text);
            self.len += self.text.len() - before;
        } else {
            self.push(&t.decoded());
        }
    }

    /// [`PromptText::scanned_message`] piece by piece, each cut at the limit.
    fn scanned_general(&mut self, m: &scan::ChatMessage<'_>) {
        self.message(m.role, |p| {
            if let Some(c) = &m.content {
                p.scanned_content(c);
            }
            if let Some(calls) = m.tool_calls {
                p.push(calls);
            }
        });
        self.sep(ITEM_SEP);
    }

    /// A content read by the scanner, as [`PromptText::content`] reads it.
    fn scanned_content(&mut self, content: &scan::Content<'_>) {
        match content {
            scan::Content::Text(t) => self.push_text(*t),
            scan::Content::Parts(parts) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        self.sep(PART_SEP);
                    }
                    match part {
                        scan::Part::Text(t) => self.push_text(*t),
                        scan::Part::Raw(raw) => self.push_part(raw),
                    }
                }
            }
        }
    }

    fn message_list(&mut self, messages: &[Message<'_>]) {
        for m in messages {
            self.message(m.role.as_deref(), |p| {
                if let Some(content) = m.content {
                    p.content(content);
                }
                if let Some(calls) = m.tool_calls {
                    p.push(calls.get());
                }
            });
            self.sep(ITEM_SEP);
        }
    }

    /// A content value: a string, or an array of parts whose `text` is taken (other parts, such
    /// as images, contribute their raw JSON so different images give different text), joined by
    /// [`PART_SEP`].
    fn content(&mut self, raw: &RawValue) {
        let text = raw.get();
        if text.starts_with('"') {
            if let Some(s) = json_str(text) {
                self.push(&s);
            }
        } else if text.starts_with('[') {
            match serde_json::from_str::<Vec<&RawValue>>(text) {
                Ok(parts) => {
                    for (i, part) in parts.iter().enumerate() {
                        if i > 0 {
                            self.sep(PART_SEP);
                        }
                        match serde_json::from_str::<Part<'_>>(part.get()) {
                            Ok(Part { text: Some(t) }) => self.push(&t),
                            _ => self.push_part(part.get()),
                        }
                    }
                }
                Err(_) => self.push(text),
            }
        } else if text != "null" {
            self.push(text);
        }
    }

    /// A prompt/input value: a string, an array of strings, or anything else as raw JSON
    /// (token-id arrays, Responses API items).
    ///
    /// Returns the prompts the value holds as a completions `prompt`: a list of strings (or of
    /// token-id lists) is one prompt each, which vLLM runs as a request each; anything else is
    /// one.
    fn value(&mut self, raw: Option<&RawValue>) -> u32 {
        let Some(raw) = raw else { return 1 };
        let text = raw.get();
        if text.starts_with('"') {
            self.content(raw);
            self.sep(ITEM_SEP);
        } else if text.starts_with('[') {
            match serde_json::from_str::<Vec<&RawValue>>(text) {
                Ok(items) => {
                    // A list of numbers is one prompt of token ids.
                    let prompts = match items.first() {
                        Some(first)
                            if !first
                                .get()
                                .starts_with(|c: char| c == '-' || c.is_ascii_digit()) =>
                        {
                            u32::try_from(items.len()).unwrap_or(u32::MAX)
                        }
                        _ => 1,
                    };
                    for item in items {
                        if item.get().starts_with('"') {
                            self.content(item);
                        } else if let Ok(m) = serde_json::from_str::<Message<'_>>(item.get()) {
                            // Responses API message items: role + content like chat.
                            self.message(m.role.as_deref(), |p| match m.content {
                                Some(c) => p.content(c),
                                None => p.push(item.get()),
                            });
                        } else {
                            self.push(item.get());
                        }
                        self.sep(ITEM_SEP);
                    }
                    return prompts;
                }
                Err(_) => self.push(text),
            }
        } else if text != "null" {
            self.push(text);
            self.sep(ITEM_SEP);
        }
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chat(body: &str) -> InferenceRequest<'_> {
        parse(body.as_bytes(), Endpoint::Chat, 1 << 20, 1024).unwrap()
    }

    fn messages(body: &str) -> InferenceRequest<'_> {
        parse(body.as_bytes(), Endpoint::Messages, 1 << 20, 1024).unwrap()
    }

    #[test]
    fn a_responses_stream_has_its_first_output_after_its_preamble() {
        let created = "event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"text\":{\"format\":{\"type\":\"text\"}}},\"type\":\"response.created\"}\n\n";
        let progress =
            "event: response.in_progress\ndata: {\"type\": \"response.in_progress\"}\n\n";
        let delta = "event: response.output_text.delta\ndata: {\"delta\":\"\\\"response.created\\\"\",\"type\":\"response.output_text.delta\"}\n\n";
        // Whole events, one chunk each: only the delta is output (its text quoting a preamble
        // event's name, escaped, does not count).
        let mut f = FirstOutput::default();
        assert!(!f.push(created.as_bytes()) && !f.push(progress.as_bytes()));
        assert!(!f.push(b": keep-alive\n\n"));
        assert!(f.push(delta.as_bytes()));
        // The same bytes a byte at a time, and with CRLF line ends, and data lines only.
        for text in [
            format!("{created}{progress}{delta}"),
            format!("{created}{progress}{delta}").replace('\n', "\r\n"),
            format!("{created}{progress}{delta}").replace("event: ", "x-event: "),
        ] {
            let mut f = FirstOutput::default();
            let at = text.bytes().position(|b| f.push(&[b]));
            assert!(
                at.is_some_and(|i| i >= created.len() + progress.len()),
                "{text:?}: {at:?}"
            );
        }
        // An error ends the preamble too; so does reading past the limit.
        let mut f = FirstOutput::default();
        assert!(f.push(b"data: {\"type\":\"error\",\"message\":\"boom\"}\n\n"));
        let mut f = FirstOutput::default();
        assert!(!f.push(created.as_bytes()));
        assert!(f.push(&vec![b'x'; FIRST_OUTPUT_MAX]));
    }

    #[test]
    fn a_responses_streams_long_preamble_is_no_output() {
        // vLLM's response.created and response.in_progress each echo the request's
        // instructions: an agent's 40 KB of them put 80 KB of preamble before the first output.
        let echo = "x".repeat(40 * 1024);
        let created = format!(
            "event: response.created\ndata: {{\"response\":{{\"instructions\":\"{echo}\"}},\"type\":\"response.created\"}}\n\n"
        );
        let progress = created.replace("response.created", "response.in_progress");
        let delta = "event: response.output_text.delta\ndata: {\"delta\":\"hi\",\"type\":\"response.output_text.delta\"}\n\n";
        for text in [
            format!("{created}{progress}{delta}"),
            format!("{created}{progress}{delta}").replace('\n', "\r\n"),
        ] {
            // In chunks of 16 KB (Envoy's), and of 1, 2 and 3 bytes: the end of an event
            // skipped may straddle two.
            for size in [16 * 1024, 1, 2, 3] {
                let mut f = FirstOutput::default();
                let at = text
                    .as_bytes()
                    .chunks(size)
                    .position(|c| f.push(c))
                    .map(|i| (i + 1) * size);
                let preamble = text.len() - delta.len() - if text.contains('\r') { 4 } else { 0 };
                assert!(
                    at.is_some_and(|end| end > preamble),
                    "{size}: {at:?} of {}",
                    text.len()
                );
                assert!(
                    f.event.len() <= FIRST_OUTPUT_MAX,
                    "{size}: kept {}",
                    f.event.len()
                );
            }
        }
        // Without `event:` lines, a preamble event is read whole (up to the limit).
        let mut f = FirstOutput::default();
        assert!(!f.push(created.replace("event: response.created\n", "").as_bytes()));
        assert!(f.push(delta.as_bytes()));
    }

    #[test]
    fn a_response_id_is_learned_for_the_pod_that_answered_it_well() {
        let a = crate::prefix::pod_key("10.0.0.1:8000");
        let b = crate::prefix::pod_key("10.0.0.2:8000");
        let ok = Some(&b"200"[..]);
        // The pick, unless Envoy says another pod answered (a retry, or its own balancer).
        assert_eq!(response_learner(ok, None, None, a), Some(a));
        assert_eq!(
            response_learner(ok, None, Some(b"10.0.0.2:8000"), a),
            Some(b)
        );
        assert_eq!(
            response_learner(ok, None, Some(b"10.0.0.2:8000"), 0),
            Some(b)
        );
        assert_eq!(response_learner(ok, None, None, 0), None);
        assert_eq!(
            response_learner(Some(b"201"), Some(b"identity"), None, a),
            Some(a)
        );
        // Not from a failure, nor from bytes that are not the body as written.
        for status in [&b"500"[..], b"404", b"302", b"2", b"2000", b""] {
            assert_eq!(response_learner(Some(status), None, None, a), None);
        }
        assert_eq!(response_learner(None, None, None, a), None);
        assert_eq!(response_learner(ok, Some(b"gzip"), None, a), None);
        assert_eq!(
            response_learner(ok, Some(b"br"), Some(b"10.0.0.2:8000"), a),
            None
        );
    }

    #[test]
    fn a_messages_body_reads_as_the_same_conversation_in_chat() {
        let system_then = |system: &str, rest: &str| {
            format!(
                r#"{{"model": "m", "messages": [{{"role": "system", "content": {system}}}, {rest}]}}"#
            )
        };
        let turns = r#"{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}"#;
        // `system` as a string, and as text blocks (with Anthropic's cache_control).
        let cases = [
            (
                format!(r#"{{"model": "m", "max_tokens": 8, "stream": true, "system": "S", "messages": [{turns}]}}"#),
                system_then(r#""S""#, turns),
            ),
            (
                format!(r#"{{"model": "m", "system": [{{"type": "text", "text": "S", "cache_control": {{"type": "ephemeral"}}}}], "messages": [{turns}]}}"#),
                system_then(r#"[{"type": "text", "text": "S"}]"#, turns),
            ),
            // Content blocks in the messages.
            (
                r#"{"model": "m", "system": "S", "messages": [{"role": "user", "content": [{"type": "text", "text": "U"}]}]}"#.to_string(),
                system_then(r#""S""#, r#"{"role": "user", "content": [{"type": "text", "text": "U"}]}"#),
            ),
            // No system prompt, or a null one: the messages alone.
            (
                format!(r#"{{"model": "m", "messages": [{turns}]}}"#),
                format!(r#"{{"model": "m", "messages": [{turns}]}}"#),
            ),
            (
                format!(r#"{{"model": "m", "system": null, "messages": [{turns}]}}"#),
                format!(r#"{{"model": "m", "messages": [{turns}]}}"#),
            ),
        ];
        for (m, c) in &cases {
            let (m, c) = (messages(m), chat(c));
            assert_eq!(m.model.as_deref(), Some("m"));
            assert_eq!(m.prompt, c.prompt);
            assert_eq!(m.prompt_len, c.prompt_len);
            assert_eq!(m.conversation_len, c.conversation_len);
            assert!(m.conversation_len.is_some());
        }
        assert!(messages(&cases[0].0).stream);
        assert!(!messages(&cases[1].0).stream);
        // The system prompt is part of the conversation's key.
        let other = cases[0].0.replace(r#""system": "S""#, r#""system": "T""#);
        assert_ne!(messages(&other).prompt, messages(&cases[0].0).prompt);
    }

    #[test]
    fn a_messages_body_is_validated_like_any_other() {
        let err = |b: &str| {
            parse(b.as_bytes(), Endpoint::Messages, 1 << 20, 1024)
                .map(|_| ())
                .unwrap_err()
        };
        assert_eq!(
            err(r#"{"model": "m", "messages": [}"#).code.as_deref(),
            Some("invalid_json")
        );
        assert_eq!(err(r#"[1]"#).code.as_deref(), Some("invalid_json"));
        let e = err(r#"{"model": 7, "messages": []}"#);
        assert_eq!((e.status, e.param), (400, Some("model")));
        assert_eq!(
            err(r#"{"model": "a", "model": "b", "messages": []}"#).status,
            400
        );
        // OpenAI's prompt fields mean nothing on this path: skipped, not read.
        let r = messages(
            r#"{"model": "m", "prompt": "P", "input": "I", "messages": [{"role": "user", "content": "U"}]}"#,
        );
        assert!(
            !r.prompt.contains('P') && !r.prompt.contains('I'),
            "{:?}",
            r.prompt
        );
        // A span for the alias rewrite, as on the other paths.
        let body = r#"{"system": "S", "model": "llama"}"#;
        let r = messages(body);
        assert_eq!(&body[r.model_span.unwrap()], r#""llama""#);
    }

    #[test]
    fn extracts_model_stream_and_span() {
        let body = r#"{ "stream": true, "model" : "llama-3", "messages": [] }"#;
        let r = chat(body);
        assert_eq!(r.model.as_deref(), Some("llama-3"));
        assert!(r.stream);
        let span = r.model_span.unwrap();
        assert_eq!(&body[span], "\"llama-3\"");
    }

    #[test]
    fn model_with_escapes_is_unescaped() {
        let r = chat(r#"{"model":"a\/b\u0041"}"#);
        assert_eq!(r.model.as_deref(), Some("a/bA"));
    }

    #[test]
    fn missing_or_null_model_is_none() {
        assert_eq!(chat(r#"{"messages":[]}"#).model, None);
        assert_eq!(chat(r#"{"model":null}"#).model, None);
    }

    #[test]
    fn non_string_model_is_a_typed_error() {
        let err = parse(br#"{"model": 42}"#, Endpoint::Chat, 100, 1024).unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param, Some("model"));
    }

    #[test]
    fn invalid_json_and_non_objects_are_400() {
        for body in [
            &b"{"[..],
            b"[1,2]",
            b"",
            b"\"model\"",
            b"{\"model\":\"a\"} trailing",
            b"\xff\xfe",
        ] {
            let err = parse(body, Endpoint::Chat, 100, 1024).unwrap_err();
            assert_eq!(err.status, 400, "{body:?}");
            assert_eq!(err.code.as_deref(), Some("invalid_json"));
        }
    }

    #[test]
    fn duplicate_model_key_is_rejected() {
        let err = parse(br#"{"model":"a","model":"b"}"#, Endpoint::Chat, 100, 1024).unwrap_err();
        assert_eq!(err.status, 400);
    }

    #[test]
    fn chat_prompt_is_independent_of_json_formatting() {
        let a = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
        );
        let b = chat(
            r#"{ "messages" : [ { "content" : "Be brief.", "role" : "system" },
                 { "role": "user", "content": [ {"type":"text", "text":"Hi"} ] } ], "model":"m" }"#,
        );
        // Array-of-parts adds a part separator; the leading system message is identical.
        assert!(a
            .prompt
            .starts_with("system\u{1f}Be brief.\u{1e}user\u{1f}Hi"));
        assert!(b
            .prompt
            .starts_with("system\u{1f}Be brief.\u{1e}user\u{1f}Hi"));
    }

    #[test]
    fn conversation_key_covers_system_prompt_and_first_user_message() {
        let t1 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Plan my trip to Lisbon."}]}"#,
        );
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Plan my trip to Lisbon."},
            {"role":"assistant","content":"Day 1: Alfama."},{"role":"user","content":"And day 2?"}]}"#,
        );
        let other = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Fix my SQL."}]}"#,
        );
        let k1 = &t1.prompt[..t1.conversation_len.unwrap()];
        let k2 = &t2.prompt[..t2.conversation_len.unwrap()];
        let ko = &other.prompt[..other.conversation_len.unwrap()];
        assert_eq!(k1, k2);
        assert!(k1.ends_with("Plan my trip to Lisbon."));
        assert_ne!(k1, ko);
        // Long first messages are capped at home_chars.
        let long = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
            "z".repeat(5000)
        );
        let r = parse(long.as_bytes(), Endpoint::Chat, 1 << 20, 100).unwrap();
        assert_eq!(r.conversation_len, Some("user\u{1f}".len() + 100));
        // Completions have no structure.
        let c = parse(
            br#"{"model":"m","prompt":"abc"}"#,
            Endpoint::Completions,
            100,
            100,
        )
        .unwrap();
        assert_eq!(c.conversation_len, None);
    }

    /// A system prompt longer than the prompt limit used to leave the first user message past
    /// the cut: every conversation with it had the same key (the audit's 17 and 40 KB system
    /// prompts). The key now holds the whole system prompt and the first user message, in every
    /// shape that has one: the text is not cut before the key's end, and is cut there (what
    /// follows it is left out), in one read of the body.
    #[test]
    fn a_system_prompt_past_the_limit_keeps_the_first_user_message_in_the_key() {
        let system = "Rule: check the repository state before editing. ".repeat(400); // 20 KB
        let chat_body = |first: &str, more: &str| {
            format!(
                r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{first}"}}{more}]}}"#
            )
        };
        let messages_body = |first: &str| {
            format!(
                r#"{{"model":"m","max_tokens":9,"system":"{system}","messages":[{{"role":"user","content":"{first}"}}]}}"#
            )
        };
        let responses_body = |first: &str| {
            format!(
                r#"{{"model":"m","input":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{first}"}}]}}"#
            )
        };
        let later = r#",{"role":"assistant","content":"Done."},{"role":"user","content":"Next."}"#;
        let limit = 16_384;
        let key = |body: &str, endpoint| {
            let r = parse(body.as_bytes(), endpoint, limit, 1024).unwrap();
            let n = r.conversation_len.unwrap();
            // Cut right after the key's message (20 KB of system prompt, a few bytes of it).
            assert!(
                r.prompt.len() > limit && r.prompt.len() <= n + 2,
                "{endpoint:?}"
            );
            // The same key as the whole prompt text gives.
            let whole = parse(body.as_bytes(), endpoint, 1 << 20, 1024).unwrap();
            let n = whole.conversation_len.unwrap();
            assert_eq!(
                r.conversation_key_text(),
                Some(&whole.prompt.as_bytes()[..n])
            );
            r.conversation_key_text().unwrap().to_vec()
        };
        let shapes = [
            (
                chat_body("Fix bug 1.", ""),
                chat_body("Fix bug 2.", ""),
                Endpoint::Chat,
            ),
            (
                messages_body("Fix bug 1."),
                messages_body("Fix bug 2."),
                Endpoint::Messages,
            ),
            (
                responses_body("Fix bug 1."),
                responses_body("Fix bug 2."),
                Endpoint::Responses,
            ),
        ];
        for (one, two, endpoint) in shapes {
            let a = key(&one, endpoint);
            assert!(a.ends_with(b"Fix bug 1."), "{endpoint:?}");
            assert_ne!(a, key(&two, endpoint), "{endpoint:?}");
        }
        assert_eq!(
            key(&chat_body("Fix bug 1.", later), Endpoint::Chat),
            key(&chat_body("Fix bug 1.", ""), Endpoint::Chat)
        );
        // A key within the limit, as before: the text goes on to the limit.
        let short = chat_body("Fix bug 1.", later).replace(&system, "Be brief.");
        let r = parse(short.as_bytes(), Endpoint::Chat, limit, 1024).unwrap();
        assert!(r.conversation_key_text().unwrap().ends_with(b"Fix bug 1."));
        assert!(r.prompt.ends_with("Next.\u{1e}"), "{:?}", r.prompt);
        // Past KEY_TEXT_MAX of system prompt, the text is cut there, key or no key.
        let huge = chat_body("Fix bug 1.", "").replace(&system, &system.repeat(14));
        let r = parse(huge.as_bytes(), Endpoint::Chat, limit, 1024).unwrap();
        assert!(r.prompt.len() <= KEY_TEXT_MAX + 1, "and the item separator");
        assert_eq!(r.conversation_len, Some(KEY_TEXT_MAX));
    }

    /// [`InferenceRequest::history_len`] by a search of the text: the start of the last
    /// assistant role written whole after the conversation key.
    fn oracle_history(r: &InferenceRequest<'_>) -> Option<usize> {
        let marker = "\u{1e}assistant\u{1f}";
        let text = &r.prompt;
        let key = (r.conversation_len?..=text.len()).find(|&k| text.is_char_boundary(k))?;
        Some(key + text.get(key..)?.rfind(marker)? + 1)
    }

    /// A turn's history is the text before its last assistant message: the previous turn's
    /// whole prompt text. A scripted assistant greeting before the first user message is not
    /// (every conversation opening alike has it).
    #[test]
    fn the_history_is_the_previous_turns_text() {
        let turn1 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}]}"#,
        );
        let turn2 = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},
            {"role":"assistant","content":"Hello!"},{"role":"user","content":"Order 7?"}]}"#,
        );
        let tools = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},
            {"role":"tool","content":"42"}]}"#,
        );
        assert_eq!(turn1.history_len(), None);
        assert_eq!(turn2.history_len(), Some(turn1.prompt.len()));
        assert_eq!(&turn2.prompt[..turn1.prompt.len()], turn1.prompt);
        assert_eq!(tools.history_len(), Some(turn1.prompt.len()));
        let greeting = chat(
            r#"{"model":"m","messages":[{"role":"assistant","content":"How can I help?"},{"role":"user","content":"Hi"}]}"#,
        );
        assert_eq!(greeting.history_len(), None);
    }

    #[test]
    fn later_turns_extend_earlier_turns() {
        let t1 =
            chat(r#"{"model":"m","messages":[{"role":"user","content":"Tell me about Envoy."}]}"#);
        let t2 = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"Tell me about Envoy."},
            {"role":"assistant","content":"Envoy is a proxy."},{"role":"user","content":"More."}]}"#,
        );
        assert!(t2.prompt.starts_with(&t1.prompt));
    }

    #[test]
    fn completions_embeddings_and_responses_prompts() {
        let c = parse(
            br#"{"model":"m","prompt":"Once upon"}"#,
            Endpoint::Completions,
            100,
            1024,
        )
        .unwrap();
        assert!(c.prompt.starts_with("Once upon"));
        let c = parse(
            br#"{"model":"m","prompt":["a","b"]}"#,
            Endpoint::Completions,
            100,
            1024,
        )
        .unwrap();
        assert!(c.prompt.contains('a') && c.prompt.contains('b'));
        let c = parse(
            br#"{"model":"m","prompt":[1,2,3]}"#,
            Endpoint::Completions,
            100,
            1024,
        )
        .unwrap();
        assert!(c.prompt.starts_with("1\u{1e}2\u{1e}3"));
        let e = parse(
            br#"{"model":"m","input":"embed me"}"#,
            Endpoint::Embeddings,
            100,
            1024,
        )
        .unwrap();
        assert!(e.prompt.starts_with("embed me"));
        let r = parse(
            br#"{"model":"m","instructions":"You are terse.","input":[{"role":"user","content":"hi"}]}"#,
            Endpoint::Responses,
            100,
            1024,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            "system\u{1f}You are terse.\u{1e}user\u{1f}hi\u{1e}"
        );
    }

    /// Text parts read as the text an engine joins them into, and a Responses body as the chat
    /// an engine builds from it: the same prompt on the pod, the same text here, so the same
    /// pods (before, a content of one text part and the same content as a string hashed apart,
    /// as did a Responses body's `instructions` and a chat system message).
    #[test]
    fn a_content_of_text_parts_reads_as_the_string_the_engine_joins_them_into() {
        // Every tier that takes the body gives the same text and length; returns them.
        let chat = |messages: &str| {
            let body = format!(r#"{{"model":"m","messages":[{messages}]}}"#);
            let b = body.as_bytes();
            let text = || PromptText::new(4096, 16, b.len()).keyed();
            let summary = |r: Result<InferenceRequest<'_>, ApiError>| {
                let r = r.expect("parsed");
                (r.prompt, r.prompt_len, r.conversation_len)
            };
            let general = summary(parse_general(b, Endpoint::Chat, text()));
            if let Some(r) = parse_chat_scan(b, text()) {
                assert_eq!(summary(r), general, "scanner: {body}");
            }
            if let Some(r) = parse_chat_serde(b, text()) {
                assert_eq!(summary(r), general, "serde tier: {body}");
            }
            general
        };
        let string =
            chat(r#"{"role":"system","content":"Be brief."},{"role":"user","content":"A\nB"}"#);
        for parts in [
            // The scanner's plain form, compact and spaced.
            r#"{"role":"system","content":[{"type":"text","text":"Be brief."}]},{"role":"user","content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]}"#,
            r#"{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}"#,
            // Parts with other fields (the scanner hands the message over).
            r#"{"role":"system","content":[{"type":"text","text":"Be brief.","cache_control":{"type":"ephemeral"}}]},{"role":"user","content":[{"text":"A","type":"text"},{"type":"text","text":"B"}]}"#,
            // One as a string, the other as parts.
            r#"{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]}"#,
        ] {
            assert_eq!(chat(parts), string, "{parts}");
        }
        // Other parts stay apart from the text around them.
        let image = chat(
            r#"{"role":"user","content":[{"type":"text","text":"A"},{"type":"image_url","image_url":{"url":"u"}},{"type":"text","text":"B"}]}"#,
        );
        assert_eq!(
            image.0,
            "user\u{1f}A\n{\"type\":\"image_url\",\"image_url\":{\"url\":\"u\"}}\nB\u{1e}"
        );
        // An empty list reads as an empty string.
        assert_eq!(
            chat(r#"{"role":"user","content":[]}"#),
            chat(r#"{"role":"user","content":""}"#)
        );

        // The Messages API and the Responses API read as chat with the same messages.
        let of = |body: &str, endpoint| {
            let r = parse(body.as_bytes(), endpoint, 4096, 16).unwrap();
            (r.prompt, r.prompt_len, r.conversation_len)
        };
        for (body, endpoint) in [
            (
                r#"{"model":"m","max_tokens":9,"system":[{"type":"text","text":"Be brief."}],"messages":[{"role":"user","content":[{"type":"text","text":"A"},{"type":"text","text":"B"}]}]}"#,
                Endpoint::Messages,
            ),
            (
                r#"{"model":"m","instructions":"Be brief.","input":"A\nB"}"#,
                Endpoint::Responses,
            ),
            (
                r#"{"model":"m","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"A"},{"type":"input_text","text":"B"}]}]}"#,
                Endpoint::Responses,
            ),
            (
                r#"{"model":"m","input":[{"role":"system","content":"Be brief."},{"role":"user","content":"A\nB"}]}"#,
                Endpoint::Responses,
            ),
        ] {
            assert_eq!(of(body, endpoint), string, "{body}");
        }
        // Without instructions, a string input is the one user message.
        assert_eq!(
            of(
                r#"{"model":"m","input":"A","instructions":null}"#,
                Endpoint::Responses
            ),
            chat(r#"{"role":"user","content":"A"}"#)
        );
    }

    #[test]
    fn prompt_is_truncated_on_a_char_boundary_but_length_is_full() {
        let body = format!(r#"{{"model":"m","prompt":"{}"}}"#, "é".repeat(100));
        let r = parse(body.as_bytes(), Endpoint::Completions, 11, 1024).unwrap();
        assert!(r.prompt.len() <= 11);
        assert_eq!(r.prompt_len, 200 + 1); // 100 two-byte chars + the item separator
        assert_eq!(r.estimated_prompt_tokens(), 51);
    }

    #[test]
    fn content_parts_are_scanned_and_read_as_the_general_path_reads_them() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":[{"type":"text","text":"be \"brief\""}]},
            {"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:x"}},{"text":null}]},
            {"role":"assistant","content":[]}]}"#;
        let summary = |r: Result<InferenceRequest<'_>, ApiError>| {
            r.map(|r| (r.prompt, r.prompt_len, r.conversation_len))
                .map_err(|e| e.status)
        };
        let general = summary(parse_general(
            body,
            Endpoint::Chat,
            PromptText::new(1 << 16, 16, body.len()),
        ));
        let scanned = parse_chat_scan(body, PromptText::new(1 << 16, 16, body.len()))
            .expect("the scanner reads content parts");
        assert_eq!(summary(scanned), general);
        let prompt = general.unwrap().0;
        assert!(prompt.contains("be \"brief\"") && prompt.contains(r#"{"url":"data:x"}"#));
    }

    #[test]
    fn an_inline_image_counts_as_media_tokens_not_as_its_base64() {
        let image = "A".repeat(400_000);
        let chat = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"what is this?"}},{{"type":"image_url","image_url":{{"url":"data:image/jpeg;base64,{image}"}}}}]}}]}}"#
        );
        let without = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is this?"}]}]}"#;
        let tokens = |body: &str, ep| {
            parse(body.as_bytes(), ep, 4096, 1024)
                .unwrap()
                .estimated_prompt_tokens()
        };
        let base = tokens(without, Endpoint::Chat) as usize;
        // The part's separator aside, the image counts MEDIA_PART_TOKENS, not 100,000.
        let with = tokens(&chat, Endpoint::Chat) as usize;
        assert!(
            (base + MEDIA_PART_TOKENS..=base + MEDIA_PART_TOKENS + 1).contains(&with),
            "{base} {with}"
        );
        // Both readers agree (the scanner's and serde's).
        let general = parse_general(
            chat.as_bytes(),
            Endpoint::Chat,
            PromptText::new(4096, 16, chat.len()),
        )
        .map(|r| r.prompt_len)
        .map_err(|e| e.status);
        let scanned = parse_chat_scan(chat.as_bytes(), PromptText::new(4096, 16, chat.len()))
            .expect("scanned")
            .map(|r| r.prompt_len)
            .map_err(|e| e.status);
        assert_eq!(scanned, general);
        // Anthropic's base64 source, and a Responses input_image, likewise.
        let messages = format!(
            r#"{{"model":"m","max_tokens":9,"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64","media_type":"image/png","data":"{image}"}}}}]}}]}}"#
        );
        assert!(tokens(&messages, Endpoint::Messages) < 2 * MEDIA_PART_TOKENS as u32);
        let responses = format!(
            r#"{{"model":"m","input":[{{"role":"user","content":[{{"type":"input_image","image_url":"data:image/png;base64,{image}"}}]}}]}}"#
        );
        assert!(tokens(&responses, Endpoint::Responses) < 2 * MEDIA_PART_TOKENS as u32);
        // A part without inline media (an image by URL, a tool result) counts for its bytes.
        let url = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}"#;
        assert!(tokens(url, Endpoint::Chat) < 40);
        let result = format!(
            r#"{{"model":"m","max_tokens":9,"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":"{}"}}]}}]}}"#,
            "x".repeat(40_000)
        );
        assert!(tokens(&result, Endpoint::Messages) > 10_000);
    }

    #[test]
    fn tools_count_toward_the_prompt_size_but_not_its_text() {
        let tools = format!(
            r#"[{{"type":"function","function":{{"name":"f","description":"{}","parameters":{{"type":"object"}}}}}}]"#,
            "d".repeat(20_000)
        );
        let chat = |tools: &str| {
            format!(
                r#"{{"model":"m","tools":{tools},"messages":[{{"role":"user","content":"hi"}}]}}"#
            )
        };
        let plain = chat("[]");
        let with = chat(&tools);
        let a = parse(plain.as_bytes(), Endpoint::Chat, 4096, 1024).unwrap();
        let b = parse(with.as_bytes(), Endpoint::Chat, 4096, 1024).unwrap();
        assert_eq!(a.prompt, b.prompt, "the hash reads the messages only");
        assert_eq!(b.prompt_len - a.prompt_len, tools.len() - 2);
        // The scanner, the typed chat parser and the general one agree.
        let lens = [
            parse_chat_scan(with.as_bytes(), PromptText::new(4096, 16, with.len()))
                .expect("scanned"),
            parse_chat_serde(with.as_bytes(), PromptText::new(4096, 16, with.len()))
                .expect("typed"),
            Ok(parse_general(
                with.as_bytes(),
                Endpoint::Chat,
                PromptText::new(4096, 16, with.len()),
            )
            .unwrap()),
        ]
        .map(|r| r.unwrap().prompt_len);
        assert!(lens.iter().all(|&l| l == lens[0]), "{lens:?}");
        // Anthropic's Messages API and the Responses API likewise.
        let messages = format!(
            r#"{{"model":"m","max_tokens":9,"tools":{tools},"messages":[{{"role":"user","content":"hi"}}]}}"#
        );
        let m = parse(messages.as_bytes(), Endpoint::Messages, 4096, 1024).unwrap();
        let general = parse_messages(
            messages.as_bytes(),
            PromptText::new(4096, 16, messages.len()),
        )
        .unwrap();
        assert_eq!(m.prompt_len, general.prompt_len);
        assert!(m.prompt_len > tools.len());
        let responses = format!(r#"{{"model":"m","tools":{tools},"input":"hi"}}"#);
        assert!(
            parse(responses.as_bytes(), Endpoint::Responses, 4096, 1024)
                .unwrap()
                .prompt_len
                > tools.len()
        );
    }

    #[test]
    fn escaped_content_is_unescaped_and_plain_content_borrowed() {
        let r = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"line\nnext \"q\" \u00e9"},{"role":"user","content":"plain"}]}"#,
        );
        assert_eq!(
            r.prompt,
            "user\u{1f}line\nnext \"q\" é\u{1e}user\u{1f}plain\u{1e}"
        );
        assert_eq!(json_str(r#""a\\b""#).as_deref(), Some("a\\b"));
        assert!(matches!(
            json_str(r#""plain""#),
            Some(Cow::Borrowed("plain"))
        ));
        assert_eq!(json_str("plain"), None);
    }

    #[test]
    fn a_rerank_body_gives_its_model_and_its_length_as_the_prefill() {
        let body = br#"{"model":"bge-reranker","query":"What is a panda?","documents":["hi","a bear"],"top_n":1}"#;
        let r = parse(body, Endpoint::Rerank, 16_384, 1_024).unwrap();
        assert_eq!(r.model.as_deref(), Some("bge-reranker"));
        assert_eq!(&body[r.model_span.clone().unwrap()], br#""bge-reranker""#);
        assert_eq!((r.prompt.as_str(), r.prompt_len), ("", body.len()));
        assert_eq!(r.estimated_prompt_tokens(), body.len().div_ceil(4) as u32);
        assert_eq!(r.conversation_len, None);
        let score = br#"{"model":"m","text_1":"a","text_2":["b","c"]}"#;
        assert_eq!(
            parse(score, Endpoint::Rerank, 64, 64).unwrap().prompt_len,
            score.len()
        );
        let twice = br#"{"model":"a","query":"q","model":"b","documents":[]}"#;
        assert_eq!(
            parse(twice, Endpoint::Rerank, 64, 64).unwrap_err().status,
            400
        );
    }

    #[test]
    fn endpoint_from_path() {
        assert_eq!(Endpoint::from_path("/v1/chat/completions"), Endpoint::Chat);
        assert_eq!(
            Endpoint::from_path("/v1/completions"),
            Endpoint::Completions
        );
        assert_eq!(Endpoint::from_path("/v1/embeddings"), Endpoint::Embeddings);
        assert_eq!(Endpoint::from_path("/v1/responses"), Endpoint::Responses);
        assert_eq!(Endpoint::from_path("/v1/score"), Endpoint::Rerank);
        assert_eq!(Endpoint::from_path("/v2/rerank"), Endpoint::Rerank);
        assert_eq!(
            Endpoint::from_path("/v1/audio/transcriptions"),
            Endpoint::Other
        );
        assert_eq!(Endpoint::from_path("/v1/messages"), Endpoint::Messages);
        assert_eq!(
            Endpoint::from_path("/v1/messages/count_tokens"),
            Endpoint::CountTokens
        );
        assert_eq!(Endpoint::from_path("/rerank"), Endpoint::Rerank);
        assert_eq!(Endpoint::from_path("/score"), Endpoint::Rerank);
        assert_eq!(Endpoint::from_path("/tokenize"), Endpoint::Tokenize);
        assert_eq!(Endpoint::from_path("/detokenize"), Endpoint::Tokenize);
        // Pooling and classification bodies carry `input` (or `messages`), read as embeddings'.
        assert_eq!(Endpoint::from_path("/pooling"), Endpoint::Other);
        assert_eq!(Endpoint::from_path("/v1/classify"), Endpoint::Other);
    }

    #[test]
    fn n_counts_the_sequences_a_request_runs() {
        let chat = |n: &str| {
            format!(r#"{{"model":"m","n":{n},"messages":[{{"role":"user","content":"hi"}}]}}"#)
        };
        let seqs =
            |body: &str, e: Endpoint| parse(body.as_bytes(), e, 1024, 64).map(|r| r.sequences);
        // The scanner's path, then serde's (a content it declines: a number), then the general
        // path (completions).
        assert_eq!(seqs(&chat("16"), Endpoint::Chat), Ok(16));
        let odd = r#"{"model":"m","n":4,"messages":[{"role":"user","content":7}]}"#;
        assert_eq!(seqs(odd, Endpoint::Chat), Ok(4));
        let completion = r#"{"model":"m","prompt":"hi","n":3}"#;
        assert_eq!(seqs(completion, Endpoint::Completions), Ok(3));
        assert_eq!(seqs(completion, Endpoint::Other), Ok(3));
        // Not a field of these APIs: one sequence whatever the body says.
        let embed = r#"{"model":"m","input":"hi","n":3}"#;
        assert_eq!(seqs(embed, Endpoint::Embeddings), Ok(1));
        assert_eq!(
            seqs(r#"{"model":"m","prompt":"hi"}"#, Endpoint::Completions),
            Ok(1)
        );
        // Absent, zero, negative, fractional, a string, null: one. Huge: the cap.
        for n in ["0", "-2", "2.5", "\"4\"", "null", "1e3", "[2]"] {
            assert_eq!(seqs(&chat(n), Endpoint::Chat), Ok(1), "n = {n}");
        }
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        assert_eq!(seqs(body, Endpoint::Chat), Ok(1));
        assert_eq!(seqs(&chat("4000000000"), Endpoint::Chat), Ok(MAX_SEQUENCES));
        assert_eq!(
            seqs(&chat("99999999999"), Endpoint::Chat),
            Ok(MAX_SEQUENCES),
            "past u32"
        );
        // A completions batch: each prompt gets its `n` choices. A list of numbers is one prompt
        // of token ids; a list of such lists is a batch.
        let batch = |prompt: &str, n: &str| {
            let body = format!(r#"{{"model":"m","prompt":{prompt},"n":{n}}}"#);
            seqs(&body, Endpoint::Completions)
        };
        assert_eq!(batch(r#"["a","b","c"]"#, "2"), Ok(6));
        assert_eq!(batch(r#"["a","b","c"]"#, "null"), Ok(3));
        assert_eq!(batch("[1,2,3]", "4"), Ok(4));
        assert_eq!(batch("[[1,2],[3]]", "1"), Ok(2));
        assert_eq!(batch("[]", "1"), Ok(1));
        let many = format!("[{}]", vec![r#""p""#; 300].join(","));
        assert_eq!(batch(&many, "1"), Ok(MAX_SEQUENCES));
        assert_eq!(batch(r#"["a","b"]"#, "200"), Ok(MAX_SEQUENCES));
        let other = r#"{"model":"m","prompt":["a","b"]}"#;
        assert_eq!(seqs(other, Endpoint::Other), Ok(2));
        // An embeddings batch is prefill only, counted by its tokens: one sequence.
        let embed = r#"{"model":"m","input":["a","b","c"]}"#;
        assert_eq!(seqs(embed, Endpoint::Embeddings), Ok(1));
        // Named twice: refused as a duplicated model or stream is.
        let twice = r#"{"model":"m","n":2,"n":3,"messages":[]}"#;
        assert_eq!(seqs(twice, Endpoint::Chat).unwrap_err().status, 400);
    }

    #[test]
    fn a_tokenize_body_gives_its_model_and_no_prompt() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true}"#;
        let r = parse(body, Endpoint::Tokenize, 1024, 64).unwrap();
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(&body[r.model_span.clone().unwrap()], br#""m""#);
        assert_eq!((r.prompt.as_str(), r.prompt_len), ("", 0));
        let ids = br#"{"model":"m","tokens":[128000,9906]}"#;
        assert_eq!(
            parse(ids, Endpoint::Tokenize, 1024, 64)
                .unwrap()
                .model
                .as_deref(),
            Some("m")
        );
        let bad = br#"{"model":7,"prompt":"hi"}"#;
        assert_eq!(
            parse(bad, Endpoint::Tokenize, 1024, 64).unwrap_err().status,
            400
        );
        assert_eq!(
            parse(b"{", Endpoint::Tokenize, 1024, 64)
                .unwrap_err()
                .status,
            400
        );
    }

    #[test]
    fn a_classify_body_reads_its_input_as_the_prompt() {
        let body = br#"{"model":"m","input":["loved it","hated it"]}"#;
        let r = parse(body, Endpoint::Other, 1024, 64).unwrap();
        assert!(r.prompt.starts_with("loved it"), "{:?}", r.prompt);
        assert!(r.prompt.contains("hated it"), "{:?}", r.prompt);
    }

    #[test]
    fn a_responses_turn_names_the_response_it_continues() {
        let body = br#"{"model":"m","previous_response_id":"resp_7","input":"and then?"}"#;
        let r = parse(body, Endpoint::Responses, 1024, 64).unwrap();
        assert_eq!(r.previous_response.as_deref(), Some("resp_7"));
        assert_eq!(r.prompt, "user\u{1f}and then?\u{1e}");
        let escaped = br#"{"model":"m","previous_response_id":"resp_\u0037","input":"x"}"#;
        let r = parse(escaped, Endpoint::Responses, 1024, 64).unwrap();
        assert_eq!(r.previous_response.as_deref(), Some("resp_7"));
        for other in [
            &br#"{"model":"m","input":"x"}"#[..],
            br#"{"model":"m","previous_response_id":null}"#,
            br#"{"model":"m","previous_response_id":7}"#,
        ] {
            assert_eq!(
                parse(other, Endpoint::Responses, 1024, 64)
                    .unwrap()
                    .previous_response,
                None
            );
        }
        // Only the Responses API continues stored responses.
        let chat = br#"{"model":"m","previous_response_id":"resp_7","messages":[]}"#;
        assert_eq!(
            parse(chat, Endpoint::Chat, 1024, 64)
                .unwrap()
                .previous_response,
            None
        );
    }

    #[test]
    fn an_answers_id_is_read_across_the_chunks_it_comes_in() {
        let body = br#"{"id":"resp_split_1","object":"response"}"#;
        for cut in 1..body.len() {
            let mut head = ResponseHead::default();
            let first = head.push(&body[..cut]);
            let id = first.or_else(|| head.push(&body[cut..]));
            assert_eq!(id.as_deref(), Some("resp_split_1"), "cut at {cut}");
        }
        // It reads at most RESPONSE_HEAD_MAX bytes: an id past them is not found.
        let mut head = ResponseHead::default();
        assert_eq!(head.push(&[b' '; RESPONSE_HEAD_MAX]), None);
        assert_eq!(
            (head.room(), head.push(br#"{"id":"resp_late"}"#)),
            (0, None)
        );
    }

    #[test]
    fn a_stored_responses_calls_name_it_in_their_path() {
        for (path, id) in [
            ("/v1/responses/resp_1", Some("resp_1")),
            ("/v1/responses/resp_1/cancel", Some("resp_1")),
            ("/v1/responses/resp_1/input_items", Some("resp_1")),
            ("/v1/responses/resp_1/other", None),
            ("/v1/responses/", None),
            ("/v1/responses", None),
            ("/v1/chat/completions/resp_1", None),
        ] {
            assert_eq!(stored_response_path(path), id, "{path}");
        }
    }

    #[test]
    fn a_responses_answer_gives_its_id_from_its_first_bytes() {
        let json =
            br#"{"id":"resp_abc123","object":"response","created_at":1,"output":[{"id":"msg_1"}]}"#;
        assert_eq!(response_id(json), Some("resp_abc123"));
        assert_eq!(
            response_id(br#"{ "id" : "resp_x", "object": "response"}"#),
            Some("resp_x")
        );
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_9\",\"object\":\"response\"}}\n\n";
        assert_eq!(response_id(sse), Some("resp_9"));
        // The answer's own id, not the first "id" in it (an audit): keys sorted, or a client's
        // metadata echoed before the id; in a stream, the response's, its event's fields sorted.
        let sorted = br#"{"conversation":{"id":"conv_abc"},"created_at":1,"id":"resp_sorted","metadata":{"id":"x"}}"#;
        assert_eq!(response_id(sorted), Some("resp_sorted"));
        let echoed = br#"{"object":"response","metadata":{"id":"resp_victim"},"output":[{"id":"msg_1","content":[]}],"id":"resp_real"}"#;
        assert_eq!(response_id(echoed), Some("resp_real"));
        let sse_sorted = b": ping\n\nevent: response.created\ndata: {\"response\": {\"conversation\": {\"id\": \"conv_1\"}, \"id\": \"resp_7\", \"n\": -1.5e3, \"ok\": true, \"t\": [1, {\"id\": \"x\"}]}, \"type\": \"response.created\"}\n\n";
        assert_eq!(response_id(sse_sorted), Some("resp_7"));
        // The id inside a string value is no key.
        assert_eq!(
            response_id(br#"{"note":"\"id\":\"resp_fake\"","id":"resp_true"}"#),
            Some("resp_true")
        );
        let long = format!(r#"{{"id":"{}"}}"#, "r".repeat(MAX_RESPONSE_ID + 1));
        for none in [
            &br#"{"object":"error","message":"not found","code":404}"#[..],
            br#"{"id":"resp_cut"#,
            br#"{"id":"resp_\"q"}"#,
            br#"{"id":"","x":1}"#,
            br#"{"id":7}"#,
            br#"{"id":"with space"}"#,
            br#"{"metadata":{"id":"resp_only_nested"},"object":"response"}"#,
            br#"{"metadata":{"id":"resp_cut_before_own"#,
            long.as_bytes(),
            b"",
        ] {
            assert_eq!(response_id(none), None, "{}", String::from_utf8_lossy(none));
        }
    }

    proptest! {
        #[test]
        fn answers_never_panic_the_id_reader(chunk in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Some(id) = response_id(&chunk) {
                prop_assert!(!id.is_empty() && id.len() <= MAX_RESPONSE_ID);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse(&body, Endpoint::Chat, 64, 1024);
            let _ = parse(&body, Endpoint::Messages, 64, 1024);
            let _ = parse(&body, Endpoint::Other, 64, 1024);
        }

        #[test]
        fn arbitrary_json_values_never_panic(model in ".{0,20}", content in ".{0,200}", n in 0usize..4) {
            let msgs: Vec<_> = (0..n).map(|i| serde_json::json!({"role": "user", "content": format!("{content}{i}")})).collect();
            let body = serde_json::json!({"model": model, "messages": msgs, "stream": n % 2 == 0}).to_string();
            let r = parse(body.as_bytes(), Endpoint::Chat, 1 << 16, 1024).unwrap();
            prop_assert_eq!(r.model.as_deref(), Some(model.as_str()));
            prop_assert_eq!(&body[r.model_span.clone().unwrap()], serde_json::to_string(&model).unwrap());
        }

        /// The scanner's plain-message path (`scan`: messages matched byte for byte in the two
        /// usual serialisations) reads what the general path reads, for messages in those forms
        /// and for ones a byte or a field away from them. Every such body is read by the scanner.
        #[test]
        fn plain_messages_read_as_the_general_path_reads_them(
            messages in proptest::collection::vec((0u8..8, "[a-z \n\"é\\\\\u{1}]{0,24}", 0usize..2, 0u8..6), 1..6),
            limit in prop_oneof![Just(1usize << 16), 0usize..40],
        ) {
            let q = |t: &str| serde_json::to_string(t).unwrap();
            let msgs: Vec<String> = messages.iter().map(|(role, text, form, twist)| {
                let role = ["user", "system", "assistant", "tool", "developer", "users", "", "use"][usize::from(*role)];
                let (colon, comma) = [(":", ","), (": ", ", ")][*form];
                let m = format!(r#"{{"role"{colon}{}{comma}"content"{colon}{}}}"#, q(role), q(text));
                match twist {
                    0 => m.replace('}', " }"),
                    1 => m.replace(r#""content""#, r#""content ""#),
                    2 => m.replace(r#""}"#, &format!(r#""{comma}"name"{colon}"x"}}"#)),
                    _ => m,
                }
            }).collect();
            let body = format!(r#"{{"model":"m","messages":[{}]}}"#, msgs.join(","));
            let summary = |r: Result<InferenceRequest<'_>, ApiError>| r
                .map(|r| (r.history_len(), oracle_history(&r), r.model.map(|m| m.into_owned()), r.prompt, r.prompt_len, r.conversation_len))
                .map_err(|e| (e.status, e.code, e.param));
            let b = body.as_bytes();
            let general = summary(parse_general(b, Endpoint::Chat, PromptText::new(limit, 16, b.len()).keyed()));
            if let Ok(g) = &general {
                prop_assert_eq!(g.0, g.1, "history as recorded and by search, body: {}", body);
            }
            let scanned = parse_chat_scan(b, PromptText::new(limit, 16, b.len()).keyed());
            prop_assert!(scanned.is_some(), "the scanner declined: {}", body);
            prop_assert_eq!(summary(scanned.unwrap()), general, "body: {}", body);
        }

        /// The Messages scanner reads what the typed `serde_json` path reads, on every body it
        /// takes, in the documented shape or not (content blocks, `system` as a string or
        /// blocks, Anthropic's other fields, near misses); and it takes every body in the
        /// shapes Anthropic's clients send.
        #[test]
        fn messages_fast_path_equals_serde_path(
            messages in proptest::collection::vec((0u8..4, 0u8..10, "[a-z \n\"é\\\\\u{1}]{0,24}", 0u8..2), 0..4),
            system in 0u8..7,
            model in 0u8..4,
            extra in 0u8..6,
            sys_text in "[a-z \"é\\\\]{0,16}",
            limit in prop_oneof![Just(1usize << 16), 0usize..40],
            system_last in any::<bool>(),
        ) {
            let q = |t: &str| serde_json::to_string(t).unwrap();
            // Whether every part of the body is in a shape the scanner takes.
            let mut usual = true;
            let msgs: Vec<String> = messages.iter().map(|(role, content, text, spacing)| {
                let role = match role {
                    0 => q("user"), 1 => q("assistant"), 2 => "null".into(),
                    _ => { usual = false; r#""us\u0065r""#.into() }
                };
                let t = q(text);
                let (colon, comma) = [(":", ","), (": ", ", ")][usize::from(*spacing)];
                let content = match content {
                    0 => t,
                    // The two forms the scanner's plain-part path matches, and near misses.
                    // One text part, or two (the plain list form), spaced as the message.
                    1 if text.len() % 2 == 0 => format!(r#"[{{"type"{colon}"text"{comma}"text"{colon}{t}}}]"#),
                    1 => format!(r#"[{{"type"{colon}"text"{comma}"text"{colon}{t}}}{comma}{{"type"{colon}"text"{comma}"text"{colon}"2"}}]"#),
                    2 => format!(r#"[{{"type":"text","text":{t},"cache_control":{{"type":"ephemeral"}}}},{{"type":"image","source":{{"type":"base64","data":"x"}}}}]"#),
                    3 => format!(r#"[ {{ "text" : {t} }} , {{"text":null}} ]"#),
                    4 => format!(r#"[{{"type":"tool_result","tool_use_id":"t","content":[{{"type":"text","text":{t}}}]}}]"#),
                    5 => { usual = false; format!(r#"[{{"text":{t},"text":"dup"}}]"#) }
                    6 => { usual = false; format!("[{t}]") }
                    7 => "null".into(),
                    8 => { usual = false; format!(r#"[{{"text":5}},{{"t\u0065xt":{t}}}]"#) }
                    _ => format!(r#"[{{"type":"text","text":{t} }},{{"type":"text","text":{t},"x":1}},{{"type":"text","text" :{t}}}]"#),
                };
                format!(r#"{{"role"{colon}{role}{comma}"content"{colon}{content}}}"#)
            }).collect();
            let st = q(&sys_text);
            let system = match system {
                0 => String::new(),
                1 => format!(r#","system":{st}"#),
                2 => format!(r#","system":[{{"type":"text","text":{st},"cache_control":{{"type":"ephemeral"}}}}]"#),
                3 => r#","system":null"#.into(),
                4 => { usual = false; r#","system":5"#.into() }
                5 => r#","system":[]"#.into(),
                _ => { usual = false; format!(r#","system":{st},"system":"again""#) }
            };
            let model = match model {
                0 => r#""model":"m\u0031""#,
                1 => r#""model":null"#,
                2 => { usual = false; r#""model":3"# }
                _ => r#""max_tokens":8"#,
            };
            let extra = match extra {
                0 => "",
                1 => r#","stream":true,"max_tokens":9"#,
                2 => r#","prompt":"p","prompt":"q""#,
                3 => { usual = false; r#","messages":[]"# }
                4 => r#","tools":[{"name":"f","input_schema":{"type":"object","properties":{}}}]"#,
                _ => { usual = false; r#","x":01"# }
            };
            // `system` before `messages`, or after them (as Anthropic's SDKs send it).
            let body = if system_last {
                format!(r#"{{{model},"messages":[{}]{system}{extra}}}"#, msgs.join(","))
            } else {
                format!(r#"{{{model}{system},"messages":[{}]{extra}}}"#, msgs.join(","))
            };
            let summary = |r: Result<InferenceRequest<'_>, ApiError>| r
                .map(|r| (r.history_len(), oracle_history(&r), r.model.map(|m| m.into_owned()), r.model_span, r.stream, r.prompt, r.prompt_len, r.conversation_len))
                .map_err(|e| (e.status, e.code, e.param));
            let b = body.as_bytes();
            let typed = summary(parse_messages(b, PromptText::new(limit, 16, b.len()).keyed()));
            if let Ok(t) = &typed {
                prop_assert_eq!(t.0, t.1, "history as recorded and by search, body: {}", body);
            }
            let scanned = parse_messages_scan(b, PromptText::new(limit, 16, b.len()).keyed());
            prop_assert!(scanned.is_some() || !usual, "the scanner declined: {}", body);
            if let Some(r) = scanned {
                prop_assert_eq!(summary(r), typed.clone(), "scanner, body: {}", body);
            }
            prop_assert_eq!(summary(parse(b, Endpoint::Messages, limit, 16)), typed, "body: {}", body);
        }

        /// The chat fast path and the general path agree on every body, in the documented shape
        /// or not: same fields, same canonical prompt, same errors.
        #[test]
        fn chat_fast_path_equals_general_path(
            messages in proptest::collection::vec((0u8..10, 0u8..11, "[a-z \n\"é\\\\\u{1}]{0,24}", any::<bool>(), 0u8..9, 0u8..3), 0..5),
            shape in 0u8..6,
            model in 0u8..4,
            extra in 0u8..8,
            tail in 0u8..3,
            limit in prop_oneof![Just(1usize << 16), 0usize..40],
        ) {
            let q = |t: &str| serde_json::to_string(t).unwrap();
            let msgs: Vec<String> = messages.iter().map(|(role, content, text, content_first, more, spacing)| {
                // Roles the scanner reads as literals, near misses of them, and an escaped one.
                let role = match role {
                    0 => q("user"), 1 => q("system"), 2 => q("assistant"), 3 => "null".into(),
                    5 => q("users"), 6 => q("tool"), 7 => r#""us\u0065r""#.into(), 8 => q("develope"),
                    9 => q("developer"), _ => "7".into(),
                };
                let content = match content {
                    0 => q(text),
                    1 => "null".into(),
                    2 => format!(r#"[{{"type":"text","text":{}}},{{"type":"image_url","image_url":{{"url":"x"}}}}]"#, q(text)),
                    3 => format!(r#"[{},{{"text":null}}, 5]"#, q(text)),
                    4 => "42".into(),
                    5 => format!(r#"{{"text":{}}}"#, q(text)),
                    6 => format!(r#"[{{"text":{}, "text": "dup"}}]"#, q(text)),
                    7 => r#""pair \ud83d\ude00 \u00e9\/""#.into(),
                    8 => r#""lone \ud800""#.into(),
                    9 => format!(r#""\u0041{}""#, &q(text)[1..]),
                    _ => "true".into(),
                };
                // Spacing: unusual, compact (JSON.stringify, serde_json) or Python's json.dumps
                // (the last two are what the scanner's plain-message path matches).
                let (colon, comma) = [(" : ", ","), (":", ","), (": ", ", ")][usize::from(*spacing)];
                let mut fields = vec![format!(r#""role"{colon}{role}"#), format!(r#""content"{colon}{content}"#)];
                if *content_first { fields.reverse(); }
                match more {
                    1 => fields.push(r#""tool_calls":[{"id":"c1","function":{"name":"f","arguments":"{}"}}]"#.into()),
                    2 => fields.push(r#""name":"bob""#.into()),
                    3 => fields.push(format!(r#""role":{}"#, q("user"))),
                    4 => fields.push(r#""tool_calls" : null"#.into()),
                    5 => fields.push(r#""r\u006fle":"x""#.into()),
                    // Keys that start like the ones read as literals.
                    6 => fields.push(r#""roles":"x""#.into()),
                    7 => fields.push(r#""contents":5,"tool_call":[]"#.into()),
                    8 => fields.push(r#""content":"again""#.into()),
                    _ => {}
                }
                format!("{{{}}}", fields.join(comma))
            }).collect();
            let messages = match shape {
                0..=2 => format!(r#","messages":[{}]"#, msgs.join(", ")),
                3 => r#","messages":null"#.into(),
                4 => r#","messages":"hello""#.into(),
                _ => String::new(),
            };
            let model = match model { 0 => r#""model":"m\u0031""#, 1 => r#""model":null"#, 2 => r#""model":3"#, _ => r#""x":1"# };
            let extra = match extra {
                0 => "",
                1 => r#","stream":true,"max_tokens":9"#,
                2 => r#","prompt":"p","prompt":"q""#,
                3 => r#","input":[1,2],"stream":"true""#,
                4 => r#" , "temperature" : -0.5e-3 ,"stop":[null,true,{"a":[]}],"n":10"#,
                5 => r#","x":01"#,
                6 => r#","models":"z","message":[],"streams":1"#,
                _ => r#","x":"a\u0000b","y":{"z":[1E+2,-0]}"#,
            };
            let tail = ["", " \n\t", " x"][usize::from(tail)];
            let body = format!("{{{model}{messages}{extra}}}{tail}");
            let summary = |r: Result<InferenceRequest<'_>, ApiError>| r
                .map(|r| (r.history_len(), oracle_history(&r), r.model.map(|m| m.into_owned()), r.model_span, r.stream, r.prompt, r.prompt_len, r.conversation_len))
                .map_err(|e| (e.status, e.code, e.param));
            let b = body.as_bytes();
            let general = summary(parse_general(b, Endpoint::Chat, PromptText::new(limit, 16, b.len()).keyed()));
            if let Ok(g) = &general {
                prop_assert_eq!(g.0, g.1, "history as recorded and by search, body: {}", body);
            }
            if let Some(r) = parse_chat_scan(b, PromptText::new(limit, 16, b.len()).keyed()) {
                prop_assert_eq!(summary(r), general.clone(), "scanner, body: {}", body);
            }
            if let Some(r) = parse_chat_serde(b, PromptText::new(limit, 16, b.len()).keyed()) {
                prop_assert_eq!(summary(r), general.clone(), "serde tier, body: {}", body);
            }
            prop_assert_eq!(summary(parse(b, Endpoint::Chat, limit, 16)), general, "body: {}", body);
        }
    }
}
