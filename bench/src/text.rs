//! Deterministic prompt text for traces that carry token counts but no text.
//!
//! Two kinds of text are needed:
//! - **filler**, unique per request, so that requests of a trace without prefix
//!   information (Azure) share nothing by accident: a prefix-aware router must not see
//!   sharing the trace does not record;
//! - **hash blocks**, for traces whose prompts are lists of block ids (Mooncake): the same
//!   id always expands to the same text, and different ids to text that differs from its
//!   first characters, so requests that share leading ids share exactly that leading
//!   text and nothing more.
//!
//! Lengths are in characters, at [`CHARS_PER_TOKEN`] characters per token.

use crate::rng::{mix64, SplitMix64};

/// Characters per token used to turn token counts into text. About 4 characters per
/// token is the usual rule of thumb for English text with BPE tokenizers (OpenAI's
/// tokenizer guide: "one token generally corresponds to ~4 characters of text").
pub const CHARS_PER_TOKEN: usize = 4;

/// Words the filler is drawn from: short common English words, so the text looks like
/// prose to a tokenizer (roughly one token per word plus the space).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "model", "data",
    "system", "query", "value", "result", "server", "token", "cache", "block", "request", "answer",
    "river", "stone", "light", "green", "paper", "north", "quick", "plain", "sound", "water",
    "field", "table", "order", "point", "state", "group", "world", "house", "night",
];

/// Seed namespace for hash-block text, so block text never equals per-request filler
/// that happens to use the same number.
const BLOCK_NAMESPACE: u64 = 0xB10C_0000_0000_0001;

/// Appends pseudo-random words from `rng` to `out` until it holds exactly `len` bytes
/// (truncating a tag or word that runs past `len`).
fn fill_words(out: &mut String, len: usize, rng: &mut SplitMix64) {
    while out.len() < len {
        let w = WORDS[rng.below(WORDS.len() as u64) as usize];
        out.push_str(w);
        out.push(' ');
    }
    // ASCII only, so truncating at a byte index is a char boundary
    out.truncate(len);
}

/// Filler text of exactly `chars` characters, unique to (`seed`, `request`): it starts
/// with a tag naming the request, so two requests never share even their first block.
pub fn filler(seed: u64, request: u64, chars: usize) -> String {
    let mut out = String::with_capacity(chars + 16);
    out.push_str(&format!("[req {request:x}.{seed:x}] "));
    let mut rng = SplitMix64::derive(seed, request);
    fill_words(&mut out, chars, &mut rng);
    out
}

/// The text of hash block `id`, `chars` characters long. A pure function of
/// (`id`, `chars`); it starts with a tag naming the block, so different ids differ from
/// the first character on, and a shorter block of the same id is a prefix of a longer one
/// (a trace's partial last block shares its leading text with the full block).
pub fn block_text(id: u64, chars: usize) -> String {
    let mut out = String::with_capacity(chars + 16);
    push_block_text(&mut out, id, chars);
    out
}

/// Appends [`block_text`]`(id, chars)` to `out` without an intermediate allocation.
pub fn push_block_text(out: &mut String, id: u64, chars: usize) {
    let start = out.len();
    out.push_str(&format!("[blk {id:x}] "));
    let mut rng = SplitMix64::new(mix64(id ^ BLOCK_NAMESPACE));
    fill_words(out, start + chars, &mut rng);
}

/// The prompt of a hash-block request: the blocks' texts concatenated, `block_chars` each,
/// except the last, which is `last_chars` long (a trace's last block is usually partial).
pub fn expand_hash_ids(ids: &[u64], block_chars: usize, last_chars: usize) -> String {
    let total = block_chars * ids.len().saturating_sub(1) + last_chars;
    let mut out = String::with_capacity(total + 16);
    for (i, &id) in ids.iter().enumerate() {
        let chars = if i + 1 == ids.len() {
            last_chars
        } else {
            block_chars
        };
        push_block_text(&mut out, id, chars);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn filler_has_exact_length_and_is_deterministic() {
        let a = filler(1, 42, 1000);
        assert_eq!(a.len(), 1000);
        assert_eq!(a, filler(1, 42, 1000));
        assert!(a.is_ascii());
    }

    #[test]
    fn fillers_of_different_requests_differ_from_the_start() {
        let a = filler(1, 1, 500);
        let b = filler(1, 2, 500);
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        // "[req " is the only shared prefix
        assert!(common < 8, "common prefix {common}");
    }

    #[test]
    fn same_block_id_gives_same_text_different_ids_differ() {
        assert_eq!(block_text(7, 2048), block_text(7, 2048));
        let a = block_text(7, 2048);
        let b = block_text(8, 2048);
        assert_ne!(a, b);
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(common < 8, "common prefix {common}");
    }

    #[test]
    fn shorter_block_is_a_prefix_of_the_longer() {
        let long = block_text(99, 2048);
        let short = block_text(99, 300);
        assert!(long.starts_with(&short));
    }

    #[test]
    fn requests_sharing_leading_ids_share_exactly_that_text() {
        let a = expand_hash_ids(&[1, 2, 3, 4], 256, 100);
        let b = expand_hash_ids(&[1, 2, 9], 256, 256);
        assert_eq!(a.len(), 3 * 256 + 100);
        assert_eq!(b.len(), 3 * 256);
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        assert!(common >= 2 * 256, "shared blocks must share text: {common}");
        assert!(
            common < 2 * 256 + 8,
            "different ids must differ early: {common}"
        );
    }

    proptest! {
        #[test]
        fn expansion_length_is_exact(ids in proptest::collection::vec(0u64..50, 1..20),
                                     block in 1usize..600, last_frac in 0.0f64..1.0) {
            let last = ((block as f64) * last_frac) as usize + 1;
            let last = last.min(block);
            let s = expand_hash_ids(&ids, block, last);
            prop_assert_eq!(s.len(), block * (ids.len() - 1) + last);
        }

        #[test]
        fn equal_id_prefixes_give_equal_text_prefixes(
            common in proptest::collection::vec(0u64..1000, 1..8),
            tail_a in proptest::collection::vec(1000u64..2000, 0..4),
            tail_b in proptest::collection::vec(2000u64..3000, 0..4)) {
            let a: Vec<u64> = common.iter().chain(&tail_a).copied().collect();
            let b: Vec<u64> = common.iter().chain(&tail_b).copied().collect();
            let ta = expand_hash_ids(&a, 128, 128);
            let tb = expand_hash_ids(&b, 128, 128);
            prop_assert_eq!(&ta[..common.len() * 128], &tb[..common.len() * 128]);
        }
    }
}
