//! Multipart form bodies (`multipart/form-data`, RFC 7578), as the audio endpoints take them:
//! `/v1/audio/transcriptions` and `/v1/audio/translations` (vLLM serves Whisper-style models
//! there) send the audio file and the fields, `model` among them, as parts of one form.
//!
//! Only what routing needs is read: `model` (with the span of its value, so an alias is
//! rewritten in place) and `stream`. The file's bytes are never read. When `model` comes before
//! the file, as OpenAI's Python SDK sends it (fields first, then files), [`scan`] is ready as
//! soon as the file's part begins, and the shells route the request then: the upload streams on
//! to the pod, unbuffered and unbounded by `max_body_bytes`. When `model` comes after the file
//! (curl's `-F file=@... -F model=...`, OpenAI's Node SDK given `file` first), the body is
//! buffered to its end, up to `max_body_bytes`, and read whole.
//!
//! A second `model` field is refused (400), as a duplicated key in a JSON body is, so the gateway
//! and the model server cannot disagree on the model, except after the file when the request was
//! routed at the file: the form is not read past it then.

use crate::error::ApiError;
use crate::request::InferenceRequest;
use std::ops::Range;

/// How much of a form the shells read for its fields before its end: the fields of OpenAI's
/// SDKs' forms take a few hundred bytes; a form whose fields are not in by then (a file first)
/// is read once, whole, at its end. Bounds the re-reading of a body as its chunks arrive.
pub const EARLY_BYTES: usize = 64 * 1024;

/// The longest part head (its header lines) read; a longer one is refused.
const MAX_PART_HEAD: usize = 8 * 1024;

/// The boundary of a `multipart/form-data` content type (its `boundary` parameter, unquoted);
/// `None` for any other type. A form without a usable boundary (missing, empty, longer than
/// RFC 2046's 70 characters, or given twice) gives `Some("")`, which [`scan`] refuses with a
/// clear 400. Twice, because parsers disagree on which one counts (Starlette's, vLLM's, takes
/// the last): a body that is a form under each could name one model to the gateway and
/// another to the pod.
pub fn boundary(content_type: &str) -> Option<String> {
    let (kind, params) = content_type.split_once(';').unwrap_or((content_type, ""));
    if !kind.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    let mut given = parameters(params.as_bytes())
        .filter(|(name, _)| name.eq_ignore_ascii_case(b"boundary"))
        .map(|(_, value)| value);
    let found = given.next().filter(|_| given.next().is_none());
    let usable =
        |b: &Vec<u8>| (1..=70).contains(&b.len()) && !b.contains(&b'\r') && !b.contains(&b'\n');
    Some(
        found
            .filter(usable)
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default(),
    )
}

/// What [`scan`] made of the body so far.
#[derive(Debug, PartialEq)]
pub enum Scan<'a> {
    /// The fields routing needs are read: `model` and `stream` (the prompt fields stay empty;
    /// an audio form has no prompt to match).
    Ready(InferenceRequest<'a>),
    /// More of the body is needed (only when the body is not yet complete).
    More,
}

/// Reads a form body's `model` and `stream` fields. `complete`: the body is whole; otherwise
/// the result is [`Scan::More`] until the fields are known. The same body gives the same
/// answer whichever prefix of it was scanned first.
pub fn scan<'a>(body: &'a [u8], boundary: &str, complete: bool) -> Result<Scan<'a>, ApiError> {
    if boundary.is_empty() {
        return Err(ApiError::invalid_form(
            "the multipart content-type has no usable `boundary` parameter",
        ));
    }
    let mut delim = Vec::with_capacity(boundary.len() + 4);
    delim.extend_from_slice(b"\r\n--");
    delim.extend_from_slice(boundary.as_bytes());
    let more = |why: &str| {
        if complete {
            Err(ApiError::invalid_form(why))
        } else {
            Ok(Scan::More)
        }
    };
    // The first delimiter opens the body, or ends a preamble.
    let mut pos = if body.starts_with(&delim[2..]) {
        delim.len() - 2
    } else {
        match find(body, &delim, 0) {
            Some(i) => i + delim.len(),
            None => return more("no part starts with the content-type's boundary"),
        }
    };
    let mut fields = Fields::default();
    loop {
        // After a delimiter: `--` closes the form; else optional blanks, then CRLF.
        let rest = body.get(pos..).unwrap_or_default();
        if rest.starts_with(b"--") {
            return Ok(Scan::Ready(fields.into_request(body)));
        }
        let blanks = rest
            .iter()
            .take_while(|&&b| b == b' ' || b == b'\t')
            .count();
        match rest.get(blanks..blanks + 2) {
            Some(b"\r\n") => pos += blanks + 2,
            Some(_) => {
                return Err(ApiError::invalid_form(
                    "a boundary line does not end with CRLF",
                ))
            }
            None if rest.len() < 2 => return more("the form is not closed"),
            None => return more("a boundary line is cut short"),
        }
        // The part's head: header lines, then an empty line (no headers: the empty line alone).
        let rest = body.get(pos..).unwrap_or_default();
        let (head, content_start) = if rest.starts_with(b"\r\n") {
            (&rest[..0], pos + 2)
        } else {
            let window = &rest[..rest.len().min(MAX_PART_HEAD + 4)];
            match window.windows(4).position(|w| w == b"\r\n\r\n") {
                Some(i) => (&rest[..i], pos + i + 4),
                None if rest.len() >= MAX_PART_HEAD + 4 => {
                    return Err(ApiError::invalid_form("a part's header lines are too long"))
                }
                None => return more("a part's header lines are cut short"),
            }
        };
        let part = disposition(head);
        if part.file && fields.model.is_some() {
            // The fields before the file are all routing needs: route now; the file streams on.
            return Ok(Scan::Ready(fields.into_request(body)));
        }
        let Some(end) = find(body, &delim, content_start) else {
            return more("a part is not closed by the boundary");
        };
        let value = content_start..end;
        match part.name.as_deref() {
            Some(b"model") => {
                if fields.model.is_some() {
                    return Err(ApiError::invalid_form(
                        "the form has more than one `model` field",
                    ));
                }
                fields.model = Some(value);
            }
            Some(b"stream") => {
                // What the server's form model (pydantic) reads as true.
                let v = body.get(value).unwrap_or_default().trim_ascii();
                fields.stream = [&b"true"[..], b"1", b"yes", b"on", b"t", b"y"]
                    .iter()
                    .any(|t| v.eq_ignore_ascii_case(t));
            }
            _ => {}
        }
        pos = end + delim.len();
    }
}

#[derive(Default)]
struct Fields {
    model: Option<Range<usize>>,
    stream: bool,
}

impl Fields {
    fn into_request(self, body: &[u8]) -> InferenceRequest<'_> {
        let model = self.model.as_ref().and_then(|r| body.get(r.clone()));
        InferenceRequest {
            // A value that is not UTF-8 is no model this gateway serves: it becomes the
            // replacement characters, which no model is named (404, as the server would answer).
            model: model.map(String::from_utf8_lossy),
            model_span: self.model,
            stream: self.stream,
            prompt: String::new(),
            prompt_len: 0,
            conversation_len: None,
            last_assistant: None,
            previous_response: None,
            sequences: 1,
        }
    }
}

/// A part's `content-disposition`: its field name, and whether it is a file.
#[derive(Default)]
struct Part {
    name: Option<Vec<u8>>,
    file: bool,
}

fn disposition(head: &[u8]) -> Part {
    let mut part = Part::default();
    for line in head.split(|&b| b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        if !line[..colon]
            .trim_ascii()
            .eq_ignore_ascii_case(b"content-disposition")
        {
            continue;
        }
        let value = &line[colon + 1..];
        // `form-data`, then its parameters.
        let params = match value.iter().position(|&b| b == b';') {
            Some(i) => &value[i + 1..],
            None => &[][..],
        };
        for (name, v) in parameters(params) {
            if name.eq_ignore_ascii_case(b"name") {
                part.name = Some(v);
            } else if name.eq_ignore_ascii_case(b"filename")
                || name.eq_ignore_ascii_case(b"filename*")
            {
                part.file = true;
            }
        }
    }
    part
}

/// `name=value` parameters separated by `;`, a value bare or quoted (`\"` and `\\` escaped; a `;`
/// inside quotes is part of it).
fn parameters(mut s: &[u8]) -> impl Iterator<Item = (&[u8], Vec<u8>)> {
    std::iter::from_fn(move || loop {
        s = s.trim_ascii_start();
        if s.is_empty() {
            return None;
        }
        let name_end = s
            .iter()
            .position(|&b| b == b'=' || b == b';')
            .unwrap_or(s.len());
        let name = s[..name_end].trim_ascii();
        if s.get(name_end) != Some(&b'=') {
            // A bare token (no value): skipped.
            s = s.get(name_end + 1..).unwrap_or_default();
            continue;
        }
        let rest = s[name_end + 1..].trim_ascii_start();
        let mut value = Vec::new();
        let mut i = 0;
        if rest.first() == Some(&b'"') {
            i = 1;
            while let Some(&b) = rest.get(i) {
                i += 1;
                match b {
                    b'"' => break,
                    // Only `\"` and `\\` are escapes, as Python's email.utils.unquote reads
                    // them (Starlette's form parser, vLLM's): `name="mo\del"` is the field
                    // `mo\del` to the pod, so it must not be `model` here.
                    b'\\' if matches!(rest.get(i), Some(b'"' | b'\\')) => {
                        value.extend(rest.get(i));
                        i += 1;
                    }
                    _ => value.push(b),
                }
            }
            // Anything up to the next `;` after the closing quote is dropped.
            while rest.get(i).is_some_and(|&b| b != b';') {
                i += 1;
            }
        } else {
            while let Some(&b) = rest.get(i) {
                if b == b';' {
                    break;
                }
                i += 1;
            }
            value.extend_from_slice(rest[..i].trim_ascii());
        }
        s = rest.get(i + 1..).unwrap_or_default();
        return Some((name, value));
    })
}

/// The first `needle` (a delimiter: it starts with CR) in `hay` at or after `from`. Each CR is
/// found by `memchr`, 16 bytes at a time (SIMD natively and with wasm32's simd128), without
/// the set-up of a substring finder: a form's head is a few hundred bytes, but a part's content
/// is a whole file when it comes before `model`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    let (&first, _) = needle.split_first()?;
    let mut at = from;
    loop {
        at += memchr::memchr(first, hay.get(at..)?)?;
        if hay.get(at..)?.starts_with(needle) {
            return Some(at);
        }
        at += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B: &str = "XyZ123";

    /// A form as OpenAI's Python SDK (httpx) writes it: the fields, then the file.
    fn form(fields: &[(&str, &str)], file: Option<&[u8]>, file_first: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let file_part = |out: &mut Vec<u8>| {
            if let Some(f) = file {
                out.extend_from_slice(
                    format!(
                        "--{B}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a;b.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
                    )
                    .as_bytes(),
                );
                out.extend_from_slice(f);
                out.extend_from_slice(b"\r\n");
            }
        };
        if file_first {
            file_part(&mut out);
        }
        for (k, v) in fields {
            out.extend_from_slice(
                format!("--{B}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                    .as_bytes(),
            );
        }
        if !file_first {
            file_part(&mut out);
        }
        out.extend_from_slice(format!("--{B}--\r\n").as_bytes());
        out
    }

    fn ready(s: Scan<'_>) -> InferenceRequest<'_> {
        match s {
            Scan::Ready(r) => r,
            Scan::More => panic!("not ready"),
        }
    }

    #[test]
    fn the_boundary_comes_from_a_form_content_type_only() {
        let cases = [
            ("multipart/form-data; boundary=abc", Some("abc")),
            ("Multipart/Form-Data;BOUNDARY=\"a b;c\"", Some("a b;c")),
            (
                "multipart/form-data; charset=utf-8; boundary=----x",
                Some("----x"),
            ),
            ("multipart/form-data", Some("")),
            ("multipart/form-data; boundary=", Some("")),
            ("multipart/form-data; boundary=\"\"", Some("")),
            ("application/json", None),
            ("multipart/mixed; boundary=abc", None),
            // Twice, in any spelling: which one a parser takes is its own choice.
            ("multipart/form-data; boundary=AAA; boundary=BBB", Some("")),
            (
                "multipart/form-data; boundary=\"AAA\"; BOUNDARY=BBB",
                Some(""),
            ),
            ("multipart/form-data; boundary=AAA; boundary=AAA", Some("")),
        ];
        for (ct, want) in cases {
            assert_eq!(boundary(ct).as_deref(), want, "{ct}");
        }
        let long = format!("multipart/form-data; boundary={}", "b".repeat(71));
        assert_eq!(boundary(&long).as_deref(), Some(""));
    }

    #[test]
    fn model_and_stream_before_the_file_are_ready_when_the_file_begins() {
        let audio = vec![0xffu8; 10_000];
        let body = form(
            &[("model", "whisper"), ("stream", "true")],
            Some(&audio),
            false,
        );
        let r = ready(scan(&body, B, true).unwrap());
        assert_eq!(r.model.as_deref(), Some("whisper"));
        assert!(r.stream);
        for (v, stream) in [
            ("True", true),
            ("1", true),
            ("yes", true),
            ("false", false),
            ("0", false),
        ] {
            let b = form(&[("model", "w"), ("stream", v)], None, false);
            assert_eq!(ready(scan(&b, B, true).unwrap()).stream, stream, "{v}");
        }
        assert_eq!(&body[r.model_span.clone().unwrap()], b"whisper");
        // Ready before any of the file arrived: the file's head is enough.
        let file_head = memchr::memmem::find(&body, b"audio/wav\r\n\r\n").unwrap() + 13;
        assert_eq!(scan(&body[..file_head - 1], B, false).unwrap(), Scan::More);
        let early = ready(scan(&body[..file_head], B, false).unwrap());
        assert_eq!(early.model.as_deref(), Some("whisper"));
        assert_eq!(early.model_span, r.model_span);
    }

    #[test]
    fn a_model_after_the_file_needs_the_whole_body() {
        let audio = b"RIFF\r\n--XyZ12 almost a boundary\r\n".repeat(50);
        let body = form(
            &[("model", "whisper"), ("language", "en")],
            Some(&audio),
            true,
        );
        for cut in [0, 10, body.len() / 2, body.len() - 20] {
            assert_eq!(scan(&body[..cut], B, false).unwrap(), Scan::More, "{cut}");
        }
        let r = ready(scan(&body, B, true).unwrap());
        assert_eq!(r.model.as_deref(), Some("whisper"));
        assert!(!r.stream);
        // Ready as soon as the closing delimiter is in, even before the body is known complete.
        assert_eq!(
            ready(scan(&body, B, false).unwrap()).model.as_deref(),
            Some("whisper")
        );
    }

    #[test]
    fn a_preamble_blank_padding_and_headless_parts_are_read() {
        let body = format!(
            "preamble\r\n--{B}  \r\n\r\nno headers\r\n--{B}\r\ncontent-disposition: form-data; name=model\r\n\r\nw\r\n--{B}--"
        );
        let r = ready(scan(body.as_bytes(), B, true).unwrap());
        assert_eq!(r.model.as_deref(), Some("w"));
    }

    #[test]
    fn a_backslash_in_a_quoted_name_escapes_only_a_quote_or_a_backslash() {
        // As vLLM's form parser (Starlette's, through Python's email.utils.unquote) reads the
        // names: `mo\del` stays `mo\del`, not `model`; so a form whose only model field is
        // spelt so has no model here either, as at the pod.
        let named = |name: &str| {
            format!("--{B}\r\ncontent-disposition: form-data; name=\"{name}\"\r\n\r\nw\r\n--{B}--")
        };
        // `\"` is a quote: the name `mo"del`, not model either.
        for name in [r"mo\del", r"\model", r"model\", r"mo\\del", r#"mo\"del"#] {
            let body = named(name);
            let r = ready(scan(body.as_bytes(), B, true).unwrap());
            assert_eq!(r.model, None, "{name}");
        }
        // And `\\` is one backslash.
        let head = r#"form-data; name="a\\b\"c""#;
        let part = disposition(format!("Content-Disposition: {head}").as_bytes());
        assert_eq!(part.name.as_deref(), Some(&br#"a\b"c"#[..]));
    }

    #[test]
    fn bad_forms_get_400_and_a_missing_model_is_left_to_the_resolver() {
        let no_model = form(&[("language", "en")], Some(b"x"), false);
        assert_eq!(ready(scan(&no_model, B, true).unwrap()).model, None);
        let two = form(&[("model", "a"), ("model", "b")], None, false);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"{\"model\":\"x\"}".to_vec(), B),
            (form(&[("model", "a")], None, false), ""),
            (two, B),
            (
                format!("--{B}\r\ncontent-disposition: form-data; name=model\r\n\r\nw")
                    .into_bytes(),
                B,
            ),
            (format!("--{B}junk\r\n\r\n").into_bytes(), B),
            (
                format!("--{B}\r\n{}", "x".repeat(MAX_PART_HEAD + 10)).into_bytes(),
                B,
            ),
        ];
        for (body, b) in cases {
            let e = scan(&body, b, true).unwrap_err();
            assert_eq!(
                (e.status, e.code.as_deref()),
                (400, Some("invalid_form")),
                "{body:?}"
            );
        }
        // A head too long is refused before the body is complete too.
        let long = format!("--{B}\r\n{}", "x".repeat(MAX_PART_HEAD + 10));
        assert!(scan(long.as_bytes(), B, false).is_err());
    }

    #[test]
    fn the_model_span_is_the_value_to_rewrite() {
        // The engine's rewrite of a form puts the new name, bytes as they are, at this span.
        let body = form(&[("model", "w")], Some(b"data"), false);
        let r = ready(scan(&body, B, true).unwrap());
        let span = r.model_span.unwrap();
        let out = [
            &body[..span.start],
            b"openai/whisper-large-v3",
            &body[span.end..],
        ]
        .concat();
        let again = ready(scan(&out, B, true).unwrap());
        assert_eq!(again.model.as_deref(), Some("openai/whisper-large-v3"));
        assert!(out.windows(4).any(|w| w == b"data"));
    }

    proptest! {
        #[test]
        fn any_bytes_give_an_answer_not_a_panic(body in proptest::collection::vec(any::<u8>(), 0..400), complete: bool) {
            let _ = scan(&body, B, complete);
        }

        /// Every prefix of a form gives More or the whole body's answer; the whole body gives
        /// its fields.
        #[test]
        fn every_prefix_agrees_with_the_whole(
            model in "[a-z0-9/._-]{1,24}",
            audio in proptest::collection::vec(any::<u8>(), 0..300),
            file_first: bool,
            stream: bool,
        ) {
            let s = if stream { "true" } else { "false" };
            let body = form(&[("model", &model), ("stream", s)], Some(&audio), file_first);
            let whole = ready(scan(&body, B, true).unwrap());
            prop_assert_eq!(whole.model.as_deref(), Some(model.as_str()));
            prop_assert_eq!(whole.stream, stream);
            for cut in 0..=body.len() {
                match scan(&body[..cut], B, false) {
                    Ok(Scan::More) => {}
                    Ok(Scan::Ready(r)) => {
                        prop_assert_eq!(r.model, whole.model.clone());
                        prop_assert_eq!(r.model_span, whole.model_span.clone());
                        prop_assert_eq!(r.stream, whole.stream);
                    }
                    Err(e) => prop_assert!(false, "cut {}: {:?}", cut, e),
                }
            }
        }
    }
}
