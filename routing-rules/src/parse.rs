//! Parsing the rules file (TOML) and admin API bodies (JSON) into the [`crate::schema`] model,
//! reporting problems with their paths.
//!
//! Both formats go through one path: the text is parsed into a `serde_json::Value`, then each
//! top-level section and each list entry is deserialized on its own with
//! `serde_path_to_error`, so one bad entry does not hide the problems of the next: the result
//! lists one problem per bad entry (serde stops at the first problem *inside* an entry).
//! Parsing checks shapes only; [`crate::validate`] checks meaning. Cost: O(size of input).

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{Problem, RulesError};
use crate::schema::{GatewaySpec, RulesFile, ServiceSpec};

const TOP_LEVEL: [&str; 7] = [
    "gateway", "workers", "pools", "profiles", "services", "tenants", "cordoned",
];

/// Parse a TOML rules file. Does not validate (see [`crate::validate::validate`]).
pub fn rules_from_toml(text: &str) -> Result<RulesFile, Vec<Problem>> {
    let table: toml::Table = toml::from_str(text)
        .map_err(|e| vec![Problem::new("", format!("TOML syntax: {}", e.message()))])?;
    let value = serde_json::to_value(table)
        .map_err(|e| vec![Problem::new("", format!("unsupported TOML value: {e}"))])?;
    rules_from_value(value)
}

/// Parse a whole rule set given as JSON (the admin API model). Does not validate.
pub fn rules_from_json(text: &str) -> Result<RulesFile, Vec<Problem>> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| vec![Problem::new("", format!("JSON syntax: {e}"))])?;
    rules_from_value(value)
}

/// Parse one service given as JSON (the body of `PUT /services/{name}`). Paths in problems are
/// relative to the service (`rule.profile`). Does not validate.
pub fn service_from_json(text: &str) -> Result<ServiceSpec, Vec<Problem>> {
    let value: Value = serde_json::from_str(text)
        .map_err(|e| vec![Problem::new("", format!("JSON syntax: {e}"))])?;
    from_value_at::<ServiceSpec>(value, "").map_err(|p| vec![p])
}

/// Parse a rule set from an already-parsed JSON value. Does not validate.
pub fn rules_from_value(value: Value) -> Result<RulesFile, Vec<Problem>> {
    let Value::Object(mut root) = value else {
        return Err(vec![Problem::new("", "the rules must be a table")]);
    };
    let mut problems = Vec::new();
    let mut unknown: Vec<String> = root
        .keys()
        .filter(|k| !TOP_LEVEL.contains(&k.as_str()))
        .cloned()
        .collect();
    unknown.sort();
    for key in unknown {
        problems.push(Problem::new(
            key.clone(),
            format!(
                "unknown field `{key}`, expected one of {}",
                TOP_LEVEL
                    .iter()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let gateway = match root.remove("gateway") {
        None => GatewaySpec::default(),
        Some(v) => match from_value_at::<GatewaySpec>(v, "gateway") {
            Ok(g) => g,
            Err(p) => {
                problems.push(p);
                GatewaySpec::default()
            }
        },
    };
    let workers = list_at(&mut root, "workers", &mut problems);
    let pools = list_at(&mut root, "pools", &mut problems);
    let profiles = list_at(&mut root, "profiles", &mut problems);
    let services = list_at(&mut root, "services", &mut problems);
    let tenants = list_at(&mut root, "tenants", &mut problems);
    let cordoned = list_at(&mut root, "cordoned", &mut problems);
    if problems.is_empty() {
        Ok(RulesFile {
            gateway,
            workers,
            pools,
            profiles,
            services,
            tenants,
            cordoned,
        })
    } else {
        Err(problems)
    }
}

/// Deserialize the list under `key`, entry by entry, collecting one problem per bad entry.
fn list_at<T: DeserializeOwned>(
    root: &mut Map<String, Value>,
    key: &str,
    problems: &mut Vec<Problem>,
) -> Vec<T> {
    let Some(value) = root.remove(key) else {
        return Vec::new();
    };
    let Value::Array(items) = value else {
        problems.push(Problem::new(
            key,
            "expected a list (in TOML: [[{key}]] tables)",
        ));
        return Vec::new();
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        match from_value_at::<T>(item, &format!("{key}[{i}]")) {
            Ok(t) => out.push(t),
            Err(p) => problems.push(p),
        }
    }
    out
}

/// Deserialize `value` as `T`; on failure, a problem whose path is `prefix` joined with the
/// path inside `value` where serde stopped.
fn from_value_at<T: DeserializeOwned>(value: Value, prefix: &str) -> Result<T, Problem> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let inner = e.path().to_string();
        let inner = if inner == "." { String::new() } else { inner };
        let path = match (prefix.is_empty(), inner.is_empty()) {
            (_, true) => prefix.to_owned(),
            (true, false) => inner,
            (false, false) if inner.starts_with('[') => format!("{prefix}{inner}"),
            (false, false) => format!("{prefix}.{inner}"),
        };
        Problem::new(path, e.into_inner().to_string())
    })
}

/// Serialize a rule set as the TOML rules file (canonical form: defaults written out, comments
/// not preserved).
pub fn rules_to_toml(rules: &RulesFile) -> Result<String, RulesError> {
    toml::to_string_pretty(rules).map_err(|e| RulesError::Serialize {
        message: e.to_string(),
    })
}

/// Parse and validate TOML in one step: the usual way to load a rules file's text.
pub fn load_toml(text: &str) -> Result<RulesFile, RulesError> {
    let rules = rules_from_toml(text).map_err(|problems| RulesError::Invalid { problems })?;
    let problems = crate::validate::validate(&rules);
    if problems.is_empty() {
        Ok(rules)
    } else {
        Err(RulesError::Invalid { problems })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_join_prefix_and_inner_path() {
        let v: Value = serde_json::json!({"id": "w", "url": "u", "weight": "x"});
        let p = from_value_at::<crate::schema::WorkerSpec>(v, "workers[3]").unwrap_err();
        assert_eq!(p.path, "workers[3].weight");
        let p =
            from_value_at::<crate::schema::PoolSpec>(serde_json::json!(1), "pools[0]").unwrap_err();
        assert_eq!(p.path, "pools[0]");
        let p =
            from_value_at::<Vec<crate::schema::PoolSpec>>(serde_json::json!([1]), "x").unwrap_err();
        assert_eq!(p.path, "x[0]");
    }

    #[test]
    fn non_table_root_and_non_list_sections() {
        assert_eq!(
            rules_from_json("[]").unwrap_err()[0].message,
            "the rules must be a table"
        );
        let p = rules_from_json(r#"{"workers": {}}"#).unwrap_err();
        assert_eq!(p[0].path, "workers");
    }
}
