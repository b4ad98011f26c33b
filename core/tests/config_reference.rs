//! The README's configuration reference is the filter's configuration: every option the filter
//! reads has a row, every row is an option, and each documented default is the code's (setting
//! an option to its documented default changes nothing). The published default weights are the
//! presets'.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "support/doc_table.rs"]
mod doc_table;

use doc_table::{
    assert_documented, default_value, expected_fields, options, set_path, table_after, Row,
};
use gpuroute_core::config::{ConfigError, FilterConfig, Preset};
use serde_json::{json, Value};
use std::collections::BTreeSet;

const README: &str = include_str!("../../README.md");
const REFERENCE: &str = "## Configuration reference (filter)";

/// The smallest configuration with every section the reference covers (ingest needs a token).
fn base() -> Value {
    json!({"pools": [{"name": "p", "models": ["m"]}], "ingest": {"token": "12345678"}})
}

fn parse(v: &Value) -> Result<FilterConfig, ConfigError> {
    FilterConfig::from_json(v.to_string().as_bytes())
}

/// A parsed configuration as comparable text (`FilterConfig` has no `PartialEq`; its `Debug`
/// shows every field).
fn shown(v: &Value) -> String {
    match parse(v) {
        Ok(cfg) => format!("{cfg:?}"),
        Err(e) => panic!("{v} does not parse: {e}"),
    }
}

fn reference() -> Vec<Row> {
    let rows = table_after(README, REFERENCE);
    assert!(rows.len() > 30, "only {} rows read", rows.len());
    rows
}

/// The fields of the struct at `at` (`""` for the top level; `pools[]` for a pool), named as
/// the reference names them: serde lists them in its error for an unknown one.
fn fields_at(at: &str) -> Vec<String> {
    let mut v = base();
    let path = if at.is_empty() {
        "zz_unknown".to_string()
    } else {
        format!("{at}.zz_unknown")
    };
    set_path(&mut v, &path, Some(json!(1)));
    let err = parse(&v)
        .expect_err("an unknown field is refused")
        .to_string();
    expected_fields(&err)
        .into_iter()
        .map(|f| {
            if at.is_empty() {
                f
            } else {
                format!("{at}.{f}")
            }
        })
        .collect()
}

#[test]
fn every_option_is_documented_and_every_documented_option_exists() {
    // Sections the reference documents field by field; the others (`pools[].scoring`,
    // `splits`) have one row each, checked below.
    let sections = [
        "scoring",
        "scoring.weights",
        "prefix",
        "ingest",
        "pools[]",
        "hold",
        "outlier_detection",
    ];
    let mut options = options(&sections, fields_at);
    // A section that is off unless present has a row of its own too, for what turning it on does.
    options.extend(OPTIONAL_SECTIONS.iter().map(|s| s.to_string()));
    assert!(options.contains("scoring.weights.prefix") && options.contains("pools[].scoring"));
    let documented: BTreeSet<String> = reference().into_iter().flat_map(|r| r.options).collect();
    assert_documented(&options, &documented);

    // `pools[].scoring` takes "any of `scoring`'s fields".
    let scoring: Vec<_> = fields_at("scoring")
        .iter()
        .map(|f| f.replace("scoring.", ""))
        .collect();
    let per_pool: Vec<_> = fields_at("pools[].scoring")
        .iter()
        .map(|f| f.replace("pools[].scoring.", ""))
        .collect();
    assert_eq!(
        per_pool, scoring,
        "a pool's scoring fields are the top level's"
    );

    // A split's targets are documented in the `splits` row's example.
    let mut v = base();
    set_path(
        &mut v,
        "splits",
        Some(json!({"s": [{"model": "m", "weight": 1, "zz_unknown": 1}]})),
    );
    let target_fields = expected_fields(&parse(&v).expect_err("unknown field").to_string());
    let splits = reference()
        .into_iter()
        .find(|r| r.options == ["splits"])
        .unwrap();
    for f in &target_fields {
        let quoted = format!("\"{f}\"");
        assert!(
            splits.cell("why").contains(&quoted),
            "splits row lacks {quoted}"
        );
    }
    assert_eq!(target_fields, ["model", "weight"]);
}

/// Sections that are off unless present (`"hold": {}` turns holding on): their fields' defaults
/// are checked within an empty section.
const OPTIONAL_SECTIONS: [&str; 1] = ["hold"];

#[test]
fn every_documented_default_is_the_codes() {
    let mut checked = 0;
    for row in reference() {
        let cell = row.cell("default");
        for option in &row.options {
            let mut v = base();
            let section = OPTIONAL_SECTIONS
                .iter()
                .find(|s| option.starts_with(&format!("{s}.")));
            if let Some(s) = section {
                set_path(&mut v, s, Some(json!({})));
            }
            let unchanged = shown(&v);
            if cell == "required" {
                set_path(&mut v, option, None);
                let err = parse(&v)
                    .expect_err("a required option is required")
                    .to_string();
                let name = option.rsplit('.').next().unwrap();
                assert!(
                    err.contains(&format!("missing field `{name}`")),
                    "{option}: {err}"
                );
            } else if option == "ingest.token" {
                // "none (ingest off)": without an `ingest` section nothing is accepted, and a
                // section needs its token.
                assert_eq!(cell, "none (ingest off)");
                set_path(&mut v, "ingest", None);
                assert!(parse(&v).unwrap().ingest.is_none());
                set_path(&mut v, "ingest", Some(json!({})));
                let err = parse(&v).expect_err("an ingest section needs its token");
                assert!(err.to_string().contains("missing field `token`"), "{err}");
            } else if let Some(weight) = option.strip_prefix("scoring.weights.") {
                // "preset's": the default preset's weight; a different value is taken.
                assert_eq!(cell, "preset's");
                let w = serde_json::to_value(weights_of(Preset::default())).unwrap();
                let weights = |v: &Value| parse(v).unwrap().scoring.effective_weights();
                let before = weights(&v);
                set_path(&mut v, option, Some(w[weight].clone()));
                assert_eq!(weights(&v), before, "{option}");
                set_path(
                    &mut v,
                    option,
                    Some(json!(w[weight].as_f64().unwrap() + 1.0)),
                );
                assert_ne!(weights(&v), before, "{option} is not read");
            } else {
                let value = if option == "inference_paths" {
                    inference_paths(cell)
                } else {
                    default_value(cell)
                        .unwrap_or_else(|| panic!("{option}: unreadable default {cell:?}"))
                };
                set_path(&mut v, option, Some(value.clone()));
                assert_eq!(
                    shown(&v),
                    unchanged,
                    "{option}: the documented default {value} is not the code's"
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 35, "only {checked} defaults checked");
}

/// The `inference_paths` cell: "a, b/c, ... under `/v1`", optionally followed by "; then `/x`,
/// `/y`" (paths outside `/v1`, in their place at the end of the list).
fn inference_paths(cell: &str) -> Value {
    let (v1, then) = cell.split_once("; then ").unwrap_or((cell, ""));
    let list = v1
        .strip_suffix(" under `/v1`")
        .unwrap_or_else(|| panic!("inference_paths: unreadable default {cell:?}"));
    let mut paths: Vec<String> = list.split(", ").map(|p| format!("/v1/{p}")).collect();
    paths.extend(
        then.split(", ")
            .filter(|p| !p.is_empty())
            .map(|p| p.trim_matches('`').to_string()),
    );
    json!(paths)
}

/// A preset's weights as JSON-able numbers, by scorer name.
fn weights_of(p: Preset) -> std::collections::BTreeMap<&'static str, f64> {
    let w = p.weights();
    [
        ("queue", w.queue),
        ("kv_cache", w.kv_cache),
        ("running", w.running),
        ("lora", w.lora),
        ("prefix", w.prefix),
    ]
    .into_iter()
    .collect()
}

#[test]
fn the_published_default_weights_are_the_presets() {
    let rows = table_after(README, "**Default weights**");
    assert_eq!(rows.len(), 2, "one row per preset");
    let mut defaults = 0;
    for row in &rows {
        let name_cell = row.cell("preset");
        let name = name_cell
            .split('`')
            .nth(1)
            .expect("a backticked preset name");
        let preset: Preset = serde_json::from_value(json!(name))
            .unwrap_or_else(|e| panic!("{name} is no preset: {e}"));
        if name_cell.contains("(default)") {
            assert_eq!(preset, Preset::default(), "{name} is marked the default");
            defaults += 1;
        }
        for (scorer, weight) in weights_of(preset) {
            let documented: f64 = row.cell(scorer).parse().expect("a number");
            assert_eq!(documented, weight, "{name}'s {scorer} weight");
        }
    }
    assert_eq!(defaults, 1, "one preset is marked the default");
}
