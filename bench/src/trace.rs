//! Readers for the public request traces the benchmark replays.
//!
//! Two formats, auto-detected from the first line:
//! - **Azure LLM inference trace 2023** (CSV `TIMESTAMP,ContextTokens,GeneratedTokens`,
//!   timestamps like `2023-11-16 18:15:46.6805900`): real arrival times and token counts,
//!   no text and no prefix information. The conversation and code traces share it.
//! - **Mooncake FAST'25** (JSON lines with `timestamp` in ms, `input_length`,
//!   `output_length`, `hash_ids`): prefix block ids of [`MOONCAKE_BLOCK_TOKENS`] tokens,
//!   equal ids at equal positions meaning a shared, cacheable prefix.
//!
//! Both become a list of [`TraceRow`]s with arrival offsets from the first request.

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Tokens per Mooncake hash block: the trace's README ("512 tokens a block"), the block
/// size of Mooncake's KV cache store in the FAST'25 paper.
pub const MOONCAKE_BLOCK_TOKENS: u64 = 512;

/// Which trace format a file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Azure LLM inference trace (CSV).
    Azure,
    /// Mooncake trace (JSON lines with `hash_ids`).
    Mooncake,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRow {
    /// Arrival time in seconds after the trace's first request.
    pub offset_s: f64,
    /// Prompt length in tokens.
    pub input_tokens: u64,
    /// Generated length in tokens.
    pub output_tokens: u64,
    /// Prefix block ids (Mooncake only; empty for Azure).
    pub hash_ids: Vec<u64>,
}

/// A parsed trace file.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Format it was read as.
    pub format: TraceFormat,
    /// Requests in arrival order.
    pub rows: Vec<TraceRow>,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {path}: {source}")]
    Io {
        /// File path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The first line matches neither format.
    #[error("unrecognised trace format (expected an Azure CSV header or Mooncake JSON lines)")]
    UnknownFormat,
    /// A line could not be parsed.
    #[error("line {line}: {reason}")]
    BadLine {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        reason: String,
    },
    /// The file holds no requests.
    #[error("trace has no requests")]
    Empty,
}

impl Trace {
    /// Reads and parses a trace file, detecting its format.
    pub fn load(path: &Path) -> Result<Self, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses trace text, detecting its format from the first non-empty line.
    pub fn parse(text: &str) -> Result<Self, TraceError> {
        let first = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .ok_or(TraceError::Empty)?;
        let trace = if first.starts_with('{') {
            Self {
                format: TraceFormat::Mooncake,
                rows: parse_mooncake(text)?,
            }
        } else if first.to_ascii_lowercase().contains("timestamp") && first.contains(',') {
            Self {
                format: TraceFormat::Azure,
                rows: parse_azure(text)?,
            }
        } else {
            return Err(TraceError::UnknownFormat);
        };
        if trace.rows.is_empty() {
            return Err(TraceError::Empty);
        }
        Ok(trace)
    }

    /// Seconds from the first to the last arrival.
    pub fn span_s(&self) -> f64 {
        span_s(&self.rows)
    }
}

/// Seconds from the first to the last arrival of `rows`.
pub fn span_s(rows: &[TraceRow]) -> f64 {
    match (rows.first(), rows.last()) {
        (Some(a), Some(b)) => b.offset_s - a.offset_s,
        _ => 0.0,
    }
}

/// The ideal prefix reuse of a list of requests: the share of all prefix blocks that
/// repeat a block some earlier request already had, i.e. the block hit rate of one
/// server with an infinite prefix cache. Block ids are prefix hashes (an id implies the
/// whole prefix before it), so a set of seen ids is enough. `None` without blocks.
pub fn ideal_prefix_reuse(rows: &[TraceRow]) -> Option<f64> {
    let mut seen = HashSet::new();
    let (mut total, mut repeats) = (0u64, 0u64);
    for row in rows {
        for &id in &row.hash_ids {
            total += 1;
            if !seen.insert(id) {
                repeats += 1;
            }
        }
    }
    (total > 0).then(|| repeats as f64 / total as f64)
}

fn bad(line: usize, reason: impl Into<String>) -> TraceError {
    TraceError::BadLine {
        line,
        reason: reason.into(),
    }
}

fn parse_azure(text: &str) -> Result<Vec<TraceRow>, TraceError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or(TraceError::Empty)?;
    let cols: Vec<String> = header
        .split(',')
        .map(|c| c.trim().to_ascii_lowercase())
        .collect();
    let col = |name: &str| {
        cols.iter()
            .position(|c| c == name)
            .ok_or_else(|| bad(1, format!("missing column {name}")))
    };
    let (ts_col, ctx_col, gen_col) = (
        col("timestamp")?,
        col("contexttokens")?,
        col("generatedtokens")?,
    );
    let mut rows = Vec::new();
    let mut t0: Option<f64> = None;
    for (i, line) in lines {
        let n = i + 1;
        let fields: Vec<&str> = line.trim().split(',').map(str::trim).collect();
        let get = |c: usize| {
            fields
                .get(c)
                .copied()
                .ok_or_else(|| bad(n, "too few fields"))
        };
        let t = parse_azure_timestamp(get(ts_col)?).ok_or_else(|| bad(n, "bad timestamp"))?;
        let input_tokens = get(ctx_col)?
            .parse()
            .map_err(|_| bad(n, "bad ContextTokens"))?;
        let output_tokens = get(gen_col)?
            .parse()
            .map_err(|_| bad(n, "bad GeneratedTokens"))?;
        let base = *t0.get_or_insert(t);
        rows.push(TraceRow {
            offset_s: t - base,
            input_tokens,
            output_tokens,
            hash_ids: Vec::new(),
        });
    }
    Ok(rows)
}

/// Seconds since 1970 of an Azure trace timestamp `YYYY-MM-DD HH:MM:SS[.fffffff]`
/// (UTC; only differences are used). `None` when malformed.
pub fn parse_azure_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (hh, mm, ss) = (t.next()?, t.next()?, t.next()?);
    let (hh, mm): (i64, i64) = (hh.parse().ok()?, mm.parse().ok()?);
    let secs: f64 = ss.parse().ok()?;
    let days = days_from_civil(y, m, day);
    Some((days * 86_400 + hh * 3_600 + mm * 60) as f64 + secs)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's
/// `days_from_civil`), so a trace that crosses midnight or a month end stays monotonic.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

fn parse_mooncake(text: &str) -> Result<Vec<TraceRow>, TraceError> {
    let mut rows = Vec::new();
    let mut t0: Option<f64> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r: MooncakeLine = serde_json::from_str(line).map_err(|e| bad(i + 1, e.to_string()))?;
        let t = r.timestamp / 1000.0;
        let base = *t0.get_or_insert(t);
        rows.push(TraceRow {
            offset_s: t - base,
            input_tokens: r.input_length,
            output_tokens: r.output_length,
            hash_ids: r.hash_ids,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn traces_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/traces")
    }

    #[test]
    fn azure_conversation_trace_parses_every_row() {
        let t = Trace::load(&traces_dir().join("azure-llm-2023-conv.csv")).unwrap();
        assert_eq!(t.format, TraceFormat::Azure);
        // the file has 19,366 data lines after its header (CRLF, no final newline)
        assert_eq!(t.rows.len(), 19_366);
        assert_eq!(t.rows[0].offset_s, 0.0);
        assert_eq!((t.rows[0].input_tokens, t.rows[0].output_tokens), (374, 44));
        // second row: 18:15:50.9951690 - 18:15:46.6805900
        assert!((t.rows[1].offset_s - 4.314579).abs() < 1e-6);
        assert!(t.rows.windows(2).all(|w| w[1].offset_s >= w[0].offset_s));
        // the trace README: 3,502 s
        assert!((t.span_s() - 3501.7).abs() < 1.0, "span {}", t.span_s());
        assert!(ideal_prefix_reuse(&t.rows).is_none());
    }

    #[test]
    fn mooncake_trace_parses_and_its_ideal_reuse_is_about_64_percent() {
        let t = Trace::load(&traces_dir().join("mooncake-fast25-synthetic.jsonl")).unwrap();
        assert_eq!(t.format, TraceFormat::Mooncake);
        assert_eq!(t.rows.len(), 3_993);
        assert_eq!(t.rows[0].hash_ids.len(), 79);
        let reuse = ideal_prefix_reuse(&t.rows).unwrap();
        // the trace README states 64%
        assert!((reuse - 0.64).abs() < 0.01, "reuse {reuse}");
        // every row's blocks cover its input: (n-1)*512 < input <= n*512
        for r in &t.rows {
            let n = r.hash_ids.len() as u64;
            assert!(r.input_tokens <= n * MOONCAKE_BLOCK_TOKENS);
            assert!(r.input_tokens > (n - 1) * MOONCAKE_BLOCK_TOKENS);
        }
    }

    #[test]
    fn ideal_reuse_counts_repeated_blocks() {
        let row = |ids: &[u64]| TraceRow {
            offset_s: 0.0,
            input_tokens: 1,
            output_tokens: 1,
            hash_ids: ids.to_vec(),
        };
        // 7 blocks, of which 1, 2 (second request) and 1 (third) repeat
        let rows = [row(&[1, 2, 3]), row(&[1, 2, 4]), row(&[1])];
        let r = ideal_prefix_reuse(&rows).unwrap();
        assert!((r - 3.0 / 7.0).abs() < 1e-12);
    }

    #[test]
    fn timestamps_cross_midnight_and_month_ends_monotonically() {
        let a = parse_azure_timestamp("2023-11-30 23:59:59.5").unwrap();
        let b = parse_azure_timestamp("2023-12-01 00:00:00.25").unwrap();
        assert!((b - a - 0.75).abs() < 1e-6);
        assert_eq!(parse_azure_timestamp("1970-01-01 00:00:10"), Some(10.0));
        assert!(parse_azure_timestamp("garbage").is_none());
    }

    #[test]
    fn unknown_and_broken_input_are_errors() {
        assert!(matches!(
            Trace::parse("hello\nworld"),
            Err(TraceError::UnknownFormat)
        ));
        assert!(matches!(Trace::parse(""), Err(TraceError::Empty)));
        assert!(matches!(
            Trace::parse("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n"),
            Err(TraceError::BadLine { line: 2, .. })
        ));
        assert!(matches!(
            Trace::parse("{\"timestamp\": 0}\n"),
            Err(TraceError::BadLine { line: 1, .. })
        ));
    }

    #[test]
    fn azure_columns_are_found_by_name_in_any_order() {
        let t = Trace::parse(
            "GeneratedTokens,TIMESTAMP,ContextTokens\r\n5,2023-01-01 00:00:00,10\r\n7,2023-01-01 00:00:02.5,20",
        )
        .unwrap();
        assert_eq!(t.rows.len(), 2);
        assert_eq!(t.rows[1].input_tokens, 20);
        assert_eq!(t.rows[1].output_tokens, 7);
        assert!((t.rows[1].offset_s - 2.5).abs() < 1e-9);
    }
}
