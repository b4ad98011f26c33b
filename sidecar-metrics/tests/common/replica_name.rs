//! Replica names and posted in-flight counts in the tests' fake receivers. Included by path in
//! the relay's unit tests and in `tests/load_relay.rs` (`#[path = ...] mod replica_name;`).

/// A replica name without the `@` and eight hex digits a sidecar draws at its start
/// (`gw-1@0123abcd/1` is `gw-1/1`), so that a test can name what it expects.
pub fn plain(name: &str) -> String {
    match name.split_once('@') {
        Some((source, rest)) if rest.len() >= 8 && rest.is_char_boundary(8) => {
            let (drawn, after) = rest.split_at(8);
            assert!(drawn.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
            format!("{source}{after}")
        }
        _ => name.to_string(),
    }
}

/// What a post of in-flight counts carried, as `(authorization, replica, counts)` per replica:
/// a bundle's entries each on its own, or the body under its `x-gpuroute-replica` name
/// (`replica`). `None` for a bundle that does not decode.
pub fn posted(
    auth: String,
    replica: String,
    body: &[u8],
) -> Option<Vec<(String, String, Vec<u8>)>> {
    match gpuroute_core::replica_load::bundle_entries(body) {
        None => Some(vec![(auth, replica, body.to_vec())]),
        Some(Ok(entries)) => Some(
            entries
                .into_iter()
                .map(|(name, b)| (auth.clone(), name.to_string(), b.to_vec()))
                .collect(),
        ),
        Some(Err(_)) => None,
    }
}
