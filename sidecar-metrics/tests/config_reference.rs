//! `sidecar-metrics/README.md`'s configuration reference is the aggregator's configuration:
//! every option has a row and every row is an option, each documented default is the code's
//! (setting an option to its documented default changes nothing), and the flags and
//! environment variables the README names are the binary's, and the other way round.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../../core/tests/support/doc_table.rs"]
mod doc_table;

use doc_table::{
    assert_documented, default_value, expected_fields, options, set_path, table_after, Row,
};
use serde_json::{json, Value};
use sidecar_metrics::config::{Config, ConfigError};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

const README: &str = include_str!("../README.md");
const REFERENCE: &str = "## Configuration reference";
const BIN: &str = env!("CARGO_BIN_EXE_sidecar-metrics");

/// Sections documented as one row each, their fields named in the row's text.
const INLINE: [&str; 5] = [
    "pools[].pods",
    "pools[].dns",
    "pools[].kubernetes",
    "prefix.peers_dns",
    "prefix.tls",
];

fn base() -> Value {
    json!({"pools": [{"name": "p", "pods": [{"address": "127.0.0.1:1"}]}]})
}

fn parse(v: &Value) -> Result<Config, ConfigError> {
    Config::from_str_named(&v.to_string(), Path::new("reference.json"))
}

fn reference() -> Vec<Row> {
    let rows = table_after(README, REFERENCE);
    assert!(rows.len() > 25, "only {} rows read", rows.len());
    rows
}

/// A row's option as the configuration names it (`pools[].pods[]` is the field `pods`).
fn option_name(documented: &str) -> &str {
    documented.strip_suffix("[]").unwrap_or(documented)
}

/// The fields of the struct at `at` (`""`: the top level), from serde's error for an unknown
/// one.
fn fields_at(at: &str) -> Vec<String> {
    let mut v = base();
    let inner = json!({"zz_unknown": 1});
    if at.is_empty() {
        v = inner;
    } else if let Some(array) = at.strip_suffix("[]") {
        set_path(&mut v, array, Some(json!([inner])));
    } else {
        set_path(&mut v, at, Some(inner));
    }
    let err = parse(&v)
        .expect_err("an unknown field is refused")
        .to_string();
    let prefix = if at.is_empty() {
        String::new()
    } else {
        format!("{at}.")
    };
    expected_fields(&err)
        .into_iter()
        .map(|f| format!("{prefix}{f}"))
        .collect()
}

#[test]
fn every_option_is_documented_and_every_documented_option_exists() {
    let sections = [
        "health",
        "ramp",
        "capacity",
        "push",
        "prefix",
        "scrape_tls",
        "pools[]",
    ];
    let options = options(&sections, fields_at);
    let rows = reference();
    let documented: BTreeSet<String> = rows
        .iter()
        .flat_map(|r| r.options.iter().map(|o| option_name(o).to_string()))
        .collect();
    assert_documented(&options, &documented);

    // The sections documented in one row name each of their fields.
    for section in INLINE {
        let row = rows
            .iter()
            .find(|r| option_name(&r.options[0]) == section)
            .unwrap_or_else(|| panic!("no row for {section}"));
        let at = if section == "pools[].pods" {
            "pools[].pods[]"
        } else {
            section
        };
        let fields = fields_at(at);
        assert!(fields.len() >= 3, "{section}: {fields:?}");
        for f in fields {
            let name = f.rsplit('.').next().unwrap();
            assert!(
                row.cell("why this default").contains(&format!("`{name}`")),
                "the {section} row does not name `{name}`"
            );
        }
    }
}

#[test]
fn every_documented_default_is_the_codes() {
    let unchanged = parse(&base()).unwrap();
    assert_eq!(parse(&json!({})).unwrap(), Config::default());
    let mut checked = 0;
    for row in reference() {
        let cell = row.cell("default");
        let option = option_name(&row.options[0]);
        assert_eq!(row.options.len(), 1, "{option}: one option per row");
        let mut v = base();
        if INLINE.contains(&option) {
            // A section of its own; its defaults are checked below where the row gives them.
            assert!(cell == "–" || cell == "none", "{option}: {cell}");
            continue;
        }
        let value = match option {
            "pools[].name" => {
                assert_eq!(cell, "required");
                set_path(&mut v, option, None);
                let err = parse(&v).expect_err("a pool needs its name").to_string();
                assert!(err.contains("missing field `name`"), "{err}");
                checked += 1;
                continue;
            }
            "publish_deadline_ms" => {
                // Derived: half the interval.
                assert_eq!(cell, "`interval_ms / 2`");
                assert_eq!(unchanged.publish_deadline_ms(), unchanged.interval_ms / 2);
                Value::Null
            }
            "source" => {
                // Derived where the snapshot is made (`$HOSTNAME`, else the program's name).
                assert_eq!(cell, "`$HOSTNAME`, else `sidecar-metrics`");
                Value::Null
            }
            "pools[].engine" => {
                assert_eq!(cell, "detect");
                Value::Null
            }
            "scrape_tls.ca_file" => {
                // Unset: the system's store, read only when a pod is scraped over HTTPS.
                assert_eq!(cell, "the system's certificate authorities");
                Value::Null
            }
            "scrape_tls.server_name" => {
                assert_eq!(cell, "the URL's host");
                Value::Null
            }
            "pools[].metrics_path" => {
                // "`/metrics` (`/prometheus/metrics` for `trtllm`)".
                let spans: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
                let pool = &unchanged.pools[0];
                assert_eq!(pool.metrics_path_for(None), spans[0]);
                let engine = serde_json::from_value(json!(spans[2])).unwrap();
                assert_eq!(pool.metrics_path_for(Some(engine)), spans[1]);
                Value::Null
            }
            _ => default_value(cell)
                .unwrap_or_else(|| panic!("{option}: unreadable default {cell:?}")),
        };
        set_path(&mut v, option, Some(value.clone()));
        let got = parse(&v).unwrap_or_else(|e| panic!("{option} = {value}: {e}"));
        assert_eq!(
            got, unchanged,
            "{option}: the documented default {value} is not the code's"
        );
        checked += 1;
    }
    assert!(checked > 20, "only {checked} defaults checked");

    // The inline sections' documented defaults.
    let rows = reference();
    let text = |option: &str| {
        rows.iter()
            .find(|r| r.options[0] == option)
            .unwrap()
            .cell("why this default")
            .to_string()
    };
    let dns = json!({"name": "gw", "port": 9100});
    let mut v = base();
    set_path(&mut v, "prefix.peers_dns", Some(dns.clone()));
    let refresh = parse(&v).unwrap().prefix.peers_dns.unwrap().refresh_ms;
    assert!(text("prefix.peers_dns").contains(&format!("`refresh_ms` (default `{refresh}`)")));
    let mut v = json!({"pools": [{"name": "p", "dns": dns}]});
    let refresh = parse(&v).unwrap().pools[0].dns.as_ref().unwrap().refresh_ms;
    assert!(text("pools[].dns").contains(&format!("`refresh_ms` (default `{refresh}`")));
    set_path(&mut v, "pools[].dns", None);
    set_path(
        &mut v,
        "pools[].kubernetes",
        Some(json!({"selector": "a=b", "port": 1})),
    );
    let namespace = parse(&v).unwrap().pools[0]
        .kubernetes
        .clone()
        .unwrap()
        .namespace;
    assert!(text("pools[].kubernetes").contains(&format!("`namespace` (default `{namespace}`)")));
}

/// `--flag` names and the environment variable of each, as `run --help` lists them.
fn run_flags() -> Vec<(String, Option<String>)> {
    let out = Command::new(BIN).args(["run", "--help"]).output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let flags: Vec<_> = help
        .lines()
        .filter_map(|line| {
            let at = line.find("--")?;
            let flag = line[at..].split_whitespace().next()?.to_string();
            let env = line.split("[env: ").nth(1).map(|rest| {
                rest.split(['=', ']'])
                    .next()
                    .unwrap_or_default()
                    .to_string()
            });
            Some((flag, env))
        })
        .collect();
    assert!(flags.len() > 8, "{help}");
    flags
}

#[test]
fn the_documented_flags_and_variables_are_the_binarys() {
    let flags = run_flags();
    let rows = reference();
    let mut documented = BTreeSet::new();
    let mut with_env = BTreeSet::new();
    for row in &rows {
        let cell = row.cell("flag / env");
        let spans: Vec<&str> = cell.split('`').skip(1).step_by(2).collect();
        let flag = spans
            .iter()
            .find(|s| s.starts_with("--"))
            .map(|s| s.split_whitespace().next().unwrap());
        let env = spans.iter().find(|s| s.starts_with("GPUROUTE_"));
        let Some(flag) = flag else {
            assert!(cell == "–" && env.is_none(), "{}: {cell}", row.options[0]);
            continue;
        };
        let found = flags.iter().find(|(f, _)| f == flag);
        let (_, actual_env) = found.unwrap_or_else(|| panic!("no {flag} in run --help"));
        // A row may name just the flag (`--pool` for `pools[].pods[]`); one that names a
        // variable names the flag's.
        if let Some(env) = env {
            assert_eq!(Some(*env), actual_env.as_deref(), "{flag}'s variable");
            with_env.insert(flag.to_string());
        }
        documented.insert(flag.to_string());
    }
    for (flag, env) in &flags {
        if documented.contains(flag) && env.is_some() {
            assert!(
                with_env.contains(flag),
                "no row names {flag}'s variable {env:?}"
            );
        }
    }
    // The README names `word` (not as the start of a longer one: `--pool` in `--pools`).
    let names = |word: &str| {
        README.match_indices(word).any(|(at, _)| {
            let next = README[at + word.len()..].chars().next();
            !next.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_')
        })
    };
    // Flags outside the table (the config file, the log format, help) are named in the text
    // around it, each with its variable.
    for (flag, env) in &flags {
        if documented.contains(flag) || flag == "--help" {
            continue;
        }
        assert!(names(flag), "{flag} is not documented");
        if let Some(env) = env {
            assert!(names(env), "{env} ({flag}) is not documented");
        }
    }
}
