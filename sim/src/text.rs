//! Text conventions of the simulator: how a prompt becomes a token count and prefix-cache block
//! hashes, how an unspecified output length is drawn, and the deterministic filler text that
//! stands for generated tokens. No tokenizer is loaded: a token is taken to be 4 bytes of text.

use xxhash_rust::xxh64::xxh64;

/// Bytes of text per token. The common rule of thumb for English text with BPE tokenizers
/// (OpenAI's tokenizer guide: "one token generally corresponds to ~4 characters"); the same
/// figure the Gateway API Inference Extension's approximate prefix scorer assumes.
pub const BYTES_PER_TOKEN: usize = 4;

/// Mean generated tokens of a request that gives no `max_tokens`: the mean `GeneratedTokens`
/// of the Azure LLM inference trace 2023, conversation service (211.1 over 19,366 requests;
/// `shared/traces/azure-llm-2023-conv.csv`).
pub const DEFAULT_MEAN_OUTPUT_TOKENS: f64 = 211.0;

/// Prompt tokens of a text: `ceil(bytes / 4)`, at least 1 (a real server adds template tokens).
pub fn prompt_tokens(text: &str) -> u32 {
    let n = text.len().div_ceil(BYTES_PER_TOKEN).max(1);
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Chained hashes of the prompt's full blocks: block `i` covers bytes
/// `[64i, 64i + 64)` (16 tokens x 4 bytes), and its hash is xxh64 of those bytes seeded with
/// the previous block's hash; the chain starts from a hash of `namespace` (model or adapter
/// name), so equal text under different adapters does not share cache, as in vLLM. Requests
/// sharing leading text share leading hashes.
pub fn block_hashes(text: &str, block_size: u32, namespace: &str) -> Vec<u64> {
    let bytes = text.as_bytes();
    let block_tokens = block_size.max(1) as usize;
    let chunk = block_tokens * BYTES_PER_TOKEN;
    let full = prompt_tokens(text) as usize / block_tokens;
    let mut h = xxh64(namespace.as_bytes(), 0);
    let mut out = Vec::with_capacity(full);
    for i in 0..full {
        let start = (i * chunk).min(bytes.len());
        let end = ((i + 1) * chunk).min(bytes.len());
        h = xxh64(&bytes[start..end], h);
        out.push(h);
    }
    out
}

/// A deterministic output length for a request without `max_tokens`: an exponential draw with
/// mean [`DEFAULT_MEAN_OUTPUT_TOKENS`], keyed by the seed and the request's model and prompt
/// (the same request gets the same length on any pod), clamped to `[1, max]`.
pub fn drawn_output_tokens(seed: u64, model: &str, prompt: &str, max: u32) -> u32 {
    let h = xxh64(prompt.as_bytes(), xxh64(model.as_bytes(), seed));
    // 53 random bits -> u in [0, 1)
    let u = (h >> 11) as f64 / (1u64 << 53) as f64;
    let draw = (-(1.0 - u).ln() * DEFAULT_MEAN_OUTPUT_TOKENS).ceil();
    let draw = if draw.is_finite() && draw >= 1.0 {
        draw
    } else {
        1.0
    };
    (draw.min(f64::from(max.max(1)))) as u32
}

/// Filler words, one per token, each with its leading space (as BPE tokens usually carry it).
const WORDS: &[&str] = &[
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " a",
    " lazy",
    " dog",
    " while",
    " simulated",
    " tokens",
    " stream",
    " from",
    " one",
    " pod",
    " of",
    " the",
    " fleet",
    " and",
    " every",
    " word",
    " stands",
    " for",
    " exactly",
    " one",
    " generated",
    " token",
    " in",
    " this",
    " reply",
    " now.",
];

/// Appends the text of output tokens `[from, to)` to `out`.
pub fn push_filler(out: &mut String, from: u32, to: u32) {
    for i in from..to {
        out.push_str(WORDS[i as usize % WORDS.len()]);
    }
}

/// The text of output tokens `[from, to)`.
pub fn filler(from: u32, to: u32) -> String {
    let mut s = String::with_capacity((to.saturating_sub(from) as usize) * 6);
    push_filler(&mut s, from, to);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_ceil_of_quarter_bytes() {
        assert_eq!(prompt_tokens(""), 1);
        assert_eq!(prompt_tokens("abcd"), 1);
        assert_eq!(prompt_tokens("abcde"), 2);
        assert_eq!(prompt_tokens(&"x".repeat(130)), 33);
    }

    #[test]
    fn shared_leading_text_shares_leading_hashes() {
        let system = "s".repeat(64 * 3);
        let a = block_hashes(&format!("{system}{}", "a".repeat(128)), 16, "m");
        let b = block_hashes(&format!("{system}{}", "b".repeat(128)), 16, "m");
        assert_eq!(a.len(), 5);
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a[3], b[3]);
        // a different namespace (adapter) shares nothing
        let c = block_hashes(&format!("{system}{}", "a".repeat(128)), 16, "lora");
        assert_ne!(a[0], c[0]);
        // a 63-byte tail is not a full block
        assert_eq!(block_hashes(&"x".repeat(64 + 60), 16, "m").len(), 1);
    }

    #[test]
    fn drawn_lengths_are_deterministic_with_the_trace_mean() {
        assert_eq!(
            drawn_output_tokens(1, "m", "p", 4096),
            drawn_output_tokens(1, "m", "p", 4096)
        );
        let n = 4000;
        let mean = (0..n)
            .map(|i| f64::from(drawn_output_tokens(7, "m", &format!("prompt {i}"), 100_000)))
            .sum::<f64>()
            / f64::from(n);
        assert!((mean - DEFAULT_MEAN_OUTPUT_TOKENS).abs() < 15.0, "{mean}");
        assert_eq!(drawn_output_tokens(7, "m", "p", 1), 1);
        // the seed matters: another seed gives another sequence of lengths
        let lengths = |seed| {
            (0..20)
                .map(|i| drawn_output_tokens(seed, "m", &format!("q{i}"), 100_000))
                .collect::<Vec<_>>()
        };
        assert_eq!(lengths(1), lengths(1));
        assert_ne!(lengths(1), lengths(2));
    }

    #[test]
    fn filler_has_one_word_per_token() {
        assert_eq!(filler(0, 3), " the quick brown");
        assert_eq!(filler(2, 2), "");
    }
}
