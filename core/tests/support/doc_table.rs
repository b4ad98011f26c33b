//! Reads a configuration reference table out of a README, for the tests that hold the README's
//! options and defaults to the code's (`core/tests/config_reference.rs`, and
//! `sidecar-metrics/tests/config_reference.rs`, which includes this file by path).

// Each test crate that includes this file uses part of it.
#![allow(dead_code)]

/// One row of a reference table: the option names it documents (a `{a,b}` group expanded:
/// `w.{a,b}` is `w.a` and `w.b`) and its cells, by the header's column names.
#[derive(Debug)]
pub struct Row {
    pub options: Vec<String>,
    pub cells: Vec<(String, String)>,
}

impl Row {
    /// The cell under `column`; a missing column is a test failure naming it.
    pub fn cell(&self, column: &str) -> &str {
        match self.cells.iter().find(|(c, _)| c == column) {
            Some((_, v)) => v,
            None => panic!("the table has no column {column:?}"),
        }
    }
}

/// The rows of the first table after the line that starts with `heading`. Every row must have
/// the header's number of cells (a `|` inside a cell would shift them).
pub fn table_after(doc: &str, heading: &str) -> Vec<Row> {
    let mut lines = doc.lines().skip_while(|l| !l.starts_with(heading));
    assert!(lines.next().is_some(), "no {heading:?} in the document");
    let mut table = lines
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    let header = cells(table.next().expect("a table after the heading"));
    let rule = table.next().expect("the header's rule");
    assert!(rule.starts_with("| ---"), "not a table rule: {rule}");
    table
        .map(|line| {
            let row = cells(line);
            assert_eq!(row.len(), header.len(), "cells of {line}");
            Row {
                options: expand(&row[0]),
                cells: header.iter().cloned().zip(row).collect(),
            }
        })
        .collect()
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

/// `` `a.{b,c}` `` -> `a.b`, `a.c`; `` `a` `` -> `a`.
fn expand(cell: &str) -> Vec<String> {
    let name = cell.trim_matches('`');
    match (name.find('{'), name.rfind('}')) {
        (Some(open), Some(close)) if close > open => name[open + 1..close]
            .split(',')
            .map(|part| format!("{}{}{}", &name[..open], part.trim(), &name[close + 1..]))
            .collect(),
        _ => vec![name.to_string()],
    }
}

/// Every option below the top level: the fields `fields_at` gives for a section (`""` the top
/// level, else the section's path, `pools` walked as `pools[]`), going into the `sections`
/// documented field by field and keeping every other field as one option.
pub fn options(
    sections: &[&str],
    fields_at: impl Fn(&str) -> Vec<String>,
) -> std::collections::BTreeSet<String> {
    let mut options = std::collections::BTreeSet::new();
    let mut pending = vec![String::new()];
    while let Some(at) = pending.pop() {
        for f in fields_at(&at) {
            let section = if f == "pools" {
                "pools[]".to_string()
            } else {
                f.clone()
            };
            if sections.contains(&section.as_str()) {
                pending.push(section);
            } else {
                options.insert(f);
            }
        }
    }
    options
}

/// The options and the documented rows are the same set; the failure names either side's extra.
pub fn assert_documented(
    options: &std::collections::BTreeSet<String>,
    documented: &std::collections::BTreeSet<String>,
) {
    let missing: Vec<_> = options.difference(documented).collect();
    let stale: Vec<_> = documented.difference(options).collect();
    assert!(missing.is_empty(), "options without a row: {missing:?}");
    assert!(stale.is_empty(), "rows of no option: {stale:?}");
}

/// The field names serde lists in a `deny_unknown_fields` struct's error for an unknown field
/// ("unknown field `x`, expected one of `a`, `b`" or "expected `a`").
pub fn expected_fields(error: &str) -> Vec<String> {
    let at = error
        .find("expected ")
        .unwrap_or_else(|| panic!("not an unknown-field error: {error}"));
    error[at..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The JSON value a default cell gives, in the tables' usual forms: a backticked value as the
/// whole cell (JSON if it reads as JSON, else a string), a bare number, `N MiB`, and `none` (or
/// `none (...)`) as `null`. `None` for anything else, which the caller must handle by name.
pub fn default_value(cell: &str) -> Option<serde_json::Value> {
    if cell == "none" || cell.starts_with("none (") {
        return Some(serde_json::Value::Null);
    }
    if let Some(inner) = cell.strip_prefix('`').and_then(|c| c.strip_suffix('`')) {
        if !inner.contains('`') {
            return Some(
                serde_json::from_str(inner)
                    .unwrap_or_else(|_| serde_json::Value::String(inner.to_string())),
            );
        }
    }
    if let Some(mib) = cell.strip_suffix(" MiB") {
        let n: u64 = mib.parse().ok()?;
        return Some((n << 20).into());
    }
    let n: serde_json::Number = cell.parse().ok()?;
    Some(serde_json::Value::Number(n))
}

/// Sets `path` (dot-separated; `name[]` is the first element of the array `name`) in `doc` to
/// `value`, creating objects on the way; `None` removes it.
pub fn set_path(doc: &mut serde_json::Value, path: &str, value: Option<serde_json::Value>) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let last = parts.pop().expect("a non-empty path");
    let mut at = doc;
    for part in parts {
        at = match part.strip_suffix("[]") {
            Some(array) => &mut at[array][0],
            None => {
                if at.get(part).is_none() {
                    at[part] = serde_json::json!({});
                }
                &mut at[part]
            }
        };
    }
    let object = at.as_object_mut().expect("an object to set the option in");
    match value {
        Some(v) => object.insert(last.to_string(), v),
        None => object.remove(last),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_table_and_its_forms() {
        let doc = "intro\n## Ref\n\ntext\n\n| option | default | why |\n| --- | --- | --- |\n\
                   | `a.{x, y}` | `1` | r |\n| `b` | 4 MiB | r |\n\nafter\n| `z` | 1 | r |\n";
        let rows = table_after(doc, "## Ref");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].options, ["a.x", "a.y"]);
        assert_eq!(rows[1].cell("default"), "4 MiB");
        assert_eq!(default_value("4 MiB"), Some((4u64 << 20).into()));
        assert_eq!(default_value("`/v1/models`"), Some("/v1/models".into()));
        assert_eq!(default_value("`{}`"), Some(serde_json::json!({})));
        assert_eq!(
            default_value("none (ingest off)"),
            Some(serde_json::Value::Null)
        );
        assert_eq!(default_value("0.8"), Some(serde_json::json!(0.8)));
        assert_eq!(default_value("`a`, else `b`"), None);
        assert_eq!(default_value("preset's"), None);
        assert_eq!(
            expected_fields("unknown field `q`, expected one of `a`, `b_c`"),
            ["a", "b_c"]
        );
        assert_eq!(expected_fields("unknown field `q`, expected `a`"), ["a"]);
        let mut v = serde_json::json!({"pools": [{"name": "p"}]});
        set_path(&mut v, "pools[].scoring.preset", Some("latency".into()));
        set_path(&mut v, "pools[].name", None);
        assert_eq!(
            v,
            serde_json::json!({"pools": [{"scoring": {"preset": "latency"}}]})
        );
    }
}
